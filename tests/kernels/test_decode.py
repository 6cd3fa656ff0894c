"""paged_decode_triton vs the torch reference (kernels/reference.py).

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (keep shapes small: the interpreter is slow).
Every case poisons what the kernel must not read (cache slots past a sequence's length, unused
blocks, unused block-table entries) and what it must write (``out`` starts as NaN).
"""

import os

import pytest
import torch
from hf_paged.kernels import paged_attention
from hf_paged.kernels.decode import MAX_NUM_SPLITS, choose_num_splits, paged_decode_triton
from hf_paged.kernels.reference import paged_attention_ref, write_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels: run on CUDA (the device machine) and interpreted in CI (.ci/run sets TRITON_INTERPRET=1)",
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {  # dtype -> (atol, rtol)
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# 1 token, a partial first block, exactly 4 blocks of 16 / 1 of 64, and several tiles.
SEQ_LENS = [1, 17, 64, 150]


def _make_inputs(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    num_spare_blocks: int = 3,
):
    """Random query and cache, with shuffled block tables and NaN wherever nothing may be read.

    Returns:
        query [num_seqs, num_heads, head_dim], k_cache and v_cache
        [num_blocks, block_size, num_kv_heads, head_dim], block_tables [num_seqs,
        max_blocks_per_seq] int32 (unused entries -1), seq_lens [num_seqs] int32.
    """
    torch.manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    max_blocks = max(blocks_per_seq + [1]) + 1  # one always-unused column
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    perm = torch.randperm(num_blocks)
    next_block = 0
    for s, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        blocks = perm[next_block : next_block + n_blocks]
        next_block += n_blocks
        block_tables[s, :n_blocks] = blocks.int()
        for i, block in enumerate(blocks.tolist()):
            live = min(block_size, seq_len - i * block_size)  # slots past seq_len stay NaN
            k_cache[block, :live] = torch.randn(live, num_kv_heads, head_dim).to(dtype)
            v_cache[block, :live] = torch.randn(live, num_kv_heads, head_dim).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return (t.to(DEVICE) for t in (query, k_cache, v_cache, block_tables, seq_lens_t))


def _check(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int | None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    seed: int = 0,
    tile_settings: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    query, k_cache, v_cache, block_tables, seq_lens_t = _make_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    result = paged_decode_triton(
        query, k_cache, v_cache, block_tables, seq_lens_t, scale,
        max_seq_len=max(seq_lens), sliding_window=sliding_window, soft_cap=soft_cap, out=out,
        num_splits=num_splits, tile_settings=tile_settings,
    )  # fmt: skip
    assert result is out
    cu_seqlens_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(
        query, k_cache, v_cache, block_tables, seq_lens_t, cu_seqlens_q, scale, sliding_window, soft_cap
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    return out


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads",
    [(4, 4), (4, 2), (8, 2), (16, 2), (4, 1)],
    ids=["mha", "gqa2", "gqa4", "gqa8", "mqa"],
)
def test_head_ratios(num_heads, num_kv_heads, dtype):
    _check(SEQ_LENS, num_heads, num_kv_heads, 64, 16, dtype, num_splits=3)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 128, 256])
def test_head_dims(head_dim, dtype):
    _check(SEQ_LENS, 8, 2, head_dim, 16, dtype, num_splits=None)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 24, 64, 256])
def test_block_sizes_and_splits(block_size, num_splits):
    # 24: a multiple of 8 that is no power of two (the per-key block-table path).
    # 8 splits of a 1-token or 17-token sequence leave most splits empty.
    _check(SEQ_LENS, 4, 2, 64, block_size, torch.float16, num_splits=num_splits)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("sliding_window", [1, 7, 64, 200])
def test_sliding_window(sliding_window, block_size, num_splits):
    # 200 > every length (no effect); 64 with block 64 starts the window mid-block.
    _check(SEQ_LENS, 8, 2, 64, block_size, torch.bfloat16, num_splits, sliding_window=sliding_window)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_soft_cap(dtype):
    # Cap 1.5 with scores of spread ~ sqrt(head_dim) * scale * 4 = 4: tanh well past its linear part.
    query, k_cache, v_cache, block_tables, seq_lens = _make_inputs(SEQ_LENS, 8, 2, 64, 16, dtype)
    query = query * 4
    out = torch.full_like(query, float("nan"))
    paged_decode_triton(
        query, k_cache, v_cache, block_tables, seq_lens, 0.125, max_seq_len=150, soft_cap=1.5, out=out, num_splits=3
    )
    cu_seqlens_q = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 0.125, None, 1.5)
    no_cap = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 0.125)
    assert (ref.float() - no_cap.float()).abs().max() > 0.1  # the cap matters in this case
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@needs_triton
def test_soft_cap_with_window():
    _check(SEQ_LENS, 8, 2, 64, 16, torch.float32, num_splits=3, sliding_window=40, soft_cap=2.0)


