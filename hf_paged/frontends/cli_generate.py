"""``hf-paged generate``: answer prompts with the continuous-batching engine and print a summary of its metrics.

One prompt streams its tokens as they come; several show a progress bar; ``--json`` prints the outputs and metrics
as one JSON object. Each prompt gets the tokenizer's chat template (``--no-chat`` sends raw text; ``--system`` puts
one system prompt in front of every prompt, which prefix caching then computes once).
"""

import argparse
import json
import sys
import time
from dataclasses import dataclass

from hf_paged.frontends.cli_engine import UsageError, add_engine_args, load_model_quietly, make_engine

MAX_NEW_TOKENS = 256  # SamplingParams' default of 16 cuts most answers short
TEMPERATURE = 0.0  # greedy: small models (the default's 135M) ramble or switch language when sampled


def add_parser(commands) -> None:
    """Add the ``generate`` subcommand to the ``hf-paged`` subparsers ``commands``."""
    gen = commands.add_parser(
        "generate",
        help="generate answers with the continuous-batching engine",
        description="Generate answers with hf_paged's continuous-batching engine (default model: the embedded "
        "SmolLM2-135M-Instruct). One prompt streams; several show a progress bar.",
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (each gets the chat template)")
    gen.add_argument("--file", help="read prompts from this file, one per line ('-' = stdin); blank lines skipped")
    gen.add_argument("--model", help="embedded default 'smollm2', a model folder, a .gguf file or a cached hub id")
    gen.add_argument("--system", help="a system prompt in front of every prompt (its blocks are computed once)")
    gen.add_argument("--no-chat", action="store_true", help="send the prompts as raw text, without chat template")
    gen.add_argument("--json", action="store_true", help="print the outputs and metrics as one JSON object")

    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="default: %(default)s")
    sampling.add_argument(
        "--temperature",
        type=float,
        default=TEMPERATURE,
        help="0 = greedy (the default); --n samples differ only with a temperature > 0",
    )
    sampling.add_argument("--top-k", type=int, default=0, help="0 = off")
    sampling.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    sampling.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    sampling.add_argument("--seed", type=int, help="seed each request's sampling")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    sampling.add_argument("--n", type=int, default=1, help="samples per prompt (they share the prompt's blocks)")
    sampling.add_argument("--beam-width", type=int, default=1, help="> 1 = beam search")
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")

    add_engine_args(
        gen,
        "KV blocks in the pool; default: what the prompts can need, at most --memory-fraction (0.5) of free memory",
        compile_default="none",  # a few prompts do not pay for a compile
    )


