"""model.generate with PagedCache on the default model (the embedded SmolLM2-135M-Instruct).

Three uses of one cache:

1. greedy decoding of a padded batch of chat prompts;
2. beam search, whose beams share the prompt's blocks (see the memory report);
3. one system prompt reused across calls: ``cache.prepare()`` attaches its cached blocks, so each call
   computes only the new question.

Run: python examples/generate_paged.py  (add --model PATH for another model; ~10 s on a laptop CPU)
"""

import argparse

import torch

from hf_paged import PagedCache, load_model

SYSTEM = (
    "You are a concise assistant for a museum. Visitors ask short questions about art, history and science. "
    "Answer in one sentence, with facts only, and never invent names or dates that you are not sure about."
)


def chat_inputs(tokenizer, questions: list[str], system: str | None = None, device: str = "cpu") -> dict:
    """Chat-formatted, left-padded ``input_ids`` and ``attention_mask`` for a batch of questions."""
    conversations = [
        ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        for q in questions
    ]
    inputs = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    return {k: v.to(device) for k, v in inputs.items()}


def answers(tokenizer, inputs: dict, output: torch.Tensor) -> list[str]:
    new_tokens = output[:, inputs["input_ids"].shape[1] :]
    return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)  # attn_implementation="paged": the kernels read the blocks
    device = str(model.device)
    cache = PagedCache(model, num_blocks=256, block_size=16)  # 256 x 16 token slots

    # 1. Greedy, a padded batch: padding takes no slot in the pool.
    questions = ["What is the capital of France?", "How many legs does a spider have?"]
    inputs = chat_inputs(tokenizer, questions, device=device)
    output = model.generate(**inputs, past_key_values=cache, max_new_tokens=16, do_sample=False)
    for question, answer in zip(questions, answers(tokenizer, inputs, output), strict=True):
        print(f"greedy: {question} -> {answer}")
    print(f"greedy: {cache.memory_report()}")

    # 2. Beam search: the 4 beams fork the prompt's blocks; a shared block is copied only when written.
    cache.reset()
    inputs = chat_inputs(tokenizer, ["Name a famous painting."], device=device)
    output = model.generate(
        **inputs, past_key_values=cache, max_new_tokens=12, num_beams=4, num_return_sequences=2, do_sample=False
    )
    for i, answer in enumerate(answers(tokenizer, inputs, output)):
        print(f"beam search, hypothesis {i}: {answer}")
    print(f"beam search, width 4: {cache.memory_report()}")

    # 3. A system prompt reused across calls: each call computes only the blocks after the cached prefix.
    for question in ["Who painted the Mona Lisa?", "What is a fossil?", "When did the Bronze Age begin?"]:
        inputs = chat_inputs(tokenizer, [question], system=SYSTEM, device=device)
        before = cache.pool.stats
        output = model.generate(**inputs, past_key_values=cache.prepare(**inputs), max_new_tokens=16, do_sample=False)
        stats = cache.pool.stats
        hits = stats.num_prefix_hit_tokens - before.num_prefix_hit_tokens
        looked_up = stats.num_prefix_query_tokens - before.num_prefix_query_tokens
        print(f"system prompt: {question} -> {answers(tokenizer, inputs, output)[0]}")
        print(f"  prefix cache: {hits}/{looked_up} prompt tokens served from cached blocks")


if __name__ == "__main__":
    main()
