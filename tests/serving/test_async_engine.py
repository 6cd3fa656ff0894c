"""AsyncEngine: many asyncio callers, one engine thread.

What can go wrong: streams that differ from the offline engine (deltas lost, doubled or crossed between requests);
a cancelled or abandoned consumer whose request keeps its blocks; one caller's bad input failing others; a waiter
left hanging when the engine fails, dies or shuts down; an idle engine thread spinning.
"""

import asyncio
import contextlib
import threading
import time

import pytest
import torch
from helpers import assert_engine_drained
from models import DEVICE, char_tokenizer, tiny_model

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.serving.async_engine import AsyncEngine, EngineDeadError

GREEDY = dict(temperature=0.0, ignore_eos=True)
TIMEOUT_S = 120  # a hang guard, not a speed target


def _prompts(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(length),), generator=gen).tolist() for length in torch.randint(4, 40, (n,))]


def _batcher(**kwargs):
    torch.manual_seed(0)
    kwargs = dict(num_blocks=128, block_size=8, max_num_seqs=16, max_num_batched_tokens=128) | kwargs
    return ContinuousBatcher(tiny_model("llama", device=DEVICE), char_tokenizer(), **kwargs)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def _idle(engine: AsyncEngine):
    """Wait until every request's final output is delivered and the engine thread has nothing left to run."""
    while engine.num_unfinished or (await engine.stats()).num_running:
        await asyncio.sleep(0.01)


def test_concurrent_streams_equal_the_offline_engine():
    prompts = _prompts(12)
    params = [SamplingParams(max_new_tokens=int(m), **GREEDY) for m in torch.randint(3, 30, (12,))]
    expected = _batcher().generate(prompts, params, use_tqdm=False)

    async def consume(engine, prompt, p):
        tokens, text, last = [], "", None
        async for delta in engine.stream(prompt, p):
            assert last is None, "a delta after the last one"
            tokens += delta.token_ids
            text += delta.text
            last = delta.finish_reason
        return tokens, text, last

    async def main():
        built_on = []

        def build():
            built_on.append(threading.current_thread().name)
            return _batcher()

        async with AsyncEngine(build) as engine:
            assert built_on == ["hf_paged-engine"]  # built on the engine thread, which alone touches it
            results = await asyncio.gather(*(consume(engine, q, p) for q, p in zip(prompts, params, strict=True)))
            whole = await engine.generate(prompts[0], params[0])
            await _idle(engine)
            assert_engine_drained(engine.batcher)
        return results, whole

    results, whole = _run(main())
    for (tokens, text, last), out in zip(results, expected, strict=True):
        assert (tokens, text, last) == (out.outputs[0].token_ids, out.outputs[0].text, "length")
    assert whole.outputs[0].token_ids == expected[0].outputs[0].token_ids and whole.finished


def test_n_samples_stream_independently_and_stop_strings_hold_back():
    prompt = _prompts(1)[0]
    n_params = SamplingParams(n=3, max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    free = _batcher().generate([prompt], SamplingParams(max_new_tokens=20, **GREEDY), use_tqdm=False)[0].outputs[0]
    stop_params = SamplingParams(max_new_tokens=20, stop=[free.text[6:9]], **GREEDY)
    expected_n = _batcher().generate([prompt], n_params, use_tqdm=False)[0]

    async def main():
        async with AsyncEngine(_batcher()) as engine:
            texts, tokens = ["", "", ""], [[], [], []]
            async for delta in engine.stream(prompt, n_params):
                texts[delta.index] += delta.text
                tokens[delta.index] += delta.token_ids
            stopped = ""
            async for delta in engine.stream(prompt, stop_params):
                stopped += delta.text
        return texts, tokens, stopped

    texts, tokens, stopped = _run(main())
    assert texts == [c.text for c in expected_n.outputs] and tokens == [c.token_ids for c in expected_n.outputs]
    assert stopped == free.text[:6]


def test_a_slow_consumer_gets_merged_deltas_that_add_up_to_the_output():
    """Deltas queued behind the one a consumer reads are joined (one SSE event instead of one per step): text,
    token ids and log-probs concatenate in order, per sample, and the finish reason rides on the last."""
    prompt = _prompts(1)[0]
    params = SamplingParams(n=2, max_new_tokens=24, temperature=1.0, seed=3, logprobs=1, ignore_eos=True)
    expected = _batcher().generate([prompt], params, use_tqdm=False)[0]

    async def main():
        async with AsyncEngine(_batcher()) as engine:
            stream = engine.stream(prompt, params)
            while engine.num_unfinished:  # let the engine finish before reading anything
                await asyncio.sleep(0.01)
            return [delta async for delta in stream]

    deltas = _run(main())
    assert len(deltas) < 2 * 24  # merged: not one delta per token
    for c in expected.outputs:
        mine = [d for d in deltas if d.index == c.index]
        assert [t for d in mine for t in d.token_ids] == c.token_ids
        assert "".join(d.text for d in mine) == c.text
        assert [lp for d in mine for lp in d.logprobs] == [lp for lp in c.logprobs]
        assert [d.finish_reason for d in mine][-1] == "length"
        assert all(d.finish_reason is None for d in mine[:-1])


@pytest.mark.parametrize("how", ["cancel", "break", "aclose"])
def test_leaving_a_stream_aborts_it_and_frees_its_blocks(how):
    prompts = _prompts(2)

    async def main():
        async with AsyncEngine(_batcher()) as engine:
            keep = asyncio.ensure_future(engine.generate(prompts[0], SamplingParams(max_new_tokens=20, **GREEDY)))
            started = asyncio.Event()

            async def consume():
                stream = engine.stream(prompts[1], SamplingParams(max_new_tokens=400, **GREEDY))
                count = 0
                async for _ in stream:
                    count += 1
                    if count == 3:
                        started.set()
                        if how == "break":
                            break  # the dropped stream aborts its request
                        if how == "aclose":
                            await stream.aclose()
                            return
                if how != "break":
                    raise AssertionError("the stream ran to its end")

            task = asyncio.ensure_future(consume())
            await started.wait()
            if how == "cancel":
                task.cancel()
            with pytest.raises(asyncio.CancelledError) if how == "cancel" else contextlib.nullcontext():
                await task
            assert engine.pool.stats.num_used_blocks > 0 or engine.num_unfinished  # `keep` may still run
            kept = await keep
            await _idle(engine)
            assert_engine_drained(engine.batcher)  # the abandoned request's 400 tokens never ran
            assert engine.batcher.metrics().num_generated_tokens < 100
        return kept

    assert len(_run(main()).outputs[0].token_ids) == 20


def test_bad_input_fails_only_its_caller():
    prompts = _prompts(4)
    params = SamplingParams(max_new_tokens=15, **GREEDY)
    expected = [o.outputs[0].token_ids for o in _batcher().generate(prompts, params, use_tqdm=False)]

    async def main():
        async with AsyncEngine(_batcher(num_blocks=32)) as engine:
            good = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts[:2]]
            await asyncio.sleep(0)
            with pytest.raises(ValueError, match="the prompt is empty"):
                engine.stream([], params)
            with pytest.raises(ValueError, match=r"token id 96 is outside the vocabulary \[0, 96\)"):
                await engine.generate([5, 96], params)
            with pytest.raises(ValueError, match="but the whole pool has 32"):
                await engine.generate(prompts[2], SamplingParams(max_new_tokens=300))
            with pytest.raises(TypeError, match="`params` must be a SamplingParams, got dict"):
                engine.stream(prompts[2], {"max_new_tokens": 3})
            with pytest.raises(TypeError, match="a prompt must be a list of token ids"):
                engine.stream(3.5, params)
            dup = engine.stream(prompts[2], params, request_id="same")
            with pytest.raises(ValueError, match="request id 'same' is already in use"):
                engine.stream(prompts[3], params, request_id="same")
            good += [asyncio.ensure_future(engine.generate(p, params)) for p in prompts[2:]]
            outs = await asyncio.gather(*good)
            await dup.aclose()
            await _idle(engine)
            assert_engine_drained(engine.batcher)
        return outs

    assert [o.outputs[0].token_ids for o in _run(main())] == expected


