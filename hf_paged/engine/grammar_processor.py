"""Structured outputs under ``model.generate``: a ``transformers`` logits processor over the engine's grammars
(hf_paged.engine.structured), for any cache, ``PagedCache`` included."""

import torch

from hf_paged.engine.bitmask import apply_bitmask, import_xgrammar
from hf_paged.engine.params import StructuredOutput
from hf_paged.engine.structured import grammar_vocab_size, parse_grammar


class GrammarLogitsProcessor:
    """A ``transformers`` logits processor that keeps ``model.generate`` output in a ``StructuredOutput``.

    One per ``generate`` call (it keeps a matcher per batch row); works with any cache, ``PagedCache`` included:

        processor = GrammarLogitsProcessor(StructuredOutput(json=schema), tokenizer, model.config.vocab_size)
        model.generate(**inputs, past_key_values=PagedCache(model), logits_processor=[processor])

    A row whose grammar has ended allows only EOS, so it pads out like a row that stopped. Greedy, sampling and
    ``num_return_sequences`` are supported; beam search is not (a row's history changes when beams are reordered).

    Args:
        spec: the constraint.
        tokenizer: the model's tokenizer.
        vocab_size: the model's logits width (``model.get_output_embeddings().weight.shape[0]``).
        stop_token_ids: the ids that end the output (default: the tokenizer's EOS).

    Raises:
        ValueError: xgrammar is missing, or ``spec`` is invalid.
    """

    def __init__(self, spec: StructuredOutput, tokenizer, vocab_size: int, stop_token_ids=None):
        if not isinstance(spec, StructuredOutput):
            raise TypeError(f"`spec` must be a StructuredOutput, got {type(spec).__name__}")
        xgr = import_xgrammar()
        if stop_token_ids is None and tokenizer.eos_token_id is not None:
            stop_token_ids = [tokenizer.eos_token_id]
        stop_token_ids = list(stop_token_ids) if stop_token_ids else None  # None: xgrammar takes the tokenizer's
        self.vocab_size = grammar_vocab_size(tokenizer, vocab_size, stop_token_ids or ())
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids)
        self.compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(parse_grammar(spec))
        self.stop_token_ids = list(info.stop_token_ids)
        self.matchers: list = []  # one per batch row, made by the first call
        self.prompt_len = 0
        self.num_calls = 0  # call i sees the prompt plus i generated tokens

    def __call__(
        self,
        input_ids: torch.LongTensor,  # [batch_size, seq_len]: the prompt plus the tokens generated so far
        scores: torch.FloatTensor,  # [batch_size, vocab_size]
    ) -> torch.FloatTensor:  # [batch_size, vocab_size]: a masked copy
        xgr = import_xgrammar()
        if not self.matchers:
            self.matchers = [xgr.GrammarMatcher(self.compiled) for _ in range(input_ids.shape[0])]
            self.prompt_len = input_ids.shape[1]
        if input_ids.shape[0] != len(self.matchers) or input_ids.shape[1] != self.prompt_len + self.num_calls:
            raise ValueError(
                f"GrammarLogitsProcessor serves one generate() call of a fixed batch: got input_ids of shape "
                f"{tuple(input_ids.shape)} at call {self.num_calls} after a prompt of {self.prompt_len} tokens for "
                f"{len(self.matchers)} rows; make a new processor per call (beam search is not supported)"
            )
        bitmask = xgr.allocate_token_bitmask(len(self.matchers), self.vocab_size)  # all allowed
        last = input_ids[:, -1].tolist() if self.num_calls else None
        ended = []
        for row, matcher in enumerate(self.matchers):
            if last is not None and not matcher.is_terminated() and not matcher.accept_token(last[row]):
                raise RuntimeError(f"bug in hf_paged: row {row}'s token {last[row]} breaks its grammar")
            if matcher.is_terminated():
                ended.append(row)
            else:
                matcher.fill_next_token_bitmask(bitmask, row)
        self.num_calls += 1
        scores = scores.clone()  # transformers' processors return new scores
        apply_bitmask(scores, bitmask, self.vocab_size, None)
        if ended:  # a row that has ended gets EOS only (transformers pads it; its scores must stay finite)
            rows = torch.tensor(ended, device=scores.device)
            scores[rows] = float("-inf")
            scores[rows.unsqueeze(1), torch.tensor(self.stop_token_ids, device=scores.device)] = 0.0
        return scores
