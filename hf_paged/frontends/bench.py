"""Throughput benchmark suite: hf_paged's ContinuousBatcher beside transformers, on one GPU, in one run.

Random-weight bf16 models built from configs (no hub; like ``vllm bench --load-format dummy``), random
prompt ids, EOS ignored, seeded workloads:
- nano: 256 requests, prompt U[100, 1024], output U[100, 1024] (nano-vllm's bench);
- sharegpt: lognormal lengths, means about 161 prompt / 338 output tokens, clipped to 2048;
- prefix: 400 requests, a 341-token shared prefix plus 10-40 unique tokens, outputs 20-80 (paper §6.4);
- short: 1000 short requests, prompt U[10, 100], output U[20, 200] (chat-like traffic: a prompt in most steps).
Systems: hf_paged (ContinuousBatcher), hf_paged without prefix caching, hf_paged without shared-prefix decode
(``hf_paged_no_cascade``; on by default on CUDA), hf_paged without async scheduling (``hf_paged_sync``),
transformers ``generate`` with padded static batches, transformers' built-in continuous batching. Each reports
output tokens/s, total tokens/s (median of ``--repeats`` runs, with min and max), start-up time and peak memory.

The physical floor is one formula for every workload, and an estimate, not a strict bound: the time to read
the weights once per decode step (the fewest steps: requests in waves of ``max_num_seqs``, each wave as long
as its longest output; the wave model is not exact for staggered arrivals) plus every KV byte each output
token attends to, over the measured copy bandwidth, plus the prefill FLOPs (2 x parameters x prompt tokens)
over the measured matmul rate. The embedding table counts as weights read each step although only its
gathered rows are read, so for small models the floor is a little too high.

Run: ``hf-paged bench --workload nano --model qwen3-0.6b`` or ``python benchmarks/throughput.py ...``.
Tensor parallelism (2 GPUs), beside 1 GPU on the same checkpoint:
``python -m hf_paged.frontends.bench --model llama-8b --workload sharegpt --systems hf_paged --model-dir /tmp/m8b``
then ``torchrun --nproc-per-node 2 -m hf_paged.frontends.bench --model llama-8b --workload sharegpt --systems
hf_paged --model-dir /tmp/m8b --tp``.
"""

import argparse
import datetime
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)),
    "llama-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)),
    "tiny": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1024, max_position_embeddings=4096)),
}  # fmt: skip