@needs_triton
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_zero_length_rows_write_zeros(num_splits):
    seq_lens = [0, 33, 0, 1, 0]
    out = _check(seq_lens, 8, 2, 64, 16, torch.float16, num_splits=num_splits)
    assert torch.equal(out[[0, 2, 4]], torch.zeros_like(out[[0, 2, 4]]))


@needs_triton
def test_all_rows_zero_length():
    out = _check([0, 0], 4, 2, 64, 16, torch.bfloat16, num_splits=4)
    assert torch.equal(out, torch.zeros_like(out))


@needs_triton
def test_kv_width_not_power_of_two():
    # num_kv_heads * head_dim = 240 and group 2.
    _check(SEQ_LENS, 6, 3, 80, 16, torch.float16, num_splits=2)


@needs_triton
def test_many_sequences_default_splits():
    seq_lens = [5, 130, 1, 64, 99, 16, 0, 150]
    _check(seq_lens, 4, 2, 64, 16, torch.float16, num_splits=None, seed=3)


@needs_triton
def test_strided_views():
    """Query from a fused qkv tensor, K/V from one combined pool, out a strided view."""
    query, k_cache, v_cache, block_tables, seq_lens = _make_inputs(SEQ_LENS, 8, 2, 64, 16, torch.float16)
    num_seqs = query.shape[0]
    qkv = torch.randn(num_seqs, 8 + 2 + 2, 64, dtype=torch.float16, device=DEVICE)
    qkv[:, :8] = query
    kv_pool = torch.stack([k_cache, v_cache], dim=1)  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    wide_tables = torch.full((num_seqs, 2 * block_tables.shape[1]), -1, dtype=torch.int32, device=DEVICE)
    wide_tables[:, ::2] = block_tables
    out_buf = torch.full((num_seqs, 8, 2 * 64), float("nan"), dtype=torch.float16, device=DEVICE)
    out = out_buf[:, :, :64]
    paged_decode_triton(
        qkv[:, :8], kv_pool[:, 0], kv_pool[:, 1], wide_tables[:, ::2], seq_lens, 0.125,
        max_seq_len=150, out=out, num_splits=3,
    )  # fmt: skip
    cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert out_buf[:, :, 64:].isnan().all()  # nothing written outside the view


