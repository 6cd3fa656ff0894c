"""Split-K paged decode attention (flash-decoding) in Triton.

One new token per sequence: query row s belongs to sequence s, sits at position ``seq_lens[s] - 1``
and attends to every cached position j <= that one (within the sliding window, if any). The cache
layout, the slot formula and the exact attention semantics are in kernels/reference.py.

Two kernels:

1. ``_paged_decode_kernel``, grid ``(num_seqs, num_kv_heads // HEADS, num_splits)``. A program owns one KV
   head of one sequence (``HEADS`` of them when a setting packs several: off by default, measured no faster end
   to end) and packs all ``group = num_heads // num_kv_heads`` query heads of that KV head into the rows of one
   tile, so each K/V tile is read from memory once per group. The
   sequence's live key range is cut into ``num_splits`` contiguous pieces, on KV-tile boundaries:

       keys:    [ lo ....................................... seq_len )   lo = seq_len - window, or 0
       tiles:   |  t0  |  t1  |  t2  |  t3  |  t4  |  t5  |  t6  |  t7 |   BLOCK_N keys each
       splits:  |     split 0        |     split 1        | split 2    |   cdiv(num_tiles, num_splits) tiles each

   Each split runs an online softmax in fp32 over its tiles. With one split the program normalizes
   and writes ``out`` directly; otherwise it writes a partial (normalized acc, log-sum-exp). A split
   with no tiles (a short sequence, or ``seq_len == 0``) writes the neutral partial (acc 0, lse -inf).
2. ``_merge_splits_kernel``, grid ``(num_seqs, num_heads)``: log-sum-exp combine of the partials.
   Rows whose partials are all neutral (``seq_len == 0``, e.g. CUDA-graph padding) get zeros. On SM90+ it is
   launched with programmatic dependent launch when the split grid is small (its launch overlaps the split
   kernel; it waits with ``griddepcontrol.wait`` before reading the partials).

With ``prefix_len`` (shared-prefix "cascade" decode, kernels/cascade.py) a third kernel reads the keys below
``prefix_len``, which every row shares, once per KV head for all rows; the split kernel then starts each row at
``prefix_len``. With several splits the merge also combines the prefix kernel's partials. With one split (large
batches) the prefix kernel runs first and the split kernel folds its partials into its own online softmax and writes
``out``: two launches, no merge (``CASCADE_MERGE_IN_SPLIT``); on SM90+ the split kernel is launched with
programmatic dependent launch and reads its own keys while the prefix kernel runs, waiting only before the fold
(``CASCADE_PDL``). ``prefix_len`` is read on the device, so with 0 the
kernels do exactly the plain decode (the prefix kernel returns at once; with one split the split kernel writes
``out`` and reads no partial, with several the merge reads only the split kernel's).

The split is per sequence (each sequence divides its own length, and uses only as many of the grid's
splits as give each ``MIN_KEYS_PER_SPLIT`` keys), so ``max_seq_len`` only sizes the grid and never
affects correctness: a CUDA graph captured with a bound that is too small still computes the right
answer, and one captured with ``max_model_len`` splits a short context as an exact bound would.

Why ``tl.dot`` for the group: the query tile is padded to at least 16 rows (the tensor-core minimum).
Decode is memory bound (about 1 flop per byte of K/V per query head), so the padded rows cost idle
tensor-core cycles but no bandwidth, while a broadcast-multiply-sum would need a
``[group, BLOCK_N, head_dim]`` register tile (64K values for group 8 at BLOCK_N 64, D 128) and spill.
"""

import functools
import math
import os

import torch
import triton
import triton.language as tl

from . import cascade as _cascade  # its MIN_KEYS_PER_PREFIX_SPLIT is read at plan time: one switch for both kernels
from .cascade import _shared_prefix_kernel, block_m_for, choose_num_prefix_splits
from .launch import Launcher, cdiv, next_power_of_2

__all__ = ["paged_decode_triton", "choose_num_splits"]

