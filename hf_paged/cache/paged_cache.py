"""PagedCache: a transformers ``Cache`` whose KV lives in the blocks of a preallocated pool.

    cache = PagedCache(model)                  # the pool grows with what the calls use; num_blocks=2048: fixed
    out = model.generate(**inputs, past_key_values=cache)
    cache = PagedCache(model, max_cache_len=prompt_len + max_new_tokens)  # compileable: generate compiles decode

Each batch row of ``generate`` is a sequence of the block pool (hf_paged.core.block_pool); all layers share
its block table. A forward hook on the model's decoder plans every forward before it runs:

1. rows get slots for their real (non-padding) new tokens; padding takes no slot;
2. copy-on-write pairs from the pool are copied in every layer;
3. the step metadata (hf_paged.core.context.ForwardContext) is made current for the forward;
4. each layer's ``update`` writes K/V at the slots and returns either the block pools (for
   ``attn_implementation="paged"``, whose kernels read the blocks) or contiguous K/V gathered through
   the block tables (for "sdpa", "eager" or any other implementation: slower, but it works). In an eager
   decode step with "paged", ``update`` leaves the K/V to the attention function instead, whose one decode
   launch writes them and attends (ForwardContext.defer_kv_write).

Slots follow the slot formula of ``hf_paged.core.planner.slot_mapping`` (written there only), computed for
all real tokens of a forward in one vectorised call.

Sharing: identical rows of the first forward (``num_return_sequences``, beams) store their prompt once
(the children fork the parent's blocks); ``reorder_cache`` (beam search) permutes block tables by ref
count and copies at most one partial block per row when it is next written (copy-on-write). Full
blocks enter a prefix index: each row keeps its own token ids (the pool keeps only counts) and hands
them to the pool as its blocks fill up. ``cache.prepare(input_ids)`` before a new ``generate`` call
attaches the cached prefix, and generate then feeds only the new tokens (it learns the cached length
from ``get_seq_length``). The pool outlives calls; ``reset()`` frees the rows and keeps the prefix index.
``crop()`` rolls rows back (assisted generation and prompt lookup drop rejected draft tokens with it).

Compiled generate (``max_cache_len`` given, "paged" attention, one device: ``is_compileable`` is True): transformers
then compiles the model's call for its decode steps (CUDA graphs on CUDA), as for StaticCache. Before each forward,
generate's eager input preparation calls the model's ``create_masks_for_generate``, which PagedCache replaces (for
itself only) with ``_plan_ahead``: a decode step is planned there in full (blocks, copy-on-write copies, slots,
lengths and block tables copied without a sync into static device buffers of fixed shape [batch], [batch,
ceil(max_cache_len / block_size)]) and gets a 4D marker mask, so transformers builds no mask inside the forward.
The forward then runs no host code: the decoder hook copies the step's token ids to a device buffer and hands the
static context to the attention function as a forward kwarg, ``update`` writes at the static slots, and the
attention calls ``paged_decode`` (a custom op over the Triton kernel on CUDA, a static-shape reference elsewhere).
The token ids come back to the host at the next host call (the next plan, ``reset``, ``crop``, a beam reorder),
when the blocks they filled enter the prefix index. The pool tensors must keep their address between compiled
steps: a growing pool holds the prefill's blocks for the prefill (its activations never meet the decode steps'
blocks, as StaticCache's max_cache_len slots a row meet them), then grows once, before the first planned step, for
every row's real tokens up to max_cache_len columns (left padding takes no slot; generate's copies of one prompt,
for ``num_return_sequences`` or beams, count its full blocks once; a cap too low for that raises at the prefill),
and a planned step never grows it. Modes: greedy, sampling and ``num_return_sequences``
compile; transformers runs beam search and assisted generation (crop) eagerly. A planned step whose forward
runs eagerly (beam search, or generate without a compile) reads the same static buffers through the eager decode
path instead (``update`` defers the K/V write to the attention's one decode launch, split for the rows' real
lengths): the static path's separate write, split count for max_cache_len and merge launch cost host time a layer
that only a compiled graph hides. Any forward not planned ahead (prefills, verification forwards, chunked
prefill) is planned by the hook as without max_cache_len (eager; inside a compiled call, behind graph breaks).

Calls: a ``generate`` call on a cache that still holds rows continues them, as with a DynamicCache (its
prompt must extend every row: the previous output plus new tokens). Any other new batch (another batch
size, or a fresh prompt that does not extend them) raises ValueError: call ``reset()`` or ``prepare()``
between calls. A prompt that is longer than the columns held is taken as an extension (its first
columns are not compared).
"""

import functools
import itertools
import math
import operator
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_paged.core.attention import PLANNED_CONTEXT_KWARG
from hf_paged.core.block_pool import BlockPool
from hf_paged.core.context import ForwardContext, get_forward_context, reset_forward_context, set_forward_context
from hf_paged.kernels import write_kv
from hf_paged.core.model_info import ModelInfo
from hf_paged.core.planner import slot_mapping
from hf_paged.core.transfer import to_device

_DEFAULT_MEMORY_FRACTION = 0.3
_PLACEHOLDER_ID = -1  # a planned step's token id until the forward has run (the pool rejects hashing it)


@dataclass
class MemoryReport:
    """What the pool holds now (the paper's Fig. 2 "token states" share and §6.3 sharing savings)."""

    num_blocks: int
    num_used_blocks: int
    num_used_slots: int  # slots holding live tokens (a shared block counts once)
    num_allocated_slots: int  # num_used_blocks * block_size
    num_table_entries: int  # blocks the rows would use without sharing
    kv_bytes_per_block: int

    @property
    def token_state_share(self) -> float:
        """Share of allocated KV slots that hold token states (the rest is the partial last blocks)."""
        return self.num_used_slots / self.num_allocated_slots if self.num_allocated_slots else 1.0

    @property
    def sharing_savings(self) -> float:
        """Blocks saved by sharing / blocks needed without sharing."""
        return 1.0 - self.num_used_blocks / self.num_table_entries if self.num_table_entries else 0.0

    @property
    def used_bytes(self) -> int:
        return self.num_used_blocks * self.kv_bytes_per_block

    def __str__(self) -> str:
        return (
            f"KV blocks used {self.num_used_blocks}/{self.num_blocks} ({self.used_bytes / 2**20:.1f} MiB), "
            f"token states {self.token_state_share:.1%} of allocated slots, "
            f"sharing saves {self.sharing_savings:.1%} of {self.num_table_entries} blocks"
        )


class _PagedLayer(CacheLayerMixin):
    """Per-layer view for transformers' bookkeeping (is_sliding, lengths); the data lives in the KVPool."""

    is_compileable = False
    is_croppable = True  # PagedCache.crop rolls back every layer at once (sliding layers keep all their tokens)
    is_sliding = False

    def __init__(self, cache: "PagedCache", layer_idx: int, is_sliding: bool):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_sliding = is_sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):  # the pool is allocated up front
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache._update_layer(key_states, value_states, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.cache._num_columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache._num_columns + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx):  # handled once for all layers by PagedCache.reorder_cache
        pass


