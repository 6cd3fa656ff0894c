"""Every step through a graph bucket: padded static inputs give the same tokens as the eager engine.

On CUDA (``HF_PAGED_TEST_DEVICE=cuda``, benchmarks/run_gpu.sh) the engine captures and replays real CUDA graphs,
decode and mixed. On the CPU there is no capture; ``runner.emulate_graphs`` runs each step eagerly through the
same padded static inputs its graph would read (padding tokens of no sequence, empty padding sequences, padded
logits rows, double-buffered staging), which is what can go wrong in the bucketing.
"""

import pytest
import torch
from helpers import assert_engine_drained, engine_outputs, needs_triton, route_prefill_through_triton
from models import DEVICE
from models import tiny_model as _tiny_model

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.engine.compile import resolve_compile_mode
from hf_paged.engine.config import COMPILE_ENV, auto_compile_mode

GREEDY = dict(temperature=0.0, ignore_eos=True)
_REAL_COMPILE = torch.compile
ON_CUDA = "runs on CUDA with HF_PAGED_TEST_DEVICE=cuda (benchmarks/run_gpu.sh tests)"


def tiny_model(family="llama"):
    return _tiny_model(family, device=DEVICE)


def _engine(model, graphs: bool, **config) -> ContinuousBatcher:
    engine = ContinuousBatcher(model, use_cuda_graphs=graphs and DEVICE == "cuda", block_size=8, **config)
    if graphs and DEVICE != "cuda":
        engine.runner.emulate_graphs = True
    runs = {"decode": 0, "mixed": 0, "eager": 0}
    run_static, execute = engine.runner._run_static, engine.runner.execute

    def counting_static(bucket, *args):
        runs[bucket[0]] += 1
        return run_static(bucket, *args)

    def counting_execute(sched, *args):
        before = runs["decode"] + runs["mixed"]
        out = execute(sched, *args)
        if out is not None and runs["decode"] + runs["mixed"] == before:
            runs["eager"] += 1
        return out

    engine.runner._run_static, engine.runner.execute = counting_static, counting_execute
    engine.bucket_runs = runs
    return engine


def _workload(seed=3):
    """Uneven prompts, two sharing a 24-token prefix (prefix hits), one whose whole prompt is cached."""
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 96, (n,), generator=gen).tolist()  # noqa: E731
    prefix = ids(24)
    prompts = [ids(5), ids(37), prefix + ids(9), ids(1), prefix + ids(3), ids(20), prefix, prefix, ids(61)]
    # logprobs: a wrong attention row shifts them long before it flips a greedy token of a tiny random model.
    params = [SamplingParams(max_new_tokens=m, logprobs=1, **GREEDY) for m in (9, 14, 6, 20, 11, 3, 8, 5, 12)]
    params[5] = SamplingParams(n=3, max_new_tokens=7, temperature=1.0, seed=11, ignore_eos=True, logprobs=1)  # forks
    return prompts, params


