"""Where a workload's time goes, step by step: each step's GPU time beside its own floor, and the GPU's idle gaps.

Runs one of ``hf-paged bench``'s workloads through a default engine (warm-up as the bench does, then one traced
run and ``--repeats`` more untraced ones for the wall time), recording for every forward: its kind (a decode
step, or a mixed step carrying prompt tokens), the sequences and tokens in it, the graph bucket it replays (or
eager), the keys its tokens attend to, and CUDA events around its forward and sampling. It then reports, per
kind and batch range: steps, GPU ms (forward + sampling), the floor of those steps (the bench's formula applied
per step: the weights once, every attended KV byte, over the copy bandwidth, plus 2 x parameters x prompt tokens
over the matmul rate), GPU ms over floor, and the GPU's idle time before the steps (the device waiting for the
host). The sum of the per-step floors is the bench's floor up to its wave model.

Run: python benchmarks/tools/engine_trace.py [--workload nano] [--model qwen3-0.6b] [--no-prefix-caching]
     [--cascade-attention auto|on|off]
On a CPU (a smoke test): --device cpu --model tiny (times are wall clock around each phase, synchronous).
"""

import argparse
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from hf_paged import ContinuousBatcher, EngineConfig, SamplingParams
from hf_paged.frontends.bench import ON_OFF
from hf_paged.frontends.bench_workloads import WORKLOADS, build_model, make_workload, measure_ceilings


@dataclass
class StepRecord:
    num_seqs: int
    num_tokens: int
    prompt_tokens: int  # tokens of rows that compute more than one token (prompt chunks, recompute)
    attended: int  # keys the step's decode rows attend to, summed (the bench's floor counts decode reads only)
    bucket: str  # "decode 256", "mixed 2048", "eager"
    start: object = None  # CUDA event before the forward is queued (float seconds on the CPU)
    end: object = None  # after the sampling is queued


def _attended(num_computed: list[int], num_new: list[int]) -> int:
    # a decode row's token attends num_computed + 1 keys; prompt chunks are charged FLOPs, as in the bench's floor
    return sum(c + 1 for c, n in zip(num_computed, num_new, strict=True) if n == 1)


def _range(n: int) -> str:
    for hi in (1, 8, 32, 64, 128, 192, 256, 512, 1024, 2048, 4096, 8192):
        if n <= hi:
            return f"<= {hi}"
    return "> 8192"


