"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache: ``mla_decode`` and ``mla_prefill``.

An MLA layer caches one row per token, shared by every query head (MQA with a single KV "head"):

    kv_cache: [num_blocks, block_size, 1, kv_width]        kv_width = v_head_dim + rope_dim
    row of token j:  k_cat_j = [ c_j (v_head_dim) | k_rot_j (rope_dim) ]

``c_j`` is the normalized latent (kv_a_layernorm of the compressed KV), ``k_rot_j`` the roped shared key. Block
tables, slots and lengths follow kernels/reference.py (``slot = block_id * block_size + offset``, ``slot < 0``
padding); the rows are written with ``write_kv(latent, latent, kv_cache, kv_cache, slot_mapping)`` (one KV head).

Attention is the absorbed form (the caller folds each head's W_UK into its query, and applies W_UV and o_proj to
the output): query head h brings ``q_cat_h = [q_lat_h | q_rot_h]`` of width kv_width and gets

    scores_hj = scale * (q_cat_h . k_cat_j)           causal over the context, softmax in fp32
    out_h     = sum_j softmax(scores_h)_j * c_j       V = the first v_head_dim columns of the same row

so each cached row is read once for K and V of every head. Semantics of lengths (``seq_lens`` counts the new
tokens, which are the last ``q_len`` of the context) are those of ``paged_attention``; there is no sliding window
and no soft cap in MLA.

