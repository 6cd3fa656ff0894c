"""ContinuousBatcher on tiny random models: equal to model.generate, shared blocks, preemption, bad input."""

import pytest
import torch
from helpers import assert_engine_drained
from models import DEVICE, cache_kwarg, char_tokenizer, tiny_falcon
from models import tiny_model as _tiny_model
from transformers import DynamicCache

from hf_paged import ContinuousBatcher, SamplingParams

CACHE = cache_kwarg()
_ASYNC = {"on": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def scheduling_mode(request):
    """Every engine test runs with async scheduling off and on (the host one step ahead of the device)."""
    _ASYNC["on"] = request.param
    yield request.param


def make_engine(*args, **kwargs) -> ContinuousBatcher:
    return ContinuousBatcher(*args, async_scheduling=_ASYNC["on"], **kwargs)


def tiny_model(*args, **kwargs):
    return _tiny_model(*args, device=DEVICE, **kwargs)


GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(seed=1, lengths=(5, 17, 33, 8, 40, 23)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in lengths]


NEW_TOKENS = [7, 20, 3, 30, 12, 16]


def _hf_greedy(model, prompt, max_new_tokens):
    out = model.generate(
        input_ids=torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, **{CACHE: DynamicCache(config=model.config)},
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference():
    """HF greedy outputs of the mixed batch, one request at a time."""
    model = tiny_model("llama", attn="sdpa")
    return [_hf_greedy(model, p, m) for p, m in zip(_prompts(), NEW_TOKENS, strict=True)]


def _drive(engine) -> dict:
    """step() until the engine is idle; the last output of each request by id (each finished one is returned once)."""
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not (out.request_id in last and last[out.request_id].finished), "a finished request came back"
            last[out.request_id] = out
    return last


@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_batched_tokens=256, num_blocks=64),  # whole prompts in one step
        dict(max_num_batched_tokens=16, num_blocks=64),  # chunked prefill
        dict(max_num_batched_tokens=16, num_blocks=64, enable_prefix_caching=False),
        dict(max_num_batched_tokens=32, num_blocks=14),  # tiny pool: preemption by recompute
        dict(max_num_batched_tokens=32, num_blocks=14, preemption_mode="swap", swap_space_gb=0.01),
    ],
    ids=["one-step", "chunked", "no-prefix-cache", "preempt-recompute", "preempt-swap"],
)
def test_greedy_equals_model_generate(reference, config):
    engine = make_engine(tiny_model("llama"), block_size=8, max_num_seqs=8, **config)
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in NEW_TOKENS]
    outs = engine.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    if config["num_blocks"] == 14:
        assert engine.metrics().num_preemptions > 0
        assert (engine.metrics().num_swapped_out_blocks > 0) == (config.get("preemption_mode") == "swap")
    assert_engine_drained(engine)


def test_prefix_cache_hits_are_not_recomputed(reference):
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=64)
    prompt = _prompts()[4]  # 40 tokens
    first = engine.generate([prompt], SamplingParams(max_new_tokens=12, **GREEDY), use_tqdm=False)[0]
    computed = engine.metrics().num_computed_tokens
    second = engine.generate([prompt], SamplingParams(max_new_tokens=12, **GREEDY), use_tqdm=False)[0]
    assert second.num_cached_tokens == 32  # 4 full blocks; the last prompt token is always computed
    assert engine.metrics().num_computed_tokens - computed == 40 + 12 - 1 - 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == reference[4]
    assert_engine_drained(engine)


def test_parallel_sampling_computes_prompt_once_and_shares_blocks():
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=64, enable_prefix_caching=False)
    prompt = _prompts()[4]  # 40 tokens = 5 full blocks
    rid = engine.add_request(prompt, SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
    engine.step()  # the prompt, then 4 samples forked from it
    assert len(engine.get_output(rid).outputs) == 4
    assert engine.metrics().num_computed_tokens == 40
    stats = engine.pool.stats
    assert stats.num_used_blocks == 5 and stats.num_table_entries == 4 * 5  # 4 sequences, one copy of the prompt
    engine.step()  # each child writes its first token into a new block: no copy needed for full blocks
    assert engine.pool.stats.num_used_blocks == 5 + 4
    out = _drive(engine)[rid]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_engine_drained(engine)


def test_parallel_sampling_copies_only_the_partial_block():
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=64, enable_prefix_caching=False)
    prompt = _prompts()[2]  # 33 tokens: 4 full blocks + 1 token
    rid = engine.add_request(prompt, SamplingParams(n=3, max_new_tokens=4, seed=0, ignore_eos=True))
    engine.step()
    assert engine.pool.stats.num_used_blocks == 5
    engine.step()  # two children copy the shared partial block, the last writes it in place
    assert engine.pool.stats.num_used_blocks == 5 + 2
    assert _drive(engine)[rid].finished
    assert_engine_drained(engine)


