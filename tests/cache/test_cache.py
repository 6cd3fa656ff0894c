"""PagedCache inside model.generate: token-identical to DynamicCache, shared blocks, prefix reuse, errors."""

import pytest
import torch
from helpers import assert_cache_released, needs_cuda
from models import FAMILIES, cache_kwarg, tiny_model
from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_paged import PagedCache

CACHE = cache_kwarg()

# Row 0 is left-padded: the batch exercises padding in the prompt and in the paged packing.
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 9, 11, 12, 13]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]])


def _generate(model, cache, **kwargs):
    kwargs.setdefault("input_ids", IDS)
    kwargs.setdefault("attention_mask", MASK)
    return model.generate(**kwargs, **{CACHE: cache})


def _dynamic(model):
    return DynamicCache(config=model.config)


def _reference_impl(family: str) -> str:
    # SDPA has no logit soft-cap; gemma2's reference is eager attention.
    return "eager" if family == "gemma2" else "sdpa"


@pytest.mark.parametrize("attn", ["paged", "sdpa"])
def test_opt_whose_head_calls_its_decoder_directly_matches_dynamic_cache(attn):
    """OPTForCausalLM calls ``model.decoder``, never ``model``: the cache's hook sits on the module that holds the
    decoder layers, so greedy and beam search (left padding, block boundaries) match DynamicCache."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                       word_embed_proj_dim=32, max_position_embeddings=128, pad_token_id=0)  # fmt: skip
    model = OPTForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    for kwargs in (dict(max_new_tokens=14), dict(max_new_tokens=6, num_beams=3)):
        expected = _generate(model, _dynamic(model), do_sample=False, **kwargs)
        cache = PagedCache(model, num_blocks=64, block_size=8)
        assert torch.equal(_generate(model, cache, do_sample=False, **kwargs), expected), kwargs


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attn", ["paged", "ref"])
def test_greedy_matches_dynamic_cache(family, attn):
    impl = _reference_impl(family) if attn == "ref" else "paged"
    model = tiny_model(family, attn=impl)
    expected = _generate(tiny_model(family, attn=_reference_impl(family)), _dynamic(model), max_new_tokens=24,
                         do_sample=False, min_new_tokens=24)  # fmt: skip
    cache = PagedCache(model, num_blocks=32, block_size=8)
    out = _generate(model, cache, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert torch.equal(out, expected)
    assert_cache_released(cache)


@pytest.mark.parametrize("attn", ["paged", "sdpa"])
def test_beam_search_matches_and_shares_blocks(attn):
    model = tiny_model("llama", attn=attn)
    kwargs = dict(max_new_tokens=64, min_new_tokens=64, num_beams=4, do_sample=False)
    expected = _generate(tiny_model("llama", attn="sdpa"), _dynamic(model), **kwargs)
    cache = PagedCache(model, num_blocks=256, block_size=16)
    out = _generate(model, cache, **kwargs)
    assert torch.equal(out, expected)
    report = cache.memory_report()
    # Copying beams costs one table's worth of blocks per beam; shared blocks are counted once.
    ratio = report.num_used_blocks / report.num_table_entries
    print(f"beam width 4, 64 new tokens: {report}; blocks used / copying beams = {ratio:.1%}")
    assert ratio < 0.60, report
    assert_cache_released(cache)


@pytest.mark.parametrize("attn", ["paged", "sdpa"])
def test_sampling_with_seed_matches_dynamic_cache(attn):
    model = tiny_model("qwen2", attn=attn)
    ref_model = tiny_model("qwen2", attn="sdpa")
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20, num_return_sequences=3)
    torch.manual_seed(123)
    expected = _generate(ref_model, _dynamic(model), **kwargs)
    cache = PagedCache(model, num_blocks=64, block_size=8)
    torch.manual_seed(123)
    out = _generate(model, cache, **kwargs)
    assert torch.equal(out, expected)
    assert_cache_released(cache)


def test_num_return_sequences_stores_prompt_once():
    model = tiny_model("llama")
    prompt = torch.arange(3, 3 + 40).unsqueeze(0)  # 40 tokens = 5 blocks of 8
    cache = PagedCache(model, num_blocks=64, block_size=8)
    seen = {}

    def after_first_forward(module, args, kwargs, output):
        seen.setdefault("report", cache.memory_report())

    handle = model.register_forward_hook(after_first_forward, with_kwargs=True)
    try:
        model.generate(input_ids=prompt, max_new_tokens=4, do_sample=True, num_return_sequences=4, **{CACHE: cache})
    finally:
        handle.remove()
    report = seen["report"]
    assert report.num_used_blocks == 5  # the prompt's blocks, once for all four sequences
    assert report.num_table_entries == 20
    assert_cache_released(cache)


def test_prefix_reuse_feeds_only_new_tokens():
    model = tiny_model("llama")
    system = list(range(10, 42))  # 32 tokens: 4 full blocks of 8
    first = torch.tensor([system + [50, 51, 52]])
    second = torch.tensor([system + [60, 61, 62, 63, 64]])
    cache = PagedCache(model, num_blocks=64, block_size=8)
    model.generate(input_ids=first, max_new_tokens=5, do_sample=False, **{CACHE: cache})
    lengths = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        out = model.generate(
            input_ids=second, attention_mask=torch.ones_like(second), max_new_tokens=6, do_sample=False,
            **{CACHE: cache.prepare(second)},
        )  # fmt: skip
    finally:
        handle.remove()
    assert lengths[0] == second.shape[1] - 32, lengths  # the 4 system blocks were not recomputed
    fresh = model.generate(input_ids=second, max_new_tokens=6, do_sample=False, **{CACHE: _dynamic(model)})
    assert torch.equal(out, fresh)
    assert cache.pool.stats.num_prefix_hit_tokens >= 32
    assert_cache_released(cache)


def test_prefix_hit_of_whole_prompt_still_computes_last_token():
    model = tiny_model("llama")
    prompt = torch.tensor([list(range(10, 34))])  # exactly 3 blocks of 8
    cache = PagedCache(model, num_blocks=32, block_size=8)
    first = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, **{CACHE: cache})
    again = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, **{CACHE: cache.prepare(prompt)})
    assert cache.get_seq_length() > 0
    assert torch.equal(first, again)
    assert_cache_released(cache)


def test_streamer_and_stopping_criteria():
    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.tolist())

        def end(self):
            self.chunks.append("end")

    class StopAfter(StoppingCriteria):
        def __init__(self, length):
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)

    model = tiny_model("mistral")
    prompt = IDS[1:]
    results = []
    for cache in (_dynamic(model), PagedCache(model, num_blocks=16, block_size=8)):
        streamer = Collect()
        out = model.generate(
            input_ids=prompt, max_new_tokens=30, do_sample=False, streamer=streamer,
            stopping_criteria=StoppingCriteriaList([StopAfter(prompt.shape[1] + 7)]), **{CACHE: cache},
        )  # fmt: skip
        results.append((out, streamer.chunks))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][0].shape[1] == prompt.shape[1] + 7
    assert results[0][1] == results[1][1]


def test_generation_config_defaults_work():
    model = tiny_model("llama")
    model.generation_config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=2)
    cache = PagedCache(model, num_blocks=16, block_size=8)
    out = model.generate(input_ids=IDS[1:], **{CACHE: cache})
    assert out.shape[1] <= IDS.shape[1] + 5


def test_pool_too_small_says_how_many_blocks():
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=2, block_size=8)
    with pytest.raises(MemoryError, match=r"needs up to \d+ blocks of 8 tokens, the pool has 2"):
        _generate(model, cache, max_new_tokens=4)


def test_pool_exhausted_during_decode_is_a_clear_error():
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=4, block_size=8)  # 2 rows x 16 tokens fit; 40 do not
    with pytest.raises(MemoryError, match="out of KV blocks"):
        _generate(model, cache, max_new_tokens=30, min_new_tokens=30)


def test_unsupported_models_get_a_named_error():
    import transformers

    config = transformers.T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    with pytest.raises(ValueError, match="'t5' is an encoder-decoder model"):
        PagedCache(transformers.T5ForConditionalGeneration(config), num_blocks=4)
    config = transformers.Qwen3NextConfig(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"'qwen3_next' has layers of type \['linear_attention'\]"):
        PagedCache(transformers.Qwen3NextForCausalLM(config), num_blocks=4)


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="block_size"):
        PagedCache(model, num_blocks=8, block_size=12)
    with pytest.raises(ValueError, match="memory_fraction"):
        PagedCache(model, memory_fraction=1.5)


def test_paged_attention_without_paged_cache_falls_back():
    model = tiny_model("llama", attn="paged")
    ref = tiny_model("llama", attn="sdpa")
    kwargs = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(**kwargs), ref.generate(**kwargs))


@pytest.mark.gpu
@needs_cuda("the Triton kernels inside generate")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_on_cuda_matches_sdpa(dtype):
    model = tiny_model("llama", attn="paged").to("cuda", dtype)
    ref = tiny_model("llama", attn="sdpa").to("cuda", dtype)
    kwargs = dict(
        input_ids=IDS.cuda(), attention_mask=MASK.cuda(), max_new_tokens=24, min_new_tokens=24, do_sample=False
    )
    expected = ref.generate(**kwargs, **{CACHE: _dynamic(ref)})
    cache = PagedCache(model, num_blocks=32, block_size=16)
    out = model.generate(**kwargs, **{CACHE: cache})
    if dtype == torch.float32:
        assert torch.equal(out, expected)
    else:  # bf16 rounding may flip a near-tie late in a random model; the start must agree
        assert torch.equal(out[:, : IDS.shape[1] + 4], expected[:, : IDS.shape[1] + 4])
        beams = dict(kwargs, num_beams=4)
        beam_cache = PagedCache(model, num_blocks=64, block_size=16)
        assert torch.equal(
            model.generate(**beams, **{CACHE: beam_cache}), ref.generate(**beams, **{CACHE: _dynamic(ref)})
        )
        assert_cache_released(beam_cache)
    assert_cache_released(cache)


def _record_contexts(cache: PagedCache) -> list:
    """Wrap ``cache._begin_forward`` to keep the context it plans for each forward."""
    contexts, begin = [], cache._begin_forward

    def recording_begin(*args, **kwargs):
        contexts.append(begin(*args, **kwargs))
        return contexts[-1]

    cache._begin_forward = recording_begin
    return contexts


@pytest.mark.parametrize("mode", ["samples", "beams"])
def test_decode_fast_path_plans_what_the_general_plan_does(monkeypatch, mode):
    """The decode hot path (kept block tables, one append per row) and the general plan build the same contexts:
    across block boundaries, copy-on-write of shared blocks, and beam search's reordered (forked) rows."""
    model = tiny_model("llama")
    kwargs = dict(max_new_tokens=20, min_new_tokens=20)
    kwargs.update(dict(do_sample=True, num_return_sequences=2) if mode == "samples" else dict(num_beams=3))
    fields = ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "max_query_len", "max_seq_len")
    decode = PagedCache._begin_decode
    num_fast = []

    def counting_decode(*args):
        ctx = decode(*args)
        num_fast.append(ctx is not None)
        return ctx

    monkeypatch.setattr(PagedCache, "_begin_decode", counting_decode)
    runs = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(PagedCache, "_begin_decode", lambda *args: None)
        cache = PagedCache(model, num_blocks=32, block_size=8)
        contexts = _record_contexts(cache)
        torch.manual_seed(5)
        out = _generate(model, cache, **kwargs)
        runs.append((out, [[getattr(ctx, f) for f in fields] for ctx in contexts]))
        assert_cache_released(cache)
    assert num_fast == [True] * 19  # every decode step of the first run took the hot path
    (out_fast, fast_ctx), (out_general, general_ctx) = runs
    assert torch.equal(out_fast, out_general) and len(fast_ctx) == len(general_ctx) == 20
    for step, (a, b) in enumerate(zip(fast_ctx, general_ctx, strict=True)):
        for name, x, y in zip(fields, a, b, strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (step, name, x, y)


def test_decode_steps_reuse_the_device_block_tables():
    """A decode step whose rows open no block reuses the last step's device block tables (and every decode step the
    same cu_seqlens_q); a step that opens one copies the new tables (the contexts above check their values)."""
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=32, block_size=8)
    contexts = _record_contexts(cache)
    _generate(model, cache, max_new_tokens=20, min_new_tokens=20)
    decode = contexts[1:]
    assert len(decode) == 19 and all(ctx.max_query_len == 1 for ctx in decode)
    assert all(ctx.cu_seqlens_q is decode[0].cu_seqlens_q for ctx in decode[1:])
    num_reused = 0
    for before, ctx in zip(contexts, decode, strict=False):
        same = ctx.block_tables.shape == before.block_tables.shape and torch.equal(
            ctx.block_tables, before.block_tables
        )
        if ctx.block_tables is before.block_tables:
            num_reused += 1
        else:
            assert not same  # copied only when a row opened a block
    assert num_reused >= 19 - 3 * len(IDS)  # 20 tokens of block size 8 open at most 3 blocks per row
    assert_cache_released(cache)


