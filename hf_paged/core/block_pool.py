"""Physical KV blocks: ref counts, an O(1) LRU free list and a chained-hash prefix index.

Pure Python (stdlib + xxhash, no torch), so the bookkeeping is property-tested on the CPU. The pool
decides; the caller executes: it writes K/V into the slots of the block tables it gets back and
runs the ``(src, dst)`` block copies that copy-on-write asks for, in one batched call.

Tokens are the caller's. Per sequence the pool keeps its block table, its token count, its
``extra_key`` and the chain hashes of its leading full blocks hashed so far; never its token ids.
``allocate`` reads the prompt (prefix lookup, hashing), ``append`` reserves slots by count and
hashes nothing, and ``cache_blocks`` reads the caller's token list to hash and index full blocks
once their ids are known and their K/V are being computed. Keeping no copy means there is nothing
to reconcile with the caller's list each step; the one copy of token ids the pool does hold is the
key of each indexed block, for the collision check below.

Prefix hash (``hash_block_tokens``): for full block ``i`` of a sequence, ::

    h_i = xxh64(h_{i-1}.to_bytes(8, "little")          # h_{-1} = 0
                + token ids of block i as int64 little-endian
                + (b"" if extra_key is None else repr(extra_key).encode()),
                seed=HASH_SEED)

Collision policy: an index hit also compares the stored key ``(block_idx, h_{i-1}, token_ids,
extra_key)``, so two blocks whose 64-bit hashes collide are a miss, never a wrong block. (What is
left is the parent hash: a wrong hit would need two different prefixes with equal xxh64 chain
values at the same depth, ~1 in 2**64 per pair.) ``extra_key`` (an adapter id, a salt) must
compare with ``==`` and have a stable ``repr``: str, int, or tuples of them.

Free-list policy (allocation always takes the head)::

    head -> [freed, no hash: latest first] [never used: by id] [cached: least recently freed first] <- tail

A freed block that carries a hash is appended at the tail and stays findable by hash (cached,
ref 0) until it is reallocated, which evicts its hash. A freed block without one (a partial last
block, a duplicate of an indexed block, a full block never passed to ``cache_blocks``, every block
when prefix caching is off) holds nothing worth keeping, so it goes to the head and is reused
before any cached block is evicted. A sequence frees its blocks last-first, so its last block is
evicted first: later blocks are shared by fewer prompts (vLLM v1's order). (``reset_prefix_cache``
leaves its unhashed blocks where they are, among the cached ones.)
"""

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from hf_paged.core.prefix_hash import _ROOT_PARENT_HASH, HASH_SEED, BlockHash, hash_block_tokens

BlockId = int
__all__ = [
    "BlockId", "BlockHash", "BlockPool", "HASH_SEED", "hash_block_tokens", "AllocationResult", "PoolStats",
]  # fmt: skip


@dataclass(frozen=True)
class AllocationResult:
    block_table: list[BlockId]  # [ceil(len(token_ids) / block_size)] block ids, a copy
    num_cached_tokens: int  # leading tokens served by the prefix cache: skip them; multiple of block_size


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


class _Block:
    __slots__ = ("block_id", "ref_count", "num_tokens", "block_hash", "cache_key")

    def __init__(self, block_id: BlockId):
        self.block_id = block_id
        self.ref_count = 0
        self.num_tokens = 0  # filled slots; equal for every sequence that references the block
        self.block_hash: BlockHash | None = None  # set iff the block is in the prefix index
        self.cache_key: tuple | None = None  # (block_idx, parent_hash, token_ids, extra_key) iff block_hash is set


