"""The seam between the scheduler and the model runner: one plain ``SchedulerOutput`` per step.

``StepBuilder`` is the scheduler's step under construction: chunks join it while the scheduler walks its queues
and leave it when their request is preempted; ``build`` turns what is left into the ``SchedulerOutput``.

Pure bookkeeping: no torch.
"""

from dataclasses import dataclass, field

from hf_paged.engine.kv_manager import BlockUpdate, KVManager
from hf_paged.engine.request import Request, Sequence


@dataclass
class SchedulerOutput:
    """One forward, as data. Sequences are in batch order: decode tokens first, then prompt chunks.

    Token ``j`` of sequence ``i`` in this forward is at position ``num_computed[i] + j`` of that sequence, and
    at flat index ``sum(num_new_tokens[:i]) + j`` of ``input_token_ids``.
    """

    seq_ids: list[int] = field(default_factory=list)  # [num_seqs]
    request_ids: list[str] = field(default_factory=list)  # [num_seqs]: the request of each sequence
    num_computed: list[int] = field(default_factory=list)  # [num_seqs]: tokens already in the pool (start position)
    num_new_tokens: list[int] = field(default_factory=list)  # [num_seqs]: tokens computed now, >= 1
    input_token_ids: list[int] = field(default_factory=list)  # [num_batched_tokens]; PLACEHOLDER: id on the device
    # (flat index into input_token_ids, row of the previous step's sampled tokens) of each PLACEHOLDER input
    placeholders: list[tuple[int, int]] = field(default_factory=list)
    sample_idx: list[int] = field(default_factory=list)  # indices into seq_ids whose last new token samples;
    # logits row r of the forward belongs to sequence sample_idx[r]
    block_updates: list[BlockUpdate] = field(default_factory=list)  # table diffs since the last step, in order
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (block id, CPU slot): copy before anything
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU slot, block id): after swap_out
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst): after swap_in
    preempted: list[str] = field(default_factory=list)  # request ids preempted while scheduling this step
    # (index into seq_ids, first token of its chunk, number of tokens): tokens whose logits the step also returns, to
    # score the prompt token after each (``prompt_logprobs``); logits rows len(sample_idx) on, in this order
    prompt_logprob_spans: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids


class StepBuilder:
    """A SchedulerOutput under construction: chunks may still be dropped (preemption) until ``build``.

    ``chunks[:num_decode]`` are decode chunks: one token each, the sequence's last one, which samples.
    """

    def __init__(self):
        self.chunks: list[tuple[Request, Sequence, int]] = []  # (request, sequence, num_new_tokens)
        self.num_tokens = 0
        self.num_decode = 0  # leading chunks that are decode tokens (set after the decode phase)
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int, Request]] = []  # copy-on-write (src, dst, the request that asked)
        self.preempted: list[str] = []
        self.num_prompt_logprob_tokens = 0  # tokens scheduled for requests still scoring their prompt (an upper
        # bound on the step's prompt log-prob rows: a preempted request's stay counted)

    def add(self, request: Request, seq: Sequence, num_new: int) -> None:
        self.chunks.append((request, seq, num_new))
        self.num_tokens += num_new

    def drop(self, request: Request) -> None:
        """Forget ``request``'s chunks and copy-on-write copies (it is being preempted). Lists change in place."""
        self.num_decode -= sum(c[0] is request for c in self.chunks[: self.num_decode])
        self.chunks[:] = [c for c in self.chunks if c[0] is not request]
        self.num_tokens = sum(c[2] for c in self.chunks)
        self.copies[:] = [c for c in self.copies if c[2] is not request]

    def build(self, kv: KVManager) -> SchedulerOutput:
        """The final step: its sequences advance and their newly full blocks enter the prefix index."""
        out = SchedulerOutput(swap_out=self.swap_out, swap_in=self.swap_in, copies=[c[:2] for c in self.copies],
                              preempted=self.preempted)  # fmt: skip
        num_decode = self.num_decode
        if num_decode:
            # Decode chunks in bulk (most steps are only these): chunk i is token ``len(token_ids) - 1`` of its
            # sequence, at flat index i; it samples; it is a placeholder iff that is the sequence's one in flight.
            decode = self.chunks[:num_decode]
            seqs = [c[1] for c in decode]
            out.seq_ids = [seq.seq_id for seq in seqs]
            out.request_ids = [c[0].request_id for c in decode]
            out.num_computed = [seq.num_computed for seq in seqs]
            out.num_new_tokens = [1] * num_decode
            out.input_token_ids = [seq.token_ids[-1] for seq in seqs]
            out.placeholders = [(i, seq.sample_row) for i, seq in enumerate(seqs) if seq.num_inflight == 1]
            out.sample_idx = list(range(num_decode))
            for seq in seqs:
                seq.num_computed += 1
            kv.cache_all(seqs)
        for request, seq, num_new in self.chunks[num_decode:]:
            start = seq.num_computed
            end = start + num_new
            if seq.num_inflight and start <= len(seq.token_ids) - seq.num_inflight < end:
                out.placeholders.append((len(out.input_token_ids) + len(seq.token_ids) - seq.num_inflight - start,
                                         seq.sample_row))  # fmt: skip
            if end == len(seq.token_ids):
                out.sample_idx.append(len(out.seq_ids))
            if request.needs_prompt_logprobs:
                # Token p's logits score prompt token p + 1: the ones of this chunk not scored yet, up to the last
                # prompt token (the prompt's last token samples instead).
                first = max(start, len(request.prompt_logprobs) - 1)
                last = min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    out.prompt_logprob_spans.append((len(out.seq_ids), first - start, last - first))
            out.seq_ids.append(seq.seq_id)
            out.request_ids.append(request.request_id)
            out.num_computed.append(start)
            out.num_new_tokens.append(num_new)
            out.input_token_ids.extend(seq.token_ids[start:end])
            kv.cache(seq, end)
            seq.num_computed = end
        out.block_updates = kv.drain_updates()
        return out
