"""The KV cache's storage dtype (``kv_cache_dtype``) and the per-layer scales of an FP8 cache.

``kv_cache_dtype`` (``PagedCache``, ``EngineConfig``, ``--kv-cache-dtype``):

- ``"auto"``: the model's dtype (bf16, fp16 or fp32); no scales.
- ``"fp8"`` or ``"fp8_e4m3"``: ``torch.float8_e4m3fn`` (3 mantissa bits, finite range +-448). On CUDA it needs
  compute capability 8.9 or newer (Ada, Hopper, Blackwell): Triton has no e4m3 type before sm_89 (compiling a kernel
  over it fails with "type fp8e4nv not supported in this architecture"), so ``check_fp8_devices`` refuses it on an
  A100 (8.0) or older card at construction, naming ``"fp8_e5m2"``.
- ``"fp8_e5m2"``: ``torch.float8_e5m2`` (2 mantissa bits, range +-57344); Triton converts it on sm_80 too.

An FP8 pool has the layout of any other (hf_paged.kernels.reference) at one byte an element: a block costs half the
bytes of a bf16 one, so the same memory holds twice the tokens. The kernels store ``saturate(x / scale)`` and read
``fp8 * scale`` (one fp32 scale for K and one for V per layer: shape [1], per tensor, or [num_kv_heads], per head,
on the layer's device). Copy-on-write, swapping and prefix caching move the fp8 bytes as they are.

Scales: where the checkpoint carries them, as the attention module's ``k_scale`` / ``v_scale`` (a parameter, a buffer
or a plain tensor attribute; a scalar or one per KV head: what vLLM's FP8 checkpoints and compressed-tensors'
``kv_cache_scheme`` store), those; where the module has none but the checkpoint stores ``<module>.k_scale`` /
``<module>.v_scale`` (hf_paged.core.checkpoint_scales: a loader that dropped them), those; else 1.0. Why 1.0
rather than a scale measured on the first batch, as vLLM's ``calculate_kv_scales`` can: the K/V of the models
hf_paged serves lie well inside e4m3's +-448 (RMS-normed inputs, projections of modest norm), so 1.0 loses no range,
while a scale taken from one batch would fix the precision of every later request to that batch's outliers and make
outputs depend on what ran first. A checkpoint
calibrated for FP8 ships its scales, which then apply.
"""

import torch

from hf_paged.core.checkpoint_scales import checkpoint_kv_scales

# kv_cache_dtype -> storage dtype; "auto" (the model's dtype) is not in the table.
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", *FP8_KV_DTYPES)

# Triton's e4m3 type (float8e4nv) exists from this CUDA compute capability on; e5m2 from sm_80.
E4M3_MIN_CAPABILITY = (8, 9)

__all__ = [
    "E4M3_MIN_CAPABILITY",
    "FP8_KV_DTYPES",
    "KV_CACHE_DTYPES",
    "check_fp8_devices",
    "check_kv_cache_dtype",
    "is_fp8",
    "kv_storage_dtype",
    "read_kv_scales",
]


def check_kv_cache_dtype(kv_cache_dtype: object) -> str:
    """``kv_cache_dtype`` itself when it is one of ``KV_CACHE_DTYPES``.

    Raises:
        ValueError: any other value (a torch dtype included: pass its name).
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"`kv_cache_dtype` must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool stores: the model's for "auto", else the FP8 dtype ``kv_cache_dtype`` names."""
    return FP8_KV_DTYPES.get(check_kv_cache_dtype(kv_cache_dtype), model_dtype)


