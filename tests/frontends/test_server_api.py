"""The server as a vLLM client meets it: every request field honoured or refused, tool calls, the utility endpoints,
the API docs behind the key, a request of too many prompts, the end of a stream at shutdown.

What can go wrong: a field accepted and silently dropped (the client believes it was applied), a chat history whose
tool calls never reach the template, a call the client cannot parse, a body of a million prompts that holds the
event loop, a stream cut without its last chunk, endpoints answering without the key.
"""

import http.client
import json
import re
import time

import pytest
from helpers import needs_serve, needs_smollm2
from server_harness import AUTH, KEY, MAX_BODY_BYTES, MODEL, TIMEOUT_S, openai_client, serving, sse

from hf_paged.engine.outputs import StreamDelta
from hf_paged.engine.request import CompletionOutput
from hf_paged.frontends.openai_api import Formatter
from hf_paged.frontends.openai_requests import _REFUSED, ChatCompletionRequest, CompletionRequest

pytestmark = [needs_serve, needs_smollm2]

# A Hermes-style template that shows what reached it: the tools, each message's tool calls and tool_call_id, and
# one extra variable (chat_template_kwargs).
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% if flavour is defined %}[{{ flavour }}]{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}:"
    "{{ c.function.arguments.city }}</tool_call>{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}"
    "{% if not (loop.last and m.role == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def server(tokenizer):
    with serving(tokenizer, api_key=KEY, max_queue=64, max_body_bytes=MAX_BODY_BYTES) as s:
        yield s


def _tokenize_text(server, body) -> str:
    status, answer = server.request("POST", "/tokenize", body)
    assert status == 200, answer
    status, text = server.request("POST", "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200, text
    return text["prompt"]


# Fields each request model declares that hf_paged acts on; every other declared field must be in _REFUSED.
HONOURED = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids",
    "repetition_penalty", "skip_special_tokens", "include_stop_str_in_output", "use_beam_search", "length_penalty",
    "truncate_prompt_tokens", "request_id", "prompt_logprobs", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar",
    # completions
    "prompt", "logprobs", "echo", "best_of", "suffix", "add_special_tokens",
    # chat
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
}  # fmt: skip


def test_every_declared_field_is_honoured_or_refused():
    """A field added to a request model without a decision fails here."""
    for model in (CompletionRequest, ChatCompletionRequest):
        undecided = set(model.model_fields) - HONOURED - set(_REFUSED)
        assert not undecided, f"{model.__name__}: {sorted(undecided)} are neither honoured nor refused"


def test_every_refused_field_is_a_400_that_names_it(server):
    endpoints = {"/v1/completions": (CompletionRequest, {"prompt": "hi", "max_tokens": 2}),
                 "/v1/chat/completions": (ChatCompletionRequest, CHAT)}  # fmt: skip
    for name, (neutral, _) in _REFUSED.items():
        value = {"modalities": ["audio"], "service_tier": "flex", "store": True, "echo": True,
                 "spaces_between_special_tokens": False, "priority": 3, "return_tokens_as_token_ids": True,
                 "return_token_ids": True}.get(name, {"x": 1})  # fmt: skip
        assert value not in neutral
        paths = [path for path, (model, _) in endpoints.items() if name in model.model_fields]
        assert paths, f"{name} is refused but no request declares it"
        for path in paths:
            base = endpoints[path][1]
            status, answer = server.request("POST", path, base | {name: value})
            assert status == 400 and answer["error"]["param"] == name, (path, name, answer)
            assert f"`{name}`" in answer["error"]["message"]
            for asks_nothing in neutral:
                status, answer = server.request("POST", path, base | {name: asks_nothing})
                assert status == 200, (path, name, asks_nothing, answer)
    server.wait_idle()


