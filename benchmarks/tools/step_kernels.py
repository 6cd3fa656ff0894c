"""The GPU kernels of one engine decode step, per batch size: what a captured step spends its device time on.

Builds a default engine (compiled decoder layers, CUDA graphs, async scheduling) over a random-weight model, fills
it with ``--batch`` requests of ``--prompt`` tokens, then for each batch size of ``--sizes`` (largest first,
aborting requests in between) profiles ``--steps`` decode steps with torch.profiler and prints the kernels by
device time per step: name, launches per step, µs per step, share of the step's kernel time.

``--shared-prefix N``: every prompt starts with the same N tokens (prefix caching shares their full blocks, and the
default engine's decode steps on CUDA read them once per step: shared-prefix "cascade" decode), as in the bench's
prefix workload (a 341-token prefix, 21 full blocks of 16: ``--batch 224 --prompt 400 --shared-prefix 341``).

``--chunk N``: each profiled step also carries one new N-token prompt (a mixed step: decode rows and a prompt chunk).

Run: python benchmarks/tools/step_kernels.py [--model qwen3-0.6b] [--batch 256] [--prompt 512] [--sizes 256 64 1]
     [--shared-prefix N] [--chunk N]
"""

import argparse
import collections
import warnings

import torch

from hf_paged import ContinuousBatcher, EngineConfig, SamplingParams
from hf_paged.frontends.bench import ON_OFF, build_model


def kernel_table(prof, steps: int, top: int) -> str:
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = per_name[event.name[:90]]
        entry[0] += 1
        entry[1] += event.device_time if hasattr(event, "device_time") else event.cuda_time
    total = sum(v[1] for v in per_name.values())
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    lines = [f"kernel time {total / steps:.1f} µs a step, {sum(v[0] for v in per_name.values()) / steps:.0f} "
             "launches a step", "| kernel | per step | µs a step | share |", "|---|---:|---:|---:|"]  # fmt: skip
    for name, (count, us) in rows[:top]:
        lines.append(f"| `{name}` | {count / steps:.1f} | {us / steps:.1f} | {us / total:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 64, 1])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no kernels to list)")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    parser.add_argument(
        "--cascade-attention",
        default="auto",
        choices=["auto", "on", "off"],
        help="EngineConfig.cascade_attention (auto: on for CUDA)",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="each profiled step also carries one new prompt of this many tokens (a mixed step)",
    )
    parser.add_argument("--no-fuse", dest="fuse", action="store_false", help="EngineConfig(fuse_projections=False)")
    args = parser.parse_args(argv)
    if not 0 <= args.shared_prefix <= args.prompt:
        parser.error(f"--shared-prefix must be in [0, --prompt={args.prompt}], got {args.shared_prefix}")
    warnings.filterwarnings("ignore")
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = EngineConfig(compile_model=None if cuda else False, fuse_projections=None if args.fuse else False,
                          cascade_attention=ON_OFF[args.cascade_attention]).resolved(args.device)  # fmt: skip
    if args.chunk and max(args.sizes) >= config.max_num_seqs:  # a full batch admits no new prompt
        parser.error(f"--chunk needs every --sizes below max_num_seqs ({config.max_num_seqs}), to leave the prompt "
                     f"a row: {args.sizes}")  # fmt: skip
    model = build_model(args.model, args.device)  # after the checks: building the 8B shape takes a while
    engine = ContinuousBatcher(model, config=config)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=2000, temperature=0.0, ignore_eos=True)
    shared = torch.randint(10, 1000, (args.shared_prefix,), generator=gen).tolist()
    for _ in range(args.batch):
        own = torch.randint(10, 1000, (args.prompt - args.shared_prefix,), generator=gen).tolist()
        engine.add_request(shared + own, params)
    while any(not o.outputs[0].token_ids for o in map(engine.get_output, list(engine.requests))):
        engine.step()  # prefill everything
    for size in sorted(args.sizes, reverse=True):
        for request_id in list(engine.requests)[size:]:  # aborted requests leave at the next step
            engine.abort(request_id)
        for _ in range(5):
            engine.step()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                if args.chunk:  # one token to sample: the request ends with its prefill, the batch stays at size
                    prompt = torch.randint(10, 1000, (args.chunk,), generator=gen).tolist()
                    engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
                engine.step()
            sync()
        kind = f"mixed: decode batch {size} + a {args.chunk}-token prompt" if args.chunk else f"decode batch {size}"
        print(
            f"\n### {args.model}, {kind}, context ~{args.prompt} ({args.shared_prefix} shared), "
            f"{args.steps} steps profiled, projections fused: {bool(engine.runner.fused_groups)}, graph replays "
            f"so far {engine.runner.graph_steps}, shared-prefix steps so far {engine.runner.num_cascade_steps}"
        )
        print(kernel_table(prof, args.steps, args.top))
    engine.close()


if __name__ == "__main__":
    main()
