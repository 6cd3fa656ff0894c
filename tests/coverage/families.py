"""The model coverage registry: one tiny random-weight config per decoder family that transformers users run.

Each ``Family`` names transformers' config and model classes (by name: the GPU image's older transformers lacks
some, and those families skip naming the class), the config overrides that make the model tiny (fp32, vocabulary 96,
hidden size 64, 2-4 layers, sliding windows of 8 tokens so that every prompt of the matrix runs past them), the
attention features it exercises, and what hf_paged must do with it:

- ``expect == MATCH``: ``PagedCache`` with ``attn_implementation="paged"`` (greedy and beam search) and
  ``ContinuousBatcher`` give the tokens transformers gives with its own attention and ``DynamicCache``;
- otherwise ``expect`` is a regex of the ``ValueError`` that ``PagedCache`` (with "paged" attention) and
  ``ContinuousBatcher`` raise at construction; ``cache_attn`` then names the attention ("sdpa", "eager") with
  which ``PagedCache`` still matches ``DynamicCache``, when it does.

The expectations are the coverage target, not a record of today's behaviour: test_matrix.py fails where hf_paged
falls short of them. ``model_table.py`` renders the README's supported-models table from this registry.
"""

from dataclasses import dataclass, field

import torch
import transformers
from models import COMMON

MATCH = "match"

# Llama-style config names, shared by most families (tests/models.py's tiny shape); overrides are applied on top.
BASE = dict(COMMON, tie_word_embeddings=False)
# Token ids only: families with their own config names still get these.
IDS = dict(vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 8  # every sliding window and chunk; the matrix's prompts run to 20-24 tokens, then generate 8 more

# The refusals hf_paged raises at construction (hf_paged/core/support.py, hf_paged/core/model_info.py).
OUTSIDE_INTERFACE = r"ForCausalLM: 0 of its \d+ attention layers call attn_implementation='paged' \(\w+Attention"
STATE_LAYERS = r"has layers of type \[.*'{}'.*\] \(linear attention, state-space or chunked layers"


@dataclass(frozen=True)
class Family:
    name: str  # transformers' model_type, or the model_type and its variant ("falcon_alibi")
    config_cls: str
    model_cls: str
    examples: str  # checkpoints users know, for the README
    features: tuple[str, ...]
    overrides: dict = field(default_factory=dict)
    base: dict | None = None  # BASE unless the family's config spells its sizes otherwise (then IDS)
    expect: str = MATCH  # MATCH, or the regex of the ValueError raised at construction
    cache_attn: str | None = None  # refused families: the attention with which PagedCache still matches
    # False where transformers itself cannot load the model with attn_implementation="paged" (Falcon keys its
    # attention classes by implementation name: KeyError), so only the engine's refusal can be checked.
    loads_paged: bool = True
    reason: str = ""  # refused families: the README's short reason
    label: str = ""  # the README's name when ``name`` is a variant, not a model_type

    def config_kwargs(self) -> dict:
        return {**(BASE if self.base is None else self.base), **self.overrides}

    def missing(self) -> str | None:
        """The class this transformers lacks (the GPU image's is older), or None."""
        return next((c for c in (self.config_cls, self.model_cls) if not hasattr(transformers, c)), None)

    def build(self, seed: int = 0, attn: str = "eager") -> torch.nn.Module:
        """The tiny fp32 model in eval mode on the CPU, its weights drawn from ``seed``.

        The attention is chosen at construction, as ``from_pretrained(attn_implementation=...)`` does: families
        outside transformers' attention interface (Falcon, BLOOM, MPT) ignore a later ``set_attn_implementation``.
        """
        import hf_paged  # noqa: F401  (registers attn_implementation="paged")

        config = getattr(transformers, self.config_cls)(**self.config_kwargs())
        torch.manual_seed(seed)
        model = getattr(transformers, self.model_cls)._from_config(config, attn_implementation=attn)
        return model.eval().to(torch.float32)


def _alternating(num_layers: int, full_every: int) -> list[str]:
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(num_layers)]


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_MLA = dict(
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
)  # fmt: skip
_HYBRID = "linear-attention or state-space layers"  # state blocks cannot hold

