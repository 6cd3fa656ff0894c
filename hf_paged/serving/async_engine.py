"""AsyncEngine: one ContinuousBatcher serving many asyncio callers from its own engine thread.

    engine = AsyncEngine(lambda: ContinuousBatcher(model, tokenizer))   # built on the engine thread
    async for delta in engine.stream("Hello", SamplingParams(max_new_tokens=64)):
        print(delta.text, end="")
    output = await engine.generate(prompt, params)                       # a RequestOutput
    await engine.shutdown()                                              # or: async with AsyncEngine(...) as engine

Threads. The engine thread is the only one that touches the batcher after it is built (so CUDA graphs and
compiled code stay on one thread; the batcher itself refuses a second thread). Callers hand it commands through
a queue under a condition variable, drained between steps; the thread sleeps on the condition while there is
no request to run. Each request's deltas go back to the event loop that submitted it with one
``loop.call_soon_threadsafe`` per loop per step, into that request's ``asyncio.Queue``.

Errors. A prompt or parameters the batcher would refuse raise ``ValueError``/``TypeError`` from ``stream()``
itself, in the caller's context (the prompt is tokenised and checked there); the few checks only the engine
thread can make reach that caller's first ``__anext__``. A step that raises (the batcher recovers from it) fails
the requests in flight with that error and the engine serves on. If the engine thread itself dies, every waiter
gets ``EngineDeadError`` and so does every later call.

Tensor parallelism (``tp_plan="auto"`` under torchrun): every rank must run the same requests in the same order
(hf_paged.engine.distributed). Rank 0 runs the AsyncEngine (and the server); before applying each batch of commands
its engine thread broadcasts them (adds, aborts, stop) through the ranks' host group, and every other rank runs
``follow(batcher)``, which applies the same batches to its own batcher and steps when rank 0 steps. While idle, rank
0 sends an empty batch every ``HEARTBEAT_S`` so the others' receive never times out.
"""

import asyncio
import collections
import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from hf_paged.engine.engine import ContinuousBatcher
from hf_paged.engine.metrics import EngineMetrics
from hf_paged.engine.outputs import StreamCursor, StreamDelta, request_output
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.request import Request, RequestOutput

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream", "ServingStats", "StreamingFront", "follow"]

HEARTBEAT_S = 60.0  # an idle tensor-parallel rank 0 broadcasts an empty batch this often


class EngineDeadError(RuntimeError):
    """The engine thread has stopped on an error; the AsyncEngine serves no more requests."""


@dataclass
class ServingStats:
    """A snapshot for monitoring, taken on the engine thread between steps."""

    metrics: EngineMetrics
    num_running: int  # requests holding blocks
    num_waiting: int  # requests queued in the scheduler (new, preempted or swapped)


@dataclass
class _Done:
    """The last item of a request's queue: its final output."""

    output: RequestOutput


@dataclass
class _Record:
    """One submitted request, from ``stream()`` until its last item is delivered."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival_time: float  # time.monotonic() at stream(): the request's metrics count the wait in the inbox
    request: Request | None = None  # the batcher's live request (engine thread only), once added
    cursors: dict[int, StreamCursor] = field(default_factory=dict)  # sequence index -> what was sent


class RequestStream:
    """The deltas of one request, as an async iterator; ``output`` holds the final RequestOutput once it ends.

    Leaving it early aborts the request and frees its blocks: a cancelled ``__anext__``, ``aclose()``, or the
    stream being dropped (``break`` out of ``async for``).
    """

    def __init__(self, engine: "AsyncEngine", record: _Record):
        self._engine = engine
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
        if isinstance(item, _Done):
            self.output = item.output
            raise StopAsyncIteration
        raise item

    def _merge_queued(self, delta: StreamDelta) -> StreamDelta:
        """``delta`` joined with the deltas of the same sequence already queued behind it.

        A consumer slower than the engine (an HTTP front writing one SSE event per delta, at saturation) then
        sends one event per pass instead of one per step: the events it writes per second stay what it can
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
            self._engine._abort_quietly(self.request_id)

    def __del__(self):
        try:
            self.abort()
        except Exception:  # interpreter shutdown: nothing left to abort
            pass


