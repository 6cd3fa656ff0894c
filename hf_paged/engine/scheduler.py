"""Iteration-level scheduling (Orca / vLLM): what the next forward computes, and what its tokens do.

The scheduler is the one owner of the engine's requests' progress and, through the KV manager
(hf_paged.engine.kv_manager), of their blocks: admission, chunking, forks for ``n`` and beams, copy-on-write,
preemption, and ``update_from_output`` — the sampled tokens of a step are applied here, stop tokens and
length limits checked, finished sequences freed. It hands the runner one plain ``SchedulerOutput`` a step
(hf_paged.engine.scheduler_output): ids, token ids, positions, block-table diffs and block copies; no live object
crosses that seam.

Pure bookkeeping: no torch.
"""

import collections
import time

from hf_paged.engine.beam_search import BeamStep
from hf_paged.engine.kv_manager import KVManager
from hf_paged.engine.request import PLACEHOLDER, Request, Sequence, Status
from hf_paged.engine.scheduler_output import SchedulerOutput, StepBuilder

__all__ = ["MAX_PROMPT_LOGPROB_ROWS", "Scheduler", "SchedulerOutput"]

# Most prompt tokens of requests still scoring their prompt (``prompt_logprobs``) in one step: each returns a logits
# row, scored in fp32 (512 rows of a 152k vocabulary: ~0.3 GiB), where a step's other tokens return none.
MAX_PROMPT_LOGPROB_ROWS = 512


