"""Varlen paged prefill: ``paged_prefill_triton``, flash attention of each sequence's new tokens over its context.

Semantics (causal mask, sliding window, soft cap, GQA) and the cache layout are those of kernels/reference.py. Sequence
s carries ``q_len`` new tokens, the last ``q_len`` of its ``seq_lens[s]`` context tokens; K/V are read straight from
the cache blocks through the block table (or, over a non-fp8 cache, a fresh prompt's from ``key=/value=``), never
gathered.

This module is the host side: the argument checks (kernels/prefill_checks.py), the tile sizes (``default_tiles``), the
grid's form and size, one launch. The kernel and how its programs find their tile slots are in
kernels/prefill_kernel.py; what one slot computes (row layout, key ranges, online softmax, FP8 scales, sinks) is in
kernels/prefill_attend.py.

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

from .kv_quant import keys_minor, scale_args
from .launch import cdiv, next_power_of_2
from .prefill_checks import check_args
from .prefill_kernel import PREFILL

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
        v_cache: [num_blocks, block_size, num_kv_heads, head_dim], k_cache's shape and dtype, any strides (an FP8
            pool's is keys-minor: kernels/kv_quant.py ``new_cache``).
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
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache.stride(),
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
        keys_minor(v_cache) and (tile_n % block_size == 0 or block_size % tile_n == 0),  # V_BLOCKS
        seqs_pad,  # SEQS_PAD (last: tests/helpers.py reads it there)
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
