"""DataParallelEngine: N replica processes, each a ContinuousBatcher on its own GPU, behind one asyncio front.

    engine = DataParallelEngine(functools.partial(build_batcher, "./my-model"), num_replicas=2, device="cuda")
    async for delta in engine.stream("Hello", SamplingParams(max_new_tokens=64)):   # as AsyncEngine.stream
        print(delta.text, end="")
    await engine.shutdown()

A model that fits one GPU gets N times the throughput on N GPUs without tensor parallelism: each replica runs its
own engine loop in its own process (no GIL shared with the front or the other replicas), and the front only
tokenises, routes and hands deltas on. It has the surface ``hf_paged.frontends.serve.create_app`` uses from
AsyncEngine (``tokenizer``, ``inputs``, ``num_unfinished``, ``stream``, ``abort``, ``stats``,
``reset_prefix_cache``, ``shutdown``).

Processes (hf_paged.serving.replica_handle). Replicas are started with the ``spawn`` method (CUDA cannot be used
in a forked child). ``factory`` is called in the replica and must be picklable: a module-level function or a
``functools.partial`` of one that loads the model itself, never a live model. With ``device="cuda"`` replica i
sees only the i-th visible GPU (``CUDA_VISIBLE_DEVICES`` is set in its environment before it starts), so
``factory`` puts the model on ``"cuda"``.

Messages. Each replica (hf_paged.serving.replica) has two one-way pipes. The front's writer thread sends it commands
(``add``, ``abort``, ``stats``, ``reset_prefix_cache``, ``stop``), which it applies between steps; it sends back one
message per step with every stream's deltas (made in the replica, where the text is detokenised, by ``request_deltas``
as AsyncEngine makes them) and the final RequestOutputs. The front's reader thread hands them to each stream's asyncio
queue with one ``loop.call_soon_threadsafe`` per message.

Routing (hf_paged.serving.routing): a new request goes to the live replica its prompt's leading blocks were sent to
before (that replica's prefix cache likely holds them), unless it is busier than the least-loaded replica by more
than a small slack; otherwise, and for a prompt never seen, to the live replica with the fewest requests in flight,
ties round-robin. Each front remembers only what it routed.

Several fronts (``hf-paged serve --api-server-count N``, hf_paged.frontends.api_servers). Built with
``num_fronts=N``, each replica gets N more pipe pairs, one per API-server process: ``front_handoff(f)`` packs front
f's ends (and what a front needs to know: the tokenizer, the limits), and ``DataParallelEngine.attach(handoff)``
in the API-server process serves them as this class serves its own pipes, without owning the processes: its
``shutdown`` detaches from the replicas (its requests in flight are aborted there) and leaves them running. Each
front sees only its own requests, so the replicas publish their loads in shared memory (``ReplicaLoads``) and
every front routes by the global count: requests each replica holds, plus its own still in the pipe.

Failures. A replica process that dies (its pipe closes) fails its requests in flight with ``ReplicaDeadError``
and the front serves on with the others; with none left, every call raises ``EngineDeadError`` (the server's
503). A replica whose step raises fails the requests in flight there with that error and serves on, as AsyncEngine
does. A replica exits by itself when the front process is gone (its command pipe closes).
"""

import asyncio
import itertools
import multiprocessing
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from hf_paged.engine.inputs import InputProcessor
from hf_paged.engine.outputs import StreamDelta
from hf_paged.engine.params import SamplingParams
from hf_paged.serving.replica import ReplicaLoads
from hf_paged.serving.replica_handle import (
    ReplicaHandle,
    put_all_outboxes,
    start_replica,
    stop_processes,
    visible_gpus,
    wait_ready,
)
from hf_paged.serving.routing import PrefixRouter
from hf_paged.serving.stats import DataParallelStats, sum_metrics
from hf_paged.serving.streaming import EngineDeadError, RequestStream, StreamingFront

__all__ = ["DataParallelEngine", "DataParallelStats", "FrontHandoff", "ReplicaDeadError"]

_DEVICES = ("cpu", "cuda")
_STOP_TIMEOUT_S = 30.0  # a replica gets this long to abort its requests and exit before it is terminated


class ReplicaDeadError(EngineDeadError):
    """A replica process died with requests in flight; the other replicas serve on."""