class Scheduler:
    """FCFS continuous batching with a token budget, chunked prefill and all-or-nothing preemption.

    Each step, in order:
      1. running requests whose every live sequence needs exactly one token (decode) get it: its slot is
         appended in the pool; out of blocks, the most recently admitted request is preempted, until the
         token fits or the request preempted is this one;
      2. running requests still computing tokens (prompt chunks, recompute after preemption) get chunks of
         what is left of the budget;
      3. waiting requests are admitted first-come-first-served while the budget, the sequence cap and the
         free blocks allow: swapped ones get their blocks back, others allocate their tokens' blocks (prefix
         hits are not recomputed) and get a first chunk.
    A request's sequences (its ``n`` samples or beams) sample in the same step: when the budget cannot finish
    all of them, none is given its last token. Preemption frees a request's blocks and requeues it at the
    front: by recompute (its tokens are computed again when readmitted) or by swap (its computed blocks are
    copied to CPU slots first). Whatever ``add`` accepts, readmission can place: a request is accepted only
    if all its sequences fit the pool unshared.

    Async scheduling (the engine samples step N on the device while this schedules step N+1): a sequence
    whose last token is a ``PLACEHOLDER`` gets its slot like any other (the runner reads the id on the
    device); one whose placeholder is its final token (``last_inflight``) is not scheduled; a waiting request
    with a placeholder is not admitted until the id is known.

    Args:
        kv: the KV manager over the block pool.
        max_num_batched_tokens: the token budget of one forward.
        max_num_seqs: the cap on sequences in one forward.
        preemption_mode: "recompute" or "swap".
        eos_token_ids: the model's end-of-sequence ids.
        max_model_len: the longest sequence (prompt + output); None = unbounded.
    """

    def __init__(
        self,
        kv: KVManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        preemption_mode: str = "recompute",
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int | None = None,
    ):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.preemption_mode = preemption_mode
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_len = max_model_len if max_model_len else 1 << 62
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self._seqs: dict[int, tuple[Sequence, Request]] = {}  # every unfinished sequence by id
        self._swap_slots_to_release: list[Sequence] = []

    # ---- queue ------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        max_new_tokens = request.params.max_new_tokens
        for seq in request.seqs:
            seq.max_num_tokens = min(seq.num_prompt_tokens + max_new_tokens, self.max_len)
            self._seqs[seq.seq_id] = (seq, request)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, seq_id: int) -> tuple[Sequence, Request]:
        """The sequence and request of ``seq_id`` (an unfinished sequence)."""
        return self._seqs[seq_id]

    def finish_seq(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End one sequence (a stop string, a stop token, the length limit, an abort) and free its blocks."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.drop_inflight()  # a token sampled after this one (async scheduling) is discarded
        self.kv.free(seq)

    def finish(self, request: Request, reason: str | None = None) -> None:
        """End a request: its live sequences get ``reason`` (if given); every block and swap slot is freed."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        for seq in request.seqs:
            if reason is not None and seq.finish_reason is None:
                seq.finish_reason = reason
            seq.drop_inflight()
            self.kv.free(seq)
            self._seqs.pop(seq.seq_id, None)
        self.kv.release_swap_slots(request.seqs)
        request.status = Status.FINISHED
        request.metrics.finished_time = time.monotonic()

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def recover(self) -> None:
        """Bring every request back to a consistent state after a step failed part-way (an exception, Ctrl-C).

        Every block is freed and every unfinished request requeued for recompute (running ones first, in
        admission order); tokens sampled but not read back are dropped and will be sampled again. The prefix
        index is cleared: it may name blocks whose forward never ran.
        """
        self.kv.free_all()
        self.kv.reset_prefix_cache()
        requests = self.running + [r for r in self.waiting if r not in self.running]
        for request in requests:
            for seq in request.live_seqs:
                seq.drop_inflight()
                seq.last_inflight = False
                seq.num_computed = 0
            self.kv.release_swap_slots(request.seqs)
            request.status = Status.WAITING
        self._swap_slots_to_release = []
        self.running = []
        self.waiting = collections.deque(requests)

    # ---- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick the tokens of the next forward, give them slots, and describe the forward (see the class doc)."""
        step = StepBuilder()
        # 1. decode: one token per live sequence, oldest request first.
        computing: list[Request] = []
        running = self.running  # a request preempted here leaves this list (the same idx is then the next one)
        append_slots = self.kv.append_slots
        chunks = step.chunks  # every chunk of this phase is one decode token
        idx = 0
        while idx < len(running):
            request = running[idx]
            seqs = request.seqs
            if len(seqs) == 1:  # the common case (one sequence), inlined: no property, no list, no generic loop
                seq = seqs[0]
                if seq.finish_reason is not None or seq.last_inflight:
                    idx += 1  # nothing to compute (see ``_schedulable``)
                    continue
                end = len(seq.token_ids)
                if end - seq.num_computed != 1:
                    computing.append(request)
                    idx += 1
                    continue
                pairs = append_slots(seq, end)
                if pairs is None and not self._reserve(request, seqs, (end,), step):
                    continue  # preempted itself: the same idx is the next request
                if pairs:
                    step.copies.extend((src, dst, request) for src, dst in pairs)
                chunks.append((request, seq, 1))
                idx += 1
                continue
            seqs = _schedulable(request)
            if any(len(seq.token_ids) - seq.num_computed != 1 for seq in seqs):
                computing.append(request)
                idx += 1
                continue
            if not self._reserve(request, seqs, [len(seq.token_ids) for seq in seqs], step):
                continue  # this request was preempted (removed from running): the same idx is the next one
            for seq in seqs:
                chunks.append((request, seq, 1))
            idx += 1
        step.num_tokens = step.num_decode = len(chunks)
        budget = self.max_num_batched_tokens - step.num_tokens
        # 2. running requests still computing tokens (chunked prefill, recompute).
        for request in computing:
            if request.status is Status.RUNNING:  # not preempted in the meantime
                budget = self._schedule_chunks(request, budget, step)
        # 3. admit waiting requests, first come first served (nothing is preempted from here on).
        num_running_seqs = self._num_running_seqs() if self.waiting else 0
        while self.waiting and budget > 0:
            request = self.waiting[0]
            width = _width(request)
            if num_running_seqs + width > self.max_num_seqs:
                break
            if any(seq.num_inflight for seq in request.seqs):
                break  # preempted with a token in flight: readmitted once its id is known (next step)
            if not self._admit(request, step):
                break
            self.waiting.popleft()
            self.running.append(request)
            num_running_seqs += width
            request.status = Status.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
            budget = self._schedule_chunks(request, budget, step)
        if step.chunks and budget < 0:
            raise RuntimeError(f"bug in hf_paged: the step overran its token budget by {-budget}")
        self.kv.release_swap_slots(self._swap_slots_to_release)  # after this step's swap-outs took theirs
        self._swap_slots_to_release = []
        return step.build(self.kv)

    def _num_running_seqs(self) -> int:
        return sum(_width(r) for r in self.running)

    def _reserve(self, request: Request, seqs: list[Sequence], ends: list[int], step: "StepBuilder") -> bool:
        """Slots for ``seq.token_ids[:end]`` of each sequence, preempting newer requests when the pool is short.

        Returns False if ``request`` itself had to be preempted.
        """
        for seq, end in zip(seqs, ends, strict=True):
            while True:
                pairs = self.kv.append_slots(seq, end)
                if pairs is not None:
                    step.copies.extend((src, dst, request) for src, dst in pairs)
                    break
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim is request:
                    return False
        return True

    def _schedule_chunks(self, request: Request, budget: int, step: "StepBuilder") -> int:
        """The next chunk of each of ``request``'s sequences that is still computing; returns the budget left.

        A request still scoring its prompt (``prompt_logprobs``) returns a logits row per prompt token: its chunks
        are capped so that a step returns at most ``MAX_PROMPT_LOGPROB_ROWS`` of them (the rows' memory is bounded).
        """
        seqs = _schedulable(request)
        remaining = [len(seq.token_ids) - seq.num_computed for seq in seqs]
        limit = budget
        if request.needs_prompt_logprobs:
            limit = min(budget, MAX_PROMPT_LOGPROB_ROWS - step.num_prompt_logprob_tokens)
            if limit <= 0:
                return budget
        sizes = _chunk_sizes(remaining, limit)
        if len(seqs) > 1 and sizes != remaining:
            sizes = _chunk_sizes([r - 1 for r in remaining], limit)  # none samples until all can
        if not any(sizes):
            return budget
        ends = [seq.num_computed + n for seq, n in zip(seqs, sizes, strict=True)]
        if not self._reserve(request, seqs, ends, step):
            return budget
        if request.needs_prompt_logprobs:
            step.num_prompt_logprob_tokens += sum(sizes)
        for seq, n in zip(seqs, sizes, strict=True):
            if n:
                step.add(request, seq, n)
                budget -= n
                # Indexed now, so a prompt admitted later in this step hits them (the same forward computes
                # them first). A chunk scheduled here is never dropped: only newer requests are preempted later
                # in this step, and admissions reserve no slots. (Decode blocks are indexed in ``build``.)
                self.kv.cache(seq, seq.num_computed + n)
        return budget

    def _admit(self, request: Request, step: "StepBuilder") -> bool:
        """Blocks for every live sequence of ``request`` (all or nothing); swapped ones get their K/V back."""
        allocated = []
        # Tokens served from the prefix cache are not computed, so they would have no logits to score them.
        find_cached = not request.needs_prompt_logprobs
        for seq in request.live_seqs:
            result = self.kv.allocate(seq, find_cached)
            if result is None:
                for done, _ in allocated:
                    self.kv.free(done)
                return False
            allocated.append((seq, result))
        swapped = request.status is Status.SWAPPED
        for seq, result in allocated:
            if swapped:
                step.swap_in.extend(self.kv.swap_in_pairs(seq, result))
                seq.num_computed = max(seq.num_computed, result.num_cached_tokens)
            else:
                seq.num_computed = result.num_cached_tokens
                if request.metrics.num_preemptions == 0:
                    request.num_cached_tokens = result.num_cached_tokens
        if swapped:
            self._swap_slots_to_release.extend(request.live_seqs)
        return True

    def _preempt(self, request: Request, step: "StepBuilder") -> None:
        """Take all of ``request``'s blocks back and requeue it at the front of the waiting queue."""
        self.running.remove(request)
        self.num_preemptions += 1
        request.metrics.num_preemptions += 1
        # Its copy-on-write copies of this step never run: the runner copies after swapping out, so a destination
        # block would be saved before it is filled (swap its source instead) and filled after it is reused.
        pending = {dst: src for src, dst, owner in step.copies if owner is request}
        step.drop(request)
        seqs = request.live_seqs
        swap = self.preemption_mode == "swap" and self.kv.can_swap_out(seqs)
        if swap:
            step.swap_out.extend(self.kv.swap_out(seqs, pending))
        for seq in seqs:
            # Sampled tokens not computed yet stay in token_ids and are computed after readmission.
            self.kv.free(seq)
            if not swap:
                seq.num_computed = 0
        request.status = Status.SWAPPED if swap else Status.WAITING
        self.waiting.appendleft(request)
        step.preempted.append(request.request_id)

    # ---- results of a step ------------------------------------------------------------------------

    def add_placeholders(self, rows: list[Sequence]) -> None:
        """Async scheduling: row ``i``'s token, sampled on the device, is the next token of ``rows[i]``.

        Each sequence gets a ``PLACEHOLDER`` the next step's input reads from row ``i`` on the device;
        ``update_from_output`` fills it in once the id is on the host. A sequence that has ended since the step was
        scheduled (a step with structured outputs reads the previous one back first) gets none: its token is dropped.
        """
        for row, seq in enumerate(rows):
            if seq.finish_reason is not None:
                continue
            token_ids = seq.token_ids
            token_ids.append(PLACEHOLDER)
            seq.num_inflight += 1
            seq.sample_row = row
            seq.last_inflight = len(token_ids) >= seq.max_num_tokens  # prompt + max_new_tokens, or the context

    def update_from_output(
        self,
        rows: list[Sequence],
        token_ids: list[int],
        deferred: bool,
        token_time: float | None = None,
        logprobs: list[tuple[float, dict[int, float]] | None] | None = None,
    ) -> list[tuple[Request, Sequence]]:
        """Apply a step's sampled tokens: fork a prompt's ``n`` samples, check stops and lengths, free what ended.

        Args:
            rows: [num_rows] the sequence that sampled each row, in order; a prompt that forks into ``n`` samples
                gives ``n`` consecutive rows with the same sequence.
            token_ids: [num_rows] the sampled token of each row.
            deferred: the step's sequences hold placeholders for these tokens (async scheduling).
            token_time: ``time.monotonic()`` when the tokens reached the host (default: now). A deferred step is
                applied one forward after its tokens were sampled: the first-token time must not include it.
            logprobs: None when no row asked for logprobs; else [num_rows] ``(logprob of the token, {token_id:
                logprob} of the top ones incl. it)`` of each row that asked, None for the others.

        Returns:
            (request, sequence) of every token applied, in row order (sequences it finished included).
        """
        applied = []
        now = time.monotonic() if token_time is None else token_time
        get_entry, check_stop, finished, eos = self._seqs.get, self._check_stop, Status.FINISHED, self.eos_token_ids
        next_row = 0  # rows before it were applied with their prompt's fork
        for j, (seq, token) in enumerate(zip(rows, token_ids, strict=True)):
            if j < next_row:
                continue
            entry = get_entry(seq.seq_id)
            if entry is None or entry[1].status is finished or seq.finish_reason is not None:
                continue  # aborted, or ended by the previous step's token: this one is discarded
            request = entry[1]
            if not request.forked:  # a prompt's first tokens: it forks into its n samples, one row each
                next_row = j + request.params.n
                children = self._fork_samples(request, seq, request.params.n)
                for row, child in zip(range(j, next_row), children, strict=True):
                    child_ids = child.token_ids
                    if deferred:
                        child_ids[len(child_ids) - child.num_inflight] = token_ids[row]  # the oldest placeholder
                        child.num_inflight -= 1
                    else:
                        child_ids.append(token_ids[row])
                    check_stop(request, child, token_ids[row], logprobs[row] if logprobs is not None else None, now)
                    applied.append((request, child))
                continue
            # The common case, one row for one sequence: the full check only for a token that can end it or count
            # (a stop id, the length limit, the request's first token, logprobs), with the fewest lookups.
            ids = seq.token_ids
            if deferred:
                ids[len(ids) - seq.num_inflight] = token  # the oldest placeholder
                seq.num_inflight -= 1
            else:
                ids.append(token)
            if (  # every condition _check_stop acts on: keep the two in step
                logprobs is not None
                or token in eos
                or len(ids) - seq.num_inflight >= seq.max_num_tokens
                or request.metrics.first_token_time is None
                or token in request.params.stop_token_ids
            ):
                check_stop(request, seq, token, logprobs[j] if logprobs is not None else None, now)
            applied.append((request, seq))
        return applied

    def _fork_samples(self, request: Request, seq: Sequence, n: int) -> list[Sequence]:
        """After the prompt: ``seq`` becomes the first of ``n`` samples; the others share its blocks."""
        children = [seq]
        for _ in range(n - 1):
            child = seq.fork()
            self.kv.fork(seq, child)
            self._seqs[child.seq_id] = (child, request)
            children.append(child)
        request.seqs = children
        request.forked = True
        return children

    def _check_stop(
        self, request: Request, seq: Sequence, token: int, logprobs: tuple[float, dict[int, float]] | None, now: float
    ) -> None:
        """Account for ``token``, just placed in ``seq``: logprobs (``update_from_output``'s), stop token, length.

        ``update_from_output`` calls it for a plain row only when one of these can apply (its filter lists them).
        """
        params = request.params
        if logprobs is not None:
            seq.cumulative_logprob += logprobs[0]
            seq.logprobs.append(logprobs[1])
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        num_known = len(seq.token_ids) - seq.num_inflight  # seq.num_known_tokens
        num_out = num_known - seq.num_prompt_tokens  # up to and including this token
        if token in self.eos_token_ids and not params.ignore_eos and num_out >= params.min_tokens:
            self.finish_seq(seq, "stop")
        elif token in params.stop_token_ids and num_out >= params.min_tokens:
            self.finish_seq(seq, "stop", token)
        elif num_out >= params.max_new_tokens or num_known >= self.max_len:
            self.finish_seq(seq, "length")

    def apply_beam_step(self, request: Request, result: BeamStep) -> None:
        """Replace ``request``'s beams by the step's new beams (forks of their parents, plus their token)."""
        if request.is_finished:
            return
        beams = request.live_seqs
        new_beams = []
        if not result.done:
            for parent_idx, token, score in result.new_beams:
                parent = beams[parent_idx]
                child = parent.fork()
                self.kv.fork(parent, child)
                self._seqs[child.seq_id] = (child, request)
                child.token_ids.append(token)
                child.cumulative_logprob = score
                new_beams.append(child)
        request.seqs = new_beams
        request.forked = True
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.monotonic()
        for beam in beams:
            self.kv.free(beam)
            self._seqs.pop(beam.seq_id, None)


def _schedulable(request: Request) -> list[Sequence]:
    """Live sequences that still compute tokens (one whose final token is in flight does not)."""
    live = request.live_seqs
    if len(live) == 1:
        return [] if live[0].last_inflight else live
    return [seq for seq in live if not seq.last_inflight]


def _chunk_sizes(remaining: list[int], budget: int) -> list[int]:
    """Greedy chunk sizes for sequences with ``remaining`` tokens each, within ``budget``."""
    sizes = []
    for r in remaining:
        n = max(0, min(r, budget))
        sizes.append(n)
        budget -= n
    return sizes


def _width(request: Request) -> int:
    """Sequences the request runs at once: its n samples or beams, once forked."""
    params = request.params
    if params.n == 1 and params.beam_width == 1 and len(request.seqs) == 1:  # the common case
        return 1
    return max(len(request.live_seqs), params.n, params.beam_width)
