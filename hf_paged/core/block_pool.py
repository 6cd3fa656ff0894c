"""Sequences' block tables over shared physical KV blocks: the block pool of PagedCache and the engine.

Pure Python (stdlib + xxhash, no torch), so the bookkeeping is property-tested on the CPU. The pool decides;
the caller executes: it writes K/V into the slots of the block tables it gets back and runs the
``(src, dst)`` block copies that copy-on-write asks for, in one batched call.

Tokens are the caller's: per sequence the pool keeps a ``SeqBlocks`` record, never token ids (the only ids it
holds are each indexed block's key, for the collision check), so there is nothing to reconcile with the
caller's list each step. ``allocate`` reads the prompt (prefix lookup,
hashing), ``append`` reserves slots by count, and ``cache_blocks`` reads the caller's token list to index
full blocks once their ids are known. Blocks, their free list and the prefix index: hf_paged.core.block_allocator.
"""

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from hf_paged.core.block import Block, BlockId, SeqBlocks
from hf_paged.core.block_allocator import BlockAllocator
from hf_paged.core.pool_args import check_num_new_tokens, check_num_tokens_to_keep, check_token_ids
from hf_paged.core.pool_stats import PoolStats
from hf_paged.core.prefix_hash import HASH_SEED, BlockHash, HashFn, hash_block_tokens

__all__ = [
    "BlockId", "BlockHash", "BlockPool", "HASH_SEED", "hash_block_tokens", "AllocationResult", "PoolStats",
]  # fmt: skip