MAX_HEAD_DIM = 256
MAX_NUM_SPLITS = 64
# A split should stream at least this many keys, so that its fixed costs (query load, partial
# write, its share of the merge) stay small next to its K/V reads.
MIN_KEYS_PER_SPLIT = 64
# Programs to aim for per SM: about two waves at two resident programs per SM.
PROGRAMS_PER_SM = 4
# Launch settings of the split kernel, from a sweep on the H100 in a CUDA graph (benchmarks/RESULTS.md, seventh
# session: keys per tile x keys per split x programs per SM x warps, then stages and merge warps). Short splits (at
# most SHORT_SPLIT_KEYS keys each: small batches over long contexts) run 32-key tiles pipelined over 3 stages (1 x
# 4096: 13.5 -> 11.3 µs); long ones (large batches: one split, a long loop) keep 64-key tiles (LONG_SETTINGS below),
# which the short settings slow down (256 x 4096: 1426 -> 1566 µs). Swept at head_dim 128 only: other head dims keep
# one setting (_Plan). The merge gets a warp per MERGE_VALUES_PER_WARP partial values of a head (1 warp for up to
# 32 partials at head_dim 128, 2 for 64; was 4 warps always: 1 x 4096 12.2 -> 11.4 µs, 8 x 2048 30.7 -> 29.7).
SHORT_SPLIT_KEYS = 256
SHORT_BLOCK_N, SHORT_NUM_STAGES = 32, 3
DECODE_NUM_WARPS = 4
# Long splits: (keys per tile, stages, warps), from `benchmarks/decode_sweep.py` at the engine's shapes (its large
# decode batches are long splits: graphs are captured with max_seq_len = max_model_len). 64-key tiles over 3 stages
# were 3-9% faster than the seventh session's 2 stages on the H200 (eleventh session) and 1-10% on the H100 (twelfth
# session; end to end +0.6% nano on the H200, +0.5% sharegpt-8B on the H100: benchmarks/RESULTS.md). A card whose
# name contains a key of LONG_SETTINGS_BY_DEVICE takes that entry instead (none yet: both Hopper cards swept agree).
LONG_SETTINGS = (64, 3, 4)
LONG_SETTINGS_BY_DEVICE: dict[str, tuple[int, int, int]] = {}
# Shared-prefix (cascade) calls at head_dim 128: (keys per tile, stages, warps) of the split kernel, which then reads
# only each row's keys past the prefix, often a few tiles (the engine's cascade graphs are captured with max_seq_len =
# max_model_len, so they would otherwise run the long settings: 64-key tiles, 3 stages, 4 warps at 255 registers a
# thread, two programs an SM; 16/2/2 takes 157 registers, six an SM; ptxas -v on Triton 3.6's sm_90 build). Swept
# on the H100 (`decode_sweep.py --prefix-len 336`, whole cascade call in a graph, fourteenth session): 16-key tiles,
# 2 stages, 2 warps took 224 rows x 400 keys 51.7 -> 44.5 µs, 128 x 420 39.4 -> 36.9, 32 x 440 22.4 -> 22.2, and
# long suffixes 348.5 -> 357.9 (224 x 1360, 16 heads) and 213.4 -> 202.1 (128 x 1360, 32 heads); the prefix workload
# end to end +1.5% (alternating runs). None = the plain decode's settings.
CASCADE_SUFFIX_SETTINGS: tuple[int, ...] | None = (16, 2, 2)
# Shared-prefix calls with one split (large batches: the split kernel folds the prefix partials in), at head_dim 128:
# (keys per tile, stages, warps[, KV heads a program packs]), or None = CASCADE_SUFFIX_SETTINGS. Packing 4 KV heads a
# program (Qwen3-0.6B's 16 / 8 heads: 8 query rows, K/V tiles of 16 keys x 4 heads) took the whole cascade call on
# the H200 with rows of equal length (`decode_sweep.py --prefix-len 336`, twentieth session) at 224 rows x 400 keys
# 37.6 -> 33.5 µs (27.6 vs 29.1 with CASCADE_PDL), but 128 x 1360 at Llama-3.1-8B's heads 145 -> 166, and the prefix
# workload end to end (alternating runs) moved +6.5% and -0.7% (H200, without CASCADE_PDL) and -2.6% (H100, with it):
# no gain that holds, so it stays off. (Packing plain calls, ONE_SPLIT_SETTINGS, lost 8.8% on nano.)
CASCADE_ONE_SPLIT_SETTINGS: tuple[int, ...] | None = None
# Plain (no prefix) calls of one split at head_dim 128 whose rows give every SM a program with the heads packed
# (large batches): (keys per tile, stages, warps, KV heads a program packs), or None = the long or short settings.
# Swept on the H200 (`run_gpu.sh OUT one-split-ab`, twentieth session, rows of equal length), 16 / 2 / 2 / 4 beat the
# long settings (64 / 3 / 4) at 256 rows x 256-2048 keys by 1-9% (64.4 vs 70.7 µs at 256 x 256) but lost 11% at 128
# x 1024; on nano (rows of 100-2048 keys) it lost 8.8% end to end (21 869 / 21 870 vs 23 948 / 23 981 tok/s,
# alternating): a program holding every packed head of one row leaves the long rows' tail to few programs. Off.
ONE_SPLIT_SETTINGS: tuple[int, ...] | None = None
# A one-split shared-prefix call launches its split kernel with programmatic dependent launch (SM90+) after the prefix
# kernel: the split kernel reads each row's own keys while the prefix kernel (a few hundred latency-bound programs)
# still runs, and waits for the prefix partials (griddepcontrol.wait) only before folding them in. The whole call at
# 224 rows x 400 keys on the H200: 37.6 -> 29.1 µs (decode_sweep.py --prefix-len 336); the prefix workload end to end
# +3.6% and +9.1% over the same code without it (alternating runs, twentieth session).
CASCADE_PDL = True
# The shared-prefix kernel at head_dim 128: (keys per tile, warps); None = 64 keys, 4 warps. The 64-key tiles over 4
# warps run out of registers at every BLOCK_M (sm_90 build of Triton 3.6, ptxas -v: 255 registers and 700-912 bytes
# of spill stores a thread), and 32-key tiles over 8 warps spill nothing (197-229 registers). Measured anyway, the
# spill-free setting is the slower one on the H100 (fifteenth session, RESULTS.md): the prefix workload ran 5% slower
# (43 522 / 43 363 vs 45 803 / 45 546 tok/s, alternating), and the kernel took 409 µs a step at 224 rows and 338 at
# 32, where the fourteenth session's profile (another H100) had 336 and 255 with 64 x 4. So the default stays None;
# the switch is kept for other cards and head sizes.
CASCADE_PREFIX_SETTINGS: tuple[int, int] | None = None
# A shared-prefix call with one split (large batches): the prefix kernel first, then the split kernel folds the
# prefix's partials into its own softmax and writes out, instead of split kernel, prefix kernel, merge (one launch
# fewer a layer: the merge took 4 µs a layer at 224 rows on the H100, 2.2 at 32; RESULTS.md, fourteenth session).
# Measured on the H100 (fifteenth session): the prefix workload +2.7% (42 529 / 43 391 vs 41 724 / 41 930 tok/s,
# alternating). A module switch, so that one tree runs both sides (benchmarks/module_ab.py).
CASCADE_MERGE_IN_SPLIT = True
MERGE_VALUES_PER_WARP = 32 * 128  # 128 fp32 values a thread
MERGE_MAX_NUM_WARPS = 4
# SM count used when no CUDA device is present (TRITON_INTERPRET=1 runs); an H100 SXM has 132.
DEFAULT_NUM_SMS = 132
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


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
    out_ptr,  # [num_seqs, num_heads, head_dim]; written only when WRITE_OUT (and no prefix this step)
    partial_acc_ptr,  # [num_seqs, num_heads, num_partials, head_dim], fp32; slots [0, num_splits) are ours
    partial_lse_ptr,  # [num_seqs, num_heads, num_partials], fp32 (log2 domain)
    new_k_ptr,  # [num_seqs, num_kv_heads, head_dim]: FUSED_WRITE: each row's new key (its last position's)
    new_v_ptr,  # [num_seqs, num_kv_heads, head_dim]: FUSED_WRITE: each row's new value
    slot_ptr,  # [num_seqs], int32/int64: FUSED_WRITE: the slot the new K/V go to (-1 = not written)
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
    # sizes
    num_splits,
    num_prefix_splits,  # MERGE_PREFIX: the shared-prefix kernel's partials, slots [0, num_prefix_splits)
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
    WRITE_OUT: tl.constexpr,  # num_splits == 1: normalize and write out, skip the merge (unless a prefix is set)
    MIN_TILES_PER_SPLIT: tl.constexpr,  # a split streams at least this many tiles (MIN_KEYS_PER_SPLIT keys)
    DOT_FP32: tl.constexpr,  # upcast dot operands (interpreter bf16 tl.dot bug), False on GPU
    # The merge is launched with PDL: 1 = let it start at once (it waits for our partials), 2 = once this program has
    # written its partial (a split grid larger than one round of resident programs), 0 = no PDL merge.
    LAUNCH_DEPENDENTS: tl.constexpr,
    # The new token's K/V come in new_k/new_v instead of the cache: the program whose split holds position
    # seq_len - 1 writes them at their slot and attends to them from registers; the cache is read below it only.
    FUSED_WRITE: tl.constexpr,
    # WRITE_OUT with a prefix: the shared-prefix kernel ran first; this program folds its partials into its own
    # online softmax and writes out (no merge launch, no partial of its own).
    MERGE_PREFIX: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,  # MERGE_PREFIX: the prefix kernel's keys per tile and tiles a split at least: no
    PREFIX_MIN_TILES: tl.constexpr,  # prefix split past cdiv(cdiv(prefix_len, BLOCK_N), MIN_TILES) has keys
    # KV heads a program packs (the grid's second dimension is num_kv_heads // HEADS): its query tile holds the
    # GROUP * HEADS query heads of KV heads [program_id(1) * HEADS, +HEADS) and each K/V tile BLOCK_N keys x HEADS
    # heads, one contiguous run of the cache block (key-major, head-minor); each query row keeps the scores of its
    # own head's columns. 1 = one head a program.
    HEADS: tl.constexpr,
    # MERGE_PREFIX, launched with PDL after the shared-prefix kernel: wait for its partials before reading them.
    WAIT_PREFIX: tl.constexpr,
):
    if LAUNCH_DEPENDENTS == 1:
        tl.extra.cuda.gdc_launch_dependents()
    seq_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1) * HEADS  # the program's first KV head
    split_idx = tl.program_id(2)

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

    offs_g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]: query rows, GROUP * HEADS query heads
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    offs_n = tl.arange(0, BLOCK_N * HEADS)  # [BLOCK_N * HEADS]: a tile's (key, head) columns, key-major
    head_idx = kv_head_idx * GROUP + offs_g  # [GROUP_PAD]
    g_mask = offs_g < GROUP * HEADS  # padded query rows
    d_mask = offs_d < HEAD_DIM  # padded head_dim lanes
    if HEADS > 1:
        key_of_n = offs_n // HEADS  # [BLOCK_N * HEADS]: the column's key within the tile
        # [GROUP_PAD, BLOCK_N * HEADS]: query row g reads only the columns of its own KV head (padded rows: none)
        own_head = (offs_g // GROUP)[:, None] == (offs_n % HEADS)[None, :]
        n_head_offset = (offs_n % HEADS) * stride_kh  # [BLOCK_N * HEADS]
        n_head_offset_v = (offs_n % HEADS) * stride_vh
    else:
        key_of_n = offs_n

    # q: [GROUP_PAD, HEAD_DIM_PAD]; padded rows/lanes are 0, so they add nothing to any score.
    q_ptrs = query_ptr + seq_idx * stride_qs + head_idx[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    table_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_bts
    k_head_ptr = k_cache_ptr + kv_head_idx * stride_kh
    v_head_ptr = v_cache_ptr + kv_head_idx * stride_vh

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    for tile_idx in range(split_tile_lo, split_tile_hi):
        key_idx = tile_idx * BLOCK_N + key_of_n  # [BLOCK_N * HEADS] positions in the sequence
        # Keys outside [lo, read_hi) are masked: their table entries may be stale or unallocated.
        n_mask = (key_idx < read_hi) & (key_idx >= lo)
        if ONE_BLOCK_PER_TILE:
            # The whole tile sits in one cache block; its first key may be below lo (window), but
            # the tile holds key lo or later, so the block-table entry is live.
            block_id = tl.load(table_ptr + ((tile_idx * BLOCK_N) // BLOCK_SIZE) * stride_btb)
            in_block = (tile_idx * BLOCK_N) % BLOCK_SIZE + key_of_n
            row_offset = block_id.to(tl.int64) * stride_kb + in_block * stride_kt
            v_row_offset = block_id.to(tl.int64) * stride_vb + in_block * stride_vt
        else:
            # block_ids: [BLOCK_N * HEADS]; several keys share each entry (BLOCK_SIZE < BLOCK_N, or not divisible).
            block_ids = tl.load(table_ptr + (key_idx // BLOCK_SIZE) * stride_btb, mask=n_mask, other=0)
            row_offset = block_ids.to(tl.int64) * stride_kb + (key_idx % BLOCK_SIZE) * stride_kt
            v_row_offset = block_ids.to(tl.int64) * stride_vb + (key_idx % BLOCK_SIZE) * stride_vt
        if HEADS > 1:
            row_offset += n_head_offset
            v_row_offset += n_head_offset_v

        kv_mask = n_mask[:, None] & d_mask[None, :]  # [BLOCK_N * HEADS, HEAD_DIM_PAD]
        # k: [BLOCK_N * HEADS, HEAD_DIM_PAD]
        k = tl.load(k_head_ptr + row_offset[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        # scores: [GROUP_PAD, BLOCK_N * HEADS]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        if USE_SOFT_CAP:
            # soft_cap * tanh(scale * s / soft_cap), with tanh(x) = 1 - 2 / (exp(2x) + 1): right at
            # both tails (exp overflow -> 1, underflow -> -1), never NaN; tl has no portable tanh.
            scores = cap_out * (1.0 - 2.0 / (tl.exp(2.0 * cap_in * scores) + 1.0))
        else:
            scores = scores * scale_log2
        if HEADS > 1:
            scores = tl.where(n_mask[None, :] & own_head, scores, float("-inf"))
        else:
            scores = tl.where(n_mask[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [GROUP_PAD]
        # Every tile holds at least one live key, so m_new is finite; guard anyway so that a fully
        # masked row gives exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # [GROUP_PAD]; 0 on the first tile (m_i = -inf)
        p = tl.exp2(scores - m_safe[:, None])  # [GROUP_PAD, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # v: [BLOCK_N * HEADS, HEAD_DIM_PAD]
        v = tl.load(v_head_ptr + v_row_offset[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if FUSED_WRITE:
        last_tile = (seq_len - 1) // BLOCK_N
        if (seq_len > 0) & (last_tile >= split_tile_lo) & (last_tile < split_tile_hi):  # our split holds it
            if HEADS == 1:
                # nk, nv: [HEAD_DIM_PAD], the cache's dtype
                nk = tl.load(new_k_ptr + seq_idx * stride_nks + kv_head_idx * stride_nkh + offs_d * stride_nkd,
                             mask=d_mask, other=0.0)  # fmt: skip
                nv = tl.load(new_v_ptr + seq_idx * stride_nvs + kv_head_idx * stride_nvh + offs_d * stride_nvd,
                             mask=d_mask, other=0.0)  # fmt: skip
                slot = tl.load(slot_ptr + seq_idx).to(tl.int64)
                if slot >= 0:
                    tl.store(k_head_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt
                             + offs_d * stride_kd, nk, mask=d_mask)  # fmt: skip
                    tl.store(v_head_ptr + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt
                             + offs_d * stride_vd, nv, mask=d_mask)  # fmt: skip
                nk_rows, nv_rows = nk[None, :], nv[None, :]  # [1, HEAD_DIM_PAD]: the new K/V of every query row
            else:
                # Each query row's own KV head: kv_of_g [GROUP_PAD]; nk, nv: [GROUP_PAD, HEAD_DIM_PAD] (a KV head's
                # new K/V repeated over its GROUP query rows; padded rows load nothing).
                kv_of_g = kv_head_idx + offs_g // GROUP
                gd_mask = g_mask[:, None] & d_mask[None, :]
                nk = tl.load(new_k_ptr + seq_idx * stride_nks + kv_of_g[:, None] * stride_nkh
                             + offs_d[None, :] * stride_nkd, mask=gd_mask, other=0.0)  # fmt: skip
                nv = tl.load(new_v_ptr + seq_idx * stride_nvs + kv_of_g[:, None] * stride_nvh
                             + offs_d[None, :] * stride_nvd, mask=gd_mask, other=0.0)  # fmt: skip
                slot = tl.load(slot_ptr + seq_idx).to(tl.int64)
                if slot >= 0:
                    # the first query row of each KV head writes that head's K/V
                    w_mask = gd_mask & ((offs_g % GROUP) == 0)[:, None]
                    slot_offset = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt
                    v_slot_offset = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt
                    tl.store(k_cache_ptr + slot_offset + kv_of_g[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                             nk, mask=w_mask)  # fmt: skip
                    tl.store(v_cache_ptr + v_slot_offset + kv_of_g[:, None] * stride_vh
                             + offs_d[None, :] * stride_vd, nv, mask=w_mask)  # fmt: skip
                nk_rows, nv_rows = nk, nv
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

    if MERGE_PREFIX:
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
        if HAS_PREFIX and not MERGE_PREFIX:
            # One split: out directly when no prefix is set this step (the merge then does nothing), else a
            # partial for the merge to combine with the prefix's.
            direct = (offs_g * 0 + prefix_len) == 0  # [GROUP_PAD], all equal (a tensor: masks must be)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask & direct[:, None])
            tl.store(pa_ptrs, acc, mask=acc_mask & ~direct[:, None])
            tl.store(pl_ptrs, lse, mask=g_mask & ~direct)
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        tl.store(pa_ptrs, acc, mask=acc_mask)
        tl.store(pl_ptrs, lse, mask=g_mask)
    if LAUNCH_DEPENDENTS == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit(do_not_specialize=["num_splits", "num_prefix_splits", "stride_pls", "stride_plh"])
def _merge_splits_kernel(
    # pointers
    partial_acc_ptr,  # [num_seqs, num_heads, num_splits + num_prefix_splits, head_dim], fp32
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits + num_prefix_splits], fp32 (log2 domain)
    prefix_len_ptr,  # [1], int32; read only when HAS_PREFIX
    out_ptr,  # [num_seqs, num_heads, head_dim]
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
    ONE_SPLIT: tl.constexpr,  # num_splits == 1: with no prefix set, the decode kernel wrote out itself
    WAIT_PRIMARY: tl.constexpr,  # launched with PDL: wait until the decode kernel's partials are in memory
):
    if WAIT_PRIMARY:
        tl.extra.cuda.gdc_wait()
    seq_idx = tl.program_id(0)
    head_idx = tl.program_id(1)
    num_partials = num_splits
    if HAS_PREFIX:
        prefix_len = tl.load(prefix_len_ptr)
        if ONE_SPLIT:
            if prefix_len == 0:  # out is written already
                return
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
    # All splits empty (seq_len == 0): -inf - -inf would be NaN; shift by 0 so every weight is 0.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [NUM_SPLITS_PAD]
    denom = tl.sum(weights, axis=0)

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
_DECODE = Launcher(_paged_decode_kernel)
_MERGE = Launcher(_merge_splits_kernel)
_PREFIX = Launcher(_shared_prefix_kernel)
# The decode kernel's arguments that a DecodeBinding takes anew at each launch: query, k_cache, v_cache, out,
# new_key, new_value (the other arguments describe the step: tables, lengths, slots, strides, constants).
_BOUND_POSITIONS = (0, 1, 2, 6, 9, 10)


class DecodeBinding:
    """``paged_decode_triton``'s launch for one layer, kept for the next layers of the same eager decode step.

    An eager decode step runs the same decode launch once per layer: the same block tables, lengths and slots, and
    query / pool / new-K/V tensors of one layout. ``launch`` checks that a layer's tensors have the layout the kept
    launch was made for (shapes, strides, dtype, 16-byte alignment, the current device) and relaunches the kernel
    with them: no argument checks, split choice or launch-key computation (the host time an eager step pays once a
    layer). A layer that differs (another pool geometry, a sliding window, a misaligned view) gets None and takes
    ``paged_decode_triton``.
    """

    def __init__(self, bound, query, k_cache, v_cache, new_key, new_value, out):
        self._bound = bound
        self._device = torch.cuda.current_device()
        self._query_layout = (query.shape, query.stride(), query.dtype)
        self._cache_layout = (k_cache.shape, k_cache.stride(), v_cache.stride(), k_cache.dtype)
        self._out_stride = out.stride()
        self._fused = new_key is not None
        self._new_kv_layout = None
        if self._fused:
            self._new_kv_layout = (new_key.shape, new_key.stride(), new_value.stride(), new_key.dtype)

    def launch(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        new_key: torch.Tensor | None,  # [num_seqs, num_kv_heads, head_dim], as at the bind (or None, as there)
        new_value: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The layer's decode output [num_seqs, num_heads, head_dim], or None (nothing launched) when its tensors do
        not fit the kept launch."""
        if (
            (query.shape, query.stride(), query.dtype) != self._query_layout
            or (k_cache.shape, k_cache.stride(), v_cache.stride(), k_cache.dtype) != self._cache_layout
            or (new_key is not None) != self._fused
            or torch.cuda.current_device() != self._device
        ):
            return None
        pointers = query.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
        if self._fused:
            if (new_key.shape, new_key.stride(), new_value.stride(), new_key.dtype) != self._new_kv_layout:
                return None
            pointers |= new_key.data_ptr() | new_value.data_ptr()
        else:
            new_key = new_value = query  # the placeholders the bind launched with (never read without FUSED_WRITE)
        out = torch.empty_like(query)
        if (pointers | out.data_ptr()) & 15 or out.stride() != self._out_stride:
            return None
        self._bound.launch(query, k_cache, v_cache, out, new_key, new_value)
        return out


# Read once: the interpreter is chosen when the process starts (Triton reads the variable at import too).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Programmatic dependent launch of the split merge (SM90+): its launch overlaps the split kernel, which a CUDA graph
# otherwise leaves as a gap between the two (~2 µs at 1 x 4096 on an H100). A module switch for benchmarks.
USE_PDL = True
# Split grids larger than one round of resident programs could launch the merge with PDL too, triggered by each split
# program once its partial is written (LAUNCH_DEPENDENTS == 2), so that the merge's launch overlaps the split
# kernel's last programs. Measured slower on the H100 (benchmarks/kernels.py's PDL table, twenty-third session: 8 x
# 2048 30.0 -> 30.5 µs, 32 x 512 31.5 -> 32.0, 32 x 4096 193.1 -> 193.6, in a CUDA graph): off; kept as a switch.
PDL_LATE_TRIGGER = False


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    import triton.language as language

    has_gdc = hasattr(getattr(getattr(language, "extra", None), "cuda", None), "gdc_wait")
    return has_gdc and torch.cuda.get_device_capability(device_index)[0] >= 9


def long_split_settings(device: torch.device) -> tuple[int, int, int]:
    """(keys per tile, stages, warps) of the split kernel for long splits on ``device``: LONG_SETTINGS_BY_DEVICE's
    entry whose key is in the card's name, else LONG_SETTINGS (the CPU interpreter included)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, settings in LONG_SETTINGS_BY_DEVICE.items():
            if key in name:
                return settings
    return LONG_SETTINGS


def choose_num_splits(
    max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int, min_keys_per_split: int | None = None
) -> int:
    """Host-side split heuristic for the decode kernel (no device sync, so CUDA-graph safe).

    Aim for ``PROGRAMS_PER_SM * num_sms`` programs (about two waves) across ``num_seqs *
    num_kv_heads * num_splits``, but give every split at least ``MIN_KEYS_PER_SPLIT`` keys of the
    longest context, and never more than ``MAX_NUM_SPLITS``. One split when the batch already
    fills the GPU or the context is short.

    Args:
        max_seq_len: Upper bound of ``seq_lens`` (a hint; correctness does not depend on it).
        num_seqs: Number of sequences (query rows) in the batch.
        num_kv_heads: KV heads of the cache.
        num_sms: Streaming multiprocessors of the device.
        min_keys_per_split: Keys each split gets at least (default ``MIN_KEYS_PER_SPLIT``; a smaller value is
            raised to it).

    Returns:
        The number of splits, in ``[1, MAX_NUM_SPLITS]``.
    """
    base_programs = max(num_seqs * num_kv_heads, 1)
    wanted = cdiv(PROGRAMS_PER_SM * num_sms, base_programs)
    min_keys = MIN_KEYS_PER_SPLIT if min_keys_per_split is None else max(min_keys_per_split, MIN_KEYS_PER_SPLIT)
    by_context = max(cdiv(max_seq_len, min_keys), 1)
    return max(1, min(wanted, by_context, MAX_NUM_SPLITS))


def _check_args(
    query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, num_splits, out, prefix_len, sliding_window,
    num_prefix_splits, new_key=None, new_value=None, slot_mapping=None,
) -> None:  # fmt: skip
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim], got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim must equal query head_dim {head_dim}, got {k_cache.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"query dtype must be one of {list(_SUPPORTED_DTYPES)}, got {query.dtype}")
    if k_cache.dtype != query.dtype or v_cache.dtype != query.dtype:
        raise ValueError(
            f"k_cache/v_cache dtype must equal query dtype {query.dtype}, got {k_cache.dtype}/{v_cache.dtype}"
        )
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks_per_seq], got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(f"seq_lens must be int32 [num_seqs={num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    devices = {t.device for t in (query, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if max_seq_len < 0:
        raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
    if num_splits is not None and not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_NUM_SPLITS}] or None, got {num_splits}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(
            f"out must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), got "
            f"({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    if num_prefix_splits is not None and not 1 <= num_prefix_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_prefix_splits must be in [1, {MAX_NUM_SPLITS}] or None, got {num_prefix_splits}")
    fused = (new_key is not None, new_value is not None, slot_mapping is not None)
    if any(fused):
        if not all(fused):
            raise ValueError(
                "new_key, new_value and slot_mapping go together (the fused K/V write), got "
                f"new_key={'set' if fused[0] else None}, new_value={'set' if fused[1] else None}, "
                f"slot_mapping={'set' if fused[2] else None}"
            )
        kv_shape = (num_seqs, num_kv_heads, head_dim)
        for name, t in (("new_key", new_key), ("new_value", new_value)):
            if tuple(t.shape) != kv_shape or t.dtype != k_cache.dtype or t.device != query.device:
                raise ValueError(
                    f"{name} must be {k_cache.dtype} [num_seqs, num_kv_heads, head_dim] = {list(kv_shape)} on "
                    f"{query.device}, got {t.dtype} {list(t.shape)} on {t.device}"
                )
        if (
            slot_mapping.dtype not in (torch.int32, torch.int64)
            or tuple(slot_mapping.shape) != (num_seqs,)
            or slot_mapping.device != query.device
        ):
            raise ValueError(
                f"slot_mapping must be int32/int64 [num_seqs={num_seqs}] on {query.device}, got {slot_mapping.dtype} "
                f"{list(slot_mapping.shape)} on {slot_mapping.device}"
            )
    if prefix_len is not None:
        if prefix_len.dtype != torch.int32 or prefix_len.numel() != 1 or prefix_len.device != query.device:
            raise ValueError(
                f"prefix_len must be an int32 tensor of one element on {query.device}, got {prefix_len.dtype} "
                f"{tuple(prefix_len.shape)} on {prefix_len.device}"
            )
        if sliding_window is not None and sliding_window > 0:
            raise ValueError(
                f"prefix_len (cascade) does not support sliding_window={sliding_window}: pass prefix_len=None for "
                "sliding-window layers"
            )


def paged_decode_triton(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32; 0 = padding row (output zeros)
    scale: float,
    *,
    max_seq_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    num_splits: int | None = None,
    prefix_len: torch.Tensor | None = None,  # [1], int32: keys shared by every row (cascade); 0 or None = none
    max_prefix_len: int | None = None,
    num_prefix_splits: int | None = None,
    new_key: torch.Tensor | None = None,  # [num_seqs, num_kv_heads, head_dim]
    new_value: torch.Tensor | None = None,  # [num_seqs, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor | None = None,  # [num_seqs], int32/int64; -1 = not written
    min_keys_per_split: int | None = None,
    bind: list | None = None,
) -> torch.Tensor:
    """Decode attention: each sequence's last token over its paged context (flash-decoding).

    Args:
        query: One new token per sequence, at position ``seq_lens[s] - 1`` of sequence s.
        k_cache: Key pool, layout in kernels/reference.py.
        v_cache: Value pool, same shape as ``k_cache`` (its strides may differ).
        block_tables: Physical block of each logical block; entries past a sequence's length are
            never read.
        seq_lens: Context length of each sequence, including the new token.
        scale: Softmax scale applied to q.k.
        max_seq_len: Host-side upper bound of ``seq_lens``; only picks ``num_splits``.
        sliding_window: Attend to the last ``sliding_window`` positions (the token itself
            included); None or <= 0 disables it, as in the reference.
        soft_cap: Scores become ``soft_cap * tanh(scores / soft_cap)``; None or <= 0 disables it.
        out: Optional output buffer; every row is written.
        num_splits: Force the number of context splits; None picks it with ``choose_num_splits``.
        prefix_len: Shared-prefix (cascade) attention, kernels/cascade.py: the keys ``[0, prefix_len)`` are read
            once per KV head for all rows, through row 0 of ``block_tables``, by the shared-prefix kernel; the
            split kernel reads only the keys from ``prefix_len`` on. The caller's contract: for every row with
            ``seq_lens > 0``, its table's blocks covering ``[0, min(prefix_len, seq_len))`` are row 0's (the same
            physical blocks). A device value, so a CUDA graph replays with any length (0 = plain decode, exactly).
            Not with ``sliding_window``.
        max_prefix_len: Host-side bound of ``prefix_len``; only picks ``num_prefix_splits`` (default: max_seq_len).
        num_prefix_splits: Force the shared-prefix kernel's split count; None picks it with
            ``choose_num_prefix_splits``.
        new_key, new_value, slot_mapping: The new token's K/V (position ``seq_lens[s] - 1``), not yet in the cache:
            written at ``slot_mapping`` (``write_kv``'s semantics) by the same kernel, which attends to them from
            registers (one launch instead of a write and a decode). All three or none. With ``prefix_len``, each
            row's new position must lie at or above ``prefix_len`` (the shared blocks are not written this step,
            as in an engine step: a row appends into a block it holds alone); the split kernel holds it.
        min_keys_per_split: Give each split at least this many keys when picking ``num_splits`` (default
            ``MIN_KEYS_PER_SPLIT``). Eager callers, whose GPU waits for the host's next launch, pass more: fewer
            splits, and one split writes ``out`` itself (no merge launch, no partial buffers).
        bind: A list to receive a ``DecodeBinding`` of this call's launch (appended when the call was one launch:
            one split, no prefix, no PDL, direct launches on): later calls with other layers' tensors of the same
            layout and the same block tables, lengths and slots take ``DecodeBinding.launch`` instead of this
            function (an eager decode step's layers after the first).

    Returns:
        out: [num_seqs, num_heads, head_dim] in query's dtype.

    Raises:
        ValueError: On a shape, dtype, device or range mismatch (the message names the value).
    """
    # The checks and every launch argument fixed by the arguments' shapes, strides, dtypes and devices are computed
    # once per such signature (eager decoding calls this once per layer per step with the same one); the values
    # that change per call (lengths, split counts) are checked on every call.
    signature = (
        query.shape, query.stride(), query.dtype, query.device,
        k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
        v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
        block_tables.shape, block_tables.stride(), block_tables.dtype, block_tables.device,
        seq_lens.shape, seq_lens.dtype, seq_lens.device,
        None if out is None else (out.shape, out.dtype, out.device),
        None if prefix_len is None else (prefix_len.shape, prefix_len.dtype, prefix_len.device),
        None if new_key is None else (
            new_key.shape, new_key.stride(), new_key.dtype, new_key.device,
            None if new_value is None else (new_value.shape, new_value.stride(), new_value.dtype, new_value.device),
            None if slot_mapping is None else (slot_mapping.shape, slot_mapping.dtype, slot_mapping.device),
        ),
        new_value is None, slot_mapping is None,
        scale, sliding_window, soft_cap,
    )  # fmt: skip
    plan = _PLANS.get(signature)
    if (
        plan is None
        or max_seq_len < 0
        or (num_splits is not None and not 1 <= num_splits <= MAX_NUM_SPLITS)
        or (num_prefix_splits is not None and not 1 <= num_prefix_splits <= MAX_NUM_SPLITS)
    ):
        _check_args(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            max_seq_len,
            num_splits,
            out,
            prefix_len,
            sliding_window,
            num_prefix_splits,
            new_key,
            new_value,
            slot_mapping,
        )  # fmt: skip  (raises on anything wrong)
        if plan is None:
            if len(_PLANS) >= _MAX_PLANS:  # e.g. many batch sizes: start over, rarely
                _PLANS.clear()
            plan = _PLANS[signature] = _Plan(
                query, k_cache, v_cache, block_tables, scale, sliding_window, soft_cap, new_key, new_value
            )
    num_seqs, num_heads, head_dim, num_kv_heads = plan.num_seqs, plan.num_heads, plan.head_dim, plan.num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    num_sms = plan.num_sms
    if num_splits is None:
        num_splits = choose_num_splits(max_seq_len, num_seqs, num_kv_heads, num_sms, min_keys_per_split)
    write_out = num_splits == 1
    has_prefix = prefix_len is not None
    # PDL for the merge when it directly follows the split kernel (the prefix kernel sits between them otherwise),
    # and only while the split grid fits one round of resident programs: the merge's programs, started early, wait
    # in SM slots that a larger split grid still needs (H100, in a graph: 1 x 512 7.0 -> 6.4 µs, 1 x 4096 13.9 ->
    # 13.6, but 32 x 512 33.1 -> 34.6; benchmarks/RESULTS.md, sixth session).
    # With PDL_LATE_TRIGGER (off: measured slower) a larger split grid lets the merge start only as its last
    # programs finish.
    pdl = plan.pdl_ok and USE_PDL and not write_out and not has_prefix
    launch_dependents = 0
    if pdl:
        launch_dependents = 1 if num_seqs * num_kv_heads * num_splits <= PROGRAMS_PER_SM * num_sms else 2
        if launch_dependents == 2 and not PDL_LATE_TRIGGER:
            pdl, launch_dependents = False, 0
    if has_prefix and num_prefix_splits is None:
        num_prefix_splits = choose_num_prefix_splits(
            max_seq_len if max_prefix_len is None else max_prefix_len,
            cdiv(num_seqs * plan.group, plan.block_m),
            num_kv_heads,
            num_sms,
        )
    if not has_prefix:
        num_prefix_splits = 0
        prefix_len = seq_lens  # placeholder pointer: never read without HAS_PREFIX
    # One split with a prefix: the prefix kernel runs first and the split kernel folds its partials in (one launch
    # fewer than the merge, and no partial of the split's own).
    merge_prefix = has_prefix and write_out and CASCADE_MERGE_IN_SPLIT
    prefix_pdl = merge_prefix and plan.pdl_ok and USE_PDL and CASCADE_PDL
    num_partials = num_prefix_splits if merge_prefix else num_splits + num_prefix_splits

    if write_out and not has_prefix:
        # Unused placeholders: the kernel never touches them when WRITE_OUT. Made per call, never kept: a kept
        # tensor first made inside a CUDA graph capture or a torch.compile "reduce-overhead" warm-up would live
        # in that graph's private pool, and inductor's CUDA-graph trees then refuse the next recording ("tensor(s)
        # in the cudagraph pool not tracked as outputs"; found by the PagedCache fuzzer on CUDA). Two small
        # allocations a call; the eager decode steps keep their launch (DecodeBinding) and skip this.
        partial_acc = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=query.device)
        partial_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=query.device)
    else:
        # Allocated per call; inside the engine's CUDA graphs that happens once, at capture (the graph's pool).
        device = query.device
        partial_acc = torch.empty((num_seqs, num_heads, num_partials, head_dim), dtype=torch.float32, device=device)
        partial_lse = torch.empty((num_seqs, num_heads, num_partials), dtype=torch.float32, device=device)
    partial_strides = (*partial_acc.stride(), *partial_lse.stride())
    out_strides = out.stride()

    variants = plan.variants
    variant = variants["long" if cdiv(max_seq_len, num_splits) > SHORT_SPLIT_KEYS else "short"]
    if has_prefix:
        variant = variants.get("cascade_one_split" if write_out else "cascade", variant)
    elif write_out and "one_split" in variants and num_seqs * num_kv_heads >= num_sms * variants["one_split"][4]:
        variant = variants["one_split"]  # at least a program an SM with its heads packed
    decode_args, min_tiles, num_stages, num_warps, heads = variant
    fused = new_key is not None
    if not fused:  # placeholder pointers: never read without FUSED_WRITE
        new_key, new_value, slot_mapping = query, query, seq_lens

    def launch_prefix(split_offset: int, launch_dependents: bool = False) -> None:
        _PREFIX(
            (cdiv(num_seqs * plan.group, plan.block_m), num_kv_heads, num_prefix_splits),
            query, k_cache, v_cache, block_tables, seq_lens, prefix_len, partial_acc, partial_lse,
            *plan.strides[:-2], plan.strides[-1],  # query, k_cache, v_cache; block_tables' column stride
            *partial_strides,
            num_seqs * plan.group,  # num_rows
            num_prefix_splits,
            split_offset,  # the first partial slot of the prefix kernel's
            *plan.prefix_args,  # scale_log2 .. MIN_TILES_PER_SPLIT
            plan.dot_fp32,
            launch_dependents,  # LAUNCH_DEPENDENTS
            num_warps=plan.prefix_num_warps,
            num_stages=2,
        )  # fmt: skip

    if merge_prefix:
        launch_prefix(0, prefix_pdl)  # its partials are the only ones
    grid = (num_seqs, num_kv_heads // heads, num_splits)
    args = (
        query, k_cache, v_cache, block_tables, seq_lens, prefix_len, out, partial_acc, partial_lse,
        new_key, new_value, slot_mapping,
        *plan.strides, *out_strides, *partial_strides, *plan.new_kv_strides,
        num_splits, num_prefix_splits,
        *decode_args,  # scale_log2, cap_in, cap_out, sliding_window, GROUP .. USE_SOFT_CAP
        has_prefix, write_out,
        min_tiles, plan.dot_fp32,  # MIN_TILES_PER_SPLIT, DOT_FP32
        launch_dependents,  # LAUNCH_DEPENDENTS
        fused,  # FUSED_WRITE
        merge_prefix,  # MERGE_PREFIX
        *plan.prefix_split_rule,  # PREFIX_BLOCK_N, PREFIX_MIN_TILES
        heads,  # HEADS
        prefix_pdl,  # WAIT_PREFIX
    )  # fmt: skip
    _DECODE(grid, *args, num_warps=num_warps, num_stages=num_stages, launch_pdl=prefix_pdl)
    if bind is not None and write_out and not has_prefix and not pdl:
        bound = _DECODE.bind(grid, args, _BOUND_POSITIONS, num_warps=num_warps, num_stages=num_stages)
        if bound is not None:
            bind.append(DecodeBinding(bound, query, k_cache, v_cache, new_key if fused else None, new_value, out))
    if merge_prefix:
        return out
    if has_prefix:
        launch_prefix(num_splits)  # the decode kernel's partials come first
    elif write_out:
        return out
    num_partials_pad = next_power_of_2(num_partials)
    _MERGE(
        (num_seqs, num_heads),
        partial_acc, partial_lse, prefix_len, out,
        *partial_strides, *out_strides,
        num_splits, num_prefix_splits,
        num_partials_pad,  # NUM_SPLITS_PAD
        head_dim, plan.head_dim_pad,
        has_prefix,  # HAS_PREFIX
        write_out,  # ONE_SPLIT
        pdl,  # WAIT_PRIMARY
        num_warps=min(MERGE_MAX_NUM_WARPS, max(1, num_partials_pad * plan.head_dim_pad // MERGE_VALUES_PER_WARP)),
        num_stages=3,  # Triton's default on CUDA
        launch_pdl=pdl,
    )  # fmt: skip
    return out


# paged_decode_triton's checked argument signatures -> their _Plan.
_PLANS: dict[tuple, "_Plan"] = {}
_MAX_PLANS = 256


class _Plan:
    """What paged_decode_triton's launches need that depends only on a checked argument signature."""

    __slots__ = ("num_seqs", "num_heads", "head_dim", "num_kv_heads", "group", "num_sms", "head_dim_pad", "block_m",
                 "strides", "variants", "prefix_args", "prefix_split_rule", "prefix_num_warps", "dot_fp32",
                 "pdl_ok", "new_kv_strides")  # fmt: skip

    def __init__(self, query, k_cache, v_cache, block_tables, scale, sliding_window, soft_cap, new_key, new_value):
        self.num_seqs, self.num_heads, self.head_dim = query.shape
        block_size, self.num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = self.group = self.num_heads // self.num_kv_heads
        self.num_sms = _num_sms(query.device.index or 0) if query.is_cuda else DEFAULT_NUM_SMS
        head_dim_pad = self.head_dim_pad = max(16, next_power_of_2(self.head_dim))
        # Keys per tile (a power of two, so with block_size >= BLOCK_N, a power of two times a multiple of BLOCK_N,
        # a tile never crosses a block and needs one block-table entry). At head_dim 128 (where the settings were
        # swept) per call: SHORT_BLOCK_N and 3 stages for short splits, the card's long_split_settings otherwise
        # (SHORT_SPLIT_KEYS). Other head dims keep the earlier settings, as the shared-prefix kernel does: 64 keys,
        # 32 above head_dim 128 (the K/V tiles stay in registers), 2 stages, 4 warps.
        base_block_n = 32 if head_dim_pad > 128 else 64
        # name -> (keys per tile, stages, warps[, KV heads a program packs]): "short" and "long" splits; at head_dim
        # 128 also "one_split" (plain calls of one split over enough rows, ONE_SPLIT_SETTINGS), "cascade" and
        # "cascade_one_split" (shared-prefix calls: CASCADE_SUFFIX_SETTINGS, CASCADE_ONE_SPLIT_SETTINGS); a missing
        # name falls back to "long" (paged_decode_triton).
        if head_dim_pad == 128:
            long = long_split_settings(query.device)
            settings = {"short": (SHORT_BLOCK_N, SHORT_NUM_STAGES, DECODE_NUM_WARPS), "long": long}
            for name, value in (
                ("one_split", ONE_SPLIT_SETTINGS),
                ("cascade", CASCADE_SUFFIX_SETTINGS),
                ("cascade_one_split", CASCADE_ONE_SPLIT_SETTINGS or CASCADE_SUFFIX_SETTINGS),
            ):
                if value is not None:
                    settings[name] = value
        else:
            settings = {"short": (base_block_n, 2, DECODE_NUM_WARPS), "long": (base_block_n, 2, DECODE_NUM_WARPS)}
        use_window = sliding_window is not None and sliding_window > 0
        use_soft_cap = soft_cap is not None and soft_cap > 0
        scale_args = (
            float(scale) * _LOG2E,  # scale_log2
            float(scale) / soft_cap if use_soft_cap else 0.0,  # cap_in
            float(soft_cap) * _LOG2E if use_soft_cap else 0.0,  # cap_out
        )
        self.strides = (*query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride())
        self.new_kv_strides = (0,) * 6 if new_key is None else (*new_key.stride(), *new_value.stride())
        # name -> (decode_args, MIN_TILES_PER_SPLIT, num_stages, num_warps, HEADS). A setting's optional fourth entry
        # is the KV heads a program packs, taken as its largest divisor of num_kv_heads that is a power of two.
        self.variants = {}
        for name, (block_n, num_stages, num_warps, *packed) in settings.items():
            heads = math.gcd(packed[0] if packed else 1, self.num_kv_heads)
            decode_args = (
                *scale_args,
                int(sliding_window) if use_window else 0,
                group, max(16, next_power_of_2(group * heads)),  # GROUP, GROUP_PAD
                self.head_dim, head_dim_pad, block_size,
                block_n, block_size % block_n == 0,  # BLOCK_N, ONE_BLOCK_PER_TILE
                use_window, use_soft_cap,
            )  # fmt: skip
            self.variants[name] = (decode_args, max(1, MIN_KEYS_PER_SPLIT // block_n), num_stages, num_warps, heads)
        self.block_m = block_m_for(self.num_seqs * group, head_dim_pad)
        prefix_block_n, self.prefix_num_warps = base_block_n, 4
        if head_dim_pad == 128 and CASCADE_PREFIX_SETTINGS is not None:
            prefix_block_n, self.prefix_num_warps = CASCADE_PREFIX_SETTINGS
        self.prefix_split_rule = (prefix_block_n, max(1, _cascade.MIN_KEYS_PER_PREFIX_SPLIT // prefix_block_n))
        self.prefix_args = (
            *scale_args,
            group, self.head_dim, head_dim_pad, block_size, self.block_m, prefix_block_n,  # GROUP .. BLOCK_N
            block_size % prefix_block_n == 0, use_soft_cap,  # ONE_BLOCK_PER_TILE, USE_SOFT_CAP
            self.prefix_split_rule[1],  # MIN_TILES_PER_SPLIT
        )  # fmt: skip
        # Triton's interpreter (3.9) returns garbage for tl.dot on bf16 operands; upcast there only.
        self.dot_fp32 = query.dtype == torch.bfloat16 and _INTERPRETED
        self.pdl_ok = query.is_cuda and _pdl_supported(query.device.index or 0)
