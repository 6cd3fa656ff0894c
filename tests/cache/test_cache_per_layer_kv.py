"""PagedCache on models whose layers differ in K/V shape or share K/V (Gemma 4, Gemma 3n), and on Falcon (whose
KV head count the config names its own way): token-equal to DynamicCache."""

import pytest
import torch
from helpers import assert_cache_released
from models import DEVICE, cache_kwarg
from per_layer_models import OWNERS, tiny_falcon_variant, tiny_gemma
from transformers import DynamicCache

from hf_paged import PagedCache
from hf_paged.core.context import ForwardContext, forward_context

CACHE = cache_kwarg()

# Row 0 is left-padded; 13 and 10 prompt tokens: the sliding window (8) and the blocks (8) are crossed.
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4, 5, 6, 7, 9, 11, 12, 13, 20, 30, 40, 50]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 13])
MODES = {"greedy": dict(max_new_tokens=16, min_new_tokens=16), "beams": dict(max_new_tokens=8, num_beams=3)}


def _generate(model, cache, **kwargs):
    ids, mask = IDS.to(model.device), MASK.to(model.device)
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs, **{CACHE: cache})


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("attn", ["paged", "sdpa"])
@pytest.mark.parametrize("family", ["gemma4", "gemma3n"])
def test_gemma_with_per_layer_shapes_and_shared_kv_matches_dynamic_cache(family, attn, mode):
    """Sharing layers read their owner's blocks (its pools under "paged", its gathered K/V otherwise) and never
    write; the tokens equal DynamicCache with eager attention on the same weights."""
    model = tiny_gemma(family, attn="eager", device=DEVICE)
    expected = _generate(model, DynamicCache(config=model.config), **MODES[mode])
    model.set_attn_implementation(attn)
    cache = PagedCache(model, num_blocks=48, block_size=8)
    assert [cache.kv.k_cache[i] is cache.kv.k_cache[o] for i, o in enumerate(OWNERS)] == [True] * 6
    assert torch.equal(_generate(model, cache, **MODES[mode]), expected)
    assert_cache_released(cache)


def test_gemma4_growing_pool_keeps_shared_layers_on_their_owners():
    """A growing pool replaces the owners' tensors: the sharing layers' entries follow them."""
    model = tiny_gemma("gemma4", attn="eager", device=DEVICE)
    expected = _generate(model, DynamicCache(config=model.config), **MODES["greedy"])
    model.set_attn_implementation("paged")
    cache = PagedCache(model, block_size=8)  # starts with one block
    assert torch.equal(_generate(model, cache, **MODES["greedy"]), expected)
    assert cache.pool.num_blocks > 1
    assert all(cache.kv.k_cache[i] is cache.kv.k_cache[o] for i, o in enumerate(OWNERS))
    assert cache.kv_bytes_per_block == 4 * 2 * 8 * 32 * 4  # four owners: K and V of 32 fp32 a token each


@pytest.mark.parametrize("family", ["gemma4", "gemma3n"])
def test_planned_decode_steps_read_the_owners_pools(family):
    """A compileable cache (max_cache_len) plans decode steps ahead into static buffers; the sharing layers' planned
    decode reads the pools the owners' update returned."""
    model = tiny_gemma(family, attn="eager", device=DEVICE)
    expected = _generate(model, DynamicCache(config=model.config), **MODES["greedy"])
    model.set_attn_implementation("paged")
    cache = PagedCache(model, block_size=8, max_cache_len=IDS.shape[1] + MODES["greedy"]["max_new_tokens"])
    assert torch.equal(_generate(model, cache, **MODES["greedy"]), expected)
    assert_cache_released(cache)


def test_update_of_a_sharing_layer_is_refused():
    model = tiny_gemma("gemma4")
    cache = PagedCache(model, num_blocks=4, block_size=8)
    ctx = ForwardContext(
        slot_mapping=torch.tensor([5]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.ones(1, dtype=torch.int32), cu_seqlens_q=torch.arange(2, dtype=torch.int32), max_query_len=1,
        max_seq_len=1, batch_size=1, query_len=1, owner=cache,
    )  # fmt: skip
    states = torch.zeros(1, 2, 1, 16)
    with forward_context(ctx), pytest.raises(ValueError, match=r"layer 4 shares the K/V of layer 2 .* must not"):
        cache.update(states, states, 4)
    other_shape = r"per-layer shapes \(layer 1: 1 KV heads of head_dim 32\), but layer 1 of this forward"
    with forward_context(ctx), pytest.raises(ValueError, match=other_shape):
        cache.update(states, states, 1)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("variant", ["multi_query", "mha", "new_arch"])
def test_falcon_kv_heads_match_dynamic_cache(variant, attn, mode):
    """Falcon's attention computes itself (no "paged"): PagedCache hands it gathered K/V with the head count its
    cache receives (1 for multi-query, every query head for the new decoder architecture)."""
    model, num_kv_heads = tiny_falcon_variant(variant, attn=attn)
    expected = _generate(model, DynamicCache(config=model.config), **MODES[mode])
    cache = PagedCache(model, num_blocks=48, block_size=8)
    assert {spec.num_kv_heads for spec in cache.kv.layers} == {num_kv_heads}
    assert torch.equal(_generate(model, cache, **MODES[mode]), expected)
    assert_cache_released(cache)