The functions dispatch on the device of ``q_cat``: CUDA takes the Triton kernels (kernels/mla_triton.py),
anything else the torch references below, which are also the test oracle.
"""

import torch

__all__ = ["mla_decode", "mla_prefill", "mla_decode_ref", "mla_prefill_ref"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mla_decode_ref(
    q_cat: torch.Tensor,  # [num_seqs, num_heads, kv_width]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_width]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32; entries past a sequence: any value
    seq_lens: torch.Tensor,  # [num_seqs], int32: context length incl. the new token; 0 = padding row
    scale: float,
    v_head_dim: int,
) -> torch.Tensor:
    """Decode MLA (one new token per sequence, the last of its context) with static shapes and no host sync.

    Gathers every block of the table (entries past a sequence's length are read, then masked), as
    ``paged_decode_ref`` does, so torch.compile traces it whole.

    Returns:
        out: [num_seqs, num_heads, v_head_dim] in q_cat's dtype; rows with ``seq_lens == 0`` are zeros.
    """
    tables = block_tables.long().clamp(min=0)
    rows = kv_cache[:, :, 0][tables].flatten(1, 2).float()  # [num_seqs, num_keys, kv_width]
    k_pos = torch.arange(rows.shape[1], device=q_cat.device)[None, :]  # [1, num_keys]
    allowed = k_pos < seq_lens.to(q_cat.device).long()[:, None]  # [num_seqs, num_keys]
    # Slots past a row's length are never written (stale, NaN): zeroed before they meet a zero weight.
    rows = rows.masked_fill(~allowed[:, :, None], 0.0)
    scores = torch.einsum("shw,skw->shk", q_cat.float(), rows) * scale  # [num_seqs, num_heads, num_keys]
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a padding row has no key: NaN -> 0
    return torch.einsum("shk,skv->shv", probs, rows[:, :, :v_head_dim]).to(q_cat.dtype)


def mla_prefill_ref(
    q_cat: torch.Tensor,  # [num_tokens, num_heads, kv_width]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_width]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32: context length incl. the new tokens
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1], int32: offsets of each sequence's new tokens
    scale: float,
    v_head_dim: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, v_head_dim]
) -> torch.Tensor:
    """Causal MLA of each sequence's new tokens over its paged context (gather + softmax, a loop over sequences).

    Returns:
        out: [num_tokens, num_heads, v_head_dim] in q_cat's dtype. Rows of tokens that belong to no sequence
        (at or beyond ``cu_seqlens_q[-1]``) are zeros, or left as they were in a given ``out``.
    """
    num_tokens, num_heads, _ = q_cat.shape
    block_size = kv_cache.shape[1]
    if out is None:
        out = q_cat.new_zeros(num_tokens, num_heads, v_head_dim)
    cu = cu_seqlens_q.tolist()
    tables = block_tables.long()
    for s, ctx_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu[s], cu[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = tables[s, : -(-ctx_len // block_size)].to(kv_cache.device)
        rows = kv_cache[blocks, :, 0].flatten(0, 1)[:ctx_len].float()  # [ctx_len, kv_width]
        scores = torch.einsum("qhw,kw->hqk", q_cat[q_start:q_end].float(), rows) * scale  # [num_heads, q_len, ctx_len]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q_cat.device)[:, None]
        k_pos = torch.arange(ctx_len, device=q_cat.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,kv->qhv", probs, rows[:, :v_head_dim]).to(out.dtype)
    return out


def check_mla_args(
    q_cat: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    v_head_dim: int,
    cu_seqlens_q: torch.Tensor | None = None,
) -> None:
    """The shapes, dtypes and devices both MLA ops need; raises ValueError naming the bad value."""
    if q_cat.dim() != 3:
        raise ValueError(f"q_cat must be [num_tokens, num_heads, kv_width], got shape {tuple(q_cat.shape)}")
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, 1, kv_width] (one latent row per token), got shape "
            f"{tuple(kv_cache.shape)}"
        )
    kv_width = kv_cache.shape[3]
    if q_cat.shape[2] != kv_width:
        raise ValueError(f"q_cat's last dim must equal kv_cache's width {kv_width}, got {q_cat.shape[2]}")
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or not 1 <= v_head_dim <= kv_width:
        raise ValueError(f"v_head_dim must be an int in [1, kv_width={kv_width}], got {v_head_dim!r}")
    if q_cat.dtype not in _SUPPORTED_DTYPES or kv_cache.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"q_cat and kv_cache dtypes must be in {list(_SUPPORTED_DTYPES)}, got {q_cat.dtype} and {kv_cache.dtype}"
        )
    if q_cat.dtype != kv_cache.dtype:
        raise ValueError(f"q_cat dtype must equal kv_cache dtype {kv_cache.dtype}, got {q_cat.dtype}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be 2-D int32 [num_seqs, max_blocks_per_seq], got {tuple(block_tables.shape)} "
            f"{block_tables.dtype}"
        )
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [num_seqs={num_seqs}], got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if cu_seqlens_q is not None and (cu_seqlens_q.shape != (num_seqs + 1,) or cu_seqlens_q.dtype != torch.int32):
        raise ValueError(
            f"cu_seqlens_q must be int32 [num_seqs + 1={num_seqs + 1}], got {tuple(cu_seqlens_q.shape)} "
            f"{cu_seqlens_q.dtype}"
        )
    for name, t in (("kv_cache", kv_cache), ("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("cu_seqlens_q", cu_seqlens_q)):  # fmt: skip
        if t is not None and t.device != q_cat.device:
            raise ValueError(f"{name} is on {t.device}, but q_cat is on {q_cat.device}")


def mla_decode(
    q_cat: torch.Tensor,  # [num_seqs, num_heads, kv_width]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_width]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32: context length incl. the new token; 0 = padding row (zeros)
    scale: float,
    v_head_dim: int,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, v_head_dim]
) -> torch.Tensor:
    """MLA decode: each sequence's one new token (position ``seq_lens[s] - 1``) over its paged latent rows.

    Args:
        q_cat: Each head's absorbed query ``[q_nope @ W_UK | q_rot]``, one row per sequence.
        kv_cache: The layer's latent pool, layout in this module's docstring.
        block_tables: Physical block of each logical block; entries past a sequence's length are never read.
        seq_lens: Context length of each sequence, including the new token (already in the cache).
        scale: Softmax scale of ``q_cat . k_cat``.
        v_head_dim: Width of the value (the latent, kv_lora_rank), the first columns of each row.
        max_seq_len: Host-side bound of ``seq_lens`` (CUDA: picks the context split count; CPU: the table columns
            the reference gathers; no device sync). None: CUDA reads it from ``seq_lens`` (a sync).
        out: Optional output buffer.

    Returns:
        out: [num_seqs, num_heads, v_head_dim] in q_cat's dtype.

    Raises:
        ValueError: a shape, dtype or device mismatch (the message names the value).
    """
    check_mla_args(q_cat, kv_cache, block_tables, seq_lens, v_head_dim)
    if q_cat.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"mla_decode takes one query row per sequence: q_cat has {q_cat.shape[0]} rows for "
            f"{block_tables.shape[0]} sequences"
        )
    if q_cat.is_cuda:
        from .mla_triton import mla_decode_triton

        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
        return mla_decode_triton(q_cat, kv_cache, block_tables, seq_lens, scale, v_head_dim, max_seq_len, out=out)
    if max_seq_len is not None:  # the reference gathers every table column: only those the longest row reaches
        block_tables = block_tables[:, : max(1, -(-max_seq_len // kv_cache.shape[1]))]
    result = mla_decode_ref(q_cat, kv_cache, block_tables, seq_lens, scale, v_head_dim)
    return result if out is None else out.copy_(result)


def mla_prefill(
    q_cat: torch.Tensor,  # [num_tokens, num_heads, kv_width]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_width]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32: context length incl. the new tokens
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1], int32: offsets of each sequence's new tokens in q_cat
    scale: float,
    v_head_dim: int,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, v_head_dim]
) -> torch.Tensor:
    """Varlen causal MLA: each sequence's new tokens (already in the cache) over its paged latent rows.

    Args:
        q_cat: Each head's absorbed query, the tokens of all sequences packed by ``cu_seqlens_q``.
        kv_cache, block_tables, seq_lens, scale, v_head_dim: as in ``mla_decode``.
        cu_seqlens_q: Sequence s's new tokens are rows ``[cu_seqlens_q[s], cu_seqlens_q[s + 1])`` of q_cat.
        max_query_len: Host-side bound of the new tokens per sequence (CUDA: sizes the grid; no device sync).
            None: read from ``cu_seqlens_q`` (a sync).
        out: Optional output buffer; rows of no sequence are left as they are (zeros when allocated here).

    Returns:
        out: [num_tokens, num_heads, v_head_dim] in q_cat's dtype.

    Raises:
        ValueError: a shape, dtype or device mismatch (the message names the value).
    """
    check_mla_args(q_cat, kv_cache, block_tables, seq_lens, v_head_dim, cu_seqlens_q)
    if q_cat.is_cuda:
        from .mla_triton import mla_prefill_triton

        if max_query_len is None:
            max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if seq_lens.numel() else 0
        return mla_prefill_triton(
            q_cat, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, v_head_dim, max_query_len, out=out
        )
    return mla_prefill_ref(q_cat, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, v_head_dim, out)
