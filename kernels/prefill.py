"""Varlen paged prefill: flash attention of each sequence's new tokens over its paged context.

Semantics (causal mask, sliding window, soft cap, GQA) and the cache layout are those of
kernels/reference.py. Sequence s carries ``q_len`` new tokens, the last ``q_len`` of its
``seq_lens[s]`` context tokens; K/V are read straight from the cache blocks through the block
table, never gathered into contiguous tensors.

One program computes one tile of ``BLOCK_M`` rows for one (sequence, KV head). The rows are the
sequence's (new token, query head of the KV head's group) pairs, token-major, so the ``GROUP``
query heads that share a KV head share every K/V tile load (GQA/MQA without repeating K/V)::

    row r of tile t  ->  m = t * BLOCK_M + r,  token = m // GROUP,  head = kv_head * GROUP + m % GROUP

The program walks the context in tiles of ``BLOCK_N`` keys, aligned to ``BLOCK_N``, from the
sliding-window start of its first token to the causal limit of its last token, in three ranges::

    lo             mid_lo                      mid_hi          hi
    |-- masked ----|-------- unmasked ---------|--- masked ----|
      window edge    every row sees every key    causal edge / end of context

Online softmax in fp32 (exp2 with log2(e) folded into the scores), fp32 accumulator. The unmasked
interior tiles use a fused update (no -inf guard, the scale folded into one FMA per score) when the
scale is positive, else the exact update of the masked tiles (the fused one needs scale > 0).

K/V are read through the block table, except that with ``key=/value=`` a fresh prompt (no cached
context) reads them from the contiguous new-token tensors instead. FP8 caches (``KV_FP8``, kernels/kv_quant.py): K/V
tiles are converted to the query's dtype as they load, the KV head's ``k_scale`` joins the score scale and its
``v_scale`` multiplies the accumulator after the last key; every sequence reads the cache, ``key=/value=`` or not,
so a prompt attends to the quantized values its later decode steps read.

One kernel and its launcher (its argument checks are in kernels/prefill_checks.py): the module is over 500 lines
because the kernel is (three key ranges, two grid forms, the contiguous-K/V path, sinks).

Grid: ``(programs, num_kv_heads)`` over one flat axis of tile slots for the whole batch (as vLLM's unified
attention), in one of two forms chosen from the shapes alone (never the lengths), so that a CUDA graph captured with
padded shapes (zero-length padding sequences, padding tokens of no sequence, and in a mixed step the decode rows,
which the decode kernel takes) replays it for any batch that fits.

The exact tile map, for batches of more than ``spare = min(num_seqs, max(SCAN_SPARE_SLOTS, num_tokens //
SCAN_TOKENS_PER_SPARE_SLOT))`` sequences (a mixed graph's 256 sequence slots): sequence s owns ``cdiv(q_len * GROUP,
BLOCK_M)`` consecutive slots after those of the sequences before it (an empty sequence owns none). Every program loads
``cu_seqlens_q`` as one vector, scans it in registers into each sequence's last slot, and takes the slots ``pid, pid +
programs, ...`` below the total (from the end of the slot range: longest tiles first), finding each one's sequence by
a vector compare, not a chain of dependent loads. ``programs = cdiv(num_tokens * GROUP, BLOCK_M) + spare``: the token
tiles plus the rounding slack of ``spare`` sequences; a batch of more short sequences loops. No program is spent on an
empty sequence.

The bound grid, for batches of at most ``spare`` sequences (a few long prompts) and past ``SCAN_MAX_SEQS``
sequences (the scan's registers): ``programs = num_tokens * GROUP // BLOCK_M + num_seqs``, one slot a program, no
loop: sequence s's first slot is ``(cu_seqlens_q[s] - cu_seqlens_q[0]) * GROUP // BLOCK_M + s`` (at least
``cdiv(q_len * GROUP, BLOCK_M)`` slots each, since floor(a + b) - floor(a) >= ceil(b) - 1), found by binary search over
``cu_seqlens_q``; a spare slot exits at once. Why both: a mixed step of many decode rows and one prompt gives the
bound grid a program per sequence, nearly all spare (an 8B mixed step on an H100: 27 µs a layer, against 10 µs
through the map), while a few long prompts run faster through the bound grid's leaner code (fewer registers, no loop).
"""

import os

import torch
import triton
import triton.language as tl