def _assert_same(got, expected):
    """Same tokens; logprobs equal up to float rounding (the padded batch changes the reduction shapes)."""
    assert [[ids for ids, _ in r] for r in got] == [[ids for ids, _ in r] for r in expected]
    tol = 1e-4 if DEVICE == "cpu" else 1e-3  # CUDA: decode rows may take another kernel (another fp32 summation order)
    for r_got, r_exp in zip(got, expected, strict=True):
        for (_, lp_got), (_, lp_exp) in zip(r_got, r_exp, strict=True):
            if lp_exp is not None:
                assert lp_got == pytest.approx(lp_exp, rel=tol, abs=tol)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "config, arrive_every",
    [
        (dict(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=96), 0),  # chunked prefill, mixed steps
        (dict(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=96), 2),  # arrivals: a prompt in most steps
        (dict(max_num_batched_tokens=24, max_num_seqs=6, num_blocks=14), 1),  # tiny pool: preemption
        (
            dict(max_num_batched_tokens=24, max_num_seqs=6, num_blocks=14, preemption_mode="swap", swap_space_gb=0.01),
            1,
        ),  # swapped out, not recomputed (a small swap space: its default 4 GB of CPU memory is zeroed per engine)
        (dict(max_num_batched_tokens=256, max_num_seqs=16, num_blocks=96), 0),  # whole prompts, steps above buckets
    ],
    ids=["chunked", "arrivals", "preempt-recompute", "preempt-swap", "large-steps"],
)
def test_graph_steps_equal_eager(config, arrive_every, async_scheduling):
    prompts, params = _workload()
    eager = _engine(tiny_model(), graphs=False, async_scheduling=async_scheduling, **config)
    graphs = _engine(tiny_model(), graphs=True, async_scheduling=async_scheduling, **config)
    expected = engine_outputs(eager, prompts, params, arrive_every)
    _assert_same(engine_outputs(graphs, prompts, params, arrive_every), expected)
    runs = graphs.bucket_runs
    assert runs["decode"] > 0 and runs["mixed"] > 0, runs
    if config["max_num_batched_tokens"] <= 32:
        assert runs["eager"] == 0, runs  # every step fits a bucket
    if config["num_blocks"] == 14:
        assert graphs.metrics().num_preemptions > 0
    assert eager.bucket_runs["decode"] == eager.bucket_runs["mixed"] == 0
    assert_engine_drained(graphs)
    assert_engine_drained(eager)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen3"])  # sliding windows, soft caps, q/k norms
def test_graph_steps_other_families(family):
    prompts, params = _workload(seed=5)
    config = dict(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=96)
    expected = engine_outputs(_engine(tiny_model(family), graphs=False, **config), prompts, params, 2)
    engine = _engine(tiny_model(family), graphs=True, **config)
    _assert_same(engine_outputs(engine, prompts, params, 2), expected)
    assert engine.bucket_runs["mixed"] > 0 and engine.bucket_runs["eager"] == 0
    assert_engine_drained(engine)


def test_beam_search_through_graph_buckets_equals_eager():
    prompts, _ = _workload(seed=7)
    config = dict(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=128)
    params = SamplingParams(beam_width=3, max_new_tokens=10)
    expected = engine_outputs(_engine(tiny_model(), graphs=False, **config), prompts[:3], [params] * 3)
    engine = _engine(tiny_model(), graphs=True, **config)
    _assert_same(engine_outputs(engine, prompts[:3], [params] * 3), expected)
    assert engine.bucket_runs["mixed"] > 0
    assert_engine_drained(engine)


@pytest.mark.parametrize("graphs, cascade", [(False, False), (True, False), (True, True)],
                         ids=["eager", "graphs", "graphs-cascade"])  # fmt: skip
