"""The rows of a PagedCache: one block-pool sequence per batch row of ``generate``, and the pool's growth.

Owns which rows exist, the token ids each holds, their blocks over the BlockPool (allocate a prompt with its
prefix hit, fork identical prompts, remap for beam search, truncate for crop, free), the rows' block tables as
the last forward planned them, and growing a pool built without ``num_blocks``. The step planners
(``planning``, ``compiled``) call these; nothing here plans a forward.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Row:
    """One batch row: a pool sequence and the token ids it holds (the pool keeps counts, not ids).

    Invariants: ``len(token_ids) == pool.num_tokens(seq_id)``, and the pool has no ``seq_id`` while
    ``token_ids`` is empty (a row whose prompt so far was padding); ``num_computed <= len(token_ids)``.
    """

    seq_id: int
    token_ids: list[int]  # the row's real prompt tokens, then every token appended since; owned by this row
    num_computed: int  # tokens of this row whose K/V are in the pool (or will be, this forward)
    write_from: int  # positions below this are shared blocks written by someone else: never written here
    extra_key: object = None


class RowBook:
    """Row bookkeeping of PagedCache (a mixin: the state lives on the cache, declared in ``PagedCache.__init__``).

    Invariants: ``_rows`` is in batch order; ``_tables`` is None or has one row per entry of ``_rows``; the pool
    holds ``row.seq_id`` exactly while ``row.token_ids`` is non-empty.
    """

    def row_token_ids(self) -> list[list[int]]:
        """The token ids each row holds, in batch order: its real prompt tokens, then every token fed back.

        For tests and debugging. Brings a planned (compiled) step's token ids to the host first: a device sync.
        """
        self._finish_planned_step()
        return [list(row.token_ids) for row in self._rows]

    def row_block_tables(self) -> list[list[int]]:
        """Each row's block table (block ids in the pool), in batch order; for tests and debugging."""
        return [self.pool.get_block_table(row.seq_id) if row.token_ids else [] for row in self._rows]

    def check_invariants(self) -> None:
        """Assert the rows' invariants (see ``Row``) and the block pool's; for tests.

        Raises:
            AssertionError: an invariant is broken (a bug in hf_paged).
        """
        for b, row in enumerate(self._rows):
            held = self.pool.has_seq(row.seq_id)
            assert held == bool(row.token_ids), f"row {b}: pool holds its sequence: {held}, tokens {row.token_ids}"
            if held:
                assert self.pool.num_tokens(row.seq_id) == len(row.token_ids), f"row {b}: pool length != its tokens"
            assert 0 <= row.num_computed <= len(row.token_ids), f"row {b}: num_computed {row.num_computed}"
        held_ids = {row.seq_id for row in self._rows if row.token_ids}
        assert set(self.pool.get_seq_ids()) == held_ids, "the pool holds sequences of no row"
        self.pool.check_invariants()

    def _decode_ready(self) -> bool:
        """Whether every row can take one token the decode way (kept block tables, rows that hold tokens)."""
        rows = self._rows
        return self._tables is not None and len(self._tables) == len(rows) and all(row.token_ids for row in rows)

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

    def _expand_prepared_rows(self, num_copies: int) -> None:
        """Row b becomes rows b * num_copies ... (generate's repeat_interleave): the copies fork its blocks."""
        rows = []
        for row in self._rows:
            rows.append(row)
            for _ in range(num_copies - 1):
                seq_id = next(self._seq_ids)
                self.pool.fork(row.seq_id, seq_id)
                # The first copy writes the uncached prompt; the others only read it.
                rows.append(Row(seq_id, list(row.token_ids), row.num_computed, len(row.token_ids), row.extra_key))
        self._rows = rows
        self._tables = None

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

    def _block_tables(self) -> np.ndarray:
        """[batch_size, max_blocks_per_seq] int32: every row's block table, zero-padded."""
        tables = [self.pool.get_block_table(row.seq_id) if row.token_ids else [] for row in self._rows]
        block_tables = np.zeros((len(tables), max(1, *(len(t) for t in tables))), dtype=np.int32)
        for b, table in enumerate(tables):
            block_tables[b, : len(table)] = table
        return block_tables

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
        first_of: dict[tuple, Row] = {}
        rows: list[Row] = []
        for b in range(batch_size):
            cols = np.flatnonzero(mask[b]) if mask is not None else np.arange(length)
            seq_id = next(self._seq_ids)
            # Embeddings: no ids to hash; a unique key keeps them out of the index.
            extra_key = ("embeds", seq_id) if input_ids is None else None
            if not len(cols):
                if allow_empty:
                    rows.append(Row(seq_id, [], num_computed=0, write_from=0, extra_key=extra_key))
                    continue
                self._free_rows(rows)
                raise ValueError(f"batch row {b} has no real token (its attention_mask is all zeros)")
            tokens = [0] * len(cols) if input_ids is None else input_ids[b, cols].tolist()
            parent = first_of.get((tuple(tokens), extra_key))
            if parent is not None:
                self.pool.fork(parent.seq_id, seq_id)
                # The parent writes the shared prompt; this row only reads it.
                rows.append(Row(seq_id, tokens, num_computed=parent.num_computed, write_from=len(tokens)))
                continue
            row = Row(seq_id, [], num_computed=0, write_from=0, extra_key=extra_key)
            if not self._allocate_row(row, tokens):
                self._free_rows(rows)
                self._raise_out_of_blocks(batch_size, length)
            if skip_cached:
                row.num_computed = row.write_from
            first_of[(tuple(tokens), extra_key)] = row
            rows.append(row)
        self._rows = rows
        self._tables = None

    def _allocate_row(self, row: "Row", tokens: list[int]) -> bool:
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
            new_rows.append(Row(seq_id, list(old.token_ids), old.num_computed, old.write_from, extra_key))
        self._free_rows([row for row, is_taken in zip(old_rows, taken, strict=True) if not is_taken])
        self._rows = new_rows
        if self._tables is not None:
            self._tables = self._tables[np.asarray(sources, dtype=np.int64)] if len(sources) else None

    def _truncate_rows(self, keep: list[int]) -> list[tuple[int, int]]:
        """Row b keeps its first ``keep[b]`` tokens (crop); returns the copy-on-write pairs for the shared blocks cut
        inside, which the caller copies before any row writes again. The caller has reserved their blocks."""
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
        return cow

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
