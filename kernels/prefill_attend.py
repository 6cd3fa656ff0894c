"""One tile slot of the varlen paged prefill kernel (kernels/prefill_kernel.py): ``attend_slot`` and its key steps.

Semantics (causal mask, sliding window, soft cap, GQA) and the cache layout are those of kernels/reference.py. Sequence
s carries ``q_len`` new tokens, the last ``q_len`` of its ``seq_lens[s]`` context tokens; K/V are read straight from
the cache blocks through the block table, never gathered into contiguous tensors.

A slot is ``BLOCK_M`` rows of one sequence for one KV head. The rows are the sequence's (new token, query head of the
KV head's group) pairs, token-major, so the ``GROUP`` query heads that share a KV head share every K/V tile load
(GQA/MQA without repeating K/V)::

    row r of tile t  ->  m = t * BLOCK_M + r,  token = m // GROUP,  head = kv_head * GROUP + m % GROUP

The slot walks the context in tiles of ``BLOCK_N`` keys, aligned to ``BLOCK_N``, from the sliding-window start of its
first token to the causal limit of its last token, in three ranges::

    lo             mid_lo                      mid_hi          hi
    |-- masked ----|-------- unmasked ---------|--- masked ----|
      window edge    every row sees every key    causal edge / end of context

Online softmax in fp32 (exp2 with log2(e) folded into the scores), fp32 accumulator. The unmasked interior tiles use a
fused update (no -inf guard, the scale folded into one FMA per score) when the scale is positive, else the exact update
of the masked tiles (the fused one needs scale > 0).

K/V are read through the block table, except that with ``CONTIG_KV`` (the launcher's ``key=/value=``) a fresh prompt
(no cached context) reads them from the contiguous new-token tensors instead. FP8 caches (``KV_FP8``,
kernels/kv_quant.py): with a bf16 or fp16 query the dots run in fp16, as in the decode kernel
(kernels/split_decode.py): K/V tiles convert to fp16 as they load (exact: every e4m3/e5m2 value is an fp16 value; one
instruction for two values), a bf16 query once per slot (clamped to fp16's finite range, +-65504, so a larger value
saturates instead of becoming inf; values in fp16's normal range convert exactly) and the probabilities for the P.V
dot; ``out`` keeps the query's dtype; an fp32 query keeps fp32 operands, as with an fp32 cache. The KV head's
``k_scale`` joins the score scale and its ``v_scale`` multiplies the accumulator after the last key; the launcher then
leaves ``CONTIG_KV`` off, so every sequence reads the cache and a prompt attends to the quantized values its later
decode steps read. With ``HAS_SINKS`` (gpt-oss) each query head's sink logit joins the softmax's denominator once,
after the last key.
"""

import triton
import triton.language as tl

from .kv_quant_triton import from_kv
from .v_tiles import load_v_tile

