"""Several devices: accelerate's device_map, and tensor parallelism (tp_plan="auto") on 2 CPU processes (gloo)."""

import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp
from helpers import HANG_TIMEOUT_S, assert_engine_drained
from models import tiny_model
from transformers import AutoModelForCausalLM, DynamicCache

from hf_paged import ContinuousBatcher, PagedCache, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 53)), [3, 4], list(range(40, 61))]
NEW = [9, 5, 14, 7]


def _greedy_engine(model, **kwargs):
    engine = ContinuousBatcher(model, block_size=8, num_blocks=64, max_num_batched_tokens=24, **kwargs)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in NEW]
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    assert_engine_drained(engine)
    return [o.outputs[0].token_ids for o in outs]


SHARED = [list(range(60, 84)) + tail for tail in ([5, 6], [7, 8, 9], [10], [11, 12, 13, 14])]  # 3 shared blocks


def _shared_prefix_greedy(model, cascade: bool) -> tuple[list[list[int]], int]:
    """Greedy tokens of four prompts on one 24-token prefix, and the steps that ran the shared-prefix decode."""
    engine = ContinuousBatcher(model, block_size=8, num_blocks=64, cascade_attention=cascade)
    engine.runner.cascade_min_saved_bytes = 0  # every decode step whose rows share a block reads it once
    params = SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True)
    outs = engine.generate(SHARED, params, use_tqdm=False)
    assert_engine_drained(engine)
    return [o.outputs[0].token_ids for o in outs], engine.runner.num_cascade_steps


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny_model("llama", attn="sdpa").save_pretrained(path)
    return str(path)


def test_a_model_with_device_map_hooks_matches_the_plain_model(saved_model):
    """accelerate's dispatch hooks on every layer (what device_map installs across GPUs; on the CPU every
    device is "cpu", so transformers would skip them: they are attached here directly)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    plain = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="paged")
    mapped = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="paged")
    for module in (mapped.model.embed_tokens, *mapped.model.layers, mapped.model.norm, mapped.lm_head):
        add_hook_to_module(module, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    # The top-level hook moves every input to the first device; logits_to_keep must stay where lm_head is.
    add_hook_to_module(mapped, AlignDevicesHook(execution_device="cpu", io_same_device=True, skip_keys=["cache"]))
    assert all(hasattr(layer, "_hf_hook") for layer in mapped.model.layers)
    assert _greedy_engine(mapped) == _greedy_engine(plain)
    assert "logits_to_keep" in mapped._hf_hook.skip_keys
    ids = torch.tensor([PROMPTS[1]])
    expected = plain.generate(
        input_ids=ids, max_new_tokens=8, do_sample=False, past_key_values=DynamicCache(config=plain.config)
    )
    out = mapped.generate(
        input_ids=ids,
        max_new_tokens=8,
        do_sample=False,
        past_key_values=PagedCache(mapped, num_blocks=16, block_size=8),
    )
    assert torch.equal(out, expected)


def test_offloaded_layers_are_refused(saved_model):
    model = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="paged")
    model.model.layers[1].self_attn.to("meta")
    with pytest.raises(ValueError, match=r"layers \[1\] have their weights offloaded"):
        PagedCache(model, num_blocks=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int, path: str, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="paged")
        assert model.tp_size == world
        greedy = _greedy_engine(model)
        assert _greedy_engine(model, async_scheduling=True) == greedy
        engine = ContinuousBatcher(model, block_size=8, num_blocks=64, async_scheduling=True)  # deferred steps
        sampled = [o.outputs[0].token_ids for o in engine.generate(
            PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True), use_tqdm=False)]  # fmt: skip
        cache = PagedCache(model, num_blocks=16, block_size=8)
        assert cache.kv.num_kv_heads == model.config.num_key_value_heads // world
        out = model.generate(input_ids=torch.tensor([PROMPTS[1]]), max_new_tokens=8, do_sample=False,
                             past_key_values=cache)  # fmt: skip
        shared, cascade_steps = _shared_prefix_greedy(model, cascade=True)  # each rank: its own KV heads' prefix
        assert cascade_steps > 0
        results.put((rank, greedy, sampled, out[0].tolist(), shared))
    except Exception as exc:  # surface the worker's error in the parent
        results.put((rank, repr(exc), None, None, None))
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run_two_ranks(worker, path: str) -> list[tuple]:
    """Spawn ``worker(rank, 2, port, path, results)`` on two ranks; what each put on ``results``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(rank, 2, port, path, results)) for rank in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=HANG_TIMEOUT_S) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return got