@needs_triton
def test_max_seq_len_hint_does_not_affect_result():
    """max_seq_len only picks num_splits: a stale, too-small hint still gives the right answer."""
    query, k_cache, v_cache, block_tables, seq_lens = _make_inputs(SEQ_LENS, 4, 2, 64, 16, torch.float32)
    exact = paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, 0.125, max_seq_len=150)
    stale = paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, 0.125, max_seq_len=1)
    torch.testing.assert_close(stale, exact, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("num_splits", [3, 8, 64])
def test_long_and_short_contexts_share_a_split_grid(num_splits):
    """Each sequence uses as many of the grid's splits as its context fills (a graph captured for a long bound):
    uneven splits of a long context, a few of a middle one, one of a short one, the rest empty."""
    _check([1, 17, 300, 700], 8, 2, 64, 16, torch.float32, num_splits=num_splits)
    _check([700, 129], 4, 4, 32, 64, torch.bfloat16, num_splits=num_splits, sliding_window=500)


def _record_decode_launches(monkeypatch) -> list:
    """(BLOCK_N, num_stages, num_warps) of every split-kernel launch from now on, appended to the returned list."""
    from hf_paged.kernels import split_decode

    launches = []
    launch = split_decode.SPLIT
    block_n_position = launch.jit_fn.arg_names.index("BLOCK_N")

    def recording(grid, *args, **options):
        launches.append((args[block_n_position], options["num_stages"], options["num_warps"]))
        return launch(grid, *args, **options)

    monkeypatch.setattr(split_decode, "SPLIT", recording)
    return launches


@needs_triton
@pytest.mark.parametrize("num_splits, long", [(1, True), (2, True), (3, False)])
def test_short_and_long_split_settings(num_splits, long, monkeypatch):
    """At head_dim 128 the launch settings follow the keys per split: 700 keys in one or two splits take the
    long-split settings (64-key tiles, 3 stages, 4 warps), three splits of at most 256 keys 32-key tiles over 3
    stages; both give the reference's result."""
    from hf_paged.kernels import decode_plan

    launches = _record_decode_launches(monkeypatch)
    _check([1, 17, 300, 700], 4, 2, 128, 16, torch.float32, num_splits=num_splits)
    expected = decode_plan.LONG_SETTINGS if long else decode_plan.SHORT_SETTINGS
    assert launches == [expected]
    assert expected == ((64, 3, 4) if long else (32, 3, 4))


@needs_triton
@pytest.mark.parametrize("settings", [(32, 3, 2), (16, 2, 1), (128, 2, 8)])
def test_forced_tile_settings_give_the_reference(settings, monkeypatch):
    """``tile_settings`` (what benchmarks/tools/decode_sweep.py times) changes only the launch: tiles smaller and
    larger than a block, other stage and warp counts, with and without splits."""
    launches = _record_decode_launches(monkeypatch)
    for num_splits in (1, 2):
        _check([1, 17, 300, 700], 4, 2, 128, 16, torch.bfloat16, num_splits=num_splits, tile_settings=settings)
    assert launches == [settings, settings]


@needs_triton
def test_empty_batch():
    query, k_cache, v_cache, block_tables, seq_lens = _make_inputs([], 4, 2, 64, 16, torch.float16)
    out = paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, 0.125, max_seq_len=0)
    assert out.shape == (0, 4, 64)


@pytest.mark.gpu
@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="needs a CUDA device: a pool of more than 2^31 elements (4.3 GB) (runs on the device machine: "
    "benchmarks/run_gpu.sh tests-kernels)",
)
def test_large_pool_index_overflow():
    """Blocks whose element offset exceeds 2^31 must be addressed with int64 math."""
    block_size, num_kv_heads, head_dim = 16, 2, 64
    num_blocks = (2**31) // (block_size * num_kv_heads * head_dim) + 64  # last blocks sit past 2^31 elements
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    seq_lens = torch.tensor([100, 37], dtype=torch.int32, device=DEVICE)
    block_tables = torch.arange(num_blocks - 16, num_blocks, dtype=torch.int32, device=DEVICE).view(2, 8)
    torch.manual_seed(0)
    k_cache[num_blocks - 16 :] = torch.randn_like(k_cache[num_blocks - 16 :])
    v_cache[num_blocks - 16 :] = torch.randn_like(v_cache[num_blocks - 16 :])
    query = torch.randn(2, 8, head_dim, dtype=torch.float16, device=DEVICE)
    cu_seqlens_q = torch.arange(3, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 0.125)
    for num_splits in (1, 3):
        out = paged_decode_triton(
            query, k_cache, v_cache, block_tables, seq_lens, 0.125, max_seq_len=100, num_splits=num_splits
        )
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_choose_num_splits():
    # A full batch or a short context: one split (the merge is skipped).
    assert choose_num_splits(4096, num_seqs=256, num_kv_heads=8, num_sms=132) == 1
    assert choose_num_splits(64, num_seqs=1, num_kv_heads=8, num_sms=132) == 1
    # A small batch with a long context splits, within the bounds.
    assert 1 < choose_num_splits(4096, num_seqs=4, num_kv_heads=8, num_sms=132) <= MAX_NUM_SPLITS
    assert choose_num_splits(1 << 20, num_seqs=1, num_kv_heads=1, num_sms=132) == MAX_NUM_SPLITS
    assert choose_num_splits(0, num_seqs=0, num_kv_heads=8, num_sms=132) == 1
    # FP8 pools' plans take at most one wave of two programs an SM (rounded down): fewer, longer splits than bf16's
    # two waves, rounded up.
    assert choose_num_splits(4096, num_seqs=32, num_kv_heads=8, num_sms=132) == 3
    fp8_rule = {"programs_per_sm": 2, "one_wave": True}
    assert choose_num_splits(4096, num_seqs=32, num_kv_heads=8, num_sms=132, **fp8_rule) == 1
    assert choose_num_splits(32768, num_seqs=1, num_kv_heads=8, num_sms=132, **fp8_rule) == 33
    assert choose_num_splits(4096, num_seqs=64, num_kv_heads=8, num_sms=132, **fp8_rule) == 1  # never below one


