"""Monitoring snapshots of a serving front: ``ServingStats`` of one engine, ``DataParallelStats`` of replicas.

A snapshot is taken on the engine's own thread (or in the replica process) between steps, so its counters are
consistent with each other; ``sum_metrics`` folds the replicas' engine metrics into one engine's.
"""

from dataclasses import dataclass, field

from hf_paged.engine.metrics import EngineMetrics

__all__ = ["DataParallelStats", "ServingStats", "sum_metrics"]


@dataclass
class ServingStats:
    """A snapshot for monitoring, taken on the engine thread between steps."""

    metrics: EngineMetrics
    num_running: int  # requests holding blocks
    num_waiting: int  # requests queued in the scheduler (new, preempted or swapped)


@dataclass
class DataParallelStats(ServingStats):
    """The replicas' snapshots summed (``metrics`` as ``sum_metrics`` says), and each replica's own.

    ``replicas[i]`` is None for a replica that has died; ``num_routed[i]`` counts the requests sent to replica i.
    """

    replicas: list[ServingStats | None] = field(default_factory=list)
    num_routed: list[int] = field(default_factory=list)


def sum_metrics(metrics: list[EngineMetrics]) -> EngineMetrics:
    """The replicas' metrics as one engine's: counters and blocks summed; ``elapsed_s`` the longest (replicas step
    at the same time, so ``generation_throughput`` is all tokens over it); ``peak_used_blocks`` the sum of the
    peaks (an upper bound: they need not coincide); ratios weighted, the prefix hit rate by prompt tokens and
    the token-state shares by used blocks."""

    def total(name: str):
        return sum(getattr(m, name) for m in metrics)

    def weighted(name: str, weight: str) -> float:
        weights = [getattr(m, weight) for m in metrics]
        if not sum(weights):
            return sum(getattr(m, name) for m in metrics) / len(metrics)
        return sum(getattr(m, name) * w for m, w in zip(metrics, weights, strict=True)) / sum(weights)

    return EngineMetrics(
        num_steps=total("num_steps"),
        num_prompt_tokens=total("num_prompt_tokens"),
        num_computed_tokens=total("num_computed_tokens"),
        num_generated_tokens=total("num_generated_tokens"),
        elapsed_s=max(m.elapsed_s for m in metrics),
        num_used_blocks=total("num_used_blocks"),
        peak_used_blocks=total("peak_used_blocks"),
        token_state_share_at_peak=weighted("token_state_share_at_peak", "peak_used_blocks"),
        num_blocks=total("num_blocks"),
        token_state_share=weighted("token_state_share", "num_used_blocks"),
        prefix_hit_rate=weighted("prefix_hit_rate", "num_prompt_tokens"),
        num_preemptions=total("num_preemptions"),
        num_swapped_out_blocks=total("num_swapped_out_blocks"),
    )
