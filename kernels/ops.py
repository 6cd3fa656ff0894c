"""The CUDA kernels as torch custom ops: opaque, capturable graph nodes for ``torch.compile``.

Dynamo does not trace into a custom op, so the Triton launchers' host-side Python (split heuristics, device
queries, ``torch.cuda.device``) runs when the op runs, never at trace time, and inductor's CUDA graphs capture
the kernels it launches. The ops take only tensors and scalars and never read a tensor's values on the host.
Registered at import (pure torch; Triton is imported when an op first runs). ``hf_paged.kernels.write_kv`` and
``paged_decode`` call them on CUDA tensors; the CPU takes the torch references (kernels/reference.py) instead.
"""

import torch

from .launch import on_device as _on_device


@torch.library.custom_op("hf_paged::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv_op(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens], int32/int64; -1 = padding, skipped
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> None:
    """``write_kv_triton`` as an op (see kernels/cache_ops.py)."""
    from .cache_ops import write_kv_triton

    with _on_device(k_cache):
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@write_kv_op.register_fake
def _write_kv_fake(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    return None


@torch.library.custom_op("hf_paged::paged_decode", mutates_args=())
def paged_decode_op(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32
    scale: float,
    max_seq_len: int,
    sliding_window: int,  # <= 0: none
    soft_cap: float,  # <= 0: none
    prefix_len: torch.Tensor | None = None,  # [1], int32: keys every row shares (cascade); None = none
    sinks: torch.Tensor | None = None,  # [num_heads], float: sink logits (gpt-oss); None = none
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> torch.Tensor:
    """``paged_decode_triton`` as an op (see kernels/decode.py); returns a new [num_seqs, num_heads, head_dim]."""
    from .decode import paged_decode_triton

    with _on_device(query):
        return paged_decode_triton(
            query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len,
            sliding_window=sliding_window if sliding_window > 0 else None, soft_cap=soft_cap if soft_cap > 0 else None,
            prefix_len=prefix_len, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip


@paged_decode_op.register_fake
def _paged_decode_fake(
    query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, sliding_window, soft_cap, prefix_len=None,
    sinks=None, k_scale=None, v_scale=None,
):  # fmt: skip
    return torch.empty_like(query)
