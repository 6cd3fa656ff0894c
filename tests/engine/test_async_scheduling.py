"""Async scheduling: the host schedules step N+1 before it reads step N's tokens back.

What can go wrong: an input id that never reaches the device (a placeholder fed to the model), a token
sampled after a stop token leaking into the output, a length limit overshot by the step in flight, an
aborted or preempted sequence whose in-flight token is applied to the wrong place, blocks never freed.
Every test compares against the same engine with async scheduling off, and ends with a leak check.
"""

import pytest
import torch
from helpers import assert_engine_drained
from models import DEVICE
from models import tiny_model as _tiny_model

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.engine.sampler import plan_rows

GREEDY = dict(temperature=0.0, ignore_eos=True)


def tiny_model(*args, **kwargs):
    return _tiny_model(*args, device=DEVICE, **kwargs)


def _prompts(seed=1, lengths=(5, 17, 33, 8, 40, 23)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in lengths]


def _engine(async_scheduling: bool, **kwargs) -> ContinuousBatcher:
    torch.manual_seed(0)  # same random weights for both engines
    kwargs = dict(block_size=8, num_blocks=64) | kwargs
    return ContinuousBatcher(tiny_model("llama"), async_scheduling=async_scheduling, **kwargs)


def _drive(engine) -> dict:
    """step() until idle; the last output of each request by id."""
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert all(t >= 0 for c in out.outputs for t in c.token_ids)  # no placeholder ever leaks out
            last[out.request_id] = out
    return last


def _run(engine, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params, use_tqdm=False)]


def test_steps_are_deferred_and_placeholders_never_leak():
    engine = _engine(True)
    prompts = _prompts()[:2]
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=4, **GREEDY)) for p in prompts]
    assert engine.step() == []  # the prompts are queued and sampled on the device; nothing is read back yet
    assert all(engine.get_output(r).outputs[0].token_ids == [] for r in rids)
    outs = engine.step()  # step 2 is queued (its inputs read on the device), then step 1 is processed
    assert sorted(o.request_id for o in outs) == sorted(rids)
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)  # step 2's tokens are still in flight
    last = _drive(engine)
    got = [last[r].outputs[0].token_ids for r in rids]
    assert [[g] for g in got] == _run(_engine(False), prompts, SamplingParams(max_new_tokens=4, **GREEDY))
    # 2 prompts + 3 decode steps of 2 tokens each: the step in flight at the length limit computes nothing more
    assert engine.metrics().num_computed_tokens == sum(map(len, prompts)) + 3 * 2
    assert_engine_drained(engine)


def test_stop_token_discards_the_token_computed_after_it():
    prompt = _prompts()[1]
    free_run = _run(_engine(False), [prompt], SamplingParams(max_new_tokens=15, **GREEDY))[0][0]
    stop_id = free_run[5]
    params = SamplingParams(max_new_tokens=15, stop_token_ids=[stop_id], **GREEDY)
    sync, eager = _engine(False), _engine(True)
    expected = _run(sync, [prompt], params)[0][0]
    out = eager.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected == free_run[: free_run.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # The step after the stop token was already queued: one token computed and thrown away.
    assert eager.metrics().num_computed_tokens == sync.metrics().num_computed_tokens + 1
    assert eager.metrics().num_generated_tokens == sync.metrics().num_generated_tokens
    assert_engine_drained(eager)


def test_mixed_requests_equal_the_synchronous_engine():
    """Plain samples run deferred; penalties, min_tokens, n > 1 and beams force their steps to be processed at once."""
    prompts = _prompts()
    params = [
        SamplingParams(max_new_tokens=9, temperature=0.9, top_k=20, seed=1, ignore_eos=True),
        SamplingParams(
            max_new_tokens=12, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True
        ),  # fmt: skip
        SamplingParams(max_new_tokens=7, temperature=1.0, n=3, seed=2, ignore_eos=True),
        SamplingParams(max_new_tokens=6, beam_width=2),
        SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.8, min_tokens=4, seed=3, logprobs=2),
        SamplingParams(max_new_tokens=16, **GREEDY),
    ]
    for budget in (512, 16):  # whole prompts, then chunked prefill mixing with decode
        expected = _run(_engine(False, max_num_batched_tokens=budget), prompts, params)
        engine = _engine(True, max_num_batched_tokens=budget)
        assert _run(engine, prompts, params) == expected
        assert_engine_drained(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_tokens_in_flight_equals_the_synchronous_engine(mode):
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in (7, 20, 3, 30, 12, 16)]
    config = dict(num_blocks=14, max_num_batched_tokens=32, max_num_seqs=8, preemption_mode=mode, swap_space_gb=0.01)
    expected = _run(_engine(False, **config), prompts, params)
    engine = _engine(True, **config)
    assert _run(engine, prompts, params) == expected
    assert engine.metrics().num_preemptions > 0
    assert_engine_drained(engine)


