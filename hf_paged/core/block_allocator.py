"""The pool's physical blocks: ref counts, the free list they return to and the prefix index they enter.

``BlockPool`` keeps the sequences and their block tables and decides; ``BlockAllocator`` keeps what each block
is (``Block``), which blocks are free and in what order they are reused (``FreeBlockList``), and which full
blocks are cached (``PrefixIndex``), with the counters over them.

Pure Python (stdlib + xxhash, no torch).
"""

import math
from collections.abc import Hashable

from hf_paged.core.block import Block, BlockId, SeqBlocks
from hf_paged.core.free_list import FreeBlockList
from hf_paged.core.prefix_hash import ROOT_PARENT_HASH, HashFn
from hf_paged.core.prefix_index import PrefixIndex


class BlockAllocator:
    """``num_blocks`` blocks of ``block_size`` slots: taken from the free list's head, returned by ref count.

    Invariants (``check_invariants``):
      - a block is either free (ref 0, on the free list exactly once) or referenced (ref > 0, off it);
      - a free block that carries a hash is cached: its hash is evicted only when the block is taken again;
      - ``num_cached_free`` counts the free blocks that carry a hash; ``num_used_slots`` sums the fill of the
        referenced blocks.

    Args:
        num_blocks: blocks to start with; ids 0..num_blocks-1, on the free list in id order.
        block_size: token slots per block.
        hash_fn: the block hash of the prefix index.
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]  # by id; grow() extends this list in place
        self.free = FreeBlockList(range(num_blocks))
        self.index = PrefixIndex(block_size, hash_fn)
        self.num_cached_free = 0
        self.num_used_slots = 0

    def get_block(self, block_id: BlockId) -> Block:
        """The record of ``block_id``.

        Raises:
            ValueError: ``block_id`` is not a block of the pool.
        """
        if not 0 <= block_id < len(self.blocks):
            raise ValueError(f"`block_id` must be in [0, {len(self.blocks)}), got {block_id}")
        return self.blocks[block_id]

    def take(self) -> Block:
        """The head of the free list (its hash evicted) as an empty block with ref 1. The caller checks one is free."""
        block = self.blocks[self.free.pop_head()]
        if block.block_hash is not None:
            self.index.remove(block)
            self.num_cached_free -= 1
        block.ref_count = 1
        block.num_tokens = 0
        return block

    def touch(self, block: Block) -> None:
        """Ref += 1 on a prefix hit; a cached free block leaves the free list."""
        if block.ref_count == 0:
            self.free.remove(block.block_id)
            self.num_cached_free -= 1
            self.num_used_slots += block.num_tokens
        block.ref_count += 1

    def release(self, block: Block) -> None:
        """Ref -= 1; at 0 the block joins the free list: at the tail while it carries a hash, else at the head."""
        block.ref_count -= 1
        if block.ref_count:
            return
        self.num_used_slots -= block.num_tokens
        if block.block_hash is None:
            self.free.push_head(block.block_id)  # reused before any cached block is evicted
        else:
            self.free.push_tail(block.block_id)
            self.num_cached_free += 1

    def fill(self, block: Block, num_tokens: int) -> int:
        """Mark ``num_tokens`` more slots of a referenced block as written; returns ``num_tokens``."""
        block.num_tokens += num_tokens
        self.num_used_slots += num_tokens
        return num_tokens

    def copy_on_write(self, block: Block, num_tokens: int) -> Block:
        """A new block for a sequence to write instead of ``block``, which another sequence still holds; the caller
        copies the first ``num_tokens`` slots over and puts the new block in its table."""
        new = self.take()
        self.fill(new, num_tokens)
        block.ref_count -= 1  # stays > 0: another sequence still holds it
        return new

    def cut(self, block: Block, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` slots of a block only one sequence holds; it leaves the prefix index, since
        the slots past them will be overwritten."""
        self.num_used_slots -= block.num_tokens - num_tokens
        block.num_tokens = num_tokens
        if block.block_hash is not None:
            self.index.remove(block)

    def grow(self, num_new_blocks: int) -> None:
        """Add ``num_new_blocks`` empty blocks at the head of the free list, lowest id first."""
        first = len(self.blocks)
        self.blocks.extend(Block(i) for i in range(first, first + num_new_blocks))
        for block_id in range(first + num_new_blocks - 1, first - 1, -1):
            self.free.push_head(block_id)

    def reset_prefix_cache(self) -> None:
        """Drop every hash from the index: cached free blocks become plain free blocks, where they are."""
        for block in self.index.clear():
            if block.ref_count == 0:
                self.num_cached_free -= 1

    def check_invariants(self, seqs: dict[Hashable, SeqBlocks]) -> None:
        """Verify the class invariants and the prefix index's, given every sequence's blocks.

        Also, per sequence: a sequence of n tokens has a table of ceil(n / block_size) blocks, only the last
        partial, and a block is filled to the same count in every sequence that holds it; an indexed block in a
        table sits where it was cached, under the same extra key, after the same chain hashes.

        Raises:
            RuntimeError: an invariant is broken (a bug in hf_paged).
        """
        bs = self.block_size
        num_refs = [0] * len(self.blocks)
        for seq_id, seq in seqs.items():
            n = seq.num_tokens
            _check(len(seq.block_table) == math.ceil(n / bs), f"seq {seq_id!r}: table length for {n} tokens")
            _check(len(seq.block_hashes) <= n // bs, f"seq {seq_id!r}: hashes beyond its full blocks")
            for block_idx, block_id in enumerate(seq.block_table):
                num_refs[block_id] += 1
                block = self.blocks[block_id]
                fill = min(bs, n - block_idx * bs)  # only the last block may be partial
                _check(block.num_tokens == fill, f"block {block_id}: fill differs in seq {seq_id!r}")
                if block.block_hash is None:
                    continue
                key_idx, key_parent_hash, _, key_extra_key = block.cache_key
                where = f"block {block_id} at position {block_idx} of seq {seq_id!r}"
                _check(key_idx == block_idx and key_extra_key == seq.extra_key, f"{where}: key of another place")
                if block_idx < len(seq.block_hashes):
                    _check(seq.block_hashes[block_idx] == block.block_hash, f"{where}: chain hash differs")
                if block_idx <= len(seq.block_hashes):
                    parent_hash = seq.block_hashes[block_idx - 1] if block_idx else ROOT_PARENT_HASH
                    _check(key_parent_hash == parent_hash, f"{where}: parent hash differs")
        for block in self.blocks:
            is_free = block.block_id in self.free
            _check(block.ref_count == num_refs[block.block_id], f"block {block.block_id}: ref count vs tables")
            _check(is_free == (block.ref_count == 0), f"block {block.block_id}: free list vs ref count")
        self.index.check_invariants(self.blocks)
        _check(len(self.free) == sum(r == 0 for r in num_refs), "free list length")
        num_cached_free = sum(self.blocks[b].block_hash is not None for b in self.free)
        _check(self.num_cached_free == num_cached_free, "cached-free counter")
        num_used_slots = sum(b.num_tokens for b in self.blocks if b.ref_count)
        _check(self.num_used_slots == num_used_slots, "used slot counter")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"bug in hf_paged: BlockAllocator invariant broken: {message}")