class _Seq:
    __slots__ = ("block_table", "num_tokens", "extra_key", "block_hashes")

    def __init__(
        self, block_table: list[BlockId], num_tokens: int, extra_key: Hashable | None, block_hashes: list[BlockHash]
    ):
        self.block_table = block_table
        self.num_tokens = num_tokens  # the caller holds the ids; the pool only needs how many
        self.extra_key = extra_key
        self.block_hashes = block_hashes  # chain hashes of the leading full blocks hashed so far


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
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"`num_blocks` must be a positive int, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or block_size % 8:
            raise ValueError(f"`block_size` must be a positive multiple of 8 (e.g. 16), got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # OrderedDict as the doubly linked list: O(1) pop at the head, push at either end and
        # removal from the middle (a prefix hit on a cached free block).
        self._free: OrderedDict[BlockId, None] = OrderedDict.fromkeys(range(num_blocks))
        self._index: dict[BlockHash, _Block] = {}
        # The chain of the last prefix lookup: (extra_key, its leading token ids (a copy), each of their full blocks'
        # token tuple and chain hash). A pure function of the tokens: a prompt that starts with the same blocks (a
        # shared system prompt) reuses them instead of hashing them again; the index is still looked up.
        self._last_chain: tuple[Hashable, list[int], list[tuple[int, ...]], list[BlockHash]] | None = None
        self._seqs: dict[Hashable, _Seq] = {}
        self._num_cached_free = 0
        self._num_used_slots = 0
        self._num_table_entries = 0
        self._num_prefix_query_tokens = 0
        self._num_prefix_hit_tokens = 0

    # ---- queries ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def stats(self) -> PoolStats:
        num_used = self.num_blocks - len(self._free)
        return PoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=len(self._free),
            num_used_blocks=num_used,
            num_cached_free_blocks=self._num_cached_free,
            num_used_slots=self._num_used_slots,
            num_allocated_slots=num_used * self.block_size,
            num_table_entries=self._num_table_entries,
            num_prefix_query_tokens=self._num_prefix_query_tokens,
            num_prefix_hit_tokens=self._num_prefix_hit_tokens,
        )

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def get_block_table(self, seq_id: Hashable) -> list[BlockId]:
        """A copy of the sequence's block table."""
        return list(self._get_seq(seq_id).block_table)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence has slots for (its prompt plus every ``append``)."""
        seq = self._seqs.get(seq_id)  # once per sequence per step: _get_seq's call only for the error
        return seq.num_tokens if seq is not None else self._get_seq(seq_id).num_tokens

    def ref_count(self, block_id: BlockId) -> int:
        return self._get_block(block_id).ref_count

    def get_block_hash(self, block_id: BlockId) -> BlockHash | None:
        """The block's hash while it is in the prefix index, else None."""
        return self._get_block(block_id).block_hash

    def get_free_block_ids(self) -> list[BlockId]:
        """The free list, head (next to be allocated) first. O(num_free_blocks): for tests and debugging."""
        return list(self._free)

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
            return math.ceil(token_ids / self.block_size) <= len(self._free)
        return self._num_blocks_to_take(token_ids, extra_key) is not None

    def can_append(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Whether ``append`` of ``num_new_tokens`` tokens (copy-on-write included) would succeed now."""
        _check_num_new_tokens(num_new_tokens)
        return self._num_blocks_to_append(self._get_seq(seq_id), num_new_tokens) <= len(self._free)

    def num_blocks_to_append(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """Free blocks ``append(seq_id, num_new_tokens)`` would take: new blocks, plus one if it copies (CoW)."""
        _check_num_new_tokens(num_new_tokens)
        return self._num_blocks_to_append(self._get_seq(seq_id), num_new_tokens)

    # ---- mutators -----------------------------------------------------------------------------

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        extra_key: Hashable | None = None,
        *,
        num_tokens_to_cache: int | None = None,
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
        _check_token_ids(seq_id, token_ids, 0, len(token_ids))
        if num_tokens_to_cache is not None and not 0 <= num_tokens_to_cache <= len(token_ids):
            raise ValueError(f"`num_tokens_to_cache` must be in [0, {len(token_ids)}], got {num_tokens_to_cache}")
        hit_blocks, hit_hashes = self._find_cached_blocks(token_ids, extra_key)
        num_new_blocks = math.ceil(len(token_ids) / self.block_size) - len(hit_blocks)
        # A cached-free hit block leaves the free list too, so it competes with the new blocks.
        if num_new_blocks + sum(b.ref_count == 0 for b in hit_blocks) > len(self._free):
            return None
        for block in hit_blocks:
            self._touch(block)
        table = [block.block_id for block in hit_blocks]
        num_cached_tokens = len(hit_blocks) * self.block_size
        for start in range(num_cached_tokens, len(token_ids), self.block_size):
            block = self._pop_free()
            self._fill(block, min(self.block_size, len(token_ids) - start))
            table.append(block.block_id)
        self._num_table_entries += len(table)
        seq = _Seq(table, len(token_ids), extra_key, hit_hashes)
        self._seqs[seq_id] = seq
        if self.enable_prefix_caching:
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
                self._num_used_slots += num_new_tokens
                seq.num_tokens += num_new_tokens
                return []
        _check_num_new_tokens(num_new_tokens)
        seq = self._get_seq(seq_id)
        if num_new_tokens == 0:
            return []
        if self._num_blocks_to_append(seq, num_new_tokens) > len(self._free):
            return None
        bs = self.block_size
        table = seq.block_table
        last = self._blocks[table[-1]]
        cow_pairs = []
        if last.ref_count > 1 and seq.num_tokens % bs:
            new = self._pop_free()
            self._fill(new, last.num_tokens)
            last.ref_count -= 1  # stays > 0: another sequence still holds it
            table[-1] = new.block_id
            cow_pairs.append((last.block_id, new.block_id))
            last = new
        num_left = num_new_tokens
        if last.num_tokens < bs:
            num_left -= self._fill(last, min(bs - last.num_tokens, num_left))
        while num_left:
            block = self._pop_free()
            num_left -= self._fill(block, min(bs, num_left))
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
        child = _Seq(list(parent.block_table), parent.num_tokens, parent.extra_key, list(parent.block_hashes))
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
        _check_num_tokens_to_keep(seq_id, seq, num_tokens)
        if num_tokens == seq.num_tokens:
            return []
        if self.num_blocks_to_truncate(seq_id, num_tokens) > len(self._free):
            return None
        bs = self.block_size
        table = seq.block_table
        num_keep = math.ceil(num_tokens / bs)
        for block_id in reversed(table[num_keep:]):
            self._release(self._blocks[block_id])
        self._num_table_entries -= len(table) - num_keep
        del table[num_keep:]
        del seq.block_hashes[num_tokens // bs :]
        seq.num_tokens = num_tokens
        last = self._blocks[table[-1]]
        fill = num_tokens - (num_keep - 1) * bs  # tokens the new last block keeps
        if fill == last.num_tokens:  # the cut is at the block's end: nothing in it changes
            return []
        if last.ref_count > 1:
            new = self._pop_free()
            self._fill(new, fill)
            last.ref_count -= 1  # stays > 0: another sequence still holds it
            table[-1] = new.block_id
            return [(last.block_id, new.block_id)]
        self._num_used_slots -= last.num_tokens - fill
        last.num_tokens = fill
        if last.block_hash is not None:
            del self._index[last.block_hash]
            last.block_hash = last.cache_key = None
        return []

    def num_blocks_to_truncate(self, seq_id: Hashable, num_tokens: int) -> int:
        """Free blocks ``truncate(seq_id, num_tokens)`` takes: 1 when it copies a shared block it cuts, else 0.

        A caller that truncates several sequences at once sums these to check all of them fit before any change
        (conservative: blocks the truncations release are not counted).
        """
        seq = self._get_seq(seq_id)
        _check_num_tokens_to_keep(seq_id, seq, num_tokens)
        if num_tokens == seq.num_tokens:
            return 0
        num_keep = math.ceil(num_tokens / self.block_size)
        last = self._blocks[seq.block_table[num_keep - 1]]
        is_cut = num_tokens - (num_keep - 1) * self.block_size < last.num_tokens
        # A shared block loses this sequence's reference only if it is dropped; one cut in the middle is copied.
        return int(is_cut and last.ref_count > 1)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks, last block first; see the module docstring for where they go."""
        seq = self._get_seq(seq_id)
        del self._seqs[seq_id]
        self._num_table_entries -= len(seq.block_table)
        for block_id in reversed(seq.block_table):
            self._release(self._blocks[block_id])

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
        first = self.num_blocks
        self._blocks.extend(_Block(i) for i in range(first, first + num_new_blocks))
        self.num_blocks += num_new_blocks
        for block_id in range(first + num_new_blocks - 1, first - 1, -1):
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Drop every hash from the index: cached-free blocks become plain free blocks.

        Block tables are untouched; blocks live now are not indexed again (their hashes are done).
        """
        for block in self._index.values():
            if block.ref_count == 0:
                self._num_cached_free -= 1
            block.block_hash = block.cache_key = None
        self._index.clear()

    # ---- invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify every invariant of the class docstring and the counters. O(pool + table entries): for tests.

        Raises:
            RuntimeError: an invariant is broken (a bug in hf_paged).
        """
        bs = self.block_size
        num_refs = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            n = seq.num_tokens
            _check(len(seq.block_table) == math.ceil(n / bs), f"seq {seq_id!r}: table length for {n} tokens")
            _check(len(seq.block_hashes) <= n // bs, f"seq {seq_id!r}: hashes beyond its full blocks")
            for block_idx, block_id in enumerate(seq.block_table):
                num_refs[block_id] += 1
                block = self._blocks[block_id]
                fill = min(bs, n - block_idx * bs)  # only the last block may be partial
                _check(block.num_tokens == fill, f"block {block_id}: fill differs in seq {seq_id!r}")
                if block.block_hash is None:
                    continue
                # An indexed block sits where it was cached, under the same extra key, after the same chain.
                key_idx, key_parent_hash, _, key_extra_key = block.cache_key
                where = f"block {block_id} at position {block_idx} of seq {seq_id!r}"
                _check(key_idx == block_idx and key_extra_key == seq.extra_key, f"{where}: key of another place")
                if block_idx < len(seq.block_hashes):
                    _check(seq.block_hashes[block_idx] == block.block_hash, f"{where}: chain hash differs")
                if block_idx <= len(seq.block_hashes):
                    parent_hash = seq.block_hashes[block_idx - 1] if block_idx else _ROOT_PARENT_HASH
                    _check(key_parent_hash == parent_hash, f"{where}: parent hash differs")
        for block in self._blocks:
            is_free = block.block_id in self._free
            _check(block.ref_count == num_refs[block.block_id], f"block {block.block_id}: ref count vs tables")
            _check(is_free == (block.ref_count == 0), f"block {block.block_id}: free list vs ref count")
            if block.block_hash is None:
                _check(block.cache_key is None, f"block {block.block_id}: key without hash")
                continue
            _check(self._index.get(block.block_hash) is block, f"block {block.block_id}: hash not indexed")
            _, parent_hash, block_tokens, extra_key = block.cache_key
            _check(block.num_tokens == bs and len(block_tokens) == bs, f"block {block.block_id}: not full")
            rehash = hash_block_tokens(parent_hash, block_tokens, extra_key)
            _check(rehash == block.block_hash, f"block {block.block_id}: stale key")
        for block_hash, block in self._index.items():
            _check(block.block_hash == block_hash, f"index entry {block_hash} points at block {block.block_id}")
        _check(len(self._free) == sum(r == 0 for r in num_refs), "free list length")
        _check(self._num_table_entries == sum(num_refs), "table entry counter")
        num_cached_free = sum(self._blocks[b].block_hash is not None for b in self._free)
        _check(self._num_cached_free == num_cached_free, "cached-free counter")
        num_used_slots = sum(b.num_tokens for b in self._blocks if b.ref_count)
        _check(self._num_used_slots == num_used_slots, "used slot counter")

    # ---- internals ----------------------------------------------------------------------------

    def _get_seq(self, seq_id: Hashable) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown `seq_id` {seq_id!r}: allocate it first")
        return seq

    def _get_block(self, block_id: BlockId) -> _Block:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"`block_id` must be in [0, {self.num_blocks}), got {block_id}")
        return self._blocks[block_id]

    def _find_cached_blocks(
        self, token_ids: Sequence[int], extra_key: Hashable | None
    ) -> tuple[list[_Block], list[BlockHash]]:
        """Longest run of leading full blocks served by the index, capped below the last token; and their hashes."""
        blocks: list[_Block] = []
        hashes: list[BlockHash] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        bs = self.block_size
        num_blocks = (len(token_ids) - 1) // bs
        tuples, chain, num_known = self._known_chain(token_ids, num_blocks, extra_key)
        parent_hash = _ROOT_PARENT_HASH
        index_get = self._index.get  # once per prompt block at each admission: the fewest lookups
        for block_idx in range(num_blocks):
            if block_idx < num_known:
                block_tokens, block_hash = tuples[block_idx], chain[block_idx]
            else:
                block_tokens = tuple(token_ids[block_idx * bs : (block_idx + 1) * bs])
                block_hash = hash_block_tokens(parent_hash, block_tokens, extra_key)
                tuples.append(block_tokens)
                chain.append(block_hash)
            block = index_get(block_hash)
            if block is None or block.cache_key != (block_idx, parent_hash, block_tokens, extra_key):
                break  # a miss, or a hash collision: also a miss
            blocks.append(block)
            hashes.append(block_hash)
            parent_hash = block_hash
        self._last_chain = (extra_key, list(token_ids[: len(tuples) * bs]), tuples, chain)
        return blocks, hashes

    def _known_chain(
        self, token_ids: Sequence[int], num_blocks: int, extra_key: Hashable | None
    ) -> tuple[list[tuple[int, ...]], list[BlockHash], int]:
        """The token tuples and chain hashes of the leading blocks (at most ``num_blocks``) that ``token_ids`` (a
        list) shares with the last lookup's prompt (same ``extra_key``), as new lists; and how many blocks that is."""
        last = self._last_chain
        if last is None or last[0] != extra_key or type(token_ids) is not list:
            return [], [], 0
        _, last_ids, last_tuples, last_chain = last
        bs = self.block_size
        num_known = min(num_blocks, len(last_tuples))
        if token_ids[: num_known * bs] != last_ids[: num_known * bs]:  # one compare when the whole run is shared
            same = 0
            while same < num_known and token_ids[same * bs : (same + 1) * bs] == last_ids[same * bs : (same + 1) * bs]:
                same += 1
            num_known = same
        return last_tuples[:num_known], last_chain[:num_known], num_known

    def _num_blocks_to_take(self, token_ids: Sequence[int], extra_key: Hashable | None) -> int | None:
        """Free-list blocks ``allocate`` would take (new blocks + cached-free hits), None if too many."""
        hit_blocks, _ = self._find_cached_blocks(token_ids, extra_key)
        num_take = math.ceil(len(token_ids) / self.block_size) - len(hit_blocks)
        num_take += sum(b.ref_count == 0 for b in hit_blocks)
        return num_take if num_take <= len(self._free) else None

    def _num_blocks_to_append(self, seq: _Seq, num_new: int) -> int:
        num_blocks = math.ceil((seq.num_tokens + num_new) / self.block_size) - len(seq.block_table)
        is_cow = num_new > 0 and seq.num_tokens % self.block_size and self._blocks[seq.block_table[-1]].ref_count > 1
        return num_blocks + bool(is_cow)

    def _touch(self, block: _Block) -> None:
        """Ref += 1 on a prefix hit; a cached-free block leaves the free list."""
        if block.ref_count == 0:
            del self._free[block.block_id]
            self._num_cached_free -= 1
            self._num_used_slots += block.num_tokens
        block.ref_count += 1

    def _pop_free(self) -> _Block:
        """Take the head of the free list (evicting its hash) as an empty block with ref 1."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            del self._index[block.block_hash]
            block.block_hash = block.cache_key = None
            self._num_cached_free -= 1
        block.ref_count = 1
        block.num_tokens = 0
        return block

    def _release(self, block: _Block) -> None:
        """Ref -= 1; at 0 the block joins the free list: at the tail while it carries a hash, else at the head."""
        block.ref_count -= 1
        if block.ref_count:
            return
        self._num_used_slots -= block.num_tokens
        self._free[block.block_id] = None  # tail
        if block.block_hash is None:
            self._free.move_to_end(block.block_id, last=False)  # head: reuse before evicting cached blocks
        else:
            self._num_cached_free += 1

    def _fill(self, block: _Block, num_tokens: int) -> int:
        block.num_tokens += num_tokens
        self._num_used_slots += num_tokens
        return num_tokens

    def _cache_full_blocks(self, seq_id: Hashable, seq: _Seq, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash the sequence's full blocks within ``num_tokens`` not hashed yet; index the new contents.

        A block whose hash is already indexed (the same content computed twice, or a collision)
        stays out of the index: one block per hash, so the index never points at a block that
        may be overwritten. Its chain hash is still recorded so later blocks can be indexed.
        """
        bs = self.block_size
        first_idx, end_idx = len(seq.block_hashes), num_tokens // bs
        if first_idx >= end_idx:
            return
        _check_token_ids(seq_id, token_ids, first_idx * bs, end_idx * bs)
        parent_hash = seq.block_hashes[-1] if seq.block_hashes else _ROOT_PARENT_HASH
        for block_idx in range(first_idx, end_idx):
            block_tokens = tuple(token_ids[block_idx * bs : (block_idx + 1) * bs])
            block_hash = hash_block_tokens(parent_hash, block_tokens, seq.extra_key)
            block = self._blocks[seq.block_table[block_idx]]
            if block.block_hash is None:
                if block_hash not in self._index:
                    block.block_hash = block_hash
                    block.cache_key = (block_idx, parent_hash, block_tokens, seq.extra_key)
                    self._index[block_hash] = block
            elif block.block_hash != block_hash:
                # Shared with the sequence that indexed it (fork): same position, so the same tokens.
                raise ValueError(
                    f"`token_ids` of seq {seq_id!r} differ from the tokens its block {block_idx} "
                    f"(block id {block.block_id}) was cached with; pass this sequence's own token list"
                )
            seq.block_hashes.append(block_hash)
            parent_hash = block_hash


def _check_token_ids(seq_id: Hashable, token_ids: Sequence[int], start: int, end: int) -> None:
    """Raise if a token in ``token_ids[start:end]`` is not a real id (< 0)."""
    window = token_ids[start:end]
    if len(window) and min(window) < 0:
        pos, bad = next((start + i, t) for i, t in enumerate(window) if t < 0)
        raise ValueError(f"`token_ids` of seq {seq_id!r} must be real token ids (>= 0), got {bad} at position {pos}")


def _check_num_new_tokens(num_new_tokens: int) -> None:
    if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int):
        raise TypeError(f"`num_new_tokens` must be an int (a token count), got {type(num_new_tokens).__name__}")
    if num_new_tokens < 0:
        raise ValueError(f"`num_new_tokens` must be >= 0, got {num_new_tokens}")


def _check_num_tokens_to_keep(seq_id: Hashable, seq: _Seq, num_tokens: int) -> None:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"`num_tokens` must be an int (a token count), got {type(num_tokens).__name__}")
    if not 1 <= num_tokens <= seq.num_tokens:
        raise ValueError(
            f"`num_tokens` must be in [1, {seq.num_tokens}] for seq {seq_id!r}, got {num_tokens} "
            "(free() the sequence to drop every token)"
        )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"bug in hf_paged: BlockPool invariant broken: {message}")
