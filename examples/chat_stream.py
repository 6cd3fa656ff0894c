"""A streamed multi-turn chat with ContinuousBatcher.stream on the default model (SmolLM2-135M-Instruct).

Each turn sends the whole conversation so far (system prompt, earlier questions and answers, the new question)
and prints the answer token by token as the engine produces it. The conversation only grows, so every turn's
prompt starts with the previous one: the prefix cache serves those blocks and the engine computes only the new
tail. Each turn prints how many prompt tokens came from the cache.

Run: python examples/chat_stream.py               (three scripted turns)
     python examples/chat_stream.py --interactive  (type your own; an empty line ends)
"""

import argparse

from hf_paged import ContinuousBatcher, SamplingParams, load_model

SYSTEM = "You are a helpful gardening assistant. Keep every answer short."
SCRIPT = [
    "I want to grow tomatoes on my balcony. What do I need?",
    "How often should I water them?",
    "What can I plant next to them?",
]


def chat_turn(engine: ContinuousBatcher, history: list[dict], question: str, params: SamplingParams) -> str:
    """Stream one answer to stdout; append the question and the answer to ``history``; return the answer."""
    history.append({"role": "user", "content": question})
    stats = engine.pool.stats
    hits_before, queried_before = stats.num_prefix_hit_tokens, stats.num_prefix_query_tokens
    print("bot> ", end="", flush=True)
    answer = ""
    for delta in engine.stream(history, params):  # chat messages: the engine applies the chat template
        print(delta.text, end="", flush=True)
        answer += delta.text
    stats = engine.pool.stats
    hits = stats.num_prefix_hit_tokens - hits_before
    queried = stats.num_prefix_query_tokens - queried_before
    print(f"\n     [{hits}/{queried} prompt tokens from the prefix cache]")
    history.append({"role": "assistant", "content": answer.strip()})
    return answer


def ask() -> str:
    """The next question from the terminal; "" at an empty line or end of input."""
    try:
        return input("you> ").strip()
    except EOFError:
        return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--interactive", action="store_true", help="read the questions from the terminal")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    engine = ContinuousBatcher(model, tokenizer, num_blocks=256, block_size=16)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.7, top_p=0.9, seed=0)

    history = [{"role": "system", "content": SYSTEM}]
    if args.interactive:
        while question := ask():
            chat_turn(engine, history, question, params)
    else:
        for question in SCRIPT:
            print(f"you> {question}")
            chat_turn(engine, history, question, params)
    m = engine.metrics()
    print(f"chat: {len(history) // 2} turns, prefix hit rate {m.prefix_hit_rate:.1%} of {m.num_prompt_tokens} "
          f"prompt tokens, {m.generation_throughput:.1f} tok/s")  # fmt: skip


if __name__ == "__main__":
    main()
