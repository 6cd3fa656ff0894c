"""model.generate per decode step and peak memory: PagedCache beside transformers' caches, over a grid (GPU).

Random-weight bf16 models built from configs (``hf_paged.frontends.bench_workloads.SHAPES``: Qwen3-0.6B and
Llama-3.1-8B shapes; like ``vllm bench --load-format dummy``), random prompt ids without padding, EOS ignored
(``min_new_tokens``), seeded.

Grid: shapes x (batch x prompt) points x modes x systems.
- points: 1x512, 8x1024, 32x512, 64x512;
- modes: ``greedy``; ``beams4`` (``num_beams=4``); ``samples4`` (``do_sample=True, num_return_sequences=4``);
- systems: ``dynamic`` = DynamicCache + sdpa (transformers' default); ``static`` = ``cache_implementation="static"``
  + sdpa, which transformers compiles (``torch.compile``, CUDA graphs) for the decode steps; ``paged`` = PagedCache
  + "paged" attention, eager, with its default pool (it grows with what the call uses); ``paged-compiled`` =
  ``PagedCache(model, max_cache_len=prompt + new tokens - 1)`` (the length generate gives StaticCache: the last new
  token is never fed back), which transformers compiles as it does StaticCache (its pool holds the prefill's blocks
  during the prefill, then grows once, before the first decode step, for every row to reach max_cache_len, in whole
  blocks; beam search runs eagerly in transformers).

Measures, per grid cell, ``--repeats`` times (after a warm-up call with the same arguments, which also compiles;
the systems of a (shape, point, mode) take turns, one call each per round, so host noise hits them alike; with
``--eager-repeats N`` DynamicCache and eager PagedCache, host-bound and cheap, go on alternating to N rounds):
- ms/step: the median interval between two decode steps of a call, timed by a logits processor that generate runs
  once per new token after the forward (each CUDA step ends in generate's host sync, so an interval is a step's
  wall time; the processor runs outside compiled forwards too); the table gives the median (min-max) of the runs'
  medians. (Not the difference between a 1-token and an N-token call's walls: the prefill's run-to-run variance
  swamps it.)
- CPU ms/step: the process's CPU time (``time.process_time``) over the same intervals. An eager step is bound by the
  host, and its wall time also counts the spells the process waits for a core (a busy host can move a cell's
  wall time by half for both caches); the CPU time leaves those out (it keeps a
  spinning device sync, which is short in a host-bound step, and the work of every thread of the process);
- prefill ms: from the call to the first logits (median);
- output tok/s: rows x N / wall of the N-token call (median);
- peak memory: the most ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) rose above the
  allocation at the call's start (the weights) during the N-token calls; the cache is built inside the call;
- ratios to DynamicCache in the same cell, and for greedy the share of output tokens equal to DynamicCache's (bf16
  near-ties in a random model may flip a few late tokens). ``time / dynamic, paired``: the median over the rounds
  of each round's ratio (a system's call and DynamicCache's call of the same round run seconds apart), which a
  host that changes speed between rounds moves less than the ratio of the two medians.

Run: ``python benchmarks/generate.py [--quick] [--out table.md] [--json record.json] [--shapes ...] [--modes ...]
[--systems ...]``.
``--quick``: Qwen3-0.6B shape, 1x512 and 32x512, greedy and beams4, 32 new tokens. ``--device cpu``: a smoke run of
the whole path on a tiny model (no memory numbers; static is not compiled there).

``--quantization none float8 int4``: each shape's grid once per named weight quantization
(hf_paged.engine.quantization: torchao, applied in place to the model built on the device, rebuilt for each name),
each row with the bytes the weights occupy as stored and the decode step's weight-bound floor: those bytes over the
card's nominal bandwidth (``--peak-gbs``, the H200's 4 800 GB/s) and over the measured copy bandwidth (read + write).
"""

