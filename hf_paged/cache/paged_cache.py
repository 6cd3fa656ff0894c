"""PagedCache: a transformers ``Cache`` whose K/V live in the blocks of a preallocated pool.

    cache = PagedCache(model)                  # the pool grows with what the calls use; num_blocks=2048: fixed
    out = model.generate(**inputs, past_key_values=cache)
    cache = PagedCache(model, max_cache_len=prompt_len + max_new_tokens)  # compileable: generate compiles decode

Layout: every layer's K and V pools are [num_blocks, block_size, num_kv_heads, head_dim] with the layer's own shape; a
layer that shares another's K/V reads that layer's pools (hf_paged.core.kv_pool).
Each batch row of ``generate`` is a sequence of the block pool (hf_paged.core.block_pool); all layers share its
block table. Slots follow the slot formula of ``hf_paged.core.planner.slot_mapping`` (written there only):
``slot = block_id * block_size + offset``, ``slot < 0`` for padding, which takes no slot.

Each forward, in order (the decoder hooks, ``hooks``; the eager plan, ``planning``):

1. rows get blocks and slots for their real (non-padding) new tokens (``rows``, ``planning``);
2. copy-on-write pairs from the pool are copied in every layer;
3. the step metadata (hf_paged.core.context.ForwardContext) is made current for the forward;
4. each layer's ``update`` writes K/V at the slots (``kv_update``) and returns the pools (for
   ``attn_implementation="paged"``, whose kernels read the blocks) or contiguous K/V gathered through the block
   tables (any other implementation). An eager decode step with "paged" leaves the write to the attention's one
   decode launch (ForwardContext.defer_kv_write).

Eager vs compiled: without ``max_cache_len`` every forward is planned eagerly by the decoder hook. With it (and
"paged" attention on one device) ``is_compileable`` is True: generate compiles its decode steps, each planned
ahead into static device buffers (``compiled``); beam search and assisted generation run them eagerly.

Sharing: identical rows of the first forward (``num_return_sequences``, beams) store their prompt once (the
children fork the parent's blocks); ``reorder_cache`` (beam search) permutes block tables by ref count, and a
shared partial block is copied when next written. Full blocks enter a prefix index; ``cache.prepare(input_ids)``
before a new ``generate`` call attaches the cached prefix, and generate feeds only the new tokens. The pool
outlives calls; ``reset()`` frees the rows and keeps the prefix index. ``crop()`` rolls rows back (assisted
generation and prompt lookup drop rejected draft tokens with it).

Calls: a ``generate`` call on a cache that still holds rows continues them, as with a DynamicCache (its prompt
must extend every row). Any other new batch raises ValueError: call ``reset()`` or ``prepare()`` between calls.
"""

import itertools
import operator
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_paged.cache.compiled import PlannedSteps, StaticStep
from hf_paged.cache.hooks import install_hooks
from hf_paged.cache.kv_update import KVWriter
from hf_paged.cache.planning import ForwardPlanner
from hf_paged.cache.rows import Row, RowBook
from hf_paged.core.block_pool import BlockPool
from hf_paged.core.context import ForwardContext
from hf_paged.core.mla import use_paged_mla
from hf_paged.core.model_info import ModelInfo
from hf_paged.core.support import check_paged_attention_reached

_DEFAULT_MEMORY_FRACTION = 0.3


