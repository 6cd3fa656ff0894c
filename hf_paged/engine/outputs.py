"""What the engine returns: incremental detokenisation with stop strings, RequestOutput snapshots, stream deltas.

Text is made one token at a time (``Detokenizer``): with a Rust-backed tokenizer through ``tokenizers``'
``DecodeStream`` (~2 µs a token, whatever the output's length), else with vLLM's prefix/read offsets over
``tokenizer.decode`` (a window of a few tokens). Either way a sequence's text only grows by whole characters:
bytes of a character split over tokens wait until the character is complete, so ``seq.text`` never ends in a
partial UTF-8 character while the sequence runs. Streams send that text minus a hold-back of
``max(len(s) for s in stop) - 1`` characters while the sequence runs (``StreamCursor``), so the first characters
of a stop string never reach the client before the match removes them.
"""

import copy
from dataclasses import dataclass

from hf_paged.engine.request import CompletionOutput, Request, RequestOutput, Sequence

_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode puts for bytes that are not (yet) a whole character
_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error when the text is not monotonic
_CONTEXT_TOKENS = 4  # tokens of sent text decoded in front of unsent ones (_flush, RustStream.as_offsets)


@dataclass
class StreamDelta:
    """What one step added to one streamed sequence."""

    text: str  # new text ("" without a tokenizer); held back near a possible stop string until the end
    token_ids: list[int]  # new token ids (never held back)
    finish_reason: str | None  # set on the last delta
    index: int = 0  # which of the request's ``n`` sequences
    logprobs: list[dict[int, float]] | None = None  # [len(token_ids)] {token_id: logprob}, when the request asked
    stop_reason: int | str | None = None  # set on the last delta: the stop token id or stop string that ended it


class StreamCursor:
    """How much of one sequence a stream has sent; ``next_delta`` says what to send next.

    The one place stream deltas are made (``ContinuousBatcher.stream`` and ``AsyncEngine`` use it). While the
    sequence runs, text within ``max(len(s) for s in stop) - 1`` characters of the end is held back: a stop
    string completed by a later token starts no earlier than that, and is cut from the text before it is sent.
    Once the sequence has ended, everything left goes out with the finish reason.

    Args:
        index: the sequence's index in its request (``StreamDelta.index``).
    """

    def __init__(self, index: int = 0):
        self.index = index
        self.num_tokens = 0  # output tokens sent
        self.num_chars = 0  # characters of seq.text sent
        self.done = False  # the delta with the finish reason was sent

    def next_delta(self, request: Request, seq: Sequence) -> StreamDelta | None:
        """The tokens and text ``seq`` gained since the last delta; None when there is nothing new to send."""
        if self.done:
            return None
        finished = seq.is_finished  # read first: a sequence that has ended has all its tokens and text
        # The new known tokens, sliced from token_ids directly (output_token_ids copies the whole output).
        tokens = seq.token_ids[seq.num_prompt_tokens + self.num_tokens : len(seq.token_ids) - seq.num_inflight]
        end = len(seq.text)
        if not finished and request.params.stop:
            end -= max(len(s) for s in request.params.stop) - 1
        text = seq.text[self.num_chars : end] if end > self.num_chars else ""
        if not (tokens or text or finished):
            return None
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = seq.logprobs[self.num_tokens : self.num_tokens + len(tokens)]
        self.num_tokens += len(tokens)
        self.num_chars += len(text)
        self.done = finished
        return StreamDelta(
            text=text,
            token_ids=tokens,
            finish_reason=seq.finish_reason if finished else None,
            index=self.index,
            logprobs=logprobs,
            stop_reason=seq.stop_reason if finished else None,
        )


