"""Do a small model's decode-step GEMMs gain from weights pulled into L2 while attention runs? (issue 13)

A Qwen3-0.6B decode step costs a fixed ~1.45 ms plus ~4 µs a row on an H100 (benchmarks/RESULTS.md, twenty-first
session), against ~0.45 ms of weight reads. At 32 rows its four GEMMs a layer take ~26 µs for 30 MB of weights
(~1.2 TB/s): each GEMM of 4-12 MB pays its ramp and tail, whoever runs it (nineteenth session). A layer's weights
(30 MB) fit the H100's 50 MB L2, and the attention between the q/k/v and o projections is latency-bound at small
batches. So: while attention runs, a side stream asks L2 for the o / gate_up / down weights of the same layer
(``cp.async.bulk.prefetch.L2``: a hint that costs no registers), and the GEMMs after it read L2.

This measures, per layer, in a CUDA graph over ``--layers`` distinct layer copies (weights and K/V L2-cold as in
the engine), µs for: the GEMMs alone cold; the GEMMs alone hot (the same weights twice in a row: the bound of
what L2 can give); the layer (q/k/v GEMM, decode attention, o, gate_up, down) without and with the prefetch.

Prediction: hot GEMMs at <= 32 rows ~1.5x faster than cold; the prefetched layer ~8 µs (of ~45) faster at 32 rows,
~0 at 224 rows (attention then uses the bandwidth the prefetch needs). If the layer gains < 5%, drop the idea.

Measured (H100, twenty-second session, benchmarks/RESULTS.md): wrong. Hot GEMMs are only 1.03-1.27x faster than
cold (o + gate_up + down at 32 rows: 21.8 -> 17.1 µs): their time is per-kernel latency, not HBM. Every prefetch
variant made the layer slower (32 rows: 62.1 µs without, 64.5-65.5 with; 224 rows: 172.5 vs 175.0-178.1). Dropped.

Runs only on CUDA: ``python benchmarks/l2_prefetch.py [--rows 1 32 128 224] [--layers 16]``.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Qwen3-0.6B, fused as the engine fuses them: (in, out)
QKV, O_PROJ, GATE_UP, DOWN = (1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


@triton.jit
def _bulk_prefetch_kernel(base_ptr, n_bytes, sink_ptr, CHUNK: tl.constexpr, PER_PROG: tl.constexpr):
    # base_ptr: uint8 [n_bytes]; each lane asks L2 for CHUNK bytes (n_bytes >= CHUNK, both multiples of 16)
    pid = tl.program_id(0)
    offs = (pid * PER_PROG + tl.arange(0, PER_PROG)).to(tl.int64) * CHUNK
    offs = tl.minimum(offs, n_bytes - CHUNK)  # a lane past the end repeats the last chunk
    size = tl.full([PER_PROG], CHUNK, tl.int32)
    r = tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [base_ptr + offs, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    tl.store(sink_ptr + pid, tl.sum(r, axis=0))


@triton.jit
def _line_prefetch_kernel(base_ptr, n_bytes, sink_ptr, PER_PROG: tl.constexpr, ITERS: tl.constexpr):
    # one prefetch.global.L2::evict_last per 128-byte line
    pid = tl.program_id(0)
    acc = tl.zeros([PER_PROG], tl.int32)
    for i in range(ITERS):
        offs = ((pid * ITERS + i) * PER_PROG + tl.arange(0, PER_PROG)).to(tl.int64) * 128
        offs = tl.minimum(offs, n_bytes - 128)
        acc += tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [base_ptr + offs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    tl.store(sink_ptr + pid, tl.sum(acc, axis=0))


def prefetch(buf: torch.Tensor, sink: torch.Tensor, mode: str) -> None:
    """Ask L2 for every byte of ``buf`` (uint8, contiguous)."""
    n = buf.numel()
    if mode.startswith("bulk"):
        chunk = int(mode[4:] or 16384)
        per_prog = 32
        grid = (triton.cdiv(triton.cdiv(n, chunk), per_prog),)
        _bulk_prefetch_kernel[grid](buf, n, sink, CHUNK=chunk, PER_PROG=per_prog, num_warps=1)
    else:
        per_prog, iters = 128, 16
        grid = (triton.cdiv(triton.cdiv(n, 128), per_prog * iters),)
        _line_prefetch_kernel[grid](buf, n, sink, PER_PROG=per_prog, ITERS=iters, num_warps=4)


class Layer:
    """One layer's fused weights (o / gate_up / down in one flat buffer, so one prefetch covers them) and K/V."""

    def __init__(self, rows: int, keys: int):
        dev, dt = "cuda", torch.bfloat16
        self.qkv = torch.randn(QKV[1], QKV[0], device=dev, dtype=dt) / 32
        sizes = [O_PROJ[0] * O_PROJ[1], GATE_UP[0] * GATE_UP[1], DOWN[0] * DOWN[1]]
        self.flat = torch.randn(sum(sizes), device=dev, dtype=dt) / 32
        o, gu, down = self.flat.split(sizes)
        self.o, self.gate_up, self.down = (
            o.view(O_PROJ[1], O_PROJ[0]),
            gu.view(GATE_UP[1], GATE_UP[0]),
            down.view(DOWN[1], DOWN[0]),
        )
        blocks = triton.cdiv(keys, BLOCK)
        self.k_cache = torch.randn(rows * blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        self.v_cache = torch.randn_like(self.k_cache)
        self.block_tables = torch.randperm(rows * blocks, device=dev, dtype=torch.int32).view(rows, blocks)
        self.seq_lens = torch.full((rows,), keys, device=dev, dtype=torch.int32)


def gemms(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    h = F.linear(x[:, : O_PROJ[0]], layer.o)
    gu = F.linear(h, layer.gate_up)
    return F.linear(gu[:, : DOWN[0]], layer.down)


def layer_step(
    x: torch.Tensor, layer: Layer, keys: int, mode: str | None, side: torch.cuda.Stream, sink
) -> torch.Tensor:
    from hf_paged.kernels import paged_attention

    rows = x.shape[0]
    qkv = F.linear(x, layer.qkv)  # [rows, 4096]
    q = qkv[:, : HEADS * HEAD_DIM].reshape(rows, HEADS, HEAD_DIM)
    main = torch.cuda.current_stream()
    if mode is not None:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch(layer.flat.view(torch.uint8), sink, mode)
    cu = torch.arange(rows + 1, device=x.device, dtype=torch.int32)
    attn = paged_attention(
        q.contiguous(), layer.k_cache, layer.v_cache, layer.block_tables, layer.seq_lens, cu, HEAD_DIM**-0.5,
        max_query_len=1, max_seq_len=keys,
    )  # fmt: skip
    if mode is not None:
        main.wait_stream(side)
    return gemms(attn.reshape(rows, HEADS * HEAD_DIM), layer)


def graph_us(fn, reps: int = 50) -> float:
    """Median µs of one replay of ``fn`` captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(rows: int, keys: int, num_layers: int, modes: list[str], side, sink) -> list[float]:
    """µs a layer: GEMMs cold, GEMMs hot, the layer, the layer with each prefetch mode."""
    layers = [Layer(rows, keys) for _ in range(num_layers)]
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    n = len(layers)

    def step(mode):
        return [layer_step(x[:, :1024], lay, keys, mode, side, sink) for lay in layers]

    cold = graph_us(lambda: [gemms(x, lay) for lay in layers]) / n
    mean = graph_us(lambda: [gemms(x, lay) for lay in layers for _ in range(2)]) / (2 * n)
    res = [cold, 2 * mean - cold, graph_us(lambda: step(None)) / n]  # hot: the second pass alone
    res += [graph_us(lambda m=mode: step(m)) / n for mode in modes]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 224])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["bulk16384", "bulk65536", "line"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}: µs a layer "
          f"(median of graph replays over {args.layers} L2-cold layer copies)")  # fmt: skip
    cols = ["gemms cold", "gemms hot", "layer", *[f"layer+{m}" for m in args.modes]]
    print("| rows | keys | " + " | ".join(cols) + " |")
    print("|---:|---:|" + "---:|" * len(cols))
    side = torch.cuda.Stream()
    sink = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
    for rows in args.rows:
        keys = 440 if rows <= 64 else 400
        res = measure(rows, keys, args.layers, args.modes, side, sink)
        print(f"| {rows} | {keys} | " + " | ".join(f"{v:.1f}" for v in res) + " |", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