def test_argument_errors():
    query, k_cache, v_cache, block_tables, seq_lens = _make_inputs([5, 9], 6, 4, 64, 16, torch.float16)
    args = (k_cache, v_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        paged_decode_triton(query, *args, max_seq_len=9)
    query = query[:, :4]
    with pytest.raises(ValueError, match=r"num_splits must be in \[1, 64\] or None, got 0"):
        paged_decode_triton(query, *args, max_seq_len=9, num_splits=0)
    with pytest.raises(ValueError, match=r"block_tables must be int32 .* got torch.int64"):
        paged_decode_triton(query, k_cache, v_cache, block_tables.long(), seq_lens, 0.125, max_seq_len=9)
    with pytest.raises(ValueError, match=r"k_cache/v_cache dtype must equal query dtype torch.float32"):
        paged_decode_triton(query.float(), *args, max_seq_len=9)
    with pytest.raises(ValueError, match=r"head_dim must equal query head_dim 32, got 64"):
        paged_decode_triton(query[..., :32], *args, max_seq_len=9)
    with pytest.raises(ValueError, match=r"out must match query"):
        paged_decode_triton(query, *args, max_seq_len=9, out=torch.empty_like(query[:1]))


@needs_triton
def test_checks_after_a_good_call_of_the_same_signature():
    """Checks are kept per argument signature (shapes, strides, dtypes, devices): a signature that passed once still
    has its per-call values checked, and any change of a checked field is checked again."""
    query, k_cache, v_cache, block_tables, seq_lens = _make_inputs([5, 9], 4, 2, 32, 16, torch.float32)
    args = (k_cache, v_cache, block_tables, seq_lens, 0.125)
    paged_decode_triton(query, *args, max_seq_len=9)  # good: its signature's plan is kept
    with pytest.raises(ValueError, match=r"max_seq_len must be >= 0, got -1"):
        paged_decode_triton(query, *args, max_seq_len=-1)
    with pytest.raises(ValueError, match=r"num_splits must be in \[1, 64\] or None, got 65"):
        paged_decode_triton(query, *args, max_seq_len=9, num_splits=65)
    with pytest.raises(ValueError, match=r"seq_lens must be int32"):
        paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens.long(), 0.125, max_seq_len=9)
    with pytest.raises(ValueError, match=r"out must match query"):
        paged_decode_triton(query, *args, max_seq_len=9, out=torch.empty_like(query).half())
    prefix = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    paged_decode_triton(query, *args, max_seq_len=9, prefix_len=prefix)  # good, another signature
    with pytest.raises(ValueError, match=r"prefix_len \(cascade\) does not support sliding_window=4"):
        paged_decode_triton(query, *args, max_seq_len=9, prefix_len=prefix, sliding_window=4)
    with pytest.raises(ValueError, match=r"num_prefix_splits must be in \[1, 64\] or None, got 0"):
        paged_decode_triton(query, *args, max_seq_len=9, prefix_len=prefix, num_prefix_splits=0)


