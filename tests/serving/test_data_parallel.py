"""DataParallelEngine: replica processes (spawned, two on the CPU, one torch thread each) behind one asyncio front.

What can go wrong: streams that differ from the offline engine once they cross a process boundary (deltas lost,
doubled or crossed between requests or replicas); requests piling onto one replica; an abandoned stream whose
request keeps its blocks in the replica; a dead replica that leaves its callers waiting forever or takes the
front down; a shutdown that hangs on a replica; the HTTP server not serving the front as it serves an AsyncEngine.

Starting a replica imports torch and transformers in a fresh process (several seconds on a loaded machine), so
one engine behind one server serves most tests, and the test that kills a replica starts its own.
"""

import asyncio
import contextlib
import functools
import os
import signal
import socket
import threading
import time

import pytest
import torch
from helpers import needs_serve
from models import tiny_batcher

from hf_paged import SamplingParams
from hf_paged.serving import data_parallel
from hf_paged.serving.data_parallel import DataParallelEngine, ReplicaDeadError
from hf_paged.serving.streaming import EngineDeadError

GREEDY = dict(temperature=0.0, ignore_eos=True)
TIMEOUT_S = 120  # a hang guard, not a speed target
FACTORY = functools.partial(tiny_batcher, num_blocks=96)


def _prompts(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(length),), generator=gen).tolist() for length in torch.randint(4, 40, (n,))]


def _is_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (the engine joins its replicas, so a stopped one is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def _engine() -> DataParallelEngine:
    return DataParallelEngine(FACTORY, num_replicas=2, device="cpu", num_threads=1)


async def _idle(engine: DataParallelEngine):
    """Until every final output is delivered and every live replica runs nothing; returns the last stats."""
    while True:
        stats = await engine.stats()
        if not engine.num_unfinished and not stats.num_running and not stats.num_waiting:
            return stats
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """One torch thread here too: the replicas and the front's threads share the cores with this process, and torch
    regions on two threads wait for the preempted one (the offline engine's 12 prompts: 17 s on a loaded 2-core
    machine, 0.4 s with one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def offline():
    """The replicas' engine, built here: what greedy outputs must equal."""
    return FACTORY()


@pytest.fixture(scope="module")
def served():
    """A 2-replica engine behind the HTTP server on a free port; stopping the server shuts the engine down."""
    if not _serve_extra():
        yield _Served(_engine(), None)  # the engine tests still run; the HTTP test skips
        return
    import uvicorn

    from hf_paged.frontends.serve import create_app

    engine = _engine()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "tiny"), log_level="warning",
                                           timeout_graceful_shutdown=10))  # fmt: skip
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield _Served(engine, sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), "the server did not stop"
        assert not any(_is_alive(pid) for pid in engine.replica_pids), "a replica outlived the server"


class _Served:
    def __init__(self, engine: DataParallelEngine, port: int | None):
        self.engine, self.port = engine, port


def _serve_extra() -> bool:
    from helpers import has_serve_extra

    return has_serve_extra()


def test_concurrent_streams_equal_the_offline_engine_and_spread_over_both_replicas(served, offline):
    engine = served.engine
    prompts = _prompts(12)
    params = [SamplingParams(max_new_tokens=int(m), **GREEDY) for m in torch.randint(3, 30, (12,))]
    params[3] = SamplingParams(n=2, max_new_tokens=9, temperature=0.9, seed=3, ignore_eos=True)
    expected = offline.generate(prompts, params, use_tqdm=False)

    async def consume(prompt, p):
        texts, tokens, reasons = {}, {}, {}
        async for delta in engine.stream(prompt, p):
            assert delta.index not in reasons, "a delta after the last one"
            texts[delta.index] = texts.get(delta.index, "") + delta.text
            tokens[delta.index] = tokens.get(delta.index, []) + delta.token_ids
            if delta.finish_reason is not None:
                reasons[delta.index] = delta.finish_reason
        return texts, tokens, reasons

    async def main():
        before = (await engine.stats()).num_routed
        results = await asyncio.gather(*(consume(q, p) for q, p in zip(prompts, params, strict=True)))
        stats = await _idle(engine)
        return results, [a - b for a, b in zip(stats.num_routed, before, strict=True)], stats

    results, routed, stats = _run(main())
    for (texts, tokens, reasons), out in zip(results, expected, strict=True):
        for c in out.outputs:
            assert (tokens[c.index], texts[c.index], reasons[c.index]) == (c.token_ids, c.text, "length")
    assert routed == [6, 6]  # submitted together: least-loaded alternates
    assert engine.replica_gpus == [os.environ.get("CUDA_VISIBLE_DEVICES")] * 2  # device="cpu": inherited as is
    assert all(s.metrics.num_generated_tokens > 0 and s.metrics.num_used_blocks == 0 for s in stats.replicas)
    assert stats.metrics.num_generated_tokens == sum(s.metrics.num_generated_tokens for s in stats.replicas)
    assert stats.metrics.num_blocks == 2 * 96


