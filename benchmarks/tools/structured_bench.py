"""Structured outputs' cost in the engine: a batch of JSON-schema requests beside the same batch unconstrained.

One engine (random bf16 weights in a benchmark shape, a real tokenizer for the grammar), then, in turn:

1. constrained: ``--num-requests`` requests at once, each with the same JSON schema (``SCHEMA``: an object of
   strings, an enum, a boolean, an integer and a short array), sampled (temperature 1), ending when the JSON is
   complete or at ``--max-new-tokens``; every output must parse and fit the schema;
2. unconstrained: the same prompts, each asked for exactly as many tokens as its constrained run produced (EOS
   ignored), so both runs generate the same tokens;
3. new schemas while the batch runs: ``--new-schemas`` requests, each with a schema never seen before (compiled on
   arrival), sent one at a time into a running constrained batch; their time to first token, whose p99 is the
   cost of a schema's compilation as a client sees it.

Prints a table of output tok/s (median of ``--repeats``), the ratio constrained / unconstrained, and the TTFT
percentiles; ``--json`` writes a record (card, date, versions, commit, command, figures).

    python benchmarks/tools/structured_bench.py [--model qwen3-0.6b] [--num-requests 256] [--tokenizer DIR]

``--tokenizer``: a tokenizer folder (default: the embedded SmolLM2-135M-Instruct's, converted once). Its vocabulary
may be smaller than the model's: the mask forbids the ids it does not have. ``--device cpu --model tiny`` is a
smoke run.
"""

import argparse
import json
import statistics
import sys
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "city": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["person", "company", "place"]},
        "active": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "city", "kind", "active", "score", "tags"],
}