class StreamingFront:
    """What every asyncio front of hf_paged shares (AsyncEngine, DataParallelEngine): ``generate`` on top of the
    front's ``stream``, and ``async with`` ending in its ``shutdown``."""

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """Run one request to the end; returns its RequestOutput (cancelling the call aborts the request)."""
        stream = self.stream(prompt, params, request_id)
        async for _ in stream:
            pass
        return stream.output

    def _checked(self, prompt, params: SamplingParams | None) -> tuple[SamplingParams, str | None, list[int]]:
        """What ``stream()`` does first, in the caller's context: (params, prompt text, token ids) of a request the
        engine accepts, or the batcher's ValueError/TypeError (and the front's own error if it stopped serving)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"`params` must be a SamplingParams, got {type(params).__name__}")
        self._check_serving()
        prompt_text, token_ids = self.inputs.tokenize(prompt)
        self.inputs.validate(token_ids, params)
        return params, prompt_text, token_ids

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


class AsyncEngine(StreamingFront):
    """A ContinuousBatcher owned by an engine thread, driven from asyncio.

    Args:
        engine: a ContinuousBatcher (only the engine thread uses it from now on), or a function that builds one
            (called on the engine thread; preferable on CUDA, so graphs are captured there). The constructor waits
            until it is built and raises what building it raised.

    Raises:
        TypeError: ``engine`` is neither.
    """

    def __init__(self, engine: ContinuousBatcher | Callable[[], ContinuousBatcher]):
        if not isinstance(engine, ContinuousBatcher) and not callable(engine):
            raise TypeError(
                f"`engine` must be a ContinuousBatcher or a function that builds one, got {type(engine).__name__}"
            )
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []  # commands for the engine thread, in order (under _cond)
        self._live: dict[str, _Record] = {}  # submitted, final item not delivered yet (under _cond)
        self._stopping = False
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._batcher: ContinuousBatcher | None = None
        self._startup_error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(engine, ready), name="hf_paged-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        self.inputs = self._batcher.inputs  # read-only: tokenises and checks prompts in the callers' threads
        self.tokenizer = self._batcher.tokenizer

    # ---- the callers' side -----------------------------------------------------------------------

    @property
    def batcher(self) -> ContinuousBatcher:
        """The batcher, for inspection only (``pool`` stats while idle); drive it through this class."""
        return self._batcher

    @property
    def pool(self):
        return self._batcher.pool

    @property
    def num_unfinished(self) -> int:
        """Requests submitted whose final output has not been delivered yet."""
        return len(self._live)

    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> RequestStream:
        """Submit a request; returns its deltas as an async iterator (call from a running event loop).

        Args:
            prompt: token ids, a string or chat messages (as ``ContinuousBatcher.add_request``).
            params: sampling parameters (default ``SamplingParams()``). With ``n > 1`` the deltas of the samples
                interleave (``StreamDelta.index``); beam search sends each hypothesis whole when the request ends.
            request_id: a new unique id (default: a counter).

        Raises:
            ValueError/TypeError: a prompt or parameters the batcher refuses (nothing is queued).
            EngineDeadError: the engine thread has died. RuntimeError: the engine is shutting down.
        """
        params, prompt_text, token_ids = self._checked(prompt, params)
        loop = asyncio.get_running_loop()
        request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        record = _Record(request_id, loop, asyncio.Queue(), time.monotonic())
        with self._cond:
            self._check_serving()
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use; pick another or let the engine pick")
            self._live[request_id] = record
            self._inbox.append(("add", record, token_ids, params, prompt_text))
            self._cond.notify()
        return RequestStream(self, record)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its stream ends with finish_reason "abort". Safe from any thread.

        Raises:
            ValueError: no such request in flight.
        """
        request_id = str(request_id)
        with self._cond:
            if request_id not in self._live:
                raise ValueError(f"unknown request id {request_id!r}: not submitted, or already finished")
            self._inbox.append(("abort", request_id))
            self._cond.notify()

    def _abort_quietly(self, request_id: str) -> None:
        with self._cond:
            if request_id in self._live and not self._stopping:
                self._inbox.append(("abort", request_id))
                self._cond.notify()

    async def stats(self) -> ServingStats:
        """Engine metrics and queue lengths, read on the engine thread between steps."""
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            self._check_serving()  # under the lock: nothing is queued behind "stop", which nobody would answer
            self._inbox.append(("stats", future))
            self._cond.notify()
        return await future

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop serving: wait up to ``drain_timeout_s`` for the requests in flight to end, abort the rest (their
        streams end with finish_reason "abort"), and stop the engine thread. New requests are refused at once."""
        with self._cond:
            already = self._stopping
            self._stopping = True
        if not already and drain_timeout_s > 0:
            deadline = asyncio.get_running_loop().time() + drain_timeout_s
            while self._live and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
        with self._cond:
            self._inbox.append(("stop",))
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)

    def _check_serving(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine thread died: {self._dead!r}") from self._dead
        if self._stopping:
            raise RuntimeError("the AsyncEngine is shutting down: it accepts no new requests")

    # ---- the engine thread -----------------------------------------------------------------------

    def _main(self, engine, ready: threading.Event) -> None:
        try:
            self._batcher = engine if isinstance(engine, ContinuousBatcher) else engine()
            if not isinstance(self._batcher, ContinuousBatcher):
                raise TypeError(f"the `engine` function must return a ContinuousBatcher, got "
                                f"{type(self._batcher).__name__}")  # fmt: skip
            if self._batcher._sync.rank != 0:
                raise ValueError(f"under tensor parallelism only rank 0 runs an AsyncEngine (this is rank "
                                 f"{self._batcher._sync.rank}); the other ranks call follow(batcher)")  # fmt: skip
        except BaseException as err:
            self._startup_error = err
            return
        finally:
            ready.set()
        try:
            self._serve(self._batcher)
        except BaseException as err:  # a bug, or the process going down: nobody may wait forever
            self._die(err)

    def _serve(self, batcher: ContinuousBatcher) -> None:
        """Apply the callers' commands, run a step, send its deltas; sleep while there is nothing to run."""
        sync = batcher._sync
        while True:
            with self._cond:
                while not self._inbox and not batcher.has_unfinished_requests():
                    if not self._cond.wait(timeout=HEARTBEAT_S if sync.enabled else None):
                        break  # idle under tensor parallelism: an empty batch keeps the followers listening
                commands, self._inbox = self._inbox, []
            if sync.enabled:  # the other ranks apply the same batch, then step when this one steps
                sync.broadcast_object([_add_for_followers(c) if c[0] == "add" else c for c in commands
                                       if c[0] != "stats"])  # fmt: skip
            for command in commands:
                if command[0] == "stop":
                    self._stop(batcher)
                    return
                self._apply(batcher, command)
            if not batcher.has_unfinished_requests():
                continue
            try:
                requests = batcher.step_requests()
            except Exception as err:  # the batcher has recovered; its requests in flight fail with the error
                self._fail_all(batcher, err)
                continue
            self._publish(requests)

    def _apply(self, batcher: ContinuousBatcher, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, record, token_ids, params, prompt_text = command
            try:
                batcher.add_request(token_ids, params, request_id=record.request_id)
            except Exception as err:  # e.g. an id the batcher still holds: this caller's error only
                self._finish(record, err)
                return
            record.request = batcher.requests[record.request_id]
            record.request.prompt = prompt_text
            record.request.metrics.arrival_time = record.arrival_time
        elif kind == "abort":
            record = self._live.get(command[1])
            if record is not None and record.request is not None and not record.request.is_finished:
                batcher.abort(record.request_id)  # reported by the next step
        elif kind == "stats":
            future = command[1]
            scheduler = batcher.scheduler
            stats = ServingStats(batcher.metrics(), len(scheduler.running), len(scheduler.waiting))
            future.get_loop().call_soon_threadsafe(_set_result, future, stats)
        else:
            raise RuntimeError(f"bug in hf_paged: unknown AsyncEngine command {kind!r}")

    def _publish(self, requests: list[Request]) -> None:
        """Queue each progressed request's deltas (and final output) to its event loop: one call per loop."""
        batches: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        finished = []
        for progressed in requests:
            record = self._live.get(progressed.request_id)
            if record is None or record.request is None:
                continue  # failed or stopped meanwhile
            request = record.request
            items = batches[record.loop]  # [(queue, item)]
            items += [(record.queue, d) for d in request_deltas(request, record.cursors, self.tokenizer is not None)]
            if request.is_finished:
                items.append((record.queue, _Done(request_output(request, self.tokenizer is not None))))
                finished.append(record.request_id)
        if finished:
            with self._cond:
                for request_id in finished:
                    self._live.pop(request_id, None)
        for loop, items in batches.items():
            if items and not _send(loop, items):  # the callers' loop is closed: nobody reads these requests
                with self._cond:  # aborted by the next batch of commands (which the followers get too)
                    for record in list(self._live.values()):
                        if record.loop is loop and record.request is not None and not record.request.is_finished:
                            self._inbox.append(("abort", record.request_id))

    def _finish(self, record: _Record, item) -> None:
        with self._cond:
            self._live.pop(record.request_id, None)
        _send(record.loop, [(record.queue, item)])

    def _fail_all(self, batcher: ContinuousBatcher, err: BaseException) -> None:
        for record in list(self._live.values()):
            if record.request is not None:
                if not record.request.is_finished:
                    batcher.abort(record.request_id)
                self._finish(record, err)

    def _stop(self, batcher: ContinuousBatcher) -> None:
        """Abort what is in flight, send the aborted requests' last deltas, and end the thread."""
        with self._cond:
            commands, self._inbox = self._inbox, []
        for command in commands:
            if command[0] == "add":  # queued before shutdown() but never started
                self._finish(command[1], RuntimeError("the AsyncEngine shut down before the request started"))
            elif command[0] == "stats":
                stopped = RuntimeError("the AsyncEngine shut down")
                command[1].get_loop().call_soon_threadsafe(_set_exception, command[1], stopped)
        for record in list(self._live.values()):
            if record.request is not None and not record.request.is_finished:
                batcher.abort(record.request_id)
        while batcher.has_unfinished_requests():
            try:
                self._publish(batcher.step_requests())
            except Exception as err:
                self._fail_all(batcher, err)
                break
        for record in list(self._live.values()):  # nothing should be left; never leave a waiter behind
            self._finish(record, RuntimeError("the AsyncEngine shut down"))

    def _die(self, err: BaseException) -> None:
        with self._cond:
            self._dead = err
            records, self._live = list(self._live.values()), {}
            commands, self._inbox = self._inbox, []
        for record in records:
            dead = EngineDeadError(f"the engine thread died: {err!r}")
            dead.__cause__ = err
            _send(record.loop, [(record.queue, dead)])
        for command in commands:  # stats() callers waiting for an answer
            if command[0] == "stats":
                dead = EngineDeadError(f"the engine thread died: {err!r}")
                command[1].get_loop().call_soon_threadsafe(_set_exception, command[1], dead)


def _add_for_followers(command: tuple) -> tuple:
    """An "add" command as the other ranks need it: no caller's record, only what the batcher takes."""
    _, record, token_ids, params, prompt_text = command
    return ("add", record.request_id, token_ids, params)


def follow(batcher: ContinuousBatcher) -> None:
    """Tensor parallelism, every rank but 0: mirror rank 0's AsyncEngine until it shuts down.

    Receives each batch of commands rank 0's engine thread broadcasts, applies it to ``batcher`` as rank 0 does
    (adds, aborts; a request rank 0 refused is refused here the same way), and runs a step whenever requests are
    unfinished, which is exactly when rank 0 steps: the ranks hold the same requests, and the engine's lock-step
    checks and token broadcast keep them identical. A failed step aborts every request in flight, as rank 0's
    engine fails them. Returns after rank 0's shutdown, once the aborted requests have drained.

    Raises:
        ValueError: not under tensor parallelism, or called on rank 0 (which runs the AsyncEngine).
    """
    sync = batcher._sync
    if not sync.enabled or sync.rank == 0:
        raise ValueError("follow() runs on the tensor-parallel ranks other than 0 (torchrun, tp_plan='auto'); "
                         f"this process is rank {sync.rank} of a {'tensor-parallel' if sync.enabled else 'single'} "
                         "engine")  # fmt: skip

    def abort_all() -> None:
        for request_id, request in list(batcher.requests.items()):
            if not request.is_finished:
                batcher.abort(request_id)

    while True:
        for command in sync.broadcast_object():
            if command[0] == "add":
                try:
                    batcher.add_request(command[2], command[3], request_id=command[1])
                except Exception:  # rank 0's batcher refused it too, and failed its caller
                    pass
            elif command[0] == "abort":
                request = batcher.requests.get(command[1])
                if request is not None and not request.is_finished:
                    batcher.abort(command[1])
            elif command[0] == "stop":
                abort_all()
                while batcher.has_unfinished_requests():
                    try:
                        batcher.step_requests()
                    except Exception:
                        break
                return
        if batcher.has_unfinished_requests():
            try:
                batcher.step_requests()
            except Exception:  # rank 0's step failed too: it fails (aborts) every request in flight
                abort_all()


def request_deltas(request: Request, cursors: dict[int, StreamCursor], detokenize: bool) -> list[StreamDelta]:
    """What a stream of ``request`` sends after a step: each sequence's new tokens and text since ``cursors``
    (sequence index -> StreamCursor, filled in here). Beams change every step, so beam search sends each hypothesis
    whole once the request has ended, and nothing before. Shared by AsyncEngine and the data-parallel replicas.
    """
    if request.is_beam_search:
        if not request.is_finished:
            return []
        return [_whole(c, request) for c in request_output(request, detokenize).outputs]
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


def _whole(completion, request: Request) -> StreamDelta:
    """A finished beam hypothesis as one delta."""
    return StreamDelta(
        text=completion.text or "",
        token_ids=completion.token_ids,
        finish_reason=completion.finish_reason,
        index=completion.index,
        stop_reason=completion.stop_reason,
    )


def _send(loop: asyncio.AbstractEventLoop, items: list) -> bool:
    """Put ``(queue, item)`` pairs on their queues, on ``loop``'s thread; False if the loop is closed."""
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the loop is closed: nobody is there to read
        return False
    return True


def _deliver(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)
