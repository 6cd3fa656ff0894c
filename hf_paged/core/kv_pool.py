"""The per-layer K/V tensors of the block pool, each on its layer's device.

Layout (see hf_paged.kernels.reference): ``k_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]``,
``v_cache[layer]: [num_blocks, block_size, num_kv_heads, v_head_dim]``, with the layer's own shape (``LayerKV``);
``slot = block_id * block_size + offset``. One block table serves every layer: block b of a sequence is block b in
every layer's pool.

A layer that shares another layer's K/V (Gemma 3n, Gemma 4: ``kv_layer != layer``) has no tensors of its own: its
``k_cache``/``v_cache`` entries are the owner's tensors (the same objects). A latent layer (``v_in_k``, MLA) keeps V
in the first ``v_head_dim`` columns of K: its ``v_cache`` entry is a view of its ``k_cache``. Growth, copy-on-write
and swapping move each owned tensor once; shared entries and views are re-pointed after a growth.

An FP8 pool (``dtype`` float8_e4m3fn or float8_e5m2, hf_paged.core.kv_dtype) also holds each layer's K and V scales
(``kv_scales``: fp32 tensors of shape [1] or [num_kv_heads] on the layer's device), which every kernel call over the
layer's tensors takes; a sharing layer's entry is its owner's pair. Its blocks move as bytes: copies and swaps need
no scale.
"""

import os
from dataclasses import dataclass

import torch

from hf_paged.core.kv_dtype import is_fp8, unit_scales
from hf_paged.core.transfer import to_device
from hf_paged.kernels import copy_blocks_layers, layer_offsets
from hf_paged.kernels.kv_quant import keys_minor, new_cache


@dataclass(frozen=True)
class LayerKV:
    """The K/V shape of one attention layer and where it keeps them.

    ``kv_layer == layer``: the layer owns its tensors. Otherwise it reads the blocks of layer ``kv_layer`` (an
    owner, with the same shape) and never writes them. ``v_in_k``: V is the first ``v_head_dim`` columns of K (an
    MLA latent): the layer owns only K.
    """

    num_kv_heads: int  # this rank's share under tensor parallelism
    head_dim: int  # width of K
    v_head_dim: int  # width of V (== head_dim except latent (MLA) layers)
    kv_layer: int  # the layer whose blocks this layer reads: itself, or the layer it shares K/V with
    v_in_k: bool = False  # V is the first v_head_dim columns of K's pool: no V tensor of its own

    def owned_elements(self, layer: int) -> int:
        """Elements per token slot that layer ``layer`` (described by this spec) allocates: 0 for a sharing layer."""
        if self.kv_layer != layer:
            return 0
        return self.num_kv_heads * (self.head_dim + (0 if self.v_in_k else self.v_head_dim))


def check_layer_specs(layers: list[LayerKV]) -> None:
    """Raise ``ValueError`` unless every sharing layer names an owner of its own shape.

    Args:
        layers: one spec per attention layer, in layer order.
    """
    if not layers:
        raise ValueError("a KV pool needs at least one attention layer, got none")
    for i, spec in enumerate(layers):
        if min(spec.num_kv_heads, spec.head_dim, spec.v_head_dim) < 1:
            raise ValueError(f"layer {i}'s num_kv_heads, head_dim and v_head_dim must be positive, got {spec}")
        if spec.v_in_k and spec.v_head_dim > spec.head_dim:
            raise ValueError(
                f"layer {i} keeps V in K (v_in_k) but v_head_dim {spec.v_head_dim} exceeds head_dim {spec.head_dim}"
            )
        if not 0 <= spec.kv_layer < len(layers):
            raise ValueError(f"layer {i}'s kv_layer must be in [0, {len(layers) - 1}], got {spec.kv_layer}")
        owner = layers[spec.kv_layer]
        if spec.kv_layer != i and owner.kv_layer != spec.kv_layer:
            raise ValueError(
                f"layer {i} shares the K/V of layer {spec.kv_layer}, which shares those of layer {owner.kv_layer}: "
                "name the owner (a layer whose kv_layer is itself)"
            )
        if spec.kv_layer != i and (spec.num_kv_heads, spec.head_dim, spec.v_head_dim, spec.v_in_k) != (
            owner.num_kv_heads,
            owner.head_dim,
            owner.v_head_dim,
            owner.v_in_k,
        ):
            raise ValueError(f"layer {i} ({spec}) shares the K/V of layer {spec.kv_layer} of another shape ({owner})")


