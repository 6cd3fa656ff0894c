"""Where one engine step spends its time (GPU), and what async scheduling wins back.

Builds a random-weight model (hf_paged.frontends.bench_workloads shapes), fills the engine with ``--batch`` requests,
then:
1. times decode steps phase by phase (schedule, forward incl. the plan, sampling, read-back + bookkeeping),
   synchronising after each phase, so the phases do not overlap: their sum is the synchronous step;
2. times runs of consecutive steps in steady state with async scheduling off and on (same engine, same
   batch, alternating), through ``step()`` and through ``_run_step()`` (what ``generate`` calls, no
   RequestOutputs), with the share of the wall time the GPU is busy;
3. counts the host-device synchronisations a step makes in async mode (torch's sync debug mode: blocking
   copies, ``.item()``, ``.tolist()`` of device tensors); the one intended wait (the event of the step
   before) is not a torch op and is not counted.

4. times mixed steps (the batch's decode tokens plus one new prompt, run eagerly, without CUDA graphs).

Run: python benchmarks/tools/profile_engine.py [--model qwen3-0.6b] [--batch 256] [--prompt 512]
    [--compile none|layers|full]
Tensor parallelism: torchrun --nproc-per-node 2 benchmarks/tools/profile_engine.py --model llama-8b --model-dir DIR
    --tp
"""

import argparse
import statistics
import time
import warnings

import torch

from hf_paged import ContinuousBatcher, EngineConfig, SamplingParams
from hf_paged.frontends.bench_workloads import load_or_build


def _steady(engine: ContinuousBatcher, async_on: bool, steps: int, outputs: bool) -> tuple[float, float]:
    """ms per step and the share of the wall time the GPU is busy with the steps' work.

    outputs: call ``step()`` (builds RequestOutputs) rather than ``_run_step()`` (what ``generate`` calls).
    The GPU's busy time is measured between a CUDA event recorded before each step's forward is queued
    and one after its sampling, so gaps between steps (the GPU waiting for the host) are not counted.
    """
    engine.async_scheduling = async_on
    run = engine.step if outputs else engine._run_step
    for _ in range(3):
        run()
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    execute, launch = engine.runner.execute, engine._launch

    def timed_execute(*args, **kwargs):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        marks.append((start, None))
        return execute(*args, **kwargs)

    def timed_launch(*args, **kwargs):
        launched = launch(*args, **kwargs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        marks[-1] = (marks[-1][0], end)
        return launched

    engine.runner.execute, engine._launch = timed_execute, timed_launch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    finally:
        engine.runner.execute, engine._launch = execute, launch
    wall = time.perf_counter() - t0
    busy = sum(start.elapsed_time(end) for start, end in marks) / 1e3
    return wall / steps * 1e3, busy / wall


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compile", default="none", choices=["none", "layers", "full"], help="compile_model")
    parser.add_argument("--torch-profile", action="store_true", help="print torch.profiler's top CPU/GPU ops")
    parser.add_argument("--model-dir", help="load the random-weight model from DIR (saved there first)")
    parser.add_argument("--tp", action="store_true", help="tensor parallelism under torchrun (needs --model-dir)")
    args = parser.parse_args()
    model = load_or_build(args.model, args.model_dir, args.tp)
    rank = torch.distributed.get_rank() if args.tp else 0
    say = print if rank == 0 else (lambda *a, **k: None)
    config = EngineConfig(memory_fraction=0.5, max_num_batched_tokens=8192, max_num_seqs=args.batch,
                          compile_model=False if args.compile == "none" else args.compile,
                          async_scheduling=False)  # fmt: skip
    engine = ContinuousBatcher(model, config=config)
    gen = torch.Generator().manual_seed(0)
    max_new = min(10_000, (engine.info.max_model_len or 1 << 30) - args.prompt)  # never finishes while timed
    for _ in range(args.batch):
        ids = torch.randint(10, 1000, (args.prompt,), generator=gen).tolist()
        engine.add_request(ids, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
    while any(not o.outputs[0].token_ids for o in map(engine.get_output, list(engine.requests))):
        engine.step()  # prefill everything
    for _ in range(3):
        engine.step()

    phases = {"schedule": [], "forward": [], "sample": [], "read+book": [], "step total": []}
    runner, sched_fn = engine.runner, engine.scheduler.schedule
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sched = sched_fn()
        t1 = time.perf_counter()
        logits = runner.execute(sched)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        launched = engine._launch(sched, logits)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        engine._process(launched, {})
        t4 = time.perf_counter()
        for name, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
            phases[name].append(value * 1e3)
    tp = f", tp={model.tp_size}" if args.tp else ""
    say(f"{args.model}{tp}, batch {args.batch}, context ~{args.prompt}: median ms per decode step, phases serialised")
    for name, values in phases.items():
        say(f"  {name:12s} {statistics.median(values):8.2f}")

    say("steady state: ms per step, share of the wall time the GPU is busy (one sync at the end)")
    for outputs in (False, True):
        for async_on in (False, True, False, True):
            ms, busy = _steady(engine, async_on, args.steps, outputs)
            api = "step()     " if outputs else "_run_step()"
            say(f"  {api} async_scheduling={async_on!s:5s} {ms:8.2f} ms  GPU busy {busy:6.1%}")

    mixed = []
    for _ in range(5):  # swap one request for a new prompt: its prefill runs with everyone's decode token
        engine._drain()
        victim = next(iter(engine.requests))
        engine.abort(victim)
        ids = torch.randint(10, 1000, (args.prompt,), generator=gen).tolist()
        engine.add_request(ids, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine._run_step()
        engine._drain()
        torch.cuda.synchronize()
        mixed.append((time.perf_counter() - t0) * 1e3)
    say(
        f"mixed step ({args.batch - 1} decode tokens + a {args.prompt}-token prompt, eager): "
        f"median {statistics.median(mixed):.2f} ms"
    )

    engine.async_scheduling = True
    engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(5):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [
        f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in caught if "ynchroniz" in str(w.message)
    ]
    say(f"host-device syncs flagged by torch in 5 async steps: {len(syncs)}")
    for message in sorted(set(syncs))[:10]:
        say(f"  {message}")

    if args.torch_profile and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
        say(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    if args.tp:
        engine.close()  # graphs with captured NCCL work must go first (pytorch/pytorch#115388)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