def _fused_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Inputs of a decode step whose new tokens are not in the cache yet: their slots hold NaN (the kernel must take
    them from new_key/new_value), zero-length rows get slot -1. Returns the _make_inputs tensors plus new_key,
    new_value [num_seqs, num_kv_heads, head_dim] (strided views, as an attention layer hands them over) and
    slot_mapping [num_seqs] int64."""
    query, k_cache, v_cache, block_tables, seq_lens_t = _make_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed
    )
    slots = []
    for s, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            slots.append(-1)
            continue
        pos = seq_len - 1
        block = int(block_tables[s, pos // block_size])
        slots.append(block * block_size + pos % block_size)
        k_cache[block, pos % block_size] = float("nan")
        v_cache[block, pos % block_size] = float("nan")
    torch.manual_seed(seed + 1)
    # [batch, num_kv_heads, 1, head_dim] -> [batch, num_kv_heads, head_dim]: not contiguous across heads
    states = torch.randn(len(seq_lens), num_kv_heads, 2, head_dim).to(dtype).to(DEVICE)
    new_key, new_value = states[:, :, 0], states[:, :, 1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    return query, k_cache, v_cache, block_tables, seq_lens_t, new_key, new_value, slot_mapping


@needs_triton
@pytest.mark.parametrize(
    "dtype, block_size, num_splits, window, cap",
    [
        (torch.float32, 16, None, None, None),
        (torch.bfloat16, 16, 1, None, None),
        (torch.float16, 16, 3, None, None),
        (torch.bfloat16, 24, 8, None, None),  # the per-key block-table path, most splits empty
        (torch.float16, 64, 2, 7, None),
        (torch.bfloat16, 16, 3, None, 5.0),
    ],
)
def test_fused_kv_write(dtype, block_size, num_splits, window, cap):
    """new_key/new_value/slot_mapping: the kernel writes the new token's K/V at its slot and attends to them; the
    result and the cache equal write_kv followed by the decode (the reference). The new tokens sit first in a tile
    (65, 33), alone (1), mid-tile and at a block's end (64); a zero-length row writes nothing."""
    seq_lens = [1, 17, 64, 150, 65, 33, 0]
    query, k_cache, v_cache, block_tables, seq_lens_t, new_key, new_value, slots = _fused_inputs(
        seq_lens, 8, 2, 64, block_size, dtype
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(new_key, new_value, k_ref, v_ref, slots)
    scale = 64**-0.5
    out = paged_decode_triton(
        query, k_cache, v_cache, block_tables, seq_lens_t, scale, max_seq_len=150, num_splits=num_splits,
        sliding_window=window, soft_cap=cap, new_key=new_key, new_value=new_value, slot_mapping=slots,
    )  # fmt: skip
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, atol=0, rtol=0)  # the new slots, nothing else
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, atol=0, rtol=0)
    cu_seqlens_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_ref, v_ref, block_tables, seq_lens_t, cu_seqlens_q, scale, window, cap)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@needs_triton
def test_fused_kv_write_through_paged_attention():
    """paged_attention(key=, value=, slot_mapping=) on a decode batch writes the new K/V and attends to them (on CUDA
    through the fused kernel, on the CPU through write_kv and the reference): the same cache and output as both
    done one after the other."""
    seq_lens = [3, 40, 16]
    query, k_cache, v_cache, block_tables, seq_lens_t, new_key, new_value, slots = _fused_inputs(
        seq_lens, 4, 2, 32, 16, torch.float32
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(new_key, new_value, k_ref, v_ref, slots)
    cu_seqlens_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    out = paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens_t, cu_seqlens_q, 0.2, max_query_len=1, max_seq_len=40,
        key=new_key, value=new_value, slot_mapping=slots, min_keys_per_split=4096,
    )  # fmt: skip
    ref = paged_attention_ref(query, k_ref, v_ref, block_tables, seq_lens_t, cu_seqlens_q, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"slot_mapping \(write key/value first\) needs key and value"):
        paged_attention(query, k_cache, v_cache, block_tables, seq_lens_t, cu_seqlens_q, 0.2, slot_mapping=slots)


@needs_triton
def test_fused_kv_write_argument_errors():
    query, k_cache, v_cache, block_tables, seq_lens, new_key, new_value, slots = _fused_inputs(
        [5, 9], 4, 2, 32, 16, torch.float32
    )
    args = (query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match=r"new_key, new_value and slot_mapping go together"):
        paged_decode_triton(*args, max_seq_len=9, new_key=new_key, new_value=new_value)
    with pytest.raises(ValueError, match=r"new_value must be torch.float32 \[num_seqs, num_kv_heads, head_dim\]"):
        paged_decode_triton(*args, max_seq_len=9, new_key=new_key, new_value=new_value[:1], slot_mapping=slots)
    with pytest.raises(ValueError, match=r"new_key must be torch.float32"):
        paged_decode_triton(*args, max_seq_len=9, new_key=new_key.half(), new_value=new_value, slot_mapping=slots)
    with pytest.raises(ValueError, match=r"slot_mapping must be int32/int64 \[num_seqs=2\]"):
        paged_decode_triton(*args, max_seq_len=9, new_key=new_key, new_value=new_value, slot_mapping=slots.float())


