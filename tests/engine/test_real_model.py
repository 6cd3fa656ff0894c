"""The engine on a real model: greedy ContinuousBatcher output equals model.generate with DynamicCache.

The default model (SmolLM2-135M-Instruct, fp32 on the CPU) answers four chat prompts: together in the engine
(a small token budget, so chunked prefills share steps with decodes; prefix hits on the shared chat preamble),
and each alone through transformers' ``generate`` with its default DynamicCache and SDPA. Token ids must be
equal.
"""

import torch
from helpers import needs_smollm2
from transformers import DynamicCache

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.frontends import models

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "How do I boil an egg?",
    "List three colours of the rainbow.",
]
MAX_NEW_TOKENS = 16


@needs_smollm2
def test_greedy_engine_equals_generate_with_dynamic_cache():
    model, tokenizer = models.load_model(device="cpu", dtype=torch.float32, attn_implementation="sdpa")
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    expected = []
    for input_ids in prompts:  # one at a time: no padding in the reference
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
            return_dict_in_generate=True,
        )  # fmt: skip
        assert isinstance(out.past_key_values, DynamicCache)  # transformers' default cache
        expected.append(out.sequences[0, input_ids.shape[1] :].tolist())

    # A 40-token budget splits the ~35-token prompts into chunks that share steps with other rows' decodes.
    engine = ContinuousBatcher(model, tokenizer, num_blocks=64, block_size=16, max_num_batched_tokens=40)
    outputs = engine.generate(
        [p[0].tolist() for p in prompts],
        SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0),
        use_tqdm=False,
    )
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected
    assert "Paris" in outputs[0].outputs[0].text
    assert sum(o.num_cached_tokens for o in outputs) > 0  # the chat preamble came from the prefix cache
    metrics = engine.metrics()
    assert metrics.num_steps > MAX_NEW_TOKENS  # the prompts were admitted over several steps
