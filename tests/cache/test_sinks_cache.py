"""Attention sinks (gpt-oss) through "paged" attention: PagedCache against DynamicCache with transformers' eager
attention, the fallback without a PagedCache, the planned (compileable) decode, and sinks held as a parameter, a
buffer or a plain attribute. A tiny random gpt-oss (tests/sink_models.py): sliding-window layers (window 8) alternate
with full ones, and the prompts run past the window."""

import pytest
import torch
from helpers import assert_cache_released, needs_cuda
from models import cache_kwarg, tiny_model
from sink_models import SLIDING_WINDOW, tiny_gpt_oss
from transformers import DynamicCache

from hf_paged import PagedCache

CACHE = cache_kwarg()
# Row 0 is left-padded; both rows are longer than the sliding window.
IDS = torch.tensor([[0, 0, 0] + list(range(5, 16)), list(range(20, 34))])
MASK = torch.tensor([[0, 0, 0] + [1] * 11, [1] * 14])
assert IDS.shape[1] > SLIDING_WINDOW


def _generate(model, cache, **kwargs):
    kwargs = dict(input_ids=IDS, attention_mask=MASK, do_sample=False) | kwargs
    return model.generate(**kwargs, **{CACHE: cache})


@pytest.fixture(scope="module")
def models():
    """The same random gpt-oss with "paged" and with transformers' "eager" attention (its reference for sinks)."""
    return tiny_gpt_oss("paged"), tiny_gpt_oss("eager")


@pytest.mark.parametrize("mode", ["greedy", "beams"])
def test_paged_cache_matches_eager_dynamic_cache(models, mode):
    """PagedCache with "paged" attention (prefill kernel, eager decode with the fused write) gives eager attention's
    tokens with DynamicCache: greedy past two windows, and beam search (num_beams=3, forks and copy-on-write)."""
    paged, eager = models
    kwargs = dict(max_new_tokens=18, min_new_tokens=18) if mode == "greedy" else dict(max_new_tokens=8, num_beams=3)
    expected = _generate(eager, DynamicCache(config=eager.config), **kwargs)
    cache = PagedCache(paged, num_blocks=64, block_size=8)
    assert torch.equal(_generate(paged, cache, **kwargs), expected)
    assert_cache_released(cache)


@needs_cuda("the Triton kernels with sinks under PagedCache: prefill, fused-write decode, kept launches")
def test_paged_cache_on_cuda_matches_eager_dynamic_cache(monkeypatch):
    """On CUDA, PagedCache's prefill kernel and eager decode steps (a step's first layer's fused-write launch, kept
    as a DecodeBinding and relaunched for the later layers of its kind with their tensors and sinks: layers 2 and 3
    of four alternating ones) give eager attention's tokens."""
    from hf_paged.kernels import decode

    paged, eager = (tiny_gpt_oss(attn, num_hidden_layers=4, device="cuda") for attn in ("paged", "eager"))
    kwargs = dict(input_ids=IDS.cuda(), attention_mask=MASK.cuda(), max_new_tokens=18, min_new_tokens=18)
    expected = _generate(eager, DynamicCache(config=eager.config), **kwargs)
    relaunches = []
    launch = decode.DecodeBinding.launch

    def recording(self, *args, **kwargs):  # args[5]: the layer's sinks (the K/V scales follow it)
        relaunches.append(args[5] is not None)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(decode.DecodeBinding, "launch", recording)
    cache = PagedCache(paged, num_blocks=64, block_size=8)
    assert torch.equal(_generate(paged, cache, **kwargs), expected)
    assert relaunches and all(relaunches)  # every relaunch carried its layer's sinks
    assert_cache_released(cache)


def test_fallback_without_paged_cache_matches_eager(models):
    """The "paged" attention outside a paged forward (DynamicCache, or no cache) computes as gpt-oss's eager attention:
    the same logits for a padded batch and for one without a mask (transformers leaves the causal mask out there,
    so the fallback builds it), and the same greedy tokens."""
    paged, eager = models
    with torch.no_grad():
        for kwargs in (dict(input_ids=IDS, attention_mask=MASK), dict(input_ids=IDS[1:])):
            torch.testing.assert_close(paged(**kwargs).logits, eager(**kwargs).logits, atol=1e-5, rtol=1e-5)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12)
    expected = _generate(eager, DynamicCache(config=eager.config), **kwargs)
    assert torch.equal(_generate(paged, DynamicCache(config=paged.config), **kwargs), expected)


def test_sinks_change_the_tokens(models):
    """The tests above would not see sinks that were dropped: with them zeroed out of reach (-inf weight) the
    model's tokens differ."""
    paged, _ = models
    expected = _generate(paged, PagedCache(paged, num_blocks=64, block_size=8), max_new_tokens=12)
    saved = [layer.self_attn.sinks.detach().clone() for layer in paged.model.layers]
    try:
        with torch.no_grad():
            for layer in paged.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        dropped = _generate(paged, PagedCache(paged, num_blocks=64, block_size=8), max_new_tokens=12)
    finally:
        with torch.no_grad():
            for layer, sinks in zip(paged.model.layers, saved, strict=True):
                layer.self_attn.sinks.copy_(sinks)
    assert not torch.equal(dropped, expected)


def test_planned_decode_steps_match_eager(models):
    """A compileable PagedCache (max_cache_len) plans each decode step ahead; run eagerly (no compile), the planned
    steps give eager attention's tokens."""
    paged, eager = models
    kwargs = dict(max_new_tokens=12, min_new_tokens=12)
    expected = _generate(eager, DynamicCache(config=eager.config), **kwargs)
    cache = PagedCache(paged, block_size=8, max_cache_len=IDS.shape[1] + 12)
    assert torch.equal(_generate(paged, cache, **kwargs), expected)
    assert_cache_released(cache)


def test_compiled_planned_decode_matches_eager(models):
    """Compiled (fullgraph, aot_eager on the CPU) planned decode steps trace the module's sinks into paged_decode
    and give eager attention's tokens."""
    from transformers import CompileConfig

    paged, eager = models
    config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    config._compile_all_devices = True  # compile on the CPU too (not a dataclass field in 5.17 nor 5.24)
    kwargs = dict(max_new_tokens=10, min_new_tokens=10)
    expected = _generate(eager, DynamicCache(config=eager.config), **kwargs)
    torch._dynamo.reset()
    cache = PagedCache(paged, block_size=8, max_cache_len=IDS.shape[1] + 10)
    assert torch.equal(_generate(paged, cache, compile_config=config, **kwargs), expected)
    assert paged._compiled_call is not None
    assert_cache_released(cache)


@pytest.mark.parametrize("holder", ["parameter", "buffer", "attribute", "none"])
def test_sinks_are_found_as_parameter_buffer_or_attribute(holder):
    """The "paged" attention reads a module's sinks wherever it keeps them (a parameter, a buffer, a plain tensor
    attribute; ``sinks = None`` is none): PagedCache's kernels and the fallback without it both apply them, so
    their tokens agree, and differ from the model without sinks."""
    model = tiny_model("llama")
    baseline = _generate(model, DynamicCache(config=model.config), max_new_tokens=10)
    attention = model.model.layers[0].self_attn
    sinks = torch.full((model.config.num_attention_heads,), 3.0)
    if holder == "parameter":
        attention.sinks = torch.nn.Parameter(sinks)
    elif holder == "buffer":
        attention.register_buffer("sinks", sinks)
    elif holder == "attribute":
        attention.sinks = sinks
    else:
        attention.sinks = None
    cache = PagedCache(model, num_blocks=32, block_size=8)
    out = _generate(model, cache, max_new_tokens=10)
    assert torch.equal(out, _generate(model, DynamicCache(config=model.config), max_new_tokens=10))
    assert torch.equal(out, baseline) == (holder == "none")
    assert_cache_released(cache)
