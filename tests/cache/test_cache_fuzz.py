"""PagedCache fuzzer: seeded random generate() calls on one long-lived cache, each checked against DynamicCache.

Each configuration (family, attention, block_size, num_blocks) builds ONE PagedCache and drives it through
``HF_PAGED_FUZZ_STEPS`` operations (default: each of the 10 once, in a seeded order; past 10, random ones) from the
seed ``HF_PAGED_FUZZ_SEED`` (default 0): raise them to fuzz longer. Every output is compared token-for-token with
the same call on a DynamicCache (fp32, CPU, same weights, attn "sdpa"). The operations:

- greedy, sampling (one fixed torch seed for both caches), ``num_beams=2``, ``num_return_sequences=2`` (sampling
  and beams), chunked prefill (``prefill_chunk_size``, also below a row's left padding), ``inputs_embeds``;
- batches of 1-3 prompts of random lengths; rows of different lengths are left-padded with an attention_mask;
- ``cache.prepare(**inputs)`` prefix reuse with prompts that share a prefix with an earlier prompt or output
  (padded batches too; then greedy, beams or 2 samples per prompt); for one prompt, generate skips exactly the
  prefix the pool has cached;
- continuation: generate again on the same cache with the previous output plus new tokens (no reset), which a
  DynamicCache supports; the reference is one fresh call on the whole sequence;
- ``crop``: roll the rows of a (padded) batch back to a random length, also into the prompt and its padding, and
  continue them with new tokens (the reference: one fresh call on the whole sequence); or prompt lookup decoding
  (batch 1), which crops rejected drafts inside generate();
- reuse without ``reset()`` for a new batch (another batch size, or a fresh prompt), or generate() on other prompts
  than prepare() got: a ValueError naming what the cache holds and the fix, and nothing changed;
- tiny pools (block_size 8, 6 blocks; 12 blocks of 16): 3 rows that overflow the pool in the prefill or in the
  first decode step, and random calls; MemoryError only when the call needs more blocks than the pool has without
  any sharing; after it, ``reset()`` frees everything and a prepare()d call on the failed prompt's prefix matches.

Caches: fixed pools and, with ``max_cache_len=64`` (compileable), a growing pool sized at each prefill, a fixed one
and a tiny one: generate then plans every decode step ahead (its mask step), and the planned steps run eagerly (no
compile on the CPU) with beams, samples, chunked prefill, crop, prompt lookup and MemoryError in a planned step.
One of them compiles as on CUDA, on any device (dynamo, eager backend): transformers then compiles its decode
steps and prefill chunks, and the cache's host planning runs behind graph breaks, through recompiles.

Device: the CPU (CI), or ``HF_PAGED_TEST_DEVICE=cuda`` (``benchmarks/run_gpu.sh OUT tests-cache-fuzz``): both models in
fp32 on the GPU, where the eager decode steps take the CUDA-only paths (the kept decode launch a layer,
``kernels.decode.DecodeBinding``; copy-on-write in one launch for all layers). The fuzzer's own tensors stay on the
CPU; each generate() gets its inputs on the device and returns its output to the CPU.

Attention: "paged" (the Triton kernels; TRITON_INTERPRET=1 on CPU; mistral's sliding window too) and "sdpa"
(update() gathers contiguous K/V). After every call without beams, each row holds its real prompt tokens plus the
tokens fed back (the pool keeps none), one per pool slot. After every operation: ``cache.reset()``,
``pool.check_invariants()``, no used block.

Hazards the fuzz cases cover, each also pinned by a focused test below:
- chunked prefill whose first chunk of a row is all left padding (the row starts at its first real token);
- a call that fails after its blocks entered the prefix index (MemoryError for a later row, in the prefill or a
  decode step; a prepare() never fed) must not leave them indexed without their K/V (a later prompt sharing that
  prefix would get wrong tokens silently);
- prepare() followed by generate() with num_beams or num_return_sequences (the copies share the prepared rows),
  and prepare() followed by generate() on other prompts (refused: it would index blocks under the wrong tokens).

A few tens of seconds on 2 CPU cores with TRITON_INTERPRET=1.
"""

import math
import os
import random

import pytest
import torch
from helpers import assert_cache_released
from models import DEVICE, cache_kwarg, tiny_model
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache

from hf_paged import PagedCache