def test_a_repeated_prompt_goes_to_the_replica_that_cached_it(served):
    """Sent one after another to an idle engine (equal loads), a prompt goes where it went before, and its second
    and third prefills come from that replica's prefix cache; least-loaded round-robin would alternate."""
    engine = served.engine
    prompt = _prompts(1, seed=7)[0] * 2  # 8..78 tokens: several full blocks of 8
    params = SamplingParams(max_new_tokens=3, **GREEDY)

    async def main():
        before = await _idle(engine)
        for _ in range(3):
            out = await engine.generate(prompt, params)
            assert len(out.outputs[0].token_ids) == 3
        after = await _idle(engine)
        return before, after

    before, after = _run(main())
    routed = [a - b for a, b in zip(after.num_routed, before.num_routed, strict=True)]
    assert sorted(routed) == [0, 3], routed
    cached = routed.index(3)
    computed = after.replicas[cached].metrics.num_computed_tokens - before.replicas[cached].metrics.num_computed_tokens
    assert computed < 3 * len(prompt)  # the second and third prompts hit the cache
    assert after.replicas[cached].metrics.num_used_blocks == 0


def test_prompt_logprobs_cross_the_pipe_and_reset_prefix_cache_empties_every_replica(served, offline):
    engine = served.engine
    prompt = list(range(10, 50))  # 5 full blocks of 8
    scored = SamplingParams(max_new_tokens=2, prompt_logprobs=3, **GREEDY)
    plain = SamplingParams(max_new_tokens=2, **GREEDY)
    expected = offline.generate([prompt], scored, use_tqdm=False)[0].prompt_logprobs

    async def main():
        await _idle(engine)
        outs = [await engine.generate(prompt, scored), await engine.generate(prompt, plain)]
        await engine.reset_prefix_cache()
        outs.append(await engine.generate(prompt, plain))
        await _idle(engine)
        return outs

    with_logprobs, hit, after_reset = _run(main())
    got = with_logprobs.prompt_logprobs
    assert len(got) == len(expected) == len(prompt) and got[0] is None
    for entry, want in zip(got[1:], expected[1:], strict=True):
        assert list(entry) == list(want)
        for token_id, lp in entry.items():
            assert (lp.rank, lp.decoded_token) == (want[token_id].rank, want[token_id].decoded_token)
            assert lp.logprob == pytest.approx(want[token_id].logprob, abs=1e-5)
    assert hit.num_cached_tokens == 32  # the blocks the scored request computed were indexed
    assert after_reset.num_cached_tokens == 0


