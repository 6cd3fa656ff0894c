"""Triton kernels that write and copy paged KV-cache rows: ``write_kv`` and ``copy_blocks``.

The cache layout and the slot formula are in kernels/reference.py:
``[num_blocks, block_size, num_kv_heads, head_dim]``, ``slot = block_id * block_size + offset``,
``slot < 0`` = padding (skipped). Element offsets into a pool reach ``num_blocks * block_size *
num_kv_heads * head_dim``, which exceeds 2^31 for large pools, so every slot and block id is
widened to int64 before it is multiplied by a stride. FP8 caches (kernels/kv_quant.py): ``write_kv`` quantizes each
row with its KV head's scale; the copies move fp8 blocks as bytes.
"""

import torch
import triton
import triton.language as tl

from .kv_quant import FP8_DTYPES, check_kv_scales, scale_args
from .kv_quant_triton import to_fp8
from .launch import Launcher, SignatureCache, cdiv, next_power_of_2

__all__ = ["write_kv_triton", "copy_blocks_triton", "copy_blocks_layers_triton", "layer_offsets", "WRITE_KV_LAUNCHES"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = _FLOAT_DTYPES + FP8_DTYPES
# Elements one program moves. A K/V row (num_kv_heads * head_dim) or a block longer than this is
# split over a second grid axis.
_MAX_TILE = 4096


@triton.jit
def _write_kv_kernel(
    # pointers
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; any strides (an FP8 pool's is keys-minor)
    slot_mapping_ptr,  # [num_tokens], int32/int64
    k_scale_ptr,  # [1] or [num_kv_heads], fp32: KV_FP8
    v_scale_ptr,  # [1] or [num_kv_heads], fp32: KV_FP8
    # strides
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_value_t,
    stride_value_h,
    stride_value_d,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_cache_d,
    stride_vcache_block,
    stride_vcache_offset,
    stride_vcache_head,
    stride_vcache_d,
    stride_ks,  # 0: one scale for every KV head; 1: a scale per KV head
    stride_vs,
    # sizes
    HEAD_DIM: tl.constexpr,
    ROW_SIZE: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    # meta-parameters
    TILE: tl.constexpr,  # power of two; elements of the row this program copies
    KV_FP8: tl.constexpr,  # the caches are fp8: store saturate(x / scale) rounded (kernels/kv_quant.py)
):
    token_idx = tl.program_id(0)
    tile_idx = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    elem = tile_idx * TILE + tl.arange(0, TILE)  # [TILE], index into the flattened [num_kv_heads, head_dim] row
    mask = elem < ROW_SIZE  # the row need not be a power of two
    head_idx = elem // HEAD_DIM
    dim_idx = elem % HEAD_DIM

    token_idx64 = token_idx.to(tl.int64)
    key_offs = token_idx64 * stride_key_t + head_idx * stride_key_h + dim_idx * stride_key_d
    value_offs = token_idx64 * stride_value_t + head_idx * stride_value_h + dim_idx * stride_value_d
    cache_offs = (
        block_id * stride_cache_block
        + block_offset * stride_cache_offset
        + head_idx * stride_cache_head
        + dim_idx * stride_cache_d
    )
    v_cache_offs = (
        block_id * stride_vcache_block
        + block_offset * stride_vcache_offset
        + head_idx * stride_vcache_head
        + dim_idx * stride_vcache_d
    )
    k = tl.load(key_ptr + key_offs, mask=mask, other=0.0)  # [TILE]
    v = tl.load(value_ptr + value_offs, mask=mask, other=0.0)  # [TILE]
    if KV_FP8:
        # k_scale, v_scale: [TILE], each element's KV head's; div_rn: IEEE division, as the reference's
        k_scale = tl.load(k_scale_ptr + head_idx * stride_ks, mask=mask, other=1.0)
        v_scale = tl.load(v_scale_ptr + head_idx * stride_vs, mask=mask, other=1.0)
        k = to_fp8(tl.math.div_rn(k.to(tl.float32), k_scale), k_cache_ptr.dtype.element_ty)
        v = to_fp8(tl.math.div_rn(v.to(tl.float32), v_scale), v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# Positional launches (kernels/launch.py): arguments in the kernel's parameter order.
WRITE_KV = Launcher(_write_kv_kernel)


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype not in _CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache dtype must be one of {list(_CACHE_DTYPES)} and equal, "
            f"got {k_cache.dtype} / {v_cache.dtype}"
        )
    if v_cache.device != k_cache.device:
        raise ValueError(f"k_cache and v_cache must be on one device, got {k_cache.device} and {v_cache.device}")


def write_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], int32/int64; -1 = padding, skipped
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> None:
    """Store each token's K/V row at its cache slot, in place, in one launch.

    key/value may be any strided views (e.g. a transpose of ``[batch, heads, q_len, head_dim]``
    flattened to tokens); rows are cast to the cache dtype, or, for an fp8 cache, quantized:
    ``saturate(x / scale)`` rounded to nearest even (kernels/kv_quant.py). No host sync: safe in a CUDA graph.

    Args:
        key: [num_tokens, num_kv_heads, head_dim], float16/bfloat16/float32.
        value: [num_tokens, num_kv_heads, head_dim], same dtype as key.
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place.
        v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place.
        slot_mapping: [num_tokens], int32/int64. ``slot = block_id * block_size + offset``;
            slots < 0 are skipped. Slots must be distinct and < num_blocks * block_size
            (not checked: that would need a device sync).
        k_scale, v_scale: fp8 caches only: [1] (per tensor) or [num_kv_heads] (per head) float32 on the cache's
            device, positive; None = 1.0.

    Raises:
        ValueError: on a shape, dtype or device mismatch, or a scale with a cache that is not fp8.
    """
    # The checks (_write_kv_launch) read nothing but this signature, so one that passed them once passes them again:
    # they and the launch's non-tensor arguments are computed once per signature (eager decode calls this once per
    # layer per step with the same one). A new shape, stride, dtype or device misses and is checked in full.
    signature = (
        key.shape, key.stride(), key.dtype, key.device,
        value.shape, value.stride(), value.dtype, value.device,
        k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
        v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
        slot_mapping.shape, slot_mapping.dtype, slot_mapping.device,
        None if k_scale is None else (k_scale.shape, k_scale.stride(), k_scale.dtype, k_scale.device),
        None if v_scale is None else (v_scale.shape, v_scale.stride(), v_scale.dtype, v_scale.device),
    )  # fmt: skip
    launch = WRITE_KV_LAUNCHES.get(signature)
    if launch is None:
        launch = _write_kv_launch(key, value, k_cache, v_cache, slot_mapping)  # raises on a bad signature
        check_kv_scales(k_cache, k_scale, v_scale)
        WRITE_KV_LAUNCHES.put(signature, launch)
    if not launch:  # no tokens
        return
    grid, sizes, num_warps = launch
    kv_fp8, k_scale, v_scale, stride_ks, stride_vs = scale_args(k_cache, k_scale, v_scale, slot_mapping)
    WRITE_KV(
        grid, key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, *sizes[:-4], stride_ks, stride_vs,
        *sizes[-4:], kv_fp8, num_warps=num_warps, num_stages=3,
    )  # fmt: skip


# write_kv_triton's checked signatures -> (grid, strides and sizes of the launch, num_warps), or () for no tokens.
WRITE_KV_LAUNCHES = SignatureCache(max_size=256)


def _write_kv_launch(key, value, k_cache, v_cache, slot_mapping) -> tuple:
    """Check write_kv_triton's arguments; return its launch's grid, non-tensor arguments and num_warps."""
    _check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.dim() != 3 or tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"key must be [num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}], got shape {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if key.dtype not in _FLOAT_DTYPES or value.dtype != key.dtype:
        raise ValueError(
            f"key/value dtype must be one of {list(_FLOAT_DTYPES)} and equal, got {key.dtype} / {value.dtype}"
        )
    num_tokens = key.shape[0]
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must be [num_tokens={num_tokens}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping dtype must be torch.int32 or torch.int64, got {slot_mapping.dtype}")
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}, but the cache is on {k_cache.device}")
    if num_tokens == 0:
        return ()

    row_size = num_kv_heads * head_dim
    tile = min(next_power_of_2(row_size), _MAX_TILE)
    strides = (*key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride())
    sizes = (*strides, head_dim, row_size, block_size, tile)
    return (num_tokens, cdiv(row_size, tile)), sizes, (4 if tile >= 1024 else 1 if tile <= 128 else 2)


@triton.jit
def _copy_block_tile(
    k_base,  # a layer's k_cache: [num_blocks, block_size, num_kv_heads, head_dim]; each block contiguous
    v_base,  # the layer's v_cache, same layout
    src_ptr,  # [num_pairs], int32/int64
    dst_ptr,  # [num_pairs], int32/int64
    pair_idx,
    tile_idx,
    stride_cache_block,
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_dim
    TILE: tl.constexpr,  # power of two; elements of the block this program copies
):
    """One tile of block ``src[pair_idx]`` -> ``dst[pair_idx]`` in one layer's k and v caches."""
    src_block = tl.load(src_ptr + pair_idx).to(tl.int64)
    dst_block = tl.load(dst_ptr + pair_idx).to(tl.int64)
    elem = tile_idx * TILE + tl.arange(0, TILE)  # [TILE]
    mask = elem < BLOCK_NUMEL  # the last tile of a block may be partial
    src_offs = src_block * stride_cache_block + elem
    dst_offs = dst_block * stride_cache_block + elem
    k = tl.load(k_base + src_offs, mask=mask, other=0.0)  # [TILE]
    tl.store(k_base + dst_offs, k, mask=mask)
    v = tl.load(v_base + src_offs, mask=mask, other=0.0)  # [TILE]
    tl.store(v_base + dst_offs, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(
    # pointers
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; each block contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; each block contiguous
    src_ptr,  # [num_pairs], int32/int64
    dst_ptr,  # [num_pairs], int32/int64
    # strides
    stride_cache_block,
    # sizes
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_dim
    # meta-parameters
    TILE: tl.constexpr,  # power of two; elements of the block this program copies
):
    _copy_block_tile(k_cache_ptr, v_cache_ptr, src_ptr, dst_ptr, tl.program_id(0), tl.program_id(1),
                     stride_cache_block, BLOCK_NUMEL, TILE)  # fmt: skip


COPY_BLOCKS = Launcher(_copy_blocks_kernel)


def copy_blocks_triton(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [num_pairs], int
    dst: torch.Tensor,  # [num_pairs], int
) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` in both caches, in one launch (copy-on-write).

    The grid is pairs x tiles of a block's ``block_size * num_kv_heads * head_dim`` elements.
    The dst blocks must be distinct and disjoint from the src blocks (the pool guarantees it for
    copy-on-write; not checked, as that would need a device sync).

    Args:
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim], each block contiguous.
        v_cache: [num_blocks, block_size, num_kv_heads, head_dim], k_cache's shape and block stride, each block
            contiguous (in any order: an FP8 pool's V is keys-minor).
        src: [num_pairs], int32/int64 block ids; moved to the cache device if needed.
        dst: [num_pairs], int32/int64 block ids.

    Raises:
        ValueError: on a shape, dtype or layout mismatch.
    """
    _check_cache_pair(k_cache, v_cache)
    block_numel = _check_copy(k_cache, src, dst)
    _check_copy(v_cache, src, dst)
    if v_cache.stride(0) != k_cache.stride(0):
        raise ValueError(f"v_cache's block stride {v_cache.stride(0)} must equal k_cache's {k_cache.stride(0)}")
    if src.numel() == 0:
        return
    src = src.to(k_cache.device, non_blocking=True)
    dst = dst.to(k_cache.device, non_blocking=True)
    k_cache, v_cache = _as_bytes(k_cache), _as_bytes(v_cache)

    tile = min(next_power_of_2(block_numel), _MAX_TILE)
    grid = (src.numel(), cdiv(block_numel, tile))
    COPY_BLOCKS(grid, k_cache, v_cache, src, dst, k_cache.stride(0), block_numel, tile, num_warps=4, num_stages=3)


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as uint8 (the same memory): a copy moves its bytes unchanged, NaN encodings included, with no
    fp8 conversion in the kernel (e4m3fn conversions need sm_89+). Other caches as they are."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def _check_dense_blocks(cache: torch.Tensor) -> None:
    """A block's elements must fill one dense range, in any order (an FP8 pool's V is keys-minor): the copies move
    the range."""
    num_kv_heads, head_dim = cache.shape[2:]
    dense = 1
    for stride, size in sorted(zip(cache.stride()[1:], cache.shape[1:], strict=True)):
        if size > 1 and stride != dense:
            raise ValueError(
                f"each cache block must be contiguous (its elements one dense range, as in strides [..., "
                f"{num_kv_heads * head_dim}, {head_dim}, 1]), got strides {cache.stride()}"
            )
        dense *= size


def _check_copy(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> int:
    """The copy wrappers' checks of the block ids and the cache layout; returns a block's element count."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    if src.dim() != 1 or dst.shape != src.shape:
        raise ValueError(
            f"src and dst must be 1-D of equal length, got shapes {tuple(src.shape)} and {tuple(dst.shape)}"
        )
    for name, t in (("src", src), ("dst", dst)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} dtype must be torch.int32 or torch.int64, got {t.dtype}")
    _check_dense_blocks(cache)
    return block_size * num_kv_heads * head_dim


@triton.jit
def _copy_blocks_layers_kernel(
    # pointers
    k_layers_ptr,  # [num_layers], int64: where each layer's k_cache starts, in elements from cache_ptr
    v_layers_ptr,  # [num_layers], int64: the same for each layer's v_cache
    cache_ptr,  # the base of those offsets (a layer's k_cache; every layer has its element type)
    src_ptr,  # [num_pairs], int32/int64
    dst_ptr,  # [num_pairs], int32/int64
    # strides
    stride_cache_block,
    # sizes
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_dim
    # meta-parameters
    TILE: tl.constexpr,  # power of two; elements of the block this program copies
):
    layer = tl.program_id(2)
    # Each layer's caches as element offsets from cache_ptr, multiples of 16 (layer_offsets checks it): the
    # compiler then vectorises the block's loads and stores. (A pointer cast from an integer address is taken as
    # unaligned, whatever multiple_of says: the copy would run 2 bytes at a time, slower than a launch a layer.)
    k_base = cache_ptr + tl.multiple_of(tl.load(k_layers_ptr + layer), 16)
    v_base = cache_ptr + tl.multiple_of(tl.load(v_layers_ptr + layer), 16)
    _copy_block_tile(k_base, v_base, src_ptr, dst_ptr, tl.program_id(0), tl.program_id(1), stride_cache_block,
                     BLOCK_NUMEL, TILE)  # fmt: skip


COPY_BLOCKS_LAYERS = Launcher(_copy_blocks_layers_kernel)


def layer_offsets(
    k_caches: list[torch.Tensor],  # num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor],  # like k_caches
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables ``copy_blocks_layers_triton`` reads, with ``k_caches[0]`` as the base: ([num_layers] int64, where
    each layer's k cache starts in elements from ``k_caches[0]``; the same for the v caches), on the caches' device.
    Valid while those tensors live and are not replaced (a grown pool needs new tables).

    Raises:
        ValueError: no layers; layers that differ in shape, strides, dtype or device from the first; a cache that
            does not start 64-byte aligned (the caching allocator's blocks are 512-byte aligned).
    """
    if not k_caches or len(k_caches) != len(v_caches):
        raise ValueError(
            f"need one v cache per k cache and at least one layer, got {len(k_caches)} k and {len(v_caches)} v caches"
        )
    first = k_caches[0]
    for layer, (k_cache, v_cache) in enumerate(zip(k_caches, v_caches, strict=True)):
        _check_cache_pair(k_cache, v_cache)
        _check_dense_blocks(v_cache)
        if v_cache.stride(0) != first.stride(0):
            raise ValueError(
                f"layer {layer}'s v cache block stride {v_cache.stride(0)} differs from layer 0's {first.stride(0)}"
            )
        if (k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device) != (
            first.shape,
            first.stride(),
            first.dtype,
            first.device,
        ):
            raise ValueError(
                f"layer {layer}'s cache (shape {tuple(k_cache.shape)}, strides {k_cache.stride()}, {k_cache.dtype}, "
                f"{k_cache.device}) differs from layer 0's (shape {tuple(first.shape)}, strides {first.stride()}, "
                f"{first.dtype}, {first.device}); one launch covers only layers of one layout"
            )
    base, size = first.data_ptr(), first.element_size()
    addresses = [[t.data_ptr() for t in caches] for caches in (k_caches, v_caches)]
    misaligned = [a for a in addresses[0] + addresses[1] if a % 64]
    if misaligned:  # the kernel tells the compiler each offset is a multiple of 16 elements (of at most 4 bytes)
        raise ValueError(f"every layer's cache must start at a 64-byte aligned address, got {misaligned[0]:#x}")
    k_offsets, v_offsets = (
        torch.tensor([(a - base) // size for a in caches], dtype=torch.int64).to(first.device) for caches in addresses
    )
    return k_offsets, v_offsets


def copy_blocks_layers_triton(
    k_offsets: torch.Tensor,  # [num_layers], int64, from layer_offsets
    v_offsets: torch.Tensor,  # [num_layers], int64
    cache: torch.Tensor,  # their base, k_caches[0]: [num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [num_pairs], int
    dst: torch.Tensor,  # [num_pairs], int
) -> None:
    """``copy_blocks_triton`` in every layer at once: blocks ``src[i] -> dst[i]`` in each layer's k and v caches, one
    launch (grid pairs x tiles x layers) instead of one a layer.

    Args:
        k_offsets, v_offsets: the layers' caches as element offsets from ``cache`` (``layer_offsets``: every
            layer of ``cache``'s shape, strides, dtype and device).
        cache: the first layer's k_cache: the offsets' base, the layout and the element type.
        src, dst: [num_pairs] int32/int64 block ids; dst distinct and disjoint from src (as for copy-on-write).

    Raises:
        ValueError: on a shape, dtype or layout mismatch.
    """
    _check_cache_pair(cache, cache)
    if k_offsets.dim() != 1 or k_offsets.shape != v_offsets.shape or k_offsets.dtype != torch.int64:
        raise ValueError(
            f"k_offsets and v_offsets must be 1-D int64 of equal length, got {tuple(k_offsets.shape)} "
            f"{k_offsets.dtype} and {tuple(v_offsets.shape)} {v_offsets.dtype}"
        )
    block_numel = _check_copy(cache, src, dst)
    if src.numel() == 0 or k_offsets.numel() == 0:
        return
    src = src.to(cache.device, non_blocking=True)
    dst = dst.to(cache.device, non_blocking=True)
    cache = _as_bytes(cache)  # the offsets count elements, and an fp8 element is a byte
    tile = min(next_power_of_2(block_numel), _MAX_TILE)
    grid = (src.numel(), cdiv(block_numel, tile), k_offsets.numel())
    COPY_BLOCKS_LAYERS(
        grid, k_offsets, v_offsets, cache, src, dst, cache.stride(0), block_numel, tile, num_warps=4, num_stages=3
    )
