"""Shared-prefix (cascade) decode in the engine: the tokens and logprobs of the engine with it off, and without prefix
caching.

The runner finds the blocks every decode row of a step shares and passes their length to the attention; on the CPU
the decode reference then reads those keys through row 0's block table (as the kernels do), so a prefix claimed
wrongly (blocks that some row does not hold) changes the logprobs. The tiny models' K/V are a few hundred bytes a
token, far below the bytes threshold of a real model, so these engines set ``cascade_min_saved_bytes = 0``: cascade
runs whenever two decode rows share a block. The last test runs the Triton kernels (interpreted) in the engine.
"""

import numpy as np
import pytest
import torch
from helpers import assert_engine_drained, engine_outputs, needs_triton
from models import DEVICE
from models import tiny_model as _tiny_model

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.core import attention as attention_module
from hf_paged.core.planner import ForwardPlan, shared_prefix_blocks
from hf_paged.engine.model_runner import CASCADE_MIN_SAVED_BYTES

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=1)


def tiny_model(family="llama"):
    return _tiny_model(family, device=DEVICE)


def _engine(cascade: bool, graphs: bool = False, max_model_len: int | None = None, **config) -> ContinuousBatcher:
    config = {"block_size": 8, "num_blocks": 160, "max_num_seqs": 16, "max_num_batched_tokens": 256, **config}
    model = tiny_model(config.pop("family", "llama"))
    if max_model_len is not None:  # bounds the graphs' split grids (the interpreter runs every empty program too)
        model.config.max_position_embeddings = max_model_len
    engine = ContinuousBatcher(model, cascade_attention=cascade,
                               use_cuda_graphs=graphs and DEVICE == "cuda", **config)  # fmt: skip
    if graphs and DEVICE != "cuda":
        engine.runner.emulate_graphs = True  # the graphs' padded static inputs, prefix_len among them
    engine.runner.cascade_min_saved_bytes = 0
    prefix_lens = engine.prefix_lens = []  # the shared-prefix length of every step with decode rows (0: none)
    choose = engine.runner._cascade_prefix_len

    def recording(plan, num_decode):
        prefix_len = choose(plan, num_decode)
        if num_decode:
            prefix_lens.append(prefix_len)
        return prefix_len

    engine.runner._cascade_prefix_len = recording
    return engine


def _workload(seed=0):
    """Ten requests on one 43-token prefix (5 full blocks of 8, the prefix cache shares them), two ``n=3`` requests
    (their samples share the whole prompt, the partial block until copy-on-write), one unrelated request (no shared
    block while it runs)."""
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 96, (n,), generator=gen).tolist()  # noqa: E731
    prefix = ids(43)
    prompts = [prefix + ids(1 + i % 6) for i in range(10)] + [prefix + ids(3), ids(30), prefix + ids(12)]
    params = [SamplingParams(max_new_tokens=4 + (5 * i) % 11, **GREEDY) for i in range(10)]
    params += [
        SamplingParams(n=3, max_new_tokens=9, temperature=0.0, ignore_eos=True, logprobs=1),
        SamplingParams(max_new_tokens=6, **GREEDY),
        SamplingParams(n=3, max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logprobs=1),
    ]
    return prompts, params


