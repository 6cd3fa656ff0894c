"""PagedCache with an FP8 KV cache inside model.generate: close to the model's-dtype cache, the checkpoint's scales
applied to what is stored, "sdpa" reading the dequantized gather, beams sharing FP8 blocks.

Tiny random models have nearly flat next-token distributions (the largest logit ~0.5, the top two often within
0.002), so any rounding of K/V flips a greedy token after a few steps and the sequences part from there: token
agreement over a whole generation says little. The tests compare what is comparable instead: up to and including
each row's first differing token both runs have fed the same tokens, so their logits at those steps must agree
within the quantization error. ATOL: e4m3 rounds each K/V element to 3 mantissa bits (relative error <= 2^-4),
e5m2 to 2 (<= 2^-3); over these models the logits then move by at most ~0.02 (e4m3) and ~0.04 (e5m2) (measured:
0.011-0.022 and 0.013-0.041 over llama, qwen3, gemma2 in fp32 and bf16), so 0.05 and 0.1 leave room, while a scale
that is dropped or applied twice moves them by more than the logits themselves (a factor of 2 or 0.5 on K or V).
"""

import pytest
import torch
from helpers import assert_cache_released
from models import cache_kwarg, tiny_model
from transformers import DynamicCache

from hf_paged import PagedCache

