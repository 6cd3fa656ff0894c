"""The prefix cache's index: chain hash -> the full block that holds those tokens.

A lookup walks a prompt's full blocks from the first, hashing each (``hash_block_tokens``, chained) and
looking it up, and stops at the first miss. Collision policy: a hit also compares the block's stored key
``(block_idx, parent_hash, token_ids, extra_key)``, so two blocks whose 64-bit hashes collide are a miss,
never a wrong block. What is left is the parent hash: a wrong hit would need two different prefixes with
equal xxh64 chain values at the same depth, ~1 in 2**64 per pair.

Pure Python (stdlib + xxhash, no torch).
"""

from collections.abc import Hashable, Sequence

from hf_paged.core.block import Block, BlockId
from hf_paged.core.prefix_hash import ROOT_PARENT_HASH, BlockHash, HashFn, hash_block_tokens


class PrefixIndex:
    """Full, immutable blocks by chain hash, for ``BlockPool``; the pool decides when blocks enter and leave.

    Invariants (``check_invariants``): one block per hash; an entry's block carries that hash and a stored key
    that re-hashes to it; a block carries a hash only while it is indexed, and is then full.

    Args:
        block_size: tokens per block.
        hash_fn: the block hash; ``hash_block_tokens`` unless a test forces collisions.
    """

    def __init__(self, block_size: int, hash_fn: HashFn = hash_block_tokens):
        self.block_size = block_size
        self.hash_fn = hash_fn
        self._blocks: dict[BlockHash, Block] = {}
        # The chain of the last lookup: (extra_key, its leading token ids (a copy), each of their full blocks' token
        # tuple and chain hash). A pure function of the tokens: a prompt that starts with the same blocks (a shared
        # system prompt) reuses them instead of hashing them again; the index is still looked up.
        self._last_chain: tuple[Hashable, list[int], list[tuple[int, ...]], list[BlockHash]] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def find_cached_blocks(
        self, token_ids: Sequence[int], extra_key: Hashable | None
    ) -> tuple[list[Block], list[BlockHash]]:
        """The longest run of leading full blocks of a prompt that the index holds, and their chain hashes.

        Capped below the last token, so that it is always computed. A prompt given as a list (the engine's)
        reuses the hashes of the blocks it shares with the last lookup's list; any other sequence is hashed in
        full.
        """
        blocks: list[Block] = []
        hashes: list[BlockHash] = []
        bs = self.block_size
        num_blocks = (len(token_ids) - 1) // bs
        tuples, chain, num_known = self._known_chain(token_ids, num_blocks, extra_key)
        parent_hash = ROOT_PARENT_HASH
        index_get = self._blocks.get  # once per prompt block at each admission: the fewest lookups
        for block_idx in range(num_blocks):
            if block_idx < num_known:
                block_tokens, block_hash = tuples[block_idx], chain[block_idx]
            else:
                block_tokens = tuple(token_ids[block_idx * bs : (block_idx + 1) * bs])
                block_hash = self.hash_fn(parent_hash, block_tokens, extra_key)
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

    def cache_full_blocks(
        self,
        seq_id: Hashable,
        blocks: Sequence[Block],
        block_table: Sequence[BlockId],
        block_hashes: list[BlockHash],
        token_ids: Sequence[int],
        num_full_blocks: int,
        extra_key: Hashable | None,
    ) -> None:
        """Hash a sequence's blocks ``len(block_hashes) .. num_full_blocks - 1``; index the contents not indexed yet.

        A block whose hash is already indexed (the same content computed twice, or a collision) stays out of the
        index: one block per hash, so the index never points at a block that may be overwritten. Its chain hash is
        still recorded so later blocks can be indexed.

        Args:
            seq_id: the sequence, for error messages.
            blocks: the pool's blocks, by id.
            block_table: the sequence's block ids, at least ``num_full_blocks`` of them.
            block_hashes: the sequence's chain hashes so far; each new one is appended as it is computed.
            token_ids: the sequence's token ids, at least ``num_full_blocks * block_size`` of them.
            num_full_blocks: hash the blocks before this one.
            extra_key: the sequence's extra key.

        Raises:
            ValueError: a block indexed already holds other tokens than ``token_ids`` says.
        """
        bs = self.block_size
        parent_hash = block_hashes[-1] if block_hashes else ROOT_PARENT_HASH
        for block_idx in range(len(block_hashes), num_full_blocks):
            block_tokens = tuple(token_ids[block_idx * bs : (block_idx + 1) * bs])
            block_hash = self.hash_fn(parent_hash, block_tokens, extra_key)
            block = blocks[block_table[block_idx]]
            if block.block_hash is None:
                if block_hash not in self._blocks:
                    block.block_hash = block_hash
                    block.cache_key = (block_idx, parent_hash, block_tokens, extra_key)
                    self._blocks[block_hash] = block
            elif block.block_hash != block_hash:
                # Shared with the sequence that indexed it (fork): same position, so the same tokens.
                raise ValueError(
                    f"`token_ids` of seq {seq_id!r} differ from the tokens its block {block_idx} "
                    f"(block id {block.block_id}) was cached with; pass this sequence's own token list"
                )
            block_hashes.append(block_hash)
            parent_hash = block_hash

    def remove(self, block: Block) -> None:
        """Take an indexed block out (it is about to be overwritten): it no longer carries a hash."""
        del self._blocks[block.block_hash]
        block.block_hash = block.cache_key = None

    def clear(self) -> list[Block]:
        """Take every block out; returns them."""
        blocks = list(self._blocks.values())
        for block in blocks:
            block.block_hash = block.cache_key = None
        self._blocks.clear()
        return blocks

    def check_invariants(self, blocks: Sequence[Block]) -> None:
        """Verify the class invariants over the pool's ``blocks``. O(blocks): for tests.

        Raises:
            RuntimeError: an invariant is broken (a bug in hf_paged).
        """
        for block in blocks:
            if block.block_hash is None:
                _check(block.cache_key is None, f"block {block.block_id}: key without hash")
                continue
            _check(self._blocks.get(block.block_hash) is block, f"block {block.block_id}: hash not indexed")
            _, parent_hash, block_tokens, extra_key = block.cache_key
            full = block.num_tokens == self.block_size and len(block_tokens) == self.block_size
            _check(full, f"block {block.block_id}: not full")
            rehash = self.hash_fn(parent_hash, block_tokens, extra_key)
            _check(rehash == block.block_hash, f"block {block.block_id}: stale key")
        for block_hash, block in self._blocks.items():
            _check(block.block_hash == block_hash, f"index entry {block_hash} points at block {block.block_id}")

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


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"bug in hf_paged: PrefixIndex invariant broken: {message}")
