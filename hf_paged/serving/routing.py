"""Prefix-aware routing for data-parallel replicas: send a prompt where its prefix was sent before.

Each replica keeps its own prefix cache, so a least-loaded router scatters the requests that share a prefix (a
repeated prompt, a long system prompt, a document asked several questions) over every replica, and each one
prefills that prefix again. ``PrefixRouter`` remembers, per replica, the chained hashes of the full blocks of the
prompts routed there (a bounded LRU, an approximation of what that replica's cache holds: it does not see the
replica's evictions), and ``choose`` prefers the replica whose remembered chain covers the most leading blocks of a
new prompt, as long as that replica is not busier than the least-loaded one by more than a small slack:

    slack = max(MIN_SLACK, least_load // SLACK_DIVISOR)     # 2 requests, or 1/16 of the least load

Without a match (a new prompt), or when the match is too busy, the choice is the least-loaded replica (ties to
the caller's round-robin order), so new prompts still spread by load. Pure Python, no locks: the caller
(DataParallelEngine, under its lock) passes the loads and the live replicas in its order.
"""

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PrefixRouter"]

MIN_SLACK = 2
SLACK_DIVISOR = 16
MAX_ENTRIES_PER_REPLICA = 1 << 16  # block hashes remembered per replica (LRU)


class PrefixRouter:
    """Remembers which replica each prompt prefix went to; picks the replica for a new prompt.

    Args:
        num_replicas: Replicas routed over (indices ``0 .. num_replicas - 1``).
        block_size: Tokens per hashed block (the engine's block size, so a remembered block is a cacheable one).
        max_entries: Block hashes remembered per replica; the least recently routed are forgotten first.

    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, num_replicas: int, block_size: int, max_entries: int = MAX_ENTRIES_PER_REPLICA):
        for name, value in (("num_replicas", num_replicas), ("block_size", block_size), ("max_entries", max_entries)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
        self.block_size = block_size
        self.max_entries = max_entries
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the prompt's full blocks: entry i identifies tokens ``[0, (i + 1) * block_size)``."""
        hashes, parent, size = [], 0, self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash((parent, *token_ids[start : start + size]))
            hashes.append(parent)
        return hashes

    def matched_blocks(self, replica: int, hashes: list[int]) -> int:
        """Leading blocks of a prompt (its ``block_hashes``) that were routed to ``replica`` before."""
        seen = self._seen[replica]
        matched = 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        return matched

    def choose(self, candidates: Sequence[int], loads: Sequence[int], hashes: list[int]) -> int:
        """The replica for a prompt, among ``candidates`` (live replicas, in the caller's tie-break order).

        Args:
            candidates: Replica indices to choose from; not empty.
            loads: Requests in flight per replica index (read only at the candidates').
            hashes: The prompt's ``block_hashes``.

        Returns:
            The replica with the longest remembered prefix if its load is within the slack of the least load, else
            the least-loaded candidate (the first of equals in ``candidates``' order).
        """
        least = min(candidates, key=lambda r: loads[r])
        if not hashes:
            return least
        best, best_matched = least, 0
        for r in candidates:
            matched = self.matched_blocks(r, hashes)
            if matched > best_matched or (matched == best_matched and matched and loads[r] < loads[best]):
                best, best_matched = r, matched
        if best_matched and loads[best] <= loads[least] + max(MIN_SLACK, loads[least] // SLACK_DIVISOR):
            return best
        return least

    def record(self, replica: int, hashes: list[int]) -> None:
        """Remember that a prompt with these block hashes went to ``replica`` (most recent last)."""
        seen = self._seen[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_entries:
            seen.popitem(last=False)

    def forget(self, replica: int) -> None:
        """Drop what ``replica`` was sent (it died, or its cache was reset)."""
        self._seen[replica].clear()
