"""EngineConfig: every setting of a ContinuousBatcher, validated before anything is allocated.

One dataclass shared by the engine, the CLI, the benchmark and the profiler. ``__post_init__`` checks each
field's type and range with a message that names it; settings that depend on the model (the pool size from
free memory, CUDA graphs on CUDA) stay ``None`` here and are resolved by the engine.
"""

import dataclasses
from dataclasses import dataclass

import torch

PREEMPTION_MODES = ("recompute", "swap")
COMPILE_MODES = ("layers", "full")  # compile_model=True means "full"; None: "layers" on one CUDA device

# max_num_seqs=None: the most sequences a step takes, by the card, as vLLM picks its default (1024 sequences on cards
# of >= 70 GiB but A100s, 256 elsewhere). Here 512 on a CUDA card of at least LARGE_CARD_GIB: the largest decode graph
# bucket (model_runner.GRAPH_BATCH_SIZES); 256 elsewhere; never above max_num_batched_tokens. Measured on an H200
# (twenty-fourth session, benchmarks/RESULTS.md), 512 against 256: the prefix workload at 400 requests +25% with
# caching on (85 steps instead of 133: the second wave of requests no longer waits for the first to finish), the
# short workload (1 000 requests) +27%, the 8B sharegpt workload (512 requests) +7%; nano (256 requests) unchanged.
MAX_NUM_SEQS = 256
LARGE_CARD_MAX_NUM_SEQS = 512
LARGE_CARD_GIB = 70


def default_max_num_seqs(device: torch.device | str | None, max_num_batched_tokens: int) -> int:
    """What ``max_num_seqs=None`` means for an engine whose model is on ``device`` (its first device)."""
    device = torch.device(device) if device is not None else None
    cap = MAX_NUM_SEQS
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_properties(index).total_memory >= LARGE_CARD_GIB * 2**30:
            cap = LARGE_CARD_MAX_NUM_SEQS
    return min(cap, max_num_batched_tokens)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def _optional_bool(name: str, value: object) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True, False or None (auto), got {value!r}")
    return value


@dataclass
class EngineConfig:
    """Settings of a ContinuousBatcher.

    Attributes:
        num_blocks: KV blocks in the pool; None = sized from memory: on CUDA what ``gpu_memory_utilization`` of
            the card leaves after a profiled full-budget step (hf_paged.engine.memory), or ``memory_fraction``
            of free memory when that is given (and on the CPU, 0.5 of free RAM up to 2 GiB).
        block_size: tokens per block (a positive multiple of 8).
        memory_fraction: share of *free* device memory for the pool (the older, simpler sizing); in (0, 1].
        gpu_memory_utilization: share of the CUDA card's *total* memory this engine may use, weights,
            activations and pool together (as vLLM's setting); in (0, 1].
        max_num_batched_tokens: token budget of one forward (chunked prefill splits longer prompts).
        max_num_seqs: most sequences in one forward; None = by the card (``default_max_num_seqs``: 512 on a CUDA
            card of >= 70 GiB, 256 elsewhere, never above ``max_num_batched_tokens``), resolved by the engine
            (``resolved``). Also the most samples (``n``) or beams one request may have.
        enable_prefix_caching: reuse full blocks across requests by content hash.
        preemption_mode: "recompute" (free and recompute later) or "swap" (copy blocks to CPU memory).
        swap_space_gb: CPU memory for swapped blocks (swap mode), >= 0.
        use_cuda_graphs: replay CUDA graphs for every step that fits a bucket (decode and mixed); None = on for a
            model on one CUDA device.
        compile_model: torch.compile on CUDA (faster steps, seconds of start-up): "layers" compiles each decoder layer
            of the model in place, the attention call staying eager between the compiled pieces (one compiled code
            for all layers, cached on disk by torch: about 12 s of start-up on a second start); "full" (or True)
            compiles the whole forward inside the CUDA graphs (about a minute); False compiles nothing. None
            (default): "layers" for a model on one CUDA device, falling back to eager with a warning if the
            compile fails; nothing elsewhere.
        async_scheduling: queue step N+1 before reading back step N's tokens; None = on for a model on CUDA.
        cascade_attention: shared-prefix decode: decode rows that share leading KV blocks (a common prompt prefix,
            the ``n`` samples of a prompt) read those blocks once per step for all of them (kernels/cascade.py);
            used on the steps where the bytes saved are worth it, the other decode steps replaying a plain decode
            graph. None (default): on for a model on CUDA, off elsewhere. On an H100 (thirteenth session,
            benchmarks/RESULTS.md) it left workloads without a shared prefix unchanged (nano 1.000x, sharegpt-8B
            0.996x); on the bench's prefix workload (a 341-token prefix shared by every request) it was 10.8% faster
            in the twelfth session, and 0.4% more since its decode steps write K/V in the decode kernel.
        fuse_projections: one GEMM for the sibling projections that read the same input (q/k/v, gate/up), their
            ``nn.Linear`` weights concatenated in place (hf_paged.engine.fuse: no extra memory, the modules' outputs
            and ``state_dict`` unchanged); None = on for a model on CUDA (not under tensor parallelism), where a
            small model's decode step is dominated by short GEMMs of ~5 µs each; False leaves the model's modules.
    """

    num_blocks: int | None = None
    block_size: int = 16
    memory_fraction: float | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_gb: float = 4.0
    use_cuda_graphs: bool | None = None
    compile_model: bool | str | None = None
    async_scheduling: bool | None = None
    cascade_attention: bool | None = None
    fuse_projections: bool | None = None

    def __post_init__(self) -> None:
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks)
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size <= 0
            or (self.block_size % 8)
        ):
            raise ValueError(f"`block_size` must be a positive multiple of 8 (e.g. 16), got {self.block_size!r}")
        for name in ("memory_fraction", "gpu_memory_utilization"):
            value = getattr(self, name)
            if name == "memory_fraction" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value <= 1.0):
                raise ValueError(f"`{name}` must be in (0, 1], got {value!r}")
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_seqs is not None:
            _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_seqs is not None and self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"`max_num_seqs` ({self.max_num_seqs}) must not exceed `max_num_batched_tokens` "
                f"({self.max_num_batched_tokens}): every running sequence needs a token of the budget each step"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"`enable_prefix_caching` must be a bool, got {self.enable_prefix_caching!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"`preemption_mode` must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if (
            isinstance(self.swap_space_gb, bool)
            or not isinstance(self.swap_space_gb, (int, float))
            or (self.swap_space_gb < 0)
        ):
            raise ValueError(f"`swap_space_gb` must be a number >= 0, got {self.swap_space_gb!r}")
        _optional_bool("use_cuda_graphs", self.use_cuda_graphs)
        _optional_bool("async_scheduling", self.async_scheduling)
        _optional_bool("cascade_attention", self.cascade_attention)
        _optional_bool("fuse_projections", self.fuse_projections)
        if not (
            self.compile_model is None or isinstance(self.compile_model, bool) or self.compile_model in COMPILE_MODES
        ):
            raise ValueError(
                f"`compile_model` must be None (auto), False, True, or one of {COMPILE_MODES}, "
                f"got {self.compile_model!r}"
            )

    def resolved(self, device: torch.device | str | None) -> "EngineConfig":
        """This config with the settings that depend on the model's (first) device filled in: ``max_num_seqs``."""
        if self.max_num_seqs is not None:
            return self
        return dataclasses.replace(self, max_num_seqs=default_max_num_seqs(device, self.max_num_batched_tokens))
