"""PagedCache on latent-attention (MLA) models: DeepSeek-V3 and V2 through the paged latent path (hf_paged.core.mla)
give the tokens and, up to rounding, the logits of DynamicCache with transformers' eager attention on the same
weights.

The paged path attends in the absorbed form (q folded through W_UK, output through W_UV), transformers in the
expanded one: in fp32 they differ by rounding only (logits within 1e-5 here; a 5% error in the softmax scale moves
them by 1.6e-4), so greedy tokens must be equal.
"""

import pytest
import torch
from mla_models import MLA_KINDS, tiny_mla_model
from models import DEVICE, cache_kwarg
from transformers import DynamicCache

from hf_paged import PagedCache
from hf_paged.core.mla import is_paged_mla, use_paged_mla

CACHE = cache_kwarg()
# Row 0 is left-padded: padding in the prompt, and in the packing of the paged forward.
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 9, 11, 12, 13]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
# fp32 logits: the CPU's rounding differences stay near 1e-7; the GPU's kernels sum in another order
LOGITS_ATOL = 1e-5 if DEVICE == "cpu" else 1e-4
GREEDY = dict(do_sample=False, max_new_tokens=20, min_new_tokens=20, output_logits=True, return_dict_in_generate=True)


def _generate(model, cache, **kwargs):
    return model.generate(
        input_ids=IDS.to(model.device), attention_mask=MASK.to(model.device), **{CACHE: cache}, **kwargs
    )


def _expected(kind, **kwargs):
    model = tiny_mla_model(kind, attn="eager")
    return _generate(model, DynamicCache(config=model.config), **kwargs)


@pytest.mark.parametrize("attn", ["paged", "sdpa"])
@pytest.mark.parametrize("kind", sorted(MLA_KINDS))
def test_greedy_matches_dynamic_cache(kind, attn):
    """Prefill, then decode steps over block boundaries (block size 8): tokens equal, logits equal up to rounding.
    With "sdpa" the latent path runs too (the kernels take lengths, not masks)."""
    expected = _expected(kind, **GREEDY)
    model = tiny_mla_model(kind, attn=attn)
    cache = PagedCache(model, num_blocks=32, block_size=8)
    out = _generate(model, cache, **GREEDY)
    assert all(is_paged_mla(layer.self_attn) for layer in model.model.layers)
    assert torch.equal(out.sequences, expected.sequences)
    for step, (got, ref) in enumerate(zip(out.logits, expected.logits, strict=True)):
        torch.testing.assert_close(got, ref, atol=LOGITS_ATOL, rtol=0, msg=f"logits of step {step}")
    # the pool holds each layer's latent rows ([c | k_rot]: 20 + 8 wide), not expanded K/V
    assert cache.kv.k_cache[0].shape[2:] == (1, 28)


@pytest.mark.parametrize("kind", sorted(MLA_KINDS))
def test_beam_search_matches_dynamic_cache(kind):
    """num_beams=3: the beams fork and reorder block tables (copy-on-write of the shared partial blocks)."""
    kwargs = dict(do_sample=False, max_new_tokens=8, num_beams=3)
    expected = _expected(kind, **kwargs)
    model = tiny_mla_model(kind)
    out = _generate(model, PagedCache(model, num_blocks=48, block_size=8), **kwargs)
    assert torch.equal(out, expected)


def test_planned_decode_steps_match_dynamic_cache():
    """With max_cache_len the decode steps are planned ahead into static buffers (the compileable mode; run eagerly
    here): the latent path reads that static context."""
    kwargs = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12)
    expected = _expected("v3", **kwargs)
    model = tiny_mla_model("v3")
    cache = PagedCache(model, num_blocks=32, block_size=8, max_cache_len=40)
    assert cache.is_compileable
    assert torch.equal(_generate(model, cache, **kwargs), expected)


def test_prepared_prefix_is_reused():
    """A second call over ``cache.prepare(...)`` reads the first call's latent rows of the shared prompt blocks."""
    ids = torch.tensor([list(range(3, 22))], device=DEVICE)
    model = tiny_mla_model("v3")
    ref = tiny_mla_model("v3", attn="eager")
    expected = ref.generate(
        input_ids=ids, do_sample=False, max_new_tokens=6, **{CACHE: DynamicCache(config=ref.config)}
    )
    cache = PagedCache(model, num_blocks=32, block_size=8)
    model.generate(input_ids=ids, do_sample=False, max_new_tokens=6, **{CACHE: cache})
    out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=6, **{CACHE: cache.prepare(ids)})
    assert torch.equal(out, expected)


def test_original_forward_runs_outside_a_paged_forward():
    """After PagedCache installed the paged forward, DynamicCache and cache-less forwards run the module's own code."""
    model = tiny_mla_model("v2")
    PagedCache(model, num_blocks=8, block_size=8)
    assert use_paged_mla(model) == 3  # idempotent: every layer already has it
    expected = _expected("v2", do_sample=False, max_new_tokens=6)
    assert torch.equal(
        _generate(model, DynamicCache(config=model.config), do_sample=False, max_new_tokens=6), expected
    )


def test_unsupported_latent_attention_is_refused():
    model = tiny_mla_model("v3")
    model.config.model_type = "deepseek_v32"

    for layer in model.model.layers:
        # a latent-KV module of a class whose forward hf_paged does not reproduce (V3.2 adds a sparse indexer)
        layer.self_attn.__class__ = type("DeepseekV32Attention", (type(layer.self_attn),), {})
    with pytest.raises(ValueError, match=r"'deepseek_v32' has latent \(MLA\) attention in \['DeepseekV32Attention'\]"):
        PagedCache(model, num_blocks=8, block_size=8)


def test_quantized_kv_b_proj_is_refused():
    model = tiny_mla_model("v3")
    attn = model.model.layers[1].self_attn
    attn.kv_b_proj.weight.data = attn.kv_b_proj.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"DeepseekV3Attention 1's kv_b_proj weight is torch.float8_e4m3fn"):
        PagedCache(model, num_blocks=8, block_size=8)