def test_decode_steps_write_kv_in_the_decode_kernel_call(graphs, cascade, monkeypatch):
    """The engine's decode steps hand each layer's new K/V to the decode kernel (paged_attention's slot_mapping: one
    launch a layer; shared-prefix (cascade) decode steps too); prefill and mixed steps write them with write_kv
    first. Every layer of every forward writes exactly once, either way, and tokens and logprobs equal those of a
    separate write (write_kv, then attention over the pools: emulated by wrapping paged_attention), with forks
    (copy-on-write), prefix hits, arrivals and preemption. With cascade on, a decode step replays the plain (fused)
    decode graph unless its rows share a prefix, then the "cascade" graph."""
    import hf_paged.core.attention as attention_module
    from hf_paged.core.context import get_forward_context

    calls = {"write_kv": 0, "fused": 0, "layers": 0}
    separate_write = [True]
    write_kv, paged_attention = attention_module.write_kv, attention_module.paged_attention
    context_attention = attention_module._context_attention

    def counting_write_kv(*args, **kwargs):
        calls["write_kv"] += 1
        return write_kv(*args, **kwargs)

    def counting_attention(*args, **kwargs):
        if separate_write[0] and kwargs.get("slot_mapping") is not None:  # write first, then attend over the pools
            counting_write_kv(kwargs["key"], kwargs["value"], args[1], args[2], kwargs["slot_mapping"])
            kwargs.update(key=None, value=None, slot_mapping=None)
        calls["fused"] += kwargs.get("slot_mapping") is not None
        return paged_attention(*args, **kwargs)

    def counting_layer(*args, **kwargs):
        ctx = get_forward_context()
        calls["layers"] += ctx is not None and ctx.paged  # a layer of a paged forward (not the start-up probe's)
        return context_attention(*args, **kwargs)

    monkeypatch.setattr(attention_module, "write_kv", counting_write_kv)
    monkeypatch.setattr(attention_module, "paged_attention", counting_attention)
    monkeypatch.setattr(attention_module, "_context_attention", counting_layer)
    prompts, params = _workload()
    # A tiny pool (preemption); layers not compiled, so that the counters see every eager call (on CUDA a replayed
    # graph runs no Python: there only the eager engine is counted, and the graphs' tokens compared).
    config = dict(max_num_batched_tokens=24, max_num_seqs=6, num_blocks=14, cascade_attention=cascade,
                  compile_model=False)  # fmt: skip

    def make_engine():
        engine = _engine(tiny_model(), graphs=graphs, **config)
        engine.runner.cascade_min_saved_bytes = 0  # cascade whenever two decode rows share a block (tiny K/V)
        return engine

    expected = engine_outputs(make_engine(), prompts, params, 1)
    assert calls["fused"] == 0 and calls["write_kv"] == calls["layers"] > 0, calls  # (on CUDA graphs: the captures)
    separate_write[0] = False
    calls.update(write_kv=0, fused=0, layers=0)
    engine = make_engine()
    _assert_same(engine_outputs(engine, prompts, params, 1), expected)
    assert engine.metrics().num_preemptions > 0
    assert_engine_drained(engine)
    assert (engine.runner.num_cascade_steps > 0) == cascade
    if graphs and DEVICE == "cuda":
        return
    assert calls["write_kv"] + calls["fused"] == calls["layers"], calls  # one write a layer a forward
    num_layers = engine.runner.model.config.num_hidden_layers
    assert calls["fused"] > 0 and calls["write_kv"] > 0, calls  # decode steps fused; prefills, mixed, cascade not
    runs = engine.runner.graph_steps
    if graphs:  # the decode graphs (plain and cascade) write in the decode kernel; the mixed graphs with write_kv
        assert calls["fused"] == (runs["decode"] + runs["cascade"]) * num_layers, (calls, runs)
        assert runs["decode"] > 0 and runs["mixed"] > 0, runs  # (the cascade graphs: tests/test_engine_cascade.py)
    else:
        assert sum(runs.values()) == 0, runs


def test_graph_bucket_is_the_smallest_that_holds_the_step():
    engine = _engine(tiny_model(), graphs=True, max_num_batched_tokens=100, max_num_seqs=6, num_blocks=32)
    runner = engine.runner
    assert runner.decode_sizes == [1, 2, 4, 6] and runner.mixed_sizes == [16, 32, 64, 100]
    assert runner.graph_bucket(num_seqs=5, num_tokens=5, num_sampling=5) == ("decode", 6)
    assert runner.graph_bucket(num_seqs=5, num_tokens=5, num_sampling=4) == ("mixed", 16)  # a chunk's last-but-one
    assert runner.graph_bucket(num_seqs=3, num_tokens=40, num_sampling=3) == ("mixed", 64)
    assert runner.bucket_shape(("mixed", 64)) == (64, 6) and runner.bucket_shape(("mixed", 16)) == (16, 6)
    runner.emulate_graphs = runner.use_cuda_graphs = False
    assert runner.graph_bucket(num_seqs=3, num_tokens=40, num_sampling=3) is None  # eager when graphs are off


ON_CUDA_ONLY = pytest.mark.skipif(
    DEVICE != "cuda",
    reason="compile_model applies on CUDA only: " + ON_CUDA,
)


