"""FP8 K/V caches: the number format, the scale arguments and their torch references (no Triton here).

A cache of dtype ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (layout as every cache, kernels/reference.py)
holds each K/V value in 8 bits with a scale: a per-tensor ``[1]`` or per-KV-head ``[num_kv_heads]`` fp32 tensor
``k_scale`` (``v_scale``) on the cache's device, positive and finite (not checked: that would read a device value).

    stored = fp8(saturate(x / scale))      fp32 division; round to nearest even; saturate to the format's finite
                                           max (+-448 for e4m3fn, +-57344 for e5m2); NaN stays NaN
    read   = float(stored) * scale

No scale with an fp8 cache means 1.0. A scale with a bf16/fp16/fp32 cache is an error (there is nothing to scale).
The kernels apply the scales per KV head where it costs least: ``k_scale`` joins the softmax scale of each score,
``v_scale`` multiplies a program's accumulator once after its last key (kernels/split_decode.py,
kernels/prefill_attend.py, kernels/cascade.py). With a bf16 or fp16 query their dots run in fp16: the fp8 K/V convert
to fp16 exactly (one instruction for two values), a bf16 query is clamped to fp16's finite range (+-65504) and
converted to fp16 (exact for values in fp16's normal range), the probabilities are rounded to fp16 for the P.V dot;
an fp32 query keeps fp32 operands. The references dequantize the K/V rows instead and keep the query as it is: the
same attention up to rounding, except that a bf16 query value beyond +-65504 counts as +-65504 in the kernels.
"""

import torch

__all__ = [
    "FP8_DTYPES", "FP8_MAX", "check_kv_scales", "dequantize_ref", "is_fp8", "keys_minor", "new_cache", "quantize_ref",
    "scale_args",
]  # fmt: skip

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The formats' largest finite values: quantization saturates to them.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds quantized K/V."""
    return dtype in FP8_DTYPES


def new_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, value: bool = False
) -> torch.Tensor:
    """A zeroed cache ``[num_blocks, block_size, num_kv_heads, head_dim]``; an FP8 V cache is stored keys-minor.

    Keys-minor: each block's V is laid out ``[num_kv_heads, head_dim, block_size]`` (the returned tensor is that
    storage viewed in the common shape, with stride 1 on the block's keys). The P.V dot reduces over keys, and its
    fp16 operand needs pairs of consecutive keys of one channel: from keys-minor 8-bit values the decode kernel loads
    them as words, where a [keys, head_dim] tile takes a byte load each (there is no transposing shared-memory load of
    8-bit values before sm_100). Every kernel takes any strides, and each block stays contiguous for the copies.
    """
    if value and is_fp8(dtype):
        storage = torch.zeros((num_blocks, num_kv_heads, head_dim, block_size), dtype=dtype, device=device)
        return storage.permute(0, 3, 1, 2)
    return torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)


def keys_minor(cache: torch.Tensor) -> bool:
    """Whether a cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` has its keys contiguous (``new_cache``)."""
    return cache.shape[1] > 1 and cache.stride(1) == 1


def check_kv_scales(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale: torch.Tensor | None,  # [1] or [num_kv_heads], fp32
    v_scale: torch.Tensor | None,  # [1] or [num_kv_heads], fp32
) -> None:
    """Raise ValueError naming the argument when a scale does not fit the cache.

    Raises:
        ValueError: a scale with a cache that is not fp8; a scale that is not a 1-D float32 tensor of 1 or
            ``num_kv_heads`` elements (contiguous) on the cache's device.
    """
    num_kv_heads = k_cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if not is_fp8(k_cache.dtype):
            raise ValueError(
                f"{name} is for fp8 caches ({', '.join(map(str, FP8_DTYPES))}); the cache is {k_cache.dtype}, which "
                f"holds K/V unscaled: pass {name}=None"
            )
        if (
            scale.dtype != torch.float32
            or scale.dim() != 1
            or scale.shape[0] not in (1, num_kv_heads)
            or (scale.shape[0] > 1 and scale.stride(0) != 1)
            or scale.device != k_cache.device
        ):
            raise ValueError(
                f"{name} must be a contiguous float32 tensor of shape [1] (per tensor) or "
                f"[num_kv_heads={num_kv_heads}] (per head) on {k_cache.device}, got {scale.dtype} of shape "
                f"{tuple(scale.shape)} with strides {scale.stride()} on {scale.device}"
            )


def quantize_ref(
    x: torch.Tensor,  # [..., num_kv_heads, head_dim], any float dtype
    scale: torch.Tensor | None,  # [1] or [num_kv_heads], fp32; None = 1.0
    dtype: torch.dtype,  # an FP8_DTYPES member
) -> torch.Tensor:
    """``x`` as the fp8 cache stores it: ``saturate(x / scale)`` rounded to ``dtype`` (see the module docstring)."""
    x = x.float()
    if scale is not None:
        x = x / scale.to(x.device).view(-1, 1)
    limit = FP8_MAX[dtype]
    return x.clamp(-limit, limit).to(dtype)  # clamp keeps NaN; the cast rounds to nearest even


def dequantize_ref(
    x: torch.Tensor,  # [..., num_kv_heads, head_dim], fp8
    scale: torch.Tensor | None,  # [1] or [num_kv_heads], fp32; None = 1.0
) -> torch.Tensor:
    """The fp32 values an fp8 cache's rows stand for: ``float(x) * scale``."""
    x = x.float()
    return x if scale is None else x * scale.to(x.device).view(-1, 1)


def scale_args(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale: torch.Tensor | None,  # [1] or [num_kv_heads], fp32 (checked: check_kv_scales)
    v_scale: torch.Tensor | None,
    placeholder: torch.Tensor,  # any tensor on the cache's device: the pointer a kernel without KV_FP8 never reads
) -> tuple[bool, torch.Tensor, torch.Tensor, int, int]:
    """A kernel's scale arguments: (KV_FP8, k_scale, v_scale, stride of k_scale, stride of v_scale).

    The stride is 0 for a per-tensor scale (every KV head reads element 0), 1 per head. An fp8 cache given no scale
    reads a fresh ``[1]`` tensor of 1.0 (made per call, never kept: see the partial buffers in kernels/decode.py;
    callers that care about the extra fill launch pass their scales)."""
    if not is_fp8(k_cache.dtype):
        return False, placeholder, placeholder, 0, 0
    if k_scale is None or v_scale is None:
        ones = torch.ones(1, dtype=torch.float32, device=k_cache.device)
        k_scale = ones if k_scale is None else k_scale
        v_scale = ones if v_scale is None else v_scale
    return True, k_scale, v_scale, int(k_scale.shape[0] > 1), int(v_scale.shape[0] > 1)