import argparse
import gc
import inspect
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import transformers
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from hf_paged import PagedCache
from hf_paged.core.model_info import ModelInfo
from hf_paged.engine.quantization import QUANTIZATIONS, weight_bytes
from hf_paged.frontends.bench_record import emit_table, make_record, write_record
from hf_paged.frontends.bench_workloads import SHAPES, build_quantized

POINTS = [(1, 512), (8, 1024), (32, 512), (64, 512)]
MODES = {
    "greedy": dict(do_sample=False),
    "beams4": dict(do_sample=False, num_beams=4),
    "samples4": dict(do_sample=True, num_return_sequences=4, top_k=50),
}
SYSTEMS = ("dynamic", "static", "paged", "paged-compiled")
PEAK_GBS = 4800.0  # the floor's nominal bandwidth (--peak-gbs): the H200's HBM3e
EAGER_SYSTEMS = ("dynamic", "paged")  # what --eager-repeats adds rounds of


@dataclass
class Cell:
    """One grid cell's measurements; lists hold one entry per repeat."""

    shape: str
    batch: int
    prompt: int
    mode: str
    system: str
    label: str
    new_tokens: int
    rows: int  # sequences returned: batch, or batch x num_return_sequences
    quantization: str = "none"  # the weights' --quantization name
    weight_bytes: int | None = None  # the weights as stored (with --quantization only)
    copy_gbs: float | None = None  # the measured copy bandwidth the floor is taken at (with --quantization, CUDA)
    peak_gbs: float = PEAK_GBS  # the nominal bandwidth the floor is taken at (--peak-gbs)
    step_ms: list[float] = field(default_factory=list)
    step_cpu_ms: list[float] = field(default_factory=list)  # the process's CPU time per decode step
    prefill_ms: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    peak_allocated: int | None = None  # bytes above the call's start; None off CUDA
    peak_reserved: int | None = None
    prefill_peak_allocated: int | None = None  # the peak as the prefill's logits arrive: prefill, or the decode steps
    kv_bytes: int | None = None  # the K/V the cache held at the call's end (StaticCache: what it reserves)
    same_tokens: float | None = None  # share of output tokens equal to DynamicCache's (greedy)
    note: str = ""
    error: str = ""


def system_label(system: str, device: str) -> str:
    if system == "dynamic":
        return "DynamicCache + sdpa"
    if system == "static":
        return "StaticCache + sdpa, compiled" if device == "cuda" else "StaticCache + sdpa (eager: compile needs CUDA)"
    if system == "paged-compiled":
        return (
            "PagedCache(max_cache_len) + paged, compiled"
            if device == "cuda"
            else "PagedCache(max_cache_len) + paged (planned steps, eager: compile needs CUDA)"
        )
    return "PagedCache + paged, eager"


