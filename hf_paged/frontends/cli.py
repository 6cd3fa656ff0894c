"""The ``hf-paged`` command: generate with the continuous-batching engine, benchmark, and describe the setup.

    hf-paged generate "What is the capital of France?"          # the embedded SmolLM2-135M-Instruct
    hf-paged generate --model ./my-model --file prompts.txt --temperature 0 --json
    hf-paged serve --port 8000 --api-key "$KEY"                  # OpenAI-compatible server (hf_paged.frontends.serve)
    hf-paged bench ...                                           # the GPU benchmark suite (hf_paged.frontends.bench)
    hf-paged info                                                # versions, devices, kernel path, default model

``generate`` applies the tokenizer's chat template to each prompt (``--no-chat`` sends raw text; ``--system``
puts one system prompt in front of every prompt, which prefix caching then computes once), streams the tokens of
a single prompt as they come, shows a progress bar for several, and ends with a summary of the engine's metrics.

Mistakes in what the user passes (a missing model, a bad flag value, a model that cannot be paged, a request the
engine can never run, such as more samples than its ``max_num_seqs``) print one line, ``hf-paged: error: ...``, to
stderr and exit with status 2: hf_paged raises ``ValueError``/``TypeError`` for a caller's mistake (STYLE §5). Also
runnable as ``python -m hf_paged.frontends.cli``.
"""

import argparse
import importlib
import json
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass

PROG = "hf-paged"
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_CLI_MAX_NEW_TOKENS = 256  # SamplingParams' default of 16 cuts most answers short
_CLI_TEMPERATURE = 0.0  # greedy: small models (the default's 135M) ramble or switch language when sampled


class UsageError(Exception):
    """A mistake in the command line that argparse cannot see (e.g. no prompt given)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``hf-paged: error: ...``, like every other CLI error."""

    def error(self, message: str):
        _print_error(f"{message} (see: {self.prog} --help)")
        raise SystemExit(2)


