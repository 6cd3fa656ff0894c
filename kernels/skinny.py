"""A weight-streaming linear layer for few rows (an experiment for issue 13; off by default).

A decode step of a small model multiplies a few dozen to a few hundred rows by each layer's weights: the GEMMs are
bound by reading the weights, and at these sizes cuBLAS reaches about 1.0-1.2 TB/s on an H100 (a Qwen3-0.6B layer's
four GEMMs take ~26 µs for ~31 MB at 32 rows; benchmarks/RESULTS.md, fourteenth session), a third of the copy
bandwidth. Here each program streams one ``BLOCK_N``-row slab of the weight over a share of K (``split_k``) and
multiplies it by up to ``ROW_TILE`` rows at once (one ``tl.dot`` a K tile, rows padded to 16; more rows take more row
tiles); with ``split_k > 1`` the partial sums go to an fp32 buffer and a second launch adds them (as cuBLAS's split-K
does).

``out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n])``: ``torch.nn.functional.linear``, the reference.
``benchmarks/skinny_gemm.py`` times it against ``F.linear`` at the decode steps' shapes. The engine's projections
take it at <= ``hf_paged.engine.fuse.SKINNY_MAX_ROWS`` rows, 0 by default (off): on an H200 (nineteenth session,
benchmarks/RESULTS.md) cuBLAS reads these weights at 1.6-2.1 TB/s (Qwen3-0.6B's q/k/v and gate/up) and 3.2 TB/s
(Llama-3.1-8B's q/k/v), and every GEMM of a few MB costs ~5-8 µs whoever runs it. The prediction (2-2.5 TB/s,
a layer's four GEMMs at 32 rows from ~26 to ~15 µs) was wrong: the time is a per-kernel fixed cost, not bandwidth.
The kernel wins only at Qwen3-0.6B's down_proj at <= 64 rows (1.11-1.19x) and at one row of o_proj (2.2x, where
cuBLAS takes 12.6 µs); it loses 0.53-0.97x elsewhere.
"""

import functools

import torch
import triton
import triton.language as tl

from .launch import Launcher, cdiv, next_power_of_2

__all__ = ["skinny_linear_triton", "MAX_ROWS"]

MAX_ROWS = 512  # beyond this a step is a regular GEMM's business
ROW_TILE = 64  # rows a program multiplies at most: more rows take more row tiles (each streams its slab; the tiles
# of one slab are neighbours in the grid, so all but the first read it from L2)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _skinny_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (read only with HAS_BIAS)
    out_ptr,  # [M, N], SPLIT_K == 1
    part_ptr,  # [SPLIT_K, M, N] fp32, SPLIT_K > 1
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (as F.linear, which takes no TF32 by default), else "tf32"
    BLOCK_M: tl.constexpr,  # power of two >= 16: min(next_power_of_2(M), ROW_TILE)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = offs_m < M
    col_ok = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]  # fmt: skip
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]  # fmt: skip
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr,  # [SPLIT_K, M, N] fp32
    b_ptr,  # [N]
    out_ptr,  # [M, N]
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] over the M x N outputs
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


_LINEAR = Launcher(_skinny_linear_kernel)
_SUM = Launcher(_sum_splits_kernel)


def skinny_linear_triton(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    block_m: int | None = None,
    block_n: int = 32,
    block_k: int = 128,
    split_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:  # [M, N], x's dtype
    """``F.linear(x, weight, bias)`` for at most ``MAX_ROWS`` rows: one launch, two with ``split_k > 1``.

    The grid is (row tiles, weight slabs, K splits); the row tiles of a slab run side by side, so the slab comes
    from HBM once and from L2 for the other tiles.

    Args:
        x: [M, K] with its last dimension contiguous.
        weight: [N, K] with its last dimension contiguous, x's dtype and device.
        bias: None or [N].
        block_m: rows a program multiplies (a power of two, 16 to ``ROW_TILE``); None: all of them up to ``ROW_TILE``.
        block_n, block_k: the weight slab a program streams (powers of two, >= 16).
        split_k: programs along K (partial sums added by a second launch); None: enough programs to give every SM
            about two (``cdiv(N, block_n)`` slabs times ``split_k``), at most one split a ``block_k``.

    Raises:
        ValueError: shapes, dtypes, devices or layouts outside the above.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1 to {MAX_ROWS} rows, got {M}")
    if x.dtype not in _FLOAT_DTYPES or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"x and weight must share a float dtype ({list(_FLOAT_DTYPES)}) and a device, got {x.dtype} on {x.device} "
            f"and {weight.dtype} on {weight.device}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x and weight need contiguous rows, got strides {x.stride()} and {weight.stride()}")
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise ValueError(f"bias must be [{N}] on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if block_m is None:
        block_m = min(max(16, next_power_of_2(M)), ROW_TILE)
    elif not 16 <= block_m <= ROW_TILE or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two from 16 to {ROW_TILE}, got {block_m}")
    row_tiles = cdiv(M, block_m)
    num_k_tiles = cdiv(K, block_k)
    slabs = cdiv(N, block_n)
    if split_k is None:
        split_k = cdiv(2 * _num_sms(x), slabs * row_tiles)
    split_k = max(1, min(split_k, num_k_tiles))
    k_per_split = cdiv(num_k_tiles, split_k) * block_k
    split_k = cdiv(K, k_per_split)  # no empty split
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    part = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else out
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    _LINEAR((row_tiles, slabs, split_k), x, weight, bias_arg, out, part, M, N, K, x.stride(0), weight.stride(0),
            out.stride(0), k_per_split, has_bias, split_k, "ieee" if x.dtype == torch.float32 else "tf32", block_m,
            block_n, block_k, num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    if split_k > 1:
        block = 1024
        _SUM((cdiv(M * N, block),), part, bias_arg, out, M, N, out.stride(0), has_bias, split_k, block, num_warps=4,
             num_stages=1)  # fmt: skip
    return out


def _num_sms(x: torch.Tensor) -> int:
    if x.is_cuda:
        return _device_sms(x.get_device())
    return 4  # the interpreter: a few programs


@functools.cache
def _device_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
