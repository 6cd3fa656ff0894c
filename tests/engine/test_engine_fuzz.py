"""An engine fuzzer: seeded random add / step / abort / stream / interrupt runs over small pools.

Features fail where they meet (n samples × beams × preemption × chunked prefill × async scheduling × aborts ×
interrupts × structured outputs), so each run mixes all of them on one engine, over a configuration drawn from:
pools of 8-40 blocks, block sizes 8/16, token budgets 16-128, prefix caching on/off, recompute/swap preemption, async
scheduling on/off, shared-prefix (cascade) decode on whenever two decode rows share a block, or off. After every
operation the block pool's invariants hold; at the end every accepted request finished or was aborted, every block
is free, and every greedy request (plain, ``n`` samples or beams) equals the same request run alone on a roomy
engine.

CI runs a bounded profile (``HF_PAGED_FUZZ`` unset: a few configurations, about a minute);
``HF_PAGED_FUZZ=long`` runs the long one (48 runs of 1200 operations: over 20 000 engine steps) and prints
its figures.
"""

import dataclasses
import os
import random
import re
import threading
import time

import pytest
from helpers import needs_triton, route_prefill_through_triton
from models import DEVICE, char_tokenizer, tiny_model

from hf_paged import ContinuousBatcher, SamplingParams, StructuredOutput

LONG = os.environ.get("HF_PAGED_FUZZ") == "long"
NUM_RUNS = 48 if LONG else 5
# Hunting runs take other seeds: HF_PAGED_FUZZ_SEED_BASE=1000 runs seeds 1000 .. 1000 + NUM_RUNS - 1.
SEED_BASE = int(os.environ.get("HF_PAGED_FUZZ_SEED_BASE", "0"))
OPS_PER_RUN = 1200 if LONG else 80


class Interrupt(KeyboardInterrupt):
    """A Ctrl-C the fuzzer injects at a random point of a step."""


