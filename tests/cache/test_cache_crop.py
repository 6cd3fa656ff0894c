"""PagedCache.crop: assisted generation and prompt lookup under generate(), and rollbacks of shared, indexed and
padded rows, each checked token-for-token against a DynamicCache cropped the same way (fp32, CPU)."""

import pytest
import torch
from helpers import assert_cache_released
from models import cache_kwarg, tiny_model
from transformers import DynamicCache

from hf_paged import PagedCache

CACHE = cache_kwarg()
# Repeated n-grams, so prompt lookup drafts tokens from the prompt.
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 11, 12, 13]])
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 9, 11, 12, 13]])  # row 0 left-padded
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]])


def _dynamic(model):
    return DynamicCache(config=model.config)


def _record_crops(cache: PagedCache) -> list[int]:
    """Wrap ``cache.crop`` to record its arguments (what generate asks for)."""
    calls, crop = [], cache.crop

    def recording_crop(max_length):
        calls.append(max_length)
        crop(max_length)

    cache.crop = recording_crop
    return calls


@pytest.mark.parametrize(
    "attn, mode",
    [("paged", "assistant"), ("paged", "assistant_sampling"), ("paged", "prompt_lookup"), ("sdpa", "prompt_lookup")],
)
def test_assisted_generation_matches_dynamic_cache(attn, mode):
    model = tiny_model("llama", attn=attn)
    ref = tiny_model("llama", attn="sdpa")
    kwargs = dict(input_ids=PROMPT, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    if mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 3
    else:  # a smaller random model of the same vocabulary drafts; it keeps its own default cache
        kwargs["assistant_model"] = tiny_model("llama", attn="sdpa", seed=1, num_hidden_layers=1)
        kwargs["do_sample"] = mode == "assistant_sampling"
    torch.manual_seed(7)
    expected = ref.generate(**kwargs, **{CACHE: _dynamic(ref)})
    cache = PagedCache(model, num_blocks=16, block_size=8)
    crops = _record_crops(cache)
    torch.manual_seed(7)
    out = model.generate(**kwargs, **{CACHE: cache})
    assert torch.equal(out, expected)
    assert crops and all(c <= 0 for c in crops), crops
    if mode == "prompt_lookup":
        assert min(crops) <= -2, crops  # drafts were rejected: the cache rolled back more than one token
    assert cache.get_seq_length() == out.shape[1] - 1
    assert_cache_released(cache)


def test_crop_then_continue_matches_dynamic_cache_and_keeps_shared_rows():
    """Two samples share their prompt's blocks; a crop inside a shared block gives one row a copy, and the other
    row, which writes other tokens there next, must not change the first row's K/V nor leave the block indexed."""
    model = tiny_model("llama", attn="paged")
    prompt = torch.arange(20, 33).unsqueeze(0)  # 13 tokens: one full block of 8 (indexed), one partial
    cache, dyn = PagedCache(model, num_blocks=16, block_size=8), _dynamic(model)
    kwargs = dict(input_ids=prompt, max_new_tokens=6, do_sample=True, num_return_sequences=2)
    outs = []
    for c in (cache, dyn):
        torch.manual_seed(3)
        outs.append(model.generate(**kwargs, **{CACHE: c}))
    assert torch.equal(outs[0], outs[1])
    assert cache.pool.ref_count(cache.row_block_tables()[0][0]) == 2
    cache.crop(5)  # the positive form keeps 5 columns (transformers 5.17's legacy crop(max_length))
    dyn.crop(5 - dyn.get_seq_length())
    assert cache.get_seq_length() == dyn.get_seq_length() == 5
    cache.check_invariants()
    assert cache.pool.num_cached_prefix_tokens(prompt[0].tolist()) == 0  # the cut block left the index
    # Continue each row with tokens other than the prompt's: both rows write into their (now distinct) block 0.
    cont = torch.cat([outs[0][:, :5], torch.tensor([[40, 41, 42, 43], [50, 51, 52, 53]])], dim=1)
    kwargs = dict(input_ids=cont, attention_mask=torch.ones_like(cont), max_new_tokens=8, do_sample=False)
    out = model.generate(**kwargs, **{CACHE: cache})
    assert torch.equal(out, model.generate(**kwargs, **{CACHE: dyn}))
    # A later prompt sharing the original first block computes it again (no stale hit on the rewritten block).
    cache.reset()
    again = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, **{CACHE: cache.prepare(prompt)})
    assert torch.equal(again, model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False))
    assert_cache_released(cache)


