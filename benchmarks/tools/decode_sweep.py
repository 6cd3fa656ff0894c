"""Sweep the decode kernel's launch settings on this card, in a CUDA graph, L2-cold.

Long splits (more than ``SHORT_SPLIT_KEYS`` keys a split: every decode graph of the engine, captured with
``max_seq_len = max_model_len``) run ``LONG_SETTINGS`` (kernels/decode_plan.py): keys per tile, pipeline stages and
warps. This script times every setting of a small grid at the shapes the engine runs, passed to the launcher as
``tile_settings``, beside SDPA (enable_gqa) on contiguous K/V of the same shape. The split count is the one the
engine's graphs get: ``choose_num_splits(--max-seq-len, batch, ...)`` (default 40 960, Qwen3's
``max_position_embeddings``).

    python benchmarks/tools/decode_sweep.py [--shapes 16x8:256x512 32x8:256x2048 ...] [--max-seq-len N] [--out FILE]
    python benchmarks/tools/decode_sweep.py --prefix-len 336 --shapes 16x8:224x400 ...   # shared-prefix decode
    python benchmarks/tools/decode_sweep.py --shapes 32x8:32x2048 --splits 1 2 3 4 6 8 --settings 64/3/4

With ``--prefix-len P`` every row's first P keys are row 0's blocks and the call is the engine's cascade decode
(the shared-prefix kernel, the split kernel over each row's keys from P on, and with several splits the merge), as
its cascade graphs run it (``max_prefix_len = --max-seq-len``); each setting is then the split kernel's (the tuned
one is ``CASCADE_SUFFIX_SETTINGS``); the bandwidth share counts the prefix's bytes once. A setting is
BLOCK_N/stages/warps.

Shape ``HQxHKV:BATCHxCONTEXT``: query heads x KV heads (head_dim 128, block_size 16, shuffled block tables, bf16).
Prints µs per call (median of the graph replays) and the share of the copy bandwidth the K/V reads reach.
Runs only on CUDA.
"""

import argparse
import itertools
import sys

import torch
import triton
import triton.testing

HEAD_DIM, BLOCK_SIZE, DTYPE = 128, 16, torch.bfloat16
# Qwen3-0.6B's heads (16 q / 8 kv) and Llama-3.1-8B's (32 / 8) at batches and contexts of the engine's decode steps.
DEFAULT_SHAPES = ("16x8:256x512", "16x8:256x1024", "16x8:128x1024", "16x8:64x1024", "16x8:32x1024", "16x8:8x2048",
                  "32x8:256x512", "32x8:128x1024", "32x8:64x1024", "32x8:32x2048")  # fmt: skip
# (BLOCK_N, num_stages, num_warps) around LONG_SETTINGS (64/3/4), with 8-warp settings that spill no registers on
# sm_90 (64/3/4 spills 264 bytes a thread at 255 registers: benchmarks/tools/ptxas_check.py reports such counts).
SETTINGS = [(64, 2, 4), (64, 3, 4), (64, 4, 4), (64, 3, 2), (64, 2, 2), (32, 2, 2), (32, 3, 2), (32, 4, 2),
            (32, 3, 1), (16, 3, 1), (128, 2, 4), (128, 3, 4), (64, 2, 8), (64, 3, 8), (128, 2, 8)]  # fmt: skip


