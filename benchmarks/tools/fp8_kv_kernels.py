"""The paged decode and prefill kernels over an FP8 (e4m3) KV pool beside a bf16 one, on this card.

Decode: Llama-3.1-8B's attention (32 query / 8 KV heads, head_dim 128), block size 16, shuffled block tables, at
batch x context 32 x 4096 and 1 x 32768 (``--shapes``), through ``hf_paged.kernels.paged_attention`` as the engine's
decode graphs call it: ``max_query_len=1``, the step's new K/V written by the decode kernel (``slot_mapping``; an FP8
pool quantizes them there), ``max_seq_len`` the engine's ``max_model_len`` (``--max-seq-len``, default Llama-3.1-8B's
131 072: it picks the split count), an FP8 pool with per-tensor ``k_scale``/``v_scale`` of 1.0 (what the engine
passes for a checkpoint without scales). Timed as benchmarks/kernels.py and benchmarks/tools/decode_sweep.py time
decode: CUDA-graph replays (``do_bench_cudagraph``), median; K/V sets rotate to span 2x L2 when one set fits in it,
so that no replay reads K/V the previous one left in L2. Bytes read: K + V of every context in the pool's dtype plus
the query read and the out written (block tables ignored); the floor is bytes / bandwidth, at the measured
device-to-device copy bandwidth (read + write, 2 GiB) and at the H200's nominal 4.8 TB/s.

Prefill: 4 fresh prompts x 1024 tokens as the engine runs them: the bf16 pool's prompts read their new K/V
(``key``/``value``), an FP8 pool's read the blocks (a prompt attends to the quantized K/V its decode steps will);
``do_bench`` median with L2 flushed before each call.

Each row also gives the call's max abs difference from the torch reference over the same pool (after the call:
the decode kernel wrote the new K/V there).

    python benchmarks/tools/fp8_kv_kernels.py [--shapes 32x4096 1x32768] [--out FILE.md] [--json FILE.json]
    TRITON_INTERPRET=1 python benchmarks/tools/fp8_kv_kernels.py --check   # CPU: the same calls, tiny shapes

``--check`` builds the same pools and makes the same calls at tiny shapes (4 / 2 heads, head_dim 32) on the CPU
through the Triton launchers ``paged_attention`` dispatches to on CUDA (on CPU tensors it takes the torch reference),
checks them against the reference and times nothing.
"""

import argparse
import itertools
import shlex
import statistics
import sys

import torch

BLOCK_SIZE, DTYPE, FP8 = 16, torch.bfloat16, torch.float8_e4m3fn
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
CHECK_HEADS = (4, 2, 32)  # --check: query heads, KV heads, head_dim
NOMINAL_GBS = 4800.0  # H200 HBM3e, as NVIDIA quotes it
DEFAULT_SHAPES = ("32x4096", "1x32768")
PREFILL_BATCH, PREFILL_LEN = 4, 1024
POOLS = {"bf16": DTYPE, "fp8_e4m3": FP8}  # the pool's name in the table -> its dtype


def parse_shape(text: str) -> tuple[int, int]:
    """``BATCHxCONTEXT`` -> (batch, context)."""
    try:
        batch, context = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a shape is BATCHxCONTEXT, such as 32x4096, got {text!r}") from None
    if batch < 1 or context < 2:
        raise ValueError(f"a shape needs batch >= 1 and context >= 2, got {text!r}")
    return batch, context


def make_pool(dtype: torch.dtype, num_blocks: int, heads: tuple[int, int, int], device, generator):
    """(k_cache, v_cache, k_scale, v_scale): random K/V in ``dtype`` (fp8: quantized bf16 normals, as write_kv stores
    them with scale 1.0); the scales are fp32 [1] tensors of 1.0 for an fp8 pool, else None."""
    from hf_paged.kernels.kv_quant import is_fp8, new_cache, quantize_ref

    _, num_kv_heads, head_dim = heads
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    caches = []
    for value in (False, True):  # in the pool's layouts (new_cache: an FP8 V is keys-minor)
        x = torch.randn(shape, device=device, dtype=DTYPE, generator=generator)
        cache = new_cache(*shape, dtype, device, value=value)
        cache.copy_(quantize_ref(x, None, dtype) if is_fp8(dtype) else x)
        caches.append(cache)
    if not is_fp8(dtype):
        return (*caches, None, None)
    ones = torch.ones(1, dtype=torch.float32, device=device)
    return (*caches, ones, ones.clone())