@pytest.mark.parametrize("how", ["cancel", "aclose"])
def test_leaving_a_stream_aborts_it_on_its_replica_and_frees_its_blocks(served, how):
    engine = served.engine

    async def main():
        generated = (await engine.stats()).metrics.num_generated_tokens
        stream = engine.stream(_prompts(1, seed=5)[0], SamplingParams(max_new_tokens=400, **GREEDY))
        started = asyncio.Event()
        busy = []

        async def consume():
            count = 0
            async for _ in stream:
                count += 1
                if count == 3:
                    busy.append(await engine.stats())
                    started.set()
                    if how == "aclose":
                        await stream.aclose()
                        return
            raise AssertionError("the stream ran to its end")

        task = asyncio.ensure_future(consume())
        await started.wait()
        if how == "cancel":
            task.cancel()
        with pytest.raises(asyncio.CancelledError) if how == "cancel" else contextlib.nullcontext():
            await task
        stats = await _idle(engine)
        return busy[0], stats, stats.metrics.num_generated_tokens - generated

    busy, stats, generated = _run(main())
    assert busy.metrics.num_used_blocks > 0
    assert [s.metrics.num_used_blocks for s in stats.replicas] == [0, 0]
    assert generated < 200  # the abandoned request's 400 tokens never ran


def test_bad_input_and_bad_settings_are_refused_in_the_front(served):
    engine = served.engine

    async def main():
        with pytest.raises(ValueError, match="the prompt is empty"):
            engine.stream([], SamplingParams())
        with pytest.raises(ValueError, match="but the whole pool has 96"):
            engine.stream([5] * 30, SamplingParams(n=4, max_new_tokens=400))
        with pytest.raises(TypeError, match="`params` must be a SamplingParams, got dict"):
            engine.stream([5], {"max_new_tokens": 3})
        held = engine.stream([5, 6], SamplingParams(max_new_tokens=50, **GREEDY), request_id="same")
        with pytest.raises(ValueError, match="request id 'same' is already in use"):
            engine.stream([5, 6], SamplingParams(), request_id="same")
        engine.abort("same")
        async for _ in held:
            pass
        assert held.output.outputs[0].finish_reason == "abort"
        with pytest.raises(ValueError, match="unknown request id 'same'"):
            engine.abort("same")
        await _idle(engine)

    _run(main())
    with pytest.raises(ValueError, match=r"`num_replicas` must be an int >= 1, got 0"):
        DataParallelEngine(FACTORY, 0, device="cpu")
    with pytest.raises(ValueError, match=r"`device` must be one of \['cpu', 'cuda'\], got 'cuda:1'"):
        DataParallelEngine(FACTORY, 2, device="cuda:1")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="64 data-parallel replicas need 64 GPUs, but"):
            DataParallelEngine(FACTORY, 64, device="cuda")
    with pytest.raises(TypeError, match="`factory` must pickle .* got <function .*<lambda>"):
        DataParallelEngine(lambda: FACTORY(), 2, device="cpu")
    with pytest.raises(ValueError, match=r"`num_fronts` must be an int >= 0, got -1"):
        DataParallelEngine(FACTORY, 2, device="cpu", num_fronts=-1)
    with pytest.raises(ValueError, match=r"`front_idx` must be in \[0, 0\) \(this engine was built with num_fronts="):
        engine.front_handoff(0)


def test_the_command_line_checks_data_parallel_before_starting_anything(capsys):
    from hf_paged.frontends.cli import main

    assert main(["serve", "--help"]) == 0
    assert "--data-parallel N" in capsys.readouterr().out
    cases = [
        (["--data-parallel", "0"], "argument --data-parallel: must be a positive int, got 0"),
        (["--data-parallel", "2", "--device", "cuda:1"],
         "--device must be 'cuda' or 'cpu' with --data-parallel 2 (replica i uses GPU i), got 'cuda:1'"),
    ]  # fmt: skip
    if torch.cuda.device_count() < 64:
        cases.append((["--data-parallel", "64", "--device", "cuda"], "--data-parallel 64 needs 64 GPUs, but"))
    for argv, message in cases:
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hf-paged: error: ") and message in err, err


