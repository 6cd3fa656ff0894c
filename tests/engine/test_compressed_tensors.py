"""compressed-tensors FP8 checkpoints (the folders llm-compressor writes) in PagedCache, the engine and load_model.

The tiny llama is saved as llm-compressor saves an FP8 model: every decoder ``nn.Linear`` (not ``lm_head``) stored as
``float8_e4m3fn`` with its ``weight_scale`` (per output channel or per tensor), FP8 input activations quantized
per token at run time (``dynamic``), and, with a ``kv_cache_scheme``, a calibrated ``k_scale``/``v_scale`` per
attention module. It loads through transformers' compressed-tensors quantizer like any hub FP8 checkpoint; on the
CPU the weights are decompressed to the model's dtype at the first forward and the activations are quantized and
dequantized in each projection's forward. What hf_paged adds must change none of that: PagedCache and the engine
equal the same loaded model under DynamicCache token for token.
"""

import json
import os
import shutil

import pytest
import torch
from helpers import assert_cache_released, assert_engine_drained
from hf_paged.kernels.kv_quant import dequantize_ref, quantize_ref
from models import cache_kwarg, char_tokenizer, tiny_model
from transformers import AutoModelForCausalLM, CompileConfig, DynamicCache

from hf_paged import ContinuousBatcher, PagedCache, SamplingParams, load_model
from hf_paged.core.model_info import ModelInfo
from hf_paged.engine.fuse import FusedPart
from hf_paged.engine.quantization import quantization_method
from hf_paged.frontends.cli import main

pytest.importorskip(
    "compressed_tensors", reason="needs compressed-tensors (the test extra; CI installs it), which transformers' "
    "compressed-tensors quantizer imports to load these checkpoints"
)  # fmt: skip

CACHE = cache_kwarg()
GREEDY = dict(temperature=0.0, ignore_eos=True)
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 9, 11, 12, 13]])  # row 0 left-padded
MASK = (IDS != 0).long()
# Calibrated-looking KV scales (amax / 448 of K and V are ~0.003-0.01 here): not 1.0, so that a dropped scale
# rounds K/V elsewhere on e4m3's grid.
K_SCALES, V_SCALES = (0.0061, 0.0043), (0.0035, 0.0052)


def _fp8_args(**overrides) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
            "actorder": None, "observer": None, "observer_kwargs": {}, **overrides}  # fmt: skip


def save_fp8_checkpoint(path, strategy: str = "channel", fmt: str = "float-quantized", kv_scales: bool = False):
    """Save a tiny llama (and the character tokenizer) at ``path`` as an FP8 compressed-tensors checkpoint.

    Args:
        strategy: the weights' scale: "channel" (``weight_scale`` [out_features, 1]) or "tensor" ([1]).
        fmt: the quantization config's ``format``: "float-quantized" or "naive-quantized" (both store FP8 weights).
        kv_scales: add a static FP8 ``kv_cache_scheme`` and each attention module's ``k_scale``/``v_scale``.
    """
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama", attn="sdpa", seed=1)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = {}
    for name, tensor in load_file(file).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = tensor
            continue
        amax = tensor.abs().amax(dim=1, keepdim=True) if strategy == "channel" else tensor.abs().amax().reshape(1)
        scale = amax / 448.0  # e4m3's largest finite value
        tensors[name] = (tensor / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + "weight_scale"] = scale
    if kv_scales:
        for layer, (k, v) in enumerate(zip(K_SCALES, V_SCALES, strict=True)):
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([k])
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v])
    save_file(tensors, file, metadata={"format": "pt"})
    group = {"targets": ["Linear"], "weights": _fp8_args(strategy=strategy, dynamic=False),
             "input_activations": _fp8_args(strategy="token", dynamic=True), "output_activations": None}  # fmt: skip
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": group}, "ignore": ["lm_head"], "global_compression_ratio": None,
        "kv_cache_scheme": _fp8_args(strategy="tensor", dynamic=False) if kv_scales else None,
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(path)


@pytest.fixture(scope="module", params=[("channel", "float-quantized"), ("tensor", "naive-quantized")],
                ids=["channel", "tensor-naive"])  # fmt: skip
def fp8_dir(request, tmp_path_factory) -> str:
    strategy, fmt = request.param
    return save_fp8_checkpoint(tmp_path_factory.mktemp(f"fp8-{strategy}"), strategy, fmt)


