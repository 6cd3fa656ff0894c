"""The "paged" attention implementation for transformers: a thin adapter over hf_paged.kernels.

``register()`` (run by ``import hf_paged``) adds:
- attention function "paged" (``AttentionInterface``): inside a paged forward (a ``ForwardContext`` is
  set, see hf_paged.core.context) ``key``/``value`` are the layer's block pools, already updated by the cache
  (in an eager PagedCache decode step the cache leaves the layer's new K/V in ``ctx.pending_kv`` and the
  decode kernel writes them: one launch a layer; on CUDA the step's first layer keeps that launch,
  ``kernels.decode.DecodeBinding``, and the later layers of the same kind repeat it with their own tensors).
  In the engine (``ctx.kv_caches``: no Cache object) the function writes the layer's new K/V itself: in a decode
  step (shared-prefix ones included) inside the decode kernel, otherwise with ``write_kv`` before the attention.
  It packs the real query tokens to
  ``[num_tokens, num_heads, head_dim]`` and calls ``paged_attention`` over the block tables. K/V are never
  gathered. Outside a paged forward (e.g. the model is used with a DynamicCache, or without cache) it falls back
  to torch SDPA on the given K/V, or, for a logit soft-cap or attention sinks (which SDPA lacks), to the direct
  computation of transformers' eager attention.
- attention sinks (gpt-oss: ``module.sinks``, one logit per query head that joins the softmax's denominator only)
  go to every kernel call as ``sinks``; the kernels add them once per head (hf_paged.kernels.reference).
- an FP8 pool's per-layer K/V scales (``ctx.kv_scales[module.layer_idx]``, hf_paged.core.kv_dtype) go to every kernel
  call over the layer's pools as ``k_scale``/``v_scale``: the kernels quantize what they write and dequantize what
  they read (the kept decode launch takes each layer's own).
- mask function "paged" (``AttentionMaskInterface``): no mask inside a paged forward (the kernels
  take lengths, not masks); the SDPA boolean mask otherwise, for the fallback.

A decode step that ``PagedCache`` planned ahead (its compiled ``generate`` path, see hf_paged.cache) hands its
static context over as the forward kwarg ``PLANNED_CONTEXT_KWARG``; transformers passes forward kwargs down to the
attention function. That path traces under torch.compile (one ``paged_decode`` call); every other path reads the
context variable and stays eager under torch.compile (a graph break, as the engine's compiled layers expect).
"""

import torch

from hf_paged.core.context import ForwardContext, get_forward_context
from hf_paged.kernels import paged_attention, paged_decode, write_kv

