"""Greedy sampling's argmax on the GPU: torch.argmax against kernels/argmax_rows.py, in a CUDA graph (issue 13).

Prediction: ATen's reduction takes ~36 µs for 1-8 rows of a 128K vocabulary and ~53 µs for 224 rows of 152K on an
H100 (the engine's step profiles, RESULTS.md); spreading each row over 4096-logit programs should take a row to
~5-6 µs (two launches) and 224 rows to ~25-30 µs (68 MB at ~2.5 TB/s): ~30 µs off every greedy decode step.

Each row of the table: rows x vocab of bf16 logits (L2-cold: a fresh buffer for each of several copies), µs a call
(median of graph replays) for both, and whether the indices are equal.

Runs only on CUDA: ``python benchmarks/argmax_bench.py [--rows 1 8 32 224 256] [--vocab 128256 151936]``.
"""

import argparse
import sys

import torch


def graph_us(fn, copies: int) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=200) * 1e3 / copies


def row(rows: int, vocab: int, l2: int) -> str:
    """One table row: ``rows`` x ``vocab`` bf16 logits over enough copies to leave L2 cold."""
    from hf_paged.kernels.argmax_rows import argmax_rows_triton

    copies = min(64, max(2, -(-4 * l2 // (rows * vocab * 2))))
    xs = [torch.randn(rows, vocab, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    equal = all(torch.equal(argmax_rows_triton(x), x.argmax(dim=-1)) for x in xs[:4])
    ref = graph_us(lambda i: xs[i].argmax(dim=-1), copies)
    new = graph_us(lambda i: argmax_rows_triton(xs[i]), copies)
    return f"| {rows} | {vocab} | {ref:.1f} | {new:.1f} | {ref / new:.2f} | {equal} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 224, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[128256, 151936])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("argmax_bench.py needs CUDA", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: µs a call in a CUDA graph, bf16, L2-cold")
    print("| rows | vocab | torch.argmax | argmax_rows_triton | torch / triton | equal |")
    print("|---:|---:|---:|---:|---:|---|")
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    for vocab in args.vocab:
        for rows in args.rows:
            print(row(rows, vocab, l2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