def decode_sets(dtype, batch, context, heads, l2_bytes, device, generator):
    """Rotating decode inputs spanning 2x L2 when one set fits in it: a list of dicts of paged_attention's pool
    arguments (caches, scales, block tables, slot_mapping of each row's new token), and the query, new K/V, lengths
    and the bytes one call reads."""
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * dtype.itemsize
    num_sets = min(-(-2 * l2_bytes // kv_bytes), 64) if kv_bytes < 2 * l2_bytes else 1
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    last = context - 1  # the new token's position
    sets = []
    for _ in range(num_sets):
        k_cache, v_cache, k_scale, v_scale = make_pool(dtype, num_blocks, heads, device, generator)
        perm = torch.randperm(num_blocks, device=device, generator=generator)
        block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
        slot_mapping = block_tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
        sets.append(dict(k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale,
                         block_tables=block_tables, slot_mapping=slot_mapping))  # fmt: skip
    query = torch.randn(batch, num_heads, head_dim, device=device, dtype=DTYPE, generator=generator)
    new_key = torch.randn(batch, num_kv_heads, head_dim, device=device, dtype=DTYPE, generator=generator)
    new_value = torch.randn_like(new_key)
    moved = kv_bytes + 2 * query.numel() * query.element_size()  # K/V read, query read, out written
    return sets, query, new_key, new_value, seq_lens, moved


def decode_call(query, new_key, new_value, seq_lens, max_seq_len, out, on_cuda: bool, tile_settings=None):
    """A function of one input set making the engine's decode call (kernels.paged_attention on CUDA; on the CPU, or
    with ``tile_settings`` forced (``--settings``), the launcher it dispatches to, with the same arguments)."""
    from hf_paged import kernels

    scale = query.shape[-1] ** -0.5
    cu_seqlens_q = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)

    def call(s: dict) -> torch.Tensor:
        if on_cuda and tile_settings is None:
            return kernels.paged_attention(
                query, s["k_cache"], s["v_cache"], s["block_tables"], seq_lens, cu_seqlens_q, scale, max_query_len=1,
                max_seq_len=max_seq_len, out=out, key=new_key, value=new_value, slot_mapping=s["slot_mapping"],
                k_scale=s["k_scale"], v_scale=s["v_scale"],
            )  # fmt: skip
        return kernels._triton().decode.paged_decode_triton(
            query, s["k_cache"], s["v_cache"], s["block_tables"], seq_lens, scale, max_seq_len=max_seq_len, out=out,
            new_key=new_key, new_value=new_value, slot_mapping=s["slot_mapping"], k_scale=s["k_scale"],
            v_scale=s["v_scale"], tile_settings=tile_settings,
        )  # fmt: skip

    return call


def decode_diff(call, s: dict, query, seq_lens) -> float:
    """Max |call - reference| for one set: the reference reads the pool as the call left it (new K/V written)."""
    from hf_paged.kernels.reference import paged_decode_ref

    out = call(s).float()
    ref = paged_decode_ref(query.float(), s["k_cache"], s["v_cache"], s["block_tables"], seq_lens,
                           query.shape[-1] ** -0.5, k_scale=s["k_scale"], v_scale=s["v_scale"])  # fmt: skip
    return (out - ref.float()).abs().max().item()


def bench_decode(dtype, batch, context, heads, max_seq_len, l2_bytes, device, timer, tile_settings=None) -> dict:
    """One decode row: µs per call (``timer``: None times nothing), bytes read, max abs diff vs reference."""
    generator = torch.Generator(device=device).manual_seed(0)
    sets, query, new_key, new_value, seq_lens, moved = decode_sets(dtype, batch, context, heads, l2_bytes, device,
                                                                   generator)  # fmt: skip
    out = torch.empty_like(query)
    call = decode_call(query, new_key, new_value, seq_lens, max_seq_len, out, device.type == "cuda", tile_settings)
    diff = decode_diff(call, sets[0], query, seq_lens)
    rotation = itertools.cycle(sets)
    us = None if timer is None else timer(lambda: call(next(rotation)))
    return dict(kind="decode", batch=batch, context=context, num_sets=len(sets), us=us, bytes=moved,
                max_abs_diff=diff)  # fmt: skip


def bench_prefill(dtype, batch, length, heads, device, timer) -> dict:
    """One prefill row: fresh prompts as the engine runs them (bf16 reads the new K/V, fp8 the blocks)."""
    from hf_paged.kernels.kv_quant import is_fp8
    from hf_paged.kernels.reference import paged_attention_ref

    from hf_paged import kernels

    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator(device=device).manual_seed(2)
    blocks_per_seq = -(-length // BLOCK_SIZE)
    k_cache, v_cache, k_scale, v_scale = make_pool(dtype, batch * blocks_per_seq, heads, device, generator)
    perm = torch.randperm(batch * blocks_per_seq, device=device, generator=generator)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)
    query = torch.randn(batch * length, num_heads, head_dim, device=device, dtype=DTYPE, generator=generator)
    fresh = {}
    if not is_fp8(dtype):  # the new tokens' K/V as the engine has them ([num_tokens, num_kv_heads, head_dim])
        rows = block_tables.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)
        rows = rows.flatten(1)[:, :length].flatten()
        fresh = dict(key=k_cache.flatten(0, 1)[rows].contiguous(), value=v_cache.flatten(0, 1)[rows].contiguous())
    out = torch.empty_like(query)
    scale = head_dim**-0.5
    args = (query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)
    kwargs = dict(max_query_len=length, max_seq_len=length, out=out, k_scale=k_scale, v_scale=v_scale, **fresh)
    if device.type == "cuda":
        call = lambda: kernels.paged_attention(*args, **kwargs)  # noqa: E731
    else:
        call = lambda: kernels._triton().prefill.paged_prefill_triton(*args, **kwargs)  # noqa: E731
    call()
    ref = paged_attention_ref(query.float(), k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                              k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    diff = (out.float() - ref.float()).abs().max().item()
    us = None if timer is None else timer(call, graph=False)
    flops = 4 * batch * num_heads * head_dim * length * (length + 1) / 2  # causal QK^T + PV
    return dict(kind="prefill", batch=batch, context=length, us=us, flops=flops, max_abs_diff=diff,
                reads="new K/V" if fresh else "blocks")  # fmt: skip


def cuda_timer(fn, graph: bool = True) -> float:
    """Median µs a call: replayed from a CUDA graph (``graph``), else eager with L2 flushed (``do_bench``)."""
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def copy_gbs(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + bytes written (decode_sweep.py's)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_timer(lambda: dst.copy_(src), graph=False)
    return 2 * num_bytes / (us * 1e-6) / 1e9


def format_tables(rows: list[dict], bandwidth: float | None, header: str) -> str:
    """Markdown: a decode table (bf16 and fp8 rows of a shape side by side) and a prefill table."""
    by = {(r["kind"], r["batch"], r["context"], r["pool"]): r for r in rows}
    lines = [header, "",
             "| batch x context | splits bf16 / fp8 | bf16 µs | fp8 µs | fp8 speed-up | bf16 MB read | fp8 MB read "
             "| bf16 % of floor (copy BW / 4.8 TB/s) | fp8 % of floor (copy BW / 4.8 TB/s) "
             "| max abs diff bf16 / fp8 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip

    def us(r):
        return "-" if r["us"] is None else f"{r['us']:.1f}"

    def share(r):
        if r["us"] is None:
            return "-"
        nominal = f"{100 * r['bytes'] / (NOMINAL_GBS * 1e3 * r['us']):.0f}%"
        measured = "-" if bandwidth is None else f"{100 * r['bytes'] / (bandwidth * 1e3 * r['us']):.0f}%"
        return f"{measured} / {nominal}"

    for (kind, batch, context, pool), bf16 in by.items():
        if kind != "decode" or pool != "bf16":
            continue
        fp8 = by[(kind, batch, context, "fp8_e4m3")]
        speedup = "-" if bf16["us"] is None else f"{bf16['us'] / fp8['us']:.2f}x"
        lines.append(
            f"| {batch} x {context} | {bf16.get('splits', '-')} / {fp8.get('splits', '-')} "
            f"| {us(bf16)} | {us(fp8)} | {speedup} "
            f"| {bf16['bytes'] / 1e6:.1f} | {fp8['bytes'] / 1e6:.1f} | {share(bf16)} | {share(fp8)} "
            f"| {bf16['max_abs_diff']:.1e} / {fp8['max_abs_diff']:.1e} |"
        )
    prefill = [r for r in rows if r["kind"] == "prefill"]
    if prefill:
        p = prefill[0]
        lines += ["", f"Prefill, {p['batch']} fresh prompts x {p['context']} tokens, do_bench median (L2 flushed):",
                  "", "| pool | reads | µs | TFLOP/s | max abs diff vs reference |",
                  "|---|---|---:|---:|---:|"]  # fmt: skip
        for r in prefill:
            tflops = "-" if r["us"] is None else f"{r['flops'] / (r['us'] * 1e-6) / 1e12:.0f}"
            lines.append(f"| {r['pool']} | {r['reads']} | {us(r)} | {tflops} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def run(
    shapes: list[tuple[int, int]],
    max_seq_len: int,
    prefill: bool,
    check: bool,
    settings: list[tuple[int, int, int]] = (),
) -> tuple[list[dict], float]:
    """Every row, bf16 then fp8 per shape (then each of ``settings`` forced on both); and the copy bandwidth (None
    under ``check``)."""
    if check:
        device, heads, l2_bytes, timer, bandwidth = torch.device("cpu"), CHECK_HEADS, 0, None, None
        num_sms = 4
    else:
        device, heads, timer = torch.device("cuda"), (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM), cuda_timer
        props = torch.cuda.get_device_properties(0)
        l2_bytes, num_sms = getattr(props, "L2_cache_size", 50 << 20), props.multi_processor_count
        bandwidth = copy_gbs()
        torch.cuda.empty_cache()  # the copy's 4 GiB
    from hf_paged.kernels.decode_plan import PROGRAMS_PER_SM, PROGRAMS_PER_SM_FP8, choose_num_splits

    # the split rule the plan takes (DecodePlan.split_rule)
    deep = device.type == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    fp8_rule = (PROGRAMS_PER_SM_FP8, True) if deep else (PROGRAMS_PER_SM, False)
    rows = []
    for batch, context in shapes:
        for pool, dtype in POOLS.items():
            row = bench_decode(dtype, batch, context, heads, max_seq_len, l2_bytes, device, timer)
            rule = (PROGRAMS_PER_SM, False) if pool == "bf16" else fp8_rule
            row.update(pool=pool, splits=choose_num_splits(max_seq_len, batch, heads[1], num_sms, None, *rule))
            rows.append(row)
            print(f"decode {batch}x{context} {pool}: {row}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for setting in settings:  # after the defaults: the table keeps its pairs, the sweep rows follow
        for batch, context in shapes:
            for pool, dtype in POOLS.items():
                row = bench_decode(dtype, batch, context, heads, max_seq_len, l2_bytes, device, timer, setting)
                row.update(pool=pool, kind="decode-setting", setting="/".join(map(str, setting)))
                rows.append(row)
                print(f"decode {batch}x{context} {pool} setting {row['setting']}: {row['us']} us", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if prefill:
        batch, length = (2, 40) if check else (PREFILL_BATCH, PREFILL_LEN)
        for pool, dtype in POOLS.items():
            rows.append({**bench_prefill(dtype, batch, length, heads, device, timer), "pool": pool})
            print(f"prefill {batch}x{length} {pool}: {rows[-1]}", flush=True)
    return rows, bandwidth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="BATCHxCONTEXT decode shapes")
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=131072,
        help="the bound the engine's decode graphs pass (its max_model_len; picks the split count)",
    )
    parser.add_argument("--no-prefill", action="store_true", help="leave the prefill rows out")
    parser.add_argument(
        "--check",
        action="store_true",
        help="CPU (TRITON_INTERPRET=1): the same calls at tiny shapes against the reference, untimed",
    )
    parser.add_argument(
        "--settings",
        nargs="*",
        default=[],
        help="BLOCK_N/stages/warps: also time the split kernel with each forced, both pools",
    )
    parser.add_argument("--out", help="also append the markdown to this file")
    parser.add_argument("--json", help="write the figures as a JSON record to this file")
    args = parser.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in (["2x40", "1x300"] if args.check else args.shapes)]
    except ValueError as error:
        parser.error(str(error))
    if args.max_seq_len < max(c for _, c in shapes):
        parser.error(f"--max-seq-len {args.max_seq_len} is below the longest context {max(c for _, c in shapes)}")
    if not args.check and not torch.cuda.is_available():
        print("fp8_kv_kernels.py: needs a CUDA GPU to time (--check runs the calls on the CPU under "
              "TRITON_INTERPRET=1)", file=sys.stderr)  # fmt: skip
        return 2
    if not args.check and torch.cuda.get_device_capability() < (8, 9):
        print("fp8_kv_kernels.py: an e4m3 pool needs compute capability >= 8.9", file=sys.stderr)
        return 2
    from hf_paged.frontends.bench_record import emit_table, make_record, write_record

    try:
        settings = [tuple(int(x) for x in setting.split("/")) for setting in args.settings]
    except ValueError:
        parser.error(f"--settings takes BLOCK_N/stages/warps, got {args.settings}")
    if any(len(setting) != 3 for setting in settings):
        parser.error(f"--settings takes BLOCK_N/stages/warps, got {args.settings}")
    rows, bandwidth = run(shapes, args.max_seq_len, not args.no_prefill, args.check, settings)
    if args.check:
        worst = max(r["max_abs_diff"] for r in rows)
        print(f"fp8_kv_kernels.py --check: {len(rows)} calls, max abs diff vs reference {worst:.2e}")
        return 0 if worst < 0.1 else 1
    device = torch.cuda.get_device_name()
    command = "python benchmarks/tools/fp8_kv_kernels.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    record = make_record(
        device, command,
        workload=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                      shapes=[f"{b}x{c}" for b, c in shapes], max_seq_len=args.max_seq_len, pools=list(POOLS),
                      copy_bandwidth_gb_s=bandwidth, nominal_bandwidth_gb_s=NOMINAL_GBS),
        rows=rows,
    )  # fmt: skip
    versions = record["versions"]
    speedups = [a["us"] / b["us"] for a, b in zip(rows[::2], rows[1::2], strict=True) if a["kind"] == "decode"]
    sweep = [r for r in rows if r["kind"] == "decode-setting"]
    rows = [r for r in rows if r["kind"] != "decode-setting"]
    header = (
        f"### FP8 (e4m3) KV pool beside bf16: paged decode — {device}, {record['date']}, torch {versions['torch']}, "
        f"triton {versions['triton']}\n\n"
        f"{NUM_HEADS} q / {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}, shuffled block "
        f"tables; `paged_attention` as the engine's decode graphs call it (fused new-K/V write, max_seq_len "
        f"{args.max_seq_len}); CUDA-graph replays, median, L2-cold. Floor = bytes read / bandwidth: measured copy "
        f"bandwidth {bandwidth:.0f} GB/s (2 GiB, read + write) / nominal {NOMINAL_GBS:.0f} GB/s. Median fp8 "
        f"speed-up {statistics.median(speedups):.2f}x. `{command}`"
    )
    if sweep:
        lines = ["", "Split-kernel settings forced (BLOCK_N/stages/warps), µs:", ""]
        lines += ["| setting | shape | bf16 µs | fp8 µs | fp8 / default bf16 |", "|---|---|---:|---:|---:|"]
        default = {(r["batch"], r["context"]): r["us"] for r in rows if r["kind"] == "decode" and r["pool"] == "bf16"}
        for a, b in zip(sweep[::2], sweep[1::2], strict=True):
            shape = (a["batch"], a["context"])
            lines.append(f"| {a['setting']} | {shape[0]} x {shape[1]} | {a['us']:.1f} | {b['us']:.1f} "
                         f"| {default[shape] / b['us']:.2f}x |")  # fmt: skip
        header += "\n" + "\n".join(lines)
    emit_table("\n" + format_tables(rows, bandwidth, header), args.out)
    if args.json:
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
