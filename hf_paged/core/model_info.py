"""What hf_paged needs to know about a Hugging Face model to page its KV cache."""

from dataclasses import dataclass

import torch

from hf_paged.core.kv_dtype import check_fp8_devices, is_fp8, kv_storage_dtype, read_kv_scales
from hf_paged.core.kv_pool import KVPool, LayerKV, check_layer_specs

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# On the CPU a default pool is capped: half of the free RAM would take long to allocate and zero.
CPU_DEFAULT_POOL_BYTES = 2 << 30

__all__ = ["CPU_DEFAULT_POOL_BYTES", "SUPPORTED_LAYER_TYPES", "LayerKV", "ModelInfo"]


@dataclass
class ModelInfo:
    """Shape of a decoder-only model's KV cache and where its layers live."""

    model_type: str
    layers: list[LayerKV]  # one per attention layer: its K/V shape and the layer whose blocks it reads
    dtype: torch.dtype  # the pool's storage dtype: the model's, or FP8 (kv_cache_dtype)
    devices: list[torch.device]  # one per layer (accelerate's device_map may spread them)
    layer_types: list[str]
    vocab_size: int
    max_model_len: int | None
    tp_size: int = 1  # tensor-parallel degree: each rank's pools hold num_kv_heads of the config's heads
    kv_cache_dtype: str = "auto"  # as given (hf_paged.core.kv_dtype.KV_CACHE_DTYPES)
    # an FP8 pool's (k_scale, v_scale) per layer, fp32 [1] or [num_kv_heads] on the layer's device; None otherwise
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def from_model(cls, model: torch.nn.Module, kv_cache_dtype: str = "auto") -> "ModelInfo":
        """Read the model's config and parameters.

        Args:
            model: the model.
            kv_cache_dtype: the pool's storage, one of ``KV_CACHE_DTYPES`` (hf_paged.core.kv_dtype): "auto" (the
                model's dtype), "fp8"/"fp8_e4m3" or "fp8_e5m2"; an FP8 pool takes the attention modules'
                ``k_scale``/``v_scale`` where the checkpoint has them, else 1.0.

        Raises:
            ValueError: the model is encoder-decoder, has layers whose state blocks cannot hold, or KV heads that
                tensor parallelism cannot split; an unknown ``kv_cache_dtype``; FP8 for latent (MLA) layers; e4m3
                on a CUDA device older than compute capability 8.9; checkpoint scales of a shape the layer cannot
                take.
        """
        config = model.config
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        _check_model_supported(config, text_config)
        num_layers = text_config.num_hidden_layers
        model_type = getattr(config, "model_type", type(config).__name__)
        # Under transformers' tensor parallelism (tp_plan) every rank computes its share of the heads, so its
        # pools hold that share of every block; all ranks use the same block tables (paper §4.6).
        tp_size = getattr(model, "tp_size", None) or 1
        dtype = kv_storage_dtype(kv_cache_dtype, _kv_dtype(model))
        layers = layer_specs(text_config, num_layers, tp_size, model_type)
        devices = _layer_devices(model, num_layers)
        kv_scales = None
        if is_fp8(dtype):
            if any(spec.v_in_k for spec in layers):
                raise ValueError(
                    f"kv_cache_dtype={kv_cache_dtype!r}: {model_type!r} has latent attention (MLA), which hf_paged "
                    "pages in the model's dtype only; use kv_cache_dtype='auto' for it"
                )
            check_fp8_devices(kv_cache_dtype, devices)
            kv_scales = read_kv_scales(model, [spec.num_kv_heads for spec in layers], devices)
        return cls(
            model_type=model_type,
            layers=layers,
            dtype=dtype,
            devices=devices,
            layer_types=list(getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers),
            vocab_size=text_config.vocab_size,
            max_model_len=getattr(text_config, "max_position_embeddings", None),
            tp_size=tp_size,
            kv_cache_dtype=kv_cache_dtype,
            kv_scales=kv_scales,
        )

    def bytes_per_block(self, block_size: int) -> int:
        """K/V bytes of one block across all layers, each allocated tensor once (sharing layers add nothing); an
        FP8 cache's are half of bf16's, so a memory budget holds twice the blocks."""
        return KVPool.bytes_per_block(self.layers, block_size, self.dtype)

    def num_blocks_for(self, num_blocks: int | None, block_size: int, memory_fraction: float) -> int:
        """``num_blocks`` if given, else as many blocks as ``memory_fraction`` of free memory holds.

        On the CPU the default is capped at ``CPU_DEFAULT_POOL_BYTES`` (2 GiB); pass ``num_blocks`` for more.
        """
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"`memory_fraction` must be in (0, 1], got {memory_fraction}")
        if num_blocks is not None:
            if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
                raise ValueError(f"`num_blocks` must be a positive int, got {num_blocks!r}")
            return num_blocks
        per_block = self.bytes_per_block(block_size)
        budget = int(KVPool.free_memory(self.devices[0]) * memory_fraction)
        if self.devices[0].type == "cpu":
            budget = min(budget, CPU_DEFAULT_POOL_BYTES)
        if budget // per_block < 1:
            raise ValueError(
                f"memory_fraction={memory_fraction} of free memory on {self.devices[0]} ({budget} bytes) holds no KV "
                f"block of {per_block} bytes; pass num_blocks= or a larger memory_fraction"
            )
        return self.same_on_every_rank(budget // per_block)

    def same_on_every_rank(self, num_blocks: int) -> int:
        """Under tensor parallelism every rank must have the same pool (same schedule): the smallest one."""
        import torch.distributed as dist

        if self.tp_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return num_blocks
        device = self.devices[0] if dist.get_backend() == "nccl" else torch.device("cpu")
        value = torch.tensor([num_blocks], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())

    def make_kv_pool(self, num_blocks: int, block_size: int) -> KVPool:
        return KVPool(self.layers, num_blocks, block_size, self.dtype, self.devices, kv_scales=self.kv_scales)


def layer_specs(text_config, num_layers: int, tp_size: int = 1, model_type: str = "model") -> list[LayerKV]:
    """One ``LayerKV`` per layer, from the (text) config.

    Per-layer shapes come from ``per_layer_config`` (transformers' heterogeneous configs: Gemma 4's global layers
    have their own head_dim and KV heads); KV sharing from ``kv_sharing_modes`` or ``num_kv_shared_layers``
    (Gemma 3n, Gemma 4: the last layers reuse the K/V of the last earlier layer of their type).

    Raises:
        ValueError: a layer's KV heads do not split over ``tp_size`` ranks, or a sharing layer has no owner.
    """
    configs = _per_layer_configs(text_config, num_layers)
    owners = _kv_owners(text_config, num_layers)
    specs = []
    for i, (layer_config, owner) in enumerate(zip(configs, owners, strict=True)):
        kv_lora_rank = getattr(layer_config, "kv_lora_rank", None)
        if kv_lora_rank:  # MLA (DeepSeek-V2/V3): one row a token, [latent | roped key], V its latent (core/mla.py)
            rope_dim = layer_config.qk_rope_head_dim
            specs.append(LayerKV(1, kv_lora_rank + rope_dim, kv_lora_rank, owner, v_in_k=True))
            continue
        num_kv_heads = kv_heads(layer_config)
        if num_kv_heads % tp_size:
            raise ValueError(
                f"{model_type!r} has {num_kv_heads} KV heads in layer {i}, which tensor parallelism of degree "
                f"{tp_size} cannot split evenly; pick a tp degree that divides the KV heads"
            )
        head_dim = _head_dim(layer_config)
        specs.append(LayerKV(num_kv_heads // tp_size, head_dim, head_dim, owner))
    # a sharing layer reads its owner's blocks: describe it with the owner's shape (they are one tensor)
    specs = [s if s.kv_layer == i else _as_sharer(specs[s.kv_layer], s.kv_layer) for i, s in enumerate(specs)]
    check_layer_specs(specs)
    return specs


def _as_sharer(owner: LayerKV, owner_idx: int) -> LayerKV:
    return LayerKV(owner.num_kv_heads, owner.head_dim, owner.v_head_dim, owner_idx, owner.v_in_k)


def _per_layer_configs(text_config, num_layers: int) -> list:
    """Each layer's config: transformers' per-layer views for a heterogeneous config (whose global per-layer
    attributes raise on access), else the config itself for every layer."""
    if getattr(text_config, "is_heterogeneous", False):
        return [text_config.per_layer_config[i] for i in range(num_layers)]
    return [text_config] * num_layers


def kv_heads(config) -> int:
    """The KV heads a layer's K/V carry into the cache, as the model computes them.

    Falcon: with ``new_decoder_architecture`` its attention broadcasts K/V to every query head before the cache,
    else ``multi_query`` means one KV head; GPT-BigCode's ``multi_query`` means one. Otherwise
    ``num_key_value_heads`` (or ``num_kv_heads``), and without either as many as the query heads.
    """
    num_heads = config.num_attention_heads
    if getattr(config, "new_decoder_architecture", False):
        return num_heads
    if getattr(config, "multi_query", False):
        return 1
    return getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or num_heads


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _kv_owners(text_config, num_layers: int) -> list[int]:
    """The layer whose K/V each layer uses: itself, or for a layer that reuses K/V (``kv_sharing_modes[i] ==
    "reuse"``), the last earlier layer of its type that stores them ("store"). Configs without
    ``kv_sharing_modes`` but with ``num_kv_shared_layers`` (older transformers' Gemma 3n) share the same way: the
    last ``num_kv_shared_layers`` layers reuse the last earlier layer of their type."""
    layer_types = list(getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers)
    modes = getattr(text_config, "kv_sharing_modes", None)
    if modes is None:
        num_shared = getattr(text_config, "num_kv_shared_layers", 0) or 0
        first_shared = num_layers - num_shared
        modes = [None if i < first_shared else "reuse" for i in range(num_layers)]
        for t in set(layer_types[first_shared:]):
            stores = [j for j in range(first_shared) if layer_types[j] == t]
            if stores:
                modes[stores[-1]] = "store"
    owners = list(range(num_layers))
    for i, mode in enumerate(modes):
        if mode != "reuse":
            continue
        stores = [j for j in range(i) if modes[j] == "store" and layer_types[j] == layer_types[i]]
        if not stores:
            raise ValueError(
                f"layer {i} ({layer_types[i]}) reuses the K/V of an earlier layer, but no earlier {layer_types[i]} "
                f"layer stores them (kv_sharing_modes {list(modes)}); hf_paged pages models whose layers compute "
                "their K/V or reuse those of an earlier layer of the model"
            )
        owners[i] = stores[-1]
    return owners


def _check_model_supported(config, text_config) -> None:
    model_type = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"PagedCache supports decoder-only models; {model_type!r} is an encoder-decoder model. "
            "Use transformers' EncoderDecoderCache for it"
        )
    layer_types = getattr(text_config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
    if other:
        raise ValueError(
            f"PagedCache supports attention layers of types {list(SUPPORTED_LAYER_TYPES)}; model type "
            f"{model_type!r} has layers of type {other} (linear attention, state-space or chunked layers keep "
            "state that blocks cannot hold). Use the model's default cache for it"
        )
    if not hasattr(text_config, "num_attention_heads") or not hasattr(text_config, "num_hidden_layers"):
        raise ValueError(f"PagedCache needs a model with attention heads and layers; {model_type!r} has none")


def _layer_devices(model: torch.nn.Module, num_layers: int) -> list[torch.device]:
    """The device of each decoder layer's attention weights (accelerate's device_map may spread them)."""
    default = next(model.parameters()).device
    devices = [default] * num_layers
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < num_layers:
            param = next(module.parameters(recurse=True), None)
            if param is not None:
                devices[idx] = param.device
    offloaded = [i for i, d in enumerate(devices) if d.type == "meta"]
    if offloaded:
        raise ValueError(
            f"layers {offloaded} have their weights offloaded (on the meta device); hf_paged keeps each layer's KV "
            "pool on that layer's device, so load the model with every layer on a GPU or the CPU (no disk offload)"
        )
    return devices


def _kv_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point() and not is_fp8(p.dtype):  # FP8 weights compute in another dtype
            return p.dtype
    return torch.float32
