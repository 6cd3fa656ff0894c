"""KV pool sizing from a profiling forward: the pool takes what a memory budget leaves after a full step.

As vLLM and nano-vllm do: before the pool exists, the engine runs one forward of a full step
(``max_num_batched_tokens`` tokens, ``max_num_seqs`` logits rows) over a pool of a few blocks and measures
the peak the allocator reached above the weights, then one sampling step with the costliest settings. On each
device the pool then gets

    budget = gpu_memory_utilization * total
             - memory torch does not manage (CUDA context, other processes)
             - memory torch holds now (weights, buffers)
             - activation peak x (2 when steps can also run eagerly beside the CUDA graphs' private pool)
             - the logits every captured graph keeps as its output (lm_head device)
             - the sampler's fp32 logits and workspace (lm_head device)

    num_blocks = min over devices of budget // (K/V bytes of one block for the layers on that device)

so the default uses the card and a full-budget step never runs out of memory. Under tensor parallelism every
rank profiles its own device and the ranks agree on the smallest pool.

A block's K/V bytes follow the pool's storage dtype: an FP8 pool (``kv_cache_dtype``) takes one byte an element, so
the same budget holds twice the blocks (and tokens) of a bf16 pool.
"""

import gc
from dataclasses import dataclass, field

import torch

from hf_paged.core.kv_pool import KVPool
from hf_paged.core.model_info import ModelInfo
from hf_paged.engine.cuda_graphs import MIXED_TOKEN_SIZES
from hf_paged.engine.model_runner import ModelRunner
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.sampler import Sampler


@dataclass
class DeviceBudget:
    """How one device's memory was split (bytes)."""

    device: str
    total: int
    utilization: float
    non_torch: int  # used on the device but not by this process's torch allocator (CUDA context, others)
    allocated: int  # reserved by torch before the pool (weights, buffers)
    activations: int  # peak of the profiling forward (x2 when graphs and eager steps coexist) + graph outputs
    sampler: int  # the fp32 logits of max_num_seqs rows and the sampler's workspace
    bytes_per_block: int

    @property
    def kv_budget(self) -> int:
        used = self.non_torch + self.allocated + self.activations + self.sampler
        return int(self.utilization * self.total) - used

    @property
    def num_blocks(self) -> int:
        return max(self.kv_budget, 0) // self.bytes_per_block

    def describe(self) -> str:
        gib = 2**30
        parts = (
            f"{self.utilization:g} of {self.total / gib:.1f} GiB = {self.utilization * self.total / gib:.2f} GiB",
            f"CUDA context and other processes {self.non_torch / gib:.2f}",
            f"weights and buffers {self.allocated / gib:.2f}",
            f"activations {self.activations / gib:.2f}",
            f"sampler {self.sampler / gib:.2f}",
        )
        return f"{self.device}: " + ", ".join(parts) + f" -> KV pool {max(self.kv_budget, 0) / gib:.2f} GiB"


