"""Attention sinks (gpt-oss) in ContinuousBatcher: greedy tokens equal transformers' generate with eager attention,
one prompt at a time, through whole-prompt and chunked prefill (mixed decode + prefill steps), a pool small enough
to preempt, async scheduling, shared-prefix (cascade) decode, and the Triton kernels (interpreted on the CPU).

A tiny random gpt-oss (tests/sink_models.py): sliding-window layers (window 8) alternate with full ones; every
prompt is longer than the window.
"""

import pytest
import torch
from helpers import assert_engine_drained, needs_triton
from models import DEVICE, cache_kwarg
from sink_models import SLIDING_WINDOW, tiny_gpt_oss
from transformers import DynamicCache

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.core import attention as attention_module

CACHE = cache_kwarg()
GREEDY = dict(temperature=0.0, ignore_eos=True)
NEW_TOKENS = [6, 16, 5, 6]  # the n=2 request (prompt 1) decodes alone at the end: shared-prefix steps


def _prompts():
    """Four prompts past the window; the last two share a 16-token (two-block) prefix."""
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, 96, (n,), generator=gen).tolist()  # noqa: E731
    prefix = ids(16)
    prompts = [ids(11), ids(23), prefix + ids(3), prefix + ids(6)]
    assert min(map(len, prompts)) > SLIDING_WINDOW
    return prompts


@pytest.fixture(scope="module")
def reference():
    """transformers' greedy tokens with eager attention (its gpt-oss sinks), one prompt at a time."""
    model = tiny_gpt_oss("eager", device=DEVICE)
    outs = []
    for prompt, new in zip(_prompts(), NEW_TOKENS, strict=True):
        cache = DynamicCache(config=model.config)
        out = model.generate(input_ids=torch.tensor([prompt], device=DEVICE), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, **{CACHE: cache})  # fmt: skip
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def _engine_tokens(**config) -> tuple[list[list[int]], object, list[int]]:
    """The engine's greedy tokens for the prompts, its metrics, and the shared-prefix length of each step with
    decode rows. ``cascade=True``: shared-prefix decode whenever two decode rows share a block (the tiny model's
    K/V are far below the bytes threshold), with the CUDA graphs' static inputs emulated on the CPU (padded rows,
    a static prefix_len, mixed steps' decode rows taking the decode path)."""
    cascade = config.pop("cascade", False)
    # No CUDA graphs: transformers' gpt-oss experts (torch._grouped_mm with host-side offsets, 5.17) copy from the
    # host during a capture, which CUDA refuses; the attention runs the same kernels eagerly.
    config = dict(block_size=8, max_num_seqs=4, cascade_attention=cascade, use_cuda_graphs=False) | config
    engine = ContinuousBatcher(tiny_gpt_oss("paged", device=DEVICE), **config)
    prefix_lens = []
    if cascade:
        engine.runner.cascade_min_saved_bytes = 0
        engine.runner.emulate_graphs = DEVICE != "cuda"
        choose = engine.runner._cascade_prefix_len

        def recording(plan, num_decode):
            prefix_len = choose(plan, num_decode)
            prefix_lens.append(prefix_len)
            return prefix_len

        engine.runner._cascade_prefix_len = recording
    # min_tokens: EOS is masked as generate's min_new_tokens masks it (the tiny model ranks it first at times)
    # n=2 on the 23-token prompt: two greedy rows on its two full blocks, shared until they finish
    params = [SamplingParams(max_new_tokens=n, min_tokens=n, n=2 if i == 1 else 1, **GREEDY)
              for i, n in enumerate(NEW_TOKENS)]  # fmt: skip
    outs = engine.generate(_prompts(), params, use_tqdm=False)
    metrics = engine.metrics()
    assert_engine_drained(engine)
    assert outs[1].outputs[0].token_ids == outs[1].outputs[1].token_ids
    return [o.outputs[0].token_ids for o in outs], metrics, prefix_lens


