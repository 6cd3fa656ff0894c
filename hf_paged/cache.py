"""PagedCache: a transformers ``Cache`` whose KV lives in the blocks of a preallocated pool.

    cache = PagedCache(model, num_blocks=2048)                  # or memory_fraction=... of free memory
    out = model.generate(**inputs, past_key_values=cache)

Each batch row of ``generate`` is a sequence of the block pool (hf_paged.block_pool); all layers share
its block table. A forward hook on the model's decoder plans every forward before it runs:

1. rows get slots for their real (non-padding) new tokens; padding takes no slot;
2. copy-on-write pairs from the pool are copied in every layer;
3. the step metadata (hf_paged.context.ForwardContext) is made current for the forward;
4. each layer's ``update`` writes K/V at the slots and returns either the block pools (for
   ``attn_implementation="paged"``, whose kernels read the blocks) or contiguous K/V gathered through
   the block tables (for "sdpa", "eager" or any other implementation: slower, but it works).

Sharing: identical rows of the first forward (``num_return_sequences``, beams) store their prompt once
(the children fork the parent's blocks); ``reorder_cache`` (beam search) permutes block tables by ref
count and copies at most one partial block per row when it is next written (copy-on-write). Full
blocks enter a prefix index: ``cache.prepare(input_ids)`` before a new ``generate`` call attaches the
cached prefix, and generate then feeds only the new tokens (it learns the cached length from
``get_seq_length``). The pool outlives calls; ``reset()`` frees the rows and keeps the prefix index.
"""

