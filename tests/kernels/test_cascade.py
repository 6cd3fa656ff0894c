"""Shared-prefix (cascade) decode: paged_decode_triton(prefix_len=...) vs the plain torch reference.

Rows share their first blocks (the same physical ids, shuffled in the pool) and diverge after; the prefix kernel
reads those blocks once through row 0's table, the split kernel each row's own keys from ``prefix_len`` on, and the
merge combines them. The oracle is plain attention over each row's own table (kernels/reference.py): cascade must
not change the result. Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (tiny shapes: the interpreter is slow).
Cache slots nothing may read are NaN, and ``out`` starts as NaN.
"""

import pytest
import torch
from helpers import needs_triton
from hf_paged.kernels import cascade, decode, decode_plan, launch, paged_attention, paged_decode, split_decode
from hf_paged.kernels.decode import paged_decode_triton
from hf_paged.kernels.reference import paged_attention_ref, paged_decode_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}  # dtype -> (atol, rtol)
# Around a 3-block prefix of 16 (48 keys): longer, the prefix plus one own key, exactly the prefix (the split kernel
# has nothing), inside the prefix (the prefix holds the whole context), a padding row, a partial first block.
SEQ_LENS = [70, 49, 48, 33, 0, 17, 64]


def _shared_inputs(
    seq_lens: list[int],
    num_shared_blocks: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
):
    """Every row's table starts with the same ``num_shared_blocks`` physical blocks, then its own blocks.

    Shared slots hold data up to the longest row's length; every other slot nothing may read is NaN, and so are
    the table entries past each row's blocks (-1).

    Returns:
        query [num_seqs, num_heads, head_dim], k_cache and v_cache [num_blocks, block_size, num_kv_heads,
        head_dim], block_tables [num_seqs, max_blocks_per_seq] int32, seq_lens [num_seqs] int32.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    own_blocks = [max(0, n - num_shared_blocks) for n in blocks_per_seq]
    num_blocks = num_shared_blocks + sum(own_blocks) + 2
    max_blocks = max(blocks_per_seq + [num_shared_blocks]) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).int()
    shared, rest = perm[:num_shared_blocks], perm[num_shared_blocks:]
    shared_keys = min(max(seq_lens + [0]), num_shared_blocks * block_size)
    for i, block in enumerate(shared.tolist()):
        live = max(0, min(block_size, shared_keys - i * block_size))
        k_cache[block, :live] = torch.randn(live, num_kv_heads, head_dim, generator=gen)
        v_cache[block, :live] = torch.randn(live, num_kv_heads, head_dim, generator=gen)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    next_block = 0
    for s, seq_len in enumerate(seq_lens):
        block_tables[s, :num_shared_blocks] = shared
        for i in range(num_shared_blocks, blocks_per_seq[s]):
            block = rest[next_block].item()
            next_block += 1
            block_tables[s, i] = block
            live = min(block_size, seq_len - i * block_size)
            k_cache[block, :live] = torch.randn(live, num_kv_heads, head_dim, generator=gen)
            v_cache[block, :live] = torch.randn(live, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(
        t.to(DEVICE, dtype if t.is_floating_point() else t.dtype)
        for t in (query, k_cache, v_cache, block_tables, seq_lens_t)
    )


def _plain_ref(query, k_cache, v_cache, block_tables, seq_lens, scale, soft_cap=None):
    cu_seqlens_q = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    return paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, None, soft_cap)


def _prefix(n: int) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int32, device=DEVICE)


def _check(
    seq_lens, num_shared_blocks, prefix_len, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits,
    num_prefix_splits=None, soft_cap=None, seed=0,
) -> torch.Tensor:  # fmt: skip
    query, k_cache, v_cache, block_tables, seq_lens_t = _shared_inputs(
        seq_lens, num_shared_blocks, num_heads, num_kv_heads, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    result = paged_decode_triton(
        query, k_cache, v_cache, block_tables, seq_lens_t, scale, max_seq_len=max(seq_lens), soft_cap=soft_cap,
        out=out, num_splits=num_splits, prefix_len=_prefix(prefix_len), num_prefix_splits=num_prefix_splits,
    )  # fmt: skip
    assert result is out
    ref = _plain_ref(query, k_cache, v_cache, block_tables, seq_lens_t, scale, soft_cap)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    return out


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["group1", "group4", "group8"])
def test_cascade_equals_plain_attention(num_heads, num_kv_heads, dtype, num_splits):
    out = _check(SEQ_LENS, 3, 48, num_heads, num_kv_heads, 32, 16, dtype, num_splits)
    assert torch.equal(out[4], torch.zeros_like(out[4]))  # the padding row


@needs_triton
@pytest.mark.parametrize("prefix_len", [16, 32, 48])
def test_prefix_shorter_than_the_shared_blocks(prefix_len):
    """The caller may claim fewer shared keys than there are (a prefix that is not a multiple of the tile): the
    split kernel reads the rest of the shared blocks through each row's own table."""
    _check(SEQ_LENS, 3, prefix_len, 8, 2, 32, 16, torch.float32, num_splits=2)


