"""PagedCache's default pool grows with what the calls use: blocks allocated for a given call, sharing kept, the cap.

Without ``num_blocks`` the pool starts with one block and grows in each forward by what it may write (plus 1/16 of
the pool), so its size follows the call (the peak memory of a DynamicCache, not a share of the device); beams and
``num_return_sequences`` still store their shared blocks once.
"""

import gc
import math
import weakref

import pytest
import torch
from helpers import assert_cache_released
from models import cache_kwarg, tiny_model
from transformers import DynamicCache

from hf_paged import PagedCache
from hf_paged.core.kv_pool import KVPool

CACHE = cache_kwarg()
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 9, 11, 12, 13]])  # row 0: 3 columns of padding
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]])


def _generate(model, cache, **kwargs):
    kwargs = {"input_ids": IDS, "attention_mask": MASK, "do_sample": False, **kwargs}
    return model.generate(**kwargs, **{CACHE: cache})


def test_default_pool_holds_what_the_call_uses():
    model = tiny_model("llama")
    cache = PagedCache(model, block_size=8)
    assert cache.pool.num_blocks == 1  # nothing allocated before the first forward
    out = _generate(model, cache, max_new_tokens=24, min_new_tokens=24)
    assert torch.equal(out, _generate(model, DynamicCache(config=model.config), max_new_tokens=24, min_new_tokens=24))
    # 6 + 23 and 9 + 23 tokens fed: 4 blocks of 8 each, and not one block more
    assert cache.peak_used_blocks == cache.pool.num_blocks == 8
    assert all(k.shape[0] == 8 for k in cache.kv.k_cache + cache.kv.v_cache)
    assert_cache_released(cache)


def test_pool_grows_by_a_sixteenth_when_every_row_opens_a_block():
    model = tiny_model("llama")
    prompts = torch.randint(3, 96, (16, 32), generator=torch.Generator().manual_seed(0))
    cache = PagedCache(model, block_size=8)
    model.generate(input_ids=prompts, max_new_tokens=18, min_new_tokens=18, do_sample=False, **{CACHE: cache})
    # 16 rows of 32 + 17 tokens: 7 blocks each. Each block boundary needs 16 blocks at once; growth adds at least
    # 1/16 of the pool, so the pool ends at most a sixteenth (and a step's blocks) above what the rows use.
    assert cache.peak_used_blocks == 16 * 7
    assert cache.peak_used_blocks <= cache.pool.num_blocks <= math.ceil(cache.peak_used_blocks * 17 / 16) + 16
    assert_cache_released(cache)


@pytest.mark.parametrize("mode", ["beams", "return_sequences"])
def test_growing_pool_keeps_sharing(mode):
    model = tiny_model("llama")
    prompt = torch.arange(3, 3 + 40).unsqueeze(0)  # 40 tokens = 5 blocks of 8
    if mode == "beams":
        kwargs = dict(num_beams=4, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    else:
        kwargs = dict(num_return_sequences=4, do_sample=True, max_new_tokens=16, min_new_tokens=16)
    cache = PagedCache(model, block_size=8)
    sizes = []
    handle = model.register_forward_hook(lambda *args: sizes.append(cache.pool.num_blocks))
    try:
        torch.manual_seed(0)
        out = model.generate(input_ids=prompt, **kwargs, **{CACHE: cache})
    finally:
        handle.remove()
    torch.manual_seed(0)
    assert torch.equal(out, model.generate(input_ids=prompt, **kwargs, **{CACHE: DynamicCache(config=model.config)}))
    assert sizes[0] == 5  # the prompt is stored once for the 4 rows
    unshared = 4 * math.ceil((40 + 15) / 8)  # 28 blocks if every row kept its own copy
    assert cache.pool.num_blocks <= 0.75 * unshared, (cache.pool.num_blocks, unshared)
    assert_cache_released(cache)


def test_growing_pool_stops_at_its_cap(monkeypatch):
    model = tiny_model("llama")
    bytes_per_block = PagedCache(model, num_blocks=1, block_size=8).kv_bytes_per_block
    monkeypatch.setattr(KVPool, "free_memory", staticmethod(lambda device: 10 * bytes_per_block))
    cache = PagedCache(model, block_size=8, memory_fraction=0.5)  # at most 5 blocks
    with pytest.raises(MemoryError, match=r"the pool has 5, grown to its cap of 5 \(0 free\)"):
        _generate(model, cache, max_new_tokens=30, min_new_tokens=30)
    assert_cache_released(cache)


def test_kv_pool_grow_keeps_blocks_and_zeroes_new_ones():
    pool = KVPool.uniform(2, 3, 8, 2, 4, torch.float32, [torch.device("cpu")] * 2)
    pool.k_cache[1].fill_(7.0)
    pool.grow(5)
    assert pool.num_blocks == 5 and all(k.shape == (5, 8, 2, 4) for k in pool.k_cache + pool.v_cache)
    assert bool((pool.k_cache[1][:3] == 7).all()) and bool((pool.k_cache[1][3:] == 0).all())
    with pytest.raises(ValueError, match="must exceed the current 5"):
        pool.grow(5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_kv_pool_copy_blocks_copies_every_layer_before_and_after_growth(device, monkeypatch):
    """One copy-on-write call copies the blocks in every layer (on CUDA one launch through the layers' addresses,
    which a grown pool must rebuild: the old tensors are gone)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the all-layers launch runs on CUDA (run_gpu.sh tests-cache)")
    pool = KVPool.uniform(3, 4, 8, 2, 4, torch.float32, [torch.device(device)] * 3)
    for layer in range(3):
        for cache, sign in ((pool.k_cache[layer], 1), (pool.v_cache[layer], -1)):
            cache.copy_(sign * torch.arange(cache.numel(), dtype=torch.float32).view(cache.shape) + 1000 * layer)
    expected = [(k[1].clone(), v[1].clone(), k[2].clone()) for k, v in zip(pool.k_cache, pool.v_cache, strict=True)]
    pool.copy_blocks([(1, 3)])
    # grow() replaces one layer's tensor at a time: the copy's cached per-layer lists must not keep the old ones
    old_k0, alive = weakref.ref(pool.k_cache[0]), []
    real_zeros = torch.zeros  # grow() allocates each tensor zeroed (kv_quant.new_cache)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: alive.append(old_k0() is not None) or real_zeros(*a, **k))
    pool.grow(6)
    monkeypatch.undo()
    assert alive[:2] == [True, False]  # layer 0's old tensor is gone before layer 1's new one is allocated
    pool.copy_blocks([(3, 5), (2, 4)])
    for layer, (k1, v1, k2) in enumerate(expected):
        for block in (1, 3, 5):
            assert torch.equal(pool.k_cache[layer][block], k1) and torch.equal(pool.v_cache[layer][block], v1)
        assert torch.equal(pool.k_cache[layer][4], k2)
        assert bool((pool.k_cache[layer][0] != pool.k_cache[layer][1]).all())  # not a dst: untouched


def test_cache_is_freed_without_the_garbage_collector():
    """Layers reach the cache through a weak proxy: dropping the cache frees its pool at once (a reference cycle
    kept every dropped pool until the next collection, and repeated generate() calls ran out of device memory)."""
    model = tiny_model("llama")
    gc.disable()
    try:
        cache = PagedCache(model, num_blocks=8, block_size=8)
        _generate(model, cache, max_new_tokens=3)
        ref = weakref.ref(cache)
        del cache
        assert ref() is None
    finally:
        gc.enable()