def _cache_kwarg() -> str:
    """generate() takes the cache as ``cache`` where models do (transformers 5.2x), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters else "past_key_values"


class StepTimer(LogitsProcessor):
    """Records the host clock each time generate processes a step's logits (once per new token, after the forward).

    On CUDA each step ends in generate's host sync on the stopping criteria, so the interval between two calls is
    one decode step's wall time; this works for compiled forwards too (the processor runs outside the model).
    """

    def __init__(self):
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # the process's CPU time (time.process_time) at the same moments
        self.prefill_peak: int | None = None  # CUDA: max_memory_allocated when the prefill's logits arrive

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())
        if len(self.times) == 1 and scores.is_cuda:  # the allocator's host-side count: no sync
            self.prefill_peak = torch.cuda.max_memory_allocated()
        return scores


def generate_once(model, system: str, prompts: torch.Tensor, new_tokens: int, mode: str, seed: int = 0):
    """One generate call: (wall s, prefill s, decode step ms, decode step CPU ms, peak allocated and reserved bytes or
    None, out, cache, peak allocated by the prefill's end or None).

    The cache is built inside the timed region, so a pool allocated up front counts in full. The prefill runs from
    the call to the first logits; the steps are the intervals between later logits.
    """
    cuda = prompts.is_cuda
    model.set_attn_implementation("paged" if system.startswith("paged") else "sdpa")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.manual_seed(seed)
    timer = StepTimer()
    kwargs = dict(MODES[mode], max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    kwargs["logits_processor"] = LogitsProcessorList([timer])
    start = time.perf_counter()
    cache = None
    if system == "static":
        kwargs["cache_implementation"] = "static"
    else:
        if system == "dynamic":
            cache = DynamicCache(config=model.config)
        elif system == "paged-compiled":
            cache = PagedCache(model, max_cache_len=prompts.shape[1] + new_tokens - 1)  # StaticCache's length
        else:
            cache = PagedCache(model)
        kwargs[_cache_kwarg()] = cache
    out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), **kwargs)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    steps = [(b - a) * 1e3 for a, b in zip(timer.times, timer.times[1:], strict=False)]
    cpu_steps = [(b - a) * 1e3 for a, b in zip(timer.cpu_times, timer.cpu_times[1:], strict=False)]
    prefill = timer.times[0] - start
    if not cuda:
        return elapsed, prefill, steps, cpu_steps, None, None, out, cache, None
    peak = torch.cuda.max_memory_allocated() - base
    reserved = torch.cuda.max_memory_reserved() - base_reserved
    prefill_peak = timer.prefill_peak - base if timer.prefill_peak is not None else None
    return elapsed, prefill, steps, cpu_steps, peak, reserved, out, cache, prefill_peak


def measure_once(model, cell: Cell, prompts: torch.Tensor) -> torch.Tensor:
    """One measured call of ``cell`` (its warm-up ran before); appends to the cell, returns the output."""
    total, prefill, steps, cpu_steps, peak, reserved, out, cache, prefill_peak = generate_once(
        model, cell.system, prompts, cell.new_tokens, cell.mode
    )
    cell.prefill_ms.append(prefill * 1e3)
    cell.total_s.append(total)
    cell.step_ms.append(statistics.median(steps))
    cell.step_cpu_ms.append(statistics.median(cpu_steps))
    if peak is not None:
        cell.peak_allocated = max(cell.peak_allocated or 0, peak)
        cell.peak_reserved = max(cell.peak_reserved or 0, reserved)
    if prefill_peak is not None:
        cell.prefill_peak_allocated = max(cell.prefill_peak_allocated or 0, prefill_peak)
    if isinstance(cache, PagedCache):
        cell.note = f"pool grew to {cache.pool.num_blocks} blocks ({cache.peak_used_blocks} used at peak)"
    cell.kv_bytes = kv_bytes(model, cache, cell.system, prompts, cell.new_tokens, cell.mode)
    return out


def kv_bytes(model, cache, system: str, prompts: torch.Tensor, new_tokens: int, mode: str) -> int | None:
    """Bytes of K/V a call's cache holds at its end: a PagedCache's pool, a DynamicCache's tensors, and for
    StaticCache (built inside generate) what it reserves: every row (copies for beams and samples included) at
    prompt + new tokens - 1 (generate's max_length - 1), each layer's K and V. Beside the peak, this splits it into
    cache and everything else."""
    if isinstance(cache, PagedCache):
        return sum(t.numel() * t.element_size() for t in (*cache.kv.k_cache, *cache.kv.v_cache))
    if system == "static":
        copies = max(MODES[mode].get("num_beams", 1), MODES[mode].get("num_return_sequences", 1))
        tokens = prompts.shape[0] * copies * (prompts.shape[1] + new_tokens - 1)
        return tokens * ModelInfo.from_model(model).bytes_per_block(1)
    total = 0
    for layer in getattr(cache, "layers", None) or []:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total or None


def run_cells(
    model, cells: list[Cell], prompts: torch.Tensor, repeats: int, device: str, eager_repeats: int | None = None
) -> None:
    """The systems of one (shape, point, mode), interleaved: a warm-up call each (JIT, compile, allocator), then
    ``repeats`` rounds of one call per system, so that a slow spell of the host hits every system alike, then rounds
    of the eager systems alone (DynamicCache and PagedCache: host-bound, so noisier, and cheap) up to
    ``eager_repeats``. DynamicCache comes first; its greedy output is the reference for the others' token
    agreement."""
    live = []
    for cell in cells:
        try:
            generate_once(model, cell.system, prompts, cell.new_tokens, cell.mode)
            live.append(cell)
        except Exception as error:  # a grid of hours should report a failing cell, not stop
            cell.error = _describe(error)
        _release(device)
    outputs: dict[int, torch.Tensor] = {}
    for round_idx in range(max(repeats, eager_repeats or 0)):
        for cell in list(live):
            if round_idx >= repeats and cell.system not in EAGER_SYSTEMS:
                continue
            try:
                outputs[id(cell)] = measure_once(model, cell, prompts)
            except Exception as error:
                cell.error = _describe(error)
                live.remove(cell)
            _release(device)
    reference = outputs.get(id(cells[0])) if cells[0].system == "dynamic" else None
    for cell in live:
        out = outputs.get(id(cell))
        if reference is not None and cell.mode == "greedy" and out is not None and out.shape == reference.shape:
            cell.same_tokens = (out == reference).float().mean().item()


def _describe(error: BaseException) -> str:
    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    return f"failed: {type(error).__name__}: {str(error)[:120]}"


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _median_range(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def _gib(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**30:.3f}"  # 3 decimals: pools that tie to 10 MB


def format_table(cells: list[Cell], title: str) -> str:
    """Markdown: one row per cell, with time and memory ratios to the DynamicCache cell of the same grid point."""
    dynamic = {(c.shape, c.quantization, c.batch, c.prompt, c.mode): c for c in cells
               if c.system == "dynamic" and not c.error}  # fmt: skip
    lines = [
        title,
        "",
        "| model | batch x prompt | mode | system | ms/step median (min-max) | CPU ms/step median (min-max) "
        "| prefill ms | output tok/s | peak alloc GiB | peak reserved GiB | time / dynamic | time / dynamic, paired "
        "| CPU time / dynamic | memory / dynamic | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        point = f"{c.batch} x {c.prompt}"
        model = c.shape if c.quantization == "none" else f"{c.shape} {c.quantization}"
        if c.error:
            lines.append(
                f"| {model} | {point} | {c.mode} | {c.label} | - | - | - | - | - | - | - | - | - | - | {c.error} |"
            )
            continue
        ref = dynamic.get((c.shape, c.quantization, c.batch, c.prompt, c.mode))
        step = statistics.median(c.step_ms)
        time_ratio = f"{step / statistics.median(ref.step_ms):.2f}" if ref else "-"
        cpu_ratio = f"{statistics.median(c.step_cpu_ms) / statistics.median(ref.step_cpu_ms):.2f}" if ref else "-"
        paired = "-"  # round i's call of this system against round i's DynamicCache call
        if ref and len(c.step_ms) <= len(ref.step_ms):  # DynamicCache may have more rounds (--eager-repeats)
            paired = f"{statistics.median(a / b for a, b in zip(c.step_ms, ref.step_ms, strict=False)):.2f}"
        memory_ratio = (
            f"{c.peak_allocated / ref.peak_allocated:.2f}" if ref and c.peak_allocated and ref.peak_allocated else "-"
        )
        notes = [c.note] if c.note else []
        if c.prefill_peak_allocated is not None:
            notes.append(f"{_gib(c.prefill_peak_allocated)} GiB by the prefill's end")
        if c.kv_bytes is not None:
            rest = f", peak {_gib(c.peak_allocated - c.kv_bytes)} GiB above it" if c.peak_allocated is not None else ""
            notes.append(f"K/V {_gib(c.kv_bytes)} GiB{rest}")
        if c.same_tokens is not None and c.system != "dynamic":
            notes.append(f"{c.same_tokens:.1%} tokens equal to dynamic")
        if c.weight_bytes is not None:
            floors = floor_ms(c)
            notes.append(f"weights {c.weight_bytes / 1e9:.2f} GB: floor {floors['nominal']:.2f} ms/step at "
                         f"{c.peak_gbs:.0f} GB/s" + ("" if floors["copy"] is None else
                                                   f", {floors['copy']:.2f} ms at the copy bandwidth"))  # fmt: skip
        tok_s = c.rows * c.new_tokens / statistics.median(c.total_s)
        lines.append(
            f"| {model} | {point} | {c.mode} | {c.label} | {_median_range(c.step_ms, '.2f')} | "
            f"{_median_range(c.step_cpu_ms, '.2f')} | {statistics.median(c.prefill_ms):.1f} | {tok_s:.0f} | "
            f"{_gib(c.peak_allocated)} | {_gib(c.peak_reserved)} | {time_ratio} | {paired} | {cpu_ratio} | "
            f"{memory_ratio} | "
            f"{'; '.join(notes)} |"
        )
    return "\n".join(lines) + "\n"


def cell_record(c: Cell) -> dict:
    """One grid cell as a JSON record row: the medians (with min and max) of its runs and its ratios' inputs."""
    row = {"shape": c.shape, "batch": c.batch, "prompt": c.prompt, "mode": c.mode, "system": c.system,
           "label": c.label, "new_tokens": c.new_tokens}  # fmt: skip
    if c.weight_bytes is not None:
        row.update(quantization=c.quantization, weight_gb=c.weight_bytes / 1e9, floor_ms=floor_ms(c))
    if c.error:
        return {**row, "error": c.error}

    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}

    return {
        **row,
        "ms_per_step": spread(c.step_ms),
        "cpu_ms_per_step": spread(c.step_cpu_ms),
        "prefill_ms": statistics.median(c.prefill_ms),
        "output_tok_s": c.rows * c.new_tokens / statistics.median(c.total_s),
        "peak_allocated_gib": None if c.peak_allocated is None else c.peak_allocated / 2**30,
        "peak_reserved_gib": None if c.peak_reserved is None else c.peak_reserved / 2**30,
        "kv_gib": None if c.kv_bytes is None else c.kv_bytes / 2**30,
        "same_tokens_as_dynamic": c.same_tokens,
        "notes": c.note,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-8b"], choices=sorted(SHAPES))
    parser.add_argument("--points", nargs="+", help="BATCHxPROMPT pairs (default: 1x512 8x1024 32x512 64x512)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager-repeats", type=int, help="rounds of DynamicCache and eager PagedCache (default: "
                        "--repeats); the compiled systems run --repeats rounds")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="qwen3-0.6b; 1x512 and 32x512; greedy, beams4; 32 tokens")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run on a tiny model")
    parser.add_argument("--quantization", nargs="+", choices=sorted(QUANTIZATIONS),
                        help="run each shape's grid once per weight quantization (torchao), with the weight-bound "
                             "floor of each row (default: the bf16 weights, no floor)")  # fmt: skip
    parser.add_argument("--peak-gbs", type=float, default=PEAK_GBS, help="the floor's nominal bandwidth (GB/s)")
    parser.add_argument("--out", help="also append the markdown table to this file")
    parser.add_argument("--json", help="write the figures as a JSON record to this file")
    args = parser.parse_args(argv)
    points = args.points
    if args.quick:
        args.shapes, points, args.modes, args.new_tokens = ["qwen3-0.6b"], ["1x512", "32x512"], [
            "greedy", "beams4"], 32  # fmt: skip
    if args.device == "cpu":
        args.shapes, points, args.new_tokens = ["tiny"], ["1x16", "2x16"], min(args.new_tokens, 4)
    args.points = args.points or points or [f"{b}x{p}" for b, p in POINTS]
    try:
        args.points = [tuple(int(n) for n in p.lower().split("x")) for p in args.points]
    except ValueError:
        parser.error(f"--points must be BATCHxPROMPT pairs such as 8x1024, got {args.points}")
    if any(len(p) != 2 or min(p) < 1 for p in args.points):
        parser.error(f"--points must be BATCHxPROMPT pairs of positive ints, got {args.points}")
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error(f"--new-tokens must be >= 2 and --repeats >= 1, got {args.new_tokens} and {args.repeats}")
    if args.eager_repeats is not None and args.eager_repeats < args.repeats:
        parser.error(f"--eager-repeats must be >= --repeats ({args.repeats}), got {args.eager_repeats}")
    return args


def floor_ms(c: Cell) -> dict:
    """A cell's weight-bound floor per decode step (ms): its weights as stored read once, at the nominal bandwidth
    and at the measured copy bandwidth (None off CUDA)."""
    return {"nominal": c.weight_bytes / (c.peak_gbs * 1e9) * 1e3,
            "copy": None if c.copy_gbs is None else c.weight_bytes / (c.copy_gbs * 1e9) * 1e3}  # fmt: skip


def run_grid(args: argparse.Namespace) -> list[Cell]:
    """Every cell of the grid, in order: shape, quantization, point, mode, then the systems (DynamicCache first)."""
    cells: list[Cell] = []
    copy_gbs = None
    if args.quantization and args.device == "cuda":
        from hf_paged.frontends.bench_workloads import measure_ceilings

        copy_gbs = measure_ceilings()[0] / 1e9
    for shape, quantization in [(s, q) for s in args.shapes for q in args.quantization or ["none"]]:
        model = build_quantized(shape, quantization, args.device)
        stored = weight_bytes(model) if args.quantization else None
        vocab = model.config.vocab_size
        for batch, prompt in args.points:
            prompts = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0))
            prompts = prompts.to(args.device)
            for mode in args.modes:
                rows = batch * (4 if mode == "samples4" else 1)  # sequences returned (beams return the best)
                group = [
                    Cell(shape, batch, prompt, mode, system, system_label(system, args.device), args.new_tokens, rows,
                         quantization, stored, copy_gbs, args.peak_gbs)
                    for system in sorted(args.systems, key=SYSTEMS.index)  # dynamic first: the reference
                ]  # fmt: skip
                run_cells(model, group, prompts, args.repeats, args.device, args.eager_repeats)
                cells.extend(group)
                for cell in group:
                    print(format_table([cell], "").splitlines()[-1], flush=True)
        del model
        _release(args.device)
    return cells


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/generate.py needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    num_threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)  # a smoke run: one thread does not wait on threads another process delays
    try:
        cells = run_grid(args)
    finally:
        torch.set_num_threads(num_threads)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    command = "python benchmarks/generate.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    record = make_record(
        device, command,
        workload=dict(shapes=args.shapes, points=[f"{b}x{p}" for b, p in args.points], modes=args.modes,
                      systems=args.systems, new_tokens=args.new_tokens, repeats=args.repeats,
                      eager_repeats=args.eager_repeats or args.repeats, quantization=args.quantization,
                      peak_gb_s=args.peak_gbs if args.quantization else None,
                      dtype="bfloat16" if args.device == "cuda" else "float32"),
        rows=[cell_record(c) for c in cells],
    )  # fmt: skip
    versions = record["versions"]
    title = (
        f"### generate: ms per decode step and peak memory — {device}, {record['date']}, torch "
        f"{versions['torch']}, transformers {versions['transformers']}, hf_paged {versions['hf_paged']}\n\n"
        f"{'bf16' if args.device == 'cuda' else 'fp32'} random weights, no padding, {args.new_tokens} new tokens "
        f"(EOS ignored), median (min-max) of {args.repeats} runs"
        + (f" ({args.eager_repeats} for the eager systems)" if (args.eager_repeats or 0) > args.repeats else "")
        + f"; ms/step = median interval between decode steps; peak memory above the weights. `{command}`"
    )
    emit_table(format_table(cells, title), args.out)
    if args.json:
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
