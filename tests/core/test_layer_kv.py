"""Per-layer K/V shapes and KV sharing: ModelInfo's LayerKV specs and the KVPool that allocates from them."""

import random

import pytest
import torch
import transformers
from helpers import needs_cuda
from models import tiny_model
from per_layer_models import OWNERS, gemma3n_config, gemma4_config, tiny_gemma

from hf_paged.core.kv_pool import KVPool, LayerKV, check_layer_specs
from hf_paged.core.model_info import ModelInfo, kv_heads, layer_specs
from hf_paged.engine.memory import kv_bytes_per_device

CPU = torch.device("cpu")


def test_gemma4_global_layers_have_their_own_shape_and_the_last_layers_share():
    specs = layer_specs(gemma4_config(), 6)
    sliding, full = (2, 16, 16), (1, 32, 32)
    assert [(s.num_kv_heads, s.head_dim, s.v_head_dim) for s in specs] == [sliding, full] * 3
    assert [s.kv_layer for s in specs] == OWNERS
    assert not any(s.v_in_k for s in specs)


def test_gemma3n_shares_the_last_layers_kv():
    specs = layer_specs(gemma3n_config(), 6)
    assert [s.kv_layer for s in specs] == OWNERS
    assert {(s.num_kv_heads, s.head_dim) for s in specs} == {(2, 16)}


def test_model_info_counts_each_owned_tensor_once():
    info = ModelInfo.from_model(tiny_gemma("gemma4"))
    assert info.num_layers == 6 and info.layers == layer_specs(gemma4_config(), 6)
    # 4 owners (layers 0-3), K and V, block of 8 fp32: sliding 2 x 16, full 1 x 32 elements a token
    assert info.bytes_per_block(8) == 4 * 2 * 8 * 32 * 4
    per_layer = KVPool.layer_bytes_per_block(info.layers, 8, torch.float32)
    assert per_layer == [2 * 8 * 32 * 4] * 4 + [0, 0]
    info.devices = [torch.device("cuda", 0)] * 3 + [torch.device("cuda", 1)] * 3  # sizing only: nothing allocated
    assert kv_bytes_per_device(info, 8) == {torch.device("cuda", 0): 3 * 2048, torch.device("cuda", 1): 2048}


def test_a_layer_reusing_kv_of_no_earlier_layer_is_refused():
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma4TextConfig; runs where it ships (CI)")
    config = transformers.Gemma4TextConfig(num_hidden_layers=2, num_kv_shared_layers=2, layer_types=None)
    with pytest.raises(ValueError, match=r"layer 0 \(sliding_attention\) reuses the K/V of an earlier layer, but no"):
        layer_specs(config, 2)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (transformers.FalconConfig(num_attention_heads=4, hidden_size=32, multi_query=True), 1),
        (transformers.FalconConfig(num_attention_heads=4, hidden_size=32, multi_query=False), 4),
        # Falcon-40B's layout broadcasts its 2 KV heads to every query head before the cache
        (
            transformers.FalconConfig(
                num_attention_heads=4, hidden_size=32, new_decoder_architecture=True, num_kv_heads=2
            ),
            4,
        ),  # fmt: skip
        (transformers.GPTBigCodeConfig(n_head=4, n_embd=32, multi_query=True), 1),
        (transformers.GPTBigCodeConfig(n_head=4, n_embd=32, multi_query=False), 4),
        (transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 2),
        (transformers.GPT2Config(n_head=4), 4),
    ],
    ids=["falcon-mq", "falcon-mha", "falcon-new-arch", "bigcode-mq", "bigcode-mha", "llama-gqa", "gpt2"],
)
def test_kv_heads_as_the_model_caches_them(config, expected):
    assert kv_heads(config) == expected


def test_tensor_parallelism_must_split_every_layers_kv_heads():
    with pytest.raises(ValueError, match=r"has 1 KV heads in layer 1, which tensor parallelism of degree 2"):
        layer_specs(gemma4_config(), 6, tp_size=2, model_type="gemma4_text")


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([], "at least one attention layer"),
        ([LayerKV(2, 16, 16, 0), LayerKV(2, 16, 16, 5)], r"layer 1's kv_layer must be in \[0, 1\], got 5"),
        ([LayerKV(2, 16, 16, 0), LayerKV(2, 16, 16, 0), LayerKV(2, 16, 16, 1)], "which shares those of layer 0"),
        ([LayerKV(2, 16, 16, 0), LayerKV(1, 16, 16, 0)], "shares the K/V of layer 0 of another shape"),
        ([LayerKV(1, 16, 24, 0, v_in_k=True)], "v_head_dim 24 exceeds head_dim 16"),
        ([LayerKV(0, 16, 16, 0)], "must be positive"),
    ],
    ids=["empty", "out-of-range", "chain", "other-shape", "v-wider-than-k", "no-heads"],
)
def test_bad_layer_specs_are_refused(layers, match):
    with pytest.raises(ValueError, match=match):
        check_layer_specs(layers)


def test_a_sharing_layer_must_sit_on_its_owners_device():
    layers = [LayerKV(2, 16, 16, 0), LayerKV(2, 16, 16, 0)]
    with pytest.raises(ValueError, match=r"layer 1 \(on meta\) shares the K/V of layer 0 \(on cpu\)"):
        KVPool(layers, 2, 8, torch.float32, [CPU, torch.device("meta")])


