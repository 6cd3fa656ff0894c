"""Structured outputs under ``model.generate`` with a PagedCache: ``GrammarLogitsProcessor`` keeps every row valid.

A tiny random Llama (logits 128 wide) and a one-character-per-token tokenizer of printable ASCII, as in
tests/engine/test_structured.py: the constraints describe finite languages, so every row ends within the budget.
"""

import json
import re

import pytest
import torch
from helpers import assert_cache_released
from models import ascii_tokenizer, cache_kwarg, tiny_model

from hf_paged import PagedCache, StructuredOutput
from hf_paged.engine.grammar_processor import GrammarLogitsProcessor

CACHE = cache_kwarg()
VOCAB = 128
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["id", "kind"],
}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model = tiny_model("llama", vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=0)
    return model, ascii_tokenizer(padding_side="left")


def _texts(model, tokenizer, spec, **kwargs) -> list[str]:
    inputs = tokenizer(["Record: ", "A longer prompt, left-padded: "], return_tensors="pt", padding=True)
    cache = PagedCache(model, num_blocks=64, block_size=8)
    processor = GrammarLogitsProcessor(spec, tokenizer, VOCAB)
    out = model.generate(**inputs, max_new_tokens=60, logits_processor=[processor], **{CACHE: cache}, **kwargs)
    assert_cache_released(cache)
    new = out[:, inputs["input_ids"].shape[1] :]
    assert (new == EOS).any(dim=1).all(), new  # every row ended on EOS, within the budget
    return tokenizer.batch_decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, num_return_sequences=2)],
                         ids=["greedy", "sampled-n2"])  # fmt: skip
def test_generate_with_paged_cache_follows_the_schema(model_and_tokenizer, sampling):
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    texts = _texts(model, tokenizer, StructuredOutput(json=SCHEMA), **sampling)
    assert len(texts) == 2 * sampling.get("num_return_sequences", 1)
    for text in texts:
        value = json.loads(text)
        assert set(value) == {"id", "kind"} and 0 <= value["id"] <= 999 and value["kind"] in ("cat", "dog"), text


def test_generate_regex_and_choice(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    for text in _texts(model, tokenizer, StructuredOutput(regex=r"[A-Z]{2}-\d{3}")):
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", text), text
    for text in _texts(model, tokenizer, StructuredOutput(choice=["left", "right"])):
        assert text in ("left", "right"), text


def test_processor_serves_one_call(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    processor = GrammarLogitsProcessor(StructuredOutput(choice=["a"]), tokenizer, VOCAB)
    scores = torch.zeros(1, VOCAB)
    processor(torch.tensor([[5, 6]]), scores)
    with pytest.raises(ValueError, match="one generate\\(\\) call of a fixed batch"):
        processor(torch.tensor([[5, 6, 7], [5, 6, 7]]), scores)
    with pytest.raises(ValueError, match="`structured_output.regex` is invalid"):
        GrammarLogitsProcessor(StructuredOutput(regex="("), tokenizer, VOCAB)
