"""Prompt log-probs (``SamplingParams.prompt_logprobs``) against a transformers forward of the same weights.

What can go wrong: a row scoring the wrong token (off by one position, a chunk boundary, a span of a sequence after
the first in the step), tokens served by the prefix cache with no logits to score them, a token scored twice when
its forward is recomputed (preemption, an interrupted step) or a gap when a step's result is lost, ranks counted
from the wrong end, a step returning more logits rows than the cap.
"""

import pytest
import torch
from helpers import assert_engine_drained
from models import DEVICE, char_tokenizer
from models import tiny_model as _tiny_model

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.engine import scheduler as scheduler_module

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request):
    return request.param


def tiny_model(attn="paged"):
    return _tiny_model("llama", attn=attn, device=DEVICE)


def _prompts(lengths=(40, 17, 33, 5, 26)):
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference():
    """log_softmax of a transformers forward over each prompt: [len(prompt), vocab_size] fp32, row p scoring token
    p + 1."""
    model = tiny_model(attn="sdpa")
    with torch.no_grad():
        return {tuple(p): torch.log_softmax(model(torch.tensor([p], device=DEVICE)).logits[0].float(), -1).cpu()
                for p in _prompts()}  # fmt: skip


def _check(prompt, entries, reference, k, tokenizer=None):
    """``entries`` are the prompt log-probs of ``prompt`` with ``k`` alternatives, as the reference forward gives."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    ref = reference[tuple(prompt)]
    for idx in range(1, len(prompt)):
        row, token, entry = ref[idx - 1], prompt[idx], entries[idx]
        assert next(iter(entry)) == token  # the prompt token first
        top = row.topk(k)
        alternatives = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        assert set(entry) == {token} | set(alternatives)
        for token_id, lp in entry.items():
            torch.testing.assert_close(lp.logprob, row[token_id].item(), atol=2e-5, rtol=1e-5)
            assert lp.rank == int((row > row[token_id]).sum()) + 1
            assert lp.decoded_token == (tokenizer.decode([token_id]) if tokenizer is not None else None)
        if k:  # the alternatives rank 1..k, most likely first
            assert sorted(lp.rank for t, lp in entry.items() if t in alternatives) == list(range(1, k + 1))


@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_batched_tokens=256, num_blocks=64),  # whole prompts in one step
        dict(max_num_batched_tokens=16, num_blocks=64),  # chunked prefill: spans end at chunk boundaries
        dict(max_num_batched_tokens=32, num_blocks=16),  # tiny pool: preemption by recompute
        dict(max_num_batched_tokens=32, num_blocks=16, preemption_mode="swap", swap_space_gb=0.01),
    ],
    ids=["one-step", "chunked", "preempt-recompute", "preempt-swap"],
)
def test_prompt_logprobs_equal_a_transformers_forward(reference, config, async_scheduling):
    engine = ContinuousBatcher(tiny_model(), block_size=8, max_num_seqs=8, async_scheduling=async_scheduling,
                               **config)  # fmt: skip
    ks = [0, 3, 5, None, 20]
    params = [SamplingParams(max_new_tokens=24, prompt_logprobs=k, **GREEDY) for k in ks]
    outs = engine.generate(_prompts(), params, use_tqdm=False)
    for prompt, k, out in zip(_prompts(), ks, outs, strict=True):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            _check(prompt, out.prompt_logprobs, reference, k)
    if config["num_blocks"] == 16:
        assert engine.metrics().num_preemptions > 0
    assert_engine_drained(engine)


def test_steps_that_score_run_eagerly_beside_graph_steps(reference, monkeypatch):
    """The graphs' logits buffers hold sampling rows only: a step with prompt rows runs eagerly, the others replay
    their buckets (emulated on the CPU through the same padded static inputs)."""
    engine = ContinuousBatcher(tiny_model(), block_size=8, num_blocks=64, max_num_batched_tokens=16)
    engine.runner.emulate_graphs = True
    eager, execute = [], engine.runner.execute

    def spy(sched, *args):
        steps = sum(engine.runner.graph_steps.values())
        logits = execute(sched, *args)
        eager.append((bool(sched.prompt_logprob_spans), sum(engine.runner.graph_steps.values()) == steps))
        return logits

    monkeypatch.setattr(engine.runner, "execute", spy)
    prompts = _prompts()[:2]
    params = [
        SamplingParams(max_new_tokens=6, prompt_logprobs=2, **GREEDY),
        SamplingParams(max_new_tokens=6, **GREEDY),
    ]
    outs = engine.generate(prompts, params, use_tqdm=False)
    _check(prompts[0], outs[0].prompt_logprobs, reference, 2)
    assert (True, True) in eager and (False, False) in eager and (True, False) not in eager
    assert_engine_drained(engine)


def test_prefix_cache_hits_are_skipped_for_them_and_their_blocks_still_serve_others(reference):
    engine = ContinuousBatcher(tiny_model(), block_size=8, num_blocks=64)
    prompt = _prompts()[0]  # 40 tokens: 4 full blocks can hit
    plain = SamplingParams(max_new_tokens=4, **GREEDY)
    scored = SamplingParams(max_new_tokens=4, prompt_logprobs=2, **GREEDY)
    first = engine.generate([prompt], plain, use_tqdm=False)[0]
    computed = engine.metrics().num_computed_tokens
    second = engine.generate([prompt], scored, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0 and engine.metrics().num_computed_tokens - computed == 40 + 3
    _check(prompt, second.prompt_logprobs, reference, 2)
    third = engine.generate([prompt], scored, use_tqdm=False)[0]  # the same prompt again still gets them all
    _check(prompt, third.prompt_logprobs, reference, 2)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == third.outputs[0].token_ids
    assert engine.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 32  # the blocks were indexed
    assert_engine_drained(engine)


def test_every_sample_and_beam_search_share_the_one_prompt_scoring(reference, async_scheduling):
    engine = ContinuousBatcher(tiny_model(), block_size=8, num_blocks=64, max_num_batched_tokens=16,
                               async_scheduling=async_scheduling)  # fmt: skip
    prompt = _prompts()[2]
    params = [SamplingParams(n=3, temperature=1.0, seed=7, max_new_tokens=8, prompt_logprobs=4),
              SamplingParams(beam_width=2, n=2, max_new_tokens=8, prompt_logprobs=1)]  # fmt: skip
    sampled, beams = engine.generate([prompt, prompt], params, use_tqdm=False)
    assert len(sampled.outputs) == 3 and len(beams.outputs) == 2
    _check(prompt, sampled.prompt_logprobs, reference, 4)
    _check(prompt, beams.prompt_logprobs, reference, 1)
    assert_engine_drained(engine)


def test_a_step_returns_at_most_the_cap_of_prompt_rows(reference, monkeypatch, async_scheduling):
    monkeypatch.setattr(scheduler_module, "MAX_PROMPT_LOGPROB_ROWS", 8)
    engine = ContinuousBatcher(tiny_model(), block_size=8, num_blocks=64, max_num_batched_tokens=64,
                               async_scheduling=async_scheduling)  # fmt: skip
    rows, execute = [], engine.runner.execute

    def spy(sched, *args):
        rows.append(sum(n for _, _, n in sched.prompt_logprob_spans))
        return execute(sched, *args)

    monkeypatch.setattr(engine.runner, "execute", spy)
    prompts = _prompts()[:3]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=4, prompt_logprobs=1, **GREEDY), use_tqdm=False)
    assert max(rows) == 8 and sum(rows) == sum(len(p) - 1 for p in prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(prompt, out.prompt_logprobs, reference, 1)
    assert_engine_drained(engine)


def test_a_step_interrupted_mid_prompt_leaves_no_gap_and_no_duplicate(reference):
    engine = ContinuousBatcher(tiny_model(), block_size=8, num_blocks=64, max_num_batched_tokens=16)
    prompt = _prompts()[0]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=3, prompt_logprobs=2, **GREEDY))
    engine.step()  # tokens 0-15 scored
    execute = engine.runner.execute

    def boom(*args):
        engine.runner.execute = execute
        raise KeyboardInterrupt

    engine.runner.execute = boom
    with pytest.raises(KeyboardInterrupt):
        engine.step()  # the request is requeued: its prompt is computed again, the tokens scored are kept
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    _check(prompt, outs[rid].prompt_logprobs, reference, 2)
    assert_engine_drained(engine)


def test_decoded_tokens_and_a_one_token_prompt():
    tokenizer = char_tokenizer()
    engine = ContinuousBatcher(tiny_model(), tokenizer, block_size=8, num_blocks=64)
    out = engine.generate(["Hello, world"], SamplingParams(max_new_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    prompt = out.prompt_token_ids
    with torch.no_grad():
        logits = tiny_model(attn="sdpa")(torch.tensor([prompt], device=DEVICE)).logits[0]
    _check(prompt, out.prompt_logprobs, {tuple(prompt): torch.log_softmax(logits.float(), -1).cpu()}, 2, tokenizer)
    one = engine.generate([[5]], SamplingParams(max_new_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    assert_engine_drained(engine)


@pytest.mark.parametrize("value, error", [(21, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)])
def test_a_bad_value_is_refused_naming_it(value, error):
    with pytest.raises(error, match=rf"`prompt_logprobs` must be .*got {value!r}"):
        SamplingParams(prompt_logprobs=value)