@dataclass
class _Stream:
    """One submitted request, from ``stream()`` until its last item is delivered (what RequestStream reads)."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    replica: ReplicaHandle


@dataclass
class FrontHandoff:
    """What an API-server process needs to serve the replicas through its own pipes (``DataParallelEngine.attach``);
    it pickles into a spawned process (the pipes' descriptors are passed along).

    ``pipes[r]`` is the (commands, results) pair of replica r for this front, whose index in every replica's list
    of pipes is ``pipe``. ``limits``: the tokenizer and the engine limits a front checks requests against.
    """

    pipe: int
    pipes: list[tuple[Connection, Connection]]
    pids: list[int]
    gpus: list[str | None]
    limits: dict
    loads: ReplicaLoads

    def close(self) -> None:
        """Close this process's copies of the pipes, once the API server's process has started with them."""
        for commands, results in self.pipes:
            commands.close()
            results.close()


class DataParallelEngine(StreamingFront):
    """Replica processes, each owning a ContinuousBatcher, driven from asyncio as one engine.

    Args:
        factory: a picklable function of no arguments that builds a ContinuousBatcher (with a tokenizer); called
            in each replica process.
        num_replicas: replica processes to start (>= 1).
        device: "cuda" gives replica i the i-th visible GPU alone; "cpu" leaves the devices as they are (meant
            for tests and demos: CPU replicas share the machine's cores).
        num_threads: torch intra-op threads of each replica (``torch.set_num_threads``); None = torch's default.
        num_fronts: pipe pairs for that many API-server processes besides this engine's own (``front_handoff``).

    The constructor starts every replica, waits until each has built its engine, and raises what building one
    raised (``ValueError``/``TypeError``/``OSError`` keep their type; other errors become ``RuntimeError``).

    Raises:
        ValueError: ``num_replicas`` below 1, ``device`` not in ("cpu", "cuda"), or more replicas than GPUs.
        TypeError: ``factory`` does not pickle (a lambda, a local function, a bound method of a live model).
    """

    def __init__(self, factory: Callable, num_replicas: int, device: str = "cuda", num_threads: int | None = None,
                 num_fronts: int = 0):  # fmt: skip
        if isinstance(num_fronts, bool) or not isinstance(num_fronts, int) or num_fronts < 0:
            raise ValueError(f"`num_fronts` must be an int >= 0, got {num_fronts!r}")
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"`num_replicas` must be an int >= 1, got {num_replicas!r}")
        if device not in _DEVICES:
            raise ValueError(f"`device` must be one of {list(_DEVICES)}, got {device!r}")
        try:
            pickle.dumps(factory)
        except Exception as err:
            raise TypeError(f"`factory` must pickle (replicas are spawned processes): a module-level function or a "
                            f"functools.partial of one, got {factory!r} ({err})") from None  # fmt: skip
        gpus = visible_gpus() if device == "cuda" else []
        if device == "cuda" and num_replicas > len(gpus):
            raise ValueError(f"{num_replicas} data-parallel replicas need {num_replicas} GPUs, but {len(gpus)} "
                             f"are visible ({gpus}); lower the number of replicas")  # fmt: skip
        self._init_front(pipe=0, loads=None)
        ctx = multiprocessing.get_context("spawn")
        if num_fronts:
            self._loads = ReplicaLoads.create(ctx, num_replicas, 1 + num_fronts)
        try:
            for idx in range(num_replicas):
                self._replicas.append(start_replica(ctx, idx, factory, gpus[idx] if gpus else None, num_threads,
                                                  1 + num_fronts, self._loads))  # fmt: skip
            infos = [wait_ready(replica) for replica in self._replicas]
        except BaseException:
            stop_processes([r.process for r in self._replicas], [], 0.0)
            raise
        # Every replica must accept what the front accepts: the smallest pool decides.
        self._limits = {"tokenizer": infos[0]["tokenizer"], "vocab_size": infos[0]["vocab_size"],
                        "max_model_len": infos[0]["max_model_len"], "num_blocks": min(i["num_blocks"] for i in infos),
                        "block_size": infos[0]["block_size"],
                        "max_num_seqs": min(i["max_num_seqs"] for i in infos)}  # fmt: skip
        self._serve_pipes([i["gpus"] for i in infos], self._limits)
        # A forgotten shutdown() must not leave processes behind (or hang the interpreter's exit joining them).
        self._finalizer = weakref.finalize(self, stop_processes, [r.process for r in self._replicas],
                                           [r.outbox for r in self._replicas], 5.0)  # fmt: skip

    @classmethod
    def attach(cls, handoff: FrontHandoff) -> "DataParallelEngine":
        """In an API-server process: serve the replicas another process started, through this front's pipes.

        The engine has the surface of one that started its replicas; ``shutdown`` detaches from them (aborting
        this front's requests in flight) instead of stopping them.
        """
        self = cls.__new__(cls)
        self._init_front(pipe=handoff.pipe, loads=handoff.loads)
        self._replicas = [ReplicaHandle(idx, None, commands, results, pid)
                          for idx, ((commands, results), pid) in enumerate(zip(handoff.pipes, handoff.pids,
                                                                                strict=True))]  # fmt: skip
        self._next = (handoff.pipe - 1) % len(self._replicas)  # the fronts break ties from different replicas
        self._limits = handoff.limits
        self._serve_pipes(handoff.gpus, handoff.limits)
        self._finalizer = weakref.finalize(self, put_all_outboxes, [r.outbox for r in self._replicas], ("detach",))
        return self

    def front_handoff(self, front_idx: int) -> FrontHandoff:
        """The pipes (and limits) of API-server ``front_idx`` (0-based, < ``num_fronts``), for its process.

        Raises:
            ValueError: ``front_idx`` out of range.
        """
        num_fronts = len(self._replicas[0].front_pipes)
        if not 0 <= front_idx < num_fronts:
            raise ValueError(f"`front_idx` must be in [0, {num_fronts}) (this engine was built with num_fronts="
                             f"{num_fronts}), got {front_idx!r}")  # fmt: skip
        return FrontHandoff(1 + front_idx, [r.front_pipes[front_idx] for r in self._replicas],
                            [r.pid for r in self._replicas], self.replica_gpus, self._limits, self._loads)  # fmt: skip

    def _init_front(self, pipe: int, loads: ReplicaLoads | None) -> None:
        self._lock = threading.RLock()  # reentrant: a RequestStream dropped (GC) inside a locked block aborts
        self._ids = itertools.count()
        self._tokens = itertools.count()  # stats() request tokens
        self._next = 0  # round-robin start among equally loaded replicas
        self._stopping = False
        self._replicas: list[ReplicaHandle] = []
        self._pipe = pipe  # this front's index in each replica's pipes (0: the engine that started them)
        self._loads = loads  # the replicas' published loads; None: this front is the only one, its counts are exact

    def _serve_pipes(self, gpus: list[str | None], limits: dict) -> None:
        """Start the threads that serve the replicas' pipes, once the limits are known."""
        self.replica_gpus: list[str | None] = gpus  # CUDA_VISIBLE_DEVICES each replica saw
        self.tokenizer = limits["tokenizer"]
        self.inputs = InputProcessor(limits["tokenizer"], limits["vocab_size"], limits["max_model_len"],
                                     limits["num_blocks"], limits["block_size"], limits["max_num_seqs"])  # fmt: skip
        self._router = PrefixRouter(len(self._replicas), limits["block_size"])
        for replica in self._replicas:
            replica.writer = threading.Thread(target=replica.write_loop, name=f"hf_paged-dp{replica.idx}-writer",
                                              daemon=True)  # fmt: skip
            replica.reader = threading.Thread(target=self._read_loop, args=(replica,),
                                              name=f"hf_paged-dp{replica.idx}-reader", daemon=True)  # fmt: skip
            replica.writer.start()
            replica.reader.start()

    # ---- the callers' side -----------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def num_live_replicas(self) -> int:
        return sum(r.alive for r in self._replicas)

    @property
    def replica_pids(self) -> list[int]:
        return [r.pid for r in self._replicas]

    @property
    def num_unfinished(self) -> int:
        """Requests submitted whose final output has not been delivered yet (all replicas). With several fronts:
        the requests every front has in flight, as the replicas last published them (plus this front's own still
        in the pipe)."""
        if self._loads is None:
            return sum(len(r.live) for r in self._replicas)
        return sum(self._load(r) for r in self._replicas if r.alive)

    def replica_of(self, request_id: str) -> int | None:
        """The index of the replica a request in flight was routed to; None if it is not in flight."""
        with self._lock:
            return next((r.idx for r in self._replicas if str(request_id) in r.live), None)

    def _load(self, replica: ReplicaHandle) -> int:
        """Requests ``replica`` holds, every front's, as it published them, plus this front's not applied yet."""
        loads = self._loads
        return loads.num_unfinished[replica.idx] + replica.num_routed - loads.added(self._pipe, replica.idx)

    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> RequestStream:
        """Submit a request to the least-loaded replica; returns its deltas as an async iterator (as AsyncEngine).

        Raises:
            ValueError/TypeError: a prompt or parameters the engine refuses (nothing is queued).
            EngineDeadError: every replica has died. RuntimeError: the engine is shutting down.
        """
        params, prompt_text, token_ids = self.checked_request(prompt, params)
        loop = asyncio.get_running_loop()
        request_id = f"dp-{next(self._ids)}" if request_id is None else str(request_id)
        block_hashes = self._router.block_hashes(token_ids)
        with self._lock:
            self.check_serving()
            if any(request_id in r.live for r in self._replicas):
                raise ValueError(f"request id {request_id!r} is already in use; pick another or let the engine pick")
            replica = self._pick(block_hashes)
            record = _Stream(request_id, loop, asyncio.Queue(), replica)
            replica.live[request_id] = record
            replica.num_routed += 1
        replica.outbox.put(("add", request_id, token_ids, params, prompt_text, time.monotonic()))
        return RequestStream(self, record)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks on its replica; its stream ends with finish_reason "abort".

        Raises:
            ValueError: no such request in flight.
        """
        request_id = str(request_id)
        if not self.abort_quietly(request_id):
            raise ValueError(f"unknown request id {request_id!r}: not submitted, or already finished")

    def abort_quietly(self, request_id: str) -> bool:
        """Abort a request if it is in flight (a RequestStream whose consumer left); False if it is not."""
        with self._lock:
            replica = next((r for r in self._replicas if request_id in r.live), None)
        if replica is None:
            return False
        replica.outbox.put(("abort", request_id))
        return True

    async def stats(self) -> DataParallelStats:
        """Every live replica's metrics and queue lengths (read between its steps), summed and per replica."""
        replicas = await self._ask_every_replica("stats")
        alive = [s for s in replicas if s is not None]
        if not alive:
            raise EngineDeadError("every data-parallel replica has died")
        if self._loads is None:
            routed = [r.num_routed for r in self._replicas]
        else:  # every front's
            routed = [self._loads.routed(r.idx) for r in self._replicas]
        return DataParallelStats(sum_metrics([s.metrics for s in alive]), sum(s.num_running for s in alive),
                                 sum(s.num_waiting for s in alive), replicas, routed)  # fmt: skip

    async def reset_prefix_cache(self) -> None:
        """Every live replica forgets its cached prefix blocks (between its steps; requests in flight keep theirs).
        Returns once each has."""
        if not any(r is not None for r in await self._ask_every_replica("reset_prefix_cache")):
            raise EngineDeadError("every data-parallel replica has died")

    async def _ask_every_replica(self, kind: str) -> list:
        """Send each live replica ``(kind, token)``; its answers ("stats" messages), None for a dead replica."""
        loop = asyncio.get_running_loop()
        futures = []
        with self._lock:
            self.check_serving()
            for replica in self._replicas:
                future = loop.create_future()
                if replica.alive:
                    token = next(self._tokens)
                    replica.stats_waiters[token] = future
                    replica.outbox.put((kind, token))
                else:
                    future.set_result(None)
                futures.append(future)
        return list(await asyncio.gather(*futures))

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop serving: wait up to ``drain_timeout_s`` for the requests in flight, then each replica aborts the
        rest (their streams end with finish_reason "abort") and exits; one that has not exited within 30 s is
        terminated. New requests are refused at once.

        An attached front (``attach``) detaches instead: each replica aborts this front's requests left in flight
        (their streams end with finish_reason "abort") and serves the other fronts on."""
        with self._lock:
            already, self._stopping = self._stopping, True
        if not already and drain_timeout_s > 0:
            deadline = time.monotonic() + drain_timeout_s
            while self.num_unfinished and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        await asyncio.to_thread(self._join, _STOP_TIMEOUT_S)

    def _join(self, timeout_s: float) -> None:
        if self._replicas[0].process is None:  # attached: the replicas answer "detached" (or are gone)
            put_all_outboxes([r.outbox for r in self._replicas if r.alive], ("detach",))
        else:
            stop_processes([r.process for r in self._replicas], [r.outbox for r in self._replicas], timeout_s)
        for replica in self._replicas:
            replica.reader.join(timeout_s)  # it ends on the closed pipe, after failing what was left
        self._finalizer.detach()

    def check_serving(self) -> None:
        if self._stopping:
            raise RuntimeError("the DataParallelEngine is shutting down: it accepts no new requests")
        if not any(r.alive for r in self._replicas):
            raise EngineDeadError("every data-parallel replica has died")

    def _pick(self, block_hashes: list[int]) -> ReplicaHandle:
        """The live replica for a prompt with these block hashes (hf_paged.serving.routing): where its prefix went,
        within the load slack; else the fewest requests in flight, among equals the next in round-robin order."""
        order = self._replicas[self._next :] + self._replicas[: self._next]
        load = (lambda r: len(r.live)) if self._loads is None else self._load
        loads = [load(r) if r.alive else 0 for r in self._replicas]
        idx = self._router.choose([r.idx for r in order if r.alive], loads, block_hashes)
        self._router.record(idx, block_hashes)
        self._next = (idx + 1) % len(self._replicas)
        return self._replicas[idx]

    # ---- the reader threads ----------------------------------------------------------------------

    def _read_loop(self, replica: ReplicaHandle) -> None:
        """Hand a replica's messages to their streams until its pipe closes; then fail what it had in flight."""
        try:
            while True:
                message = replica.results.recv()
                if message[0] == "step":
                    self._deliver(replica, message[1])
                elif message[0] == "stats":
                    with self._lock:
                        future = replica.stats_waiters.pop(message[1], None)
                    if future is not None:
                        _call(future.get_loop(), _set_result, future, message[2])
                elif message[0] in ("stopped", "detached"):
                    break
                else:
                    raise RuntimeError(f"bug in hf_paged: unknown replica message {message[0]!r}")
        except (EOFError, OSError):
            pass
        code = None
        if replica.process is not None:
            replica.process.join(5.0)
            code = replica.process.exitcode
        with self._lock:
            replica.alive = False
            self._router.forget(replica.idx)
            records, replica.live = list(replica.live.values()), {}
            waiters, replica.stats_waiters = list(replica.stats_waiters.values()), {}
        replica.outbox.put(None)  # ends the writer thread
        for future in waiters:
            _call(future.get_loop(), _set_result, future, None)
        for record in records:
            if self._stopping:
                err = RuntimeError("the DataParallelEngine shut down")
            else:
                exit_code = f" (exit code {code})" if code is not None else ""
                err = ReplicaDeadError(f"data-parallel replica {replica.idx} (pid {replica.pid}) died{exit_code}; "
                                       "its requests in flight failed")  # fmt: skip
            _call(record.loop, _put_all, [(record.queue, err, record.request_id)])

    def _deliver(self, replica: ReplicaHandle, items: list) -> None:
        """Queue a step's ``(request_id, item)`` pairs to their streams: one call per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, item in items:
                record = replica.live.get(request_id)
                if record is None:
                    continue  # failed or stopped meanwhile
                if type(item) is tuple:  # a delta, sent as a tuple (hf_paged.serving.replica)
                    item = StreamDelta(*item)
                else:  # the final output or an error: the stream's last item
                    del replica.live[request_id]
                batches.setdefault(record.loop, []).append((record.queue, item, request_id))
        for loop, batch in batches.items():
            if not _call(loop, _put_all, batch):  # the callers' loop is closed: nobody reads these requests
                for _, _, request_id in batch:
                    replica.outbox.put(("abort", request_id))


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """``fn(*args)`` on ``loop``'s thread; False if the loop is closed (nobody is there to read)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _put_all(items: list) -> None:
    for q, item, _ in items:
        q.put_nowait(item)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