def test_seeded_sampling_is_reproducible_across_batches():
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    alone = make_engine(tiny_model("llama"), block_size=8, num_blocks=64).generate(
        [prompts[1]], params, use_tqdm=False
    )[0]
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=64)
    together = engine.generate(prompts, [SamplingParams(max_new_tokens=10, temperature=1.0)] * 1 + [params] + [
        SamplingParams(max_new_tokens=5, temperature=1.0)] * 4, use_tqdm=False)  # fmt: skip
    assert together[1].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_hf_beam_search(width):
    model = tiny_model("llama", attn="sdpa")
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=128)
    for prompt in _prompts(lengths=(9, 21)):
        expected = model.generate(
            input_ids=torch.tensor([prompt], device=DEVICE), max_new_tokens=12, num_beams=width, do_sample=False,
            **{CACHE: DynamicCache(config=model.config)},
        )[0, len(prompt) :].tolist()  # fmt: skip
        out = engine.generate([prompt], SamplingParams(beam_width=width, max_new_tokens=12), use_tqdm=False)[0]
        got = out.outputs[0].token_ids
        assert got == expected[: len(got)] and all(t == model.config.pad_token_id for t in expected[len(got) :])
    assert_engine_drained(engine)


def test_beam_search_shares_blocks():
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=128)
    rid = engine.add_request(_prompts()[4], SamplingParams(beam_width=4, max_new_tokens=20))
    peak_used, peak_entries = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.pool.stats
        if stats.num_used_blocks > peak_used:
            peak_used, peak_entries = stats.num_used_blocks, stats.num_table_entries
    assert peak_used < 0.6 * peak_entries, (peak_used, peak_entries)  # vs a copy of every block per beam
    assert rid not in engine.requests  # returned by step(), then forgotten
    assert_engine_drained(engine)


def test_text_prompts_chat_messages_and_stop_strings():
    tok = char_tokenizer()
    engine = make_engine(tiny_model("llama"), tokenizer=tok, block_size=8, num_blocks=64)
    plain = engine.generate("hello there", SamplingParams(max_new_tokens=20, **GREEDY), use_tqdm=False)[0]
    text = plain.outputs[0].text
    assert len(text) == 20 and plain.prompt_token_ids == tok("hello there")["input_ids"]
    stop = text[8:10]
    stopped = engine.generate("hello there", SamplingParams(max_new_tokens=20, stop=[stop], **GREEDY), use_tqdm=False)[
        0
    ].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    chat = [{"role": "user", "content": "hi"}]
    out = engine.generate([chat], SamplingParams(max_new_tokens=3, **GREEDY), use_tqdm=False)[0]
    expected = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out.prompt_token_ids == list(expected)
    deltas = list(engine.stream("hello there", SamplingParams(max_new_tokens=20, **GREEDY)))
    assert "".join(d.text for d in deltas) == text and deltas[-1].finish_reason == "length"
    assert_engine_drained(engine)


def test_stop_token_ids_min_tokens_and_logprobs():
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=64)
    prompt = _prompts()[1]
    free_run = engine.generate([prompt], SamplingParams(max_new_tokens=15, **GREEDY), use_tqdm=False)[0]
    tokens = free_run.outputs[0].token_ids
    stop_id = tokens[5]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=15, stop_token_ids=[stop_id], **GREEDY),
                          use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == tokens[: tokens.index(stop_id) + 1]
    params = SamplingParams(max_new_tokens=15, stop_token_ids=[stop_id], min_tokens=14, logprobs=3, **GREEDY)
    out = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 14 and stop_id not in out.token_ids[:14]
    assert len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert token in lp and len(lp) >= 3 and all(v <= 0 for v in lp.values())
    assert_engine_drained(engine)


def test_abort_mid_stream_frees_blocks_and_others_finish(reference):
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=64)
    prompts = _prompts()
    keep = engine.add_request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS[0], **GREEDY))
    drop = engine.add_request(prompts[3], SamplingParams(max_new_tokens=30, **GREEDY))
    for _ in range(4):
        engine.step()
    used = engine.pool.stats.num_used_blocks
    engine.abort(drop)
    assert engine.pool.stats.num_used_blocks < used
    assert engine.get_output(drop).outputs[0].finish_reason == "abort"
    outs = _drive(engine)
    assert outs[drop].finished and outs[drop].outputs[0].finish_reason == "abort"  # reported by the next step
    assert outs[keep].outputs[0].token_ids == reference[0]
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        engine.abort("nope")
    assert_engine_drained(engine)


