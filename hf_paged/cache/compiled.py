"""Compiled generate: PagedCache's decode steps planned ahead, into static device buffers.

With ``max_cache_len`` and "paged" attention on one device the cache is compileable, and transformers compiles
the model's call for its decode steps (CUDA graphs on CUDA), as for StaticCache. Before each forward generate's
eager input preparation calls the model's ``create_masks_for_generate``, which the cache's hooks replace (for
PagedCache only) with ``_plan_ahead``: a decode step is planned there in full (blocks, copy-on-write copies, slots,
lengths and block tables copied without a sync into the static buffers of ``StaticStep``, of fixed shapes
[batch] and [batch, ceil(max_cache_len / block_size)]) and gets a 4D marker mask, so transformers builds no mask
inside the forward. The forward then runs no host code: the decoder hook copies the step's token ids to a device
buffer and hands the static context to the attention as a forward kwarg; ``update`` writes at the static slots.
The token ids come back to the host at the next host call (``_finish_planned_step``), when the blocks they filled
enter the prefix index.

The pool tensors must keep their address between compiled steps. A growing pool holds only the prefill's blocks
during the prefill (its activations never meet the decode steps' blocks), then grows once, before the first
planned step, for every row's real tokens up to max_cache_len columns (left padding takes no slot; generate's
copies of one prompt count its full blocks once); a planned step never grows it.

A planned step whose forward runs eagerly (beam search, or generate without a compile) reads the same static
buffers through the eager decode path: the static path's separate write and max_cache_len-wide split cost host
time per layer that only a compiled graph hides. Forwards not planned ahead (prefills, verification forwards,
chunked prefill) are planned by the decoder hook as without max_cache_len.
"""

import numpy as np
import torch

from hf_paged.core.context import ForwardContext


class StaticStep:
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
            kv_scales=owner.kv.kv_scales,  # the pool's list: an FP8 pool's scales (kv_update and attention read them)
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


class PlannedSteps:
    """Decode steps planned ahead, for a compileable PagedCache (a mixin; state in ``PagedCache.__init__``).

    Per step: ``_plan_ahead`` (generate's mask step: the host plan, copied into ``_static``), the forward (the
    hooks, traced), ``_finish_planned_step`` (the next host call: the step's token ids back into the rows and the
    prefix index). Pool sizing for the call: ``_presize`` / ``_start_rows`` record the target, and
    ``_grow_for_planned_steps`` grows the pool once, before the first planned step.
    """

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

    def _static_buffers(self, batch_size: int) -> StaticStep:
        """The planned steps' device buffers for ``batch_size`` rows (made once per batch size; the compiled graph
        reads them by address), with the pools marked as static inputs of the compiled graph."""
        device = self.kv.k_cache[0].device
        if self._static is None or self._static.batch_size != batch_size or self._static.device != device:
            max_blocks_per_seq = -(-self._max_cache_len // self.block_size)
            self._static = StaticStep(batch_size, max_blocks_per_seq, self.block_size, device, owner=self)
        if self._marked_pool is not self.kv.k_cache[0]:  # new pool tensors (first use, or grown at a prefill)
            for t in self.kv.owned_tensors():  # shared layers' entries and V views are these tensors
                torch._dynamo.mark_static_address(t)
            self._marked_pool = self.kv.k_cache[0]
        return self._static
