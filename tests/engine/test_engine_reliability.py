"""Where engine features meet: one regression test per failure a seeded add/step/abort run found.

1. beam search and n > 1 sampling in one step (the sampler's row map);
2. n > 1 + recompute preemption + a budget smaller than the samples' recompute;
3. the same with beams;
4. a preempted forked request with prefix caching off (readmission must fit what admission accepted);
5. Ctrl-C inside a step (in detokenisation, in the forward): the engine keeps serving;
6. two interleaved ``stream()`` generators;
7. ``abort()`` from another thread of a request a running ``generate()`` waits for;
8. one engine used from two threads;
9. ``n`` or ``beam_width`` above ``max_num_seqs``;
10. beam search with ``stop`` strings or ``logprobs`` (refused, not ignored);
and the smaller input errors found in the same run.
"""

import gc
import threading

import numpy as np
import pytest
import torch
from helpers import assert_engine_drained
from models import DEVICE, char_tokenizer, tiny_model

from hf_paged import ContinuousBatcher, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(seed=1, lengths=(5, 17, 33, 8, 40, 23)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", device=DEVICE)


def _alone(model, prompt, params, **kwargs):
    engine = ContinuousBatcher(model, num_blocks=256, block_size=8, max_num_batched_tokens=256, **kwargs)
    return [c.token_ids for c in engine.generate([prompt], params, use_tqdm=False)[0].outputs]


def test_1_beam_and_n_samples_in_one_step(model):
    prompts = _prompts()[:2]
    beam = SamplingParams(beam_width=2, max_new_tokens=6, ignore_eos=True)
    pair = SamplingParams(n=2, max_new_tokens=6, **GREEDY)
    engine = ContinuousBatcher(model, num_blocks=64, block_size=8)
    outs = engine.generate(prompts, [beam, pair], use_tqdm=False)
    expected = _alone(model, prompts[1], pair)
    assert [c.token_ids for c in outs[1].outputs] == expected  # not drawn from the beam request's logits
    assert [c.token_ids for c in outs[0].outputs] == _alone(model, prompts[0], beam)
    assert_engine_drained(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("kind", ["n", "beams"])
def test_2_3_forks_recompute_with_a_small_budget(model, kind, async_scheduling):
    if kind == "n":
        params, num_blocks = SamplingParams(n=3, max_new_tokens=24, **GREEDY), 22
    else:
        params, num_blocks = SamplingParams(beam_width=3, max_new_tokens=40, ignore_eos=True), 28
    prompts = _prompts(lengths=(30, 26, 22))
    engine = ContinuousBatcher(model, num_blocks=num_blocks, block_size=8, max_num_batched_tokens=16, max_num_seqs=9,
                               async_scheduling=async_scheduling)  # fmt: skip
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.metrics().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert sorted(c.token_ids for c in out.outputs) == sorted(_alone(model, prompt, params))
    assert_engine_drained(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_4_preempted_forks_without_prefix_caching_are_readmitted(model, mode):
    params = SamplingParams(n=2, max_new_tokens=30, **GREEDY)
    prompts = _prompts(lengths=(40, 33, 36))
    engine = ContinuousBatcher(model, num_blocks=24, block_size=8, max_num_batched_tokens=32, max_num_seqs=8,
                               enable_prefix_caching=False, preemption_mode=mode, swap_space_gb=0.001)  # fmt: skip
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.metrics().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert sorted(c.token_ids for c in out.outputs) == sorted(_alone(model, prompt, params))
    assert_engine_drained(engine)


def test_4_admission_counts_the_unshared_case(model):
    engine = ContinuousBatcher(model, num_blocks=16, block_size=8)
    # Shared, 6 prompt blocks + 2 x 2 = 10 blocks; readmitted unshared, 2 x 8 = 16: fits exactly.
    engine.add_request(list(range(3, 51)), SamplingParams(n=2, max_new_tokens=16, **GREEDY))
    with pytest.raises(ValueError, match=r"can need 18 KV blocks .* the whole pool has 16"):
        engine.add_request(list(range(3, 51)), SamplingParams(n=2, max_new_tokens=17, **GREEDY))


class _FlakyTokenizer:
    """A tokenizer whose decode raises once, on the call number ``fail_at``."""

    def __init__(self, fail_at: int, exc=KeyboardInterrupt):
        self.inner = char_tokenizer()
        self.calls = 0
        self.fail_at = fail_at
        self.exc = exc

    def decode(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.exc("injected")
        return self.inner.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, ValueError], ids=["ctrl-c", "tokenizer-error"])
def test_5_interrupt_in_detokenisation_leaves_the_engine_usable(model, async_scheduling, exc):
    tok = _FlakyTokenizer(fail_at=5, exc=exc)
    engine = ContinuousBatcher(model, tok, num_blocks=64, block_size=8, async_scheduling=async_scheduling)
    prompts = _prompts()[:3]
    params = SamplingParams(max_new_tokens=8, **GREEDY)
    with pytest.raises(exc, match="injected"):
        engine.generate(prompts, params, use_tqdm=False)
    assert_engine_drained(engine)  # the interrupted call's requests are aborted, their blocks free
    assert gc.get_freeze_count() == 0  # the call's heap freeze is undone
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_alone(model, p, params)[0] for p in prompts]
    assert_engine_drained(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_5_interrupt_after_allocation_keeps_other_requests(model, async_scheduling):
    """Ctrl-C in the forward, after the scheduler gave a new request its blocks; a step() caller's requests go on."""
    engine = ContinuousBatcher(model, num_blocks=64, block_size=8, async_scheduling=async_scheduling)
    prompts = _prompts()[:2]
    params = SamplingParams(max_new_tokens=10, **GREEDY)
    rid = engine.add_request(prompts[0], params)
    engine.step()
    engine.add_request(prompts[1], params)
    execute = engine.runner.execute

    def interrupted(*args, **kwargs):
        engine.runner.execute = execute
        raise KeyboardInterrupt

    engine.runner.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.pool.check_invariants()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done[rid] == _alone(model, prompts[0], params)[0]
    assert sorted(done.values()) == sorted(_alone(model, p, params)[0] for p in prompts)
    assert_engine_drained(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_5_interrupt_right_after_the_scheduler_allocated(model, async_scheduling, monkeypatch):
    """Ctrl-C inside scheduling, after a waiting request got its blocks and before it is running."""
    from hf_paged.core.block_pool import BlockPool

    engine = ContinuousBatcher(model, num_blocks=64, block_size=8, async_scheduling=async_scheduling)
    prompts = _prompts()[:3]
    params = SamplingParams(max_new_tokens=6, **GREEDY)
    first = engine.add_request(prompts[0], params)
    engine.step()
    allocate = BlockPool.allocate

    def allocate_then_interrupt(self, *args, **kwargs):
        allocate(self, *args, **kwargs)
        monkeypatch.setattr(BlockPool, "allocate", allocate)
        raise KeyboardInterrupt

    monkeypatch.setattr(BlockPool, "allocate", allocate_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts[1:], params, use_tqdm=False)
    engine.pool.check_invariants()
    outs = engine.generate(prompts[1:], params, use_tqdm=False)  # the engine still serves
    assert [o.outputs[0].token_ids for o in outs] == [_alone(model, p, params)[0] for p in prompts[1:]]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[first].outputs[0].token_ids == _alone(model, prompts[0], params)[0]
    assert_engine_drained(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_5_stop_string_of_a_token_whose_check_was_interrupted(model, async_scheduling):
    """A failed step applied a token but never checked it for stop strings: the check catches up, and tokens
    sampled after the stop string are dropped, as in an uninterrupted run."""
    tok = char_tokenizer()
    prompt = _prompts()[1]
    free = _alone(model, prompt, SamplingParams(max_new_tokens=8, **GREEDY))[0]
    stop = tok.decode([free[2]])
    params = SamplingParams(max_new_tokens=8, stop=[stop], temperature=0.0)
    engine = ContinuousBatcher(model, tok, num_blocks=64, block_size=8, async_scheduling=async_scheduling)
    expected = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert expected.finish_reason == "stop" and expected.token_ids == free[: free.index(free[2]) + 1]
    rid = engine.add_request(prompt, params)
    update = engine.detokenizer.update
    calls = []

    def skip_the_third(request, seq):
        calls.append(1)
        if len(calls) == 3:  # the token that completes the stop string is applied, then the step fails
            engine.detokenizer.update = update
            raise KeyboardInterrupt
        return update(request, seq)

    engine.detokenizer.update = skip_the_third
    outs = {}
    while engine.has_unfinished_requests():
        try:
            outs.update({o.request_id: o for o in engine.step()})
        except KeyboardInterrupt:
            pass
    got = outs[rid].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, "stop")
    assert_engine_drained(engine)


def test_5_detokenizer_checks_skipped_tokens_in_order():
    """Three unchecked tokens whose second completes a stop string: the third is dropped, the text cut."""
    from hf_paged.engine.outputs import Detokenizer
    from hf_paged.engine.request import Request

    tok = char_tokenizer()
    ids = tok("abcd")["input_ids"]
    request = Request("r", [5, 6], SamplingParams(stop=["bc"], max_new_tokens=8), None)
    seq = request.seqs[0]
    seq.token_ids += ids[:3]  # "abc": nothing checked yet
    seq.logprobs = [{t: -1.0} for t in ids[:3]]
    assert Detokenizer(tok).update(request, seq) == "bc"
    assert seq.output_token_ids == ids[:3] and seq.text == "a"
    seq = Request("s", [5, 6], SamplingParams(stop=["b"], max_new_tokens=8), None).seqs[0]
    seq.token_ids += ids[:3]
    seq.logprobs = [{t: -1.0} for t in ids[:3]]
    assert Detokenizer(tok).update(request=Request("s", [5], SamplingParams(stop=["b"]), None), seq=seq) == "b"
    assert seq.output_token_ids == ids[:2] and seq.text == "a" and len(seq.logprobs) == 2


def test_5_a_failed_step_keeps_the_reports_of_what_it_finished(model):
    """Async scheduling: a step processes the previous step (finishing a request), then fails in its own beam
    step; the finished request is still reported once by a later step()."""
    engine = ContinuousBatcher(model, num_blocks=64, block_size=8, async_scheduling=True)
    plain = engine.add_request(_prompts()[0], SamplingParams(max_new_tokens=2, **GREEDY))
    engine.step()
    engine.step()  # plain's last token is in flight (deferred)
    beams = engine.add_request(_prompts()[1], SamplingParams(beam_width=2, max_new_tokens=4, ignore_eos=True))
    apply_beam_step = engine.scheduler.apply_beam_step

    def fail_once(request, result):
        engine.scheduler.apply_beam_step = apply_beam_step
        assert engine.get_output(plain).finished  # finished by this step, before its beam step
        raise KeyboardInterrupt

    engine.scheduler.apply_beam_step = fail_once
    finished = []
    while engine.has_unfinished_requests():
        try:
            finished += [o.request_id for o in engine.step() if o.finished]
        except KeyboardInterrupt:
            pass
    assert sorted(finished) == sorted([plain, beams])
    assert_engine_drained(engine)


def test_6_interleaved_streams_each_get_every_token(model):
    engine = ContinuousBatcher(model, num_blocks=64, block_size=8)
    prompts = _prompts()[:2]
    params = [SamplingParams(max_new_tokens=4, **GREEDY), SamplingParams(max_new_tokens=9, **GREEDY)]
    streams = [engine.stream(p, q) for p, q in zip(prompts, params, strict=True)]
    deltas = [[], []]
    live = [0, 1]
    while live:
        for i in list(live):
            delta = next(streams[i], None)
            if delta is None:
                live.remove(i)
            else:
                deltas[i].append(delta)
    for i in range(2):
        assert [t for d in deltas[i] for t in d.token_ids] == _alone(model, prompts[i], params[i])[0]
        assert deltas[i][-1].finish_reason == "length"
    assert_engine_drained(engine)


def _in_another_thread_during_step(engine, call_number: int, fn) -> None:
    """Run ``fn`` on a second thread (and wait for it) while this thread is inside step number ``call_number``."""
    execute = engine.runner.execute
    calls = []

    def execute_and_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == call_number:
            thread = threading.Thread(target=fn)
            thread.start()
            thread.join()
        return execute(*args, **kwargs)

    engine.runner.execute = execute_and_run


def test_7_abort_from_another_thread_ends_a_waiting_generate(model):
    engine = ContinuousBatcher(model, num_blocks=64, block_size=8)
    _in_another_thread_during_step(engine, 3, lambda: engine.abort("1"))
    result = []
    worker = threading.Thread(
        target=lambda: result.append(
            engine.generate(_prompts()[:2], SamplingParams(max_new_tokens=50, **GREEDY), use_tqdm=False)
        )
    )
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "generate() never returned"
    outs = result[0]
    assert outs[1].outputs[0].finish_reason == "abort" and outs[0].outputs[0].finish_reason == "length"
    assert_engine_drained(engine)


def test_8_a_second_thread_is_refused(model):
    engine = ContinuousBatcher(model, num_blocks=64, block_size=8)
    errors = []

    def intrude():
        try:
            engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
        except RuntimeError as e:
            errors.append(e)

    _in_another_thread_during_step(engine, 1, intrude)
    outs = engine.generate(_prompts()[:2], SamplingParams(max_new_tokens=5, **GREEDY), use_tqdm=False)
    assert len(errors) == 1 and "in use by another thread" in str(errors[0])
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert_engine_drained(engine)


def test_9_more_samples_than_max_num_seqs_is_refused(model):
    engine = ContinuousBatcher(model, num_blocks=64, block_size=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match=r"`n` = 6 exceeds the engine's max_num_seqs=4"):
        engine.add_request([5, 6, 7], SamplingParams(n=6, max_new_tokens=2))
    with pytest.raises(ValueError, match=r"`beam_width` = 5 exceeds the engine's max_num_seqs=4"):
        engine.add_request([5, 6, 7], SamplingParams(beam_width=5, max_new_tokens=2))
    out = engine.generate([[5, 6, 7]], SamplingParams(n=4, max_new_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert_engine_drained(engine)


def test_10_beam_search_refuses_stop_strings_and_logprobs():
    with pytest.raises(ValueError, match=r"`stop` strings are not supported with beam search"):
        SamplingParams(beam_width=2, stop=["x"])
    with pytest.raises(ValueError, match=r"`logprobs` must be None with beam search"):
        SamplingParams(beam_width=2, logprobs=2)


def test_bad_prompt_types_raise_errors_that_name_them(model):
    engine = ContinuousBatcher(model, num_blocks=64, block_size=8)
    with pytest.raises(TypeError, match="`prompts` must be a prompt or a list of prompts .* got None"):
        engine.generate(None)
    with pytest.raises(TypeError, match=r"token ids must be ints, got 1.5"):
        engine.add_request([3, 1.5])
    with pytest.raises(TypeError, match=r"token ids must be ints, got True \(bool\)"):
        engine.add_request([3, True])
    with pytest.raises(ValueError, match=r"token id -1 is outside the vocabulary"):
        engine.add_request([3, -1, 4])
    caller_ids = [5, 6, 7]  # plain ints take the fast path: the engine keeps its own copy
    rid = engine.add_request(caller_ids, SamplingParams(max_new_tokens=2, **GREEDY))
    caller_ids.append(99)
    assert engine.requests[rid].prompt_token_ids == [5, 6, 7]
    while engine.has_unfinished_requests():
        engine.step()
    # numpy integer ids (lists of np.int64, 1-D arrays) are token ids like any other
    ids = np.array([5, 6, 7, 8], dtype=np.int64)
    params = SamplingParams(max_new_tokens=3, **GREEDY)
    outs = engine.generate([ids, list(ids), torch.tensor([5, 6, 7, 8])], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert_engine_drained(engine)


def test_finished_requests_are_forgotten_in_a_long_step_loop(model):
    """A caller driving add_request()/step() itself: finished requests leave engine.requests once returned."""
    engine = ContinuousBatcher(model, num_blocks=256, block_size=8, max_num_batched_tokens=128)
    params = SamplingParams(max_new_tokens=1, **GREEDY)
    high_water = 0
    for i in range(10_000):
        engine.add_request([3 + i % 90, 4], params)
        if i % 64 == 63:
            while engine.has_unfinished_requests():
                engine.step()
        high_water = max(high_water, len(engine.requests))
    while engine.has_unfinished_requests():
        engine.step()
    assert high_water <= 64 and not engine.requests
    assert_engine_drained(engine)
