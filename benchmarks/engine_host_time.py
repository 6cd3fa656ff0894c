"""Host time of ContinuousBatcher steps, phase by phase, on the CPU (no GPU needed).

With async scheduling a step's host work (schedule, input staging, sampling launch, read-back and bookkeeping)
overlaps the GPU's forward, so a workload whose forwards are short is bound by the host: the prefix workload of
``hf-paged bench`` (200 requests sharing a 341-token prefix, 10-40 own tokens, 20-80 output tokens) runs 82
steps of ~3.9 ms on an H100 (benchmarks/RESULTS.md), against a GPU floor of ~2.5 ms a step. This script runs the
same workload shape through the engine on the CPU with a one-layer tiny model, times each phase with
``time.perf_counter`` (wrappers around the engine's methods) and reports per step:

- ``host``: everything but the model's forward (schedule, the runner's input preparation, sampling, read-back and
  bookkeeping): what the host does per step whatever the device;
- its parts: ``schedule`` (Scheduler.schedule, with building the SchedulerOutput), ``prepare`` (the runner's
  work around the forward: block movements, table diffs, the plan, input tensors), ``launch`` (sampling and
  queuing the token copy), ``process`` (reading tokens back, applying them, stop checks);
- ``model``: the tiny model's forward on the CPU (torch reference attention: not a GPU figure).

``--workload decode``: 256 requests with prompts of 10-29 random tokens and 120 output tokens each (greedy,
``ignore_eos``): ~250 sequences decoding one token a step, the host's per-sequence cost at full batch.

No tokenizer by default, as ``hf-paged bench`` runs (``--tokenizer`` adds the per-token detokenization of a
character tokenizer). The engine's defaults otherwise (2048-token budget, 256 sequences, block size 16). Figures
are the median over ``--repeats`` runs of the per-step means; run it on a quiet machine and compare runs of one
session only.

Run: python benchmarks/engine_host_time.py [--workload prefix|decode] [--requests N] [--repeats 3] [--tokenizer]
     [--async-scheduling]
"""

import argparse
import collections
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import char_tokenizer, tiny_model  # noqa: E402  (tests/models.py: the test suite's tiny models)

from hf_paged import ContinuousBatcher, SamplingParams  # noqa: E402


def _timed(obj, name: str, totals: dict, key: str) -> None:
    """Wrap ``obj.name`` so that its wall time adds to ``totals[key]``."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def run_once(workload: str, num_requests: int, tokenizer: bool, seed: int, async_scheduling: bool) -> dict[str, float]:
    """One engine over a workload's shape; ms per step of each phase."""
    model = tiny_model("llama", num_hidden_layers=1)
    engine = ContinuousBatcher(model, char_tokenizer() if tokenizer else None, num_blocks=20000, block_size=16,
                               async_scheduling=async_scheduling)  # fmt: skip
    totals: dict[str, float] = collections.defaultdict(float)
    _timed(engine.scheduler, "schedule", totals, "schedule")
    _timed(engine.runner, "execute", totals, "execute")
    _timed(engine.runner.model, "forward", totals, "model")
    _timed(engine, "_launch", totals, "launch")
    _timed(engine, "_process", totals, "process")
    rng = random.Random(seed)
    if workload == "prefix":
        prefix = [rng.randrange(3, 96) for _ in range(341)]
        for _ in range(num_requests):
            prompt = prefix + [rng.randrange(3, 96) for _ in range(rng.randrange(10, 41))]
            num_out = rng.randrange(20, 81)
            engine.add_request(prompt, SamplingParams(max_new_tokens=num_out, ignore_eos=True, temperature=0.0))
    else:
        for _ in range(num_requests):
            prompt = [rng.randrange(3, 96) for _ in range(rng.randrange(10, 30))]
            engine.add_request(prompt, SamplingParams(max_new_tokens=120, ignore_eos=True, temperature=0.0))
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine._run_step()
        steps += 1
    total = time.perf_counter() - start
    engine.close()
    per_step = {key: value * 1e3 / steps for key, value in totals.items()}
    per_step["prepare"] = per_step.pop("execute") - per_step["model"]
    per_step["host"] = total * 1e3 / steps - per_step["model"]
    per_step["steps"] = steps
    return per_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("prefix", "decode"), default="prefix")
    parser.add_argument("--requests", type=int, default=None, help="default: 200 (prefix), 256 (decode)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--async-scheduling", action="store_true", help="as on CUDA: placeholders, deferred steps")
    parser.add_argument("--tokenizer", action="store_true", help="detokenize every token (a character tokenizer)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    num_requests = args.requests or (200 if args.workload == "prefix" else 256)
    runs = [
        run_once(args.workload, num_requests, args.tokenizer, 0, args.async_scheduling) for _ in range(args.repeats)
    ]
    keys = ("host", "schedule", "prepare", "launch", "process", "model")
    mode = ", async scheduling" if args.async_scheduling else ""
    print(f"{num_requests} requests, {args.workload} workload shape{mode}, {runs[0]['steps']} steps; ms per step, "
          f"median of {args.repeats} runs (min-max)")  # fmt: skip
    print("| " + " | ".join(keys) + " |")
    print("|" + "---:|" * len(keys))
    cells = []
    for key in keys:
        values = [run[key] for run in runs]
        cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
    print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
