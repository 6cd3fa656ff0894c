"""Compile the MLA kernels' launches for sm_90 and sm_80 on a machine without a GPU (as gpu_compile.py does for the
other kernels): the CPU tests' interpreter never compiles them.

The launchers (``mla_decode_triton``, ``mla_prefill_triton``) run over CPU tensors at DeepSeek's widths
(kv_lora_rank 512 + rope 64 in bf16; fp32 at a small width; the head count changes no compiled code) with each
kernel's ``[grid]`` replaced by a recorder (nothing runs); each distinct launch is compiled through Triton's NVIDIA
pipeline and its shared memory checked against the card's limit. Run without ``TRITON_INTERPRET``; exits 1 on any
failure.
"""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from gpu_compile import SHARED_LIMIT, compile_launch  # noqa: E402
from hf_paged.kernels import mla_triton  # noqa: E402

KERNELS = ("_mla_decode_kernel", "_mla_merge_kernel", "_mla_prefill_kernel")


def record_launches() -> list[tuple]:
    """(jit_fn, positional args, num_warps, num_stages) of every launch the two launchers make here."""
    launches = {}

    class Recorder:
        def __init__(self, jit_fn):
            self.jit_fn = jit_fn

        def __getitem__(self, grid):
            def launch(num_warps=4, num_stages=2, **kwargs):
                args = tuple(kwargs[p.name] for p in self.jit_fn.params)
                consts = tuple(a for p, a in zip(self.jit_fn.params, args, strict=True) if p.is_constexpr)
                launches.setdefault((self.jit_fn.__name__, consts, num_warps, num_stages),
                                    (self.jit_fn, args, num_warps, num_stages))  # fmt: skip

            return launch

    for name in KERNELS:
        setattr(mla_triton, name, Recorder(getattr(mla_triton, name)))
    for dtype, num_heads, rank, rope in ((torch.bfloat16, 16, 512, 64), (torch.float32, 16, 128, 32)):
        kv_cache = torch.zeros(8, 16, 1, rank + rope, dtype=dtype)
        tables = torch.arange(8, dtype=torch.int32).view(2, 4)
        seq_lens = torch.tensor([60, 3], dtype=torch.int32)
        q_cat = torch.zeros(2, num_heads, rank + rope, dtype=dtype)
        for num_splits in (1, 4):
            mla_triton.mla_decode_triton(q_cat, kv_cache, tables, seq_lens, 0.1, rank, 64, num_splits=num_splits)
        cu = torch.tensor([0, 40, 43], dtype=torch.int32)
        q_cat = torch.zeros(43, num_heads, rank + rope, dtype=dtype)
        mla_triton.mla_prefill_triton(q_cat, kv_cache, tables, seq_lens, cu, 0.1, rank, 40)
    return list(launches.values())


def main() -> int:
    failures = 0
    for jit_fn, args, num_warps, num_stages in record_launches():
        for capability in (90, 80):
            consts = {p.name: a for p, a in zip(jit_fn.params, args, strict=True) if p.is_constexpr}
            label = f"sm_{capability} {jit_fn.__name__} warps={num_warps} stages={num_stages} {consts}"
            try:
                shared = compile_launch(jit_fn, args, num_warps, num_stages, False, capability).metadata.shared
                if shared > SHARED_LIMIT[capability]:
                    raise RuntimeError(f"{shared} bytes of shared memory, over the card's {SHARED_LIMIT[capability]}")
                print(f"ok   {label} shared={shared}", flush=True)
            except Exception as exc:  # every failure is reported, not just the first
                failures += 1
                print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
