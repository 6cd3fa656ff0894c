"""Throughput benchmark: hf_paged's ContinuousBatcher beside transformers, on one GPU, in one run.

Models, workloads and the physical floor: ``hf_paged.frontends.bench_workloads`` (random-weight bf16 models in
the Qwen3-0.6B and Llama-3.1-8B shapes; the nano, sharegpt, prefix, short and long workloads; EOS ignored).
Systems: hf_paged (ContinuousBatcher), hf_paged without prefix caching, hf_paged without shared-prefix decode
(``hf_paged_no_cascade``; on by default on CUDA), hf_paged without async scheduling (``hf_paged_sync``),
transformers ``generate`` with padded static batches, transformers' built-in continuous batching. Each reports
output tokens/s, total tokens/s (median of ``--repeats`` runs, with min and max), the share of the floor, the
start-up time to the first token and peak memory, as a markdown table (``--out``) and a JSON record (``--json``).

Run: ``hf-paged bench --workload nano --model qwen3-0.6b [--out table.md] [--json record.json]``.
Tensor parallelism (2 GPUs), beside 1 GPU on the same checkpoint:
``python -m hf_paged.frontends.bench --model llama-8b --workload sharegpt --systems hf_paged --model-dir /tmp/m8b``
then ``torchrun --nproc-per-node 2 -m hf_paged.frontends.bench --model llama-8b --workload sharegpt --systems
hf_paged --model-dir /tmp/m8b --tp``.
"""

import argparse
import gc
import shlex
import statistics
import sys
import time

import torch

from hf_paged.core.kv_dtype import KV_CACHE_DTYPES
from hf_paged.engine.quantization import QUANTIZATIONS, torchao_config
from hf_paged.frontends.bench_record import emit_table, make_record, write_record
from hf_paged.frontends.bench_workloads import (
    SHAPES,
    WORKLOADS,
    Workload,
    build_model,
    floor_seconds,
    load_or_build,
    make_workload,
    measure_ceilings,
)

__all__ = ["ON_OFF", "SHAPES", "SYSTEMS", "WORKLOADS", "build_model", "emit_table", "main", "make_workload"]

COMPILE_CHOICES = {"auto": None, "none": False, "layers": "layers", "full": "full"}  # --compile -> compile_model
ON_OFF = {"auto": None, "on": True, "off": False}  # an auto/on/off flag as an EngineConfig value
SYSTEMS = ("hf_paged", "hf_paged_no_prefix", "hf_paged_no_cascade", "hf_paged_sync", "hf_generate", "hf_cb")


