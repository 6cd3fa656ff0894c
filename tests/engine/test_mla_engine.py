"""ContinuousBatcher on latent-attention (MLA) models: greedy tokens equal model.generate's (DynamicCache, eager
attention) for each prompt, through chunked prefill, prefix hits and preemption (recompute and swap).

The engine's pool holds one latent row per token and layer (hf_paged.core.mla); its steps mix prompt chunks and
decode rows, so both the prefill and the decode paths of the latent attention run.
"""

import functools

import pytest
import torch
from helpers import assert_engine_drained
from mla_models import tiny_mla_model
from models import cache_kwarg
from transformers import DynamicCache

from hf_paged import ContinuousBatcher, SamplingParams

CACHE = cache_kwarg()
NEW_TOKENS = [7, 20, 3, 14, 9]


def _prompts():
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 17, 33, 8)]
    return prompts + [prompts[2][:24] + [7, 8]]  # shares three full blocks with the third prompt: a prefix hit


@functools.cache  # per kind: model.generate one prompt at a time is the slow part
def _expected(kind: str) -> list[list[int]]:
    model = tiny_mla_model(kind, attn="eager")
    return [
        model.generate(input_ids=torch.tensor([p], device=model.device), max_new_tokens=m, min_new_tokens=m,
                       do_sample=False, **{CACHE: DynamicCache(config=model.config)})[0, len(p) :].tolist()
        for p, m in zip(_prompts(), NEW_TOKENS, strict=True)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        dict(num_blocks=64, max_num_batched_tokens=256),  # whole prompts in one step
        dict(num_blocks=9, max_num_batched_tokens=16),  # chunked prefill, tiny pool: preemption by recompute
        dict(num_blocks=9, max_num_batched_tokens=16, preemption_mode="swap", swap_space_gb=0.01),
    ],
    ids=["one-step", "preempt-recompute", "preempt-swap"],
)
@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_greedy_equals_model_generate(kind, config):
    engine = ContinuousBatcher(tiny_mla_model(kind), block_size=8, max_num_seqs=8, **config)
    params = [SamplingParams(max_new_tokens=m, temperature=0.0, ignore_eos=True) for m in NEW_TOKENS]
    outputs = engine.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _expected(kind)
    assert engine.kv.k_cache[0].shape[2:] == (1, 28)  # one latent row [c | k_rot] a token
    if config["num_blocks"] == 9:
        assert engine.metrics().num_preemptions > 0
        assert (engine.metrics().num_swapped_out_blocks > 0) == (config.get("preemption_mode") == "swap")
    assert_engine_drained(engine)


def test_prefix_hits_read_cached_latent_rows():
    """A prompt whose first blocks are cached reads their latent rows instead of recomputing them."""
    engine = ContinuousBatcher(tiny_mla_model("v3"), block_size=8, num_blocks=64)
    prompt = _prompts()[2]  # 33 tokens
    params = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    first = engine.generate([prompt], params, use_tqdm=False)[0]
    second = engine.generate([prompt], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert_engine_drained(engine)