def test_vllm_extras_are_honoured(server, tokenizer):
    long_prompt = list(range(10, 60))
    status, answer = server.request("POST", "/v1/completions",
                                    {"prompt": long_prompt, "max_tokens": 2, "truncate_prompt_tokens": 7})  # fmt: skip
    assert status == 200 and answer["usage"]["prompt_tokens"] == 7, answer
    status, answer = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "request_id": "abc"})
    assert status == 200 and answer["id"] == "cmpl-abc"
    beams = {"prompt": "Once", "max_tokens": 5, "n": 2, "use_beam_search": True, "length_penalty": 0.5}
    status, answer = server.request("POST", "/v1/completions", beams)
    assert status == 200 and len(answer["choices"]) == 2, answer
    assert answer["choices"][0]["text"] != answer["choices"][1]["text"]  # two distinct beams
    status, again = server.request("POST", "/v1/completions", beams)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in answer["choices"]]  # beams are deterministic
    status, answer = server.request("POST", "/v1/completions", {"prompt": "hi", "length_penalty": 2.0})
    assert status == 400 and answer["error"]["param"] == "length_penalty"
    status, answer = server.request("POST", "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0})
    assert status == 400 and answer["error"]["param"] == "truncate_prompt_tokens"
    server.wait_idle()


def test_the_chat_template_receives_tools_histories_and_its_options(server):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                               "function": {"name": "get_weather",
                                                                            "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    text = _tokenize_text(server, {"messages": history, "tools": [WEATHER], "chat_template": TEMPLATE,
                                   "chat_template_kwargs": {"flavour": "mint"}})  # fmt: skip
    assert text.startswith("<tools>get_weather;</tools>[mint]")
    assert "<tool_call>get_weather:Paris</tool_call>" in text and "sunny(answers call_1)" in text
    assert text.endswith("<|im_start|>assistant\n")
    cont = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello the"}]
    text = _tokenize_text(server, {"messages": cont, "chat_template": TEMPLATE, "add_generation_prompt": False,
                                   "continue_final_message": True})  # fmt: skip
    assert text.endswith("assistant\nHello the")
    # the same options reach generation: the prompt is the template's
    for body in (
        {"messages": history, "tools": [WEATHER], "chat_template": TEMPLATE, "max_tokens": 3},
        {"messages": cont, "chat_template": TEMPLATE, "add_generation_prompt": False, "continue_final_message": True,
         "max_tokens": 3},
    ):  # fmt: skip
        status, answer = server.request("POST", "/v1/chat/completions", body)
        assert status == 200, answer
        expected = server.request("POST", "/tokenize", {k: v for k, v in body.items() if k != "max_tokens"})[1]
        assert answer["usage"]["prompt_tokens"] == expected["count"]
    bad = [
        (CHAT | {"continue_final_message": True}, "continue_final_message"),
        (CHAT | {"add_generation_prompt": False, "continue_final_message": True}, "continue_final_message"),
        (CHAT | {"tool_choice": "auto"}, "tool_choice"),
        (
            CHAT
            | {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
                "chat_template": TEMPLATE,
            },
            "tool_choice",
        ),
        (
            CHAT
            | {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
                "chat_template": TEMPLATE,
            },
            "tool_choice",
        ),
        (CHAT | {"tools": [WEATHER]}, "tools"),  # SmolLM2's template writes no tool calls: no parser to read them
        (CHAT | {"tools": [{"type": "function"}], "chat_template": TEMPLATE}, "tools"),
    ]
    for body, param in bad:
        status, answer = server.request("POST", "/v1/chat/completions", body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    server.wait_idle()


def test_tool_calls_in_the_output_become_tool_calls_whole_and_streamed():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    fmt = Formatter("chat", MODEL, None, tool_parser="hermes")
    body = fmt.response([(0, CompletionOutput(0, [1, 2], text, "stop"))], {})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # streamed in pieces that split the opener: the content goes out, the call comes whole with the last chunk
    fmt = Formatter("chat", MODEL, None, tool_parser="hermes")
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    ends = [None] * (len(pieces) - 1) + ["stop"]
    chunks = [fmt.chunk(0, StreamDelta(p, [1], end)) for p, end in zip(pieces, ends, strict=True)]
    deltas = [c["choices"][0] for c in chunks if c is not None]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content.strip() == "Let me check." and "<tool" not in content
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert deltas[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert deltas[-1]["delta"]["tool_calls"][0]["index"] == 0
    # a call cut by max_tokens does not parse: the text stays content, finish_reason "length"
    fmt = Formatter("chat", MODEL, None, tool_parser="hermes")
    body = fmt.response([(0, CompletionOutput(0, [1], text[:-30], "length"))], {})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text[:-30]}


def test_utility_endpoints_and_the_docs_need_the_key(server, tokenizer):
    status, answer = server.request("POST", "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and answer["tokens"] == tokenizer("Hello world")["input_ids"] and answer["count"] == 2
    assert server.request("POST", "/detokenize", {"tokens": answer["tokens"]}) == (200, {"prompt": "Hello world"})
    status, answer = server.request("POST", "/detokenize", {"tokens": [10**7]})
    assert status == 400 and answer["error"]["param"] == "tokens"
    status, answer = server.request("POST", "/tokenize", {"prompt": "a", "messages": CHAT["messages"]})
    assert status == 400
    status, answer = server.request("GET", "/version")
    assert status == 200 and answer["version"]
    assert server.request("GET", "/ping", headers={})[0] == 200
    assert server.request("POST", "/ping", headers={})[0] == 200
    status, card = server.request("GET", f"/v1/models/{MODEL}")
    assert status == 200 and card["id"] == MODEL
    assert server.request("GET", "/v1/models/other")[0] == 404
    for path in ("/docs", "/redoc", "/openapi.json", "/version", "/v1/models/" + MODEL):
        status, answer = server.request("GET", path, headers={})
        assert status == 401, (path, answer)
    status, schema = server.request("GET", "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in schema["paths"]
    assert server.request("GET", "/docs")[0] == 200


def test_a_body_of_more_prompts_than_the_queue_is_a_400_at_once(server):
    body = json.dumps({"prompt": [[5]] * 12_000, "max_tokens": 1})
    assert len(body) < MAX_BODY_BYTES
    start = time.monotonic()
    status, answer = server.request("POST", "/v1/completions", body)
    assert status == 400 and "12000 prompts" in answer["error"]["message"], answer
    assert time.monotonic() - start < 10  # no per-prompt work: a hang guard, not a speed target
    assert server.engine.num_unfinished == 0


def test_a_stream_still_running_at_the_shutdown_timeout_ends_with_abort_and_done(tokenizer):
    with serving(tokenizer, shutdown_timeout_s=0.0) as server:
        body = {"prompt": "Keep going", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.readline()  # the first event: the request is in flight
        server.uvicorn.should_exit = True  # SIGTERM
        events = [line[len("data: ") :] for line in resp.read().decode().splitlines() if line]
        conn.close()
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])["choices"][0]
    assert last["finish_reason"] == "abort", last


def test_a_chat_with_tools_streams_what_it_answers_whole(server):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "chat_template": TEMPLATE,
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, whole = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, whole
    events = sse(server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert streamed == (whole["choices"][0]["message"]["content"] or "")
    assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    server.wait_idle()


def _samples(server, headers=AUTH) -> dict:
    """/metrics as {(sample name, its labels as a sorted tuple): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = server.request("GET", "/metrics", headers=headers)
    assert status == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def test_metrics_count_requests_and_aborts_with_the_model_name(server):
    def finished(reason):
        key = ("hf_paged_request_success_total", (("finished_reason", reason), ("model_name", MODEL)))
        return _samples(server).get(key, 0.0)

    before = {r: finished(r) for r in ("length", "abort")}
    status, answer = server.request("POST", "/v1/completions", {"prompt": "hi", "n": 3, "max_tokens": 3})
    assert status == 200 and len(answer["choices"]) == 3
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
    body = {"prompt": "Keep going", "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=AUTH)
    resp = conn.getresponse()
    resp.readline()
    conn.close()  # the client leaves mid-stream
    server.wait_idle()
    deadline = time.monotonic() + TIMEOUT_S
    while finished("abort") == before["abort"]:
        assert time.monotonic() < deadline, "the abandoned stream was never counted"
        time.sleep(0.05)
    assert finished("abort") == before["abort"] + 1
    assert finished("length") == before["length"] + 1  # one request of three samples
    assert all(dict(labels).get("model_name") == MODEL for _, labels in _samples(server))


def test_metrics_under_vllm_names(tokenizer):
    with serving(tokenizer, metric_names="vllm") as server:
        status, _ = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={})
        assert status == 200
        names = {name for name, _ in _samples(server, headers={})}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):  # fmt: skip
        assert name in names, name
    assert not any(name.startswith("hf_paged_") for name in names)


CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "capital": {"type": "boolean"},
                   "size": {"enum": ["small", "large"]}, "tags": {"type": "array", "items": {"type": "boolean"},
                                                                   "maxItems": 3}},
    "required": ["name", "capital", "size", "tags"],
}  # fmt: skip


def _valid_city(text: str) -> dict:
    record = json.loads(text)
    assert set(record) == set(CITY["properties"]), record
    assert isinstance(record["name"], str) and len(record["name"]) <= 12 and isinstance(record["capital"], bool)
    assert record["size"] in ("small", "large") and all(isinstance(t, bool) for t in record["tags"])
    return record


def test_every_constraint_field_gives_output_that_parses(server):
    """A random-weight model knows nothing; the constraint alone makes every output valid."""
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the test extra installs it)")
    free = {"max_tokens": 160, "temperature": 1.0, "seed": 3}
    chat_json = (
        CHAT | free | {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}}
    )
    status, answer = server.request("POST", "/v1/chat/completions", chat_json | {"n": 3})
    assert status == 200, answer
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "stop", choice
        _valid_city(choice["message"]["content"])
    cases = [
        ({"guided_json": CITY}, _valid_city),
        ({"structured_outputs": {"json": CITY}}, _valid_city),
        # any object: a random model writes keys without end, so only its start is checked (the engine's tests
        # check that a finished one parses)
        ({"response_format": {"type": "json_object"}}, lambda text: text.startswith('{"')),
        ({"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
         lambda text: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text)),
        ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
        ({"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe"'}},
         lambda text: text in ("yes", "no", "maybe")),
    ]  # fmt: skip
    for extra, valid in cases:
        status, answer = server.request("POST", "/v1/completions", {"prompt": "Answer:", **free, **extra})
        assert status == 200, (extra, answer)
        text = answer["choices"][0]["text"]
        finished = answer["choices"][0]["finish_reason"] == "stop" or "response_format" in extra
        assert finished and valid(text), (extra, text)
    events = sse(server, "/v1/completions", {"prompt": "Answer:", **free, "guided_json": CITY})
    _valid_city("".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]))
    bad = [
        ({"guided_json": CITY, "guided_regex": "a+"}, "guided_regex"),
        ({"guided_regex": "[0-"}, None),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": CITY, "use_beam_search": True, "n": 2}, None),
    ]
    for extra, param in bad:
        status, answer = server.request("POST", "/v1/completions", {"prompt": "hi", **extra})
        assert status == 400, (extra, answer)
        if param is not None:
            assert answer["error"]["param"] == param, (extra, answer)
    server.wait_idle()


def test_the_openai_client_parses_structured_output_and_round_trips_tool_calls(server):
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the test extra installs it)")
    from typing import Literal

    from pydantic import BaseModel

    class City(BaseModel):
        capital: bool
        size: Literal["small", "large"]

    client = openai_client(server)
    messages = [{"role": "user", "content": "Describe Paris."}]
    completion = client.chat.completions.parse(model=MODEL, messages=messages, response_format=City, max_tokens=60)
    assert isinstance(completion.choices[0].message.parsed, City)

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}  # fmt: skip
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}  # fmt: skip
    body = dict(model=MODEL, messages=messages, tools=[weather, clock], max_tokens=80, temperature=1.0, seed=1,
                extra_body={"chat_template": TEMPLATE})  # fmt: skip
    named = client.chat.completions.create(**body, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments)["utc"], bool)
    required = client.chat.completions.create(**body, tool_choice="required", parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    # the call and its answer go back as history: the template sees both
    history = messages + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
    again = client.chat.completions.create(**{**body, "messages": history}, tool_choice="none")
    assert again.choices[0].message.tool_calls is None
    streamed = client.chat.completions.create(**body, tool_choice="required", parallel_tool_calls=False, stream=True)
    calls = [tc for chunk in streamed for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert calls and all(tc.function.name in ("get_weather", "get_time") for tc in calls)
    server.wait_idle()
