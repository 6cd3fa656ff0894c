"""Where a ``model.generate`` decode step's time goes on a GPU: PagedCache + "paged" beside DynamicCache + sdpa.

The eager step of a small model is bound by the host (a Qwen3-0.6B step takes ~3 ms of GPU and tens of ms of host
time), and a CPU run does not pay what only a CUDA host pays: Triton's launcher, the CUDA caching allocator, device-to-
host reads. This script runs one grid cell of ``generate.py`` for both systems, alternating (step times: median and
every step), then one more call of each under ``torch.profiler`` (CPU and CUDA activities) and prints the operators by
self CPU time, with the summed device time, so the two systems' host costs can be compared op by op; ``--python``
profiles the Python functions instead (cProfile, by own time).

``--phases`` splits each decode step instead, without a profiler: the host's time from the forward's start to its
return (issuing the step's kernels), the host's time from there to the next forward (generate's logits processing,
its stop-check sync, the next step's input preparation), and the GPU's time from the forward's first kernel to its
last (CUDA events recorded at the forward's start and end, read after the call: no sync added). The GPU reaches the
end event only after the host has issued it, so a step bound by the host shows a GPU time equal to its issue time,
and one bound by the GPU a longer one. ``--syncs`` lists where the host waits on the GPU during one call (torch's
sync debug mode): the calling lines, counted per system.

``--segments`` splits each decode forward's host time at module boundaries (forward hooks, registered after
hf_paged's own): from the model's call to its decoder's body (hf_paged's plan of the step), to the first layer
(embedding, rotary, mask), through the layers, to the decoder's return (final norm, hf_paged's end of step), and
to the model's return (LM head); minimum and median per segment and system over ``--rounds`` calls each.

Run (CUDA): python benchmarks/tools/generate_profile.py [--shape qwen3-0.6b] [--batch 64] [--prompt 512]
    [--mode greedy] [--python | --phases [--syncs] | --segments]
"""

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/generate.py
import generate  # noqa: E402  (benchmarks/generate.py: the same generate call and step timer)

from hf_paged.frontends.bench_workloads import SHAPES, build_model  # noqa: E402


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
    parser.add_argument("--phases", action="store_true", help="split each step: host issue, host rest, GPU time")
    parser.add_argument("--syncs", action="store_true", help="with --phases: where the host syncs, per system")
    parser.add_argument("--segments", action="store_true", help="each decode forward's host time by module")
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
    if args.segments:
        print_segments(model, systems, prompts, args)
        return 0
    if args.phases:
        for _ in range(args.rounds):
            for system in systems:
                print(f"{system}: {format_phases(step_phases(model, system, prompts, args.new_tokens, args.mode))}")
        if args.syncs:
            for system in systems:
                print(f"\n== {system}: host syncs in one call (calling line: count)")
                for line, count in count_syncs(model, system, prompts, args.new_tokens, args.mode):
                    print(f"{count:5d}  {line}")
        return 0
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


def step_phases(model, system: str, prompts: torch.Tensor, new_tokens: int, mode: str) -> dict[str, list[float]]:
    """Per decode step of one generate call (the prefill left out): host ms from the forward's start to its return
    ("issue"), host ms from its return to the next forward's start ("rest"), GPU ms from the forward's start to its
    end ("gpu", CUDA events), and the step's wall ms (from one forward's start to the next one's)."""
    marks: list[tuple[float, torch.cuda.Event]] = []
    ends: list[tuple[float, torch.cuda.Event]] = []

    def mark(into):
        def hook(*args):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            into.append((time.perf_counter(), event))

        return hook

    pre = model.register_forward_pre_hook(mark(marks))
    post = model.register_forward_hook(mark(ends))
    try:
        generate.generate_once(model, system, prompts, new_tokens, mode)
    finally:
        pre.remove()
        post.remove()
    torch.cuda.synchronize()
    phases = {"step": [], "issue": [], "rest": [], "gpu": []}
    for i in range(1, len(ends) - 1):  # forward 0 is the prefill; the last forward has no next one
        (t0, e0), (t1, e1), (t2, _) = marks[i], ends[i], marks[i + 1]
        phases["step"].append((t2 - t0) * 1e3)
        phases["issue"].append((t1 - t0) * 1e3)
        phases["rest"].append((t2 - t1) * 1e3)
        phases["gpu"].append(e0.elapsed_time(e1))
    return phases


