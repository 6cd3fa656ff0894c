"""The OpenAI-compatible server (hf_paged.frontends.serve) through the official openai client and raw HTTP.

A uvicorn server runs in a background thread on a free port, over an AsyncEngine with a tiny random model and
SmolLM2's tokenizer (its chat template and byte-level BPE; the model's vocabulary is the tokenizer's). What can
go wrong: streams that differ from the offline engine, SSE framing clients choke on (a role-only chunk, a
missing ``[DONE]``, usage in the wrong place), bad input that reaches the engine or takes other streams down, a
disconnected client whose request keeps running and holding blocks, an unguarded endpoint, metrics Prometheus
cannot parse, a shutdown that hangs.
"""

import asyncio
import http.client
import json
import socket
import sys
import threading
import time

import pytest
from helpers import needs_serve, needs_smollm2
from server_harness import (
    AUTH,
    CONTEXT,
    KEY,
    MAX_BODY_BYTES,
    MAX_PROMPT_TOKENS,
    MODEL,
    TIMEOUT_S,
    Server,
    batcher,
    greedy,
    openai_client,
    serving,
    sse,
)

pytestmark = [needs_serve, needs_smollm2]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """As ``hf-paged serve`` does on the CPU: a core left for the event loop (and here, the clients)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(tokenizer):
    with serving(tokenizer, api_key=KEY, max_queue=64, max_prompt_tokens=MAX_PROMPT_TOKENS,
                  max_body_bytes=MAX_BODY_BYTES) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def offline(tokenizer):
    """The same model in a plain ContinuousBatcher: what greedy answers must equal."""
    return batcher(tokenizer)


def test_models_health_and_the_api_key(server):
    prompt_tokens = server.engine.batcher.metrics().num_prompt_tokens
    assert server.request("GET", "/health", headers={}) == (200, {"status": "ok"})
    status, body = server.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL] and body["data"][0]["max_model_len"] == CONTEXT
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("POST", "/v1/completions", {"prompt": "hi"}),
                               ("POST", "/v1/chat/completions", chat)]:  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, answer = server.request(method, path, body, headers=headers)
            assert status == 401, (path, headers)
            assert answer["error"]["type"] == "authentication_error" and answer["error"]["code"] == "invalid_api_key"
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert server.engine.batcher.metrics().num_prompt_tokens == prompt_tokens  # nothing reached the engine


def test_completions_and_chat_with_the_openai_client(server, offline, tokenizer):
    client = openai_client(server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = greedy(offline, messages, 12)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == expected.text and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == expected.finish_reason
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    assert chat.usage.prompt_tokens == len(prompt_ids)
    assert chat.usage.completion_tokens == len(expected.token_ids)

    pieces = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == expected.text
    assert pieces[-1].choices == [] and pieces[-1].usage.completion_tokens == len(expected.token_ids)

    expected = greedy(offline, "Once upon a time", 10)
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert completion.choices[0].text == expected.text
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    batch = client.completions.create(model=MODEL, prompt=["Once upon a time", "Hello"], max_tokens=4,
                                      temperature=0, n=2)  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == greedy(offline, "Once upon a time", 4).text
    assert batch.choices[2].text == greedy(offline, "Hello", 4).text
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert ids.choices[0].text == greedy(offline, [5, 6, 7], 4).text
    nulls = {"temperature": None, "top_p": None, "n": None, "stop": None, "top_k": None, "ignore_eos": None}
    status, body = server.request("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4} | nulls)
    assert status == 200 and len(body["choices"]) == 1  # null means the default, as OpenAI takes it
    server.wait_idle()


def test_sse_framing_role_in_the_first_content_chunk_usage_last_then_done(server):
    events = sse(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                  "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}})  # fmt: skip
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"]  # no role-only chunk before the first token
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in events[:-1]}) == 1
    events = sse(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert events[-1] == "[DONE]" and all("usage" not in c for c in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_32_concurrent_streams_with_mixed_sampling(server, offline):
    """Greedy streams equal the offline engine; sampled ones (seeded, top-k, min-p, n=2, penalties, logprobs,
    stop strings) all end properly."""
    client = openai_client(server, asynchronous=True)
    questions = [f"Question {i}: name a colour." for i in range(32)]

    async def one(i):
        messages = [{"role": "user", "content": questions[i]}]
        kind = i % 4
        if kind == 0:  # greedy chat
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                          temperature=0, stream=True)  # fmt: skip
            return kind, i, "".join([c.choices[0].delta.content or "" async for c in stream])
        if kind == 1:  # greedy completion
            stream = await client.completions.create(model=MODEL, prompt=questions[i], max_tokens=8, temperature=0,
                                                     stream=True)  # fmt: skip
            return kind, i, "".join([c.choices[0].text async for c in stream])
        if kind == 2:  # sampled chat, two choices
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0.8, n=2, seed=i, stream=True,
                extra_body={"top_k": 20, "min_p": 0.05, "stop": ["\n"]},
            )  # fmt: skip
            finish = {}
            async for c in stream:
                for choice in c.choices:
                    if choice.finish_reason is not None:
                        finish[choice.index] = choice.finish_reason
            return kind, i, finish
        stream = await client.completions.create(
            model=MODEL, prompt=questions[i], max_tokens=8, temperature=1.0, logprobs=2, stream=True,
            stream_options={"include_usage": True},
            extra_body={"repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True},
        )  # fmt: skip
        tokens, usage = 0, None
        async for c in stream:
            if c.choices and c.choices[0].logprobs is not None:
                tokens += len(c.choices[0].logprobs.tokens)
                assert all(len(top) == 2 for top in c.choices[0].logprobs.top_logprobs)
            usage = c.usage or usage
        return kind, i, (tokens, usage.completion_tokens)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), TIMEOUT_S)

    results = asyncio.run(main())
    for kind, i, got in results:
        if kind == 0:
            assert got == greedy(offline, [{"role": "user", "content": questions[i]}], 8).text
        elif kind == 1:
            assert got == greedy(offline, questions[i], 8).text
        elif kind == 2:
            assert set(got) == {0, 1} and set(got.values()) <= {"stop", "length"}
        else:
            assert got == (8, 8)
    server.wait_idle()


def test_a_client_that_disconnects_frees_its_request(server):
    generated = server.engine.batcher.metrics().num_generated_tokens
    body = {"prompt": "Tell me everything", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
    conn.request("POST", "/v1/completions", body=json.dumps(body | {"stream": True}), headers=AUTH)
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(6):  # a few events in, the client goes away
        resp.readline()
    conn.close()
    resp.close()
    server.wait_idle()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=0.5)  # non-streamed: the client gives up
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=AUTH)
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()
    server.wait_idle()
    assert server.engine.batcher.metrics().num_generated_tokens - generated < 400  # neither ran to its end


def test_bad_input_is_answered_and_never_reaches_the_engine_while_others_stream(server, offline):
    client = openai_client(server)
    expected = greedy(offline, "A long story", 40)
    first_chunk = threading.Event()
    result = {}

    def background():
        stream = client.completions.create(model=MODEL, prompt="A long story", max_tokens=40, temperature=0,
                                           stream=True)  # fmt: skip
        text = ""
        for chunk in stream:
            text += chunk.choices[0].text
            first_chunk.set()
        result["text"] = text

    thread = threading.Thread(target=background)
    thread.start()
    assert first_chunk.wait(TIMEOUT_S)
    prompt_tokens = server.engine.batcher.metrics().num_prompt_tokens
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/v1/completions", b"{not json", 400, None, None),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
        ("/v1/completions", {"prompt": "hi", "temperature": 0.001}, 400, "temperature", None),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, "logit_bias", None),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
        ("/v1/completions", {"prompt": [5, 10**6]}, 400, None, None),
        ("/v1/completions", {"prompt": ""}, 400, None, None),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
        ("/v1/completions", {"prompt": "hi " * 300}, 400, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT}, 400, "max_tokens", "context_length_exceeded"),
        ("/v1/completions", {"prompt": "x" * MAX_BODY_BYTES}, 413, None, "request_too_large"),
        ("/v1/completions", {}, 400, "prompt", None),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages", None),
        ("/v1/chat/completions", chat | {"tools": [{"type": "function"}]}, 400, "tools", None),
        ("/v1/chat/completions", chat | {"top_logprobs": 2}, 400, "top_logprobs", None),
        ("/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ]  # fmt: skip
    for path, body, status, param, code in cases:
        got, answer = server.request("POST", path, body)
        assert got == status, (body, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], answer
        assert (error["param"], error["code"]) == (param, code), (body, error)
    assert server.engine.batcher.metrics().num_prompt_tokens == prompt_tokens  # none of them reached the engine
    thread.join(TIMEOUT_S)
    assert result["text"] == expected.text
    server.wait_idle()


def test_metrics_are_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    openai_client(server).completions.create(model=MODEL, prompt="Count", max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    status, text = server.request("GET", "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("hf_paged_num_requests_running", "hf_paged_num_requests_waiting", "hf_paged_kv_cache_usage_perc",
                 "hf_paged_prefix_cache_hit_rate", "hf_paged_num_preemptions", "hf_paged_prompt_tokens",
                 "hf_paged_generation_tokens", "hf_paged_time_to_first_token_seconds",
                 "hf_paged_time_per_output_token_seconds", "hf_paged_e2e_request_latency_seconds",
                 "hf_paged_request_success"):  # fmt: skip
        assert name in families, name

    def value(family, suffix=""):
        return next(s.value for s in families[family].samples if s.name == family + suffix)

    assert value("hf_paged_num_requests_running") == 0 and value("hf_paged_kv_cache_usage_perc") == 0.0
    assert value("hf_paged_time_to_first_token_seconds", "_count") >= 1
    assert value("hf_paged_e2e_request_latency_seconds", "_count") >= 1
    assert value("hf_paged_generation_tokens", "_total") >= 5
    assert 0.0 <= value("hf_paged_prefix_cache_hit_rate") <= 1.0


def test_overload_is_503_and_shutdown_ends_streams_in_flight(tokenizer):
    with serving(tokenizer, max_queue=1) as server:
        body = {"prompt": "Keep going", "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.readline()  # the first event: the request is in flight
        status, answer = server.request("POST", "/v1/completions", {"prompt": "one more"}, headers={})
        assert status == 503 and answer["error"]["code"] == "overloaded"
        server.uvicorn.should_exit = True  # SIGTERM: no new connections; the stream in flight may finish
        events = [line[len("data: ") :] for line in resp.read().decode().splitlines() if line]
        conn.close()
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        with pytest.raises(OSError):
            server.request("GET", "/health", headers={}, timeout=5)


def test_the_command_serves_the_default_model_and_ends_on_sigterm(default_model_dir):
    """``hf-paged serve`` as a user runs it: a stream in flight when SIGTERM arrives still ends properly, and the
    process exits."""
    import signal
    import subprocess
    import sys

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    command = [sys.executable, "-m", "hf_paged.frontends.cli", "serve", "--port", str(port), "--num-blocks", "64",
               "--max-num-batched-tokens", "256", "--shutdown-timeout", "60"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        server = Server(port, None, None)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if server.request("GET", "/health", headers={}, timeout=5)[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
        body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.readline()
        assert first.startswith(b"data: {")
        proc.send_signal(signal.SIGTERM)
        events = [first.decode().strip()[len("data: ") :]]
        events += [line[len("data: ") :] for line in resp.read().decode().splitlines() if line]
        conn.close()
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the signal once it has shut down, so the exit status says "ended by SIGTERM"
        assert proc.wait(TIMEOUT_S) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Application shutdown complete" in proc.stdout.read()


def test_the_serving_benchmark_measures_a_few_requests(server, tmp_path, monkeypatch):
    """benchmarks/serve.py (vllm bench serve's method) against the test server: Poisson arrivals, streaming."""
    import importlib.util
    import pathlib

    # Imported by name from its folder: --client-processes spawns processes that import it the same way.
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    bench = importlib.import_module("serve")
    monkeypatch.setitem(sys.modules, "serve", bench)  # forgotten after the test
    result_file = tmp_path / "result.json"
    argv = ["--base-url", f"http://127.0.0.1:{server.port}", "--api-key", KEY, "--num-prompts", "6",
            "--random-input-len", "12", "--random-output-len", "5", "--request-rate", "40", "--ignore-eos",
            "--goodput", "ttft:60000", "e2el:1", "--result-file", str(result_file)]  # fmt: skip
    for endpoint in ("completions", "chat"):
        assert bench.main([*argv, "--endpoint", endpoint]) == 0
        result = json.loads(result_file.read_text())
        assert (result["completed"], result["failed"], result["model"]) == (6, 0, MODEL)
        assert result["total_output_tokens"] == 30  # ignore_eos: every request gives its 5 tokens
        assert result["goodput"] == 0.0  # no request ends within 1 ms
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
        assert result["p50_e2el_ms"] >= result["p50_ttft_ms"]
    # Two client processes share the requests (round-robin) and one arrival schedule; the same totals come back.
    assert bench.main([*argv, "--endpoint", "chat", "--client-processes", "2"]) == 0
    result = json.loads(result_file.read_text())
    assert (result["completed"], result["total_output_tokens"], result["client_processes"]) == (6, 30, 2)
    assert 0 < result["duration_s"] < 120
    assert bench.main([*argv, "--goodput", "latency:5"]) == 2
    assert bench.main([*argv, "--client-processes", "0"]) == 2
    assert bench.parse_goodput(["ttft:500", "tpot:50"]) == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    server.wait_idle()
