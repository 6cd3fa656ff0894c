"""kernels/launch.py: the direct-launch key, the host helpers, and (on CUDA) direct launches against Triton's own.

The key must separate every pair of calls Triton would compile differently (dtype, 16-byte alignment, a
specialized int's value); the CUDA tests check that a direct launch runs the kernel Triton selects.
"""

import pytest
import torch
import triton
from hf_paged.kernels import cache_ops, launch, split_decode
from hf_paged.kernels.cache_ops import write_kv_triton
from hf_paged.kernels.decode import paged_decode_triton

from tests.helpers import needs_cuda

_write_kv_kernel = cache_ops.WRITE_KV.jit_fn
_paged_decode_kernel = split_decode.SPLIT.jit_fn


def _write_kv_args(key, value, k_cache, slots):
    return (key, value, k_cache, k_cache, slots, slots, slots, *key.stride(), *value.stride(), *k_cache.stride(),
            *k_cache.stride(), 0, 0, 8, 16, 4, 16, False)  # fmt: skip


def test_host_helpers_match_triton():
    for n in range(1, 3000):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64):
            assert launch.cdiv(n, d) == triton.cdiv(n, d)
    assert launch.next_power_of_2(0) == 1


def test_key_separates_what_triton_specializes():
    cache = torch.zeros(3, 4, 2, 8)
    key = torch.zeros(5, 2, 8)
    slots = torch.zeros(5, dtype=torch.int64)
    args = _write_kv_args(key, key, cache, slots)
    key_fn = launch.make_key_fn(_write_kv_kernel, args)
    base = key_fn(*args)
    assert key_fn(*_write_kv_args(key.clone(), key.clone(), cache.clone(), slots.clone())) == base  # other storage
    assert key_fn(*_write_kv_args(key.half(), key.half(), cache, slots)) != base  # dtype
    flat = torch.zeros(5 * 16 + 1)
    misaligned = flat[1:].view(5, 2, 8)  # 4 bytes past a 16-byte boundary
    assert key_fn(*_write_kv_args(misaligned, key, cache, slots)) != base
    strided = torch.zeros(5, 2, 16)[:, :, :8]  # another token stride (a specialized int)
    assert key_fn(*_write_kv_args(strided, key, cache, slots)) != base
    assert key_fn(*_write_kv_args(key, key, cache, slots.int())) != base  # slot dtype


def test_key_of_unspecialized_ints_keeps_only_their_class():
    q = torch.zeros(2, 4, 8)
    kc = torch.zeros(6, 4, 2, 8)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    acc, lse = torch.zeros(2, 4, 5, 8), torch.zeros(2, 4, 5)

    def args(num_splits, stride_bts, num_prefix_splits=2):
        return (q, kc, kc, tables, lens, lens, q, acc, lse, q, q, lens, q, q, q, *q.stride(), *kc.stride(),
                *kc.stride(), stride_bts, 1, *q.stride(), *acc.stride(), *lse.stride(), *(0,) * 8, num_splits,
                num_prefix_splits, 0.5, 0.0, 0.0, 0, 2, 16, 8, 16, 4, 64, False, False, False, False, False, 1, False,
                False, False, 64, 4, False, False, False, False)  # fmt: skip

    key_fn = launch.make_key_fn(_paged_decode_kernel, args(5, 3))
    assert key_fn(*args(5, 3)) == key_fn(*args(7, 40))  # num_splits and stride_bts are do_not_specialize
    assert key_fn(*args(5, 3, 2)) == key_fn(*args(5, 3, 16))  # so is num_prefix_splits
    assert key_fn(*args(1, 3)) != key_fn(*args(7, 3))  # == 1 may matter to Triton: kept apart
    assert key_fn(*args(5, 3)) != key_fn(*args(5, 2**31))  # i32 vs i64


def test_unsupported_argument_is_a_clear_error():
    with pytest.raises(TypeError, match="stride_key_t"):
        launch.make_key_fn(_write_kv_kernel, (torch.zeros(1),) * 7 + ("x",) + (0,) * 20)


