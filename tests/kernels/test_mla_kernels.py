"""MLA over a paged latent cache (kernels/mla.py, kernels/mla_triton.py).

Three layers of checks:
- the references against a dense computation of the non-absorbed formulation (the latent expanded into per-head K
  and V by a random kv_b_proj, then plain causal attention): equal in fp32 up to rounding;
- the Triton kernels against the references, on CUDA or under TRITON_INTERPRET=1 (tiny shapes: the interpreter is
  slow), with shuffled block tables and NaN in every cache slot no sequence owns (a read of one poisons the output);
- the public functions' argument checks.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_paged.kernels import mla_decode, mla_decode_ref, mla_prefill, mla_prefill_ref, write_kv
from hf_paged.kernels.mla_triton import mla_decode_triton, mla_prefill_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels: run on CUDA (the device machine) and interpreted in CI (.ci/run sets TRITON_INTERPRET=1)",
)
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _make_cache(seq_lens, kv_width, block_size, dtype, seed=0, num_spare_blocks=2):
    """A latent pool with each sequence's rows in shuffled blocks and NaN in every slot no sequence owns.

    Returns:
        kv_cache [num_blocks, block_size, 1, kv_width], block_tables [num_seqs, max_blocks_per_seq] int32 (unused
        entries -1), seq_lens [num_seqs] int32, all on DEVICE.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    kv_cache = torch.full((num_blocks, block_size, 1, kv_width), float("nan"), dtype=dtype)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq + [1]) + 1), -1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    next_block = 0
    for s, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        blocks = perm[next_block : next_block + n_blocks]
        next_block += n_blocks
        block_tables[s, :n_blocks] = blocks.int()
        for i, block in enumerate(blocks.tolist()):
            live = min(block_size, seq_len - i * block_size)
            kv_cache[block, :live] = torch.randn(live, 1, kv_width, generator=gen).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return kv_cache.to(DEVICE), block_tables.to(DEVICE), seq_lens_t.to(DEVICE)


def _query(num_tokens, num_heads, kv_width, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, kv_width, generator=gen).to(dtype).to(DEVICE)


# ---- references against the non-absorbed formulation ----------------------------------------------------------


