"""The ``hf-paged`` command: generate with the continuous-batching engine, benchmark, and describe the setup.

    hf-paged generate "What is the capital of France?"          # the embedded SmolLM2-135M-Instruct
    hf-paged generate --model ./my-model --file prompts.txt --temperature 0 --json
    hf-paged serve --port 8000 --api-key "$KEY"                  # OpenAI-compatible server (hf_paged.frontends.serve)
    hf-paged bench ...                                           # the GPU benchmark suite (hf_paged.frontends.bench)
    hf-paged info                                                # versions, devices, kernel path, default model

This module holds the parser, the dispatch and the small ``bench`` and ``info`` commands; ``generate`` and
``serve`` live in ``cli_generate`` and ``cli_serve``, over ``cli_engine`` (the engine flags they share and the
engine those flags build).

Mistakes in what the user passes (a missing model, a bad flag value, a model that cannot be paged, a request the
engine can never run, such as more samples than its ``max_num_seqs``) print one line, ``hf-paged: error: ...``, to
stderr and exit with status 2: hf_paged raises ``ValueError``/``TypeError`` for a caller's mistake (STYLE §5). Also
runnable as ``python -m hf_paged.frontends.cli``.
"""

import argparse
import importlib
import os
import platform
import sys

from hf_paged.frontends import cli_generate, cli_serve
from hf_paged.frontends.cli_engine import PROG, UsageError


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``hf-paged: error: ...``, like every other CLI error."""

    def error(self, message: str):
        _print_error(f"{message} (see: {self.prog} --help)")
        raise SystemExit(2)


def _print_error(message: str) -> None:
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-paged`` argument parser with its ``generate``, ``serve``, ``bench`` and ``info`` subcommands."""
    parser = _Parser(prog=PROG, description="PagedAttention for Hugging Face transformers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    cli_generate.add_parser(commands)
    cli_serve.add_parser(commands)
    commands.add_parser(
        "bench",
        help="GPU throughput benchmarks (hf_paged.frontends.bench; arguments pass through)",
        add_help=False,  # `hf-paged bench --help` reaches the benchmark's own parser
    )
    commands.add_parser("info", help="versions, devices, kernel path and the default model")
    return parser


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
            return cli_serve.run(args)
        return cli_generate.run(args)
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
