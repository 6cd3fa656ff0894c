"""Beam search over shared blocks (paper §4.4), scored as transformers' beam search scores it.

Each step a request's live beams give ``[num_beams, vocab]`` logits. The ``2 * beam_width`` best
(beam, token) extensions by cumulative log-prob are ranked; candidates among the first ``beam_width``
ranks that end (EOS, a stop token, or the length limit) become finished hypotheses scored
``sum_logprobs / num_generated ** length_penalty``; the best ``beam_width`` candidates that do not end
become the next beams, each a fork of its parent's blocks (no KV copy; the parent's partial last block
is copied when first written). Generation ends at the length limit or once no running beam can beat
the worst of ``beam_width`` finished hypotheses (transformers' ``early_stopping=False`` heuristic).
"""

from dataclasses import dataclass

import torch


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens (incl. the ending one)
    score: float  # length-penalised
    sum_logprobs: float
    finish_reason: str
    stop_reason: int | None


@dataclass
class BeamStep:
    """The outcome of one beam step for one request."""

    new_beams: list[tuple[int, int, float]]  # (parent beam index, token, cumulative log-prob), best first
    done: bool  # no further step: the request finishes with its best hypotheses


class BeamState:
    """Finished hypotheses of one request and the early-stop test.

    Args:
        beam_width: beams kept.
        length_penalty: exponent of the generated length in the hypothesis score.
        max_new_tokens: the length limit.
    """

    def __init__(self, beam_width: int, length_penalty: float, max_new_tokens: int):
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self.max_new_tokens = max_new_tokens
        self.finished: list[Hypothesis] = []  # at most beam_width, best first
        self.improvable = True

    def step(
        self,
        logits: torch.Tensor,  # [num_beams, vocab_size]
        cumulative: list[float],  # [num_beams]
        generated: list[list[int]],  # [num_beams][num_generated]: each beam's output so far
        stop_ids: set[int],  # token ids that end a hypothesis (EOS unless ignored, stop_token_ids)
        masked_ids: list[int],  # ids forbidden this step (EOS / stop ids under min_tokens)
    ) -> BeamStep:
        num_generated = len(generated[0])
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if masked_ids:
            logprobs[:, masked_ids] = float("-inf")
        scores = logprobs + torch.tensor(cumulative, device=logits.device).unsqueeze(1)
        k = min(2 * self.beam_width, scores.numel())
        top_scores, flat_idx = scores.flatten().topk(k)
        vocab_size = logits.shape[1]
        beam_ids, token_ids = (flat_idx // vocab_size).tolist(), (flat_idx % vocab_size).tolist()
        candidates = list(zip(beam_ids, token_ids, top_scores.tolist(), strict=True))
        at_limit = num_generated + 1 >= self.max_new_tokens
        new_beams = []
        for rank, (beam, token, score) in enumerate(candidates):
            ends = at_limit or token in stop_ids
            if ends:
                if rank < self.beam_width and self.improvable:
                    reason = "length" if token not in stop_ids else "stop"
                    stop_reason = token if reason == "stop" else None
                    self._add(generated[beam] + [token], score, num_generated + 1, reason, stop_reason)
            elif len(new_beams) < self.beam_width:
                new_beams.append((beam, token, score))
        done = at_limit or not new_beams
        if not done and len(self.finished) == self.beam_width:
            # Best running beam at the current length vs the worst finished hypothesis.
            best_running = new_beams[0][2] / ((num_generated + 1) ** self.length_penalty)
            self.improvable = best_running > self.finished[-1].score
            done = not self.improvable
        return BeamStep(new_beams=new_beams, done=done)

    def _add(self, token_ids, sum_logprobs, length, reason, stop_reason) -> None:
        score = sum_logprobs / (length**self.length_penalty)
        self.finished.append(Hypothesis(token_ids, score, sum_logprobs, reason, stop_reason))
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.beam_width :]
