"""``hf-paged serve``: the OpenAI-compatible server, with the engine the flags ask for.

The engine is one of:

- an AsyncEngine in the server's process (the default on the CPU);
- a DataParallelEngine of N replica processes (``--data-parallel N``), or of one (``--engine-process``, the default
  on CUDA, so that the engine and the HTTP loop share no GIL);
- under torchrun (``WORLD_SIZE > 1``), tensor parallelism: rank 0 serves an AsyncEngine, the other ranks mirror it
  (hf_paged.serving.tensor_parallel);
- with ``--api-server-count N > 1``, N HTTP processes (hf_paged.frontends.api_servers) over the engine processes.
"""

import argparse
import os
import signal
import sys

from hf_paged.frontends.cli_engine import (
    PROG,
    UsageError,
    add_engine_args,
    load_model_quietly,
    make_engine,
    positive_int,
)
from hf_paged.frontends.tool_calls import PARSERS as TOOL_CALL_PARSERS


def add_parser(commands) -> None:
    """Add the ``serve`` subcommand to the ``hf-paged`` subparsers ``commands``."""
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
    serve.add_argument("--max-queue", type=positive_int, default=256,
                       help="most requests in flight; more are answered 503; default: %(default)s")  # fmt: skip
    serve.add_argument("--max-prompt-tokens", type=positive_int,
                       help="longest prompt accepted (400 beyond); default: the model's context")  # fmt: skip
    serve.add_argument("--max-body-bytes", type=positive_int, default=4 * 2**20,
                       help="largest request body accepted (413 beyond); default: %(default)s")  # fmt: skip
    serve.add_argument("--tool-call-parser", choices=("auto", *TOOL_CALL_PARSERS), default="auto",
                       help="the format of tool calls in the model's output, parsed into `tool_calls` when a chat "
                       "sends `tools`: 'auto' = the one the chat template writes; default: %(default)s")  # fmt: skip
    serve.add_argument("--metric-names", choices=("hf_paged", "vllm"), default="hf_paged",
                       help="/metrics names: hf_paged_* or vLLM's vllm:* (dashboards made for vLLM read them); "
                       "default: %(default)s")  # fmt: skip
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds the requests in flight get on SIGTERM before they are aborted")  # fmt: skip
    serve.add_argument(
        "--data-parallel",
        type=positive_int,
        default=1,
        metavar="N",
        help="N engine replicas, one process per GPU (replica i on GPU i), behind this one server; a request goes to "
        "the replica that was sent its prompt's prefix before, unless that one is much busier than the least-loaded. "
        "Meant for N GPUs and a model that fits one; on the CPU the replicas share the cores. Default: 1 (one engine "
        "in the server process)",
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
        type=positive_int,
        default=1,
        metavar="N",
        help="N HTTP server processes on the same host:port, each parsing, tokenising and streaming its own "
        "connections and talking to every engine process (the engine runs in processes of its own); for when one "
        "process's HTTP work limits the served throughput at saturation. Default: 1",
    )
    add_engine_args(serve, "KV blocks in the pool; default: sized from memory (see --gpu-memory-utilization)",
                     compile_default="auto")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """``hf-paged serve``: build the engine the flags ask for and serve it until a signal; the exit status."""
    if args.data_parallel > 1:  # settings first: a wrong flag is reported whatever is installed
        _data_parallel_device(args)
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
    elif args.data_parallel > 1 or uses_engine_process(args):
        engine = _data_parallel_engine(args)
    else:
        model, tokenizer = load_model_quietly(args)
        if next(model.parameters()).device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            import torch

            # The HTTP event loop needs a core of its own: with torch's intra-op threads on every core, each of a
            # step's parallel regions waits for a thread the event loop has preempted (4.6x slower on 2 cores,
            # 6 streams).
            torch.set_num_threads(max(1, torch.get_num_threads() - 1))
        # Built on the engine thread, which alone drives it from then on (CUDA graphs are captured there).
        engine = AsyncEngine(lambda: make_engine(model, tokenizer, args.num_blocks, args))
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
        tool_call_parser=args.tool_call_parser,
        metric_names=args.metric_names,
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

    from hf_paged.serving.async_engine import AsyncEngine
    from hf_paged.serving.tensor_parallel import follow

    if args.data_parallel > 1:
        raise UsageError(f"--data-parallel {args.data_parallel} does not combine with tensor parallelism (torchrun, "
                         f"WORLD_SIZE={os.environ['WORLD_SIZE']}): use one or the other")  # fmt: skip
    model, tokenizer = load_model_quietly(args, tp_plan="auto")
    if dist.get_rank() != 0:
        # torchrun passes its signals to every rank: this one ends when rank 0's shutdown reaches it, after the
        # requests in flight drained (an early exit would leave rank 0's collectives without a peer).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow(make_engine(model, tokenizer, args.num_blocks, args))
        return None
    # Built on the engine thread, which alone drives it from then on (CUDA graphs are captured there).
    return AsyncEngine(lambda: make_engine(model, tokenizer, args.num_blocks, args))


def uses_engine_process(args: argparse.Namespace) -> bool:
    """Whether the engine runs in a process of its own (``--engine-process``; "auto": on with CUDA)."""
    if args.engine_process != "auto":
        return args.engine_process == "on"
    if args.device is not None:
        return args.device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def _data_parallel_device(args: argparse.Namespace) -> str:
    """The replicas' device type for ``--data-parallel N``, checked against the visible GPUs."""
    import torch

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
    return device


def _data_parallel_engine(args: argparse.Namespace, num_fronts: int = 0):
    """``--data-parallel N``: N replica processes, each loading the model onto its own GPU (or the CPU); with
    ``num_fronts`` pipes for that many API-server processes."""
    import functools

    from hf_paged.frontends import models
    from hf_paged.serving.data_parallel import DataParallelEngine

    n = args.data_parallel
    device = _data_parallel_device(args)
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
    return DataParallelEngine(functools.partial(replica_engine, replica_args), n, device, num_threads, num_fronts)


def replica_engine(args: argparse.Namespace):
    """The engine of one ``--data-parallel`` replica, built in its process (a module-level function: it pickles)."""
    model, tokenizer = load_model_quietly(args)
    return make_engine(model, tokenizer, args.num_blocks, args)
