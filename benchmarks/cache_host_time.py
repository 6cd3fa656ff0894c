"""Host time of a generate() decode step: PagedCache + "paged" beside DynamicCache + "sdpa", on the CPU.

On a GPU, a small model's decode step is bound by the host: the GPU waits for Python to launch each kernel. This
script measures that host time on the CPU (``time.process_time``, one torch thread) with a model of Qwen3-0.6B's
depth (28 layers) and tiny widths, so the numbers are the per-step Python and dispatch cost, not arithmetic:

- ``dynamic``: DynamicCache + sdpa (torch's CPU kernels; tiny shapes, so this is mostly dispatch);
- ``paged``: PagedCache + "paged" with the kernels (``write_kv``, ``paged_attention``) replaced by no-ops, so the
  number is hf_paged's host work per step (the plan of each forward and the per-layer glue) plus the model;
- ``plan``: of that, the time in ``PagedCache._begin_forward`` (the per-forward plan: slots, tables, lengths).

``--wrappers`` keeps the kernels' Python wrappers instead of stubbing them: the dispatchers of hf_paged.kernels
(``write_kv``, ``paged_attention``) take their CUDA branch on these CPU tensors (their source is run with the device
test flipped, nothing else changed), so the Triton launchers' checks, output and scratch allocations, split
heuristics and argument packing all run; only ``Launcher.__call__`` (kernels/launch.py: the launch-key lookup and
``CompiledKernel.run``) and the kept launch (``Launcher.bind``'s ``BoundLaunch.launch``) are no-ops. What this
leaves out of the GPU host's cost: the launch itself, the CUDA caching allocator (``torch.empty`` on CPU is
cheaper), ``torch.cuda.current_device()`` in ``on_device`` and the SM count lookup, which the CPU branch of those
helpers skips. Copy-on-write (``KVPool.copy_blocks``) keeps its CPU path: a reference copy a layer, where CUDA
makes one launch for all layers.

A step's host time runs from the start of one forward to the start of the next (the forward, then generate's
sampling and input preparation), measured with ``time.process_time``; each run gives the median over its decode
steps, and the table the minimum over ``--repeats`` runs and, in brackets, their median (on a shared machine other
processes only ever add time, so the minimum is the steadier number). The DynamicCache and PagedCache runs
alternate, so both see the same load. The CUDA launch cost of the kernels is not in these numbers; nor, for
DynamicCache, is its arithmetic left out: at large batch and prompt its CPU attention and concatenations compute for
real, so that column is not a host cost there.

``--mode`` picks generate's decoding as benchmarks/generate.py names it: ``greedy``, ``samples4``
(``do_sample=True, num_return_sequences=4, top_k=50``: 4 rows a prompt) or ``beams4`` (``num_beams=4``).

Run: python benchmarks/cache_host_time.py [--batch 1 64] [--prompt 512] [--new-tokens 32] [--wrappers]
[--mode greedy|samples4|beams4]
"""

import argparse
import functools
import inspect
import statistics
import time

import hf_paged.kernels as kernels_module
import torch
import transformers
from hf_paged.kernels import launch as launch_module
from transformers import DynamicCache

import hf_paged.core.attention as paged_attention_module
import hf_paged.cache.paged_cache as cache_module
from hf_paged import PagedCache


def build_model(num_layers: int = 28) -> torch.nn.Module:
    """Qwen3-0.6B's depth and head layout at tiny widths (host cost per layer, no arithmetic to speak of)."""
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval()


def stub_kernels() -> None:
    """Replace the paged kernels by no-ops: what is left of a step is host work."""

    def write_kv(*args, **kwargs):
        pass

    def paged_attention(query, *args, out=None, **kwargs):
        return torch.empty_like(query) if out is None else out

    cache_module.write_kv = write_kv
    paged_attention_module.write_kv = write_kv
    paged_attention_module.paged_attention = paged_attention
    gpu_decode_branch()


def _flip_device_test(module, name: str, device_test: str, targets: tuple) -> None:
    """Run ``module.name``'s own source with ``device_test`` flipped (``is_cuda`` -> ``is_cpu``) and install it in
    ``targets``: the CPU tensors here then take the branch a GPU takes."""
    source = inspect.getsource(getattr(module, name))
    if source.count(device_test) != 1:
        raise RuntimeError(f"cache_host_time: {name} no longer tests its device with {device_test!r}; update this")
    scope = dict(vars(module))
    exec(source.replace(device_test, device_test.replace("is_cuda", "is_cpu")), scope)  # noqa: S102
    for target in targets:
        if hasattr(target, name):
            setattr(target, name, scope[name])


def gpu_decode_branch() -> None:
    """The eager decode step's attention takes its GPU branch (``paged_attention``), not the CPU one (the vectorised
    decode reference, real arithmetic)."""
    module = paged_attention_module
    _flip_device_test(module, "_context_attention", "if not query.is_cuda and", (module,))