CACHE = cache_kwarg()
if DEVICE == "cuda":  # compiled generate runs under inductor's CUDA-graph trees: name an allocation they refuse
    import torch._inductor.config

    torch._inductor.config.triton.cudagraph_trees_history_recording = True
PAD = 0  # pad_token_id of the tiny models; prompts use ids >= 3 (1 is bos, 2 is eos)
OPS = [
    "greedy", "sample", "beams", "return_sequences", "chunked", "embeds", "prefix", "continue", "reuse", "overflow",
    "crop",
]  # fmt: skip
STEPS = int(os.environ.get("HF_PAGED_FUZZ_STEPS", str(len(OPS))))
SEED = int(os.environ.get("HF_PAGED_FUZZ_SEED", "0"))
STALE = (
    r"still holds \d+ rows of \d+ columns from an earlier generate\(\) or prepare\(\) call.*call cache\.reset\(\)"
    r".*cache\.prepare\("
)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 96) for _ in range(n)]


def _batch(prompts: list[list[int]]) -> dict:
    """input_ids and attention_mask of left-padded prompts."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _generate(model, cache, inputs: dict, kwargs: dict, seed: int) -> torch.Tensor:
    """generate() with the inputs on the model's device; the output on the CPU (where the fuzzer compares it)."""
    device = model.device
    torch.manual_seed(seed)  # seeds the CUDA generators too: both caches' sampling draws alike on the device
    out = model.generate(**{k: v.to(device) for k, v in inputs.items()}, **kwargs, **{CACHE: cache})
    return out.cpu()


def _num_blocks_unshared(inputs: dict, kwargs: dict, block_size: int) -> int:
    """Blocks the call needs if nothing is shared: more than the pool has is the only excuse for MemoryError."""
    batch_size, prompt_len = inputs["attention_mask"].shape
    rows = batch_size * max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))
    return rows * math.ceil((prompt_len + kwargs["max_new_tokens"]) / block_size)


def _check_rows(cache: PagedCache, inputs: dict, kwargs: dict, out: torch.Tensor) -> None:
    """Row b holds its real prompt tokens and every token fed back (all but the last one generated)."""
    prompt_len = inputs["input_ids"].shape[1]
    mask = inputs["attention_mask"].bool().repeat_interleave(kwargs.get("num_return_sequences", 1), dim=0)
    held = cache.row_token_ids()  # max_cache_len: brings the last planned step's ids to the host
    assert len(held) == out.shape[0]
    for b, token_ids in enumerate(held):
        expected = out[b, :prompt_len][mask[b]].tolist() + out[b, prompt_len:-1].tolist()
        assert token_ids == expected, (b, token_ids, expected)
    cache.check_invariants()  # among them: each row has a pool slot for every token it holds