@dataclass
class MemoryReport:
    """What the pool holds now (the paper's Fig. 2 "token states" share and §6.3 sharing savings)."""

    num_blocks: int
    num_used_blocks: int
    num_used_slots: int  # slots holding live tokens (a shared block counts once)
    num_allocated_slots: int  # num_used_blocks * block_size
    num_table_entries: int  # blocks the rows would use without sharing
    kv_bytes_per_block: int
    kv_cache_dtype: str = "auto"  # as given to the cache ("auto": the model's dtype)
    kv_dtype: torch.dtype | None = None  # what the pool stores (an FP8 dtype holds twice bf16's tokens a byte)
    block_size: int = 0  # tokens per block

    @property
    def num_token_slots(self) -> int:
        """Tokens the pool holds at its current size (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

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
        dtype = str(self.kv_dtype).removeprefix("torch.")
        return (
            f"KV cache {self.kv_cache_dtype} ({dtype}), {self.num_token_slots} token slots "
            f"({self.kv_bytes_per_block // max(self.block_size, 1)} bytes a token); "
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


class PagedCache(RowBook, ForwardPlanner, PlannedSteps, KVWriter, Cache):
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
        kv_cache_dtype: what the pool stores: "auto" (default: the model's dtype), "fp8" / "fp8_e4m3"
            (float8_e4m3fn) or "fp8_e5m2" (float8_e5m2). FP8 takes one byte an element, so the same memory holds
            twice bf16's tokens; the K/V scales come from the attention modules' ``k_scale``/``v_scale`` where the
            checkpoint has them, else 1.0 (hf_paged.core.kv_dtype). With "sdpa"/"eager" attention the gathered K/V
            are dequantized to the model's dtype.
        max_cache_len: the most columns (prompt, its padding and new tokens, over every call the rows continue)
            a row may reach, as StaticCache's. Given, the cache is compileable (with ``attn_implementation="paged"``
            on one device): ``generate`` compiles its decode steps, each planned ahead into static buffers, and a
            growing pool is sized at each prefill for every row to reach it (hf_paged.cache.compiled). None
            (default): not compileable; the pool grows as the rows need blocks.

    Raises:
        ValueError: the model is not a decoder-only model of attention layers, or an argument is out of range
            (``kv_cache_dtype`` not one of "auto", "fp8", "fp8_e4m3", "fp8_e5m2", or FP8 for latent (MLA) layers).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int | None = None,
        block_size: int = 16,
        memory_fraction: float = _DEFAULT_MEMORY_FRACTION,
        enable_prefix_caching: bool = True,
        max_cache_len: int | None = None,
        kv_cache_dtype: str = "auto",
    ):
        if max_cache_len is not None and (
            isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1
        ):
            raise ValueError(f"`max_cache_len` must be a positive int or None, got {max_cache_len!r}")
        info = ModelInfo.from_model(model, kv_cache_dtype)
        use_paged_mla(model)  # latent-attention (MLA) layers page their latent, any attn_implementation
        if getattr(model.config, "_attn_implementation", None) == "paged":
            check_paged_attention_reached(model, info.num_layers)
        # A growing pool starts with one block (pools are never empty) and may grow to _max_num_blocks.
        self._max_num_blocks = info.num_blocks_for(None, block_size, memory_fraction) if num_blocks is None else None
        num_blocks = info.num_blocks_for(num_blocks, block_size, memory_fraction) if num_blocks is not None else 1
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.kv = info.make_kv_pool(num_blocks, block_size)
        self.block_size = block_size
        self.kv_bytes_per_block = info.bytes_per_block(block_size)
        self.kv_cache_dtype = kv_cache_dtype
        self._model_config = model.config
        layer_cache = weakref.proxy(self)  # layers -> cache without a reference cycle: the pool goes with the cache
        super().__init__(
            layers=[_PagedLayer(layer_cache, i, t == "sliding_attention") for i, t in enumerate(info.layer_types)]
        )
        self._seq_ids = itertools.count()
        self._rows: list[Row] = []  # one per batch row, in batch order
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
        # Decode steps planned ahead (compileable mode, hf_paged.cache.compiled).
        self._max_cache_len = max_cache_len
        self._static: StaticStep | None = None  # device buffers of planned steps, kept across steps and calls
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
        install_hooks(model)

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
        self.kv.copy_blocks(self._truncate_rows(keep))
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
        """The KV dtype and the tokens the pool holds, blocks used, token-state share of allocated slots and sharing
        savings, for the pool as it is now."""
        s = self.pool.stats
        return MemoryReport(
            num_blocks=s.num_blocks,
            num_used_blocks=s.num_used_blocks,
            num_used_slots=s.num_used_slots,
            num_allocated_slots=s.num_allocated_slots,
            num_table_entries=s.num_table_entries,
            kv_bytes_per_block=self.kv_bytes_per_block,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_dtype=self.kv.dtype,
            block_size=self.block_size,
        )
