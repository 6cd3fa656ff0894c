"""Sampler: one batched call per engine step turns the last-position logits into the next tokens.

Every stage is a whole-batch tensor op on the logits' device; per-row parameters become one small tensor
each (built from Python lists, O(num_seqs), copied up through pinned memory), and a stage that no row
uses is skipped. Nothing reads a tensor back to the host and no copy blocks, so sampling never waits for
the device. Beams are ranked, not sampled: beam-search rows go to the engine's beam search
(hf_paged.engine.beam_search) instead.
"""

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.core.transfer import to_device
from hf_paged.engine.params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """The tokens of one step, one per row, on the logits' device."""

    token_ids: torch.Tensor  # [num_seqs], int64
    # The rest is None unless some row asks for logprobs; then every row gets them (rows read what they asked).
    logprobs: torch.Tensor | None  # [num_seqs], fp32: log-prob of token_ids under the raw model distribution
    top_logprobs: torch.Tensor | None  # [num_seqs, max_k], fp32, descending; max_k = max `logprobs` over rows
    top_token_ids: torch.Tensor | None  # [num_seqs, max_k], int64: the tokens of top_logprobs


@dataclass(frozen=True)
class RowPlan:
    """What the sampler derives from its rows' parameters and generators alone, checked once (``plan_rows``).

    A caller whose rows do not change between calls (the engine, while a step's sequences stay the same) passes
    the plan back in, and the sampler then does no per-row Python work for the stages no row uses.
    """

    num_rows: int
    device_type: str  # the device type the generators were checked against (the logits')
    max_num_logprobs: int | None  # the most ``logprobs`` any row asks for; None: no row does
    use_penalties: bool  # some row has a repetition, frequency or presence penalty
    use_min_tokens: bool  # some row has ``min_tokens`` > 0
    sample_rows: list[int]  # rows that sample (not greedy), ascending

    def take(self, idx: list[int], params: Sequence[SamplingParams]) -> "RowPlan":
        """The plan of rows ``idx`` of the rows this plan checked (``params``: theirs, in ``idx`` order).

        Those rows passed the checks already: what is left is O(len(idx)) only for a stage some row uses.
        """
        sample_rows = []
        if len(self.sample_rows) == self.num_rows:
            sample_rows = list(range(len(idx)))
        elif self.sample_rows:
            sampled = set(self.sample_rows)
            sample_rows = [row for row, i in enumerate(idx) if i in sampled]
        max_num_logprobs = self.max_num_logprobs
        if max_num_logprobs is not None:
            max_num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        return RowPlan(
            num_rows=len(idx),
            device_type=self.device_type,
            max_num_logprobs=max_num_logprobs,
            use_penalties=self.use_penalties and _uses_penalties(params),
            use_min_tokens=self.use_min_tokens and any(p.min_tokens > 0 for p in params),
            sample_rows=sample_rows,
        )


def plan_rows(
    params: Sequence[SamplingParams],  # [num_seqs]
    generators: Sequence[torch.Generator | None],  # [num_seqs]
    device: torch.device,  # the logits' device
) -> RowPlan:
    """Check each row's parameters and generator for the sampler and summarise them (see ``RowPlan``).

    Raises:
        ValueError: If a row uses beam search, or a seeded row that samples has no generator or one on another
            device than ``device``.
    """
    for i, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.beam_width > 1:
            raise ValueError(
                f"row {i} uses beam search (beam_width={p.beam_width}); beams are ranked by the engine's beam "
                "search (hf_paged.engine.beam_search), the Sampler only samples"
            )
        if p.is_greedy:
            continue
        if p.seed is not None and generator is None:
            raise ValueError(f"row {i} has seed={p.seed} but no generator; pass torch.Generator(device).manual_seed")
        if generator is not None and generator.device.type != device.type:
            raise ValueError(
                f"row {i}'s generator is on {generator.device}, the logits on {device}; "
                "make the generator on the logits' device"
            )
    return RowPlan(
        num_rows=len(params),
        device_type=device.type,
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        use_penalties=_uses_penalties(params),
        use_min_tokens=any(p.min_tokens > 0 for p in params),
        sample_rows=[i for i, p in enumerate(params) if not p.is_greedy],
    )


def _uses_penalties(params: Sequence[SamplingParams]) -> bool:
    return any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)