import itertools
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_paged.block_pool import BlockPool
from hf_paged.context import ForwardContext, get_forward_context, reset_forward_context, set_forward_context
from hf_paged.kernels import write_kv
from hf_paged.model_info import ModelInfo

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
        num_blocks: blocks in the pool. Default: ``memory_fraction`` of the free memory of the
            first layer's device.
        block_size: tokens per block, a positive multiple of 8.
        memory_fraction: share of free device memory for the pool when ``num_blocks`` is None.
        enable_prefix_caching: index full blocks by content hash so later prompts reuse them.

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
    ):
        info = ModelInfo.from_model(model)
        num_blocks = info.num_blocks_for(num_blocks, block_size, memory_fraction)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.kv = info.make_kv_pool(num_blocks, block_size)
        self.block_size = block_size
        self.kv_bytes_per_block = info.bytes_per_block(block_size)
        self._model_config = model.config
        super().__init__(
            layers=[_PagedLayer(self, i, t == "sliding_attention") for i, t in enumerate(info.layer_types)]
        )
        self._seq_ids = itertools.count()
        self._rows: list[_Row] = []  # one per batch row, in batch order
        self._num_columns = 0  # input columns seen per row (incl. padding): what generate calls the seq length
        self._pending_columns = 0
        self._ctx: ForwardContext | None = None
        self.peak_used_blocks = 0  # high-water mark of blocks in use, to size a pool for a workload
        _install_hooks(model)

    # ---- transformers Cache API ------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._num_columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._num_columns + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self._update_layer(key_states, value_states, layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: new row i continues old row beam_idx[i]. Block tables are forked, never copied."""
        self._remap_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._remap_rows([i for i in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap_rows(indices.tolist())

    def reset(self) -> None:
        """Free every row; the pool's prefix index keeps their full blocks for later prompts."""
        self._free_rows(self._rows)
        self._rows = []
        self._num_columns = 0

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("PagedCache does not support crop() (assisted decoding); use DynamicCache for it")

    # ---- hf_paged API ----------------------------------------------------------------------------

    def prepare(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> "PagedCache":
        """Start a new batch of prompts on this pool, reusing cached prefix blocks; returns ``self``.

        Frees the previous rows (their full blocks stay in the prefix index), gives each row its
        prompt's blocks, and sets the cached length that ``generate`` reads from ``get_seq_length`` so
        that only the uncached tokens go through the model::

            out = model.generate(**inputs, past_key_values=cache.prepare(**inputs))

        Rows with left padding are stored, but only a batch without padding skips its common cached
        prefix (generate skips the same number of columns in every row).

        Args:
            input_ids: [batch_size, prompt_len] prompt token ids, as passed to generate.
            attention_mask: [batch_size, prompt_len] 1 for tokens, 0 for padding; None = no padding.
        """
        self.reset()
        mask = attention_mask.to("cpu", torch.bool) if attention_mask is not None else None
        padded = mask is not None and not bool(mask.all())
        self._start_rows(input_ids, mask if padded else None, skip_cached=not padded)
        self._num_columns = min(row.num_computed for row in self._rows)
        for row in self._rows:
            row.num_computed = self._num_columns
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

    def _begin_forward(self, input_ids: torch.Tensor | None, shape: tuple[int, int], mask: torch.Tensor | None):
        """Plan one forward: slots for every row's real new tokens, CoW copies, the step metadata."""
        batch_size, query_len = shape
        if mask is not None:
            if mask.dim() != 2:
                raise ValueError(
                    f"PagedCache needs a 2D attention_mask [batch, length], got shape {tuple(mask.shape)}"
                )
            if mask.shape[1] != self._num_columns + query_len:
                raise ValueError(
                    f"attention_mask covers {mask.shape[1]} columns, expected past {self._num_columns} + new "
                    f"{query_len}; pass the mask of the whole sequence, as generate does"
                )
            mask = mask.to("cpu", torch.bool)
            if bool(mask.all()):
                mask = None
        ids_cpu = input_ids.to("cpu") if input_ids is not None else None
        if not self._rows:
            if self._num_columns:
                raise RuntimeError("bug in hf_paged: PagedCache has columns but no rows")
            self._start_rows(ids_cpu, mask, shape=shape)
        elif len(self._rows) != batch_size:
            raise ValueError(
                f"this PagedCache holds {len(self._rows)} rows but the forward has batch size {batch_size}; "
                "call cache.reset() or cache.prepare(...) before a new batch"
            )
        new_mask = mask[:, -query_len:] if mask is not None else None
        slot_mapping = torch.full((batch_size, query_len), -1, dtype=torch.int64)
        cow: list[tuple[int, int]] = []
        q_lens = []
        for b, row in enumerate(self._rows):
            cols = new_mask[b].nonzero().flatten().tolist() if new_mask is not None else range(query_len)
            num_new = len(cols)
            start = row.num_computed
            have = self.pool.num_tokens(row.seq_id)
            if start + num_new > have:  # tokens the pool has not seen yet: append them
                skip = have - start
                tokens = ids_cpu[b, list(cols)[skip:]].tolist() if ids_cpu is not None else [0] * (num_new - skip)
                pairs = self.pool.append(row.seq_id, tokens)
                if pairs is None:
                    self._raise_out_of_blocks(batch_size, query_len)
                cow.extend(pairs)
            table = self.pool.get_block_table(row.seq_id)
            bs = self.block_size
            for i, col in enumerate(cols):
                pos = start + i
                if pos >= row.write_from:
                    slot_mapping[b, col] = table[pos // bs] * bs + pos % bs
            row.num_computed = start + num_new
            q_lens.append(num_new)
        self.kv.copy_blocks(cow)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.stats.num_used_blocks)
        tables = [self.pool.get_block_table(row.seq_id) for row in self._rows]
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros((batch_size, max_blocks), dtype=torch.int32)
        for b, t in enumerate(tables):
            block_tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        seq_lens = [row.num_computed for row in self._rows]
        cu = [0, *itertools.accumulate(q_lens)]
        token_idx = None
        if new_mask is not None and not bool(new_mask.all()):
            token_idx = new_mask.flatten().nonzero().flatten()
        paged = getattr(self._model_config, "_attn_implementation", None) == "paged"
        gather_idx = None
        if not paged:
            gather_idx = self._gather_index(tables, mask, self._num_columns + query_len)
        device = self.kv.k_cache[0].device
        self._pending_columns = query_len
        self._ctx = ForwardContext(
            slot_mapping=slot_mapping.flatten().to(device),
            block_tables=block_tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(device),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            batch_size=batch_size,
            query_len=query_len,
            token_idx=token_idx.to(device) if token_idx is not None else None,
            gather_idx=gather_idx.to(device) if gather_idx is not None else None,
            paged=paged,
            owner=self,
        )
        return self._ctx

    def _end_forward(self) -> None:
        self._num_columns += self._pending_columns
        self._pending_columns = 0
        self._ctx = None

    def _update_layer(self, key_states, value_states, layer_idx: int):
        """Write this step's K/V into the layer's blocks; return what the attention implementation reads."""
        ctx = get_forward_context()
        if ctx is None or ctx.owner is not self:
            raise RuntimeError(
                "PagedCache.update() was called outside a forward it planned. PagedCache plans each forward "
                "through a hook on the model it was built with: pass it to that model's generate()/forward()"
            )
        k_cache, v_cache = self.kv.k_cache[layer_idx], self.kv.v_cache[layer_idx]
        ctx = ctx.on(k_cache.device)
        batch_size, num_kv_heads, query_len, head_dim = key_states.shape
        key = key_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        value = value_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        write_kv(key, value, k_cache, v_cache, ctx.slot_mapping)
        if ctx.paged:
            return k_cache, v_cache
        return _gather(k_cache, ctx.gather_idx), _gather(v_cache, ctx.gather_idx)

    # ---- rows ------------------------------------------------------------------------------------

    def _start_rows(self, input_ids, mask, shape=None, skip_cached: bool = False) -> None:
        """Create one pool sequence per batch row for its prompt; identical rows fork the first one.

        Args:
            input_ids: [batch_size, length] prompt ids, or None for inputs_embeds (then ``shape`` is given).
            mask: [batch_size, length] bool, True for real tokens; None = no padding.
            skip_cached: start each row after its cached prefix (prepare()); otherwise the coming forward
                computes every column and only skips writing the shared cached blocks.
        """
        if input_ids is not None:
            input_ids = input_ids.to("cpu")
            shape = tuple(input_ids.shape[:2])
        batch_size, length = shape
        first_of: dict[tuple, _Row] = {}
        rows: list[_Row] = []
        for b in range(batch_size):
            cols = mask[b].nonzero().flatten().tolist() if mask is not None else list(range(length))
            if not cols:
                self._free_rows(rows)
                raise ValueError(f"batch row {b} has no real token (its attention_mask is all zeros)")
            seq_id = next(self._seq_ids)
            if input_ids is None:  # embeddings: no ids to hash; a unique key keeps them out of the index
                tokens, extra_key = [0] * len(cols), ("embeds", seq_id)
            else:
                tokens, extra_key = input_ids[b, cols].tolist(), None
            parent = first_of.get((tuple(tokens), extra_key))
            if parent is not None:
                self.pool.fork(parent.seq_id, seq_id)
                # The parent writes the shared prompt; this row only reads it.
                rows.append(_Row(seq_id, num_computed=parent.num_computed, write_from=len(tokens)))
                continue
            result = self.pool.allocate(seq_id, tokens, extra_key)
            if result is None:
                self._free_rows(rows)
                self._raise_out_of_blocks(batch_size, length)
            cached = result.num_cached_tokens
            row = _Row(seq_id, num_computed=cached if skip_cached else 0, write_from=cached, extra_key=extra_key)
            first_of[(tuple(tokens), extra_key)] = row
            rows.append(row)
        self._rows = rows

    def _free_rows(self, rows) -> None:
        for row in rows:
            self.pool.free(row.seq_id)

    def _remap_rows(self, sources: list[int]) -> None:
        """New row i continues old row sources[i] (fork, then free the old rows): no KV is copied."""
        if len(sources) and (min(sources) < 0 or max(sources) >= len(self._rows)):
            raise ValueError(f"row indices must be in [0, {len(self._rows)}), got {sources}")
        new_rows = []
        for src in sources:
            old = self._rows[src]
            seq_id = next(self._seq_ids)
            self.pool.fork(old.seq_id, seq_id)
            new_rows.append(_Row(seq_id, old.num_computed, old.write_from, old.extra_key))
        for row in self._rows:
            self.pool.free(row.seq_id)
        self._rows = new_rows

    def _gather_index(self, tables: list[list[int]], mask: torch.Tensor | None, kv_len: int) -> torch.Tensor:
        """[batch_size, kv_len] slot of every key column transformers' mask addresses; -1 for padding."""
        bs = self.block_size
        if mask is None:
            pos = torch.arange(kv_len).expand(len(tables), kv_len)
        else:
            pos = mask.long().cumsum(-1) - 1
        max_blocks = max(len(t) for t in tables)
        table_t = torch.zeros((len(tables), max_blocks), dtype=torch.int64)
        for b, t in enumerate(tables):
            table_t[b, : len(t)] = torch.tensor(t)
        pos = pos.clamp(min=0)
        slots = table_t.gather(1, pos // bs) * bs + pos % bs
        if mask is not None:
            slots = slots.masked_fill(~mask, -1)
        return slots

    def _raise_out_of_blocks(self, batch_size: int, length: int):
        need = batch_size * math.ceil((self._num_columns + length) / self.block_size)
        raise MemoryError(
            f"PagedCache is out of KV blocks: a batch of {batch_size} rows at {self._num_columns + length} tokens "
            f"needs up to {need} blocks of {self.block_size} tokens, the pool has {self.pool.num_blocks} "
            f"({self.pool.num_free_blocks} free). Pass a larger num_blocks= (or memory_fraction=) to PagedCache"
        )


@dataclass
class _Row:
    seq_id: int
    num_computed: int  # tokens of this row whose K/V are in the pool (or will be, this forward)
    write_from: int  # positions below this are shared blocks written by someone else: never written here
    extra_key: object = None


def _gather(cache: torch.Tensor, gather_idx: torch.Tensor) -> torch.Tensor:
    """[batch_size, num_kv_heads, kv_len, head_dim] contiguous K or V; padding columns are zero."""
    flat = cache.view(-1, cache.shape[2], cache.shape[3])  # [num_slots, num_kv_heads, head_dim]
    out = flat[gather_idx.clamp(min=0)]  # [batch_size, kv_len, num_kv_heads, head_dim]
    out = out.masked_fill((gather_idx < 0)[:, :, None, None], 0)
    return out.transpose(1, 2)


# ---- forward hooks -------------------------------------------------------------------------------

_HOOKED = "_hf_paged_hooks"


def _install_hooks(model: torch.nn.Module) -> None:
    """Hook the decoder (the module that receives the cache and the 2D mask) once per model."""
    decoder = getattr(model, "base_model", model)
    if getattr(decoder, _HOOKED, False):
        return
    decoder.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    decoder.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)
    setattr(decoder, _HOOKED, True)


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
    cache = _find_cache(args, kwargs)
    if cache is None:
        return None
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    if input_ids is not None:
        shape = tuple(input_ids.shape[:2])
    elif embeds is not None:
        shape = tuple(embeds.shape[:2])
    else:
        raise ValueError("PagedCache needs input_ids or inputs_embeds in the forward call")
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    ctx = cache._begin_forward(input_ids, shape, mask)
    module._hf_paged_token = set_forward_context(ctx)
    return None


def _post_forward(module, args, kwargs, output):
    token = getattr(module, "_hf_paged_token", None)
    if token is None:
        return None
    module._hf_paged_token = None
    cache = _find_cache(args, kwargs)
    reset_forward_context(token)
    if cache is not None:
        cache._end_forward()
    return None
