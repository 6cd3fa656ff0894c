"""Eager ``model.generate`` steps: DynamicCache + sdpa beside PagedCache + "paged" with a module switch at two values.

A host-bound eager step moves by a few percent with host-side changes, less than a shared host's noise between
processes; this script runs DynamicCache and PagedCache at each switch value in one process, alternating call by
call (``--rounds`` rounds), so every system sees the same host, and reports each one's median of per-call median
step times, its fastest step, and its median ratio to DynamicCache's step in the same round (paired). The switch
is put back to its value afterwards. ``--device cpu``: a smoke run on the CPU references (no host-cost meaning).

Example, the eager decode step's kept launch (hf_paged.core.attention.DECODE_BINDING)::

    python benchmarks/eager_ab.py --shape llama-8b --batch 64 --switch hf_paged.core.attention.DECODE_BINDING \\
        --values True False

Steps are generate.py's (a logits processor's clock, once per new token); ``--new-tokens`` per call; ``--mode``
greedy (default), samples4 or beams4 as generate.py names them (sampling seeded alike for every call).
"""

import argparse
import ast
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate  # noqa: E402  (benchmarks/generate.py: the same generate call and step timer)

from hf_paged.frontends.bench import SHAPES, build_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--switch", required=True, help="MODULE.NAME of a module-level switch, e.g. a bool")
    parser.add_argument("--mode", default="greedy", choices=list(generate.MODES))
    parser.add_argument("--values", nargs=2, required=True, help="two Python literals for the switch")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (the CPU references, not the CUDA host)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (an eager step's host cost is the CUDA host's); --device cpu: a smoke run")
    module_name, _, name = args.switch.rpartition(".")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        parser.error(f"{module_name} has no attribute {name!r}")
    values = [ast.literal_eval(v) for v in args.values]
    original = getattr(module, name)
    try:
        return run(args, module, name, values)
    finally:
        setattr(module, name, original)


def run(args, module, name: str, values: list) -> int:
    model = build_model(args.shape, args.device)
    if args.device == "cpu":
        model = model.float()  # the CPU references run in fp32
    gen = torch.Generator(device=args.device).manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device=args.device, generator=gen)
    systems = {"DynamicCache + sdpa": ("dynamic", values[0])}
    systems.update({f"PagedCache, {name}={v!r}": ("paged", v) for v in values})
    medians = {label: [] for label in systems}
    fastest = {label: [] for label in systems}
    outputs = {}
    for system, value in systems.values():  # warm-up: kernels compiled, allocator pools grown
        setattr(module, name, value)
        generate.generate_once(model, system, prompts, 4, args.mode)
    for _ in range(args.rounds):
        for label, (system, value) in systems.items():
            setattr(module, name, value)
            result = generate.generate_once(model, system, prompts, args.new_tokens, args.mode)
            medians[label].append(statistics.median(result[2]))
            fastest[label].append(min(result[2]))
            outputs[label] = result[6]
    base = medians["DynamicCache + sdpa"]
    card = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{args.shape}, {args.batch} x {args.prompt} {args.mode}, {args.new_tokens} new tokens, "
          f"{args.rounds} rounds, {card}: ms a decode step")  # fmt: skip
    print("| system | median of call medians | fastest step | paired / DynamicCache (median) |")
    print("|---|---:|---:|---:|")
    for label in systems:
        paired = statistics.median(m / b for m, b in zip(medians[label], base, strict=True))
        print(f"| {label} | {statistics.median(medians[label]):.2f} | {min(fastest[label]):.2f} | {paired:.3f} |")
    paged = [outputs[label] for label in systems if label.startswith("PagedCache")]
    print(f"PagedCache's tokens equal at both values: {torch.equal(paged[0], paged[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
