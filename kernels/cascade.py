"""Shared-prefix ("cascade") decode attention: keys every sequence shares are read once per KV head.

When the decode rows of a step share their leading physical KV blocks (a common system prompt with prefix
caching, or the ``n`` samples of one prompt), the plain split-K decode kernel (kernels/split_decode.py) streams those
blocks once per sequence. Here the attention of each row is cut at ``prefix_len`` (FlashInfer's cascade
attention, vLLM v1's cascade for decode):

    keys of row s:  [ 0 ........ prefix_len )[ prefix_len ......... seq_len[s] )
                      shared prefix: this kernel  own suffix: the split-K decode kernel
                      one program per BLOCK_M     one program per (sequence, KV head, split)
                      rows of all sequences

``_shared_prefix_kernel``, grid ``(cdiv(num_seqs * group, BLOCK_M), num_kv_heads, num_prefix_splits)``: the query
rows of every sequence of one KV head (row r -> sequence r // group, query head kv_head * group + r % group,
``BLOCK_M`` rows a program) attend to the prefix keys through row 0 of ``block_tables``: the prefix blocks are
the same physical blocks in every row (the caller's contract), so each K/V tile is loaded once for ``BLOCK_M``
rows instead of once per row. Row s sees the keys ``[0, min(prefix_len, seq_len[s]))``: a row whose whole context
lies in the prefix works, and a padding row (``seq_len == 0``) sees nothing. Each split writes a partial
(normalized acc, log-sum-exp in the log2 domain) into the partial slots after the decode kernel's own splits,
and the decode kernel's merge combines them all; or, when the decode kernel runs one split, into the first slots,
before the decode kernel, which folds them into its own softmax (kernels/split_decode.py). ``prefix_len`` is a device
int32 scalar (shape [1]): a CUDA graph captured once serves every prefix length, and with ``prefix_len == 0`` every
program returns at once and no prefix partial is read (the result is exactly the plain decode).

Not covered (the caller passes no prefix): sliding-window layers (their window already bounds what each row
reads, and a window cutting through the prefix would need a per-row lower bound here). Soft capping is applied.
Attention sinks are not applied here: this kernel's partials hold keys only, and the sink joins once, where every
partial of a row meets (the merge, or the one-split fold; kernels/split_decode.py). FP8 caches (``KV_FP8``,
kernels/kv_quant.py): with a bf16 or fp16 query the dots run in fp16, as in the decode kernel
(kernels/split_decode.py): K/V tiles convert to fp16 as they load (exact; one instruction for two values), a bf16
query once per program, clamped to +-65504, and the probabilities for the P.V dot (an fp32 query keeps fp32 dots);
the KV head's ``k_scale`` joins the score scale and its ``v_scale`` multiplies the partial's accumulator.

Bytes model (KV bytes read per decode step; Qwen3-0.6B: 28 layers, 8 KV heads, head_dim 128, bf16, so a key
costs 8 * 128 * 2 B * 2 (K and V) = 4 KiB per layer). The bench's "prefix" workload: ~200 decode rows sharing a
341-token prompt prefix, of which 336 tokens fill 21 blocks of 16 (the prefix cache shares full blocks only), and
each row's own ~15-125 keys (5 prefix tokens in its first own block, 10-40 unique prompt tokens, 20-80 outputs):
- plain decode: every row streams the 336 shared keys: 200 * 336 * 4 KiB = 275 MB per layer, plus ~49 MB of own keys
  (200 rows * ~60 keys): 324 MB per layer, 9.1 GB per step, 2.7 ms at the H100's ~3.35 TB/s.
- cascade: the prefix is streamed once per KV head per ``BLOCK_M``-row tile: 1.4 MB per layer from HBM (the
  ``cdiv(200 * 2, 64) = 7`` row tiles of a head reread it, mostly from L2), plus the partials: each row and query
  head writes and reads one fp32 [head_dim] partial per prefix split and one for its own keys (2 prefix splits
  run: 200 * 16 heads * 512 B * 2 * 3 = 9.8 MB per layer), plus the same ~49 MB of own keys: ~60 MB per layer,
  1.7 GB per step, 0.5 ms.
The shared part drops ~25x and a decode step's KV traffic ~5x. With the weights (1.2 GB in bf16, read once a step
either way) a full-batch decode step moves ~2.9 GB instead of ~10.3 GB: predicted ~3x faster while ~200 rows run
(less at the ramp-up and tail of the run, where fewer rows share the prefix; compute, ~0.24 TFLOP a step at 200
rows, and launch overheads are not in this model).
"""

