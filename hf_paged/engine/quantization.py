"""Quantized weights: the torchao quantizations ``--quantization`` names, and what the engine can do with a model
quantized by any of transformers' integrations.

Two ways in, both through transformers' own integrations (hf_paged has no quantized kernels of its own):

- quantize on load: ``load_model(name, quantization="int8")`` passes ``TorchAoConfig(quant_type=...)`` to
  ``from_pretrained``; ``torchao_config(name, device, dtype)`` builds the torchao config, refusing a name this device
  cannot run with a ``ValueError`` before any weight is read;
- a pre-quantized folder (torchao, bitsandbytes, compressed-tensors, ...; saved with a ``quantization_config``) loads
  as any folder: ``from_pretrained`` reads its config.

Quantized projections are tensor subclasses (torchao: ``Int8Tensor``, ``Float8Tensor``, ...) or module classes
(bitsandbytes ``Linear4bit``/``Linear8bitLt``); attention, the KV cache and the engine see plain activations, so
PagedCache and the engine need nothing of them beyond three rules: projection fusion leaves them unfused
(``hf_paged.engine.fuse``), a quantization that cannot be traced runs eagerly (``eager_reason``), and one whose
eager GEMMs sync with the host runs without CUDA graphs (``graph_reason``).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Divides the widths of Llama (4096, 14336), Qwen3 (1024, 3072) and SmolLM2 (576, 1536). Groups of 32 cost a scale and
# a zero point per 32 weights (~5 bits a weight in all) against 64's ~4.5, for SmolLM2-135M's log-likelihood error
# 0.60 nats a token instead of 0.85 (benchmarks/tools/quant_accuracy.py, CPU).
INT4_GROUP_SIZE = 32

# --quantization name -> what it is, in torchao's words. "none" keeps the checkpoint's weights.
QUANTIZATIONS = {
    "none": "no quantization",
    "int8": "torchao Int8WeightOnlyConfig: int8 weights, per output channel",
    "int8-dynamic": "torchao Int8DynamicActivationInt8WeightConfig: int8 weights and per-token int8 activations",
    "int4": "torchao Int4WeightOnlyConfig (CUDA, bfloat16: tinygemm) or IntxWeightOnlyConfig (CPU): int4 weights, "
    f"groups of {INT4_GROUP_SIZE}",
    "float8": "torchao Float8WeightOnlyConfig: float8 e4m3 weights, per output channel",
    "float8-dynamic": "torchao Float8DynamicActivationFloat8WeightConfig: float8 weights and per-token float8 "
    "activations (CUDA, compute capability >= 8.9)",
}


def _needs_torchao(name: str):
    try:
        import torchao.quantization as quantization
    except ImportError:
        raise ValueError(
            f"--quantization {name} needs torchao, which is not installed; install it with: "
            "pip install 'hf_paged[quantization]'"
        ) from None
    return quantization


def torchao_config(name: str, device: "torch.device | str", dtype: "torch.dtype"):
    """The torchao config ``--quantization name`` stands for on ``device`` with ``dtype`` weights.

    Args:
        name: one of ``QUANTIZATIONS``.
        device: where the model runs (``"int4"`` and ``"float8-dynamic"`` depend on it).
        dtype: the unquantized weights' dtype (torchao's CUDA int4 kernel takes bfloat16 only).

    Returns:
        A torchao ``AOBaseConfig`` for ``TorchAoConfig(quant_type=...)`` or ``torchao.quantization.quantize_``;
        None for ``"none"``.

    Raises:
        ValueError: an unknown name, torchao missing, or a quantization this device or dtype cannot run.
    """
    import torch

    if name not in QUANTIZATIONS:
        raise ValueError(f"`quantization` must be one of {sorted(QUANTIZATIONS)}, got {name!r}")
    if name == "none":
        return None
    device = torch.device(device)
    q = _needs_torchao(name)
    if name == "int8":
        return q.Int8WeightOnlyConfig()
    if name == "int8-dynamic":
        return q.Int8DynamicActivationInt8WeightConfig()
    if name == "float8":
        return q.Float8WeightOnlyConfig()
    if name == "int4":
        if device.type != "cuda":
            # torchao's packed int4 layouts run on CUDA only (tinygemm) or need the mslk package; on the CPU the
            # int4 values are kept one per int8 and dequantised per GEMM: int4 accuracy, int8 memory.
            # asymmetric (a zero point per group), as the CUDA kernel's quantization is
            return q.IntxWeightOnlyConfig(
                weight_dtype=torch.int4, granularity=q.PerGroup(INT4_GROUP_SIZE), mapping_type=q.MappingType.ASYMMETRIC
            )
        if dtype != torch.bfloat16:
            raise ValueError(
                f"--quantization int4 on CUDA needs bfloat16 weights (torchao's tinygemm int4 kernel), got {dtype}; "
                "pass --dtype bfloat16"
            )
        return q.Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d")
    # float8-dynamic: torchao's float8 GEMM (torch._scaled_mm) needs Ada/Hopper or newer.
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"--quantization float8-dynamic needs a CUDA GPU of compute capability >= 8.9 (float8 GEMMs), got "
            f"device {str(device)!r}; use --quantization float8 (weight-only) instead"
        )
    return q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow())


def weight_bytes(model: "torch.nn.Module") -> int:
    """Bytes ``model``'s parameters occupy as stored: a quantized weight (torchao's tensor subclasses) counts its
    inner tensors (the packed values, scales and zero points), a plain one ``numel * element_size``. A decode step
    of a dense model reads about this much (the input embedding only its gathered rows)."""
    return sum(t.numel() * t.element_size() for p in model.parameters() for t in _inner_tensors(p.data))


def _inner_tensors(t: "torch.Tensor"):
    """The plain tensors a (possibly nested) tensor subclass stores: its ``__tensor_flatten__`` names, recursively;
    a plain tensor is its own."""
    import torch

    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _inner_tensors(getattr(t, name))
    else:
        yield t


def quantization_method(model: "torch.nn.Module") -> str | None:
    """How ``model``'s weights are quantized: transformers' ``quant_method`` (``"torchao"``, ``"bitsandbytes"``,
    ``"compressed-tensors"``, ``"fp8"``, ...); ``"torchao"`` for weights that ``torchao.quantization.quantize_``
    changed in place without a config; None for plain weights."""
    import torch

    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is not None:
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        method = getattr(method, "value", method)  # transformers' QuantizationMethod enum, or its string
        if method is not None:
            return str(method)
    for param in model.parameters():
        if type(param.data) is not torch.Tensor and type(param.data).__module__.startswith("torchao"):
            return "torchao"
    return None


def eager_reason(model: "torch.nn.Module") -> str | None:
    """Why ``model``'s quantized layers must run eagerly (no ``torch.compile``, no CUDA graphs); None when they can
    be traced.

    bitsandbytes' LLM.int8 (8-bit with ``llm_int8_threshold`` > 0) splits out the outlier columns of each input by a
    data-dependent mask: a host sync that a CUDA graph cannot capture, and a graph break per projection under
    dynamo. torchao's tensor subclasses and bitsandbytes 4-bit trace; compressed-tensors' decompressed modules
    trace with a graph break each (its offload wrapper compares data pointers; the layers compile without fullgraph).
    """
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if quantization_method(model) != "bitsandbytes" or config is None:
        return None
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    if get("load_in_8bit", False) and float(get("llm_int8_threshold", 6.0) or 0.0) > 0.0:
        return (
            f"bitsandbytes 8-bit with llm_int8_threshold={get('llm_int8_threshold', 6.0)} picks outlier columns by "
            "a data-dependent mask (a host sync per projection), which torch.compile and CUDA graphs cannot trace"
        )
    return None


def _quantizes_activations_to_int8(weight: "torch.Tensor") -> bool:
    """Whether ``weight`` is a torchao tensor whose linear rounds its input to int8 and multiplies int8 by int8:
    ``Int8Tensor`` with an activation quantization (version 2 configs: torchao 0.18's only kind, 0.17's on request)
    or a ``LinearActivationQuantizedTensor`` around int8 weights (version 1, torchao 0.17's default). Matched by
    class name, not imported: the classes move between torchao's private modules from one version to the next."""
    import torch

    cls = type(weight)
    if not cls.__module__.startswith("torchao"):
        return False
    if cls.__name__ == "Int8Tensor":
        return getattr(weight, "act_quant_kwargs", None) is not None
    if cls.__name__ == "LinearActivationQuantizedTensor":
        inner = getattr(weight, "original_weight_tensor", None)
        return inner is not None and any(t.dtype == torch.int8 for t in _inner_tensors(inner))
    return False


def graph_reason(model: "torch.nn.Module", device: "torch.device | str") -> str | None:
    """Why ``model``'s steps on ``device`` cannot be captured in a CUDA graph though they may run and compile; None
    when they can.

    torchao's int8 x int8 GEMM (``Int8DynamicActivationInt8WeightConfig``, torchao 0.17 and 0.18) reaches
    ``torchao.kernel.intmm.safe_int_mm`` eagerly, which tests ``"FakeTensor" in input.__repr__()``: formatting the
    CUDA input copies its values to the host, a sync that stream capture refuses ("operation not permitted when
    stream is capturing") and that invalidates the capture. Under ``torch.compile`` that test is skipped while
    tracing (``dynamo_is_compiling()`` comes first), so compiled layers do not run it.
    """
    import torch

    if torch.device(device).type != "cuda":
        return None
    names = [name for name, p in model.named_parameters() if _quantizes_activations_to_int8(p.data)]
    if not names:
        return None
    return (
        f"torchao int8 dynamic activation quantization ({len(names)} weights, e.g. {names[0]}) syncs with the host "
        "in every eager GEMM (torchao.kernel.intmm.safe_int_mm formats its input), which a CUDA graph cannot capture"
    )


def traceable_config(config, model: "torch.nn.Module", device: "torch.device"):
    """``config`` (an EngineConfig) for a model on ``device``: unchanged; or without CUDA graphs and torch.compile
    when the model's quantization cannot be traced (``eager_reason``); or without CUDA graphs when its steps cannot
    be captured (``graph_reason``; ``compile_model`` then stays as given, its None meaning eager as it does for any
    engine without graphs). Only settings left to their defaults are turned off, with a warning that says why.

    Raises:
        ValueError: CUDA graphs or compilation asked for explicitly on a model that cannot have them; the message
            names why.
    """
    import dataclasses
    import logging

    if device.type != "cuda":
        return config
    logger = logging.getLogger(__name__)
    reason = eager_reason(model)
    if reason is not None:
        if config.use_cuda_graphs or config.compile_model not in (None, False):
            raise ValueError(f"{reason}: pass use_cuda_graphs=False and compile_model=False, or leave them unset")
        logger.warning("%s: the engine runs it without CUDA graphs or torch.compile", reason)
        return dataclasses.replace(config, use_cuda_graphs=False, compile_model=False)
    reason = graph_reason(model, device)
    if reason is None or config.use_cuda_graphs is False:
        return config
    if config.use_cuda_graphs:
        raise ValueError(f"{reason}: pass use_cuda_graphs=False, or leave it unset")
    logger.warning("%s: the engine runs it without CUDA graphs", reason)
    return dataclasses.replace(config, use_cuda_graphs=False)