class Sampler:
    """Batched sampling for rows with mixed SamplingParams (stateless).

    Pipeline, in order:

    1. upcast the logits to fp32 (a copy: the caller's tensor is never changed); when any row wants
       logprobs, keep ``log_softmax`` of these raw logits;
    2. penalties (``apply_penalties``): repetition over prompt + output tokens, then frequency and
       presence over output tokens;
    3. ``min_tokens``: rows with fewer output tokens than their ``min_tokens`` get -inf on the EOS ids and
       their ``stop_token_ids``;
    4. greedy rows (temperature 0 or top-k 1) take the argmax of the penalised logits;
    5. the other rows: temperature, top-k, top-p, min-p, then sample by the exponential race
       ``argmax(probs / q)`` with ``q ~ Exponential(1)`` (a Gumbel-max in disguise: no cumsum, no search).
       A row with a generator draws its ``q`` from it, so its token depends only on its own logits,
       parameters and generator, never on its batch companions; the other rows share one global draw;
    6. logprobs, gathered from step 1 at the sampled ids, and the top ``max_k`` alternatives.

    Beam-search rows (``beam_width > 1``) do not come here: the engine's beam search
    (hf_paged.engine.beam_search) ranks them.
    """

    def __call__(
        self,
        logits: torch.Tensor,  # [num_seqs, vocab_size], fp32 or the model dtype
        params: Sequence[SamplingParams],  # [num_seqs]
        output_token_ids: Sequence[Sequence[int]],  # [num_seqs][num_output_tokens of the row]
        prompt_token_ids: Sequence[Sequence[int]],  # [num_seqs][num_prompt_tokens of the row]
        generators: Sequence[torch.Generator | None],  # [num_seqs]
        eos_token_ids: Iterable[int] = (),
        plan: RowPlan | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: Last-position logits, one row per sequence.
            params: Each row's sampling parameters (rows of one request share the object).
            output_token_ids: Tokens each row has generated so far (penalties, ``min_tokens``).
            prompt_token_ids: Each row's prompt (repetition penalty).
            generators: A generator on the logits' device for each seeded row, else None. Rows may
                share one (a request's ``n`` samples); they then draw from it in row order.
            eos_token_ids: The model's EOS ids, masked while a row is under its ``min_tokens``.
            plan: ``plan_rows(params, generators, logits.device)`` of these very rows, made by an earlier call
                (default: made and checked now).

        Returns:
            SamplerOutput with the tokens on the logits' device.

        Raises:
            ValueError: If ``logits`` is not 2-D, the per-row lists do not have ``num_seqs`` entries, a row
                uses beam search, or a seeded row that samples has no generator or one on another device.
        """
        _check_inputs(logits, params, output_token_ids, prompt_token_ids, generators)
        device = logits.device
        if plan is None or plan.num_rows != len(params) or plan.device_type != device.type:
            plan = plan_rows(params, generators, device)
        max_num_logprobs = plan.max_num_logprobs
        raw_logprobs = None if max_num_logprobs is None else torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        if plan.use_penalties or plan.use_min_tokens or plan.sample_rows:
            logits = logits.to(torch.float32, copy=True)  # the stages below change it in place
        # else: greedy rows only, argmax of the logits as given (a bf16 -> fp32 cast is exact: same argmax)

        if plan.use_penalties:
            logits = apply_penalties(logits, params, output_token_ids, prompt_token_ids)
        if plan.use_min_tokens:
            _apply_min_tokens(logits, params, output_token_ids, eos_token_ids)

        sample_rows = plan.sample_rows
        if len(sample_rows) < len(params):
            token_ids = logits.argmax(dim=-1)
        if sample_rows:
            all_sampled = len(sample_rows) == len(params)
            # Indexing copies, so greedy rows keep their logits; when every row samples, work in place.
            sample_logits = logits if all_sampled else logits[to_device(sample_rows, torch.int64, device)]
            sampled = _sample(sample_logits, [params[i] for i in sample_rows], [generators[i] for i in sample_rows])
            if all_sampled:
                token_ids = sampled
            else:
                token_ids.index_copy_(0, to_device(sample_rows, torch.int64, device), sampled)

        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        sampled_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_logprobs, top_token_ids = raw_logprobs.topk(min(max_num_logprobs, logits.shape[1]), dim=-1)
        return SamplerOutput(token_ids, sampled_logprobs, top_logprobs, top_token_ids)


def _check_inputs(
    logits: torch.Tensor,  # [num_seqs, vocab_size]
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> None:
    """The shapes and lengths of the inputs (each row's parameters are checked by ``plan_rows``)."""
    if logits.dim() != 2:
        raise ValueError(f"`logits` must be 2-D [num_seqs, vocab_size], got shape {tuple(logits.shape)}")
    num_seqs = logits.shape[0]
    for name, rows in (
        ("params", params),
        ("output_token_ids", output_token_ids),
        ("prompt_token_ids", prompt_token_ids),
        ("generators", generators),
    ):
        if len(rows) != num_seqs:
            raise ValueError(f"`{name}` must have one entry per logits row ({num_seqs}), got {len(rows)}")


def _token_counts(
    token_ids: Sequence[Sequence[int]],  # [num_seqs][num_tokens of the row]
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:  # [num_seqs, vocab_size], fp32: occurrences of each token in each row
    # One flat index (row * (vocab_size + 1) + token) built with numpy and copied once, then one scatter_add:
    # a padded [num_seqs, max_len] tensor from nested lists took ~9x longer to build (20 ms vs 2 ms for 256
    # rows of 500 tokens on the dev CPU). fp32 sums of ones are exact below 2**24, so atomic order cannot
    # change a count.
    lens = [len(ids) for ids in token_ids]
    num_tokens = sum(lens)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    if num_tokens:
        flat = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=num_tokens)
        # Ids past the logits' vocab (an embedding larger than lm_head, as HF notes) cannot be generated:
        # they land in the extra column, which is dropped.
        flat[(flat < 0) | (flat >= vocab_size)] = vocab_size
        flat += np.repeat(np.arange(len(lens), dtype=np.int64) * (vocab_size + 1), lens)
        index = to_device(flat, torch.int64, device)
        counts.view(-1).scatter_add_(0, index, torch.ones(num_tokens, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,  # [num_seqs, vocab_size], fp32
    params: Sequence[SamplingParams],  # [num_seqs]
    output_token_ids: Sequence[Sequence[int]],  # [num_seqs][num_output_tokens of the row]
    prompt_token_ids: Sequence[Sequence[int]],  # [num_seqs][num_prompt_tokens of the row]
) -> torch.Tensor:  # [num_seqs, vocab_size], fp32
    """Apply repetition, frequency and presence penalties (vLLM's order), in place.

    Repetition (HF/vLLM): every token seen in the prompt or the output has its logit divided by the
    penalty when positive and multiplied by it when negative. Frequency and presence (OpenAI/vLLM), over
    output tokens only: ``logit -= frequency * count + presence * (count > 0)``. Rows at the defaults are
    unchanged; when no row uses a penalty nothing is computed.

    Args:
        logits: Logits to penalise (changed in place).
        params: Each row's sampling parameters.
        output_token_ids: Tokens each row has generated so far.
        prompt_token_ids: Each row's prompt.

    Returns:
        ``logits``, penalised.
    """
    repetition = [p.repetition_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    use_repetition = any(r != 1.0 for r in repetition)
    use_output_penalties = any(f != 0.0 for f in frequency) or any(p != 0.0 for p in presence)
    if not (use_repetition or use_output_penalties):
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    output_counts = _token_counts(output_token_ids, vocab_size, device)

    if use_repetition:
        seen = (output_counts + _token_counts(prompt_token_ids, vocab_size, device)) > 0
        penalty = to_device(repetition, torch.float32, device).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if use_output_penalties:
        frequency_t = to_device(frequency, torch.float32, device).unsqueeze(1)
        presence_t = to_device(presence, torch.float32, device).unsqueeze(1)
        logits -= frequency_t * output_counts + presence_t * (output_counts > 0)
    return logits


def _apply_min_tokens(
    logits: torch.Tensor,  # [num_seqs, vocab_size], fp32; changed in place
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Iterable[int],
) -> None:
    vocab_size = logits.shape[1]
    eos = set(eos_token_ids)
    rows, cols = [], []  # O(num_seqs * num_stop_ids) Python, no vocab-sized loop
    for i, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        if len(output) < p.min_tokens:
            stop_ids = [t for t in eos.union(p.stop_token_ids) if 0 <= t < vocab_size]
            rows += [i] * len(stop_ids)
            cols += stop_ids
    if rows:
        device = logits.device
        logits[to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)] = _NEG_INF


def _sample(
    logits: torch.Tensor,  # [num_rows, vocab_size], fp32; changed in place
    params: Sequence[SamplingParams],  # [num_rows], none greedy
    generators: Sequence[torch.Generator | None],  # [num_rows]
) -> torch.Tensor:  # [num_rows], int64
    device, vocab_size = logits.device, logits.shape[1]

    temperature = [p.temperature for p in params]
    if any(t != 1.0 for t in temperature):
        logits /= to_device(temperature, torch.float32, device).unsqueeze(1)

    top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]  # k >= vocab keeps every token
    if any(top_k):
        max_k = max(top_k)
        kth_idx = to_device([max(k, 1) - 1 for k in top_k], torch.int64, device).unsqueeze(1)
        threshold = logits.topk(max_k, dim=-1).values.gather(1, kth_idx)
        # Rows with top-k off get a -inf threshold, which masks nothing. Ties at the k-th logit all stay (as HF).
        threshold.masked_fill_(to_device([k == 0 for k in top_k], torch.bool, device).unsqueeze(1), _NEG_INF)
        logits.masked_fill_(logits < threshold, _NEG_INF)

    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        top_p_t = to_device(top_p, torch.float32, device).unsqueeze(1)
        sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens above it already hold >= top_p of the mass (HF's rule). The most
        # likely token always stays; rows with top_p 1 are exempt, so fp32 underflow cannot touch them.
        drop_sorted = (cumulative <= 1.0 - top_p_t) & (top_p_t < 1.0)
        drop_sorted[:, -1] = False
        logits.masked_fill_(drop_sorted.scatter(1, sorted_idx, drop_sorted), _NEG_INF)

    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        probs = logits.softmax(dim=-1)
        min_p_t = to_device(min_p, torch.float32, device).unsqueeze(1)
        logits.masked_fill_(probs < min_p_t * probs.amax(dim=-1, keepdim=True), _NEG_INF)

    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs)
    seeded_rows = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded_rows) < len(params):
        q.exponential_()  # one global draw; the seeded rows are overwritten below
    for i in seeded_rows:
        q[i].exponential_(generator=generators[i])
    # Exponential draws of exactly 0 were possible on some CUDA builds (pytorch#48841); 0/0 would be NaN,
    # which argmax picks. Clamping to the smallest normal float changes nothing else.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return probs.div_(q).argmax(dim=-1)