import triton
import triton.language as tl

from .kv_quant_triton import from_kv
from .launch import Launcher, cdiv, next_power_of_2

__all__ = ["PREFIX", "choose_num_prefix_splits", "block_m_for"]

MAX_NUM_PREFIX_SPLITS = 16
# Each prefix split adds one partial per row and query head, so a split covers at least this many keys: 256 is the
# fastest at large batches on the H100 (benchmarks/tools/decode_sweep.py --prefix-len 336); the engine takes
# shared-prefix steps from ~48 rows.
MIN_KEYS_PER_PREFIX_SPLIT = 256
# Programs to aim for per SM, as the decode kernel does.
PROGRAMS_PER_SM = 4


def block_m_for(num_rows: int, head_dim_pad: int) -> int:
    """Query rows per program: 64 (32 at head_dim 256, to keep acc in registers), fewer for a small batch (>= 16,
    the tensor-core minimum)."""
    top = 32 if head_dim_pad > 128 else 64
    return min(top, max(16, next_power_of_2(max(num_rows, 1))))


def choose_num_prefix_splits(max_prefix_len: int, num_row_tiles: int, num_kv_heads: int, num_sms: int) -> int:
    """Host-side split count of the shared-prefix kernel's grid (no device sync: CUDA-graph safe).

    Aim for ``PROGRAMS_PER_SM * num_sms`` programs over ``num_row_tiles * num_kv_heads * splits``, with at least
    ``MIN_KEYS_PER_PREFIX_SPLIT`` keys of ``max_prefix_len`` a split and at most ``MAX_NUM_PREFIX_SPLITS``. The
    kernel uses only as many of them as the actual prefix fills (``max_prefix_len`` is a bound, not the length).

    Returns:
        The number of prefix splits, in ``[1, MAX_NUM_PREFIX_SPLITS]``.
    """
    wanted = cdiv(PROGRAMS_PER_SM * num_sms, max(num_row_tiles * num_kv_heads, 1))
    by_prefix = max(cdiv(max_prefix_len, MIN_KEYS_PER_PREFIX_SPLIT), 1)
    return max(1, min(wanted, by_prefix, MAX_NUM_PREFIX_SPLITS))


