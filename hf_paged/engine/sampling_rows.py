"""The map from a step's logits rows to the sampler's rows, and a step queued on the device.

Logits row ``r`` of a step belongs to sequence ``sched.seq_ids[sched.sample_idx[r]]``. The sampler's rows are an
explicit map into them: a prompt that forks into ``n`` samples gives its row ``n`` times, beam-search rows go to
the beam search instead. ``SamplingRows`` holds that map with each row's parameters; ``Launched`` is a step whose
sampling is queued and whose tokens are on their way to the host.
"""

from dataclasses import dataclass, field

import torch

from hf_paged.engine.sampler import RowPlan
from hf_paged.engine.scheduler_output import SchedulerOutput


@dataclass
class Launched:
    """A step whose forward and sampling are queued on the device; the engine reads its tokens back later."""

    deferred: bool  # processed after the next step is queued; its rows' sequences hold placeholders
    rows: list = field(default_factory=list)  # [num_rows] Sequence of each sampled row (a forking prompt: n rows)
    requests: list = field(default_factory=list)  # [num_rows] Request of each row
    beam_rows: dict[str, list[int]] = field(default_factory=dict)  # request id -> its rows of ``logits``
    logits: torch.Tensor | None = None  # kept for beam search only
    token_ids: torch.Tensor | None = None  # [num_rows] int64 on the device: read by the next step's inputs
    host: list | None = None  # host copies of (token_ids, logprobs, top_logprobs, top_token_ids) (pinned on CUDA)
    event: torch.cuda.Event | None = None  # recorded after the copies (CUDA)
    token_time: float | None = None  # time.monotonic() when the tokens reached the host (first-token metrics)
    processed: bool = False  # its tokens were read back and applied (StepPipeline._process)
    prompt_logprobs: object = None  # hf_paged.engine.prompt_logprobs.PromptLogprobRows of the step, if it scores any
    # (SamplingRows, logits rows, grammar_masks.StepMasks or None) until the sampling is queued (StepPipeline._sample)
    sampling: tuple | None = None