CACHE = cache_kwarg()
PROMPT_LEN = 24
IDS = torch.randint(3, 96, (4, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
ATOL = {"fp8": 0.05, "fp8_e4m3": 0.05, "fp8_e5m2": 0.1}


def _generate(model, cache, **kwargs):
    return model.generate(
        input_ids=IDS, attention_mask=torch.ones_like(IDS), do_sample=False, output_scores=True,
        return_dict_in_generate=True, **kwargs, **{CACHE: cache},
    )  # fmt: skip


def _assert_close_until_first_flip(out, ref, atol: float) -> int:
    """Each row's logits agree within ``atol`` at every step up to its first differing token (inclusive); returns
    the number of new tokens both runs share, over all rows."""
    new = out.sequences[:, PROMPT_LEN:]
    expected = ref.sequences[:, PROMPT_LEN:]
    num_steps = min(new.shape[1], expected.shape[1])
    shared = 0
    for row in range(new.shape[0]):
        same = (new[row, :num_steps] == expected[row, :num_steps]).tolist()
        first_flip = same.index(False) if False in same else num_steps
        shared += first_flip
        for step in range(min(first_flip + 1, num_steps)):
            got, want = out.scores[step][row].float(), ref.scores[step][row].float()
            finite = torch.isfinite(want)
            assert torch.equal(finite, torch.isfinite(got)), (row, step)
            diff = (got[finite] - want[finite]).abs().max().item()
            assert diff <= atol, f"row {row} step {step}: max |logit difference| {diff:.4f} > {atol}"
    return shared


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_greedy_stays_close_to_the_models_dtype(family, dtype, kv_cache_dtype):
    model = tiny_model(family).to(dtype)
    ref = _generate(model, PagedCache(model, num_blocks=64, block_size=8), max_new_tokens=32)
    cache = PagedCache(model, num_blocks=64, block_size=8, kv_cache_dtype=kv_cache_dtype)
    out = _generate(model, cache, max_new_tokens=32)
    assert cache.kv.k_cache[0].element_size() == 1
    shared = _assert_close_until_first_flip(out, ref, ATOL[kv_cache_dtype])
    assert shared >= 4  # each flip needs a near-tie: the first new tokens agree
    assert_cache_released(cache)


def test_sdpa_reads_the_dequantized_gather():
    """With "sdpa" the cache hands over K/V gathered from the FP8 blocks and dequantized: the same values the paged
    kernels read, so (in fp32) the same tokens as "paged" attention over the same FP8 cache."""
    paged, sdpa = tiny_model("llama"), tiny_model("llama", attn="sdpa")
    expected = _generate(paged, PagedCache(paged, num_blocks=64, block_size=8, kv_cache_dtype="fp8"),
                         max_new_tokens=24)  # fmt: skip
    out = _generate(sdpa, PagedCache(sdpa, num_blocks=64, block_size=8, kv_cache_dtype="fp8"), max_new_tokens=24)
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.scores, expected.scores, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("per_head", [False, True])
def test_checkpoint_scales_scale_what_is_stored(per_head):
    """A layer's K is stored as K / k_scale: dequantized with its scale the pool holds the model's K (as
    DynamicCache holds it) within e4m3's rounding, for a per-tensor and a per-head scale."""
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    k_scale = torch.tensor([0.05, 0.2]) if per_head else torch.tensor(0.1)
    attn.register_buffer("k_scale", k_scale)
    attn.register_buffer("v_scale", torch.tensor(4.0))
    ids = IDS[:1]
    dynamic = DynamicCache(config=model.config)
    model(input_ids=ids, **{CACHE: dynamic})
    expected_k = dynamic.layers[0].keys[0].transpose(0, 1)  # [prompt_len, num_kv_heads, head_dim]
    expected_v = dynamic.layers[0].values[0].transpose(0, 1)
    cache = PagedCache(model, num_blocks=8, block_size=8, kv_cache_dtype="fp8")
    model(input_ids=ids, **{CACHE: cache})
    table = cache.pool.get_block_table(cache._rows[0].seq_id)
    stored_k = cache.kv.k_cache[0][table].flatten(0, 1)[:PROMPT_LEN].float()  # [prompt_len, num_kv_heads, head_dim]
    stored_v = cache.kv.v_cache[0][table].flatten(0, 1)[:PROMPT_LEN].float()
    # |rounding| <= 2^-4 of the value (e4m3), plus the subnormal step (2^-9) near 0, in stored units
    for stored, expected, scale in ((stored_k, expected_k, k_scale), (stored_v, expected_v, torch.tensor(4.0))):
        scale = scale.reshape(-1, 1)
        quantized = expected / scale
        assert ((stored - quantized).abs() <= quantized.abs() / 16 + 2**-9).all()
    assert_cache_released(cache)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_beam_search_runs_close_and_shares_fp8_blocks(kv_cache_dtype):
    model = tiny_model("llama")
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, num_beams=4)
    ref = _generate(model, PagedCache(model, num_blocks=256, block_size=8), **kwargs)
    cache = PagedCache(model, num_blocks=256, block_size=8, kv_cache_dtype=kv_cache_dtype)
    out = _generate(model, cache, **kwargs)
    assert out.sequences.shape == ref.sequences.shape
    report = cache.memory_report()
    assert report.num_used_blocks < 0.7 * report.num_table_entries  # the beams share their FP8 blocks
    assert f"KV cache {kv_cache_dtype} (float8_" in str(report) and report.num_token_slots == 256 * 8
    # beams re-rank on summed log-probabilities: the first step's scores are those of the same prompt
    first = torch.isfinite(ref.scores[0])
    diff = (out.scores[0][first] - ref.scores[0][first]).abs().max().item()
    assert diff <= ATOL[kv_cache_dtype], diff
    assert_cache_released(cache)


@pytest.mark.parametrize("compiled", [False, True], ids=["planned-eager", "compiled"])
def test_planned_decode_steps_take_the_scales(compiled):
    """``max_cache_len``: decode steps planned ahead (run eagerly, or compiled on the CPU with aot_eager) write and
    read the same FP8 values as the eager path, with a checkpoint's scales: the same tokens."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.register_buffer("k_scale", torch.tensor([0.5, 2.0]))
        layer.self_attn.register_buffer("v_scale", torch.tensor(0.25))
    kwargs = dict(input_ids=IDS[:2], attention_mask=torch.ones_like(IDS[:2]), max_new_tokens=12, min_new_tokens=12,
                  do_sample=False)  # fmt: skip
    eager = PagedCache(model, block_size=8, kv_cache_dtype="fp8")
    expected = model.generate(**kwargs, **{CACHE: eager})
    cache = PagedCache(model, block_size=8, max_cache_len=PROMPT_LEN + 12, kv_cache_dtype="fp8")
    if compiled:
        config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
        config._compile_all_devices = True  # compile on the CPU too
        kwargs["compile_config"] = config
    out = model.generate(**kwargs, **{CACHE: cache})
    assert torch.equal(out, expected)
    if compiled:
        assert model._compiled_call is not None
    # the bytes each row's tokens hold in every layer are the eager path's
    num_written = PROMPT_LEN + 11  # the last token is sampled, never fed
    for layer in range(len(model.model.layers)):
        for pool in ("k_cache", "v_cache"):
            rows = [
                getattr(c.kv, pool)[layer][c.pool.get_block_table(row.seq_id)].flatten(0, 1)[:num_written]
                for c in (cache, eager)
                for row in c._rows
            ]
            half = len(rows) // 2
            for got, want in zip(rows[:half], rows[half:], strict=True):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layer, pool)
    assert_cache_released(cache)
