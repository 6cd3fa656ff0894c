"""Benchmark the paged attention kernels against the card's copy bandwidth and torch SDPA.

Decode (bf16, 32 query heads, 8 KV heads, head_dim 128, block_size 16, shuffled block tables) at
batch {1, 8, 32, 256} x context {512, 2048, 4096}: median latency (do_bench, with p20/p80), bytes moved
(K + V of every context + query + out; block-table reads are ignored), achieved GB/s, the share of
the measured device-to-device copy bandwidth, and torch SDPA on contiguous K/V of the same shape.
Eager calls include each call's launch cost (a Triton launch from Python costs more than the kernel at batch 1);
the "in a CUDA graph" columns replay both calls from a graph (``do_bench_cudagraph``), as the engine runs decode,
so they compare device time.
Shared-prefix (cascade) decode, the bench's "prefix" workload at the Qwen3-0.6B shape (16 q / 8 kv heads): 200 rows
sharing 21 blocks (336 tokens) and 15-125 keys of their own; in-graph µs of one layer's decode without and with
``prefix_len`` (kernels/cascade.py predicts ~324 MB -> ~60 MB moved), and the max difference between the two.
Copy-on-write of 96 blocks in each of 28 layers (a beam step of Qwen3-0.6B at 32 x 4 beams): ``copy_blocks_layers``
in one launch vs ``copy_blocks`` a layer, eager calls, GPU and host µs a call.
Prefill: 4 fresh prompts x 1024 tokens vs causal SDPA.

Prints a markdown block; ``--out PATH`` also writes it to a file. Runs only on CUDA.

    python benchmarks/kernels.py [--out kernels_h100.md]
"""

import argparse
import datetime
import itertools
import sys

import torch
import triton
import triton.testing

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 8, 32, 256)
DECODE_CONTEXTS = (512, 2048, 4096)
PREFILL_BATCH, PREFILL_LEN = 4, 1024
QUANTILES = [0.5, 0.2, 0.8]  # do_bench returns (median, p20, p80) in ms


def _bench(fn) -> tuple[float, float, float]:
    """(median, p20, p80) in microseconds. do_bench flushes L2 before every call."""
    median, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=QUANTILES)
    return median * 1e3, p20 * 1e3, p80 * 1e3


def copy_bandwidth_gbs(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    median_us, _, _ = _bench(lambda: dst.copy_(src))
    return 2 * num_bytes / (median_us * 1e-6) / 1e9


def _sdpa_gqa_kwargs() -> dict:
    """enable_gqa=True where torch's SDPA has it (torch >= 2.5), else {} (K/V repeated by the caller)."""
    q = torch.zeros(1, 4, 1, 16, device="cuda", dtype=DTYPE)
    kv = torch.zeros(1, 2, 8, 16, device="cuda", dtype=DTYPE)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return {}
    return {"enable_gqa": True}


def _paged_inputs(batch: int, context: int, num_sets: int, generator: torch.Generator):
    """num_sets independent (k_cache, v_cache, block_tables) with shuffled tables; one shared query."""
    blocks_per_seq = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    sets = []
    for _ in range(num_sets):
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=generator)
        v_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=generator)
        perm = torch.randperm(num_blocks, device="cuda", generator=generator)
        block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
        sets.append((k_cache, v_cache, block_tables))
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return query, seq_lens, sets


def _bench_paged_decode(batch: int, context: int, l2_bytes: int) -> tuple[float, float, float, float]:
    """(median, p20, p80, in-graph median) µs of paged_decode_triton, rotating input sets when the KV fits in L2."""
    from hf_paged.kernels.decode import paged_decode_triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    kv_bytes = _kv_bytes(batch, context)
    # do_bench flushes L2 already; rotating sets as well keeps a small KV from being served from L2
    # even if that flush changes. Enough sets to span 2x L2 when the KV fits in it.
    num_sets = min(triton.cdiv(2 * l2_bytes, kv_bytes), 64) if kv_bytes < 2 * l2_bytes else 1
    query, seq_lens, sets = _paged_inputs(batch, context, num_sets, generator)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    rotation = itertools.cycle(sets)

    def run_paged():
        k_cache, v_cache, block_tables = next(rotation)
        paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=context, out=out)

    return (*_bench(run_paged), _graph_us(run_paged))


SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)


