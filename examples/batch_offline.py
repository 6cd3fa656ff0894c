"""Offline batch inference with ContinuousBatcher on the default model (the embedded SmolLM2-135M-Instruct).

Eight chat prompts share one system prompt: the engine computes its blocks once and serves the other prompts
from the prefix cache. A progress bar counts finished requests; at the end the answers and the engine's metrics
(throughput, KV blocks, prefix hit rate, preemptions) are printed.

Run: python examples/batch_offline.py  (add --model PATH for another model; ~10 s on a laptop CPU)
"""

import argparse

from hf_paged import ContinuousBatcher, SamplingParams, load_model

SYSTEM = (
    "You are a helpful assistant for a school quiz. Answer every question in one short, factual sentence. "
    "If you are not sure of the answer, say so instead of guessing."
)
QUESTIONS = [
    "What is the capital of France?",
    "What is the largest planet in the solar system?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water at sea level?",
    "How many continents are there?",
    "What gas do plants take in from the air?",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)

    # 256 blocks x 16 tokens hold every request at once; the default sizes the pool from free memory.
    engine = ContinuousBatcher(model, tokenizer, num_blocks=256, block_size=16)
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)  # greedy
    outputs = engine.generate(prompts, params)  # a tqdm bar of finished requests

    for question, output in zip(QUESTIONS, outputs, strict=True):
        completion = output.outputs[0]
        cached = f"{output.num_cached_tokens}/{len(output.prompt_token_ids)} prompt tokens from the prefix cache"
        print(f"Q: {question}\nA: {completion.text.strip()}  [{completion.finish_reason}, {cached}]")

    m = engine.metrics()
    print(
        f"engine: {len(outputs)} requests, {m.num_steps} steps, {m.num_generated_tokens} generated tokens, "
        f"{m.generation_throughput:.1f} tok/s; prefix hit rate {m.prefix_hit_rate:.1%} of {m.num_prompt_tokens} "
        f"prompt tokens; {m.num_computed_tokens} tokens through the model; preemptions {m.num_preemptions}; "
        f"KV blocks in use after the batch {m.num_used_blocks}/{m.num_blocks}"
    )


if __name__ == "__main__":
    main()
