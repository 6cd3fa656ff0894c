"""Time ``mla_decode`` (the Triton MLA decode over a paged latent cache) against the same math in torch ops.

At DeepSeek-V2-Lite's attention shapes by default (16 query heads, kv_lora_rank 512, qk_rope_head_dim 64: each
cached row is 576 values, V is its first 512), bf16, block size 16, shuffled block tables. Each shape
``BATCHxCONTEXT`` gives every row ``CONTEXT`` keys. Both sides run in a CUDA graph (no host time) and are timed with
``triton.testing.do_bench_cudagraph`` (median):

- triton: ``hf_paged.kernels.mla_decode`` (split-K kernel, merge when it splits; the split count the launcher picks
  from ``max_seq_len = CONTEXT``, or ``--splits``);
- dense: the rows gathered through the block tables into a contiguous [batch, context, 576] tensor, then
  ``softmax(scale * q @ rows^T) @ rows[..., :512]`` in torch (fp32 softmax), the gather included.

Achieved bandwidth counts the latent bytes one call must read (``batch * context * 576 * 2``) plus the queries and
outputs; the floor is those bytes over ``--peak-tbs`` (4.8 TB/s, the H200's HBM3e).

    python benchmarks/tools/mla_decode_bench.py [--shapes 1x4096 32x4096 64x1024] [--num-heads 16] [--splits N]

Runs only on CUDA.
"""

import argparse
import sys

import torch
import triton.testing

DEFAULT_SHAPES = ("1x4096", "32x4096", "64x1024")


def make_inputs(batch: int, context: int, num_heads: int, rank: int, rope: int, block_size: int, seed: int = 0):
    """Random bf16 queries and a latent pool whose rows each sequence reaches through a shuffled block table.

    Returns:
        q_cat [batch, num_heads, rank + rope], kv_cache [num_blocks, block_size, 1, rank + rope], block_tables
        [batch, blocks_per_seq] int32, seq_lens [batch] int32.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    kv_cache = torch.randn(num_blocks, block_size, 1, rank + rope, generator=gen, device="cuda").to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")[: batch * blocks_per_seq]
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_cat = torch.randn(batch, num_heads, rank + rope, generator=gen, device="cuda").to(torch.bfloat16)
    return q_cat, kv_cache, block_tables, seq_lens


def dense_decode(q_cat, kv_cache, block_tables, scale: float, rank: int, context: int) -> torch.Tensor:
    """The same attention in torch ops: gather every row's keys, then one softmax over them (all rows are full)."""
    rows = kv_cache[:, :, 0][block_tables.long()].flatten(1, 2)[:, :context]  # [batch, context, rank + rope]
    scores = torch.einsum("bhw,bkw->bhk", q_cat, rows).float() * scale  # [batch, num_heads, context]
    probs = torch.softmax(scores, dim=-1).to(rows.dtype)
    return torch.einsum("bhk,bkv->bhv", probs, rows[:, :, :rank])  # [batch, num_heads, rank]


def bench_shape(args: argparse.Namespace, batch: int, context: int, settings: tuple | None) -> str:
    """One shape's row of the table: times, bandwidth, the floor and the two sides' largest difference."""
    from hf_paged.kernels import mla_decode
    from hf_paged.kernels.mla_triton import mla_decode_triton

    scale = (128 + args.rope) ** -0.5  # DeepSeek's qk_nope_head_dim 128
    q_cat, kv_cache, block_tables, seq_lens = make_inputs(
        batch, context, args.num_heads, args.rank, args.rope, args.block_size
    )

    def triton_fn():
        if args.splits is None and settings is None:
            return mla_decode(q_cat, kv_cache, block_tables, seq_lens, scale, args.rank, max_seq_len=context)
        return mla_decode_triton(
            q_cat, kv_cache, block_tables, seq_lens, scale, args.rank, context, num_splits=args.splits,
            tile_settings=settings,
        )  # fmt: skip

    def dense_fn():
        return dense_decode(q_cat, kv_cache, block_tables, scale, args.rank, context)

    err = (triton_fn().float() - dense_fn().float()).abs().max().item()
    triton_ms = triton.testing.do_bench_cudagraph(triton_fn, rep=200, return_mode="median")
    dense_ms = triton.testing.do_bench_cudagraph(dense_fn, rep=200, return_mode="median")
    width = args.rank + args.rope
    num_bytes = 2 * (batch * context * width + batch * args.num_heads * (width + args.rank))
    floor_ms = num_bytes / (args.peak_tbs * 1e12) * 1e3
    return (
        f"{triton_ms:>10.4f} {dense_ms:>10.4f} {dense_ms / triton_ms:>7.2f}x "
        f"{num_bytes / (triton_ms * 1e-3) / 1e9:>8.0f} {floor_ms:>9.4f} {floor_ms / triton_ms:>8.1%} {err:>8.4f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="BATCHxCONTEXT, e.g. 32x4096")
    parser.add_argument("--num-heads", type=int, default=16, help="query heads (V2-Lite 16, V3 128)")
    parser.add_argument("--rank", type=int, default=512, help="kv_lora_rank: V's width")
    parser.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--splits", type=int, default=None, help="force the decode kernel's split count")
    parser.add_argument(
        "--settings", nargs="+", default=None,
        help="decode tile settings to compare, BLOCK_H/BLOCK_N/WARPS/STAGES each (default: the launcher's own)",
    )  # fmt: skip
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="HBM bandwidth for the floor, TB/s")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_decode_bench: needs a CUDA device", file=sys.stderr)
        return 2

    print(f"{torch.cuda.get_device_name()}  heads {args.num_heads}  rank {args.rank}  rope {args.rope}  bf16  "
          f"block {args.block_size}")  # fmt: skip
    print(f"{'shape':>10} {'settings':>11} {'triton ms':>10} {'dense ms':>10} {'speedup':>8} {'GB/s':>8} "
          f"{'floor ms':>9} {'of floor':>9} {'max err':>8}")  # fmt: skip
    settings_list = [None] + [tuple(int(x) for x in text.split("/")) for text in args.settings or []]
    for shape in args.shapes:
        batch, context = (int(x) for x in shape.split("x"))
        for settings in settings_list:
            name = "default" if settings is None else "/".join(map(str, settings))
            print(f"{shape:>10} {name:>11} " + bench_shape(args, batch, context, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
