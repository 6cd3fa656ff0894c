"""Sweep the paged prefill kernel's tiles on this card, in a CUDA graph, beside causal SDPA on contiguous K/V.

The default tiles (kernels/prefill.py ``default_tiles``: 128 x 32 over 4 warps, 4 stages, key-major K loads when K/V
come through the block table; 128 x 64 over 8 warps, 3 stages for fresh prompts' contiguous K/V) are the fastest of
this sweep on an H200. This times each setting of a grid, passed to the launcher as ``tiles``, at the shapes the
engine prefills: fresh prompts (4 x 1024, and 32 x 128 as in the short workload) of the Qwen3-0.6B (16 q / 8 kv heads)
and Llama-3.1-8B (32 / 8) shapes, K/V read through the block table or from the new-token tensors.

    python benchmarks/tools/prefill_sweep.py [--out FILE]

Prints µs per call (median of graph replays), TFLOP/s, and SDPA's µs on the same shape. Runs only on CUDA.
"""

import argparse
import sys

import torch
import triton.testing

HEAD_DIM, BLOCK_SIZE, DTYPE = 128, 16, torch.bfloat16
SHAPES = ((16, 8, 4, 1024), (32, 8, 4, 1024), (32, 8, 32, 128))  # q heads, kv heads, prompts, tokens each
# (BLOCK_M, BLOCK_N, num_warps, num_stages, k_row_major); None = the defaults.
SETTINGS = [None, (128, 32, 8, 3, False), (128, 32, 8, 4, False), (128, 32, 8, 3, True), (128, 64, 8, 3, False),
            (128, 32, 4, 4, True), (64, 32, 4, 3, False), (64, 64, 4, 3, False)]  # fmt: skip


def make_inputs(hq, hkv, prompts, length, generator):
    blocks_per_seq = -(-length // BLOCK_SIZE)
    num_blocks = prompts * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda", generator=generator).view(prompts, blocks_per_seq).int()
    query = torch.randn(prompts * length, hq, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    seq_lens = torch.full((prompts,), length, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, (prompts + 1) * length, length, dtype=torch.int32, device="cuda")
    key = k_cache[tables.long()].flatten(1, 2)[:, :length].flatten(0, 1).contiguous()  # [tokens, hkv, D]
    value = v_cache[tables.long()].flatten(1, 2)[:, :length].flatten(0, 1).contiguous()
    return query, k_cache, v_cache, tables, seq_lens, cu, key, value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_sweep.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    from hf_paged.kernels import prefill

    from hf_paged.frontends.bench import emit_table

    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = {shape: make_inputs(*shape, generator) for shape in SHAPES}
    columns = [(shape, contig) for shape in SHAPES for contig in (False, True)]
    rows = []
    for setting in SETTINGS:
        cells = []
        for shape, contig in columns:
            hq, hkv, prompts, length = shape
            query, k_cache, v_cache, tables, seq_lens, cu, key, value = inputs[shape]
            out = torch.empty_like(query)
            kv = dict(key=key, value=value) if contig else {}

            def run(query=query, k_cache=k_cache, v_cache=v_cache, tables=tables, seq_lens=seq_lens, cu=cu,
                    out=out, kv=kv, length=length, setting=setting):  # fmt: skip
                prefill.paged_prefill_triton(query, k_cache, v_cache, tables, seq_lens, cu, HEAD_DIM**-0.5,
                                             max_query_len=length, max_seq_len=length, out=out, tiles=setting,
                                             **kv)  # fmt: skip

            try:
                us = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median") * 1e3
                flops = 4 * prompts * hq * HEAD_DIM * length * (length + 1) / 2
                cells.append(f"{us:.1f} ({flops / (us * 1e-6) / 1e12:.0f})")
            except Exception as exc:  # e.g. out of resources
                cells.append(f"failed: {type(exc).__name__}")
        label = "defaults" if setting is None else " / ".join(map(str, setting))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cells = []
    for (hq, hkv, prompts, length), _ in columns[::2]:
        q = torch.randn(prompts, hq, length, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
        k = torch.randn(prompts, hkv, length, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
        us = triton.testing.do_bench_cudagraph(lambda q=q, k=k: sdpa(q, k, k, is_causal=True, enable_gqa=True),
                                               rep=100, return_mode="median") * 1e3  # fmt: skip
        cells += [f"{us:.1f}", ""]
    rows.append("| SDPA (flash), contiguous K/V | " + " | ".join(cells) + " |")
    header = (
        f"### Prefill tiles, {torch.cuda.get_device_name()}, bf16, head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}, in "
        "a CUDA graph: µs (TFLOP/s)\n\n| BLOCK_M / BLOCK_N / warps / stages / K row-major | "
        + " | ".join(
            f"{hq}/{hkv} heads, {p} x {n}, {'fresh K/V' if c else 'through the table'}"
            for (hq, hkv, p, n), c in columns
        )  # fmt: skip
        + " |\n|---|"
        + "---:|" * len(columns)
    )
    emit_table("\n" + header + "\n" + "\n".join(rows) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