def _assert_same(got, expected, tol=1e-4):
    """Same tokens; logprobs equal up to fp32 rounding (cascade sums the keys in another order)."""
    assert [[ids for ids, _ in r] for r in got] == [[ids for ids, _ in r] for r in expected]
    for r_got, r_exp in zip(got, expected, strict=True):
        for (_, lp_got), (_, lp_exp) in zip(r_got, r_exp, strict=True):
            assert lp_got == pytest.approx(lp_exp, rel=tol, abs=tol)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "graphs, config, arrive_every",
    [
        (False, {}, 0),  # whole prompts; eager decode steps
        (True, {}, 0),  # every step through its graph bucket's static inputs
        (True, {}, 2),  # arrivals: the shared prefix grows, shrinks and vanishes between steps
        (True, dict(max_num_batched_tokens=16), 1),  # chunked prefill: decode rows of mixed steps share it
        (False, dict(max_num_batched_tokens=16), 1),
    ],
    ids=["eager", "graphs", "graphs-arrivals", "graphs-chunked", "eager-chunked"],
)
def test_cascade_equals_cascade_off_and_no_prefix_cache(graphs, config, arrive_every, async_scheduling):
    prompts, params = _workload()
    on = _engine(True, graphs, async_scheduling=async_scheduling, **config)
    off = _engine(False, graphs, async_scheduling=async_scheduling, **config)
    no_cache = _engine(True, graphs, async_scheduling=async_scheduling, enable_prefix_caching=False, **config)
    expected = engine_outputs(off, prompts, params, arrive_every)
    _assert_same(engine_outputs(on, prompts, params, arrive_every), expected)
    _assert_same(engine_outputs(no_cache, prompts, params, arrive_every), expected)
    assert set(off.prefix_lens) == {0} and off.runner.num_cascade_steps == 0
    # The 5 blocks of the common prefix; none while the unrelated request decodes; the 6 prompt blocks of the last
    # request's samples once they decode alone.
    # (An eager mixed step sends its decode rows to the prefill kernel, without cascade: with chunks of 16 tokens,
    # the ten requests never decode in a step of their own.)
    chunked_eager = not graphs and config.get("max_num_batched_tokens") == 16
    assert ({0, 48} if chunked_eager else {0, 40, 48}) <= set(on.prefix_lens), on.prefix_lens
    assert on.runner.num_cascade_steps == sum(n > 0 for n in on.prefix_lens)
    # Without prefix caching only forks share blocks: those samples.
    assert set(no_cache.prefix_lens) == {0, 48}, no_cache.prefix_lens
    if graphs:  # a decode step replays the cascade graph of its batch size when its rows share a prefix, else the
        # plain one (no prefix kernel); the engine without cascade never the cascade graphs
        assert on.runner.graph_steps["cascade"] > 0, on.runner.graph_steps  # the decode steps share the prefix here
        assert off.runner.graph_steps["cascade"] == 0 < off.runner.graph_steps["decode"], off.runner.graph_steps
    for engine in (on, off, no_cache):
        assert_engine_drained(engine)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cascade_steps_with_the_fused_kv_write(graphs, monkeypatch):
    """Shared-prefix decode steps hand each layer's new K/V to the decode kernel
    too (every row's new token lies above the shared blocks), instead of a write_kv call first; tokens and logprobs
    equal the cascade-off engine's. (On CUDA the graphs replay without Python: there the captures are counted.)"""
    calls = {"write_kv": 0, "fused_with_prefix": 0}
    write_kv, paged_attention = attention_module.write_kv, attention_module.paged_attention

    def counting_write_kv(*args, **kwargs):
        calls["write_kv"] += 1
        return write_kv(*args, **kwargs)

    def counting_attention(*args, **kwargs):
        calls["fused_with_prefix"] += kwargs.get("slot_mapping") is not None and kwargs.get("prefix_len") is not None
        return paged_attention(*args, **kwargs)

    monkeypatch.setattr(attention_module, "write_kv", counting_write_kv)
    monkeypatch.setattr(attention_module, "paged_attention", counting_attention)
    prompts, params = _workload()
    expected = engine_outputs(_engine(False, graphs), prompts, params, 0)
    assert calls["fused_with_prefix"] == 0
    on = _engine(True, graphs)
    _assert_same(engine_outputs(on, prompts, params, 0), expected)
    assert calls["fused_with_prefix"] > 0 and on.runner.num_cascade_steps > 0, calls
    if graphs:
        assert on.runner.graph_steps["cascade"] > 0, on.runner.graph_steps
    assert_engine_drained(on)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_cascade_under_preemption(preemption_mode):
    """A pool too small for the batch: requests are preempted and readmitted (their tables rebuilt, swapped blocks
    back in other ids) while the others decode over the shared prefix."""
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, 96, (n,), generator=gen).tolist()  # noqa: E731
    prefix = ids(24)  # 3 blocks; each request then needs about 5 blocks of its own: 8 of them do not fit 24
    prompts = [prefix + ids(6 + 2 * i) for i in range(8)]
    params = [SamplingParams(max_new_tokens=18 + i, **GREEDY) for i in range(8)]
    config = dict(num_blocks=24, max_num_batched_tokens=32, max_num_seqs=8, preemption_mode=preemption_mode,
                  swap_space_gb=0.01)  # fmt: skip
    on, off = _engine(True, True, **config), _engine(False, True, **config)
    _assert_same(engine_outputs(on, prompts, params), engine_outputs(off, prompts, params))
    assert on.metrics().num_preemptions > 0 and 24 in on.prefix_lens
    assert_engine_drained(on)
    assert_engine_drained(off)


def test_sliding_window_and_soft_cap_families():
    """gemma2 (sliding-window layers take the plain decode, global ones the cascade; soft cap) and mistral (every
    layer windowed: cascade is found but no layer uses it)."""
    prompts, params = _workload(seed=2)
    for family in ("gemma2", "mistral"):
        on, off = _engine(True, True, family=family), _engine(False, True, family=family)
        _assert_same(engine_outputs(on, prompts, params), engine_outputs(off, prompts, params))
        assert any(on.prefix_lens)


