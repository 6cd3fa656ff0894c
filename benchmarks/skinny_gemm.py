"""The decode steps' linear layers at few rows: cuBLAS (``F.linear``) against kernels/skinny.py (issue 13).

A small model's decode step spends about half its kernel time in four GEMMs a layer that read the layer's weights at
~1.0-1.2 TB/s at <= 64 rows (benchmarks/RESULTS.md, tenth and fourteenth sessions). This times each fused projection
of Qwen3-0.6B and Llama-3.1-8B (q/k/v, o, gate/up, down) at 1 to 256 rows (beyond 64 in row tiles of 64: the prefix
workload's and nano's big decode steps), bf16, in a CUDA graph as the engine runs them, with the weights L2-cold:
each timed graph runs the GEMM over enough distinct weight copies to exceed four times the L2 (a step's layers are
distinct weights too). Per GEMM: µs and the bandwidth its bytes (weight, input, output) take, for ``F.linear`` and
for ``skinny_linear_triton`` at each of a few launch settings (``block_n`` / ``block_k`` / ``split_k``, None = the
heuristic), with the largest difference from ``F.linear``.

Prediction: the weight slabs streamed by ~2 programs an SM reach 2-2.5 TB/s on an H100, so the Qwen3-0.6B layer's
four GEMMs at 32 rows go from ~26 µs to ~15 µs (~0.3 ms of a ~1.6 ms prefix-workload decode step). If no setting
beats ``F.linear`` at a shape, the kernel stays unused there. Measured (H200, benchmarks/RESULTS.md, nineteenth
session): wrong, cuBLAS already reads 1.6-3.2 TB/s and each GEMM of a few MB costs ~5-8 µs whoever runs it; the
kernel wins only at Qwen3-0.6B's down_proj at <= 64 rows and one row of o_proj.

Runs only on CUDA: ``python benchmarks/skinny_gemm.py [--shapes qwen3-0.6b llama-8b] [--rows 1 8 32 64 128 256]``.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
import triton.testing

SHAPES = {  # (projection, in_features, out_features), fused as the engine fuses them
    "qwen3-0.6b": [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024)],
    "llama-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
}
DEVICE = "cuda"  # tests/test_skinny.py runs bench_rows on the CPU (interpreted kernel, graph_us replaced)
# (block_n, block_k, split_k): one launch with thin slabs, then split-K (None: the kernel's heuristic)
SETTINGS = [(16, 128, 1), (16, 256, 1), (32, 128, 1), (16, 128, None), (32, 128, None), (64, 128, None),
            (32, 256, None)]  # fmt: skip


def graph_us(fn, copies: int) -> float:
    """µs a call of ``fn(i)`` for i over ``copies`` weight copies, replayed from one CUDA graph (median)."""
    return triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=200) * 1e3 / copies


def bench(shape: str, rows: list[int]) -> list[str]:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    lines = []
    for name, k, n in SHAPES[shape]:
        copies = max(2, -(-4 * l2 // (n * k * 2)))
        weights = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in rows:
            lines.append(bench_rows(f"| {shape} | {name} {k}->{n} | {m} |", weights, m))
            print(lines[-1], flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    return lines


def bench_rows(prefix: str, weights: list[torch.Tensor], m: int) -> str:
    """One table row: ``m`` rows times each of ``weights`` (copies of one [N, K] projection)."""
    from hf_paged.kernels.skinny import skinny_linear_triton

    n, k = weights[0].shape
    x = torch.randn(m, k, device=weights[0].device, dtype=weights[0].dtype)
    moved = (n * k + m * k + m * n) * 2
    ref_us = graph_us(lambda i: F.linear(x, weights[i]), len(weights))
    expected = F.linear(x, weights[0]).float()
    cells = []
    for block_n, block_k, split_k in SETTINGS:

        def call(i, block_n=block_n, block_k=block_k, split_k=split_k):
            return skinny_linear_triton(x, weights[i], block_n=block_n, block_k=block_k, split_k=split_k)

        diff = (call(0).float() - expected).abs().max().item()
        us = graph_us(call, len(weights))
        cells.append((us, f"{us:.1f} ({moved / us / 1e6:.2f}, {diff:.0e})"))
    best = min(us for us, _ in cells)
    return (f"{prefix} {ref_us:.1f} ({moved / ref_us / 1e6:.2f}) | " + " | ".join(text for _, text in cells)
            + f" | {ref_us / best:.2f}x |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/skinny_gemm.py needs a CUDA device; none found, nothing measured.", file=sys.stderr)
        return 0
    settings = " | ".join(f"skinny {bn}/{bk}/{sk}" for bn, bk, sk in SETTINGS)
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    print(f"{torch.cuda.get_device_name(0)}, {versions}: µs a GEMM in a CUDA graph, L2-cold (TB/s of its bytes, max "
          "abs diff from F.linear); skinny block_n/block_k/split_k")  # fmt: skip
    print(f"| shape | projection | rows | F.linear (cuBLAS) | {settings} | F.linear / best skinny |")
    print("|---|---|---:|---:|" + "---:|" * len(SETTINGS) + "---:|")
    for shape in args.shapes:
        bench(shape, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