@ON_CUDA_ONLY
@pytest.mark.parametrize("mode", ["layers", "full"])
def test_compiled_steps_equal_eager(mode):
    """compile_model="layers" (each decoder layer compiled in place) and "full": the eager engine's tokens and
    logprobs."""
    prompts, params = _workload(seed=9)
    config = dict(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=96)
    expected = engine_outputs(_engine(tiny_model(), graphs=True, **config), prompts, params, 2)
    model = tiny_model()
    engine = _engine(model, graphs=True, compile_model=mode, **config)
    assert engine.runner.compile_mode == mode
    _assert_same(engine_outputs(engine, prompts, params, 2), expected)
    assert engine.bucket_runs["mixed"] > 0 and engine.bucket_runs["decode"] > 0
    compiled = [m for m in model.modules() if getattr(m, "_hf_paged_compiled", False)]
    assert len(compiled) == (2 if mode == "layers" else 0), len(compiled)  # the tiny model's 2 decoder layers
    assert_engine_drained(engine)


@pytest.mark.parametrize(
    ("env", "expected"),
    [(None, "layers"), ("", "layers"), ("layers", "layers"), ("FULL", "full"), ("0", False), ("off", False)],
)
def test_auto_compile_mode_reads_the_environment(monkeypatch, env, expected):
    """compile_model=None resolves through $HF_PAGED_COMPILE: unset means "layers"; a mode or an "off" word."""
    if env is None:
        monkeypatch.delenv(COMPILE_ENV, raising=False)
    else:
        monkeypatch.setenv(COMPILE_ENV, env)
    assert auto_compile_mode() == expected


def test_auto_compile_mode_refuses_an_unknown_value(monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "fastest")
    with pytest.raises(ValueError, match=r"\$HF_PAGED_COMPILE must be one of .*got 'fastest'"):
        auto_compile_mode()


def test_compile_model_setting_resolves_to_a_mode(monkeypatch):
    """None compiles the layers on CUDA with graphs, nothing without graphs or on the CPU; True means "full"."""
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_compile_mode(None, True, cuda) == "layers"
    assert resolve_compile_mode(None, False, cuda) is None
    assert resolve_compile_mode(True, False, cuda) == "full"
    assert resolve_compile_mode("layers", True, cuda) == "layers"
    assert resolve_compile_mode(False, True, cuda) is None
    assert resolve_compile_mode("full", True, cpu) is None and resolve_compile_mode(None, True, cpu) is None
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert resolve_compile_mode(None, True, cuda) is None


def test_default_compile_mode_is_layers_on_cuda_and_eager_on_cpu(monkeypatch):
    """compile_model=None compiles the layers on one CUDA device (the test run's default is eager: conftest) and
    nothing on the CPU."""
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    engine = _engine(tiny_model(), graphs=True, num_blocks=32, max_num_batched_tokens=32, max_num_seqs=4)
    assert engine.runner.compile_mode == ("layers" if DEVICE == "cuda" else None)
    assert not engine.runner.compiled_modules or DEVICE == "cuda"


@ON_CUDA_ONLY
def test_failed_default_compile_falls_back_to_eager(monkeypatch):
    """A compile error under the default setting warns and leaves an eager engine with the same outputs."""
    monkeypatch.delenv(COMPILE_ENV, raising=False)

    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("inductor could not compile this")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    prompts, params = _workload(seed=9)
    config = dict(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=96)
    model = tiny_model()
    with pytest.warns(UserWarning, match="torch.compile of the model's layers failed"):
        engine = _engine(model, graphs=True, **config)
    assert engine.runner.compile_mode is None and not any("forward" in vars(m) for m in model.modules())
    monkeypatch.setattr(torch, "compile", _REAL_COMPILE)
    expected = engine_outputs(_engine(tiny_model(), graphs=True, compile_model=False, **config), prompts, params, 2)
    _assert_same(engine_outputs(engine, prompts, params, 2), expected)
    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.raises(RuntimeError, match="inductor could not compile"):  # asked for explicitly: no fallback
        _engine(tiny_model(), graphs=True, compile_model="layers", **config)


