"""Compiled generate with a compileable PagedCache (``max_cache_len``), eager PagedCache and compiled StaticCache.

Random-weight model (CUDA: the Qwen3-0.6B shape in bf16, ``hf_paged.frontends.bench_workloads.SHAPES``;
``--device cpu``: the tiny shape in fp32), random prompts without padding, EOS ignored, greedy, seeded. Systems,
each called twice (the first call compiles; the second is measured):
- ``paged-eager``: ``PagedCache(model)`` (not compileable: the eager path, the reference for the logits);
- ``paged-compiled``: ``PagedCache(model, max_cache_len=prompt + new tokens)``: generate compiles its decode steps;
- ``static-compiled``: ``cache_implementation="static"``, transformers' compiled baseline.
On CUDA both compiled systems use ``CompileConfig(fullgraph=True)`` (inductor, mode "reduce-overhead" = CUDA graphs),
so a graph break fails the call; on the CPU the backend is aot_eager (no CUDA graphs), ``_compile_all_devices`` on.

Checks (exit status 1 when one fails): compiled vs eager PagedCache logits agree within ``--atol`` (over the steps
up to and including each row's first differing token: later steps see other tokens), and the second call adds no
compiled graph (no recompile). Reports ms per decode step (median interval between steps, timed by a logits
processor), peak memory above the weights during the second call (the cache included) and the share of equal
tokens, as a markdown table.

Run: ``python benchmarks/tools/cache_compile_check.py [--points 8x1024 32x512] [--new-tokens 128]``;
``--device cpu`` for a smoke run of the whole path on a tiny model.
"""

import argparse
import gc
import statistics
import sys
import time

import torch
import transformers
from torch._dynamo.utils import counters
from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

import hf_paged
from hf_paged import PagedCache
from hf_paged.frontends.bench_workloads import build_model

SYSTEMS = ("paged-eager", "paged-compiled", "static-compiled")


class StepTimer(LogitsProcessor):
    """Host clock at each step's logits (once per new token, after the forward; each CUDA step ends in a sync)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def compile_config(device: str) -> CompileConfig:
    if device == "cuda":
        return CompileConfig(fullgraph=True)  # inductor, reduce-overhead (CUDA graphs)
    config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    config._compile_all_devices = True
    return config


def cache_kwarg() -> str:
    """generate() takes the cache as ``cache`` where models do (transformers 5.2x), else ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters else "past_key_values"