def _reset_memory():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def run_hf_paged(
    model,
    workload: Workload,
    prefix_caching: bool,
    args,
    repeats: int,
    async_scheduling: bool | None = None,
    cascade_attention: bool | None = None,
) -> dict:
    """One engine (start-up timed to its first token), then ``repeats`` timed runs of the workload."""
    from hf_paged import ContinuousBatcher, EngineConfig, SamplingParams

    base = _reset_memory()
    config = EngineConfig(
        num_blocks=args.num_blocks, memory_fraction=args.memory_fraction,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=prefix_caching, compile_model=COMPILE_CHOICES[args.compile],
        async_scheduling=async_scheduling, cascade_attention=cascade_attention,
        fuse_projections=ON_OFF[args.fuse_projections], kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    start = time.perf_counter()
    engine = ContinuousBatcher(model, config=config)
    first = engine.generate([workload.prompts[0]], SamplingParams(max_new_tokens=1, ignore_eos=True), use_tqdm=False)
    startup = time.perf_counter() - start
    assert len(first[0].outputs[0].token_ids) == 1
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    warm = engine.generate(
        workload.prompts[:4], [SamplingParams(max_new_tokens=8, ignore_eos=True)] * 4, use_tqdm=False
    )
    assert len(warm) == 4
    elapsed, generated = [], 0
    for _ in range(repeats):
        engine.reset_prefix_cache()
        steps_before = engine.metrics().num_steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.generate(workload.prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed.append(time.perf_counter() - start)
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
    m = engine.metrics()
    pool_gib = engine.pool.num_blocks * engine.info.bytes_per_block(engine.pool.block_size) / 2**30
    card_gib = torch.cuda.mem_get_info()[1] / 2**30
    pool_tokens = engine.pool.num_blocks * engine.pool.block_size
    note = (f"{engine.pool.num_blocks} blocks ({pool_tokens} tokens), prefix hit {m.prefix_hit_rate:.0%}, "
            f"{m.num_preemptions} preemptions, {m.num_steps - steps_before} steps, "
            f"async {engine.async_scheduling}, pool {pool_gib:.1f} GiB ({engine.config.kv_cache_dtype} KV), "
            f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.1f} of {card_gib:.0f} GiB")  # fmt: skip
    peak = torch.cuda.max_memory_allocated() - base
    engine.close()  # frees the graphs now (under TP, destroy_process_group hangs while they live)
    del engine
    return dict(elapsed=elapsed, generated=generated, peak=peak, note=note, startup=startup, pool_tokens=pool_tokens)


def run_hf_generate(model, workload: Workload, args, repeats: int) -> dict:
    """transformers generate over padded static batches of ``args.hf_batch`` requests (arrival order)."""
    model.set_attn_implementation("sdpa")
    base = _reset_memory()
    model.generate(input_ids=torch.tensor([workload.prompts[0][:16]], device="cuda"), max_new_tokens=4)
    elapsed = []
    for _ in range(repeats):
        t, generated = _hf_generate_once(model, workload, args)
        elapsed.append(t)
    peak = torch.cuda.max_memory_allocated() - base
    return dict(elapsed=elapsed, generated=generated, peak=peak, note=f"batches of {args.hf_batch}, sdpa")


def _hf_generate_once(model, workload: Workload, args) -> tuple[float, int]:
    pad = model.config.pad_token_id
    torch.cuda.synchronize()
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(workload.prompts), args.hf_batch):
        prompts = workload.prompts[i : i + args.hf_batch]
        outs = workload.output_lens[i : i + args.hf_batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
        # EOS ignored: every row runs to the batch's longest output; only the requested tokens count.
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                       do_sample=False, pad_token_id=pad)  # fmt: skip
        generated += sum(outs)
    torch.cuda.synchronize()
    return time.perf_counter() - start, generated


def run_hf_cb(model, workload: Workload, args, repeats: int) -> dict:
    """transformers' built-in continuous batching (ContinuousBatchingManager), sdpa attention, or eager attention
    for a model that has no sdpa (gpt-oss: its sinks)."""
    attention = "sdpa"
    try:
        model.set_attn_implementation(attention)
    except ValueError:  # "does not support an attention implementation through ... scaled_dot_product_attention"
        attention = "eager"
        model.set_attn_implementation(attention)
    base = _reset_memory()
    elapsed = []
    for _ in range(repeats):
        t, generated = _hf_cb_once(model, workload, args.baseline_timeout)
        elapsed.append(t)
    peak = torch.cuda.max_memory_allocated() - base
    return dict(elapsed=elapsed, generated=generated, peak=peak, note=f"ContinuousBatchingManager, {attention}")


def _hf_cb_once(model, workload: Workload, timeout_s: float | None = None) -> tuple[float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=-1,
                              pad_token_id=model.config.pad_token_id)  # fmt: skip
    start = None
    generated = 0
    # Past ``timeout_s`` the manager is stopped (its thread ends after its current step) and the run reported as
    # unfinished: its throughput is then below the tokens of the whole workload over that time.
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=60) as manager:
        start = time.perf_counter()
        for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=out_len, eos_token_id=-1)
        done = 0
        while done < len(workload.prompts):
            left = 600 if timeout_s is None else timeout_s - (time.perf_counter() - start)
            result = manager.get_result(timeout=max(left, 0.001))
            if result is None and timeout_s is not None:
                total = sum(workload.output_lens)
                raise RuntimeError(f"unfinished: {done} of {len(workload.prompts)} requests in {timeout_s:.0f} s "
                                   f"(below {total / timeout_s:.0f} tok/s)")  # fmt: skip
            if result is None:
                raise RuntimeError("transformers continuous batching returned no result within 600 s")
            if result.is_finished() if hasattr(result, "is_finished") else True:
                done += 1
                generated += len(result.generated_tokens)
    torch.cuda.synchronize()
    if generated == 0:  # its generation loop failed (logged above): the results came back empty
        raise RuntimeError("transformers continuous batching generated no token (its generation loop failed)")
    return time.perf_counter() - start, generated


