"""ContinuousBatcher with an FP8 KV cache: the same tokens however the schedule runs (chunked prefill, preemption by
recompute and by swap, prefix hits: each moves or recomputes the same FP8 bytes), copy-on-write with n > 1, no
block leaks, and logits close to the model's-dtype engine."""

import pytest
import torch
from helpers import assert_engine_drained, needs_triton
from models import DEVICE, cache_kwarg
from models import tiny_model as _tiny_model

from hf_paged import ContinuousBatcher, PagedCache, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
NEW_TOKENS = [7, 20, 3, 30, 12, 16]


def tiny_model(*args, **kwargs):
    return _tiny_model(*args, device=DEVICE, **kwargs)


def _prompts(seed=1, lengths=(5, 17, 33, 8, 40, 23)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in lengths]


def _greedy(engine) -> list[list[int]]:
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in NEW_TOKENS]
    return [o.outputs[0].token_ids for o in engine.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module", params=["fp8", "fp8_e5m2"])
def kv_cache_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def reference(kv_cache_dtype):
    """The FP8 engine's greedy outputs with a pool that never preempts, each prompt in one step."""
    engine = ContinuousBatcher(tiny_model("llama"), block_size=8, num_blocks=64, max_num_batched_tokens=256,
                               kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    return _greedy(engine)


@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_batched_tokens=16, num_blocks=64),  # chunked prefill
        dict(max_num_batched_tokens=32, num_blocks=14),  # tiny pool: preemption by recompute
        dict(max_num_batched_tokens=32, num_blocks=14, preemption_mode="swap", swap_space_gb=0.01),
        dict(max_num_batched_tokens=32, num_blocks=14, async_scheduling=True),
    ],
    ids=["chunked", "preempt-recompute", "preempt-swap", "preempt-async"],
)
def test_greedy_is_the_same_under_chunking_and_preemption(reference, kv_cache_dtype, config):
    engine = ContinuousBatcher(tiny_model("llama"), block_size=8, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype,
                               **config)  # fmt: skip
    assert engine.kv.k_cache[0].element_size() == 1 and engine.kv.is_fp8
    assert _greedy(engine) == reference
    if config["num_blocks"] == 14:
        assert engine.metrics().num_preemptions > 0
        assert (engine.metrics().num_swapped_out_blocks > 0) == (config.get("preemption_mode") == "swap")
    assert_engine_drained(engine)


def test_graph_buckets_pass_the_scales(reference, kv_cache_dtype):
    """Every step through the padded static inputs of its CUDA-graph bucket (decode and mixed steps, emulated on the
    CPU): the static forward context carries the pool's scales too."""
    engine = ContinuousBatcher(tiny_model("llama"), block_size=8, num_blocks=14, max_num_batched_tokens=32,
                               max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    engine.runner.emulate_graphs = True
    assert _greedy(engine) == reference
    assert engine.runner.graph_steps["decode"] > 0 and engine.runner.graph_steps["mixed"] > 0
    assert_engine_drained(engine)


@needs_triton
@pytest.mark.parametrize("kv_cache_dtype", ["fp8"], scope="module")  # one format (both: tests/kernels/test_fp8_kv.py)
def test_engine_through_the_triton_kernels(reference, kv_cache_dtype, monkeypatch):
    """The engine's attention through the Triton kernels (interpreted on the CPU), as it runs on CUDA: the decode
    kernel's fused FP8 write (quantize in registers), write_kv's before prefill chunks, the prefill and decode reads
    (dequantize), preemption: the same tokens as through the torch references."""
    from hf_paged.kernels.cache_ops import write_kv_triton
    from hf_paged.kernels.decode import paged_decode_triton
    from hf_paged.kernels.prefill import paged_prefill_triton

    from hf_paged.core import attention as attention_module

    calls = []

    def triton_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_query_len=None,
                         max_seq_len=None, sliding_window=None, soft_cap=None, out=None, key=None, value=None,
                         prefix_len=None, max_prefix_len=None, slot_mapping=None, sinks=None, k_scale=None,
                         v_scale=None, **kwargs):  # fmt: skip
        calls.append((max_query_len == 1, slot_mapping is not None, k_scale is not None))
        if max_query_len == 1:
            return paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len,
                                       out=out, new_key=key if slot_mapping is not None else None,
                                       new_value=value if slot_mapping is not None else None,
                                       slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        return paged_prefill_triton(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                    max_query_len=max_query_len, max_seq_len=max_seq_len, out=out, key=key,
                                    value=value, k_scale=k_scale, v_scale=v_scale)  # fmt: skip

    monkeypatch.setattr(attention_module, "paged_attention", triton_attention)
    monkeypatch.setattr(attention_module, "write_kv", write_kv_triton)
    # The three shortest prompts, fewer tokens (the interpreter runs a program per token written), a 16-token budget
    # and a pool of 6 blocks: still a chunked prefill, fused decode writes and preemptions. Greedy tokens are the
    # reference's first ones.
    chosen, new_tokens = (0, 3, 1), (7, 16, 12)
    engine = ContinuousBatcher(tiny_model("llama"), block_size=8, num_blocks=6, max_num_batched_tokens=16,
                               max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in new_tokens]
    outputs = engine.generate([_prompts()[i] for i in chosen], params, use_tqdm=False)
    expected = [reference[i][:m] for i, m in zip(chosen, new_tokens, strict=True)]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert (True, True, True) in calls and (False, False, True) in calls  # fused decode writes, prefill reads
    assert all(has_scales for *_, has_scales in calls)
    assert engine.metrics().num_preemptions > 0
    assert_engine_drained(engine)


