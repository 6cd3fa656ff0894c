"""Triton kernels of MLA over a paged latent cache (kernels/mla.py holds the layout, the semantics and the
torch references; the public functions there dispatch here on CUDA).

Every query head attends to the same cached row per token, ``[c (V_DIM) | k_rot (ROPE_DIM)]``: a program takes a
tile of heads (decode) or of (token, head) pairs (prefill) as the rows of one query tile, so each KV tile is
loaded once for all of them, and the latent part ``c`` of the tile serves as K (with ``k_rot``) and as V:

    scores = q_lat @ c^T + q_rot @ k_rot^T        [rows, BLOCK_N]
    acc    = acc * alpha + p @ c                  [rows, V_PAD]

1. ``_mla_decode_kernel``, grid ``(cdiv(num_heads, BLOCK_H), num_seqs, num_splits)``: one new token per sequence.
   The head tiles come first so that those of one sequence's split run side by side and read its rows from L2.
   The context is cut into ``num_splits`` pieces on tile boundaries (split-K, as kernels/split_decode.py), each
   sequence using only as many as give each ``MIN_TILES_PER_SPLIT`` tiles; one split writes ``out``, several write
   partials (normalized acc, log2-sum-exp) that ``_mla_merge_kernel`` combines. ``seq_len == 0`` (padding) gives 0.
2. ``_mla_prefill_kernel``, grid ``(cdiv(max_query_len * num_heads, BLOCK_M), num_seqs)``: a sequence's new tokens,
   rows ``m -> (token m // num_heads, head m % num_heads)``, causal over the context. The grid comes from the host
   bound ``max_query_len``; programs past their sequence's rows return at once.

Why ``tl.dot`` with padded head rows: at a few heads (DeepSeek-V2-Lite's 16) decode is memory bound, so rows padded
up to the tensor-core minimum of 16 cost no bandwidth. At 128 heads (DeepSeek-V3) a cached row costs about 280 flops
a byte and decode is bound by the tensor cores instead (docs/kernels.md has the figures).
"""

import os

import torch
import triton
import triton.language as tl

from .launch import cdiv, next_power_of_2

__all__ = ["mla_decode_triton", "mla_prefill_triton", "choose_mla_splits"]

_LOG2E = 1.4426950408889634
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# A split streams at least this many keys: fewer would cost more in partials and merge than the parallelism gains.
MIN_KEYS_PER_SPLIT = 128
MAX_NUM_SPLITS = 64
# SM count when no CUDA device is present (TRITON_INTERPRET=1 runs).
_DEFAULT_NUM_SMS = 132
_NUM_SMS: dict[int, int] = {}


@triton.jit
def _online_step(q_lat, q_rot, c, k_rot, n_mask, m_i, l_i, acc, scale_log2, DOT_FP32: tl.constexpr):
    """One KV tile of the online softmax for every query row of the program.

    q_lat [ROWS, V_PAD], q_rot [ROWS, ROPE_PAD], c [BLOCK_N, V_PAD], k_rot [BLOCK_N, ROPE_PAD],
    n_mask [ROWS, BLOCK_N] (True: the row attends to the key), m_i / l_i [ROWS], acc [ROWS, V_PAD] fp32.
    """
    if DOT_FP32:
        c = c.to(tl.float32)
        k_rot = k_rot.to(tl.float32)
    # scores: [ROWS, BLOCK_N], log2 domain
    scores = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
    scores = tl.dot(q_rot, tl.trans(k_rot), acc=scores, input_precision="ieee")
    scores = tl.where(n_mask, scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row with no live key in this tile (causal edge, padded head) keeps m = -inf: exp2(-inf - 0) = 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])  # [ROWS, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits", "stride_bts"])
