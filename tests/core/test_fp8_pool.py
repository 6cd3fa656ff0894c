"""FP8 KV pool: the kv_cache_dtype names, half the bytes a block (twice the tokens a budget), per-layer scales from
the checkpoint's attention modules, bit-exact block moves, and the refusals (e4m3 on GPUs before sm_89 included)."""

import pytest
import torch
from mla_models import tiny_mla_model
from models import tiny_model

from hf_paged import ContinuousBatcher, EngineConfig, PagedCache
from hf_paged.core import model_info
from hf_paged.core.kv_dtype import KV_CACHE_DTYPES, check_fp8_devices, check_kv_cache_dtype, kv_storage_dtype
from hf_paged.core.kv_pool import KVPool, LayerKV
from hf_paged.core.model_info import ModelInfo
from hf_paged.engine.memory import kv_bytes_per_device

ALLOWED = r"`kv_cache_dtype` must be one of \['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\]"
CPU = torch.device("cpu")


def test_kv_cache_dtype_names():
    assert KV_CACHE_DTYPES == ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    assert kv_storage_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_storage_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2", torch.float16) is torch.float8_e5m2
    for bad in ("fp16", "FP8", "int8", torch.float8_e4m3fn, None):
        with pytest.raises(ValueError, match=ALLOWED + f", got {bad!r}"):
            check_kv_cache_dtype(bad)


@pytest.mark.parametrize("bad", ["e4m3", torch.float8_e5m2])
def test_unknown_dtype_is_refused_everywhere(bad):
    with pytest.raises(ValueError, match=ALLOWED):
        EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match=ALLOWED):
        PagedCache(tiny_model("llama"), num_blocks=4, kv_cache_dtype=bad)
    with pytest.raises(ValueError, match=ALLOWED):
        ContinuousBatcher(tiny_model("llama"), num_blocks=4, kv_cache_dtype=bad)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_block_is_half_of_bf16_and_a_budget_holds_twice_the_tokens(monkeypatch, kv_cache_dtype):
    model = tiny_model("llama").to(torch.bfloat16)
    bf16 = ModelInfo.from_model(model)
    fp8 = ModelInfo.from_model(model, kv_cache_dtype)
    assert bf16.dtype is torch.bfloat16 and fp8.dtype is kv_storage_dtype(kv_cache_dtype, torch.bfloat16)
    # 2 layers x (K + V) x 2 KV heads x head_dim 16 x 16 tokens, at 2 bytes and at 1
    assert bf16.bytes_per_block(16) == 2 * 2 * 2 * 16 * 16 * 2 == 2 * fp8.bytes_per_block(16)
    assert kv_bytes_per_device(fp8, 16) == {CPU: fp8.bytes_per_block(16)}
    # The same free memory: memory_fraction sizing (PagedCache's default pool, the engine on the CPU)
    monkeypatch.setattr(KVPool, "free_memory", staticmethod(lambda device: 2**20))
    blocks = bf16.num_blocks_for(None, 16, 0.5)
    assert blocks == 2**19 // bf16.bytes_per_block(16) and fp8.num_blocks_for(None, 16, 0.5) == 2 * blocks
    auto = ContinuousBatcher(model, block_size=16, memory_fraction=0.5)
    small = ContinuousBatcher(model, block_size=16, memory_fraction=0.5, kv_cache_dtype=kv_cache_dtype)
    assert small.pool.num_blocks == 2 * auto.pool.num_blocks == 2 * blocks
    assert small.kv.k_cache[0].dtype == fp8.dtype and small.kv.k_cache[0].element_size() == 1
    assert f"{2 * blocks * 16} tokens, kv_cache_dtype {kv_cache_dtype}" in small.kv_pool_summary
    cache = PagedCache(model, kv_cache_dtype=kv_cache_dtype, memory_fraction=0.5)
    assert cache._max_num_blocks == 2 * PagedCache(model, memory_fraction=0.5)._max_num_blocks


