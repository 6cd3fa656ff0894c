"""Sequences' grammar matchers and a step's token masks (structured outputs; hf_paged.engine.structured).

``SeqMatcher``: one sequence's xgrammar matcher and how many of its output tokens it has read.

``MaskFiller``: the masks of a step's constrained rows, in two calls around the host's other work of the step:

1. ``start`` (step loop): each row's matcher reads the token the previous step sampled, just read back (xgrammar's
   batch call, on its threads); a matcher further behind (a new, forked or resumed sequence) is replayed. It returns
   the sequences whose grammar that token ended: "stop" when the grammar has terminated (it accepted EOS: with
   ``ignore_eos`` the scheduler does not end the sequence on EOS, the grammar does), "abort" when it refused the
   token (never with the mask applied; logged by the caller). Then a worker thread fills the other rows of the
   bitmask (xgrammar's batch fill, which releases the GIL), while the step loop makes the previous step's text and
   schedules the next step. ``start`` returns once the worker holds the job: a thread that waits for the GIL
   while the step loop runs Python would wait for the interpreter's switch interval (5 ms), longer than the text
   and the schedule take.
2. ``finish``: waits for the worker, sets every bit of the rows whose sequence has ended since ``start`` (a stop
   string, an abort; their token is dropped), copies the mask up and applies it to the logits in one launch.
"""

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from hf_paged.engine.bitmask import MaskStaging, apply_bitmask, import_xgrammar

if TYPE_CHECKING:
    from hf_paged.engine.request import Request, Sequence

_BATCH_MIN_ROWS = 16  # below this, a step's matchers run serially: the batch call's thread hand-off costs more


def _mask_threads() -> int:
    """Threads of the batch mask fill: the cores this process may run on, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores))


class SeqMatcher:
    """One sequence's grammar matcher and how many of its output tokens it has read (``num_accepted``).

    Invariant: the matcher has read exactly ``seq.output_token_ids[:num_accepted]``, or rejected the last of them
    (``rejected``). Outputs only grow, except when a failed step's tokens are dropped: ``sync`` then replays.
    """

    def __init__(self, grammar):
        self.grammar = grammar
        self.matcher = grammar.new_matcher()
        self.num_accepted = 0
        self.rejected: int | None = None  # a token the grammar refused (then the sequence is ended)

    @classmethod
    def sync(cls, request: "Request", seq: "Sequence") -> "SeqMatcher":
        """``seq``'s matcher, made or replayed as needed, having read every known output token of ``seq``."""
        state = seq.grammar_state
        start, end = seq.num_prompt_tokens, len(seq.token_ids) - seq.num_inflight
        if state is None or state.num_accepted > end - start:
            state = seq.grammar_state = cls(request.grammar)
        if state.rejected is None:
            token_ids, matcher = seq.token_ids, state.matcher
            for i in range(start + state.num_accepted, end):
                if not matcher.accept_token(token_ids[i]):
                    state.rejected = token_ids[i]
                    break
                state.num_accepted += 1
        return state


class StepMasks:
    """One step's masks between ``MaskFiller.start`` and ``finish``."""

    def __init__(self, logits, seqs, rows, bitmask, row_index, every_row, grammar_vocab):
        self.logits = logits  # [num_rows, vocab_size]: the sampler's rows, masked in place by finish
        self.seqs, self.rows = seqs, rows  # rows: the constrained ones, ascending
        self.bitmask, self.row_index = bitmask, row_index  # host staging (MaskStaging)
        self.every_row = every_row  # every logits row is constrained: the kernel takes no row indices
        self.grammar_vocab = grammar_vocab
        self.matchers: list = []  # the matchers to fill, with their rows
        self.fill_rows: list[int] = []
        self.copies: list[tuple[int, int]] = []  # (row, source row): a prompt forking into n samples
        self.seq_ids: set[int] = set()  # the sequences whose matchers the worker reads
        self.future: Future | None = None


