"""paged_prefill_triton against paged_attention_ref (kernels/reference.py).

On CPU the Triton kernel runs under TRITON_INTERPRET=1, so shapes stay small; the same tests run
unchanged on CUDA. Poisoning:
- every cache slot that holds no context token is NaN (spare blocks, the tail of each last block,
  unused table entries point at a NaN block), so a read outside the context shows up as NaN;
- ``out`` starts as NaN, and rows past ``cu_seqlens_q[-1]`` must stay NaN.
"""

import os

import pytest
import torch
from helpers import record_prefill_launches
from hf_paged.kernels.reference import paged_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels: run on CUDA (the device machine) and interpreted in CI (.ci/run sets TRITON_INTERPRET=1)",
)

if DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
    from hf_paged.kernels import prefill
    from hf_paged.kernels.prefill import paged_prefill_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}  # atol, rtol

# (q_len, seq_len) per sequence. q_len == seq_len: fresh prompt; q_len < seq_len: chunked prefill or
# prefix hit over cached context; q_len == 1: a decode token in a mixed batch; q_len == 0: idle slot.
MIXED = [(13, 13), (7, 40), (1, 23), (30, 30), (1, 1)]


def _make_case(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, extra_tokens=0, spare_blocks=3, seed=0):
    """Random paged inputs: shuffled block tables, NaN everywhere outside the context.

    Returns:
        query: [num_tokens + extra_tokens, num_heads, head_dim]; the extra rows belong to no sequence.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: [num_seqs, max_blocks_per_seq], int32; unused entries name a NaN block.
        seq_lens: [num_seqs], int32.
        cu_seqlens_q: [num_seqs + 1], int32.
    """
    torch.manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    max_blocks = max(blocks_per_seq) + 1  # one unused column in every row
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    ids = torch.randperm(num_blocks, device=DEVICE)
    nan_block = ids[-1].item()  # never holds context
    block_tables = torch.full((len(seqs), max_blocks), nan_block, dtype=torch.int32, device=DEVICE)
    used = 0
    for s, (_, seq_len) in enumerate(seqs):
        n = blocks_per_seq[s]
        block_tables[s, :n] = ids[used : used + n].int()
        used += n
        for pos in range(0, seq_len, block_size):  # fill the context's slots only
            length = min(block_size, seq_len - pos)
            block = block_tables[s, pos // block_size].item()
            k_cache[block, :length] = torch.randn(length, num_kv_heads, head_dim, device=DEVICE).to(dtype)
            v_cache[block, :length] = torch.randn(length, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    q_lens = [q_len for q_len, _ in seqs]
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens + extra_tokens, num_heads, head_dim, device=DEVICE).to(dtype)
    seq_lens = torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32, device=DEVICE)
    cu_seqlens_q = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).int()
    return query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q


def _tiles(dtype, head_dim, contig_kv=False, block_m=None, block_n=None):
    """``tiles=`` forcing BLOCK_M / BLOCK_N (None: the default's), the rest as ``default_tiles``; None when neither
    is forced. Small tiles give many row tiles and all three key ranges on the short sequences the interpreter can
    afford."""
    if block_m is None and block_n is None:
        return None
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    tile_m, tile_n, num_warps, num_stages, k_row_major = prefill.default_tiles(dtype, block_d, contig_kv)
    return block_m or tile_m, block_n or tile_n, num_warps, num_stages, k_row_major


def _check(
    seqs,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    dtype=torch.float16,
    sliding_window=None,
    soft_cap=None,
    block_m=None,
    block_n=None,
    query_view=False,
    contig_kv=False,
    key_ramp=False,
    scale=None,  # default head_dim**-0.5
    extra=3,
    max_query_len=None,  # host hints; default: the batch's own
    max_seq_len=None,
    tiles=None,  # forced tiles (else block_m / block_n over the default's)
    **grid,  # the launcher's grid tuning for tests: spare_slots, tokens_per_spare_slot, scan_max_seqs
):
    query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q = _make_case(
        seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, extra_tokens=extra
    )
    if key_ramp:  # key norms grow with the block id: row maxima rise over the tiles (a rescale at every tile)
        ramp = torch.linspace(0.2, 3.0, k_cache.shape[0], device=DEVICE).to(dtype)[:, None, None, None]
        k_cache = k_cache * ramp
    if query_view:  # query as a slice of a fused qkv projection: token stride 3 * num_heads * head_dim
        qkv = torch.randn(query.shape[0], 3 * num_heads, head_dim, device=DEVICE).to(dtype)
        qkv[:, :num_heads] = query
        query = qkv[:, :num_heads]
        assert not query.is_contiguous()
    scale = head_dim**-0.5 if scale is None else scale
    expected = paged_attention_ref(
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, sliding_window, soft_cap
    )
    key = value = None
    if contig_kv:
        key, value, k_cache, v_cache = _contiguous_new_kv(seqs, k_cache, v_cache, block_tables, query.shape[0])
    out = torch.full(query.shape, float("nan"), dtype=dtype, device=DEVICE)
    result = paged_prefill_triton(
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
        max_query_len=max_query_len or max(q for q, _ in seqs), max_seq_len=max_seq_len or max(n for _, n in seqs),
        sliding_window=sliding_window, soft_cap=soft_cap, out=out, key=key, value=value,
        tiles=tiles or _tiles(dtype, head_dim, contig_kv, block_m, block_n), **grid,
    )  # fmt: skip
    assert result is out
    num_tokens = out.shape[0] - extra
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out[:num_tokens], expected[:num_tokens], atol=atol, rtol=rtol)
    assert out[num_tokens:].isnan().all(), "rows past cu_seqlens_q[-1] must stay untouched"


