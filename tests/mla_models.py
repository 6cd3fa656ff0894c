"""Tiny random-weight latent-attention (MLA) models for the MLA tests: DeepSeek-V3 (Kimi-K2's code) and DeepSeek-V2.

A few layers in fp32: the first dense, the others mixture-of-experts with tiny experts (``first_k_dense_replace``),
small latent widths that are no powers of two, and a vocabulary of 96 ids (the char tokenizer's range).
"""

import torch
import transformers
from models import DEVICE

import hf_paged  # noqa: F401  (registers attn_implementation="paged")

# kind -> the config's attention settings (the rest is shared): V3 with a q LoRA and interleaved rope pairs, V3 with
# a plain q_proj and rope in halves, V2 (complex-frequency rope) with a q LoRA.
MLA_KINDS = {
    "v3": dict(q_lora_rank=24, rope_interleave=True),
    "v3-qproj-halves": dict(q_lora_rank=None, rope_interleave=False),
    "v2": dict(q_lora_rank=24),
}


def tiny_mla_model(kind: str = "v3", attn: str = "paged", seed: int = 0, device: str = DEVICE) -> torch.nn.Module:
    """A tiny MLA model of ``kind`` (a key of ``MLA_KINDS``), in eval mode, with ``attn`` as its attention, on
    ``device`` (the test device: cpu in CI, ``HF_PAGED_TEST_DEVICE=cuda`` on a GPU machine)."""
    shared = dict(
        vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=12,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if kind.startswith("v3"):
        config = transformers.DeepseekV3Config(**shared, n_group=1, topk_group=1, **MLA_KINDS[kind])
        model_cls = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.DeepseekV2Config(**shared, **MLA_KINDS[kind])
        model_cls = transformers.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(device)
    model.set_attn_implementation(attn)
    if torch.device(device).type == "cuda" and hasattr(model, "set_experts_implementation"):
        # The engine captures its steps in CUDA graphs; transformers' default grouped_mm experts copy from the host
        # inside the forward (torch 2.11), which a capture refuses. batched_mm is the same math, capturable.
        model.set_experts_implementation("batched_mm")
    return model
