"""The pool's free blocks in eviction order: an O(1) LRU list of block ids.

Allocation always takes the head::

    head -> [freed, no hash: latest first] [never used: by id] [cached: least recently freed first] <- tail

A freed block that carries a hash joins at the tail and stays findable by hash (cached, ref 0) until it
is taken, which evicts its hash. A freed block without one holds nothing worth keeping, so it joins at
the head and is reused before any cached block is evicted. A prefix hit takes a cached block out of the
middle. ``BlockPool`` decides which end; this module only keeps the order.

Pure Python (no torch).
"""

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from hf_paged.core.block import BlockId


class FreeBlockList:
    """Free block ids, head (allocated next) first; each id at most once.

    Args:
        block_ids: the initial list, head first.
    """

    def __init__(self, block_ids: Iterable[BlockId]):
        # OrderedDict as the doubly linked list: O(1) pop at the head, push at either end and removal from the
        # middle (a prefix hit on a cached free block).
        self._ids: OrderedDict[BlockId, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, block_id: BlockId) -> bool:
        return block_id in self._ids

    def __iter__(self) -> Iterator[BlockId]:
        return iter(self._ids)

    def pop_head(self) -> BlockId:
        """Take the next block to allocate. The caller checks that the list is not empty."""
        return self._ids.popitem(last=False)[0]

    def push_head(self, block_id: BlockId) -> None:
        """Add a block that holds nothing worth keeping: it is allocated next."""
        self._ids[block_id] = None
        self._ids.move_to_end(block_id, last=False)

    def push_tail(self, block_id: BlockId) -> None:
        """Add a cached block: it is evicted after every block already on the list."""
        self._ids[block_id] = None

    def remove(self, block_id: BlockId) -> None:
        """Take a block out of the middle (a prefix hit on a cached free block)."""
        del self._ids[block_id]
