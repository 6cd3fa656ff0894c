"""Accuracy of torchao weight quantization (``--quantization``) against the model's dtype, on the real default model.

Each quantization is loaded as the CLI loads it (``hf_paged.load_model(quantization=name)``: transformers'
``TorchAoConfig``) and compared with the unquantized model ("none"):

- greedy agreement: the engine answers PROMPTS (chat template, greedy, MAX_NEW_TOKENS tokens each, EOS ignored);
  "agreement" is the share of positions whose token equals the unquantized run's, "same prefix" the mean share of
  each answer before its first differing token (after a flip the continuations part, so agreement understates);
- log-likelihood: the per-token log-likelihood of TEXT (one forward, teacher forcing) against the unquantized
  model's: mean and max absolute difference, in nats, and the mean log-likelihood itself.

PROMPTS, TEXT and both measures are those of benchmarks/tools/fp8_kv_accuracy.py, so the two tables compare.
The CPU runs int8, int8-dynamic, int4 (torchao's int4 values kept one per int8 there) and float8; float8-dynamic
and the packed int4 kernel need CUDA.

    python benchmarks/tools/quant_accuracy.py [--quantizations int8 int4] [--device cpu] [--json out.json]
"""

import argparse
import json
import time

import torch
from accuracy_set import MAX_NEW_TOKENS, PROMPTS, TEXT, agreement  # benchmarks/tools/, first on sys.path for a script

CPU_QUANTIZATIONS = ("int8", "int8-dynamic", "int4", "float8")


def greedy_answers(model, tokenizer) -> list[list[int]]:
    """The engine's greedy answers to PROMPTS, MAX_NEW_TOKENS tokens each."""
    from hf_paged import ContinuousBatcher, SamplingParams

    engine = ContinuousBatcher(model, tokenizer, num_blocks=256, block_size=16)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs = engine.generate(chats, params, use_tqdm=False)
    engine.close()
    return [o.outputs[0].token_ids for o in outputs]


@torch.no_grad()
def token_log_likelihoods(model, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(token_i | tokens_<i) for i >= 1, float64.

    Args:
        input_ids: [1, num_tokens]

    Returns:
        [num_tokens - 1]
    """
    logits = model(input_ids).logits[0, :-1].double()  # [num_tokens - 1, vocab_size]
    return logits.log_softmax(-1).gather(-1, input_ids[0, 1:, None]).squeeze(-1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantizations", nargs="+", default=list(CPU_QUANTIZATIONS),
                        help="names of --quantization; default: %(default)s")  # fmt: skip
    parser.add_argument("--json", help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from hf_paged import load_model

    args = parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, device=args.device, dtype=dtype)
    text_ids = tokenizer(TEXT, return_tensors="pt")["input_ids"].to(model.device)
    reference_answers = greedy_answers(model, tokenizer)
    reference_ll = token_log_likelihoods(model, text_ids)
    del model
    print(f"model: {args.model or 'SmolLM2-135M-Instruct'}, {args.dtype} on {args.device}; {len(PROMPTS)} prompts x "
          f"{MAX_NEW_TOKENS} greedy tokens; log-likelihood over {reference_ll.numel()} tokens of a fixed text "
          f"(unquantized mean {reference_ll.mean():.4f} nats)\n")  # fmt: skip
    print("| quantization | greedy agreement | same prefix | mean abs dlogp (nats) | max abs dlogp | mean logp | s |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for name in args.quantizations:
        start = time.perf_counter()
        model, _ = load_model(args.model, device=args.device, dtype=dtype, quantization=name)
        equal, prefix = agreement(greedy_answers(model, tokenizer), reference_answers)
        log_likelihoods = token_log_likelihoods(model, text_ids)
        diff = (log_likelihoods - reference_ll).abs()
        seconds = time.perf_counter() - start
        del model
        row = dict(quantization=name, agreement=equal, same_prefix=prefix, mean_abs_dlogp=diff.mean().item(),
                   max_abs_dlogp=diff.max().item(), mean_logp=log_likelihoods.mean().item(),
                   seconds=seconds)  # fmt: skip
        results.append(row)
        print(f"| {name} | {equal:.1%} | {prefix:.1%} | {row['mean_abs_dlogp']:.4f} | {row['max_abs_dlogp']:.4f} | "
              f"{row['mean_logp']:.4f} | {seconds:.0f} |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, dtype=args.dtype, device=args.device, num_prompts=len(PROMPTS),
                           max_new_tokens=MAX_NEW_TOKENS, reference_mean_logp=reference_ll.mean().item(),
                           results=results), f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
