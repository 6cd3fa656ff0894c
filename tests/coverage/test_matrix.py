"""The model coverage matrix: every family of families.py against transformers' own attention and cache.

For a family expected to match, on the same fp32 weights:
  (a) ``PagedCache`` greedy with attn_implementation="paged" equals ``DynamicCache`` with "eager" attention, token
      for token, on a left-padded batch whose prompts run past every sliding window;
  (b) the same for beam search (3 beams);
  (c) ``ContinuousBatcher`` greedy over four prompts of different lengths, in a pool too small for all of them at
      once (preemption by recompute), equals ``generate`` of each prompt alone, and every block is free after.
A refused family must raise the registry's ``ValueError`` at construction, from ``PagedCache`` with "paged"
attention and from the engine, never a deeper error; where ``cache_attn`` is set, ``PagedCache`` with that
attention still matches (checks (a) and (b)).

Each family's model is built once per module and copied for each check: the engine fuses the projections of the
model it gets, in place.
"""

import copy
import functools

import pytest
import torch
import transformers
from families import BY_NAME, FAMILIES, MATCH, Family
from helpers import assert_cache_released, assert_engine_drained
from models import cache_kwarg
from transformers import DynamicCache

from hf_paged import ContinuousBatcher, PagedCache, SamplingParams

CACHE = cache_kwarg()
NEW_TOKENS = 8
# Row 0 is left-padded; both rows run past the sliding windows (8 tokens) before the first new token.
IDS = torch.tensor([[0, 0, 0, 0, *range(10, 26)], list(range(30, 50))])
MASK = (torch.arange(IDS.shape[1]) >= torch.tensor([[4], [0]])).long()
# Engine prompts need 2 + 3 + 4 + 4 blocks of 8 with their new tokens; the pool has 6, so requests get preempted.
ENGINE_PROMPT_LENS = (4, 11, 17, 24)
ENGINE = dict(num_blocks=6, block_size=8, max_num_batched_tokens=64, max_num_seqs=4)


def _param(family: Family):
    missing = family.missing()
    reason = f"transformers {transformers.__version__} has no {missing}; runs where transformers ships it (CI)"
    marks = [pytest.mark.skip(reason=reason)]
    return pytest.param(family, id=family.name, marks=marks if missing else [])


MATCHING = [_param(f) for f in FAMILIES if f.expect == MATCH]
CACHE_MATCHING = [_param(f) for f in FAMILIES if f.expect == MATCH or f.cache_attn]
REFUSED = [_param(f) for f in FAMILIES if f.expect != MATCH]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Run the matrix on one intra-op thread. Its matrices are 64 wide: a second thread only adds a barrier per op,
    and when the CPU is shared (CI's two cores, other test processes) waiting at it made each op ~50x slower."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@functools.cache
def _reference(name: str) -> torch.nn.Module:
    """The family's model with transformers' eager attention; checks copy it."""
    return BY_NAME[name].build(attn="eager")


def _with_attn(family: Family, attn: str) -> torch.nn.Module:
    """A copy of the reference weights under ``attn``, chosen at construction as users load it."""
    model = family.build(attn=attn)
    model.load_state_dict(_reference(family.name).state_dict())
    return model


def _generate(model, cache, **kwargs) -> torch.Tensor:
    return model.generate(input_ids=IDS, attention_mask=MASK, do_sample=False, **kwargs, **{CACHE: cache})


def _cache_check(family: Family, **kwargs) -> None:
    reference = _reference(family.name)
    expected = _generate(reference, DynamicCache(config=reference.config), **kwargs)
    model = _with_attn(family, family.cache_attn or "paged")
    cache = PagedCache(model, num_blocks=48, block_size=8)
    assert torch.equal(_generate(model, cache, **kwargs), expected)
    assert_cache_released(cache)


@pytest.mark.parametrize("family", CACHE_MATCHING)
def test_paged_cache_greedy_equals_dynamic_cache(family):
    _cache_check(family, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("family", CACHE_MATCHING)
def test_paged_cache_beam_search_equals_dynamic_cache(family):
    _cache_check(family, max_new_tokens=NEW_TOKENS, num_beams=3)


@pytest.mark.parametrize("family", MATCHING)
def test_engine_greedy_equals_generate_under_preemption(family):
    reference = _reference(family.name)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in ENGINE_PROMPT_LENS]
    expected = [
        reference.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, **{CACHE: DynamicCache(config=reference.config)})[0, len(p) :].tolist()
        for p in prompts
    ]  # fmt: skip
    engine = ContinuousBatcher(copy.deepcopy(reference), **ENGINE)
    # min_tokens masks EOS as generate's min_new_tokens does: random weights pick it often.
    params = SamplingParams(max_new_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.metrics().num_preemptions > 0
    assert_engine_drained(engine)


@pytest.mark.parametrize("family", REFUSED)
def test_refused_at_construction_with_a_clear_error(family):
    if family.loads_paged:
        with pytest.raises(ValueError, match=family.expect):
            PagedCache(family.build(attn="paged"), num_blocks=8, block_size=8)
    else:  # transformers refuses "paged" for it itself; fails once it loads, so that PagedCache gets checked
        with pytest.raises(KeyError, match="paged"):
            family.build(attn="paged")
    with pytest.raises(ValueError, match=family.expect):
        ContinuousBatcher(copy.deepcopy(_reference(family.name)), **ENGINE)
