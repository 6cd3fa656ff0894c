"""kernels/skinny.py (the few-rows linear layer, an experiment for issue 13) against ``F.linear``.

On CPU the kernel runs under TRITON_INTERPRET=1 (as CI does); the same tests run on CUDA, bf16 there too
(``benchmarks/run_gpu.sh OUT tests-kernels``; not run on a card yet).
"""

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels: run on CUDA (the device machine) and interpreted in CI (.ci/run sets TRITON_INTERPRET=1)",
)

if DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
    from hf_paged.kernels.skinny import MAX_ROWS, skinny_linear_triton

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (100, 200)])
@pytest.mark.parametrize("split_k", [1, 3, None])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_f_linear(dtype, rows, out_features, in_features, split_k, with_bias):
    generator = torch.Generator(device=DEVICE).manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, device=DEVICE, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, device=DEVICE, generator=generator).to(dtype) / in_features**0.5
    bias = torch.randn(out_features, device=DEVICE, generator=generator).to(dtype) if with_bias else None
    out = skinny_linear_triton(x, weight, bias, block_n=16, block_k=32, split_k=split_k)
    expected = F.linear(x.float(), weight.float(), bias.float() if with_bias else None)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("rows, block_m", [(70, None), (130, None), (100, 16), (33, 32)])
@pytest.mark.parametrize("split_k", [1, 2])
def test_skinny_linear_row_tiles(rows, block_m, split_k):
    """More rows than a tile: each tile's rows, the last one partial, land in their own rows of the output."""
    generator = torch.Generator(device=DEVICE).manual_seed(rows + (block_m or 0))
    x = torch.randn(rows, 64, device=DEVICE, generator=generator)
    weight = torch.randn(40, 64, device=DEVICE, generator=generator) / 8
    bias = torch.randn(40, device=DEVICE, generator=generator)
    out = skinny_linear_triton(x, weight, bias, block_m=block_m, block_n=16, block_k=32, split_k=split_k)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_skinny_linear_reads_strided_rows():
    """Rows of a wider tensor (a slice of the hidden states) and a weight slab of a fused projection."""
    x = torch.randn(7, 96, device=DEVICE)[:, :64]
    weight = torch.randn(80, 64, device=DEVICE)[16:]
    out = skinny_linear_triton(x, weight, block_n=16, block_k=16, split_k=2)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=1e-4)


def test_skinny_linear_rejects_bad_arguments():
    x, weight = torch.randn(4, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    with pytest.raises(ValueError, match=rf"takes 1 to {MAX_ROWS} rows, got {MAX_ROWS + 1}"):
        skinny_linear_triton(torch.randn(MAX_ROWS + 1, 32, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"need x \[M, K\] and weight \[N, K\], got \(4, 32\) and \(16, 31\)"):
        skinny_linear_triton(x, weight[:, :31])
    with pytest.raises(ValueError, match="must share a float dtype"):
        skinny_linear_triton(x, weight.half())
    with pytest.raises(ValueError, match="need contiguous rows"):
        skinny_linear_triton(x.t().contiguous().t(), weight)
    with pytest.raises(ValueError, match=r"bias must be \[16\]"):
        skinny_linear_triton(x, weight, torch.zeros(15, device=DEVICE))
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        skinny_linear_triton(x, weight, block_n=24)
    with pytest.raises(ValueError, match="block_m must be a power of two from 16 to 64, got 128"):
        skinny_linear_triton(x, weight, block_m=128)


def test_skinny_gemm_benchmark_row_on_the_cpu(monkeypatch):
    """benchmarks/skinny_gemm.py's row for one shape (its CUDA-graph timer replaced by a plain call, fp32 weights on
    the CPU): every launch setting gives F.linear's result."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "skinny_gemm.py"
    spec = importlib.util.spec_from_file_location("skinny_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "graph_us", lambda fn, copies: [fn(i) for i in range(copies)] and 1.0)
    weights = [torch.randn(48, 64, device=DEVICE) / 8 for _ in range(2)]
    row = bench.bench_rows("| tiny | p 64->48 | 3 |", weights, 3)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 3 + 1 + len(bench.SETTINGS) + 1 and cells[-1] == "1.00x"
    diffs = [float(c.split(",")[1].rstrip(")")) for c in cells[4:-1]]
    assert max(diffs) < 1e-4, row
