"""Paged multi-head latent attention (MLA) for DeepSeek-V2/V3 attention modules (Kimi-K2 loads as DeepSeek-V3).

transformers' MLA modules expand the cached latent into per-head K (qk_nope + qk_rope wide) and V (v_head_dim wide)
with ``kv_b_proj`` before attention, so their K/V fit no paged pool of one width and the "paged" attention function
never sees the latent. ``use_paged_mla(model)`` gives each MLA attention module a forward that, inside a paged
forward (a ForwardContext is current: the engine, or a ``PagedCache`` forward), pages the latent itself:

1. projections as the module's own forward: ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)``), split
   into ``q_nope``/``q_rot``; ``[c | k_rot] = kv_a_proj_with_mqa(x)``, ``c = kv_a_layernorm(c)``; rope on
   ``q_rot``/``k_rot`` with the module's own rope function (V3: cos/sin, interleaved or not; V2: complex freqs);
2. the token's row ``[c | k_rot]`` (kv_lora_rank + qk_rope_head_dim wide) is written to the layer's pool at the
   step's slots (``write_kv`` with one KV head; the pool's layer is ``LayerKV(1, rank + rope, rank, v_in_k=True)``);
3. absorbed attention (as vLLM and FlashInfer do): with ``W_UK_h, W_UV_h`` head h's rows of ``kv_b_proj.weight``,
   ``q_cat_h = [q_nope_h @ W_UK_h | q_rot_h]``, ``o_lat_h = kernels.mla_decode / mla_prefill(q_cat, pool)``, which
   attends every head to the same cached rows (scores ``scaling * q_cat . row``, V = the row's latent ``c``);
4. ``out_h = o_lat_h @ W_UV_h^T``, then ``o_proj``.

``q_nope_h . (W_UK_h c) = (q_nope_h W_UK_h) . c`` and ``sum_j p_j W_UV_h c_j = W_UV_h sum_j p_j c_j``: the result is
the module's own up to rounding, and each cached token costs ``rank + rope`` values instead of
``num_heads * (qk_nope + qk_rope + v_head_dim)``.

Outside a paged forward (a DynamicCache, no cache, the support probe) the module's original forward runs. Under
``PagedCache`` the latent path runs whatever the model's ``attn_implementation`` (the attention function is never
called: the kernels take lengths, not masks). Step metadata comes from the forward context exactly as in
hf_paged.core.attention: ``ctx.kv_caches[layer_idx]`` in the engine, the cache's pool (``ctx.owner.kv``) under
PagedCache, and a planned decode step's static context from the forward kwarg ``PLANNED_CONTEXT_KWARG``.
"""

import sys
import types

import torch

from hf_paged.core.attention import PLANNED_CONTEXT_KWARG
from hf_paged.core.context import ForwardContext, get_forward_context
from hf_paged.kernels import mla_decode, mla_prefill, write_kv

__all__ = ["SUPPORTED_MLA_MODULES", "is_mla_model", "use_paged_mla", "is_paged_mla"]

# The attention classes whose forward this module reproduces (projections, norms, rope); DeepSeek-V3's code also
# serves Kimi-K2. Other classes with a latent KV (DeepSeek-V3.2's sparse indexer, LongCat-Flash's latent scaling,
# GLM-4-MoE-Lite) are refused, never run through a forward that is not theirs.
SUPPORTED_MLA_MODULES = ("DeepseekV2Attention", "DeepseekV3Attention")
_ORIGINAL_FORWARD = "_hf_paged_original_forward"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_mla_model(model: torch.nn.Module) -> bool:
    """Whether the model's (text) config describes latent attention layers (``kv_lora_rank`` set)."""
    config = model.config
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "kv_lora_rank", None))


def is_paged_mla(module: torch.nn.Module) -> bool:
    """Whether ``use_paged_mla`` gave this attention module its paged forward."""
    return _ORIGINAL_FORWARD in module.__dict__


