"""write_kv_triton, copy_blocks_triton and copy_blocks_layers_triton against the torch references
(kernels/reference.py).

On CPU the Triton kernels run under TRITON_INTERPRET=1; the same tests run unchanged on CUDA.
Caches start poisoned (NaN) so a slot written by mistake, or one left unwritten, shows up; the
kernels only copy and cast, so results must match the reference exactly.
"""

import os

import pytest
import torch
from hf_paged.kernels.reference import copy_blocks_ref, write_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels: run on CUDA (the device machine) and interpreted in CI (.ci/run sets TRITON_INTERPRET=1)",
)

if DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
    from hf_paged.kernels.cache_ops import (
        copy_blocks_layers_triton,
        copy_blocks_triton,
        layer_offsets,
        write_kv_triton,
    )

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    """[num_blocks, block_size, num_kv_heads, head_dim] K and V caches filled with NaN."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (
        torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
        torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
    )


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_kv_heads, head_dim, block_size",
    [(2, 64, 16), (3, 80, 8), (2, 256, 32), (40, 128, 16)],  # 3 * 80: not a power of two; 40 * 128 > one tile
)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_matches_reference(dtype, num_kv_heads, head_dim, block_size, slot_dtype):
    torch.manual_seed(0)
    num_blocks, num_tokens = 6, 29
    k_cache, v_cache = _poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    # Non-contiguous key/value: [batch, num_kv_heads, q_len, head_dim] transposed and flattened to tokens
    # gives a view with strides (head_dim, q_len * head_dim, 1); a permuted head_dim view adds stride != 1.
    key = torch.randn(1, num_kv_heads, num_tokens, head_dim, dtype=dtype, device=DEVICE).transpose(1, 2)[0]
    value = torch.randn(num_tokens, head_dim, num_kv_heads, dtype=dtype, device=DEVICE).transpose(1, 2)
    assert not key.is_contiguous() and value.stride(2) != 1
    slot_mapping = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens].to(slot_dtype)
    slot_mapping[::5] = -1  # padding tokens

    write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    write_kv_ref(key, value, k_ref, v_ref, slot_mapping)

    _assert_same(k_cache, k_ref)
    _assert_same(v_cache, v_ref)
    assert k_cache.isnan().any()  # unwritten slots stay poisoned


def test_write_kv_casts_to_cache_dtype():
    torch.manual_seed(1)
    k_cache, v_cache = _poisoned_cache(4, 16, 2, 64, torch.float16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    key = torch.randn(10, 2, 64, device=DEVICE)  # float32 rows into a float16 cache
    value = torch.randn(10, 2, 64, device=DEVICE)
    slot_mapping = torch.tensor([3, -1, 17, 0, 63, -1, 40, 41, 42, 8], device=DEVICE)

    write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    write_kv_ref(key, value, k_ref, v_ref, slot_mapping)

    _assert_same(k_cache, k_ref)
    _assert_same(v_cache, v_ref)


def test_write_kv_empty_and_all_padding():
    k_cache, v_cache = _poisoned_cache(2, 8, 1, 64, torch.float16)
    empty = torch.empty(0, 1, 64, dtype=torch.float16, device=DEVICE)
    write_kv_triton(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    rows = torch.randn(3, 1, 64, dtype=torch.float16, device=DEVICE)
    write_kv_triton(rows, rows, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int32, device=DEVICE))
    assert k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(2, 64, 16), (3, 80, 8), (8, 128, 32)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_copy_blocks_matches_reference(dtype, num_kv_heads, head_dim, block_size, index_dtype):
    torch.manual_seed(2)
    num_blocks = 12
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(dtype)
    k_cache[7:] = float("nan")  # poisoned dst blocks: each must be fully overwritten
    v_cache[7:] = float("nan")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    src = torch.tensor([4, 0, 6, 2], dtype=index_dtype)  # host tensors: moved to the cache device
    dst = torch.tensor([9, 7, 11, 8], dtype=index_dtype)

    copy_blocks_triton(k_cache, v_cache, src, dst)
    copy_blocks_ref(k_ref, v_ref, src, dst)

    _assert_same(k_cache, k_ref)
    _assert_same(v_cache, v_ref)
    assert k_cache[10].isnan().all()  # not a dst: untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(2, 64, 16), (3, 80, 8)])
def test_copy_blocks_layers_matches_the_reference_in_every_layer(dtype, num_kv_heads, head_dim, block_size):
    torch.manual_seed(5)
    num_layers, num_blocks = 3, 12
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_caches = [torch.randn(shape, device=DEVICE).to(dtype) for _ in range(num_layers)]
    v_caches = [torch.randn(shape, device=DEVICE).to(dtype) for _ in range(num_layers)]
    for cache in k_caches + v_caches:
        cache[7:] = float("nan")  # poisoned dst blocks: each must be fully overwritten in every layer
    k_ref, v_ref = [t.clone() for t in k_caches], [t.clone() for t in v_caches]
    src = torch.tensor([4, 0, 6, 2])
    dst = torch.tensor([9, 7, 11, 8], dtype=torch.int32)

    copy_blocks_layers_triton(*layer_offsets(k_caches, v_caches), k_caches[0], src, dst)
    for k, v in zip(k_ref, v_ref, strict=True):
        copy_blocks_ref(k, v, src, dst)

    for layer in range(num_layers):
        _assert_same(k_caches[layer], k_ref[layer])
        _assert_same(v_caches[layer], v_ref[layer])
        assert k_caches[layer][10].isnan().all()  # not a dst: untouched


def test_layer_offsets_and_copy_blocks_layers_reject_bad_arguments():
    k0, v0 = _poisoned_cache(4, 8, 2, 64, torch.float16)
    k1, v1 = _poisoned_cache(5, 8, 2, 64, torch.float16)
    with pytest.raises(ValueError, match=r"layer 1's cache \(shape \(5, 8, 2, 64\).*differs from layer 0's"):
        layer_offsets([k0, k1], [v0, v1])
    with pytest.raises(ValueError, match="need one v cache per k cache and at least one layer, got 2 k and 1 v"):
        layer_offsets([k0, k0], [v0])
    k_odd = torch.empty(4 * 8 * 2 * 64 + 1, dtype=torch.float16, device=DEVICE)[1:].view(4, 8, 2, 64)
    with pytest.raises(ValueError, match="64-byte aligned address"):
        layer_offsets([k_odd], [k_odd.clone()])
    k_offsets, v_offsets = layer_offsets([k0], [v0])
    with pytest.raises(ValueError, match=r"src and dst must be 1-D of equal length"):
        copy_blocks_layers_triton(k_offsets, v_offsets, k0, torch.tensor([0, 1]), torch.tensor([2]))
    with pytest.raises(ValueError, match=r"must be 1-D int64 of equal length"):
        copy_blocks_layers_triton(k_offsets.int(), v_offsets, k0, torch.tensor([0]), torch.tensor([2]))


def _huge_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    """Two caches of more than 2^31 elements.

    On CPU torch.empty maps the pages lazily, so only the blocks the test touches take memory;
    on CUDA the allocation is real (4 GiB each for the sizes used below).
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.empty(shape, dtype=dtype, device=DEVICE), torch.empty(shape, dtype=dtype, device=DEVICE)