def test_a_failed_step_fails_the_requests_in_flight_and_the_engine_serves_on():
    prompts = _prompts(3)
    params = SamplingParams(max_new_tokens=10, **GREEDY)
    expected = _batcher().generate([prompts[2]], params, use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        batcher = _batcher()
        execute = batcher.runner.execute
        calls = []

        def fail_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected step failure")
            return execute(*args, **kwargs)

        batcher.runner.execute = fail_once
        async with AsyncEngine(batcher) as engine:
            results = await asyncio.gather(*(engine.generate(p, params) for p in prompts[:2]), return_exceptions=True)
            after = await engine.generate(prompts[2], params)
            await _idle(engine)
            assert_engine_drained(engine.batcher)
        return results, after

    results, after = _run(main())
    assert all(isinstance(r, RuntimeError) and "injected step failure" in str(r) for r in results)
    assert after.outputs[0].token_ids == expected


class _InjectedBug(BaseException):
    pass


def test_a_dead_engine_thread_fails_every_waiter_and_every_later_call(monkeypatch):
    async def main():
        engine = AsyncEngine(_batcher())

        def broken():  # a BaseException: not a failed step the engine recovers from, but a bug that ends the thread
            raise _InjectedBug("injected bug")

        monkeypatch.setattr(engine.batcher, "step_requests", broken)
        waiters = [engine.generate(p, SamplingParams(max_new_tokens=50, **GREEDY)) for p in _prompts(3)]
        results = await asyncio.gather(*waiters, return_exceptions=True)
        with pytest.raises(EngineDeadError, match="injected bug"):
            engine.stream([5, 6], SamplingParams())
        with pytest.raises(EngineDeadError, match="injected bug"):
            await engine.stats()
        await engine.shutdown()  # returns at once: the thread is gone
        return results

    results = _run(main())
    assert all(isinstance(r, EngineDeadError) and "injected bug" in str(r) for r in results)


@pytest.mark.parametrize("drain_timeout_s", [0.0, 30.0], ids=["abort", "drain"])
def test_shutdown_with_requests_in_flight(drain_timeout_s):
    async def main():
        engine = AsyncEngine(_batcher())
        streams = [engine.stream(p, SamplingParams(max_new_tokens=30, **GREEDY)) for p in _prompts(4)]
        first = await streams[0].__anext__()
        await engine.shutdown(drain_timeout_s)
        reasons = [first.finish_reason]
        for stream in streams:
            async for delta in stream:
                reasons.append(delta.finish_reason)
        with pytest.raises(RuntimeError, match="shutting down"):
            engine.stream([5, 6], SamplingParams())
        assert not engine.is_running
        assert_engine_drained(engine.batcher)
        return [r for r in reasons if r is not None]

    reasons = _run(main())
    assert len(reasons) == 4
    assert set(reasons) == ({"abort"} if drain_timeout_s == 0 else {"length"})


def test_the_idle_engine_thread_sleeps():
    async def main():
        async with AsyncEngine(_batcher()) as engine:
            await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=3, **GREEDY))
            steps = engine.batcher.metrics().num_steps
            cpu = time.process_time()
            await asyncio.sleep(0.5)
            assert time.process_time() - cpu < 0.2  # a polling thread would burn the whole half second
            assert engine.batcher.metrics().num_steps == steps

    _run(main())