def summarize(system: str, result: dict, total_tokens: int, floor_tps: float) -> dict:
    """One system's figures from its runs (``result``: elapsed seconds per run, generated tokens, peak bytes,
    note, start-up seconds): the row of the table and of the JSON record. A failed system has ``runs`` 0."""
    times = result["elapsed"]
    row = {"system": system, "runs": len(times), "notes": result["note"]}
    if not times:
        return row
    median = statistics.median(times)
    output_tps = result["generated"] / median
    row.update(
        time_s={"median": median, "min": min(times), "max": max(times)},
        output_tok_s={"median": output_tps, "min": result["generated"] / max(times),
                      "max": result["generated"] / min(times)},
        total_tok_s=total_tokens / median,
        floor_pct=100 * output_tps / floor_tps,
        startup_s=result.get("startup"),
        peak_memory_gib=result["peak"] / 2**30,
        output_tokens=result["generated"],
        pool_tokens=result.get("pool_tokens"),  # hf_paged's KV pool capacity; None for transformers' systems
    )  # fmt: skip
    return row


def format_table(header: str, rows: list[dict]) -> str:
    """The markdown table of ``summarize``'s rows under ``header``."""
    table = (
        f"{header}\n\n"
        "| system | runs | time (s), median [min, max] | output tok/s, median [min, max] | total tok/s | % of floor "
        "| start-up to first token (s) | peak memory (GiB) | notes |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    for row in rows:
        if not row["runs"]:
            table += f"| {row['system']} | 0 | - | - | - | - | - | - | {row['notes']} |\n"
            continue
        t, tps = row["time_s"], row["output_tok_s"]
        startup = "-" if row["startup_s"] is None else f"{row['startup_s']:.1f}"
        table += (f"| {row['system']} | {row['runs']} | {t['median']:.2f} [{t['min']:.2f}, {t['max']:.2f}] | "
                  f"{tps['median']:.0f} [{tps['min']:.0f}, {tps['max']:.0f}] | {row['total_tok_s']:.0f} | "
                  f"{row['floor_pct']:.1f}% | {startup} | {row['peak_memory_gib']:.1f} | "
                  f"{row['notes']} |\n")  # fmt: skip
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from hf_paged.engine.config import EngineConfig

    parser = argparse.ArgumentParser(prog="hf-paged bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--workload", default="nano", choices=WORKLOADS)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--input-len", type=int, help="the long workload's prompt tokens (default 2048)")
    parser.add_argument("--output-len", type=int, help="the long workload's output tokens (default 512)")
    parser.add_argument("--quick", action="store_true",
                        help="16 requests, outputs clipped to 128 tokens: < 2 min of GPU for all systems")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system (median, min and max)")
    parser.add_argument(
        "--baseline-timeout",
        type=float,
        default=None,
        help="seconds after which a run of hf_cb is stopped and reported unfinished",
    )
    parser.add_argument("--baseline-repeats", type=int, default=None,
                        help="timed runs of hf_generate and hf_cb (default: --repeats)")  # fmt: skip
    parser.add_argument("--num-blocks", type=int, default=None)
    # hf_paged's settings: the engine's defaults unless given
    parser.add_argument("--memory-fraction", type=float, default=EngineConfig.memory_fraction,
                        help="pool = this share of free memory (default: by --gpu-memory-utilization)")  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                        help="share of the card for weights, activations and pool (default: %(default)s)")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="EngineConfig.max_num_seqs (default: the engine's, by the card: 512 on >= 70 GiB, else "
                             "256); also the wave size of the floor")  # fmt: skip
    parser.add_argument("--compile", default="auto", choices=list(COMPILE_CHOICES),
                        help="hf_paged's compile_model: auto (the engine's default: layers on CUDA), none, layers, "
                             "full (default: %(default)s)")  # fmt: skip
    parser.add_argument("--fuse-projections", default="auto", choices=list(ON_OFF),
                        help="EngineConfig.fuse_projections: auto (on CUDA), on, off")  # fmt: skip
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="hf_paged's KV pool: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2; "
                             "default: %(default)s")  # fmt: skip
    parser.add_argument("--quantization", default="none", choices=sorted(QUANTIZATIONS),
                        help="quantize the random weights with torchao before the runs (every system runs the "
                             "quantized model); default: %(default)s")  # fmt: skip
    parser.add_argument("--hf-batch", type=int, default=64, help="static batch size of transformers generate")
    parser.add_argument("--out", help="append the markdown table to this file")
    parser.add_argument("--json", help="write the figures as a JSON record to this file")
    parser.add_argument("--model-dir", help="load the random-weight model from DIR (built and saved there first)")
    tp_help = "tensor parallelism: run under torchrun; loads --model-dir with tp_plan='auto'"
    parser.add_argument("--tp", action="store_true", help=tp_help)
    return parser.parse_args(argv)


