"""The front's side of a data-parallel replica process: starting it, its pipes and threads, and stopping it.

``start_replica`` spawns a replica (hf_paged.serving.replica) with one pair of one-way pipes per front and
returns its ``ReplicaHandle``; ``wait_ready`` reads the replica's first message (its engine's limits, or the
error building the engine raised); ``stop_processes`` asks replicas to stop and terminates those that do not.
With ``device="cuda"`` each replica sees only its own GPU: ``CUDA_VISIBLE_DEVICES`` is set in its environment
before it starts.
"""

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from hf_paged.serving.replica import ReplicaLoads, replica_main

__all__ = ["ReplicaHandle", "put_all_outboxes", "start_replica", "stop_processes", "visible_gpus", "wait_ready"]


class ReplicaHandle:
    """The front's side of one replica: its process (None in an attached front), pipes, writer and reader threads,
    and requests in flight."""

    def __init__(self, idx: int, process, commands: Connection, results: Connection, pid: int | None = None):
        self.idx = idx
        self.process = process
        self.pid = process.pid if process is not None else pid
        self.front_pipes: list[tuple[Connection, Connection]] = []  # pipes 1..: the API servers' ends, until handed
        self.commands = commands  # front -> replica (written by the writer thread only)
        self.results = results  # replica -> front (read by the reader thread only)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # commands for the writer thread; None ends it
        self.live: dict[str, object] = {}  # request id -> the front's record of it, under the front's lock
        self.stats_waiters: dict[int, asyncio.Future] = {}  # under the front's lock
        self.alive = True  # under the front's lock
        self.num_routed = 0
        self.writer: threading.Thread | None = None
        self.reader: threading.Thread | None = None

    def write_loop(self) -> None:
        """The writer thread: send the outbox's commands until None (or until the replica is gone)."""
        while (command := self.outbox.get()) is not None:
            try:
                self.commands.send(command)
            except OSError:  # the replica is gone: its reader thread fails its requests
                return


def start_replica(ctx, idx: int, factory: Callable, gpu: str | None, num_threads: int | None, num_pipes: int,
                  loads: ReplicaLoads | None) -> ReplicaHandle:  # fmt: skip
    """Spawn replica ``idx`` (on GPU ``gpu`` alone, if given) with ``num_pipes`` pipe pairs; pipe 0 is the
    handle's, the others wait in ``front_pipes`` for the API-server processes."""
    commands = [ctx.Pipe(duplex=False) for _ in range(num_pipes)]  # (read, write)
    results = [ctx.Pipe(duplex=False) for _ in range(num_pipes)]
    process = ctx.Process(target=replica_main, args=(idx, factory, [r for r, _ in commands],
                                                     [w for _, w in results], num_threads, loads),
                          name=f"hf_paged-dp{idx}")  # fmt: skip
    with _environ(CUDA_VISIBLE_DEVICES=gpu):  # the child's environment is copied when it starts
        process.start()
    for (commands_read, _), (_, results_write) in zip(commands, results, strict=True):
        commands_read.close()  # the replica's ends: closed here, so either side sees EOF when the other is gone
        results_write.close()
    handle = ReplicaHandle(idx, process, commands[0][1], results[0][0])
    handle.front_pipes = [(commands[p][1], results[p][0]) for p in range(1, num_pipes)]
    return handle


def wait_ready(replica: ReplicaHandle) -> dict:
    """The replica's first message: its engine's limits (and the tokenizer, from replica 0), or its error."""
    wait([replica.results, replica.process.sentinel])
    try:
        message = replica.results.recv()
    except (EOFError, OSError):
        replica.process.join(5.0)
        raise RuntimeError(f"data-parallel replica {replica.idx} exited with code {replica.process.exitcode} "
                           "while building its engine") from None  # fmt: skip
    if message[0] == "failed":
        _, err, trace = message
        raise err from RuntimeError(f"in data-parallel replica {replica.idx}:\n{trace}")
    return message[1]


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (a replica gets one of them)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in env.split(",") if d.strip()][:count]


def stop_processes(processes: list, outboxes: list[queue.SimpleQueue], timeout_s: float) -> None:
    """Ask each replica to stop, wait up to ``timeout_s`` for all, then terminate (and at last kill) the rest."""
    for outbox in outboxes:
        outbox.put(("stop",))
    deadline = time.monotonic() + timeout_s
    for process in processes:
        if process.pid is not None:
            process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.pid is not None and process.is_alive():
            process.terminate()
            process.join(5.0)
        if process.pid is not None and process.is_alive():
            process.kill()
            process.join()


def put_all_outboxes(outboxes: list[queue.SimpleQueue], command: tuple) -> None:
    for outbox in outboxes:
        outbox.put(command)


class _environ:
    """Set environment variables (None = leave as is) for a ``with`` block, then restore them."""

    def __init__(self, **values: str | None):
        self.values = {k: v for k, v in values.items() if v is not None}
        self.saved: dict[str, str | None] = {}

    def __enter__(self):
        for key, value in self.values.items():
            self.saved[key] = os.environ.get(key)
            os.environ[key] = value

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
