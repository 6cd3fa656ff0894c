"""Serving under tensor parallelism (``tp_plan="auto"`` under torchrun): rank 0 leads, every other rank follows.

Every rank must run the same requests in the same order (hf_paged.engine.distributed). Rank 0 runs the AsyncEngine
(and the server); before applying each batch of callers' commands its engine thread sends the batch to the other
ranks through the ranks' host group (``broadcast_commands``), and every other rank runs ``follow(batcher)``, which
applies the same batches to its own batcher and steps when rank 0 steps. While idle, rank 0 sends an empty batch
every ``HEARTBEAT_S`` so the followers' receive never times out.

Commands, as the followers receive them: ``("add", request_id, token_ids, params)``, ``("abort", request_id)``,
``("stop",)``. Rank 0's ``stats`` commands stay on rank 0.
"""

from hf_paged.engine.engine import ContinuousBatcher

__all__ = ["HEARTBEAT_S", "broadcast_commands", "follow"]

HEARTBEAT_S = 60.0  # an idle rank 0 broadcasts an empty batch this often, well inside the host group's timeout


def broadcast_commands(sync, commands: list[tuple]) -> None:
    """Rank 0: send a batch of AsyncEngine commands to the followers, before rank 0 applies it.

    Args:
        sync: the batcher's RankSync (hf_paged.engine.distributed).
        commands: AsyncEngine commands; an ``add`` is ``("add", record, token_ids, params, prompt_text)``, of which
            the followers get only what their batcher takes.
    """
    sync.broadcast_object([_for_followers(c) for c in commands if c[0] != "stats"])


def _for_followers(command: tuple) -> tuple:
    if command[0] == "reset_prefix_cache":  # without rank 0's future: every rank's pool must drop the same hashes
        return ("reset_prefix_cache",)
    if command[0] != "add":
        return command
    _, record, token_ids, params, _prompt_text = command
    return ("add", record.request_id, token_ids, params)


def follow(batcher: ContinuousBatcher) -> None:
    """Tensor parallelism, every rank but 0: mirror rank 0's AsyncEngine until it shuts down.

    Receives each batch of commands rank 0's engine thread broadcasts, applies it to ``batcher`` as rank 0 does (adds,
    aborts, prefix-cache resets; a request rank 0 refused is refused here the same way), and runs a step whenever
    requests are unfinished, which is exactly when rank 0 steps: the ranks hold the same requests, and the engine's
    lock-step checks and token broadcast keep them identical. A failed step aborts every request in flight, as rank 0's
    engine fails them. Returns after rank 0's shutdown, once the aborted requests have drained.

    Raises:
        ValueError: not under tensor parallelism, or called on rank 0 (which runs the AsyncEngine).
    """
    sync = batcher.rank_sync
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
            elif command[0] == "reset_prefix_cache":
                batcher.reset_prefix_cache()
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