from .kv_quant import scale_args
from .launch import Launcher, cdiv, next_power_of_2
from .prefill_checks import check_args

__all__ = ["paged_prefill_triton"]

# The exact tile map (see "Grid" in the module docstring) for batches of up to this many sequences: each program holds
# a [next_power_of_2(num_seqs)] scan of cu_seqlens_q in registers. Larger batches take the binary-search grid.
SCAN_MAX_SEQS = 1024
# Programs of the exact-map grid beyond the token tiles, for the slots that rounding up each sequence's tiles adds:
# max(SCAN_SPARE_SLOTS, num_tokens // SCAN_TOKENS_PER_SPARE_SLOT), at most num_seqs (more sequences loop). 16 spare
# slots serve a mixed step of one prompt; one per 32 tokens keeps a step of many short prefix-hit chunks from looping.
SCAN_SPARE_SLOTS = 16
SCAN_TOKENS_PER_SPARE_SLOT = 32
_LOG2E = 1.4426950408889634


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
    stride_v_n,  # CONTIG: token stride of value
    table_row_ptr,  # this sequence's block table row (paged)
    ctx_len,
    qk_scale,  # scale (* log2(e) unless there is a soft cap)
    soft_cap,
    sliding_window,
    stride_cache_block,
    stride_cache_offset,
    stride_table_b,
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
        else:
            # The tile spans several cache blocks: one table read per key (same-block keys share it).
            block_ids = tl.load(table_row_ptr + (offs_n // BLOCK_SIZE) * stride_table_b, mask=key_in_ctx, other=0)
            slot_offs = block_ids.to(tl.int64) * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_offset
        k_offs = k_base + slot_offs  # [BLOCK_N], int64
        v_offs = v_base + slot_offs  # [BLOCK_N], int64 (k_base == v_base: the caches share strides)

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
    k = k.to(q.dtype)  # fp8 -> the query's dtype (exact); else no conversion
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

    v = tl.load(
        v_ptr + v_offs[:, None] + offs_d[None, :],
        mask=key_in_ctx[:, None] & d_mask[None, :],
        other=0.0,
    ).to(q.dtype)  # v: [BLOCK_N, BLOCK_D]; fp8 -> the query's dtype, as k
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
):
    """The three key ranges of the module docstring, in order; returns (acc, l_i, m_i)."""
    for start_n in range(lo, mid_lo, BLOCK_N):  # window edge
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, k_ptr, v_ptr, k_base, v_base, stride_k_n, stride_v_n,
            table_row_ptr, ctx_len, qk_scale, soft_cap, sliding_window, stride_cache_block, stride_cache_offset,
            stride_table_b, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, True, HAS_WINDOW, HAS_SOFT_CAP,
            DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, CONTIG,
        )  # fmt: skip
    for start_n in range(mid_lo, mid_hi, BLOCK_N):  # interior: no mask
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, k_ptr, v_ptr, k_base, v_base, stride_k_n, stride_v_n,
            table_row_ptr, ctx_len, qk_scale, soft_cap, sliding_window, stride_cache_block, stride_cache_offset,
            stride_table_b, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, False, HAS_WINDOW, HAS_SOFT_CAP,
            DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, CONTIG,
        )  # fmt: skip
    for start_n in range(mid_hi, hi, BLOCK_N):  # causal edge
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, k_ptr, v_ptr, k_base, v_base, stride_k_n, stride_v_n,
            table_row_ptr, ctx_len, qk_scale, soft_cap, sliding_window, stride_cache_block, stride_cache_offset,
            stride_table_b, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, True, HAS_WINDOW, HAS_SOFT_CAP,
            DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, CONTIG,
        )  # fmt: skip
    return acc, l_i, m_i