def test_uniform_pool_keeps_its_shape_attributes_and_a_mixed_one_refuses_them():
    uniform = KVPool.uniform(2, 2, 8, 2, 16, torch.float32, [CPU] * 2)
    assert (uniform.num_kv_heads, uniform.head_dim) == (2, 16)
    mixed = KVPool([LayerKV(2, 16, 16, 0), LayerKV(1, 32, 32, 1)], 2, 8, torch.float32, [CPU] * 2)
    with pytest.raises(ValueError, match=r"differ in head_dim \(\[16, 32\]\): read pool.layers\[i\].head_dim"):
        _ = mixed.head_dim


def _random_specs(rng: random.Random) -> list[LayerKV]:
    """1-6 layers; each owns K/V of a random shape (sometimes V inside K) or shares an earlier owner's."""
    layers: list[LayerKV] = []
    for i in range(rng.randint(1, 6)):
        owners = [j for j, s in enumerate(layers) if s.kv_layer == j]
        if owners and rng.random() < 0.4:
            owner = layers[rng.choice(owners)]
            layers.append(LayerKV(owner.num_kv_heads, owner.head_dim, owner.v_head_dim, owner.kv_layer, owner.v_in_k))
            continue
        head_dim = rng.choice([4, 8])
        v_in_k = rng.random() < 0.3
        v_head_dim = rng.choice([2, head_dim]) if v_in_k else rng.choice([4, 8])
        layers.append(LayerKV(rng.choice([1, 2]), head_dim, v_head_dim, i, v_in_k))
    return layers


def _check_aliases(pool: KVPool) -> None:
    for i, spec in enumerate(pool.layers):
        k, v = pool.k_cache[i], pool.v_cache[i]
        assert k.shape == (pool.num_blocks, pool.block_size, spec.num_kv_heads, spec.head_dim)
        assert v.shape == (pool.num_blocks, pool.block_size, spec.num_kv_heads, spec.v_head_dim)
        assert k is pool.k_cache[spec.kv_layer] and v is pool.v_cache[spec.kv_layer]
        if spec.v_in_k:  # V is K's first columns: the same storage
            assert v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
    owned = pool.owned_tensors()
    assert len({id(t) for t in owned}) == len(owned)
    assert len({t.data_ptr() for t in owned}) == len(owned)  # no two owned tensors overlap
    per_block = sum(t[0].numel() * t.element_size() for t in owned)
    assert per_block == KVPool.bytes_per_block(pool.layers, pool.block_size, pool.dtype)


def _fill(pool: KVPool, gen: torch.Generator) -> None:
    for t in pool.owned_tensors():
        t.copy_(torch.randn(t.shape, generator=gen))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("seed", range(12))
def test_random_pools_grow_copy_and_swap_each_owned_tensor(seed, device):
    """Random per-layer specs: sharing layers alias their owner, and growth, copy-on-write and a swap round trip keep
    every owned tensor's blocks (a sharing layer sees them through its owner)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the one-launch copy of each layout needs CUDA: runs on the device machine "
                    "(benchmarks/run_gpu.sh tests-cache)")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    layers = _random_specs(rng)
    pool = KVPool(layers, 4, 8, torch.float32, [torch.device(device)] * len(layers))
    _check_aliases(pool)
    _fill(pool, gen)
    before = [t.clone() for t in pool.owned_tensors()]
    pool.copy_blocks([(1, 3), (0, 2)])
    for old, t in zip(before, pool.owned_tensors(), strict=True):
        expected = old.clone()
        expected[3], expected[2] = old[1], old[0]
        assert torch.equal(t, expected)
    pool.grow(7)
    _check_aliases(pool)
    for old, t in zip(before, pool.owned_tensors(), strict=True):
        assert torch.equal(t[:2], old[:2]) and torch.equal(t[2], old[0]) and torch.equal(t[3], old[1])
        assert not t[4:].any()
    pool.copy_blocks([(3, 6)])  # the copy groups were rebuilt for the grown tensors
    assert all(torch.equal(t[6], t[3]) for t in pool.owned_tensors())
    kept = [t.clone() for t in pool.owned_tensors()]
    pool.allocate_swap(3)
    pool.swap_out([(1, 0), (6, 2)])
    for t in pool.owned_tensors():
        t[1].normal_()  # another sequence reuses the swapped-out blocks
        t[6].zero_()
    pool.swap_in([(0, 1), (2, 6)])
    assert all(torch.equal(t, k) for t, k in zip(pool.owned_tensors(), kept, strict=True))
    for i, spec in enumerate(layers):  # what each layer reads: its owner's blocks, V inside K where latent
        assert torch.equal(pool.k_cache[i], pool.k_cache[spec.kv_layer])
        if spec.v_in_k:
            assert torch.equal(pool.v_cache[i], pool.k_cache[i][..., : spec.v_head_dim])


@needs_cuda("the all-layers copy launch over layouts")
def test_copy_groups_pair_each_owned_tensor_once_on_cuda():
    """Three owned tensors of one layout (K and V of layer 0, K of a latent layer): two launch pairs, the odd one
    out paired with itself, and every tensor copied."""
    layers = [LayerKV(2, 8, 8, 0), LayerKV(2, 8, 4, 1, v_in_k=True), LayerKV(2, 8, 8, 0)]
    pool = KVPool(layers, 4, 8, torch.float32, [torch.device("cuda")] * 3)
    _fill(pool, torch.Generator().manual_seed(0))
    pool.copy_blocks([(0, 3)])
    assert all(torch.equal(t[3], t[0]) for t in pool.owned_tensors())
    assert sorted(len(firsts) for _, firsts, _, _ in pool._copy_groups) == [2]


def test_uniform_model_info_matches_the_config():
    model = tiny_model("qwen3")  # head_dim 16 set apart from hidden_size // heads
    info = ModelInfo.from_model(model)
    assert info.layers == [LayerKV(2, 16, 16, i) for i in range(2)]
