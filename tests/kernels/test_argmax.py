"""argmax_rows_triton (kernels/argmax_rows.py) against torch.argmax, its reference: the same index, exactly.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (CHUNK made small so that rows span many chunks at the
interpreter's speed); the same tests run unchanged on CUDA, at the default CHUNK too.
"""

import pytest
import torch
from helpers import needs_triton
from hf_paged.kernels import argmax_rows as argmax_module
from hf_paged.kernels.argmax_rows import argmax_rows_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = needs_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CHUNKS = [64, None] if DEVICE == "cpu" else [64, 4096]  # None: the module's default; the interpreter keeps it small


@pytest.fixture(params=CHUNKS, ids=lambda c: f"chunk{c}")
def chunk(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(argmax_module, "CHUNK", request.param)
    return argmax_module.CHUNK


def _check(x: torch.Tensor) -> None:
    got = argmax_rows_triton(x)
    expected = x.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.device == x.device
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 5, 64, 200, 1000])
def test_random_rows(dtype, vocab, chunk):
    gen = torch.Generator().manual_seed(vocab)
    _check(torch.randn(7, vocab, generator=gen).to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first_index_across_chunks(dtype, chunk):
    # Low-precision logits tie often (bf16 keeps 8 bits): the first index of the maximum wins, also when the
    # tied values sit in different chunks, and when every value of a row is equal.
    vocab = 3 * chunk + 17
    x = torch.zeros(5, vocab)
    x[0, [3, chunk + 1, 2 * chunk + 5]] = 2.0  # three chunks hold the maximum
    x[1, [vocab - 1, chunk]] = 1.5
    x[2] = -1.0  # all equal
    x[3] = float("-inf")  # all -inf: index 0
    x[4, vocab - 1] = 9.0  # the last lane of a partial chunk
    _check(x.to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_is_the_maximum_and_the_first_nan_wins(dtype, chunk):
    vocab = 2 * chunk + 9
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    x[0, chunk + 3] = float("nan")
    x[0, 2] = float("inf")
    x[1, [vocab - 1, chunk + 7]] = float("nan")  # two NaNs in two chunks: the earlier one
    x[2, :] = float("nan")
    x[3, 5] = float("inf")  # +inf without NaN
    _check(x.to(dtype).to(DEVICE))


def test_strided_rows_and_a_row_slice(chunk):
    # Rows of a larger buffer (a CUDA graph's logits, sliced to the rows that sample): row stride > vocab.
    buf = torch.randn(9, 300, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    _check(buf[:, :250])
    _check(buf[2:6])


def test_no_rows():
    assert argmax_rows_triton(torch.empty(0, 10, device=DEVICE)).shape == (0,)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="vocab >= 1"):
        argmax_rows_triton(torch.empty(3, 0, device=DEVICE))
    with pytest.raises(ValueError, match="shape"):
        argmax_rows_triton(torch.randn(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="int64"):
        argmax_rows_triton(torch.zeros(2, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        argmax_rows_triton(torch.randn(4, 6, device=DEVICE).t())


def test_dispatcher_takes_torch_off_cuda():
    from hf_paged.kernels import argmax

    x = torch.randn(3, 11)
    assert torch.equal(argmax(x), x.argmax(dim=-1))  # CPU tensors: the reference


@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="the dispatcher takes the Triton kernels for CUDA tensors only: runs on the device (run_gpu.sh argmax-ab)",
)
def test_sampler_rows_on_cuda_take_the_kernels(monkeypatch):
    # The engine's sampler: greedy rows and the exponential race of sampled rows both go through kernels.argmax,
    # which must answer as torch.argmax, ties included (bf16 logits of a 128K vocabulary tie often).
    from hf_paged.kernels import argmax_rows

    from hf_paged import kernels
    from hf_paged.engine.params import SamplingParams
    from hf_paged.engine.sampler import Sampler

    monkeypatch.setattr(kernels, "TRITON_ARGMAX", True)
    calls = []
    launch = argmax_rows.argmax_rows_triton
    monkeypatch.setattr(argmax_rows, "argmax_rows_triton", lambda x: calls.append(x.shape) or launch(x))
    logits = torch.randn(24, 128256, device="cuda").to(torch.bfloat16)
    logits[3, [10, 90000]] = 30.0  # a tie across chunks
    params = [SamplingParams(temperature=0.0)] * 20 + [SamplingParams(temperature=0.8, seed=i) for i in range(4)]
    gens = [None] * 20 + [torch.Generator(device="cuda").manual_seed(i) for i in range(4)]
    out = Sampler()(logits, params, [[]] * 24, [[]] * 24, gens)
    assert torch.equal(out.token_ids[:20], logits[:20].argmax(dim=-1))
    assert out.token_ids[3].item() == 10
    assert calls == [(24, 128256), (4, 128256)]  # the greedy rows, then the sampled rows' race