def trace(engine: ContinuousBatcher, workload, cuda: bool) -> tuple[list[StepRecord], object, object]:
    """The run's step records, and marks at the start and end of its ``generate`` call."""
    records: list[StepRecord] = []
    runner = engine.runner
    execute, launch, bucket_fn = runner.execute, engine._launch, runner.graph_bucket
    chosen: list = [None]

    def mark():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def timed_bucket(*args, **kwargs):
        chosen[0] = bucket_fn(*args, **kwargs)
        return chosen[0]

    def timed_execute(sched, *args, **kwargs):
        if sched.is_empty:
            return execute(sched, *args, **kwargs)
        chosen[0] = None
        multi = [n for n in sched.num_new_tokens if n > 1]
        rec = StepRecord(len(sched.seq_ids), sched.num_batched_tokens, sum(multi),
                         _attended(sched.num_computed, sched.num_new_tokens), "")  # fmt: skip
        rec.start = mark()
        cascade_before = runner.graph_steps["cascade"]
        out = execute(sched, *args, **kwargs)
        kind = "cascade" if runner.graph_steps["cascade"] > cascade_before else None  # the shared-prefix decode graph
        rec.bucket = "eager" if chosen[0] is None else f"{kind or chosen[0][0]} {chosen[0][1]}"
        records.append(rec)
        return out

    def timed_launch(*args, **kwargs):
        launched = launch(*args, **kwargs)
        records[-1].end = mark()
        return launched

    runner.execute, engine._launch, runner.graph_bucket = timed_execute, timed_launch, timed_bucket
    try:
        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
        engine.reset_prefix_cache()
        if cuda:
            torch.cuda.synchronize()
        begin = mark()
        engine.generate(workload.prompts, params, use_tqdm=False)
        end = mark()
        if cuda:
            torch.cuda.synchronize()
    finally:
        runner.execute, engine._launch, runner.graph_bucket = execute, launch, bucket_fn
    return records, begin, end


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="nano", choices=WORKLOADS)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--cascade-attention",
        default="auto",
        choices=["auto", "on", "off"],
        help="shared-prefix decode (EngineConfig.cascade_attention; auto: on for CUDA)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="untraced runs for the wall time")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--steps", action="store_true", help="also print every step")
    parser.add_argument("--profile", action="store_true", help="list the kernels of one more run (torch.profiler)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    warnings.filterwarnings("ignore")
    model = build_model(args.model, args.device)
    workload = make_workload(args.workload, model.config.vocab_size, args.num_requests)
    if cuda:
        bandwidth, flops = measure_ceilings()
    else:
        bandwidth, flops = 20e9, 0.2e12  # nominal: the CPU run checks the script, not the machine
    extra = {} if args.max_num_batched_tokens is None else dict(max_num_batched_tokens=args.max_num_batched_tokens)
    config = EngineConfig(
        enable_prefix_caching=not args.no_prefix_caching, cascade_attention=ON_OFF[args.cascade_attention], **extra
    )
    if not cuda:
        config.compile_model = False
    engine = ContinuousBatcher(model, config=config)
    engine.generate([workload.prompts[0]], SamplingParams(max_new_tokens=1, ignore_eos=True), use_tqdm=False)
    engine.generate(workload.prompts[:4], [SamplingParams(max_new_tokens=8, ignore_eos=True)] * 4, use_tqdm=False)
    walls = []
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    for _ in range(args.repeats):
        engine.reset_prefix_cache()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(workload.prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    records, begin, end = trace(engine, workload, cuda)
    traced_wall = time.perf_counter() - t0

    config_m = model.config
    params_n = sum(p.numel() for p in model.parameters())
    weight_bytes = 2 * params_n
    kv_heads = getattr(config_m, "num_key_value_heads", config_m.num_attention_heads)
    head_dim = getattr(config_m, "head_dim", None) or config_m.hidden_size // config_m.num_attention_heads
    kv_per_token = 2 * config_m.num_hidden_layers * kv_heads * head_dim * 2

    def floor_ms(r: StepRecord) -> float:
        return ((weight_bytes + r.attended * kv_per_token) / bandwidth + 2 * params_n * r.prompt_tokens / flops) * 1e3

    def elapsed_ms(a, b) -> float:
        return a.elapsed_time(b) if cuda else (b - a) * 1e3

    groups: dict[str, dict] = {}
    total_idle = 0.0
    for i, r in enumerate(records):
        kind = "mixed" if r.prompt_tokens else "decode"
        key = f"{kind} {_range(r.num_seqs)} seqs" if kind == "decode" else f"mixed {_range(r.num_tokens)} tokens"
        g = groups.setdefault(key, dict(steps=0, gpu=0.0, floor=0.0, idle=0.0, tokens=0, buckets={}))
        gpu = elapsed_ms(r.start, r.end)
        idle = max(0.0, elapsed_ms(records[i - 1].end, r.start)) if i and cuda else 0.0
        total_idle += idle
        g["steps"] += 1
        g["gpu"] += gpu
        g["floor"] += floor_ms(r)
        g["idle"] += idle
        g["tokens"] += r.num_tokens
        g["buckets"][r.bucket] = g["buckets"].get(r.bucket, 0) + 1
        if args.steps:
            print(f"step {i:5d} {kind:6s} seqs {r.num_seqs:4d} tokens {r.num_tokens:5d} {r.bucket:12s} "
                  f"gpu {gpu:7.3f} ms floor {floor_ms(r):7.3f} idle before {idle:7.3f}")  # fmt: skip
    gpu_total = sum(g["gpu"] for g in groups.values())
    median_wall = statistics.median(walls) if walls else float("nan")
    floor_total = sum(g["floor"] for g in groups.values())
    print(f"{args.model}, workload {args.workload} ({len(workload.prompts)} requests, {workload.num_prompt_tokens} "
          f"prompt / {workload.num_output_tokens} output tokens), prefix caching {not args.no_prefix_caching}, "
          f"cascade {engine.runner.cascade_attention}, "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}, copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
          f"matmul {flops / 1e12:.0f} TFLOP/s")  # fmt: skip
    print(
        f"untraced runs: {', '.join(f'{w:.3f}' for w in walls)} s (median {median_wall:.3f}); "
        f"traced run {traced_wall:.3f} s, {len(records)} forwards"
    )
    print(
        f"traced: GPU busy {gpu_total / 1e3:.3f} s, idle between steps {total_idle / 1e3:.3f} s, sum of the "
        f"steps' floors {floor_total / 1e3:.3f} s (GPU busy / floor {gpu_total / max(floor_total, 1e-9):.2f}); "
        f"before the first forward {elapsed_ms(begin, records[0].start):.1f} ms, after the last "
        f"{elapsed_ms(records[-1].end, end):.1f} ms\n"
    )
    print("| steps | count | tokens | GPU ms | floor ms | GPU / floor | idle ms before | GPU ms a step | buckets |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for key in sorted(groups, key=lambda k: (k.split()[0], int(k.split()[2]) if k.split()[2].isdigit() else 1 << 30)):
        g = groups[key]
        buckets = ", ".join(f"{b} x{n}" for b, n in sorted(g["buckets"].items(), key=lambda kv: -kv[1])[:3])
        print(
            f"| {key} | {g['steps']} | {g['tokens']} | {g['gpu']:.1f} | {g['floor']:.1f} | "
            f"{g['gpu'] / max(g['floor'], 1e-9):.2f} | {g['idle']:.1f} | {g['gpu'] / g['steps']:.3f} | {buckets} |"
        )
    if args.profile and cuda:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/tools/step_kernels.py
        from step_kernels import kernel_table  # noqa: PLC0415

        engine.reset_prefix_cache()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.generate(workload.prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        print(f"\n### The kernels of one more run ({len(records)} forwards), µs in the whole run\n")
        print(kernel_table(prof, 1, 40).replace("a step", "in the run"))


if __name__ == "__main__":
    main()
