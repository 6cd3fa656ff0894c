"""Prompt log-probs (``SamplingParams.prompt_logprobs``): how likely the model found each prompt token.

The logits at prompt position p score prompt token p + 1, so a request that asks returns a logits row for every
prompt token but the last (whose row samples) while its prompt is computed: the scheduler lists those tokens in
``SchedulerOutput.prompt_logprob_spans`` (capped per step: ``MAX_PROMPT_LOGPROB_ROWS``), the runner appends their
rows after the sampling rows, and this module scores them on the device (``score``) and files them on the host,
in prompt order (``PromptLogprobRows.apply``). Each entry is the prompt token's ``Logprob`` and the k most likely
tokens', under the raw model distribution (``log_softmax`` of the logits, as ``logprobs``).

A token scored twice (its forward recomputed after a preemption, or a recovery, while the first result was still in
flight) keeps its first entry: entries are filed by position, never appended twice.
"""

from dataclasses import dataclass, field

import torch

from hf_paged.core.transfer import to_device
from hf_paged.engine.request import Logprob, Request
from hf_paged.engine.sampling_rows import to_host
from hf_paged.engine.scheduler_output import SchedulerOutput


@dataclass
class PromptLogprobRows:
    """One step's prompt log-probs, computed on the device and on their way to the host."""

    requests: list[Request] = field(default_factory=list)  # [num_spans] the request of each span
    first_idx: list[int] = field(default_factory=list)  # [num_spans] the prompt index its first row scores
    num_rows: list[int] = field(default_factory=list)  # [num_spans] rows (prompt tokens scored) of each span
    # host copies of (token_logprobs [R] fp32, ranks [R] int64, top_logprobs [R, k] fp32, top_token_ids [R, k])
    host: list = field(default_factory=list)
    event: torch.cuda.Event | None = None  # recorded after the copies (CUDA)

    def apply(self, tokenizer) -> None:
        """File each row's entry in its request's ``prompt_logprobs`` (waits for the copies); ``tokenizer`` (or
        None) gives each token's ``decoded_token``."""
        if self.event is not None:
            self.event.synchronize()
        token_lps, ranks, top_lps, top_ids = (t.tolist() for t in self.host)
        decoded: dict[int, str | None] = {}

        def decode(token_id: int) -> str | None:
            if tokenizer is None:
                return None
            text = decoded.get(token_id)
            if text is None:
                text = decoded[token_id] = tokenizer.decode([token_id])
            return text

        row = 0
        for request, first, num_rows in zip(self.requests, self.first_idx, self.num_rows, strict=True):
            entries, k = request.prompt_logprobs, request.params.prompt_logprobs
            for idx in range(first, first + num_rows):
                if idx == len(entries):
                    token_id = request.prompt_token_ids[idx]
                    entry = {token_id: Logprob(token_lps[row], ranks[row], decode(token_id))}
                    for rank, (alt, lp) in enumerate(zip(top_ids[row][:k], top_lps[row][:k], strict=True), 1):
                        entry.setdefault(alt, Logprob(lp, rank, decode(alt)))
                    entries.append(entry)
                elif idx > len(entries):
                    raise RuntimeError(f"bug in hf_paged: prompt token {idx} of request {request.request_id!r} "
                                       f"scored before token {len(entries)}")  # fmt: skip
                row += 1


def score(sched: SchedulerOutput, logits: torch.Tensor, requests: dict[str, Request]) -> PromptLogprobRows:
    """Queue the scoring of a step's prompt log-prob rows and their copy to the host; wait for nothing.

    Args:
        sched: the step; its ``prompt_logprob_spans`` say which token each row belongs to.
        logits: [num_rows, vocab_size] the step's rows past its sampling rows, in span order.
        requests: the engine's requests by id.
    """
    rows = PromptLogprobRows()
    targets: list[int] = []
    for seq_idx, offset, num_rows in sched.prompt_logprob_spans:
        request = requests[sched.request_ids[seq_idx]]
        first = sched.num_computed[seq_idx] + offset + 1  # the prompt token the span's first row scores
        rows.requests.append(request)
        rows.first_idx.append(first)
        rows.num_rows.append(num_rows)
        targets += request.prompt_token_ids[first : first + num_rows]
    if len(targets) != logits.shape[0]:
        raise RuntimeError(f"bug in hf_paged: {logits.shape[0]} prompt log-prob rows for {len(targets)} tokens")
    k = min(max(r.params.prompt_logprobs for r in rows.requests), logits.shape[1])
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [num_rows, vocab_size]
    target_ids = to_device(targets, torch.int64, logits.device)
    token_logprobs = logprobs.gather(1, target_ids.unsqueeze(1))  # [num_rows, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # ties share the better rank
    top_logprobs, top_token_ids = logprobs.topk(k, dim=-1)  # [num_rows, k]
    rows.host = [to_host(t) for t in (token_logprobs.squeeze(1), ranks, top_logprobs, top_token_ids)]
    if logits.is_cuda:
        rows.event = torch.cuda.Event()
        rows.event.record()
    return rows
