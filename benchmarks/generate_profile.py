"""Where a ``model.generate`` decode step's time goes on a GPU: PagedCache + "paged" beside DynamicCache + sdpa.

The eager step of a small model is bound by the host (benchmarks/RESULTS.md: 28-60 ms a step for Qwen3-0.6B on the
device tool's H100 hosts, ~3 ms of it on the GPU), and the CPU harness (``cache_host_time.py``) does not run what
only a CUDA host pays: Triton's launcher, the CUDA caching allocator, device-to-host reads. This script runs one
grid cell of ``generate.py`` for both systems, alternating (step times: median and every step), then one more call
of each under ``torch.profiler`` (CPU and CUDA activities) and prints the operators by self CPU time, with the
summed device time, so the two systems' host costs can be compared op by op; ``--python`` profiles the Python
functions instead (cProfile, by own time).

Run (CUDA): python benchmarks/generate_profile.py [--shape qwen3-0.6b] [--batch 64] [--prompt 512] [--mode greedy]
    [--python]
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate  # noqa: E402  (benchmarks/generate.py: the same generate call and step timer)

from hf_paged.frontends.bench import SHAPES, build_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--mode", default="greedy", choices=sorted(generate.MODES))
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2, help="timed calls per system before the profiled one")
    parser.add_argument("--rows", type=int, default=25, help="operators printed per system")
    parser.add_argument(
        "--python",
        action="store_true",
        help="profile the Python functions (cProfile, by own "
        "time) instead of torch's operators: where the host's time goes inside the step",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the costs it looks for are the CUDA host's)")
    model = build_model(args.shape)
    generator = torch.Generator(device="cuda").manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device="cuda", generator=generator)
    systems = ("dynamic", "paged")
    for system in systems:  # warm-up: kernels compiled, allocator pools grown
        generate.generate_once(model, system, prompts, 4, args.mode)
    for _ in range(args.rounds):
        for system in systems:
            steps = generate.generate_once(model, system, prompts, args.new_tokens, args.mode)[2]
            print(f"{system}: step ms median {statistics.median(steps):.2f}; steps {[round(x, 1) for x in steps]}")
    if args.python:
        for system in systems:
            profiler = cProfile.Profile()
            profiler.enable()
            steps = generate.generate_once(model, system, prompts, args.new_tokens, args.mode)[2]
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.rows)
            print(f"\n== {system} (cProfile): step ms median {statistics.median(steps):.2f}")
            print(text.getvalue())
        return 0
    for system in systems:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            steps = generate.generate_once(model, system, prompts, args.new_tokens, args.mode)[2]
        averages = prof.key_averages()
        device_ms = sum(event.self_device_time_total for event in averages) / 1e3
        print(f"\n== {system} (profiled call): step ms median {statistics.median(steps):.2f}, device time "
              f"{device_ms:.1f} ms over the call's prefill and {len(steps)} steps")  # fmt: skip
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
