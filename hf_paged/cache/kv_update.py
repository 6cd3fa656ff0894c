"""Writing a layer's K/V into a PagedCache's blocks: the work behind ``PagedCache.update``.

Three ways, by how the forward was planned: a planned (compiled) decode step writes at the static slots and
returns the pools; an eager forward writes at its ForwardContext's slots (an eager decode step with "paged"
attention leaves the write to the attention's decode launch, ``defer_kv_write``) and returns the pools, or,
for any other attention implementation, contiguous K/V gathered through the block tables.

An FP8 pool (``kv.kv_scales``, hf_paged.core.kv_dtype) takes its layer's scales in every write; the gathered K/V
are dequantized (fp8 * scale) into the dtype of the layer's key states, as the kernels read them.
"""

import torch

from hf_paged.core.context import get_forward_context
from hf_paged.kernels import write_kv


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    gather_idx: torch.Tensor,  # [batch_size, kv_len], int64; -1 = padding
    scale: torch.Tensor | None = None,  # an FP8 pool's [1] or [num_kv_heads], fp32
    dtype: torch.dtype | None = None,  # the dtype an FP8 pool's K/V are dequantized to
) -> torch.Tensor:
    """[batch_size, num_kv_heads, kv_len, head_dim] contiguous K or V; padding columns are zero."""
    slots = gather_idx.clamp(min=0)
    block_size = cache.shape[1]
    # (block, offset) indices: any strides (an FP8 pool's V is keys-minor)
    out = cache[slots // block_size, slots % block_size]  # [batch_size, kv_len, num_kv_heads, head_dim]
    if scale is not None:  # FP8: dequantize as the kernels read (fp8 * scale, in fp32)
        out = (out.float() * scale.view(1, 1, -1, 1)).to(dtype)
    out = out.masked_fill((gather_idx < 0)[:, :, None, None], 0)
    return out.transpose(1, 2)


class KVWriter:
    """K/V writes of PagedCache (a mixin; state in ``PagedCache.__init__``): ``kv`` (the KVPool), ``_static``."""

    def _update_planned(self, key_states, value_states, layer_idx: int):
        """A planned decode step (traced under torch.compile): write at the static slots, return the pools."""
        kv = self.kv
        shape = key_states.shape
        if type(layer_idx) is not int or not 0 <= layer_idx < kv.num_layers or len(shape) != 4:
            self._check_layer(key_states, layer_idx)
        spec = kv.layers[layer_idx]
        if shape[1] != spec.num_kv_heads or shape[3] != spec.head_dim or spec.kv_layer != layer_idx:
            self._check_layer(key_states, layer_idx)
        k_cache, v_cache = kv.k_cache[layer_idx], kv.v_cache[layer_idx]
        batch_size, num_kv_heads, query_len, head_dim = shape
        key = key_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        value = value_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        k_scale, v_scale = (None, None) if kv.kv_scales is None else kv.kv_scales[layer_idx]
        write_kv(key, value, k_cache, v_cache, self._static.ctx.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return k_cache, v_cache

    def _update_from_context(self, key_states, value_states, layer_idx: int):
        ctx = get_forward_context()
        if ctx is None or ctx.owner is not self:
            raise RuntimeError(
                "PagedCache.update() was called outside a forward it planned. PagedCache plans each forward "
                "through a hook on the model it was built with: pass it to that model's generate()/forward()"
            )
        kv = self.kv
        shape = key_states.shape
        if type(layer_idx) is not int or not 0 <= layer_idx < kv.num_layers or len(shape) != 4:
            self._check_layer(key_states, layer_idx)
        spec = kv.layers[layer_idx]
        # the checks of _check_layer, inline: this runs once per layer per forward
        if shape[1] != spec.num_kv_heads or shape[3] != spec.head_dim or spec.kv_layer != layer_idx:
            self._check_layer(key_states, layer_idx)
        k_cache, v_cache = kv.k_cache[layer_idx], kv.v_cache[layer_idx]
        if ctx.slot_mapping.device != k_cache.device:  # device_map: this layer lives on another device
            ctx = ctx.on(k_cache.device)
        batch_size, num_kv_heads, query_len, head_dim = shape
        if query_len == 1:  # decode: dropping the size-1 column is a view, at half the host time of the general form
            key = key_states.view(batch_size, num_kv_heads, head_dim)
            value = value_states.view(batch_size, num_kv_heads, head_dim)
            if ctx.defer_kv_write and key.dtype == k_cache.dtype:  # the attention's decode kernel writes them
                if ctx.pending_kv is not None:  # an earlier layer's, which no attention took (not expected)
                    ctx.flush_pending_kv()
                ctx.pending_kv = (k_cache, v_cache, key, value)
                return k_cache, v_cache
        else:
            key = key_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
            value = value_states.transpose(1, 2).reshape(batch_size * query_len, num_kv_heads, head_dim)
        k_scale, v_scale = (None, None) if kv.kv_scales is None else kv.kv_scales[layer_idx]
        write_kv(key, value, k_cache, v_cache, ctx.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        if ctx.paged:
            return k_cache, v_cache
        dtype = key_states.dtype
        return _gather(k_cache, ctx.gather_idx, k_scale, dtype), _gather(v_cache, ctx.gather_idx, v_scale, dtype)

    _update_from_context_disabled = torch.compiler.disable(_update_from_context)

    def _check_layer(self, key_states: torch.Tensor, layer_idx: int) -> None:
        """The layer and its K/V shape must be those of the model the pool was built for, and the layer must own
        its K/V (a layer that shares an earlier layer's K/V takes them from the model, never through update)."""
        kv = self.kv
        spec = kv.layers[layer_idx] if type(layer_idx) is int and 0 <= layer_idx < kv.num_layers else None
        if len({(s.num_kv_heads, s.head_dim) for s in kv.layers}) == 1:
            shapes = f"of {kv.layers[0].num_kv_heads} KV heads of head_dim {kv.layers[0].head_dim}"
        elif spec is not None:
            shapes = (
                f"of per-layer shapes (layer {layer_idx}: {spec.num_kv_heads} KV heads of head_dim {spec.head_dim})"
            )
        else:
            shapes = "of per-layer shapes"
        built_for = f"PagedCache was built for a model with {kv.num_layers} attention layers {shapes}"
        fix = "; use a PagedCache built for this model: PagedCache(model, ...)"
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < kv.num_layers:
            raise ValueError(
                f"{built_for}, but this forward updates layer_idx {layer_idx!r} (allowed: 0 to "
                f"{kv.num_layers - 1}){fix}"
            )
        if spec.kv_layer != layer_idx:
            raise ValueError(
                f"layer {layer_idx} shares the K/V of layer {spec.kv_layer} (the config's KV sharing), so it must "
                "not write K/V, but this forward calls update() for it; PagedCache follows the config's "
                "kv_sharing_modes / num_kv_shared_layers, which this model's attention does not"
            )
        shape = tuple(key_states.shape)
        if len(shape) != 4 or shape[1] != spec.num_kv_heads or shape[3] != spec.head_dim:
            got = f"num_kv_heads {shape[1]}, head_dim {shape[3]}" if len(shape) == 4 else f"{len(shape)} dims"
            raise ValueError(
                f"{built_for}, but layer {layer_idx} of this forward has key states of shape {shape} "
                f"([batch, num_kv_heads, query_len, head_dim]: {got}){fix}"
            )
