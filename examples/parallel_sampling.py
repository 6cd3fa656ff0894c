"""Parallel sampling (n > 1) with ContinuousBatcher on the default model (SmolLM2-135M-Instruct).

One request asks for 4 samples of one prompt. The engine computes the prompt once; the 4 samples then fork its
blocks (ref count + 1 each) instead of storing 4 copies. A block is copied only when a sample writes into a shared
one, which happens only for the prompt's last, partial block (copy-on-write). The block tables a few steps in
show it: every sample starts with the same full prompt blocks, then owns its own.

Run: python examples/parallel_sampling.py  (add --model PATH for another model; ~10 s on a laptop CPU)
"""

import argparse

from hf_paged import ContinuousBatcher, SamplingParams, load_model

PROMPT = [
    {"role": "system", "content": "You are a creative writer who writes short, vivid lines about nature."},
    {"role": "user", "content": "Write one sentence about the sea at night."},
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--n", type=int, default=4)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    engine = ContinuousBatcher(model, tokenizer, num_blocks=128, block_size=16)
    params = SamplingParams(n=args.n, temperature=0.8, top_p=0.95, seed=0, max_new_tokens=32)

    request_id = engine.add_request(PROMPT, params)
    request = engine.requests[request_id]
    num_prompt_tokens = len(request.prompt_token_ids)
    pool = engine.pool
    for _ in range(3):  # the prompt's forward samples the first tokens and forks; two decode steps follow
        engine.step()
    print(f"prompt: {num_prompt_tokens} tokens = {-(-num_prompt_tokens // pool.block_size)} blocks of "
          f"{pool.block_size}; {len(request.seqs)} samples, block tables after 3 steps:")  # fmt: skip
    for i, seq in enumerate(request.seqs):
        table = pool.get_block_table(seq.seq_id)
        refs = [pool.ref_count(block_id) for block_id in table]
        print(f"  sample {i}: blocks {table}  ref counts {refs}")
    stats = pool.stats
    print(f"pool: {stats.num_used_blocks} blocks in use for {stats.num_table_entries} block-table entries "
          f"(sharing saves {stats.sharing_savings:.0%})")  # fmt: skip

    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.finished]
    (output,) = outputs
    for completion in output.outputs:
        print(f"sample {completion.index}: {completion.text.strip()!r} ({completion.finish_reason})")
    m = engine.metrics()
    print(f"engine: {m.num_generated_tokens} tokens generated in {m.num_steps} steps; "
          f"{m.num_computed_tokens} tokens through the model for a {num_prompt_tokens}-token prompt x {args.n} "
          f"samples (the prompt once)")  # fmt: skip


if __name__ == "__main__":
    main()
