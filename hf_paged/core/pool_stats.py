"""A snapshot of the block pool's occupancy and prefix-cache counters (``BlockPool.stats``).

Pure Python (no torch).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    block_size: int
    num_free_blocks: int  # on the free list; includes num_cached_free_blocks
    num_used_blocks: int  # ref > 0; equals num_blocks - num_free_blocks
    num_cached_free_blocks: int  # ref 0 and still carrying a hash
    num_used_slots: int  # distinct slots holding live tokens (a shared block counts once)
    num_allocated_slots: int  # num_used_blocks * block_size
    num_table_entries: int  # sum of block table lengths = blocks needed without sharing = sum of ref counts
    num_prefix_query_tokens: int  # prompt tokens looked up by allocate() (0 while prefix caching is off)
    num_prefix_hit_tokens: int  # of those, tokens served from the cache

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0

    @property
    def sharing_savings(self) -> float:
        """Fraction of blocks saved by sharing (prefix hits and forks): 1 - used / table entries."""
        return 1.0 - self.num_used_blocks / self.num_table_entries if self.num_table_entries else 0.0
