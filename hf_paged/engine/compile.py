"""torch.compile of the model for the engine: each decoder layer in place ("layers"), or the whole forward ("full").

"layers": each decoder layer (LlamaDecoderLayer, Qwen3DecoderLayer...) is compiled in place. The attention function
is excluded from tracing, so a layer compiles into two pieces around it (projections, norms, rotary / output
projection, residuals, MLP); all layers share the compiled code (same code, dynamic shapes). Eagerly a layer runs
about 40 small kernels; compiled, a handful. Models without such classes compile their norms, MLPs and attention
modules instead.

A model whose quantized layers cannot be traced (``hf_paged.engine.quantization.eager_reason``: bitsandbytes'
LLM.int8) is left eager, with a log line saying why; torchao's quantized tensors compile like plain weights.
"""

import logging

import torch

from hf_paged.engine.config import auto_compile_mode
from hf_paged.engine.quantization import eager_reason

logger = logging.getLogger(__name__)

LAYER_SUFFIXES = ("DecoderLayer",)  # class-name endings of the modules "layers" compiles
FALLBACK_SUFFIXES = ("RMSNorm", "MLP", "Attention")  # compiled instead when a model has no decoder-layer class


def resolve_compile_mode(compile_model: bool | str | None, use_cuda_graphs: bool, device: torch.device) -> str | None:
    """The compilation that runs: "layers", "full" or None (eager), from ``EngineConfig.compile_model``.

    None (auto) means ``auto_compile_mode()`` when the steps replay CUDA graphs on CUDA, else eager; True means
    "full". The CPU never compiles.
    """
    if device.type != "cuda":
        return None
    if compile_model is None:
        compile_model = auto_compile_mode() if use_cuda_graphs else False
    return "full" if compile_model is True else (compile_model or None)


def compile_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """torch.compile the forward of every decoder layer of ``model`` in place; returns the modules compiled (none
    when its quantization cannot be traced: it then runs eagerly)."""
    reason = eager_reason(model)
    if reason is not None:
        logger.warning("the model's layers run eagerly, not compiled: %s", reason)
        return []
    compiled = []
    for suffixes in (LAYER_SUFFIXES, FALLBACK_SUFFIXES):
        for module in model.modules():
            if type(module).__name__.endswith(suffixes) and not getattr(module, "_hf_paged_compiled", False):
                module.forward = torch.compile(module.forward, dynamic=True)
                module._hf_paged_compiled = True
                compiled.append(module)
        if compiled or any(getattr(m, "_hf_paged_compiled", False) for m in model.modules()):
            break
    return compiled


def uncompile_layers(modules: list[torch.nn.Module]) -> None:
    """Undo ``compile_layers``: the modules' class forwards again."""
    for module in modules:
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_hf_paged_compiled", None)
