"""A tiny random-weight gpt-oss (attention sinks, alternating sliding-window and full layers, GQA, a mixture of
experts), built from a config (no hub), for CPU tests of the paged path with sinks."""

import pytest
import torch
import transformers

import hf_paged  # noqa: F401  (registers attn_implementation="paged")

# Prompts in the tests run past SLIDING_WINDOW, so the sliding-window layers drop keys that the full layers keep.
SLIDING_WINDOW = 8


def tiny_gpt_oss(attn: str = "paged", seed: int = 0, num_hidden_layers: int = 2, device: str = "cpu"):
    """A gpt-oss of ``num_hidden_layers`` layers alternating sliding_attention (window ``SLIDING_WINDOW``) and
    full_attention, 4 query heads over 2 KV heads, 4 experts (2 a token), fp32. Its sink logits are redrawn at a
    scale (std 2) where they take a good share of each softmax (the model's own init, std 0.02, would make them
    near-invisible next to the scores). Skips where transformers has no gpt-oss."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss (GptOssConfig); runs where it ships (CI)")
    config = transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW, max_position_embeddings=131072, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_hidden_layers)],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval().to(device)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model.set_attn_implementation(attn)
    return model
