"""Iteration-level scheduling over the block pool (Orca / vLLM): what runs in the next forward.

Pure bookkeeping (no torch): it decides which tokens of which sequences the next forward computes,
allocates their slots in the block pool, and hands the runner one ``SchedulerOutput``; the runner
executes the block copies and the forward.
"""

import collections
import time
from dataclasses import dataclass, field

from hf_paged.block_pool import BlockPool
from hf_paged.engine.request import Request, Sequence, Status


@dataclass
class ScheduledChunk:
    """Tokens ``seq.token_ids[start:end]`` are computed this step (their slots are allocated)."""

    request: Request
    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence's tokens: its last position gives the next token."""
        return self.end == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step, in execution order."""

    chunks: list[ScheduledChunk]  # decode tokens first, then prefill chunks; batch order of the forward
    num_batched_tokens: int  # equals sum(end - start) over chunks; <= max_num_batched_tokens
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (block id, CPU slot): copy before anything
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU slot, block id): after swap_out
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst): after swap_in
    preempted: list[Request] = field(default_factory=list)  # requests preempted this step

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class SwapSpace:
    """CPU block slots for swapped-out sequences (the bookkeeping; the runner owns the tensors)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give_back(self, slots) -> None:
        self._free.extend(slots)


class Scheduler:
    """FCFS continuous batching with a token budget, chunked prefill and all-or-nothing preemption.

    Each step, in order:
      1. running sequences that decode get one token each (their new slot is appended in the pool; out
         of blocks, the most recently admitted request is preempted, until the token fits or the
         request preempted is this one);
      2. running requests still in their prompt get a chunk of what is left of the budget;
      3. waiting requests are admitted first-come-first-served while the budget, the sequence cap and
         the free blocks allow: swapped ones get their blocks back, others allocate their prompt's
         blocks (prefix-cache hits are not recomputed) and get a first chunk.
    Preemption frees a request's blocks and requeues it at the front: by recompute (its tokens so far
    are computed again when it is readmitted) or by swap (its blocks are copied to CPU slots first).

    Async scheduling (the engine samples step N on the device while this schedules step N+1): a sequence
    whose last token is a placeholder gets its slot like any other (the runner reads the id on the
    device); one whose placeholder is its final token (``last_inflight``) is not scheduled; a waiting
    request with a placeholder is not admitted until the id is known.

    Args:
        pool: the block pool shared with the runner.
        max_num_batched_tokens: the token budget of one forward.
        max_num_seqs: the cap on sequences in one forward.
        preemption_mode: "recompute" or "swap".
        num_swap_slots: CPU blocks available for swapping (swap mode).
    """

    def __init__(
        self,
        pool: BlockPool,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        preemption_mode: str = "recompute",
        num_swap_slots: int = 0,
    ):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"`preemption_mode` must be 'recompute' or 'swap', got {preemption_mode!r}")
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(
                f"`max_num_seqs` ({max_num_seqs}) must not exceed `max_num_batched_tokens` "
                f"({max_num_batched_tokens}): every running sequence needs a token of the budget each step"
            )
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.preemption_mode = preemption_mode
        self.swap = SwapSpace(num_swap_slots)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0

    # ---- queue ------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's blocks (running) or swap slots (swapped)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        for seq in request.seqs:
            self.release_seq(seq)
        self._release_swap_slots(request)
        request.status = Status.FINISHED

    def release_seq(self, seq: Sequence) -> None:
        """Free one sequence's blocks (a finished sample, a dropped beam)."""
        if self.pool.has_seq(seq.seq_id):
            self.pool.free(seq.seq_id)

    def _release_swap_slots(self, request: Request) -> None:
        """Give back the CPU slots of a swapped request (siblings share slots: each is given back once)."""
        slots = set()
        for seq in request.seqs:
            if seq.swap_table is not None:
                slots.update(seq.swap_table)
                seq.swap_table = None
        self.swap.give_back(slots)

    # ---- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(chunks=[], num_batched_tokens=0)
        budget = self.max_num_batched_tokens
        # 1. decode: one token per running sequence, oldest request first.
        prefilling: list[Request] = []
        idx = 0
        while idx < len(self.running):
            request = self.running[idx]
            # In prefill: slots were allocated at admission for tokens not computed yet.
            num_tokens = self.pool.num_tokens
            if any(num_tokens(seq.seq_id) > seq.num_computed for seq in request.live_seqs):
                prefilling.append(request)
                idx += 1
                continue
            if not self._schedule_decode(request, out):
                continue  # this request was preempted (removed from running): same idx is the next one
            idx += 1
        budget -= out.num_batched_tokens
        # 2. running requests still computing their prompt (chunked prefill).
        for request in prefilling:
            if request not in self.running:
                continue  # preempted in step 1
            budget = self._schedule_prefill(request, budget, out)
        # 3. admit waiting requests, first come first served.
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self._num_running_seqs() + _max_seqs(request) > self.max_num_seqs:
                break
            if any(seq.num_inflight for seq in request.seqs):
                break  # preempted with a token in flight: readmitted once its id is known (next step)
            if not self._admit(request, out):
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = Status.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
            budget = self._schedule_prefill(request, budget, out)
        return out

    def _num_running_seqs(self) -> int:
        return sum(_max_seqs(r) for r in self.running)

    def _schedule_decode(self, request: Request, out: SchedulerOutput) -> bool:
        """Give each live sequence of ``request`` its next token's slot; False if it had to be preempted."""
        live = request.live_seqs
        if len(live) == 1:
            if live[0].last_inflight:
                return True  # its last token is in flight: nothing left to compute
        elif any(seq.last_inflight for seq in live):
            live = [seq for seq in live if not seq.last_inflight]
        for seq in live:
            # Sampled, not yet in the pool; a placeholder while its id is on the device (async scheduling).
            pending = seq.token_ids[self.pool.num_tokens(seq.seq_id) :]
            while True:
                pairs = self.pool.append(seq.seq_id, pending) if pending else []
                if pairs is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    return False
            if pairs:
                out.copies.extend(pairs)
        for seq in live:
            num = len(seq.token_ids) - seq.num_computed
            out.chunks.append(ScheduledChunk(request, seq, seq.num_computed, seq.num_computed + num))
            out.num_batched_tokens += num
        return True

    def _schedule_prefill(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule the next chunk of each sequence that is still computing its tokens; returns the budget left."""
        for seq in request.live_seqs:
            num = min(len(seq.token_ids) - seq.num_computed, budget)
            if num <= 0:
                continue
            start = seq.num_computed
            # Full blocks enter the prefix index once their tokens are in a forward (not before).
            self.pool.cache_blocks(seq.seq_id, start + num)
            out.chunks.append(ScheduledChunk(request, seq, start, start + num))
            out.num_batched_tokens += num
            budget -= num
        return budget

    def _admit(self, request: Request, out: SchedulerOutput) -> bool:
        """Allocate blocks for every live sequence of ``request`` (all or nothing)."""
        allocated: list[Sequence] = []
        for seq in request.live_seqs:
            result = self.pool.allocate(seq.seq_id, seq.token_ids, num_tokens_to_cache=0)
            if result is None:
                for done in allocated:
                    self.pool.free(done.seq_id)
                return False
            allocated.append(seq)
            if request.status == Status.SWAPPED:
                table = result.block_table
                num_blocks_computed = -(-seq.num_computed // self.pool.block_size)
                hit_blocks = result.num_cached_tokens // self.pool.block_size
                for logical in range(hit_blocks, num_blocks_computed):
                    out.swap_in.append((seq.swap_table[logical], table[logical]))
                seq.num_computed = max(seq.num_computed, result.num_cached_tokens)
            else:
                seq.num_computed = result.num_cached_tokens
                if request.metrics.num_preemptions == 0:
                    request.num_cached_tokens = result.num_cached_tokens
        if request.status == Status.SWAPPED:
            self._release_swap_slots(request)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take all of ``request``'s blocks back and requeue it at the front of the waiting queue."""
        self.running.remove(request)
        self.num_preemptions += 1
        request.metrics.num_preemptions += 1
        out.preempted.append(request)
        # Chunks already scheduled for it this step are dropped.
        out.chunks = [c for c in out.chunks if c.request is not request]
        out.num_batched_tokens = sum(c.end - c.start for c in out.chunks)
        swap = self.preemption_mode == "swap" and self._can_swap_out(request)
        slot_of: dict[int, int] = {}  # block -> CPU slot, shared by the request's sequences
        for seq in request.live_seqs:
            if swap:
                self._swap_out(seq, slot_of, out)
            # Sampled tokens not computed yet stay in token_ids and are computed after readmission.
            self.pool.free(seq.seq_id)
            if not swap:
                seq.num_computed = 0
        request.status = Status.SWAPPED if swap else Status.WAITING
        self.waiting.appendleft(request)

    def _can_swap_out(self, request: Request) -> bool:
        needed = set()
        for seq in request.live_seqs:
            num_blocks = -(-seq.num_computed // self.pool.block_size)
            needed.update(self.pool.get_block_table(seq.seq_id)[:num_blocks])
        return len(needed) <= self.swap.num_free

    def _swap_out(self, seq: Sequence, slot_of: dict[int, int], out: SchedulerOutput) -> None:
        """Copy the blocks holding ``seq``'s computed tokens to CPU slots (a block shared by siblings once)."""
        num_blocks = -(-seq.num_computed // self.pool.block_size)
        table = self.pool.get_block_table(seq.seq_id)[:num_blocks]
        seq.swap_table = []
        for block in table:
            if block not in slot_of:
                slot_of[block] = self.swap.take()
                out.swap_out.append((block, slot_of[block]))
                self.num_swapped_out_blocks += 1
            seq.swap_table.append(slot_of[block])


def _max_seqs(request: Request) -> int:
    """Sequences the request will run at once: its n samples or beams, once forked."""
    return max(len(request.live_seqs), request.params.n, request.params.beam_width)
