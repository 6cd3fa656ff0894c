"""Row-wise argmax of logits in two launches (greedy sampling), the same answer as ``torch.argmax(x, dim=-1)``.

Why. ATen's argmax reduces a row of a large vocabulary with few blocks: on an H100 it took 36 µs for one row of
Llama-3.1-8B's 128 256 logits and for eight, and 53 µs for 224 rows of Qwen3-0.6B's 151 936 (RESULTS.md,
twenty-first and twenty-second sessions), against ~1 µs of bytes at one row: up to 2.5% of a small model's decode
step, every step of greedy decoding.

How. ``_argmax_chunks_kernel``, grid ``(num_rows, num_chunks)``: a program reduces ``CHUNK`` logits of one row to
the chunk's maximum and the first index holding it. ``_argmax_rows_kernel``, grid ``(num_rows,)``: the chunks' winner,
ties to the lowest index (chunks are in index order). A row of one chunk is finished by the first launch.

Semantics of ``torch.argmax``, kept exactly: NaN counts as the maximum (the first NaN wins), and among equal maxima
the first index wins (a row of only -inf gives 0). Values are compared in fp32 (exact for fp16 / bf16).
"""

import torch
import triton
import triton.language as tl

from .launch import Launcher, cdiv, next_power_of_2

__all__ = ["argmax_rows_triton", "CHUNK"]

CHUNK = 4096  # logits a program of the first launch reduces (8 KiB of bf16); read at each call
MAX_VOCAB = 2**31 - 1  # an index no row reaches (the kernels' "no index yet")
_NO_INDEX: tl.constexpr = tl.constexpr(MAX_VOCAB)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _argmax_chunks_kernel(
    x_ptr,  # [num_rows, vocab], row stride stride_row, last dim contiguous
    part_val_ptr,  # [num_rows, num_chunks], fp32: each chunk's maximum (NaN if it holds a NaN)
    part_idx_ptr,  # [num_rows, num_chunks], int32: the first index of that maximum (of the first NaN)
    out_ptr,  # [num_rows], int64: written instead when ONE_CHUNK
    vocab,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    ok = offs < vocab
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan & ok, offs, _NO_INDEX), axis=0)  # a NaN wins: then best is not used
    best = tl.max(x, axis=0)
    first_best = tl.min(tl.where((x == best) & ok, offs, _NO_INDEX), axis=0)  # lanes past vocab never win
    has_nan = first_nan < _NO_INDEX
    index = tl.where(has_nan, first_nan, first_best)
    if ONE_CHUNK:
        tl.store(out_ptr + row, index.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * num_chunks + chunk, tl.where(has_nan, float("nan"), best))
        tl.store(part_idx_ptr + row * num_chunks + chunk, index)


@triton.jit
def _argmax_rows_kernel(
    part_val_ptr,  # [num_rows, num_chunks], fp32
    part_idx_ptr,  # [num_rows, num_chunks], int32
    out_ptr,  # [num_rows], int64
    num_chunks,
    CHUNKS_PAD: tl.constexpr,  # next power of two >= num_chunks
):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_PAD)  # [CHUNKS_PAD]
    ok = offs < num_chunks
    val = tl.load(part_val_ptr + row * num_chunks + offs, mask=ok, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * num_chunks + offs, mask=ok, other=_NO_INDEX)
    is_nan = val != val
    first_nan = tl.min(tl.where(is_nan & ok, idx, _NO_INDEX), axis=0)  # a NaN wins: then best is not used
    best = tl.max(val, axis=0)
    first_best = tl.min(tl.where((val == best) & ok, idx, _NO_INDEX), axis=0)
    tl.store(out_ptr + row, tl.where(first_nan < _NO_INDEX, first_nan, first_best).to(tl.int64))


_CHUNKS = Launcher(_argmax_chunks_kernel)
_ROWS = Launcher(_argmax_rows_kernel)


def argmax_rows_triton(x: torch.Tensor) -> torch.Tensor:  # x: [num_rows, vocab] -> [num_rows], int64
    """``torch.argmax(x, dim=-1)`` for a 2-D float tensor whose last dimension is contiguous (see the module doc).

    Raises:
        ValueError: not 2-D, an empty vocabulary, a dtype other than fp16 / bf16 / fp32, a strided last dimension,
            or a vocabulary of 2**31 - 1 entries or more.
    """
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows_triton takes [num_rows, vocab] with vocab >= 1, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"argmax_rows_triton takes {list(_FLOAT_DTYPES)}, got {x.dtype}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"argmax_rows_triton needs a contiguous last dimension, got strides {x.stride()}")
    num_rows, vocab = x.shape
    if vocab >= MAX_VOCAB:
        raise ValueError(f"argmax_rows_triton takes a vocabulary below {MAX_VOCAB}, got {vocab}")
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    chunk = CHUNK
    num_chunks = cdiv(vocab, chunk)
    one_chunk = num_chunks == 1
    if one_chunk:
        chunk = max(16, next_power_of_2(vocab))
        part_val = part_idx = out  # not read
    else:
        part_val = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=x.device)
        part_idx = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=x.device)
    _CHUNKS((num_rows, num_chunks), x, part_val, part_idx, out, vocab, x.stride(0), num_chunks, chunk, one_chunk,
            num_warps=4, num_stages=1)  # fmt: skip
    if not one_chunk:
        _ROWS((num_rows,), part_val, part_idx, out, num_chunks, max(16, next_power_of_2(num_chunks)), num_warps=1,
              num_stages=1)  # fmt: skip
    return out
