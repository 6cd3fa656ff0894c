"""A compileable PagedCache (max_cache_len): generate plans each decode step ahead and runs it through
torch.compile with fullgraph=True (any graph break fails) on the CPU (aot_eager backend, CompileConfig's
_compile_all_devices), token-for-token against DynamicCache in fp32, without recompiling on a repeated call.

The compile is shared: one module-scoped model, batch size 2 everywhere it compiles (one graph).
"""

import pytest
import torch
from helpers import assert_cache_released, needs_triton
from hf_paged.kernels import paged_attention_ref, paged_decode_ref
from models import FAMILIES, cache_kwarg, tiny_model
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache

from hf_paged import PagedCache

CACHE = cache_kwarg()
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 9, 11, 12, 13]])  # row 0 left-padded
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]])


def _compile_config() -> CompileConfig:
    config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    config._compile_all_devices = True  # compile on the CPU too (not a dataclass field in 5.17 nor 5.24)
    return config


def _dynamic(model):
    return DynamicCache(config=model.config)


def _num_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def model():
    torch._dynamo.reset()
    return tiny_model("llama")


def test_compiled_greedy_matches_dynamic_cache_without_recompiling(model):
    # 9 columns + 12 new tokens with blocks of 8: every row crosses block boundaries in compiled steps.
    kwargs = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    expected = model.generate(**kwargs, **{CACHE: _dynamic(model)})
    cache = PagedCache(model, block_size=8, max_cache_len=40)
    assert cache.is_compileable
    planned = []
    plan = cache._plan_ahead
    cache._plan_ahead = lambda *args: planned.append(plan(*args)) or planned[-1]
    grow, sizes = cache._grow_for_planned_steps, []  # the pool's size before and after each call's growth
    cache._grow_for_planned_steps = lambda: (
        sizes.append(cache.pool.num_blocks),
        grow(),
        sizes.append(cache.pool.num_blocks),
    )
    out = model.generate(**kwargs, compile_config=_compile_config(), **{CACHE: cache})
    assert torch.equal(out, expected)
    assert model._compiled_call is not None and sum(m is not None for m in planned) == 11  # every decode step
    # The last step's id stays on the device until a host method needs it (reset, crop, the next forward).
    assert cache.row_token_ids()[0] == out[0, 3:-1].tolist()
    graphs = _num_graphs()
    # The prefill ran with its own blocks (6 and 9 real tokens: 1 + 2 blocks of 8); the pool grew once, before the
    # first planned step, for each row's real tokens up to max_cache_len (padding takes no slot): no more than
    # StaticCache's 2 x 40 slots here, and no planned step grew it.
    full = -(-(6 + 40 - 9) // 8) + -(-(9 + 40 - 9) // 8)
    assert sizes[:2] == [3, full] and sizes[2:] == [full] * (len(sizes) - 2) and full * 8 <= 80
    assert cache.pool.num_blocks == full
    cache.reset()
    again = model.generate(**kwargs, compile_config=_compile_config(), **{CACHE: cache})
    assert torch.equal(again, expected)
    # A second call continues the rows (prompt = the output plus new tokens), as with a DynamicCache.
    dyn = _dynamic(model)
    model.generate(**kwargs, **{CACHE: dyn})
    cont = torch.cat([again, torch.tensor([[40, 41, 42], [50, 51, 52]])], dim=1)
    cont_kwargs = dict(input_ids=cont, attention_mask=torch.cat([MASK, torch.ones(2, 15, dtype=MASK.dtype)], dim=1))
    cont_kwargs.update(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    out = model.generate(**cont_kwargs, compile_config=_compile_config(), **{CACHE: cache})
    assert torch.equal(out, model.generate(**cont_kwargs, **{CACHE: dyn}))
    assert _num_graphs() == graphs, "a repeated or continued call with the same batch size recompiled"
    cache.check_invariants()
    assert_cache_released(cache)


def test_compiled_sampling_with_seed_matches_dynamic_cache(model):
    kwargs = dict(input_ids=IDS[1:], max_new_tokens=10, do_sample=True, temperature=0.9, num_return_sequences=2)
    torch.manual_seed(11)
    expected = model.generate(**kwargs, **{CACHE: _dynamic(model)})
    cache = PagedCache(model, num_blocks=16, block_size=8, max_cache_len=24)  # a fixed pool compiles too
    graphs = _num_graphs()
    torch.manual_seed(11)
    out = model.generate(**kwargs, compile_config=_compile_config(), **{CACHE: cache})
    assert torch.equal(out, expected)
    assert _num_graphs() <= graphs + 1
    # The rows' second blocks, filled by compiled steps, entered the prefix index with their real ids (a query
    # one token longer: the last token of a prompt is always computed).
    for row in out:
        assert cache.pool.num_cached_prefix_tokens(row[:17].tolist()) == 16
    assert_cache_released(cache)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_planned_steps_without_compile_match_dynamic_cache(family):
    """generate plans ahead whenever the cache is compileable; without a compile the planned steps run eagerly
    over the same static buffers, through the eager decode path (sliding windows, soft caps too)."""
    model = tiny_model(family)
    kwargs = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    ref = tiny_model(family, attn="eager" if family == "gemma2" else "sdpa")
    expected = ref.generate(**kwargs, **{CACHE: _dynamic(ref)})
    cache = PagedCache(model, block_size=8, max_cache_len=21)
    assert torch.equal(model.generate(**kwargs, **{CACHE: cache}), expected)
    assert cache.get_seq_length() == 20 and not cache._planned
    assert_cache_released(cache)


def test_planned_steps_run_eagerly_take_the_eager_decode_path(monkeypatch):
    """A planned step whose forward is not compiled (beam search, generate without a compile) reads the static
    buffers through the eager decode path: the attention writes the new K/V (on CUDA inside its one decode launch)
    and attends with the rows' real longest length, never the static path (a separate write in update(), the
    decode split for max_cache_len and a merge). On the CPU the eager path writes, then runs the decode reference
    over the table columns the longest row reaches."""
    import hf_paged.core.attention as attention

    model = tiny_model("llama")
    kwargs = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=6, min_new_tokens=6, num_beams=2)
    expected = model.generate(**kwargs, **{CACHE: _dynamic(model)})
    cache = PagedCache(model, block_size=8, max_cache_len=40)
    planned = []
    plan = cache._plan_ahead
    cache._plan_ahead = lambda *args: planned.append(plan(*args)) or planned[-1]
    monkeypatch.setattr(cache, "_update_planned", lambda *args: pytest.fail("a planned step took the static path"))
    decode_calls, writes = [], []
    paged_decode, write_kv = attention.paged_decode, attention.write_kv

    def spy_decode(*args, **kw):
        decode_calls.append((args[6], args[3].shape[1]))  # max_seq_len, block-table columns read
        return paged_decode(*args, **kw)

    monkeypatch.setattr(attention, "paged_decode", spy_decode)
    monkeypatch.setattr(attention, "write_kv", lambda *args: writes.append(1) or write_kv(*args))
    assert torch.equal(model.generate(**kwargs, **{CACHE: cache}), expected)
    steps = sum(m is not None for m in planned)
    assert steps == 5  # every decode step was planned ahead ...
    layers = model.config.num_hidden_layers
    # ... and ran eagerly: the longest row's length (9 columns + the step), not max_cache_len's 40 (5 blocks).
    assert decode_calls == [(10 + step, -(-(10 + step) // 8)) for step in range(steps) for _ in range(layers)]
    assert len(writes) == steps * layers
    assert not cache._planned and not cache._planned_eager
    assert_cache_released(cache)


def test_beams_and_prompt_lookup_run_planned_steps_eagerly():
    """transformers compiles only the sampling loop: beam search and assisted decoding call the model eagerly; beam
    steps are still planned ahead (reorders between them), prompt lookup's verification forwards are not (crop)."""
    model = tiny_model("llama")
    kwargs = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=16, min_new_tokens=16, num_beams=3)
    expected = model.generate(**kwargs, **{CACHE: _dynamic(model)})
    cache = PagedCache(model, block_size=8, max_cache_len=25)
    assert torch.equal(model.generate(**kwargs, **{CACHE: cache}), expected)
    assert_cache_released(cache)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 11, 12, 13]])
    kwargs = dict(input_ids=prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=3)
    cache = PagedCache(model, block_size=8, max_cache_len=33)
    assert torch.equal(model.generate(**kwargs, **{CACHE: cache}), model.generate(**kwargs))
    assert_cache_released(cache)