def format_phases(phases: dict[str, list[float]]) -> str:
    return ", ".join(f"{name} {statistics.median(values):.2f}" for name, values in phases.items()) + " ms (medians)"


def count_syncs(model, system: str, prompts: torch.Tensor, new_tokens: int, mode: str) -> list[tuple[str, int]]:
    """(calling line, count) of every host sync in one generate call, most frequent first: torch's sync debug mode
    warns at each synchronizing CUDA call; the line is the innermost frame outside torch."""
    counts: collections.Counter = collections.Counter()
    torch_dir = os.path.dirname(torch.__file__)

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if not f.filename.startswith(torch_dir) and not f.filename.endswith(("warnings.py", __file__))
        ]
        frame = frames[-1] if frames else None
        where = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}" if frame else "?"
        counts[f"{where}: {str(message)[:60]}"] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                generate.generate_once(model, system, prompts, new_tokens, mode)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = shown
    return counts.most_common()


SEGMENT_MARKS = ("model", "decoder", "layer 0", "last layer end", "decoder end", "model end")


def forward_segments(model, system: str, prompts: torch.Tensor, new_tokens: int, mode: str) -> list[dict]:
    """Host clock at each of SEGMENT_MARKS in every decode forward of one generate call (the prefill left out).
    Call after a warm-up call of a PagedCache system, so hf_paged's decoder hooks come before these."""
    marks: list[tuple[str, float]] = []

    def mark(name):
        def hook(*args):
            marks.append((name, time.perf_counter()))

        return hook

    decoder, layers = model.model, model.model.layers
    handles = [
        model.register_forward_pre_hook(mark("model")),
        decoder.register_forward_pre_hook(mark("decoder")),
        layers[0].register_forward_pre_hook(mark("layer 0")),
        layers[-1].register_forward_hook(mark("last layer end")),
        decoder.register_forward_hook(mark("decoder end")),
        model.register_forward_hook(mark("model end")),
    ]
    try:
        generate.generate_once(model, system, prompts, new_tokens, mode)
    finally:
        for handle in handles:
            handle.remove()
    forwards, current = [], {}
    for name, t in marks:
        if name == "model":
            current = {}
        current[name] = t
        if name == "model end" and len(current) == len(SEGMENT_MARKS):
            forwards.append(current)
    return forwards[1:]


def print_segments(model, systems, prompts: torch.Tensor, args) -> None:
    spans = list(zip(SEGMENT_MARKS, SEGMENT_MARKS[1:], strict=False)) + [(SEGMENT_MARKS[0], SEGMENT_MARKS[-1])]
    times: dict = {}
    for _ in range(args.rounds):
        for system in systems:
            for forward in forward_segments(model, system, prompts, args.new_tokens, args.mode):
                for start, end in spans:
                    times.setdefault((system, start, end), []).append((forward[end] - forward[start]) * 1e3)
    print(f"\n{args.shape}, {args.batch} x {args.prompt} {args.mode}: host ms of a decode forward by segment, "
          f"min (median) over {args.rounds} calls")  # fmt: skip
    print(f"| segment | {' | '.join(systems)} |")
    print("|---|" + "---:|" * len(systems))
    for start, end in spans:
        cells = [f"{min(v):.3f} ({statistics.median(v):.3f})" for v in (times[(s, start, end)] for s in systems)]
        print(f"| {start} -> {end} | {' | '.join(cells)} |")


if __name__ == "__main__":
    sys.exit(main())