def test_interpreter_and_opt_out_disable_direct_launch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.direct_launch_enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("HF_PAGED_DIRECT_LAUNCH", "0")
    assert not launch.direct_launch_enabled()


@needs_cuda("direct Triton launches")
def test_direct_launch_equals_standard_launch(monkeypatch):
    """Each direct launch is checked against Triton's own lookup (HF_PAGED_CHECK_LAUNCH) and gives its result."""
    monkeypatch.setenv("HF_PAGED_CHECK_LAUNCH", "1")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        launcher = launch.Launcher(_paged_decode_kernel)
        monkeypatch.setattr(split_decode, "SPLIT", launcher)
        q = torch.randn(3, 8, 64, device="cuda", dtype=dtype, generator=gen)
        kc = torch.randn(40, 16, 2, 64, device="cuda", dtype=dtype, generator=gen)
        vc = torch.randn_like(kc)
        tables = torch.randperm(40, device="cuda", generator=gen)[:30].view(3, 10).int()
        lens = torch.tensor([1, 77, 160], device="cuda", dtype=torch.int32)
        results = [paged_decode_triton(q, kc, vc, tables, lens, 0.125, max_seq_len=160, num_splits=s) for s in (1, 4)]
        assert launcher._enabled and len(launcher._cache) == 2  # WRITE_OUT on and off
        again = [paged_decode_triton(q, kc, vc, tables, lens, 0.125, max_seq_len=160, num_splits=s) for s in (1, 4)]
        for a, b in zip(results, again, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        monkeypatch.setenv("HF_PAGED_DIRECT_LAUNCH", "0")  # read at a launcher's first call
        standard = launch.Launcher(_paged_decode_kernel)
        monkeypatch.setattr(split_decode, "SPLIT", standard)
        expected = paged_decode_triton(q, kc, vc, tables, lens, 0.125, max_seq_len=160, num_splits=4)
        assert standard._enabled is False
        torch.testing.assert_close(again[1], expected, rtol=0, atol=0)
        monkeypatch.setenv("HF_PAGED_DIRECT_LAUNCH", "1")


@needs_cuda("direct Triton launches")
def test_check_mode_catches_a_wrong_cached_kernel(monkeypatch):
    monkeypatch.setenv("HF_PAGED_CHECK_LAUNCH", "1")
    launcher = launch.Launcher(_write_kv_kernel)
    monkeypatch.setattr(cache_ops, "WRITE_KV", launcher)
    kc = torch.zeros(4, 16, 2, 64, device="cuda")
    key = torch.randn(3, 2, 64, device="cuda")
    slots = torch.tensor([0, 5, 17], device="cuda")
    write_kv_triton(key, key, kc, kc.clone(), slots)
    write_kv_triton(key.half(), key.half(), kc, kc.clone(), slots)  # a second specialization
    kernels = list(launcher._cache.values())
    assert len(kernels) == 2 and kernels[0] is not kernels[1]
    first_key = next(iter(launcher._cache))
    launcher._cache[first_key] = kernels[1]  # the wrong kernel under the fp32 key
    with pytest.raises(RuntimeError, match="misses a specialization"):
        write_kv_triton(key, key, kc, kc.clone(), slots)


def test_an_empty_triton_hook_chain_counts_as_no_hook():
    """Triton >= 3.5 keeps launch hooks in a HookChain that is never None; an empty one must not make each direct
    launch build launch metadata for nobody, and a hook a profiler adds must still be called."""
    from hf_paged.kernels.launch import active_hook

    def hook(metadata):
        return None

    assert active_hook(None) is None
    assert active_hook(hook) is hook  # Triton before 3.5: a plain callable or None
    try:
        from triton.knobs import HookChain
    except ImportError:
        return
    chain = HookChain()
    assert active_hook(chain) is None
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        chain.calls.append(hook)
    assert active_hook(chain) is chain
