"""The engine's steady decode step with quantized weights: ms per step at batch 1, 8 and 64 beside the weight floor.

For each ``--quantization`` name (hf_paged.engine.quantization: torchao) the shape's random-weight model is built on
the device in bf16 and quantized there, in place (no checkpoint to write or load), and one engine (the defaults:
compiled decoder layers, CUDA graphs, async scheduling; ``max_num_seqs`` = the largest batch) runs, for each batch
B: B requests of a ``--prompt-tokens`` prompt (EOS ignored), stepped until every prefill is done and a few decode
steps ran, then ``--repeats`` windows of ``--steps`` decode steps, each timed by the wall clock between two device
syncs: ms per step = window / steps (median, min and max over the windows). Every timed step must carry B tokens (the
engine's generated count says so; else the row says how many it carried).

The floor of a step is the weights as stored (``weight_bytes``: a quantized weight counts its packed values, scales
and zero points) read once, over the nominal bandwidth (``--peak-gbs``, the H200's 4 800 GB/s) and over the
measured copy bandwidth (read + write); the K/V a step reads (B x ~600 tokens) is left out.

    python benchmarks/tools/quant_decode_steps.py --quantization none float8 int4 [--batches 1 8 64] [--json F]
    python benchmarks/tools/quant_decode_steps.py --device cpu --quantization none int4   # a smoke run, tiny model
"""

import argparse
import gc
import shlex
import statistics
import sys
import time

import torch

