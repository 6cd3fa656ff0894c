"""KVManager: the engine's one path to the block pool, and the record of what changed in the block tables.

The scheduler decides; the KV manager turns each decision into block-pool calls (allocate, append slots,
enter computed blocks into the prefix index, fork, free, swap slots) and records every block-table change
as a diff ``(seq_id, first table index, block ids)`` — ``block ids = None`` when the sequence was freed —
so the runner can keep its own copy of the tables without reading the pool. Nothing else in the engine
calls a mutating method of ``BlockPool`` (tests check it).

Pure Python (no torch), like the pool under it.
"""

from hf_paged.core.block_pool import AllocationResult, BlockPool
from hf_paged.engine.request import Sequence

BlockUpdate = tuple[int, int, list[int] | None]  # (seq_id, first table index, block ids); None = freed


class SwapSpace:
    """CPU block slots for swapped-out sequences (the bookkeeping; the runner owns the tensors)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give_back(self, slots) -> None:
        self._free.extend(slots)


class KVManager:
    """Blocks and swap slots of the engine's sequences.

    Args:
        pool: the block pool (the manager is its only mutator).
        num_swap_slots: CPU blocks for preemption by swapping (0: no swapping).
    """

    def __init__(self, pool: BlockPool, num_swap_slots: int = 0):
        self.pool = pool
        self.block_size = pool.block_size
        self.swap = SwapSpace(num_swap_slots)
        self.num_swapped_out_blocks = 0
        self._updates: list[BlockUpdate] = []
        self._seq_ids: set[int] = set()  # sequences holding blocks

    # ---- queries ----------------------------------------------------------------------------------

    def has_blocks(self, seq: Sequence) -> bool:
        return self.pool.has_seq(seq.seq_id)

    def num_slots(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that have a slot in the pool."""
        return self.pool.num_tokens(seq.seq_id)

    def drain_updates(self) -> list[BlockUpdate]:
        """The block-table diffs since the last call, in order."""
        updates, self._updates = self._updates, []
        return updates

    # ---- mutators ---------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, find_cached: bool = True) -> AllocationResult | None:
        """Blocks for all of ``seq``'s tokens (prefix-cache hits reused unless not ``find_cached``); None if the
        pool is short."""
        self._seq_ids.add(seq.seq_id)  # first: an interrupt right after the pool call must not lose the blocks
        result = self.pool.allocate(seq.seq_id, seq.token_ids, num_tokens_to_cache=0, find_cached=find_cached)
        if result is None:
            self._seq_ids.discard(seq.seq_id)
        else:
            seq.num_hashed_blocks = result.num_cached_tokens // self.block_size  # the prefix hits
            self._updates.append((seq.seq_id, 0, result.block_table))
        return result

    def append_slots(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]] | None:
        """Make the first ``num_tokens`` tokens of ``seq`` have slots; the copy-on-write pairs, or None if short."""
        pool, seq_id = self.pool, seq.seq_id
        have = pool.num_tokens(seq_id)
        if num_tokens <= have:
            return []
        pairs = pool.append(seq_id, num_tokens - have)
        if pairs is None:
            return None
        bs = self.block_size
        old_len = -(-have // bs)
        if pairs or -(-num_tokens // bs) > old_len:  # the table changed (most steps: it did not)
            first = old_len - 1 if pairs else old_len  # copy-on-write replaced the last block
            self._updates.append((seq_id, first, pool.get_block_table(seq_id)[first:]))
        return pairs

    def cache(self, seq: Sequence, num_tokens: int) -> None:
        """Enter ``seq``'s full blocks within its first ``num_tokens`` tokens into the prefix index.

        Called when those tokens are scheduled: a block is indexed once the forward that computes it is queued
        (a request that hits it in a later step reads it after that forward on the device's stream).
        """
        num_tokens = min(num_tokens, seq.num_known_tokens)
        if num_tokens // self.block_size > seq.num_hashed_blocks:  # a block filled up: O(1) on most steps
            self.pool.cache_blocks(seq.seq_id, seq.token_ids, num_tokens)
            seq.num_hashed_blocks = num_tokens // self.block_size

    def cache_all(self, seqs: list[Sequence]) -> None:
        """``cache(seq, len(seq.token_ids))`` for each of ``seqs`` in order (a step's decode rows), in one loop."""
        bs = self.block_size
        for seq in seqs:
            num_tokens = len(seq.token_ids) - seq.num_inflight  # seq.num_known_tokens
            if num_tokens // bs > seq.num_hashed_blocks:
                self.pool.cache_blocks(seq.seq_id, seq.token_ids, num_tokens)
                seq.num_hashed_blocks = num_tokens // bs

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (ref += 1); a shared partial block is copied when written."""
        self._seq_ids.add(child.seq_id)
        self.pool.fork(parent.seq_id, child.seq_id)
        self._updates.append((child.seq_id, 0, self.pool.get_block_table(child.seq_id)))

    def free(self, seq: Sequence) -> None:
        """Give ``seq``'s blocks back (no-op if it holds none)."""
        self._free_id(seq.seq_id)

    def free_all(self) -> None:
        """Give back every sequence's blocks (error recovery: nothing is left half-scheduled)."""
        for seq_id in sorted(self._seq_ids):
            self._free_id(seq_id)

    def _free_id(self, seq_id: int) -> None:
        if self.pool.has_seq(seq_id):
            self.pool.free(seq_id)
            self._updates.append((seq_id, 0, None))
        self._seq_ids.discard(seq_id)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ---- swapping ---------------------------------------------------------------------------------

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """Whether the swap space holds the computed blocks of ``seqs`` (a shared block counts once)."""
        needed = set()
        for seq in seqs:
            needed.update(self._computed_blocks(seq))
        return len(needed) <= self.swap.num_free

    def swap_out(self, seqs: list[Sequence], unfilled: dict[int, int] | None = None) -> list[tuple[int, int]]:
        """Give each sequence CPU slots for its computed blocks (shared blocks once); the (block, slot) copies.

        Args:
            seqs: the sequences of one request; they keep their blocks (the caller frees them afterwards).
            unfilled: copy-on-write destination -> source for copies that will not run: the source is saved.
        """
        slot_of: dict[int, int] = {}
        copies = []
        for seq in seqs:
            seq.swap_table = []
            for block in self._computed_blocks(seq):
                block = (unfilled or {}).get(block, block)
                if block not in slot_of:
                    slot_of[block] = self.swap.take()
                    copies.append((block, slot_of[block]))
                    self.num_swapped_out_blocks += 1
                seq.swap_table.append(slot_of[block])
        return copies

    def swap_in_pairs(self, seq: Sequence, result: AllocationResult) -> list[tuple[int, int]]:
        """(CPU slot, block) copies that bring ``seq``'s swapped blocks back, past its prefix-cache hits."""
        num_blocks = len(seq.swap_table)
        hit_blocks = result.num_cached_tokens // self.block_size
        return [(seq.swap_table[i], result.block_table[i]) for i in range(hit_blocks, num_blocks)]

    def release_swap_slots(self, seqs: list[Sequence]) -> None:
        """Give back the CPU slots of swapped sequences (siblings share slots: each is given back once)."""
        slots = set()
        for seq in seqs:
            if seq.swap_table is not None:
                slots.update(seq.swap_table)
                seq.swap_table = None
        self.swap.give_back(slots)

    def _computed_blocks(self, seq: Sequence) -> list[int]:
        return self.pool.get_block_table(seq.seq_id)[: -(-seq.num_computed // self.block_size)]