def test_bad_input_is_rejected_while_others_complete(reference):
    model = tiny_model("llama")
    engine = make_engine(model, block_size=8, num_blocks=32)
    prompts = _prompts()
    ok = engine.add_request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS[0], **GREEDY))
    engine.step()
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=r"token id 96 is outside the vocabulary \[0, 96\)"):
        engine.add_request([5, 96], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model's context of 512 tokens"):
        engine.add_request(prompts[0], SamplingParams(max_new_tokens=600))
    with pytest.raises(ValueError, match="but the whole pool has 32"):
        engine.add_request(prompts[4], SamplingParams(max_new_tokens=300))
    with pytest.raises(ValueError, match="`top_p` must be in"):
        engine.add_request(prompts[0], SamplingParams(top_p=1.5))
    with pytest.raises(TypeError, match="a prompt must be a list of token ids"):
        engine.add_request(3.5, SamplingParams())
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.add_request("text without tokenizer", SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompts[1], SamplingParams(), request_id=ok)
    assert _drive(engine)[ok].outputs[0].token_ids == reference[0]
    assert_engine_drained(engine)


def test_max_num_seqs_default_is_resolved_by_the_card(monkeypatch):
    from types import SimpleNamespace

    from hf_paged.engine.config import EngineConfig, default_max_num_seqs

    assert EngineConfig().max_num_seqs is None  # resolved by the engine, where the model's device is known
    assert EngineConfig().resolved("cpu").max_num_seqs == 256
    assert EngineConfig(max_num_batched_tokens=32).resolved("cpu").max_num_seqs == 32  # never above the budget
    assert EngineConfig(max_num_seqs=48).resolved("cuda").max_num_seqs == 48  # a set value stays
    engine = make_engine(tiny_model("llama"), num_blocks=8)
    expected = default_max_num_seqs(DEVICE, 2048)  # 256 on the CPU; by the card on CUDA (the GPU test run)
    assert DEVICE != "cpu" or expected == 256
    assert engine.config.max_num_seqs == engine.scheduler.max_num_seqs == engine.runner.max_num_seqs == expected
    assert engine.inputs.max_num_seqs == expected
    # CUDA cards, faked: 512 from LARGE_CARD_GIB of memory on (an H100's 79.1 GiB), 256 below (a 24 GiB card)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for gib, expected in ((79.1, 512), (140.0, 512), (70.0, 512), (69.9, 256), (24.0, 256)):
        props = SimpleNamespace(total_memory=int(gib * 2**30))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, p=props: p)
        assert default_max_num_seqs("cuda", 2048) == expected, gib
        assert default_max_num_seqs(torch.device("cuda", 1), 2048) == expected, gib
        assert default_max_num_seqs("cuda", 300) == min(expected, 300), gib
        assert EngineConfig().resolved("cuda:0").max_num_seqs == expected, gib
    assert default_max_num_seqs("cpu", 2048) == 256
    assert default_max_num_seqs(None, 2048) == 256


def test_engine_rejects_bad_configuration():
    with pytest.raises(ValueError, match="`max_num_seqs` \\(64\\) must not exceed `max_num_batched_tokens` \\(32\\)"):
        make_engine(tiny_model("llama"), num_blocks=8, max_num_batched_tokens=32, max_num_seqs=64)
    with pytest.raises(ValueError, match=r"`preemption_mode` must be one of \('recompute', 'swap'\), got 'drop'"):
        make_engine(tiny_model("llama"), num_blocks=8, preemption_mode="drop")
    with pytest.raises(ValueError, match="`block_size` must be a positive multiple of 8"):
        make_engine(tiny_model("llama"), num_blocks=8, block_size=4)
    for bad in ("yes", 1, "modules"):
        with pytest.raises(
            ValueError, match=r"`compile_model` must be None \(auto\), False, True, or one of \('layers',"
        ):
            make_engine(tiny_model("llama"), num_blocks=8, compile_model=bad)


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2"])
def test_other_families_greedy_equals_model_generate(family):
    ref_model = tiny_model(family, attn="eager" if family == "gemma2" else "sdpa")
    engine = make_engine(tiny_model(family), block_size=8, num_blocks=64, max_num_batched_tokens=16)
    prompts = _prompts(lengths=(21, 6))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=14, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(ref_model, prompt, 14)
    assert_engine_drained(engine)


