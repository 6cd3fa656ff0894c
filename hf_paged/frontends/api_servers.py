"""``hf-paged serve --api-server-count N``: N HTTP front processes (API servers) on one host:port, before the
engine processes.

    hf-paged serve ./my-model --data-parallel 2 --api-server-count 4

Why. Per request, an API server parses HTTP, validates the body, applies the chat template and tokenises, and
writes one SSE event (JSON) per delta. In one Python process that work limits what a server delivers at saturation
(hundreds of streams), all the more with several engine processes to feed. With N API servers each does it for its
own connections; the engine runs in processes of its own (the ``--data-parallel`` replicas, or the one engine
process of ``--engine-process on``), and every API server talks to every engine process directly::

    launcher (run(): sockets, supervision)  --pipe 0-->  engine process r (hf_paged.serving.replica), r < M
    API server f (uvicorn, f < N)           --pipe f+1-> engine process r: add, abort, stats, detach
    engine process r                        --pipe f+1-> API server f: one "step" message per step, with the
                                                         deltas of f's requests there (none if it has none)

Per engine step that is one message per API server with requests on that engine process, and one poll call over
its N + 1 pipes; with one API server the engine process polls its one pipe.

Sockets. The launcher binds N sockets to host:port with ``SO_REUSEPORT`` before anything starts (a busy port fails
at once), one per API server, which starts listening on it once it serves: the kernel spreads new connections over
the listening ones by a hash of the connection's addresses, so a burst of connections is shared out evenly (with one
shared socket, the API server that wakes first accepts the whole backlog), and none waits in the backlog of an API
server still starting. Without ``SO_REUSEPORT`` the servers share one socket. The launcher says "N API servers ...
on http://host:port" once every one of them serves.

Global view. The engine processes publish their loads in shared memory (``ReplicaLoads``): each API server routes
a request to the engine process with the fewest requests (every API server's, plus its own not yet applied), and
``--max-queue`` counts every API server's requests in flight the same way, so it is a global limit (requests sent
at the same instant to different API servers may pass it by a few). /metrics from any API server: the engine
gauges come from the engine processes, and the latency histograms are summed over every API server's row of
shared memory (hf_paged.frontends.serve_metrics); ``hf_paged_api_server_requests{api_server}`` shows the share.

Lifecycle. SIGTERM or SIGINT to the launcher: it sends SIGTERM to each API server, which stops accepting, gives
its requests in flight ``--shutdown-timeout`` seconds, then detaches from the engine processes (its requests left
are aborted there); then the launcher stops the engine processes and exits as ended by that signal. A second signal
kills the API servers at once. An API server that dies: the engine processes abort its requests (their blocks are
freed) and the others serve on. An engine process that dies: its requests fail, the others serve on. The launcher
stops everything and exits with status 1 once every API server or every engine process has died. If the launcher
itself dies (even by SIGKILL), each API server reads EOF on its lifeline pipe and shuts down gracefully, and then
the engine processes, all of whose pipes have closed, exit.
"""

import asyncio
import multiprocessing
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection

from hf_paged.frontends.serve_metrics import FrontObservations
from hf_paged.serving.data_parallel import DataParallelEngine, FrontHandoff

__all__ = ["bind", "run"]

_POLL_S = 0.2  # how often the launcher looks at its processes
_EXIT_MARGIN_S = 30.0  # beyond --shutdown-timeout, an API server's time to detach and exit before it is killed


def bind(host: str, port: int, num_servers: int) -> list[socket.socket]:
    """Sockets bound to ``host:port`` for ``num_servers`` API servers: one each with ``SO_REUSEPORT``, else one
    shared (the same socket ``num_servers`` times). Port 0 picks a free port, the same for all. They do not listen
    yet: each API server's event loop does when it starts serving (asyncio's ``create_server`` calls ``listen``).

    Raises:
        OSError: the address cannot be bound (in use, not this host's), naming it.
    """
    reuse_port = num_servers > 1 and hasattr(socket, "SO_REUSEPORT")
    sockets: list[socket.socket] = []
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]  # fmt: skip
        for _ in range(num_servers if reuse_port else 1):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            address = sock.getsockname()  # port 0: the others bind the port the first one got
    except OSError as err:
        for sock in sockets:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sockets if reuse_port else sockets * num_servers