def run_system(model, system: str, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Two generate calls of ``system``; returns the second call's measurements, logits and tokens."""
    device = prompts.device.type
    model.set_attn_implementation("sdpa" if system == "static-compiled" else "paged")
    model.__dict__.pop("_cache", None)  # generate's kept StaticCache from an earlier system
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    kwargs = dict(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens)
    kwargs.update(min_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    cache = None
    if system == "static-compiled":
        kwargs.update(cache_implementation="static", compile_config=compile_config(device))
    else:
        max_cache_len = prompts.shape[1] + new_tokens if system == "paged-compiled" else None
        cache = PagedCache(model, max_cache_len=max_cache_len)
        kwargs[cache_kwarg()] = cache
        if system == "paged-compiled":
            kwargs["compile_config"] = compile_config(device)
    graphs = []
    for _ in range(2):  # the first call compiles
        if cache is not None:
            cache.reset()
        graphs.append(counters["stats"]["unique_graphs"])
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        timer = StepTimer()
        out = model.generate(**kwargs, logits_processor=LogitsProcessorList([timer]))
        if device == "cuda":
            torch.cuda.synchronize()
    steps = [(b - a) * 1e3 for a, b in zip(timer.times, timer.times[1:], strict=False)]
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    compiled = system != "paged-eager"
    return dict(
        system=system,
        step_ms=statistics.median(steps),
        peak=peak,
        new_graphs=counters["stats"]["unique_graphs"] - graphs[1],
        first_graphs=graphs[1] - graphs[0],
        compiled=compiled and graphs[1] > graphs[0],  # the first call compiled a graph (a new shape each point)
        tokens=out.sequences[:, prompts.shape[1] :].cpu(),
        logits=torch.stack([x.float().cpu() for x in out.logits], dim=1),  # [batch, new_tokens, vocab]
    )


def compare_logits(ref: dict, other: dict) -> tuple[float, float]:
    """(max |logit difference| over the comparable steps, share of equal tokens)."""
    equal = ref["tokens"] == other["tokens"]  # [batch, new_tokens]
    # Step t's logits depend on the tokens before t: compare each row up to its first differing token.
    first_diff = torch.where(equal.all(dim=1), equal.shape[1] - 1, (~equal).int().argmax(dim=1))
    steps = torch.arange(equal.shape[1])[None, :] <= first_diff[:, None]  # [batch, new_tokens]
    diff = (ref["logits"] - other["logits"]).abs().amax(dim=-1)  # [batch, new_tokens]
    return diff[steps].max().item(), equal.float().mean().item()


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--points", nargs="+", default=None, help="BATCHxPROMPT (default: 1x512 8x1024 32x512)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--atol", type=float, default=None, help="logit tolerance (default: 0.5 in bf16, 1e-3 fp32)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="weights and KV (default: bf16 on CUDA, fp32 on the CPU); fp32 on CUDA makes greedy "
                        "ties rare, so compiled and eager tokens should agree almost everywhere")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.points, args.new_tokens = args.points or ["2x16"], min(args.new_tokens, 8)
    args.points = args.points or ["1x512", "8x1024", "32x512"]
    try:
        args.points = [tuple(int(n) for n in p.lower().split("x")) for p in args.points]
    except ValueError:
        parser.error(f"--points must be BATCHxPROMPT pairs such as 8x1024, got {args.points}")
    if any(len(p) != 2 or min(p) < 1 for p in args.points) or args.new_tokens < 3:
        parser.error(f"--points must be BATCHxPROMPT pairs of positive ints and --new-tokens >= 3, got {args}")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.atol is None:
        args.atol = 0.5 if args.dtype == "bf16" else 1e-3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks/tools/cache_compile_check.py needs a CUDA GPU (or --device cpu for a smoke run)",
            file=sys.stderr,
        )
        return 2
    shape = "qwen3-0.6b" if args.device == "cuda" else "tiny"
    model = build_model(shape, device=args.device)
    if args.dtype == "fp32":
        model = model.float()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [
        f"### compiled PagedCache check — {device_name}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, hf_paged {hf_paged.__version__}",
        "",
        f"{shape}, {args.dtype} random weights, greedy, {args.new_tokens} new "
        f"tokens, no padding; second of two calls; logits tolerance {args.atol}. "
        "`python benchmarks/tools/cache_compile_check.py " + " ".join(sys.argv[1:] if argv is None else argv) + "`",
        "",
        "| batch x prompt | system | compiled | ms/step | peak alloc GiB | graphs (1st call / 2nd) "
        "| max logit diff vs paged-eager | tokens equal | check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    failures = []
    for batch, prompt in args.points:
        prompts = torch.randint(
            3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)
        )
        prompts = prompts.to(args.device)
        results = {system: run_system(model, system, prompts, args.new_tokens) for system in SYSTEMS}
        ref = results["paged-eager"]
        for system, r in results.items():
            diff, same = compare_logits(ref, r)
            problems = []
            if system == "paged-compiled" and diff > args.atol:
                problems.append(f"logits differ by {diff:.3g} > {args.atol}")
            if system != "paged-eager" and not r["compiled"]:
                problems.append("generate did not compile")
            if r["new_graphs"]:
                problems.append(f"{r['new_graphs']} recompiles in the 2nd call")
            if problems:
                failures.append(f"{batch}x{prompt} {system}: {'; '.join(problems)}")
            peak = "n/a" if r["peak"] is None else f"{r['peak'] / 2**30:.2f}"
            lines.append(
                f"| {batch} x {prompt} | {system} | {'yes' if r['compiled'] else 'no'} | {r['step_ms']:.2f} | {peak} "
                f"| {r['first_graphs']} / {r['new_graphs']} | {diff:.3g} | {same:.1%} "
                f"| {'; '.join(problems) or 'ok'} |"
            )
            print(lines[-1], flush=True)
        del results
    print("\n".join(lines))
    if failures:
        print("FAILED:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