def _mla_decode_kernel(
    # pointers
    q_ptr,  # [num_seqs, num_heads, kv_width]
    kv_ptr,  # [num_blocks, block_size, 1, kv_width]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens_ptr,  # [num_seqs], int32
    out_ptr,  # [num_seqs, num_heads, V_DIM]: written when WRITE_OUT
    partial_acc_ptr,  # [num_seqs, num_heads, num_splits, V_DIM], fp32: written unless WRITE_OUT
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits], fp32 (log2 domain)
    # strides
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kd,
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
    # sizes
    num_heads,
    num_splits,
    scale_log2,  # softmax scale * log2(e)
    # meta-parameters
    V_DIM: tl.constexpr,  # the latent's width (kv_lora_rank)
    V_PAD: tl.constexpr,  # next power of two >= max(V_DIM, 16)
    ROPE_DIM: tl.constexpr,  # kv_width - V_DIM
    ROPE_PAD: tl.constexpr,  # next power of two >= max(ROPE_DIM, 16)
    BLOCK_H: tl.constexpr,  # query heads per program (>= 16)
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_SIZE: tl.constexpr,  # keys per cache block
    MIN_TILES_PER_SPLIT: tl.constexpr,
    WRITE_OUT: tl.constexpr,  # num_splits == 1: normalize and write out, no partials
    DOT_FP32: tl.constexpr,  # upcast dot operands (interpreter bf16 tl.dot bug), False on GPU
):
    # the fastest axis: the head tiles of one (sequence, split) run together and share its rows in L2
    head_tile = tl.program_id(0)
    seq_idx = tl.program_id(1)
    split_idx = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq_idx)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    splits_used = tl.minimum(num_splits, tl.maximum(tl.cdiv(num_tiles, MIN_TILES_PER_SPLIT), 1))
    tiles_per_split = tl.cdiv(num_tiles, splits_used)
    tile_lo = split_idx * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_v = tl.arange(0, V_PAD)  # [V_PAD]
    offs_r = tl.arange(0, ROPE_PAD)  # [ROPE_PAD]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    h_mask = offs_h < num_heads  # padded head rows
    v_mask = offs_v < V_DIM  # padded latent lanes
    r_mask = offs_r < ROPE_DIM  # padded rope lanes

    # q_lat: [BLOCK_H, V_PAD], q_rot: [BLOCK_H, ROPE_PAD]; padded rows and lanes are 0 and add nothing to a score.
    q_row = q_ptr + seq_idx.to(tl.int64) * stride_qs + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_v[None, :] * stride_qd, mask=h_mask[:, None] & v_mask[None, :], other=0.0)
    q_rot = tl.load(q_row + (V_DIM + offs_r)[None, :] * stride_qd, mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_rot = q_rot.to(tl.float32)

    table_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_bts
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, V_PAD], dtype=tl.float32)
    for tile_idx in range(tile_lo, tile_hi):
        key_idx = tile_idx * BLOCK_N + offs_n  # [BLOCK_N] positions in the sequence
        n_mask = key_idx < seq_len  # past the length: stale or unallocated table entries, never read
        block_ids = tl.load(table_ptr + (key_idx // BLOCK_SIZE) * stride_btb, mask=n_mask, other=0)
        row_offset = block_ids.to(tl.int64) * stride_kb + (key_idx % BLOCK_SIZE) * stride_kt  # [BLOCK_N]
        # c: [BLOCK_N, V_PAD] (K's latent part and V), k_rot: [BLOCK_N, ROPE_PAD]
        c = tl.load(kv_ptr + row_offset[:, None] + offs_v[None, :] * stride_kd,
                    mask=n_mask[:, None] & v_mask[None, :], other=0.0)  # fmt: skip
        k_rot = tl.load(kv_ptr + row_offset[:, None] + (V_DIM + offs_r)[None, :] * stride_kd,
                        mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # fmt: skip
        live = h_mask[:, None] & n_mask[None, :]  # [BLOCK_H, BLOCK_N]
        m_i, l_i, acc = _online_step(q_lat, q_rot, c, k_rot, live, m_i, l_i, acc, scale_log2, DOT_FP32)

    if WRITE_OUT:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no key (seq_len 0): acc is 0, so is o
        out_rows = out_ptr + seq_idx.to(tl.int64) * stride_os + offs_h[:, None] * stride_oh
        tl.store(out_rows + offs_v[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
                 mask=h_mask[:, None] & v_mask[None, :])  # fmt: skip
    else:
        # A split without keys writes the neutral partial (acc 0, lse -inf).
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))  # [BLOCK_H]
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        base = partial_acc_ptr + seq_idx.to(tl.int64) * stride_pas + split_idx * stride_pap
        tl.store(base + offs_h[:, None] * stride_pah + offs_v[None, :] * stride_pad, o,
                 mask=h_mask[:, None] & v_mask[None, :])  # fmt: skip
        tl.store(partial_lse_ptr + seq_idx.to(tl.int64) * stride_pls + offs_h * stride_plh + split_idx * stride_plp,
                 lse, mask=h_mask)  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(
    # pointers
    partial_acc_ptr,  # [num_seqs, num_heads, num_splits, V_DIM], fp32
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits], fp32 (log2 domain)
    out_ptr,  # [num_seqs, num_heads, V_DIM]
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
    num_splits,
    # meta-parameters
    V_DIM: tl.constexpr,
    V_TILE: tl.constexpr,  # latent lanes per program (the third grid axis tiles V_DIM)
    NUM_SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits
):
    seq_idx = tl.program_id(0).to(tl.int64)
    head_idx = tl.program_id(1)
    offs_d = tl.program_id(2) * V_TILE + tl.arange(0, V_TILE)  # [V_TILE]
    offs_p = tl.arange(0, NUM_SPLITS_PAD)  # [NUM_SPLITS_PAD]
    d_mask = offs_d < V_DIM
    p_mask = offs_p < num_splits
    lse = tl.load(partial_lse_ptr + seq_idx * stride_pls + head_idx * stride_plh + offs_p * stride_plp,
                  mask=p_mask, other=float("-inf"))  # fmt: skip
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty (seq_len 0): weights 0
    weights = tl.exp2(lse - lse_max)  # [NUM_SPLITS_PAD]
    denom = tl.sum(weights, axis=0)
    # acc: [NUM_SPLITS_PAD, V_TILE]; an empty split's acc is 0 but is not loaded anyway (its weight is 0)
    acc = tl.load(
        partial_acc_ptr + seq_idx * stride_pas + head_idx * stride_pah + offs_p[:, None] * stride_pap
        + offs_d[None, :] * stride_pad,
        mask=(p_mask & (lse > float("-inf")))[:, None] & d_mask[None, :],
        other=0.0,
    )  # fmt: skip
    merged = tl.sum(acc * weights[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)  # [V_TILE]
    tl.store(out_ptr + seq_idx * stride_os + head_idx * stride_oh + offs_d * stride_od,
             merged.to(out_ptr.dtype.element_ty), mask=d_mask)  # fmt: skip


@triton.jit(do_not_specialize=["stride_bts"])
def _mla_prefill_kernel(
    # pointers
    q_ptr,  # [num_tokens, num_heads, kv_width]
    kv_ptr,  # [num_blocks, block_size, 1, kv_width]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens_ptr,  # [num_seqs], int32
    cu_seqlens_q_ptr,  # [num_seqs + 1], int32
    out_ptr,  # [num_tokens, num_heads, V_DIM]
    # strides
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kd,
    stride_bts,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_od,
    # sizes
    num_heads,
    scale_log2,  # softmax scale * log2(e)
    # meta-parameters
    V_DIM: tl.constexpr,
    V_PAD: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # (token, head) rows per program
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_SIZE: tl.constexpr,  # keys per cache block
    DOT_FP32: tl.constexpr,
):
    tile_m = tl.program_id(0)
    seq_idx = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    num_rows = q_len * num_heads
    if tile_m * BLOCK_M >= num_rows:  # the grid is sized for the longest query: nothing of this sequence here
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    ctx_start = seq_len - q_len  # position of the sequence's first new token

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_mask = offs_m < num_rows
    token_idx = offs_m // num_heads  # [BLOCK_M], within the sequence's new tokens
    head_idx = offs_m % num_heads
    q_pos = ctx_start + token_idx  # [BLOCK_M]: each row sees the keys at positions <= q_pos
    offs_v = tl.arange(0, V_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    v_mask = offs_v < V_DIM
    r_mask = offs_r < ROPE_DIM

    # q_lat: [BLOCK_M, V_PAD], q_rot: [BLOCK_M, ROPE_PAD]; padded rows are 0
    q_row = q_ptr + (q_start + token_idx).to(tl.int64)[:, None] * stride_qt + head_idx[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_v[None, :] * stride_qd, mask=m_mask[:, None] & v_mask[None, :], other=0.0)
    q_rot = tl.load(q_row + (V_DIM + offs_r)[None, :] * stride_qd, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_rot = q_rot.to(tl.float32)

    # Keys up to the tile's last row's position: [0, key_hi).
    last_token = tl.minimum((tile_m * BLOCK_M + BLOCK_M - 1) // num_heads, q_len - 1)
    key_hi = ctx_start + last_token + 1
    table_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_bts
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_PAD], dtype=tl.float32)
    for tile_idx in range(0, tl.cdiv(key_hi, BLOCK_N)):
        key_idx = tile_idx * BLOCK_N + offs_n  # [BLOCK_N]
        n_mask = key_idx < key_hi
        block_ids = tl.load(table_ptr + (key_idx // BLOCK_SIZE) * stride_btb, mask=n_mask, other=0)
        row_offset = block_ids.to(tl.int64) * stride_kb + (key_idx % BLOCK_SIZE) * stride_kt  # [BLOCK_N]
        c = tl.load(kv_ptr + row_offset[:, None] + offs_v[None, :] * stride_kd,
                    mask=n_mask[:, None] & v_mask[None, :], other=0.0)  # fmt: skip
        k_rot = tl.load(kv_ptr + row_offset[:, None] + (V_DIM + offs_r)[None, :] * stride_kd,
                        mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # fmt: skip
        causal = (key_idx[None, :] <= q_pos[:, None]) & n_mask[None, :] & m_mask[:, None]  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _online_step(q_lat, q_rot, c, k_rot, causal, m_i, l_i, acc, scale_log2, DOT_FP32)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_row = out_ptr + (q_start + token_idx).to(tl.int64)[:, None] * stride_ot + head_idx[:, None] * stride_oh
    tl.store(out_row + offs_v[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & v_mask[None, :])  # fmt: skip


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def choose_mla_splits(max_seq_len: int, num_seqs: int, num_head_tiles: int, num_sms: int) -> int:
    """Context splits of the decode grid: enough programs for about two per SM, each split at least
    ``MIN_KEYS_PER_SPLIT`` keys of the longest context, at most ``MAX_NUM_SPLITS``. Host values only (no sync)."""
    programs = max(1, num_seqs * num_head_tiles)
    wanted = cdiv(2 * num_sms, programs)
    by_length = max(1, cdiv(max_seq_len, MIN_KEYS_PER_SPLIT))
    return max(1, min(wanted, by_length, MAX_NUM_SPLITS))


def _decode_settings(v_pad: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) of the decode kernel.

    H200, bf16, rank 512 + rope 64 (benchmarks/tools/mla_decode_bench.py): 16 heads a program with 32-key tiles, 4
    warps and 2 stages was the fastest of the settings tried, at 16 and at 128 query heads (32 or 64 heads a program
    hold a 32 x 512 or 64 x 512 fp32 accumulator: slower at every shape tried).
    """
    return 16, (16 if dtype == torch.float32 and v_pad >= 256 else 32), 4, 2


def _dims(kv_cache: torch.Tensor, v_head_dim: int) -> tuple[int, int, int, int]:
    """(V_DIM, V_PAD, ROPE_DIM, ROPE_PAD) of a latent pool."""
    rope_dim = kv_cache.shape[3] - v_head_dim
    return v_head_dim, max(16, next_power_of_2(v_head_dim)), rope_dim, max(16, next_power_of_2(max(rope_dim, 1)))


def mla_decode_triton(
    q_cat: torch.Tensor,  # [num_seqs, num_heads, kv_width]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_width]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32; 0 = padding row (zeros)
    scale: float,
    v_head_dim: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, v_head_dim]
    num_splits: int | None = None,
    tile_settings: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """MLA decode (kernels.mla.mla_decode, checked there): split-K over the context, then a merge.

    ``num_splits`` (tests, benchmarks): force the split count (1 to ``MAX_NUM_SPLITS``); None picks it from the
    host bound ``max_seq_len`` (``choose_mla_splits``), never from the lengths on the device (CUDA-graph safe).
    ``tile_settings`` (benchmarks/tools/mla_decode_bench.py): force (BLOCK_H, BLOCK_N, num_warps, num_stages).

    Returns:
        out: [num_seqs, num_heads, v_head_dim] in q_cat's dtype.
    """
    num_seqs, num_heads, _ = q_cat.shape
    if out is None:
        out = torch.empty((num_seqs, num_heads, v_head_dim), dtype=q_cat.dtype, device=q_cat.device)
    if num_seqs == 0:
        return out
    v_dim, v_pad, rope_dim, rope_pad = _dims(kv_cache, v_head_dim)
    block_h, block_n, num_warps, num_stages = tile_settings or _decode_settings(v_pad, kv_cache.dtype)
    num_head_tiles = cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = choose_mla_splits(max_seq_len, num_seqs, num_head_tiles, _num_sms(q_cat.device))
    elif not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_NUM_SPLITS}], got {num_splits}")
    write_out = num_splits == 1
    if write_out:  # unused placeholders: never touched when WRITE_OUT
        partial_acc = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q_cat.device)
        partial_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=q_cat.device)
    else:
        partial_acc = torch.empty((num_seqs, num_heads, num_splits, v_dim), dtype=torch.float32, device=q_cat.device)
        partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q_cat.device)
    _mla_decode_kernel[(num_head_tiles, num_seqs, num_splits)](
        q_ptr=q_cat, kv_ptr=kv_cache, block_tables_ptr=block_tables, seq_lens_ptr=seq_lens, out_ptr=out,
        partial_acc_ptr=partial_acc, partial_lse_ptr=partial_lse,
        stride_qs=q_cat.stride(0), stride_qh=q_cat.stride(1), stride_qd=q_cat.stride(2),
        stride_kb=kv_cache.stride(0), stride_kt=kv_cache.stride(1), stride_kd=kv_cache.stride(3),
        stride_bts=block_tables.stride(0), stride_btb=block_tables.stride(1),
        stride_os=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
        stride_pas=partial_acc.stride(0), stride_pah=partial_acc.stride(1), stride_pap=partial_acc.stride(2),
        stride_pad=partial_acc.stride(3),
        stride_pls=partial_lse.stride(0), stride_plh=partial_lse.stride(1), stride_plp=partial_lse.stride(2),
        num_heads=num_heads, num_splits=num_splits, scale_log2=float(scale) * _LOG2E,
        V_DIM=v_dim, V_PAD=v_pad, ROPE_DIM=rope_dim, ROPE_PAD=rope_pad, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[1], MIN_TILES_PER_SPLIT=max(1, MIN_KEYS_PER_SPLIT // block_n),
        WRITE_OUT=write_out, DOT_FP32=q_cat.dtype == torch.bfloat16 and _INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if write_out:
        return out
    v_tile = min(v_pad, 128)
    _mla_merge_kernel[(num_seqs, num_heads, cdiv(v_dim, v_tile))](
        partial_acc_ptr=partial_acc, partial_lse_ptr=partial_lse, out_ptr=out,
        stride_pas=partial_acc.stride(0), stride_pah=partial_acc.stride(1), stride_pap=partial_acc.stride(2),
        stride_pad=partial_acc.stride(3),
        stride_pls=partial_lse.stride(0), stride_plh=partial_lse.stride(1), stride_plp=partial_lse.stride(2),
        stride_os=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
        num_splits=num_splits, V_DIM=v_dim, V_TILE=v_tile, NUM_SPLITS_PAD=max(2, next_power_of_2(num_splits)),
        num_warps=4 if v_tile * num_splits >= 2048 else 2,
    )  # fmt: skip
    return out


def mla_prefill_triton(
    q_cat: torch.Tensor,  # [num_tokens, num_heads, kv_width]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_width]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1], int32
    scale: float,
    v_head_dim: int,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, v_head_dim]
) -> torch.Tensor:
    """Varlen causal MLA (kernels.mla.mla_prefill, checked there). The grid comes from ``max_query_len`` (a host
    bound); rows of tokens past ``cu_seqlens_q[-1]`` are left as they are (zeros when ``out`` is allocated here).

    Returns:
        out: [num_tokens, num_heads, v_head_dim] in q_cat's dtype.
    """
    num_tokens, num_heads, _ = q_cat.shape
    if out is None:
        out = torch.zeros((num_tokens, num_heads, v_head_dim), dtype=q_cat.dtype, device=q_cat.device)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    v_dim, v_pad, rope_dim, rope_pad = _dims(kv_cache, v_head_dim)
    fp32 = kv_cache.dtype == torch.float32
    # Registers: the fp32 accumulator is BLOCK_M x V_PAD; at the real models' 512 lanes 32 rows over 8 warps.
    if v_pad >= 256:
        block_m, block_n, num_warps = 32, (16 if fp32 else 32), 8
    else:
        block_m, block_n, num_warps = 64, (32 if fp32 else 64), 4
    grid = (cdiv(max_query_len * num_heads, block_m), num_seqs)
    _mla_prefill_kernel[grid](
        q_ptr=q_cat, kv_ptr=kv_cache, block_tables_ptr=block_tables, seq_lens_ptr=seq_lens,
        cu_seqlens_q_ptr=cu_seqlens_q, out_ptr=out,
        stride_qt=q_cat.stride(0), stride_qh=q_cat.stride(1), stride_qd=q_cat.stride(2),
        stride_kb=kv_cache.stride(0), stride_kt=kv_cache.stride(1), stride_kd=kv_cache.stride(3),
        stride_bts=block_tables.stride(0), stride_btb=block_tables.stride(1),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
        num_heads=num_heads, scale_log2=float(scale) * _LOG2E,
        V_DIM=v_dim, V_PAD=v_pad, ROPE_DIM=rope_dim, ROPE_PAD=rope_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[1], DOT_FP32=q_cat.dtype == torch.bfloat16 and _INTERPRETED,
        num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    return out