def test_large_block_ids_use_int64_offsets():
    # block_id * stride_block = 2^22 * 512 = 2^31: element offsets past int32, so 32-bit index math
    # would wrap. The cache is 2^31 + 8192 fp16 elements (4 GiB) each for K and V.
    block_size, num_kv_heads, head_dim = 8, 1, 64
    num_blocks = 2**22 + 16
    k_cache, v_cache = _huge_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float16)
    high = torch.tensor([2**22 + 3, 2**22 + 15, 2**22 + 7, 5], device=DEVICE)
    for cache in (k_cache, v_cache):
        cache[high] = float("nan")
        cache[2**22 + 10] = float("nan")
    torch.manual_seed(3)
    key = torch.randn(20, num_kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
    value = torch.randn(20, num_kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
    offsets = torch.arange(20, device=DEVICE) % block_size
    slot_mapping = high.repeat_interleave(block_size)[:20] * block_size + offsets

    write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    _assert_same(k_cache[high].flatten(0, 1)[:20], key)
    _assert_same(v_cache[high].flatten(0, 1)[:20], value)

    copy_blocks_triton(k_cache, v_cache, high[:1], torch.tensor([2**22 + 10], device=DEVICE))
    _assert_same(k_cache[2**22 + 10], k_cache[2**22 + 3])
    _assert_same(v_cache[2**22 + 10], v_cache[2**22 + 3])


def test_write_kv_rejects_bad_arguments():
    k_cache, v_cache = _poisoned_cache(2, 8, 2, 64, torch.float16)
    key = torch.randn(4, 2, 64, dtype=torch.float16, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(
        ValueError, match=r"key must be \[num_tokens, num_kv_heads=2, head_dim=64\], got shape \(4, 2, 32\)"
    ):
        write_kv_triton(key[..., :32], key[..., :32], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match=r"slot_mapping dtype must be torch.int32 or torch.int64, got torch.float32"):
        write_kv_triton(key, key, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match=r"slot_mapping must be \[num_tokens=4\], got shape \(3,\)"):
        write_kv_triton(key, key, k_cache, v_cache, slots[:3])
    with pytest.raises(ValueError, match=r"v_cache shape \(2, 8, 1, 64\) must equal k_cache shape"):
        write_kv_triton(key, key, k_cache, v_cache[:, :, :1], slots)


def test_write_kv_checks_every_new_signature():
    """The checks run once per signature (shapes, strides, dtypes, devices): a call that differs from a checked one in
    any of them is checked again and raises as before; a checked one still writes its own tensors' values."""
    from hf_paged.kernels import cache_ops

    k_cache, v_cache = _poisoned_cache(2, 8, 2, 64, torch.float16)
    key = torch.randn(4, 2, 64, dtype=torch.float16, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    write_kv_triton(key, key, k_cache, v_cache, slots)  # checked and remembered
    assert any(sig[0] == key.shape and sig[8] == k_cache.shape for sig in cache_ops.WRITE_KV_LAUNCHES)
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, num_kv_heads=2, head_dim=64\]"):
        write_kv_triton(key[..., :32], key[..., :32], k_cache, v_cache, slots)  # shape
    # strides: V keys-minor (an FP8 pool's layout, here in fp16) is another signature, written at its own strides
    v_keys_minor = v_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    k_ref, v_ref = k_cache.clone(), v_keys_minor.clone()
    write_kv_triton(key, key, k_cache, v_keys_minor, slots)
    write_kv_ref(key, key, k_ref, v_ref, slots)
    assert torch.equal(v_keys_minor.view(torch.int16), v_ref.view(torch.int16))  # bitwise: NaN in unwritten slots
    assert torch.equal(k_cache.view(torch.int16), k_ref.view(torch.int16))
    with pytest.raises(
        ValueError, match=r"key/value dtype must be one of .* and equal, got torch.float16 / torch.float32"
    ):
        write_kv_triton(key, key.float(), k_cache, v_cache, slots)  # dtype
    with pytest.raises(ValueError, match=r"slot_mapping dtype must be torch.int32 or torch.int64, got torch.float32"):
        write_kv_triton(key, key, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match=r"slot_mapping is on meta, but the cache is on"):  # device
        write_kv_triton(key, key, k_cache, v_cache, slots.to("meta"))
    with pytest.raises(ValueError, match=r"value is on meta, but the cache is on"):
        write_kv_triton(key, key.to("meta"), k_cache, v_cache, slots)
    # The checked signature with other values (nothing but the signature is remembered): written as the reference.
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    other_key, other_slots = torch.randn_like(key), torch.tensor([9, 3, -1, 12], device=DEVICE)
    write_kv_ref(other_key, -other_key, expected_k, expected_v, other_slots)
    write_kv_triton(other_key, -other_key, k_cache, v_cache, other_slots)
    _assert_same(k_cache, expected_k)
    _assert_same(v_cache, expected_v)


def test_signature_cache_is_bounded():
    """The per-signature launch cache (write_kv's, the decode plans) starts over when full: memory stays bounded."""
    from hf_paged.kernels.launch import SignatureCache

    cache = SignatureCache(max_size=2)
    for i in range(5):
        cache.put((i,), i)
        assert len(cache) <= 2
    assert cache.get((4,)) == 4 and cache.get((0,)) is None
    with pytest.raises(ValueError, match=r"max_size must be >= 1, got 0"):
        SignatureCache(max_size=0)


def test_write_kv_across_many_signatures():
    """Calls of several signatures, one with no tokens, interleaved: each writes as the reference, and the cache of
    checked signatures holds them within its bound."""
    from hf_paged.kernels import cache_ops

    k_cache, v_cache = _poisoned_cache(4, 8, 2, 64, torch.float32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for num_tokens in (1, 2, 3, 0, 1):  # five calls, four signatures
        key = torch.randn(num_tokens, 2, 64, device=DEVICE)
        slots = torch.arange(num_tokens, device=DEVICE) + 8 * num_tokens
        write_kv_triton(key, key * 2, k_cache, v_cache, slots)
        write_kv_ref(key, key * 2, expected_k, expected_v, slots)
        assert 1 <= len(cache_ops.WRITE_KV_LAUNCHES) <= cache_ops.WRITE_KV_LAUNCHES.max_size
    _assert_same(k_cache, expected_k)
    _assert_same(v_cache, expected_v)


def test_copy_blocks_rejects_bad_arguments():
    k_cache, v_cache = _poisoned_cache(4, 8, 2, 64, torch.float16)
    src = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"src and dst must be 1-D of equal length, got shapes \(2,\) and \(1,\)"):
        copy_blocks_triton(k_cache, v_cache, src, src[:1])
    with pytest.raises(ValueError, match=r"dst dtype must be torch.int32 or torch.int64, got torch.float32"):
        copy_blocks_triton(k_cache, v_cache, src, src.float())
    k_t, v_t = k_cache[..., :32], v_cache[..., :32]  # a block's elements with gaps between them
    with pytest.raises(ValueError, match=r"each cache block must be contiguous"):
        copy_blocks_triton(k_t, v_t, src, src + 2)