@needs_triton
@pytest.mark.parametrize("block_size", [8, 24, 64])
def test_block_sizes(block_size):
    # 8 and 24: several blocks per 64-key tile (the per-key table path; 24 is no power of two); 64: one per tile.
    seq_lens = [3 * block_size + 5, 2 * block_size + 1, 2 * block_size, block_size - 1, 0]
    _check(seq_lens, 2, 2 * block_size, 4, 2, 32, block_size, torch.float32, num_splits=2)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2])  # 1: the split kernel folds the prefix partials in (no merge)
@pytest.mark.parametrize("num_prefix_splits", [1, 2, 5])
def test_long_prefix_over_several_prefix_splits(num_prefix_splits, num_splits):
    """A prefix of 640 keys (10 blocks of 64): up to 3 prefix splits of at least 256 keys run; a grid with more
    leaves the others empty."""
    _check([700, 641, 660, 0, 600], 10, 640, 4, 2, 16, 64, torch.float32, num_splits=num_splits,
           num_prefix_splits=num_prefix_splits)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_split_folds_the_prefix_partials(dtype):
    """One split with a prefix: the prefix kernel first, then the split kernel folding its partials in (no merge);
    equal to plain attention, with rows inside the prefix, a padding row and several prefix splits."""
    out = _check(SEQ_LENS, 3, 48, 8, 2, 32, 16, dtype, num_splits=1, num_prefix_splits=3)
    assert torch.equal(out[4], torch.zeros_like(out[4]))  # the padding row


@needs_triton
def test_many_rows_over_several_row_tiles():
    """20 sequences x group 4 = 80 query rows: two programs of 64 rows per KV head, the second one part-filled."""
    seq_lens = [40 + (7 * i) % 30 for i in range(20)]
    seq_lens[5] = 0
    seq_lens[11] = 20  # inside the prefix
    _check(seq_lens, 2, 32, 8, 2, 16, 16, torch.float32, num_splits=1)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_soft_cap(dtype):
    query, k_cache, v_cache, block_tables, seq_lens = _shared_inputs(SEQ_LENS, 3, 8, 2, 32, 16, dtype)
    query = query * 4  # scores spread ~4: tanh well past its linear part
    out = paged_decode_triton(
        query, k_cache, v_cache, block_tables, seq_lens, 0.18, max_seq_len=70, soft_cap=1.5, num_splits=2,
        prefix_len=_prefix(48),
    )  # fmt: skip
    ref = _plain_ref(query, k_cache, v_cache, block_tables, seq_lens, 0.18, soft_cap=1.5)
    no_cap = _plain_ref(query, k_cache, v_cache, block_tables, seq_lens, 0.18)
    assert (ref.float() - no_cap.float()).abs().max() > 0.1  # the cap matters in this case
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefix_len_zero_is_exactly_plain_decode(num_splits):
    """prefix_len 0 (a captured graph replayed for a step without a shared prefix): bit for bit the plain kernel."""
    query, k_cache, v_cache, block_tables, seq_lens = _shared_inputs(SEQ_LENS, 3, 8, 2, 32, 16, torch.bfloat16)
    args = (query, k_cache, v_cache, block_tables, seq_lens, 0.18)
    plain = paged_decode_triton(*args, max_seq_len=70, num_splits=num_splits)
    cascade_off = paged_decode_triton(*args, max_seq_len=70, num_splits=num_splits, prefix_len=_prefix(0))
    assert torch.equal(cascade_off, plain)