class _Reference:
    """Greedy outputs of requests run alone on a roomy engine (memoised)."""

    def __init__(self, model, tokenizer, block_size, kv_cache_dtype="auto"):
        self.engine = ContinuousBatcher(model, tokenizer, num_blocks=256, block_size=block_size,
                                        max_num_batched_tokens=256, async_scheduling=False,
                                        kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        self.memo = {}

    def __call__(self, prompt, params: SamplingParams, companions: int = 0):
        """The request's outputs, run alone (or beside ``companions`` unrelated requests: another batch shape)."""
        grammar = params.structured_output.key if params.structured_output is not None else None
        key = (tuple(prompt), params.n, params.beam_width, params.max_new_tokens, params.stop, params.ignore_eos,
               grammar, companions)  # fmt: skip
        if key not in self.memo:
            others = [[7 + i, 9, 11 + i] * (i + 2) for i in range(companions)]
            outs = self.engine.generate([prompt, *others], [params] + [SamplingParams(max_new_tokens=3)] * companions,
                                        use_tqdm=False)  # fmt: skip
            self.memo[key] = sorted((c.token_ids, c.finish_reason) for c in outs[0].outputs)
        return self.memo[key]

    def is_numerically_tied(self, prompt, params: SamplingParams) -> bool:
        """Whether the request's own greedy choices change with the batch around it (fp32 rounding of a near-tie:
        then a run that differs from the lone one is not a bug)."""
        return any(self(prompt, params, c) != self(prompt, params) for c in (1, 3))


def _config(rng: random.Random) -> dict:
    block_size = rng.choice([8, 16])
    budget = rng.choice([16, 24, 32, 64, 128])
    return dict(
        block_size=block_size,
        num_blocks=rng.randint(8, 40) if block_size == 8 else rng.randint(8, 24),
        max_num_batched_tokens=budget,
        max_num_seqs=rng.choice([4, 8, min(16, budget)]),
        enable_prefix_caching=rng.random() < 0.6,
        preemption_mode=rng.choice(["recompute", "swap"]),
        swap_space_gb=0.0005,
        async_scheduling=rng.random() < 0.5,
    )


# Structured outputs over the char tokenizer's characters ("$" to "~"), given to some greedy requests, each with a
# Python regex of its language: a complete output must match it.
GRAMMARS = [
    (StructuredOutput(regex="[a-z]{2,6}(-[0-9]{1,3})?"), "[a-z]{2,6}(-[0-9]{1,3})?"),
    (StructuredOutput(choice=["alpha", "beta", "gamma"]), "alpha|beta|gamma"),
    (StructuredOutput(grammar='root ::= "(" [a-e]+ ")" | [0-9] [0-9]'), r"\([a-e]+\)|[0-9][0-9]"),
]


def _params(rng: random.Random, prefixes, grammar_rng: random.Random,
            scoring_rng: random.Random) -> tuple[list[int], SamplingParams]:  # fmt: skip
    """A request drawn from ``rng``; ``grammar_rng`` and ``scoring_rng`` (their own streams, so that ``rng``'s runs
    stay the same) pick which greedy requests get a structured output and which requests score their prompt
    (``prompt_logprobs``)."""
    prompt = list(rng.choice(prefixes))[: rng.randint(0, 24)] + [rng.randint(3, 95) for _ in range(rng.randint(1, 20))]
    kind = rng.random()
    common = dict(max_new_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.7)
    if kind < 0.15:
        params = SamplingParams(beam_width=rng.choice([2, 3]), n=1, **common)
    elif kind < 0.35:
        params = SamplingParams(n=rng.choice([2, 3]), temperature=0.0, **common)
    elif kind < 0.55:
        params = SamplingParams(n=rng.choice([1, 2]), temperature=1.0, seed=rng.randint(0, 99),
                                logprobs=rng.choice([None, 2]), **common)  # fmt: skip
    else:
        stop = [chr(ord("!") + rng.randint(3, 95))] if rng.random() < 0.3 else []
        grammar = grammar_rng.choice(GRAMMARS)[0] if grammar_rng.random() < 0.3 else None
        params = SamplingParams(temperature=0.0, stop=stop, structured_output=grammar, **common)
    if scoring_rng.random() < 0.25:
        params = dataclasses.replace(params, prompt_logprobs=scoring_rng.choice([0, 3]))
    return prompt, params


def _check_prompt_logprobs(prompt, params: SamplingParams, entries) -> None:
    """Every prompt token scored once, in order: the token first, then its k alternatives ranked 1..k."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None, (prompt, entries)
    for token_id, entry in zip(prompt[1:], entries[1:], strict=True):
        assert next(iter(entry)) == token_id
        alternatives = sorted(lp.rank for lp in entry.values())[: params.prompt_logprobs]
        assert alternatives == list(range(1, params.prompt_logprobs + 1)), entry


def _is_greedy(params: SamplingParams) -> bool:
    return params.beam_width > 1 or params.temperature == 0.0


def _arm_interrupt(engine, rng: random.Random):
    """Make the next step raise at a random point: in the forward, in token application, in detokenisation, in
    a beam step, or in scheduling right after the pool allocated or appended.

    Returns a function that disarms it (the chosen point may not be reached in that step).
    """
    target = rng.choice(["runner", "scheduler", "detokenizer", "allocate", "append", "beams"])
    obj, name = {
        "runner": (engine.runner, "execute"),
        "scheduler": (engine.scheduler, "update_from_output"),
        "detokenizer": (engine.detokenizer, "update"),
        "allocate": (engine.pool, "allocate"),  # inside scheduling, once the pool has changed
        "append": (engine.pool, "append"),
        "beams": (engine.scheduler, "apply_beam_step"),  # the beam search has ranked, the beams have not moved
    }[target]
    original = getattr(obj, name)

    def boom(*args, **kwargs):
        setattr(obj, name, original)
        if target in ("scheduler", "allocate", "append"):  # part-way through: the call's effect, then fail
            original(*args, **kwargs)
        raise Interrupt(f"injected into {target}")

    setattr(obj, name, boom)
    return lambda: setattr(obj, name, original) if obj is not engine.pool else obj.__dict__.pop(name, None)


def _run(seed: int, model, tokenizer, references, fused_model=None) -> dict:
    rng = random.Random(seed)
    config = _config(rng)
    # Cascade decode whenever two decode rows share a block (the tiny model's K/V is far below the runner's bytes
    # threshold), or off. Its own stream: the seeds keep their runs.
    cascade = random.Random(f"cascade-{seed}").random() < 0.7
    # Half the runs use a copy of the model whose q/k/v and gate/up run as one GEMM each (the engine's default on
    # CUDA), checked against the references of the unfused model. Its own stream too.
    if fused_model is not None and random.Random(f"fuse-{seed}").random() < 0.5:
        model = fused_model
    # Half the runs keep K/V in FP8 (e4m3 or e5m2), checked against references that do too. Its own stream too.
    kv_cache_dtype = random.Random(f"kv-{seed}").choice(["auto", "auto", "fp8", "fp8_e5m2"])
    engine = ContinuousBatcher(model, tokenizer, cascade_attention=cascade, kv_cache_dtype=kv_cache_dtype, **config)
    if cascade:
        engine.runner.cascade_min_saved_bytes = 0
    if rng.random() < 0.5 and not engine.runner.use_cuda_graphs:
        engine.runner.emulate_graphs = True  # every step through the padded inputs of its CUDA-graph bucket
    reference = references.setdefault((config["block_size"], kv_cache_dtype),
                                      _Reference(model, tokenizer, config["block_size"], kv_cache_dtype))  # fmt: skip
    prefixes = [[rng.randint(3, 95) for _ in range(24)] for _ in range(2)]
    grammar_rng = random.Random(f"grammar-{seed}")
    scoring_rng = random.Random(f"prompt-logprobs-{seed}")
    accepted: dict[str, tuple] = {}  # request id -> (prompt, params)
    finished: dict[str, object] = {}
    aborted: set[str] = set()
    streams: list[tuple[str, object, list]] = []
    counts = dict(
        steps=0, requests=0, rejected=0, aborts=0, interrupts=0, stream_deltas=0, greedy_checked=0, numeric_ties=0
    )
    counts["structured"] = 0  # structured-output requests whose outputs were checked
    counts["prompt_logprobs"] = 0  # requests whose prompt log-probs were checked

    def record(outs):
        for out in outs:
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} reported finished twice"
                finished[out.request_id] = out

    for _ in range(OPS_PER_RUN):
        op = rng.random()
        try:
            if op < 0.3:
                prompt, params = _params(rng, prefixes, grammar_rng, scoring_rng)
                try:
                    rid = engine.add_request(prompt, params)
                except ValueError as e:  # documented: the request can never fit this pool
                    assert "KV blocks" in str(e) or "max_num_seqs" in str(e), e
                    counts["rejected"] += 1
                    continue
                accepted[rid] = (prompt, params)
                counts["requests"] += 1
            elif op < 0.4:
                prompt, params = _params(rng, prefixes, grammar_rng, scoring_rng)
                if params.n != 1 or params.beam_width != 1:
                    continue
                try:
                    gen = engine.stream(prompt, params)
                except ValueError:
                    counts["rejected"] += 1
                    continue
                streams.append((None, gen, []))
                counts["requests"] += 1
            elif op < 0.5 and streams:
                i = rng.randrange(len(streams))
                _, gen, deltas = streams[i]
                delta = next(gen, None)
                if delta is None:
                    streams.pop(i)
                else:
                    deltas.append(delta)
                    counts["stream_deltas"] += 1
                    if delta.finish_reason is not None:
                        assert next(gen, None) is None
                        streams.pop(i)
            elif op < 0.55:
                live = [r for r in accepted if r not in finished and r not in aborted]
                if live:
                    rid = rng.choice(live)
                    engine.abort(rid)
                    aborted.add(rid)
                    counts["aborts"] += 1
            elif op < 0.6:
                disarm = _arm_interrupt(engine, rng)
                try:
                    record(engine.step())
                except Interrupt:
                    counts["interrupts"] += 1
                disarm()
                counts["steps"] += 1
            else:
                record(engine.step())
                counts["steps"] += 1
        finally:
            engine.pool.check_invariants()
    # Drain: the open streams and every queued request.
    for _, gen, deltas in streams:
        for delta in gen:
            deltas.append(delta)
        assert deltas and deltas[-1].finish_reason is not None
    deadline = 20000
    while engine.has_unfinished_requests():
        record(engine.step())
        counts["steps"] += 1
        deadline -= 1
        assert deadline, "the engine made no progress"
    assert set(finished) == set(accepted), sorted(set(accepted) - set(finished))
    for rid, (prompt, params) in accepted.items():
        out = finished[rid]
        if rid in aborted:
            assert all(c.finish_reason in ("abort", "stop", "length") for c in out.outputs)
            continue
        if _is_greedy(params):
            got = sorted((c.token_ids, c.finish_reason) for c in out.outputs)
            if got != reference(prompt, params):
                if not reference.is_numerically_tied(prompt, params):
                    raise AssertionError((rid, prompt, params, config, got, reference(prompt, params)))
                counts["numeric_ties"] += 1
            counts["greedy_checked"] += 1
        assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
        if params.prompt_logprobs is not None:
            _check_prompt_logprobs(prompt, params, out.prompt_logprobs)
            counts["prompt_logprobs"] += 1
        if params.structured_output is not None:
            pattern = next(p for g, p in GRAMMARS if g is params.structured_output)
            for c in out.outputs:
                if c.finish_reason == "stop" and c.stop_reason is None:  # the grammar's end, not a stop string
                    assert re.fullmatch(pattern, c.text), (rid, params, c)
            counts["structured"] += 1
    assert engine.pool.stats.num_used_blocks == 0
    assert not engine.requests
    engine.pool.check_invariants()
    counts["cascade_steps"] = engine.runner.num_cascade_steps
    return counts


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama", device=DEVICE), char_tokenizer()


@pytest.fixture(scope="module")
def fused_model():
    from hf_paged.engine.fuse import fuse_projections

    model = tiny_model("llama", device=DEVICE)  # the same weights as model_and_tokenizer's
    assert fuse_projections(model)
    return model


@pytest.mark.parametrize("seed", range(SEED_BASE, SEED_BASE + NUM_RUNS))
def test_engine_fuzz_random_workloads_match_references_and_free_every_block(
    seed, model_and_tokenizer, fuzz_references, fused_model
):
    model, tokenizer = model_and_tokenizer
    start = time.perf_counter()
    counts = _run(seed, model, tokenizer, fuzz_references, fused_model)
    if LONG:
        print(f"seed {seed}: {counts} in {time.perf_counter() - start:.1f} s")


@needs_triton
@pytest.mark.parametrize("seed", [SEED_BASE + 100, SEED_BASE + 101])
def test_engine_fuzz_through_the_triton_prefill_kernel(seed, model_and_tokenizer, fuzz_references, fused_model,
                                                      monkeypatch):  # fmt: skip
    """The fuzzer's mix (n, beams, preemption, chunking, async, aborts, interrupts) with every prefill and
    mixed-step attention call through the Triton prefill kernel (interpreted on the CPU) in the exact tile map's
    form with no spare program, so that programs loop over a step's chunks; greedy results against the references
    (the reference attention's, where another test made them first)."""
    model, tokenizer = model_and_tokenizer
    launches = route_prefill_through_triton(monkeypatch, spare_slots=0)
    _run(seed, model, tokenizer, fuzz_references, fused_model)
    assert launches and any(pad for _, pad in launches), launches


@pytest.fixture(scope="module")
def fuzz_references():
    return {}


def test_abort_from_another_thread_is_safe_while_stepping(model_and_tokenizer):
    """abort() from a second thread while the first drives the engine: applied at the next step, never lost."""
    model, tokenizer = model_and_tokenizer
    engine = ContinuousBatcher(model, tokenizer, num_blocks=64, block_size=8)
    rids = [engine.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=40, ignore_eos=True)) for _ in range(4)]
    stop = threading.Event()

    def aborter():
        for rid in rids[:2]:
            time.sleep(0.01)
            engine.abort(rid)
        stop.set()

    thread = threading.Thread(target=aborter)
    thread.start()
    finished = {}
    while engine.has_unfinished_requests() or not stop.is_set():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    thread.join()
    assert set(finished) == set(rids)
    assert engine.pool.stats.num_used_blocks == 0
    engine.pool.check_invariants()