def test_abort_with_a_token_in_flight_drops_it_and_reports_the_request_once():
    prompts = _prompts()
    engine = _engine(True)
    keep = engine.add_request(prompts[0], SamplingParams(max_new_tokens=8, **GREEDY))
    drop = engine.add_request(prompts[3], SamplingParams(max_new_tokens=30, **GREEDY))
    for _ in range(3):
        engine.step()
    engine.abort(drop)  # its third token is in flight
    out = engine.get_output(drop).outputs[0]
    assert out.finish_reason == "abort" and len(out.token_ids) == 2
    outs = engine.step()  # the aborted request's row of the step in flight is dropped
    assert [o.outputs[0].token_ids for o in outs if o.request_id == drop] == [out.token_ids]  # reported once
    last = _drive(engine)
    assert drop not in last
    got = last[keep].outputs[0].token_ids
    assert got == _run(_engine(False), [prompts[0]], SamplingParams(max_new_tokens=8, **GREEDY))[0][0]
    assert_engine_drained(engine)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_sampling_rows_are_reused_only_while_the_step_sequences_stay_the_same(async_scheduling, mixed):
    """The engine reuses a step's sampler rows for the next step while the step's sequences are the same; a finish,
    an abort or a preemption keeps the rows of the sequences that stay, an admission rebuilds them. The sampler
    always gets the rows (and the row plan) a rebuild would give, and the outputs equal those of an engine that
    rebuilds them every step."""
    prompts = _prompts()
    config = dict(num_blocks=14, max_num_batched_tokens=32, max_num_seqs=8)  # a small pool: preemptions

    def run(reuse: bool):
        engine = _engine(async_scheduling, **config)
        launch, sampling_rows, sample = engine._launch, engine._sampling_rows, engine.sampler
        record = {"rebuilt": [], "changed": [], "joined": [], "key": None, "sampled": set()}

        def checked_launch(sched, logits, *args):
            if not reuse:
                engine._rows = None
            key = (list(sched.seq_ids), list(sched.sample_idx))
            sampled = {sched.seq_ids[i] for i in sched.sample_idx}
            record["changed"].append(key != record["key"])
            record["joined"].append(key != record["key"] and not sampled <= record["sampled"])
            record["key"], record["sampled"] = key, sampled
            record["sched"] = sched
            return launch(sched, logits, *args)

        def counted_sampling_rows(sched):
            record["rebuilt"].append(len(record["changed"]) - 1)
            return sampling_rows(sched)

        def checked_sample(logits, params, outputs, prompts_, generators, eos_token_ids, plan):
            fresh = sampling_rows(record["sched"])
            assert (params, outputs, prompts_, generators) == (fresh.params, fresh.outputs, fresh.prompts,
                                                               fresh.generators)  # fmt: skip
            assert engine._rows is None or engine._rows.seqs == fresh.seqs
            if plan is not None:
                assert plan == plan_rows(fresh.params, fresh.generators, logits.device)
            return sample(logits, params, outputs, prompts_, generators, eos_token_ids, plan)

        engine._launch, engine._sampling_rows, engine.sampler = checked_launch, counted_sampling_rows, checked_sample
        lengths = (3, 9, 20, 30, 12)
        # mixed: greedy and seeded sampling rows, with and without logprobs (the kept rows' plan is remapped)
        kinds = [dict(temperature=0.8, seed=3, logprobs=2), dict(logprobs=1), dict(top_k=7, seed=5), {}]
        rids = [
            engine.add_request(p, SamplingParams(max_new_tokens=m, **(GREEDY | (kinds[i % 4] if mixed else {}))))
            for i, (p, m) in enumerate(zip(prompts[:5], lengths, strict=True))
        ]
        last = {}
        for step in range(200):
            if step == 5:
                engine.abort(rids[1])
            if step == 8:
                rids.append(engine.add_request(prompts[5], SamplingParams(max_new_tokens=6, **GREEDY)))
            last |= {o.request_id: o for o in engine.step()}
            if not engine.has_unfinished_requests():
                break
        assert_engine_drained(engine)
        outputs = {r: (last[r].outputs[0].token_ids, last[r].outputs[0].logprobs) for r in rids}
        return outputs, record, engine.metrics().num_preemptions

    outputs, record, num_preemptions = run(reuse=True)
    changed = [i for i, c in enumerate(record["changed"]) if c]
    joined = [i for i, j in enumerate(record["joined"]) if j]
    assert record["rebuilt"] == joined  # rebuilt exactly when a sequence joined the step's sampling ones
    assert len(joined) < len(changed)  # rows kept (taken) when some only left: finishes, an abort, preemptions
    assert len(changed) < len(record["changed"]) / 2  # and reused as they are on most steps
    assert num_preemptions > 0
    assert outputs == run(reuse=False)[0]


def test_stream_delivers_every_token_once():
    prompt = _prompts()[2]
    params = SamplingParams(max_new_tokens=11, **GREEDY)
    engine = _engine(True)
    deltas = list(engine.stream(prompt, params))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == _run(_engine(False), [prompt], params)[0][0]
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert_engine_drained(engine)


def test_to_device_copies_the_host_buffer_and_converts_the_dtype():
    """Host staging must not alias the caller's buffer: the engine reuses its numpy arrays every step."""
    import numpy as np

    from hf_paged.core.transfer import to_device

    cpu = torch.device("cpu")
    buf = np.arange(4, dtype=np.int64)
    for dtype in (torch.int64, torch.int32):
        t = to_device(buf, dtype, cpu)
        buf[0] = 99
        assert t.dtype == dtype and t.tolist() == [0, 1, 2, 3]
        buf[0] = 0
    assert to_device([0.5, 1.0], torch.float32, cpu).tolist() == [0.5, 1.0]
    assert to_device([True, False], torch.bool, cpu).dtype == torch.bool
    assert to_device([], torch.int64, cpu).numel() == 0