def run(
    engine: DataParallelEngine,
    sockets: list[socket.socket],
    model_name: str,
    api_key: str | None = None,
    max_queue: int = 256,
    max_prompt_tokens: int | None = None,
    max_body_bytes: int | None = None,
    shutdown_timeout_s: float = 30.0,
    tool_call_parser: str | None = "auto",
    metric_names: str = "hf_paged",
) -> tuple[int, int | None]:
    """Start one API server per socket over ``engine``'s processes and supervise them until a signal or until
    every API server or every engine process has died; then stop everything (see the module docstring).

    Args:
        engine: a DataParallelEngine built with ``num_fronts=len(sockets)``; it is shut down before returning.
        sockets: from ``bind``; closed in this process once the API servers hold them.
        model_name, api_key, max_queue, max_prompt_tokens, max_body_bytes, shutdown_timeout_s, tool_call_parser,
            metric_names: as ``hf_paged.frontends.serve.run`` takes them, for every API server.

    Returns:
        ``(exit status, signal)``: ``(0, SIGTERM or SIGINT)`` after a signal, ``(1, None)`` when every API server or
        every engine process died.
    """
    from hf_paged.frontends.serve import DEFAULT_MAX_BODY_BYTES, warn_if_open

    host, port = sockets[0].getsockname()[:2]
    warn_if_open(host, api_key)
    ctx = multiprocessing.get_context("spawn")
    observations = FrontObservations.shared(ctx, len(sockets))
    settings = dict(model_name=model_name, api_key=api_key, max_queue=max_queue, max_prompt_tokens=max_prompt_tokens,
                    max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                    tool_call_parser=tool_call_parser, metric_names=metric_names)  # fmt: skip
    # Only this process holds the write end: if it dies (even by SIGKILL), every API server reads EOF and shuts down,
    # and then the engine processes, whose pipes have all closed, exit.
    lifeline, lifeline_write = ctx.Pipe(duplex=False)
    serving = [ctx.Event() for _ in sockets]  # set by each API server once it listens
    handoffs = [engine.front_handoff(idx) for idx in range(len(sockets))]
    fronts = [ctx.Process(target=front_main, args=(idx, sock, handoffs[idx], observations[idx], settings,
                                                   shutdown_timeout_s, lifeline, serving[idx]),
                          name=f"hf_paged-api{idx}") for idx, sock in enumerate(sockets)]  # fmt: skip
    errors: list[BaseException] = []

    def start(process) -> None:
        try:
            process.start()
        except BaseException as err:
            errors.append(err)

    try:
        # One thread each: start() returns once the child has read its arguments, which it does while importing
        # (torch, transformers: seconds); one after another, N API servers would take N times as long to start.
        threads = [threading.Thread(target=start, args=(process,)) for process in fronts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    except BaseException:
        _stop_fronts([process for process in fronts if process.pid is not None], 0.0)
        asyncio.run(engine.shutdown())
        raise
    finally:
        for handoff in handoffs:  # the API servers' ends are theirs now: each alone holds them, EOF tells its death
            handoff.close()
        lifeline.close()
        for sock in set(sockets):
            sock.close()
    ready = (
        f"{len(fronts)} API servers (pids {', '.join(str(p.pid) for p in fronts)}) on http://{_url_host(host)}:"
        f"{port}; {engine.num_replicas} engine process(es) (pids {', '.join(map(str, engine.replica_pids))})"
    )
    try:
        return asyncio.run(_supervise(engine, fronts, serving, ready, shutdown_timeout_s))
    finally:
        lifeline_write.close()


async def _supervise(engine: DataParallelEngine, fronts: list, serving: list, ready: str,
                     shutdown_timeout_s: float) -> tuple[int, int | None]:  # fmt: skip
    """Watch the API servers and engine processes until a signal or until all of either died; then stop them."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        if len(received) > 1:  # a second signal: no more waiting for the API servers
            _say(f"signal {signal.Signals(sig).name} again: killing the API servers")
            for process in fronts:
                if process.is_alive():
                    process.kill()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    status, gone = 0, set()
    while not stop.is_set():
        if ready and all(event.is_set() for event in serving):
            _say(ready)
            ready = ""
        for idx, process in enumerate(fronts):
            if idx not in gone and not process.is_alive():
                gone.add(idx)
                _say(f"API server {idx} (pid {process.pid}) exited with code {process.exitcode}; its requests were "
                     f"aborted, {len(fronts) - len(gone)} API server(s) serve on")  # fmt: skip
        if len(gone) == len(fronts):
            _say("every API server has exited: stopping the engine processes")
            status = 1
            break
        if not engine.num_live_replicas:
            _say("every engine process has died: stopping the API servers")
            status = 1
            break
        try:
            await asyncio.wait_for(stop.wait(), _POLL_S)
        except TimeoutError:
            pass
    await asyncio.to_thread(_stop_fronts, fronts, shutdown_timeout_s + _EXIT_MARGIN_S)
    await engine.shutdown()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    return status, (received[0] if received else None)


def _stop_fronts(fronts: list, timeout_s: float) -> None:
    """SIGTERM each API server (uvicorn's graceful shutdown), wait up to ``timeout_s`` for all, kill the rest."""
    for process in fronts:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in fronts:
        process.join(max(0.0, deadline - time.monotonic()))
    for idx, process in enumerate(fronts):
        if process.is_alive():
            _say(f"API server {idx} (pid {process.pid}) has not exited {timeout_s:.0f} s after SIGTERM: killed")
            process.kill()
            process.join()


def front_main(idx: int, sock: socket.socket, handoff: FrontHandoff, observations: FrontObservations,
               settings: dict, shutdown_timeout_s: float, lifeline: Connection, serving) -> None:  # fmt: skip
    """An API server's process: serve ``sock`` with the OpenAI-compatible app over the engine processes' pipes
    until SIGTERM, or until the launcher is gone (``lifeline`` reads EOF): uvicorn's graceful shutdown, then the
    app's shutdown detaches from the engine processes. ``serving`` (a multiprocessing Event) is set once it
    listens."""
    # Ctrl-C reaches the whole process group: the launcher decides (it sends SIGTERM, and kills on a second signal).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if sig != signal.SIGINT:  # else a Ctrl-C arriving after the launcher's SIGTERM would cut the drain short
                super().handle_exit(sig, frame)

    from hf_paged.frontends.serve import create_app, make_server

    engine = DataParallelEngine.attach(handoff)
    app = create_app(engine, observations=observations, **settings)
    server = make_server(app, shutdown_timeout_s, server_cls=Server, log_level="info")

    def watch_launcher() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            serving.set()
        try:
            lifeline.recv()  # nothing is ever sent: returns (raises) when the launcher's end closes
        except (EOFError, OSError):
            pass
        server.should_exit = True

    threading.Thread(target=watch_launcher, name="hf_paged-lifeline", daemon=True).start()
    server.run(sockets=[sock])


def _say(message: str) -> None:
    print(f"hf-paged: {message}", file=sys.stderr, flush=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
