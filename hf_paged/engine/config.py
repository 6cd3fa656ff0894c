"""EngineConfig: every setting of a ContinuousBatcher, validated before anything is allocated.

One dataclass shared by the engine, the CLI, the benchmark and the profiler. ``__post_init__`` checks each
field's type and range with a message that names it; settings that depend on the model (the pool size from
free memory, CUDA graphs on CUDA) stay ``None`` here and are resolved by the engine.
"""

import dataclasses
import os
from dataclasses import dataclass

import torch

from hf_paged.core.kv_dtype import check_kv_cache_dtype

PREEMPTION_MODES = ("recompute", "swap")
COMPILE_MODES = ("layers", "full")  # compile_model=True means "full"

# max_num_seqs=None picks by the card, as vLLM does: LARGE_CARD_MAX_NUM_SEQS on a CUDA card of >= LARGE_CARD_GIB.
# 512, the largest decode graph bucket: +7% to +27% throughput over 256 on H200 workloads (hf-paged bench).
MAX_NUM_SEQS = 256
LARGE_CARD_MAX_NUM_SEQS = 512
LARGE_CARD_GIB = 70

# compile_model=None on one CUDA device with CUDA graphs: this environment variable, when set, picks the mode
# ("layers", "full", or "0"/"false"/"off"/"eager" for none); unset, "layers".
COMPILE_ENV = "HF_PAGED_COMPILE"
_COMPILE_OFF = ("0", "false", "off", "eager", "none")


def auto_compile_mode() -> str | bool:
    """What ``compile_model=None`` means for a model on one CUDA device with CUDA graphs (see ``COMPILE_ENV``).

    Raises:
        ValueError: ``$HF_PAGED_COMPILE`` is set to something else than a mode or an "off" word.
    """
    value = os.environ.get(COMPILE_ENV)
    if value is None or value.strip() == "":
        return "layers"
    value = value.strip().lower()
    if value in COMPILE_MODES:
        return value
    if value in _COMPILE_OFF:
        return False
    raise ValueError(f"${COMPILE_ENV} must be one of {COMPILE_MODES + _COMPILE_OFF} (or unset), got {value!r}")


def default_max_num_seqs(device: torch.device | str | None, max_num_batched_tokens: int) -> int:
    """What ``max_num_seqs=None`` means for an engine whose model is on ``device`` (its first device)."""
    device = torch.device(device) if device is not None else None
    cap = MAX_NUM_SEQS
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_properties(index).total_memory >= LARGE_CARD_GIB * 2**30:
            cap = LARGE_CARD_MAX_NUM_SEQS
    return min(cap, max_num_batched_tokens)


def on_cuda_by_default(value: bool | None, devices: list[torch.device]) -> bool:
    """A setting whose None means on for a model on CUDA (``async_scheduling``, ``cascade_attention``)."""
    return value if value is not None else devices[0].type == "cuda"


def cuda_graphs_on(use_cuda_graphs: bool | None, devices: list[torch.device]) -> bool:
    """What ``use_cuda_graphs`` resolves to: None means on for a model on one CUDA device."""
    if use_cuda_graphs is not None:
        return use_cuda_graphs
    return len(set(devices)) == 1 and devices[0].type == "cuda"


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
    """Settings of a ContinuousBatcher. Every field has a default that suits a model on one CUDA card.

    Attributes:
        num_blocks: KV blocks in the pool. None (default): sized from memory: on CUDA, what
            ``gpu_memory_utilization`` of the card leaves after a profiled full-budget step (hf_paged.engine.memory),
            or ``memory_fraction`` of free memory when that is given; on the CPU, 0.5 of free RAM up to 2 GiB. Set
            it for a fixed, reproducible pool (tests, several engines on one card).
        block_size: tokens per block, a positive multiple of 8 (default 16). Larger blocks mean fewer block-table
            entries but coarser prefix sharing and more memory lost to partly filled last blocks.
        memory_fraction: share of *free* device memory for the pool, in (0, 1]; None (default) uses
            ``gpu_memory_utilization`` instead. A simpler sizing that skips the profiling step.
        gpu_memory_utilization: share of the CUDA card's *total* memory this engine may use, weights, activations
            and pool together (as vLLM's setting), in (0, 1]; default 0.9. Lower it to leave room for other
            processes on the card.
        max_num_batched_tokens: token budget of one forward (default 2048); chunked prefill splits longer prompts.
            Larger budgets admit prompts faster at the cost of longer steps (higher latency for running requests).
        max_num_seqs: most sequences in one forward, and the most samples (``n``) or beams one request may have.
            None (default): by the card (``default_max_num_seqs``: 512 on a CUDA card of >= 70 GiB, 256 elsewhere,
            never above ``max_num_batched_tokens``), resolved by the engine (``resolved``).
        enable_prefix_caching: reuse full KV blocks across requests by content hash (default True). Turn it off
            only to measure uncached prefill.
        preemption_mode: what happens to the newest request when the pool runs out of blocks: "recompute"
            (default: free its blocks, recompute its tokens when readmitted) or "swap" (copy its blocks to CPU
            memory and back).
        swap_space_gb: CPU memory for swapped blocks in "swap" mode, >= 0 (default 4.0).
        use_cuda_graphs: replay CUDA graphs for every step that fits a bucket (decode and mixed steps). None
            (default): on for a model on one CUDA device. False runs every step eagerly (debugging, profiling).
        compile_model: torch.compile on CUDA (faster steps, seconds of start-up): "layers" compiles each decoder
            layer in place, the attention call staying eager between the compiled pieces (one compiled code for
            all layers, cached on disk by torch); "full" (or True) compiles the whole forward inside the CUDA
            graphs (longer start-up); False compiles nothing. None (default): for a model on one CUDA device with
            CUDA graphs, the mode named by the environment variable ``HF_PAGED_COMPILE`` ("layers", "full", or
            "0"/"false"/"off"/"eager" for none), "layers" when it is unset; a compile failure under this default
            warns and falls back to eager. Nothing is compiled on the CPU.
        async_scheduling: schedule and queue step N+1 on the device before reading back step N's tokens, so the
            device never waits for the host. None (default): on for a model on CUDA. A token sampled after a stop
            token is then computed and discarded.
        cascade_attention: shared-prefix decode: decode rows that share leading KV blocks (a common prompt prefix,
            the ``n`` samples of a prompt) read those blocks once per step for all of them (kernels/cascade.py),
            on the steps where the bytes saved are worth the extra kernel; other decode steps replay a plain
            decode graph. None (default): on for a model on CUDA, off elsewhere (one more decode graph per batch
            bucket to capture).
        fuse_projections: one GEMM for the sibling projections that read the same input (q/k/v, gate/up), their
            ``nn.Linear`` weights concatenated in place (hf_paged.engine.fuse: no extra memory, the modules' outputs
            and ``state_dict`` unchanged). None (default): on for a model on CUDA, not under tensor parallelism;
            False leaves the model's modules as they are.
        kv_cache_dtype: what the KV pool stores: "auto" (default: the model's dtype), "fp8" / "fp8_e4m3"
            (float8_e4m3fn) or "fp8_e5m2" (float8_e5m2). FP8 takes one byte an element: the same memory holds
            twice the tokens of a bf16 pool (the sizing above counts FP8 blocks), at a small accuracy cost; scales
            from the checkpoint's ``k_scale``/``v_scale`` where it has them, else 1.0 (hf_paged.core.kv_dtype).
            Latent-attention (MLA) models take "auto" only.
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
    kv_cache_dtype: str = "auto"

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
        check_kv_cache_dtype(self.kv_cache_dtype)
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
