"""What the engine accepts as a request: prompts in three forms, checked before anything is queued."""

import numbers

import numpy as np
import torch

from hf_paged.engine.params import SamplingParams


class InputProcessor:
    """Turns a prompt into token ids and refuses requests that could never run.

    Args:
        tokenizer: optional; needed for string prompts and chat messages.
        vocab_size: token ids must be in [0, vocab_size).
        max_model_len: the model's context (None: unbounded).
        num_blocks: blocks in the pool (a request must fit in the whole pool).
        block_size: tokens per block.
        max_num_seqs: the most sequences in one forward (a request's samples or beams run together).
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int | None, num_blocks: int, block_size: int,
                 max_num_seqs: int):  # fmt: skip
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs

    @property
    def max_len(self) -> int:
        return self.max_model_len if self.max_model_len else 1 << 62

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for token ids, a string or chat messages.

        Raises:
            ValueError: a string or messages without a tokenizer.
            TypeError: anything else than these three forms.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a string prompt needs a tokenizer: ContinuousBatcher(model, tokenizer=...)")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if is_messages(prompt):
            if self.tokenizer is None:
                raise ValueError(
                    "chat messages need a tokenizer with a chat template: ContinuousBatcher(..., tokenizer=)"
                )
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return None, list(ids)
        if isinstance(prompt, (torch.Tensor, np.ndarray)):
            if prompt.ndim != 1 or (prompt.dtype.is_floating_point if isinstance(prompt, torch.Tensor)
                                    else not np.issubdtype(prompt.dtype, np.integer)):  # fmt: skip
                raise TypeError(f"a prompt tensor must be 1-D integer token ids, got shape {tuple(prompt.shape)} "
                                f"of {prompt.dtype}")  # fmt: skip
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(
                f"a prompt must be a list of token ids, a string or chat messages, got {type(prompt).__name__}"
            )
        if set(map(type, prompt)) <= {int}:  # plain ints (the usual case): one C-level pass, no per-token isinstance
            return None, list(prompt)
        # numpy integers and the like are converted; bools and non-integers are refused (an ABC isinstance per
        # token costs ~1.7 µs: 0.13 s for 200 prompts of 366 tokens, so plain ints skip it above)
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if bad is not None:
            raise TypeError(f"a prompt's token ids must be ints, got {bad!r} ({type(bad).__name__})")
        return None, [int(t) for t in prompt]

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Refuse, at submission, a request that is malformed or could never fit (it would stall the engine).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt + max_new_tokens beyond
                the model's context or beyond the whole pool.
        """
        if not token_ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        total = len(token_ids) + params.max_new_tokens
        if total > self.max_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} exceeds the "
                f"model's context of {self.max_model_len} tokens; shorten the prompt or lower max_new_tokens"
            )
        width = max(params.n, params.beam_width)
        if width > self.max_num_seqs:
            name = "beam_width" if params.beam_width > 1 else "n"
            raise ValueError(
                f"`{name}` = {width} exceeds the engine's max_num_seqs={self.max_num_seqs}: a request's samples or "
                f"beams run in one forward; lower `{name}` or raise max_num_seqs (and max_num_batched_tokens)"
            )
        bs = self.block_size
        # Running, the prompt's blocks are shared (plus each sample's own blocks and a copied partial block);
        # readmitted after a preemption, every sequence holds its own copy: the request must fit either way.
        shared = -(-len(token_ids) // bs) + width * (-(-params.max_new_tokens // bs) + 1)
        unshared = width * -(-total // bs)
        needed = max(shared, unshared) if width > 1 else shared
        if needed > self.num_blocks:
            raise ValueError(
                f"the request can need {needed} KV blocks ({len(token_ids)} prompt tokens, "
                f"{params.max_new_tokens} new, {width} sequences) but the whole pool has {self.num_blocks}; "
                "lower max_new_tokens or n, or give the engine more blocks"
            )


def as_prompt_list(prompts) -> list:
    """``ContinuousBatcher.generate``'s prompts (one prompt or a list) as a list of single prompts."""
    if prompts is None:
        raise TypeError("`prompts` must be a prompt or a list of prompts (token ids, strings or chat messages), "
                        "got None")  # fmt: skip
    if isinstance(prompts, str) or is_messages(prompts):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        return [prompts] if prompts.dim() == 1 else list(prompts)
    if isinstance(prompts, np.ndarray):
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], numbers.Integral):
        return [list(prompts)]  # one prompt of token ids
    if not isinstance(prompts, (list, tuple)):
        return [prompts]
    return list(prompts)


def is_messages(prompt) -> bool:
    """A chat: a non-empty list of {"role": ..., "content": ...} dicts."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The model's end-of-sequence ids: its generation config, else its config, else the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)