class _Fuzzer:
    def __init__(
        self, family: str, attn: str, block_size: int, num_blocks: int | None, seed: int, max_cache_len: int | None
    ):
        self.rng = random.Random(seed)
        self.model = tiny_model(family, attn=attn, device=DEVICE)
        self.ref = tiny_model(family, attn="sdpa", device=DEVICE)
        self.cache = PagedCache(self.model, num_blocks=num_blocks, block_size=block_size, max_cache_len=max_cache_len)
        self.block_size = block_size
        self.growing = num_blocks is None  # the pool grows at each prefill: no overflow to provoke
        self.history: list[list[int]] = []  # earlier prompts and outputs: sources of shared prefixes
        self.num_skipped = 0
        self.counts: dict[str, int] = {}

    def run(self, steps: int) -> dict[str, int]:
        """Every operation once in a random order, then random ones; returns how often each ran (and events)."""
        ops = self.rng.sample(OPS, len(OPS))[:steps] + [self.rng.choice(OPS) for _ in range(steps - len(OPS))]
        for op in ops:
            self._count(op)
            getattr(self, f"_op_{op}")()
            assert_cache_released(self.cache)
        return self.counts

    def _count(self, event: str) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1

    # ---- one call, compared ------------------------------------------------------------------------

    def _prompts(self, batch_size: int | None = None) -> list[list[int]]:
        batch_size = batch_size or self.rng.randint(1, 3)
        return [_tokens(self.rng, self.rng.randint(1, 20)) for _ in range(batch_size)]

    def _kwargs(self, **extra) -> dict:
        max_new = self.rng.randint(1, 6)
        kwargs = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
        if self.rng.random() < 0.5:
            kwargs["min_new_tokens"] = max_new
        return {**kwargs, **extra}

    def _call(self, inputs: dict, kwargs: dict, *, prepare: bool = False, check_rows: bool = True):
        """One generate() on the PagedCache and on a DynamicCache; None if the pool was (rightly) too small."""
        seed = self.rng.randrange(2**31)
        try:
            if prepare:
                self.cache.prepare(inputs["input_ids"], inputs["attention_mask"])
                self.num_skipped = self.cache.get_seq_length()  # the columns generate will not feed
            out = _generate(self.model, self.cache, inputs, kwargs, seed)
        except MemoryError:
            need = _num_blocks_unshared(inputs, kwargs, self.block_size)
            assert self.cache._max_num_blocks is None and need > self.cache.pool.num_blocks, (need, inputs, kwargs)
            self._count("memory_error")
            assert_cache_released(self.cache)
            if "input_ids" in inputs:  # row 0's prompt: its blocks were the first to be indexed
                failed = inputs["input_ids"][0][inputs["attention_mask"][0].bool()].tolist()
                self._after_memory_error(failed[: self.block_size * 2])
            return None
        expected = _generate(self.ref, DynamicCache(config=self.ref.config), inputs, kwargs, seed)
        assert torch.equal(out, expected), (inputs, kwargs, out, expected)
        if "inputs_embeds" not in inputs:  # embeddings are indexed under a key of their own: no shared prefix
            if check_rows:
                _check_rows(self.cache, inputs, kwargs, out)
            self.history += [[t for t in row if t != PAD] for row in out.tolist()]
        return out

    def _after_memory_error(self, failed: list[int]) -> None:
        """After a MemoryError and reset(), a call that fits the pool works, also with the failed prompt's prefix
        (whose blocks may have been indexed before their K/V were written)."""
        inputs = _batch([failed[: self.rng.randint(1, len(failed))] + _tokens(self.rng, 1)])
        out = self._call(inputs, dict(max_new_tokens=2, do_sample=False, pad_token_id=PAD), prepare=True)
        assert out is not None

    # ---- operations ----------------------------------------------------------------------------------

    def _op_greedy(self):
        self._call(_batch(self._prompts()), self._kwargs())

    def _op_sample(self):
        self._call(_batch(self._prompts()), self._kwargs(do_sample=True, temperature=0.8, top_k=20))

    def _op_beams(self):
        self._call(_batch(self._prompts()), self._kwargs(num_beams=2), check_rows=False)

    def _op_return_sequences(self):
        if self.rng.random() < 0.5:
            kwargs = self._kwargs(do_sample=True, top_k=20, num_return_sequences=2)
            self._call(_batch(self._prompts()), kwargs)
        else:
            kwargs = self._kwargs(num_beams=2, num_return_sequences=2)
            self._call(_batch(self._prompts()), kwargs, check_rows=False)

    def _op_chunked(self):
        self._call(_batch(self._prompts()), self._kwargs(prefill_chunk_size=self.rng.randint(2, 6)))

    def _op_embeds(self):
        inputs = _batch(self._prompts())
        embeds = self.model.get_input_embeddings()(inputs.pop("input_ids").to(DEVICE)).detach().cpu()
        self._call({"inputs_embeds": embeds, **inputs}, self._kwargs())

    def _op_prefix(self):
        """prepare() with prompts that share a prefix with an earlier prompt or output (row 0: the latest one)."""
        if not self.history:
            self._op_greedy()
        prompts = self._prompts()
        for b in range(len(prompts)):
            if self.history and (b == 0 or self.rng.random() < 0.5):
                source = self.history[-1] if b == 0 else self.rng.choice(self.history)
                num_shared = self.rng.randint(min(len(source), self.block_size + 1), len(source))
                prompts[b] = (source[:num_shared] + _tokens(self.rng, self.rng.randint(0, 4)))[:24]
        inputs = _batch(prompts)
        num_cached = self.cache.pool.num_cached_prefix_tokens(prompts[0]) if len(prompts) == 1 else None
        num_hits = self.cache.pool.stats.num_prefix_hit_tokens
        kwargs, check_rows = self.rng.choice(  # generate expands each prepared prompt for beams and samples
            [({}, True), ({}, True), ({"num_beams": 2}, False), ({"do_sample": True, "num_return_sequences": 2}, True)]
        )
        out = self._call(inputs, self._kwargs(**kwargs), prepare=True, check_rows=check_rows)
        if out is not None and num_cached is not None:
            assert self.num_skipped == num_cached
        if out is not None and self.cache.pool.stats.num_prefix_hit_tokens > num_hits:
            self._count("prefix_hit")  # padded batches hit too: the shared blocks are not written again

    def _op_continue(self):
        """generate() again with the output + new tokens, without reset: the cache continues its rows."""
        inputs = _batch(self._prompts())
        kwargs = self._kwargs(do_sample=self.rng.random() < 0.5)
        out = self._call(inputs, kwargs)
        if out is None:
            return
        num_more = self.rng.randint(1, 6)
        more = torch.tensor([_tokens(self.rng, num_more) for _ in range(out.shape[0])])
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(out[:, inputs["input_ids"].shape[1] :]),
                          torch.ones_like(more)], dim=1)  # fmt: skip
        self._call({"input_ids": torch.cat([out, more], dim=1), "attention_mask": mask}, self._kwargs())

    def _op_crop(self):
        """crop() the rows to a random length and continue them; or assisted decoding by prompt lookup, whose rejected
        drafts generate() crops."""
        if self.rng.random() < 0.3:
            prompt = _tokens(self.rng, self.rng.randint(4, 12))
            prompt += prompt[: self.rng.randint(1, 4)]  # a repeated n-gram: prompt lookup drafts from it
            self._call(_batch([prompt]), self._kwargs(prompt_lookup_num_tokens=self.rng.randint(1, 4)))
            return
        inputs, kwargs = _batch(self._prompts()), self._kwargs()
        out = self._call(inputs, kwargs)
        if out is None:
            return
        num_columns = self.cache.get_seq_length()
        if num_columns < 2:
            return
        keep = self.rng.randint(1, num_columns - 1)
        self.cache.crop(keep if self.rng.random() < 0.5 else keep - num_columns)  # 5.17's positive form, or < 0
        assert self.cache.get_seq_length() == keep
        self.cache.check_invariants()
        more = torch.tensor([_tokens(self.rng, self.rng.randint(1, 5))] * out.shape[0])
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(out[:, inputs["input_ids"].shape[1] :])], dim=1)
        cont = {"input_ids": torch.cat([out[:, :keep], more], dim=1),
                "attention_mask": torch.cat([mask[:, :keep], torch.ones_like(more)], dim=1)}  # fmt: skip
        kwargs = self._kwargs()
        try:
            out = _generate(self.model, self.cache, cont, kwargs, 0)
        except MemoryError:  # the tiny pools: the continuation may not fit where the first call did
            self._count("memory_error")
            return
        # The reference computes the kept columns again (a sliding-window DynamicCache cannot crop past its window).
        assert torch.equal(out, _generate(self.ref, DynamicCache(config=self.ref.config), cont, kwargs, 0))
        self._count("cropped")

    def _op_overflow(self):
        """3 rows that fill the pool: the prompts (prefill) or their first decode step (append) must not fit."""
        blocks_per_row = self.cache.pool.num_blocks // 3
        if blocks_per_row > 4 or self.growing:  # keeps prompts short: roomy (or growing) pools get a plain call
            return self._op_greedy()
        prompt_len = blocks_per_row * self.block_size + self.rng.randint(0, 1)  # +1: already the prompt overflows
        kwargs = self._kwargs(max_new_tokens=3, min_new_tokens=3)
        assert self._call(_batch([_tokens(self.rng, prompt_len) for _ in range(3)]), kwargs) is None

    def _op_reuse(self):
        """A new batch on a cache that still holds the last call's rows (or prepare()d other prompts): a clear
        error, nothing changed."""
        if self.rng.random() < 0.25:
            prepared = self._prompts(1)
            fed = [[3 + (prepared[0][0] - 2) % 93, *prepared[0][1:]]]  # another first token
            self.cache.prepare(**_batch(prepared))
            with pytest.raises(ValueError, match=r"feeds other tokens than the prompt cache\.prepare\(\) got"):
                _generate(self.model, self.cache, _batch(fed), self._kwargs(), 0)
            return
        out = self._call(_batch(self._prompts()), self._kwargs())
        if out is None:
            return
        batch_size, num_columns = out.shape[0], self.cache.get_seq_length()
        if self.rng.random() < 0.5:
            prompts = self._prompts(self.rng.choice([n for n in (1, 2, 3, 4) if n != batch_size]))
        else:  # same batch size, a fresh prompt no longer than what the cache holds (a longer one continues it)
            prompts = [_tokens(self.rng, self.rng.randint(1, num_columns)) for _ in range(batch_size)]
        before = self.cache.pool.stats
        with pytest.raises(ValueError, match=STALE):
            _generate(self.model, self.cache, _batch(prompts), self._kwargs(), 0)
        assert self.cache.pool.stats == before