@dataclass
class _Prompt:
    text: str  # what the user typed, before the system prompt and chat template
    token_ids: list[int]


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file is not None:
        if args.file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            try:
                with open(args.file, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except OSError as err:
                raise UsageError(f"--file {args.file!r} cannot be read: {err.strerror}") from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError("no prompt: pass PROMPT... or --file FILE (one prompt per line)")
    return prompts


def _sampling_params(args: argparse.Namespace):
    from hf_paged import SamplingParams

    return SamplingParams(
        n=args.n,
        beam_width=args.beam_width,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _tokenize(tokenizer, texts: list[str], system: str | None, chat: bool) -> list[_Prompt]:
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UsageError("the model's tokenizer has no chat template; pass --no-chat to send raw text")
    prompts = []
    for text in texts:
        if chat:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": text})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = tokenizer(f"{system}\n{text}" if system else text)["input_ids"]
        prompts.append(_Prompt(text, list(ids)))
    return prompts


def _num_blocks(model, prompts: list[_Prompt], params, args: argparse.Namespace) -> int:
    """Blocks for every prompt at once (no preemption), capped by ``--memory-fraction`` of free memory.

    On the CPU a pool of half the free RAM would take tens of seconds to zero, for a few prompts.
    """
    from hf_paged.core.model_info import ModelInfo

    if args.num_blocks is not None:
        return args.num_blocks
    bs = args.block_size
    width = max(params.n, params.beam_width)
    # As the engine's admission check: the prompt once, then each sequence's own blocks plus a copied partial one.
    need = sum(-(-len(p.token_ids) // bs) + width * (-(-params.max_new_tokens // bs) + 1) for p in prompts)
    info = ModelInfo.from_model(model, args.kv_cache_dtype)
    return min(need, info.num_blocks_for(None, bs, args.memory_fraction or 0.5))


def run(args: argparse.Namespace) -> int:
    """``hf-paged generate``: answer the prompts, print the answers and a summary; returns the exit status."""
    from hf_paged.frontends.models import DEFAULT_MODEL

    texts = _read_prompts(args)
    params = _sampling_params(args)  # bad sampling values fail here, before the model loads
    model, tokenizer = load_model_quietly(args)
    prompts = _tokenize(tokenizer, texts, args.system, chat=not args.no_chat)
    engine = make_engine(model, tokenizer, _num_blocks(model, prompts, params, args), args)

    start = time.perf_counter()
    if len(prompts) == 1 and params.n == 1 and params.beam_width == 1 and not args.json:
        finish_reason = None
        for delta in engine.stream(prompts[0].token_ids, params):
            print(delta.text, end="", flush=True)
            finish_reason = delta.finish_reason
        print()
        if finish_reason == "length":
            print(f"[stopped at --max-new-tokens {params.max_new_tokens}]", file=sys.stderr)
        outputs = None
    else:
        use_tqdm = len(prompts) > 1 and not args.json
        outputs = engine.generate([p.token_ids for p in prompts], params, use_tqdm=use_tqdm)
    wall_s = time.perf_counter() - start

    metrics = engine.metrics()
    summary = {
        "requests": len(prompts),
        "generated_tokens": metrics.num_generated_tokens,
        "throughput_tok_s": metrics.generation_throughput,
        "wall_s": wall_s,
        "kv_blocks_used_peak": metrics.peak_used_blocks,
        "kv_blocks_total": metrics.num_blocks,
        "token_state_share_at_peak": metrics.token_state_share_at_peak,
        "prefix_hit_rate": metrics.prefix_hit_rate,
        "preemptions": metrics.num_preemptions,
    }
    if args.json:
        outputs = _jsonable(prompts, outputs, beam_search=params.beam_width > 1)
        print(json.dumps({"model": args.model or DEFAULT_MODEL, "outputs": outputs, "metrics": summary}))
        return 0
    if outputs is not None:
        _print_outputs(prompts, outputs)
    _print_summary(summary)
    return 0


def _jsonable(prompts: list[_Prompt], outputs, beam_search: bool) -> list[dict]:
    # Without beam search the engine sums log-probs only when they are asked for (not a CLI flag yet).
    return [
        {
            "prompt": prompt.text,
            "num_prompt_tokens": len(prompt.token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "completions": [
                {
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                }
                | ({"cumulative_logprob": c.cumulative_logprob} if beam_search else {})
                for c in out.outputs
            ],
        }
        for prompt, out in zip(prompts, outputs, strict=True)
    ]


def _print_outputs(prompts: list[_Prompt], outputs) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True), start=1):
        print(f"[{i}/{len(prompts)}] {prompt.text}")
        for completion in out.outputs:
            if len(out.outputs) > 1:
                print(f"  --- {completion.index + 1} ({completion.finish_reason}) ---")
            print(completion.text.strip())
        print()


def _print_summary(s: dict) -> None:
    sys.stdout.flush()  # the summary goes to stderr, after the answers
    print(
        f"-- {s['requests']} request(s), {s['generated_tokens']} generated tokens, "
        f"{s['throughput_tok_s']:.1f} tok/s ({s['wall_s']:.1f} s)\n"
        f"-- KV blocks used {s['kv_blocks_used_peak']}/{s['kv_blocks_total']} at peak, token states "
        f"{s['token_state_share_at_peak']:.1%} of their slots; prefix hit rate {s['prefix_hit_rate']:.1%}; "
        f"preemptions {s['preemptions']}",
        file=sys.stderr,
    )