def test_reference_equals_expanded_attention():
    """The absorbed form (q_nope folded through W_UK, output through W_UV) equals attention over the expanded
    per-head K = [W_UK c | k_rot] and V = W_UV c, in fp32; with a cached context and two sequences."""
    torch.manual_seed(0)
    num_heads, nope, rope, rank, v_dim, block_size = 3, 8, 4, 16, 6, 4
    seq_lens, q_lens = [7, 5], [3, 5]  # sequence 0 has 4 cached tokens, sequence 1 is a fresh prompt
    kv_b = torch.randn(num_heads * (nope + v_dim), rank) / rank**0.5  # kv_b_proj.weight
    w_uk, w_uv = kv_b.view(num_heads, nope + v_dim, rank).split([nope, v_dim], dim=1)  # [H, nope, R], [H, v, R]
    scale = 0.3
    kv_cache, block_tables, seq_lens_t = _make_cache(seq_lens, rank + rope, block_size, torch.float32)
    kv_cache, block_tables, seq_lens_t = kv_cache.cpu(), block_tables.cpu(), seq_lens_t.cpu()
    q_nope = torch.randn(sum(q_lens), num_heads, nope)
    q_rot = torch.randn(sum(q_lens), num_heads, rope)
    q_cat = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rot], dim=-1)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    o_lat = mla_prefill_ref(q_cat, kv_cache, block_tables, seq_lens_t, cu, scale, rank)  # [T, H, R]
    out = torch.einsum("thr,hvr->thv", o_lat, w_uv)

    for s, (ctx_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        blocks = block_tables[s, : -(-ctx_len // block_size)].long()
        rows = kv_cache[blocks, :, 0].flatten(0, 1)[:ctx_len]  # [ctx_len, R + rope]
        c, k_rot = rows.split([rank, rope], dim=-1)
        key = torch.cat([torch.einsum("hnr,kr->hkn", w_uk, c), k_rot.expand(num_heads, -1, -1)], dim=-1)
        value = torch.einsum("hvr,kr->hkv", w_uv, c)  # [H, ctx_len, v]
        q = torch.cat([q_nope, q_rot], dim=-1)[cu[s] : cu[s + 1]].transpose(0, 1)  # [H, q_len, nope + rope]
        causal = torch.ones(q_len, ctx_len, dtype=torch.bool).tril(ctx_len - q_len)
        dense = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=causal, scale=scale)
        torch.testing.assert_close(out[cu[s] : cu[s + 1]], dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_decode_reference_equals_prefill_reference():
    seq_lens = [1, 9, 0, 20]  # a padding row (length 0) gets zeros
    kv_cache, block_tables, seq_lens_t = _make_cache(seq_lens, 12, 8, torch.float32)
    kv_cache, block_tables, seq_lens_t = kv_cache.cpu(), block_tables.cpu(), seq_lens_t.cpu()
    q_cat = _query(len(seq_lens), 5, 12, torch.float32).cpu()
    decode = mla_decode_ref(q_cat, kv_cache, block_tables, seq_lens_t, 0.5, 8)
    cu = torch.tensor([0, 1, 2, 2, 3], dtype=torch.int32)  # the padding row carries no token
    rows = torch.tensor([0, 1, 3])
    prefill = mla_prefill_ref(q_cat[rows], kv_cache, block_tables, seq_lens_t, cu, 0.5, 8)
    torch.testing.assert_close(decode[rows], prefill, atol=1e-6, rtol=1e-6)
    assert decode[2].eq(0).all()


def test_rows_written_with_write_kv_are_read_back():
    """write_kv with one KV head stores latent rows where the MLA ops read them (the layers' write path)."""
    block_size, kv_width, num_heads = 4, 10, 2
    kv_cache = torch.zeros(3, block_size, 1, kv_width)
    latent = torch.randn(6, 1, kv_width)
    slots = torch.tensor([8, 9, 10, 11, 0, -1])  # block 2, then block 0 (the last token is padding)
    write_kv(latent, latent, kv_cache, kv_cache, slots)
    block_tables = torch.tensor([[2, 0]], dtype=torch.int32)
    q_cat = torch.randn(5, num_heads, kv_width)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    out = mla_prefill(q_cat, kv_cache, block_tables, torch.tensor([5], dtype=torch.int32), cu, 1.0, 6)
    rows = latent[:5, 0]
    scores = torch.einsum("qhw,kw->hqk", q_cat, rows).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -1e30)
    expected = torch.einsum("hqk,kv->qhv", scores.softmax(-1), rows[:, :6])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# ---- Triton kernels against the references ----------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    "num_heads, v_dim, rope", [(3, 32, 16), (20, 24, 8)], ids=["h3-v32-r16", "h20-v24-r8"]
)  # 20 heads: two tiles of 16 heads, the second partly padding; 24 and 8: widths that are no power of two
def test_decode_kernel(num_heads, v_dim, rope, num_splits, dtype):
    seq_lens = [1, 17, 0, 70]
    kv_cache, block_tables, seq_lens_t = _make_cache(seq_lens, v_dim + rope, 16, dtype)
    q_cat = _query(len(seq_lens), num_heads, v_dim + rope, dtype)
    out = torch.full((len(seq_lens), num_heads, v_dim), float("nan"), dtype=dtype, device=DEVICE)
    result = mla_decode_triton(
        q_cat, kv_cache, block_tables, seq_lens_t, 0.2, v_dim, max(seq_lens), out=out, num_splits=num_splits
    )
    assert result is out
    ref = mla_decode_ref(q_cat, kv_cache, block_tables.clamp(min=0), seq_lens_t, 0.2, v_dim)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert out[2].eq(0).all()


@needs_triton
@pytest.mark.parametrize("block_size", [8, 24])
def test_decode_kernel_block_sizes(block_size):
    # 24: a multiple of 8 that is no power of two (tiles cross blocks); 5 splits of short contexts: empty splits.
    seq_lens = [5, 40, 33]
    kv_cache, block_tables, seq_lens_t = _make_cache(seq_lens, 40, block_size, torch.float16, seed=3)
    q_cat = _query(len(seq_lens), 4, 40, torch.float16)
    out = mla_decode_triton(q_cat, kv_cache, block_tables, seq_lens_t, 0.3, 32, max(seq_lens), num_splits=5)
    ref = mla_decode_ref(q_cat, kv_cache, block_tables, seq_lens_t, 0.3, 32)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads, v_dim, rope", [(3, 32, 16), (5, 24, 8)], ids=["h3-v32-r16", "h5-v24-r8"])
def test_prefill_kernel(num_heads, v_dim, rope, dtype):
    # (context, new tokens): a fresh prompt, a chunk over a cached context, a decode row, an empty sequence.
    seqs = [(13, 13), (30, 9), (21, 1), (6, 0)]
    seq_lens = [n for n, _ in seqs]
    kv_cache, block_tables, seq_lens_t = _make_cache(seq_lens, v_dim + rope, 8, dtype, seed=2)
    q_lens = [q for _, q in seqs]
    num_tokens = sum(q_lens) + 2  # two rows of no sequence (CUDA-graph padding): left untouched
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q_cat = _query(num_tokens, num_heads, v_dim + rope, dtype)
    out = torch.full((num_tokens, num_heads, v_dim), 7.0, dtype=dtype, device=DEVICE)
    result = mla_prefill_triton(q_cat, kv_cache, block_tables, seq_lens_t, cu, 0.25, v_dim, max(q_lens), out=out)
    assert result is out
    ref = mla_prefill_ref(q_cat, kv_cache, block_tables, seq_lens_t, cu, 0.25, v_dim)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out[: sum(q_lens)], ref[: sum(q_lens)], atol=atol, rtol=rtol)
    assert out[sum(q_lens) :].eq(7.0).all()