class PagedCache(Cache):
    """A transformers Cache over a paged KV pool, for ``model.generate``.

    Args:
        model: a Hugging Face decoder-only model (standard or sliding-window attention layers).
        num_blocks: blocks in the pool, allocated at once. Default (None): the pool starts empty and grows as
            the rows need blocks (each forward reserves what it may write, plus 1/16 of the pool), up to
            ``memory_fraction`` of the free memory of the first layer's device: its size is the most a call used.
            It never shrinks: its free blocks keep the prefix cache for later calls.
        block_size: tokens per block, a positive multiple of 8.
        memory_fraction: the most of the free device memory (measured here) a growing pool may take, when
            ``num_blocks`` is None.
        enable_prefix_caching: index full blocks by content hash so later prompts reuse them.
        max_cache_len: the most columns (prompt, its padding and new tokens, over every call the rows continue)
            a row may reach, as StaticCache's. Given, the cache is compileable (with ``attn_implementation="paged"``
            on one device): ``generate`` compiles its decode steps, each planned ahead into static buffers, and a
            growing pool is sized at each prefill for every row to reach it (see the module docstring). None
            (default): not compileable; the pool grows as the rows need blocks.

    Raises:
        ValueError: the model is not a decoder-only model of attention layers, or an argument is out of range.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int | None = None,
        block_size: int = 16,
        memory_fraction: float = _DEFAULT_MEMORY_FRACTION,
        enable_prefix_caching: bool = True,
        max_cache_len: int | None = None,
    ):
        if max_cache_len is not None and (
            isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1
        ):
            raise ValueError(f"`max_cache_len` must be a positive int or None, got {max_cache_len!r}")
        info = ModelInfo.from_model(model)
        # A growing pool starts with one block (pools are never empty) and may grow to _max_num_blocks.
        self._max_num_blocks = info.num_blocks_for(None, block_size, memory_fraction) if num_blocks is None else None
        num_blocks = info.num_blocks_for(num_blocks, block_size, memory_fraction) if num_blocks is not None else 1
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.kv = info.make_kv_pool(num_blocks, block_size)
        self.block_size = block_size
        self.kv_bytes_per_block = info.bytes_per_block(block_size)
        self._model_config = model.config
        layer_cache = weakref.proxy(self)  # layers -> cache without a reference cycle: the pool goes with the cache
        super().__init__(
            layers=[_PagedLayer(layer_cache, i, t == "sliding_attention") for i, t in enumerate(info.layer_types)]
        )
        self._seq_ids = itertools.count()
        self._rows: list[_Row] = []  # one per batch row, in batch order
        self._num_columns = 0  # input columns seen per row (incl. padding): what generate calls the seq length
        self._left_padded = True  # no row has a padding column after a token (crop() relies on it)
        # [batch_size, width] int32: the rows' block tables as the last forward planned them (zero-padded; width
        # at least the longest table); None after anything that changes rows outside a forward (reset, crop, ...).
        self._tables: np.ndarray | None = None
        # What decode steps reuse on the device while it holds: (the _tables array as last copied, that copy), dropped
        # when _refresh_tables writes into the array (a new array is told apart by identity); and cu_seqlens_q of a
        # decode step, 0..batch_size.
        self._device_tables: tuple[np.ndarray, torch.Tensor] | None = None
        self._decode_cu_seqlens: torch.Tensor | None = None
        self._pending_columns = 0
        self._prepared = False  # rows from prepare() that no forward has fed yet
        # True from the moment blocks enter the prefix index for tokens whose K/V no forward has completed yet
        # (allocate indexes a prompt's blocks at once; the forward writes them); see _forget_unwritten_blocks.
        self._index_unwritten = False
        self._ctx: ForwardContext | None = None
        self.peak_used_blocks = 0  # high-water mark of blocks in use, to size a pool for a workload
        # Decode steps planned ahead (compileable mode, see the module docstring).
        self._max_cache_len = max_cache_len
        self._static: _StaticStep | None = None  # device buffers of planned steps, kept across steps and calls
        self._planned = False  # a step is planned and its forward has not run yet
        self._planned_failed = False  # the last planned step's forward raised
        self._planned_eager = False  # the planned step's forward runs eagerly (the decoder hook saw no compile)
        self._planned_max_seq_len = 0  # the planned step's longest row (host), for its eager decode launch
        self._ids_pending = False  # the last planned step's token ids are still only on the device
        self._rows_to_index: list[int] = []  # rows whose last planned token filled a block: indexed once ids are in
        self._pool_frozen = False  # while planning ahead: the pool must not grow (compiled graphs keep its address)
        self._presize_left: int | None = None  # columns left after a fresh prefill, until _start_rows sizes the pool
        self._grow_target: int | None = None  # blocks the planned steps need: the pool grows at the first one
        self._marked_pool: torch.Tensor | None = None
        _install_hooks(model)

    # ---- transformers Cache API ------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # A planned step counts once its forward has run. An int, not int - bool: under torch.compile the column
        # count can be a symbolic int, and sympy refuses to subtract a bool from it.
        return self._num_columns - 1 if self._planned else self._num_columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def max_cache_len(self) -> int | None:
        """The ``max_cache_len`` given at construction (None: not compileable)."""
        return self._max_cache_len

    @property
    def is_compileable(self) -> bool:
        """True with ``max_cache_len``, attn_implementation "paged" and every layer's pool on one device: generate
        then plans decode steps ahead and compiles them (on CUDA, or on any device with a CompileConfig whose
        ``_compile_all_devices`` is set)."""
        return (
            self._max_cache_len is not None
            and getattr(self._model_config, "_attn_implementation", None) == "paged"
            and len({t.device for t in self.kv.k_cache}) == 1
        )

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write this step's K/V into the layer's blocks; return what the attention implementation reads."""
        if self._planned:
            if self._planned_eager:  # a planned step run eagerly: the eager decode path over the static buffers
                return self._update_from_context(key_states, value_states, layer_idx)
            return self._update_planned(key_states, value_states, layer_idx)
        if torch.compiler.is_compiling():  # the forward context is a context variable, which dynamo cannot read
            return self._update_from_context_disabled(key_states, value_states, layer_idx)
        return self._update_from_context(key_states, value_states, layer_idx)  # eager: no disable wrapper

    _update_layer = update  # for _PagedLayer.update (one call frame fewer per layer than a wrapper)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: new row i continues old row beam_idx[i]. Block tables are forked, never copied."""
        self._remap_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._remap_rows([i for i in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap_rows(indices.tolist())

    def reset(self) -> None:
        """Free every row; the pool's prefix index keeps their full blocks for later prompts.

        After a call that failed (MemoryError, an exception in the model) or a ``prepare()`` that no forward
        fed, the index is emptied instead: some of its blocks may not hold their K/V.
        """
        self._finish_planned_step()
        self._free_rows(self._rows)
        self._rows = []
        self._num_columns = 0
        self._presize_left = self._grow_target = None
        self._left_padded = True
        self._tables = None
        self._prepared = False
        self._forget_unwritten_blocks()

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` columns of every row and release the blocks past them (assisted decoding).

        As ``DynamicCache.crop``: a negative ``max_length`` drops that many columns, and 0 drops none (transformers
        calls ``crop(-0)`` when every draft token was accepted); a length at or beyond ``get_seq_length()`` changes
        nothing, and dropping every column is ``reset()``. Each row keeps its real tokens within those columns: a
        block cut inside that another row shares (num_return_sequences, beams, a prefix hit) is copied for this
        row, an own block cut inside leaves the prefix index (its slots will be rewritten), released full blocks
        stay cached for later prompts (their K/V match their tokens).

        Args:
            max_length: columns to keep (> 0), or minus the number of columns to drop (< 0).

        Raises:
            TypeError: ``max_length`` is not an int (or a 0-d integer tensor).
            ValueError: the cache holds rows from ``prepare()`` that no forward fed yet, or a row's attention_mask
                has a padding column after a token (only left padding can be cropped).
            RuntimeError: called inside a forward.
            MemoryError: copying the shared blocks the crop cuts needs more free blocks than the pool has
                (nothing changed).
        """
        try:  # transformers 5.17's assisted generation passes a 0-d integer tensor
            if isinstance(max_length, bool):
                raise TypeError
            max_length = operator.index(max_length)
        except TypeError:
            raise TypeError(
                f"`max_length` must be an int (columns to keep, or < 0: columns to drop), got {max_length!r}"
            ) from None
        if self._ctx is not None:
            raise RuntimeError("PagedCache.crop() was called inside a forward; crop between forwards")
        self._finish_planned_step()
        requested = max_length
        if max_length < 0:
            max_length = max(0, self._num_columns + max_length)
        elif max_length == 0:
            return
        if max_length >= self._num_columns:
            return
        if self._prepared:
            raise ValueError(
                "PagedCache.crop() after prepare(): no forward has fed the prepared prompts yet; call "
                "prepare() with the prompt you want to keep instead"
            )
        if max_length == 0:
            self.reset()
            return
        if not self._left_padded:
            raise ValueError(
                f"PagedCache.crop({requested}) needs every row's padding columns before its tokens (left padding), "
                "but an attention_mask of this call has a padding column after a token; call reset() instead"
            )
        # Left padding: row b's real tokens are its last num_computed columns.
        keep = [max(0, max_length - (self._num_columns - row.num_computed)) for row in self._rows]
        to_truncate = [(row, n) for row, n in zip(self._rows, keep, strict=True) if 0 < n < len(row.token_ids)]
        need = sum(self.pool.num_blocks_to_truncate(row.seq_id, n) for row, n in to_truncate)
        self._reserve(need)
        if need > self.pool.num_free_blocks:
            raise MemoryError(
                f"PagedCache.crop({requested}) copies up to {need} shared blocks that it cuts, but the pool has "
                f"{self.pool.num_free_blocks} free blocks of {self.pool.num_blocks}; nothing was cropped. Pass a "
                "larger num_blocks= to PagedCache, or reset() the cache"
            )
        cow: list[tuple[int, int]] = []
        for row, n in zip(self._rows, keep, strict=True):
            if n >= len(row.token_ids):
                continue
            if n == 0:  # only padding is left in this row: no blocks, as a row whose prompt so far was padding
                self.pool.free(row.seq_id)
            else:
                cow.extend(self.pool.truncate(row.seq_id, n))
            del row.token_ids[n:]
            row.num_computed = n
            row.write_from = min(row.write_from, n)  # the row writes its next positions itself
        self.kv.copy_blocks(cow)
        self._num_columns = max_length
        self._tables = None

    # ---- hf_paged API ----------------------------------------------------------------------------

    def prepare(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> "PagedCache":
        """Start a new batch of prompts on this pool, reusing cached prefix blocks; returns ``self``.

        Frees the previous rows (their full blocks stay in the prefix index), gives each row its
        prompt's blocks, and sets the cached length that ``generate`` reads from ``get_seq_length`` so
        that only the uncached tokens go through the model::

            out = model.generate(**inputs, past_key_values=cache.prepare(**inputs))

        Rows with left padding are stored, but only a batch without padding skips its common cached
        prefix (generate skips the same number of columns in every row). When generate expands each prompt
        into several rows (``num_beams``, ``num_return_sequences``), the copies share the prepared blocks.
        The first forward must feed the prompts given here (checked where ids are given).

        Args:
            input_ids: [batch_size, prompt_len] prompt token ids, as passed to generate.
            attention_mask: [batch_size, prompt_len] 1 for tokens, 0 for padding; None = no padding.

        Raises:
            ValueError: ``input_ids`` is not a [batch_size, prompt_len] batch of at least one prompt, or a
                row's attention_mask is all zeros.
            MemoryError: the pool is too small for the prompts.
        """
        self.reset()
        if input_ids.dim() != 2 or input_ids.shape[0] == 0:
            raise ValueError(
                f"`input_ids` must be a [batch_size, prompt_len] batch of at least one prompt, got shape "
                f"{tuple(input_ids.shape)}"
            )
        ids = input_ids.to("cpu").numpy()
        mask = attention_mask.to("cpu", torch.bool).numpy() if attention_mask is not None else None
        padded = mask is not None and not mask.all()
        self._index_unwritten = True  # until the first forward has written the prompts
        self._start_rows(ids, mask if padded else None, skip_cached=not padded)
        self._num_columns = min(row.num_computed for row in self._rows)
        for row in self._rows:
            row.num_computed = self._num_columns
        self._prepared = True
        return self

    def memory_report(self) -> MemoryReport:
        """Blocks used, token-state share of allocated slots and sharing savings, for the pool as it is now."""
        s = self.pool.stats
        return MemoryReport(
            num_blocks=s.num_blocks,
            num_used_blocks=s.num_used_blocks,
            num_used_slots=s.num_used_slots,
            num_allocated_slots=s.num_allocated_slots,
            num_table_entries=s.num_table_entries,
            kv_bytes_per_block=self.kv_bytes_per_block,
        )

    # ---- one forward ---------------------------------------------------------------------------

    def _begin_forward(
        self,
        input_ids: torch.Tensor | None,
        shape: tuple[int, int],
        mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ):
        """Plan one forward: slots for every row's real new tokens, CoW copies, the step metadata.

        Row b's real (unmasked) new columns carry the positions that follow its computed tokens, in order;
        padding columns take no slot (-1), and neither do positions below ``write_from`` (shared blocks
        another row writes)::

            columns    | pad  pad  t    t    t   |   one row, query_len 5, left-padded
            positions  |  -    -   p    p+1  p+2 |   p = row.num_computed before this forward
        """
        self._finish_planned_step()
        batch_size, query_len = shape
        # generate() expands each prepared prompt into num_copies rows for num_beams / num_return_sequences.
        num_copies = 1
        if self._prepared and batch_size > len(self._rows) and batch_size % len(self._rows) == 0:
            num_copies = batch_size // len(self._rows)
        self._check_forward(batch_size, query_len, mask, num_copies)
        paged = getattr(self._model_config, "_attn_implementation", None) == "paged"
        if query_len == 1 and paged and input_ids is not None and self._rows and not self._prepared:
            # A decode step: only the new column of the mask crosses to the host, not the whole [batch, length].
            if mask is None or bool(mask[:, -1:].to("cpu").all()):
                ctx = self._begin_decode(input_ids, position_ids)
                if ctx is not None:
                    return ctx
        if mask is not None:
            mask = mask.to("cpu", torch.bool)
            mask = None if bool(mask.all()) else mask.numpy()  # [batch_size, num_columns + query_len]
        ids = input_ids.to("cpu").numpy() if input_ids is not None else None  # [batch_size, query_len]
        # [batch_size, query_len] bool: the columns of this forward that hold real tokens
        real = mask[:, self._num_columns :] if mask is not None else np.ones(shape, dtype=bool)
        if self._rows:
            rows = [self._rows[b // num_copies] for b in range(batch_size)]  # each batch row's row, before forks
            self._check_positions(rows, position_ids, real)
            if self._prepared and ids is not None:
                self._check_prepared_tokens(rows, ids, real)
            if num_copies > 1:
                self._expand_prepared_rows(num_copies)
            self._prepared = False
        else:
            if self._num_columns:
                raise RuntimeError("bug in hf_paged: PagedCache has columns but no rows")
            self._forget_unwritten_blocks()  # left by a first forward that failed
        self._index_unwritten = True  # until this forward completes: it writes the blocks indexed below
        if not self._rows:
            self._start_rows(ids, mask, shape=shape, allow_empty=True)
        num_new = real.sum(axis=1)  # [batch_size] real new tokens per row
        num_computed = np.array([row.num_computed for row in self._rows], dtype=np.int64)
        if mask is not None and self._left_padded:  # a padding column after a token of its row breaks left padding
            seen = np.logical_or.accumulate(real, axis=1) | (num_computed > 0)[:, None]
            self._left_padded = not (seen & ~real).any()
        if self._max_num_blocks is not None:  # a growing pool: room for every row's new tokens (and copies) at once
            need = 0
            for b, row in enumerate(self._rows):
                num_unseen = int(num_computed[b] + num_new[b]) - len(row.token_ids)
                if num_unseen > 0:
                    need += (
                        self.pool.num_blocks_to_append(row.seq_id, num_unseen)
                        if row.token_ids
                        else -(-num_unseen // self.block_size)
                    )
            self._reserve(need)
        cow: list[tuple[int, int]] = []
        for b, row in enumerate(self._rows):
            # The prompt's slots were reserved by _start_rows; later tokens get theirs here.
            num_unseen = int(num_computed[b] + num_new[b]) - len(row.token_ids)
            if num_unseen <= 0:
                continue
            # inputs_embeds: no ids; the row's unique extra key keeps these blocks out of every other prompt
            tokens = ids[b, np.flatnonzero(real[b])[-num_unseen:]].tolist() if ids is not None else [0] * num_unseen
            if not row.token_ids:  # a row whose prompt so far was all padding (chunked prefill) starts here
                if not self._allocate_row(row, tokens):
                    self._raise_out_of_blocks(batch_size, query_len)
                continue
            pairs = self.pool.append(row.seq_id, num_unseen)
            if pairs is None:
                self._raise_out_of_blocks(batch_size, query_len)
            cow.extend(pairs)
            row.token_ids.extend(tokens)
            self.pool.cache_blocks(row.seq_id, row.token_ids, len(row.token_ids))
        self.kv.copy_blocks(cow)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_blocks - self.pool.num_free_blocks)
        block_tables = self._tables = self._block_tables()
        write_from = np.array([row.write_from for row in self._rows], dtype=np.int64)
        slots = self._column_slots(block_tables, real, num_computed, write_from)  # [batch_size, query_len]
        seq_lens = num_computed + num_new
        for row, seq_len in zip(self._rows, seq_lens.tolist(), strict=True):
            row.num_computed = seq_len
        cu_seqlens_q = np.zeros(batch_size + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu_seqlens_q[1:])
        token_idx = None if real.all() else np.flatnonzero(real)
        gather_idx = None if paged else self._gather_index(block_tables, mask, self._num_columns + query_len)
        device = self.kv.k_cache[0].device
        self._pending_columns = query_len
        self._ctx = ForwardContext(
            slot_mapping=to_device(slots.reshape(-1), torch.int64, device),
            block_tables=to_device(block_tables, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            cu_seqlens_q=to_device(cu_seqlens_q, torch.int32, device),
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            batch_size=batch_size,
            query_len=query_len,
            token_idx=to_device(token_idx, torch.int64, device) if token_idx is not None else None,
            gather_idx=to_device(gather_idx, torch.int64, device) if gather_idx is not None else None,
            paged=paged,
            owner=self,
        )
        self._device_tables = (block_tables, self._ctx.block_tables)
        return self._ctx

    def _begin_decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> ForwardContext | None:
        """The plan of a decode step in which every row appends one real token: the hot path of ``generate``.

        Same result as the general plan, with less host work: one pool ``append`` and one list append per row (the
        pool's fast path when the token fits the row's own partial last block), the block tables kept from the
        previous forward (only rows that opened or copied a block are read again), slots and lengths in a few
        vectorised numpy operations, and no copy of the whole attention mask to the host.

        Returns:
            None, with nothing changed, when a row is not ready for it (a row that has no token yet); the caller
            then plans the forward the general way.
        """
        plan = self._plan_decode(input_ids, position_ids)
        if plan is None:
            return None
        slots, seq_lens, _ = plan
        device = self.kv.k_cache[0].device
        batch_size = len(self._rows)
        # Most steps open no block: the block tables and cu_seqlens_q on the device are the last step's.
        tables = self._device_tables
        if tables is None or tables[0] is not self._tables:
            tables = self._device_tables = (self._tables, to_device(self._tables, torch.int32, device))
        cu_seqlens_q = self._decode_cu_seqlens
        if cu_seqlens_q is None or cu_seqlens_q.shape[0] != batch_size + 1:
            cu_seqlens_q = self._decode_cu_seqlens = to_device(np.arange(batch_size + 1), torch.int32, device)
        self._pending_columns = 1
        self._ctx = ForwardContext(
            slot_mapping=to_device(slots, torch.int64, device),
            block_tables=tables[1],
            seq_lens=to_device(seq_lens, torch.int32, device),
            cu_seqlens_q=cu_seqlens_q,
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            batch_size=batch_size,
            query_len=1,
            paged=True,
            owner=self,
            defer_kv_write=True,
        )
        return self._ctx

    def _decode_ready(self) -> bool:
        """Whether every row can take one token the decode way (kept block tables, rows that hold tokens)."""
        rows = self._rows
        return self._tables is not None and len(self._tables) == len(rows) and all(row.token_ids for row in rows)

    def _plan_decode(
        self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
        """Append one token to every row (blocks, copy-on-write, tables): the host side of a decode step.

        Args:
            input_ids: [batch_size, 1] the step's tokens; None when planning ahead (the ids are not known yet): each
                row then holds a placeholder id, and the rows whose block it fills are indexed once the ids are in
                (``_finish_planned_step``).

        Returns:
            (slots [batch_size] int64, seq_lens [batch_size] int64, rows whose block table changed), or None with
            nothing changed when a row is not ready (see ``_decode_ready``).
        """
        rows = self._rows
        if not self._decode_ready():
            return None
        # [batch_size] int64: each row's computed tokens = the position of its new token
        positions = np.fromiter((row.num_computed for row in rows), dtype=np.int64, count=len(rows))
        if position_ids is not None and tuple(position_ids.shape) in {(len(rows), 1), (1, 1)}:
            # _check_positions for one real column per row: each row's position is its computed-token count.
            wrong = np.flatnonzero(position_ids.to("cpu").numpy().reshape(-1) != positions)
            if len(wrong):
                self._check_positions(rows, position_ids, np.ones((len(rows), 1), dtype=bool))  # raises, naming it
        self._index_unwritten = True  # until this forward completes: cache_blocks below indexes blocks it writes
        if input_ids is None:
            token_ids = [_PLACEHOLDER_ID] * len(rows)
            self._rows_to_index = []
        else:
            token_ids = input_ids.to("cpu").reshape(-1).tolist()
        bs = self.block_size
        if self._max_num_blocks is not None:  # a growing pool: a block for every row that opens one
            self._reserve(int(np.count_nonzero(positions % bs == 0)))
        cow: list[tuple[int, int]] = []
        changed: list[int] = []  # rows whose block table changed: a new block, or a copy of the last one
        for b, (row, token) in enumerate(zip(rows, token_ids, strict=True)):
            pairs = self.pool.append(row.seq_id, 1)
            if pairs is None:  # a copy-on-write the reservation did not count (a shared partial block)
                self._reserve(self.pool.num_blocks_to_append(row.seq_id, 1))
                pairs = self.pool.append(row.seq_id, 1)
            if pairs is None:
                self._raise_out_of_blocks(len(rows), 1)
            if pairs or row.num_computed % bs == 0:
                cow.extend(pairs)
                changed.append(b)
            row.token_ids.append(token)
            row.num_computed += 1
            if row.num_computed % bs == 0:  # the token fills its block: into the prefix index
                if input_ids is None:
                    self._rows_to_index.append(b)
                else:
                    self.pool.cache_blocks(row.seq_id, row.token_ids, row.num_computed)
        self.kv.copy_blocks(cow)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_blocks - self.pool.num_free_blocks)
        if changed:
            self._refresh_tables(changed)
        slots = slot_mapping(self._tables, np.arange(len(rows)), positions, bs)  # [batch_size]
        return slots, positions + 1, changed

    def _refresh_tables(self, changed: list[int]) -> None:
        """Read the block tables of rows ``changed`` from the pool into the kept [batch_size, width] tables."""
        self._device_tables = None  # written in place below: its device copy is stale
        tables = [self.pool.get_block_table(self._rows[b].seq_id) for b in changed]
        width = max(len(t) for t in tables)
        if width > self._tables.shape[1]:
            grown = np.zeros((len(self._tables), width), dtype=np.int32)
            grown[:, : self._tables.shape[1]] = self._tables
            self._tables = grown
        for b, table in zip(changed, tables, strict=True):
            self._tables[b, : len(table)] = table

    def _check_forward(self, batch_size: int, query_len: int, mask: torch.Tensor | None, num_copies: int) -> None:
        """Name the caller mistakes a forward can carry before any state changes.

        Raises:
            ValueError: an empty batch; a mask that is not [batch_size, past + new columns]; or rows left from
                an earlier ``generate``/``prepare`` call that this forward does not continue.
        """
        if batch_size == 0:
            raise ValueError(
                f"PagedCache needs a batch of at least one row, got an empty batch (input of shape "
                f"({batch_size}, {query_len})); call generate() with at least one prompt"
            )
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"PagedCache needs a 2D attention_mask [batch, length], got shape {tuple(mask.shape)}")
        num_mask_columns = mask.shape[1] if mask is not None else self._num_columns + query_len
        if self._rows and (
            len(self._rows) * num_copies != batch_size
            or query_len == 0
            or num_mask_columns != self._num_columns + query_len
        ):
            # Within one generate() call every forward continues the rows; only a new call breaks that.
            got = f"batch size {batch_size} with {query_len} new columns"
            if mask is not None:
                got += f" and an attention_mask of {mask.shape[1]} columns"
            self._raise_stale(got)
        if num_mask_columns != self._num_columns + query_len:
            raise ValueError(
                f"attention_mask covers {num_mask_columns} columns, expected past {self._num_columns} + new "
                f"{query_len}; pass the mask of the whole sequence, as generate does"
            )
        if mask is not None and mask.shape[0] != batch_size:
            raise ValueError(f"attention_mask has {mask.shape[0]} rows, but the forward has batch size {batch_size}")
        if query_len == 0:
            raise ValueError(f"PagedCache needs at least one input column per forward, got shape ({batch_size}, 0)")

    def _check_positions(self, rows: list["_Row"], position_ids: torch.Tensor | None, real: np.ndarray) -> None:
        """A forward on held rows must continue them: its real tokens' position_ids are the rows' next positions.

        generate() passes position_ids (cumsum of the mask - 1: the count of real tokens before each one), so a
        new generate() call on rows left from an earlier one shows up here, unless its prompt extends them
        (a continuation, as with a DynamicCache). Without position_ids (or with 3D rope positions) nothing is checked.
        """
        batch_size, query_len = real.shape
        if position_ids is None or tuple(position_ids.shape) not in {(batch_size, query_len), (1, query_len)}:
            return
        given = np.broadcast_to(position_ids.to("cpu").numpy(), real.shape)
        num_computed = np.array([row.num_computed for row in rows], dtype=np.int64)
        seq_idx, col_idx = np.nonzero(real)
        expected = num_computed[seq_idx] + np.cumsum(real, axis=1)[seq_idx, col_idx] - 1
        wrong = np.flatnonzero(given[seq_idx, col_idx] != expected)
        if len(wrong):
            i = wrong[0]
            self._raise_stale(
                f"position_ids {int(given[seq_idx[i], col_idx[i]])} in row {seq_idx[i]}, where that row continues "
                f"at position {int(expected[i])}"
            )

    def _check_prepared_tokens(self, rows: list["_Row"], ids: np.ndarray, real: np.ndarray) -> None:
        """The first forward after prepare() feeds the prompts it got: else their blocks would be indexed under
        prepare()'s tokens while holding the K/V of others (wrong prefix hits later)."""
        for b, row in enumerate(rows):
            cols = np.flatnonzero(real[b])[: len(row.token_ids) - row.num_computed]
            expected = row.token_ids[row.num_computed : row.num_computed + len(cols)]
            if ids[b, cols].tolist() != expected:
                raise ValueError(
                    f"row {b} of this forward feeds other tokens than the prompt cache.prepare() got (from position "
                    f"{row.num_computed}: {ids[b, cols].tolist()[:8]} vs {expected[:8]}); pass generate() the "
                    "input_ids (and attention_mask) given to prepare()"
                )

    def _expand_prepared_rows(self, num_copies: int) -> None:
        """Row b becomes rows b * num_copies ... (generate's repeat_interleave): the copies fork its blocks."""
        rows = []
        for row in self._rows:
            rows.append(row)
            for _ in range(num_copies - 1):
                seq_id = next(self._seq_ids)
                self.pool.fork(row.seq_id, seq_id)
                # The first copy writes the uncached prompt; the others only read it.
                rows.append(_Row(seq_id, list(row.token_ids), row.num_computed, len(row.token_ids), row.extra_key))
        self._rows = rows
        self._tables = None

    def _raise_stale(self, got: str):
        raise ValueError(
            f"this PagedCache still holds {len(self._rows)} rows of {self._num_columns} columns from an earlier "
            f"generate() or prepare() call, which this forward ({got}) does not continue; call cache.reset() "
            "before reusing the cache for another generate() call, or cache.prepare(input_ids, attention_mask) "
            "to start it on the new prompts with their cached prefix"
        )

    def _end_forward(self, completed: bool) -> None:
        if self._ctx is not None:
            self._ctx.flush_pending_kv()  # a deferred K/V write no attention took (not expected): keep the cache whole
        self._num_columns += self._pending_columns
        self._pending_columns = 0
        self._ctx = None
        if completed and all(row.num_computed == len(row.token_ids) for row in self._rows):
            self._index_unwritten = False  # every token the rows hold has its K/V

    def _forget_unwritten_blocks(self) -> None:
        """Empty the prefix index if it may hold blocks whose K/V were never written.

        ``allocate`` indexes a prompt's full blocks, and ``cache_blocks`` a row's new full blocks, when the
        forward that writes them is planned (so rows of one batch share a common prefix at once). If that
        forward never completes (out of blocks for a later row, an exception in the model, a prepare() that
        generate never fed), a later prompt would hit blocks without their K/V: wrong tokens, no error. The
        pool has no per-block eviction, so the whole index goes (rare: only after a failed call).
        """
        if self._index_unwritten:
            self.pool.reset_prefix_cache()
            self._index_unwritten = False

    def _update_planned(self, key_states, value_states, layer_idx: int):
        """A planned decode step (traced under torch.compile): write at the static slots, return the pools."""
        kv = self.kv
        shape = key_states.shape
        if type(layer_idx) is not int or not 0 <= layer_idx < kv.num_layers or len(shape) != 4:
            self._check_layer(key_states, layer_idx)
        if shape[1] != kv.num_kv_heads or shape[3] != kv.head_dim:
            self._check_layer(key_states, layer_idx)
        k_cache, v_cache = kv.k_cache[layer_idx], kv.v_cache[layer_idx]
        batch_size, num_kv_heads, query_len, head_dim = shape
        key = key_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        value = value_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        write_kv(key, value, k_cache, v_cache, self._static.ctx.slot_mapping)
        return k_cache, v_cache

    def _update_from_context(self, key_states, value_states, layer_idx: int):
        ctx = get_forward_context()
        if ctx is None or ctx.owner is not self:
            raise RuntimeError(
                "PagedCache.update() was called outside a forward it planned. PagedCache plans each forward "
                "through a hook on the model it was built with: pass it to that model's generate()/forward()"
            )
        kv = self.kv
        shape = key_states.shape
        if (  # the checks of _check_layer, inline: this runs once per layer per forward
            type(layer_idx) is not int
            or not 0 <= layer_idx < kv.num_layers
            or len(shape) != 4
            or shape[1] != kv.num_kv_heads
            or shape[3] != kv.head_dim
        ):
            self._check_layer(key_states, layer_idx)
        k_cache, v_cache = kv.k_cache[layer_idx], kv.v_cache[layer_idx]
        if ctx.slot_mapping.device != k_cache.device:  # device_map: this layer lives on another device
            ctx = ctx.on(k_cache.device)
        batch_size, num_kv_heads, query_len, head_dim = shape
        if query_len == 1:  # decode: dropping the size-1 column is a view, at half the host time of the general form
            key = key_states.view(batch_size, num_kv_heads, head_dim)
            value = value_states.view(batch_size, num_kv_heads, head_dim)
            if ctx.defer_kv_write and key.dtype == k_cache.dtype:  # the attention's decode kernel writes them
                if ctx.pending_kv is not None:  # an earlier layer's, which no attention took (not expected)
                    ctx.flush_pending_kv()
                ctx.pending_kv = (k_cache, v_cache, key, value)
                return k_cache, v_cache
        else:
            key = key_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
            value = value_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        write_kv(key, value, k_cache, v_cache, ctx.slot_mapping)
        if ctx.paged:
            return k_cache, v_cache
        return _gather(k_cache, ctx.gather_idx), _gather(v_cache, ctx.gather_idx)

    _update_from_context_disabled = torch.compiler.disable(_update_from_context)

    def _check_layer(self, key_states: torch.Tensor, layer_idx: int) -> None:
        """The layer and its K/V shape must be those of the model the pool was built for."""
        kv = self.kv
        built_for = (
            f"PagedCache was built for a model with {kv.num_layers} attention layers of {kv.num_kv_heads} KV heads "
            f"of head_dim {kv.head_dim}"
        )
        fix = "; use a PagedCache built for this model: PagedCache(model, ...)"
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < kv.num_layers:
            raise ValueError(
                f"{built_for}, but this forward updates layer_idx {layer_idx!r} (allowed: 0 to "
                f"{kv.num_layers - 1}){fix}"
            )
        shape = tuple(key_states.shape)
        if len(shape) != 4 or shape[1] != kv.num_kv_heads or shape[3] != kv.head_dim:
            got = f"num_kv_heads {shape[1]}, head_dim {shape[3]}" if len(shape) == 4 else f"{len(shape)} dims"
            raise ValueError(
                f"{built_for}, but layer {layer_idx} of this forward has key states of shape {shape} "
                f"([batch, num_kv_heads, query_len, head_dim]: {got}){fix}"
            )

    def _block_tables(self) -> np.ndarray:
        """[batch_size, max_blocks_per_seq] int32: every row's block table, zero-padded."""
        tables = [self.pool.get_block_table(row.seq_id) if row.token_ids else [] for row in self._rows]
        block_tables = np.zeros((len(tables), max(1, *(len(t) for t in tables))), dtype=np.int32)
        for b, table in enumerate(tables):
            block_tables[b, : len(table)] = table
        return block_tables

    def _column_slots(
        self,
        block_tables: np.ndarray,  # [num_rows, max_blocks_per_seq], int32
        real: np.ndarray,  # [num_rows, num_columns], bool: True for a column that holds a token
        first_pos: np.ndarray,  # [num_rows], int64: position of each row's first real column
        write_from: np.ndarray | None = None,  # [num_rows], int64: positions below it get -1
    ) -> np.ndarray:
        """[num_rows, num_columns] int64: pool slot of each real column (-1 for padding), one slot_mapping call.

        Row b's real columns hold positions first_pos[b], first_pos[b] + 1, ... from left to right.
        """
        seq_idx, col_idx = np.nonzero(real)  # [num_tokens] each, row-major: a row's columns in order
        positions = first_pos[seq_idx] + np.cumsum(real, axis=1)[seq_idx, col_idx] - 1
        slots = slot_mapping(block_tables, seq_idx, positions, self.block_size)
        if write_from is not None:
            slots[positions < write_from[seq_idx]] = -1
        out = np.full(real.shape, -1, dtype=np.int64)
        out[seq_idx, col_idx] = slots
        return out

    def _gather_index(self, block_tables: np.ndarray, mask: np.ndarray | None, kv_len: int) -> np.ndarray:
        """[batch_size, kv_len] int64: slot of every key column transformers' mask addresses; -1 for padding."""
        batch_size = block_tables.shape[0]
        real = mask if mask is not None else np.ones((batch_size, kv_len), dtype=bool)
        return self._column_slots(block_tables, real, np.zeros(batch_size, dtype=np.int64))

    # ---- decode steps planned ahead (compileable mode) ---------------------------------------------

    def _plan_ahead(
        self, shape: tuple[int, int], mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Plan the coming forward from generate's eager mask step; returns its 4D mask marker, or None.

        A decode step (one real new token per row, every row ready) is planned here in full: blocks, copy-on-write
        copies, then slots, lengths and block tables copied (non-blocking) into the static device buffers that the
        forward reads, so the forward itself runs no host code and can be compiled. Its token ids are not known
        here; the forward copies them to the device and ``_finish_planned_step`` reads them later. Any other
        forward (a prefill, a padding column, rows from ``prepare()``) returns None and is planned by the decoder
        hook as usual, after the pool was sized for this call (``_presize``).

        Raises:
            ValueError: the forward would take a row past ``max_cache_len`` columns.
            MemoryError: the pool is out of blocks (a fixed pool), or would have to grow (a growing pool).
        """
        self._finish_planned_step()
        batch_size, query_len = shape
        if self._num_columns + query_len > self._max_cache_len:
            raise ValueError(
                f"PagedCache(max_cache_len={self._max_cache_len}) holds at most {self._max_cache_len} columns per row "
                f"(prompt with its padding, then new tokens, over every call that continues the rows), but this "
                f"forward takes them to {self._num_columns + query_len}. Pass a larger max_cache_len= (at least the "
                "prompt length plus max_new_tokens) or reset() the cache"
            )
        decode = (
            query_len == 1
            and not self._prepared
            and len(self._rows) == batch_size
            and self._decode_ready()
            and (mask is None or (mask.dim() == 2 and mask.shape == (batch_size, self._num_columns + 1)))
        )
        if decode and mask is not None:  # one column of the mask crosses to the host, as in the eager decode path
            decode = bool(mask[:, -1].to("cpu").all())
        if not decode:
            self._presize(shape, mask)
            return None
        self._grow_for_planned_steps()
        static = self._static_buffers(batch_size)
        self._pool_frozen = True
        try:
            slots, seq_lens, changed = self._plan_decode(None, position_ids)
        finally:
            self._pool_frozen = False
        static.write(slots, seq_lens, self._tables, copy_tables=bool(changed) or static.tables_src is not self._tables)
        self._planned_max_seq_len = int(seq_lens.max())
        self._num_columns += 1
        self._planned = self._ids_pending = True
        return static.mask

    def _finish_planned_step(self) -> None:
        """Bring the last planned step's token ids to the host (a device sync) and index the blocks they filled.

        Called first by every host method that reads or changes rows. If the planned forward never ran (it
        raised before), its token ids stay unknown: the prefix index is emptied at the next ``reset()``, as after
        any failed forward.
        """
        if not self._ids_pending:
            return
        self._ids_pending = False
        if self._planned or self._planned_failed:  # the forward never ran, or raised
            self._planned = self._planned_failed = False
            return
        ids = self._static.step_ids.tolist()
        for row, token in zip(self._rows, ids, strict=True):
            row.token_ids[-1] = token
        for b in self._rows_to_index:
            row = self._rows[b]
            self.pool.cache_blocks(row.seq_id, row.token_ids, row.num_computed)
        self._rows_to_index = []
        self._index_unwritten = False  # the forward completed: every token the rows hold has its K/V

    def _presize(self, shape: tuple[int, int], mask: torch.Tensor | None) -> None:
        """Grow a growing pool, before the prefill, to what every row needs to reach ``max_cache_len`` columns.

        Row b ends with at most its real tokens after this forward plus the columns left up to max_cache_len, so
        the rows never hold more than the sum of those rounded up to blocks, and the planned decode steps never
        grow the pool (a compiled graph keeps its address). Left padding takes no slot. One allocation: the
        prefill's own reservation then finds its blocks free. Fresh rows (the first forward of a call) are sized
        where their prompts are known, in ``_start_rows``: rows with the same prompt (generate's copies for
        ``num_return_sequences`` and beams) share its full blocks (``_fresh_rows_blocks``).
        """
        if self._max_num_blocks is None:
            return
        batch_size, query_len = shape
        if not self._rows:
            self._presize_left = max(0, self._max_cache_len - self._num_columns - query_len)
            return
        if mask is not None and mask.dim() == 2 and mask.shape[1] >= query_len:
            new_real = mask[:, -query_len:].to("cpu", torch.bool).numpy().sum(axis=1)
        else:
            new_real = np.full(batch_size, query_len)
        rows = self._rows
        past_real = [rows[b * len(rows) // batch_size].num_computed if rows else 0 for b in range(batch_size)]
        left = max(0, self._max_cache_len - self._num_columns - query_len)
        target = sum(-(-(int(p) + int(n) + left) // self.block_size) for p, n in zip(past_real, new_real, strict=True))
        self._defer_growth(target, batch_size)

    def _fresh_rows_blocks(self, prompt_lens: list[int], copies: list[int], left: int) -> int:
        """The most blocks fresh rows can hold up to ``left`` more tokens each: ``copies[d]`` rows share prompt d
        (``prompt_lens[d]`` real tokens), whose full blocks they share for life (a full block is never written
        again), while each row's partial prompt block (copied when first written) and later blocks are its own.
        Beams keep the bound: a reorder only re-shares blocks, and each beam still owns at most its own tail."""
        bs = self.block_size
        return sum(n // bs + k * (-(-(n + left) // bs) - n // bs) for n, k in zip(prompt_lens, copies, strict=True))

    def _defer_growth(self, target: int, batch_size: int) -> None:
        """Record that the planned steps of this call need ``target`` blocks (``_presize``), or raise at once if the
        cap is lower. The pool grows to it at the first planned step (``_grow_for_planned_steps``), not before the
        prefill: the prefill's activations then coexist with its own blocks only, not with every decode step's
        (StaticCache allocates max_cache_len slots a row before its prefill's attention)."""
        if target > self._max_num_blocks:
            raise MemoryError(
                f"PagedCache needs {target} blocks of {self.block_size} tokens for {batch_size} rows to reach "
                f"max_cache_len={self._max_cache_len} columns, over the {self._max_num_blocks} blocks that "
                "memory_fraction allows; pass a smaller max_cache_len= or a larger memory_fraction= (or num_blocks=)"
            )
        self._grow_target = max(target, self._grow_target or 0)

    def _grow_for_planned_steps(self) -> None:
        """Grow the pool in one allocation (a copy of the prefill's blocks, one layer's tensor at a time) to what the
        call's planned steps need, before the first of them: a compiled graph keeps the pool's address after."""
        target, self._grow_target = self._grow_target, None
        if target is not None and target > self.pool.num_blocks:
            self.kv.grow(target)
            self.pool.grow(target - self.pool.num_blocks)
            if self.kv.k_cache[0].is_cuda:
                torch.cuda.empty_cache()

    def _static_buffers(self, batch_size: int) -> "_StaticStep":
        """The planned steps' device buffers for ``batch_size`` rows (made once per batch size; the compiled graph
        reads them by address), with the pools marked as static inputs of the compiled graph."""
        device = self.kv.k_cache[0].device
        if self._static is None or self._static.batch_size != batch_size or self._static.device != device:
            max_blocks_per_seq = -(-self._max_cache_len // self.block_size)
            self._static = _StaticStep(batch_size, max_blocks_per_seq, self.block_size, device, owner=self)
        if self._marked_pool is not self.kv.k_cache[0]:  # new pool tensors (first use, or grown at a prefill)
            for t in (*self.kv.k_cache, *self.kv.v_cache):
                torch._dynamo.mark_static_address(t)
            self._marked_pool = self.kv.k_cache[0]
        return self._static

    # ---- rows ------------------------------------------------------------------------------------

    def _start_rows(
        self,
        input_ids: np.ndarray | None,
        mask: np.ndarray | None,
        shape=None,
        skip_cached: bool = False,
        allow_empty: bool = False,
    ) -> None:
        """Create one pool sequence per batch row for its prompt; identical rows fork the first one.

        Args:
            input_ids: [batch_size, length] prompt ids, or None for inputs_embeds (then ``shape`` is given).
            mask: [batch_size, length] bool, True for real tokens; None = no padding.
            skip_cached: start each row after its cached prefix (prepare()); otherwise the coming forward
                computes every column and only skips writing the shared cached blocks.
            allow_empty: a row without a real token gets no blocks yet and starts at its first real token
                (generate's chunked prefill: ``prefill_chunk_size`` below a row's left padding). Otherwise an error.
        """
        if input_ids is not None:
            shape = tuple(input_ids.shape[:2])
        batch_size, length = shape
        if self._max_num_blocks is not None:  # a growing pool: room for every distinct prompt at once
            num_tokens = mask.sum(axis=1) if mask is not None else np.full(batch_size, length)
            distinct: dict = {}  # prompt (or row, without ids) -> [real tokens, rows with it]
            for b in range(batch_size):
                n = int(num_tokens[b])
                # Keyed as the rows below fork: by prompt; a row without ids or without a real token starts alone.
                key = (
                    b
                    if input_ids is None or not n
                    else tuple(input_ids[b][mask[b]] if mask is not None else input_ids[b])
                )
                distinct.setdefault(key, [n, 0])[1] += 1
            left, self._presize_left = self._presize_left, None
            if left is not None:  # planned decode steps follow (max_cache_len): their size, grown at the first one
                lens, copies = zip(*distinct.values(), strict=True)
                self._defer_growth(self._fresh_rows_blocks(list(lens), list(copies), left), batch_size)
            self._reserve(sum(-(-n // self.block_size) for n, _ in distinct.values()))
        first_of: dict[tuple, _Row] = {}
        rows: list[_Row] = []
        for b in range(batch_size):
            cols = np.flatnonzero(mask[b]) if mask is not None else np.arange(length)
            seq_id = next(self._seq_ids)
            # Embeddings: no ids to hash; a unique key keeps them out of the index.
            extra_key = ("embeds", seq_id) if input_ids is None else None
            if not len(cols):
                if allow_empty:
                    rows.append(_Row(seq_id, [], num_computed=0, write_from=0, extra_key=extra_key))
                    continue
                self._free_rows(rows)
                raise ValueError(f"batch row {b} has no real token (its attention_mask is all zeros)")
            tokens = [0] * len(cols) if input_ids is None else input_ids[b, cols].tolist()
            parent = first_of.get((tuple(tokens), extra_key))
            if parent is not None:
                self.pool.fork(parent.seq_id, seq_id)
                # The parent writes the shared prompt; this row only reads it.
                rows.append(_Row(seq_id, tokens, num_computed=parent.num_computed, write_from=len(tokens)))
                continue
            row = _Row(seq_id, [], num_computed=0, write_from=0, extra_key=extra_key)
            if not self._allocate_row(row, tokens):
                self._free_rows(rows)
                self._raise_out_of_blocks(batch_size, length)
            if skip_cached:
                row.num_computed = row.write_from
            first_of[(tuple(tokens), extra_key)] = row
            rows.append(row)
        self._rows = rows
        self._tables = None

    def _allocate_row(self, row: "_Row", tokens: list[int]) -> bool:
        """Give a row without blocks those of its first ``tokens`` (a prefix hit is not written again).

        Returns:
            False if the pool is out of blocks (nothing changed).
        """
        result = self.pool.allocate(row.seq_id, tokens, row.extra_key)
        if result is None:
            return False
        row.token_ids = tokens
        row.write_from = result.num_cached_tokens
        return True

    def _free_rows(self, rows) -> None:
        for row in rows:
            if row.token_ids:  # a row without tokens has no blocks
                self.pool.free(row.seq_id)

    def _remap_rows(self, sources: list[int]) -> None:
        """New row i continues old row sources[i]: no KV is copied (beam search reorders rows every step).

        The first new row that continues an old row takes it over as it is; each further one forks it; old rows
        that no new row continues are freed. The kept block tables are reordered the same way (a fork's table is its
        source's), so the next decode step still takes the hot path.
        """
        self._finish_planned_step()
        if len(sources) and (min(sources) < 0 or max(sources) >= len(self._rows)):
            raise ValueError(f"row indices must be in [0, {len(self._rows)}), got {sources}")
        old_rows = self._rows
        taken = [False] * len(old_rows)
        new_rows = []
        for src in sources:
            old = old_rows[src]
            if not taken[src]:
                taken[src] = True
                new_rows.append(old)
                continue
            seq_id = next(self._seq_ids)
            extra_key = old.extra_key
            if old.token_ids:
                self.pool.fork(old.seq_id, seq_id)
            elif extra_key is not None:  # an embeddings row not started yet: its copy gets a key of its own
                extra_key = ("embeds", seq_id)
            new_rows.append(_Row(seq_id, list(old.token_ids), old.num_computed, old.write_from, extra_key))
        self._free_rows([row for row, is_taken in zip(old_rows, taken, strict=True) if not is_taken])
        self._rows = new_rows
        if self._tables is not None:
            self._tables = self._tables[np.asarray(sources, dtype=np.int64)] if len(sources) else None

    def _reserve(self, num_blocks: int) -> None:
        """Grow a growing pool (``num_blocks=None``) until ``num_blocks`` blocks are free, as far as its cap allows.

        Grows by the shortfall, and by at least 1/16 of the pool so that decode steps grow it rarely (every row
        opening a block at once costs one growth per several block boundaries); never past the cap. A fixed pool,
        or a cap reached, leaves it short: the allocation that follows then fails and names the numbers.
        """
        short = num_blocks - self.pool.num_free_blocks
        if short <= 0 or self._max_num_blocks is None or self.pool.num_blocks >= self._max_num_blocks:
            return
        if self._pool_frozen:
            raise MemoryError(
                f"PagedCache's pool ({self.pool.num_blocks} blocks of {self.block_size} tokens, "
                f"{self.pool.num_free_blocks} free) was sized before the first planned step for every row to reach "
                f"max_cache_len={self._max_cache_len} columns, and a planned (compiled) decode step cannot grow it: "
                f"it needs {short} more. Pass a larger max_cache_len= or num_blocks= to PagedCache"
            )
        new_num_blocks = min(self._max_num_blocks, self.pool.num_blocks + max(short, -(-self.pool.num_blocks // 16)))
        self.kv.grow(new_num_blocks)
        self.pool.grow(new_num_blocks - self.pool.num_blocks)
        if self.kv.k_cache[0].is_cuda:  # hand the old, smaller pools back: reserved memory stays near allocated
            torch.cuda.empty_cache()

    def _raise_out_of_blocks(self, batch_size: int, length: int):
        need = batch_size * math.ceil((self._num_columns + length) / self.block_size)
        grown = "" if self._max_num_blocks is None else f", grown to its cap of {self._max_num_blocks}"
        raise MemoryError(
            f"PagedCache is out of KV blocks: a batch of {batch_size} rows at {self._num_columns + length} tokens "
            f"needs up to {need} blocks of {self.block_size} tokens, the pool has {self.pool.num_blocks}{grown} "
            f"({self.pool.num_free_blocks} free). Pass a larger num_blocks= (or memory_fraction=) to PagedCache"
        )


@dataclass
class _Row:
    """One batch row: a pool sequence and the token ids it holds (the pool keeps counts, not ids).

    Invariants: ``len(token_ids) == pool.num_tokens(seq_id)``, and the pool has no ``seq_id`` while
    ``token_ids`` is empty (a row whose prompt so far was padding); ``num_computed <= len(token_ids)``.
    """

    seq_id: int
    token_ids: list[int]  # the row's real prompt tokens, then every token appended since; owned by this row
    num_computed: int  # tokens of this row whose K/V are in the pool (or will be, this forward)
    write_from: int  # positions below this are shared blocks written by someone else: never written here
    extra_key: object = None


class _StaticStep:
    """The device buffers of planned decode steps: one static ForwardContext, the step's token ids, the mask marker.

    A compiled (CUDA-graph) forward reads them by address, so they are written in place: each step copies its
    slots and lengths (and its block tables when a row's changed) from pinned host staging, without a sync.
    """

    def __init__(self, batch_size: int, max_blocks_per_seq: int, block_size: int, device: torch.device, owner):
        self.batch_size = batch_size
        self.device = device
        self.ctx = ForwardContext(
            slot_mapping=torch.zeros(batch_size, dtype=torch.int64, device=device),  # [batch_size]
            block_tables=torch.zeros(batch_size, max_blocks_per_seq, dtype=torch.int32, device=device),
            seq_lens=torch.ones(batch_size, dtype=torch.int32, device=device),  # [batch_size]
            cu_seqlens_q=torch.arange(batch_size + 1, dtype=torch.int32, device=device),  # [batch_size + 1]
            max_query_len=1,
            max_seq_len=max_blocks_per_seq * block_size,  # a static bound: it only sizes the decode kernel's grid
            batch_size=batch_size,
            query_len=1,
            paged=True,
            owner=owner,
        )
        self.step_ids = torch.zeros(batch_size, dtype=torch.int64, device=device)  # [batch_size], written by forward
        # [batch_size, 1, 1, 1] bool: a 4D mask makes transformers skip its mask code inside the forward.
        self.mask = torch.ones(batch_size, 1, 1, 1, dtype=torch.bool, device=device)
        for t in (self.ctx.slot_mapping, self.ctx.block_tables, self.ctx.seq_lens, self.ctx.cu_seqlens_q):
            torch._dynamo.mark_static_address(t)
        torch._dynamo.mark_static_address(self.step_ids)
        pin = device.type == "cuda"
        self._host_slots = torch.zeros(batch_size, dtype=torch.int64, pin_memory=pin)
        self._host_seq_lens = torch.zeros(batch_size, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros(batch_size, max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self._copied = None  # CUDA event after the last copies from staging
        self.tables_src: np.ndarray | None = None  # the host tables last copied (the cache's _tables array)

    def write(self, slots: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray, copy_tables: bool) -> None:
        """Copy a step's plan into the buffers (non-blocking on CUDA; staging is reused once the last copy ran)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies (long done: generate syncs every step)
        width = tables.shape[1]
        if width > self._host_tables.shape[1]:
            raise RuntimeError(
                f"bug in hf_paged: a block table of {width} blocks, over the static width {self._host_tables.shape[1]}"
            )
        self._host_slots.numpy()[:] = slots
        self._host_seq_lens.numpy()[:] = seq_lens
        non_blocking = self.device.type == "cuda"
        self.ctx.slot_mapping.copy_(self._host_slots, non_blocking=non_blocking)
        self.ctx.seq_lens.copy_(self._host_seq_lens, non_blocking=non_blocking)
        if copy_tables:
            host = self._host_tables.numpy()
            host[:, :width] = tables
            host[:, width:] = 0
            self.ctx.block_tables.copy_(self._host_tables, non_blocking=non_blocking)
            self.tables_src = tables
        if non_blocking:
            self._copied = torch.cuda.Event()
            self._copied.record()


def _gather(cache: torch.Tensor, gather_idx: torch.Tensor) -> torch.Tensor:
    """[batch_size, num_kv_heads, kv_len, head_dim] contiguous K or V; padding columns are zero."""
    flat = cache.view(-1, cache.shape[2], cache.shape[3])  # [num_slots, num_kv_heads, head_dim]
    out = flat[gather_idx.clamp(min=0)]  # [batch_size, kv_len, num_kv_heads, head_dim]
    out = out.masked_fill((gather_idx < 0)[:, :, None, None], 0)
    return out.transpose(1, 2)


# ---- forward hooks -------------------------------------------------------------------------------

_HOOKED = "_hf_paged_hooks"


def _install_hooks(model: torch.nn.Module) -> None:
    """Hook the decoder (the module that receives the cache and the 2D mask) once per model, and give the model the
    ``create_masks_for_generate`` through which generate's eager input preparation plans decode steps ahead."""
    decoder = getattr(model, "base_model", model)
    if getattr(decoder, _HOOKED, False):
        return
    decoder.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    decoder.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)
    setattr(decoder, _HOOKED, True)
    # generate calls getattr(model, "create_masks_for_generate", <transformers' function>) for compileable caches;
    # models may define their own, which every other cache keeps using.
    model.create_masks_for_generate = functools.partial(
        _create_masks_for_generate, getattr(model, "create_masks_for_generate", None)
    )


def _create_masks_for_generate(model_function, **kwargs):
    """generate's mask step (eager, before each forward) for a compileable PagedCache: plan the step ahead.

    A decode step gets a 4D marker mask (transformers then builds no mask inside the forward) and is planned into
    the cache's static buffers; any other forward gets generate's 2D mask unchanged, and the decoder hook plans it.
    Other caches get the model's or transformers' own mask function.
    """
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if not isinstance(cache, PagedCache) or not cache.is_compileable:
        if model_function is not None:
            return model_function(**kwargs)
        from transformers.masking_utils import create_masks_for_generate

        return create_masks_for_generate(**kwargs)
    mask = kwargs.get("attention_mask")
    marker = cache._plan_ahead(tuple(kwargs["inputs_embeds"].shape[:2]), mask, kwargs.get("position_ids"))
    return mask if marker is None else marker


def _find_cache(args, kwargs) -> "PagedCache | None":
    for name in ("cache", "past_key_values"):
        value = kwargs.get(name)
        if isinstance(value, PagedCache):
            return value
    for value in args:
        if isinstance(value, PagedCache):
            return value
    return None


def _pre_forward(module, args, kwargs):
    """Before the decoder's forward: a planned step hands its static context down (traceable, no host code);
    any other forward is planned here, eagerly."""
    cache = _find_cache(args, kwargs)
    if cache is None:
        return None
    if cache._planned:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        batch_size = cache._static.batch_size
        if input_ids is None or tuple(input_ids.shape) != (batch_size, 1):
            got = "no input_ids" if input_ids is None else f"input_ids of shape {tuple(input_ids.shape)}"
            raise ValueError(
                f"PagedCache planned a decode step of {batch_size} rows x 1 token (generate's mask step), but the "
                f"forward got {got}; a planned step needs input_ids of shape ({batch_size}, 1)"
            )
        cache._static.step_ids.copy_(input_ids.reshape(-1))  # read back by _finish_planned_step
        if not torch.compiler.is_compiling():  # generate runs this step eagerly (beam search, no compile)
            _begin_eager_planned_forward(module, cache)
            return None
        return args, {**kwargs, PLANNED_CONTEXT_KWARG: cache._static.ctx}
    _plan_forward(module, cache, args, kwargs)
    return None


def _begin_eager_planned_forward(module, cache: "PagedCache") -> None:
    """A planned decode step whose forward runs eagerly: hand the layers an eager decode context over the static
    buffers (the K/V write deferred to the attention's decode launch, splits for the real longest row)."""
    static = cache._static.ctx
    ctx = ForwardContext(
        slot_mapping=static.slot_mapping,
        block_tables=static.block_tables,
        seq_lens=static.seq_lens,
        cu_seqlens_q=static.cu_seqlens_q,
        max_query_len=1,
        max_seq_len=cache._planned_max_seq_len,
        batch_size=static.batch_size,
        query_len=1,
        paged=True,
        owner=cache,
        defer_kv_write=True,
    )
    cache._planned_eager = True
    module._hf_paged_token = set_forward_context(ctx)


def _end_eager_planned_forward(module) -> None:
    token = getattr(module, "_hf_paged_token", None)
    if token is not None:
        ctx = get_forward_context()
        if ctx is not None:
            ctx.flush_pending_kv()  # a deferred K/V write no attention took (not expected): keep the cache whole
        module._hf_paged_token = None
        reset_forward_context(token)


@torch.compiler.disable  # host planning: under torch.compile a graph break (a planned step never gets here)
def _plan_forward(module, cache: "PagedCache", args, kwargs) -> None:
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    if input_ids is not None:
        shape = tuple(input_ids.shape[:2])
    elif embeds is not None:
        shape = tuple(embeds.shape[:2])
    else:
        raise ValueError("PagedCache needs input_ids or inputs_embeds in the forward call")
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    position_ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    ctx = cache._begin_forward(
        input_ids, shape, mask, position_ids if isinstance(position_ids, torch.Tensor) else None
    )
    module._hf_paged_token = set_forward_context(ctx)


def _post_forward(module, args, kwargs, output):
    cache = _find_cache(args, kwargs)
    if cache is None:  # another cache (e.g. a compiled StaticCache forward of the same model): nothing to do
        return None
    if cache._planned:  # traceable: the step's bookkeeping was done when it was planned
        cache._planned = False
        cache._planned_failed = output is None  # torch passes no output when the forward raised
        if cache._planned_eager:  # never while compiling: the pre-hook sets it only outside a compile
            cache._planned_eager = False
            _end_eager_planned_forward(module)
        return None
    _end_hooked_forward(module, cache, output)
    return None


@torch.compiler.disable
def _end_hooked_forward(module, cache: "PagedCache", output) -> None:
    token = getattr(module, "_hf_paged_token", None)
    if token is None:
        return
    module._hf_paged_token = None
    reset_forward_context(token)
    cache._end_forward(completed=output is not None)  # torch passes no output when the forward raised