# (family, attention, block_size, num_blocks (None: a growing pool), max_cache_len (given: compileable, every decode
# step planned ahead by generate's mask step; without a compile, as on the CPU, they run eagerly over the static
# buffers; beams and assisted decoding too)).
CONFIGS = {
    "llama-paged": ("llama", "paged", 8, 40, None),
    "llama-sdpa-gather": ("llama", "sdpa", 8, 40, None),
    "llama-paged-tiny-pool": ("llama", "paged", 8, 6, None),
    "mistral-sliding-paged": ("mistral", "paged", 16, 12, None),
    "llama-paged-planned-growing": ("llama", "paged", 8, None, 64),
    "llama-paged-planned-fixed": ("llama", "paged", 8, 40, 64),
    "llama-paged-planned-tiny-pool": ("llama", "paged", 8, 6, 64),
    "llama-paged-planned-compiled": ("llama", "paged", 8, 40, 64),
}
# Configurations whose generate() compiles as on CUDA, on any device: dynamo over the eager backend (no inductor
# on the CPU; CUDA runs inductor with CUDA-graph trees anyway). Every forward transformers compiles (decode steps,
# prefill chunks) is traced with the cache's host planning behind graph breaks, and recompiled as shapes change.
COMPILED = {"llama-paged-planned-compiled"}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fuzz_generate_matches_dynamic_cache(config):
    family, attn, block_size, num_blocks, max_cache_len = CONFIGS[config]
    seed = SEED * len(CONFIGS) + sorted(CONFIGS).index(config)
    fuzzer = _Fuzzer(family, attn, block_size, num_blocks, seed=seed, max_cache_len=max_cache_len)
    if config in COMPILED:
        compile_config = CompileConfig(backend="eager", fullgraph=False, mode=None)
        compile_config._compile_all_devices = True  # not a dataclass field in 5.17 nor 5.24
        fuzzer.model.generation_config.compile_config = compile_config
        torch._dynamo.reset()
    counts = fuzzer.run(STEPS)
    print(f"{config}: {dict(sorted(counts.items()))}")
    if config in COMPILED:  # generate did take the compiled call, and dynamo traced graphs through it
        assert fuzzer.model._compiled_call is not None and counters["stats"]["unique_graphs"] > 0