@needs_triton
def test_public_functions_dispatch_to_the_kernels_on_cuda():
    if DEVICE != "cuda":
        pytest.skip("the public functions take the references on the CPU: runs on the device machine "
                    "(benchmarks/run_gpu.sh tests-kernels)")
    seq_lens = [300, 2]
    kv_cache, block_tables, seq_lens_t = _make_cache(seq_lens, 576, 16, torch.bfloat16)
    q_cat = _query(2, 16, 576, torch.bfloat16)
    out = mla_decode(q_cat, kv_cache, block_tables, seq_lens_t, 0.1, 512, max_seq_len=300)
    ref = mla_decode_ref(q_cat, kv_cache, block_tables, seq_lens_t, 0.1, 512)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    out = mla_prefill(q_cat, kv_cache, block_tables, seq_lens_t, cu, 0.1, 512, max_query_len=1)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except Exception:  # Triton without its NVIDIA backend (e.g. not Linux x86-64)
        return False
    return True


@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend (ptxas)")
def test_launches_compile_for_nvidia_gpus():
    """Every MLA launch compiles for sm_90 and sm_80 within the cards' shared memory (tests/kernels/
    mla_gpu_compile.py), without a GPU: the interpreter above never compiles the kernels."""
    script = Path(__file__).with_name("mla_gpu_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], env=env, text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # two dtypes x (decode with one split, decode with several, merge, prefill) x (sm_90, sm_80)
    assert proc.stdout.count("ok ") == 16, proc.stdout


# ---- argument checks ---------------------------------------------------------------------------------------------


def test_errors_name_the_bad_value():
    kv_cache = torch.zeros(2, 4, 1, 12)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q_cat's last dim must equal kv_cache's width 12, got 10"):
        mla_decode(torch.zeros(1, 2, 10), kv_cache, tables, lens, 1.0, 8)
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks, block_size, 1, kv_width\]"):
        mla_decode(torch.zeros(1, 2, 12), torch.zeros(2, 4, 2, 12), tables, lens, 1.0, 8)
    with pytest.raises(ValueError, match=r"v_head_dim must be an int in \[1, kv_width=12\], got 13"):
        mla_decode(torch.zeros(1, 2, 12), kv_cache, tables, lens, 1.0, 13)
    with pytest.raises(ValueError, match=r"one query row per sequence: q_cat has 2 rows for 1 sequences"):
        mla_decode(torch.zeros(2, 2, 12), kv_cache, tables, lens, 1.0, 8)
    with pytest.raises(ValueError, match=r"q_cat dtype must equal kv_cache dtype torch.float32, got torch.float16"):
        mla_decode(torch.zeros(1, 2, 12, dtype=torch.float16), kv_cache, tables, lens, 1.0, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be int32 \[num_seqs \+ 1=2\], got \(3,\)"):
        mla_prefill(torch.zeros(1, 2, 12), kv_cache, tables, lens, torch.zeros(3, dtype=torch.int32), 1.0, 8)