FAMILIES: list[Family] = [
    # Dense decoders with rotary positions and full attention.
    Family("llama", "LlamaConfig", "LlamaForCausalLM", "Llama 3.x, SmolLM2", ("GQA",)),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "Qwen2.5", ("GQA", "QKV bias")),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3", ("GQA", "QK norm"), dict(head_dim=16)),
    Family("gemma", "GemmaConfig", "GemmaForCausalLM", "Gemma", ("MQA",), dict(head_dim=16, num_key_value_heads=1)),
    Family("cohere", "CohereConfig", "CohereForCausalLM", "Command R", ("GQA", "parallel block", "logit scale")),
    Family("phi", "PhiConfig", "PhiForCausalLM", "Phi-2", ("MHA", "partial rotary"), dict(num_key_value_heads=4)),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", "Phi-3, Phi-4-mini", ("GQA", "partial rotary", "fused QKV"),
           dict(partial_rotary_factor=0.5)),
    Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", "OLMo 2", ("GQA", "QK norm")),
    Family("stablelm", "StableLmConfig", "StableLmForCausalLM", "StableLM 2", ("GQA", "partial rotary")),
    Family("granite", "GraniteConfig", "GraniteForCausalLM", "Granite 3.x", ("GQA", "scaled attention"),
           dict(attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0)),
    Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", "Pythia, GPT-NeoX-20B", ("MHA", "partial rotary"),
           dict(num_key_value_heads=4)),
    Family("gptj", "GPTJConfig", "GPTJForCausalLM", "GPT-J-6B", ("MHA", "partial rotary"),
           dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, rotary_dim=8), base=IDS),
    Family("glm", "GlmConfig", "GlmForCausalLM", "GLM-4-9B", ("GQA", "partial rotary"), dict(head_dim=16)),
    Family("glm4", "Glm4Config", "Glm4ForCausalLM", "GLM-4-0414", ("GQA", "partial rotary"), dict(head_dim=16)),
    Family("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", "SmolLM3", ("GQA", "NoPE layers"),
           dict(no_rope_layer_interval=2)),
    # Sliding windows: every layer, alternating with full layers, soft-capped logits.
    Family("mistral", "MistralConfig", "MistralForCausalLM", "Mistral 7B", ("GQA", "sliding window"),
           dict(sliding_window=WINDOW)),
    Family("ministral", "MinistralConfig", "MinistralForCausalLM", "Ministral 8B", ("GQA", "alternating window"),
           dict(head_dim=16, sliding_window=WINDOW, layer_types=_alternating(2, 2))),
    Family("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", "StarCoder2", ("GQA", "sliding window", "bias"),
           dict(sliding_window=WINDOW)),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", "Gemma 2", ("GQA", "alternating window", "softcap"),
           dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16)),
    Family("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", "Gemma 3 (text), Gemma 3 1B",
           ("GQA", "alternating window", "QK norm"),
           dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16, num_hidden_layers=3,
                layer_types=_alternating(3, 3))),
    Family("cohere2", "Cohere2Config", "Cohere2ForCausalLM", "Command R7B, Command A",
           ("GQA", "alternating window", "NoPE layers"),
           dict(head_dim=16, sliding_window=WINDOW, layer_types=_alternating(2, 2))),
    Family("exaone4", "Exaone4Config", "Exaone4ForCausalLM", "EXAONE 4.0", ("GQA", "alternating window", "QK norm"),
           dict(sliding_window=WINDOW, layer_types=_alternating(2, 2))),
    Family("olmo3", "Olmo3Config", "Olmo3ForCausalLM", "Olmo 3", ("GQA", "alternating window", "QK norm"),
           dict(sliding_window=WINDOW, layer_types=_alternating(2, 2))),
    # Learned absolute positions.
    Family("gpt2", "GPT2Config", "GPT2LMHeadModel", "GPT-2, DistilGPT2", ("MHA", "absolute positions"),
           dict(n_embd=64, n_layer=2, n_head=4, n_positions=512), base=IDS),
    Family("gpt_bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM", "StarCoder, SantaCoder",
           ("MQA", "absolute positions"), dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, multi_query=True),
           base=IDS),
    Family("opt", "OPTConfig", "OPTForCausalLM", "OPT", ("MHA", "absolute positions"),
           dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                max_position_embeddings=512), base=IDS),
    # Mixture of experts.
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM", "Mixtral 8x7B", ("GQA", "MoE"),
           dict(num_local_experts=4, num_experts_per_tok=2)),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen1.5-MoE, Qwen2-57B-A14B", ("GQA", "MoE"),
           dict(_MOE, shared_expert_intermediate_size=32)),
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3-30B-A3B, Qwen3-235B-A22B",
           ("GQA", "QK norm", "MoE"), dict(_MOE, head_dim=16)),
    Family("phimoe", "PhimoeConfig", "PhimoeForCausalLM", "Phi-3.5-MoE", ("GQA", "MoE"),
           dict(num_local_experts=4, num_experts_per_tok=2)),
    Family("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", "Granite 3.x MoE", ("GQA", "MoE"),
           dict(num_local_experts=4, num_experts_per_tok=2)),
    Family("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "OLMoE", ("MHA", "QK norm", "MoE"),
           dict(num_experts=4, num_experts_per_tok=2, num_key_value_heads=4)),
    Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM", "gpt-oss-20b/120b",
           ("GQA", "alternating window", "sinks", "MoE"),
           dict(head_dim=16, sliding_window=WINDOW, layer_types=_alternating(2, 2), num_local_experts=4,
                num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Multi-head latent attention: one compressed latent per token instead of per-head K/V.
    Family("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepSeek-V2, DeepSeek-V2-Lite",
           ("MLA", "MoE"), dict(_MLA, topk_method="greedy")),
    Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "DeepSeek-V3, DeepSeek-R1, Kimi K2",
           ("MLA", "MoE"), _MLA),
    # Per-layer K/V shapes and K/V shared across layers.
    Family("gemma4", "Gemma4TextConfig", "Gemma4ForCausalLM", "Gemma 4 (text)",
           ("GQA", "alternating window", "per-layer shapes", "KV sharing"),
           dict(head_dim=16, global_head_dim=32, sliding_window=WINDOW, num_hidden_layers=4,
                layer_types=_alternating(4, 2), num_kv_shared_layers=2, vocab_size_per_layer_input=96,
                hidden_size_per_layer_input=16)),
    Family("gemma3n_text", "Gemma3nTextConfig", "Gemma3nForCausalLM", "Gemma 3n E2B/E4B (text)",
           ("GQA", "alternating window", "KV sharing", "AltUp"),
           dict(head_dim=16, sliding_window=WINDOW, num_hidden_layers=4, layer_types=_alternating(4, 2),
                num_kv_shared_layers=2, vocab_size_per_layer_input=96, hidden_size_per_layer_input=16,
                laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4)),
    # Attention that computes itself instead of calling transformers' attention interface.
    Family("falcon", "FalconConfig", "FalconForCausalLM", "Falcon-7B/40B", ("MQA", "parallel block"),
           dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True, alibi=False,
                new_decoder_architecture=False, parallel_attn=True), base=IDS,
           expect=OUTSIDE_INTERFACE, cache_attn="sdpa", loads_paged=False,
           reason="own attention code"),
    Family("falcon_alibi", "FalconConfig", "FalconForCausalLM", "Falcon-RW-1B", ("MHA", "ALiBi"),
           dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=False, alibi=True,
                new_decoder_architecture=False, parallel_attn=False), base=IDS, expect=OUTSIDE_INTERFACE,
           loads_paged=False, reason="own attention code", label="`falcon` (alibi)"),
    Family("bloom", "BloomConfig", "BloomForCausalLM", "BLOOM, BLOOMZ", ("MHA", "ALiBi"),
           dict(hidden_size=64, n_layer=2, n_head=4), base=IDS, expect=OUTSIDE_INTERFACE, cache_attn="eager",
           reason="own attention code"),
    Family("mpt", "MptConfig", "MptForCausalLM", "MPT-7B/30B", ("MHA", "ALiBi"),
           dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=512), base=IDS, expect=OUTSIDE_INTERFACE,
           reason="own attention code"),
    # State that blocks cannot hold: chunked, linear-attention and state-space layers.
    Family("llama4_text", "Llama4TextConfig", "Llama4ForCausalLM", "Llama 4 Scout/Maverick (text)",
           ("GQA", "chunked attention", "NoPE layers", "MoE"),
           dict(head_dim=16, attention_chunk_size=WINDOW, num_local_experts=4, num_experts_per_tok=1,
                intermediate_size_mlp=96, no_rope_layer_interval=2), expect=STATE_LAYERS.format("chunked_attention"),
           reason="chunked attention layers"),
    Family("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3-Next-80B-A3B",
           ("linear attention", "MoE"),
           dict(head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], num_experts=2,
                num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16),
           expect=STATE_LAYERS.format("linear_attention"), reason=_HYBRID),
    Family("qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3.5 (text)", ("linear attention",),
           dict(head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"]),
           expect=STATE_LAYERS.format("linear_attention"), reason=_HYBRID),
    Family("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", "Granite 4.0",
           ("state space", "MoE"),
           dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16, num_local_experts=4,
                num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]),
           expect=STATE_LAYERS.format("linear_attention"), reason=_HYBRID),
    Family("falcon_h1", "FalconH1Config", "FalconH1ForCausalLM", "Falcon-H1", ("state space",),
           dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16),
           expect=STATE_LAYERS.format("hybrid"), reason=_HYBRID),
    Family("jamba", "JambaConfig", "JambaForCausalLM", "Jamba 1.5", ("state space", "MoE"),
           dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8),
           expect=STATE_LAYERS.format("linear_attention"), reason=_HYBRID),
    Family("lfm2", "Lfm2Config", "Lfm2ForCausalLM", "LFM2", ("short convolutions",),
           dict(full_attn_idxs=[1], layer_types=["conv", "full_attention"]), expect=STATE_LAYERS.format("conv"),
           reason=_HYBRID),
    Family("mamba", "MambaConfig", "MambaForCausalLM", "Mamba, Falcon-Mamba", ("state space",),
           dict(hidden_size=64, num_hidden_layers=2, state_size=8), base=IDS,
           expect=STATE_LAYERS.format("linear_attention"), reason=_HYBRID),
]  # fmt: skip

BY_NAME = {f.name: f for f in FAMILIES}
