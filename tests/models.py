"""Tiny random-weight models of several families, built from configs (no hub), for CPU tests."""

import os

import torch
import transformers

import hf_paged  # noqa: F401  (registers attn_implementation="paged")

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# family -> (config class, model class, extra config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 4}),
    # Sliding-window layers alternating with global ones, logit soft-capping.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16, "final_logit_softcapping": None},
    ),
}


# Engine tests run on this device: cpu in CI; HF_PAGED_TEST_DEVICE=cuda runs them on the GPU (device machine).
DEVICE = os.environ.get("HF_PAGED_TEST_DEVICE", "cpu")


def tiny_model(
    family: str = "llama", attn: str = "paged", seed: int = 0, device: str = "cpu", **overrides
) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval().to(device)
    model.set_attn_implementation(attn)
    return model


def tiny_falcon(attn: str = "paged") -> torch.nn.Module:
    """A tiny multi-query Falcon: its attention computes itself, outside transformers' attention interface."""
    config = transformers.FalconConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, alibi=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    return model


def cache_kwarg() -> str:
    """The name generate() takes the cache by: `cache` where models take it so (5.2x), else `past_key_values`."""
    import inspect

    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def char_tokenizer():
    """One character per token (ids 3-95, so they fit the tiny models' vocabulary), with a chat template: stop
    strings and text are easy to place in tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, 96):
        vocab[chr(ord("!") + i)] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}assistant:"
    return fast


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama's layout: BPE with byte fallback, "▁" for spaces, a decoder that
    strips the leading space), trained in memory on a few sentences, so Chinese characters and emoji fall back to
    one token per UTF-8 byte."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60,
                                  show_progress=False)  # fmt: skip
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello streams!", "naïve café 你好 😀"]
    tok.train_from_iterator(corpus * 20, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte tokens as ordinary vocabulary entries (not special: they must not be skipped)
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_batcher(seed: int = 0, **settings):
    """A ContinuousBatcher over ``tiny_model("llama", seed=seed)`` on the CPU with ``char_tokenizer()``.

    Module-level, so ``functools.partial(tiny_batcher, ...)`` pickles: the data-parallel tests' replica processes
    (started with ``spawn``) build their engines with it, and the tests build the same engine offline.
    """
    from hf_paged import ContinuousBatcher

    settings = dict(num_blocks=128, block_size=8, max_num_seqs=16, max_num_batched_tokens=128) | settings
    return ContinuousBatcher(tiny_model("llama", seed=seed), char_tokenizer(), **settings)


def ascii_tokenizer(padding_side: str = "right"):
    """One token per printable ASCII character (ids 3-97) after <pad> (0), <s> (1), </s> (2): grammars over text a
    tiny random model can spell."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side=padding_side)  # fmt: skip
