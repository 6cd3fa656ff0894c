"""Registers, stack and spills of the prefill kernel's forms for Hopper, compiled on the CPU (no GPU needed).

``triton.compile`` builds a kernel for ``GPUTarget("cuda", 90, 32)`` from its source alone, and Triton's bundled
``ptxas -v`` reports what a thread of it uses: the way to see why one form of the kernel runs slower than another
(e.g. the exact tile map's slot loop raises a thread's stack bytes at 255 registers). The figures are Triton-version
dependent (the CPU image's Triton may be newer than the card's); compare forms and revisions in one run, not across
runs.

Each row compiles the prefill kernel at the engine's Hopper tiles (``kernels.prefill.default_tiles``: fresh
prompts' K/V from the new-token tensors, and K/V through the block table), bf16, head_dim 128, block_size 16, GQA
group 4 (Llama-3.1-8B) or 2 (Qwen3-0.6B), in each grid form: the bound grid (``SEQS_PAD`` 0) and the exact tile map
with its slot loop (``SEQS_PAD`` 4 and 256). Pointers and strides are marked 16-byte divisible, as the launcher's
specialization sees them in the engine. ``--rev REV`` adds the same rows for the kernel of a git revision (its
``kernels/`` package, extracted to a temporary folder).

Run: python benchmarks/tools/ptxas_check.py [--rev REV] [--groups 4 2] [--quick]   (TRITON_INTERPRET unset)
"""

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_INT_POINTERS = ("block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr")
_FLOATS = ("qk_scale", "soft_cap")


def _signature(fn, constexprs: dict) -> tuple[dict, dict]:
    """Triton's (signature, attrs) for ``fn``: bf16 / int32 pointers, fp32 scales, int32 sizes; pointers and
    specialized ints 16-byte divisible."""
    signature, attrs = {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in _INT_POINTERS else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride") and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def ptxas_usage(ptx: str) -> dict:
    """``ptxas -v`` of ``ptx`` for sm_90a: registers, stack bytes, spill store / load bytes."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(ptx)
        run = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    text = run.stderr

    def grab(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    return {
        "registers": grab(r"Used (\d+) registers"),
        "stack": grab(r"(\d+) bytes (?:cumulative )?stack"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
    }


def _kernel(prefill):
    """The prefill kernel's JIT function and its default-tile function (a revision's module may hold them under
    other names: its launcher object, or private names)."""
    launcher = getattr(prefill, "PREFILL", None)
    fn = launcher.jit_fn if launcher is not None else prefill._paged_prefill_kernel
    return fn, getattr(prefill, "default_tiles", None) or prefill._default_tiles


def compile_prefill(prefill, contig_kv: bool, group: int, seqs_pad: int | None) -> dict:
    """ptxas usage of the prefill kernel at the engine's tiles; ``seqs_pad`` None: a kernel without the tile map (no
    such parameter)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, default_tiles = _kernel(prefill)
    block_m, block_n, num_warps, num_stages, k_row_major = default_tiles(torch.bfloat16, 128, contig_kv)
    constexprs = dict(HEAD_DIM=128, BLOCK_SIZE=16, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=128,
                      HAS_WINDOW=False, HAS_SOFT_CAP=False, DOT_FP32=False, K_ROW_MAJOR=k_row_major,
                      EXACT_SOFTMAX=False, CONTIG_KV=contig_kv, HAS_SINKS=False)  # fmt: skip
    if seqs_pad is not None:
        constexprs["SEQS_PAD"] = seqs_pad
    if any(param.name == "KV_FP8" for param in fn.params):  # a bf16 cache (a revision before fp8 caches has no flag)
        constexprs["KV_FP8"] = False
    signature, attrs = _signature(fn, constexprs)
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    usage = ptxas_usage(compiled.asm["ptx"])
    usage["tiles"] = f"{block_m} x {block_n}, {num_warps} warps, {num_stages} stages"
    return usage


def revision_module(rev: str, tmp: str):
    """``kernels.prefill`` of git revision ``rev``, imported from ``tmp`` as its own package."""
    package = Path(tmp) / f"kernels_{re.sub(r'[^0-9A-Za-z]', '_', rev)}"
    package.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:kernels"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()  # fmt: skip
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run(["git", "show", f"{rev}:kernels/{name}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout  # fmt: skip
            (package / name).write_text(text)
    sys.path.insert(0, tmp)
    return importlib.import_module(f"{package.name}.prefill")


def rows(prefill, label: str, groups: list[int], forms: list[int | None], kv_paths=(True, False)) -> list[str]:
    out = []
    for group in groups:
        for contig_kv in kv_paths:
            for seqs_pad in forms:
                u = compile_prefill(prefill, contig_kv, group, seqs_pad)
                form = "bound grid" if not seqs_pad else f"tile map, SEQS_PAD {seqs_pad}"
                kv = "new K/V" if contig_kv else "block table"
                out.append(f"| {label} | {form} | {kv} ({u['tiles']}) | {group} | {u['registers']} | {u['stack']} | "
                           f"{u['spill_stores']} | {u['spill_loads']} |")  # fmt: skip
                print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="also compile the prefill kernel of this git revision")
    parser.add_argument("--groups", type=int, nargs="+", default=[4], help="GQA groups (query heads a KV head)")
    parser.add_argument("--quick", action="store_true", help="the new-K/V tiles only, bound grid and SEQS_PAD 256")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the kernels must be imported as compilable JIT functions")
    sys.path.insert(0, str(ROOT))
    from hf_paged.kernels import prefill

    print("| kernel | grid form | tiles | group | registers | stack bytes | spill stores | spill loads |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    if args.quick:
        rows(prefill, "current", args.groups, [0, 256], kv_paths=(True,))
        return 0
    rows(prefill, "current", args.groups, [0, 4, 256])
    if args.rev:
        with tempfile.TemporaryDirectory() as tmp:
            old = revision_module(args.rev, tmp)
            has_map = "SEQS_PAD" in _kernel(old)[0].arg_names
            rows(old, args.rev, args.groups, [0, 4, 256] if has_map else [None])
    return 0


if __name__ == "__main__":
    sys.exit(main())
