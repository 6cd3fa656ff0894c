"""Generate with PagedCache and attn_implementation="paged" on a tiny random Llama (no download).

Shows greedy decoding, beam search with its memory report, and a system prompt reused across calls.
Run: python examples/generate_paged.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_paged  # noqa: F401  (registers attn_implementation="paged")
from hf_paged import PagedCache


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM(config).to(device).eval()
    model.set_attn_implementation("paged")

    cache = PagedCache(model, num_blocks=512, block_size=16)
    prompts = torch.randint(3, 1000, (4, 40), device=device)
    out = model.generate(input_ids=prompts, max_new_tokens=32, do_sample=False, past_key_values=cache)
    print(f"greedy: {tuple(out.shape)} tokens; {cache.memory_report()}")

    cache.reset()
    out = model.generate(
        input_ids=prompts[:1], max_new_tokens=32, min_new_tokens=32, num_beams=4, do_sample=False,
        past_key_values=cache,
    )  # fmt: skip
    print(f"beam search, width 4: {cache.memory_report()}")

    # A system prompt reused across calls: prepare() attaches its cached blocks, generate runs only the rest.
    system = torch.randint(3, 1000, (1, 64), device=device)
    for turn in range(3):
        question = torch.randint(3, 1000, (1, 8), device=device)
        ids = torch.cat([system, question], dim=1)
        model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, past_key_values=cache.prepare(ids))
        stats = cache.pool.stats
        print(f"turn {turn}: prefix hits {stats.num_prefix_hit_tokens}/{stats.num_prefix_query_tokens} prompt tokens")


if __name__ == "__main__":
    main()