# ---- focused tests: errors and hazards ---------------------------------------------------------------------


def test_reuse_without_reset_names_what_the_cache_holds():
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=32, block_size=8)
    first = _batch([_tokens(random.Random(1), 9), _tokens(random.Random(2), 5)])
    out = model.generate(**first, max_new_tokens=4, min_new_tokens=4, do_sample=False, **{CACHE: cache})
    assert cache.get_seq_length() == 12
    held = r"still holds 2 rows of 12 columns from an earlier generate\(\) or prepare\(\) call"
    fresh_inputs = [
        _batch([[5, 6, 7]] * 3),  # another batch size
        _batch([[5, 6, 7], [8, 9, 10, 11]]),  # same batch size, a padded fresh prompt
        {"input_ids": torch.tensor([[5, 6, 7, 8]] * 2)},  # no mask: caught by the position ids
        {"input_ids": out[:, :12]},  # as many columns as the cache holds
    ]
    for inputs in fresh_inputs:
        with pytest.raises(ValueError, match=held + r".*call cache\.reset\(\).*cache\.prepare\(input_ids"):
            model.generate(**inputs, max_new_tokens=2, do_sample=False, **{CACHE: cache})
    cache.reset()
    again = model.generate(**first, max_new_tokens=4, min_new_tokens=4, do_sample=False, **{CACHE: cache})
    assert torch.equal(again, out)
    assert_cache_released(cache)


