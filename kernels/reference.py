"""Torch references for every hf_paged kernel: the CPU path and the test oracle.

KV-cache layout (one pool per layer, written once here and referred to everywhere):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset        (offset in [0, block_size))
    slot < 0 marks a padding token: it is never written and never read.

A sequence's token at position p (0-based, counting its whole context) lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Attention semantics shared by the references and the Triton kernels:
- Sequence s carries ``q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s]`` new tokens, which are the
  last ``q_len`` of its ``seq_lens[s]`` context tokens (already written to the cache).
- New token i of sequence s sits at position ``p = seq_lens[s] - q_len + i`` and attends to the
  positions j with ``j <= p`` and, with a sliding window W, ``p - j < W`` (transformers' convention:
  the window counts the token itself).
- scores = (q . k) * scale; with a soft cap C, scores = C * tanh(scores / C); softmax in fp32.
- Attention sinks (gpt-oss): ``sinks[h]``, one logit per query head, joins the softmax's denominator only, unscaled
  and uncapped: ``out = sum_j exp(s_j - m) v_j / (exp(sinks[h] - m) + sum_j exp(s_j - m))``,
  ``m = max(sinks[h], max_j s_j)``. A row with no visible key gets zeros.
- GQA: query head h reads KV head ``h // (num_heads // num_kv_heads)``.
- FP8 caches (kernels/kv_quant.py): ``write_kv_ref`` stores ``saturate(x / scale)`` in 8 bits; the attention
  references read ``float(stored) * scale``. ``k_scale``/``v_scale``: ``[1]`` or ``[num_kv_heads]`` fp32, None = 1.0.
"""

import torch

