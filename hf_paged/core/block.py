"""The block pool's records: a physical KV block (ref count, fill, prefix-cache key) and a sequence's blocks.

Pure Python (no torch).
"""

from collections.abc import Hashable

from hf_paged.core.prefix_hash import BlockHash

BlockId = int


class Block:
    """The record of block ``block_id``, shared by the pool, its free list (by id) and its prefix index.

    ``block_hash`` and ``cache_key`` are set together, exactly while the block is in the prefix index; an
    indexed block is full (``num_tokens == block_size``) and is never written again.
    """

    __slots__ = ("block_id", "ref_count", "num_tokens", "block_hash", "cache_key")

    def __init__(self, block_id: BlockId):
        self.block_id = block_id
        self.ref_count = 0  # block-table entries that hold the block
        self.num_tokens = 0  # filled slots; equal for every sequence that references the block
        self.block_hash: BlockHash | None = None
        # (block_idx, parent_hash, token_ids, extra_key): compared on every index hit, so a collision is a miss
        self.cache_key: tuple[int, BlockHash, tuple[int, ...], Hashable | None] | None = None


class SeqBlocks:
    """What the pool keeps of one sequence: its block table, token count, extra key and chain hashes; never its
    token ids (the caller holds them)."""

    __slots__ = ("block_table", "num_tokens", "extra_key", "block_hashes")

    def __init__(
        self, block_table: list[BlockId], num_tokens: int, extra_key: Hashable | None, block_hashes: list[BlockHash]
    ):
        self.block_table = block_table  # [ceil(num_tokens / block_size)] block ids
        self.num_tokens = num_tokens
        self.extra_key = extra_key  # mixed into every block hash (adapter id, salt)
        self.block_hashes = block_hashes  # chain hashes of the leading full blocks hashed so far
