"""The step pipeline of ContinuousBatcher: schedule, run, sample, then apply the tokens, as one transaction.

One step, in order: the scheduler picks the tokens of the next forward (one plain ``SchedulerOutput``); the runner
computes them in one flat forward; ``_launch`` queues the sampling (or hands beam rows to the beam search) and the copy
of the tokens to the host, and the prompt tokens asked for are scored beside it (hf_paged.engine.prompt_logprobs);
``_process`` reads them back and applies them through the scheduler (``update_from_output``: stops, lengths, forks,
frees), then stop strings and text (hf_paged.engine.outputs) and structured-output matchers
(hf_paged.engine.structured).

Async scheduling: ``_step_once`` schedules and queues step N+1 before it processes step N, so the device never
waits for the host's bookkeeping; a token of step N reaches step N+1's input on the device, never through the host.
A step with structured-output rows reads the previous step's tokens back as soon as its own forward is queued: its
masks need them on the host. Its matchers read them, then a worker thread fills the masks while the device runs that
forward and the step loop makes the previous step's text and schedules the next step; the next step queues this
one's sampling, before its own forward (hf_paged.engine.grammar_masks).
"""

import logging
import time

import torch

from hf_paged.core.transfer import to_device
from hf_paged.engine import prompt_logprobs
from hf_paged.engine.request import Request
from hf_paged.engine.request import Sequence as Seq
from hf_paged.engine.sampler import plan_rows
from hf_paged.engine.sampling_rows import Launched, SamplingRows, to_host
from hf_paged.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class StepPipeline:
    """The step half of ``ContinuousBatcher`` (a base class: every attribute below is set by its constructor).

    Reads ``scheduler``, ``runner``, ``sampler``, ``detokenizer``, ``structured`` (StructuredDecoding),
    ``requests``, ``eos_token_ids``, ``async_scheduling``, ``_sync`` (RankSync), ``_metrics`` (MetricsRecorder) and
    ``_apply_aborts``; owns ``_inflight`` (the step queued last, not processed yet), ``_rows`` (the last step's
    sampling rows while reusable) and ``_unreported`` (requests finished outside a step, reported by the next one).
    """

    def _drain(self) -> None:
        """Process the step in flight, if any (waits for the device)."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            if launched.sampling is not None:
                self._sample(launched)
            self._process(launched, self._unreported)  # reported by the next step

    def _run_step(self) -> dict[str, Request]:
        """One forward, as a transaction; returns the requests that progressed, finished or were aborted.

        Async scheduling: step N+1 is scheduled and queued on the device before step N's sampled tokens are
        read back and processed, so the device never waits for the host's bookkeeping (see ``_launch``).
        """
        start = time.perf_counter()
        try:
            return self._step_once()
        except BaseException:
            self._recover()
            raise
        finally:
            self._metrics.elapsed_s += time.perf_counter() - start

    def _recover(self) -> None:
        """After a failed step: the scheduler requeues every request; those it left with no live sequence end."""
        self._inflight = None
        self._rows = None  # every sequence is requeued: nothing of the failed step's rows is kept
        self.structured.masks.cancel()  # masks being made: the worker writes into a buffer the next step reuses
        self.scheduler.recover()
        for request in list(self.requests.values()):
            if request.is_finished:
                continue
            for seq in request.seqs:  # stop strings and grammars of tokens applied by the failed step
                if seq.num_detokenized < len(seq.output_token_ids):
                    self._end_on_stop_string(request, seq)
                if request.grammar is not None:
                    self._advance_grammar(request, seq)
            if not request.live_seqs:
                self.scheduler.finish(request)
                self._unreported[request.request_id] = request

    def _step_once(self) -> dict[str, Request]:
        self._apply_aborts()
        # Reports accumulate in self._unreported and leave it only when the step returns: a step that fails after
        # finishing a request (say, in the step it processes after the previous one) loses no report.
        touched = self._unreported
        if self.structured.waiting:  # requests whose grammar compiled join the queue (hf_paged.engine.structured)
            idle = self._inflight is None and not self.scheduler.has_unfinished()
            for request in self.structured.release(self.scheduler.add, idle):
                self.scheduler.finish(request, "abort")
                touched[request.request_id] = request
        sched = self.scheduler.schedule()
        for request_id in sched.preempted:
            touched[request_id] = self.requests[request_id]
        prev, launched = self._inflight, None
        if prev is not None and prev.sampling is not None:  # its masks were made while this step was scheduled
            self._sample(prev)
        if not sched.is_empty:
            self._sync.check_schedule(sched)
            pool = self.pool
            if pool.num_blocks - pool.num_free_blocks > self._metrics.peak_used_blocks:
                self._metrics.observe_pool(pool.stats)
            logits = self.runner.execute(sched, prev.token_ids if prev is not None else None)
            self._metrics.num_steps += 1
            self._metrics.num_computed_tokens += sched.num_batched_tokens
            num_sampling = len(sched.sample_idx)
            launched = self._launch(sched, logits[:num_sampling] if sched.prompt_logprob_spans else logits, prev,
                                    touched)  # fmt: skip
            if sched.prompt_logprob_spans:  # the rows past the sampling ones score prompt tokens
                launched.prompt_logprobs = prompt_logprobs.score(sched, logits[num_sampling:], self.requests)
        else:
            self.runner.execute(sched)  # block movements and table diffs only
            if prev is None and not touched and self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError(
                    "bug in hf_paged: requests are waiting but none can be admitted into an empty pool "
                    f"({self.pool.num_free_blocks}/{self.pool.num_blocks} blocks free)"
                )
        if prev is not None and not prev.processed:  # the previous step: its tokens are needed by now
            self._inflight = None
            self._process(prev, touched)
        if launched is not None:
            if launched.deferred:
                self._inflight = launched
            else:
                self._process(launched, touched)
        self._unreported = {}
        return touched

    def _launch(
        self,
        sched: SchedulerOutput,
        logits: torch.Tensor,
        prev: Launched | None = None,
        touched: dict[str, Request] | None = None,
    ) -> Launched:
        """Queue the sampling of one step and the copy of its tokens to the host; wait for nothing.

        Logits row ``r`` belongs to sequence ``sched.seq_ids[sched.sample_idx[r]]``; the sampler's rows are an
        explicit map into them (a prompt that forks into ``n`` samples gives its row ``n`` times; beam rows go
        to the beam search). The step is *deferred* (processed after the next step is queued) when async
        scheduling is on and every sampling row is a plain sample: no beam search, no prompt that forks into
        ``n`` samples, no penalty or ``min_tokens`` (they need the previous token on the host). Structured-output
        rows get their grammar's mask, -inf for the tokens it rules out, before the sampler (logprobs included). The
        masks need the tokens of the step queued before (``prev``, deferred): they are read back first (its
        requests go to ``touched``), and its text is made while a worker makes the masks. A deferred step with
        masks leaves its sampling (``Launched.sampling``) to the next step, which queues it once it is scheduled.
        """
        rows = self._rows
        if rows is None or rows.seq_ids != sched.seq_ids or rows.sample_idx != sched.sample_idx:
            # Sequences that finished, were aborted or preempted leave rows behind: keep the others' (no rebuild).
            rows = (rows.take(sched) if rows is not None else None) or self._sampling_rows(sched)
            self._rows = rows if rows.reusable else None
        launched = Launched(deferred=self.async_scheduling and rows.deferrable, rows=rows.seqs,
                             requests=rows.requests, beam_rows=rows.beam_rows)  # fmt: skip
        if rows.beam_rows:  # read after this step is processed: a copy (a graph's logits are its output buffer)
            launched.logits = logits.to(torch.float32, copy=True)
        if rows.row_idx:
            identity = rows.identity and len(rows.row_idx) == logits.shape[0]
            row_logits = logits if identity else logits[to_device(rows.row_idx, torch.int64, logits.device)]
            masks = None
            if rows.constrained:  # in place: a captured graph's logits buffer is rewritten by its next replay
                applied = None
                if prev is not None and not prev.processed:  # the masks need its tokens
                    self._inflight = None
                    applied = self._read_back(prev, touched)
                structured = self.structured
                masks, ends = structured.masks.start(row_logits, rows.seqs, rows.requests, rows.constrained,
                                                     structured.grammar_vocab, launched.deferred)  # fmt: skip
                if ends:
                    self._end_grammars(ends, touched)
                if applied is not None:  # its text, while the worker fills the masks
                    try:
                        self._apply_text(prev, applied, touched, masks.seq_ids)
                    except BaseException:
                        self.structured.masks.cancel()
                        raise
            launched.sampling = rows, row_logits, masks
            if masks is None or not launched.deferred:
                self._sample(launched)
        if launched.deferred:
            self.scheduler.add_placeholders(launched.rows)
        return launched

    def _sample(self, launched: Launched) -> None:
        """Queue a launched step's sampling (after its masks, if it has any) and the copy of its tokens to the host."""
        rows, row_logits, masks = launched.sampling
        launched.sampling = None
        if masks is not None:
            self.structured.masks.finish(masks)
        if rows.plan is None or rows.plan.device_type != row_logits.device.type:
            rows.plan = plan_rows(rows.params, rows.generators, row_logits.device)
        out = self.sampler(row_logits, rows.params, rows.outputs, rows.prompts, rows.generators, self.eos_token_ids,
                           rows.plan)  # fmt: skip
        self._sync.broadcast(out.token_ids, out.logprobs, out.top_logprobs, out.top_token_ids)
        launched.token_ids = out.token_ids
        launched.host = [to_host(t) for t in (out.token_ids, out.logprobs, out.top_logprobs, out.top_token_ids)]
        if out.token_ids.is_cuda:
            launched.event = torch.cuda.Event()
            launched.event.record()
        else:  # the tokens are on the host now, though a deferred step applies them after the next forward
            launched.token_time = time.monotonic()

    def _sampling_rows(self, sched: SchedulerOutput) -> SamplingRows:
        """The sampler's rows of a step, rebuilt (see ``_launch``)."""
        return SamplingRows.build(sched, self.scheduler.get)

    def _process(self, launched: Launched, touched: dict[str, Request]) -> None:
        """Read a launched step's tokens back (the one wait on the device) and apply them."""
        self._apply_text(launched, self._read_back(launched, touched), touched)

    def _read_back(self, launched: Launched, touched: dict[str, Request]) -> list[tuple[Request, Seq]]:
        """The first half of ``_process``: the tokens into their sequences; returns the (request, sequence) pairs
        that got one."""
        launched.processed = True
        if launched.prompt_logprobs is not None:  # first: a prompt whose last chunk this is forks below
            launched.prompt_logprobs.apply(self.detokenizer.tokenizer)
        applied = []
        if launched.host is not None:
            if launched.event is not None:
                launched.event.synchronize()
                launched.token_time = time.monotonic()
            tokens, lps, top_lps, top_ids = (t.tolist() if t is not None else None for t in launched.host)
            logprobs = None  # None: no row asked for logprobs (the sampler computes none then)
            if lps is not None:
                logprobs = []
                for row, request in enumerate(launched.requests):
                    k = request.params.logprobs
                    entry = None
                    if k is not None:
                        top = dict(zip(top_ids[row][:k], top_lps[row][:k], strict=True))
                        entry = lps[row], {tokens[row]: lps[row]} | top  # the sampled token first, then the top k
                    logprobs.append(entry)
            applied = self.scheduler.update_from_output(launched.rows, tokens, launched.deferred, launched.token_time,
                                                        logprobs)  # fmt: skip
        self._metrics.num_generated_tokens += len(applied)
        return applied

    def _apply_text(
        self, launched: Launched, applied: list[tuple[Request, Seq]], touched: dict[str, Request], skip=frozenset()
    ) -> None:
        """The second half of ``_process``: text and stop strings, grammars (but those of the sequences in ``skip``,
        whose matchers have read their token and are being read by the mask worker), beam steps, the requests that
        ended."""
        # A request can lose its last live sequence only here: one of its rows ended (a stop, the length, a stop
        # string) or its beam search did. Those are the requests to finish (every other touched one either has a
        # live sequence or was finished already: aborts, preemptions, the step processed before this one).
        ended: dict[str, Request] = {}
        detokenize = self.detokenizer.tokenizer is not None  # without one: no text to make, no stop string to find
        for request, seq in applied:
            touched[request.request_id] = request
            if detokenize:
                self._end_on_stop_string(request, seq)
            if request.grammar is not None and seq.seq_id not in skip:
                self._advance_grammar(request, seq)
            if seq.finish_reason is not None:
                ended[request.request_id] = request
        for request_id, rows in launched.beam_rows.items():
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._beam_step(request, launched.logits[to_device(rows, torch.int64, launched.logits.device)])
                touched[request_id] = request
                ended[request_id] = request
        for request in ended.values():
            if not request.is_finished and not request.live_seqs:
                self.scheduler.finish(request)

    def _end_grammars(self, ends: list, touched: dict[str, Request]) -> None:
        """End the sequences whose grammar ended with the token its matcher just read (``MaskFiller.start``)."""
        for request, seq, reason, token in ends:
            if seq.finish_reason is not None or request.is_finished:
                continue
            if reason == "abort":
                logger.error("request %s: the sampled token %d does not follow its structured_output; the sequence is "
                             "ended", request.request_id, token)  # fmt: skip
            self.scheduler.finish_seq(seq, reason)
            seq.grammar_state = None
            touched[request.request_id] = request
            if not request.live_seqs:
                self.scheduler.finish(request)

    def _advance_grammar(self, request: Request, seq: Seq) -> None:
        """Feed ``seq``'s new tokens to its structured-output matcher; end it where the grammar ends it."""
        end = self.structured.advance(request, seq)
        if end is not None:
            self.scheduler.finish_seq(seq, end)

    def _end_on_stop_string(self, request: Request, seq: Seq) -> None:
        stop = self.detokenizer.update(request, seq)
        if stop is not None:
            if seq.is_finished:  # it also reached its length limit: the stop string wins
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.scheduler.finish_seq(seq, "stop", stop)

    def _beam_step(self, request: Request, logits: torch.Tensor) -> None:
        params = request.params
        beams = request.live_seqs
        if logits.shape[0] != len(beams):
            raise RuntimeError(f"bug in hf_paged: {logits.shape[0]} logits rows for {len(beams)} live beams")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        num_out = beams[0].num_output_tokens
        masked = sorted(stop_ids | set(self.eos_token_ids)) if num_out < params.min_tokens else []
        state = request.beam_state
        saved, old_seqs = (list(state.finished), state.improvable), request.seqs
        try:
            result = state.step(logits, [b.cumulative_logprob for b in beams], [b.output_token_ids for b in beams],
                                stop_ids, masked)  # fmt: skip
            if result.done:
                request.finished_seqs = [self._hypothesis(request, hyp) for hyp in state.finished[: params.n]]
            self.scheduler.apply_beam_step(request, result)
        except BaseException:
            if request.seqs is old_seqs:  # the beams did not move: the step is redone after recovery
                state.finished, state.improvable = saved
                request.finished_seqs = []
            raise
        self._metrics.num_generated_tokens += 1  # one more output position for the request (whatever its beams)

    def _hypothesis(self, request: Request, hyp) -> Seq:
        """A finished beam hypothesis as an output sequence (not in the pool)."""
        seq = Seq(request.prompt_token_ids + hyp.token_ids, len(request.prompt_token_ids))
        seq.cumulative_logprob = hyp.sum_logprobs
        seq.finish_reason, seq.stop_reason = hyp.finish_reason, hyp.stop_reason
        seq.text = self.detokenizer.decode(request, hyp.token_ids) or ""
        return seq