def test_empty_batch_is_a_clear_error():
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=8, block_size=8)
    empty = torch.zeros((0, 5), dtype=torch.long)
    with pytest.raises(ValueError, match=r"at least one row, got an empty batch \(input of shape \(0, 5\)\)"):
        model.generate(input_ids=empty, max_new_tokens=2, do_sample=False, **{CACHE: cache})
    with pytest.raises(ValueError, match=r"`input_ids` must be .* at least one prompt, got shape \(0, 5\)"):
        cache.prepare(empty)
    assert_cache_released(cache)


def test_cache_of_another_model_names_both_shapes():
    llama, phi3 = tiny_model("llama"), tiny_model("phi3")  # 2 vs 4 KV heads of head_dim 16
    deeper = tiny_model("llama", num_hidden_layers=3)
    llama_cache, phi3_cache = (
        PagedCache(llama, num_blocks=8, block_size=8),
        PagedCache(phi3, num_blocks=8, block_size=8),
    )
    PagedCache(deeper, num_blocks=8, block_size=8)  # hooks the deeper model, as a user's earlier cache would
    ids = torch.tensor([list(range(5, 15))])  # 10 tokens: one full block enters the prefix index
    other_heads = (
        r"built for a model with 2 attention layers of 4 KV heads of head_dim 16, "
        r"but layer 0 of this forward has key states of shape \(1, 2, 10, 16\).*num_kv_heads 2"
    )
    with pytest.raises(ValueError, match=other_heads):
        llama.generate(input_ids=ids, max_new_tokens=2, **{CACHE: phi3_cache})
    with pytest.raises(ValueError, match=r"2 attention layers .* updates layer_idx 2 \(allowed: 0 to 1\)"):
        deeper.generate(input_ids=ids, max_new_tokens=2, **{CACHE: llama_cache})
    for cache in (phi3_cache, llama_cache):
        assert_cache_released(cache)
        assert cache.pool.stats.num_cached_free_blocks == 0  # the failed forward's block is not left indexed


@pytest.mark.parametrize("attn", ["paged", "sdpa"])
def test_chunked_prefill_below_left_padding(attn):
    """A row whose first prefill chunks are all padding gets no blocks until its first real token (no "batch row 0
    has no real token" error), and the tokens equal DynamicCache's."""
    model, ref = tiny_model("llama", attn=attn), tiny_model("llama", attn="sdpa")
    cache = PagedCache(model, num_blocks=16, block_size=8)
    inputs = _batch([[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]])  # row 0: 8 columns of padding
    for chunk in (2, 4):  # chunk 2: the first chunk is padding in row 0 only; chunk 4 too, and for 2 chunks
        kwargs = dict(max_new_tokens=4, do_sample=False, prefill_chunk_size=chunk)
        out = model.generate(**inputs, **kwargs, **{CACHE: cache})
        assert torch.equal(out, ref.generate(**inputs, **kwargs, **{CACHE: DynamicCache(config=ref.config)}))
        assert cache.row_token_ids()[0] == [5, 6, 7, *out[0, 11:-1].tolist()]
        assert_cache_released(cache)
    both_padded = _batch([[5, 6], [7, 8, 9]])
    both_padded = {k: torch.cat([torch.zeros_like(v[:, :4]), v], dim=1) for k, v in both_padded.items()}
    kwargs = dict(max_new_tokens=3, do_sample=False, prefill_chunk_size=2)  # the first 2 chunks: no real token
    out = model.generate(**both_padded, **kwargs, **{CACHE: cache})
    assert torch.equal(out, ref.generate(**both_padded, **kwargs, **{CACHE: DynamicCache(config=ref.config)}))
    assert_cache_released(cache)


def test_decoded_blocks_enter_the_prefix_index():
    """Tokens appended by decode steps are indexed once their block is full, as the prompt's blocks are."""
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=32, block_size=8)
    prompt = torch.tensor([_tokens(random.Random(3), 5)])
    out = model.generate(input_ids=prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, **{CACHE: cache})
    assert_cache_released(cache)
    fed = out[0, :-1].tolist()  # 24 tokens whose K/V were computed: 3 full blocks
    again = torch.tensor([fed + [40, 41]])
    assert cache.pool.num_cached_prefix_tokens(again[0].tolist()) == 24
    cache.prepare(again)
    assert cache.get_seq_length() == 24  # generate feeds only the last 2 tokens
    cont = model.generate(input_ids=again, max_new_tokens=3, do_sample=False, **{CACHE: cache})
    fresh = model.generate(
        input_ids=again, max_new_tokens=3, do_sample=False, **{CACHE: DynamicCache(config=model.config)}
    )
    assert torch.equal(cont, fresh)
    assert_cache_released(cache)