def test_warmup_forward_writes_nothing_to_the_pool():
    """The start-up dummy prefill (run on CUDA) must leave every block as it was."""
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=16)
    for k in engine.kv.k_cache + engine.kv.v_cache:
        k.normal_()
    before = [t.clone() for t in engine.kv.k_cache + engine.kv.v_cache]
    engine.runner.warmup(40)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.kv.k_cache + engine.kv.v_cache, strict=True))
    assert_engine_drained(engine)


def test_close_drains_and_the_engine_still_serves(reference):
    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=64)
    prompt = _prompts()[0]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS[0], **GREEDY))
    engine.step()
    engine.close()  # the step in flight is processed; graphs (CUDA) are freed
    assert not engine.runner.use_cuda_graphs
    assert _drive(engine)[rid].outputs[0].token_ids == reference[0]
    assert_engine_drained(engine)


def test_generate_freezes_the_heap_it_found_for_the_call(monkeypatch):
    """generate() runs with the objects alive at its start frozen (a full collection then skips the engine's static
    heap) and unfreezes them when it returns or raises. A freeze made before the call is folded into the call's and
    undone with it, never a reason to skip it; with the collector disabled nothing is frozen; an engine dropped after
    its calls is still collected."""
    import gc
    import weakref

    engine = make_engine(tiny_model("llama"), block_size=8, num_blocks=64)
    during = []
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: during.append(gc.get_freeze_count()) or schedule())
    prompts, params = _prompts(), [SamplingParams(max_new_tokens=m, **GREEDY) for m in NEW_TOKENS]
    gc.freeze()  # a freeze made before the call (here ours; on the card also the image's)
    try:
        before = gc.get_freeze_count()
        first = engine.generate(prompts, params, use_tqdm=False)
        # frozen throughout (the heap alive at the start: the engine, the model, pytest; thousands of objects), and
        # the one permanent generation is emptied after the call
        assert during and min(during) > 1000 and gc.get_freeze_count() == 0
        assert before > 1000
    finally:
        gc.unfreeze()
    during.clear()
    second = engine.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
    assert min(during) > 1000 and gc.get_freeze_count() == 0  # nothing frozen before: the same
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, 10_000]], params[:1], use_tqdm=False)
    assert gc.get_freeze_count() == 0
    gc.disable()  # the caller turned the collector off: nothing to spare it, nothing frozen
    try:
        during.clear()
        engine.generate(prompts, params, use_tqdm=False)
        assert during and max(during) == 0
    finally:
        gc.enable()
    assert_engine_drained(engine)
    ref = weakref.ref(engine)
    monkeypatch.undo()  # the schedule wrapper holds the engine
    engine = schedule = None
    gc.collect()
    assert ref() is None


def _tiny_bloom():
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4)).eval()


@pytest.mark.parametrize("family", ["falcon", "bloom"])
def test_a_model_whose_attention_ignores_paged_is_refused(family):
    """Falcon and BLOOM (ALiBi) compute attention themselves, so attn_implementation="paged" never reaches them: the
    engine would attend over the packed batch without the past K/V (Falcon: wrong tokens; BLOOM: a crash deep in
    its ALiBi). It refuses at construction, naming the module."""
    model, name = (tiny_falcon(), "Falcon") if family == "falcon" else (_tiny_bloom(), "Bloom")
    with pytest.raises(ValueError, match=rf"{name}ForCausalLM: 0 of its 2 attention layers call .*{name}Attention"):
        ContinuousBatcher(model, num_blocks=16, block_size=8)


def test_every_layer_of_a_supported_model_reaches_paged():
    from hf_paged.core.support import paged_attention_callers

    model = tiny_model("llama")
    assert len(paged_attention_callers(model)) == model.config.num_hidden_layers
    from transformers import AttentionInterface

    from hf_paged.core.attention import paged_attention_forward

    assert AttentionInterface._global_mapping["paged"] is paged_attention_forward  # the probe put it back


def test_opt_greedy_equals_generate_under_preemption():
    """OPT (learned positions with an offset, a head that calls its decoder directly): the engine's greedy tokens
    equal model.generate's for each prompt, with a pool small enough to preempt."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                       word_embed_proj_dim=32, max_position_embeddings=128, pad_token_id=0)  # fmt: skip
    model = OPTForCausalLM(config).eval()
    prompts = [[5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 9, 11, 12, 13, 14, 15], [20, 21, 22], list(range(30, 47))]
    expected = [
        model.generate(input_ids=torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p) :]
        for p in prompts
    ]
    engine = ContinuousBatcher(model, num_blocks=9, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e.tolist() for e in expected]
    assert engine.metrics().num_preemptions > 0
    assert_engine_drained(engine)