@needs_serve
def test_the_server_serves_the_replicas_with_the_openai_client(served, offline):
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none", max_retries=0,
                                timeout=TIMEOUT_S)  # fmt: skip
    questions = [f"Question {i}?" for i in range(6)]

    async def one(i):
        if i % 2:
            stream = await client.completions.create(model="tiny", prompt=questions[i], max_tokens=8,
                                                     temperature=0, stream=True)  # fmt: skip
            return "".join([c.choices[0].text async for c in stream])
        chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": questions[i]}],
                                                    max_tokens=8, temperature=0)  # fmt: skip
        return chat.choices[0].message.content

    async def main():
        before = (await served.engine.stats()).num_routed
        texts = await asyncio.gather(*(one(i) for i in range(6)))
        stats = await _idle(served.engine)
        return texts, [a - b for a, b in zip(stats.num_routed, before, strict=True)]

    texts, routed = _run(main())
    for i, text in enumerate(texts):
        prompt = questions[i] if i % 2 else [{"role": "user", "content": questions[i]}]
        assert text == offline.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0),
                                        use_tqdm=False)[0].outputs[0].text  # fmt: skip
    assert sum(routed) == 6 and min(routed) >= 1
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=TIMEOUT_S)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, s.labels.get("replica")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples}  # fmt: skip
    assert samples[("hf_paged_kv_cache_usage_perc", None)] == 0.0
    assert samples[("hf_paged_generation_tokens_total", None)] > 0
    for idx in ("0", "1"):
        assert samples[("hf_paged_replica_alive", idx)] == 1.0
        assert samples[("hf_paged_replica_requests_routed_total", idx)] >= routed[int(idx)]
        assert samples[("hf_paged_replica_num_requests_running", idx)] == 0.0


def test_a_killed_replica_fails_its_requests_the_other_serves_on_and_shutdown_ends_the_rest(offline, monkeypatch):
    prompts = _prompts(5, seed=7)
    long = SamplingParams(max_new_tokens=300, **GREEDY)
    # As if this machine had GPUs 3 and 5 visible: each replica must start with one of them alone (the tiny model
    # stays on the CPU whatever it sees).
    monkeypatch.setattr(data_parallel, "visible_gpus", lambda: ["3", "5"])

    async def main():
        engine = DataParallelEngine(FACTORY, num_replicas=2, device="cuda", num_threads=1)
        assert engine.replica_gpus == ["3", "5"]
        streams = [engine.stream(p, long) for p in prompts[:4]]
        for stream in streams:
            await stream.__anext__()  # every request is running
        on = {idx: [s for s in streams if engine.replica_of(s.request_id) == idx] for idx in (0, 1)}
        assert len(on[0]) == len(on[1]) == 2
        os.kill(engine.replica_pids[1], signal.SIGKILL)
        for stream in on[1]:
            with pytest.raises(ReplicaDeadError, match=r"data-parallel replica 1 \(pid \d+\) died \(exit code -9\)"):
                async for _ in stream:
                    pass
        after = await engine.generate(prompts[4], SamplingParams(max_new_tokens=10, **GREEDY))
        stats = await engine.stats()
        assert stats.replicas[1] is None and stats.replicas[0] is not None
        # shutdown with the surviving replica's two requests still running: they end, aborted, at once
        start = time.monotonic()
        await engine.shutdown()
        took = time.monotonic() - start
        reasons = []
        for stream in on[0]:
            async for delta in stream:
                reasons.append(delta.finish_reason)
        with pytest.raises(RuntimeError, match="shutting down"):
            engine.stream([5, 6], SamplingParams())
        assert not any(_is_alive(pid) for pid in engine.replica_pids)
        return after, took, [r for r in reasons if r is not None]

    after, took, reasons = _run(main())
    expected = offline.generate([prompts[4]], SamplingParams(max_new_tokens=10, **GREEDY), use_tqdm=False)[0]
    assert after.outputs[0].token_ids == expected.outputs[0].token_ids
    assert reasons == ["abort", "abort"]
    assert took < 20  # the replica stopped by itself, not by the 30 s terminate fallback


def test_every_replica_dead_is_engine_dead():
    async def main():
        engine = DataParallelEngine(FACTORY, num_replicas=1, device="cpu", num_threads=1)
        os.kill(engine.replica_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT_S
        while engine.num_live_replicas:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError, match="every data-parallel replica has died"):
            engine.stream([5, 6], SamplingParams())
        with pytest.raises(EngineDeadError, match="every data-parallel replica has died"):
            await engine.stats()
        await engine.shutdown()

    _run(main())