class KVPool:
    """K/V block storage for the attention layers described by ``layers``.

    Invariants: ``k_cache[i] is k_cache[layers[i].kv_layer]`` (and the same for ``v_cache``); a ``v_in_k`` owner's
    ``v_cache`` is a view of its ``k_cache``; every owned tensor has ``num_blocks`` blocks.

    Args:
        layers: one ``LayerKV`` per attention layer (``check_layer_specs`` holds).
        num_blocks: blocks per layer.
        block_size: tokens per block.
        dtype: storage dtype: the model's activation dtype, or an FP8 dtype (hf_paged.core.kv_dtype).
        devices: one device per layer (accelerate's device_map puts layers on different devices); a sharing layer
            must be on its owner's device.
        kv_scales: an FP8 pool's (k_scale, v_scale) per layer, fp32 [1] or [num_kv_heads] on the layer's device
            (a sharing layer's pair is replaced by its owner's); None: 1.0 for every layer of an FP8 pool.

    Raises:
        ValueError: the layers or devices break the rules above; scales for a pool that is not FP8; an FP8 pool
            with a latent (MLA) layer.
    """

    def __init__(
        self,
        layers: list[LayerKV],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        devices: list[torch.device],
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        check_layer_specs(layers)
        if len(devices) != len(layers):
            raise ValueError(f"KVPool needs one device per layer: got {len(devices)} devices for {len(layers)} layers")
        moved = [i for i, s in enumerate(layers) if devices[i] != devices[s.kv_layer]]
        if moved:
            i = moved[0]
            raise ValueError(
                f"layer {i} (on {devices[i]}) shares the K/V of layer {layers[i].kv_layer} (on "
                f"{devices[layers[i].kv_layer]}): place layers that share K/V on one device"
            )
        self.kv_scales = _pool_scales(layers, dtype, devices, kv_scales)
        self.layers = list(layers)
        self.num_layers = len(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.devices = list(devices)
        self.k_cache: list[torch.Tensor] = [None] * self.num_layers
        self.v_cache: list[torch.Tensor] = [None] * self.num_layers
        for i, spec in enumerate(self.layers):
            if spec.kv_layer == i:
                self.k_cache[i] = new_cache(*self._shape(spec, v=False), dtype, devices[i])
                if not spec.v_in_k:  # an FP8 V is keys-minor (new_cache): the attention kernels read it so faster
                    self.v_cache[i] = new_cache(*self._shape(spec, v=True), dtype, devices[i], value=True)
        self._link()
        # copy_blocks' groups of same-layout tensors (_copy_groups_by_layout): built at first use, dropped when grow()
        # replaces the tensors
        self._copy_groups: list[tuple] | None = None

    @property
    def is_fp8(self) -> bool:
        """Whether the pool stores FP8 (its kernel calls take ``kv_scales``)."""
        return self.kv_scales is not None

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        devices: list[torch.device],
    ) -> "KVPool":
        """A pool of ``num_layers`` layers of one shape, each owning its K and V."""
        layers = [LayerKV(num_kv_heads, head_dim, head_dim, i) for i in range(num_layers)]
        return cls(layers, num_blocks, block_size, dtype, devices)

    @property
    def num_kv_heads(self) -> int:
        """The KV head count of a pool whose layers all have one (raises ``ValueError`` for per-layer counts)."""
        return self._uniform("num_kv_heads")

    @property
    def head_dim(self) -> int:
        """The head_dim of a pool whose layers all have one (raises ``ValueError`` for per-layer head dims)."""
        return self._uniform("head_dim")

    def _uniform(self, name: str) -> int:
        values = {getattr(spec, name) for spec in self.layers}
        if len(values) != 1:
            raise ValueError(f"this pool's layers differ in {name} ({sorted(values)}): read pool.layers[i].{name}")
        return values.pop()

    def owns(self, layer: int) -> bool:
        """Whether ``layer`` writes its own K/V (False: it reads the blocks of ``layers[layer].kv_layer``)."""
        return self.layers[layer].kv_layer == layer

    def owned_tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool allocated, once each: owners' K, then owners' V (none for ``v_in_k`` layers)."""
        return self._owned("k") + self._owned("v")

    def _owned(self, which: str) -> list[torch.Tensor]:
        caches = self.k_cache if which == "k" else self.v_cache
        return [
            caches[i]
            for i, spec in enumerate(self.layers)
            if spec.kv_layer == i and not (which == "v" and spec.v_in_k)
        ]

    def _shape(self, spec: LayerKV, v: bool) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, spec.num_kv_heads, spec.v_head_dim if v else spec.head_dim)

    def _link(self) -> None:
        """Point the entries that own nothing at their storage: a v_in_k V at its K, a sharing layer at its owner."""
        for i, spec in enumerate(self.layers):
            if spec.kv_layer == i and spec.v_in_k:
                self.v_cache[i] = self.k_cache[i][..., : spec.v_head_dim]
        for i, spec in enumerate(self.layers):
            if spec.kv_layer != i:
                self.k_cache[i] = self.k_cache[spec.kv_layer]
                self.v_cache[i] = self.v_cache[spec.kv_layer]

    def _unlink(self) -> None:
        """Drop the entries that own nothing, so that only the owners' lists reference each tensor."""
        for i, spec in enumerate(self.layers):
            if spec.kv_layer != i or spec.v_in_k:
                self.v_cache[i] = None
            if spec.kv_layer != i:
                self.k_cache[i] = None

    def grow(self, num_blocks: int) -> None:
        """Enlarge every owned tensor to ``num_blocks`` blocks, keeping the blocks' contents; new blocks are zeros.

        One tensor at a time (new tensor, copy, drop the old one), so the extra memory while growing is one layer's
        old pool, not the whole cache's. Block ids do not change: block tables stay valid.
        """
        if num_blocks <= self.num_blocks:
            raise ValueError(f"`num_blocks` must exceed the current {self.num_blocks} to grow, got {num_blocks}")
        self._copy_groups = None  # first: its references would keep every old tensor alive through the loop below
        self._unlink()  # shared entries and views would keep the old tensors alive too
        old = self.num_blocks
        for caches in (self.k_cache, self.v_cache):
            for layer, cache in enumerate(caches):
                if cache is None:
                    continue
                # zeroed: kernels load whole tiles of a block, so unwritten slots stay finite; in the same layout
                grown = new_cache(num_blocks, *cache.shape[1:], cache.dtype, cache.device, value=keys_minor(cache))
                grown[:old].copy_(cache)
                caches[layer] = grown
                del cache
        self.num_blocks = num_blocks
        self._link()

    @staticmethod
    def layer_bytes_per_block(layers: list[LayerKV], block_size: int, dtype: torch.dtype) -> list[int]:
        """Bytes of K and V that each layer allocates for one block (0 for a layer that shares another's): one byte an
        element for an FP8 ``dtype``, half of bf16's."""
        size = torch.empty((), dtype=dtype).element_size()
        return [block_size * spec.owned_elements(i) * size for i, spec in enumerate(layers)]

    @staticmethod
    def bytes_per_block(layers: list[LayerKV], block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one block across all layers, each owned tensor counted once."""
        return sum(KVPool.layer_bytes_per_block(layers, block_size, dtype))

    @staticmethod
    def free_memory(device: torch.device) -> int:
        """Free bytes on ``device``: CUDA's free memory, or available RAM for the CPU."""
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return free
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 8 << 30

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks src -> dst in every owned tensor (copy-on-write): one launch per layout on a CUDA device."""
        if not pairs:
            return
        src = [p[0] for p in pairs]
        dst = [p[1] for p in pairs]
        if self._copy_groups is None:
            self._copy_groups = self._copy_groups_by_layout()
        for device, firsts, seconds, offsets in self._copy_groups:
            # pinned, non-blocking: the step does not wait for the GPU here
            src_t, dst_t = to_device(src, torch.int64, device), to_device(dst, torch.int64, device)
            copy_blocks_layers(firsts, seconds, src_t, dst_t, offsets)

    def _copy_groups_by_layout(self) -> list[tuple[torch.device, list, list, tuple | None]]:
        """The owned tensors by device and layout (the one-launch copy needs one layout), as (device, first
        tensors, second tensors, their offsets for the one-launch copy on CUDA, else None).

        ``copy_blocks_layers`` copies a pair of tensors a layer; any two tensors of one layout make a pair, so a
        group's tensors are paired up in order and each is copied once (an odd one out is paired with itself, a
        second copy of the same block contents).
        """
        by_layout: dict[tuple, list[torch.Tensor]] = {}
        for t in self.owned_tensors():
            by_layout.setdefault((t.device, tuple(t.shape), t.stride(), t.dtype), []).append(t)
        groups = []
        for (device, *_), tensors in by_layout.items():
            firsts, seconds = tensors[0::2], tensors[1::2]
            if len(seconds) < len(firsts):
                seconds.append(firsts[-1])
            groups.append((device, firsts, seconds, layer_offsets(firsts, seconds)))
        return groups

    def allocate_swap(self, num_slots: int) -> None:
        """CPU blocks for preemption by swapping, one per owned tensor: pinned when the pools are on CUDA (async
        copies)."""
        owned = self.owned_tensors()
        pin = torch.cuda.is_available() and any(t.is_cuda for t in owned)
        # in owned_tensors() order, which grow() keeps
        self._swap_space = [torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in owned]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU slots: pairs of (block id, CPU slot)."""
        self._swap(pairs, to_cpu=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU slots back to device blocks: pairs of (CPU slot, block id)."""
        self._swap(pairs, to_cpu=False)

    def _swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        if not pairs:
            return
        first = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        second = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        for pool, swap in zip(self.owned_tensors(), self._swap_space, strict=True):
            if to_cpu:  # a D2H copy on the current stream: ordered before later kernels reuse the blocks
                swap[second] = pool[first.to(pool.device)].to("cpu")
            else:
                pool[second.to(pool.device)] = swap[first].to(pool.device, non_blocking=True)


def _pool_scales(
    layers: list[LayerKV], dtype: torch.dtype, devices: list[torch.device], kv_scales: list | None
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """An FP8 pool's per-layer (k_scale, v_scale), each sharing layer given its owner's pair; None otherwise."""
    if not is_fp8(dtype):
        if kv_scales is not None:
            raise ValueError(f"`kv_scales` are for an FP8 pool (float8_e4m3fn, float8_e5m2), got dtype {dtype}")
        return None
    latent = [i for i, spec in enumerate(layers) if spec.v_in_k]
    if latent:
        raise ValueError(
            f"an FP8 KV cache does not support latent attention (MLA: layers {latent}); use kv_cache_dtype='auto' "
            "for this model"
        )
    scales = unit_scales(devices) if kv_scales is None else list(kv_scales)
    if len(scales) != len(layers):
        raise ValueError(f"`kv_scales` needs one (k_scale, v_scale) per layer: got {len(scales)} for {len(layers)}")
    for i, (k_scale, v_scale) in enumerate(scales):
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if (
                scale.dtype != torch.float32
                or scale.dim() != 1
                or scale.numel() not in (1, layers[i].num_kv_heads)
                or scale.device != devices[i]
            ):
                raise ValueError(
                    f"layer {i}'s {name} must be an fp32 tensor of shape [1] or [{layers[i].num_kv_heads}] on "
                    f"{devices[i]}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}"
                )
    return [scales[spec.kv_layer] for spec in layers]
