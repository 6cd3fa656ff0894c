"""Structured outputs with a real byte-level BPE vocabulary: the default model's tokenizer (SmolLM2, 49 152 tokens)
over a tiny random Llama of that vocabulary.

Its tokens span several characters, open a string and close it in one token, carry a leading space or a quote: the
grammar must allow exactly the tokens whose bytes continue a valid output. Random weights pick any of them.
"""

import json
import re

import pytest
from helpers import assert_engine_drained
from models import DEVICE, tiny_model

from hf_paged import ContinuousBatcher, SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}


@pytest.fixture(scope="module")
def engine_parts(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = tiny_model("llama", device=DEVICE, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return model, tokenizer


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_outputs_parse_with_a_bpe_vocabulary(engine_parts, async_scheduling):
    model, tokenizer = engine_parts
    engine = ContinuousBatcher(model, tokenizer, num_blocks=64, block_size=16, async_scheduling=async_scheduling)
    specs = [
        StructuredOutput(json=SCHEMA),
        StructuredOutput(regex=r"\d{4}-\d{2}-\d{2}"),
        StructuredOutput(choice=["red alert", "all clear", "stand by"]),
    ]
    params = [SamplingParams(max_new_tokens=96, temperature=t, seed=3, n=n, structured_output=spec)
              for spec in specs for t, n in ((0.0, 1), (1.0, 2))]  # fmt: skip
    outs = engine.generate(["Reply in the format asked."] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop" and c.token_ids[-1] == tokenizer.eos_token_id, c
            spec = p.structured_output
            if spec.json is not None:
                value = json.loads(c.text)
                assert set(value) == {"name", "age", "tags"} and len(value["name"]) <= 12, c.text
                assert 0 <= value["age"] <= 120 and set(value["tags"]) <= {"red", "green", "blue"}, c.text
            elif spec.regex is not None:
                assert re.fullmatch(spec.regex, c.text), c.text
            else:
                assert c.text in spec.choice, c.text
    assert_engine_drained(engine)
