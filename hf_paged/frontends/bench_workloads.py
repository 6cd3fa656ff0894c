"""The benchmark's models, workloads and physical floor (no GPU needed to build them).

Models: random-weight bf16 models built from configs (no hub; like ``vllm bench --load-format dummy``), in the
shapes of Qwen3-0.6B and Llama-3.1-8B, of gpt-oss-20b, DeepSeek-V2-Lite, Gemma-3-4B and Mixtral-8x7B (their
attention and expert layouts), plus a tiny shape for CPU smoke runs.

Workloads: random prompt ids, EOS ignored, seeded:
- nano: 256 requests, prompt U[100, 1024], output U[100, 1024] (nano-vllm's bench);
- sharegpt: 512 requests, lognormal lengths, means about 161 prompt / 338 output tokens, clipped to 2048;
- prefix: 400 requests, a 341-token shared prefix plus 10-40 unique tokens, outputs 20-80 (vLLM paper §6.4);
- short: 1000 short requests, prompt U[10, 100], output U[20, 200] (chat-like traffic: a prompt in most steps);
- long: 1024 requests of 2048 prompt and 512 output tokens each (KV-bound: the pool, not max_num_seqs, caps the
  batch of an 8B model; what an FP8 pool's doubled capacity is for); ``lengths`` sets other fixed lengths.

The physical floor is one formula for every workload, and an estimate, not a strict bound: the time to read
the weights once per decode step (the fewest steps: requests in waves of ``max_num_seqs``, each wave as long
as its longest output; the wave model is not exact for staggered arrivals) plus every KV byte each output
token attends to, over the measured copy bandwidth, plus the prefill FLOPs (2 x parameters x prompt tokens)
over the measured matmul rate. The embedding table counts as weights read each step although only its
gathered rows are read, so for small models the floor is a little too high.
"""

import math
import os
from dataclasses import dataclass

import torch

SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)),
    "llama-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)),
    # attention sinks, sliding window on every other layer, 32 experts (4 active); bf16 experts instead of MXFP4
    "gpt-oss-20b": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=24, hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072)),
    # multi-head latent attention (kv_lora_rank 512 + rope 64 per token), 64 routed experts (6 active)
    "deepseek-v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=27, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, vocab_size=102400, max_position_embeddings=163840, topk_method="greedy", n_group=1,
        topk_group=1)),
    # five sliding-window layers (1024) to one global layer, head_dim 256
    "gemma-3-4b": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=34, hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, sliding_window=1024, query_pre_attn_scalar=256, vocab_size=262208,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4,
        max_position_embeddings=131072)),
    # 8 experts (2 active) of Llama-2-7B's width: 47B parameters, 94 GB in bf16
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768)),
    "tiny": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1024, max_position_embeddings=4096)),
}  # fmt: skip

WORKLOADS = ("nano", "sharegpt", "prefix", "short", "long")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    name: str, vocab_size: int, num_requests: int | None, seed: int = 0, lengths: tuple[int, int] | None = None
) -> Workload:
    """The seeded prompts and output lengths of a named workload; ``lengths`` (prompt, output): the long workload's."""
    if lengths is not None and (name != "long" or min(lengths) < 1):
        raise ValueError(f"prompt and output lengths {lengths} apply to the long workload only, each >= 1 "
                         f"(got workload {name!r})")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab_size - 10, (n,), generator=gen).tolist()

    if name == "nano":
        n = num_requests or 256
        lens_in = torch.randint(100, 1025, (n,), generator=gen).tolist()
        lens_out = torch.randint(100, 1025, (n,), generator=gen).tolist()
        return Workload(name, [ids(k) for k in lens_in], lens_out)
    if name == "sharegpt":
        n = num_requests or 512
        # lognormal with means ~161 / ~338: mean = exp(mu + sigma^2 / 2)
        sigma_in, sigma_out = 1.0, 0.9
        mu_in, mu_out = math.log(161) - sigma_in**2 / 2, math.log(338) - sigma_out**2 / 2
        lens_in = torch.empty(n).log_normal_(mu_in, sigma_in, generator=gen).clamp(4, 2048).long().tolist()
        lens_out = torch.empty(n).log_normal_(mu_out, sigma_out, generator=gen).clamp(4, 2048).long().tolist()
        return Workload(name, [ids(k) for k in lens_in], lens_out)
    if name == "prefix":
        n = num_requests or 400
        prefix = ids(341)
        uniq = torch.randint(10, 41, (n,), generator=gen).tolist()
        lens_out = torch.randint(20, 81, (n,), generator=gen).tolist()
        return Workload(name, [prefix + ids(k) for k in uniq], lens_out)
    if name == "short":
        n = num_requests or 1000
        lens_in = torch.randint(10, 101, (n,), generator=gen).tolist()
        lens_out = torch.randint(20, 201, (n,), generator=gen).tolist()
        return Workload(name, [ids(k) for k in lens_in], lens_out)
    if name == "long":
        n = num_requests or 1024
        prompt_len, output_len = lengths or (2048, 512)
        return Workload(name, [ids(prompt_len) for _ in range(n)], [output_len] * n)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def build_model(shape: str, device: str = "cuda", **overrides):
    """The shape's model with random bf16 weights on ``device``; ``overrides`` replace config fields (e.g.
    ``num_hidden_layers=1``)."""
    import transformers

    config_cls, model_cls, kwargs = SHAPES[shape]
    config = getattr(transformers, config_cls)(
        **{**kwargs, **overrides}, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(config).eval()
    finally:
        torch.set_default_dtype(default)
    return model


def load_or_build(shape: str, model_dir: str | None, tp: bool):
    """The benchmark model: built in memory, or loaded from ``model_dir`` (saved there first if missing).

    Tensor parallelism (``tp``) needs a checkpoint to shard: under torchrun, rank 0 saves it and every rank
    loads it with ``tp_plan="auto"``.
    """
    from transformers import AutoModelForCausalLM

    if model_dir is None:
        return build_model(shape)
    rank = int(os.environ.get("RANK", "0"))
    if tp and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if rank == 0 and not os.path.isdir(model_dir):
        model = build_model(shape)
        model.save_pretrained(model_dir)
        del model
        torch.cuda.empty_cache()
    if tp:
        torch.distributed.barrier()
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, tp_plan="auto").eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda").eval()