@pytest.fixture(scope="module")
def fp8_kv_dir(tmp_path_factory) -> str:
    return save_fp8_checkpoint(tmp_path_factory.mktemp("fp8-kv"), kv_scales=True)


def _load(path: str, attn: str = "paged"):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()


def _generate(model, cache, **kwargs):
    return model.generate(input_ids=IDS, attention_mask=MASK, do_sample=False, **kwargs, **{CACHE: cache})


def test_loads_through_the_compressed_tensors_quantizer(fp8_dir):
    model = _load(fp8_dir)
    proj = model.model.layers[0].self_attn.q_proj
    assert quantization_method(model) == "compressed-tensors"
    assert proj.weight.dtype == torch.float8_e4m3fn and hasattr(proj, "weight_scale")  # compressed until a forward
    assert proj.quantization_scheme.input_activations.dynamic  # activations quantized in the forward
    assert model.lm_head.weight.dtype == torch.float32  # ignored: stays as saved


def test_paged_cache_greedy_and_beams_equal_dynamic_cache(fp8_dir):
    model = _load(fp8_dir)
    for kwargs in (dict(max_new_tokens=24, min_new_tokens=24), dict(max_new_tokens=10, num_beams=3)):
        expected = _generate(model, DynamicCache(config=model.config), **kwargs)
        cache = PagedCache(model, num_blocks=48, block_size=8)
        assert torch.equal(_generate(model, cache, **kwargs), expected), kwargs
        assert_cache_released(cache)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # decompressed by the first forward


def test_compiled_decode_equals_dynamic_cache(fp8_dir):
    """generate's compiled decode over PagedCache(max_cache_len=...). Not fullgraph: decompressing the weights puts
    every module that holds weights (projections, norms, embeddings) behind compressed-tensors' offload wrapper
    (``compressed_tensors.offload``, 0.20: it moves a forward's inputs to the weights' device after comparing data
    pointers, which dynamo cannot trace), so each of those forwards is a graph break; transformers' default
    CompileConfig is not fullgraph either."""
    model = _load(fp8_dir)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6)
    expected = _generate(model, DynamicCache(config=model.config), **kwargs)
    config = CompileConfig(backend="aot_eager", fullgraph=False, mode=None)
    config._compile_all_devices = True  # compile on the CPU too
    torch._dynamo.reset()
    out = _generate(model, PagedCache(model, block_size=8, max_cache_len=16), compile_config=config, **kwargs)
    assert model._compiled_call is not None
    assert torch.equal(out, expected)


def _prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 17, 33, 8, 23)]


NEW_TOKENS = [7, 20, 3, 24, 12]


def _expected(model, prompts, cache_factory=None):
    make = cache_factory or (lambda: DynamicCache(config=model.config))
    return [
        model.generate(input_ids=torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False,
                       **{CACHE: make()})[0, len(p):].tolist()
        for p, m in zip(prompts, NEW_TOKENS, strict=True)
    ]  # fmt: skip


def test_engine_greedy_with_preemption_equals_generate_and_leaves_projections_unfused(fp8_dir):
    """A model fresh from the folder (weights still FP8): fusion must leave the projections alone, since each quantizes
    its input in its own forward (and their FP8 weights carry separate scales until the first forward)."""
    reference = _load(fp8_dir)
    expected = _expected(reference, _prompts())
    model = _load(fp8_dir)
    engine = ContinuousBatcher(model, block_size=8, num_blocks=10, max_num_seqs=8, max_num_batched_tokens=32,
                               fuse_projections=True)  # fmt: skip
    assert engine.runner.fused_groups == []
    assert not any(isinstance(m, FusedPart) for m in model.modules())
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in NEW_TOKENS]
    outs = engine.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.metrics().num_preemptions > 0
    assert_engine_drained(engine)


def test_load_model_and_the_cli_take_the_folder(fp8_dir, capsys):
    model, tokenizer = load_model(fp8_dir, device="cpu")
    assert quantization_method(model) == "compressed-tensors"
    assert model.config._attn_implementation == "paged" and tokenizer.padding_side == "left"
    reference = _load(fp8_dir, attn="sdpa")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = reference.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    argv = ["generate", "--model", fp8_dir, "--device", "cpu", "--no-chat", "--max-new-tokens", "8", "--ignore-eos",
            "--json", tokenizer.decode(ids[0])]  # fmt: skip
    assert main(argv) == 0
    (result,) = json.loads(capsys.readouterr().out)["outputs"]
    assert result["num_prompt_tokens"] == ids.shape[1]
    assert result["completions"][0]["token_ids"] == expected[0, ids.shape[1] :].tolist()
    with pytest.raises(ValueError, match="stored quantized already.*compressed-tensors.*drop quantization='int8'"):
        load_model(fp8_dir, device="cpu", quantization="int8")