@dataclass
class SamplingRows:
    """The sampling rows of a step: what the engine derives from the step's sequences and their requests.

    Reused for the next step while its ``seq_ids`` and ``sample_idx`` are the same lists (one C-level compare) and
    ``reusable``: every row is then one plain sample of a sequence whose inputs do not change between steps (no
    beams, no prompt forking into ``n`` samples, no penalties or ``min_tokens``, whose rows copy the output so
    far; a structured-output row's mask is made each step from its sequence, not kept here). Sequence ids are never
    reused and a sequence belongs to one request for life, so equal ids mean the same
    sequences, requests, parameters, prompts and generators: any change of the running set (an admission, a
    finish, an abort, a preemption, a fork, a beam step) changes ``seq_ids``. Rows are then kept for the sequences
    that stay (``take``: a finish, an abort, a preemption only drops rows) and rebuilt when a sequence joins.
    """

    seq_ids: list[int]  # [num_seqs] the step's sequences (the reuse key, with sample_idx)
    sample_idx: list[int]  # [num_logits] the step's sampling sequences
    row_idx: list[int] = field(default_factory=list)  # [num_rows] the logits row of each sampler row
    params: list = field(default_factory=list)  # [num_rows] SamplingParams
    outputs: list = field(default_factory=list)  # [num_rows] output so far (penalties, min_tokens), else ()
    prompts: list = field(default_factory=list)  # [num_rows] prompt token ids
    generators: list = field(default_factory=list)  # [num_rows] torch.Generator of a seeded request, else None
    seqs: list = field(default_factory=list)  # [num_rows] Sequence of each row
    requests: list = field(default_factory=list)  # [num_rows] Request of each row
    beam_rows: dict[str, list[int]] = field(default_factory=dict)  # request id -> its rows of the logits
    identity: bool = False  # row_idx is range(num_logits): the sampler takes the logits as they are
    deferrable: bool = True  # every row is a plain sample: the step may be processed after the next is queued
    constrained: list[int] = field(default_factory=list)  # rows of requests with structured_output, ascending:
    # their grammar masks the logits (the engine reads the previous step's tokens first: StepPipeline._launch)
    reusable: bool = False  # see the class doc
    plan: RowPlan | None = None  # the sampler's checked summary of params and generators, made on first use
    row_of: dict[int, int] | None = None  # sequence id -> its row (reusable rows), made on first use by ``take``

    @classmethod
    def build(cls, sched: SchedulerOutput, get) -> "SamplingRows":
        """The sampler's rows of ``sched``; ``get(seq_id)`` gives a sequence and its request (``Scheduler.get``)."""
        seq_ids = sched.seq_ids
        pairs = [get(seq_ids[i]) for i in sched.sample_idx]
        rows = cls(list(seq_ids), list(sched.sample_idx))
        if all(r.forked and not r.needs_history and r.params.beam_width == 1 for _, r in pairs):
            # The common case: one row per sequence, each a plain sample of fixed inputs (reusable).
            rows.seqs = [seq for seq, _ in pairs]
            rows.requests = requests = [r for _, r in pairs]
            rows.row_idx = list(range(len(pairs)))
            rows.params = [r.params for r in requests]
            rows.outputs = [()] * len(pairs)
            rows.prompts = [r.prompt_token_ids for r in requests]
            rows.generators = [r.generator for r in requests]
            rows.constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
            rows.identity = rows.reusable = True
            return rows
        for r, (seq, request) in enumerate(pairs):
            if request.is_beam_search:
                rows.beam_rows.setdefault(request.request_id, []).append(r)
                rows.deferrable = False
                continue
            copies = 1 if request.forked else request.params.n  # the prompt's row is sampled n times
            history = request.needs_history
            rows.deferrable = rows.deferrable and copies == 1 and not history
            for _ in range(copies):
                rows.row_idx.append(r)
                rows.params.append(request.params)
                # The output so far matters only to penalties and min_tokens; copying it costs O(length).
                rows.outputs.append(seq.output_token_ids if history else ())
                rows.prompts.append(request.prompt_token_ids)
                rows.generators.append(request.generator)
                rows.seqs.append(seq)
                rows.requests.append(request)
                if request.grammar is not None:
                    rows.constrained.append(len(rows.row_idx) - 1)
        rows.identity = rows.row_idx == list(range(len(pairs)))
        return rows

    def take(self, sched: SchedulerOutput) -> "SamplingRows | None":
        """The rows of ``sched`` picked from these reusable rows, when its every sampling sequence has one here.

        A finish, an abort or a preemption only drops sequences from a step: their rows go and the others' stay
        (same sequences, so the same inputs), with no per-row lookup of requests and no new checks of parameters
        (``RowPlan.take``). None when a sequence joined (an admission, a fork): the caller rebuilds the rows.
        """
        row_of = self.row_of
        if row_of is None:
            seq_ids = self.seq_ids
            row_of = self.row_of = {seq_ids[i]: row for row, i in enumerate(self.sample_idx)}
        seq_ids = sched.seq_ids
        try:
            idx = [row_of[seq_ids[i]] for i in sched.sample_idx]
        except KeyError:
            return None
        params = [self.params[r] for r in idx]
        constrained = []
        if self.constrained:
            kept = set(self.constrained)
            constrained = [row for row, r in enumerate(idx) if r in kept]
        return SamplingRows(
            list(seq_ids), list(sched.sample_idx), row_idx=list(range(len(idx))), params=params,
            outputs=[()] * len(idx), prompts=[self.prompts[r] for r in idx],
            generators=[self.generators[r] for r in idx], seqs=[self.seqs[r] for r in idx],
            requests=[self.requests[r] for r in idx], identity=True, deferrable=True,
            constrained=constrained, reusable=True,
            plan=self.plan.take(idx, params) if self.plan is not None else None,
        )  # fmt: skip


def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start copying ``t`` to the host without waiting (pinned memory on CUDA); read it after the event."""
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