def check_fp8_devices(kv_cache_dtype: str, devices: list[torch.device]) -> None:
    """Refuse an e4m3 cache (``"fp8"``, ``"fp8_e4m3"``) on a CUDA device older than ``E4M3_MIN_CAPABILITY``.

    Why at construction: the failure would otherwise come from the first kernel compile, mid-request, as Triton's
    "type fp8e4nv not supported in this architecture".

    Raises:
        ValueError: naming the device, its compute capability and the alternative (``"fp8_e5m2"``).
    """
    if FP8_KV_DTYPES.get(kv_cache_dtype) is not torch.float8_e4m3fn:
        return
    for device in dict.fromkeys(d for d in devices if d.type == "cuda"):
        capability = tuple(torch.cuda.get_device_capability(device))
        if capability < E4M3_MIN_CAPABILITY:
            major, minor = capability
            need = ".".join(map(str, E4M3_MIN_CAPABILITY))
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} stores float8 e4m3, which Triton supports on CUDA GPUs of compute "
                f"capability >= {need} (Ada, Hopper or newer); {device} has compute capability {major}.{minor}: use "
                "kv_cache_dtype='fp8_e5m2' (compute capability 8.0 and newer) or 'auto'"
            )


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the FP8 storage dtypes (whose pools carry scales)."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def unit_scales(devices: list[torch.device]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A (k_scale, v_scale) pair of 1.0 per layer: fp32 [1] tensors on the layer's device."""
    return [
        (torch.ones(1, dtype=torch.float32, device=d), torch.ones(1, dtype=torch.float32, device=d)) for d in devices
    ]


def read_kv_scales(
    model: torch.nn.Module, num_kv_heads: list[int], devices: list[torch.device]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each attention layer's (k_scale, v_scale) from the model's attention modules, 1.0 where a module has none.

    A module is layer i's when its ``layer_idx`` is i; its ``k_scale`` / ``v_scale`` (parameter, buffer or tensor
    attribute) are copied, detached, as fp32 on the layer's device: shape [1] for a scalar, [num_kv_heads] for one
    per KV head. A module without them takes the checkpoint's ``<module name>.k_scale`` / ``.v_scale`` where the
    model's config says its checkpoint stores KV scales (``checkpoint_kv_scales``).

    Args:
        model: the model (its checkpoint's scales, if any, are on its attention modules).
        num_kv_heads: the KV heads of each layer's pool (this rank's share under tensor parallelism).
        devices: each layer's device.

    Raises:
        ValueError: a scale that is not one value or one per KV head of its layer, or that is not positive and
            finite; a layer with one of ``k_scale``/``v_scale`` but not the other.
    """
    scales = unit_scales(devices)
    stored = None  # the checkpoint's scales by name, read at the first module that lacks its own
    for module_name, module in model.named_modules():
        layer = module.__dict__.get("layer_idx")
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(devices):
            continue
        found = {name: _tensor_attr(module, name) for name in ("k_scale", "v_scale")}
        if all(v is None for v in found.values()):
            stored = checkpoint_kv_scales(model) if stored is None else stored
            found = {name: stored.get(f"{module_name}.{name}") for name in found}
        if all(v is None for v in found.values()):
            continue
        if any(v is None for v in found.values()):
            has, lacks = ("k_scale", "v_scale") if found["v_scale"] is None else ("v_scale", "k_scale")
            raise ValueError(
                f"layer {layer}'s attention module ({type(module).__name__}) has {has} but no {lacks}: an FP8 KV "
                "cache takes both or neither (neither: scale 1.0)"
            )
        scales[layer] = tuple(
            _checked_scale(found[name], name, layer, num_kv_heads[layer], devices[layer]) for name in found
        )
    return scales


def _tensor_attr(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    value = module._parameters.get(name)
    if value is None:
        value = module._buffers.get(name)
    if value is None:
        value = module.__dict__.get(name)
    return value if isinstance(value, torch.Tensor) else None


def _checked_scale(value: torch.Tensor, name: str, layer: int, num_kv_heads: int, device) -> torch.Tensor:
    """``value`` as an fp32 [1] or [num_kv_heads] tensor on ``device``."""
    scale = value.detach().float().reshape(-1)
    if scale.numel() not in (1, num_kv_heads):
        raise ValueError(
            f"layer {layer}'s {name} has shape {tuple(value.shape)}; an FP8 KV cache takes one scale per tensor "
            f"or one per KV head ({num_kv_heads} in this layer's pool)"
        )
    if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"layer {layer}'s {name} must hold positive finite values, got {scale.tolist()}")
    return scale.to(device).contiguous().clone()