class Detokenizer:
    """Text of each sequence's output, made incrementally, and stop-string matching (a no-op without a tokenizer).

    Each sequence keeps its own decoder state (``seq.detok_state``, a ``TextStream``; copied when the sequence
    forks), which has read exactly ``seq.num_detokenized`` output tokens. Tokenizers whose ``decode`` is their
    Rust backend's (a fast tokenizer without ``clean_up_tokenization_spaces``) use ``DecodeStream``; others (a
    slow tokenizer, one that cleans up spaces, a wrapper) use prefix/read offsets over ``tokenizer.decode``.
    Either way the text of a finished sequence equals ``tokenizer.decode(output_token_ids)`` when no stop string
    cut it.

    Args:
        tokenizer: the engine's tokenizer, or None.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = _rust_backend(tokenizer)  # tokenizers.Tokenizer for DecodeStream, or None: offsets

    def update(self, request: Request, seq: Sequence) -> str | None:
        """Extend ``seq.text`` by its new tokens; returns the stop string they completed, if any.

        A stop string is looked for once ``min_tokens`` tokens are out, and only where it ends in the text a token
        added (vLLM's rule). The text is cut before it (or after it with ``include_stop_str_in_output``). New tokens
        are read one at a time (there is one, unless a failed step left some unread), and tokens after the one that
        completes a stop string are dropped, so the output is what an uninterrupted run gives. When the sequence has
        ended, the tokens still waiting give the text of their whole characters; bytes of a character the
        sequence never finished (``max_tokens`` cut it) are dropped, not sent as U+FFFD, as vLLM does, so the
        streamed and the final text agree. The caller ends the sequence.
        """
        if self.tokenizer is None:
            return None
        params = request.params
        state = self._state(seq, params.skip_special_tokens)
        check = bool(params.stop) and seq.finish_reason in (None, "length")
        max_stop = max(len(s) for s in params.stop) if check else 0
        # Output token i is token_ids[base + i]; no slice of the whole output: this runs for every token.
        token_ids, base = seq.token_ids, seq.num_prompt_tokens
        num_out = len(token_ids) - seq.num_inflight - base
        text = seq.text
        found = None
        for end in range(seq.num_detokenized + 1, num_out + 1):
            prev_len = len(text)
            token_id = token_ids[base + end - 1]
            try:
                chunk = state.step(token_id)
            except Exception as err:
                if not (isinstance(state.stream, RustStream) and _INVALID_PREFIX in str(err)):
                    raise
                read = base + end - 1 - state.num_pending
                state.stream = state.stream.as_offsets(token_ids[base:read], token_ids[read : base + end - 1])
                chunk = state.step(token_id)
            if chunk is None:
                continue
            text += chunk
            if check and end >= params.min_tokens:
                search_from = max(0, prev_len - max_stop + 1)  # a match must end in the new text
                for stop in params.stop:
                    at = text.find(stop, search_from)
                    if at >= 0:
                        text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                        found = stop
                        break
                if found is not None:
                    if end < num_out:  # tokens sampled after the stop string (a check a failed step skipped)
                        del token_ids[base + end : len(token_ids) - seq.num_inflight]
                        del seq.logprobs[end:]
                    break
        if found is None and seq.is_finished and state.num_pending:
            flushed = self._flush(seq.output_token_ids, state.num_pending, params.skip_special_tokens)
            text += flushed.rstrip(_REPLACEMENT)
            state.num_pending = 0
        seq.text, seq.num_detokenized = text, len(token_ids) - seq.num_inflight - base
        return found

    def decode(self, request: Request, token_ids: list[int]) -> str | None:
        """One-shot text of ``token_ids`` (beam-search hypotheses, made once they end)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=request.params.skip_special_tokens)

    def _state(self, seq: Sequence, skip_special_tokens: bool) -> "TextStream":
        """``seq``'s decoder, rebuilt from its checked tokens if missing or out of step (a failed update)."""
        state = seq.detok_state
        if state is None or state.num_tokens != seq.num_detokenized:
            if self.backend is not None:
                state = TextStream(RustStream(self.backend, skip_special_tokens))
            else:
                tokenizer = self.tokenizer
                state = TextStream(
                    OffsetStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
                )
            base = seq.num_prompt_tokens
            for token_id in seq.token_ids[base : base + seq.num_detokenized]:  # their text is in seq.text already
                state.step(token_id)
            seq.detok_state = state
        return state

    def _flush(self, out: list[int], num_pending: int, skip_special_tokens: bool) -> str:
        """The text of the last ``num_pending`` tokens, whose bytes never made a whole character, as a full decode
        gives it (decoded behind a few tokens of context, as the stream would)."""
        first = len(out) - num_pending
        context = out[max(0, first - _CONTEXT_TOKENS) : first]
        head = self.tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        full = self.tokenizer.decode(context + out[first:], skip_special_tokens=skip_special_tokens)
        return full[len(head) :]