def _dynamic_generate(model, **kwargs) -> torch.Tensor:
    return model.generate(**kwargs, **{CACHE: DynamicCache(config=model.config)})


def test_failed_call_leaves_no_unwritten_block_in_the_prefix_index():
    """Blocks enter the prefix index when the forward that writes them is planned. A call that fails before that
    forward runs (MemoryError for a later row) must drop them from the index: a later prompt with that prefix would
    otherwise get wrong tokens without an error."""
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=6, block_size=8)
    prompts = [_tokens(random.Random(b), 17) for b in range(3)]  # 3 blocks each: rows 0 and 1 fit, row 2 does not
    with pytest.raises(MemoryError, match="out of KV blocks"):
        model.generate(**_batch(prompts), max_new_tokens=2, **{CACHE: cache})
    assert_cache_released(cache)
    again = torch.tensor([prompts[0][:16] + [50]])
    cache.prepare(again)
    assert cache.get_seq_length() == 0  # no hit on row 0's blocks: their K/V were never written
    out = model.generate(input_ids=again, max_new_tokens=3, do_sample=False, **{CACHE: cache})
    assert torch.equal(out, _dynamic_generate(model, input_ids=again, max_new_tokens=3, do_sample=False))
    assert_cache_released(cache)

    # Out of blocks in a decode step: row 0 fills its block (indexed), then row 1 finds no free block.
    cache = PagedCache(model, num_blocks=4, block_size=8)
    batch = _batch([_tokens(random.Random(5), 15), _tokens(random.Random(6), 16)])
    with pytest.raises(MemoryError, match="out of KV blocks"):
        model.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False, **{CACHE: cache})
    row0 = cache.row_token_ids()[0]  # 15 prompt tokens + the first generated one: 2 full blocks
    assert len(row0) == 16
    assert_cache_released(cache)
    assert cache.pool.num_cached_prefix_tokens(row0 + [50]) == 0

    # A prepare() that generate never fed leaves the same hazard.
    cache.prepare(again)
    assert_cache_released(cache)
    assert cache.pool.num_cached_prefix_tokens(again[0].tolist()) == 0


@pytest.mark.parametrize("kwargs", [dict(num_beams=2), dict(do_sample=True, num_return_sequences=2)])
def test_prepare_then_beams_or_samples_share_the_prepared_prompt(kwargs):
    """generate expands each prepared prompt into several rows (num_beams, num_return_sequences): the first forward
    takes them as copies of the prepared row (sharing its blocks), not as a batch that does not continue it."""
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=32, block_size=8)
    system = _tokens(random.Random(4), 16)
    model.generate(input_ids=torch.tensor([system + [40]]), max_new_tokens=1, **{CACHE: cache})
    cache.reset()
    prompt = torch.tensor([system + [50, 51, 52]])
    kwargs = dict(kwargs, max_new_tokens=4, min_new_tokens=4)
    cache.prepare(prompt)
    assert cache.get_seq_length() == 16
    torch.manual_seed(0)
    out = model.generate(input_ids=prompt, **kwargs, **{CACHE: cache})
    torch.manual_seed(0)
    assert torch.equal(out, _dynamic_generate(model, input_ids=prompt, **kwargs))
    assert_cache_released(cache)


def test_prepare_then_other_prompts_is_a_clear_error():
    """generate() after prepare() must feed the prepared prompts: else their blocks would be indexed under
    prepare()'s tokens while holding other K/V. The error leaves no such block behind."""
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=16, block_size=8)
    prepared, fed = torch.tensor([list(range(10, 30))]), torch.tensor([list(range(40, 60))])
    cache.prepare(prepared)
    with pytest.raises(ValueError, match=r"row 0 of this forward feeds other tokens than the prompt cache\.prepare"):
        model.generate(input_ids=fed, max_new_tokens=2, **{CACHE: cache})
    assert_cache_released(cache)
    out = model.generate(input_ids=prepared, max_new_tokens=4, do_sample=False, **{CACHE: cache.prepare(prepared)})
    assert torch.equal(out, _dynamic_generate(model, input_ids=prepared, max_new_tokens=4, do_sample=False))
    assert_cache_released(cache)
