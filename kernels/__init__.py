"""hf_paged.kernels: tensor-in, tensor-out ops over the paged KV cache.

No transformers or hf_paged import here. Each op has a torch reference (kernels/reference.py:
the CPU path and the test oracle) and a Triton implementation (the CUDA path). The public
functions below dispatch on the device of their tensors: CUDA tensors take Triton, everything
else takes the reference. Tests call the ``*_triton`` launchers directly, on the CPU under
``TRITON_INTERPRET=1``. The cache layout and slot formula are in kernels/reference.py.

Under torch.compile: ``write_kv`` and ``paged_decode`` trace without a graph break or a host sync (on CUDA
through the custom ops of kernels/ops.py, on the CPU through traceable torch references); ``paged_attention``
and ``copy_blocks`` are for eager callers (the reference loops on host copies of the lengths).

FP8 K/V caches (kernels/kv_quant.py): caches of dtype ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` take optional
``k_scale``/``v_scale`` (``[1]`` or ``[num_kv_heads]`` fp32, None = 1.0): ``write_kv`` quantizes, the attention
functions dequantize as they read, ``copy_blocks`` moves the bytes.
"""

from types import SimpleNamespace

import torch

from . import ops  # noqa: F401  (registers the custom ops torch.ops.hf_paged.*)
from .kv_quant import FP8_DTYPES
from .launch import on_device
from .mla import mla_decode, mla_decode_ref, mla_prefill, mla_prefill_ref  # latent attention (MLA)
from .reference import copy_blocks_ref, paged_attention_ref, paged_decode_ref, write_kv_ref

__all__ = [
    "FP8_DTYPES",
    "write_kv",
    "copy_blocks",
    "copy_blocks_layers",
    "layer_offsets",
    "paged_attention",
    "paged_decode",
    "write_kv_ref",
    "copy_blocks_ref",
    "paged_attention_ref",
    "paged_decode_ref",
    "mla_decode",
    "mla_prefill",
    "mla_decode_ref",
    "mla_prefill_ref",
]

_triton_modules: SimpleNamespace | None = None


def _triton() -> SimpleNamespace:
    """The Triton launchers' modules (cache_ops, decode, prefill), imported at the first CUDA call: CPU callers never
    load Triton. Kept here because a function-level ``from .decode import ...`` costs about 1 µs a call, which eager
    decoding pays per layer."""
    global _triton_modules
    if _triton_modules is None:
        from . import cache_ops, decode, prefill

        _triton_modules = SimpleNamespace(cache_ops=cache_ops, decode=decode, prefill=prefill)
    return _triton_modules


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], int32/int64; -1 = padding, skipped
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> None:
    """Store new K/V rows into their cache slots (in place); an fp8 cache stores them quantized with the scales."""
    if k_cache.is_cuda:
        if torch.compiler.is_compiling():  # an opaque op: dynamo does not trace the launcher's host code
            torch.ops.hf_paged.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return
        with on_device(k_cache):  # Triton launches on the current device
            _triton().cache_ops.write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:  # traced under torch.compile only when every slot is >= 0 (see write_kv_ref)
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def copy_blocks(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [num_pairs], int
    dst: torch.Tensor,  # [num_pairs], int; distinct
) -> None:
    """Copy whole blocks src[i] -> dst[i] in both caches, in one batched call (copy-on-write); fp8 blocks bit-exact."""
    if src.numel() == 0:
        return
    if k_cache.is_cuda:
        with on_device(k_cache):
            _triton().cache_ops.copy_blocks_triton(k_cache, v_cache, src, dst)
    else:
        copy_blocks_ref(k_cache, v_cache, src, dst)