@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_batched_tokens=256, num_blocks=48),  # whole prompts in one step
        dict(max_num_batched_tokens=8, num_blocks=48, async_scheduling=True),  # chunks: mixed decode + prefill steps
        dict(max_num_batched_tokens=16, num_blocks=10),  # a tiny pool: preemption by recompute
        # shared-prefix decode on the full layers (the sliding ones take the plain decode), emulated graphs
        dict(max_num_batched_tokens=16, num_blocks=48, cascade=True),
    ],
    ids=["one-step", "chunked-async", "preempt", "cascade"],
)
def test_engine_greedy_equals_generate(reference, config):
    tokens, metrics, prefix_lens = _engine_tokens(**config)
    assert tokens == reference
    if config["num_blocks"] == 10:
        assert metrics.num_preemptions > 0
    if config.get("cascade"):
        assert max(prefix_lens) == 16  # the n=2 rows' two shared blocks


@needs_triton
def test_engine_through_the_triton_kernels(reference, monkeypatch):
    """The engine's attention through the Triton prefill and decode kernels (interpreted on the CPU): the fused K/V
    write of decode steps, the prefill kernel's chunks and the decode rows of mixed steps, all with the layer's
    sinks, give the same tokens."""
    from hf_paged.kernels import write_kv
    from hf_paged.kernels.decode import paged_decode_triton
    from hf_paged.kernels.prefill import paged_prefill_triton

    calls = []

    def triton_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_query_len=None,
                         max_seq_len=None, sliding_window=None, soft_cap=None, out=None, key=None, value=None,
                         prefix_len=None, max_prefix_len=None, slot_mapping=None, sinks=None, **kwargs):  # fmt: skip
        calls.append((max_query_len == 1, slot_mapping is not None, sinks is not None))
        if max_query_len == 1:
            return paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len,
                                       sliding_window=sliding_window, soft_cap=soft_cap, out=out,
                                       prefix_len=prefix_len, max_prefix_len=max_prefix_len, sinks=sinks,
                                       new_key=key if slot_mapping is not None else None,
                                       new_value=value if slot_mapping is not None else None,
                                       slot_mapping=slot_mapping)  # fmt: skip
        if slot_mapping is not None:
            write_kv(key, value, k_cache, v_cache, slot_mapping)
        return paged_prefill_triton(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                    max_query_len=max_query_len, max_seq_len=max_seq_len,
                                    sliding_window=sliding_window, soft_cap=soft_cap, out=out, key=key, value=value,
                                    sinks=sinks)  # fmt: skip

    monkeypatch.setattr(attention_module, "paged_attention", triton_attention)
    tokens, _, _ = _engine_tokens(max_num_batched_tokens=16, num_blocks=48)
    assert tokens == reference
    # (decode, fused write, sinks): fused decode steps and prefill / mixed steps (written before), all with sinks
    assert set(calls) == {(True, True, True), (False, False, True)}


def test_engine_graph_steps_with_sinks():
    """Sinks through the CUDA-graph steps (on the CPU their static inputs emulated): a tiny llama whose layers hold
    sink logits (gpt-oss's experts cannot be captured) gives, with graphs and shared-prefix decode, the tokens of
    "paged" attention's fallback under generate (which honours the sinks too)."""
    from models import tiny_model

    model = tiny_model("llama", device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        layer.self_attn.sinks = torch.nn.Parameter((2.0 * torch.randn(4, generator=gen)).to(DEVICE))
    expected = []
    for prompt, new in zip(_prompts(), NEW_TOKENS, strict=True):
        cache = DynamicCache(config=model.config)
        out = model.generate(input_ids=torch.tensor([prompt], device=DEVICE), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, **{CACHE: cache})  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    engine = ContinuousBatcher(model, block_size=8, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=16,
                               cascade_attention=True, use_cuda_graphs=DEVICE == "cuda")  # fmt: skip
    if DEVICE != "cuda":
        engine.runner.emulate_graphs = True
    engine.runner.cascade_min_saved_bytes = 0
    params = [SamplingParams(max_new_tokens=n, min_tokens=n, n=2 if i == 1 else 1, **GREEDY)
              for i, n in enumerate(NEW_TOKENS)]  # fmt: skip
    outs = engine.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.runner.num_cascade_steps > 0
    assert_engine_drained(engine)