def test_tensor_parallel_two_ranks_match_one_process(saved_model):
    got = dict((r[0], r[1:]) for r in _run_two_ranks(_tp_worker, saved_model))
    for rank in (0, 1):
        assert isinstance(got[rank][0], list), got[rank][0]
    plain = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="paged")
    single = _greedy_engine(plain)
    assert got[0][0] == got[1][0] == single  # greedy: both ranks equal one process
    assert got[0][1] == got[1][1]  # sampling: rank 0's tokens are broadcast, the ranks stay in lock-step
    expected = plain.generate(input_ids=torch.tensor([PROMPTS[1]]), max_new_tokens=8, do_sample=False,
                              past_key_values=DynamicCache(config=plain.config))  # fmt: skip
    assert got[0][2] == got[1][2] == expected[0].tolist()
    assert got[0][3] == got[1][3] == _shared_prefix_greedy(plain, cascade=False)[0]  # cascade under TP: as plain


def _tp_serving_worker(rank: int, world: int, port: int, path: str, results):
    """Rank 0 serves through an AsyncEngine (staggered arrivals, a stream left early, a refused request); rank 1
    mirrors it with follow()."""
    import asyncio

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from hf_paged.serving.async_engine import AsyncEngine
    from hf_paged.serving.tensor_parallel import follow

    try:
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="paged")

        def build():
            return ContinuousBatcher(model, block_size=8, num_blocks=64, max_num_batched_tokens=24)

        if rank != 0:
            batcher = build()
            follow(batcher)
            assert_engine_drained(batcher)
            results.put((rank, "followed"))
            return

        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in NEW]

        async def main():
            async with AsyncEngine(build) as engine:

                async def one(i):
                    await asyncio.sleep(0.05 * i)  # arrivals while other requests run
                    return (await engine.generate(PROMPTS[i], params[i])).outputs[0].token_ids

                async def left_early():
                    stream = engine.stream(PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
                    async for _ in stream:
                        break  # the dropped stream aborts its request on both ranks

                outs = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))), left_early())
                try:
                    await engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=10_000))
                except ValueError:
                    pass
                else:
                    raise AssertionError("a request beyond the pool was accepted")
                while engine.num_unfinished:
                    await asyncio.sleep(0.01)
                return outs[: len(PROMPTS)]

        outs = asyncio.run(main())
        results.put((rank, outs))
    except Exception as exc:  # surface the worker's error in the parent
        results.put((rank, repr(exc)))
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_tensor_parallel_serving_rank0_broadcasts_requests(saved_model):
    """Requests reach rank 0's AsyncEngine at any time; the other rank gets them through the broadcast and stays in
    lock-step (a mismatch would raise in the engine's schedule check or hang the collectives)."""
    got = dict(_run_two_ranks(_tp_serving_worker, saved_model))
    assert got[1] == "followed", got[1]
    assert isinstance(got[0], list), got[0]
    plain = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="paged")
    assert got[0] == _greedy_engine(plain)


def test_follow_refuses_a_single_process_engine():
    from hf_paged.serving.tensor_parallel import follow

    engine = ContinuousBatcher(tiny_model("llama"), block_size=8, num_blocks=16)
    with pytest.raises(ValueError, match="follow\\(\\) runs on the tensor-parallel ranks other than 0"):
        follow(engine)


def test_hf_paged_serve_under_torchrun_serves_from_rank_0(tmp_path):
    """`torchrun --nproc-per-node 2 -m hf_paged.frontends.cli serve DIR`: both ranks load their shard, rank 0 answers
    HTTP and broadcasts the requests, rank 1 follows; the answer equals one process's; SIGTERM ends both ranks (rank 1
    ignores it and ends when rank 0's shutdown reaches it)."""
    import json
    import signal
    import subprocess
    import time
    import urllib.request

    from models import char_tokenizer

    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama", attn="sdpa").save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "hf_paged.frontends.cli", "serve", str(model_dir), "--device", "cpu", "--port", str(port),
           "--num-blocks", "64", "--block-size", "8", "--served-model-name", "tiny"]  # fmt: skip
    log = open(tmp_path / "torchrun.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + HANG_TIMEOUT_S
        while True:
            assert proc.poll() is None, "torchrun ended before serving:\n" + open(log.name).read()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "not healthy in time:\n" + open(log.name).read()[-3000:]
                time.sleep(0.5)
        body = json.dumps({"model": "tiny", "prompt": PROMPTS[1], "max_tokens": NEW[1], "temperature": 0.0,
                           "ignore_eos": True, "logprobs": 0}).encode()  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks, then exits 1 (its own way)
        proc.wait(timeout=120)  # raises if a rank is left running
    finally:
        if proc.poll() is None:
            proc.kill()
    plain = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="paged")
    expected = ContinuousBatcher(plain, char_tokenizer(), block_size=8, num_blocks=64).generate(
        [PROMPTS[1]], SamplingParams(max_new_tokens=NEW[1], temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    assert answer["choices"][0]["text"] == expected.outputs[0].text
    assert answer["usage"]["completion_tokens"] == NEW[1]
