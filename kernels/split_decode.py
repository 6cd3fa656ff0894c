"""The split-K paged decode kernels (flash-decoding): the split kernel and the merge of its partials.

One new token per sequence: query row s belongs to sequence s, sits at position ``seq_lens[s] - 1`` and attends to
every cached position j <= that one (within the sliding window, if any). The cache layout, the slot formula and the
exact attention semantics are in kernels/reference.py; the launcher is kernels/decode.py.

1. ``_paged_decode_kernel``, grid ``(num_seqs, num_kv_heads, num_splits)``. A program owns one KV head of one
   sequence and packs all ``group = num_heads // num_kv_heads`` query heads of that KV head into the rows of one
   tile, so each K/V tile is read from memory once per group. The sequence's live key range is cut into
   ``num_splits`` contiguous pieces, on KV-tile boundaries:

       keys:    [ lo ....................................... seq_len )   lo = seq_len - window, or 0
       tiles:   |  t0  |  t1  |  t2  |  t3  |  t4  |  t5  |  t6  |  t7 |   BLOCK_N keys each
       splits:  |     split 0        |     split 1        | split 2    |   cdiv(num_tiles, num_splits) tiles each

   Each split runs an online softmax in fp32 over its tiles. With one split the program normalizes and writes
   ``out`` directly; otherwise it writes a partial (normalized acc, log-sum-exp). A split with no tiles (a short
   sequence, or ``seq_len == 0``) writes the neutral partial (acc 0, lse -inf).
2. ``_merge_splits_kernel``, grid ``(num_seqs, num_heads)``: log-sum-exp combine of the partials. Rows whose
   partials are all neutral (``seq_len == 0``, e.g. CUDA-graph padding) get zeros. On SM90+ it may be launched with
   programmatic dependent launch (its launch overlaps the split kernel; it waits with ``griddepcontrol.wait``
   before reading the partials).

With ``HAS_PREFIX`` (shared-prefix "cascade" decode, kernels/cascade.py) the shared-prefix kernel reads the keys
below ``prefix_len``, which every row shares, once per KV head for all rows; the split kernel starts each row at
``prefix_len``. With several splits the merge also combines the prefix kernel's partials. With one split the prefix
kernel runs first and the split kernel folds its partials into its own online softmax and writes ``out`` (no merge
launch); on SM90+ the split kernel then reads its own keys while the prefix kernel runs, waiting only before the fold
(``WAIT_PREFIX``). ``prefix_len`` is read on the device, so with 0 the kernels do exactly the plain decode.

With ``HAS_SINKS`` (gpt-oss) each query head's sink logit joins the softmax's denominator once, where the row's whole
softmax meets: in the merge (a term ``exp2(sink - lse_max)`` with no value), or with one split in the split kernel
after its last key and the prefix fold. Partials never contain it, so neither a split nor a prefix split counts it.

With ``KV_FP8`` (fp8 caches, kernels/kv_quant.py) and a bf16 or fp16 query the dots run in fp16: K/V tiles are
converted to fp16 as they load (exact: every e4m3/e5m2 value is an fp16 value; one instruction converts two e4m3
values to fp16 on sm_89+, and e5m2 -> fp16 is a shift, where e4m3 -> bf16 takes several per value), a bf16 query once
per program (clamped to fp16's finite range, +-65504: a larger value saturates instead of becoming inf; values in
fp16's normal range convert exactly) and the probabilities for the P.V dot; scores, softmax and accumulator stay fp32
and ``out`` keeps the query's dtype; an fp32 query keeps fp32 dots. The KV head's ``k_scale`` joins the score scale
and its ``v_scale`` multiplies the accumulator once, after the last key and before the prefix fold (the prefix
partials carry theirs); the fused write quantizes the new K/V as ``write_kv`` does and attends to the stored
(quantized) values, in the tiles' dtype.

With ``V_KEYS_MINOR`` (an FP8 pool's V is keys-minor, kernels/kv_quant.py ``new_cache``) a split first streams its
interior tiles, which hold only live keys, without a mask, V loaded as whole blocks along keys (kernels/v_tiles.py),
then its edge tiles (the one holding ``lo``, the one holding ``read_hi``; at most one each) with masks: the same
online softmax over the same keys, in another order. A V tile in rows of head_dim takes a byte load per 8-bit value
(1 252 instructions a 128-key tile at head_dim 128, sm_90); keys-minor, about 740; at 32 x 4096 the kernel then runs
83 µs against 100 (H200, one split each).

The split is per sequence (each sequence divides its own length, and uses only as many of the grid's splits as give
each ``MIN_TILES_PER_SPLIT`` tiles), so the grid's split count never affects correctness: a CUDA graph captured with
a bound that is too small still computes the right answer.

Why ``tl.dot`` for the group: the query tile is padded to at least 16 rows (the tensor-core minimum). Decode is
memory bound (about 1 flop per byte of K/V per query head), so the padded rows cost idle tensor-core cycles but no
bandwidth, while a broadcast-multiply-sum would need a ``[group, BLOCK_N, head_dim]`` register tile (64K values for
group 8 at BLOCK_N 64, D 128) and spill.
"""