def sweep_splits(batch: int, context: int) -> dict[int, float]:
    """In-graph µs of the decode kernel for each forced split count (the heuristic's choice is in the main table).

    The kernel caps each sequence's splits at one per MIN_KEYS_PER_SPLIT keys, so large counts stop mattering.
    """
    from hf_paged.kernels.decode import paged_decode_triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    query, seq_lens, sets = _paged_inputs(batch, context, 1, generator)
    k_cache, v_cache, block_tables = sets[0]
    out = torch.empty_like(query)
    result = {}
    for n in SWEEP_SPLITS:
        result[n] = _graph_us(
            lambda n=n: paged_decode_triton(
                query, k_cache, v_cache, block_tables, seq_lens, HEAD_DIM**-0.5, max_seq_len=context, out=out,
                num_splits=n,
            )
        )  # fmt: skip
    return result


CASCADE_ROWS, CASCADE_HEADS, CASCADE_PREFIX_BLOCKS = 200, 16, 21


def bench_cascade() -> list[str]:
    """Markdown rows: one layer's decode on the prefix workload's shape, plain vs shared-prefix, in a CUDA graph."""
    from hf_paged.kernels.decode import paged_decode_triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    own = torch.randint(15, 126, (CASCADE_ROWS,), generator=generator, device="cuda")  # keys past the prefix
    seq_lens = (CASCADE_PREFIX_BLOCKS * BLOCK_SIZE + own).to(torch.int32)
    own_blocks = triton.cdiv(int(own.max()), BLOCK_SIZE)
    num_blocks = CASCADE_PREFIX_BLOCKS + CASCADE_ROWS * own_blocks
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=generator)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=generator)
    perm = torch.randperm(num_blocks, device="cuda", generator=generator).to(torch.int32)
    block_tables = torch.empty((CASCADE_ROWS, CASCADE_PREFIX_BLOCKS + own_blocks), dtype=torch.int32, device="cuda")
    block_tables[:, :CASCADE_PREFIX_BLOCKS] = perm[:CASCADE_PREFIX_BLOCKS]  # the same physical blocks in every row
    block_tables[:, CASCADE_PREFIX_BLOCKS:] = perm[CASCADE_PREFIX_BLOCKS:].view(CASCADE_ROWS, own_blocks)
    query = torch.randn(CASCADE_ROWS, CASCADE_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    prefix_len = torch.tensor([CASCADE_PREFIX_BLOCKS * BLOCK_SIZE], dtype=torch.int32, device="cuda")
    outs = {}

    def run(cascade: bool, max_seq_len: int):
        out = outs.setdefault(cascade, torch.empty_like(query))
        paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, HEAD_DIM**-0.5, max_seq_len=max_seq_len,
                            out=out, prefix_len=prefix_len if cascade else None)  # fmt: skip

    lines = [
        f"### Shared-prefix decode: {CASCADE_ROWS} rows, {CASCADE_HEADS} q / {NUM_KV_HEADS} kv heads, a "
        f"{CASCADE_PREFIX_BLOCKS * BLOCK_SIZE}-token shared prefix, 15-125 own keys, one layer, in a CUDA graph",
        "",
        "| max_seq_len bound | plain µs | cascade µs | plain / cascade | cascade, prefix_len 0 µs | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for bound in (int(seq_lens.max()), 4096):  # the exact bound, and an engine graph's (max_model_len)
        plain_us, cascade_us = _graph_us(lambda b=bound: run(False, b)), _graph_us(lambda b=bound: run(True, b))
        diff = (outs[True].float() - outs[False].float()).abs().max().item()
        prefix_len.fill_(0)
        off_us = _graph_us(lambda b=bound: run(True, b))
        prefix_len.fill_(CASCADE_PREFIX_BLOCKS * BLOCK_SIZE)
        lines.append(
            f"| {bound} | {plain_us:.1f} | {cascade_us:.1f} | {plain_us / cascade_us:.2f}x | {off_us:.1f} "
            f"| {diff:.2e} |"
        )
    return lines


def bench_copy_blocks(num_layers: int = 28, num_pairs: int = 96) -> list[str]:
    """Markdown rows: a copy-on-write step's block copies in every layer, one launch vs a launch a layer (eager calls
    as PagedCache's beam steps make them; CUDA events for the GPU time, the wall clock for the host's)."""
    import time

    from hf_paged.kernels import copy_blocks, copy_blocks_layers, layer_offsets

    shape = (2560, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_caches = [torch.randn(shape, device="cuda", dtype=DTYPE) for _ in range(num_layers)]
    v_caches = [torch.randn(shape, device="cuda", dtype=DTYPE) for _ in range(num_layers)]
    src = torch.arange(0, 2 * num_pairs, 2, device="cuda")
    dst = torch.arange(1000, 1000 + num_pairs, device="cuda")
    offsets = layer_offsets(k_caches, v_caches)

    def per_layer():
        for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
            copy_blocks(k_cache, v_cache, src, dst)

    calls = {
        "one launch (copy_blocks_layers)": lambda: copy_blocks_layers(k_caches, v_caches, src, dst, offsets),
        "a launch a layer (copy_blocks)": per_layer,
    }
    mib = num_pairs * num_layers * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize / 2**20
    lines = [f"### Copy-on-write: {num_pairs} blocks in each of {num_layers} layers ({mib:.0f} MiB copied), eager", "",
             "| call | GPU µs | host µs | blocks equal |", "|---|---:|---:|---|"]  # fmt: skip
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        for _ in range(50):
            call()
        end.record()
        torch.cuda.synchronize()
        host_us = (time.perf_counter() - began) / 50 * 1e6
        equal = all(torch.equal(k[1000 + i], k[2 * i]) for k in k_caches for i in (0, num_pairs - 1))
        lines.append(f"| {name} | {start.elapsed_time(end) / 50 * 1e3:.0f} | {host_us:.0f} | {equal} |")
    return lines


def _graph_us(fn) -> float:
    """Median µs per call of ``fn`` replayed from a CUDA graph (no launch cost; L2 not flushed between calls)."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def _bench_sdpa_decode(batch: int, context: int, gqa_kwargs: dict, l2_bytes: int) -> tuple[float, float]:
    """Median µs of torch SDPA (eager, in a graph): one query token over contiguous K/V [batch, kv_heads, ctx, D].

    K/V sets rotate as for the paged kernel (``_bench_paged_decode``), so that in a graph (many calls captured
    back to back) neither side reads K/V that the previous call left in L2."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    kv_bytes = _kv_bytes(batch, context)
    num_sets = min(triton.cdiv(2 * l2_bytes, kv_bytes), 64) if kv_bytes < 2 * l2_bytes else 1
    q = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    sets = []
    for _ in range(num_sets):
        k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
        v = torch.randn_like(k)
        if not gqa_kwargs:  # repeat outside the timed region
            k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
            v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        sets.append((k, v))
    rotation = itertools.cycle(sets)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        k, v = next(rotation)
        sdpa(q, k, v, scale=HEAD_DIM**-0.5, **gqa_kwargs)

    median_us, _, _ = _bench(run)
    return median_us, _graph_us(run)


def _kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * (torch.finfo(DTYPE).bits // 8)


def bench_decode(batch: int, context: int, copy_gbs: float, gqa_kwargs: dict, l2_bytes: int) -> dict:
    """One row of the decode table."""
    from hf_paged.kernels.decode import choose_num_splits

    paged_us, paged_p20, paged_p80, paged_graph_us = _bench_paged_decode(batch, context, l2_bytes)
    torch.cuda.empty_cache()
    sdpa_us, sdpa_graph_us = _bench_sdpa_decode(batch, context, gqa_kwargs, l2_bytes)
    torch.cuda.empty_cache()
    # K + V of every context, plus the query read and the out written.
    moved = _kv_bytes(batch, context) + 2 * batch * NUM_HEADS * HEAD_DIM * (torch.finfo(DTYPE).bits // 8)
    gbs = moved / (paged_us * 1e-6) / 1e9
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {
        "batch": batch,
        "context": context,
        "splits": choose_num_splits(context, batch, NUM_KV_HEADS, num_sms),
        "us": paged_us,
        "p20": paged_p20,
        "p80": paged_p80,
        "mb": moved / 1e6,
        "gbs": gbs,
        "pct": 100 * gbs / copy_gbs,
        "sdpa_us": sdpa_us,
        "graph_us": paged_graph_us,
        "sdpa_graph_us": sdpa_graph_us,
    }


def decode_max_abs_diff(batch: int = 8, context: int = 1000) -> float:
    """Max |kernel - reference| for one decode shape (ragged lengths, default splits)."""
    from hf_paged.kernels.decode import paged_decode_triton
    from hf_paged.kernels.reference import paged_attention_ref

    generator = torch.Generator(device="cuda").manual_seed(1)
    query, _, [(k_cache, v_cache, block_tables)] = _paged_inputs(batch, context, 1, generator)
    seq_lens = torch.randint(1, context + 1, (batch,), device="cuda", generator=generator, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    out = paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=context)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    ref = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)
    return (out.float() - ref.float()).abs().max().item()


def bench_prefill(gqa_kwargs: dict) -> list[str]:
    """Fresh prompts through the paged prefill kernel vs causal SDPA."""
    from hf_paged.kernels.prefill import paged_prefill_triton
    from hf_paged.kernels.reference import paged_attention_ref

    generator = torch.Generator(device="cuda").manual_seed(2)
    batch, length = PREFILL_BATCH, PREFILL_LEN
    query, seq_lens, [(k_cache, v_cache, block_tables)] = _paged_inputs(batch, length, 1, generator)
    query = torch.randn(batch * length, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    cu_seqlens_q = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    # The new tokens' K/V as the engine has them ([num_tokens, num_kv_heads, head_dim], rows as query).
    key = k_cache[block_tables.long()].flatten(1, 2).flatten(0, 1).contiguous()
    value = v_cache[block_tables.long()].flatten(1, 2).flatten(0, 1).contiguous()
    ref = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)
    paths = {
        "K/V read through the block table": {},
        "fresh prompts read the new K/V (engine default)": dict(key=key, value=value),
    }
    rows = []
    for name, kwargs in paths.items():

        def run_paged(kwargs=kwargs):
            paged_prefill_triton(
                query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                max_query_len=length, max_seq_len=length, out=out, **kwargs,
            )  # fmt: skip

        out.zero_()
        paged_us, paged_p20, paged_p80 = _bench(run_paged)
        max_diff = (out.float() - ref.float()).abs().max().item()
        rows.append((name, paged_us, paged_p20, paged_p80, max_diff))

    # The same K/V, gathered into contiguous [batch, num_kv_heads, length, head_dim].
    k = k_cache[block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
    v = v_cache[block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
    q = query.view(batch, length, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    if not gqa_kwargs:
        k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_us, _, _ = _bench(lambda: sdpa(q, k, v, is_causal=True, scale=scale, **gqa_kwargs))
    flops = 4 * batch * NUM_HEADS * HEAD_DIM * length * (length + 1) / 2  # causal QK^T + PV
    lines = [
        f"### Prefill: bf16, {batch} fresh prompts x {length} tokens, {NUM_HEADS} q / {NUM_KV_HEADS} kv heads, "
        f"head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}",
        "",
        "| path | paged µs (p20-p80) | TFLOP/s | SDPA causal µs | paged / SDPA time | max abs diff vs ref |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, us, p20, p80, diff in rows:
        lines.append(
            f"| {name} | {us:.1f} ({p20:.1f}-{p80:.1f}) | {flops / (us * 1e-6) / 1e12:.1f} | {sdpa_us:.1f} "
            f"| {us / sdpa_us:.2f}x | {diff:.2e} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the markdown block to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device; none found, nothing measured.", file=sys.stderr)
        return 0

    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    gqa_kwargs = _sdpa_gqa_kwargs()
    copy_gbs = copy_bandwidth_gbs()
    torch.cuda.empty_cache()
    rows = [bench_decode(b, c, copy_gbs, gqa_kwargs, l2_bytes) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    max_diff = decode_max_abs_diff()

    lines = [
        f"## {torch.cuda.get_device_name(0)}, {datetime.date.today().isoformat()}, "
        f"torch {torch.__version__}, triton {triton.__version__}",
        "",
        f"Device-to-device copy bandwidth (2 GiB, read + write): **{copy_gbs:.0f} GB/s**. "
        f"SDPA {'with enable_gqa' if gqa_kwargs else 'on K/V repeated to 32 heads'}.",
        "",
        f"### Decode: bf16, {NUM_HEADS} q / {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}, "
        "shuffled block tables",
        "",
        "| batch | context | splits | paged µs (p20-p80) | MB moved | GB/s | % of copy BW | SDPA µs | SDPA / paged "
        "| in a CUDA graph: paged µs | SDPA µs | SDPA / paged |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['splits']} | {r['us']:.1f} ({r['p20']:.1f}-{r['p80']:.1f}) "
            f"| {r['mb']:.1f} | {r['gbs']:.0f} | {r['pct']:.0f}% | {r['sdpa_us']:.1f} | {r['sdpa_us'] / r['us']:.2f} "
            f"| {r['graph_us']:.1f} | {r['sdpa_graph_us']:.1f} | {r['sdpa_graph_us'] / r['graph_us']:.2f} |"
        )
    lines += ["", f"Decode correctness (batch 8, ragged contexts <= 1000): max abs diff vs reference {max_diff:.2e}."]
    lines += ["", "### Decode split count, in a CUDA graph (µs; the heuristic's pick: main table, `splits`)", "",
              "| batch | context | " + " | ".join(f"{n} splits" for n in SWEEP_SPLITS) + " |",
              "|---:|---:|" + "---:|" * len(SWEEP_SPLITS)]  # fmt: skip
    for batch, context in ((1, 512), (1, 4096), (8, 2048)):
        sweep = sweep_splits(batch, context)
        lines.append(f"| {batch} | {context} | " + " | ".join(f"{sweep[n]:.1f}" for n in SWEEP_SPLITS) + " |")
    lines += [""] + bench_cascade()
    lines += [""] + bench_copy_blocks()
    lines += [""] + bench_prefill(gqa_kwargs)

    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
