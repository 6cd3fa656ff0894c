"""Loading a V tile from a keys-minor cache (an FP8 pool's V, kernels/kv_quant.py ``new_cache``) for the P.V dot.

A keys-minor block stores each KV head's V as ``[head_dim, block_size]``: a block's keys are contiguous for every
channel. The attention kernels' P.V dot reduces over keys, and its fp16 operand takes pairs of consecutive keys of
one channel; from keys-minor bytes those load as words, where a ``[keys, head_dim]`` row layout of 8-bit values
takes one byte load per value (sm_90 has no transposing shared-memory load of 8-bit values).

``load_v_tile`` reads a tile of ``BLOCK_N`` keys as whole blocks, ``[BLOCK_N // BLOCK_SIZE, BLOCK_SIZE, BLOCK_D]``
(or a slice of one block when ``BLOCK_SIZE >= BLOCK_N``), so the compiler sees runs of ``BLOCK_SIZE`` contiguous keys
and vectorizes along them. A key mask would break those runs, so masking works on whole blocks: a block outside the
live range reads block 0 instead of its table entry (which may be stale), and the masked keys' values are zeroed
after the load (a stale slot may hold NaN, and the dot's 0 * NaN would be NaN).
"""

import triton
import triton.language as tl

__all__ = ["load_v_tile"]


@triton.jit
def load_v_tile(
    v_head_ptr,  # v_cache at this KV head: [num_blocks, block_size, head_dim] through the strides below
    table_row_ptr,  # the sequence's block-table row
    stride_table_b,
    start_n,  # the tile's first key position: a multiple of BLOCK_N
    lo,  # MASKED: keys below lo are masked
    hi,  # MASKED: keys from hi on are masked
    stride_vb,
    stride_vt,  # 1 (keys-minor)
    stride_vd,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # keys per cache block; BLOCK_N % BLOCK_SIZE == 0 or BLOCK_SIZE % BLOCK_N == 0
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    MASKED: tl.constexpr,  # keys outside [lo, hi) may be in the tile; else every key is live
):
    """The V tile of keys ``[start_n, start_n + BLOCK_N)``: ``[BLOCK_N, BLOCK_D]`` in the cache's dtype, with 0 for
    masked keys and padded channels."""
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = offs_d < HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    if BLOCK_SIZE >= BLOCK_N:
        # The tile is a slice of one block, whose table entry is live (the tile holds a live key). The slice's first
        # key in the block is written as a multiple of BLOCK_N, so the compiler knows the loads are aligned.
        block_id = tl.load(table_row_ptr + (start_n // BLOCK_SIZE) * stride_table_b).to(tl.int64)
        in_block = ((start_n // BLOCK_N) % (BLOCK_SIZE // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ptrs = v_head_ptr + block_id * stride_vb + in_block[:, None] * stride_vt + offs_d[None, :] * stride_vd
        if HEAD_DIM < BLOCK_D:
            v = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
        else:
            v = tl.load(ptrs)
    else:
        NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
        blocks = start_n // BLOCK_SIZE + tl.arange(0, NB)  # [NB]: the tile's blocks in the sequence
        if MASKED:
            live = (blocks * BLOCK_SIZE < hi) & ((blocks + 1) * BLOCK_SIZE > lo)
            block_ids = tl.load(table_row_ptr + blocks * stride_table_b, mask=live, other=0)
        else:
            block_ids = tl.load(table_row_ptr + blocks * stride_table_b)
        offs_t = tl.arange(0, BLOCK_SIZE)
        # ptrs: [NB, BLOCK_SIZE, BLOCK_D]
        ptrs = (
            v_head_ptr + block_ids.to(tl.int64)[:, None, None] * stride_vb + offs_t[None, :, None] * stride_vt
            + offs_d[None, None, :] * stride_vd
        )  # fmt: skip
        if HEAD_DIM < BLOCK_D:
            v = tl.load(ptrs, mask=d_mask[None, None, :], other=0.0)
        else:
            v = tl.load(ptrs)
        v = tl.reshape(v, [BLOCK_N, BLOCK_D])
    if MASKED:
        v = tl.where(((offs_n >= lo) & (offs_n < hi))[:, None], v, 0.0)
    return v