def test_unplanned_forward_breaks_a_fullgraph_compile(model):
    """Only a planned step is free of host code: a forward that the decoder hook plans (here a decode step nobody
    planned ahead) reaches host code inside the compiled region, which fullgraph=True refuses."""
    cache = PagedCache(model, num_blocks=8, block_size=8, max_cache_len=16)
    model(input_ids=IDS[1:, :8], **{CACHE: cache})
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(input_ids=IDS[1:, 8:], position_ids=torch.tensor([[8]]), **{CACHE: cache})


def test_compileable_only_with_max_cache_len_and_paged_attention():
    model = tiny_model("llama")
    assert not PagedCache(model, num_blocks=8).is_compileable  # the default: eager
    assert not PagedCache(tiny_model("llama", attn="sdpa"), num_blocks=8, max_cache_len=16).is_compileable
    with pytest.raises(ValueError, match=r"`max_cache_len` must be a positive int or None, got 0"):
        PagedCache(model, max_cache_len=0)


def test_max_cache_len_errors_name_the_values():
    model = tiny_model("llama")
    cache = PagedCache(model, block_size=8, max_cache_len=14)
    with pytest.raises(ValueError, match=r"max_cache_len=14\) holds at most 14 columns .* takes them to 15"):
        model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False, **{CACHE: cache})
    assert cache.get_seq_length() == 14  # the steps that fit ran
    cache.reset()
    with pytest.raises(ValueError, match=r"at most 14 columns .* takes them to 20"):
        model.generate(input_ids=torch.ones(1, 20, dtype=torch.long), max_new_tokens=2, **{CACHE: cache})
    cache = PagedCache(model, block_size=8, max_cache_len=4096, memory_fraction=1e-6)
    with pytest.raises(MemoryError, match=r"needs \d+ blocks of 8 tokens for 2 rows to reach max_cache_len=4096"):
        model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, **{CACHE: cache})