@dataclass(frozen=True)
class AllocationResult:
    block_table: list[BlockId]  # [ceil(len(token_ids) / block_size)] block ids, a copy
    num_cached_tokens: int  # leading tokens served by the prefix cache: skip them; multiple of block_size


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots, shared by ref count. Ids are 0..num_blocks-1.

    Slot of token ``position`` of a sequence (computed by the caller's planner, not here):
    ``block_table[position // block_size] * block_size + position % block_size``. Running out of
    blocks is a return value (``None`` / ``False``) and leaves the pool unchanged; caller mistakes
    raise ``ValueError``.

    A sequence's life: ``allocate`` (prompt) -> ``cache_blocks`` as its tokens are computed ->
    ``append`` (slots for new tokens) -> ``cache_blocks`` once their ids are known -> ... -> ``free``;
    ``fork`` and ``truncate`` (drop the last tokens) at any point.

    Invariants (``check_invariants`` verifies all of them; tests call it after every operation):
      - every block is either free (ref 0, on the free list exactly once) or referenced (ref > 0,
        not on the free list); never both;
      - a block's ref count equals its number of block-table entries, so the sum of ref counts
        equals the number of table entries across sequences;
      - a sequence of n tokens has a table of ceil(n / block_size) blocks; only its last block
        may be partial, and a block is filled to the same count in every sequence that references it;
      - the prefix index maps each hash to a block carrying that hash, whose stored key re-hashes to
        it; indexed blocks are full and immutable (writes go to a partial block, and a shared
        partial block is copied first); a sequence's chain hash at an indexed block is that block's.

    Freed blocks: one that carries a hash stays cached (evicted last, hf_paged.core.free_list); one without is
    reused first. A sequence frees its blocks last-first, so its last block is evicted first: later blocks are
    shared by fewer prompts (vLLM v1's order).

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block, a positive multiple of 8.
        enable_prefix_caching: index full blocks by hash and serve prompts' cached prefixes.
        hash_fn: the block hash; leave the default (``hash_block_tokens``) except to force collisions in tests.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        *,
        hash_fn: HashFn = hash_block_tokens,
    ):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"`num_blocks` must be a positive int, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or block_size % 8:
            raise ValueError(f"`block_size` must be a positive multiple of 8 (e.g. 16), got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._alloc = BlockAllocator(num_blocks, block_size, hash_fn)
        self._blocks = self._alloc.blocks  # the allocator's list, by id (grown in place)
        self._seqs: dict[Hashable, SeqBlocks] = {}
        self._num_table_entries = 0
        self._num_prefix_query_tokens = 0
        self._num_prefix_hit_tokens = 0

    # ---- queries ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._alloc.free)

    @property
    def stats(self) -> PoolStats:
        num_used = self.num_blocks - len(self._alloc.free)
        return PoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=len(self._alloc.free),
            num_used_blocks=num_used,
            num_cached_free_blocks=self._alloc.num_cached_free,
            num_used_slots=self._alloc.num_used_slots,
            num_allocated_slots=num_used * self.block_size,
            num_table_entries=self._num_table_entries,
            num_prefix_query_tokens=self._num_prefix_query_tokens,
            num_prefix_hit_tokens=self._num_prefix_hit_tokens,
        )

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def get_seq_ids(self) -> list[Hashable]:
        """The ids of the allocated sequences, in allocation order."""
        return list(self._seqs)

    def get_block_table(self, seq_id: Hashable) -> list[BlockId]:
        """A copy of the sequence's block table."""
        return list(self._get_seq(seq_id).block_table)

    def get_block_hashes(self, seq_id: Hashable) -> list[BlockHash]:
        """A copy of the chain hashes of the sequence's leading full blocks hashed so far."""
        return list(self._get_seq(seq_id).block_hashes)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence has slots for (its prompt plus every ``append``)."""
        seq = self._seqs.get(seq_id)  # once per sequence per step: _get_seq's call only for the error
        return seq.num_tokens if seq is not None else self._get_seq(seq_id).num_tokens

    def ref_count(self, block_id: BlockId) -> int:
        return self._alloc.get_block(block_id).ref_count

    def get_block_hash(self, block_id: BlockId) -> BlockHash | None:
        """The block's hash while it is in the prefix index, else None."""
        return self._alloc.get_block(block_id).block_hash

    def get_free_block_ids(self) -> list[BlockId]:
        """The free list, head (next to be allocated) first. O(num_free_blocks): for tests and debugging."""
        return list(self._alloc.free)

    def num_cached_prefix_tokens(self, token_ids: Sequence[int], extra_key: Hashable | None = None) -> int:
        """Tokens of this prompt that ``allocate`` would serve from the cache now; no state change, no stats.

        Whole blocks only, and at most ``len(token_ids) - 1`` so that the last token is computed.
        """
        return len(self._find_cached_blocks(token_ids, extra_key)[0]) * self.block_size

    def can_allocate(self, token_ids: Sequence[int] | int, extra_key: Hashable | None = None) -> bool:
        """Whether ``allocate`` would succeed now.

        Args:
            token_ids: the prompt (exact answer, prefix hits included), or a token count (no
                prefix lookup: conservative, never True when allocate would fail).
            extra_key: as in ``allocate``.
        """
        if isinstance(token_ids, int):
            if token_ids < 0:
                raise ValueError(f"`token_ids` as a token count must be >= 0, got {token_ids}")
            return math.ceil(token_ids / self.block_size) <= len(self._alloc.free)
        return self._num_blocks_to_take(token_ids, extra_key) is not None

    def can_append(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Whether ``append`` of ``num_new_tokens`` tokens (copy-on-write included) would succeed now."""
        check_num_new_tokens(num_new_tokens)
        return self._num_blocks_to_append(self._get_seq(seq_id), num_new_tokens) <= len(self._alloc.free)

    def num_blocks_to_append(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """Free blocks ``append(seq_id, num_new_tokens)`` would take: new blocks, plus one if it copies (CoW)."""
        check_num_new_tokens(num_new_tokens)
        return self._num_blocks_to_append(self._get_seq(seq_id), num_new_tokens)

    # ---- mutators -----------------------------------------------------------------------------

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        extra_key: Hashable | None = None,
        *,
        num_tokens_to_cache: int | None = None,
        find_cached: bool = True,
    ) -> AllocationResult | None:
        """Give a new sequence the blocks for its prompt, reusing the longest cached prefix.

        The prefix cache serves the longest run of leading full blocks whose hash hits and whose
        stored key matches (each hit block: ref += 1, off the free list if it was cached-free),
        capped so that the last prompt token is always computed. New blocks come from the head
        of the free list. All or nothing. ``token_ids`` is read, not kept: the pool records
        ``len(token_ids)`` and the chain hashes of the blocks it hashed.

        Args:
            seq_id: a new, hashable sequence id.
            token_ids: the prompt, at least one token, every id >= 0.
            extra_key: kept with the sequence and mixed into every block hash (adapter id, salt).
            num_tokens_to_cache: full blocks within this many leading tokens enter the prefix
                index now (default: all of them). Other sequences may then hit them before their
                K/V exist, so with chunked prefill pass the end of the first chunk and call
                ``cache_blocks`` as later chunks are scheduled.
            find_cached: look the prompt up in the prefix index; False: every block is new (the caller needs the
                whole prompt computed), and the lookup is not counted in the hit-rate stats.

        Returns:
            The block table and ``num_cached_tokens`` (write K/V from that position on), or None
            if there are not enough free blocks (nothing changed).

        Raises:
            ValueError: ``seq_id`` exists, ``token_ids`` is empty or holds an id < 0, or
                ``num_tokens_to_cache`` is out of range.
        """
        if seq_id in self._seqs:
            raise ValueError(f"`seq_id` {seq_id!r} already has blocks; free it first or pick a new id")
        if len(token_ids) == 0:
            raise ValueError(f"`token_ids` must hold at least one token for seq {seq_id!r}, got an empty sequence")
        check_token_ids(seq_id, token_ids, 0, len(token_ids))
        if num_tokens_to_cache is not None and not 0 <= num_tokens_to_cache <= len(token_ids):
            raise ValueError(f"`num_tokens_to_cache` must be in [0, {len(token_ids)}], got {num_tokens_to_cache}")
        hit_blocks, hit_hashes = self._find_cached_blocks(token_ids, extra_key) if find_cached else ([], [])
        num_new_blocks = math.ceil(len(token_ids) / self.block_size) - len(hit_blocks)
        # A cached-free hit block leaves the free list too, so it competes with the new blocks.
        if num_new_blocks + sum(b.ref_count == 0 for b in hit_blocks) > len(self._alloc.free):
            return None
        for block in hit_blocks:
            self._alloc.touch(block)
        table = [block.block_id for block in hit_blocks]
        num_cached_tokens = len(hit_blocks) * self.block_size
        for start in range(num_cached_tokens, len(token_ids), self.block_size):
            block = self._alloc.take()
            self._alloc.fill(block, min(self.block_size, len(token_ids) - start))
            table.append(block.block_id)
        self._num_table_entries += len(table)
        seq = SeqBlocks(table, len(token_ids), extra_key, hit_hashes)
        self._seqs[seq_id] = seq
        if self.enable_prefix_caching:
            if find_cached:
                self._num_prefix_query_tokens += len(token_ids)
                self._num_prefix_hit_tokens += num_cached_tokens
            num_tokens = len(token_ids) if num_tokens_to_cache is None else num_tokens_to_cache
            self._cache_full_blocks(seq_id, seq, token_ids, num_tokens)
        return AllocationResult(block_table=list(table), num_cached_tokens=num_cached_tokens)

    def cache_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_tokens: int) -> None:
        """Enter the sequence's full blocks within its first ``num_tokens`` tokens into the prefix index.

        Hashes only the blocks not hashed yet, chained from the last hashed one. Call it once the
        tokens' ids are known and their K/V are in (or scheduled into) the blocks: a later prompt
        may hit an indexed block at once. A block whose content is already indexed stays out of
        the index (one block per hash) but still gets its chain hash. No-op when prefix caching is off.

        Args:
            seq_id: an allocated sequence.
            token_ids: the caller's token list of that sequence, read, never stored or mutated.
                Entries past ``num_tokens`` are ignored (they may be anything); the ones it hashes
                must be the ids whose K/V the sequence's blocks hold.
            num_tokens: how many leading tokens are final; in ``[0, num_tokens(seq_id)]``.

        Raises:
            ValueError: ``num_tokens`` is out of range, ``token_ids`` is shorter than ``num_tokens``,
                a token it hashes is < 0, or a block already indexed holds other tokens than
                ``token_ids`` says (the list is not this sequence's).
        """
        seq = self._get_seq(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"`num_tokens` must be in [0, {seq.num_tokens}] for seq {seq_id!r}, got {num_tokens}")
        if len(token_ids) < num_tokens:
            raise ValueError(
                f"`token_ids` of seq {seq_id!r} must hold at least `num_tokens` = {num_tokens} tokens, "
                f"got {len(token_ids)}"
            )
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq_id, seq, token_ids, num_tokens)

    def append(self, seq_id: Hashable, num_new_tokens: int) -> list[tuple[BlockId, BlockId]] | None:
        """Reserve slots for ``num_new_tokens`` more tokens: fill the last block, then take new blocks.

        Hot path (once per generated token per sequence): O(1 + new blocks), and it hashes nothing
        (the pool has no token ids; ``cache_blocks`` indexes the blocks once the ids are known). If
        the partial last block is shared (ref > 1, after ``fork``), this sequence gets a fresh copy
        of it first (copy-on-write); full blocks are never written.

        Args:
            seq_id: an allocated sequence.
            num_new_tokens: how many tokens to add slots for (0: no-op).

        Returns:
            ``[(src_block, dst_block)]`` to copy on the device before writing the new K/V (at most
            one pair; ``[]`` when nothing is shared), or None if there are not enough free blocks
            (nothing changed).

        Raises:
            ValueError: ``num_new_tokens`` < 0, or ``seq_id`` is unknown.
            TypeError: ``num_new_tokens`` is not an int.
        """
        seq = self._seqs.get(seq_id)
        if seq is not None and type(num_new_tokens) is int and num_new_tokens > 0 and seq.block_table:
            last = self._blocks[seq.block_table[-1]]
            if last.ref_count == 1 and last.num_tokens + num_new_tokens <= self.block_size:
                # Fast path (most decode steps): the tokens fit in the sequence's own partial last block.
                last.num_tokens += num_new_tokens
                self._alloc.num_used_slots += num_new_tokens
                seq.num_tokens += num_new_tokens
                return []
        check_num_new_tokens(num_new_tokens)
        seq = self._get_seq(seq_id)
        if num_new_tokens == 0:
            return []
        if self._num_blocks_to_append(seq, num_new_tokens) > len(self._alloc.free):
            return None
        bs = self.block_size
        table = seq.block_table
        last = self._blocks[table[-1]]
        cow_pairs = []
        if last.ref_count > 1 and seq.num_tokens % bs:
            new = self._alloc.copy_on_write(last, last.num_tokens)
            table[-1] = new.block_id
            cow_pairs.append((last.block_id, new.block_id))
            last = new
        num_left = num_new_tokens
        if last.num_tokens < bs:
            num_left -= self._alloc.fill(last, min(bs - last.num_tokens, num_left))
        while num_left:
            block = self._alloc.take()
            num_left -= self._alloc.fill(block, min(bs, num_left))
            table.append(block.block_id)
            self._num_table_entries += 1
        seq.num_tokens += num_new_tokens
        return cow_pairs

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Create ``child_id`` sharing every block of ``parent_id`` (ref += 1). Needs no free block.

        The child starts with the parent's token count, extra key and chain hashes.
        """
        parent = self._get_seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"`child_id` {child_id!r} already has blocks; free it first or pick a new id")
        for block_id in parent.block_table:
            self._blocks[block_id].ref_count += 1
        child = SeqBlocks(list(parent.block_table), parent.num_tokens, parent.extra_key, list(parent.block_hashes))
        self._seqs[child_id] = child
        self._num_table_entries += len(child.block_table)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> list[tuple[BlockId, BlockId]] | None:
        """Keep only the first ``num_tokens`` tokens of a sequence (a rollback: rejected draft tokens, ``crop``).

        The blocks past them are released as ``free`` releases them (last first). The new last block, when the cut
        falls inside it, becomes writable again::

            before   | b0# full | b1# full | b2 partial |      truncate to 12 tokens (block_size 8)
            after    | b0# full | b1 4 tokens |            b2 released; b1 leaves the index

        - shared (ref > 1, after ``fork`` or a prefix hit): the sequence gets a fresh copy of it (copy-on-write,
          now rather than at the next ``append``, since a block's fill is one count for every sequence that
          holds it); the other holders keep the block, its tokens and its hash;
        - the sequence's own and in the prefix index: it leaves the index, since its slots past the cut will be
          overwritten. Released full blocks keep their hash: their K/V still match their tokens.

        The sequence's chain hashes past its last full block are dropped.

        Args:
            seq_id: an allocated sequence.
            num_tokens: tokens to keep, in ``[1, num_tokens(seq_id)]`` (``free`` drops them all).

        Returns:
            ``[(src_block, dst_block)]`` to copy on the device before the next write (at most one pair; ``[]``
            when the cut block is not shared), or None if that copy needs a free block and there is none
            (nothing changed; see ``num_blocks_to_truncate``).

        Raises:
            ValueError: ``num_tokens`` is out of range, or ``seq_id`` is unknown.
            TypeError: ``num_tokens`` is not an int.
        """
        seq = self._get_seq(seq_id)
        check_num_tokens_to_keep(seq_id, seq, num_tokens)
        if num_tokens == seq.num_tokens:
            return []
        if self.num_blocks_to_truncate(seq_id, num_tokens) > len(self._alloc.free):
            return None
        bs = self.block_size
        table = seq.block_table
        num_keep = math.ceil(num_tokens / bs)
        for block_id in reversed(table[num_keep:]):
            self._alloc.release(self._blocks[block_id])
        self._num_table_entries -= len(table) - num_keep
        del table[num_keep:]
        del seq.block_hashes[num_tokens // bs :]
        seq.num_tokens = num_tokens
        last = self._blocks[table[-1]]
        fill = num_tokens - (num_keep - 1) * bs  # tokens the new last block keeps
        if fill == last.num_tokens:  # the cut is at the block's end: nothing in it changes
            return []
        if last.ref_count > 1:
            new = self._alloc.copy_on_write(last, fill)
            table[-1] = new.block_id
            return [(last.block_id, new.block_id)]
        self._alloc.cut(last, fill)
        return []

    def num_blocks_to_truncate(self, seq_id: Hashable, num_tokens: int) -> int:
        """Free blocks ``truncate(seq_id, num_tokens)`` takes: 1 when it copies a shared block it cuts, else 0.

        A caller that truncates several sequences at once sums these to check all of them fit before any change
        (conservative: blocks the truncations release are not counted).
        """
        seq = self._get_seq(seq_id)
        check_num_tokens_to_keep(seq_id, seq, num_tokens)
        if num_tokens == seq.num_tokens:
            return 0
        num_keep = math.ceil(num_tokens / self.block_size)
        last = self._blocks[seq.block_table[num_keep - 1]]
        is_cut = num_tokens - (num_keep - 1) * self.block_size < last.num_tokens
        # A shared block loses this sequence's reference only if it is dropped; one cut in the middle is copied.
        return int(is_cut and last.ref_count > 1)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks, last block first; see the class docstring for where they go."""
        seq = self._get_seq(seq_id)
        del self._seqs[seq_id]
        self._num_table_entries -= len(seq.block_table)
        for block_id in reversed(seq.block_table):
            self._alloc.release(self._blocks[block_id])

    def grow(self, num_new_blocks: int) -> None:
        """Add ``num_new_blocks`` empty blocks (ids ``num_blocks ...``) at the head of the free list.

        For a pool that starts small and grows as its sequences need blocks (the caller grows the device
        tensors to match first). New blocks hold nothing, so they are allocated before any cached block is
        evicted, lowest id first.

        Raises:
            ValueError: ``num_new_blocks`` is not a positive int.
        """
        if isinstance(num_new_blocks, bool) or not isinstance(num_new_blocks, int) or num_new_blocks <= 0:
            raise ValueError(f"`num_new_blocks` must be a positive int, got {num_new_blocks!r}")
        self._alloc.grow(num_new_blocks)
        self.num_blocks += num_new_blocks

    def reset_prefix_cache(self) -> None:
        """Drop every hash from the index: cached-free blocks become plain free blocks.

        Block tables are untouched; blocks live now are not indexed again (their hashes are done).
        """
        self._alloc.reset_prefix_cache()

    # ---- invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify every invariant of the class docstring and the counters. O(pool + table entries): for tests.

        Raises:
            RuntimeError: an invariant is broken (a bug in hf_paged).
        """
        num_table_entries = sum(len(seq.block_table) for seq in self._seqs.values())
        _check(self._num_table_entries == num_table_entries, "table entry counter")
        self._alloc.check_invariants(self._seqs)

    # ---- internals ----------------------------------------------------------------------------

    def _get_seq(self, seq_id: Hashable) -> SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown `seq_id` {seq_id!r}: allocate it first")
        return seq

    def _find_cached_blocks(
        self, token_ids: Sequence[int], extra_key: Hashable | None
    ) -> tuple[list[Block], list[BlockHash]]:
        if not self.enable_prefix_caching:
            return [], []
        return self._alloc.index.find_cached_blocks(token_ids, extra_key)

    def _num_blocks_to_take(self, token_ids: Sequence[int], extra_key: Hashable | None) -> int | None:
        """Free-list blocks ``allocate`` would take (new blocks + cached-free hits), None if too many."""
        hit_blocks, _ = self._find_cached_blocks(token_ids, extra_key)
        num_take = math.ceil(len(token_ids) / self.block_size) - len(hit_blocks)
        num_take += sum(b.ref_count == 0 for b in hit_blocks)
        return num_take if num_take <= len(self._alloc.free) else None

    def _num_blocks_to_append(self, seq: SeqBlocks, num_new: int) -> int:
        num_blocks = math.ceil((seq.num_tokens + num_new) / self.block_size) - len(seq.block_table)
        is_cow = num_new > 0 and seq.num_tokens % self.block_size and self._blocks[seq.block_table[-1]].ref_count > 1
        return num_blocks + bool(is_cow)

    def _cache_full_blocks(self, seq_id: Hashable, seq: SeqBlocks, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash the sequence's full blocks within ``num_tokens`` not hashed yet; index the new contents."""
        first_idx, end_idx = len(seq.block_hashes), num_tokens // self.block_size
        if first_idx >= end_idx:
            return
        check_token_ids(seq_id, token_ids, first_idx * self.block_size, end_idx * self.block_size)
        self._alloc.index.cache_full_blocks(
            seq_id, self._blocks, seq.block_table, seq.block_hashes, token_ids, end_idx, seq.extra_key
        )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"bug in hf_paged: BlockPool invariant broken: {message}")
