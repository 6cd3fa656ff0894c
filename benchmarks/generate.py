"""model.generate with PagedCache + "paged" vs DynamicCache + "sdpa", on a random-weight model (GPU).

Llama-3.1-8B shape by default (32 layers, hidden 4096, 32/8 heads, intermediate 14336, vocab 128256),
bf16, random weights (like `vllm bench --load-format dummy`), random prompt ids, EOS ignored.

- greedy: batch 32, prompt 512, 256 new tokens: wall time and peak memory;
- beam search width 4: peak memory, and the KV memory at the end of generation.

The PagedCache pool is sized to what the workload needs (its high-water mark in a first run), as a
server sizes its pool; both caches' peak memory is measured from the same baseline (weights loaded).

Run: python benchmarks/generate.py [--quick] [--out results.md]
"""

import argparse
import datetime
import math
import time

import torch
import transformers
from transformers import DynamicCache

import hf_paged
from hf_paged import PagedCache
from hf_paged.frontends.bench import SHAPES, build_model


def run(model, make_cache, attn: str, prompts: torch.Tensor, new_tokens: int, **kwargs):
    """Wall seconds, peak allocated and peak reserved bytes above the call's start, the output, the cache.

    The cache is built inside the measured region, so a preallocated pool counts in full.
    """
    model.set_attn_implementation(attn)
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    start = time.perf_counter()
    cache = make_cache()
    out = model.generate(
        input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, past_key_values=cache, **kwargs,
    )  # fmt: skip
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base
    reserved = torch.cuda.max_memory_reserved() - base_reserved
    return elapsed, peak, reserved, out, cache


def paged_cache(model, num_blocks: int):
    return lambda: PagedCache(model, num_blocks=num_blocks, block_size=16)


def dynamic_cache(model):
    return lambda: DynamicCache(config=model.config)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--beam-batch", type=int, default=8)
    parser.add_argument("--beam-new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="tiny model, short outputs")
    parser.add_argument("--out", help="also append the markdown table to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/generate.py needs a CUDA GPU")
    if args.quick:
        args.shape, args.new_tokens, args.beam_new_tokens = "tiny", 32, 32
    torch.manual_seed(0)
    model = build_model(args.shape)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.prompt), device="cuda")
    beam_prompts = torch.randint(3, vocab, (args.beam_batch, args.prompt), device="cuda")
    total = args.prompt + args.new_tokens
    num_blocks = args.batch * math.ceil(total / 16) + args.batch

    # Warm-up (CUDA context, Triton compilation, cuBLAS handles) on both paths.
    run(model, dynamic_cache(model), "sdpa", prompts[:2, :64], 4)
    run(model, paged_cache(model, 64), "paged", prompts[:2, :64], 4)

    rows = []
    t_dyn, m_dyn, r_dyn, out_dyn, _ = run(model, dynamic_cache(model), "sdpa", prompts, args.new_tokens)
    t_pag, m_pag, r_pag, out_pag, _ = run(model, paged_cache(model, num_blocks), "paged", prompts, args.new_tokens)
    same = (out_dyn == out_pag).float().mean().item()
    tok = args.batch * args.new_tokens
    kv_bytes = PagedCache(model, num_blocks=1).kv_bytes_per_block
    rows.append(("greedy", "DynamicCache + sdpa", t_dyn, tok / t_dyn, m_dyn, r_dyn, ""))
    rows.append(("greedy", "PagedCache + paged", t_pag, tok / t_pag, m_pag, r_pag,
                 f"pool {num_blocks} blocks = {num_blocks * kv_bytes / 2**30:.2f} GiB, preallocated; "
                 f"{same:.1%} tokens equal to DynamicCache (bf16, random weights: near-ties)"))  # fmt: skip

    # Beam search: measure the paged high-water mark, then size the pool to it.
    beam = dict(num_beams=4)
    big_blocks = args.beam_batch * 4 * math.ceil((args.prompt + args.beam_new_tokens) / 16) + 64
    *_, big = run(model, paged_cache(model, big_blocks), "paged", beam_prompts, args.beam_new_tokens, **beam)
    peak_blocks = big.peak_used_blocks
    end_report = big.memory_report()
    del big
    t_bd, m_bd, r_bd, out_bd, dyn_cache = run(model, dynamic_cache(model), "sdpa", beam_prompts, args.beam_new_tokens,
                                              **beam)  # fmt: skip
    dyn_kv = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in dyn_cache.layers)
    del dyn_cache
    t_bp, m_bp, r_bp, out_bp, _ = run(model, paged_cache(model, peak_blocks), "paged", beam_prompts,
                                      args.beam_new_tokens, **beam)  # fmt: skip
    paged_kv = end_report.used_bytes
    beam_tok = args.beam_batch * args.beam_new_tokens
    rows.append(("beam 4", "DynamicCache + sdpa", t_bd, beam_tok / t_bd, m_bd, r_bd,
                 f"KV at end {dyn_kv / 2**30:.2f} GiB"))  # fmt: skip
    rows.append(("beam 4", "PagedCache + paged", t_bp, beam_tok / t_bp, m_bp, r_bp,
                 f"pool {peak_blocks} blocks = peak use ({peak_blocks * kv_bytes / 2**30:.2f} GiB); KV at end "
                 f"{paged_kv / 2**30:.2f} GiB ({1 - paged_kv / dyn_kv:.0%} less); {end_report}"))  # fmt: skip

    head = (
        f"### generate: {args.shape}, bf16, random weights — {torch.cuda.get_device_name()}, "
        f"{datetime.date.today()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"hf_paged {hf_paged.__version__}\n\n"
        f"`python benchmarks/generate.py` — greedy: batch {args.batch}, prompt {args.prompt}, "
        f"{args.new_tokens} new tokens; beam: batch {args.beam_batch} x 4 beams, prompt {args.prompt}, "
        f"{args.beam_new_tokens} new tokens\n\n"
        "| workload | cache + attention | time (s) | output tok/s | peak allocated above weights (GiB) "
        "| peak reserved above start (GiB) | notes |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    table = head + "".join(
        f"| {w} | {name} | {t:.2f} | {tps:.0f} | {m / 2**30:.2f} | {r / 2**30:.2f} | {note} |\n"
        for w, name, t, tps, m, r, note in rows
    )
    table += (
        f"\ngreedy: paged time / dynamic time = {t_pag / t_dyn:.3f}; peak memory ratio {m_pag / m_dyn:.3f}. "
        f"beam: peak memory ratio {m_bp / m_bd:.3f}; beam outputs equal: "
        f"{(out_bd == out_bp).float().mean().item():.1%} of tokens\n"
    )
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
