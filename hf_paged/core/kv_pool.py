"""The per-layer K/V tensors of the block pool, each on its layer's device.

Layout (see hf_paged.kernels.reference): ``k_cache[layer], v_cache[layer]: [num_blocks, block_size,
num_kv_heads, head_dim]``; ``slot = block_id * block_size + offset``. One block table serves every layer:
block b of a sequence is block b in every layer's pool.
"""

import os

import torch

from hf_paged.core.transfer import to_device
from hf_paged.kernels import copy_blocks_layers, layer_offsets


class KVPool:
    """K/V block storage for ``num_layers`` layers.

    Args:
        num_layers: attention layers that own a pool.
        num_blocks: blocks per layer.
        block_size: tokens per block.
        num_kv_heads: KV heads per layer (this rank's share under tensor parallelism).
        head_dim: size of each head.
        dtype: storage dtype (the model's activation dtype).
        devices: one device per layer (accelerate's device_map puts layers on different devices).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        devices: list[torch.device],
    ):
        if len(devices) != num_layers:
            raise ValueError(f"KVPool needs one device per layer: got {len(devices)} devices for {num_layers} layers")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        # copy_blocks' layer groups (_layer_groups): built at first use, dropped when grow() replaces the tensors
        self._copy_groups: list[tuple] | None = None

    def grow(self, num_blocks: int) -> None:
        """Enlarge every layer's pools to ``num_blocks`` blocks, keeping the blocks' contents; new blocks are zeros.

        One layer at a time (new tensor, copy, drop the old one), so the extra memory while growing is one layer's
        old pools, not the whole cache's. Block ids do not change: block tables stay valid.
        """
        if num_blocks <= self.num_blocks:
            raise ValueError(f"`num_blocks` must exceed the current {self.num_blocks} to grow, got {num_blocks}")
        self._copy_groups = None  # first: its references would keep every old tensor alive through the loop below
        old = self.num_blocks
        for caches in (self.k_cache, self.v_cache):
            for layer, cache in enumerate(caches):
                grown = torch.empty((num_blocks, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
                grown[:old].copy_(cache)
                grown[old:].zero_()  # kernels load whole tiles of a block: keep unwritten slots finite
                caches[layer] = grown
                del cache
        self.num_blocks = num_blocks

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one block across all layers."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

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
        """Copy blocks src -> dst in every layer (copy-on-write): one launch for all the layers of a CUDA device."""
        if not pairs:
            return
        src = [p[0] for p in pairs]
        dst = [p[1] for p in pairs]
        if self._copy_groups is None:
            self._copy_groups = self._layer_groups()
        for device, k_caches, v_caches, offsets in self._copy_groups:
            # pinned, non-blocking: the step does not wait for the GPU here
            src_t, dst_t = to_device(src, torch.int64, device), to_device(dst, torch.int64, device)
            copy_blocks_layers(k_caches, v_caches, src_t, dst_t, offsets)

    def _layer_groups(self) -> list[tuple[torch.device, list[torch.Tensor], list[torch.Tensor], tuple | None]]:
        """The layers' caches by device (accelerate's device_map may spread them): (device, k caches, v caches, their
        offsets for the one-launch copy on CUDA, else None)."""
        by_device: dict[torch.device, tuple[list, list]] = {}
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            ks, vs = by_device.setdefault(k.device, ([], []))
            ks.append(k)
            vs.append(v)
        return [(device, ks, vs, layer_offsets(ks, vs)) for device, (ks, vs) in by_device.items()]

    def allocate_swap(self, num_slots: int) -> None:
        """CPU blocks for preemption by swapping: pinned when the pools are on CUDA (async copies)."""
        shape = (num_slots, self.block_size, self.num_kv_heads, self.head_dim)
        pin = torch.cuda.is_available() and any(k.is_cuda for k in self.k_cache)
        self.k_swap = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]
        self.v_swap = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]

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
        for layer in range(self.num_layers):
            for pool, swap in ((self.k_cache[layer], self.k_swap[layer]), (self.v_cache[layer], self.v_swap[layer])):
                if to_cpu:  # a D2H copy on the current stream: ordered before later kernels reuse the blocks
                    swap[second] = pool[first.to(pool.device)].to("cpu")
                else:
                    pool[second.to(pool.device)] = swap[first].to(pool.device, non_blocking=True)
