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

Tensor parallelism (``tp_plan="auto"`` under torchrun): rank 0 runs the AsyncEngine and sends each batch of
commands to the other ranks, which run ``follow(batcher)`` (hf_paged.serving.tensor_parallel).
"""

import asyncio
import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from hf_paged.engine.engine import ContinuousBatcher
from hf_paged.engine.outputs import StreamCursor, request_output
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.request import Request
from hf_paged.serving.stats import ServingStats
from hf_paged.serving.streaming import EngineDeadError, FinalOutput, RequestStream, StreamingFront, request_deltas
from hf_paged.serving.tensor_parallel import HEARTBEAT_S, broadcast_commands

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream", "ServingStats"]


@dataclass
class _Record:
    """One submitted request, from ``stream()`` until its last item is delivered."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival_time: float  # time.monotonic() at stream(): the request's metrics count the wait in the inbox
    request: Request | None = None  # the batcher's live request (engine thread only), once added
    cursors: dict[int, StreamCursor] = field(default_factory=dict)  # sequence index -> what was sent


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
    def is_running(self) -> bool:
        """Whether the engine thread is running (False once shut down, or dead)."""
        return self._thread.is_alive()

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
        params, prompt_text, token_ids = self.checked_request(prompt, params)
        loop = asyncio.get_running_loop()
        request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        record = _Record(request_id, loop, asyncio.Queue(), time.monotonic())
        with self._cond:
            self.check_serving()
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

    def abort_quietly(self, request_id: str) -> bool:
        """Abort a request if it is in flight (a RequestStream whose consumer left); False if it is not."""
        with self._cond:
            if request_id not in self._live or self._stopping:
                return False
            self._inbox.append(("abort", request_id))
            self._cond.notify()
        return True

    async def stats(self) -> ServingStats:
        """Engine metrics and queue lengths, read on the engine thread between steps."""
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            self.check_serving()  # under the lock: nothing is queued behind "stop", which nobody would answer
            self._inbox.append(("stats", future))
            self._cond.notify()
        return await future

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block, on the engine thread between steps (requests in flight keep their
        blocks; what they computed is not indexed again). Returns once it is done."""
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            self.check_serving()
            self._inbox.append(("reset_prefix_cache", future))
            self._cond.notify()
        await future

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

    def check_serving(self) -> None:
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
            if self._batcher.rank_sync.rank != 0:
                raise ValueError(f"under tensor parallelism only rank 0 runs an AsyncEngine (this is rank "
                                 f"{self._batcher.rank_sync.rank}); the other ranks call follow(batcher)")  # fmt: skip
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
        sync = batcher.rank_sync
        while True:
            with self._cond:
                while not self._inbox and not batcher.has_unfinished_requests():
                    if not self._cond.wait(timeout=HEARTBEAT_S if sync.enabled else None):
                        break  # idle under tensor parallelism: an empty batch keeps the followers listening
                commands, self._inbox = self._inbox, []
            if sync.enabled:  # the other ranks apply the same batch, then step when this one steps
                broadcast_commands(sync, commands)
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
        elif kind == "reset_prefix_cache":
            batcher.reset_prefix_cache()
            command[1].get_loop().call_soon_threadsafe(_set_result, command[1], None)
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
                items.append((record.queue, FinalOutput(request_output(request, self.tokenizer is not None))))
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
            elif command[0] in _ANSWERED:
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
        for command in commands:  # stats() and reset_prefix_cache() callers waiting for an answer
            if command[0] in _ANSWERED:
                dead = EngineDeadError(f"the engine thread died: {err!r}")
                command[1].get_loop().call_soon_threadsafe(_set_exception, command[1], dead)


_ANSWERED = ("stats", "reset_prefix_cache")  # commands whose caller awaits a future (the command's second item)


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