def parse_shape(text: str) -> tuple[int, int, int, int]:
    heads, sizes = text.split(":")
    hq, hkv = (int(x) for x in heads.split("x"))
    batch, context = (int(x) for x in sizes.split("x"))
    return hq, hkv, batch, context


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def copy_gbs(num_bytes: int = 2 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def make_inputs(hq, hkv, batch, context, l2_bytes, generator, prefix_len=0, ragged=False):
    """Rotating sets of (k_cache, v_cache, block_tables) spanning 2x L2, one query; contiguous K/V for SDPA too.
    With ``prefix_len`` (a multiple of BLOCK_SIZE) every row's first blocks are row 0's. ``ragged``: row lengths
    uniform in [context / 8, context] (seeded) instead of all ``context``, and no dense K/V."""
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    if ragged:
        low = max(context // 8, prefix_len + 1)
        seq_lens = torch.randint(low, context + 1, (batch,), device="cuda", generator=generator).to(torch.int32)
    kv_bytes = 2 * (prefix_len + int(seq_lens.sum()) - batch * prefix_len) * hkv * HEAD_DIM * 2
    num_sets = min(triton.cdiv(2 * l2_bytes, kv_bytes), 64) if kv_bytes < 2 * l2_bytes else 1
    blocks_per_seq = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    paged, dense = [], []
    for _ in range(num_sets):
        k = torch.randn((num_blocks, BLOCK_SIZE, hkv, HEAD_DIM), device="cuda", dtype=DTYPE, generator=generator)
        v = torch.randn_like(k)
        perm = torch.randperm(num_blocks, device="cuda", generator=generator)
        tables = perm.view(batch, blocks_per_seq).to(torch.int32)
        tables[:, : prefix_len // BLOCK_SIZE] = tables[0, : prefix_len // BLOCK_SIZE].clone()
        paged.append((k, v, tables))
        if not ragged:  # SDPA pads every row to the context: no like-for-like baseline for ragged rows
            kd = torch.randn(batch, hkv, context, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
            dense.append((kd, torch.randn_like(kd)))
    query = torch.randn(batch, hq, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    return query, seq_lens, paged, dense, kv_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    parser.add_argument("--max-seq-len", type=int, default=40960, help="the bound the split count is chosen by")
    parser.add_argument("--prefix-len", type=int, default=0, help="keys every row shares (cascade decode)")
    parser.add_argument("--settings", nargs="+", help="BLOCK_N/stages/warps triples to time (default: a grid)")
    parser.add_argument(
        "--splits",
        nargs="+",
        type=int,
        help="time each shape at each of these split counts (default: the one the engine picks)",
    )
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="row lengths uniform in [context / 8, context] (SDPA, which pads every row, is left out)",
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.prefix_len % BLOCK_SIZE or args.prefix_len < 0:
        parser.error(f"--prefix-len {args.prefix_len}: must be a non-negative multiple of the block size {BLOCK_SIZE}")
    settings = [tuple(int(x) for x in t.split("/")) for t in args.settings] if args.settings else SETTINGS
    if not torch.cuda.is_available():
        print("decode_sweep.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    from hf_paged.kernels import decode, decode_plan

    from hf_paged.frontends.bench import emit_table

    bandwidth = copy_gbs()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = [parse_shape(s) for s in args.shapes]
    if any(args.prefix_len >= context for *_, context in shapes):
        parser.error(f"--prefix-len {args.prefix_len}: every shape's context must be longer")
    inputs = [make_inputs(*shape, l2_bytes, generator, args.prefix_len, args.ragged) for shape in shapes]
    prefix = None
    if args.prefix_len:
        prefix = torch.tensor([args.prefix_len], dtype=torch.int32, device="cuda")
    # the tuned default (shared-prefix calls take their own settings at head_dim 128)
    current = [decode_plan.CASCADE_SUFFIX_SETTINGS if prefix is not None else decode_plan.LONG_SETTINGS]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    picked = [decode_plan.choose_num_splits(args.max_seq_len, batch, hkv, num_sms) for _, hkv, batch, _ in shapes]
    # (shape index, split count) a column: the engine's pick, or each of --splits
    cases = [(i, n) for i in range(len(shapes)) for n in (args.splits or [picked[i]])]
    rows = []
    for setting in settings:
        cells = []
        for i, n in cases:
            query, seq_lens, paged, _, kv_bytes = inputs[i]
            rotation = itertools.cycle(paged)
            out = torch.empty_like(query)

            def run(rotation=rotation, query=query, seq_lens=seq_lens, out=out, n=n, setting=setting):
                k, v, tables = next(rotation)
                decode.paged_decode_triton(query, k, v, tables, seq_lens, HEAD_DIM**-0.5,
                                           max_seq_len=args.max_seq_len, num_splits=n, out=out, prefix_len=prefix,
                                           max_prefix_len=args.max_seq_len, tile_settings=setting)  # fmt: skip

            try:
                us = graph_us(run)
                cells.append(f"{us:.1f} ({kv_bytes / (us * 1e-6) / 1e9 / bandwidth:.0%})")
            except Exception as exc:  # e.g. out of shared memory for large tiles x stages
                cells.append(f"failed: {type(exc).__name__}")
        mark = " (the default)" if setting in current else ""
        rows.append(f"| {' / '.join(map(str, setting))}{mark} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_cells = []
    for (hq, _, batch, _), (query, _, _, dense, _) in zip(shapes, inputs, strict=True):
        if args.ragged:
            break
        rotation = itertools.cycle(dense)
        q = query.view(batch, hq, 1, HEAD_DIM)

        def run_sdpa(rotation=rotation, q=q):
            k, v = next(rotation)
            sdpa(q, k, v, enable_gqa=True)

        us = graph_us(run_sdpa)
        dense_bytes = dense[0][0].numel() * dense[0][0].element_size() * 2  # every row's keys and values
        sdpa_cells.append(f"{us:.1f} ({dense_bytes / (us * 1e-6) / 1e9 / bandwidth:.0%})")
    if not args.ragged:
        rows.append("| SDPA, contiguous K/V | " + " | ".join(sdpa_cells[i] for i, _ in cases) + " |")
    header = (
        f"### Decode launch settings, {torch.cuda.get_device_name()}, copy bandwidth "
        f"{bandwidth:.0f} GB/s, in a CUDA graph, µs (share of the copy bandwidth); splits chosen for max_seq_len "
        f"{args.max_seq_len}"
        + (f"; every row shares its first {args.prefix_len} keys (cascade)" if prefix is not None else "")
        + ("; ragged rows: lengths uniform in [context / 8, context]" if args.ragged else "")
        + ("" if args.ragged else "; SDPA reads every row's keys")
        + "\n\n"
        "| BLOCK_N / stages / warps | "
        + " | ".join(
            f"{args.shapes[i]} ({n} split{'s' * (n > 1)}{', the pick' if args.splits and n == picked[i] else ''})"
            for i, n in cases
        )
        + " |\n|---|"
        + "---:|" * len(cases)
    )
    emit_table("\n" + header + "\n" + "\n".join(rows) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