def run_system(system: str, model, workload: Workload, args) -> dict:
    """``repeats`` timed runs of one system; a failure is reported as a result without runs."""
    baseline_repeats = args.baseline_repeats or args.repeats
    try:
        if system == "hf_paged":
            return run_hf_paged(model, workload, True, args, args.repeats)
        if system == "hf_paged_no_prefix":
            return run_hf_paged(model, workload, False, args, args.repeats)
        if system == "hf_paged_no_cascade":
            return run_hf_paged(model, workload, True, args, args.repeats, cascade_attention=False)
        if system == "hf_paged_sync":  # the host's work between steps not overlapped with the GPU's
            return run_hf_paged(model, workload, True, args, args.repeats, async_scheduling=False)
        if system == "hf_generate":
            return run_hf_generate(model, workload, args, baseline_repeats)
        return run_hf_cb(model, workload, args, baseline_repeats)
    except Exception as exc:  # report the failure in the table, go on with the other systems
        return dict(elapsed=[], generated=0, peak=0, note=f"failed: {type(exc).__name__}: {exc}"[:200])


def main(argv: list[str] | None = None) -> int:
    from hf_paged.engine.config import default_max_num_seqs

    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("hf-paged bench: error: needs a CUDA GPU (the benchmark compares GPU throughput)", file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        print(f"hf-paged bench: error: unknown systems {unknown}; choose from {list(SYSTEMS)}", file=sys.stderr)
        return 2
    if args.tp and (not args.model_dir or set(systems) != {"hf_paged"}):
        print("hf-paged bench: error: --tp needs --model-dir and --systems hf_paged (run under torchrun)",
              file=sys.stderr)  # fmt: skip
        return 2
    model = load_or_build(args.model, args.model_dir, args.tp)
    quantization = torchao_config(args.quantization, "cuda", next(model.parameters()).dtype)
    if quantization is not None:
        from torchao.quantization import quantize_

        quantize_(model, quantization)
    rank = torch.distributed.get_rank() if args.tp else 0
    num_requests = args.num_requests or (16 if args.quick else None)
    lengths = None
    if args.input_len is not None or args.output_len is not None:
        lengths = (args.input_len or 2048, args.output_len or 512)
    workload = make_workload(args.workload, model.config.vocab_size, num_requests, lengths=lengths)
    if args.quick:
        workload.output_lens = [min(n, 128) for n in workload.output_lens]
    if args.max_num_seqs is None:  # the engine's default for this card, named in the table's header
        args.max_num_seqs = default_max_num_seqs(next(model.parameters()).device, args.max_num_batched_tokens)
    bandwidth, flops = measure_ceilings()
    floor = floor_seconds(model, workload, bandwidth, flops, args.max_num_seqs,
                          kv_element_bytes=1 if args.kv_cache_dtype.startswith("fp8") else 2)  # fmt: skip
    total_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    floor_tps = workload.num_output_tokens / floor
    rows = []
    for system in systems:
        result = run_system(system, model, workload, args)
        if rank == 0:
            print(f"{system}: {result}", flush=True)
        name = system + (f" (tp={model.tp_size})" if args.tp else "")
        rows.append(summarize(name, result, total_tokens, floor_tps))
    if rank != 0:
        return 0
    command = "hf-paged bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    record = make_record(
        torch.cuda.get_device_name(), command,
        workload=dict(name=args.workload, model=args.model, dtype="bfloat16", quantization=args.quantization,
                      kv_cache_dtype=args.kv_cache_dtype, num_requests=len(workload.prompts),
                      prompt_tokens=workload.num_prompt_tokens, output_tokens=workload.num_output_tokens,
                      max_num_seqs=args.max_num_seqs, copy_bandwidth_gb_s=bandwidth / 1e9,
                      matmul_tflop_s=flops / 1e12, floor_s=floor, floor_output_tok_s=floor_tps),
        systems=rows,
    )  # fmt: skip
    versions = record["versions"]
    header = (
        f"### throughput: {args.workload} workload ({len(workload.prompts)} requests, "
        f"{workload.num_prompt_tokens} prompt / {workload.num_output_tokens} output tokens), {args.model}, bf16"
        f"{'' if args.quantization == 'none' else ' quantized ' + args.quantization}, "
        f"random weights — {record['card']}, {record['date']}, torch {versions['torch']}, "
        f"transformers {versions['transformers']}, hf_paged {versions['hf_paged']}\n\n"
        f"`{command}` — measured copy bandwidth {bandwidth / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} "
        f"TFLOP/s; physical floor {floor:.2f} s = {floor_tps:.0f} output tok/s; max_num_seqs {args.max_num_seqs}"
    )
    emit_table(format_table(header, rows), args.out)
    if args.json:
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