def _print_error(message: str) -> None:
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-paged`` argument parser with its ``generate``, ``serve``, ``bench`` and ``info`` subcommands."""
    parser = _Parser(prog=PROG, description="PagedAttention for Hugging Face transformers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    gen = commands.add_parser(
        "generate",
        help="generate answers with the continuous-batching engine",
        description="Generate answers with hf_paged's continuous-batching engine (default model: the embedded "
        "SmolLM2-135M-Instruct). One prompt streams; several show a progress bar.",
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (each gets the chat template)")
    gen.add_argument("--file", help="read prompts from this file, one per line ('-' = stdin); blank lines skipped")
    gen.add_argument("--model", help="embedded default 'smollm2', a model folder, a .gguf file or a cached hub id")
    gen.add_argument("--system", help="a system prompt in front of every prompt (its blocks are computed once)")
    gen.add_argument("--no-chat", action="store_true", help="send the prompts as raw text, without chat template")
    gen.add_argument("--json", action="store_true", help="print the outputs and metrics as one JSON object")

    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=_CLI_MAX_NEW_TOKENS, help="default: %(default)s")
    sampling.add_argument(
        "--temperature",
        type=float,
        default=_CLI_TEMPERATURE,
        help="0 = greedy (the default); --n samples differ only with a temperature > 0",
    )
    sampling.add_argument("--top-k", type=int, default=0, help="0 = off")
    sampling.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    sampling.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    sampling.add_argument("--seed", type=int, help="seed each request's sampling")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    sampling.add_argument("--n", type=int, default=1, help="samples per prompt (they share the prompt's blocks)")
    sampling.add_argument("--beam-width", type=int, default=1, help="> 1 = beam search")
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")

    _add_engine_args(
        gen,
        "KV blocks in the pool; default: what the prompts can need, at most --memory-fraction (0.5) of free memory",
        compile_default="none",  # a few prompts do not pay for a compile
    )

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (needs the serve extra: pip install 'hf_paged[serve]')",
        description="Serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models) "
        "plus /health and /metrics (Prometheus). Default model: the embedded SmolLM2-135M-Instruct.",
    )
    serve.add_argument("model", nargs="?", metavar="MODEL",
                       help="embedded default 'smollm2', a model folder, a .gguf file or a cached hub id")  # fmt: skip
    serve.add_argument("--served-model-name", help="the `model` clients name; default: MODEL")
    serve.add_argument("--host", default="127.0.0.1", help="default: %(default)s (this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    serve.add_argument("--api-key", default=os.environ.get("HF_PAGED_API_KEY"),
                       help="require `Authorization: Bearer KEY` on every endpoint but /health; default: "
                       "$HF_PAGED_API_KEY, else none")  # fmt: skip
    serve.add_argument("--max-queue", type=_positive_int, default=256,
                       help="most requests in flight; more are answered 503; default: %(default)s")  # fmt: skip
    serve.add_argument("--max-prompt-tokens", type=_positive_int,
                       help="longest prompt accepted (400 beyond); default: the model's context")  # fmt: skip
    serve.add_argument("--max-body-bytes", type=_positive_int, default=4 * 2**20,
                       help="largest request body accepted (413 beyond); default: %(default)s")  # fmt: skip
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds the requests in flight get on SIGTERM before they are aborted")  # fmt: skip
    serve.add_argument(
        "--data-parallel",
        type=_positive_int,
        default=1,
        metavar="N",
        help="N engine replicas, one process per GPU (replica i on GPU i), behind this one server; each request goes "
        "to the least-loaded replica. Meant for N GPUs and a model that fits one; on the CPU the replicas share the "
        "cores. Default: 1 (one engine in the server process)",
    )
    serve.add_argument(
        "--engine-process",
        choices=("auto", "on", "off"),
        default="auto",
        help="run the engine in a process of its own, the server process keeping HTTP, tokenisation and SSE (as "
        "vLLM does; they share no GIL): 'auto' = on with CUDA, off on the CPU; --data-parallel N > 1 and "
        "--api-server-count N > 1 always do",
    )
    serve.add_argument(
        "--api-server-count",
        type=_positive_int,
        default=1,
        metavar="N",
        help="N HTTP server processes on the same host:port, each parsing, tokenising and streaming its own "
        "connections and talking to every engine process (the engine runs in processes of its own); for when one "
        "process's HTTP work limits the served throughput at saturation. Default: 1",
    )
    _add_engine_args(serve, "KV blocks in the pool; default: sized from memory (see --gpu-memory-utilization)",
                     compile_default="auto")  # fmt: skip

    commands.add_parser(
        "bench",
        help="GPU throughput benchmarks (hf_paged.frontends.bench; arguments pass through)",
        add_help=False,  # `hf-paged bench --help` reaches the benchmark's own parser
    )
    commands.add_parser("info", help="versions, devices, kernel path and the default model")
    return parser


_COMPILE = {"auto": None, "none": False, "layers": "layers", "full": "full"}  # --compile -> compile_model


def _add_engine_args(command: argparse.ArgumentParser, num_blocks_help: str, compile_default: str) -> None:
    """The engine settings ``generate`` and ``serve`` share."""
    engine = command.add_argument_group("engine")
    engine.add_argument("--num-blocks", type=_positive_int, help=num_blocks_help)
    engine.add_argument(
        "--memory-fraction",
        type=float,
        help="the pool takes this share of free memory; default: on CUDA what --gpu-memory-utilization leaves after "
        "a profiled step, on the CPU 0.5 of free RAM up to 2 GiB",
    )
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the card for weights, activations and pool; default: %(default)s")  # fmt: skip
    engine.add_argument("--compile", choices=tuple(_COMPILE), default=compile_default,
                        help="torch.compile on CUDA: auto (each decoder layer, faster steps, ~10-25 s of start-up), "
                             "none, layers, full; default: %(default)s")  # fmt: skip
    engine.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block; default: 16")
    engine.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048, help="default: %(default)s")
    engine.add_argument("--max-num-seqs", type=_positive_int,
                        help="most sequences in one step; default: 512 on a CUDA card of >= 70 GiB, else 256, "
                             "never above --max-num-batched-tokens")  # fmt: skip
    engine.add_argument("--no-prefix-caching", action="store_true", help="don't reuse blocks across prompts")
    engine.add_argument(
        "--no-cascade-attention",
        action="store_true",
        help="decode rows that share a prompt prefix read it each (by default on CUDA they read it once a step)",
    )
    engine.add_argument(
        "--preemption-mode",
        choices=("recompute", "swap"),
        default="recompute",
        help="out of blocks: recompute a preempted request later, or swap its blocks to CPU",
    )
    engine.add_argument("--device", help="default: cuda when available, else cpu")
    engine.add_argument("--dtype", choices=_DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")


def main(argv: list[str] | None = None) -> int:
    """Run the ``hf-paged`` command line.

    Args:
        argv: the arguments after the program name; None = ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 for a usage error (one line on stderr), 130 on Ctrl-C.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        if args.command == "info":
            return _info()
        if args.command == "serve":
            return _serve(args)
        return _generate(args)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, already printed)
        return exit_.code if isinstance(exit_.code, int) else 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `hf-paged generate ... | head`: stop quietly, as the Python docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    # ValueError/TypeError: hf_paged's errors for a caller's mistake, from SamplingParams, load_model, the engine's
    # constructor and its add_request (reached through generate and stream); OSError: unreadable model files.
    except (UsageError, ValueError, TypeError, OSError) as err:
        _print_error(err)
        return 2