def use_paged_mla(model: torch.nn.Module) -> int:
    """Give every MLA attention module of ``model`` the paged latent forward (idempotent); no-op for other models.

    Returns:
        The number of MLA attention modules that have the paged forward.

    Raises:
        ValueError: the model has latent attention that hf_paged does not page (its model type and why): an
            attention class outside ``SUPPORTED_MLA_MODULES`` (DeepSeek-V3.2's sparse indexer, ...), quantized
            ``kv_b_proj`` weights (the absorbed form multiplies by them), or tensor parallelism.
    """
    if not is_mla_model(model):
        return 0
    model_type = getattr(model.config, "model_type", type(model.config).__name__)
    modules = [m for m in model.modules() if _has_latent_kv(m)]
    other = sorted({type(m).__name__ for m in modules if type(m).__name__ not in SUPPORTED_MLA_MODULES})
    if other or not modules:
        raise ValueError(
            f"{model_type!r} has latent (MLA) attention in {other or 'no recognised module'}; hf_paged pages the MLA "
            f"of {list(SUPPORTED_MLA_MODULES)} only (DeepSeek-V2, DeepSeek-V3, Kimi-K2). Run this model with "
            "model.generate and transformers' own cache (DynamicCache)"
        )
    if (getattr(model, "tp_size", None) or 1) > 1:
        raise ValueError(
            f"{model_type!r}: hf_paged's latent attention does not support tensor parallelism (tp_size="
            f"{model.tp_size}); load the model on one device per process, or with device_map"
        )
    for module in modules:
        weight = module.kv_b_proj.weight
        if weight.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{model_type!r}: {type(module).__name__} {module.layer_idx}'s kv_b_proj weight is {weight.dtype}; "
                f"the absorbed latent attention multiplies by it and needs one of {list(_FLOAT_DTYPES)} "
                "(load the model dequantized)"
            )
    for module in modules:
        if not is_paged_mla(module):
            setattr(module, _ORIGINAL_FORWARD, module.forward)
            module.forward = types.MethodType(_paged_mla_forward, module)
    return len(modules)


def _has_latent_kv(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm", "layer_idx"))


def _paged_mla_forward(self, *args, **kwargs):
    """The MLA module's forward: the paged latent path inside a paged forward, the original forward elsewhere."""
    if torch.compiler.is_compiling():  # the forward context is a context variable, which dynamo cannot read
        return _dispatch_disabled(self, args, kwargs)
    return _dispatch(self, args, kwargs)


def _dispatch(module, args: tuple, kwargs: dict):
    ctx = kwargs.get(PLANNED_CONTEXT_KWARG)
    if ctx is None:
        ctx = get_forward_context()
    if ctx is None:
        return getattr(module, _ORIGINAL_FORWARD)(*args, **kwargs)
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if "position_embeddings" in kwargs:
        position_embeddings = kwargs["position_embeddings"]
    else:  # positional call: V2 and V3 order their parameters differently; the original's signature tells
        import inspect

        bound = inspect.signature(getattr(module, _ORIGINAL_FORWARD)).bind(*args, **kwargs)
        position_embeddings = bound.arguments["position_embeddings"]
    return _paged_mla(module, hidden_states, position_embeddings, ctx), None


_dispatch_disabled = torch.compiler.disable(_dispatch)


def _rope(module, q_rot: torch.Tensor, k_rot: torch.Tensor, position_embeddings):
    """The module's own rope, from its modeling module: q_rot [B, H, L, rope], k_rot [B, 1, L, rope]."""
    modeling = sys.modules[type(module).__module__]
    if isinstance(position_embeddings, tuple):  # DeepSeek-V3: (cos, sin), pairs interleaved or in halves
        cos, sin = position_embeddings
        if getattr(module.config, "rope_interleave", False):
            return modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        return modeling.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    # DeepSeek-V2: complex frequencies
    return modeling.apply_rotary_emb(q_rot, k_rot, position_embeddings.to(q_rot.device))


def _layer_pool(module, ctx: ForwardContext) -> tuple[torch.Tensor, bool]:
    """The layer's latent pool [num_blocks, block_size, 1, rank + rope] and whether this layer writes it."""
    layer_idx = module.layer_idx
    if ctx.kv_caches is not None:  # engine: (k_cache, v_cache) or (k_cache, v_cache, writes)
        entry = ctx.kv_caches[layer_idx]
        return entry[0], len(entry) < 3 or bool(entry[2])
    kv = ctx.owner.kv  # PagedCache: the pool it built for the model
    return kv.k_cache[layer_idx], kv.owns(layer_idx) if hasattr(kv, "owns") else True


def _paged_mla(module, hidden_states: torch.Tensor, position_embeddings, ctx: ForwardContext) -> torch.Tensor:
    """Steps 1-4 of the module docstring over the current step.

    Args:
        hidden_states: [batch_size, query_len, hidden_size].
        ctx: the step's ForwardContext (its slots cover the ``batch_size * query_len`` input columns).

    Returns:
        [batch_size, query_len, hidden_size]: o_proj of the attention; padding columns attend to nothing.
    """
    if module.training and module.attention_dropout:
        raise ValueError(
            f"paged latent attention is inference-only; got attention_dropout={module.attention_dropout} in training "
            "mode (call model.eval())"
        )
    batch_size, query_len, _ = hidden_states.shape
    num_heads, nope, rope = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim
    rank, v_dim = module.kv_lora_rank, module.v_head_dim
    num_columns = batch_size * query_len

    # 1. projections and rope, as the module's forward computes them
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(batch_size, query_len, num_heads, nope + rope).transpose(1, 2)  # [B, H, L, nope + rope]
    q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
    c, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    c = module.kv_a_layernorm(c)  # [B, L, rank]
    q_rot, k_rot = _rope(module, q_rot, k_rot.view(batch_size, 1, query_len, rope), position_embeddings)

    # 2. the latent rows [num_columns, 1, rank + rope] into the layer's pool
    kv_cache, writes = _layer_pool(module, ctx)
    ctx = ctx.on(kv_cache.device)
    if ctx.pending_kv is not None:  # a deferred write of a non-MLA layer that no attention took (not expected)
        ctx.flush_pending_kv()
    if writes:
        rows = torch.cat([c, k_rot.view(batch_size, query_len, rope)], dim=-1).reshape(num_columns, 1, rank + rope)
        rows = rows.to(kv_cache.dtype)
        write_kv(rows, rows, kv_cache, kv_cache, ctx.slot_mapping)

    # 3. absorbed queries [num_tokens, H, rank + rope] of the real tokens, then the latent attention
    weight = module.kv_b_proj.weight.view(num_heads, nope + v_dim, rank)
    w_uk, w_uv = weight[:, :nope], weight[:, nope:]  # [H, nope, rank], [H, v_dim, rank]
    q_nope = q_nope.transpose(0, 1).reshape(num_heads, num_columns, nope)  # [H, B * L, nope]
    q_rot = q_rot.transpose(1, 2).reshape(num_columns, num_heads, rope)  # [B * L, H, rope]
    if ctx.token_idx is not None:
        q_nope, q_rot = q_nope.index_select(1, ctx.token_idx), q_rot.index_select(0, ctx.token_idx)
    q_lat = torch.bmm(q_nope, w_uk)  # [H, num_tokens, rank]
    q_cat = torch.cat([q_lat.transpose(0, 1), q_rot], dim=-1).to(kv_cache.dtype)  # [num_tokens, H, rank + rope]
    o_lat = _attend(q_cat, kv_cache, ctx, module.scaling, rank)  # [num_tokens, H, rank]

    # 4. per-head up-projection of the latent output, then o_proj
    out = torch.bmm(o_lat.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2))  # [H, num_tokens, v_dim]
    out = out.transpose(0, 1)  # [num_tokens, H, v_dim]
    if ctx.token_idx is not None:
        full = out.new_zeros(num_columns, num_heads, v_dim)
        full.index_copy_(0, ctx.token_idx, out)
        out = full
    return module.o_proj(out.reshape(batch_size, query_len, num_heads * v_dim).to(hidden_states.dtype))


