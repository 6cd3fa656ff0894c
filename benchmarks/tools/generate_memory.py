"""Where a generate() call's peak memory goes, per system: the CUDA allocator's live blocks at the peak, by the code
that allocated them: what separates compiled PagedCache's peak from compiled StaticCache's at the same K/V bytes.

For each system, one warm-up call (compile, CUDA graphs, allocator), then one call under
``torch.cuda.memory._record_memory_history``; the trace is replayed (alloc / free events) to find the moment of the
peak, and the blocks live then are grouped by their innermost frame in hf_paged, transformers or this benchmark's
caller (a torch-internal frame when there is none). The tables print the largest groups and, against the first
system, the groups that differ.

Run (CUDA): python benchmarks/tools/generate_memory.py [--shape qwen3-0.6b] [--point 64x512] [--mode greedy]
            [--systems static paged-compiled]
"""

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/generate.py
from generate import MODES, SYSTEMS, generate_once  # noqa: E402

from hf_paged.frontends.bench_workloads import build_model  # noqa: E402

OURS = ("hf_paged", "transformers", "generate.py")
LARGEST = 8  # the largest blocks live at the peak, printed with their frames
SIZES: list[collections.Counter] = []  # each replayed peak: {block size: count live}


def _short(frame: dict) -> str:
    name = frame.get("filename", "?")
    name = name.rsplit("-packages/", 1)[-1].rsplit("/work/", 1)[-1]
    return f"{name}:{frame.get('line')} {frame.get('name')}"


def frame_label(frames: list[dict], depth: int = 2) -> str:
    """The innermost ``depth`` frames of our code, transformers' or this benchmark's (innermost first, joined by
    " < "), else the innermost frame of any code."""
    names = [f.get("filename", "") for f in frames]
    ours = [f for f, name in zip(frames, names, strict=True) if any(p in name for p in OURS) and "torch/" not in name]
    if ours:
        return " < ".join(_short(f) for f in ours[:depth])
    return _short(frames[0]) if frames else "(no frames)"


def peak_groups(snapshot: dict) -> tuple[int, dict[str, int], int]:
    """(peak bytes above the recording's start, {frame label: live bytes at the peak}, events replayed)."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live: dict[int, int] = {}
    current = peak = peak_at = 0
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])
        if current > peak:
            peak, peak_at = current, i
    owner: dict[int, dict] = {}
    for event in events[: peak_at + 1]:
        if event["action"] == "alloc":
            owner[event["addr"]] = event
        elif event["action"] == "free_completed":
            owner.pop(event["addr"], None)
    groups: dict[str, int] = collections.Counter()
    for event in owner.values():
        groups[frame_label(event.get("frames") or [])] += event["size"]
    largest = sorted(owner.values(), key=lambda e: -e["size"])[:LARGEST]
    for event in largest:
        frames = event.get("frames") or []
        print(f"    live at the peak: {event['size'] / 2**20:9.2f} MiB  {frame_label(frames, depth=4)}")
    SIZES.append(collections.Counter(e["size"] for e in owner.values()))
    return peak, dict(groups), len(events)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--point", default="64x512")
    parser.add_argument("--mode", default="greedy", choices=sorted(MODES))
    parser.add_argument("--systems", nargs="+", default=["static", "paged-compiled"], choices=SYSTEMS)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tools/generate_memory.py needs a CUDA GPU", file=sys.stderr)
        return 2
    batch, prompt = (int(x) for x in args.point.split("x"))
    model = build_model(args.shape, device="cuda")
    prompts = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    prompts = prompts.cuda()
    results = {}
    for system in args.systems:
        generate_once(model, system, prompts, args.new_tokens, args.mode)  # warm-up: compile, graphs, allocator
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        try:
            out = generate_once(model, system, prompts, args.new_tokens, args.mode)
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        peak, groups, num_events = peak_groups(snapshot)
        results[system] = groups
        print(f"\n== {system}: peak {peak / 2**20:.1f} MiB above the call's start in the trace (max_memory_allocated"
              f" above the start: {out[4] / 2**20:.1f} MiB), {num_events} allocator events")  # fmt: skip
        for label, size in sorted(groups.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {size / 2**20:10.2f} MiB  {label}")
        del out
        torch.cuda.empty_cache()
    first, *others = args.systems
    for system, sizes in zip(others, SIZES[1:], strict=False):
        extra, missing = sizes - SIZES[0], SIZES[0] - sizes
        print(
            f"\n== blocks live at {system}'s peak and not at {first}'s, by size (bytes x count): "
            f"{sum(k * v for k, v in extra.items()) / 2**20:.2f} MiB in {sorted(extra.items(), reverse=True)[:24]}"
        )
        print(f"   and the reverse: {sum(k * v for k, v in missing.items()) / 2**20:.2f} MiB in "
              f"{sorted(missing.items(), reverse=True)[:24]}")  # fmt: skip
    for system in others:
        print(f"\n== {system} minus {first}, live at each one's peak (groups differing by >= 0.1 MiB)")
        labels = set(results[first]) | set(results[system])
        diffs = {label: results[system].get(label, 0) - results[first].get(label, 0) for label in labels}
        for label, diff in sorted(diffs.items(), key=lambda kv: -abs(kv[1])):
            if abs(diff) >= 0.1 * 2**20:
                print(f"  {diff / 2**20:+10.2f} MiB  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
