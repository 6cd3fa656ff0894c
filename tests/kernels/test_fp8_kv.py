"""FP8 K/V caches (kernels/kv_quant.py): the references against dense attention over the dequantized K/V, and the
Triton kernels (write_kv, prefill, split and shared-prefix decode, fused write, copies) against the references.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (small shapes: the interpreter is slow). The writes are
bit-exact (quantization rounds by integer arithmetic in the kernels, kernels/kv_quant_triton.py); attention matches
to the output dtype's rounding (the kernels fold the scales into the softmax scale and the accumulator, the
references dequantize the rows). NaN checks read the cache's bytes, never its values: Triton's interpreter reads fp8
NaN/inf encodings as finite numbers (the kernels never store inf, and NaN only for a NaN input).
"""

import os

import pytest
import torch
from hf_paged.kernels import paged_attention, paged_decode, write_kv
from hf_paged.kernels.kv_quant import FP8_MAX, dequantize_ref, new_cache, quantize_ref
from hf_paged.kernels.reference import copy_blocks_ref, paged_attention_ref, paged_decode_ref, write_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_TRITON = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not _TRITON,
    reason="Triton kernels: run on CUDA (the device machine) and interpreted in CI (.ci/run sets TRITON_INTERPRET=1)",
)
if _TRITON:
    from hf_paged.kernels.cache_ops import (
        copy_blocks_layers_triton,
        copy_blocks_triton,
        layer_offsets,
        write_kv_triton,
    )
    from hf_paged.kernels.decode import paged_decode_triton
    from hf_paged.kernels.prefill import paged_prefill_triton

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# k_scale per head, v_scale per tensor; and the reverse
SCALES = {"per_head_k": ([0.6, 1.7], [0.05]), "per_head_v": ([0.3], [0.02, 0.11])}
# query dtype -> (atol, rtol): the kernels and references differ only in fp32 rounding order and the output's rounding
TOLERANCES = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 16


