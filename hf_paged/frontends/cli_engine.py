"""What ``hf-paged generate`` and ``hf-paged serve`` share: the engine flags, loading the model ``--model`` names,
building the ContinuousBatcher the flags describe, and the CLI's error for a mistake in the command line.
"""

import argparse
import sys

PROG = "hf-paged"
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # hf_paged.core.kv_dtype's, without importing torch
COMPILE = {"auto": None, "none": False, "layers": "layers", "full": "full"}  # --compile -> compile_model
# hf_paged.engine.quantization.QUANTIZATIONS' names, without importing torch
QUANTIZATIONS = ("none", "int8", "int8-dynamic", "int4", "float8", "float8-dynamic")


class UsageError(Exception):
    """A mistake in the command line that argparse cannot see (e.g. no prompt given)."""


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def add_engine_args(command: argparse.ArgumentParser, num_blocks_help: str, compile_default: str) -> None:
    """The engine settings ``generate`` and ``serve`` share."""
    engine = command.add_argument_group("engine")
    engine.add_argument("--num-blocks", type=positive_int, help=num_blocks_help)
    engine.add_argument(
        "--memory-fraction",
        type=float,
        help="the pool takes this share of free memory; default: on CUDA what --gpu-memory-utilization leaves after "
        "a profiled step, on the CPU 0.5 of free RAM up to 2 GiB",
    )
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the card for weights, activations and pool; default: %(default)s")  # fmt: skip
    engine.add_argument("--compile", choices=tuple(COMPILE), default=compile_default,
                        help="torch.compile on CUDA: auto (each decoder layer, faster steps, ~10-25 s of start-up), "
                             "none, layers, full; default: %(default)s")  # fmt: skip
    engine.add_argument("--block-size", type=positive_int, default=16, help="tokens per block; default: 16")
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="default: %(default)s")
    engine.add_argument("--max-num-seqs", type=positive_int,
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
    engine.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    engine.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                        help="quantize the weights on load with torchao (the quantization extra): int8, int4, float8 "
                             "weight-only; int8-dynamic, float8-dynamic (CUDA >= sm89) also quantize activations. "
                             "A model saved quantized loads quantized without it; default: %(default)s")  # fmt: skip
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="what the KV pool stores: auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2: one "
                             "byte an element, twice the tokens in the same memory; default: %(default)s")  # fmt: skip


def load_model_quietly(args: argparse.Namespace, tp_plan: str | None = None):
    """The model and tokenizer ``--model`` names, on ``--device`` in ``--dtype``, without transformers' loading
    bars and info logs; says so on stderr when the embedded default is converted first (~20 s, once)."""
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
        return models.load_model(args.model, device=args.device, dtype=dtype, tp_plan=tp_plan,
                                 quantization=args.quantization)  # fmt: skip
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def make_engine(model, tokenizer, num_blocks: int, args: argparse.Namespace):
    """The ContinuousBatcher over ``model`` that the engine flags in ``args`` describe."""
    from hf_paged import ContinuousBatcher, EngineConfig

    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        memory_fraction=args.memory_fraction,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        compile_model=COMPILE[args.compile],
        enable_prefix_caching=not args.no_prefix_caching,
        cascade_attention=False if args.no_cascade_attention else None,
        preemption_mode=args.preemption_mode,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    return ContinuousBatcher(model, tokenizer, config)
