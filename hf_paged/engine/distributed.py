"""Tensor-parallel lock-step: every rank runs the same engine on the same requests (launched with torchrun).

Every rank schedules deterministically from the same inputs; two things keep the ranks identical:
- the sampled tokens of each step are broadcast from rank 0 (sampling draws random numbers, and each rank's
  generator is its own), so every rank appends the same tokens; the broadcast is a device collective queued
  after the sampling, so it never makes the host wait (async scheduling works under tensor parallelism);
- a fingerprint of each step's schedule (which tokens of which requests, the block copies) is compared
  across ranks with one small all-reduce before the step is queued; a mismatch raises instead of computing
  garbage (or hanging in mismatched collectives). With NCCL the check goes through a CPU (gloo) group of
  the same ranks, so it waits for the other ranks' hosts, not for the GPU work queued before it.
"""

import torch
import torch.distributed as dist
import xxhash

from hf_paged.engine.scheduler import SchedulerOutput


class RankSync:
    """No-op on one process; lock-step checks and token broadcast under tensor parallelism.

    Args:
        tp_size: the model's tensor-parallel degree (1: nothing to synchronise).
        device: the device of this rank's tensors (collectives on NCCL need CUDA tensors).
    """

    def __init__(self, tp_size: int, device: torch.device):
        self.enabled = tp_size > 1 and dist.is_available() and dist.is_initialized()
        if self.enabled:
            nccl = dist.get_backend() == "nccl"
            self.device = device if nccl else torch.device("cpu")
            # Every rank builds its engine, so every rank makes this group, in the same order.
            self._check_group = dist.new_group(backend="gloo") if nccl else None

    def check_schedule(self, sched: SchedulerOutput) -> None:
        """Raise if the ranks scheduled different steps."""
        if not self.enabled:
            return
        plan = repr((sched.request_ids, sched.num_computed, sched.num_new_tokens, sched.copies, sched.swap_in,
                     sched.swap_out))  # fmt: skip
        fp = xxhash.xxh64_intdigest(plan.encode()) & ((1 << 62) - 1)
        both = torch.tensor([fp, -fp], dtype=torch.int64)  # host tensors: no device sync
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._check_group)
        if both[0].item() != -both[1].item():
            raise RuntimeError(
                "bug in hf_paged, or ranks fed different requests: tensor-parallel ranks scheduled different "
                "steps. Every rank must call add_request/generate with the same prompts in the same order"
            )

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.enabled else 0

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank (pickled; through the host group, so it never waits for queued GPU work).
        The other ranks pass nothing and get rank 0's value. Used to send the requests rank 0 receives (AsyncEngine)
        to the ranks that mirror it (``hf_paged.serving.tensor_parallel.follow``)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._check_group)
        return box[0]

    def broadcast(self, *tensors: torch.Tensor | None) -> None:
        """Overwrite the tensors with rank 0's values (in place)."""
        if not self.enabled:
            return
        for t in tensors:
            if t is None:
                continue
            if t.device == self.device:
                dist.broadcast(t, src=0)
            else:
                moved = t.to(self.device)
                dist.broadcast(moved, src=0)
                t.copy_(moved)