def _scales(kind: str) -> dict:
    k_scale, v_scale = SCALES[kind]
    return {"k_scale": torch.tensor(k_scale, device=DEVICE), "v_scale": torch.tensor(v_scale, device=DEVICE)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _nan_cache(shape: tuple, fp8: torch.dtype, value: bool) -> torch.Tensor:
    """An fp8 cache in the pool's layout (kernels.kv_quant.new_cache: V keys-minor) full of NaN bytes (0x7F)."""
    cache = new_cache(*shape, fp8, DEVICE, value=value)
    cache.view(torch.uint8).fill_(0x7F)
    return cache


def _paged_batch(
    seq_lens: list[int], fp8: torch.dtype, scales: dict, seed: int = 0, k_std: float = 0.5, v_keys_minor: bool = True,
    block_size: int = BLOCK_SIZE,
):  # fmt: skip
    """Dense K/V of each sequence (fp32, [seq_len, num_kv_heads, head_dim]; standard deviation k_std for K, 1 for V)
    written quantized into fp8 caches through shuffled block tables; every slot no sequence holds, in the blocks no
    sequence owns and past each sequence's end in its last block, holds NaN bytes (a read of one would show). V is
    keys-minor as in the pool unless ``v_keys_minor`` is False. Returns (k_cache, v_cache, block_tables [num_seqs,
    max_blocks] int32, seq_lens int32, dense_k, dense_v)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 2
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = _nan_cache(shape, fp8, value=False), _nan_cache(shape, fp8, value=v_keys_minor)
    tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    dense_k, dense_v = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen) * k_std
        v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        pos = torch.arange(n)
        slots = tables[s, pos // block_size] * block_size + pos % block_size
        write_kv_ref(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), **scales)
        dense_k.append(k)
        dense_v.append(v)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, tables.to(torch.int32).to(DEVICE), lens, dense_k, dense_v


def _dense_attention(q, k, v, scale):
    """Causal attention of q's rows (the last len(q) positions of k) in fp32: [q_len, num_heads, head_dim]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _stored(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """What an fp8 cache gives back for x: dequantize(quantize(x)) in fp32."""
    return dequantize_ref(quantize_ref(x, scale.cpu(), fp8), scale.cpu())


# References ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", FP8)
def test_quantize_ref_saturates_and_keeps_nan(fp8):
    limit = FP8_MAX[fp8]
    x = torch.tensor([[[1.0, -3.0, 2 * limit, -float("inf"), float("inf"), float("nan")]]])
    scale = torch.tensor([0.5])
    stored = quantize_ref(x, scale, fp8)
    assert stored.dtype == fp8
    assert stored.float()[0, 0, :5].tolist() == [2.0, -6.0, limit, -limit, limit]  # x / 0.5, saturated
    assert stored.float()[0, 0, 5].isnan()
    assert dequantize_ref(stored, scale)[0, 0, :2].tolist() == [1.0, -3.0]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scale_kind", list(SCALES))
def test_references_attend_to_the_dequantized_kv(fp8, scale_kind):
    """paged_attention_ref (a prompt's last 5 tokens over its cached context) and paged_decode_ref (the last token)
    read the shuffled fp8 blocks as dense attention reads dequantize(quantize(K/V))."""
    scales = _scales(scale_kind)
    seq_lens = [37, 16]
    k_cache, v_cache, tables, lens, dense_k, dense_v = _paged_batch(seq_lens, fp8, scales)
    scale = HEAD_DIM**-0.5
    query = torch.randn(10, NUM_HEADS, HEAD_DIM, device=DEVICE)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32, device=DEVICE)
    out = paged_attention_ref(query, k_cache, v_cache, tables, lens, cu, scale, **scales)
    decode_q = query[[4, 9]]
    out_decode = paged_decode_ref(decode_q, k_cache, v_cache, tables, lens, scale, **scales)
    for s in range(len(seq_lens)):
        k = _stored(dense_k[s], scales["k_scale"], fp8)
        v = _stored(dense_v[s], scales["v_scale"], fp8)
        expected = _dense_attention(query[5 * s : 5 * s + 5].cpu(), k, v, scale)
        torch.testing.assert_close(out[5 * s : 5 * s + 5].cpu(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_decode[s].cpu(), expected[-1], atol=1e-5, rtol=1e-5)
    # the quantization is visible: the unquantized K/V give another result
    assert not torch.allclose(out[:5].cpu(), _dense_attention(query[:5].cpu(), dense_k[0], dense_v[0], scale))


# Writes ----------------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
def test_write_kv_rounds_every_value_as_torch(fp8):
    """Every finite fp8 value, the midpoints between neighbours (ties to even) and the floats either side of them,
    subnormals, values past the finite max, +-inf (saturated), NaN and zeros: the kernel stores torch's bytes."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[values.isfinite()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    special = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 1e-30, 0.0, -0.0, 1e-45, 460.0, 464.0, 6e4]
    x = torch.cat([values, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1), torch.tensor(special)])
    x = torch.cat([x, torch.randn(4096 - x.numel()) * 30])
    key = x.view(-1, 1, HEAD_DIM).to(DEVICE)
    slots = torch.arange(key.shape[0], device=DEVICE)
    shape = (key.shape[0] // BLOCK_SIZE, BLOCK_SIZE, 1, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=fp8, device=DEVICE), torch.zeros(shape, dtype=fp8, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_triton(key, -key, k_cache, v_cache, slots)  # no scales: 1.0
    write_kv_ref(key, -key, k_ref, v_ref, slots)
    assert torch.equal(_bytes(k_cache), _bytes(k_ref)) and torch.equal(_bytes(v_cache), _bytes(v_ref))
    assert torch.equal(_bytes(k_ref).flatten()[: values.numel()].cpu(), _bytes(values.to(fp8)))  # exact values stay


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scale_kind", list(SCALES))
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32])
def test_write_kv_quantizes_with_each_heads_scale(fp8, scale_kind, key_dtype):
    """Strided key/value views, padding slots (-1) left alone, a value past the finite max saturated."""
    scales = _scales(scale_kind)
    num_tokens, num_blocks = 21, 4
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(fp8)  # NaN bytes
    v_cache = k_cache.clone()
    key = torch.randn(1, NUM_KV_HEADS, num_tokens, HEAD_DIM, device=DEVICE).to(key_dtype).transpose(1, 2)[0] * 3
    value = torch.randn(num_tokens, HEAD_DIM, NUM_KV_HEADS, device=DEVICE).to(key_dtype).transpose(1, 2)
    key[1, 0, 0] = 1e5  # past the finite max after any scale here
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    slots[::4] = -1  # token 1 keeps its slot
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_triton(key, value, k_cache, v_cache, slots, **scales)
    write_kv_ref(key, value, k_ref, v_ref, slots, **scales)
    assert torch.equal(_bytes(k_cache), _bytes(k_ref)) and torch.equal(_bytes(v_cache), _bytes(v_ref))
    assert (_bytes(k_cache) == 0x7F).sum() == (num_blocks * BLOCK_SIZE - (slots >= 0).sum()) * NUM_KV_HEADS * HEAD_DIM
    saturated = dequantize_ref(k_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[1]], scales["k_scale"])[0, 0]
    assert saturated == FP8_MAX[fp8] * scales["k_scale"][0]


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
def test_copy_blocks_move_fp8_bytes(fp8):
    """copy_blocks_triton and copy_blocks_layers_triton copy every byte, NaN encodings included, V keys-minor as in
    the pool."""
    shape = (8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [new_cache(*shape, fp8, DEVICE, value=i % 2 == 1) for i in range(4)]  # K, V, K, V
    for c in caches:
        c.view(torch.uint8).copy_(torch.randint(0, 256, shape, dtype=torch.uint8))
    src, dst = torch.tensor([5, 0, 3]), torch.tensor([1, 7, 2])
    expected = [c.clone() for c in caches]
    for k, v in ((expected[0], expected[1]), (expected[2], expected[3])):
        copy_blocks_ref(k, v, src, dst)
    copy_blocks_triton(caches[0], caches[1], src, dst)
    assert torch.equal(_bytes(caches[0]), _bytes(expected[0])) and torch.equal(_bytes(caches[1]), _bytes(expected[1]))
    for c, e in zip(caches, expected, strict=True):
        e.copy_(c)
    for k, v in ((expected[0], expected[1]), (expected[2], expected[3])):
        copy_blocks_ref(k, v, dst, src)
    offsets = layer_offsets([caches[0], caches[2]], [caches[1], caches[3]])
    copy_blocks_layers_triton(*offsets, caches[0], dst, src)
    for c, e in zip(caches, expected, strict=True):
        assert torch.equal(_bytes(c), _bytes(e))


# Attention kernels -----------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scale_kind", list(SCALES))
@pytest.mark.parametrize("with_key_value", [False, True])
def test_prefill_matches_reference(fp8, scale_kind, with_key_value):
    """A fresh prompt, a chunk over cached context and a single token; with key/value given the fp8 cache is read
    all the same (the prompt attends to its quantized K/V, as the reference and later decode steps do)."""
    scales = _scales(scale_kind)
    dtype = torch.bfloat16 if fp8 == torch.float8_e4m3fn else torch.float16
    seq_lens = [23, 40, 9]
    k_cache, v_cache, tables, lens, _, _ = _paged_batch(seq_lens, fp8, scales, seed=1)
    cu = torch.tensor([0, 23, 30, 31], dtype=torch.int32, device=DEVICE)  # q_len 23 (fresh), 7, 1
    query = torch.randn(31, NUM_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    kv = {}
    if with_key_value:  # activations that differ from the cache's K/V: must not be read
        kv = {"key": torch.randn(31, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype)}
        kv["value"] = kv["key"]
    out = paged_prefill_triton(query, k_cache, v_cache, tables, lens, cu, HEAD_DIM**-0.5, max_query_len=23,
                               max_seq_len=40, **kv, **scales)  # fmt: skip
    expected = paged_attention_ref(query, k_cache, v_cache, tables, lens, cu, HEAD_DIM**-0.5, **scales)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scale_kind", list(SCALES))
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("v_keys_minor", [True, False])
def test_decode_matches_reference(fp8, scale_kind, num_splits, v_keys_minor):
    """Single-split (writes out) and multi-split (merge) decode, with a padding row (seq_len 0); V keys-minor (the
    pool's layout) or in rows (any strides are taken)."""
    scales = _scales(scale_kind)
    dtype = torch.bfloat16 if num_splits == 1 else torch.float16
    seq_lens = [50, 1, 17]
    k_cache, v_cache, tables, _, _, _ = _paged_batch(seq_lens, fp8, scales, seed=2, v_keys_minor=v_keys_minor)
    lens = torch.tensor([50, 1, 0], dtype=torch.int32, device=DEVICE)
    query = torch.randn(3, NUM_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    out = paged_decode_triton(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, max_seq_len=64,
                              num_splits=num_splits, **scales)  # fmt: skip
    expected = paged_decode_ref(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, **scales)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    assert (out[2] == 0).all()


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
def test_window_and_soft_cap(fp8):
    """k_scale joins the soft cap's inner scale too (prefill and decode), with a sliding window."""
    scales = _scales("per_head_k")
    seq_lens = [50, 17]
    k_cache, v_cache, tables, lens, _, _ = _paged_batch(seq_lens, fp8, scales, seed=7)
    options = {"sliding_window": 20, "soft_cap": 2.0}
    query = (torch.randn(10, NUM_HEADS, HEAD_DIM, device=DEVICE) * 3).to(torch.float16)
    cu = torch.tensor([0, 6, 10], dtype=torch.int32, device=DEVICE)
    out = paged_prefill_triton(query, k_cache, v_cache, tables, lens, cu, HEAD_DIM**-0.5, max_query_len=6,
                               max_seq_len=50, **options, **scales)  # fmt: skip
    expected = paged_attention_ref(query, k_cache, v_cache, tables, lens, cu, HEAD_DIM**-0.5, **options, **scales)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    decode_q = query[[5, 9]]
    out = paged_decode_triton(decode_q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, max_seq_len=64, num_splits=1,
                              **options, **scales)  # fmt: skip
    expected = paged_decode_ref(decode_q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, **options, **scales)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_write_quantizes_like_write_kv(fp8, num_splits):
    """The decode kernel's fused write stores write_kv's bytes and attends to them, as a write then a decode."""
    scales = _scales("per_head_k")
    seq_lens = [50, 1, 17]
    k_cache, v_cache, tables, lens, _, _ = _paged_batch(seq_lens, fp8, scales, seed=3)
    query = torch.randn(3, NUM_HEADS, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    new_key = (torch.randn(3, NUM_KV_HEADS, HEAD_DIM, device=DEVICE) * 4).to(torch.bfloat16)
    new_value = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    pos = lens.long() - 1
    slots = tables.long()[torch.arange(3, device=DEVICE), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(new_key, new_value, k_ref, v_ref, slots, **scales)
    expected = paged_decode_ref(query, k_ref, v_ref, tables, lens, HEAD_DIM**-0.5, **scales)
    out = paged_decode_triton(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, max_seq_len=64,
                              num_splits=num_splits, new_key=new_key, new_value=new_value, slot_mapping=slots,
                              **scales)  # fmt: skip
    assert torch.equal(_bytes(k_cache), _bytes(k_ref)) and torch.equal(_bytes(v_cache), _bytes(v_ref))
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cascade_matches_reference(fp8, num_splits):
    """Shared-prefix decode: the prefix kernel's partials carry v_scale, folded (one split) or merged (several)."""
    scales = _scales("per_head_v")
    seq_lens = [40, 35, 33]
    k_cache, v_cache, tables, lens, _, _ = _paged_batch(seq_lens, fp8, scales, seed=4)
    tables[1:, :2] = tables[0, :2]  # the first two blocks are shared
    prefix_len = torch.tensor([32], dtype=torch.int32, device=DEVICE)
    query = torch.randn(3, NUM_HEADS, HEAD_DIM, device=DEVICE).to(torch.float16)
    out = paged_decode_triton(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, max_seq_len=64,
                              num_splits=num_splits, prefix_len=prefix_len, **scales)  # fmt: skip
    expected = paged_decode_ref(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, prefix_len=prefix_len,
                                **scales)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
def test_bf16_query_beyond_fp16_range_saturates(fp8):
    """With an fp8 cache the kernels' dots run in fp16 (kernels/split_decode.py): a bf16 query value beyond fp16's
    finite range counts as +-65504 (a finite output, not inf/NaN), and values within it (up to 6e4 here) convert
    exactly. Prefill, one-split and multi-split decode, and the shared-prefix kernel (folded and merged) match the
    references on the clamped query. K is small (and k_scale with it) so that the scores stay near 1 with queries
    of ~1e4: the clamp changes them, so the unclamped query's reference differs."""
    k_scale = 1e-4
    scales = {"k_scale": torch.tensor([k_scale], device=DEVICE), "v_scale": torch.tensor([0.05], device=DEVICE)}
    seq_lens = [40, 35, 33]
    k_cache, v_cache, tables, lens, _, _ = _paged_batch(seq_lens, fp8, scales, seed=8, k_std=2 * k_scale)
    tables[1:, :2] = tables[0, :2]  # the first two blocks are shared (the prefix runs)
    gen = torch.Generator().manual_seed(9)
    query = torch.randn(7, NUM_HEADS, HEAD_DIM, generator=gen) * 1e4
    query[:, :, 0] = 7e4  # beyond fp16's finite max
    query[:, :, 1] = -3e5
    query[:, 1::2, 2] = 6e4  # within it: its bf16 value (59904) is an fp16 value
    query[:, ::2, 2] = -65504.0  # -fp16's max, rounded to bf16 (-65536): beyond it
    query = query.to(DEVICE).to(torch.bfloat16)
    clamped = query.float().clamp(-65504.0, 65504.0)  # fp32: 65504 is no bf16 value
    scale = HEAD_DIM**-0.5
    atol, rtol = TOLERANCES[torch.bfloat16]

    def check(out, expected, unclamped):  # expected: the reference on the clamped query; unclamped: on the query
        assert out.dtype == torch.bfloat16 and out.isfinite().all()
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
        assert not torch.allclose(out.float(), unclamped.float(), atol=atol, rtol=rtol)

    cu = torch.tensor([0, 5, 6, 7], dtype=torch.int32, device=DEVICE)  # q_len 5, 1, 1
    out = paged_prefill_triton(query, k_cache, v_cache, tables, lens, cu, scale, max_query_len=5, max_seq_len=40,
                               **scales)  # fmt: skip
    check(
        out, *(paged_attention_ref(q, k_cache, v_cache, tables, lens, cu, scale, **scales) for q in (clamped, query))
    )
    decode_q = query[[4, 5, 6]]
    prefix_len = torch.tensor([32], dtype=torch.int32, device=DEVICE)
    for num_splits, prefix in ((1, None), (3, None), (1, prefix_len), (3, prefix_len)):
        out = paged_decode_triton(decode_q, k_cache, v_cache, tables, lens, scale, max_seq_len=64,
                                  num_splits=num_splits, prefix_len=prefix, **scales)  # fmt: skip
        check(out, *(paged_decode_ref(q[[4, 5, 6]], k_cache, v_cache, tables, lens, scale, prefix_len=prefix, **scales)
                     for q in (clamped, query)))  # fmt: skip


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("block_size", [16, 64, 128, 24])
def test_keys_minor_v_interior_and_edge_tiles(fp8, block_size):
    """A keys-minor V (the pool's layout) read as whole blocks: contexts of several 64-key tiles, so that splits have
    interior tiles (no masks) and edge tiles (a window's lower end, the context's end, the fused write's slot), and
    every slot outside the contexts holds NaN. Blocks of 16 (four to a tile), 64 (one), 128 (half a block a tile) and
    24 (no nesting: V is read key by key) give the reference's results: no NaN gets in."""
    scales = _scales("per_head_v")
    seq_lens = [200, 129, 64, 1]
    k_cache, v_cache, tables, lens, _, _ = _paged_batch(seq_lens, fp8, scales, seed=11, block_size=block_size)
    assert v_cache.stride(1) == 1
    gen = torch.Generator().manual_seed(12)
    query = torch.randn(4, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE, torch.float16)
    scale = HEAD_DIM**-0.5
    for num_splits in (1, 3):
        for options in ({}, {"sliding_window": 70}):
            out = paged_decode_triton(query, k_cache, v_cache, tables, lens, scale, max_seq_len=256,
                                      num_splits=num_splits, **options, **scales)  # fmt: skip
            expected = paged_decode_ref(query, k_cache, v_cache, tables, lens, scale, **options, **scales)
            torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    # the fused write: the new token's slot (NaN until written) sits in the last tile
    new_key = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE, torch.float16)
    pos = lens.long() - 1
    slots = tables.long()[torch.arange(4, device=DEVICE), pos // block_size] * block_size + pos % block_size
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(new_key, -new_key, k_ref, v_ref, slots, **scales)
    out = paged_decode_triton(query, k_cache, v_cache, tables, lens, scale, max_seq_len=256, num_splits=3,
                              new_key=new_key, new_value=-new_key, slot_mapping=slots, **scales)  # fmt: skip
    assert torch.equal(_bytes(v_cache), _bytes(v_ref))
    expected = paged_decode_ref(query, k_ref, v_ref, tables, lens, scale, **scales)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    # prefill over the blocks: chunks of 70, 9, 64 and 1 new tokens (interior tiles for the long ones)
    cu = torch.tensor([0, 70, 79, 143, 144], dtype=torch.int32, device=DEVICE)
    prefill_q = torch.randn(144, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE, torch.float16)
    out = paged_prefill_triton(prefill_q, k_cache, v_cache, tables, lens, cu, scale, max_query_len=70, max_seq_len=200,
                               **scales)  # fmt: skip
    expected = paged_attention_ref(prefill_q, k_cache, v_cache, tables, lens, cu, scale, **scales)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


def test_fp8_plans_take_one_wave_of_splits():
    """At head_dim 128 an FP8 pool's decode plan takes FP8's split rule (decode_plan.PROGRAMS_PER_SM_FP8, rounded
    down: one split at 32 x 4096, 33 at 1 x 32768 on 132 SMs), a bf16 pool's the default one; no kernel runs."""
    from hf_paged.kernels import decode_plan

    def plan(dtype, num_seqs):
        caches = [torch.zeros(4, 16, 8, 128, dtype=dtype) for _ in range(2)]
        query = torch.zeros(num_seqs, 32, 128, dtype=torch.bfloat16)
        tables = torch.zeros(num_seqs, 4, dtype=torch.int32)
        return decode_plan.DecodePlan(query, *caches, tables, 0.088, None, None, None, None)

    for fp8 in FP8:
        assert plan(fp8, 32).split_rule == (decode_plan.PROGRAMS_PER_SM_FP8, True)
        for num_seqs, context, splits in ((32, 4096, 1), (1, 32768, 33)):
            rule = plan(fp8, num_seqs).split_rule
            assert decode_plan.choose_num_splits(context, num_seqs, 8, 132, None, *rule) == splits
    assert plan(torch.bfloat16, 32).split_rule == (decode_plan.PROGRAMS_PER_SM, False)


def test_public_functions_quantize_and_dequantize():
    """write_kv, paged_attention (with a slot_mapping write) and paged_decode on the cache's device: CUDA takes the
    kernels, the CPU the references; both store the same bytes."""
    fp8 = torch.float8_e4m3fn
    scales = _scales("per_head_k")
    k_cache, v_cache, tables, lens, _, _ = _paged_batch([20, 5], fp8, scales, seed=5)
    pos = lens.long() - 1
    slots = tables.long()[torch.arange(2, device=DEVICE), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    new_key = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(new_key, new_key, k_ref, v_ref, slots, **scales)
    query = torch.randn(2, NUM_HEADS, HEAD_DIM, device=DEVICE)
    cu = torch.arange(3, dtype=torch.int32, device=DEVICE)
    out = paged_attention(query, k_cache, v_cache, tables, lens, cu, HEAD_DIM**-0.5, max_query_len=1, key=new_key,
                          value=new_key, slot_mapping=slots, **scales)  # fmt: skip
    assert torch.equal(_bytes(k_cache), _bytes(k_ref)) and torch.equal(_bytes(v_cache), _bytes(v_ref))
    expected = paged_decode_ref(query, k_ref, v_ref, tables, lens, HEAD_DIM**-0.5, **scales)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(paged_decode(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, 32, **scales),
                               expected, atol=1e-4, rtol=1e-4)  # fmt: skip
    k2, v2 = k_ref.clone(), v_ref.clone()
    write_kv(new_key, -new_key, k2, v2, slots, **scales)
    write_kv_ref(new_key, -new_key, k_ref, v_ref, slots, **scales)
    assert torch.equal(_bytes(k2), _bytes(k_ref)) and torch.equal(_bytes(v2), _bytes(v_ref))


# Argument errors -------------------------------------------------------------------------------------------------


def _error_calls():
    """(name, call(k_cache, v_cache, **scales)) for each entry point that takes scales."""
    query = torch.randn(2, NUM_HEADS, HEAD_DIM, device=DEVICE)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    rows = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    cu = torch.arange(3, dtype=torch.int32, device=DEVICE)
    calls = {
        "write_kv_ref": lambda k, v, **s: write_kv_ref(rows, rows, k, v, slots, **s),
        "paged_decode_ref": lambda k, v, **s: paged_decode_ref(query, k, v, tables, lens, 0.1, **s),
        "paged_attention_ref": lambda k, v, **s: paged_attention_ref(query, k, v, tables, lens, cu, 0.1, **s),
    }
    if _TRITON:
        calls["write_kv_triton"] = lambda k, v, **s: write_kv_triton(rows, rows, k, v, slots, **s)
        calls["paged_decode_triton"] = lambda k, v, **s: paged_decode_triton(
            query.to(torch.bfloat16), k, v, tables, lens, 0.1, max_seq_len=3, **s
        )
        calls["paged_prefill_triton"] = lambda k, v, **s: paged_prefill_triton(
            query.to(torch.bfloat16), k, v, tables, lens, cu, 0.1, max_query_len=1, max_seq_len=3, **s
        )
    return calls


@pytest.mark.parametrize("entry", list(_error_calls()))
def test_scale_errors_name_the_argument(entry):
    call = _error_calls()[entry]
    shape = (2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    bf16 = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    fp8 = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_scale is for fp8 caches .* the cache is torch.bfloat16"):
        call(bf16, bf16, k_scale=one)
    with pytest.raises(ValueError, match=r"v_scale is for fp8 caches"):
        call(bf16, bf16, v_scale=one)
    with pytest.raises(ValueError, match=r"k_scale must be a contiguous float32 tensor of shape \[1\] .* "
                                         r"\[num_kv_heads=2\] .* got torch.float32 of shape \(3,\)"):  # fmt: skip
        call(fp8, fp8, k_scale=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match=r"v_scale must be .* got torch.bfloat16 of shape \(1,\)"):
        call(fp8, fp8, v_scale=torch.ones(1, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match=r"k_scale must be .* got torch.float32 of shape \(1, 2\)"):
        call(fp8, fp8, k_scale=torch.ones(1, 2, device=DEVICE))


@needs_triton
def test_cache_dtype_errors():
    shape = (2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    e4m3 = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    e5m2 = torch.zeros(shape, dtype=torch.float8_e5m2, device=DEVICE)
    query = torch.randn(2, NUM_HEADS, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_cache/v_cache dtype must equal query dtype torch.bfloat16 or be one fp8"):
        paged_decode_triton(query, e4m3, e5m2, tables, lens, 0.1, max_seq_len=3)
    with pytest.raises(ValueError, match=r"k_cache/v_cache dtype must be .* and equal, got torch.float8_e4m3fn"):
        write_kv_triton(query[:, :2], query[:, :2], e4m3, e5m2, torch.tensor([0, 1], device=DEVICE))
    new = torch.zeros(2, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match=r"new_key must be torch.bfloat16 \[num_seqs, num_kv_heads, head_dim\]"):
        paged_decode_triton(query, e4m3, e4m3, tables, lens, 0.1, max_seq_len=3, new_key=new, new_value=new,
                            slot_mapping=torch.tensor([0, 1], device=DEVICE))  # fmt: skip


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: a DecodeBinding keeps a direct Triton launch (kernels/launch.py), which the CPU interpreter "
    "of CI does not make (device machine: benchmarks/run_gpu.sh tests-kernels)",
)
def test_a_bound_fp8_decode_launch_takes_each_layers_scales():
    """DecodeBinding.launch relaunches an fp8 decode with another layer's caches and scales, bit for bit as the full
    call, and refuses (None) scales of another granularity or none where the bind had an fp8 pool's."""
    fp8 = torch.float8_e4m3fn
    scales = _scales("per_head_k")
    k_cache, v_cache, tables, lens, _, _ = _paged_batch([50, 17], fp8, scales, seed=6)
    query = torch.randn(2, NUM_HEADS, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    bind = []
    paged_decode_triton(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, max_seq_len=64,
                        min_keys_per_split=2048, bind=bind, **scales)  # fmt: skip
    assert len(bind) == 1
    other = {"k_scale": scales["k_scale"] * 2, "v_scale": scales["v_scale"] * 3}
    expected = paged_decode_triton(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, max_seq_len=64,
                                   min_keys_per_split=2048, **other)  # fmt: skip
    out = bind[0].launch(query, k_cache, v_cache, None, None, **other)
    assert out is not None and torch.equal(out, expected)
    swapped = {"k_scale": other["v_scale"], "v_scale": other["k_scale"]}  # per tensor / per head: another launch
    assert bind[0].launch(query, k_cache, v_cache, None, None, **swapped) is None
    assert bind[0].launch(query, k_cache, v_cache, None, None) is None  # 1.0 per tensor: not the bind's per-head k