def _fill(pool: KVPool, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in pool.owned_tensors():
        t.copy_((torch.randn(t.shape, generator=gen) * 4).to(t.dtype))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_pool_holds_fp8_tensors_and_moves_blocks_bit_exact(dtype):
    """Layer 2 shares layer 0's K/V: it has the owner's tensors and the owner's scales. Growth, copy-on-write and
    a swap round trip keep every byte."""
    layers = [LayerKV(2, 8, 8, 0), LayerKV(1, 16, 16, 1), LayerKV(2, 8, 8, 0)]
    scales = [(torch.full((1,), 0.5), torch.tensor([1.0, 2.0])), (torch.ones(1), torch.ones(1)),
              (torch.full((1,), 9.0), torch.full((1,), 9.0))]  # fmt: skip
    pool = KVPool(layers, 6, 8, dtype, [CPU] * 3, kv_scales=scales)
    assert pool.is_fp8 and all(t.dtype == dtype for t in pool.owned_tensors())
    assert pool.kv_scales[2] is pool.kv_scales[0] and pool.kv_scales[0][1].tolist() == [1.0, 2.0]
    assert KVPool(layers, 6, 8, dtype, [CPU] * 3).kv_scales[1][0].tolist() == [1.0]  # no scales given: 1.0
    _fill(pool)
    before = [_bytes(t).clone() for t in pool.owned_tensors()]
    pool.copy_blocks([(1, 4), (2, 5)])
    for old, t in zip(before, pool.owned_tensors(), strict=True):
        assert torch.equal(_bytes(t)[4], old[1]) and torch.equal(_bytes(t)[5], old[2])
    pool.allocate_swap(3)
    kept = [_bytes(t).clone() for t in pool.owned_tensors()]
    pool.swap_out([(4, 0), (5, 2)])
    for t in pool.owned_tensors():
        t[4:].zero_()
    pool.swap_in([(0, 4), (2, 5)])
    assert all(torch.equal(_bytes(t), k) for t, k in zip(pool.owned_tensors(), kept, strict=True))
    pool.grow(9)
    assert all(t.dtype == dtype and t.shape[0] == 9 for t in pool.owned_tensors())
    assert all(torch.equal(_bytes(t)[:6], k) for t, k in zip(pool.owned_tensors(), kept, strict=True))
    assert pool.k_cache[2] is pool.k_cache[0] and pool.kv_scales[2] is pool.kv_scales[0]


def test_pool_refuses_scales_it_cannot_use():
    layers = [LayerKV(2, 8, 8, 0)]
    with pytest.raises(ValueError, match=r"`kv_scales` are for an FP8 pool .* got dtype torch.bfloat16"):
        KVPool(layers, 4, 8, torch.bfloat16, [CPU], kv_scales=[(torch.ones(1), torch.ones(1))])
    with pytest.raises(ValueError, match=r"layer 0's v_scale must be an fp32 tensor of shape \[1\] or \[2\]"):
        KVPool(layers, 4, 8, torch.float8_e4m3fn, [CPU], kv_scales=[(torch.ones(1), torch.ones(3))])
    with pytest.raises(ValueError, match=r"latent attention \(MLA: layers \[0\]\); use kv_cache_dtype='auto'"):
        KVPool([LayerKV(1, 24, 16, 0, v_in_k=True)], 4, 8, torch.float8_e4m3fn, [CPU])


def _attention(model, layer: int) -> torch.nn.Module:
    return model.model.layers[layer].self_attn


def test_scales_are_read_from_the_attention_modules():
    """compressed-tensors / vLLM checkpoints: k_scale, v_scale on the attention module, scalar or per KV head, as a
    parameter or a buffer; a layer without them gets 1.0."""
    model = tiny_model("llama")  # 2 layers, 2 KV heads
    attn = _attention(model, 0)
    attn.k_scale = torch.nn.Parameter(torch.tensor(0.25), requires_grad=False)
    attn.register_buffer("v_scale", torch.tensor([[2.0], [3.0]]))  # per head, in a shape of its own
    info = ModelInfo.from_model(model, "fp8")
    (k0, v0), (k1, v1) = info.kv_scales
    assert (k0.tolist(), v0.tolist(), k1.tolist(), v1.tolist()) == ([0.25], [2.0, 3.0], [1.0], [1.0])
    assert all(s.dtype == torch.float32 and s.dim() == 1 for pair in info.kv_scales for s in pair)
    assert ModelInfo.from_model(model).kv_scales is None  # "auto" stores the model's dtype: scales unused
    cache = PagedCache(model, num_blocks=4, kv_cache_dtype="fp8")
    assert cache.kv.kv_scales[0][1].tolist() == [2.0, 3.0]
    attn.k_scale.data.fill_(5.0)  # the pool keeps its own copy
    assert cache.kv.kv_scales[0][0].tolist() == [0.25]


def test_scales_the_loader_dropped_are_read_from_the_checkpoint(tmp_path):
    """A config with a static kv_cache_scheme whose scales are not on the modules (compressed-tensors under
    transformers 5.24): the checkpoint's "<module>.k_scale" tensors, here over two shards of an index; the modules'
    own scales win where they have them; a dynamic scheme stores none (1.0, nothing read)."""
    import json

    from safetensors.torch import save_file

    model = tiny_model("llama")  # 2 layers, 2 KV heads
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor([0.5]), "model.layers.0.self_attn.v_scale":
               torch.tensor(0.25), "model.norm.weight": torch.ones(4)}, tmp_path / "a.safetensors")  # fmt: skip
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor([2.0, 4.0]),
               "model.layers.1.self_attn.v_scale": torch.tensor([0.125])}, tmp_path / "b.safetensors")  # fmt: skip
    names = ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale", "model.norm.weight"]
    weight_map = {name: "a.safetensors" for name in names} | {
        f"model.layers.1.self_attn.{n}": "b.safetensors" for n in ("k_scale", "v_scale")
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    model.config.quantization_config = {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}
    model.config._name_or_path = str(tmp_path)
    scales = [[s.tolist() for s in pair] for pair in ModelInfo.from_model(model, "fp8").kv_scales]
    assert scales == [[[0.5], [0.25]], [[2.0, 4.0], [0.125]]]
    _attention(model, 1).register_buffer("k_scale", torch.tensor([3.0]))
    _attention(model, 1).register_buffer("v_scale", torch.tensor([6.0]))
    scales = [[s.tolist() for s in pair] for pair in ModelInfo.from_model(model, "fp8").kv_scales]
    assert scales == [[[0.5], [0.25]], [[3.0], [6.0]]]
    scheme["dynamic"] = True
    (tmp_path / "model.safetensors.index.json").unlink()  # a read would now find no files and raise
    scales = [[s.tolist() for s in pair] for pair in ModelInfo.from_model(model, "fp8").kv_scales]
    assert scales == [[[1.0], [1.0]], [[3.0], [6.0]]]


@pytest.mark.parametrize(
    ("k_scale", "v_scale", "message"),
    [
        (torch.ones(3), torch.ones(1), r"layer 0's k_scale has shape \(3,\); .* one per KV head \(2 in this layer"),
        (torch.tensor(0.0), torch.ones(1), r"layer 0's k_scale must hold positive finite values, got \[0.0\]"),
        (torch.ones(1), torch.tensor(float("nan")), r"layer 0's v_scale must hold positive finite values"),
        (torch.ones(1), None, r"layer 0's attention module \(LlamaAttention\) has k_scale but no v_scale"),
    ],
)
def test_bad_checkpoint_scales_are_refused(k_scale, v_scale, message):
    model = tiny_model("llama")
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is not None:
            _attention(model, 0).register_buffer(name, value)
    with pytest.raises(ValueError, match=message):
        ModelInfo.from_model(model, "fp8")


def test_fp8_with_latent_attention_is_refused():
    model = tiny_mla_model("v3")
    message = r"kv_cache_dtype='fp8': 'deepseek_v3' has latent attention \(MLA\).*use kv_cache_dtype='auto'"
    with pytest.raises(ValueError, match=message):
        PagedCache(model, num_blocks=8, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=message.replace("'fp8'", "'fp8_e5m2'")):
        ContinuousBatcher(model, num_blocks=8, kv_cache_dtype="fp8_e5m2")
    assert PagedCache(model, num_blocks=8).kv.dtype == next(model.parameters()).dtype  # "auto" still pages it


def test_e4m3_is_refused_on_gpus_before_sm89(monkeypatch):
    """Triton has no e4m3 type before sm_89 (tests/kernels/test_gpu_compile.py shows its compile error for sm_80): an
    A100 (8.0) refuses "fp8"/"fp8_e4m3" when PagedCache or the engine is built, naming the device and fp8_e5m2; an
    Ada or Hopper card takes e4m3, and e5m2 runs from 8.0. torch's answer for the capability is patched: no GPU
    here."""
    capabilities = {0: (8, 0), 1: (8, 9)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capabilities[device.index])
    a100, ada = torch.device("cuda", 0), torch.device("cuda", 1)
    message = (
        r"kv_cache_dtype='fp8' stores float8 e4m3, which Triton supports on CUDA GPUs of compute capability "
        r">= 8\.9 \(Ada, Hopper or newer\); cuda:0 has compute capability 8\.0: use kv_cache_dtype='fp8_e5m2'"
    )
    with pytest.raises(ValueError, match=message):
        check_fp8_devices("fp8", [ada, a100])
    with pytest.raises(ValueError, match=message.replace("'fp8'", "'fp8_e4m3'", 1)):
        check_fp8_devices("fp8_e4m3", [a100])
    for kv_cache_dtype, devices in (("fp8", [ada, CPU]), ("fp8_e4m3", [ada]), ("fp8_e5m2", [a100]), ("auto", [a100])):
        check_fp8_devices(kv_cache_dtype, devices)  # no error
    # Both constructors check their layers' devices before allocating anything (here: layers "on" the A100).
    monkeypatch.setattr(model_info, "_layer_devices", lambda model, num_layers: [a100] * num_layers)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        PagedCache(model, num_blocks=4, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=message):
        ContinuousBatcher(model, num_blocks=4, kv_cache_dtype="fp8")