@dataclass
class MemoryProfile:
    """The profiling result: the pool size and each device's split of the budget."""

    num_blocks: int
    devices: list[DeviceBudget] = field(default_factory=list)
    block_size: int = 0  # tokens per block
    kv_dtype: str = ""  # what the pool stores, e.g. "bfloat16" or "float8_e4m3fn"

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds."""
        return self.num_blocks * self.block_size

    def __str__(self) -> str:
        head = f"{self.num_blocks} KV blocks ({self.num_tokens} tokens of {self.kv_dtype})"
        return head + "; " + "; ".join(d.describe() for d in self.devices)


def describe_kv_pool(info: ModelInfo, num_blocks: int, block_size: int) -> str:
    """One line on a pool of ``num_blocks``: its storage dtype, the tokens it holds and its bytes."""
    size = num_blocks * info.bytes_per_block(block_size)
    return (
        f"KV pool: {num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens, kv_cache_dtype "
        f"{info.kv_cache_dtype} ({_dtype_name(info.dtype)}), {size / 2**30:.2f} GiB"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_bytes_per_device(info: ModelInfo, block_size: int) -> dict[torch.device, int]:
    """K/V bytes of one block for the layers on each device (each allocated tensor once: a layer that shares
    another's K/V adds nothing)."""
    out: dict[torch.device, int] = {}
    for d, size in zip(info.devices, KVPool.layer_bytes_per_block(info.layers, block_size, info.dtype), strict=True):
        out[d] = out.get(d, 0) + size
    return out


def profile_num_blocks(
    model: torch.nn.Module,
    info: ModelInfo,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
    use_cuda_graphs: bool,
    max_model_len: int,
    fuse_projections: bool | None = None,
) -> MemoryProfile:
    """Size the pool from one profiling forward and sampling step (CUDA only; the model is already "paged").

    Raises:
        ValueError: the budget leaves no room for the pool on some device (the message shows the split).
    """
    devices = sorted({d for d in info.devices if d.type == "cuda"}, key=str)
    lm_head = model.get_output_embeddings()
    out_device = lm_head.weight.device if lm_head is not None else devices[0]
    num_tokens = max(1, min(max_num_batched_tokens, max_model_len))
    num_rows = min(max_num_seqs, num_tokens)
    gc.collect()
    torch.cuda.empty_cache()
    for d in devices:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    # Reserved, not allocated: what the device gives the allocator, fragmentation included.
    before = {d: torch.cuda.memory_reserved(d) for d in devices}
    tiny = info.make_kv_pool(-(-num_tokens // block_size) + 1, block_size)  # the forward's table fits in it
    runner = ModelRunner(model, tiny, block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         max_num_batched_tokens=max_num_batched_tokens, use_cuda_graphs=use_cuda_graphs,
                         fuse_projections=fuse_projections)  # fmt: skip
    logits = runner.warmup(num_tokens, num_logits=num_rows)  # [num_rows, vocab] fp32
    torch.cuda.synchronize(out_device)
    peak = {d: torch.cuda.max_memory_reserved(d) - before[d] for d in devices}
    # The sampler's own workspace on top of the logits, with the costliest settings (penalties, top-k/p, logprobs).
    torch.cuda.reset_peak_memory_stats(out_device)
    held = torch.cuda.memory_reserved(out_device)
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1, logprobs=20)
    Sampler()(logits, [params] * num_rows, [[1]] * num_rows, [[1]] * num_rows, [None] * num_rows)
    torch.cuda.synchronize(out_device)
    sampler_bytes = torch.cuda.max_memory_reserved(out_device) - held + logits.numel() * logits.element_size()
    graph_outputs = runner.graph_output_bytes()
    del runner, tiny, logits
    gc.collect()
    torch.cuda.empty_cache()
    # Steps above the largest graph bucket (or all, without graphs) run eagerly from the allocator's cache, while
    # the graphs keep their own private pool of about one step's activations: both can be resident.
    graphs_and_eager = use_cuda_graphs and max_num_batched_tokens > MIXED_TOKEN_SIZES[-1]
    per_block = kv_bytes_per_device(info, block_size)
    budgets = []
    for d in devices:
        free, total = torch.cuda.mem_get_info(d)
        budgets.append(
            DeviceBudget(
                device=str(d),
                total=total,
                utilization=gpu_memory_utilization,
                non_torch=max(0, total - free - torch.cuda.memory_reserved(d)),
                allocated=torch.cuda.memory_reserved(d),
                activations=peak[d] * (2 if graphs_and_eager else 1) + (graph_outputs if d == out_device else 0),
                sampler=sampler_bytes if d == out_device else 0,
                bytes_per_block=per_block.get(d, 0) or 1,
            )
        )
    num_blocks = min(b.num_blocks for b in budgets if per_block.get(torch.device(b.device)))
    num_blocks = info.same_on_every_rank(num_blocks)
    profile = MemoryProfile(num_blocks, budgets, block_size, _dtype_name(info.dtype))
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for a KV block after a "
            f"{num_tokens}-token step ({profile}); raise gpu_memory_utilization, lower max_num_batched_tokens "
            "or max_num_seqs, or pass num_blocks="
        )
    return profile
