"""One GEMM for the projections that read the same input: q/k/v of an attention, gate/up of an MLP.

A decode step of a small model is a few hundred short kernels; at batch 1-256 each projection GEMM of a
Qwen3-0.6B layer takes ~5 µs whatever its width (NVIDIA H200 profile, benchmarks/tools/step_kernels.py), so the three
of q/k/v and the two of gate/up cost about as much as one GEMM of their summed width would, twice and a half
over. vLLM builds its models with merged projections (QKVParallelLinear, MergedColumnParallelLinear); here the
engine merges the user's modules in place, without touching the model's code:

- the sibling ``nn.Linear`` modules of a group (same parent, same input width, dtype, device and bias presence)
  get their weights concatenated into one tensor, and each module's parameters become views of it (no extra
  memory; ``state_dict`` keys and values are unchanged);
- each module is replaced by a ``FusedPart`` that computes the group's GEMM once for an input and returns its
  columns: the first part called with a tensor runs ``F.linear`` over the fused weight, the others called with
  the *same* tensor object slice that output (a different tensor: its own GEMM over its rows of the weight, so
  the result is always that module's projection). The cached input and output are dropped once every part of
  the group has read them.

Quantized projections stay unfused: torchao's weights are tensor subclasses (``Int8Tensor``, ``Float8Tensor``, ...)
whose scales and packing ``torch.cat`` does not merge into one valid quantized weight; bitsandbytes' modules are
``nn.Linear`` subclasses with their own forward; compressed-tensors keeps ``nn.Linear`` but sets a forward on the
instance (it quantizes each input, e.g. per token to FP8, before the GEMM: a fused GEMM would skip that) and, until
its first forward decompresses them, holds FP8 weights whose scales live in a separate ``weight_scale``. Such a
model keeps five projection GEMMs per layer instead of two: the same weight bytes are read, so a weight-bound decode
step loses only the extra launches (~5 µs each at small batch on an H200, fewer inside a CUDA graph), not bandwidth.

``unfuse_projections`` puts the original modules back (their parameters stay views of the fused storage).
Under torch.compile the parts trace like any module (the cache is Python state that dynamo tracks); the engine
fuses before compiling its layers.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# Sibling modules that read one input, by name (Llama, Qwen2/3, Mistral, Gemma, Phi-3-style layouts, ...).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Weights F.linear multiplies as they are (quantized weights of other dtypes need their scales).
_FUSABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(eq=False)
class _Group:
    weight: torch.Tensor  # [sum of out_features, in_features]
    bias: torch.Tensor | None  # [sum of out_features]
    num_parts: int
    # The input the last GEMM ran on, its output, and how many parts have yet to read it.
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    pending: int = 0
    originals: list = field(default_factory=list)  # (parent, name, original module)


class FusedPart(nn.Module):
    """One projection of a fused group: ``forward(x)`` equals the original ``nn.Linear``'s."""

    def __init__(self, original: nn.Linear, group: _Group, start: int):
        super().__init__()
        self.in_features, self.out_features = original.in_features, original.out_features
        self.weight = original.weight  # a view of the group's weight: state_dict keys and values unchanged
        self.bias = original.bias
        self.start = start
        self._data_ptr = original.weight.data_ptr()  # where the view into the fused weight starts
        self._group = group  # a plain attribute, not a submodule: the fused weight is no parameter of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        group = self._group
        if torch.compiler.is_compiling():  # traced code: dtype and device are what a trace can check
            moved = self.weight.dtype != group.weight.dtype or self.weight.device != group.weight.device
        else:
            moved = self.weight.data_ptr() != self._data_ptr
        if moved:  # the model was moved or cast since (.to(), .half()): its parameters have new storage
            return F.linear(x, self.weight, self.bias)
        if group.input is not x:
            group.input, group.output = x, F.linear(x, group.weight, group.bias)
            group.pending = group.num_parts
        out = group.output.narrow(-1, self.start, self.out_features)
        group.pending -= 1
        if group.pending == 0:
            group.input = group.output = None
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused"


def _fusable(modules: list) -> bool:
    if any(type(m) is not nn.Linear for m in modules):  # subclasses (bitsandbytes, LoRA...) keep their forward
        return False
    first = modules[0]
    for m in modules:
        w = m.weight
        if getattr(m, "_hf_hook", None) is not None or m._forward_hooks or m._forward_pre_hooks:
            return False  # accelerate's offload hooks, tensor parallelism's input/output hooks
        if "forward" in m.__dict__:
            return False  # a forward set on the instance (compressed-tensors' input quantization) would be skipped
        if type(w) is not nn.Parameter or type(w.data) is not torch.Tensor:
            return False  # DTensors, torchao's quantized weights and other tensor subclasses
        if w.dtype not in _FUSABLE_DTYPES:
            return False  # FP8 or integer weights: their scales are kept beside them, outside the GEMM
        if (w.dim(), w.shape[1], w.dtype, w.device) != (2, first.in_features, first.weight.dtype, first.weight.device):
            return False
        if (m.bias is None) != (first.bias is None):
            return False
    return True


@torch.no_grad()
def fuse_projections(model: nn.Module) -> list[_Group]:
    """Fuse every group of ``GROUPS`` found in ``model`` in place; returns the model's fused groups, those fused
    earlier (by another engine over the same model) included."""
    groups = list({id(m._group): m._group for m in model.modules() if isinstance(m, FusedPart)}.values())
    for parent in list(model.modules()):
        for names in GROUPS:
            modules = [getattr(parent, name, None) for name in names]
            if any(m is None for m in modules) or not _fusable(modules):
                continue
            weight = torch.cat([m.weight for m in modules])
            bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
            group = _Group(weight, bias, len(modules))
            start = 0
            for name, m in zip(names, modules, strict=True):
                rows = slice(start, start + m.out_features)
                m.weight.data = weight[rows]  # the parameter object stays; its storage is now the fused tensor's
                if bias is not None:
                    m.bias.data = bias[rows]
                setattr(parent, name, FusedPart(m, group, start))
                group.originals.append((parent, name, m))
                start += m.out_features
            groups.append(group)
    return groups


def unfuse_projections(groups: list[_Group]) -> None:
    """Put the original modules of ``fuse_projections`` back."""
    for group in groups:
        for parent, name, original in group.originals:
            setattr(parent, name, original)
        group.input = group.output = None
