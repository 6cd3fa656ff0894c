"""Requests, their sequences, and what the engine returns for them.

A request is one prompt with its SamplingParams; it owns a group of sequences (block-pool sequences):
one while the prompt is computed, then ``n`` parallel samples or ``beam_width`` beams that fork the
prompt's blocks (copy-on-write). The scheduler admits, runs and preempts a request as a whole.
"""

import enum
import itertools
import time
from dataclasses import dataclass, field

from hf_paged.engine.params import SamplingParams

_seq_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks (new, or preempted by recompute)
    SWAPPED = "swapped"  # queued; its blocks are in CPU swap space
    RUNNING = "running"  # holds blocks; scheduled every step
    FINISHED = "finished"


PLACEHOLDER = -1  # a token sampled on the device whose id has not reached the host yet


class Sequence:
    """One token stream in the block pool: the prompt plus what it has generated.

    Invariant: ``num_computed <= len(token_ids)``; the K/V of ``token_ids[:num_computed]`` are in the pool
    (or in swap space while swapped). Tokens past ``num_computed`` are computed by the next forwards.

    Async scheduling: the last ``num_inflight`` (0-2) entries of ``token_ids`` are ``PLACEHOLDER``s for
    tokens sampled by steps whose results are not processed yet; the oldest one is resolved first.
    ``sample_row`` is the row of the latest such step's sampled-token tensor that holds this sequence's
    token (the next forward reads its input id from there, on the device). ``last_inflight``: the
    newest placeholder is this sequence's last token (``max_new_tokens`` or the context end): the
    scheduler gives it no more slots.

    ``max_num_tokens``: the length at which the sequence ends (prompt + ``max_new_tokens``, capped by the
    model's context), set by ``Scheduler.add`` (which knows the context) and copied by ``fork``; None until
    then. It lets the per-step paths test the length limit with one compare.
    """

    def __init__(self, token_ids: list[int], num_prompt_tokens: int):
        self.seq_id = next(_seq_ids)
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.max_num_tokens: int | None = None  # set by Scheduler.add (see the class doc)
        self.num_computed = 0
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []  # per output token: {token_id: logprob} incl. alternatives
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""  # detokenized output so far (with a tokenizer)
        self.swap_table: list[int] | None = None  # CPU swap slots per logical block while swapped
        self.num_inflight = 0
        self.sample_row = -1
        self.last_inflight = False
        self.num_hashed_blocks = 0  # leading full blocks the pool has hashed (kept by the KV manager)
        self.num_detokenized = 0  # output tokens whose text and stop strings were checked (outputs.Detokenizer)
        self.detok_state = None  # the incremental decoder of outputs.Detokenizer (copied on fork)
        # grammar_masks.SeqMatcher of a constrained request's sequence, made from its tokens on first use (a fork
        # starts without one and replays its output: no matcher state is copied)
        self.grammar_state = None

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens whose ids are known (placeholders excluded)."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_inflight]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, placeholders included."""
        return len(self.token_ids) - self.num_prompt_tokens

    def drop_inflight(self) -> None:
        """Forget unresolved placeholders (the sequence finished: their tokens are discarded)."""
        if self.num_inflight:
            del self.token_ids[-self.num_inflight :]
            self.num_inflight = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host (all but the trailing placeholders)."""
        return len(self.token_ids) - self.num_inflight

    def fork(self) -> "Sequence":
        """A new sequence with this one's tokens and progress (the scheduler forks its blocks in the pool)."""
        if self.num_inflight:
            raise RuntimeError("bug in hf_paged: a sequence with tokens in flight cannot be forked")
        child = Sequence(list(self.token_ids), self.num_prompt_tokens)
        child.max_num_tokens = self.max_num_tokens
        child.num_computed = self.num_computed
        child.num_hashed_blocks = self.num_hashed_blocks
        child.num_detokenized = self.num_detokenized
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = list(self.logprobs)
        child.text = self.text
        if self.detok_state is not None:
            child.detok_state = self.detok_state.fork()  # an independent stream from the same point
        return child


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


class Request:
    """A prompt, its sampling parameters and its group of sequences."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        # The sampler needs the output so far (penalties, min_tokens): such a step cannot run ahead (async).
        self.needs_history = (
            params.min_tokens > 0
            or params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self.status = Status.WAITING
        self.seqs = [Sequence(list(prompt_token_ids), len(prompt_token_ids))]
        self.finished_seqs: list[Sequence] = []  # beam search: finished hypotheses (not in the pool)
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.generator = None  # torch.Generator for seeded sampling, set by the engine
        self.forked = params.n == 1 and params.beam_width == 1  # True once the n samples / beams exist
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        # params.prompt_logprobs: entry i scores prompt token i (entry 0 is None: nothing comes before it); filled in
        # prompt order as the forwards that compute the prompt are processed (hf_paged.engine.prompt_logprobs)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        self.beam_state = None  # hf_paged.engine.beam_search.BeamState of a beam-search request
        self.grammar = None  # hf_paged.engine.structured.RequestGrammar of a request with structured_output
        # Who collects the finished output: None = whoever calls step(); else the generate()/stream() call.
        self.owner: object = None

    @property
    def live_seqs(self) -> list[Sequence]:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, on the per-step path: no new list
            return seqs if seqs[0].finish_reason is None else []
        return [s for s in seqs if s.finish_reason is None]

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some of the prompt log-probs it asked for are not known yet: its prompt forwards return their logits."""
        entries = self.prompt_logprobs
        return entries is not None and len(entries) < len(self.prompt_token_ids)

    @property
    def is_beam_search(self) -> bool:
        return self.params.beam_width > 1


@dataclass
class Logprob:
    """A token's log-prob at one position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None  # 1 + the number of tokens more likely there (1 = the most likely)
    decoded_token: str | None = None  # the token's text alone (None without a tokenizer)


@dataclass
class CompletionOutput:
    """One generated sequence of a request (one of ``n``, or one beam)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}, when asked


@dataclass
class RequestOutput:
    """What a request has produced so far; ``finished`` once every sequence has ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # SamplingParams.prompt_logprobs, once the whole prompt is scored: [num_prompt_tokens] None for the first token,
    # then {token_id: Logprob} of the prompt token and the k most likely ones (the prompt token first); None before
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