def measure_ceilings(device: str = "cuda") -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), measured on ``device``."""
    from triton.testing import do_bench

    def copy_ms() -> float:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
        dst = torch.empty_like(src)
        return do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")

    def matmul_ms() -> float:
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        return do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")

    bandwidth = 2 * (1 << 30) / (copy_ms() * 1e-3)
    flops = 2 * 8192**3 / (matmul_ms() * 1e-3)
    torch.cuda.empty_cache()
    return bandwidth, flops


def floor_seconds(model, workload: Workload, bandwidth: float, flops: float, max_concurrency: int,
                  kv_element_bytes: int = 2) -> float:  # fmt: skip
    """Time no engine can beat: weights once per decode step + every attended KV byte + prefill FLOPs.

    Mixture-of-experts models: every expert counts as read each decode step (a batch of many rows routes to all of
    them) but only the active experts' FLOPs count in the prefill. MLA models keep one latent row a token a layer.
    Sliding-window layers count every key (the floor is then a little too easy). ``kv_element_bytes``: 1 for an
    FP8 KV cache.
    """
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * 2
    kv_read = 0
    for prompt, out_len in zip(workload.prompts, workload.output_lens, strict=True):
        # output token t attends len(prompt) + t keys
        kv_read += out_len * len(prompt) + out_len * (out_len - 1) // 2
    # Fewest decode steps: the requests run in waves of max_concurrency; each wave lasts its longest output.
    lens = sorted(workload.output_lens, reverse=True)
    steps = sum(lens[i] for i in range(0, len(lens), max_concurrency))
    prefill_flops = 2 * active_parameters(model) * workload.num_prompt_tokens
    kv_bytes = kv_bytes_per_token(config) * kv_element_bytes // 2  # kv_bytes_per_token counts bf16
    return (steps * weight_bytes + kv_read * kv_bytes) / bandwidth + prefill_flops / flops


def kv_bytes_per_token(config) -> int:
    """bf16 K/V bytes one token keeps over all layers: K and V per KV head, or one MLA latent row."""
    if getattr(config, "kv_lora_rank", None):
        return config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * num_kv_heads * head_dim * 2


def active_parameters(model) -> int:
    """Parameters a token runs through: the routed experts count by the share of them a token picks."""
    config = model.config
    num_experts = next((getattr(config, k) for k in ("n_routed_experts", "num_local_experts", "num_experts")
                        if getattr(config, k, None)), None)  # fmt: skip
    params = sum(p.numel() for p in model.parameters())
    if not num_experts:
        return params
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name or name.endswith(".experts"))
    return params - routed + routed * config.num_experts_per_tok // num_experts


def build_quantized(shape: str, quantization: str, device: str = "cuda"):
    """The shape's random-weight model on ``device`` (bf16; fp32 on the CPU), its weights quantized in place there
    by ``quantization`` (torchao, hf_paged.engine.quantization; "none" keeps them)."""
    from hf_paged.engine.quantization import torchao_config

    model = build_model(shape, device=device)
    if device == "cpu":
        model = model.float()
    config = torchao_config(quantization, device, next(model.parameters()).dtype)
    if config is not None:
        from torchao.quantization import quantize_

        quantize_(model, config)
    return model
