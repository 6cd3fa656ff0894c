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
        it with ``include_stop_str_in_output``). New tokens are checked one at a time (there is one, unless a
        failed step left some unchecked), and tokens after the one that completes a stop string are dropped, so
        the output is what an uninterrupted run gives. The caller ends the sequence.
        """
        if self.tokenizer is None:
            return None
        params = request.params
        out = seq.output_token_ids
        ends = [len(out)]
        if params.stop and seq.finish_reason in (None, "length"):
            ends = range(max(seq.num_detokenized + 1, params.min_tokens, 1), len(out) + 1) or ends
        found = None
        prev_len = len(seq.text)
        for end in ends:
            text = self.tokenizer.decode(out[:end], skip_special_tokens=params.skip_special_tokens)
            if params.stop and seq.finish_reason in (None, "length") and end >= params.min_tokens:
                search_from = max(0, prev_len - max(len(s) for s in params.stop))  # only the new tail can match
                for stop in params.stop:
                    at = text.find(stop, search_from)
                    if at >= 0:
                        text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                        found = stop
                        break
            if found is not None:
                if end < len(out):  # tokens sampled after the stop string (a check a failed step skipped)
                    start = seq.num_prompt_tokens + end
                    del seq.token_ids[start : len(seq.token_ids) - seq.num_inflight]
                    del seq.logprobs[end:]
                break
            prev_len = len(text)
        seq.text = text
        seq.num_detokenized = len(seq.output_token_ids)
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