COMPILE_CHOICES = {"auto": None, "none": False, "layers": "layers", "full": "full"}  # --compile -> compile_model
ON_OFF = {"auto": None, "on": True, "off": False}  # an auto/on/off flag as an EngineConfig value
SYSTEMS = ("hf_paged", "hf_paged_no_prefix", "hf_paged_no_cascade", "hf_paged_sync", "hf_generate", "hf_cb")
WORKLOADS = ("nano", "sharegpt", "prefix", "short")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, vocab_size: int, num_requests: int | None, seed: int = 0) -> Workload:
    """The seeded prompts and output lengths of a named workload."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab_size - 10, (n,), generator=gen).tolist()

    if name == "nano":
        n = num_requests or 256
        lens_in = torch.randint(100, 1025, (n,), generator=gen).tolist()
        lens_out = torch.randint(100, 1025, (n,), generator=gen).tolist()
        return Workload(name, [ids(k) for k in lens_in], lens_out)
    if name == "sharegpt":
        n = num_requests or 512
        # lognormal with means ~161 / ~338: mean = exp(mu + sigma^2 / 2)
        sigma_in, sigma_out = 1.0, 0.9
        mu_in, mu_out = math.log(161) - sigma_in**2 / 2, math.log(338) - sigma_out**2 / 2
        lens_in = torch.empty(n).log_normal_(mu_in, sigma_in, generator=gen).clamp(4, 2048).long().tolist()
        lens_out = torch.empty(n).log_normal_(mu_out, sigma_out, generator=gen).clamp(4, 2048).long().tolist()
        return Workload(name, [ids(k) for k in lens_in], lens_out)
    if name == "prefix":
        n = num_requests or 400  # issue 13's count (the twenty-third session and before: 200)
        prefix = ids(341)
        uniq = torch.randint(10, 41, (n,), generator=gen).tolist()
        lens_out = torch.randint(20, 81, (n,), generator=gen).tolist()
        return Workload(name, [prefix + ids(k) for k in uniq], lens_out)
    if name == "short":
        n = num_requests or 1000
        lens_in = torch.randint(10, 101, (n,), generator=gen).tolist()
        lens_out = torch.randint(20, 201, (n,), generator=gen).tolist()
        return Workload(name, [ids(k) for k in lens_in], lens_out)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def build_model(shape: str, device: str = "cuda", **overrides):
    """The shape's model with random bf16 weights on ``device``; ``overrides`` replace config fields (e.g.
    ``num_hidden_layers=1``)."""
    import transformers

    config_cls, model_cls, kwargs = SHAPES[shape]
    config = getattr(transformers, config_cls)(
        **{**kwargs, **overrides}, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(config).eval()
    finally:
        torch.set_default_dtype(default)
    return model


def load_or_build(shape: str, model_dir: str | None, tp: bool):
    """The benchmark model: built in memory, or loaded from ``model_dir`` (saved there first if missing).

    Tensor parallelism (``tp``) needs a checkpoint to shard: under torchrun, rank 0 saves it and every rank
    loads it with ``tp_plan="auto"``.
    """
    import os

    from transformers import AutoModelForCausalLM

    if model_dir is None:
        return build_model(shape)
    rank = int(os.environ.get("RANK", "0"))
    if tp and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if rank == 0 and not os.path.isdir(model_dir):
        model = build_model(shape)
        model.save_pretrained(model_dir)
        del model
        torch.cuda.empty_cache()
    if tp:
        torch.distributed.barrier()
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, tp_plan="auto").eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda").eval()


def measure_ceilings(device: str = "cuda") -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), measured on ``device``."""
    from triton.testing import do_bench

    def copy_ms() -> float:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
        dst = torch.empty_like(src)
        return do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")

    def matmul_ms() -> float:
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        return do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")

    bandwidth = 2 * (1 << 30) / (copy_ms() * 1e-3)
    flops = 2 * 8192**3 / (matmul_ms() * 1e-3)
    torch.cuda.empty_cache()
    return bandwidth, flops


def floor_seconds(model, workload: Workload, bandwidth: float, flops: float, max_concurrency: int) -> float:
    """Time no engine can beat: weights once per decode step + every attended KV byte + prefill FLOPs."""
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * 2
    num_kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * num_kv_heads * head_dim * 2
    kv_read = 0
    for prompt, out_len in zip(workload.prompts, workload.output_lens, strict=True):
        # output token t attends len(prompt) + t keys
        kv_read += out_len * len(prompt) + out_len * (out_len - 1) // 2
    # Fewest decode steps: the requests run in waves of max_concurrency; each wave lasts its longest output.
    lens = sorted(workload.output_lens, reverse=True)
    steps = sum(lens[i] for i in range(0, len(lens), max_concurrency))
    prefill_flops = 2 * params * workload.num_prompt_tokens
    return (steps * weight_bytes + kv_read * kv_bytes_per_token) / bandwidth + prefill_flops / flops


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
        fuse_projections=ON_OFF[getattr(args, "fuse_projections", "auto")],
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
    note = (f"{engine.pool.num_blocks} blocks, prefix hit {m.prefix_hit_rate:.0%}, "
            f"{m.num_preemptions} preemptions, {m.num_steps - steps_before} steps, "
            f"async {engine.async_scheduling}, pool {pool_gib:.1f} GiB, "
            f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.1f} of {card_gib:.0f} GiB")  # fmt: skip
    peak = torch.cuda.max_memory_allocated() - base
    engine.close()  # frees the graphs now (under TP, destroy_process_group hangs while they live)
    del engine
    return dict(elapsed=elapsed, generated=generated, peak=peak, note=note, startup=startup)


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
    """transformers' built-in continuous batching (ContinuousBatchingManager), sdpa attention."""
    model.set_attn_implementation("sdpa")
    base = _reset_memory()
    elapsed = []
    for _ in range(repeats):
        t, generated = _hf_cb_once(model, workload)
        elapsed.append(t)
    peak = torch.cuda.max_memory_allocated() - base
    return dict(elapsed=elapsed, generated=generated, peak=peak, note="ContinuousBatchingManager, sdpa")