def test_paged_attention_that_a_layer_never_calls_is_refused():
    """A model set to attn_implementation="paged" whose first layer computes attention itself (as remote code or
    a family outside transformers' attention interface does): PagedCache refuses it at construction, naming the
    module, instead of letting generate run a layer that never reads the blocks."""
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn

    def own_attention(hidden_states, *args, **kwargs):
        return attention.o_proj(torch.zeros_like(hidden_states)), None

    attention.forward = own_attention
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: 1 of its 2 attention layers call .*\(LlamaAttention "):
        PagedCache(model, num_blocks=16, block_size=8)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda("the fused decode kernel"))])
def test_decode_steps_write_kv_in_the_attention_call(monkeypatch, device):
    """Eager decode with "paged" attention: update() leaves each layer's new K/V to the attention, which writes and
    attends; the cache's write_kv runs for the prefill only. On CUDA that is one decode launch a layer (the kernel
    writes them, slot_mapping): paged_attention for a step's first layer, its kept launch (DecodeBinding) for the
    others; on the CPU the attention writes them, then runs the decode reference over the table columns the longest
    row reaches. Tokens equal DynamicCache's, with left padding and across block boundaries."""
    from hf_paged.kernels.decode import DecodeBinding

    import hf_paged.cache.kv_update as kv_update_module
    import hf_paged.core.attention as attention_module

    model = tiny_model("llama").to(device)
    num_layers = model.config.num_hidden_layers
    calls = {"write_kv": 0, "fused": 0, "plain": 0, "cpu_write": 0, "cpu_decode": 0, "bound": 0}
    write_kv, paged_attention = kv_update_module.write_kv, attention_module.paged_attention
    attention_write_kv, paged_decode = attention_module.write_kv, attention_module.paged_decode

    def counting(name, function):
        def count(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return count

    def counting_attention(*args, **kwargs):
        calls["fused" if kwargs.get("slot_mapping") is not None else "plain"] += 1
        return paged_attention(*args, **kwargs)

    def counting_decode(*args, **kwargs):
        calls["cpu_decode"] += 1
        assert args[3].shape[1] == -(-args[6] // 8)  # the block table cut to the longest row's blocks
        return paged_decode(*args, **kwargs)

    monkeypatch.setattr(kv_update_module, "write_kv", counting("write_kv", write_kv))
    monkeypatch.setattr(attention_module, "write_kv", counting("cpu_write", attention_write_kv))
    monkeypatch.setattr(attention_module, "paged_attention", counting_attention)
    monkeypatch.setattr(attention_module, "paged_decode", counting_decode)
    bound_launch = DecodeBinding.launch

    def counting_bound(self, *args):
        out = bound_launch(self, *args)
        calls["bound"] += out is not None
        return out

    monkeypatch.setattr(DecodeBinding, "launch", counting_bound)
    cache = PagedCache(model, num_blocks=32, block_size=8)
    ids, mask = IDS.to(device), MASK.to(device)
    out = _generate(model, cache, input_ids=ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20,
                    do_sample=False)  # fmt: skip
    ref = tiny_model("llama", attn="sdpa").to(device)
    expected = _generate(ref, _dynamic(ref), input_ids=ids, attention_mask=mask, max_new_tokens=20,
                         min_new_tokens=20, do_sample=False)  # fmt: skip
    assert torch.equal(out, expected)
    decode = 19 * num_layers
    if device == "cuda":
        assert calls == {"write_kv": num_layers, "fused": 19, "plain": num_layers, "cpu_write": 0,
                         "cpu_decode": 0, "bound": decode - 19}, calls  # fmt: skip
    else:
        assert calls == {"write_kv": num_layers, "fused": 0, "plain": num_layers, "cpu_write": decode,
                         "cpu_decode": decode, "bound": 0}, calls  # fmt: skip
    assert_cache_released(cache)


def test_a_deferred_kv_write_no_attention_takes_is_still_written():
    """A layer's deferred K/V that no attention call takes is written by the next layer's update() or at the end of
    the forward (ForwardContext.flush_pending_kv): the pools never miss a token's K/V."""
    from hf_paged.core.context import ForwardContext, forward_context

    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=4, block_size=8)
    kv = cache.kv
    slots = torch.tensor([5, 9])
    ctx = ForwardContext(
        slot_mapping=slots, block_tables=torch.zeros(2, 1, dtype=torch.int32),
        seq_lens=torch.ones(2, dtype=torch.int32), cu_seqlens_q=torch.arange(3, dtype=torch.int32), max_query_len=1,
        max_seq_len=1, batch_size=2, query_len=1, owner=cache, defer_kv_write=True,
    )  # fmt: skip
    shape = (2, kv.num_kv_heads, 1, kv.head_dim)
    states = [torch.randn(shape, dtype=kv.k_cache[0].dtype) for _ in range(4)]
    with forward_context(ctx):
        cache.update(states[0], states[1], 0)
        assert ctx.pending_kv is not None and kv.k_cache[0].abs().sum() == 0  # deferred: not written yet
        cache.update(states[2], states[3], 1)  # layer 0's write was not taken: written now
        assert ctx.pending_kv[0] is kv.k_cache[1]
        ctx.flush_pending_kv()  # what the end of a forward does
    assert ctx.pending_kv is None
    for layer, (key, value) in enumerate([(states[0], states[1]), (states[2], states[3])]):
        flat_k = kv.k_cache[layer].view(-1, kv.num_kv_heads, kv.head_dim)
        flat_v = kv.v_cache[layer].view(-1, kv.num_kv_heads, kv.head_dim)
        assert torch.equal(flat_k[slots], key[:, :, 0]) and torch.equal(flat_v[slots], value[:, :, 0])


@pytest.mark.gpu
@needs_cuda("the kept decode launch (DecodeBinding) of eager decode steps")
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_kept_decode_launches_on_cuda_match_dynamic_cache(family):
    """An eager decode step's layers after the first repeat its kept launch (DecodeBinding): the tokens equal
    DynamicCache's (fp32), for Gemma2's sliding-window layers between global ones too (a layer of another kind takes
    the full path; Gemma2's soft-capped logits are compared with eager attention)."""
    model = tiny_model(family).to("cuda")
    kwargs = dict(input_ids=IDS.cuda(), attention_mask=MASK.cuda(), max_new_tokens=20, min_new_tokens=20,
                  do_sample=False)  # fmt: skip
    cache = PagedCache(model, num_blocks=32, block_size=8)
    out = _generate(model, cache, **kwargs)
    assert_cache_released(cache)
    ref = tiny_model(family, attn=_reference_impl(family)).to("cuda")
    assert torch.equal(out, _generate(ref, _dynamic(ref), **kwargs))