def test_engine_equals_paged_cache_generate(reference, kv_cache_dtype):
    """The engine and PagedCache write and read the same FP8 values: greedy outputs are equal."""
    model = tiny_model("llama")
    for prompt, new, expected in zip(_prompts(), NEW_TOKENS, reference, strict=True):
        cache = PagedCache(model, num_blocks=16, block_size=8, kv_cache_dtype=kv_cache_dtype)
        out = model.generate(input_ids=torch.tensor([prompt], device=model.device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, **{cache_kwarg(): cache})  # fmt: skip
        assert out[0, len(prompt) :].tolist() == expected


def test_prefix_hits_reuse_fp8_blocks(reference, kv_cache_dtype):
    engine = ContinuousBatcher(tiny_model("llama"), block_size=8, num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    prompt = _prompts()[4]  # 40 tokens
    params = SamplingParams(max_new_tokens=12, **GREEDY)
    first = engine.generate([prompt], params, use_tqdm=False)[0]
    computed = engine.metrics().num_computed_tokens
    second = engine.generate([prompt], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 32  # 4 full blocks; the last prompt token is always computed
    assert engine.metrics().num_computed_tokens - computed == 40 + 12 - 1 - 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == reference[4][:12]
    assert_engine_drained(engine)


def test_parallel_samples_copy_the_partial_fp8_block(kv_cache_dtype):
    engine = ContinuousBatcher(tiny_model("llama"), block_size=8, num_blocks=64, enable_prefix_caching=False,
                               kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    prompt = _prompts()[2]  # 33 tokens: 4 full blocks + 1 token
    rid = engine.add_request(prompt, SamplingParams(n=3, max_new_tokens=6, seed=0, ignore_eos=True))
    engine.step()
    assert engine.pool.stats.num_used_blocks == 5
    partial = engine.pool.get_block_table(engine.requests[rid].seqs[0].seq_id)[4]
    before = engine.kv.k_cache[0][partial].view(torch.uint8).clone()
    engine.step()  # two children copy the shared partial block (bit-exact), the last writes it in place
    assert engine.pool.stats.num_used_blocks == 5 + 2
    for seq in engine.requests[rid].seqs:
        block = engine.pool.get_block_table(seq.seq_id)[4]
        assert torch.equal(engine.kv.k_cache[0][block, :1].view(torch.uint8), before[:1])  # the prompt's token
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_drained(engine)


def test_logits_stay_close_to_the_models_dtype(kv_cache_dtype):
    """One prompt's first-token log-probabilities (same inputs in both engines) within the quantization error
    (tests/cache/test_fp8_cache.py says how the tolerances were chosen)."""
    atol = {"fp8": 0.05, "fp8_e5m2": 0.1}[kv_cache_dtype]
    params = SamplingParams(max_new_tokens=1, logprobs=20, **GREEDY)
    got, want = (
        ContinuousBatcher(tiny_model("llama"), block_size=8, num_blocks=32, kv_cache_dtype=d)
        .generate(_prompts()[4:5], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        for d in (kv_cache_dtype, "auto")
    )  # fmt: skip
    common = sorted(set(got) & set(want))
    assert len(common) >= 15
    assert max(abs(got[t] - want[t]) for t in common) <= atol


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_flag_reaches_the_engine_config(monkeypatch, command):
    from hf_paged.frontends import cli, cli_engine

    made = {}
    monkeypatch.setattr("hf_paged.ContinuousBatcher", lambda model, tokenizer, config: made.setdefault("c", config))
    prompt = ["hi"] if command == "generate" else []
    for flag, expected in (([], "auto"), (["--kv-cache-dtype", "fp8_e5m2"], "fp8_e5m2")):
        made.clear()
        args = cli.build_parser().parse_args([command, *flag, *prompt])
        assert cli_engine.make_engine(None, None, 8, args).kv_cache_dtype == expected
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'fp16' (choose from auto, fp8, ...)", status 2
        cli.build_parser().parse_args([command, "--kv-cache-dtype", "fp16", *prompt])


def test_bench_flag():
    from hf_paged.frontends import bench

    assert bench.parse_args([]).kv_cache_dtype == "auto"
    assert bench.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