@needs_triton
def test_one_launch_serves_every_prefix_length():
    """The grid and constants are fixed by host bounds (a CUDA graph); the device prefix_len changes per step."""
    query, k_cache, v_cache, block_tables, seq_lens = _shared_inputs(SEQ_LENS, 3, 8, 2, 32, 16, torch.float32)
    ref = _plain_ref(query, k_cache, v_cache, block_tables, seq_lens, 0.18)
    prefix_len = _prefix(0)
    for n in (48, 0, 16, 32):
        prefix_len.fill_(n)
        out = paged_decode_triton(
            query, k_cache, v_cache, block_tables, seq_lens, 0.18, max_seq_len=1024, prefix_len=prefix_len,
            max_prefix_len=1024,
        )  # fmt: skip
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("block_size", [8, 16])
def test_suffix_settings_at_head_dim_128(block_size, num_splits):
    """At head_dim 128 a shared-prefix call's split kernel takes its own settings (CASCADE_SUFFIX_SETTINGS: 16-key
    tiles, one block-table entry a tile at block size 16, a lookup per key at 8) and the prefix kernel 64-key tiles
    over 4 warps, and the result still equals plain attention."""
    decode.PLANS.clear()
    seq_lens = [70, 49, 48, 0, 64]
    _check(seq_lens, 48 // block_size, 48, 4, 2, 128, block_size, torch.bfloat16, num_splits=num_splits)
    (plan,) = decode.PLANS.values()
    decode.PLANS.clear()
    suffix = plan.variants["cascade"]  # (constexpr args, MIN_TILES_PER_SPLIT, num_stages, num_warps, V_KEYS_MINOR)
    block_n, stages, warps = decode_plan.CASCADE_SUFFIX_SETTINGS
    assert suffix[2:4] == (stages, warps) and suffix[0][9] == block_n  # BLOCK_N
    assert (plan.prefix_split_rule[0], plan.prefix_num_warps) == (64, 4)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_long_prefix_at_head_dim_128(num_splits):
    """A 320-key prefix at head_dim 128: the prefix kernel's tiles fill 2 of 4 prefix splits (256 keys a split
    at least), which the split kernel folds in (one split) or the merge combines (three)."""
    _check([400, 333, 321, 0, 390], 20, 320, 4, 2, 128, 16, torch.bfloat16, num_splits=num_splits,
           num_prefix_splits=4)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("head_dim", [32, 128])  # 128: the split kernel's shared-prefix settings
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_kv_write_with_a_shared_prefix(dtype, num_splits, head_dim):
    """new_key/new_value/slot_mapping with prefix_len (an engine's cascade decode step with the K/V write fused): the
    split kernel writes each row's new K/V, at or above the prefix as in an engine step, and attends to it from
    registers; the prefix kernel reads the shared blocks. The new slots start as NaN (never read), a padding row
    has slot -1, one row's new token is the first key past the prefix."""
    seq_lens, block_size, num_kv_heads = [70, 49, 0, 64, 57], 16, 2
    query, k_cache, v_cache, block_tables, seq_lens_t = _shared_inputs(
        seq_lens, 3, 8, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    expected = _plain_ref(query, k_cache, v_cache, block_tables, seq_lens_t, scale)
    slots = [-1 if n == 0 else int(block_tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for s, n in enumerate(seq_lens)]  # fmt: skip
    slot_t = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    live = slot_t >= 0
    flat = lambda cache: cache.view(-1, num_kv_heads, head_dim)  # noqa: E731  [num_slots, Hkv, D]
    new_key = torch.zeros(len(seq_lens), num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    new_value = torch.zeros_like(new_key)
    new_key[live], new_value[live] = flat(k_cache)[slot_t[live]], flat(v_cache)[slot_t[live]]
    k_in, v_in = k_cache.clone(), v_cache.clone()
    flat(k_in)[slot_t[live]] = float("nan")
    flat(v_in)[slot_t[live]] = float("nan")
    out = torch.full_like(query, float("nan"))
    paged_decode_triton(
        query, k_in, v_in, block_tables, seq_lens_t, scale, max_seq_len=max(seq_lens), out=out, num_splits=num_splits,
        prefix_len=_prefix(48), new_key=new_key, new_value=new_value, slot_mapping=slot_t,
    )  # fmt: skip
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_in, k_cache, atol=0, rtol=0, equal_nan=True)  # written, nothing else touched
    torch.testing.assert_close(v_in, v_cache, atol=0, rtol=0, equal_nan=True)
    # The dispatcher takes the same arguments (on the CPU: write, then the prefix-reading reference, which reads
    # every slot of the tables and masks: no NaN there, the new slots hold garbage until written).
    k_in, v_in = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    flat(k_in)[slot_t[live]] = 1e3
    flat(v_in)[slot_t[live]] = 1e3
    cu_seqlens_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    got = paged_attention(
        query, k_in, v_in, block_tables, seq_lens_t, cu_seqlens_q, scale, max_query_len=1, max_seq_len=max(seq_lens),
        prefix_len=_prefix(48), key=new_key, value=new_value, slot_mapping=slot_t,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_in, k_cache.nan_to_num(0.0), atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefix_then_split_kernel_launch_with_pdl(num_splits, monkeypatch):
    """Where PDL is supported (SM90+: forced here on the host), a one-split shared-prefix call launches the prefix
    kernel with LAUNCH_DEPENDENTS and the split kernel with launch_pdl and WAIT_PREFIX (it waits before folding the
    partials in); never one without the other, and not with several splits (the merge reads the partials after
    both)."""
    decode.PLANS.clear()
    args = _shared_inputs(SEQ_LENS, 3, 8, 2, 32, 16, torch.float32)
    kwargs = dict(max_seq_len=max(SEQ_LENS), num_splits=num_splits, prefix_len=_prefix(48))
    paged_decode_triton(*args, 32**-0.5, **kwargs)  # makes the plan
    (plan,) = decode.PLANS.values()
    plan.pdl_ok = True
    launches = []

    def recorder(name, launcher):
        def record(grid, *launch_args, launch_pdl=False, **launch_kwargs):
            names = [p.name for p in launch.kernel_params(launcher.jit_fn)]
            launches.append((name, launch_args[names.index("LAUNCH_DEPENDENTS" if name == "prefix" else "WAIT_PREFIX")]
                             if name != "merge" else None, launch_pdl))  # fmt: skip

        return record

    monkeypatch.setattr(cascade, "PREFIX", recorder("prefix", cascade.PREFIX))
    monkeypatch.setattr(split_decode, "SPLIT", recorder("split", split_decode.SPLIT))
    monkeypatch.setattr(split_decode, "MERGE", recorder("merge", split_decode.MERGE))
    paged_decode_triton(*args, 32**-0.5, **kwargs)
    decode.PLANS.clear()
    if num_splits == 1:
        assert launches == [("prefix", True, False), ("split", True, True)]
    else:  # split kernel, prefix kernel, merge: no PDL between them (the prefix kernel sits between)
        assert launches == [("split", False, False), ("prefix", False, False), ("merge", None, False)]


@needs_triton
def test_argument_errors():
    query, k_cache, v_cache, block_tables, seq_lens = _shared_inputs([20, 30], 1, 4, 2, 32, 16, torch.float32)
    args = (query, k_cache, v_cache, block_tables, seq_lens, 0.18)
    with pytest.raises(ValueError, match=r"does not support sliding_window=8: pass prefix_len=None"):
        paged_decode_triton(*args, max_seq_len=30, sliding_window=8, prefix_len=_prefix(16))
    with pytest.raises(ValueError, match=r"prefix_len must be an int32 tensor of one element .* got torch.int64"):
        paged_decode_triton(*args, max_seq_len=30, prefix_len=_prefix(16).long())
    with pytest.raises(ValueError, match=r"num_prefix_splits must be in \[1, 64\] or None, got 0"):
        paged_decode_triton(*args, max_seq_len=30, prefix_len=_prefix(16), num_prefix_splits=0)


def test_reference_reads_the_prefix_through_row_0():
    """paged_decode_ref(prefix_len=...): the plain result where the rows share the prefix blocks, row 0's keys
    where a row's table says otherwise (what the kernels do, so a wrong prefix claim shows in outputs)."""
    query, k_cache, v_cache, block_tables, seq_lens = _shared_inputs([40, 37, 0], 2, 4, 2, 16, 16, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)  # the reference reads every table entry
    block_tables = block_tables.clamp(min=0)
    plain = _plain_ref(query, k_cache, v_cache, block_tables, seq_lens, 0.25)
    torch.testing.assert_close(
        paged_decode_ref(query, k_cache, v_cache, block_tables, seq_lens, 0.25, prefix_len=_prefix(32)), plain
    )
    diverged = block_tables.clone()
    diverged[1, 1] = block_tables[1, 2]  # row 1 does not share block 1 of the claimed 2-block prefix
    claimed = paged_decode_ref(query, k_cache, v_cache, diverged, seq_lens, 0.25, prefix_len=_prefix(32))
    torch.testing.assert_close(claimed, plain)  # keys 16..31 of row 1 come from row 0's table
    truth = _plain_ref(query, k_cache, v_cache, diverged, seq_lens, 0.25)
    assert (truth[1] - claimed[1]).abs().max() > 1e-3


def test_choose_num_prefix_splits():
    # The bench's prefix workload (200 rows, group 2 -> 7 row tiles of 64, 8 KV heads) with a 4096-token bound.
    assert cascade.choose_num_prefix_splits(4096, num_row_tiles=7, num_kv_heads=8, num_sms=132) == 10
    # Bounded by the prefix (256 keys a split), and by the GPU being full already.
    assert cascade.choose_num_prefix_splits(336, num_row_tiles=1, num_kv_heads=8, num_sms=132) == 2
    assert cascade.choose_num_prefix_splits(1 << 20, num_row_tiles=64, num_kv_heads=32, num_sms=132) == 1
    assert cascade.choose_num_prefix_splits(1 << 20, num_row_tiles=1, num_kv_heads=1, num_sms=132) == 16
    assert cascade.block_m_for(400, 128) == 64 and cascade.block_m_for(400, 256) == 32
    assert cascade.block_m_for(3, 128) == 16  # the tensor-core minimum


def test_paged_attention_cpu_path_and_errors():
    """The dispatcher: on the CPU a decode batch with prefix_len takes the decode reference (row 0's table for the
    prefix) over the table's columns the longest row reaches, and fills ``out``; prefix_len with a prefill batch or
    a sliding window is refused."""
    query, k_cache, v_cache, block_tables, seq_lens = _shared_inputs([40, 37, 0], 2, 4, 2, 16, 16, torch.float32)
    k_cache, v_cache, block_tables = k_cache.nan_to_num(0.0).cpu(), v_cache.nan_to_num(0.0).cpu(), block_tables.cpu()
    query, seq_lens = query.cpu(), seq_lens.cpu()
    cu_seqlens_q = torch.arange(4, dtype=torch.int32)
    args = (query, k_cache, v_cache, block_tables.clamp(min=0), seq_lens, cu_seqlens_q, 0.25)
    prefix_len = torch.tensor([32], dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    result = paged_attention(*args, max_query_len=1, out=out, prefix_len=prefix_len)
    assert result is out
    torch.testing.assert_close(out, paged_attention(*args))
    # An engine's table is as wide as max_model_len: the columns past the longest row are not read (a NaN block).
    wide = torch.cat([args[3], torch.full((3, 40), k_cache.shape[0], dtype=torch.int32)], dim=1)
    k_wide = torch.cat([k_cache, torch.full_like(k_cache[:1], float("nan"))])
    v_wide = torch.cat([v_cache, torch.full_like(v_cache[:1], float("nan"))])
    wide_args = (query, k_wide, v_wide, wide, seq_lens, cu_seqlens_q, 0.25)
    torch.testing.assert_close(paged_attention(*wide_args, max_query_len=1, prefix_len=prefix_len), out)
    with pytest.raises(ValueError, match=r"prefix_len is for decode batches \(max_query_len=1\), got max_query_len=2"):
        paged_attention(*args, max_query_len=2, prefix_len=prefix_len)
    with pytest.raises(ValueError, match=r"does not support sliding_window=4"):
        paged_attention(*args, max_query_len=1, sliding_window=4, prefix_len=prefix_len)
    with pytest.raises(ValueError, match=r"does not support sliding_window=4"):
        paged_decode(query, *args[1:5], 0.25, 64, sliding_window=4, prefix_len=prefix_len)


@needs_triton
def test_custom_op_with_prefix_traces_whole():
    """torch.ops.hf_paged.paged_decode with the optional prefix_len (what paged_decode calls on CUDA): fullgraph
    under torch.compile, and the plain result (here interpreted on the CPU)."""
    query, k_cache, v_cache, block_tables, seq_lens = _shared_inputs([40, 37, 0], 2, 4, 2, 16, 16, torch.float32)
    expected = _plain_ref(query, k_cache, v_cache, block_tables, seq_lens, 0.25)
    prefix_len = _prefix(32)

    def step():
        return torch.ops.hf_paged.paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens, 0.25, 64, 0, 0.0, prefix_len
        )

    out = torch.compile(step, backend="aot_eager", fullgraph=True)()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    plain = torch.ops.hf_paged.paged_decode(query, k_cache, v_cache, block_tables, seq_lens, 0.25, 64, 0, 0.0)
    torch.testing.assert_close(plain, expected, atol=1e-5, rtol=1e-5)  # callers that pass no prefix
