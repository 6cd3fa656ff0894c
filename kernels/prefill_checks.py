"""The argument checks of ``paged_prefill_triton`` (kernels/prefill.py): every caller mistake raises a ValueError
that names the argument, its value and what is allowed, before anything launches."""

import torch

from .kv_quant import FP8_DTYPES, check_kv_scales

__all__ = ["MAX_HEAD_DIM", "check_args"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_args(
    query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len, out, key, value, sinks,
    k_scale=None, v_scale=None,
) -> None:  # fmt: skip
    """Raise ValueError naming the argument on anything ``paged_prefill_triton`` does not accept (its docstring
    lists the shapes, dtypes and layouts)."""
    if query.dim() != 3:
        raise ValueError(f"query must be 3-D [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must match k_cache in shape, got {tuple(v_cache.shape)} vs {tuple(k_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} must equal the cache head_dim {cache_head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query dtype must be one of {list(FLOAT_DTYPES)}, got {query.dtype}")
    if k_cache.dtype not in (query.dtype, *FP8_DTYPES) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache dtype must equal query dtype {query.dtype} or be one fp8 dtype of {list(FP8_DTYPES)} "
            f"for both, got {k_cache.dtype} / {v_cache.dtype}"
        )
    check_kv_scales(k_cache, k_scale, v_scale)
    if query.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError(
            f"query and k_cache need a contiguous last dim, got strides {query.stride()} and {k_cache.stride()}"
        )
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be 2-D int32 [num_seqs, max_blocks_per_seq], "
            f"got {block_tables.dtype} of shape {tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(
            f"seq_lens must be int32 of shape [num_seqs={num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if cu_seqlens_q.dtype != torch.int32 or tuple(cu_seqlens_q.shape) != (num_seqs + 1,):
        raise ValueError(
            f"cu_seqlens_q must be int32 of shape [num_seqs + 1={num_seqs + 1}], "
            f"got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}"
        )
    for name, t in (
        ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("seq_lens", seq_lens),
        ("cu_seqlens_q", cu_seqlens_q),
    ):  # fmt: skip
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, but query is on {query.device}")
    if max_query_len < 0 or max_seq_len < 0:
        raise ValueError(f"max_query_len and max_seq_len must be >= 0, got {max_query_len} and {max_seq_len}")
    if (key is None) != (value is None):
        raise ValueError("key and value must be given together (contiguous K/V of the new tokens) or not at all")
    if key is not None:
        want = (num_tokens, num_kv_heads, head_dim)
        for name, t in (("key", key), ("value", value)):
            if tuple(t.shape) != want or t.dtype != query.dtype or t.device != query.device or t.stride(2) != 1:
                raise ValueError(
                    f"{name} must be {want} {query.dtype} on {query.device} with a contiguous last dim "
                    f"(rows aligned with query), got {tuple(t.shape)} {t.dtype} on {t.device} "
                    f"with strides {t.stride()}"
                )
    if sinks is not None:
        if tuple(sinks.shape) != (num_heads,) or not sinks.is_floating_point() or sinks.device != query.device:
            raise ValueError(
                f"sinks must be a float tensor [num_heads={num_heads}] on {query.device}, got {sinks.dtype} "
                f"{tuple(sinks.shape)} on {sinks.device}"
            )
    if out is not None and (
        out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(2) != 1
    ):
        raise ValueError(
            f"out must be {tuple(query.shape)} {query.dtype} on {query.device} with a contiguous last dim, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}"
        )
