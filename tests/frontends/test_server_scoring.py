"""The server's prompt log-probs (vLLM's ``prompt_logprobs``) and ``POST /reset_prefix_cache``.

What can go wrong: prompt log-probs in the wrong place of the body or of the wrong prompt (a batch of prompts with
``n`` choices each), token ids that do not survive JSON (keys must be strings, -inf is not JSON), a field accepted
with ``stream: true`` and dropped, a reset endpoint that answers without the key, does not empty the cache, or
breaks requests in flight.
"""

import math
import threading
import time

import pytest
import torch
from helpers import needs_serve, needs_smollm2
from models import DEVICE, tiny_model
from server_harness import CONTEXT, KEY, serving

from hf_paged.engine.request import Logprob
from hf_paged.frontends.openai_api import prompt_logprobs_json

pytestmark = [needs_serve, needs_smollm2]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def server(tokenizer):
    with serving(tokenizer, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def forward(tokenizer):
    """log_softmax of a transformers forward of the server's model (same seed, so the same weights) over a prompt."""
    model = tiny_model("llama", attn="sdpa", device=DEVICE, vocab_size=len(tokenizer), num_hidden_layers=1,
                       max_position_embeddings=CONTEXT)  # fmt: skip

    def logprobs(token_ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids], device=DEVICE)).logits[0].float(), -1).cpu()

    return logprobs


def _check(entries, token_ids, k, forward, tokenizer):
    """vLLM's JSON of the prompt log-probs of ``token_ids`` with ``k`` alternatives, as the forward gives them."""
    assert len(entries) == len(token_ids) and entries[0] is None
    ref = forward(token_ids)
    for idx in range(1, len(token_ids)):
        row, entry = ref[idx - 1], entries[idx]
        alternatives = row.topk(k).indices.tolist()
        assert list(entry)[0] == str(token_ids[idx])  # the prompt token first, ids as strings
        assert set(entry) == {str(t) for t in [token_ids[idx], *alternatives]}
        for key, value in entry.items():
            token_id = int(key)
            assert value["logprob"] == pytest.approx(row[token_id].item(), abs=1e-4)
            assert value["rank"] == int((row > row[token_id]).sum()) + 1
            assert value["decoded_token"] == tokenizer.decode([token_id])


def test_completions_give_each_choice_its_prompts_log_probs(server, tokenizer, forward):
    prompts = ["The capital of France is", "One two three four five six"]
    body = {"prompt": prompts, "max_tokens": 3, "n": 2, "prompt_logprobs": 2, "temperature": 0.0}
    status, answer = server.request("POST", "/v1/completions", body)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    for choice in answer["choices"]:
        token_ids = tokenizer(prompts[choice["index"] // 2])["input_ids"]
        _check(choice["prompt_logprobs"], token_ids, 2, forward, tokenizer)
    status, answer = server.request("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 2})
    assert status == 200 and answer["choices"][0]["prompt_logprobs"] is None  # not asked: null, as vLLM
    server.wait_idle()


def test_chat_gives_its_prompts_log_probs_at_the_top(server, tokenizer, forward):
    messages = [{"role": "user", "content": "Name a colour."}]
    body = {"messages": messages, "max_tokens": 3, "prompt_logprobs": 0}
    status, answer = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, answer
    token_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    token_ids = token_ids["input_ids"] if hasattr(token_ids, "keys") else token_ids
    assert answer["usage"]["prompt_tokens"] == len(token_ids)
    _check(answer["prompt_logprobs"], list(token_ids), 0, forward, tokenizer)
    assert "prompt_logprobs" not in answer["choices"][0]
    status, answer = server.request("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 200 and answer["prompt_logprobs"] is None
    server.wait_idle()


@pytest.mark.parametrize(
    "path, base",
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_what_prompt_logprobs_cannot_do_is_a_400_naming_it(server, path, base):
    for extra in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 0, "stream": True},
                  {"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": "all"}):  # fmt: skip
        status, answer = server.request("POST", path, base | {"max_tokens": 2} | extra)
        assert status == 400 and answer["error"]["param"] == "prompt_logprobs", (extra, answer)
        assert "`prompt_logprobs`" in answer["error"]["message"]
    server.wait_idle()


def test_log_probs_of_minus_infinity_become_vllms_floor():
    entries = [None, {7: Logprob(-math.inf, 96, "x"), 3: Logprob(-0.5, 1, "y")}]
    assert prompt_logprobs_json(entries) == [
        None,
        {
            "7": {"logprob": -9999.0, "rank": 96, "decoded_token": "x"},
            "3": {"logprob": -0.5, "rank": 1, "decoded_token": "y"},
        },
    ]
    assert prompt_logprobs_json(None) is None


def test_reset_prefix_cache_needs_the_key_empties_the_cache_and_spares_requests_in_flight(server):
    prompt = "A prompt long enough for several full blocks of sixteen tokens, " * 3
    body = {"prompt": prompt, "max_tokens": 2}

    def cached_tokens():
        status, answer = server.request("POST", "/v1/completions", body)
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached_tokens()
    assert cached_tokens() > 0
    assert server.request("POST", "/reset_prefix_cache", headers={})[0] == 401
    assert server.request("POST", "/reset_prefix_cache") == (200, "")
    assert cached_tokens() == 0
    # while a request runs: it keeps its blocks and ends as it would have
    long = {"prompt": prompt, "max_tokens": 120, "ignore_eos": True, "temperature": 0.0}
    results = []
    thread = threading.Thread(target=lambda: results.append(server.request("POST", "/v1/completions", long)))
    thread.start()
    while not server.engine.num_unfinished and thread.is_alive():
        time.sleep(0.005)
    assert server.request("POST", "/reset_prefix_cache") == (200, "")
    thread.join()
    status, answer = results[0]
    assert status == 200 and answer["usage"]["completion_tokens"] == 120
    _, again = server.request("POST", "/v1/completions", long)
    assert again["choices"][0]["text"] == answer["choices"][0]["text"]
    server.wait_idle()