# ---- bench ---------------------------------------------------------------------------------------


def _bench(argv: list[str]) -> int:
    try:
        bench = importlib.import_module("hf_paged.frontends.bench")
    except ModuleNotFoundError as err:
        if err.name != "hf_paged.frontends.bench":
            raise
        _print_error("the benchmark suite (hf_paged.frontends.bench) is not in this version of hf_paged")
        return 2
    try:
        return bench.main(argv)
    except SystemExit as exit_:  # the benchmark's argparse: --help or a usage error
        return exit_.code if isinstance(exit_.code, int) else 0


# ---- generate ------------------------------------------------------------------------------------


@dataclass
class _Prompt:
    text: str  # what the user typed, before the system prompt and chat template
    token_ids: list[int]


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file is not None:
        if args.file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            try:
                with open(args.file, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except OSError as err:
                raise UsageError(f"--file {args.file!r} cannot be read: {err.strerror}") from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError("no prompt: pass PROMPT... or --file FILE (one prompt per line)")
    return prompts


def _sampling_params(args: argparse.Namespace):
    from hf_paged import SamplingParams

    return SamplingParams(
        n=args.n,
        beam_width=args.beam_width,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _tokenize(tokenizer, texts: list[str], system: str | None, chat: bool) -> list[_Prompt]:
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UsageError("the model's tokenizer has no chat template; pass --no-chat to send raw text")
    prompts = []
    for text in texts:
        if chat:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": text})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = tokenizer(f"{system}\n{text}" if system else text)["input_ids"]
        prompts.append(_Prompt(text, list(ids)))
    return prompts


def _load(args: argparse.Namespace, tp_plan: str | None = None):
    import torch
    from transformers.utils import logging as hf_logging

    from hf_paged.frontends import models

    if args.model in (None, models.DEFAULT_MODEL):
        gguf = models.default_model_path()
        if not models.converted_dir(gguf, None).is_dir():
            print(f"{PROG}: converting the embedded {models.DEFAULT_DESCRIPTION} to safetensors, once (~20 s)...",
                  file=sys.stderr, flush=True)  # fmt: skip
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    # Without transformers' "Loading weights" bars and info logs; restored after, for callers of main() in-process.
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        return models.load_model(args.model, device=args.device, dtype=dtype, tp_plan=tp_plan)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _num_blocks(model, prompts: list[_Prompt], params, args: argparse.Namespace) -> int:
    """Blocks for every prompt at once (no preemption), capped by ``--memory-fraction`` of free memory.

    On the CPU a pool of half the free RAM would take tens of seconds to zero, for a few prompts.
    """
    from hf_paged.core.model_info import ModelInfo

    if args.num_blocks is not None:
        return args.num_blocks
    bs = args.block_size
    width = max(params.n, params.beam_width)
    # As the engine's admission check: the prompt once, then each sequence's own blocks plus a copied partial one.
    need = sum(-(-len(p.token_ids) // bs) + width * (-(-params.max_new_tokens // bs) + 1) for p in prompts)
    return min(need, ModelInfo.from_model(model).num_blocks_for(None, bs, args.memory_fraction or 0.5))


def _make_engine(model, tokenizer, num_blocks: int, args: argparse.Namespace):
    from hf_paged import ContinuousBatcher, EngineConfig

    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        memory_fraction=args.memory_fraction,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        compile_model=_COMPILE[args.compile],
        enable_prefix_caching=not args.no_prefix_caching,
        cascade_attention=False if args.no_cascade_attention else None,
        preemption_mode=args.preemption_mode,
    )
    return ContinuousBatcher(model, tokenizer, config)


def _generate(args: argparse.Namespace) -> int:
    from hf_paged.frontends.models import DEFAULT_MODEL

    texts = _read_prompts(args)
    params = _sampling_params(args)  # bad sampling values fail here, before the model loads
    model, tokenizer = _load(args)
    prompts = _tokenize(tokenizer, texts, args.system, chat=not args.no_chat)
    engine = _make_engine(model, tokenizer, _num_blocks(model, prompts, params, args), args)

    start = time.perf_counter()
    if len(prompts) == 1 and params.n == 1 and params.beam_width == 1 and not args.json:
        finish_reason = None
        for delta in engine.stream(prompts[0].token_ids, params):
            print(delta.text, end="", flush=True)
            finish_reason = delta.finish_reason
        print()
        if finish_reason == "length":
            print(f"[stopped at --max-new-tokens {params.max_new_tokens}]", file=sys.stderr)
        outputs = None
    else:
        use_tqdm = len(prompts) > 1 and not args.json
        outputs = engine.generate([p.token_ids for p in prompts], params, use_tqdm=use_tqdm)
    wall_s = time.perf_counter() - start

    metrics = engine.metrics()
    summary = {
        "requests": len(prompts),
        "generated_tokens": metrics.num_generated_tokens,
        "throughput_tok_s": metrics.generation_throughput,
        "wall_s": wall_s,
        "kv_blocks_used_peak": engine.metrics().peak_used_blocks,
        "kv_blocks_total": metrics.num_blocks,
        "token_state_share_at_peak": engine.metrics().token_state_share_at_peak,
        "prefix_hit_rate": metrics.prefix_hit_rate,
        "preemptions": metrics.num_preemptions,
    }
    if args.json:
        outputs = _jsonable(prompts, outputs, beam_search=params.beam_width > 1)
        print(json.dumps({"model": args.model or DEFAULT_MODEL, "outputs": outputs, "metrics": summary}))
        return 0
    if outputs is not None:
        _print_outputs(prompts, outputs)
    _print_summary(summary)
    return 0


def _jsonable(prompts: list[_Prompt], outputs, beam_search: bool) -> list[dict]:
    # Without beam search the engine sums log-probs only when they are asked for (not a CLI flag yet).
    return [
        {
            "prompt": prompt.text,
            "num_prompt_tokens": len(prompt.token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "completions": [
                {
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                }
                | ({"cumulative_logprob": c.cumulative_logprob} if beam_search else {})
                for c in out.outputs
            ],
        }
        for prompt, out in zip(prompts, outputs, strict=True)
    ]


def _print_outputs(prompts: list[_Prompt], outputs) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True), start=1):
        print(f"[{i}/{len(prompts)}] {prompt.text}")
        for completion in out.outputs:
            if len(out.outputs) > 1:
                print(f"  --- {completion.index + 1} ({completion.finish_reason}) ---")
            print(completion.text.strip())
        print()


def _print_summary(s: dict) -> None:
    sys.stdout.flush()  # the summary goes to stderr, after the answers
    print(
        f"-- {s['requests']} request(s), {s['generated_tokens']} generated tokens, "
        f"{s['throughput_tok_s']:.1f} tok/s ({s['wall_s']:.1f} s)\n"
        f"-- KV blocks used {s['kv_blocks_used_peak']}/{s['kv_blocks_total']} at peak, token states "
        f"{s['token_state_share_at_peak']:.1%} of their slots; prefix hit rate {s['prefix_hit_rate']:.1%}; "
        f"preemptions {s['preemptions']}",
        file=sys.stderr,
    )


# ---- serve ---------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    try:
        from hf_paged.frontends import serve
    except ModuleNotFoundError as err:
        if err.name not in ("fastapi", "uvicorn", "prometheus_client", "starlette"):
            raise
        raise UsageError(f"`{PROG} serve` needs the serve extra ({err.name} is missing): "
                         "pip install 'hf_paged[serve]'") from None  # fmt: skip
    from hf_paged.serving.async_engine import AsyncEngine

    if args.api_server_count > 1:
        return _serve_api_servers(args, serve)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: tensor parallelism, rank 0 serves
        engine = _tensor_parallel_engine(args)
        if engine is None:  # another rank: it mirrored rank 0 until rank 0 shut down
            return 0
    elif args.data_parallel > 1 or _engine_process(args):
        engine = _data_parallel_engine(args)
    else:
        model, tokenizer = _load(args)
        if next(model.parameters()).device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            import torch

            # The HTTP event loop needs a core of its own: with torch's intra-op threads on every core, each of a
            # step's parallel regions waits for a thread the event loop has preempted (4.6x slower on 2 cores,
            # 6 streams).
            torch.set_num_threads(max(1, torch.get_num_threads() - 1))
        # Built on the engine thread, which alone drives it from then on (CUDA graphs are captured there).
        engine = AsyncEngine(lambda: _make_engine(model, tokenizer, args.num_blocks, args))
    serve.run(engine, host=args.host, port=args.port, **_server_options(args))
    return 0


def _server_options(args: argparse.Namespace) -> dict:
    """The HTTP front's settings, the same for one front (serve.run) and several (api_servers.run)."""
    from hf_paged.frontends.models import DEFAULT_MODEL

    return dict(
        model_name=args.served_model_name or args.model or DEFAULT_MODEL,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_prompt_tokens=args.max_prompt_tokens,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
    )


def _serve_api_servers(args: argparse.Namespace, serve) -> int:
    """``--api-server-count N > 1``: N HTTP processes (hf_paged.frontends.api_servers) before the engine processes.

    Returns the exit status (1: every API server or every engine process died); after a signal, ends the process
    by that signal once everything has stopped, as uvicorn does."""
    from hf_paged.frontends import api_servers

    n = args.api_server_count
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(f"--api-server-count {n} does not combine with tensor parallelism (torchrun, WORLD_SIZE="
                         f"{os.environ['WORLD_SIZE']}): serve with one API server (--api-server-count 1)")  # fmt: skip
    if args.engine_process == "off":
        raise UsageError(f"--api-server-count {n} needs the engine in processes of its own, but --engine-process is "
                         "'off': pass --engine-process on (or auto), or --api-server-count 1")  # fmt: skip
    sockets = api_servers.bind(args.host, args.port, n)  # a busy port fails before any model loads
    try:
        engine = _data_parallel_engine(args, num_fronts=n)
    except BaseException:
        for sock in set(sockets):
            sock.close()
        raise
    status, received = api_servers.run(engine, sockets, **_server_options(args))
    if received is not None:
        signal.signal(received, signal.SIG_DFL)
        signal.raise_signal(received)
    return status


def _tensor_parallel_engine(args: argparse.Namespace):
    """Under torchrun: every rank loads its shard (``tp_plan="auto"``); rank 0 returns an AsyncEngine to serve, the
    other ranks mirror it (``follow``) and return None once it has shut down."""
    import torch.distributed as dist

    from hf_paged.serving.async_engine import AsyncEngine, follow

    if args.data_parallel > 1:
        raise UsageError(f"--data-parallel {args.data_parallel} does not combine with tensor parallelism (torchrun, "
                         f"WORLD_SIZE={os.environ['WORLD_SIZE']}): use one or the other")  # fmt: skip
    model, tokenizer = _load(args, tp_plan="auto")
    if dist.get_rank() != 0:
        # torchrun passes its signals to every rank: this one ends when rank 0's shutdown reaches it, after the
        # requests in flight drained (an early exit would leave rank 0's collectives without a peer).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow(_make_engine(model, tokenizer, args.num_blocks, args))
        return None
    # Built on the engine thread, which alone drives it from then on (CUDA graphs are captured there).
    return AsyncEngine(lambda: _make_engine(model, tokenizer, args.num_blocks, args))


def _engine_process(args: argparse.Namespace) -> bool:
    if args.engine_process != "auto":
        return args.engine_process == "on"
    if args.device is not None:
        return args.device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def _data_parallel_engine(args: argparse.Namespace, num_fronts: int = 0):
    """``--data-parallel N``: N replica processes, each loading the model onto its own GPU (or the CPU); with
    ``num_fronts`` pipes for that many API-server processes."""
    import functools

    import torch

    from hf_paged.serving.data_parallel import DataParallelEngine
    from hf_paged.frontends import models

    n = args.data_parallel
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise UsageError(f"--device must be 'cuda' or 'cpu' with --data-parallel {n} (replica i uses GPU i), "
                         f"got {device!r}")  # fmt: skip
    if device == "cuda" and n > torch.cuda.device_count():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UsageError(f"--data-parallel {n} needs {n} GPUs, but {torch.cuda.device_count()} are visible"
                         + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                         + f"; pass --data-parallel {torch.cuda.device_count()} or fewer")  # fmt: skip
    # A GGUF model is converted here, once, rather than by every replica at the same time.
    gguf = models.default_model_path() if args.model in (None, models.DEFAULT_MODEL) else args.model
    if gguf.endswith(".gguf") and os.path.isfile(gguf) and not models.converted_dir(gguf, None).is_dir():
        print(f"{PROG}: converting {os.path.basename(gguf)} to safetensors, once (~20 s)...", file=sys.stderr,
              flush=True)  # fmt: skip
        models.convert_gguf(gguf)
    num_threads = None
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # a core left for each HTTP process, the rest shared
        num_threads = max(1, ((os.cpu_count() or 1) - max(1, num_fronts)) // n)
    replica_args = argparse.Namespace(**{**vars(args), "device": device})
    return DataParallelEngine(functools.partial(_replica_engine, replica_args), n, device, num_threads, num_fronts)


def _replica_engine(args: argparse.Namespace):
    """The engine of one ``--data-parallel`` replica, built in its process (a module-level function: it pickles)."""
    model, tokenizer = _load(args)
    return _make_engine(model, tokenizer, args.num_blocks, args)


# ---- info ----------------------------------------------------------------------------------------


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "not installed"


def _info() -> int:
    import torch

    import hf_paged
    from hf_paged.frontends import models

    print(f"hf_paged {hf_paged.__version__} ({os.path.dirname(hf_paged.__file__)})")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}, "
        f"transformers {_version('transformers')}"
    )
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            print(f"device cuda:{i}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
        kernels = "Triton kernels (CUDA tensors)"
    else:
        print(f"device: CPU ({os.cpu_count()} cores; no CUDA device)")
        kernels = "torch reference ops (CPU tensors; Triton runs on CUDA tensors only)"
    print(f"kernel path: {kernels}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: tests run the Triton launchers on the CPU through Triton's interpreter")
    try:
        gguf = models.default_model_path()
    except ValueError as err:
        print(f"default model: {err}")
        return 0
    converted = models.converted_dir(gguf, None)
    state = "converted" if converted.is_dir() else "not converted yet: the first use converts it, ~20 s"
    print(f"default model: {models.DEFAULT_DESCRIPTION} ({models.DEFAULT_MODEL!r}), GGUF {gguf}")
    print(f"converted cache: {converted} ({state})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