def _hf_cb_once(model, workload: Workload) -> tuple[float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=-1,
                              pad_token_id=model.config.pad_token_id)  # fmt: skip
    start = None
    generated = 0
    with model.continuous_batching_context_manager(generation_config=config) as manager:
        start = time.perf_counter()
        for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=out_len, eos_token_id=-1)
        done = 0
        while done < len(workload.prompts):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers continuous batching returned no result within 600 s")
            if result.is_finished() if hasattr(result, "is_finished") else True:
                done += 1
                generated += len(result.generated_tokens)
    torch.cuda.synchronize()
    return time.perf_counter() - start, generated


def emit_table(table: str, out: str | None) -> None:
    """Print a markdown table and, with ``out``, append it to that file (the benchmarks' ``--out``)."""
    print(table)
    if out:
        with open(out, "a") as f:
            f.write(table.rstrip("\n") + "\n\n")


def main(argv: list[str] | None = None) -> int:
    from hf_paged.engine.config import EngineConfig, default_max_num_seqs

    parser = argparse.ArgumentParser(prog="hf-paged bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--workload", default="nano", choices=WORKLOADS)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 requests, outputs clipped to 128 tokens: < 2 min of GPU for all systems",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system (median, min and max)")
    parser.add_argument(
        "--baseline-repeats", type=int, default=None, help="timed runs of hf_generate and hf_cb (default: --repeats)"
    )
    parser.add_argument("--num-blocks", type=int, default=None)
    # hf_paged's settings: the engine's defaults unless given
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=EngineConfig.memory_fraction,
        help="pool = this share of free memory (default: sized by --gpu-memory-utilization)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=EngineConfig.gpu_memory_utilization,
        help="share of the card for weights, activations and pool (default: %(default)s)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="EngineConfig.max_num_seqs (default: the engine's, by the card: 512 on >= 70 GiB, else "
                             "256); also the wave size of the floor")  # fmt: skip
    parser.add_argument("--compile", default="auto", choices=["auto", "none", "layers", "full"],
                        help="hf_paged's compile_model: auto (the engine's default: layers on CUDA), none, layers, "
                             "full (default: %(default)s)")  # fmt: skip
    parser.add_argument("--fuse-projections", default="auto", choices=["auto", "on", "off"],
                        help="EngineConfig.fuse_projections: auto (on CUDA), on, off")  # fmt: skip
    parser.add_argument("--hf-batch", type=int, default=64, help="static batch size of transformers generate")
    parser.add_argument("--out", help="append the markdown table to this file (e.g. benchmarks/RESULTS.md)")
    parser.add_argument("--model-dir", help="load the random-weight model from DIR (built and saved there first)")
    tp_help = "tensor parallelism: run under torchrun; loads --model-dir with tp_plan='auto'"
    parser.add_argument("--tp", action="store_true", help=tp_help)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("hf-paged bench: error: needs a CUDA GPU (the benchmark compares GPU throughput)", file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        print(f"hf-paged bench: error: unknown systems {unknown}; choose from {list(SYSTEMS)}", file=sys.stderr)
        return 2
    import transformers

    import hf_paged

    if args.tp and (not args.model_dir or set(systems) != {"hf_paged"}):
        print(
            "hf-paged bench: error: --tp needs --model-dir and --systems hf_paged (run under torchrun)",
            file=sys.stderr,
        )
        return 2
    model = load_or_build(args.model, args.model_dir, args.tp)
    rank = torch.distributed.get_rank() if args.tp else 0
    num_requests = args.num_requests or (16 if args.quick else None)
    workload = make_workload(args.workload, model.config.vocab_size, num_requests)
    if args.quick:
        workload.output_lens = [min(n, 128) for n in workload.output_lens]
    if args.max_num_seqs is None:  # the engine's default for this card, named in the table's header
        args.max_num_seqs = default_max_num_seqs(next(model.parameters()).device, args.max_num_batched_tokens)
    bandwidth, flops = measure_ceilings()
    floor = floor_seconds(model, workload, bandwidth, flops, args.max_num_seqs)
    baseline_repeats = args.baseline_repeats or args.repeats
    rows = []
    for system in systems:
        try:
            if system == "hf_paged":
                r = run_hf_paged(model, workload, True, args, args.repeats)
            elif system == "hf_paged_no_prefix":
                r = run_hf_paged(model, workload, False, args, args.repeats)
            elif system == "hf_paged_no_cascade":  # shared-prefix decode off (kernels/cascade.py; on by default)
                r = run_hf_paged(model, workload, True, args, args.repeats, cascade_attention=False)
            elif system == "hf_paged_sync":  # async scheduling off: the host's work between steps not overlapped
                r = run_hf_paged(model, workload, True, args, args.repeats, async_scheduling=False)
            elif system == "hf_generate":
                r = run_hf_generate(model, workload, args, baseline_repeats)
            else:
                r = run_hf_cb(model, workload, args, baseline_repeats)
        except Exception as exc:  # report the failure in the table, go on with the other systems
            r = dict(elapsed=[], generated=0, peak=0, note=f"failed: {type(exc).__name__}: {exc}"[:200])
        rows.append((system + (f" (tp={model.tp_size})" if args.tp else ""), r))
        if rank == 0:
            print(f"{system}: {r}", flush=True)
    if rank != 0:
        return 0
    total_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    floor_tps = workload.num_output_tokens / floor
    table = (
        f"### throughput: {args.workload} workload ({len(workload.prompts)} requests, "
        f"{workload.num_prompt_tokens} prompt / {workload.num_output_tokens} output tokens), {args.model}, bf16, "
        f"random weights — {torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, hf_paged {hf_paged.__version__}\n\n"
        f"`hf-paged bench {' '.join(argv if argv is not None else sys.argv[1:])}` — measured copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s; physical floor {floor:.2f} s = "
        f"{floor_tps:.0f} output tok/s; max_num_seqs {args.max_num_seqs}\n\n"
        "| system | runs | time (s), median [min, max] | output tok/s, median [min, max] | total tok/s | % of floor "
        "| start-up to first token (s) | peak memory (GiB) | notes |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    for system, r in rows:
        times = r["elapsed"]
        if not times:
            table += f"| {system} | 0 | - | - | - | - | - | - | {r['note']} |\n"
            continue
        med = statistics.median(times)
        out_tps = r["generated"] / med
        startup = f"{r['startup']:.1f}" if "startup" in r else "-"
        spread = f"[{r['generated'] / max(times):.0f}, {r['generated'] / min(times):.0f}]"
        table += (f"| {system} | {len(times)} | {med:.2f} [{min(times):.2f}, {max(times):.2f}] | {out_tps:.0f} "
                  f"{spread} | {total_tokens / med:.0f} | {out_tps / floor_tps:.1%} | {startup} | "
                  f"{r['peak'] / 2**30:.1f} | {r['note']} |\n")  # fmt: skip
    emit_table(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