def layer_offsets(
    k_caches: list[torch.Tensor],  # num_layers x [num_blocks, block_size, num_kv_heads, head_dim], one layout
    v_caches: list[torch.Tensor],  # like k_caches
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What ``copy_blocks_layers`` needs to copy every layer in one launch: where each layer's caches start, in
    elements from ``k_caches[0]``, on their CUDA device ([num_layers] int64 each, valid until a cache tensor is
    replaced); None for CPU caches."""
    if not k_caches[0].is_cuda:
        return None
    return _triton().cache_ops.layer_offsets(k_caches, v_caches)


def copy_blocks_layers(
    k_caches: list[torch.Tensor],  # num_layers x [num_blocks, block_size, num_kv_heads, head_dim], one device
    v_caches: list[torch.Tensor],  # like k_caches
    src: torch.Tensor,  # [num_pairs], int
    dst: torch.Tensor,  # [num_pairs], int; distinct
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``copy_blocks`` in every layer: on CUDA one launch for all of them, through ``offsets`` (from
    ``layer_offsets(k_caches, v_caches)``, kept by the caller; built here when None); a reference call a layer
    elsewhere."""
    if src.numel() == 0:
        return
    if k_caches[0].is_cuda:
        cache_ops = _triton().cache_ops
        if offsets is None:
            offsets = cache_ops.layer_offsets(k_caches, v_caches)
        with on_device(k_caches[0]):
            cache_ops.copy_blocks_layers_triton(*offsets, k_caches[0], src, dst)
    else:
        for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
            copy_blocks_ref(k_cache, v_cache, src, dst)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1], int32
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the new tokens' K, rows as query
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the new tokens' V
    prefix_len: torch.Tensor | None = None,  # [1], int32: keys every row shares (cascade decode); None = none
    max_prefix_len: int | None = None,
    slot_mapping: torch.Tensor | None = None,  # [num_tokens], int32/int64: write key/value here first; -1 = skip
    min_keys_per_split: int | None = None,
    bind: list | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads], any float dtype: sink logits (gpt-oss); None = none
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    On CUDA, a batch whose sequences each carry one new token (``max_query_len == 1``) takes the
    split-K decode kernel; any other batch takes the varlen prefill kernel. ``max_query_len`` and
    ``max_seq_len`` are host-side hints (no device sync); computed from the tensors when omitted.
    ``key``/``value`` (optional, already written to the cache): the prefill kernel reads a fresh
    sequence's K/V (no cached context) from them instead of through the block table, which is faster;
    the result is the same.

    ``slot_mapping`` (with ``key``/``value``, not yet in the cache): write them at these slots first, as
    ``write_kv`` does, then attend. On CUDA a decode batch does both in one kernel (the decode program that reads
    a row's last position writes it and takes its K/V from registers); other batches write, then attend. With
    ``prefix_len``, every row's new position lies at or above it (no shared block is written).

    ``min_keys_per_split`` (decode batches on CUDA): the fewest keys a context split gets; eager callers, whose GPU
    waits for the host, pass more than the default for fewer splits (one split needs no merge launch).

    ``bind`` (decode batches on CUDA): a list that receives a ``decode.DecodeBinding`` of the launch when it was one
    launch (``paged_decode_triton``'s ``bind``); its ``launch`` repeats the call for another layer's tensors at a
    fraction of the host time. Nothing is appended elsewhere.

    ``prefix_len`` (decode batches only: ``max_query_len == 1``, no sliding window): shared-prefix ("cascade")
    decode, kernels/cascade.py. The keys below it are read once per KV head for all rows, through row 0's block
    table: the caller guarantees that every row with a query holds the same physical blocks there. A device value
    (0 = none); ``max_prefix_len`` is its host-side bound (sizes the prefix kernel's grid; default max_seq_len).

    ``sinks`` (gpt-oss): each query head's sink logit joins the softmax's denominator only (kernels/reference.py);
    every path honours it, once per head (the split decode's merge, the cascade's final merge).

    ``k_scale``/``v_scale`` (fp8 caches, kernels/kv_quant.py): the K/V read are ``float(stored) * scale``; a
    ``slot_mapping`` write quantizes ``key``/``value`` first. With an fp8 cache every sequence attends to the cache's
    quantized K/V, also where ``key``/``value`` are given (a prompt sees what its decode steps will).

    Returns:
        out: [num_tokens, num_heads, head_dim], query's dtype.
    """
    if prefix_len is not None:
        if max_query_len != 1:
            raise ValueError(f"prefix_len is for decode batches (max_query_len=1), got max_query_len={max_query_len}")
        if sliding_window is not None and sliding_window > 0:
            raise ValueError(
                f"prefix_len (cascade) does not support sliding_window={sliding_window}: pass prefix_len=None for "
                "sliding-window layers"
            )
    if slot_mapping is not None and (key is None or value is None):
        raise ValueError("slot_mapping (write key/value first) needs key and value, got key or value None")
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if not query.is_cuda:
        if slot_mapping is not None:
            write_kv_ref(key, value, k_cache, v_cache, slot_mapping, **scales)
        if prefix_len is not None:  # the decode reference reads the prefix through row 0's table, as the kernels do
            if seq_lens.numel():  # it gathers every column of the table: only those the longest row reaches
                block_tables = block_tables[:, : max(1, -(-int(seq_lens.max()) // k_cache.shape[1]))]
            result = paged_decode_ref(
                query, k_cache, v_cache, block_tables, seq_lens, scale, soft_cap=soft_cap, prefix_len=prefix_len,
                sinks=sinks, **scales,
            )  # fmt: skip
            return result if out is None else out.copy_(result)
        return paged_attention_ref(
            query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, sliding_window, soft_cap, out,
            sinks=sinks, **scales,
        )  # fmt: skip
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if seq_lens.numel() else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    # Triton launches on the current device: with accelerate's device_map, layers live on several GPUs.
    with on_device(query):
        if max_query_len == 1:
            # The fused write takes the cache's dtype, or the query's for an fp8 cache (it quantizes them).
            fused_dtype = query.dtype if k_cache.dtype in FP8_DTYPES else k_cache.dtype
            if slot_mapping is not None and key.dtype != fused_dtype:
                _triton().cache_ops.write_kv_triton(key, value, k_cache, v_cache, slot_mapping, **scales)
                key = value = slot_mapping = None
            return _triton().decode.paged_decode_triton(
                query, k_cache, v_cache, block_tables, seq_lens, scale,
                max_seq_len=max_seq_len, sliding_window=sliding_window, soft_cap=soft_cap, out=out,
                prefix_len=prefix_len, max_prefix_len=max_prefix_len,
                new_key=None if slot_mapping is None else key, new_value=None if slot_mapping is None else value,
                slot_mapping=slot_mapping, min_keys_per_split=min_keys_per_split, bind=bind, sinks=sinks, **scales,
            )  # fmt: skip
        if slot_mapping is not None:
            _triton().cache_ops.write_kv_triton(key, value, k_cache, v_cache, slot_mapping, **scales)
        return _triton().prefill.paged_prefill_triton(
            query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, sliding_window=sliding_window, soft_cap=soft_cap,
            out=out, key=key, value=value, sinks=sinks, **scales,
        )  # fmt: skip


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32; entries past a sequence: valid ids (0)
    seq_lens: torch.Tensor,  # [num_seqs], int32: context length incl. the new token
    scale: float,
    max_seq_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    prefix_len: torch.Tensor | None = None,  # [1], int32: keys every row shares (cascade); None = none
    sinks: torch.Tensor | None = None,  # [num_heads], any float dtype: sink logits (gpt-oss); None = none
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> torch.Tensor:
    """Decode attention (one new token per sequence) for CUDA graphs and torch.compile: no host sync.

    Same semantics as ``paged_attention`` with ``cu_seqlens_q = arange(num_seqs + 1)``. ``max_seq_len`` is a
    static host-side bound (it sizes the CUDA kernel's split grid; correctness never depends on it). CUDA: the
    split-K Triton kernel as the custom op ``torch.ops.hf_paged.paged_decode``; otherwise ``paged_decode_ref``,
    which torch.compile traces whole. ``prefix_len``: shared-prefix decode, ``sinks`` and the fp8 scales
    ``k_scale``/``v_scale``, as in ``paged_attention``.

    Returns:
        out: [num_seqs, num_heads, head_dim], query's dtype.
    """
    if query.is_cuda:
        return torch.ops.hf_paged.paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens, float(scale), int(max_seq_len),
            int(sliding_window) if sliding_window else 0, float(soft_cap) if soft_cap else 0.0, prefix_len, sinks,
            k_scale, v_scale,
        )  # fmt: skip
    if prefix_len is not None and sliding_window is not None and sliding_window > 0:
        raise ValueError(
            f"prefix_len (cascade) does not support sliding_window={sliding_window}: pass prefix_len=None for "
            "sliding-window layers"
        )
    return paged_decode_ref(
        query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, prefix_len=prefix_len,
        sinks=sinks, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