def keep_wrappers() -> None:
    """Run the kernels' Python wrappers on these CPU tensors with no-op launches (see the module docstring)."""

    def no_launch(self, grid, *args, **options):
        pass

    class NoBoundLaunch:  # what Launcher.bind keeps (kernels.launch.BoundLaunch), minus the launch
        def launch(self, *values):
            pass

    launch_module.Launcher.__call__ = no_launch
    launch_module.Launcher.bind = lambda self, grid, args, positions, **options: NoBoundLaunch()
    torch.cuda.current_device = lambda: 0  # DecodeBinding checks the device of each layer's launch
    # The dispatchers send CPU tensors to the torch references: run their own source with the device test flipped.
    for name, device_test in (("write_kv", "if k_cache.is_cuda:"), ("paged_attention", "if not query.is_cuda:")):
        _flip_device_test(kernels_module, name, device_test, (kernels_module, cache_module, paged_attention_module))
    gpu_decode_branch()


class PlanTimer:
    """Accumulates the process time spent in PagedCache._begin_forward."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        begin = cache_module.PagedCache._begin_forward

        def timed(cache, *args, **kwargs):
            start = time.process_time()
            try:
                return begin(cache, *args, **kwargs)
            finally:
                self.seconds += time.process_time() - start
                self.calls += 1

        cache_module.PagedCache._begin_forward = timed


# The kernels do not run here, so the logits can hold NaN or inf: remove_invalid_values keeps sampling and beam
# scores finite (both caches pay for it), so that every call runs its full number of steps.
MODES = {
    "greedy": dict(do_sample=False),
    "samples4": dict(do_sample=True, num_return_sequences=4, top_k=50, remove_invalid_values=True),
    "beams4": dict(do_sample=False, num_beams=4, remove_invalid_values=True),
}


def decode_step_ms(
    model, make_cache, prompts: torch.Tensor, new_tokens: int, timer: PlanTimer | None = None, mode: str = "greedy"
):
    """(host ms of each decode step, plan ms of each decode step) of one generate() call.

    A step runs from one forward's start to the next one's (the forward, then generate's sampling and input
    preparation); the first forward (the prefill) is left out.
    """
    marks, plans = [], []

    def mark(module, args, kwargs):
        marks.append(time.process_time())
        plans.append(timer.seconds if timer else 0.0)

    handle = model.register_forward_pre_hook(mark, with_kwargs=True)
    try:
        model.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, past_key_values=make_cache(), **MODES[mode],
        )  # fmt: skip
    finally:
        handle.remove()
    if len(marks) != new_tokens:  # a call that ends early would time other steps than its peers
        raise RuntimeError(f"generate ran {len(marks)} forwards for {new_tokens} new tokens")
    steps = [(b - a) * 1e3 for a, b in zip(marks[1:], marks[2:], strict=False)]
    plan_steps = [(b - a) * 1e3 for a, b in zip(plans[1:], plans[2:], strict=False)]
    return steps, plan_steps


def step_ms(model, runs: dict, prompts, new_tokens: int, repeats: int, timer: PlanTimer, mode: str = "greedy"):
    """Per run, the median host ms of a decode step (and of its plan) of each of ``runs``: name -> (attention
    implementation, cache factory). The runs alternate, so that every configuration sees the same machine load.

    Returns:
        {name: (step ms of each run, plan ms of each run)}.
    """
    for attn, make_cache in runs.values():  # warm-up
        model.set_attn_implementation(attn)
        decode_step_ms(model, make_cache, prompts, 3, mode=mode)
    result = {name: ([], []) for name in runs}
    for _ in range(repeats):
        for name, (attn, make_cache) in runs.items():
            model.set_attn_implementation(attn)
            run_steps, run_plans = decode_step_ms(model, make_cache, prompts, new_tokens, timer, mode)
            result[name][0].append(statistics.median(run_steps))
            result[name][1].append(statistics.median(run_plans))
    return result


def _fmt(values: list[float]) -> str:
    return f"{min(values):.3f} ({statistics.median(values):.3f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--mode", choices=list(MODES), default="greedy")
    parser.add_argument(
        "--wrappers", action="store_true", help="keep the kernels' Python wrappers; only the launches are no-ops"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.wrappers:
        keep_wrappers()
    else:
        stub_kernels()
    timer = PlanTimer()
    model = build_model(args.layers)
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}"
    print(f"{versions}, {args.layers} layers, {args.mode}, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"{args.repeats} runs; host ms/step: min (median)")  # fmt: skip
    kernels = "kernel wrappers, no-op launches" if args.wrappers else "no-op kernels"
    print(f"| batch | DynamicCache + sdpa | PagedCache + paged ({kernels}) | of which the plan (_begin_forward) |")
    print("|---|---|---|---|")
    for batch in args.batch:
        prompts = torch.randint(3, 256, (batch, args.prompt), generator=torch.Generator().manual_seed(0))
        rows = batch if args.mode == "greedy" else 4 * batch
        num_blocks = rows * ((args.prompt + args.new_tokens) // 16 + 2)
        runs = {
            "dynamic": ("sdpa", lambda: DynamicCache(config=model.config)),
            "paged": ("paged", functools.partial(PagedCache, model, num_blocks=num_blocks, block_size=16)),
        }
        result = step_ms(model, runs, prompts, args.new_tokens, args.repeats, timer, args.mode)
        (dynamic, _), (paged, plan) = result["dynamic"], result["paged"]
        print(f"| {batch} | {_fmt(dynamic)} | {_fmt(paged)} | {_fmt(plan)} |", flush=True)


if __name__ == "__main__":
    main()
