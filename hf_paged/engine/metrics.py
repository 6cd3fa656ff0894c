"""Engine-wide counters: what ``ContinuousBatcher.metrics()`` reports."""

from dataclasses import dataclass

from hf_paged.core.block_pool import PoolStats


@dataclass
class EngineMetrics:
    """Engine-wide counters since construction."""

    num_steps: int
    num_prompt_tokens: int  # prompt tokens of accepted requests (each request once, however often readmitted)
    num_computed_tokens: int  # tokens that went through the model (recomputation and discarded tokens included)
    num_generated_tokens: int
    elapsed_s: float  # wall time spent inside step()
    num_used_blocks: int
    peak_used_blocks: int  # high-water mark since construction
    token_state_share_at_peak: float  # token_state_share when peak_used_blocks was reached
    num_blocks: int
    token_state_share: float  # slots holding tokens / slots of used blocks
    prefix_hit_rate: float  # prompt tokens served by the prefix cache / prompt tokens looked up
    num_preemptions: int
    num_swapped_out_blocks: int  # blocks copied to CPU memory by preemption in swap mode

    @property
    def generation_throughput(self) -> float:
        """Generated tokens per second of step() time."""
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s else 0.0


class MetricsRecorder:
    """The counters behind EngineMetrics, updated by the engine as it runs."""

    def __init__(self):
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_computed_tokens = 0
        self.num_generated_tokens = 0
        self.elapsed_s = 0.0
        self.peak_used_blocks = 0
        self.peak_share = 1.0

    def observe_pool(self, stats: PoolStats) -> None:
        """Track the high-water mark of used blocks (and how full their slots were then)."""
        if stats.num_used_blocks > self.peak_used_blocks:
            self.peak_used_blocks = stats.num_used_blocks
            self.peak_share = stats.num_used_slots / stats.num_allocated_slots

    def snapshot(self, stats: PoolStats, num_preemptions: int, num_swapped_out_blocks: int) -> EngineMetrics:
        return EngineMetrics(
            num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_tokens=self.num_computed_tokens,
            num_generated_tokens=self.num_generated_tokens,
            elapsed_s=self.elapsed_s,
            num_used_blocks=stats.num_used_blocks,
            peak_used_blocks=self.peak_used_blocks,
            token_state_share_at_peak=self.peak_share,
            num_blocks=stats.num_blocks,
            token_state_share=stats.num_used_slots / stats.num_allocated_slots if stats.num_allocated_slots else 1.0,
            prefix_hit_rate=stats.prefix_hit_rate,
            num_preemptions=num_preemptions,
            num_swapped_out_blocks=num_swapped_out_blocks,
        )