def test_min_keys_per_split():
    """More keys per split, fewer splits (an eager caller's choice); never fewer keys than the default minimum."""
    assert choose_num_splits(512, 1, 8, 132) == 8
    assert choose_num_splits(512, 1, 8, 132, min_keys_per_split=2048) == 1
    assert choose_num_splits(4096, 1, 8, 132, min_keys_per_split=2048) == 2
    assert choose_num_splits(512, 1, 8, 132, min_keys_per_split=1) == 8  # raised to MIN_KEYS_PER_SPLIT
    assert choose_num_splits(8192, 64, 8, 132, min_keys_per_split=2048) == choose_num_splits(8192, 64, 8, 132)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: a DecodeBinding keeps a direct Triton launch (kernels/launch.py), which the CPU interpreter "
    "of CI does not make (device machine: benchmarks/run_gpu.sh tests-kernels)",
)
@pytest.mark.parametrize("fused", [False, True])
def test_a_bound_decode_launch_repeats_the_call_for_other_layers(fused):
    """paged_decode_triton(bind=[...]) keeps its launch (one split, no prefix); DecodeBinding.launch then gives
    another layer's output bit for bit as the full call does, writing the new K/V when fused, and refuses (None,
    nothing launched) tensors of another layout: another pool geometry, a misaligned query, a fused call on an
    unfused bind or the reverse."""
    seq_lens = [1, 17, 64, 150]
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    query, k_cache, v_cache, tables, lens = _make_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    slots = torch.stack([tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size
                         for s, n in enumerate(seq_lens)]).long()  # fmt: skip

    def layer():  # another layer's tensors: same layout, same tables and lengths
        k = torch.randn(k_cache.shape, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn(v_cache.shape, generator=gen, device="cuda").to(torch.bfloat16)
        q = torch.randn(query.shape, generator=gen, device="cuda").to(torch.bfloat16)
        new = torch.randn((len(seq_lens), num_kv_heads, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
        return q, k, v, new, -new

    def full_call(q, k, v, nk, nv, bind=None):
        kwargs = dict(new_key=nk, new_value=nv, slot_mapping=slots) if fused else {}
        return paged_decode_triton(q, k, v, tables, lens, head_dim**-0.5, max_seq_len=max(seq_lens),
                                   min_keys_per_split=2048, bind=bind, **kwargs)  # fmt: skip

    bind = []
    first = layer()
    full_call(*first, bind=bind)
    assert len(bind) == 1
    binding = bind[0]
    for _ in range(2):
        q, k, v, nk, nv = layer()
        k_ref, v_ref = k.clone(), v.clone()
        expected = full_call(q, k_ref, v_ref, nk, nv)
        out = binding.launch(q, k, v, nk if fused else None, nv if fused else None)
        assert out is not None and torch.equal(out, expected)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # fused: the same slots written; else untouched
    q, k, v, nk, nv = layer()
    bigger = torch.zeros((k.shape[0] + 1, *k.shape[1:]), dtype=k.dtype, device="cuda")
    assert binding.launch(q, bigger, bigger, nk if fused else None, nv if fused else None) is None
    storage = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    misaligned = storage[1:].view(q.shape).copy_(q)
    assert binding.launch(misaligned, k, v, nk if fused else None, nv if fused else None) is None
    assert binding.launch(q, k, v, None if fused else nk, None if fused else nv) is None
    # Several splits (a merge launch follows): nothing is kept.
    many = []
    paged_decode_triton(q, k, v, tables, lens, head_dim**-0.5, max_seq_len=max(seq_lens), num_splits=3, bind=many)
    assert many == []


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: a CUDA graph's private memory pool (device machine: benchmarks/run_gpu.sh tests-kernels)",
)
def test_a_one_split_call_keeps_nothing_in_a_cuda_graph_pool():
    """A one-split call passes placeholder partials it never reads. Made inside a graph capture (or a torch.compile
    "reduce-overhead" warm-up), nothing of them may stay alive in that graph's private pool: inductor's CUDA-graph
    trees refuse the next recording when they find such a tensor (the PagedCache fuzzer on CUDA found one kept per
    device, made in a warm-up)."""
    query, k_cache, v_cache, tables, lens = _make_inputs([17, 64, 150], 4, 2, 64, 16, torch.bfloat16)

    def call():
        return paged_decode_triton(query, k_cache, v_cache, tables, lens, 0.125, max_seq_len=150, num_splits=1)

    expected = call()  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    out_ptr = out.data_ptr()
    graph.replay()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    pool = tuple(graph.pool())

    def live_in_pool() -> list[int]:
        return [
            segment["address"] + sum(b["size"] for b in segment["blocks"][:i])
            for segment in torch.cuda.memory_snapshot()
            if tuple(segment["segment_pool_id"]) == pool
            for i, block in enumerate(segment["blocks"])
            if block["state"] == "active_allocated"
        ]

    assert out_ptr in live_in_pool()  # the check sees the pool's live tensors
    del out
    assert live_in_pool() == []


@needs_triton
def test_the_split_merge_launches_with_pdl_for_small_split_grids(monkeypatch):
    """Where PDL is supported (SM90+: forced here on the host), a several-split call without a prefix whose split
    grid fits one round of resident programs (PROGRAMS_PER_SM an SM) launches the merge with launch_pdl and
    WAIT_PRIMARY, and the split kernel triggers it at once (LAUNCH_DEPENDENTS); a larger grid launches both without
    PDL (the merge's waiting programs would hold SM slots the split grid needs). One split: no merge, no PDL."""
    from hf_paged.kernels import decode, launch, split_decode

    seq_lens = [150, 90, 30]  # 3 rows x 2 KV heads
    args = tuple(_make_inputs(seq_lens, 4, 2, 32, 16, torch.float32))
    launches = []

    def recorder(name, launcher):
        def record(grid, *launch_args, launch_pdl=False, **launch_kwargs):
            names = [p.name for p in launch.kernel_params(launcher.jit_fn)]
            flag = "LAUNCH_DEPENDENTS" if name == "split" else "WAIT_PRIMARY"
            launches.append((name, launch_args[names.index(flag)], launch_pdl))

        return record

    for num_splits, num_sms, expected in (
        (3, 132, [("split", True, False), ("merge", True, True)]),  # 18 programs <= 4 x 132
        (3, 4, [("split", False, False), ("merge", False, False)]),  # 18 programs > 4 x 4
        (1, 4, [("split", False, False)]),
    ):
        decode.PLANS.clear()
        paged_decode_triton(*args, 32**-0.5, max_seq_len=150, num_splits=num_splits)  # makes the plan
        (plan,) = decode.PLANS.values()
        plan.pdl_ok, plan.num_sms = True, num_sms
        launches.clear()
        with monkeypatch.context() as patch:
            patch.setattr(split_decode, "SPLIT", recorder("split", split_decode.SPLIT))
            patch.setattr(split_decode, "MERGE", recorder("merge", split_decode.MERGE))
            paged_decode_triton(*args, 32**-0.5, max_seq_len=150, num_splits=num_splits)
        assert launches == expected, (num_splits, num_sms)
    decode.PLANS.clear()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs an SM90+ CUDA device: programmatic dependent launch (runs on the device machine: "
    "benchmarks/run_gpu.sh tests-kernels)",
)
def test_the_merge_reads_every_partial_with_and_without_pdl():
    """The merge waits for the whole split grid: on a card, a split grid of one round (merge launched with PDL) and
    of several rounds (no PDL) give the same rows bit for bit, eager and replayed in a CUDA graph, and match the
    reference."""
    seq_lens = [int(n) for n in torch.randint(1, 2048, (96,), generator=torch.Generator().manual_seed(3))]
    query, k_cache, v_cache, tables, lens = _make_inputs(seq_lens, 32, 8, 128, 16, torch.bfloat16)
    cu_seqlens_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, tables, lens, cu_seqlens_q, 128**-0.5)
    outs = {}
    for batch in (96, 4):  # 96 x 8 x 4 splits: several rounds (no PDL); 4 x 8 x 4: one round (PDL)
        q, t, n = query[:batch], tables[:batch], lens[:batch]
        eager = paged_decode_triton(q, k_cache, v_cache, t, n, 128**-0.5, max_seq_len=2048, num_splits=4)
        out = torch.empty_like(q)
        paged_decode_triton(q, k_cache, v_cache, t, n, 128**-0.5, max_seq_len=2048, num_splits=4, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_decode_triton(q, k_cache, v_cache, t, n, 128**-0.5, max_seq_len=2048, num_splits=4, out=out)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), batch
        outs[batch] = eager
        torch.testing.assert_close(eager.float(), ref[:batch].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(outs[4], outs[96][:4])  # each row's splits are the same: only the launch differs
