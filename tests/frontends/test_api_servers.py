"""``hf-paged serve --api-server-count 2`` (hf_paged.frontends.api_servers) as a user runs it: the command in a
subprocess, two API-server processes on one port, in front of two data-parallel engine processes or of one engine
process (``--engine-process on``), a tiny random model saved with SmolLM2's tokenizer, on the CPU.

What can go wrong: streams crossed or lost between an API server and an engine process that serves several API
servers (every greedy stream must equal the offline engine); every connection landing on one API server; metrics
that show one API server's share, or engine gauges that differ by API server; a global limit (``--max-queue``)
that is in fact per API server; a disconnected client or a killed API server whose requests keep their blocks in
an engine process; a SIGTERM that leaves a process behind or cuts a stream short.

Each server starts five processes that import torch and transformers (~20 s on a loaded 2-core machine): two
servers (module fixtures) serve every test, and the tests that end a server come last.
"""

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import http_request, needs_serve, needs_smollm2
from models import tiny_model

from hf_paged import ContinuousBatcher, SamplingParams, load_model

pytestmark = [needs_serve, needs_smollm2]

MODEL = "tiny"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
TIMEOUT_S = 180  # a hang guard, not a speed target
ENGINE_ARGS = ["--device", "cpu", "--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "48",
               "--max-num-batched-tokens", "512"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    """A one-layer random llama with SmolLM2's tokenizer (and chat template), saved where the command loads it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model("llama", device="cpu", vocab_size=len(tokenizer), num_hidden_layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def offline(model_dir):
    """The saved model in a plain ContinuousBatcher, loaded as the command loads it: what greedy answers equal."""
    model, tokenizer = load_model(model_dir, device="cpu")
    return ContinuousBatcher(model, tokenizer, num_blocks=256, block_size=16, max_num_seqs=48,
                             max_num_batched_tokens=512)  # fmt: skip


class _Server:
    """``hf-paged serve --api-server-count 2 ...`` in a subprocess, with the pids its launcher prints."""

    def __init__(self, model_dir: str, log_path, *args: str):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        command = [
            sys.executable,
            "-m",
            "hf_paged.frontends.cli",
            "serve",
            model_dir,
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL,
            "--api-server-count",
            "2",
            "--api-key",
            KEY,
            *ENGINE_ARGS,
            *args,
        ]
        self.log_path = log_path
        self.signalled = False
        self.log = open(log_path, "w")  # noqa: SIM115  (closed by stop())
        env = dict(os.environ, OMP_NUM_THREADS="1")  # five processes on two cores: one torch thread each
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_started()
        except BaseException:
            self.stop()
            raise

    def _wait_started(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        pattern = r"2 API servers \(pids (\d+), (\d+)\) on .*engine process\(es\) \(pids ([\d, ]+)\)"
        while not (line := re.search(pattern, self.output())) or not self._healthy():  # the launcher's line: all up
            assert self.proc.poll() is None, f"the server exited: {self.output()}"
            assert time.monotonic() < deadline, f"the server did not start: {self.output()}"
            time.sleep(0.3)
        self.front_pids = [int(line[1]), int(line[2])]
        self.engine_pids = [int(p) for p in line[3].split(", ")]

    def _healthy(self) -> bool:
        try:
            return self.request("GET", "/health", headers={}, timeout=5)[0] == 200
        except OSError:
            return False

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def request(self, method: str, path: str, body=None, headers=AUTH, timeout=TIMEOUT_S):
        """(status, parsed JSON or text) of one plain HTTP request, on a new connection."""
        return http_request(self.port, method, path, body, headers, timeout)

    def metrics(self) -> dict:
        """/metrics parsed by prometheus_client: {(sample name, the label's value or None): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        status, text = self.request("GET", "/metrics")
        assert status == 200, text
        return {(s.name, s.labels.get("replica", s.labels.get("api_server", s.labels.get("finished_reason")))):
                s.value for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip

    def wait_idle(self) -> dict:
        """Until no engine process runs a request or holds a block (asked of both API servers); the last metrics."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            samples = [self.metrics() for _ in range(4)]  # new connections: both API servers answer
            if all(_idle(s, len(self.engine_pids)) for s in samples):
                return samples[-1]
            assert time.monotonic() < deadline, f"the engine never went idle: {samples[-1]}"
            time.sleep(0.1)

    def stop(self) -> int:
        """SIGTERM; the exit status once every process has exited."""
        if self.proc.poll() is None and not self.signalled:
            self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
        return status

    def assert_processes_gone(self, timeout_s: float = 0.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(_gone(pid) for pid in self.front_pids + self.engine_pids):
            assert time.monotonic() < deadline, [pid for pid in self.front_pids + self.engine_pids if not _gone(pid)]
            time.sleep(0.1)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie that init has not reaped yet counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _idle(samples: dict, num_engines: int) -> bool:
    return samples[("hf_paged_num_requests_running", None)] == 0 and all(
        samples[("hf_paged_replica_kv_cache_usage_perc", str(r))] == 0.0 for r in range(num_engines)
    )


@contextlib.contextmanager
def _serving(model_dir, log_path, *args):
    server = _Server(model_dir, log_path, *args)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


@pytest.fixture(scope="module")
def two_engines(model_dir, offline, tmp_path_factory):
    """Two API servers, two data-parallel engine processes."""
    with _serving(model_dir, tmp_path_factory.mktemp("log") / "serve.log", "--data-parallel", "2",
                  "--max-queue", "64") as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def one_engine(model_dir, offline, tmp_path_factory):
    """Two API servers, one engine process (``--engine-process on``), at most 20 requests in flight."""
    with _serving(model_dir, tmp_path_factory.mktemp("log") / "serve.log", "--engine-process", "on",
                  "--max-queue", "20") as server:  # fmt: skip
        yield server


def _greedy(offline, prompt, max_tokens):
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("server_name", ["two_engines", "one_engine"])
def test_concurrent_streams_equal_the_offline_engine_and_both_api_servers_serve(server_name, request, offline):
    """16 greedy requests (chat and completion, streamed or not, n=2, logprobs) equal the offline engine; 4 sampled
    ones end properly. Both API servers took requests, both engine processes ran some, and every API server's
    /metrics counts every request (the histograms are global)."""
    import openai

    server = request.getfixturevalue(server_name)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0,
                                timeout=TIMEOUT_S)  # fmt: skip
    questions = [f"Question {i}: name a colour." for i in range(20)]
    before = server.metrics()

    async def one(i):
        messages = [{"role": "user", "content": questions[i]}]
        kind = i % 4 if i < 16 else "sampled"
        if kind == 0:  # streamed chat
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                          temperature=0, stream=True)  # fmt: skip
            return ["".join([c.choices[0].delta.content or "" async for c in stream])]
        if kind == 1:  # streamed completion with logprobs
            stream = await client.completions.create(model=MODEL, prompt=questions[i], max_tokens=8, temperature=0,
                                                     logprobs=2, stream=True)  # fmt: skip
            text, num_logprobs = "", 0
            async for c in stream:
                text += c.choices[0].text
                num_logprobs += len(c.choices[0].logprobs.tokens)
            return [text, num_logprobs]
        if kind == 2:  # two greedy samples, streamed
            stream = await client.completions.create(model=MODEL, prompt=questions[i], max_tokens=8, temperature=0,
                                                     n=2, stream=True)  # fmt: skip
            texts = ["", ""]
            async for c in stream:
                for choice in c.choices:
                    texts[choice.index] += choice.text
            return texts
        if kind == 3:  # a whole chat answer with logprobs
            chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                        logprobs=True, top_logprobs=2)  # fmt: skip
            return [chat.choices[0].message.content, len(chat.choices[0].logprobs.content)]
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9,
                                                      seed=i, n=2, stream=True,
                                                      extra_body={"top_k": 20, "stop": ["\n"]})  # fmt: skip
        finish = {}
        async for c in stream:
            for choice in c.choices:
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
        return [sorted(finish), set(finish.values()) <= {"stop", "length"}]

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(20))), TIMEOUT_S)

    results = asyncio.run(main())
    for i, got in enumerate(results[:16]):
        chat = [{"role": "user", "content": questions[i]}]
        expected = _greedy(offline, chat if i % 4 in (0, 3) else questions[i], 8)
        want = {0: [expected.text], 1: [expected.text, len(expected.token_ids)], 2: [expected.text] * 2,
                3: [expected.text, len(expected.token_ids)]}[i % 4]  # fmt: skip
        assert got == want, (i, got, want)
    assert all(got == [[0, 1], True] for got in results[16:])
    after = server.wait_idle()

    def grew(name, label=None):
        return after[(name, label)] - before.get((name, label), 0.0)

    assert grew("hf_paged_api_server_requests_total", "0") > 0 and grew("hf_paged_api_server_requests_total", "1") > 0
    assert grew("hf_paged_api_server_requests_total", "0") + grew("hf_paged_api_server_requests_total", "1") == 20
    assert grew("hf_paged_e2e_request_latency_seconds_count") == 20  # both API servers' requests, in either's answer
    assert grew("hf_paged_time_to_first_token_seconds_count") == 20
    finished = sum(grew("hf_paged_request_success_total", r) for r in ("stop", "length", "abort", "unknown"))
    assert finished == 20 and grew("hf_paged_request_success_total", "abort") == 0  # a request each, whatever its n
    routed = [grew("hf_paged_replica_requests_routed_total", str(r)) for r in range(len(server.engine_pids))]
    assert sum(routed) == 20 and min(routed) > 0, routed
    assert after[("hf_paged_generation_tokens_total", None)] > 0


def test_auth_limits_and_bad_input_on_every_api_server(two_engines):
    server = two_engines
    prompt_tokens = server.metrics()[("hf_paged_prompt_tokens_total", None)]
    for _ in range(6):  # new connections: both API servers answer
        assert server.request("GET", "/health", headers={}) == (200, {"status": "ok"})
        status, body = server.request("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in body["data"]] == [MODEL] and body["data"][0]["max_model_len"] == 512
        for path in ("/v1/models", "/metrics"):
            status, answer = server.request("GET", path, headers={"Authorization": "Bearer wrong"})
            assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        status, answer = server.request("POST", "/v1/completions", {"prompt": "hi", "top_p": 1.5})
        assert status == 400 and answer["error"]["param"] == "top_p"
        status, answer = server.request("POST", "/v1/completions", {"prompt": "hi", "model": "gpt-4"})
        assert status == 404 and answer["error"]["code"] == "model_not_found"
        status, answer = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 512})
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert server.metrics()[("hf_paged_prompt_tokens_total", None)] == prompt_tokens  # none reached the engine


def _open_stream(server, body, path="/v1/completions"):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
    conn.request("POST", path, body=json.dumps(body | {"stream": True}), headers=AUTH)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.readline().startswith(b"data: {")  # the first event: the request runs in an engine process
    return conn, resp


def test_clients_that_disconnect_mid_stream_leave_no_block_in_any_engine_process(two_engines):
    server = two_engines
    generated = server.metrics()[("hf_paged_generation_tokens_total", None)]
    body = {"prompt": "Tell me everything", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    streams = [_open_stream(server, body) for _ in range(6)]
    busy = server.metrics()
    assert busy[("hf_paged_num_requests_running", None)] + busy[("hf_paged_num_requests_waiting", None)] > 0
    for conn, resp in streams:
        resp.readline()
        conn.close()
        resp.close()
    after = server.wait_idle()
    assert after[("hf_paged_generation_tokens_total", None)] - generated < 6 * 400  # none ran to its end


def test_the_queue_limit_is_global(one_engine):
    """--max-queue 20: one request of 20 prompts on one API server fills it; every other request is refused with
    503, whichever API server it reaches (8 connections: both API servers, but with odds of 1/128)."""
    server = one_engine
    body = {"prompt": [f"Story {i}" for i in range(20)], "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    conn, resp = _open_stream(server, body)
    try:
        for _ in range(8):
            status, answer = server.request("POST", "/v1/completions", {"prompt": "one more"})
            assert status == 503 and answer["error"]["code"] == "overloaded", answer
    finally:
        conn.close()
        resp.close()
    server.wait_idle()
    status, _ = server.request("POST", "/v1/completions", {"prompt": "one more", "max_tokens": 2})
    assert status == 200


def test_sigterm_ends_streams_in_flight_then_every_process(two_engines):
    server = two_engines
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    streams = [_open_stream(server, body) for _ in range(4)]
    server.proc.send_signal(signal.SIGTERM)
    server.signalled = True  # a second signal would kill the API servers at once
    for conn, resp in streams:
        events = [line[len("data: ") :] for line in resp.read().decode().splitlines() if line]
        conn.close()
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    # as uvicorn does, the launcher ends by the signal it got, once everything has stopped
    assert server.stop() == -signal.SIGTERM
    server.assert_processes_gone()
    assert server.output().count("Application shutdown complete") == 2


def test_a_killed_api_server_has_its_requests_aborted_and_the_other_serves_on(one_engine, offline):
    server = one_engine
    body = {"prompt": "Tell me everything", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    before = server.metrics()
    streams = []
    while not all(server.metrics()[("hf_paged_api_server_requests_total", f)] > before[
        ("hf_paged_api_server_requests_total", f)] for f in ("0", "1")):  # fmt: skip
        assert len(streams) < 18, "every connection reached the same API server"
        streams.append(_open_stream(server, body))
    os.kill(server.front_pids[0], signal.SIGKILL)
    survivors = 0
    for conn, resp in streams:
        try:
            resp.read()
            survivors += 1  # on the other API server: ran to its end
        except (http.client.IncompleteRead, ConnectionError):
            pass  # on the killed one
        conn.close()
    assert 0 < survivors < len(streams)
    after = server.wait_idle()  # the killed API server's requests were aborted in the engine process
    assert after[("hf_paged_replica_alive", "0")] == 1.0
    deadline = time.monotonic() + TIMEOUT_S
    while "API server 0 (pid" not in server.output():  # the launcher noticed (and reaped it)
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with pytest.raises(ProcessLookupError):  # reaped by the launcher: no zombie
        os.kill(server.front_pids[0], 0)
    status, answer = server.request("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 6, "temperature": 0})
    assert status == 200 and answer["choices"][0]["text"] == _greedy(offline, "Hello", 6).text
    # The launcher killed outright: the API server left reads EOF on its lifeline and shuts down, then the engine
    # process, all of whose pipes have closed, exits.
    server.proc.kill()
    server.signalled = True
    assert server.stop() == -signal.SIGKILL
    server.assert_processes_gone(timeout_s=60)


def test_the_command_line_checks_api_server_count_before_starting_anything(capsys, monkeypatch):
    from hf_paged.frontends.cli import main

    assert main(["serve", "--help"]) == 0
    assert "--api-server-count N" in capsys.readouterr().out
    cases = [
        (["--api-server-count", "0"], "argument --api-server-count: must be a positive int, got 0"),
        (["--api-server-count", "2", "--engine-process", "off"],
         "--api-server-count 2 needs the engine in processes of its own, but --engine-process is 'off'"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hf-paged: error: ") and message in err, err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["serve", "--api-server-count", "3"]) == 2
    err = capsys.readouterr().err
    assert "--api-server-count 3 does not combine with tensor parallelism (torchrun, WORLD_SIZE=2)" in err, err
    monkeypatch.delenv("WORLD_SIZE")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--api-server-count", "2", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err, err
