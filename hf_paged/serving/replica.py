"""The replica process of a DataParallelEngine: one ContinuousBatcher driven by commands from the fronts' pipes.

The process builds its engine with the front's ``factory``, sends its limits (``ready``) or its error (``failed``) on
its first result pipe, then loops: apply the commands waiting in its command pipes (``add``, ``abort``, ``stats``,
``reset_prefix_cache``, ``detach``, ``stop``), run a step, send each front the deltas of that step's requests it
submitted, in one ``step`` message per front. It sleeps on its pipes while it has nothing to run. See
hf_paged.serving.data_parallel for the front.

Pipes. Pipe 0 belongs to the DataParallelEngine that started the process; with ``hf-paged serve
--api-server-count N`` pipes 1..N belong to the API-server processes (hf_paged.frontends.api_servers), each
attached to every replica. A request is known by its front's pipe and the front's request id (two fronts may pick
the same id). A front that detaches (``detach``: its requests are aborted, their last deltas sent, then
``detached``) or whose pipe closes (its process died: its requests are aborted, their outputs dropped) is forgotten;
the others serve on. The process exits on ``stop`` from any pipe, or once every pipe has closed.
"""

import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from hf_paged.engine.outputs import StreamDelta, request_output
from hf_paged.serving.stats import ServingStats
from hf_paged.serving.streaming import FinalOutput, request_deltas


@dataclass
class ReplicaLoads:
    """The replicas' loads in shared memory, so that API servers that each see only their own requests route by
    the global load (``hf-paged serve --api-server-count N``). Each slot has one writer, a replica, and is read
    without a lock (an aligned 64-bit store is atomic on the hosts hf_paged runs on).

    ``num_unfinished[r]``: requests replica r holds (every front's), written after each of its steps.
    ``num_added[p * num_replicas + r]``: "add" commands replica r has applied from pipe p, so that a front can
    count its own requests still in the pipe: sent minus added.
    """

    num_replicas: int
    num_unfinished: object  # multiprocessing RawArray of int64, [num_replicas]
    num_added: object  # multiprocessing RawArray of int64, [num_pipes * num_replicas]

    @classmethod
    def create(cls, ctx, num_replicas: int, num_pipes: int) -> "ReplicaLoads":
        return cls(num_replicas, ctx.RawArray("q", num_replicas), ctx.RawArray("q", num_pipes * num_replicas))

    def added(self, pipe: int, replica_idx: int) -> int:
        return self.num_added[pipe * self.num_replicas + replica_idx]

    def routed(self, replica_idx: int) -> int:
        """Requests every front has sent replica ``replica_idx`` (those it has applied)."""
        return sum(self.num_added[replica_idx :: self.num_replicas])