class MaskFiller:
    """The engine's mask work: the staging buffers, xgrammar's batch matcher and one worker thread.

    Args:
        vocab_size: the model's logits width.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._staging = MaskStaging()
        self._batch = None  # xgrammar's BatchGrammarMatcher (a thread pool), made by the first batched call
        self._stop_ids: frozenset[int] | None = None  # the tokens that end a grammar (its tokenizer info's)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-paged-masks")
        self._current: StepMasks | None = None  # started, not finished or cancelled

    def _batcher(self, num_matchers: int):
        """xgrammar's batch matcher when a step has enough matchers to share out over threads, else None (serial).

        A JSON-schema mask costs ~20-30 µs a row: 256 constrained rows take ~6 ms of host time a step serially, more
        than a small model's forward; the batch call fills them on a pool of threads.
        """
        if num_matchers < _BATCH_MIN_ROWS:
            return None
        if self._batch is None:
            xgr = import_xgrammar()
            if not hasattr(xgr, "BatchGrammarMatcher"):  # older xgrammar: serial
                return None
            # A few threads (not xgrammar's "auto": half the host's cores, 32 and more on a GPU server): the fill
            # shares the host with the step loop and with other processes, and a mask is tens of microseconds.
            self._batch = xgr.BatchGrammarMatcher(max_threads=_mask_threads())
        return self._batch

    def start(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size]: the sampler's rows
        seqs: list,  # [num_rows] the Sequence of each row (a forking prompt: n rows of one sequence)
        requests: list,  # [num_rows] the Request of each row
        rows: list[int],  # the constrained rows, ascending
        grammar_vocab: int,  # the ids the grammars know
        background: bool,  # fill on the worker thread (else here, now)
    ) -> tuple[StepMasks, list[tuple["Request", "Sequence", str, int]]]:
        """Begin the masks of a step's constrained rows (the module docstring); ``finish`` applies them.

        Returns:
            The job, and the (request, sequence, "stop" or "abort", token) of each sequence whose grammar ended
            with the token it just read (its row is left unmasked: the token it samples is dropped).
        """
        xgr = import_xgrammar()
        if logits.shape[1] != self.vocab_size:
            raise RuntimeError(
                f"bug in hf_paged: logits have {logits.shape[1]} columns, the grammars {self.vocab_size}"
            )
        shape = tuple(xgr.get_bitmask_shape(logits.shape[0], grammar_vocab))
        every_row = len(rows) == logits.shape[0]
        bitmask, row_index = self._staging.host(shape, 0 if every_row else len(rows), logits.device)
        job = StepMasks(logits, seqs, rows, bitmask, row_index, every_row, grammar_vocab)
        accepts, tokens, accept_rows = [], [], []  # matchers one token behind, that token, their rows
        prev_seq, prev_row = None, -1
        for row in rows:
            seq = seqs[row]
            if seq is prev_seq:  # a prompt forking into n samples: n rows of one state
                job.copies.append((row, prev_row))
                continue
            if seq.finish_reason is not None:  # ended by the step read back just before: its token is dropped
                bitmask[row] = -1
                continue
            if seq.num_inflight:  # its last token is still on the device: the mask would miss it
                raise RuntimeError(
                    f"bug in hf_paged: sequence {seq.seq_id} has a structured output and tokens in flight"
                )
            state = seq.grammar_state
            num_out = len(seq.token_ids) - seq.num_prompt_tokens
            if state is not None and state.rejected is None and state.num_accepted == num_out - 1:
                accepts.append(state)  # the common case: the token just read back, accepted in one batch below
                tokens.append(seq.token_ids[-1])
                accept_rows.append(row)
            elif state is None or state.num_accepted != num_out:
                state = SeqMatcher.sync(requests[row], seq)
                if state.matcher.is_terminated():
                    raise RuntimeError(f"bug in hf_paged: sequence {seq.seq_id} samples after its grammar ended")
            if state.rejected is not None:
                raise RuntimeError(f"bug in hf_paged: sequence {seq.seq_id} samples after its grammar refused a token")
            job.matchers.append(state.matcher)
            job.fill_rows.append(row)
            job.seq_ids.add(seq.seq_id)
            prev_seq, prev_row = seq, row
        ends = self._accept(job, accepts, tokens, accept_rows, requests) if accepts else []
        self._current = job
        if background:
            started = threading.Event()
            job.future = self._worker.submit(self._run, job, started)
            started.wait()  # releases the GIL to the worker until it is in the fill (the module docstring)
        else:
            self._fill(job)
        return job, ends

    def _accept(self, job: StepMasks, accepts: list, tokens: list[int], accept_rows: list[int], requests) -> list:
        """Feed each matcher one behind its token; leave the rows whose grammar ended out of the fill."""
        matchers = [state.matcher for state in accepts]
        batch = self._batcher(len(matchers))
        if batch is not None:
            accepted = batch.batch_accept_token(matchers, tokens)
        else:
            accepted = [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]
        if self._stop_ids is None:
            self._stop_ids = frozenset(matchers[0].stop_token_ids)
        stop = self._stop_ids
        ends = []
        if False not in accepted:  # the usual answer: one scan (in C for xgrammar's array)
            for state in accepts:
                state.num_accepted += 1
            ended = [(i, "stop") for i, token in enumerate(tokens) if token in stop]  # accepted EOS: terminated
        else:
            ended = []
            for i, (state, ok) in enumerate(zip(accepts, accepted, strict=True)):
                if ok:
                    state.num_accepted += 1
                    if tokens[i] in stop:
                        ended.append((i, "stop"))
                else:
                    state.rejected = tokens[i]
                    ended.append((i, "abort"))
        if ended:  # a terminated matcher has no next token to mask (xgrammar refuses): out of the fill
            gone = set()
            for i, reason in ended:
                row = accept_rows[i]
                ends.append((requests[row], job.seqs[row], reason, tokens[i]))
                job.bitmask[row] = -1
                gone.add(row)
            kept = [(m, r) for m, r in zip(job.matchers, job.fill_rows, strict=True) if r not in gone]
            job.matchers, job.fill_rows = [m for m, _ in kept], [r for _, r in kept]
        return ends

    def _run(self, job: StepMasks, started: threading.Event) -> None:
        started.set()
        self._fill(job)

    def _fill(self, job: StepMasks) -> None:
        """The fill (on the worker thread: xgrammar's batch call releases the GIL)."""
        batch = self._batcher(len(job.matchers))
        if batch is not None:
            batch.batch_fill_next_token_bitmask(job.matchers, job.bitmask, indices=job.fill_rows)
        else:
            for matcher, row in zip(job.matchers, job.fill_rows, strict=True):
                matcher.fill_next_token_bitmask(job.bitmask, row)

    def finish(self, job: StepMasks) -> None:
        """Apply the masks to ``job.logits`` (one launch)."""
        self._current = None
        if job.future is not None:
            job.future.result()  # the worker's error, if any, is raised here
        bitmask, seqs = job.bitmask, job.seqs
        for row in job.fill_rows:  # ended while the masks filled (a stop string, an abort): the token is dropped
            if seqs[row].finish_reason is not None:
                bitmask[row] = -1
        for row, source in job.copies:
            bitmask[row] = bitmask[source]
        if not job.every_row:  # rows of the other requests stay unfilled: the indices keep the kernel off them
            job.row_index.copy_(torch.tensor(job.rows, dtype=torch.int32))
        bitmask, row_index = self._staging.upload(bitmask, job.row_index, job.logits.device)
        apply_bitmask(job.logits, bitmask, job.grammar_vocab, None if job.every_row else row_index)

    def cancel(self) -> None:
        """Drop the masks started and not finished, if any (a failed step): wait for the worker, which writes into a
        buffer the next step reuses."""
        job, self._current = self._current, None
        if job is not None and job.future is not None:
            try:
                job.future.result()
            except Exception:  # noqa: BLE001 - the step failed already; its masks are not needed
                pass