class TextStream:
    """One sequence's incremental decoder: how many tokens it has read, and how many of them await text."""

    def __init__(self, stream):
        self.stream = stream  # RustStream or OffsetStream
        self.num_tokens = 0  # tokens read (equals seq.num_detokenized between updates)
        self.num_pending = 0  # trailing tokens read whose text is not out yet (a partial character)

    def step(self, token_id: int) -> str | None:
        """Read one token; the new text, or None while its bytes do not finish a character."""
        chunk = self.stream.step(token_id)
        self.num_tokens += 1
        self.num_pending = self.num_pending + 1 if chunk is None else 0
        return chunk

    def fork(self) -> "TextStream":
        """An independent copy (a sequence forking into ``n`` samples)."""
        child = TextStream(self.stream.fork())
        child.num_tokens, child.num_pending = self.num_tokens, self.num_pending
        return child


class RustStream:
    """``tokenizers.decoders.DecodeStream`` over the tokenizer's Rust backend."""

    def __init__(self, backend, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self.decoder.step(self.backend, token_id)

    def fork(self) -> "RustStream":
        child = copy.copy(self)
        child.decoder = copy.deepcopy(self.decoder)
        return child

    def as_offsets(self, read: list[int], pending: list[int]) -> "OffsetStream":
        """The same position as an ``OffsetStream`` (text of ``read`` is out, ``pending`` awaits its text).

        DecodeStream refuses to go on when the text of its window stops being a prefix of the longer window's
        ("Invalid prefix encountered"): a byte-fallback decoder turns valid bytes it had decoded into U+FFFD once
        an invalid byte joins their run, so the full decode itself changes what it said (vllm-project/vllm#17448).
        The offsets route never fails there; its text then stays what was already sent.
        """
        backend, skip = self.backend, self.skip_special_tokens
        offsets = OffsetStream(lambda ids: backend.decode(ids, skip_special_tokens=skip))
        offsets.ids, offsets.read_offset = read[-_CONTEXT_TOKENS:] + pending, min(len(read), _CONTEXT_TOKENS)
        return offsets


class OffsetStream:
    """DecodeStream's algorithm on a ``decode(ids) -> str`` (vLLM's prefix and read offsets), for any tokenizer.

    ``ids[:read_offset]`` is the prefix: tokens whose text is out, decoded again only as context (a decoder
    may drop a leading space at the start of what it decodes). A token's text is the part of
    ``decode(ids)`` beyond ``decode(prefix)``, sent once it grows and does not end in U+FFFD.
    """

    def __init__(self, decode):
        self.decode = decode
        self.ids: list[int] = []  # the prefix, then tokens whose text is not out yet
        self.read_offset = 0

    def step(self, token_id: int) -> str | None:
        ids = self.ids + [token_id]  # state changes only once both decodes succeeded
        prefix = self.decode(ids[: self.read_offset])
        text = self.decode(ids)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            self.ids = ids
            return None
        self.ids, self.read_offset = ids[self.read_offset :], len(ids) - self.read_offset
        return text[len(prefix) :]

    def fork(self) -> "OffsetStream":
        child = copy.copy(self)
        child.ids = list(self.ids)
        return child


def _rust_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` whose ``decode`` is exactly ``tokenizer.decode``'s, or None.

    That is a transformers fast tokenizer that does not override decoding and does not clean up spaces after it
    (``clean_up_tokenization_spaces``, meant for WordPiece). Anything else takes the offsets route.
    """
    if tokenizer is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if type(tokenizer).decode is not PreTrainedTokenizerFast.decode:
        return None
    if type(tokenizer)._decode is not PreTrainedTokenizerFast._decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return getattr(tokenizer, "backend_tokenizer", None)


def request_output(request: Request, with_text: bool) -> RequestOutput:
    """A snapshot of what ``request`` has produced (beam search: its best finished hypotheses once done); prompt
    log-probs once every prompt token is scored."""
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
        prompt_logprobs=None if request.needs_prompt_logprobs else _copy(request.prompt_logprobs),
    )


def _copy(entries: list | None) -> list | None:
    return None if entries is None else list(entries)  # entries are complete: never changed again
