"""Accuracy of the FP8 KV cache against the model's dtype, on the real default model (CPU is enough).

For each ``kv_cache_dtype`` (fp8_e4m3, fp8_e5m2) against "auto" (the model's dtype):

- greedy agreement: the engine answers PROMPTS (chat template, greedy, MAX_NEW_TOKENS tokens each, EOS ignored);
  "agreement" is the share of positions whose token equals the "auto" run's, "same prefix" the mean share of each
  answer before its first differing token (after a flip the continuations part, so agreement understates);
- log-likelihood: TEXT is fed one token a step through a ``PagedCache`` (teacher forcing: every token's prediction
  attends to the cache's stored K/V, as decoding does), and the per-token log-likelihood is compared with the
  "auto" run's: mean and max absolute difference, in nats.

For scale, a last row (with ``--dtype float32``) measures the same against a change that is not the KV cache's:
the whole model in bfloat16 with an "auto" cache, against float32.

    python benchmarks/tools/fp8_kv_accuracy.py [--dtype float32] [--json out.json]
"""

import argparse
import copy
import inspect
import json
import time

import torch
from accuracy_set import MAX_NEW_TOKENS, PROMPTS, TEXT, agreement  # benchmarks/tools/, first on sys.path for a script

KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")


def greedy_answers(model, tokenizer, kv_cache_dtype: str) -> list[list[int]]:
    from hf_paged import ContinuousBatcher, SamplingParams

    engine = ContinuousBatcher(model, tokenizer, num_blocks=512, kv_cache_dtype=kv_cache_dtype)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(chats, params, use_tqdm=False)]


@torch.inference_mode()
def token_log_likelihoods(model, input_ids: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1, one token a forward through a PagedCache: [num_tokens - 1], fp32."""
    from hf_paged import PagedCache

    cache = PagedCache(model, num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    # transformers 5.2x's models take the cache as `cache`, later ones as `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    out = []
    for t in range(input_ids.shape[1] - 1):
        logits = model(input_ids=input_ids[:, t : t + 1], use_cache=True, **{name: cache}).logits[0, -1]
        out.append(torch.log_softmax(logits.float(), dim=-1)[input_ids[0, t + 1]])
    return torch.stack(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's dtype")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hf_paged import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(device=args.device, dtype=getattr(torch, args.dtype))
    start = time.perf_counter()
    reference = greedy_answers(model, tokenizer, "auto")
    text_ids = tokenizer(TEXT, return_tensors="pt")["input_ids"].to(model.device)
    reference_ll = token_log_likelihoods(model, text_ids, "auto")
    runs = [(kv_cache_dtype, model, kv_cache_dtype) for kv_cache_dtype in KV_CACHE_DTYPES]
    if args.dtype == "float32":
        runs.append(("auto, bfloat16 model", copy.deepcopy(model).to(torch.bfloat16), "auto"))
    rows = []
    for name, run_model, kv_cache_dtype in runs:
        tokens, prefix = agreement(greedy_answers(run_model, tokenizer, kv_cache_dtype), reference)
        diff = (token_log_likelihoods(run_model, text_ids, kv_cache_dtype) - reference_ll).abs()
        rows.append(dict(kv_cache_dtype=name, token_agreement=tokens, same_prefix=prefix,
                         ll_mean_abs_diff=diff.mean().item(), ll_max_abs_diff=diff.max().item()))  # fmt: skip
    print(f"model: SmolLM2-135M-Instruct, {args.dtype} on {args.device}; {len(PROMPTS)} prompts x {MAX_NEW_TOKENS} "
          f"greedy tokens; log-likelihood of a {text_ids.shape[1]}-token text, one token a step; "
          f"mean log-likelihood (auto) {reference_ll.mean().item():.3f} nats/token")  # fmt: skip
    print("| kv_cache_dtype | token agreement | same prefix | mean abs diff log-lik (nats) | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['token_agreement']:.1%} | {r['same_prefix']:.1%} | "
              f"{r['ll_mean_abs_diff']:.4f} | {r['ll_max_abs_diff']:.4f} |")  # fmt: skip
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model="SmolLM2-135M-Instruct", dtype=args.dtype, device=args.device,
                           num_prompts=len(PROMPTS), max_new_tokens=MAX_NEW_TOKENS,
                           text_tokens=int(text_ids.shape[1]), mean_log_likelihood_auto=reference_ll.mean().item(),
                           rows=rows), f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