def test_default_threshold_is_the_bytes_model():
    """Cascade runs when (decode rows - 1) x prefix tokens x K/V bytes a token reach the threshold."""
    engine = _engine(True)
    runner = engine.runner
    bytes_per_token = 2 * 2 * 16 * 4  # K and V x 2 KV heads x head_dim 16 x fp32: the tiny llama's
    assert runner._kv_bytes_per_token == bytes_per_token
    assert CASCADE_MIN_SAVED_BYTES == 64 << 20
    tables = np.array([[4, 7, 9, 1], [4, 7, 2, 0], [4, 7, 3, 5]], dtype=np.int32)
    seq_lens = np.array([30, 20, 25], dtype=np.int32)  # 2 shared blocks of 8: a 16-token prefix
    plan = ForwardPlan(np.zeros(3, np.int64), np.zeros(3, np.int64), tables, seq_lens, np.arange(4, dtype=np.int32),
                       np.arange(3), 1, 30)  # fmt: skip
    saved = (3 - 1) * 16 * bytes_per_token
    choose = type(runner)._cascade_prefix_len
    runner.cascade_min_saved_bytes = saved
    assert choose(runner, plan, 3) == 16
    runner.cascade_min_saved_bytes = saved + 1
    assert choose(runner, plan, 3) == 0
    runner.cascade_min_saved_bytes = 0
    assert choose(runner, plan, 1) == 0  # one row shares nothing with anyone
    runner.cascade_attention = False
    assert choose(runner, plan, 3) == 0


def test_shared_prefix_blocks():
    tables = np.array([[4, 7, 9, 1, 6], [4, 7, 9, 2, 6], [4, 7, 9, 1, 6]], dtype=np.int32)
    assert shared_prefix_blocks(tables, np.array([40, 40, 40]), 8) == 3
    assert shared_prefix_blocks(tables[[0, 2]], np.array([40, 33]), 8) == 5  # equal to the end of both tables
    # Entries past a row's blocks are stale: row 1 has 2 blocks (16 tokens), so at most 2 count.
    assert shared_prefix_blocks(tables[[0, 2]], np.array([40, 16]), 8) == 2
    assert shared_prefix_blocks(tables, np.array([40, 17, 40]), 8) == 3
    assert shared_prefix_blocks(tables[:1], np.array([40]), 8) == 0  # one row
    assert shared_prefix_blocks(np.array([[1, 7], [2, 7]], dtype=np.int32), np.array([16, 16]), 8) == 0  # 1st differs


@needs_triton
def test_engine_with_the_triton_decode_kernels(monkeypatch):
    """The engine's decode attention through the Triton kernels (interpreted on the CPU): the runner's tables, the
    static prefix_len of the graphs and the mixed steps' decode rows, against the cascade-off engine."""
    from hf_paged.kernels.decode import paged_decode_triton

    original = attention_module.paged_attention

    def triton_decode(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_query_len=None,
                      max_seq_len=None, sliding_window=None, soft_cap=None, out=None, prefix_len=None,
                      max_prefix_len=None, **kwargs):  # fmt: skip
        if max_query_len != 1:
            return original(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                            max_query_len=max_query_len, max_seq_len=max_seq_len, sliding_window=sliding_window,
                            soft_cap=soft_cap, out=out, **kwargs)  # fmt: skip
        fused = kwargs.get("slot_mapping") is not None  # a plain decode step: the kernel writes the new K/V
        return paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len,
                                   sliding_window=sliding_window, soft_cap=soft_cap, out=out, prefix_len=prefix_len,
                                   max_prefix_len=max_prefix_len, new_key=kwargs["key"] if fused else None,
                                   new_value=kwargs["value"] if fused else None,
                                   slot_mapping=kwargs["slot_mapping"] if fused else None)  # fmt: skip

    gen = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 96, (n,), generator=gen).tolist()  # noqa: E731
    prefix = ids(20)
    prompts = [prefix + ids(1 + i) for i in range(3)] + [prefix + ids(2)]
    params = [SamplingParams(max_new_tokens=3 + i, **GREEDY) for i in range(3)]
    params.append(SamplingParams(n=2, max_new_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1))
    config = dict(max_num_batched_tokens=16, max_num_seqs=4, num_blocks=48)
    expected = engine_outputs(_engine(False, True, 64, **config), prompts, params, 1)
    monkeypatch.setattr(attention_module, "paged_attention", triton_decode)
    on = _engine(True, True, 64, **config)
    _assert_same(engine_outputs(on, prompts, params, 1), expected)
    assert any(on.prefix_lens)
    assert on.runner.graph_steps["cascade"] > 0, on.runner.graph_steps  # the decode steps share the prefix here
