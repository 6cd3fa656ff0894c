"""The replica process of a DataParallelEngine: one ContinuousBatcher driven by commands from the front's pipe.

The process builds its engine with the front's ``factory``, sends its limits (``ready``) or its error
(``failed``), then loops: apply the commands waiting in the pipe (``add``, ``abort``, ``stats``, ``stop``), run a
step, send every stream's deltas of that step in one ``step`` message. It sleeps in the pipe's ``recv`` while it has
nothing to run, and exits when told to stop or when the front is gone (the pipe closes). See data_parallel.py for
the front.
"""

import os
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from hf_paged.engine.async_engine import ServingStats, _Done, request_deltas
from hf_paged.engine.outputs import StreamDelta, request_output


def replica_main(idx: int, factory: Callable, commands: Connection, results: Connection,
                 num_threads: int | None) -> None:  # fmt: skip
    """A replica process: build the engine, report its limits, then serve commands until "stop" or the front is
    gone (its pipe closes)."""
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
        results.send(("failed", _portable(err), traceback.format_exc()))
        return
    inputs = batcher.inputs
    info = {"tokenizer": batcher.tokenizer if idx == 0 else None, "vocab_size": inputs.vocab_size,
            "max_model_len": inputs.max_model_len, "num_blocks": inputs.num_blocks, "block_size": inputs.block_size,
            "max_num_seqs": inputs.max_num_seqs, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip
    try:
        results.send(("ready", info))
        _Replica(batcher, results).serve(commands)
    except (EOFError, OSError):  # the front is gone: nobody to serve
        pass
    # Skip the interpreter's teardown of torch and transformers (seconds): everything to send has been sent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Replica:
    """The replica's engine loop: apply the front's commands between steps, send each step's deltas in one message.

    Args:
        batcher: the replica's ContinuousBatcher (this loop alone drives it).
        results: the pipe to the front.
    """

    def __init__(self, batcher, results: Connection):
        self.batcher = batcher
        self.results = results
        self.live: dict[str, tuple] = {}  # request id -> (Request, its StreamCursors), until its last item is sent
        self.out: list = []  # (request_id, StreamDelta | _Done | error) to send after this step

    def serve(self, commands: Connection) -> None:
        batcher = self.batcher
        while True:
            if not batcher.has_unfinished_requests() and not self._apply(commands.recv()):  # idle: sleep in recv
                return
            while commands.poll():
                if not self._apply(commands.recv()):
                    return
            if batcher.has_unfinished_requests():
                try:
                    self._publish(batcher.step_requests())
                except Exception as err:  # the batcher has recovered; its requests in flight fail with the error
                    self._fail_all(err)
            self._flush()

    def _apply(self, command: tuple) -> bool:
        """Apply one command; False after "stop" (the loop ends)."""
        kind = command[0]
        if kind == "add":
            _, request_id, token_ids, params, prompt_text, arrival_time = command
            try:
                self.batcher.add_request(token_ids, params, request_id=request_id)
            except Exception as err:  # e.g. a request the front's checks let through: this caller's error only
                self.out.append((request_id, _portable(err)))
                return True
            request = self.batcher.requests[request_id]
            request.prompt = prompt_text
            request.metrics.arrival_time = arrival_time
            self.live[request_id] = (request, {})
        elif kind == "abort":
            entry = self.live.get(command[1])
            if entry is not None and not entry[0].is_finished:
                self.batcher.abort(command[1])  # reported by the next step
        elif kind == "stats":
            scheduler = self.batcher.scheduler
            stats = ServingStats(self.batcher.metrics(), len(scheduler.running), len(scheduler.waiting))
            self.results.send(("stats", command[1], stats))
        elif kind == "stop":
            self._stop()
            return False
        else:
            raise RuntimeError(f"bug in hf_paged: unknown replica command {kind!r}")
        return True

    def _publish(self, requests: list) -> None:
        detokenize = self.batcher.tokenizer is not None
        for progressed in requests:
            entry = self.live.get(progressed.request_id)
            if entry is None:
                continue  # failed meanwhile
            request, cursors = entry
            # Deltas travel as tuples (astuple order): a fifth of a dataclass's pickling cost, both ways.
            self.out += [(request.request_id, _as_tuple(d)) for d in request_deltas(request, cursors, detokenize)]
            if request.is_finished:
                self.out.append((request.request_id, _Done(request_output(request, detokenize))))
                del self.live[request.request_id]

    def _fail_all(self, err: BaseException) -> None:
        for request_id, (request, _) in self.live.items():
            if not request.is_finished:
                self.batcher.abort(request_id)
            self.out.append((request_id, _portable(err)))
        self.live.clear()

    def _flush(self) -> None:
        if self.out:
            self.results.send(("step", self.out))
            self.out = []

    def _stop(self) -> None:
        """Abort what is in flight, send the aborted requests' last deltas, and say so."""
        for request_id, (request, _) in self.live.items():
            if not request.is_finished:
                self.batcher.abort(request_id)
        while self.batcher.has_unfinished_requests():
            try:
                self._publish(self.batcher.step_requests())
            except Exception as err:
                self._fail_all(err)
                break
        for request_id in self.live:  # nothing should be left; never leave a waiter behind
            self.out.append((request_id, RuntimeError("the DataParallelEngine shut down")))
        self._flush()
        self.results.send(("stopped",))


def _portable(err: BaseException) -> Exception:
    """An error that pickles across the pipe: the caller's-mistake types keep their type and message."""
    if type(err) in (ValueError, TypeError, RuntimeError, OSError):
        return type(err)(str(err))
    return RuntimeError(f"{type(err).__name__}: {err}")


def _as_tuple(delta: StreamDelta) -> tuple:
    """A delta's fields in declaration order; ``StreamDelta(*fields)`` rebuilds it (data_parallel.py)."""
    return (delta.text, delta.token_ids, delta.finish_reason, delta.index, delta.logprobs, delta.stop_reason)