def test_crop_left_padded_batch_into_the_padding():
    model = tiny_model("llama", attn="paged")
    kwargs = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    cache, dyn = PagedCache(model, num_blocks=16, block_size=8), _dynamic(model)
    out = model.generate(**kwargs, **{CACHE: cache})
    model.generate(**kwargs, **{CACHE: dyn})
    cache.crop(-3)
    assert [len(ids) for ids in cache.row_token_ids()] == [6 + 6, 9 + 6]
    cache.crop(2)  # row 0 keeps no token (its first 3 columns are padding), row 1 keeps 2
    dyn.crop(2 - dyn.get_seq_length())
    assert [len(ids) for ids in cache.row_token_ids()] == [0, 2]
    cache.check_invariants()
    cont, mask = out[:, :12], torch.cat([MASK, torch.ones(2, 3, dtype=MASK.dtype)], dim=1)
    kwargs = dict(input_ids=cont, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(**kwargs, **{CACHE: cache}), model.generate(**kwargs, **{CACHE: dyn}))
    assert_cache_released(cache)


def test_crop_no_ops_reset_and_errors():
    model = tiny_model("llama", attn="paged")
    cache = PagedCache(model, num_blocks=16, block_size=8)
    with pytest.raises(TypeError, match=r"`max_length` must be an int .*got 2.0"):
        cache.crop(2.0)
    model.generate(input_ids=PROMPT, max_new_tokens=4, do_sample=False, **{CACHE: cache})
    length = cache.get_seq_length()
    for no_op in (0, length, length + 5):
        cache.crop(no_op)
        assert cache.get_seq_length() == length
    cache.crop(torch.tensor(-1))  # transformers 5.17 passes a 0-d tensor
    assert cache.get_seq_length() == length - 1 and len(cache.row_token_ids()[0]) == length - 1
    cache.crop(-100)  # more than it holds: every column goes, as reset()
    assert cache.get_seq_length() == 0 and cache.pool.stats.num_used_blocks == 0
    cache.prepare(PROMPT)
    with pytest.raises(ValueError, match=r"crop\(\) after prepare\(\)"):
        cache.crop(-1)
    cache.reset()
    holes = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])  # a padding column after a token
    model.generate(input_ids=PROMPT, attention_mask=holes, max_new_tokens=3, do_sample=False, **{CACHE: cache})
    with pytest.raises(
        ValueError, match=r"crop\(-1\) needs every row's padding columns before its tokens \(left padding\)"
    ):
        cache.crop(-1)
    assert_cache_released(cache)


def test_crop_needs_free_blocks_for_shared_copies():
    model = tiny_model("llama", attn="paged")
    prompt = torch.arange(20, 36).unsqueeze(0)  # 2 full blocks of 8
    cache = PagedCache(model, num_blocks=4, block_size=8)
    model.generate(input_ids=prompt, max_new_tokens=1, do_sample=True, num_return_sequences=4, **{CACHE: cache})
    used = cache.pool.stats.num_used_blocks
    with pytest.raises(
        MemoryError, match=r"crop\(3\) copies up to 4 shared blocks .* the pool has 2 free blocks of 4"
    ):
        cache.crop(3)  # each of the 4 rows may need its own copy of the shared block 0
    assert cache.get_seq_length() == 16 and cache.pool.stats.num_used_blocks == used  # nothing changed
    assert_cache_released(cache)