def test_paged_decode_ref_matches_paged_attention_ref():
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 8, 8, 2, 16).unbind(0)
    query = torch.randn(3, 4, 16)
    tables = torch.tensor([[0, 1, 2, 0], [3, 4, 0, 0], [5, 6, 7, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 9, 0], dtype=torch.int32)  # the last row is padding: zeros
    for window, cap in [(None, None), (5, None), (None, 3.0)]:
        expected = paged_attention_ref(
            query, k_cache, v_cache, tables, seq_lens, torch.arange(4).int(), 0.3, window, cap
        )
        out = paged_decode_ref(query, k_cache, v_cache, tables, seq_lens, 0.3, window, cap)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert out[2].eq(0).all()


@needs_triton
def test_custom_ops_trace_whole_and_match_the_reference():
    """The Triton launchers as custom ops (what paged_decode/write_kv call on CUDA): fullgraph-traceable, functional
    K/V mutation, same result as the references (here interpreted on the CPU)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k_cache, v_cache = torch.randn(2, 6, 16, 2, 16, device=device).unbind(0)
    query, new = torch.randn(2, 4, 16, device=device), torch.randn(2, 2, 16, device=device)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([40, 17], dtype=torch.int32, device=device)
    slots = torch.tensor([39, 4 * 16], device=device)

    def step(k, v):
        torch.ops.hf_paged.write_kv(new, new, k, v, slots)
        return torch.ops.hf_paged.paged_decode(query, k, v, tables, seq_lens, 0.25, 64, 0, 0.0)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = torch.compile(step, backend="aot_eager", fullgraph=True)(k_cache, v_cache)
    k_ref.view(-1, 2, 16)[slots], v_ref.view(-1, 2, 16)[slots] = new, new
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    expected = paged_decode_ref(query, k_ref, v_ref, tables, seq_lens, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["samples", "beams", "padded-duplicates"])
def test_copies_of_a_prompt_share_its_full_blocks_in_the_presized_pool(mode):
    """With max_cache_len the pool is sized once, at the prefill, for every planned step: generate's copies of a
    prompt (num_return_sequences, beams) share its full blocks for life, so they are counted once; each copy's
    partial block and new blocks are its own (StaticCache would reserve max_cache_len for every copy)."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 96, (2, 19), generator=gen)  # 2 full blocks of 8 + a partial block of 3
    if mode == "samples":
        kwargs = dict(do_sample=True, temperature=0.9, num_return_sequences=4)
    elif mode == "beams":
        kwargs = dict(do_sample=False, num_beams=4, num_return_sequences=2)
    else:  # the user's batch repeats a prompt, left-padded, and each row gets 2 samples: 4 copies of it again
        prompts = torch.cat([torch.zeros(1, 2, dtype=torch.long), prompts[:1, :17]], dim=1).repeat(2, 1)
        kwargs = dict(do_sample=True, temperature=0.9, num_return_sequences=2,
                      attention_mask=torch.tensor([[0, 0] + [1] * 17] * 2))  # fmt: skip
    kwargs.update(input_ids=prompts, max_new_tokens=10, min_new_tokens=10)
    torch.manual_seed(5)
    expected = model.generate(**kwargs, **{CACHE: _dynamic(model)})
    cache = PagedCache(model, block_size=8, max_cache_len=29)
    grow, sizes = cache._grow_for_planned_steps, []  # the pool's size before and after the growth
    cache._grow_for_planned_steps = lambda: (
        sizes.append(cache.pool.num_blocks),
        grow(),
        sizes.append(cache.pool.num_blocks),
    )
    torch.manual_seed(5)
    assert torch.equal(model.generate(**kwargs, **{CACHE: cache}), expected)
    # The prefill held its prompts' blocks only (3 a distinct prompt: 2 full blocks and a partial one, forked by the
    # copies); the pool grew once, at the first planned step, to what every step needs.
    assert sizes[:2] == [3 if mode == "padded-duplicates" else 6, cache.pool.num_blocks]
    assert sizes[2:] == [cache.pool.num_blocks] * (len(sizes) - 2)
    # Per prompt: its 2 full blocks once, and 4 copies x (ceil(29 / 8) - 2) = 8 own blocks: 2 x 10, where one row per
    # copy up to max_cache_len would take 8 x 4 = 32. Padded duplicates: one prompt of 17 real tokens (2 full blocks),
    # 4 copies x (ceil(27 / 8) - 2) = 8: 10 blocks, where a row per copy would take 4 x 4 = 16 (padding takes no slot).
    assert cache.pool.num_blocks == (10 if mode == "padded-duplicates" else 2 * (2 + 4 * 2))
    assert cache.peak_used_blocks <= cache.pool.num_blocks
    assert_cache_released(cache)


@needs_triton
def test_compiled_chunked_prefill_matches_dynamic_cache():
    """transformers compiles each chunk of a chunked prefill too (its ``_prefill`` takes the compiled call for a
    compileable cache). Those forwards are not planned ahead: the hook plans them behind graph breaks (eager
    backend here, several prompt and chunk lengths, so dynamo recompiles).

    Under torch 2.11 the column count get_seq_length reads is a symbolic int there, which dynamo cannot subtract a
    bool from; torch 2.13 keeps it a constant, so on the CPU this checks the tokens (``run_gpu.sh tests-cache`` runs
    it under the device image's torch)."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    config = CompileConfig(backend="eager", fullgraph=False, mode=None)
    config._compile_all_devices = True
    cache = PagedCache(model, block_size=8, max_cache_len=48)
    for length, chunk in ((9, 3), (14, 4), (11, 5)):
        ids = torch.arange(3, 3 + length).unsqueeze(0).repeat(2, 1)
        ids[1] = ids[1].flip(0)
        kwargs = dict(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, prefill_chunk_size=chunk)
        expected = model.generate(**kwargs, **{CACHE: _dynamic(model)})
        cache.reset()
        assert torch.equal(model.generate(**kwargs, compile_config=config, **{CACHE: cache}), expected)
    cache.reset()
    assert_cache_released(cache)
