"""Host time of one eager kernel call from Python (GPU): what an eager decode step pays per layer.

On a small model, an eager decode step (PagedCache under ``model.generate``) is bound by the host: each layer calls
``write_kv`` and ``paged_attention``, and their Python (argument checks, split choice, Triton's launch) runs while
the GPU waits. This script times those calls at decode shapes (Qwen3-0.6B's attention: 16 q / 8 kv heads,
head_dim 128, block_size 16) and the two ways of launching one Triton kernel:

- ``write_kv``, ``paged_attention`` (decode): the public entry points, as the "paged" attention calls them;
- ``kernel[grid](**kwargs)``: Triton's own launch (binds and specializes every argument per call);
- ``Launcher``: hf_paged's direct launch of the cached CompiledKernel (kernels/launch.py).

Each figure is the mean host µs per call over ``--calls`` calls (the GPU is drained before and after; the calls
are queued without waiting, so the host time is the launch path's own). Run: ``python benchmarks/launch_overhead.py``.
"""

import argparse
import time

import torch
from hf_paged.kernels import paged_attention, write_kv
from hf_paged.kernels.cache_ops import _write_kv_kernel
from hf_paged.kernels.launch import Launcher

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16


def host_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/launch_overhead.py needs a CUDA GPU")
        return 2
    batch, context = args.batch, args.context
    blocks = batch * (-(-context // BLOCK_SIZE))
    dev, dtype = "cuda", torch.bfloat16
    k_cache = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    key = torch.randn(batch, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    slots = torch.arange(batch, device=dev)
    query = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dtype)
    tables = torch.randperm(blocks, device=dev).view(batch, -1).int()
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    kwargs = dict(
        key_ptr=key, value_ptr=key, k_cache_ptr=k_cache, v_cache_ptr=v_cache, slot_mapping_ptr=slots,
        stride_key_t=key.stride(0), stride_key_h=key.stride(1), stride_key_d=key.stride(2),
        stride_value_t=key.stride(0), stride_value_h=key.stride(1), stride_value_d=key.stride(2),
        stride_cache_block=k_cache.stride(0), stride_cache_offset=k_cache.stride(1),
        stride_cache_head=k_cache.stride(2), stride_cache_d=k_cache.stride(3),
        HEAD_DIM=HEAD_DIM, ROW_SIZE=KV_HEADS * HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, TILE=KV_HEADS * HEAD_DIM,
    )  # fmt: skip
    positional = tuple(kwargs.values())
    launcher = Launcher(_write_kv_kernel)
    grid = (batch, 1)
    rows = [
        ("write_kv (entry point)", lambda: write_kv(key, key, k_cache, v_cache, slots)),
        (
            f"paged_attention decode {batch}x{context}",
            lambda: paged_attention(query, k_cache, v_cache, tables, lens, cu, 0.088, 1, context),
        ),
        ("write kernel: kernel[grid](**kwargs)", lambda: _write_kv_kernel[grid](**kwargs, num_warps=4)),
        ("write kernel: Launcher (direct)", lambda: launcher(grid, *positional, num_warps=4, num_stages=3)),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| call | host µs per call |\n|---|---:|")
    for name, fn in rows:
        print(f"| {name} | {host_us(fn, args.calls):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