def _attend(q_cat: torch.Tensor, kv_cache: torch.Tensor, ctx: ForwardContext, scale: float, rank: int) -> torch.Tensor:
    """The step's latent attention: decode rows through ``mla_decode``, everything else through ``mla_prefill``.

    Args:
        q_cat: [num_tokens, num_heads, rank + rope], the real tokens packed by ``ctx.cu_seqlens_q``.

    Returns:
        [num_tokens, num_heads, rank]; rows of tokens of no sequence (CUDA-graph padding) are zeros.
    """
    num_seqs = ctx.block_tables.shape[0]
    if ctx.decode_seq_lens is not None:
        # A mixed CUDA-graph step: the leading single-token sequences (row s is sequence s) take the decode kernel;
        # the prefill kernel then writes the other sequences' rows (the decode ones are empty sequences there).
        out = q_cat.new_zeros(q_cat.shape[0], q_cat.shape[1], rank)
        decode_rows = min(ctx.decode_seq_lens.shape[0], q_cat.shape[0])
        mla_decode(q_cat[:decode_rows], kv_cache, ctx.block_tables[:decode_rows], ctx.decode_seq_lens[:decode_rows],
                   scale, rank, max_seq_len=ctx.max_seq_len, out=out[:decode_rows])  # fmt: skip
        return mla_prefill(q_cat, kv_cache, ctx.block_tables, ctx.seq_lens, ctx.prefill_cu_seqlens_q, scale, rank,
                           max_query_len=ctx.max_query_len, out=out)  # fmt: skip
    if ctx.max_query_len == 1 and q_cat.shape[0] == num_seqs:  # a decode step: row s is sequence s's new token
        return mla_decode(q_cat, kv_cache, ctx.block_tables, ctx.seq_lens, scale, rank, max_seq_len=ctx.max_seq_len)
    return mla_prefill(q_cat, kv_cache, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q, scale, rank,
                       max_query_len=ctx.max_query_len)  # fmt: skip
