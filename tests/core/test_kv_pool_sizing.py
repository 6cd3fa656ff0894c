"""KV pool sizing: the budget arithmetic (CPU) and a profiled default engine that stays inside it (CUDA)."""

import gc

import pytest
import torch
from helpers import assert_engine_drained, needs_cuda
from models import tiny_model

from hf_paged import ContinuousBatcher, EngineConfig, SamplingParams
from hf_paged.core.model_info import CPU_DEFAULT_POOL_BYTES, ModelInfo
from hf_paged.engine.memory import DeviceBudget, kv_bytes_per_device

GIB = 2**30


def test_budget_arithmetic():
    b = DeviceBudget("cuda:0", total=80 * GIB, utilization=0.9, non_torch=GIB // 2, allocated=2 * GIB,
                     activations=3 * GIB, sampler=GIB // 2, bytes_per_block=2**20)  # fmt: skip
    assert b.kv_budget == int(0.9 * 80 * GIB) - 6 * GIB
    assert b.num_blocks == b.kv_budget // 2**20
    assert "KV pool" in b.describe() and "weights and buffers 2.00" in b.describe()
    short = DeviceBudget("cuda:0", total=8 * GIB, utilization=0.5, non_torch=GIB, allocated=3 * GIB,
                         activations=GIB, sampler=0, bytes_per_block=2**20)  # fmt: skip
    assert short.kv_budget < 0 and short.num_blocks == 0  # a negative budget holds no block


def test_bytes_per_device_follow_the_layers():
    info = ModelInfo.from_model(tiny_model("llama"))
    assert info.num_layers >= 2
    info.devices = [torch.device("cuda", 0)] + [torch.device("cuda", 1)] * (info.num_layers - 1)
    per = kv_bytes_per_device(info, 16)
    assert per[torch.device("cuda", 0)] == info.bytes_per_block(16) // info.num_layers
    assert sum(per.values()) == info.bytes_per_block(16)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, "0.9"])
def test_utilization_is_checked(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


def test_cpu_default_pool_is_capped():
    """On the CPU no profiling: half of the free RAM, capped at CPU_DEFAULT_POOL_BYTES."""
    engine = ContinuousBatcher(tiny_model("llama"), block_size=8)
    assert engine.memory_profile is None
    assert engine.pool.num_blocks * engine.info.bytes_per_block(8) <= CPU_DEFAULT_POOL_BYTES
    explicit = ContinuousBatcher(tiny_model("llama"), block_size=8, memory_fraction=0.001)
    assert explicit.pool.num_blocks < engine.pool.num_blocks


@needs_cuda("profiles a forward on the card")
def test_profiled_pool_stays_inside_the_budget():
    """The default engine fills ``gpu_memory_utilization`` of the card, and full-budget steps stay inside it."""
    gc.collect()
    torch.cuda.empty_cache()
    util = 0.3  # leaves room for whatever earlier tests of this process still hold
    model = tiny_model("llama", device="cuda")
    engine = ContinuousBatcher(model, gpu_memory_utilization=util, max_num_batched_tokens=256, max_num_seqs=32)
    profile = engine.memory_profile
    assert profile is not None and profile.num_blocks == engine.pool.num_blocks, profile
    budget = profile.devices[0]
    pool_bytes = engine.pool.num_blocks * budget.bytes_per_block
    assert pool_bytes > 0.5 * budget.kv_budget  # the pool took (about) what the budget left
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (int(n),), generator=gen).tolist() for n in torch.randint(40, 300, (48,))]
    engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), use_tqdm=False)
    free, total = torch.cuda.mem_get_info()
    used_peak = torch.cuda.max_memory_reserved() + budget.non_torch
    assert used_peak <= (util + 0.02) * total, (used_peak / GIB, util * total / GIB, str(profile))
    assert_engine_drained(engine)
    del engine
    gc.collect()
    torch.cuda.empty_cache()


@needs_cuda("profiles a forward on the card")
def test_budget_too_small_is_a_clear_error():
    model = tiny_model("llama", device="cuda")
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.0001 leaves no room"):
        ContinuousBatcher(model, gpu_memory_utilization=0.0001)