def _contiguous_new_kv(seqs, k_cache, v_cache, block_tables, num_rows):
    """The new tokens' K/V as contiguous rows aligned with query, and caches that make misreads show.

    Returns (key, value, k_cache, v_cache): key/value [num_rows, num_kv_heads, head_dim] hold each
    fresh prompt's (q_len == seq_len) K/V and NaN elsewhere (rows of cached-prefix sequences must be
    read from the cache); the returned caches are copies with every fresh prompt's blocks set to NaN
    (those must be read from key/value).
    """
    block_size = k_cache.shape[1]
    shape = (num_rows, *k_cache.shape[2:])
    key = torch.full(shape, float("nan"), dtype=k_cache.dtype, device=DEVICE)
    value = torch.full(shape, float("nan"), dtype=k_cache.dtype, device=DEVICE)
    k_poisoned, v_poisoned = k_cache.clone(), v_cache.clone()
    q_start = 0
    for s, (q_len, seq_len) in enumerate(seqs):
        if q_len == seq_len and q_len > 0:
            for i in range(q_len):
                block = block_tables[s, i // block_size].long()
                key[q_start + i] = k_cache[block, i % block_size]
                value[q_start + i] = v_cache[block, i % block_size]
            blocks = block_tables[s, : -(-seq_len // block_size)].long()
            k_poisoned[blocks] = float("nan")
            v_poisoned[blocks] = float("nan")
        q_start += q_len
    return key, value, k_poisoned, v_poisoned


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (4, 1)])  # MHA, GQA, MQA
def test_head_ratios_and_dtypes(dtype, num_heads, num_kv_heads):
    _check(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize(
    "head_dim, num_heads, num_kv_heads, seqs",
    [
        (32, 4, 2, MIXED),
        (64, 4, 2, MIXED),
        (80, 4, 2, MIXED),
        (96, 4, 2, MIXED),
        (128, 4, 2, MIXED),
        (256, 2, 1, [(9, 9), (5, 30), (1, 17)]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_head_dims(head_dim, num_heads, num_kv_heads, seqs, dtype):
    _check(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("block_size", [8, 16, 24, 32, 256])
@pytest.mark.parametrize("block_n", [None, 16])  # default 64 (several blocks per tile) and 16 (part of one)
def test_block_sizes(block_size, block_n):
    _check(MIXED, block_size=block_size, block_n=block_n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 64])
def test_key_major_tiles(dtype, block_size):
    # 2-byte dtypes with head_dim in (64, 128] read K through the block table key-major (transposed in
    # registers), 128 x 32 tiles: the same function as the K^T load of the other shapes.
    _check(MIXED, head_dim=128, block_size=block_size, dtype=dtype)
    _check(MIXED, head_dim=128, block_size=block_size, dtype=dtype, sliding_window=9, soft_cap=20.0)


@pytest.mark.parametrize("contig_kv", [False, True])
@pytest.mark.parametrize("setting", [(32, 32, 8, 3, False), (32, 16, 8, 2, True)], ids=["kt-loads", "key-major"])
def test_forced_tiles(contig_kv, setting):
    """``tiles=`` (what benchmarks/tools/prefill_sweep.py times) replaces the head_dim-128 tiles of 2-byte dtypes,
    key-major K loads or not, and the result still equals the reference."""
    _check(MIXED, head_dim=128, dtype=torch.bfloat16, contig_kv=contig_kv, tiles=setting)


@pytest.mark.parametrize("dtype", DTYPES)
def test_several_row_tiles_per_sequence(dtype):
    # 4 * 50 rows over BLOCK_M = 16 or the default: many row tiles, each with its own causal range.
    seqs = [(50, 50), (45, 97), (1, 64), (17, 17)]
    _check(seqs, num_heads=4, num_kv_heads=1, dtype=dtype, block_size=8, block_m=16, block_n=16)
    _check(seqs, num_heads=4, num_kv_heads=1, dtype=dtype, block_size=8)


@pytest.mark.parametrize("sliding_window", [1, 5, 17, 64])
@pytest.mark.parametrize("block_size, block_m, block_n", [(8, None, None), (16, 16, 16)])
def test_sliding_window(sliding_window, block_size, block_m, block_n):
    seqs = [(40, 40), (20, 90), (1, 70), (3, 3)]
    _check(seqs, block_size=block_size, sliding_window=sliding_window, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("soft_cap", [2.0, 50.0])
def test_soft_cap(dtype, soft_cap):
    _check(MIXED, dtype=dtype, soft_cap=soft_cap)


def test_soft_cap_with_sliding_window_and_mqa():
    _check(MIXED, num_heads=4, num_kv_heads=1, block_size=8, sliding_window=9, soft_cap=30.0, block_n=16)


def test_idle_sequences_and_single_tokens():
    # q_len == 0 sequences (idle batch slots) write nothing; a batch of only single tokens also works.
    _check([(0, 12), (5, 20), (0, 1), (1, 1)])
    _check([(1, 9), (1, 33), (1, 1)], num_heads=8, num_kv_heads=2)


@pytest.mark.parametrize("num_heads, num_kv_heads, block_m", [(4, 2, 16), (6, 2, 16), (4, 1, None)])
def test_padded_graph_batch(num_heads, num_kv_heads, block_m):
    # A mixed step as a CUDA graph bucket sees it: many sequences of uneven lengths (the flat grid's binary search
    # over cu_seqlens_q), zero-length padding sequences at the end, padding tokens of no sequence, and host hints
    # sized for the bucket rather than for the batch. GROUP 3 does not divide BLOCK_M.
    gen = torch.Generator().manual_seed(7)
    seqs = []
    for _ in range(29):
        q_len = [1, 1, 1, 2, 5, 17][torch.randint(6, (1,), generator=gen).item()]
        seqs.append((q_len, q_len + torch.randint(0, 40, (1,), generator=gen).item()))
    seqs += [(0, 0)] * 11  # padding sequences: no token, no context
    _check(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=8, block_m=block_m, extra=9,
           max_query_len=256, max_seq_len=4096)  # fmt: skip


@pytest.mark.parametrize("block_m", [16, None])
def test_leading_empty_sequences(block_m):
    # The chunks of a mixed step whose leading decode rows another kernel already wrote: those sequences are made
    # empty at the offset where the chunks begin (cu_seqlens_q = max(cu, D)), their rows must stay as they were.
    num_decode = 37
    seqs = [(1, 5 + 3 * i) for i in range(num_decode)] + [(17, 17), (9, 40), (30, 30)] + [(0, 0)] * 5
    query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q = _make_case(
        seqs, 4, 2, 64, 16, torch.float16, extra_tokens=7
    )
    scale = 64**-0.5
    expected = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=DEVICE)
    out[:num_decode] = 7.0  # "written by the decode kernel"
    paged_prefill_triton(
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q.clamp(min=num_decode), scale,
        max_query_len=2048, max_seq_len=4096, out=out, tiles=_tiles(torch.float16, 64, block_m=block_m),
    )  # fmt: skip
    num_tokens = int(cu_seqlens_q[-1])
    assert (out[:num_decode] == 7.0).all()
    torch.testing.assert_close(out[num_decode:num_tokens], expected[num_decode:num_tokens], atol=2e-3, rtol=2e-3)
    assert out[num_tokens:].isnan().all()


@pytest.mark.parametrize("scan_max_seqs, spare_slots", [(0, 16), (1024, 0), (1024, 3)])
@pytest.mark.parametrize("block_m", [16, None])
def test_tile_maps_and_looping_programs(scan_max_seqs, spare_slots, block_m):
    # The same padded mixed batch through each grid: the binary-search bound (scan_max_seqs below the batch), and
    # the exact tile map with fewer programs than slots, so that programs loop (no spare slack at all: each
    # sequence's rounding takes a second pass), with leading empty sequences as a mixed step has them.
    gen = torch.Generator().manual_seed(11)
    seqs = [(0, 3 + i) for i in range(6)]  # leading empty sequences (decode rows taken by the decode kernel)
    for _ in range(23):
        q_len = [1, 2, 3, 9, 20][torch.randint(5, (1,), generator=gen).item()]
        seqs.append((q_len, q_len + torch.randint(0, 30, (1,), generator=gen).item()))
    seqs += [(0, 0)] * 7
    _check(seqs, num_heads=6, num_kv_heads=2, block_size=8, block_m=block_m, extra=5, max_query_len=512,
           max_seq_len=2048, scan_max_seqs=scan_max_seqs, spare_slots=spare_slots)  # fmt: skip


@pytest.mark.parametrize("num_chunks, chunk_len", [(1, 24), (12, 30)])
def test_exact_tile_map_grid_takes_no_program_per_empty_sequence(monkeypatch, num_chunks, chunk_len):
    # A mixed graph step: 200 decode rows (made empty sequences: the decode kernel took them), prompt chunks, padding
    # to 256 sequences. The exact-map grid is the token tiles plus the spare slots of SCAN_SPARE_SLOTS or one per
    # tokens_per_spare_slot tokens, however many empty sequences the batch holds (the bound grid takes a program per
    # sequence and KV head).
    grids = record_prefill_launches(monkeypatch)
    num_decode, num_pad = 200, 256 - 200 - num_chunks
    seqs = [(1, 4)] * num_decode + [(chunk_len, chunk_len + 9)] * num_chunks + [(0, 0)] * num_pad
    query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q = _make_case(seqs, 4, 2, 64, 16, torch.float16)
    scale = 64**-0.5
    expected = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)
    out = torch.zeros_like(query)
    paged_prefill_triton(
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q.clamp(min=num_decode), scale,
        max_query_len=chunk_len, max_seq_len=chunk_len + 9, out=out, tiles=_tiles(torch.float16, 64, block_m=16),
        tokens_per_spare_slot=16,
    )  # fmt: skip
    torch.testing.assert_close(out[num_decode:], expected[num_decode:], atol=2e-3, rtol=2e-3)
    num_tokens, group = query.shape[0], 2
    spare = max(prefill.SCAN_SPARE_SLOTS, num_tokens // 16)
    assert grids == [((-(-num_tokens * group // 16) + spare, 2), 256)]  # the map (SEQS_PAD 256)
    assert grids[0][0][0] < num_tokens * group // 16 + 256  # the binary-search bound's program per sequence


def test_few_long_prompts_take_the_bound_grid(monkeypatch):
    # At most `spare` sequences (a few long prompts): the bound grid, a program a slot, no loop (the map's loop
    # runs such batches slower).
    grids = record_prefill_launches(monkeypatch)
    seqs = [(40, 40), (23, 50), (9, 9)]
    _check(seqs, num_heads=4, num_kv_heads=2, block_m=16, extra=2)
    tokens = 40 + 23 + 9 + 2
    assert grids == [((tokens * 2 // 16 + len(seqs), 2), 0)]


def test_strided_query():
    _check(MIXED, query_view=True)


def test_large_scores_do_not_overflow():
    # Scores of ~1e3: the running max must keep exp2 in range (no inf/NaN).
    seqs = [(20, 50)]
    query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q = _make_case(seqs, 4, 2, 64, 16, torch.float16)
    query = query * 30
    out = paged_prefill_triton(
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 1.0, max_query_len=20, max_seq_len=50
    )
    expected = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 1.0)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("block_size, block_n", [(8, None), (16, 16)])  # tiles over 8 blocks / within one block
def test_large_block_ids_use_int64_offsets(block_size, block_n):
    # block_id * stride_block reaches 2^31 elements (2^22 * 512 or 2^21 * 1024): 32-bit index math
    # would wrap. K and V are 2^31 + 16 * stride_block fp16 elements (4 GiB) each. On CPU torch.empty
    # maps pages lazily, so only the few blocks written here take memory; on CUDA the 8 GiB are real.
    num_kv_heads, head_dim, dtype = 1, 64, torch.float16
    base = 2**31 // (block_size * num_kv_heads * head_dim)  # first block whose offset is >= 2^31
    num_blocks = base + 16
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.empty(shape, dtype=dtype, device=DEVICE)
    torch.manual_seed(4)
    block_tables = torch.tensor(
        [[base + 15, 3, base + 1, base + 8], [base + 9, base + 2, base, 7]], dtype=torch.int32, device=DEVICE
    )
    used = block_tables.flatten().long()
    k_cache[used] = torch.randn(used.numel(), block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache[used] = torch.randn(used.numel(), block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    seq_lens = torch.tensor([3 * block_size + 6, 3 * block_size + 3], dtype=torch.int32, device=DEVICE)
    cu_seqlens_q = torch.tensor([0, 30, 40], dtype=torch.int32, device=DEVICE)
    query = torch.randn(40, 2, head_dim, device=DEVICE).to(dtype)

    out = paged_prefill_triton(
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 0.125,
        max_query_len=30, max_seq_len=int(seq_lens.max()), tiles=_tiles(dtype, head_dim, block_n=block_n),
    )  # fmt: skip
    expected = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    del k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_new_kv_mixed_batch(dtype):
    # key=/value=: fresh prompts read the new tokens' K/V (their cache blocks are NaN), cached prefixes,
    # single tokens and idle slots read the cache; GQA 2:1 and MQA 4:1.
    _check(MIXED, dtype=dtype, contig_kv=True)
    _check(MIXED + [(0, 5)], num_heads=4, num_kv_heads=1, block_size=8, dtype=dtype, contig_kv=True)


def test_contiguous_new_kv_window_soft_cap_and_row_tiles():
    seqs = [(50, 50), (45, 97), (1, 64), (17, 17)]
    _check(seqs, num_heads=4, num_kv_heads=1, block_size=8, block_m=16, block_n=16, contig_kv=True)
    _check(seqs, block_size=16, block_m=16, block_n=16, sliding_window=17, soft_cap=20.0, contig_kv=True)
    _check(MIXED, block_size=24, sliding_window=5, contig_kv=True)


@pytest.mark.parametrize("scale", [-0.125, 0.0])
def test_nonpositive_scale_takes_exact_softmax(scale):
    # The fused update of the interior tiles folds the scale into max(scores), which needs scale > 0;
    # other scales take the exact update there too.
    seqs = [(50, 50), (45, 97), (1, 64), (17, 17)]
    _check(seqs, num_heads=4, num_kv_heads=1, block_size=8, block_m=16, block_n=16, scale=scale)
    _check(seqs, block_size=16, block_m=16, block_n=16, sliding_window=17, soft_cap=20.0, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rising_maxima(dtype):
    # Key norms ramp up over the context: each tile raises the row max, in many 16-key interior tiles
    # (the fused update rescales the accumulator at every tile).
    seqs = [(60, 60), (20, 130)]
    _check(seqs, num_heads=4, num_kv_heads=2, block_size=16, block_m=16, block_n=16, dtype=dtype, key_ramp=True)
    _check(seqs, num_heads=2, num_kv_heads=2, head_dim=32, dtype=dtype, key_ramp=True, soft_cap=5.0)


def test_contiguous_new_kv_rejects_bad_arguments():
    query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q = _make_case([(4, 4)], 4, 2, 64, 16, torch.float16)
    args = (k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 0.125)
    hints = {"max_query_len": 4, "max_seq_len": 4}
    key = torch.zeros(4, 2, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"key and value must be given together"):
        paged_prefill_triton(query, *args, **hints, key=key)
    with pytest.raises(ValueError, match=r"value must be \(4, 2, 64\) torch.float16 .* got \(3, 2, 64\)"):
        paged_prefill_triton(query, *args, **hints, key=key, value=key[:3])
    with pytest.raises(ValueError, match=r"key must be \(4, 2, 64\) torch.float16 .* got \(4, 2, 64\) torch.float32"):
        paged_prefill_triton(query, *args, **hints, key=key.float(), value=key)


def test_rejects_bad_arguments():
    query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q = _make_case([(4, 10)], 4, 2, 64, 16, torch.float16)
    args = (k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, 0.125)
    hints = {"max_query_len": 4, "max_seq_len": 10}
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a positive multiple of num_kv_heads \(2\)"):
        paged_prefill_triton(query[:, :3], *args, **hints)
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\], got 512"):
        big = torch.zeros(4, 16, 2, 512, dtype=torch.float16, device=DEVICE)
        paged_prefill_triton(query.new_zeros(4, 2, 512), big, big, *args[2:], **hints)
    with pytest.raises(ValueError, match=r"block_tables must be 2-D int32 .* got torch.int64"):
        paged_prefill_triton(query, k_cache, v_cache, block_tables.long(), seq_lens, cu_seqlens_q, 0.125, **hints)
    with pytest.raises(
        ValueError, match=r"cu_seqlens_q must be int32 of shape \[num_seqs \+ 1=2\], got torch.int32 \(1,\)"
    ):
        paged_prefill_triton(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q[:1], 0.125, **hints)
    with pytest.raises(ValueError, match=r"k_cache/v_cache dtype must equal query dtype torch.float32"):
        paged_prefill_triton(query.float(), *args, **hints)