__all__ = ["attend_slot"]


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, BLOCK_D], fp32
    l_i,  # [BLOCK_M], fp32: running softmax denominator
    m_i,  # [BLOCK_M], fp32: running max of the (log2-scaled) scores
    q,  # [BLOCK_M, BLOCK_D]
    q_pos,  # [BLOCK_M], int32: context position of each row's token
    start_n,  # first key position of this tile; a multiple of BLOCK_N
    k_ptr,  # k_cache (paged) or key (CONTIG)
    v_ptr,  # v_cache (paged) or value (CONTIG)
    k_base,  # int64 offset of key position 0 of this KV head: kv_head * stride (+ q_start * stride_t if CONTIG)
    v_base,  # int64, as k_base for V
    stride_k_n,  # CONTIG: token stride of key
    stride_v_n,  # token stride of value (CONTIG), or of v_cache in a block (paged)
    table_row_ptr,  # this sequence's block table row (paged)
    ctx_len,
    qk_scale,  # scale (* log2(e) unless there is a soft cap)
    soft_cap,
    sliding_window,
    stride_cache_block,
    stride_cache_offset,
    stride_table_b,
    stride_v_block,  # paged: v_cache's block stride (K's is stride_cache_block)
    stride_v_d,  # V's head_dim stride (K's is 1)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    K_ROW_MAJOR: tl.constexpr,  # load K as [BLOCK_N, BLOCK_D] and transpose in registers (else as K^T)
    EXACT_SOFTMAX: tl.constexpr,  # interior tiles too take the exact update (scale <= 0); else the fused one
    CONTIG: tl.constexpr,  # K/V rows of key position n at k_base + n * stride_k_n (no block table)
    V_BLOCKS: tl.constexpr,  # paged, V keys-minor (an FP8 pool's): V tiles load as whole blocks (kernels/v_tiles.py)
):
    """One online-softmax step over the keys [start_n, start_n + BLOCK_N); returns (acc, l_i, m_i)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N], key positions
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    if MASKED:
        key_in_ctx = offs_n < ctx_len  # [BLOCK_N]
    else:
        key_in_ctx = tl.full([BLOCK_N], 1, tl.int1)  # interior tiles end at or before ctx_len
    d_mask = offs_d < HEAD_DIM  # [BLOCK_D], head_dim padded to a power of two

    if CONTIG:
        k_offs = k_base + offs_n.to(tl.int64) * stride_k_n  # [BLOCK_N], int64
        v_offs = v_base + offs_n.to(tl.int64) * stride_v_n  # [BLOCK_N], int64
    else:
        if BLOCK_SIZE % BLOCK_N == 0:
            # The whole tile lies in one cache block (start_n is a multiple of BLOCK_N): one table read.
            block_id = tl.load(table_row_ptr + (start_n // BLOCK_SIZE) * stride_table_b).to(tl.int64)
            slot_offs = block_id * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_offset  # [BLOCK_N]
            v_slot_offs = block_id * stride_v_block + (offs_n % BLOCK_SIZE) * stride_v_n  # [BLOCK_N]
        else:
            # The tile spans several cache blocks: one table read per key (same-block keys share it).
            block_ids = tl.load(table_row_ptr + (offs_n // BLOCK_SIZE) * stride_table_b, mask=key_in_ctx, other=0)
            slot_offs = block_ids.to(tl.int64) * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_offset
            v_slot_offs = block_ids.to(tl.int64) * stride_v_block + (offs_n % BLOCK_SIZE) * stride_v_n
        k_offs = k_base + slot_offs  # [BLOCK_N], int64
        v_offs = v_base + v_slot_offs  # [BLOCK_N], int64

    if K_ROW_MAJOR:
        k = tl.trans(
            tl.load(
                k_ptr + k_offs[:, None] + offs_d[None, :],
                mask=key_in_ctx[:, None] & d_mask[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
        )  # k: [BLOCK_D, BLOCK_N]
    else:
        kv_mask_t = key_in_ctx[None, :] & d_mask[:, None]  # [BLOCK_D, BLOCK_N]: real key, real dim
        k = tl.load(k_ptr + k_offs[None, :] + offs_d[:, None], mask=kv_mask_t, other=0.0)  # k: [BLOCK_D, BLOCK_N]
    k = from_kv(k, q.dtype)  # fp8 -> fp16 (exact; fp32 for an fp32 query); else no conversion
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    # s: [BLOCK_M, BLOCK_N], fp32
    if HAS_SOFT_CAP:
        # soft_cap * tanh(x / soft_cap), with tanh(y) = 1 - 2 / (exp(2y) + 1): saturates to +-1, no NaN.
        y = s * qk_scale / soft_cap
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * 1.4426950408889634
    if MASKED or EXACT_SOFTMAX:
        if not HAS_SOFT_CAP:
            s = s * qk_scale
        if MASKED:
            visible = key_in_ctx[None, :] & (offs_n[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
            if HAS_WINDOW:
                visible = visible & (q_pos[:, None] - offs_n[None, :] < sliding_window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # A row with no visible key so far has m_new == -inf; exp2(-inf - -inf) would be NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]; 0 when m_i == -inf
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]; 0 where masked
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    else:
        # Interior tile, fused softmax: every row sees all BLOCK_N finite scores, so m_new is finite and
        # needs no -inf guard (m_i == -inf before a row's first tile gives alpha = exp2(-inf) = 0). The scale
        # is folded into one FMA per score: max(s) * scale == max(s * scale) as scale > 0.
        if HAS_SOFT_CAP:
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]; s already log2-scaled
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
        if HAS_SOFT_CAP:
            p = tl.exp2(s - m_i[:, None])  # [BLOCK_M, BLOCK_N]
        else:
            p = tl.exp2(s * qk_scale - m_i[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i + tl.sum(p, 1)

    if V_BLOCKS:
        v = load_v_tile(v_ptr + v_base, table_row_ptr, stride_table_b, start_n, 0, ctx_len, stride_v_block,
                        stride_v_n, stride_v_d, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, MASKED)  # fmt: skip
    else:
        v = tl.load(v_ptr + v_offs[:, None] + offs_d[None, :] * stride_v_d, mask=key_in_ctx[:, None] & d_mask[None, :],
                    other=0.0)  # fmt: skip
    v = from_kv(v, q.dtype)  # v: [BLOCK_N, BLOCK_D]; fp8 -> fp16 as k
    if DOT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit
def _attend_ranges(
    acc,  # [BLOCK_M, BLOCK_D], fp32
    l_i,  # [BLOCK_M], fp32
    m_i,  # [BLOCK_M], fp32
    q,  # [BLOCK_M, BLOCK_D]
    q_pos,  # [BLOCK_M], int32
    lo,
    mid_lo,
    mid_hi,
    hi,
    k_ptr,
    v_ptr,
    k_base,
    v_base,
    stride_k_n,
    stride_v_n,
    table_row_ptr,
    ctx_len,
    qk_scale,
    soft_cap,
    sliding_window,
    stride_cache_block,
    stride_cache_offset,
    stride_table_b,
    stride_v_block,
    stride_v_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    K_ROW_MAJOR: tl.constexpr,
    EXACT_SOFTMAX: tl.constexpr,
    CONTIG: tl.constexpr,
    V_BLOCKS: tl.constexpr,
):
    """The three key ranges of the module docstring, in order; returns (acc, l_i, m_i)."""
    for start_n in range(lo, mid_lo, BLOCK_N):  # window edge
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, k_ptr, v_ptr, k_base, v_base, stride_k_n, stride_v_n,
            table_row_ptr, ctx_len, qk_scale, soft_cap, sliding_window, stride_cache_block, stride_cache_offset,
            stride_table_b, stride_v_block, stride_v_d, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, True,
            HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, CONTIG, V_BLOCKS,
        )  # fmt: skip
    for start_n in range(mid_lo, mid_hi, BLOCK_N):  # interior: no mask
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, k_ptr, v_ptr, k_base, v_base, stride_k_n, stride_v_n,
            table_row_ptr, ctx_len, qk_scale, soft_cap, sliding_window, stride_cache_block, stride_cache_offset,
            stride_table_b, stride_v_block, stride_v_d, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, False,
            HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, CONTIG, V_BLOCKS,
        )  # fmt: skip
    for start_n in range(mid_hi, hi, BLOCK_N):  # causal edge
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, k_ptr, v_ptr, k_base, v_base, stride_k_n, stride_v_n,
            table_row_ptr, ctx_len, qk_scale, soft_cap, sliding_window, stride_cache_block, stride_cache_offset,
            stride_table_b, stride_v_block, stride_v_d, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, True,
            HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, CONTIG, V_BLOCKS,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def attend_slot(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    key_ptr,
    value_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_query_t,
    stride_query_h,
    stride_out_t,
    stride_out_h,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_vcache_block,
    stride_vcache_offset,
    stride_vcache_head,
    stride_vcache_d,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_table_s,
    stride_table_b,
    stride_ks,
    stride_vs,
    qk_scale,
    soft_cap,
    sliding_window,
    seq_idx,  # the sequence of this slot
    q_start,  # its first new token's row in query
    q_len,  # its new tokens
    row_start,  # the slot's first (token, head) row of the sequence: a multiple of BLOCK_M below q_len * GROUP
    kv_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    K_ROW_MAJOR: tl.constexpr,
    EXACT_SOFTMAX: tl.constexpr,
    CONTIG_KV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_BLOCKS: tl.constexpr,
):
    """One slot: rows [row_start, row_start + BLOCK_M) of sequence seq_idx, for one KV head."""
    num_rows = q_len * GROUP
    ctx_len = tl.load(seq_lens_ptr + seq_idx)
    first_pos = ctx_len - q_len  # context position of the sequence's first new token

    offs_m = row_start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_valid = offs_m < num_rows  # [BLOCK_M]
    token_in_seq = offs_m // GROUP  # [BLOCK_M]
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    q_pos = first_pos + token_in_seq  # [BLOCK_M]
    token_idx = (q_start + token_in_seq).to(tl.int64)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    q_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    q = tl.load(
        query_ptr + token_idx[:, None] * stride_query_t + head[:, None] * stride_query_h + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )  # q: [BLOCK_M, BLOCK_D]
    if KV_FP8 and q.dtype == tl.bfloat16:
        # fp16 dots (the module docstring): fp8 -> fp16 is one instruction for two values, exact. q saturates to
        # fp16's finite range (NaN stays NaN); values in fp16's normal range convert exactly. Under DOT_FP32 the
        # dots take these same values in fp32.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)

    # Key ranges (see the module docstring); every bound is a multiple of BLOCK_N.
    tile_first_pos = first_pos + row_start // GROUP
    tile_last_pos = first_pos + (tl.minimum(row_start + BLOCK_M, num_rows) - 1) // GROUP
    hi = tile_last_pos + 1  # causal limit of the tile's last token; <= ctx_len
    mid_hi = (tile_first_pos + 1) // BLOCK_N * BLOCK_N  # keys below are visible to every row
    if HAS_WINDOW:
        lo = tl.maximum(tile_first_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
        mid_lo = tl.cdiv(tl.maximum(tile_last_pos - sliding_window + 1, 0), BLOCK_N) * BLOCK_N
        mid_lo = tl.minimum(mid_lo, mid_hi)
    else:
        lo = 0
        mid_lo = 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_table_s
    kv_head_off = kv_head.to(tl.int64) * stride_cache_head
    v_head_off = kv_head.to(tl.int64) * stride_vcache_head
    if KV_FP8:  # the KV head's k_scale joins each score's scale (> 0: the fused update's condition holds)
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head * stride_ks)

    if CONTIG_KV:  # a constexpr branch: the default build has no runtime test here
        if first_pos == 0:
            # A fresh prompt: its context is exactly its new tokens, contiguous rows of key/value.
            acc, l_i, m_i = _attend_ranges(
                acc, l_i, m_i, q, q_pos, lo, mid_lo, mid_hi, hi, key_ptr, value_ptr,
                q_start.to(tl.int64) * stride_key_t + kv_head.to(tl.int64) * stride_key_h,
                q_start.to(tl.int64) * stride_value_t + kv_head.to(tl.int64) * stride_value_h,
                stride_key_t, stride_value_t, table_row_ptr, ctx_len, qk_scale, soft_cap, sliding_window,
                stride_cache_block, stride_cache_offset, stride_table_b, 0, 1, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N,
                BLOCK_D, HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, True, False,
            )  # fmt: skip
        else:
            acc, l_i, m_i = _attend_ranges(
                acc, l_i, m_i, q, q_pos, lo, mid_lo, mid_hi, hi, k_cache_ptr, v_cache_ptr, kv_head_off,
                v_head_off, stride_cache_offset, stride_vcache_offset, table_row_ptr, ctx_len, qk_scale, soft_cap,
                sliding_window, stride_cache_block, stride_cache_offset, stride_table_b, stride_vcache_block,
                stride_vcache_d, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32,
                K_ROW_MAJOR, EXACT_SOFTMAX, False, V_BLOCKS,
            )  # fmt: skip
    else:  # through the block table
        acc, l_i, m_i = _attend_ranges(
            acc, l_i, m_i, q, q_pos, lo, mid_lo, mid_hi, hi, k_cache_ptr, v_cache_ptr, kv_head_off, v_head_off,
            stride_cache_offset, stride_vcache_offset, table_row_ptr, ctx_len, qk_scale, soft_cap, sliding_window,
            stride_cache_block, stride_cache_offset, stride_table_b, stride_vcache_block, stride_vcache_d, HEAD_DIM,
            BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX,
            False, V_BLOCKS,
        )  # fmt: skip
    if KV_FP8:  # every value is in: scale them once
        acc = acc * tl.load(v_scale_ptr + kv_head * stride_vs)

    if HAS_SINKS:
        # The head's sink logit (natural log, neither scaled nor capped) is one more softmax term without a value:
        # it joins l_i only. In the log2 domain of m_i; m_i is finite for real rows, -inf for padding rows.
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # [BLOCK_M]; head < num_heads on every row
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a sink of -inf on a padding row
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
        l_i = l_i * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha[:, None]
    # Every real row sees at least its own key, so l_i > 0 there; padding rows (l_i == 0) are not stored.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_D], fp32
    tl.store(
        out_ptr + token_idx[:, None] * stride_out_t + head[:, None] * stride_out_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )
