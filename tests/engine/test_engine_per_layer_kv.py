"""ContinuousBatcher on models whose layers differ in K/V shape or share K/V (Gemma 4, Gemma 3n): equal to
model.generate per prompt, through chunked prefill and preemption; sharing layers never write."""

import collections
import functools

import pytest
import torch
from helpers import assert_engine_drained
from models import DEVICE, cache_kwarg
from per_layer_models import OWNERS, tiny_gemma
from transformers import DynamicCache

import hf_paged.core.attention as paged_attention_module
from hf_paged import ContinuousBatcher, SamplingParams

CACHE = cache_kwarg()
LENGTHS, NEW_TOKENS = (5, 17, 33, 23), (7, 20, 3, 12)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in LENGTHS]


@functools.cache
def _reference(family: str) -> list[list[int]]:
    """generate's greedy tokens for each prompt alone (DynamicCache, eager attention)."""
    model = tiny_gemma(family, attn="eager", device=DEVICE)
    out = []
    for prompt, max_new_tokens in zip(_prompts(), NEW_TOKENS, strict=True):
        ids = model.generate(
            input_ids=torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, **{CACHE: DynamicCache(config=model.config)},
        )  # fmt: skip
        out.append(ids[0, len(prompt) :].tolist())
    return out


CONFIGS = {
    "chunked": dict(max_num_batched_tokens=16, num_blocks=64),
    "preempt-recompute": dict(max_num_batched_tokens=32, num_blocks=8),  # tiny pool
    "preempt-swap": dict(max_num_batched_tokens=32, num_blocks=8, preemption_mode="swap", swap_space_gb=0.01),
}


@pytest.mark.parametrize(
    ("config", "async_scheduling"),
    [("chunked", False), ("preempt-recompute", False), ("preempt-recompute", True), ("preempt-swap", False)],
    ids=["chunked", "preempt-recompute", "preempt-recompute-async", "preempt-swap"],
)
@pytest.mark.parametrize("family", ["gemma4", "gemma3n"])
def test_greedy_equals_model_generate(family, config, async_scheduling):
    reference = _reference(family)
    config = CONFIGS[config]
    model = tiny_gemma(family, device=DEVICE)
    engine = ContinuousBatcher(model, block_size=8, max_num_seqs=8, async_scheduling=async_scheduling, **config)
    # min_tokens as generate's min_new_tokens: both hold back EOS, so a near-tie with it cannot split them
    params = [SamplingParams(max_new_tokens=n, min_tokens=n, temperature=0.0) for n in NEW_TOKENS]
    outs = engine.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(engine.kv.k_cache[i] is engine.kv.k_cache[o] for i, o in enumerate(OWNERS))
    if config["num_blocks"] == 8:
        assert engine.metrics().num_preemptions > 0
    assert_engine_drained(engine)


def test_sharing_layers_never_write(monkeypatch):
    """Every forward writes each owner's K pool once (write_kv, or the decode kernel's fused write) and no sharing
    layer writes it again."""
    if DEVICE != "cpu":
        pytest.skip("counts the attention's write calls, which CUDA graph replays do not make: runs on the CPU (CI)")
    writes = collections.Counter()
    real_write, real_attention = paged_attention_module.write_kv, paged_attention_module.paged_attention

    def write_kv(key, value, k_cache, v_cache, slot_mapping, **scales):
        writes[id(k_cache)] += 1
        return real_write(key, value, k_cache, v_cache, slot_mapping, **scales)

    def paged_attention(query, k_cache, *args, slot_mapping=None, **kwargs):
        if slot_mapping is not None:
            writes[id(k_cache)] += 1
        return real_attention(query, k_cache, *args, slot_mapping=slot_mapping, **kwargs)

    monkeypatch.setattr(paged_attention_module, "write_kv", write_kv)
    monkeypatch.setattr(paged_attention_module, "paged_attention", paged_attention)
    engine = ContinuousBatcher(tiny_gemma("gemma4"), block_size=8, num_blocks=64, max_num_batched_tokens=16)
    engine.generate(_prompts(), SamplingParams(max_new_tokens=5, temperature=0.0), use_tqdm=False)
    owners = {id(engine.kv.k_cache[i]) for i in sorted(set(OWNERS))}
    assert set(writes) == owners
    assert len(set(writes.values())) == 1  # as many writes into each owner's pool: one a forward
    assert_engine_drained(engine)