PEAK_GBS = 4800.0  # the H200's HBM3e, as NVIDIA quotes it


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from hf_paged.engine.quantization import QUANTIZATIONS
    from hf_paged.frontends.bench_workloads import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=sorted(QUANTIZATIONS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64, help="decode steps a timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows a batch (median, min and max)")
    parser.add_argument("--peak-gbs", type=float, default=PEAK_GBS, help="nominal bandwidth for the floor (GB/s)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run on a tiny model")
    parser.add_argument("--out", help="also append the markdown table to this file")
    parser.add_argument("--json", help="write the figures as a JSON record to this file")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.model, args.batches = "tiny", [b for b in args.batches if b <= 2] or [1]
        args.prompt_tokens, args.steps, args.repeats = min(args.prompt_tokens, 16), min(args.steps, 3), 1
    if min(args.batches) < 1 or args.steps < 1 or args.repeats < 1 or args.prompt_tokens < 1:
        parser.error(f"--batches, --steps, --repeats and --prompt-tokens must be >= 1, got {args.batches}, "
                     f"{args.steps}, {args.repeats} and {args.prompt_tokens}")  # fmt: skip
    return args


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_batch(engine, batch: int, args) -> dict:
    """ms per steady decode step at ``batch`` rows: warm-up steps, then ``repeats`` timed windows of ``steps``."""
    from hf_paged import SamplingParams

    budget = engine.config.max_num_batched_tokens
    warm_steps = -(-batch * args.prompt_tokens // budget) + 4  # every prefill done, then a few decode steps
    new_tokens = warm_steps + args.repeats * args.steps + 4  # no row ends inside a window
    generator = torch.Generator().manual_seed(batch)
    vocab = engine.info.vocab_size
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        prompt = torch.randint(10, vocab - 10, (args.prompt_tokens,), generator=generator).tolist()
        engine.add_request(prompt, params)
    for _ in range(warm_steps):
        engine.step()
    windows, tokens = [], []
    for _ in range(args.repeats):
        _sync(args.device)
        generated, start = engine.metrics().num_generated_tokens, time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        _sync(args.device)
        windows.append((time.perf_counter() - start) / args.steps * 1e3)
        tokens.append((engine.metrics().num_generated_tokens - generated) / args.steps)
    while engine.has_unfinished_requests():
        engine.step()
    return dict(batch=batch, ms_per_step={"median": statistics.median(windows), "min": min(windows),
                                          "max": max(windows), "runs": len(windows)},
                tokens_per_step=statistics.median(tokens), warm_steps=warm_steps)  # fmt: skip


def run_quantization(quantization: str, args, copy_gbs: float | None) -> list[dict]:
    """One engine over the quantized model; a row per batch (a failure is a row with ``error``)."""
    from hf_paged import ContinuousBatcher, EngineConfig
    from hf_paged.engine.quantization import weight_bytes
    from hf_paged.frontends.bench_workloads import build_quantized

    unquantized = "bf16" if args.device == "cuda" else "fp32"
    base = dict(quantization=quantization, weights=unquantized if quantization == "none" else quantization,
                model=args.model)  # fmt: skip
    try:
        model = build_quantized(args.model, quantization, args.device)
    except Exception as error:
        return [{**base, "batch": b, "error": f"{type(error).__name__}: {error}"[:200]} for b in args.batches]
    stored = weight_bytes(model)
    floor = {"nominal": stored / (args.peak_gbs * 1e9) * 1e3,
             "copy": None if copy_gbs is None else stored / (copy_gbs * 1e9) * 1e3}  # fmt: skip
    base.update(weight_gb=stored / 1e9, floor_ms=floor)
    rows, engine = [], None
    try:
        start = time.perf_counter()
        engine = ContinuousBatcher(model, config=EngineConfig(max_num_seqs=max(args.batches)))
        base["startup_s"] = time.perf_counter() - start
        for batch in args.batches:
            try:
                rows.append({**base, **time_batch(engine, batch, args)})
            except Exception as error:
                rows.append({**base, "batch": batch, "error": f"{type(error).__name__}: {error}"[:200]})
            print(rows[-1], flush=True)
    except Exception as error:
        done = {r["batch"] for r in rows}
        rows += [{**base, "batch": b, "error": f"{type(error).__name__}: {error}"[:200]}
                 for b in args.batches if b not in done]  # fmt: skip
    finally:
        if engine is not None:
            engine.close()
        del engine, model
        gc.collect()
        torch._dynamo.reset()  # the next quantization's model: compiled afresh, not against this one's guards
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| weights | batch | ms/step median (min-max) | output tok/s | tokens a step | weights GB "
             "| floor ms (nominal / copy BW) | step / floor (nominal) | engine start-up s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        name = r["weights"]
        if "error" in r:
            lines.append(f"| {name} | {r['batch']} | {r['error']} | - | - | - | - | - | - |")
            continue
        ms, floor = r["ms_per_step"], r["floor_ms"]
        copy = "-" if floor["copy"] is None else f"{floor['copy']:.2f}"
        lines.append(
            f"| {name} | {r['batch']} | {ms['median']:.2f} ({ms['min']:.2f}-{ms['max']:.2f}) "
            f"| {r['tokens_per_step'] / ms['median'] * 1e3:.0f} | {r['tokens_per_step']:.1f} | {r['weight_gb']:.2f} "
            f"| {floor['nominal']:.2f} / {copy} | {ms['median'] / floor['nominal']:.2f} | {r['startup_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("quant_decode_steps.py: needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    from hf_paged.frontends.bench_record import emit_table, make_record, write_record

    copy_gbs = None
    if args.device == "cuda":
        from hf_paged.frontends.bench_workloads import measure_ceilings

        copy_gbs = measure_ceilings()[0] / 1e9
    rows = [row for q in args.quantization for row in run_quantization(q, args, copy_gbs)]
    card = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    command = "python benchmarks/tools/quant_decode_steps.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    record = make_record(
        card, command,
        workload=dict(model=args.model, quantization=args.quantization, batches=args.batches,
                      prompt_tokens=args.prompt_tokens, steps=args.steps, repeats=args.repeats,
                      peak_gb_s=args.peak_gbs, copy_bandwidth_gb_s=copy_gbs),
        rows=rows,
    )  # fmt: skip
    versions = record["versions"]
    header = (
        f"### engine decode step with quantized weights: {args.model}, random weights — {card}, {record['date']}, "
        f"torch {versions['torch']}, transformers {versions['transformers']}, hf_paged {versions['hf_paged']}\n\n"
        f"B requests of {args.prompt_tokens} prompt tokens, {args.repeats} windows of {args.steps} steady decode "
        f"steps (wall clock between device syncs); floor = weights as stored / {args.peak_gbs:.0f} GB/s (nominal) / "
        f"copy bandwidth {'-' if copy_gbs is None else f'{copy_gbs:.0f}'} GB/s (measured). `{command}`"
    )
    emit_table(format_table(rows, header), args.out)
    if args.json:
        write_record(args.json, record)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