class _RoundedKVCache(DynamicCache):
    """A DynamicCache that keeps each layer's new K/V rounded as an e4m3 cache with the given scales stores them:
    what the model attends to over hf_paged's FP8 cache, computed by torch."""

    def __init__(self, config, scales):
        super().__init__(config=config)
        self.scales = scales  # per layer: (k_scale, v_scale), fp32 [1]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = []
        for states, scale in zip((key_states, value_states), self.scales[layer_idx], strict=True):
            x = states.transpose(1, 2)  # [batch, tokens, num_kv_heads, head_dim], as the pool holds rows
            x = dequantize_ref(quantize_ref(x, scale, torch.float8_e4m3fn), scale).to(states.dtype)
            rounded.append(x.transpose(1, 2))
        return super().update(*rounded, layer_idx, *args, **kwargs)


def _checkpoint_scales():
    return [(torch.tensor([k]), torch.tensor([v])) for k, v in zip(K_SCALES, V_SCALES, strict=True)]


def test_fp8_kv_cache_takes_the_checkpoints_scales(fp8_kv_dir):
    """The folder's per-layer k_scale/v_scale reach the FP8 pool: PagedCache(kv_cache_dtype="fp8") equals, token for
    token and in its logits, a DynamicCache whose K/V are rounded with those scales. (compressed-tensors 0.20 leaves
    them off the modules under transformers 5.24, where they are read from the checkpoint; where it attaches them, the
    model's own forward rounds K/V with them first and rounding again with the same scale changes nothing.)"""
    model = _load(fp8_kv_dir)
    info = ModelInfo.from_model(model, "fp8")
    for (k, v), (want_k, want_v) in zip(info.kv_scales, _checkpoint_scales(), strict=True):
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, output_scores=True, return_dict_in_generate=True)
    expected = _generate(model, _RoundedKVCache(model.config, _checkpoint_scales()), **kwargs)
    cache = PagedCache(model, num_blocks=48, block_size=8, kv_cache_dtype="fp8")
    out = _generate(model, cache, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.scores, expected.scores, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert_cache_released(cache)


def test_fp8_engine_takes_the_checkpoints_scales_and_auto_ignores_them(fp8_kv_dir):
    """The engine's FP8 pool rounds with the checkpoint's scales too; without FP8 (kv_cache_dtype "auto") the scales
    change nothing: the engine and PagedCache equal DynamicCache."""
    model = _load(fp8_kv_dir)
    prompts = _prompts()
    rounded = _expected(model, prompts, lambda: _RoundedKVCache(model.config, _checkpoint_scales()))
    plain = _expected(model, prompts)
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in NEW_TOKENS]
    for kv_cache_dtype, expected in (("fp8", rounded), ("auto", plain)):
        engine = ContinuousBatcher(model, block_size=8, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32,
                                   kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, kv_cache_dtype
        assert_engine_drained(engine)
    assert ModelInfo.from_model(model, "auto").kv_scales is None
    kwargs = dict(max_new_tokens=16, min_new_tokens=16)
    expected = _generate(model, DynamicCache(config=model.config), **kwargs)
    assert torch.equal(_generate(model, PagedCache(model, num_blocks=48, block_size=8), **kwargs), expected)


def test_fp8_kv_cache_refuses_a_checkpoint_it_cannot_read_its_scales_from(fp8_kv_dir, tmp_path):
    folder = shutil.copytree(fp8_kv_dir, tmp_path / "moved")
    model = _load(str(folder))
    if hasattr(model.model.layers[0].self_attn, "k_scale"):
        pytest.skip("compressed-tensors attached the scales to the attention modules (a transformers whose attention "
                    "takes `past_key_values`, e.g. 5.17), so none is read from the checkpoint; runs under 5.24, as CI "
                    "installs it")  # fmt: skip
    os.remove(folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"kv_cache_scheme.*has no safetensors files.*kv_cache_dtype='auto'"):
        PagedCache(model, num_blocks=8, block_size=8, kv_cache_dtype="fp8")
    PagedCache(model, num_blocks=8, block_size=8)  # "auto" reads no scales