ATTN_NAME = "paged"
# Eager decode (PagedCache under generate, not compiled): the GPU waits for the host's launches, so each context
# split streams at least this many keys (one split up to 2048 keys: no merge launch, no partial buffers); at batch
# 1 x 2048 one split of 8 KV heads reads 8 MB in tens of µs, against ~1 ms of host time a layer.
EAGER_MIN_KEYS_PER_SPLIT = 2048
# The forward kwarg that carries a planned decode step's static ForwardContext (set by PagedCache's decoder hook).
PLANNED_CONTEXT_KWARG = "hf_paged_planned_context"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch_size, num_heads, query_len, head_dim]
    key: torch.Tensor,  # paged: k_cache [num_blocks, block_size, num_kv_heads, head_dim]; else [B, Hkv, kv_len, D]
    value: torch.Tensor,  # like key
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry point.

    Returns:
        (out, None): out is [batch_size, query_len, num_heads, head_dim], as transformers expects.
    """
    planned = kwargs.get(PLANNED_CONTEXT_KWARG)
    if planned is not None:
        return _planned_decode_attention(planned, module, query, key, value, dropout, scaling, sliding_window, softcap)
    # Under torch.compile the context path must stay out of the graph (a graph break); eager callers skip the
    # disable wrapper, whose frame-hook bookkeeping costs more per layer than the rest of this adapter.
    context_attention = _context_attention_disabled if torch.compiler.is_compiling() else _context_attention
    return context_attention(
        module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs
    )


def _planned_decode_attention(
    ctx: ForwardContext, module, query, key, value, dropout, scaling, sliding_window, softcap
) -> tuple[torch.Tensor, None]:
    """A planned decode step: ``key``/``value`` are the pools, already written; one ``paged_decode`` over the
    static block tables and lengths. Traceable: no host sync, nothing read from tensors on the host."""
    _check_paged_module(module, dropout)
    sinks = _module_sinks(module)
    k_scale, v_scale = ctx.layer_scales(module.layer_idx)
    batch_size, num_heads, query_len, head_dim = query.shape
    if query_len != 1:
        raise RuntimeError(f"bug in hf_paged: a planned decode step got {query_len} query columns, expected 1")
    out = paged_decode(
        query.reshape(batch_size, num_heads, head_dim),
        key,
        value,
        ctx.block_tables,
        ctx.seq_lens,
        scaling if scaling is not None else head_dim**-0.5,
        ctx.max_seq_len,
        sliding_window=sliding_window or None,
        soft_cap=softcap or None,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
    )  # [batch_size, num_heads, head_dim]
    return out.view(batch_size, 1, num_heads, head_dim), None


def _check_paged_module(module: torch.nn.Module, dropout: float) -> None:
    if dropout and module.training:
        raise ValueError(f"attn_implementation='paged' is inference-only; got dropout={dropout} in training mode")


def _context_attention(
    module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs: dict
) -> tuple[torch.Tensor, None]:
    """Every forward but a planned decode step: the step metadata comes from the forward context.

    ``kwargs``: the attention function's other keyword arguments, as a dict (only the fallback reads them).
    """
    ctx = get_forward_context()
    if ctx is None or not ctx.paged:
        return _fallback_attention(module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs)
    _check_paged_module(module, dropout)
    sinks = _module_sinks(module)
    scales = ctx.kv_scales  # an FP8 pool's per-layer (k_scale, v_scale); None otherwise
    k_scale, v_scale = (None, None) if scales is None else scales[module.layer_idx]
    batch_size, num_heads, query_len, head_dim = query.shape
    ctx = ctx.on(query.device)
    if scaling is None:
        scaling = head_dim**-0.5
    if (
        query_len == 1
        and ctx.token_idx is None
        and ctx.max_query_len == 1
        and ctx.kv_caches is None
        and ctx.decode_seq_lens is None
    ):
        # A decode step under PagedCache (the hot path of eager generate): one real token in every row, its K/V left
        # by update() in ctx.pending_kv (or already in the pools): one decode launch writes and reads them.
        pending = ctx.pending_kv
        new_key = new_value = slots = None
        if pending is not None:
            if pending[0] is key and ctx.prefix_len is None:
                ctx.pending_kv = None
                new_key, new_value, slots = pending[2], pending[3], ctx.slot_mapping
            else:  # not this layer's pools (not expected): write them the separate way
                ctx.flush_pending_kv()
        if not query.is_cuda and ctx.prefix_len is None:
            # CPU: the decode reference, vectorised over the rows, over the table columns the longest row reaches
            # (the varlen reference that paged_attention takes there loops over the rows).
            if slots is not None:  # a deferred write: of the pool's own dtype only (FP8 pools are written in update)
                write_kv(new_key, new_value, key, value, slots)
            width = max(1, -(-ctx.max_seq_len // key.shape[1]))
            out = paged_decode(
                query.view(batch_size, num_heads, head_dim), key, value, ctx.block_tables[:, :width], ctx.seq_lens,
                scaling, ctx.max_seq_len, sliding_window=sliding_window or None, soft_cap=softcap or None,
                sinks=sinks, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
            return out.view(batch_size, 1, num_heads, head_dim), None
        q = query.view(batch_size, num_heads, head_dim)
        binding = ctx.decode_binding
        kind = (scaling, sliding_window, softcap, slots is None, sinks is None)
        # The first layer's launch, kept (kernels.decode.DecodeBinding), serves every layer of the same kind: its
        # tables, lengths and slots are this step's, so a layer with the same scale, window, cap, fused write and
        # presence of sinks only brings its own tensors (its sinks and an FP8 pool's scales among them). A layer of
        # another kind takes the full path (and binds nothing).
        if binding and binding[0] == kind:
            out = binding[1].launch(q, key, value, new_key, new_value, sinks, k_scale, v_scale)
            if out is not None:
                return out.view(batch_size, 1, num_heads, head_dim), None
        bind = [] if binding is None and ctx.prefix_len is None else None
        out = paged_attention(
            q, key, value, ctx.block_tables, ctx.seq_lens,
            ctx.cu_seqlens_q, scaling, max_query_len=1, max_seq_len=ctx.max_seq_len,
            sliding_window=sliding_window or None, soft_cap=softcap or None,
            prefix_len=ctx.prefix_len if not sliding_window else None, max_prefix_len=ctx.max_prefix_len,
            key=new_key, value=new_value, slot_mapping=slots, min_keys_per_split=EAGER_MIN_KEYS_PER_SPLIT, bind=bind,
            sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        if bind is not None:
            ctx.decode_binding = (kind, bind[0]) if bind else False
        return out.view(batch_size, 1, num_heads, head_dim), None
    if ctx.pending_kv is not None:  # a deferred write the fast path did not take (not expected)
        ctx.flush_pending_kv()
    new_key = new_value = None  # the new tokens' K/V [num_tokens, num_kv_heads, head_dim] (engine path)
    window, cap = (sliding_window if sliding_window else None), (softcap if softcap else None)
    # Shared-prefix decode (kernels/cascade.py) for the single-token rows; a sliding-window layer reads only its
    # window and takes the plain decode.
    prefix_len = ctx.prefix_len if window is None else None
    fused_write = None  # the engine's decode step: slot_mapping for the decode kernel's own K/V write
    if ctx.kv_caches is not None:  # engine path: no Cache object; write this layer's new K/V here
        # writes is False for a layer that shares an earlier layer's K/V (Gemma 3n, Gemma 4): its pools are that
        # layer's, already written this step, and its key/value (the model's shared K/V) are the same new tokens'
        k_cache, v_cache, writes = ctx.kv_caches[module.layer_idx]
        num_kv_heads = key.shape[1]
        new_key = key.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        new_value = value.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        decode = ctx.max_query_len == 1 and ctx.decode_seq_lens is None and ctx.token_idx is None
        if writes and decode:
            # A decode step (shared-prefix ones too: each row's new token lies above the shared blocks): the decode
            # kernel writes each row's new K/V and attends to it from registers, one launch a layer fewer.
            fused_write = ctx.slot_mapping  # token i is row i's new token (padding: slot -1, length 0)
        elif writes:
            write_kv(new_key, new_value, k_cache, v_cache, ctx.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        key, value = k_cache, v_cache
    if query_len == 1:
        q = query.reshape(batch_size, num_heads, head_dim)  # [num_tokens, num_heads, head_dim], a view
    else:
        q = query.transpose(1, 2).reshape(batch_size * query_len, num_heads, head_dim)
    if ctx.token_idx is not None:
        q = q.index_select(0, ctx.token_idx)
        if new_key is not None:
            new_key, new_value = new_key.index_select(0, ctx.token_idx), new_value.index_select(0, ctx.token_idx)
    # Decode reads the blocks; the prefill kernel needs a contiguous last dim. An FP8 pool's prefill reads the blocks
    # too: a fresh prompt then attends to the same quantized K/V as a chunked or prefix-hit one, so outputs do not
    # depend on how the scheduler split the prompt.
    if fused_write is None and (
        query_len == 1 or k_scale is not None or (new_key is not None and new_key.stride(2) != 1)
    ):
        new_key = new_value = None
    out = None
    cu_seqlens_q = ctx.cu_seqlens_q
    if ctx.decode_seq_lens is not None:  # mixed graph step: the leading decode rows take the decode kernel first
        num_seqs = ctx.decode_seq_lens.shape[0]
        out = torch.zeros_like(q)  # rows of no sequence read as 0
        paged_attention(
            q[:num_seqs], key, value, ctx.block_tables, ctx.decode_seq_lens, ctx.decode_cu_seqlens_q, scaling,
            max_query_len=1, max_seq_len=ctx.max_seq_len, sliding_window=window, soft_cap=cap, out=out[:num_seqs],
            prefix_len=prefix_len, max_prefix_len=ctx.max_prefix_len, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        cu_seqlens_q = ctx.prefill_cu_seqlens_q  # the decode rows are empty sequences there: left as written
    if ctx.max_query_len != 1:
        prefix_len = None  # the prefill kernel has no shared-prefix path
    out = paged_attention(
        q,
        key,
        value,
        ctx.block_tables,
        ctx.seq_lens,
        cu_seqlens_q,
        scaling,
        max_query_len=ctx.max_query_len,
        max_seq_len=ctx.max_seq_len,
        sliding_window=window,
        soft_cap=cap,
        out=out,
        key=new_key,  # fresh prompts read their K/V here instead of through the block table
        value=new_value,
        prefix_len=prefix_len,
        max_prefix_len=ctx.max_prefix_len,
        slot_mapping=fused_write,  # a decode step: written by the decode kernel (else None: written above)
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
    )  # [num_tokens, num_heads, head_dim]
    if ctx.token_idx is not None:
        full = out.new_zeros(batch_size * query_len, num_heads, head_dim)
        full.index_copy_(0, ctx.token_idx, out)
        out = full
    return out.view(batch_size, query_len, num_heads, head_dim), None


# reads the forward context and launches Triton kernels: stays eager under torch.compile
_context_attention_disabled = torch.compiler.disable(_context_attention)


def _module_sinks(module: torch.nn.Module) -> torch.Tensor | None:
    """The attention module's sink logits [num_heads] (gpt-oss), held as a parameter, a buffer or a plain attribute;
    None without. Dict lookups only: ``getattr``'s miss on a Module is slow, and this runs per layer per step."""
    sinks = module._parameters.get("sinks")
    if sinks is None:
        sinks = module._buffers.get("sinks")
        if sinks is None:
            sinks = module.__dict__.get("sinks")
    return sinks


def _fallback_attention(module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs):
    """Plain attention on contiguous K/V [B, Hkv, kv_len, D] with transformers' boolean mask: SDPA, or, for what SDPA
    lacks (a logit soft-cap, attention sinks), the direct computation of transformers' eager attention (gpt-oss's
    with sinks: the sink logit is one more softmax column, dropped after the softmax)."""
    sinks = _module_sinks(module)
    if softcap is None and sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    # [batch_size, num_heads, query_len, kv_len]
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:
        # transformers leaves out a plain causal mask for SDPA (its is_causal): causal, the queries the last keys
        query_len, kv_len = scores.shape[-2:]
        if query_len > 1 and getattr(module, "is_causal", True):
            allowed = torch.ones(query_len, kv_len, dtype=torch.bool, device=scores.device).tril(kv_len - query_len)
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + attention_mask
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1)
    else:
        sink_col = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1).float(), dim=-1)[..., :-1]
    return torch.matmul(probs.to(query.dtype), value).transpose(1, 2).contiguous(), None


def paged_mask(*args, **kwargs):
    """Mask function for "paged": none inside a paged forward; SDPA's boolean mask for the fallback."""
    ctx = get_forward_context()
    if ctx is not None and ctx.paged:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register "paged" with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, paged_mask)
