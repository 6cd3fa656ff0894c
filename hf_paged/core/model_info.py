"""What hf_paged needs to know about a Hugging Face model to page its KV cache."""

from dataclasses import dataclass

import torch

from hf_paged.core.kv_pool import KVPool

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# On the CPU a default pool is capped: half of the free RAM would take long to allocate and zero.
CPU_DEFAULT_POOL_BYTES = 2 << 30


@dataclass
class ModelInfo:
    """Shape of a decoder-only model's KV cache and where its layers live."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    devices: list[torch.device]  # one per layer (accelerate's device_map may spread them)
    layer_types: list[str]
    vocab_size: int
    max_model_len: int | None
    tp_size: int = 1  # tensor-parallel degree: each rank's pools hold num_kv_heads of the config's heads

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "ModelInfo":
        """Read the model's config and parameters.

        Raises:
            ValueError: the model is encoder-decoder or has layers whose state blocks cannot hold.
        """
        config = model.config
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        _check_model_supported(config, text_config)
        num_layers = text_config.num_hidden_layers
        num_heads = text_config.num_attention_heads
        model_type = getattr(config, "model_type", type(config).__name__)
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        # Under transformers' tensor parallelism (tp_plan) every rank computes its share of the heads, so its
        # pools hold that share of every block; all ranks use the same block tables (paper §4.6).
        tp_size = getattr(model, "tp_size", None) or 1
        if num_kv_heads % tp_size:
            raise ValueError(
                f"{model_type!r} has {num_kv_heads} KV heads, which tensor parallelism of degree {tp_size} cannot "
                "split evenly; pick a tp degree that divides the KV heads"
            )
        return cls(
            model_type=model_type,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads // tp_size,
            head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads,
            dtype=_kv_dtype(model),
            devices=_layer_devices(model, num_layers),
            layer_types=list(getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers),
            vocab_size=text_config.vocab_size,
            max_model_len=getattr(text_config, "max_position_embeddings", None),
            tp_size=tp_size,
        )

    def bytes_per_block(self, block_size: int) -> int:
        return KVPool.bytes_per_block(self.num_layers, block_size, self.num_kv_heads, self.head_dim, self.dtype)

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
        return KVPool(
            self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype, self.devices
        )


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
        if p.is_floating_point():
            return p.dtype
    return torch.float32