# The block table's row stride is its width and num_seqs is the batch's: both change from step to step, so they
# are not specialised (Triton would compile a new kernel for 1 and for multiples of 16 in the middle of serving).
@triton.jit(do_not_specialize=["stride_table_s", "num_seqs"])
def _paged_prefill_kernel(
    # pointers
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]: the new tokens' K (CONTIG_KV; else any pointer)
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]: the new tokens' V (CONTIG_KV; else any pointer)
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens_ptr,  # [num_seqs], int32
    cu_seqlens_q_ptr,  # [num_seqs + 1], int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    sinks_ptr,  # [num_heads], fp32: HAS_SINKS: each query head's sink logit (else any pointer)
    k_scale_ptr,  # [1] or [num_kv_heads], fp32: KV_FP8 (else any pointer)
    v_scale_ptr,  # [1] or [num_kv_heads], fp32: KV_FP8 (else any pointer)
    # strides
    stride_query_t,
    stride_query_h,
    stride_out_t,
    stride_out_h,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_table_s,
    stride_table_b,
    stride_ks,  # 0: one scale for every KV head; 1: a scale per KV head
    stride_vs,
    # sizes and scalars
    qk_scale,
    soft_cap,
    sliding_window,
    num_seqs,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # num_heads // num_kv_heads: rows are (token, query head) pairs of one KV head
    # meta-parameters
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast dot operands (fp32 caches, and bf16 under the interpreter)
    K_ROW_MAJOR: tl.constexpr,
    EXACT_SOFTMAX: tl.constexpr,  # scale <= 0: no fused update of the interior tiles
    CONTIG_KV: tl.constexpr,  # fresh sequences (seq_len == q_len) read K/V from key/value, not the cache
    HAS_SINKS: tl.constexpr,  # a sink logit per query head joins the softmax's denominator (gpt-oss)
    KV_FP8: tl.constexpr,  # fp8 caches: dequantize as K/V load (kernels/kv_quant.py)
    SEQS_PAD: tl.constexpr,  # power of two >= num_seqs: the exact tile map; 0 = the binary-search bound grid
):
    # Tile slots (see "Grid" in the module docstring). Causal: later tiles attend to more keys, and chunks sit after
    # decode rows; slots are taken from the end so the short ones fill the tail.
    kv_head = tl.program_id(1)
    num_programs = tl.num_programs(0)
    if SEQS_PAD > 0:
        # The exact tile map: sequence s owns cdiv(q_len * GROUP, BLOCK_M) slots after those of the sequences before
        # it (an empty sequence owns none). Every program scans cu_seqlens_q in registers (one vector load, no
        # chain of dependent loads) and loops over the slots pid, pid + num_programs, ... below the total.
        offs_s = tl.arange(0, SEQS_PAD)  # [SEQS_PAD]
        s_ok = offs_s < num_seqs
        q_lo = tl.load(cu_seqlens_q_ptr + offs_s, mask=s_ok, other=0)  # [SEQS_PAD]
        q_hi = tl.load(cu_seqlens_q_ptr + offs_s + 1, mask=s_ok, other=0)  # [SEQS_PAD]
        seq_tiles = ((q_hi - q_lo) * GROUP + BLOCK_M - 1) // BLOCK_M  # [SEQS_PAD]; 0 past num_seqs
        tile_ends = tl.cumsum(seq_tiles, axis=0)  # [SEQS_PAD]: one past each sequence's last slot
        total_slots = tl.sum(seq_tiles, axis=0)
        for it in range(tl.program_id(0), total_slots, num_programs):
            slot = total_slots - 1 - it
            seq_idx = tl.sum((tile_ends <= slot).to(tl.int32), axis=0)  # the sequence whose slots hold this one
            first_tile = tl.sum(tl.where(offs_s == seq_idx, tile_ends - seq_tiles, 0), axis=0)
            q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
            q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
            _attend_slot(
                query_ptr, k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
                sinks_ptr, k_scale_ptr, v_scale_ptr, stride_query_t, stride_query_h, stride_out_t, stride_out_h,
                stride_cache_block, stride_cache_offset, stride_cache_head, stride_key_t, stride_key_h, stride_value_t,
                stride_value_h, stride_table_s, stride_table_b, stride_ks, stride_vs, qk_scale, soft_cap,
                sliding_window, seq_idx, q_start, q_len, (slot - first_tile) * BLOCK_M, kv_head, HEAD_DIM, BLOCK_SIZE,
                GROUP, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX,
                CONTIG_KV, HAS_SINKS, KV_FP8,
            )  # fmt: skip
    else:
        # The bound grid, one slot a program, no loop (batches of few sequences). seq_idx: the last sequence whose
        # first slot first_slot(s) = (cu_seqlens_q[s] - cu_seqlens_q[0]) * GROUP // BLOCK_M + s is <= slot. Offsets
        # count from cu_seqlens_q[0], which may be > 0 (rows before it belong to no sequence): first_slot(0) = 0 <=
        # slot then holds for every program, the search's invariant.
        slot = num_programs - 1 - tl.program_id(0)
        cu_first = tl.load(cu_seqlens_q_ptr)
        seq_lo = 0
        seq_hi = num_seqs
        while seq_hi - seq_lo > 1:
            mid = (seq_lo + seq_hi) // 2
            before = (tl.load(cu_seqlens_q_ptr + mid) - cu_first) * GROUP // BLOCK_M + mid <= slot
            seq_lo = tl.where(before, mid, seq_lo)
            seq_hi = tl.where(before, seq_hi, mid)
        seq_idx = seq_lo
        q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
        q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
        row_start = (slot - ((q_start - cu_first) * GROUP // BLOCK_M + seq_idx)) * BLOCK_M
        if row_start >= q_len * GROUP:  # a spare slot of this sequence (or of an empty padding sequence)
            return
        _attend_slot(
            query_ptr, k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
            sinks_ptr, k_scale_ptr, v_scale_ptr, stride_query_t, stride_query_h, stride_out_t, stride_out_h,
            stride_cache_block, stride_cache_offset, stride_cache_head, stride_key_t, stride_key_h, stride_value_t,
            stride_value_h, stride_table_s, stride_table_b, stride_ks, stride_vs, qk_scale, soft_cap, sliding_window,
            seq_idx, q_start, q_len, row_start, kv_head, HEAD_DIM, BLOCK_SIZE, GROUP, BLOCK_M, BLOCK_N, BLOCK_D,
            HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, CONTIG_KV, HAS_SINKS, KV_FP8,
        )  # fmt: skip


@triton.jit
def _attend_slot(
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
                stride_cache_block, stride_cache_offset, stride_table_b, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N,
                BLOCK_D, HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, True,
            )  # fmt: skip
        else:
            acc, l_i, m_i = _attend_ranges(
                acc, l_i, m_i, q, q_pos, lo, mid_lo, mid_hi, hi, k_cache_ptr, v_cache_ptr, kv_head_off,
                kv_head_off, stride_cache_offset, stride_cache_offset, table_row_ptr, ctx_len, qk_scale, soft_cap,
                sliding_window, stride_cache_block, stride_cache_offset, stride_table_b, HEAD_DIM, BLOCK_SIZE,
                BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, False,
            )  # fmt: skip
    else:  # through the block table
        acc, l_i, m_i = _attend_ranges(
            acc, l_i, m_i, q, q_pos, lo, mid_lo, mid_hi, hi, k_cache_ptr, v_cache_ptr, kv_head_off, kv_head_off,
            stride_cache_offset, stride_cache_offset, table_row_ptr, ctx_len, qk_scale, soft_cap, sliding_window,
            stride_cache_block, stride_cache_offset, stride_table_b, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N,
            BLOCK_D, HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, False,
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


# Positional launch (kernels/launch.py): arguments in the kernel's parameter order.
PREFILL = Launcher(_paged_prefill_kernel)


def default_tiles(dtype: torch.dtype, block_d: int, contig_kv: bool = False) -> tuple[int, int, int, int, bool]:
    """Default (BLOCK_M, BLOCK_N, num_warps, num_stages, k_row_major) for Hopper (H100/H200).

    With ``contig_kv`` (fresh prompts read their K/V from the contiguous key/value tensors) 2-byte dtypes
    with head_dim in (64, 128] use 128 x 64 tiles, 8 warps, 3 stages, K^T loads: 130 µs vs 150 µs for the
    paged-read default on the same shape (4 x 1024 tokens on an H200, benchmarks/tools/prefill_sweep.py).

    Heuristic: 2-byte dtypes with head_dim <= 64 use the flash-attention tiles 128 x 64; head_dim in
    (64, 128] uses 128 x 32 tiles, 4 warps, 4 stages and key-major K loads, the fastest of that sweep
    (151 µs vs 169 µs for the 128 x 64 / 8 warps / K^T tiles on 4 x 1024 tokens, 32/8 heads, block_size
    16); head_dim 256 halves the tiles to fit registers and shared memory. fp32 operands take twice the
    shared memory and registers per element, so they use 64 x 32 tiles, and 32 x 32 without software
    pipelining for head_dim 256 (Q + K + V tiles = 96 KiB of the H100's 227 KiB shared memory per block;
    two stages would need 160 KiB).
    """
    if dtype == torch.float32:
        if block_d <= 128:
            return 64, 32, 4, 2, False
        return 32, 32, 4, 1, False
    if block_d <= 64:
        return 128, 64, 4, 3, False
    if block_d <= 128:
        return (128, 64, 8, 3, False) if contig_kv else (128, 32, 4, 4, True)
    return 64, 32, 8, 2, False


def paged_prefill_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1], int32
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]
    sinks: torch.Tensor | None = None,  # [num_heads], any float dtype
    tiles: tuple[int, int, int, int, bool] | None = None,
    spare_slots: int = SCAN_SPARE_SLOTS,
    tokens_per_spare_slot: int = SCAN_TOKENS_PER_SPARE_SLOT,
    scan_max_seqs: int = SCAN_MAX_SEQS,
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> torch.Tensor:
    """Causal varlen attention of each sequence's new tokens over its paged context (flash attention).

    Sequence s's ``q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s]`` new tokens are the last ``q_len``
    of its ``seq_lens[s]`` context tokens, whose K/V are already in the cache (write_kv runs first).
    Fresh prompts (q_len == seq_len), chunked prefill / prefix hits (q_len < seq_len) and single
    tokens mix freely in one batch. No host sync: the grid comes from the tensor shapes.

    Tile sizes follow a per-dtype/head_dim heuristic (``default_tiles``); ``BLOCK_M`` shrinks to the
    next power of two >= 16 of ``max_query_len * num_heads // num_kv_heads`` for short queries. The rows
    of a program are (token, query head) pairs of one KV head, so a GQA group shares each K/V tile load.
    The unmasked interior tiles take the fused softmax update (no -inf guard, the scale folded into one
    FMA per score; 2% faster on the H200 benchmark shape), which needs ``scale > 0``; with
    ``scale <= 0`` they take the exact update of the masked tiles.

    Args:
        query: [num_tokens, num_heads, head_dim], float16/bfloat16/float32; last dim contiguous.
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim], query's dtype or fp8 (kernels/kv_quant.py);
            last dim contiguous.
        v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same shape and strides as k_cache.
        block_tables: [num_seqs, max_blocks_per_seq], int32 block ids, any order.
        seq_lens: [num_seqs], int32: context length of each sequence, including its new tokens.
        cu_seqlens_q: [num_seqs + 1], int32: offsets of each sequence's new tokens in ``query``.
        scale: softmax scale applied to q . k.
        max_query_len: host-side upper bound of the q_len values; picks ``BLOCK_M`` (shorter tiles for
            short queries). The grid comes from the shapes.
        max_seq_len: host-side upper bound of seq_lens; 0 means nothing to do.
        sliding_window: W > 0: token p attends only to j with p - j < W. None or <= 0: off.
        soft_cap: C > 0: scores become C * tanh(scores / C). None or <= 0: off.
        out: [num_tokens, num_heads, head_dim], query's dtype; zero-filled when None. Rows of tokens
            of no sequence (before ``cu_seqlens_q[0]`` or from ``cu_seqlens_q[-1]`` on) are left untouched.
        key, value: [num_tokens, num_kv_heads, head_dim], the new tokens' K/V, rows aligned with
            ``query`` (the tensors write_kv stored), last dim contiguous. When given, a fresh prompt
            (seq_len == q_len) reads its K/V from these contiguous rows instead of through the block
            table; other sequences still read the cache. Both or neither. Not read with an fp8 cache: every
            sequence attends to the quantized K/V in the cache (as its decode steps will), written by the caller.
        sinks: [num_heads], any float dtype (taken as fp32): each query head's sink logit, which joins the
            softmax's denominator only (gpt-oss; kernels/reference.py). None: no sinks (the kernel compiles
            without them).
        tiles: For tests and benchmarks/tools/prefill_sweep.py: force (BLOCK_M, BLOCK_N, num_warps, num_stages,
            k_row_major); None takes ``default_tiles``. BLOCK_M still shrinks for short queries.
        spare_slots, tokens_per_spare_slot, scan_max_seqs: For tests: the grid's tuning (SCAN_SPARE_SLOTS,
            SCAN_TOKENS_PER_SPARE_SLOT, SCAN_MAX_SEQS; see "Grid" in the module docstring). Any values give the
            same result; they pick the grid's form and size only.
        k_scale, v_scale: fp8 caches only: [1] (per tensor) or [num_kv_heads] (per head) float32 on the cache's
            device, positive; None = 1.0.

    Returns:
        out: [num_tokens, num_heads, head_dim].

    Raises:
        ValueError: on a shape, dtype, layout or device mismatch, or an unsupported head_dim.
    """
    check_args(
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len, out, key, value,
        sinks, k_scale, v_scale,
    )  # fmt: skip
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_seqs = block_tables.shape[0]
    if sinks is not None:
        sinks = sinks.float().contiguous()  # the same tensor when it already is
    if out is None:
        out = torch.zeros_like(query)  # like the reference: rows of no sequence read as 0, never garbage
    if num_seqs == 0 or num_tokens == 0 or max_query_len == 0 or max_seq_len == 0:
        return out

    group = num_heads // num_kv_heads
    block_d = max(16, next_power_of_2(head_dim))
    if tiles is None:
        tiles = default_tiles(query.dtype, block_d, key is not None and k_cache.dtype == query.dtype)
    default_m, tile_n, num_warps, num_stages, k_row_major = tiles
    # Short queries (e.g. decode-like rows in a mixed batch) need fewer rows than the default tile.
    tile_m = min(default_m, max(16, next_power_of_2(max_query_len * group)))
    has_window = sliding_window is not None and sliding_window > 0
    has_soft_cap = soft_cap is not None and soft_cap > 0
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    # fp32 caches take an IEEE fp32 dot (no TF32). bf16 tl.dot is wrong under the triton 3.9
    # interpreter, so it is upcast there too; on the GPU bf16 runs on tensor cores.
    dot_fp32 = query.dtype == torch.float32 or (interpreting and query.dtype == torch.bfloat16)

    kv_fp8, k_scale, v_scale, stride_ks, stride_vs = scale_args(k_cache, k_scale, v_scale, seq_lens)
    contig_kv = key is not None and not kv_fp8  # fp8: the cache's quantized K/V, never the activations
    if not contig_kv:  # never read (CONTIG_KV=False): any pointer and strides of the right dtype
        key = value = k_cache[0, 0]  # [num_kv_heads, head_dim]
    # The exact tile map (SEQS_PAD > 0) needs at most cdiv(tokens * group, tile_m) + (sequences with tokens) slots;
    # a grid with fewer programs loops, so the grid is capped at `spare` sequences' slack: padding and decode rows,
    # empty sequences in a captured mixed step, take no program each. A batch of at most `spare` sequences (a few
    # long prompts) takes the bound grid, about as many programs, and its leaner code (fewer registers and no stack:
    # benchmarks/tools/ptxas_check.py). Past scan_max_seqs sequences the bound grid spares the scan's registers.
    spare = min(num_seqs, max(spare_slots, num_tokens // tokens_per_spare_slot))
    seqs_pad = next_power_of_2(num_seqs) if spare < num_seqs <= scan_max_seqs else 0
    if seqs_pad:
        grid = (cdiv(num_tokens * group, tile_m) + spare, num_kv_heads)
    else:
        grid = (num_tokens * group // tile_m + num_seqs, num_kv_heads)
    PREFILL(
        grid,
        query, k_cache, v_cache, key, value, block_tables, seq_lens, cu_seqlens_q, out,
        seq_lens if sinks is None else sinks,  # sinks_ptr: never read without HAS_SINKS
        k_scale, v_scale,  # placeholders (seq_lens) without KV_FP8
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        key.stride(0) if contig_kv else 0, key.stride(1) if contig_kv else 0,
        value.stride(0) if contig_kv else 0, value.stride(1) if contig_kv else 0,
        block_tables.stride(0), block_tables.stride(1), stride_ks, stride_vs,
        float(scale) * (1.0 if has_soft_cap else _LOG2E),  # qk_scale
        float(soft_cap) if has_soft_cap else 1.0,  # soft_cap
        int(sliding_window) if has_window else 0,
        num_seqs,
        head_dim, block_size, group,  # HEAD_DIM, BLOCK_SIZE, GROUP
        tile_m, tile_n, block_d,  # BLOCK_M, BLOCK_N, BLOCK_D
        has_window, has_soft_cap,
        dot_fp32,  # DOT_FP32
        k_row_major,  # K_ROW_MAJOR
        not scale > 0,  # EXACT_SOFTMAX: the fused update folds the scale into max(scores): needs scale > 0
        contig_kv,  # CONTIG_KV
        sinks is not None,  # HAS_SINKS
        kv_fp8,  # KV_FP8
        seqs_pad,  # SEQS_PAD (last: tests/helpers.py reads it there)
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
