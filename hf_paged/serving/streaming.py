"""What every asyncio front of hf_paged shares: a request's stream of deltas, and the front's common surface.

A front (``AsyncEngine`` for one engine thread, ``DataParallelEngine`` for replica processes) hands each request an
``asyncio.Queue``: ``StreamDelta`` items while it runs, then one last item, a ``FinalOutput`` or an exception.
``RequestStream`` reads that queue as an async iterator; ``request_deltas`` makes a step's deltas of one request
(on the engine thread or in a replica process, wherever the text is detokenised).
"""

import abc
import collections
from dataclasses import dataclass

from hf_paged.engine.outputs import StreamCursor, StreamDelta, request_output
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.request import Request, RequestOutput
from hf_paged.engine.structured import parse_grammar

__all__ = ["EngineDeadError", "FinalOutput", "RequestStream", "StreamingFront", "request_deltas"]


class EngineDeadError(RuntimeError):
    """The engine has stopped on an error (its thread died, or every replica process did); it serves no more."""


@dataclass
class FinalOutput:
    """The last item of a request's queue: its final output."""

    output: RequestOutput


class RequestStream:
    """The deltas of one request, as an async iterator; ``output`` holds the final RequestOutput once it ends.

    Leaving it early aborts the request and frees its blocks: a cancelled ``__anext__``, ``aclose()``, or the
    stream being dropped (``break`` out of ``async for``).

    Args:
        front: the front that runs the request (its ``abort_quietly`` is called when the consumer leaves).
        record: the front's record of the request: ``request_id`` and ``queue`` (the asyncio.Queue it fills).
    """

    def __init__(self, front: "StreamingFront", record):
        self._front = front
        self._record = record
        self.request_id = record.request_id
        self.output: RequestOutput | None = None
        self._done = False
        self._held: collections.deque = collections.deque()  # items taken from the queue while merging, not returned

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if self._done:
            raise StopAsyncIteration
        if self._held:  # what the last merge took from the queue (deltas already merged), in order
            item = self._held.popleft()
            if isinstance(item, StreamDelta):
                return item
        else:
            try:
                item = await self._record.queue.get()
            except BaseException:  # cancelled (a client disconnect, a timeout): the request is not needed anymore
                self.abort()
                raise
            if isinstance(item, StreamDelta):
                return self._merge_queued(item)
        self._done = True
        if isinstance(item, FinalOutput):
            self.output = item.output
            raise StopAsyncIteration
        raise item

    def _merge_queued(self, delta: StreamDelta) -> StreamDelta:
        """``delta`` joined with the deltas of the same sequence already queued behind it.

        A consumer slower than the engine (an HTTP front writing one SSE event per delta, at saturation) then
        sends one event per pass rather than one per step: the events it writes per second stay what it can
        afford while the tokens keep the engine's pace (vLLM's output collector merges the same way). The other
        samples' (``n > 1``) queued deltas are joined per sample and returned next, each sample in order.
        """
        queue = self._record.queue
        if queue.empty():
            return delta
        parts = {delta.index: [delta]}
        while not queue.empty():
            item = queue.get_nowait()
            if not isinstance(item, StreamDelta):
                self._held.append(item)
                break
            parts.setdefault(item.index, []).append(item)
        merged = [_joined(p) for p in parts.values()]
        self._held.extendleft(reversed(merged[1:]))  # before the item that ended the run, if any
        return merged[0]

    async def aclose(self) -> None:
        """Abort the request if it has not ended."""
        self.abort()

    def abort(self) -> None:
        """Abort the request if it has not ended (the stream then ends); safe from any thread."""
        if not self._done:
            self._done = True
            self._front.abort_quietly(self.request_id)

    def __del__(self):
        try:
            self.abort()
        except Exception:  # interpreter shutdown: nothing left to abort
            pass


class StreamingFront(abc.ABC):
    """What every asyncio front shares: ``generate`` on top of the front's ``stream``, the caller-side checks of a
    request, and ``async with`` ending in the front's ``shutdown``.

    A subclass provides ``inputs`` (an InputProcessor), ``stream``, ``abort_quietly``, ``check_serving`` and
    ``shutdown``.
    """

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """Run one request to the end; returns its RequestOutput (cancelling the call aborts the request)."""
        stream = self.stream(prompt, params, request_id)
        async for _ in stream:
            pass
        return stream.output

    @abc.abstractmethod
    def abort_quietly(self, request_id: str) -> bool:
        """Abort a request if it is in flight (a RequestStream whose consumer left); False if it is not."""

    @abc.abstractmethod
    def check_serving(self) -> None:
        """Raise EngineDeadError or RuntimeError if the front accepts no new requests."""

    def checked_request(self, prompt, params: SamplingParams | None) -> tuple[SamplingParams, str | None, list[int]]:
        """What ``stream()`` does first, in the caller's context: (params, prompt text, token ids) of a request the
        engine accepts, or the batcher's ValueError/TypeError (and the front's own error if it stopped serving)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"`params` must be a SamplingParams, got {type(params).__name__}")
        self.check_serving()
        prompt_text, token_ids = self.inputs.tokenize(prompt)
        self.inputs.validate(token_ids, params)
        if params.structured_output is not None:  # an invalid schema, regex or grammar fails here, not in the stream
            if self.inputs.tokenizer is None:
                raise ValueError("`structured_output` needs an engine with a tokenizer: ContinuousBatcher(model, "
                                 "tokenizer=...)")  # fmt: skip
            parse_grammar(params.structured_output)
        return params, prompt_text, token_ids

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


def request_deltas(request: Request, cursors: dict[int, StreamCursor], detokenize: bool) -> list[StreamDelta]:
    """What a stream of ``request`` sends after a step: each sequence's new tokens and text since ``cursors``
    (sequence index -> StreamCursor, filled in here). Beams change every step, so beam search sends each hypothesis
    whole once the request has ended, and nothing before. Shared by AsyncEngine and the data-parallel replicas.
    """
    if request.is_beam_search:
        if not request.is_finished:
            return []
        return [_whole(c) for c in request_output(request, detokenize).outputs]
    deltas = []
    for idx, seq in enumerate(request.seqs):
        cursor = cursors.get(idx)
        if cursor is None:
            cursor = cursors[idx] = StreamCursor(idx)
        delta = cursor.next_delta(request, seq)
        if delta is not None:
            deltas.append(delta)
    return deltas


def _joined(deltas: list[StreamDelta]) -> StreamDelta:
    """Consecutive deltas of one sequence as one."""
    if len(deltas) == 1:
        return deltas[0]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    last = deltas[-1]
    return StreamDelta(
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        finish_reason=last.finish_reason,
        index=deltas[0].index,
        logprobs=logprobs,
        stop_reason=last.stop_reason,
    )


def _whole(completion) -> StreamDelta:
    """A finished beam hypothesis as one delta."""
    return StreamDelta(
        text=completion.text or "",
        token_ids=completion.token_ids,
        finish_reason=completion.finish_reason,
        index=completion.index,
        stop_reason=completion.stop_reason,
    )