def replica_main(idx: int, factory: Callable, commands: list[Connection], results: list[Connection],
                 num_threads: int | None, loads: ReplicaLoads | None = None) -> None:  # fmt: skip
    """A replica process: build the engine, report its limits on pipe 0, then serve commands until "stop" or until
    every front is gone (every command pipe closed).

    Args:
        commands, results: one pair per front (pipe index = list index); pipe 0 is the starting engine's.
        loads: where to publish this replica's load (None: the fronts count their own requests).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front decides
    try:
        import torch

        from hf_paged.engine.engine import ContinuousBatcher

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        batcher = factory()
        if not isinstance(batcher, ContinuousBatcher):
            raise TypeError(f"the `factory` must return a ContinuousBatcher, got {type(batcher).__name__}")
    except BaseException as err:
        results[0].send(("failed", _portable(err), traceback.format_exc()))
        return
    inputs = batcher.inputs
    info = {"tokenizer": batcher.tokenizer if idx == 0 else None, "vocab_size": inputs.vocab_size,
            "max_model_len": inputs.max_model_len, "num_blocks": inputs.num_blocks, "block_size": inputs.block_size,
            "max_num_seqs": inputs.max_num_seqs, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip
    try:
        results[0].send(("ready", info))
    except OSError:  # the starting engine is gone: nobody to serve
        commands, results = [], []
    _Replica(idx, batcher, commands, results, loads).serve()
    # Skip the interpreter's teardown of torch and transformers (seconds): everything to send has been sent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class _Live:
    """A request of one front, from its "add" until its last item is sent."""

    pipe: int
    request_id: str  # the front's id (the batcher's may carry the pipe too)
    request: object  # the batcher's Request
    cursors: dict  # sequence index -> StreamCursor


class _Replica:
    """The replica's engine loop: apply the fronts' commands between steps, send each front its deltas of a step
    in one message.

    Args:
        idx: the replica's index (its slot in ``loads``).
        batcher: the replica's ContinuousBatcher (this loop alone drives it).
        commands, results: the fronts' pipes, one pair per front.
        loads: where to publish the load (None = nowhere).
    """

    def __init__(self, idx: int, batcher, commands: list[Connection], results: list[Connection],
                 loads: ReplicaLoads | None):  # fmt: skip
        self.idx = idx
        self.batcher = batcher
        self.loads = loads
        self.commands: dict[Connection, int] = {conn: pipe for pipe, conn in enumerate(commands)}  # read, by pipe
        self.results: dict[int, Connection] = dict(enumerate(results))  # fronts still listening
        self.single = len(commands) == 1  # one front: the batcher's ids are the front's
        self.leaving: set[int] = set()  # detached fronts, answered "detached" once their requests are reported
        self.live: dict[str, _Live] = {}  # the batcher's request id -> the request, until its last item is sent
        self.out: dict[int, list] = {}  # pipe -> (request_id, StreamDelta tuple | FinalOutput | error) to send

    def serve(self) -> None:
        batcher = self.batcher
        # Until no front is left: none reading (each gone, or detached and answered), or only detached ones whose
        # requests no step has left to report (then nothing could be sent to them: they read EOF).
        while self.commands or (self.leaving and batcher.has_unfinished_requests()):
            if batcher.has_unfinished_requests():
                ready = self._ready(0)
            else:
                ready = self._ready(None)  # idle: sleep until a front writes (or goes)
            for conn in ready:
                if not self._drain(conn):
                    return
            if ready and self.loads is not None:
                # Now, not only after the step: an add just applied no longer counts as in its front's pipe.
                self.loads.num_unfinished[self.idx] = len(self.live)
            if batcher.has_unfinished_requests():
                try:
                    self._publish(batcher.step_requests())
                except Exception as err:  # the batcher has recovered; its requests in flight fail with the error
                    self._fail_all(err)
            self._flush()

    def _ready(self, timeout: float | None) -> list[Connection]:
        """The command pipes with something to read (a command, or EOF), waiting up to ``timeout`` (None: until
        one has). One front polls its one pipe; several are waited on together (one poll call)."""
        if not self.commands:  # only detached fronts are left, waiting for their requests' last deltas
            return []
        if self.single:
            (conn,) = self.commands
            return [conn] if conn.poll(timeout) else []
        return wait(list(self.commands), timeout)

    def _drain(self, conn: Connection) -> bool:
        """Apply the commands waiting in one pipe; False after "stop" (the loop ends)."""
        pipe = self.commands[conn]
        try:
            while conn in self.commands and conn.poll():
                if not self._apply(pipe, conn.recv()):
                    return False
        except (EOFError, OSError):  # the front's process is gone
            self._forget(pipe, send=False)
        return True

    def _key(self, pipe: int, request_id: str) -> str:
        return request_id if self.single else f"{pipe}/{request_id}"

    def _apply(self, pipe: int, command: tuple) -> bool:
        """Apply one command of front ``pipe``; False after "stop" (the loop ends)."""
        kind = command[0]
        if kind == "add":
            _, request_id, token_ids, params, prompt_text, arrival_time = command
            key = self._key(pipe, request_id)
            if self.loads is not None:
                self.loads.num_added[pipe * self.loads.num_replicas + self.idx] += 1
            try:
                self.batcher.add_request(token_ids, params, request_id=key)
            except Exception as err:  # e.g. a request the front's checks let through: this caller's error only
                self.out.setdefault(pipe, []).append((request_id, _portable(err)))
                return True
            request = self.batcher.requests[key]
            request.prompt = prompt_text
            request.metrics.arrival_time = arrival_time
            self.live[key] = _Live(pipe, request_id, request, {})
        elif kind == "abort":
            key = self._key(pipe, command[1])
            entry = self.live.get(key)
            if entry is not None and not entry.request.is_finished:
                self.batcher.abort(key)  # reported by the next step
        elif kind == "stats":
            scheduler = self.batcher.scheduler
            stats = ServingStats(self.batcher.metrics(), len(scheduler.running), len(scheduler.waiting))
            self._send(pipe, ("stats", command[1], stats))
        elif kind == "reset_prefix_cache":  # every front's requests share the pool: the reset is for all of them
            self.batcher.reset_prefix_cache()
            self._send(pipe, ("stats", command[1], True))
        elif kind == "detach":
            self._forget(pipe, send=True)
        elif kind == "stop":
            self._stop()
            return False
        else:
            raise RuntimeError(f"bug in hf_paged: unknown replica command {kind!r}")
        return True

    def _forget(self, pipe: int, send: bool) -> None:
        """Front ``pipe`` leaves: read no more of its commands and abort its requests. ``send``: it detached and
        waits for their last deltas, then "detached"; else its process is gone and nothing more is sent to it."""
        for conn, p in list(self.commands.items()):
            if p == pipe:
                del self.commands[conn]
                conn.close()
        if send:
            self.leaving.add(pipe)
        else:
            self._close(pipe)
        for key, entry in self.live.items():
            if entry.pipe == pipe and not entry.request.is_finished:
                self.batcher.abort(key)

    def _close(self, pipe: int) -> None:
        conn = self.results.pop(pipe, None)
        if conn is not None:
            conn.close()
        self.out.pop(pipe, None)
        self.leaving.discard(pipe)

    def _send(self, pipe: int, message: tuple) -> None:
        conn = self.results.get(pipe)
        if conn is None:
            return
        try:
            conn.send(message)
        except OSError:  # the front's process is gone
            self._forget(pipe, send=False)

    def _publish(self, requests: list) -> None:
        detokenize = self.batcher.tokenizer is not None
        for progressed in requests:
            key = progressed.request_id
            entry = self.live.get(key)
            if entry is None:
                continue  # failed meanwhile
            request = entry.request
            out = self.out.setdefault(entry.pipe, [])
            # Deltas travel as tuples (astuple order): a fifth of a dataclass's pickling cost, both ways.
            out += [(entry.request_id, _as_tuple(d)) for d in request_deltas(request, entry.cursors, detokenize)]
            if request.is_finished:
                output = request_output(request, detokenize)
                output.request_id = entry.request_id
                out.append((entry.request_id, FinalOutput(output)))
                del self.live[key]

    def _fail_all(self, err: BaseException) -> None:
        for key, entry in self.live.items():
            if not entry.request.is_finished:
                self.batcher.abort(key)
            self.out.setdefault(entry.pipe, []).append((entry.request_id, _portable(err)))
        self.live.clear()

    def _flush(self) -> None:
        """Send each front its items of this step (one message per front), answer the detached fronts whose
        requests have all been reported, and publish the load."""
        out, self.out = self.out, {}
        for pipe, items in out.items():
            if items and pipe in self.results:
                self._send(pipe, ("step", items))
        if self.leaving:
            waiting = {entry.pipe for entry in self.live.values()}
            for pipe in [p for p in self.leaving if p not in waiting]:
                self._send(pipe, ("detached",))
                self._close(pipe)
        if self.loads is not None:
            self.loads.num_unfinished[self.idx] = len(self.live)

    def _stop(self) -> None:
        """Abort what is in flight, send the aborted requests' last deltas, and tell every front."""
        for key, entry in self.live.items():
            if not entry.request.is_finished:
                self.batcher.abort(key)
        while self.batcher.has_unfinished_requests():
            try:
                self._publish(self.batcher.step_requests())
            except Exception as err:
                self._fail_all(err)
                break
        for entry in self.live.values():  # nothing should be left; never leave a waiter behind
            self.out.setdefault(entry.pipe, []).append((entry.request_id, RuntimeError("the DataParallelEngine "
                                                                                        "shut down")))  # fmt: skip
        self.live.clear()
        self._flush()
        for pipe in list(self.results):
            self._send(pipe, ("stopped",))


def _portable(err: BaseException) -> Exception:
    """An error that pickles across the pipe: the caller's-mistake types keep their type and message."""
    if type(err) in (ValueError, TypeError, RuntimeError, OSError):
        return type(err)(str(err))
    return RuntimeError(f"{type(err).__name__}: {err}")


def _as_tuple(delta: StreamDelta) -> tuple:
    """A delta's fields in declaration order; ``StreamDelta(*fields)`` rebuilds it (data_parallel.py)."""
    return (delta.text, delta.token_ids, delta.finish_reason, delta.index, delta.logprobs, delta.stop_reason)