@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="CUDA graphs are captured on CUDA only: " + ON_CUDA,
)
def test_no_garbage_collection_while_capturing(monkeypatch):
    """A collection inside a capture can free an unreachable engine's CUDA graphs, whose reset invalidates the
    capture ("operation failed due to a previous error during capture"): the collector is off during every
    capture, back on after."""
    import contextlib
    import gc

    seen = []
    graph_capture = torch.cuda.graph

    @contextlib.contextmanager
    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        with graph_capture(*args, **kwargs) as g:
            yield g

    monkeypatch.setattr(torch.cuda, "graph", recording)
    engine = _engine(tiny_model(), graphs=True, num_blocks=32, max_num_batched_tokens=32, max_num_seqs=4)
    assert seen and not any(seen), seen  # one entry per captured bucket
    assert len(seen) == len(engine.runner._graphs) and gc.isenabled()


def test_block_tables_gather_rows_follow_taken_and_freed_rows():
    """gather keeps the last step's row indices while its sequence ids repeat; a row taken or freed drops them."""
    from hf_paged.core.planner import BlockTables

    tables = BlockTables(max_blocks_per_seq=4, num_rows=4)
    tables.apply([(1, 0, [10]), (2, 0, [20, 21]), (3, 0, [30])])  # rows: 1->0, 2->1, 3->2
    assert tables.gather([2, 3]).tolist() == [[20, 21], [30, 0]]
    tables.apply([(2, 2, [22])])  # an append: same rows, wider table
    assert tables.gather([2, 3]).tolist() == [[20, 21, 22], [30, 0, 0]]
    # Sequence 2 freed (preempted) and back with new blocks in the same step's diffs: free rows 1 then 0, so it
    # takes row 0, while row 1 still holds its old blocks. Same ids as the last gather, other rows.
    tables.apply([(2, 0, None), (1, 0, None), (2, 0, [40])])
    assert tables.gather([2, 3]).tolist() == [[40], [30]]


def test_placeholder_indices_are_reused_only_while_equal():
    """The runner's placeholder index tensors come back for an equal list of placeholders, never for another."""
    runner = ContinuousBatcher(tiny_model(), num_blocks=16, block_size=8).runner
    prev = torch.tensor([100, 101, 102], device=DEVICE)
    for placeholders, expected in [
        ([(0, 0), (2, 1)], [100, 7, 101]),
        ([(0, 0), (2, 1)], [100, 7, 101]),  # equal: reused
        ([(0, 1), (2, 0)], [101, 7, 100]),  # same length and first entry, other rows
        ([(1, 2)], [-1, 102, -1]),
    ]:
        input_ids = torch.tensor([-1, 7 if len(placeholders) == 2 else -1, -1], device=DEVICE)
        runner._fill_placeholders(input_ids, placeholders, prev)
        assert input_ids.tolist() == expected


@needs_triton
@pytest.mark.parametrize("spare_slots", [0, 16], ids=["tile-map", "bound-grid"])
def test_engine_with_the_triton_prefill_kernel(monkeypatch, spare_slots):
    """The engine's prefill and mixed-step attention through the Triton prefill kernel (interpreted on the CPU): the
    runner's padded mixed inputs (decode rows as empty leading sequences, padding sequences and tokens) in the exact
    tile map's grid (no spare slot: programs loop over the slots of a step's several chunks) and in the bound grid,
    with chunked prefill and prefix hits, against the reference engine."""
    prompts, params = _workload()
    config = dict(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=96)
    # All at once: mixed steps carry several chunks (a prompt's tail, whole short prompts, prefix hits).
    expected = engine_outputs(_engine(tiny_model(), graphs=True, **config), prompts, params, 0)
    launches = route_prefill_through_triton(monkeypatch, spare_slots)
    engine = _engine(tiny_model(), graphs=True, **config)
    _assert_same(engine_outputs(engine, prompts, params, 0), expected)
    assert engine.bucket_runs["mixed"] > 0, engine.bucket_runs
    seqs_pads = [pad for _, pad in launches]
    assert seqs_pads and (any(seqs_pads) if spare_slots == 0 else not any(seqs_pads)), seqs_pads
    assert_engine_drained(engine)