# Sizes that change from step to step are not specialised (see _paged_decode_kernel): the row count (the batch),
# the split counts and the strides that follow them.
@triton.jit(do_not_specialize=["num_rows", "num_prefix_splits", "split_offset", "stride_pls", "stride_plh"])
def _shared_prefix_kernel(
    # pointers
    query_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq], int32; only row 0 is read (the shared blocks)
    seq_lens_ptr,  # [num_seqs], int32; 0 = padding row
    prefix_len_ptr,  # [1], int32: keys [0, prefix_len) are shared by every row
    partial_acc_ptr,  # [num_seqs, num_heads, num_partials, head_dim], fp32
    partial_lse_ptr,  # [num_seqs, num_heads, num_partials], fp32 (log2 domain)
    k_scale_ptr,  # [1] or [num_kv_heads], fp32: KV_FP8
    v_scale_ptr,  # [1] or [num_kv_heads], fp32: KV_FP8
    # strides
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_btb,
    stride_pas,
    stride_pah,
    stride_pap,
    stride_pad,
    stride_pls,
    stride_plh,
    stride_plp,
    stride_ks,  # 0: one scale for every KV head; 1: a scale per KV head
    stride_vs,
    # sizes
    num_rows,  # num_seqs * GROUP
    num_prefix_splits,
    split_offset,  # partial slot of prefix split 0 (the decode kernel's splits come first)
    scale_log2,  # softmax scale * log2(e)
    cap_in,  # scale / soft_cap; used only when USE_SOFT_CAP
    cap_out,  # soft_cap * log2(e); used only when USE_SOFT_CAP
    # meta-parameters
    GROUP: tl.constexpr,  # num_heads // num_kv_heads
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # keys per cache block
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per tile
    ONE_BLOCK_PER_TILE: tl.constexpr,  # BLOCK_SIZE % BLOCK_N == 0: one block-table entry per tile
    USE_SOFT_CAP: tl.constexpr,
    MIN_TILES_PER_SPLIT: tl.constexpr,  # a split streams at least this many tiles
    DOT_FP32: tl.constexpr,  # upcast dot operands (interpreter bf16 tl.dot bug), False on GPU
    LAUNCH_DEPENDENTS: tl.constexpr,  # the split kernel is launched with PDL: let it start (it waits for our partials)
    KV_FP8: tl.constexpr,  # fp8 caches: fp16 dots for a bf16/fp16 query, the scales per KV head (kernels/kv_quant.py)
):
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    row_tile_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1)
    split_idx = tl.program_id(2)

    prefix_len = tl.load(prefix_len_ptr)
    if prefix_len <= 0:  # no shared prefix this step: no prefix partial is read
        return
    if KV_FP8:  # the KV head's k_scale joins each score's scale; v_scale multiplies acc after the last value
        k_scale = tl.load(k_scale_ptr + kv_head_idx * stride_ks)
        scale_log2 = scale_log2 * k_scale
        cap_in = cap_in * k_scale

    offs_m = row_tile_idx * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of this program
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_mask = offs_m < num_rows  # rows past the last sequence's
    d_mask = offs_d < HEAD_DIM  # padded head_dim lanes
    seq_idx = (offs_m // GROUP).to(tl.int64)  # [BLOCK_M]
    head_idx = kv_head_idx * GROUP + offs_m % GROUP  # [BLOCK_M]
    seq_len = tl.load(seq_lens_ptr + seq_idx, mask=m_mask, other=0)  # [BLOCK_M]
    key_hi = tl.minimum(seq_len, prefix_len)  # [BLOCK_M]: row r sees the prefix keys [0, key_hi[r])

    # Split this program's prefix keys (those of its longest row) on tile boundaries, as the decode kernel
    # splits a context: the grid's num_prefix_splits is a bound; only as many as hold MIN_TILES_PER_SPLIT run.
    tile_key_hi = tl.max(key_hi, axis=0)  # keys of the program's longest row
    num_tiles = tl.cdiv(tile_key_hi, BLOCK_N)
    splits_used = tl.minimum(num_prefix_splits, tl.maximum(tl.cdiv(num_tiles, MIN_TILES_PER_SPLIT), 1))
    tiles_per_split = tl.cdiv(num_tiles, splits_used)
    split_tile_lo = split_idx * tiles_per_split
    split_tile_hi = tl.minimum(split_tile_lo + tiles_per_split, num_tiles)
    slot = split_offset + split_idx
    pl_ptrs = partial_lse_ptr + seq_idx * stride_pls + head_idx * stride_plh + slot * stride_plp  # [BLOCK_M]
    if split_tile_lo >= split_tile_hi:  # a split the prefix does not reach (the grid is sized for a bound): neutral
        tl.store(pl_ptrs, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=m_mask)
        return

    # q: [BLOCK_M, HEAD_DIM_PAD]; rows past num_rows and padded lanes are 0.
    q_ptrs = query_ptr + seq_idx[:, None] * stride_qs + head_idx[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8 and q.dtype == tl.bfloat16:
        # fp16 dots, as the decode kernel: fp8 -> fp16 is one instruction for two values, exact. q saturates to
        # fp16's finite range (NaN stays NaN); values in fp16's normal range convert exactly. Under DOT_FP32 the
        # dots take these same values in fp32.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
    if DOT_FP32:
        q = q.to(tl.float32)

    k_head_ptr = k_cache_ptr + kv_head_idx * stride_kh
    v_head_ptr = v_cache_ptr + kv_head_idx * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    for tile_idx in range(split_tile_lo, split_tile_hi):
        key_idx = tile_idx * BLOCK_N + offs_n  # [BLOCK_N] positions in the prefix
        n_mask = key_idx < tile_key_hi  # keys some row of the program sees; the rest are not loaded
        # Row 0's table holds the shared blocks (the same physical ids in every row's table).
        if ONE_BLOCK_PER_TILE:
            block_id = tl.load(block_tables_ptr + ((tile_idx * BLOCK_N) // BLOCK_SIZE) * stride_btb)
            k_offset = block_id.to(tl.int64) * stride_kb + ((tile_idx * BLOCK_N) % BLOCK_SIZE + offs_n) * stride_kt
            v_offset = block_id.to(tl.int64) * stride_vb + ((tile_idx * BLOCK_N) % BLOCK_SIZE + offs_n) * stride_vt
        else:
            block_ids = tl.load(block_tables_ptr + (key_idx // BLOCK_SIZE) * stride_btb, mask=n_mask, other=0)
            k_offset = block_ids.to(tl.int64) * stride_kb + (key_idx % BLOCK_SIZE) * stride_kt
            v_offset = block_ids.to(tl.int64) * stride_vb + (key_idx % BLOCK_SIZE) * stride_vt
        kv_mask = n_mask[:, None] & d_mask[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        # k: [BLOCK_N, HEAD_DIM_PAD]
        k = tl.load(k_head_ptr + k_offset[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        k = from_kv(k, q.dtype)  # fp8 -> fp16 (exact; fp32 for an fp32 query or under DOT_FP32); else no conversion
        # scores: [BLOCK_M, BLOCK_N]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        if USE_SOFT_CAP:
            # soft_cap * tanh(scale * s / soft_cap), written with exp as in the decode kernel (never NaN).
            scores = cap_out * (1.0 - 2.0 / (tl.exp(2.0 * cap_in * scores) + 1.0))
        else:
            scores = scores * scale_log2
        # Each row sees only its own keys: a row whose context ends inside the prefix stops there.
        live = key_idx[None, :] < key_hi[:, None]  # [BLOCK_M, BLOCK_N]
        scores = tl.where(live, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BLOCK_M]
        # A row with no live key yet (its context is shorter, or padding) keeps m = -inf: shift by 0, not -inf,
        # so that exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
        p = tl.exp2(scores - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # v: [BLOCK_N, HEAD_DIM_PAD]
        v = tl.load(v_head_ptr + v_offset[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        v = from_kv(v, q.dtype)  # as k
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head_idx * stride_vs)
    # A row with no prefix key in this split writes the neutral lse (-inf) and no acc (the merge skips it).
    has_keys = l_i > 0.0  # [BLOCK_M]
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))  # [BLOCK_M]
    pa_ptrs = (
        partial_acc_ptr
        + seq_idx[:, None] * stride_pas
        + head_idx[:, None] * stride_pah
        + slot * stride_pap
        + offs_d[None, :] * stride_pad
    )
    tl.store(pa_ptrs, acc, mask=(m_mask & has_keys)[:, None] & d_mask[None, :])
    tl.store(pl_ptrs, lse, mask=m_mask)


# Positional launch (kernels/launch.py): arguments in the kernel's parameter order.
PREFIX = Launcher(_shared_prefix_kernel)
