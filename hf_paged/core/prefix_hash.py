"""The prefix-cache hash of a full block: chained xxh64 over the token ids (formula in hf_paged.core.block_pool).

Pure Python (xxhash, no torch).
"""

import struct
from collections.abc import Hashable, Sequence
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", int)

HASH_SEED = 0x68665F7061676564  # b"hf_paged" read as a big-endian int
_ROOT_PARENT_HASH = BlockHash(0)  # h_{-1}, the "parent" of a sequence's first block
_PACKERS: dict[int, struct.Struct] = {}  # token count -> its compiled int64 format (no format string per block)


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_key: Hashable | None = None
) -> BlockHash:
    """Chained xxh64 of one full block: h_i = xxh64(h_{i-1} as 8 little-endian bytes + token ids as int64
    little-endian + repr(extra_key), seed=HASH_SEED). The collision policy is the caller's (BlockPool compares
    the stored key on every hit)."""
    packer = _PACKERS.get(len(token_ids))
    if packer is None:
        packer = _PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q")
    data = parent_hash.to_bytes(8, "little") + packer.pack(*token_ids)
    if extra_key is not None:
        data += repr(extra_key).encode()
    return BlockHash(xxhash.xxh64_intdigest(data, seed=HASH_SEED))
