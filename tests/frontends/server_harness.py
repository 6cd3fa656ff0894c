"""The test server: a uvicorn server in a background thread on a free port, over an AsyncEngine with a tiny random
model and SmolLM2's tokenizer (its chat template and byte-level BPE; the model's vocabulary is the tokenizer's)."""

import contextlib
import http.client
import json
import socket
import threading
import time

from helpers import assert_engine_drained, http_request
from models import DEVICE, tiny_model

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.serving.async_engine import AsyncEngine

MODEL = "tiny-smollm2"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
CONTEXT = 512  # the tiny models' max_position_embeddings
MAX_PROMPT_TOKENS = 256
MAX_BODY_BYTES = 64 * 1024
TIMEOUT_S = 120  # a hang guard, not a speed target


def batcher(tokenizer) -> ContinuousBatcher:
    model = tiny_model("llama", device=DEVICE, vocab_size=len(tokenizer), num_hidden_layers=1)
    return ContinuousBatcher(model, tokenizer, num_blocks=256, block_size=16, max_num_seqs=48,
                             max_num_batched_tokens=512)  # fmt: skip


class Server:
    def __init__(self, port: int, engine: AsyncEngine, uvicorn_server):
        self.port, self.engine, self.uvicorn = port, engine, uvicorn_server
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def request(self, method: str, path: str, body=None, headers=AUTH, timeout=TIMEOUT_S):
        """(status, parsed JSON or text) of one plain HTTP request."""
        return http_request(self.port, method, path, body, headers, timeout)

    def wait_idle(self) -> None:
        """Until every request has ended and its blocks are back (read while the engine thread sleeps)."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.engine.num_unfinished or self.engine.batcher.has_unfinished_requests():
            assert time.monotonic() < deadline, "the server never went idle"
            time.sleep(0.02)
        time.sleep(0.05)
        assert_engine_drained(self.engine.batcher)


@contextlib.contextmanager
def serving(tokenizer, shutdown_timeout_s: float = 5.0, **app_kwargs):
    """The server of ``create_app(**app_kwargs)`` as ``hf-paged serve`` runs it (``make_server``), until the block
    ends; then as on SIGTERM: the requests in flight get ``shutdown_timeout_s``."""
    from hf_paged.frontends.serve import create_app, make_server

    engine = AsyncEngine(lambda: batcher(tokenizer))
    app = create_app(engine, MODEL, **app_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = make_server(app, shutdown_timeout_s, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield Server(sock.getsockname()[1], engine, server)
    finally:
        server.should_exit = True  # what uvicorn's SIGTERM handler does
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), "the server did not stop"
        assert not engine.is_running, "the engine thread did not stop"


def openai_client(server, asynchronous=False):
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=TIMEOUT_S)


def greedy(offline, prompt, max_tokens):
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def sse(server, path, body):
    """The parsed ``data:`` events of a streamed request, ``"[DONE]"`` included."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=json.dumps(body | {"stream": True}), headers=AUTH)
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        events = []
        for line in resp.read().decode().splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == "", line
        return events
    finally:
        conn.close()
