"""PagedCache over torchao-quantized weights (eager and compiled): token-identical to DynamicCache on the same
quantized model. The quantizations are the CPU's set of ``--quantization`` (hf_paged.engine.quantization)."""

import pytest
import torch
from helpers import assert_cache_released
from models import cache_kwarg, tiny_model
from transformers import CompileConfig, DynamicCache

from hf_paged import PagedCache
from hf_paged.engine.quantization import torchao_config

quantization = pytest.importorskip(
    "torchao.quantization", reason="needs torchao (the test and quantization extras; CI installs it)"
)

CACHE = cache_kwarg()
CPU_QUANTIZATIONS = ["int8", "int8-dynamic", "int4", "float8"]  # float8-dynamic needs CUDA >= sm89
# Quantizing activations per token rounds them to a grid: the few-ulp differences between the paged kernels and
# SDPA can move a value across a rounding boundary and flip a near-tie token, so these compare PagedCache under SDPA
# (the cache's bookkeeping, bit for bit) rather than the paged kernels.
DYNAMIC = {"int8-dynamic", "float8-dynamic"}

IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 9, 11, 12, 13]])  # row 0 left-padded
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]])


def quantized_tiny_model(name: str, attn: str = "paged", **overrides) -> torch.nn.Module:
    """A tiny llama with every projection quantized by ``--quantization name``."""
    model = tiny_model("llama", attn=attn, **overrides)
    # as transformers' TorchAoConfig does by default: every decoder Linear, not the output embedding
    quantization.quantize_(
        model, torchao_config(name, "cpu", torch.float32), filter_fn=lambda m, fqn: _is_linear(m) and fqn != "lm_head"
    )
    for proj in (model.model.layers[0].self_attn.q_proj, model.model.layers[0].mlp.down_proj):
        assert type(proj.weight) is not torch.nn.Parameter, f"{name} left {proj} unquantized"
    return model


def _is_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear)


def _generate(model, cache, **kwargs):
    return model.generate(input_ids=IDS, attention_mask=MASK, do_sample=False, **kwargs, **{CACHE: cache})


@pytest.mark.parametrize("name", CPU_QUANTIZATIONS)
def test_greedy_and_beams_match_dynamic_cache(name):
    attn = "sdpa" if name in DYNAMIC else "paged"
    model, reference = quantized_tiny_model(name, attn=attn), quantized_tiny_model(name, attn="sdpa")
    for kwargs in (dict(max_new_tokens=24, min_new_tokens=24), dict(max_new_tokens=10, num_beams=3)):
        expected = _generate(reference, DynamicCache(config=model.config), **kwargs)
        cache = PagedCache(model, num_blocks=48, block_size=8)
        assert torch.equal(_generate(model, cache, **kwargs), expected), (name, kwargs)
        assert_cache_released(cache)


@pytest.mark.parametrize("name", CPU_QUANTIZATIONS)
def test_compiled_decode_matches_eager(name):
    """generate's compiled decode over PagedCache(max_cache_len=...) (fullgraph: a graph break fails): the quantized
    weights trace as tensor subclasses; tokens equal DynamicCache's (activation quantization: the eager PagedCache
    run's, same kernels)."""
    model = quantized_tiny_model(name)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6)
    if name in DYNAMIC:
        expected = _generate(model, PagedCache(model, block_size=8, max_cache_len=16), **kwargs)
    else:
        expected = _generate(quantized_tiny_model(name, attn="sdpa"), DynamicCache(config=model.config), **kwargs)
    config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    config._compile_all_devices = True  # compile on the CPU too
    torch._dynamo.reset()
    cache = PagedCache(model, block_size=8, max_cache_len=16)
    out = _generate(model, cache, compile_config=config, **kwargs)
    assert model._compiled_call is not None
    assert torch.equal(out, expected)
