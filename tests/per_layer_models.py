"""Tiny random models whose layers differ in K/V shape or share K/V (Gemma 4, Gemma 3n), and Falcon variants.

Layers (both Gemma builders): sliding, full, sliding, full, sliding, full; the last two reuse the K/V of layers 2
and 3 (the last earlier layer of their type), so layers 2 and 3 own blocks that two layers read.
"""

import inspect

import pytest
import torch
import transformers

import hf_paged  # noqa: F401  (registers attn_implementation="paged")

LAYER_TYPES = ["sliding_attention", "full_attention"] * 3
OWNERS = [0, 1, 2, 3, 2, 3]  # the layer whose K/V each layer reads
COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8, layer_types=LAYER_TYPES,
    num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _needs(config_name: str, attention_name: str) -> None:
    """Skip unless this transformers has the family and its sharing layers take K/V from ``shared_kv_states`` (older
    releases read them from the cache's layers, which a paged cache does not expose)."""
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}; runs where it ships (CI)")
    module = inspect.getmodule(getattr(transformers, config_name))
    modeling = module.__name__.replace(".configuration_", ".modeling_")
    attention = getattr(__import__(modeling, fromlist=[attention_name]), attention_name)
    if "shared_kv_states" not in inspect.signature(attention.forward).parameters:
        pytest.skip(f"transformers {transformers.__version__}'s {attention_name} reads shared K/V from its cache; "
                    "runs with the releases that pass it between layers (CI)")


def gemma4_config():
    """Global layers: head_dim 32 and 1 KV head; sliding layers: head_dim 16 and 2 KV heads."""
    _needs("Gemma4TextConfig", "Gemma4TextAttention")
    return transformers.Gemma4TextConfig(
        **COMMON, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True
    )


def gemma3n_config():
    _needs("Gemma3nTextConfig", "Gemma3nTextAttention")
    return transformers.Gemma3nTextConfig(**COMMON, laurel_rank=8, altup_num_inputs=2)


def tiny_gemma(family: str = "gemma4", attn: str = "paged", device: str = "cpu") -> torch.nn.Module:
    """A tiny random Gemma 4 or Gemma 3n text model (fp32, seed 0)."""
    if family == "gemma4":
        config, model_cls = gemma4_config(), transformers.Gemma4ForCausalLM
    else:
        config, model_cls = gemma3n_config(), transformers.Gemma3nForCausalLM
    torch.manual_seed(0)
    model = model_cls(config).eval().to(device)
    model.set_attn_implementation(attn)
    return model


def tiny_falcon_variant(variant: str, attn: str = "sdpa") -> tuple[torch.nn.Module, int]:
    """A tiny Falcon and the KV heads its cache holds: "multi_query" (1), "mha" (4), "new_arch" (the 2 KV heads
    that Falcon-40B's layout broadcasts to all 4 query heads before the cache)."""
    kwargs, num_kv_heads = {
        "multi_query": (dict(multi_query=True), 1),
        "mha": (dict(multi_query=False), 4),
        "new_arch": (dict(new_decoder_architecture=True, num_kv_heads=2), 4),
    }[variant]
    config = transformers.FalconConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, parallel_attn=True, alibi=False,
        pad_token_id=0, **kwargs,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    return model, num_kv_heads
