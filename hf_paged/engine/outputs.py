"""What the engine returns: detokenised text with stop strings, RequestOutput snapshots and stream deltas."""

from dataclasses import dataclass

from hf_paged.engine.request import CompletionOutput, Request, RequestOutput, Sequence


@dataclass
class StreamDelta:
    """What one step added to a streamed request."""

    text: str  # new text ("" without a tokenizer)
    token_ids: list[int]  # new token ids
    finish_reason: str | None  # set on the last delta


class Detokenizer:
    """Text of each sequence's output and stop-string matching (needs a tokenizer; a no-op without one).

    Args:
        tokenizer: the engine's tokenizer, or None.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, request: Request, seq: Sequence) -> str | None:
        """Refresh ``seq.text`` after new tokens; returns the stop string found in the new text, if any.

        A stop string is looked for once ``min_tokens`` tokens are out; the text is cut before it (or after
        it with ``include_stop_str_in_output``). The caller ends the sequence.
        """
        if self.tokenizer is None:
            return None
        params = request.params
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=params.skip_special_tokens)
        found = None
        if params.stop and seq.finish_reason in (None, "length") and len(seq.output_token_ids) >= params.min_tokens:
            # Only the new tail can hold a new match.
            search_from = max(0, len(seq.text) - max(len(s) for s in params.stop))
            for stop in params.stop:
                at = text.find(stop, search_from)
                if at >= 0:
                    text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                    found = stop
                    break
        seq.text = text
        return found

    def decode(self, request: Request, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=request.params.skip_special_tokens)


def request_output(request: Request, with_text: bool) -> RequestOutput:
    """A snapshot of what ``request`` has produced (beam search: its best finished hypotheses once done)."""
    seqs = request.finished_seqs if request.is_beam_search and request.finished_seqs else request.seqs
    outputs = [
        CompletionOutput(
            index=i,
            token_ids=list(seq.output_token_ids),
            text=seq.text if with_text else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
        )
        for i, seq in enumerate(seqs)
    ]
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outputs,
        finished=request.is_finished,
        metrics=request.metrics,
        num_cached_tokens=request.num_cached_tokens,
    )
