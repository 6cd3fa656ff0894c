"""The prefix-cache hash of a full block: chained xxh64 over its token ids.

For full block ``i`` of a sequence::

    h_i = xxh64(h_{i-1}.to_bytes(8, "little")          # h_{-1} = ROOT_PARENT_HASH = 0
                + token ids of block i as int64 little-endian
                + (b"" if extra_key is None else repr(extra_key).encode()),
                seed=HASH_SEED)

Chaining makes a block's hash name its whole prefix, so one dict lookup per block finds a cached prefix.
``extra_key`` (an adapter id, a salt) must compare with ``==`` and have a stable ``repr``: str, int, or
tuples of them. Collision policy: the caller's; ``PrefixIndex`` compares the stored key on every hit.

Pure Python (xxhash, no torch).
"""

import struct
from collections.abc import Callable, Hashable, Sequence
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", int)
# (parent_hash, token_ids, extra_key) -> hash of the block; hash_block_tokens, or a stand-in in collision tests
HashFn = Callable[[BlockHash, Sequence[int], Hashable | None], BlockHash]

HASH_SEED = 0x68665F7061676564  # b"hf_paged" read as a big-endian int
ROOT_PARENT_HASH = BlockHash(0)  # h_{-1}, the "parent" of a sequence's first block
_PACKERS: dict[int, struct.Struct] = {}  # token count -> its compiled int64 format (no format string per block)


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_key: Hashable | None = None
) -> BlockHash:
    """The chain hash of one full block (formula in the module docstring).

    Args:
        parent_hash: the hash of the previous block of the sequence, ``ROOT_PARENT_HASH`` for the first.
        token_ids: the block's token ids, each in [0, 2**63).
        extra_key: mixed into the hash when not None (adapter id, salt).

    Returns:
        The 64-bit hash.
    """
    packer = _PACKERS.get(len(token_ids))
    if packer is None:
        packer = _PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q")
    data = parent_hash.to_bytes(8, "little") + packer.pack(*token_ids)
    if extra_key is not None:
        data += repr(extra_key).encode()
    return BlockHash(xxhash.xxh64_intdigest(data, seed=HASH_SEED))