from .kv_quant import check_kv_scales, dequantize_ref, is_fp8, quantize_ref


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], int32/int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> None:
    """Store each token's K/V row at its slot; slots < 0 are skipped. An fp8 cache stores the rows quantized
    (kernels/kv_quant.py); other caches cast them to their dtype."""
    check_kv_scales(k_cache, k_scale, v_scale)
    block_size = k_cache.shape[1]
    key, value = _to_cache(key, k_cache, k_scale), _to_cache(value, v_cache, v_scale)
    if is_fp8(k_cache.dtype):  # fp8 rows are copied as their bytes (index_put_ has no fp8 kernel on the CPU)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    slots = slot_mapping.long()
    if torch.compiler.is_compiling():
        # Boolean indexing has a data-dependent shape, which torch.compile cannot trace: a traced caller (a planned
        # decode step of hf_paged.cache.PagedCache) gives every token a slot. A -1 left there goes past the last
        # block and fails inside index_put_ (out of range), never silently (a negative index would wrap).
        slots = torch.where(slots < 0, k_cache.shape[0] * block_size, slots)
    else:
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    # (block, offset) indices: a cache may have any strides (an FP8 pool's V is keys-minor, kv_quant.new_cache)
    index = (slots // block_size, slots % block_size)
    k_cache.index_put_(index, key)
    v_cache.index_put_(index, value)


def _to_cache(
    x: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scale: torch.Tensor | None,  # [1] or [num_kv_heads], fp32
) -> torch.Tensor:
    """Rows as the cache stores them: quantized for fp8, else cast ([num_tokens, num_kv_heads, head_dim])."""
    return quantize_ref(x, scale, cache.dtype) if is_fp8(cache.dtype) else x.to(cache.dtype)


def copy_blocks_ref(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [num_pairs], int
    dst: torch.Tensor,  # [num_pairs], int
) -> None:
    """Copy whole blocks src[i] -> dst[i] (copy-on-write). dst blocks must be distinct."""
    src = src.long().to(k_cache.device)
    dst = dst.long().to(k_cache.device)
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32: context length incl. the new tokens
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1], int32: offsets of each sequence's new tokens
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    sinks: torch.Tensor | None = None,  # [num_heads], any float dtype: sink logits (see the module docstring)
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (gather + softmax); fp8 caches are
    dequantized as they are read.

    Returns:
        out: [num_tokens, num_heads, head_dim] in query's dtype. Rows of tokens that belong to no
        sequence (beyond cu_seqlens_q[-1]) are left untouched.
    """
    check_kv_scales(k_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.zeros_like(query)
    seq_lens_l = seq_lens.tolist()
    cu_l = cu_seqlens_q.tolist()
    tables = block_tables.long()
    for s, ctx_len in enumerate(seq_lens_l):
        q_start, q_end = cu_l[s], cu_l[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-ctx_len // block_size)
        blocks = tables[s, :num_blocks].to(k_cache.device)
        # [ctx_len, num_kv_heads, head_dim]
        k = dequantize_ref(k_cache[blocks].flatten(0, 1)[:ctx_len], k_scale)
        v = dequantize_ref(v_cache[blocks].flatten(0, 1)[:ctx_len], v_scale)
        k = k.repeat_interleave(group, dim=1)  # [ctx_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, ctx_len]
        if soft_cap is not None and soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)[:, None]
        k_pos = torch.arange(ctx_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None and sliding_window > 0:
            allowed &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = _softmax_with_sinks(scores, sinks, head_axis=0)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def paged_decode_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32; every entry a valid block id
    seq_lens: torch.Tensor,  # [num_seqs], int32: context length incl. the new token; 0 = padding row
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    prefix_len: torch.Tensor | None = None,  # [1], int32: keys below it are read through row 0's table (cascade)
    sinks: torch.Tensor | None = None,  # [num_heads], any float dtype: sink logits (see the module docstring)
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> torch.Tensor:
    """Decode attention (one new token per sequence, the last of its context) with static shapes and no host sync.

    The torch reference of ``paged_decode``: unlike ``paged_attention_ref`` it loops over nothing and reads no
    tensor value on the host, so torch.compile traces it whole. It gathers every block of the table (entries past
    a sequence's length are read, then masked), so it costs ``max_blocks_per_seq * block_size`` keys per sequence.

    ``prefix_len`` is the reference of shared-prefix (cascade) decode (kernels/cascade.py): key ``j < prefix_len``
    of every row is read through row 0's block table, the rest through the row's own. Where the caller keeps the
    contract (those blocks are row 0's in every row), the result is that of ``prefix_len=None``; where it does not,
    the rows read row 0's keys, as the kernels do, so an engine that claims a wrong prefix gives wrong output.

    Returns:
        out: [num_seqs, num_heads, head_dim] in query's dtype; rows with ``seq_lens == 0`` are zeros.
    """
    check_kv_scales(k_cache, k_scale, v_scale)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    tables = block_tables.long()
    # [num_seqs, max_blocks_per_seq * block_size, num_kv_heads, head_dim]
    k = k_cache[tables].flatten(1, 2)
    v = v_cache[tables].flatten(1, 2)
    k_pos = torch.arange(k.shape[1], device=query.device)[None, :]  # [1, num_keys]
    if prefix_len is not None:
        shared = (k_pos < prefix_len.to(query.device).long().reshape(1, 1))[:, :, None, None]  # [1, num_keys, 1, 1]
        k = torch.where(shared, k[:1], k)
        v = torch.where(shared, v[:1], v)
    # [num_seqs, max_blocks_per_seq * block_size, num_heads, head_dim]
    k = dequantize_ref(k, k_scale).repeat_interleave(group, dim=2)
    v = dequantize_ref(v, v_scale).repeat_interleave(group, dim=2)
    scores = torch.einsum("shd,skhd->shk", query.float(), k) * scale  # [num_seqs, num_heads, num_keys]
    if soft_cap is not None and soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = (seq_lens.long() - 1)[:, None]  # [num_seqs, 1]
    allowed = k_pos <= q_pos
    if sliding_window is not None and sliding_window > 0:
        allowed &= (q_pos - k_pos) < sliding_window
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    # A padding row (seq_len 0) has no allowed key: its softmax is NaN, zeroed here (with sinks the sink takes it all).
    probs = _softmax_with_sinks(scores, sinks, head_axis=1).nan_to_num(0.0)
    # Slots past a row's length are read but never written (NaN, inf or stale): their zero weight must not meet them.
    v = v.masked_fill(~allowed[:, :, None, None], 0.0)
    return torch.einsum("shk,skhd->shd", probs, v).to(query.dtype)


def _softmax_with_sinks(
    scores: torch.Tensor,  # [..., num_keys], fp32, masked keys -inf; dim head_axis is num_heads
    sinks: torch.Tensor | None,  # [num_heads]
    head_axis: int,
) -> torch.Tensor:
    """softmax over the keys; with sinks, each head's sink logit is one more column, dropped after the softmax (as
    transformers' gpt-oss eager attention does), so it joins the denominator only."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink_shape = (-1,) + (1,) * (scores.dim() - head_axis - 1)  # num_heads, then a 1 for each later dim
    sink_col = sinks.to(device=scores.device, dtype=scores.dtype).view(sink_shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