def valid(text: str, schema: dict = SCHEMA) -> bool:
    """Whether ``text`` is JSON that fits ``schema`` (the subset of JSON Schema that SCHEMA uses)."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return False
    return _fits(record, schema)


def _fits(value, schema: dict) -> bool:
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", [])) <= set(value) <= set(props)
                and all(_fits(v, props[k]) for k, v in value.items()))  # fmt: skip
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(_fits(v, schema["items"]) for v in value))  # fmt: skip
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))  # fmt: skip
    return True


def new_schema(i: int) -> dict:
    """A schema no earlier request used (its property names differ): compiled when it arrives."""
    return {"type": "object", "properties": {f"field_{i}_{j}": {"type": "boolean"} for j in range(4)},
            "required": [f"field_{i}_{j}" for j in range(4)]}  # fmt: skip


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(engine, prompts, constrained, device: str, repeats: int, profile: bool = False) -> dict:
    """Median output tok/s of the constrained batch and of the same batch unconstrained, same token counts; with
    ``profile``, the host's time by function of one more constrained and unconstrained run each (cProfile; not in
    the figures)."""
    from hf_paged import SamplingParams

    figures = {"constrained": [], "unconstrained": []}
    lengths, num_invalid = None, 0
    # One unmeasured round first: the first full batch compiles kernels the 2-request warm-up did not reach (the mask
    # kernel over a partial batch, the sampler's): a first measured constrained run was 14-26% slower (H200).
    for repeat in range(-1, repeats):
        engine.reset_prefix_cache()
        _sync(device)
        start = time.perf_counter()
        outs = engine.generate(prompts, constrained, use_tqdm=False)
        _sync(device)
        seconds = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        num_invalid += sum(not valid(o.outputs[0].text) for o in outs if o.outputs[0].finish_reason == "stop")
        if repeat >= 0:
            figures["constrained"].append(sum(lengths) / seconds)
        free = [SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True) for n in lengths]
        engine.reset_prefix_cache()
        _sync(device)
        start = time.perf_counter()
        outs = engine.generate(prompts, free, use_tqdm=False)
        _sync(device)
        seconds = time.perf_counter() - start
        if repeat >= 0:
            figures["unconstrained"].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    if profile:
        import cProfile
        import pstats

        for name, params in (("constrained", constrained), ("unconstrained", free)):
            engine.reset_prefix_cache()
            with cProfile.Profile() as profiler:
                engine.generate(prompts, params, use_tqdm=False)
                _sync(device)
            # cProfile counts the mask worker thread's calls too; its cumulative times mix the two threads' stacks
            print(f"--- {name} run: the host's time by function")
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumtime").print_stats("hf_paged|synchronize|result|acquire", 30)
    return dict(constrained_tok_s=statistics.median(figures["constrained"]),
                unconstrained_tok_s=statistics.median(figures["unconstrained"]),
                mean_output_tokens=sum(lengths) / len(lengths), num_invalid=num_invalid,
                runs=figures)  # fmt: skip


def new_schema_ttft(engine, prompts, constrained, num_new: int, max_new_tokens: int) -> list[float]:
    """Time to first token of requests with never-seen schemas, each sent while a constrained batch runs."""
    from hf_paged import SamplingParams, StructuredOutput

    ttfts = []
    background = len(prompts) // 2
    for i in range(num_new):
        for prompt, params in zip(prompts[:background], constrained[:background], strict=True):
            engine.add_request(prompt, params)
        for _ in range(3):  # the batch is running
            engine.step()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                                structured_output=StructuredOutput(json=new_schema(i)))  # fmt: skip
        sent = time.perf_counter()
        rid = engine.add_request(prompts[-1], params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.request_id == rid and out.outputs[0].token_ids:
                    first = time.perf_counter() - sent
        ttfts.append(first)
    return ttfts


def main(argv: list[str] | None = None) -> int:
    from hf_paged import ContinuousBatcher, EngineConfig, SamplingParams, StructuredOutput
    from hf_paged.frontends import models
    from hf_paged.frontends.bench_record import make_record, write_record
    from hf_paged.frontends.bench_workloads import SHAPES, build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--tokenizer", help="tokenizer folder; default: the embedded SmolLM2's")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-schemas", type=int, default=20)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--profile", action="store_true",
                        help="print the host's time by function of a constrained run and an unconstrained one")
    parser.add_argument("--json", help="write the figures as a JSON record to this file")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    folder = args.tokenizer or str(models.convert_gguf(models.default_model_path()))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = build_model(args.model, device=args.device)
    gen = torch.Generator().manual_seed(0)
    usable = min(len(tokenizer), model.config.vocab_size)
    prompts = [torch.randint(3, usable, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_requests)]
    # Unseeded, as the unconstrained run: a seeded row draws from a generator of its own (a launch a row), which
    # would be measured as the grammars' cost.
    constrained = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0,
                                  structured_output=StructuredOutput(json=SCHEMA))
                   for _ in range(args.num_requests)]  # fmt: skip
    start = time.perf_counter()
    engine = ContinuousBatcher(model, tokenizer, EngineConfig(max_num_seqs=max(args.num_requests, 1)))
    engine.generate(prompts[:2], constrained[:2], use_tqdm=False)  # compile, graphs, the schema's grammar
    startup = time.perf_counter() - start
    figures = measure(engine, prompts, constrained, args.device, args.repeats, args.profile)
    ttfts = sorted(new_schema_ttft(engine, prompts, constrained, args.new_schemas, 16))
    ratio = figures["constrained_tok_s"] / figures["unconstrained_tok_s"]
    p50, p99 = ttfts[len(ttfts) // 2], ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    print(f"{args.model}, {args.num_requests} requests, prompt {args.prompt_len}, "
          f"{figures['mean_output_tokens']:.0f} output tokens on average, {args.device}")  # fmt: skip
    print("| run | output tok/s (median) | constrained / unconstrained | invalid outputs |")
    print("|---|---:|---:|---:|")
    print(f"| JSON schema | {figures['constrained_tok_s']:.0f} | {ratio:.2f} | {figures['num_invalid']} |")
    print(f"| unconstrained, same tokens | {figures['unconstrained_tok_s']:.0f} | | |")
    print(f"new schema while the batch runs: TTFT p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms "
          f"({len(ttfts)} schemas); start-up {startup:.1f} s")  # fmt: skip
    if args.json:
        card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        command = " ".join(["python benchmarks/tools/structured_bench.py", *(sys.argv[1:] if argv is None else argv)])
        workload = dict(model=args.model, num_requests=args.num_requests, prompt_len=args.prompt_len,
                        max_new_tokens=args.max_new_tokens, schema=SCHEMA)  # fmt: skip
        write_record(args.json, make_record(card, command, workload, **figures, ratio=ratio,
                                            new_schema_ttft_s=ttfts, startup_s=startup))  # fmt: skip
    engine.close()
    return 1 if figures["num_invalid"] else 0


if __name__ == "__main__":
    sys.exit(main())
