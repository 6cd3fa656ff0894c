"""Where one engine step spends its time (GPU): schedule, plan, forward, sample, bookkeeping.

Builds a random-weight model (hf_paged.bench shapes), fills the engine with ``--batch`` requests and
times decode steps phase by phase, synchronising after each phase (so phases do not overlap here the way
they do in a real run: the sum is an upper bound of the step time).

Run: python benchmarks/profile_engine.py [--model qwen3-0.6b] [--batch 256] [--prompt 512]
"""

import argparse
import statistics
import time

import torch

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.bench import build_model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--torch-profile", action="store_true", help="print torch.profiler's top CPU/GPU ops")
    args = parser.parse_args()
    model = build_model(args.model)
    engine = ContinuousBatcher(
        model, memory_fraction=0.5, max_num_batched_tokens=8192, max_num_seqs=args.batch, compile_model=args.compile
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.batch):
        ids = torch.randint(10, 1000, (args.prompt,), generator=gen).tolist()
        engine.add_request(ids, SamplingParams(max_new_tokens=10_000, temperature=0.0, ignore_eos=True))
    while any(len(r.seqs[0].token_ids) == r.seqs[0].num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # prefill everything
    for _ in range(3):
        engine.step()
    phases = {"schedule": [], "tables": [], "forward": [], "sample+book": [], "step total": []}
    runner, sched_fn = engine.runner, engine.scheduler.schedule
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sched = sched_fn()
        t1 = time.perf_counter()
        tables = [engine.pool.get_block_table(c.seq.seq_id) for c in sched.chunks]
        t2 = time.perf_counter()
        logits = runner.execute(sched, tables)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        for chunk in sched.chunks:
            chunk.seq.num_computed = chunk.end
        engine._process_logits(sched, logits, {})
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        for name, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
            phases[name].append(value * 1e3)
    print(f"{args.model}, batch {args.batch}, context ~{args.prompt}: median ms per decode step")
    for name, values in phases.items():
        print(f"  {name:12s} {statistics.median(values):8.2f}")
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