import triton
import triton.language as tl

from .kv_quant_triton import from_kv, to_fp8
from .launch import Launcher
from .v_tiles import load_v_tile

__all__ = ["SPLIT", "MERGE", "BOUND_POSITIONS"]


@triton.jit
def _attend_tile(
    q,  # [GROUP_PAD, HEAD_DIM_PAD]: the dots' dtype
    m_i,  # [GROUP_PAD]: running max (log2 domain)
    l_i,  # [GROUP_PAD]: running sum of exp2(score - m_i)
    acc,  # [GROUP_PAD, HEAD_DIM_PAD], fp32
    tile_idx,  # keys [tile_idx * BLOCK_N, (tile_idx + 1) * BLOCK_N) of the sequence
    lo,  # keys below lo are not attended to (window, shared prefix)
    read_hi,  # keys from read_hi on are not read from the cache
    table_ptr,  # the sequence's block-table row
    k_head_ptr,  # k_cache at the KV head
    v_head_ptr,  # v_cache at the KV head
    stride_btb,
    stride_kb,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vd,
    scale_log2,
    cap_in,
    cap_out,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_BLOCK_PER_TILE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    V_KEYS_MINOR: tl.constexpr,  # v_cache's keys are its contiguous dimension (stride_vt == 1)
    MASKED: tl.constexpr,  # the tile may hold keys outside [lo, read_hi); else every key is live
):
    """One online-softmax step over a tile of keys: returns the new (m_i, l_i, acc)."""
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]: a tile's keys
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    d_mask = offs_d < HEAD_DIM  # padded head_dim lanes
    key_idx = tile_idx * BLOCK_N + offs_n  # [BLOCK_N] positions in the sequence
    # Keys outside [lo, read_hi) are masked: their table entries may be stale or unallocated.
    n_mask = (key_idx < read_hi) & (key_idx >= lo)
    if ONE_BLOCK_PER_TILE:
        # The whole tile sits in one cache block; its first key may be below lo (window), but the tile holds key lo
        # or later, so the block-table entry is live. The tile's first key in the block is a multiple of BLOCK_N
        # (written so, the compiler knows the loads are aligned).
        block_id = tl.load(table_ptr + ((tile_idx * BLOCK_N) // BLOCK_SIZE) * stride_btb)
        in_block = (tile_idx % (BLOCK_SIZE // BLOCK_N)) * BLOCK_N + offs_n
        row_offset = block_id.to(tl.int64) * stride_kb + in_block * stride_kt
        v_row_offset = block_id.to(tl.int64) * stride_vb + in_block * stride_vt
    else:
        # block_ids: [BLOCK_N]; several keys share each entry (BLOCK_SIZE < BLOCK_N, or not divisible).
        if MASKED:
            block_ids = tl.load(table_ptr + (key_idx // BLOCK_SIZE) * stride_btb, mask=n_mask, other=0)
        else:
            block_ids = tl.load(table_ptr + (key_idx // BLOCK_SIZE) * stride_btb)
        row_offset = block_ids.to(tl.int64) * stride_kb + (key_idx % BLOCK_SIZE) * stride_kt
        v_row_offset = block_ids.to(tl.int64) * stride_vb + (key_idx % BLOCK_SIZE) * stride_vt

    # Loads mask keys only in a masked tile, and head_dim lanes only where head_dim is padded.
    kv_mask = n_mask[:, None] & d_mask[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
    if not MASKED:
        kv_mask = d_mask[None, :]
    k_ptrs = k_head_ptr + row_offset[:, None] + offs_d[None, :] * stride_kd  # [BLOCK_N, HEAD_DIM_PAD]
    if MASKED or HEAD_DIM < HEAD_DIM_PAD:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    k = from_kv(k, q.dtype)  # fp8 -> fp16 (exact; fp32 for an fp32 query or under DOT_FP32); else no conversion
    # scores: [GROUP_PAD, BLOCK_N]
    scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    if USE_SOFT_CAP:
        # soft_cap * tanh(scale * s / soft_cap), with tanh(x) = 1 - 2 / (exp(2x) + 1): right at both tails (exp
        # overflow -> 1, underflow -> -1), never NaN; tl has no portable tanh.
        scores = cap_out * (1.0 - 2.0 / (tl.exp(2.0 * cap_in * scores) + 1.0))
    else:
        scores = scores * scale_log2
    if MASKED:
        scores = tl.where(n_mask[None, :], scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [GROUP_PAD]
    # Every tile holds at least one live key, so m_new is finite; guard anyway so that a fully masked row gives
    # exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)  # [GROUP_PAD]; 0 on the first tile (m_i = -inf)
    p = tl.exp2(scores - m_safe[:, None])  # [GROUP_PAD, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)

    # v: [BLOCK_N, HEAD_DIM_PAD]
    if V_KEYS_MINOR:  # whole blocks along keys (kernels/v_tiles.py)
        v = load_v_tile(v_head_ptr, table_ptr, stride_btb, tile_idx * BLOCK_N, lo, read_hi, stride_vb, stride_vt,
                        stride_vd, HEAD_DIM, BLOCK_SIZE, BLOCK_N, HEAD_DIM_PAD, MASKED)  # fmt: skip
    else:
        v_ptrs = v_head_ptr + v_row_offset[:, None] + offs_d[None, :] * stride_vd  # [BLOCK_N, HEAD_DIM_PAD]
        if MASKED or HEAD_DIM < HEAD_DIM_PAD:
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        else:
            v = tl.load(v_ptrs)
    v = from_kv(v, q.dtype)  # as k
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


# Sizes that change from step to step are not specialised (Triton would compile a new kernel whenever one
# of them became 1 or a multiple of 16 in the middle of serving): the split count, the block table's width,
# and the strides of the partial log-sum-exps that follow the split count.
@triton.jit(do_not_specialize=["num_splits", "num_prefix_splits", "stride_bts", "stride_pls", "stride_plh"])
def _paged_decode_kernel(
    # pointers
    query_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens_ptr,  # [num_seqs], int32
    prefix_len_ptr,  # [1], int32: keys below it are the shared-prefix kernel's (kernels/cascade.py); HAS_PREFIX
    out_ptr,  # [num_seqs, num_heads, head_dim]; written only when WRITE_OUT
    partial_acc_ptr,  # [num_seqs, num_heads, num_partials, head_dim], fp32; slots [0, num_splits) are ours
    partial_lse_ptr,  # [num_seqs, num_heads, num_partials], fp32 (log2 domain)
    new_k_ptr,  # [num_seqs, num_kv_heads, head_dim]: FUSED_WRITE: each row's new key (its last position's)
    new_v_ptr,  # [num_seqs, num_kv_heads, head_dim]: FUSED_WRITE: each row's new value
    slot_ptr,  # [num_seqs], int32/int64: FUSED_WRITE: the slot the new K/V go to (-1 = not written)
    sinks_ptr,  # [num_heads], fp32: HAS_SINKS and WRITE_OUT: each query head's sink logit
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
    stride_bts,
    stride_btb,
    stride_os,
    stride_oh,
    stride_od,
    stride_pas,
    stride_pah,
    stride_pap,
    stride_pad,
    stride_pls,
    stride_plh,
    stride_plp,
    stride_nks,
    stride_nkh,
    stride_nkd,
    stride_nvs,
    stride_nvh,
    stride_nvd,
    stride_ks,  # 0: one scale for every KV head; 1: a scale per KV head
    stride_vs,
    # sizes
    num_splits,
    num_prefix_splits,  # HAS_PREFIX: the shared-prefix kernel's partials (with one split: slots [0, this))
    scale_log2,  # softmax scale * log2(e): scores live in the log2 domain so exp2 can be used
    cap_in,  # scale / soft_cap; used only when USE_SOFT_CAP
    cap_out,  # soft_cap * log2(e); used only when USE_SOFT_CAP
    sliding_window,  # used only when USE_WINDOW
    # meta-parameters
    GROUP: tl.constexpr,  # num_heads // num_kv_heads
    GROUP_PAD: tl.constexpr,  # next power of two >= max(GROUP, 16)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # keys per cache block
    BLOCK_N: tl.constexpr,  # keys per tile
    ONE_BLOCK_PER_TILE: tl.constexpr,  # BLOCK_SIZE % BLOCK_N == 0: one block-table entry per tile
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    HAS_PREFIX: tl.constexpr,  # a shared prefix may be set (device value; 0 = none this step)
    # num_splits == 1: normalize and write out, no merge (with HAS_PREFIX: after folding in the prefix's partials)
    WRITE_OUT: tl.constexpr,
    MIN_TILES_PER_SPLIT: tl.constexpr,  # a split streams at least this many tiles (MIN_KEYS_PER_SPLIT keys)
    DOT_FP32: tl.constexpr,  # upcast dot operands (interpreter bf16 tl.dot bug), False on GPU
    LAUNCH_DEPENDENTS: tl.constexpr,  # the merge is launched with PDL: let it start at once (it waits for us)
    # The new token's K/V come in new_k/new_v instead of the cache: the program whose split holds position
    # seq_len - 1 writes them at their slot and attends to them from registers; the cache is read below it only.
    FUSED_WRITE: tl.constexpr,
    # HAS_PREFIX and WRITE_OUT: the prefix kernel's keys per tile and tiles a split at least (its split rule): no
    # prefix split past cdiv(cdiv(prefix_len, PREFIX_BLOCK_N), PREFIX_MIN_TILES) has keys.
    PREFIX_BLOCK_N: tl.constexpr,
    PREFIX_MIN_TILES: tl.constexpr,
    # HAS_PREFIX and WRITE_OUT, launched with PDL after the shared-prefix kernel: wait for its partials before
    # reading them.
    WAIT_PREFIX: tl.constexpr,
    # A sink logit per query head joins the softmax's denominator (gpt-oss): here when WRITE_OUT, else in the merge,
    # so that it counts once per head, not once per split.
    HAS_SINKS: tl.constexpr,
    # fp8 caches (new_k/new_v then hold the query's dtype): fp16 dots for a bf16/fp16 query (the module docstring),
    # the scales per KV head, quantize the fused write.
    KV_FP8: tl.constexpr,
    # v_cache's keys are its contiguous dimension (FP8 pools store each block's V as [num_kv_heads, head_dim,
    # block_size]): interior tiles load V whole blocks along keys, unmasked (the module docstring).
    V_KEYS_MINOR: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    seq_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1)
    split_idx = tl.program_id(2)
    if KV_FP8:
        # The KV head's scales: k_scale joins each score's scale (scores are q . k_fp8 * k_scale * scale), v_scale
        # multiplies acc once after the last value.
        k_scale = tl.load(k_scale_ptr + kv_head_idx * stride_ks)
        v_scale = tl.load(v_scale_ptr + kv_head_idx * stride_vs)
        scale_log2 = scale_log2 * k_scale
        cap_in = cap_in * k_scale

    seq_len = tl.load(seq_lens_ptr + seq_idx)
    read_hi = seq_len  # keys read from the cache: [lo, read_hi)
    if FUSED_WRITE:
        read_hi = seq_len - 1  # the new token's K/V are not in the cache yet: new_k/new_v hold them
    lo = 0
    if USE_WINDOW:
        # Position seq_len - 1 sees j with (seq_len - 1) - j < window, i.e. j >= seq_len - window.
        lo = tl.maximum(seq_len - sliding_window, 0)
    prefix_len = 0
    if HAS_PREFIX:
        # The keys below prefix_len are the shared-prefix kernel's; prefix_len need not be a multiple of BLOCK_N
        # (it is of the block size), so the first tile's keys below it are masked like those below a window.
        prefix_len = tl.load(prefix_len_ptr)
        lo = tl.maximum(lo, tl.minimum(prefix_len, seq_len))
    # Tiles are aligned to multiples of BLOCK_N, so with ONE_BLOCK_PER_TILE no tile crosses a block.
    tile_lo = lo // BLOCK_N
    tile_hi = tl.where(lo < seq_len, tl.cdiv(seq_len, BLOCK_N), tile_lo)  # no tile when the prefix holds it all
    # The grid holds num_splits splits (fixed for a CUDA graph, sized for the longest context it may see); this
    # sequence uses only as many as its own context fills with MIN_TILES_PER_SPLIT tiles each. The rest are
    # empty (neutral partials), so a short context in a graph captured for a long one keeps long splits.
    num_tiles = tile_hi - tile_lo
    splits_used = tl.minimum(num_splits, tl.maximum(tl.cdiv(num_tiles, MIN_TILES_PER_SPLIT), 1))
    tiles_per_split = tl.cdiv(num_tiles, splits_used)
    split_tile_lo = tile_lo + split_idx * tiles_per_split
    split_tile_hi = tl.minimum(split_tile_lo + tiles_per_split, tile_hi)

    offs_g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]: query rows, the GROUP query heads of the KV head
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    head_idx = kv_head_idx * GROUP + offs_g  # [GROUP_PAD]
    g_mask = offs_g < GROUP  # padded query rows
    d_mask = offs_d < HEAD_DIM  # padded head_dim lanes

    # q: [GROUP_PAD, HEAD_DIM_PAD]; padded rows/lanes are 0, so they add nothing to any score.
    q_ptrs = query_ptr + seq_idx * stride_qs + head_idx[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8 and q.dtype == tl.bfloat16:
        # fp16 dots (the module docstring): fp8 -> fp16 is one instruction for two values, exact. q saturates to
        # fp16's finite range (NaN stays NaN); values in fp16's normal range convert exactly. Under DOT_FP32 the
        # dots take these same values in fp32.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
    if DOT_FP32:
        q = q.to(tl.float32)

    table_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_bts
    k_head_ptr = k_cache_ptr + kv_head_idx * stride_kh
    v_head_ptr = v_cache_ptr + kv_head_idx * stride_vh

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    if V_KEYS_MINOR:
        # Interior tiles hold only live keys: no masks, and V loads whole blocks along keys. The edge tiles (the one
        # holding lo, the one holding read_hi; at most one of each a split) follow with masks.
        full_lo = tl.maximum(split_tile_lo, tl.cdiv(lo, BLOCK_N))
        full_hi = tl.maximum(tl.minimum(split_tile_hi, read_hi // BLOCK_N), full_lo)
        for tile_idx in range(full_lo, full_hi):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile_idx, lo, read_hi, table_ptr, k_head_ptr, v_head_ptr, stride_btb, stride_kb,
                stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, scale_log2, cap_in, cap_out, HEAD_DIM,
                HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, ONE_BLOCK_PER_TILE, USE_SOFT_CAP, True, False,
            )  # fmt: skip
        for tile_idx in tl.range(split_tile_lo, tl.minimum(full_lo, split_tile_hi), num_stages=1):  # one tile at most
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile_idx, lo, read_hi, table_ptr, k_head_ptr, v_head_ptr, stride_btb, stride_kb,
                stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, scale_log2, cap_in, cap_out, HEAD_DIM,
                HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, ONE_BLOCK_PER_TILE, USE_SOFT_CAP, True, True,
            )  # fmt: skip
        for tile_idx in tl.range(full_hi, split_tile_hi, num_stages=1):  # one tile at most
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile_idx, lo, read_hi, table_ptr, k_head_ptr, v_head_ptr, stride_btb, stride_kb,
                stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, scale_log2, cap_in, cap_out, HEAD_DIM,
                HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, ONE_BLOCK_PER_TILE, USE_SOFT_CAP, True, True,
            )  # fmt: skip
    else:
        for tile_idx in range(split_tile_lo, split_tile_hi):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile_idx, lo, read_hi, table_ptr, k_head_ptr, v_head_ptr, stride_btb, stride_kb,
                stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, scale_log2, cap_in, cap_out, HEAD_DIM,
                HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, ONE_BLOCK_PER_TILE, USE_SOFT_CAP, False, True,
            )  # fmt: skip

    if FUSED_WRITE:
        last_tile = (seq_len - 1) // BLOCK_N
        if (seq_len > 0) & (last_tile >= split_tile_lo) & (last_tile < split_tile_hi):  # our split holds it
            # nk, nv: [HEAD_DIM_PAD], the cache's dtype (the query's for an fp8 cache)
            nk = tl.load(new_k_ptr + seq_idx * stride_nks + kv_head_idx * stride_nkh + offs_d * stride_nkd,
                         mask=d_mask, other=0.0)  # fmt: skip
            nv = tl.load(new_v_ptr + seq_idx * stride_nvs + kv_head_idx * stride_nvh + offs_d * stride_nvd,
                         mask=d_mask, other=0.0)  # fmt: skip
            if KV_FP8:  # quantized as write_kv stores them (IEEE division, as the reference)
                nk = to_fp8(tl.math.div_rn(nk.to(tl.float32), k_scale), k_cache_ptr.dtype.element_ty)
                nv = to_fp8(tl.math.div_rn(nv.to(tl.float32), v_scale), v_cache_ptr.dtype.element_ty)
            slot = tl.load(slot_ptr + seq_idx).to(tl.int64)
            if slot >= 0:
                tl.store(k_head_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt
                         + offs_d * stride_kd, nk, mask=d_mask)  # fmt: skip
                tl.store(v_head_ptr + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt
                         + offs_d * stride_vd, nv, mask=d_mask)  # fmt: skip
            if KV_FP8:  # attend to the stored values, in the dtype the loop's tiles take
                nk = from_kv(nk, q.dtype)
                nv = from_kv(nv, q.dtype)
            nk_rows, nv_rows = nk[None, :], nv[None, :]  # [1, HEAD_DIM_PAD]: the new K/V of every query row
            # The new key's score for each query row ([GROUP_PAD]), as the tile loop scores a key (fp32 products of
            # the stored dtype), then one more online-softmax step.
            s_new = tl.sum(q.to(tl.float32) * nk_rows.to(tl.float32), axis=1)
            if USE_SOFT_CAP:
                s_new = cap_out * (1.0 - 2.0 / (tl.exp(2.0 * cap_in * s_new) + 1.0))
            else:
                s_new = s_new * scale_log2
            m_new = tl.maximum(m_i, s_new)  # finite
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)  # [GROUP_PAD]
            l_i = l_i * alpha + p_new
            # p rounded to the value dtype, as the loop's p @ v takes it
            acc = acc * alpha[:, None] + p_new.to(nv_rows.dtype).to(tl.float32)[:, None] * nv_rows.to(tl.float32)
            m_i = m_new

    if KV_FP8:  # every value of this split is in: scale them once (before the fold: the prefix partials are scaled)
        acc = acc * v_scale

    if HAS_PREFIX and WRITE_OUT:  # the prefix kernel ran first: fold its partials in
        if WAIT_PREFIX:
            tl.extra.cuda.gdc_wait()
        if prefix_len > 0:  # else the prefix kernel wrote nothing: the plain decode
            # Each prefix partial (normalized acc, lse in the log2 domain; lse -inf and no acc for a split without
            # keys) is one more online-softmax step with weight exp2(lse - m).
            pl_row = partial_lse_ptr + seq_idx.to(tl.int64) * stride_pls + head_idx * stride_plh  # [GROUP_PAD]
            pa_row = (
                partial_acc_ptr + seq_idx.to(tl.int64) * stride_pas + head_idx[:, None] * stride_pah
                + offs_d[None, :] * stride_pad
            )  # [GROUP_PAD, HEAD_DIM_PAD]  # fmt: skip
            # The prefix kernel's splits past this bound are empty (its split rule with the longest possible row).
            prefix_splits_used = tl.maximum(tl.cdiv(tl.cdiv(prefix_len, PREFIX_BLOCK_N), PREFIX_MIN_TILES), 1)
            for p_idx in range(tl.minimum(num_prefix_splits, prefix_splits_used)):
                lse_p = tl.load(pl_row + p_idx * stride_plp, mask=g_mask, other=float("-inf"))  # [GROUP_PAD]
                has_p = lse_p > float("-inf")
                # a_p: [GROUP_PAD, HEAD_DIM_PAD]
                a_p = tl.load(pa_row + p_idx * stride_pap, mask=(g_mask & has_p)[:, None] & d_mask[None, :],
                              other=0.0)  # fmt: skip
                m_new = tl.maximum(m_i, lse_p)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key on either side yet: weights 0
                alpha = tl.exp2(m_i - m_safe)
                w_p = tl.exp2(lse_p - m_safe)  # [GROUP_PAD]
                l_i = l_i * alpha + w_p
                acc = acc * alpha[:, None] + w_p[:, None] * a_p
                m_i = m_new

    if HAS_SINKS and WRITE_OUT:  # after the prefix fold: the row's whole softmax is in (m_i, l_i, acc)
        # The sink (natural log, neither scaled nor capped) is one more term without a value: it joins l_i only.
        sink = tl.load(sinks_ptr + head_idx, mask=g_mask, other=float("-inf")) * 1.4426950408889634  # [GROUP_PAD]
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded query rows
        alpha = tl.exp2(m_i - m_safe)  # [GROUP_PAD]; 0 for a row without keys (seq_len 0): out stays 0
        l_i = l_i * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha[:, None]
        m_i = m_new
    # l_i == 0 only for an empty split (no tiles): acc is 0 there, so out / lse become 0 / -inf.
    has_keys = l_i > 0.0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))  # [GROUP_PAD]
    pa_ptrs = (
        partial_acc_ptr
        + seq_idx.to(tl.int64) * stride_pas
        + head_idx[:, None] * stride_pah
        + split_idx * stride_pap
        + offs_d[None, :] * stride_pad
    )
    pl_ptrs = partial_lse_ptr + seq_idx.to(tl.int64) * stride_pls + head_idx * stride_plh + split_idx * stride_plp
    # An empty split writes only its lse (-inf): the merge loads no acc of a split without keys.
    acc_mask = store_mask & has_keys[:, None]
    if WRITE_OUT:
        out_ptrs = out_ptr + seq_idx * stride_os + head_idx[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        tl.store(pa_ptrs, acc, mask=acc_mask)
        tl.store(pl_ptrs, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits", "num_prefix_splits", "stride_pls", "stride_plh"])
def _merge_splits_kernel(
    # pointers
    partial_acc_ptr,  # [num_seqs, num_heads, num_splits + num_prefix_splits, head_dim], fp32
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits + num_prefix_splits], fp32 (log2 domain)
    prefix_len_ptr,  # [1], int32; read only when HAS_PREFIX
    out_ptr,  # [num_seqs, num_heads, head_dim]
    sinks_ptr,  # [num_heads], fp32; read only when HAS_SINKS
    # strides
    stride_pas,
    stride_pah,
    stride_pap,
    stride_pad,
    stride_pls,
    stride_plh,
    stride_plp,
    stride_os,
    stride_oh,
    stride_od,
    # sizes
    num_splits,  # the decode kernel's partials: slots [0, num_splits)
    num_prefix_splits,  # the shared-prefix kernel's: the next num_prefix_splits slots, when a prefix is set
    # meta-parameters
    NUM_SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits + num_prefix_splits
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    WAIT_PRIMARY: tl.constexpr,  # launched with PDL: wait until the decode kernel's partials are in memory
    HAS_SINKS: tl.constexpr,  # the head's sink logit joins the denominator, once (the splits leave it out)
):
    if WAIT_PRIMARY:
        tl.extra.cuda.gdc_wait()
    seq_idx = tl.program_id(0)
    head_idx = tl.program_id(1)
    num_partials = num_splits
    if HAS_PREFIX:
        prefix_len = tl.load(prefix_len_ptr)
        num_partials = num_splits + tl.where(prefix_len > 0, num_prefix_splits, 0)
    offs_p = tl.arange(0, NUM_SPLITS_PAD)  # [NUM_SPLITS_PAD]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    p_mask = offs_p < num_partials  # padded split slots (and the prefix's, when no prefix is set)
    d_mask = offs_d < HEAD_DIM  # padded head_dim lanes

    # lse: [NUM_SPLITS_PAD]; padded and empty splits are -inf and get weight 0.
    lse = tl.load(
        partial_lse_ptr + seq_idx.to(tl.int64) * stride_pls + head_idx * stride_plh + offs_p * stride_plp,
        mask=p_mask,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head_idx) * 1.4426950408889634  # natural log -> the partials' log2 domain
        lse_max = tl.maximum(lse_max, sink)
    # All splits empty (seq_len == 0): -inf - -inf would be NaN; shift by 0 so every weight is 0.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [NUM_SPLITS_PAD]
    denom = tl.sum(weights, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - lse_max)  # a term without a value; a row without keys gets 0 / that = 0

    # acc: [NUM_SPLITS_PAD, HEAD_DIM_PAD]; a split without keys (lse -inf) wrote no acc: not loaded, 0.
    acc = tl.load(
        partial_acc_ptr
        + seq_idx.to(tl.int64) * stride_pas
        + head_idx * stride_pah
        + offs_p[:, None] * stride_pap
        + offs_d[None, :] * stride_pad,
        mask=(p_mask & (lse > float("-inf")))[:, None] & d_mask[None, :],
        other=0.0,
    )
    merged = tl.sum(acc * weights[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)  # [HEAD_DIM_PAD]
    tl.store(
        out_ptr + seq_idx * stride_os + head_idx * stride_oh + offs_d * stride_od,
        merged.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


# Positional launches (kernels/launch.py): arguments in the kernel's parameter order.
SPLIT = Launcher(_paged_decode_kernel)
MERGE = Launcher(_merge_splits_kernel)
# The split kernel's arguments that a DecodeBinding (kernels/decode.py) takes anew at each launch: query, k_cache,
# v_cache, out, new_key, new_value, sinks, k_scale, v_scale (the other arguments describe the step: tables, lengths,
# slots, strides, constants).
BOUND_POSITIONS = (0, 1, 2, 6, 9, 10, 12, 13, 14)
