"""Eager planning of a PagedCache forward: the rows' new tokens get slots, and the step gets its ForwardContext.

Owns the plan of every forward that the decoder hook plans on the host (prefills, chunked prefill, verification
forwards, eager decode steps): checks that the forward continues the rows, gives the rows' real new tokens their
blocks and slots (``slot_mapping``, hf_paged.core.planner), copies shared blocks that are written (copy-on-write),
and builds the step's ForwardContext. ``_plan_decode`` is the decode step's host work, shared with the compiled
planner (``compiled``), which calls it ahead of the forward.
"""

import numpy as np
import torch

from hf_paged.cache.rows import Row
from hf_paged.core.context import ForwardContext
from hf_paged.core.planner import slot_mapping
from hf_paged.core.transfer import to_device

PLACEHOLDER_ID = -1  # a planned step's token id until the forward has run (the pool rejects hashing it)


class ForwardPlanner:
    """Forward planning of PagedCache (a mixin over the cache's rows, ``RowBook``; state in ``PagedCache.__init__``).

    A forward's plan, in order: check it continues the rows; start rows for a first forward; reserve pool
    growth; give each row's new tokens blocks (copy-on-write pairs copied in every layer); slots and lengths;
    the ForwardContext. A decode step where every row appends one token takes ``_begin_decode`` instead (the
    same plan with less host work). ``_end_forward`` commits the columns once the forward has run.
    """

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
            kv_scales=self.kv.kv_scales,
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
            kv_scales=self.kv.kv_scales,
            defer_kv_write=True,
        )
        return self._ctx

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
            token_ids = [PLACEHOLDER_ID] * len(rows)
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

    def _check_positions(self, rows: list[Row], position_ids: torch.Tensor | None, real: np.ndarray) -> None:
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

    def _check_prepared_tokens(self, rows: list[Row], ids: np.ndarray, real: np.ndarray) -> None:
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
