"""Compile every Triton kernel launch the library makes for NVIDIA GPUs, on a machine without one.

The CPU tests run the kernels under ``TRITON_INTERPRET=1``, which executes their Python and never compiles them: a
construct the GPU compiler rejects, or launch settings whose pipeline stages need more shared memory than a card has,
would first show on the GPU. This script drives the host wrappers (``paged_decode_triton``, ``paged_prefill_triton``,
``write_kv_triton``, ``copy_blocks_triton``, ``copy_blocks_layers_triton``) over the argument
combinations the engine and PagedCache use, with CPU tensors and every ``Launcher`` replaced by a recorder (nothing
runs), then compiles each distinct launch through Triton's whole NVIDIA pipeline (IR, LLVM, PTX, ptxas) for sm_90
(H100/H200) and sm_80 (A100), and checks its shared memory against the card's limit. The programmatic-dependent-launch
variants (SM90 only, chosen on a CUDA device) are compiled for sm_90 too.

Run without ``TRITON_INTERPRET`` (the interpreter replaces the kernels' helper functions):
``python tests/kernels/gpu_compile.py [--shard I/N]`` prints one line a compile and exits 1 on any failure
(``--memory-ops CASE``: one kernel's global-memory instructions; ``--e4m3-sm80``: the error an e4m3 cache's kernel
gets for sm_80);
tests/kernels/test_gpu_compile.py runs it in one subprocess a core.
"""

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from hf_paged.kernels import cache_ops, decode, launch, prefill  # noqa: E402
from hf_paged.kernels.kv_quant import new_cache  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# Opt-in shared memory a block may use: H100/H200 227 KB, A100 163 KB (CUDA programming guide, compute capabilities).
SHARED_LIMIT = {90: 232448, 80: 166912}
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv",
           torch.float8_e5m2: "fp8e5"}  # fmt: skip


def record_launches() -> list[tuple]:
    """(kernel, args, num_warps, num_stages, launch_pdl) of every launch the wrappers make here, deduplicated by what
    the compiled code depends on."""
    seen: dict = {}

    def record(self, grid, *args, num_warps=4, num_stages=2, launch_pdl=False):
        jit_fn = self.jit_fn
        kinds = tuple(_kind(p, a) for p, a in zip(jit_fn.params, args, strict=True))
        key = (jit_fn.__name__, num_warps, num_stages, launch_pdl, kinds)
        seen.setdefault(key, (jit_fn, args, num_warps, num_stages, launch_pdl))

    launch.Launcher.__call__ = record
    gen = torch.Generator().manual_seed(0)

    def cache(num_blocks, block_size, kv_heads, head_dim, dtype):
        return torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)

    # bf16 at the two model shapes of the benchmarks (group 2 and 4, head_dim 128): every decode variant the engine
    # and PagedCache launch; other dtypes and head dims (fp16, fp32, head_dim 64 group 1, 256 group 4): the plain ones.
    cases = [(torch.bfloat16, 16, 8, 128, True), (torch.bfloat16, 32, 8, 128, True), (torch.float16, 8, 8, 64, False),
             (torch.float32, 8, 2, 256, False)]  # fmt: skip
    for dtype, heads, kv_heads, head_dim, full in cases:
        k, v = cache(64, 16, kv_heads, head_dim, dtype), cache(64, 16, kv_heads, head_dim, dtype)
        tables = torch.arange(64, dtype=torch.int32).view(4, 16)
        seq_lens = torch.tensor([200, 150, 0, 97], dtype=torch.int32)
        q = torch.randn(4, heads, head_dim, generator=gen).to(dtype)
        new_k = torch.randn(4, kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([199, 16 + 149, -1, 48 + 96], dtype=torch.int64)
        prefix = torch.tensor([64], dtype=torch.int32)
        scale = head_dim**-0.5
        for max_seq_len in (256, 40960) if full else (40960,):  # short splits, long splits (the engine's graphs)
            for num_splits in (1, 3):
                common = dict(max_seq_len=max_seq_len, num_splits=num_splits)
                decode.paged_decode_triton(q, k, v, tables, seq_lens, scale, **common)
                if not full:
                    continue
                decode.paged_decode_triton(q, k, v, tables, seq_lens, scale, new_key=new_k, new_value=new_k,
                                           slot_mapping=slots, **common)  # fmt: skip
                decode.paged_decode_triton(q, k, v, tables, seq_lens, scale, sliding_window=64, soft_cap=30.0,
                                           **common)  # fmt: skip
                decode.paged_decode_triton(q, k, v, tables, seq_lens, scale, prefix_len=prefix,
                                           max_prefix_len=max_seq_len, new_key=new_k, new_value=new_k,
                                           slot_mapping=slots, **common)  # fmt: skip
        # Prefill: fresh prompts (K/V from the new-token tensors) and chunks over the cache; window and cap.
        num_tokens = 40
        qp = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
        kp = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
        cu = torch.tensor([0, 30, 31, 31, 40], dtype=torch.int32)
        for max_query_len in (30, 1024) if full else (1024,):
            prefill.paged_prefill_triton(qp, k, v, tables, seq_lens, cu, scale, max_query_len=max_query_len,
                                         max_seq_len=200)  # fmt: skip
            if full:
                prefill.paged_prefill_triton(qp, k, v, tables, cu[1:], cu, scale, max_query_len=max_query_len,
                                             max_seq_len=200, key=kp, value=kp)  # fmt: skip
                prefill.paged_prefill_triton(qp, k, v, tables, seq_lens, cu, scale, max_query_len=max_query_len,
                                             max_seq_len=200, sliding_window=64, soft_cap=30.0)  # fmt: skip
        cache_ops.write_kv_triton(kp, kp, k, v, torch.arange(num_tokens, dtype=torch.int64))
        cache_ops.copy_blocks_triton(k, v, torch.tensor([0, 1]), torch.tensor([5, 6]))
        k2, v2 = cache(64, 16, kv_heads, head_dim, dtype), cache(64, 16, kv_heads, head_dim, dtype)
        offsets = cache_ops.layer_offsets([k, k2], [v, v2])
        cache_ops.copy_blocks_layers_triton(*offsets, k, torch.tensor([0, 1]), torch.tensor([5, 6]))
    _record_fp8_launches(gen)
    return list(seen.values())


def _record_fp8_launches(gen: torch.Generator) -> None:
    """FP8 caches (kernels/kv_quant.py) under bf16 queries at the benchmark shape (32 heads, 8 KV heads, head_dim
    128), both formats, V keys-minor as in the pool: the decode variants (splits, fused write, window and cap, shared
    prefix), prefill over the cache (with key/value too, which an fp8 cache does not read), write_kv with per-head and
    per-tensor scales, and the copies (bytes). e4m3 launches compile for sm_90 only (Triton has no e4m3 type before sm_89: ``e4m3_on_sm80``),
    e5m2 ones for sm_80 too. Every variant in e4m3; e5m2 differs only in its conversions, so one variant of each
    kernel in it (the check's CI time)."""
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        every = fp8 is torch.float8_e4m3fn
        k = torch.randn(64, 16, 8, 128, generator=gen).to(fp8)
        v = new_cache(64, 16, 8, 128, fp8, "cpu", value=True)  # the pool's layout: keys-minor
        v.copy_(torch.randn(64, 16, 8, 128, generator=gen).to(fp8))
        scales = {"k_scale": torch.rand(8, generator=gen) + 0.5, "v_scale": torch.tensor([0.7])}
        tables = torch.arange(64, dtype=torch.int32).view(4, 16)
        seq_lens = torch.tensor([200, 150, 0, 97], dtype=torch.int32)
        q = torch.randn(4, 32, 128, generator=gen).to(torch.bfloat16)
        new_k = torch.randn(4, 8, 128, generator=gen).to(torch.bfloat16)
        slots = torch.tensor([199, 16 + 149, -1, 48 + 96], dtype=torch.int64)
        prefix = torch.tensor([64], dtype=torch.int32)
        for max_seq_len in (256, 40960) if every else (256,):
            for num_splits in (1, 3) if every else (3,):
                common = dict(max_seq_len=max_seq_len, num_splits=num_splits, **scales)
                decode.paged_decode_triton(q, k, v, tables, seq_lens, 0.088, new_key=new_k, new_value=new_k,
                                           slot_mapping=slots, **common)  # fmt: skip
                if not every:
                    continue
                decode.paged_decode_triton(q, k, v, tables, seq_lens, 0.088, **common)
                decode.paged_decode_triton(q, k, v, tables, seq_lens, 0.088, sliding_window=64, soft_cap=30.0,
                                           **common)  # fmt: skip
                decode.paged_decode_triton(q, k, v, tables, seq_lens, 0.088, prefix_len=prefix,
                                           max_prefix_len=max_seq_len, new_key=new_k, new_value=new_k,
                                           slot_mapping=slots, **common)  # fmt: skip
        qp = torch.randn(40, 32, 128, generator=gen).to(torch.bfloat16)
        kp = torch.randn(40, 8, 128, generator=gen).to(torch.bfloat16)
        cu = torch.tensor([0, 30, 31, 31, 40], dtype=torch.int32)
        for max_query_len in (30, 1024) if every else (1024,):
            prefill.paged_prefill_triton(qp, k, v, tables, seq_lens, cu, 0.088, max_query_len=max_query_len,
                                         max_seq_len=200, key=kp, value=kp, **scales)  # fmt: skip
            if every:
                prefill.paged_prefill_triton(qp, k, v, tables, seq_lens, cu, 0.088, max_query_len=max_query_len,
                                             max_seq_len=200, sliding_window=64, soft_cap=30.0, **scales)  # fmt: skip
        cache_ops.write_kv_triton(kp, kp, k, v, torch.arange(40, dtype=torch.int64), **scales)
        cache_ops.copy_blocks_triton(k, v, torch.tensor([0, 1]), torch.tensor([5, 6]))
        k2, v2 = torch.empty_like(k), torch.empty_like(v)
        offsets = cache_ops.layer_offsets([k, k2], [v, v2])
        cache_ops.copy_blocks_layers_triton(*offsets, k, torch.tensor([0, 1]), torch.tensor([5, 6]))


def _kind(param, value):
    if param.is_constexpr or value is None or type(value) is bool:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype
    if type(value) is int:
        return value == 1 and not param.do_not_specialize, -(2**31) <= value < 2**31
    return type(value)


def _signature(jit_fn, args) -> tuple[dict, dict]:
    signature, constexprs = {}, {}
    for index, (param, value) in enumerate(zip(jit_fn.params, args, strict=True)):
        if param.is_constexpr or value is None or type(value) is bool:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _DTYPES[value.dtype]
        elif type(value) is int:
            if value == 1 and not param.do_not_specialize:  # Triton folds a specialized 1 into the code
                signature[param.name] = "constexpr"
                constexprs[(index,)] = 1
            else:
                signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    return signature, constexprs


def compile_launch(jit_fn, args, num_warps, num_stages, launch_pdl, capability: int):
    signature, constexprs = _signature(jit_fn, args)
    source = ASTSource(fn=jit_fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if launch_pdl:
        options["launch_pdl"] = True
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def _pdl_variants(launches: list[tuple]) -> list[tuple]:
    """The decode and merge kernels as a CUDA device launches them with PDL (split kernel LAUNCH_DEPENDENTS, merge
    WAIT_PRIMARY and launch_pdl; a one-split shared-prefix call's prefix kernel LAUNCH_DEPENDENTS and split kernel
    WAIT_PREFIX and launch_pdl): SM90 only, never chosen with CPU tensors."""
    out = []
    for jit_fn, args, num_warps, num_stages, _ in launches:
        values = {p.name: a for p, a in zip(jit_fn.params, args, strict=True)}
        # A one-split shared-prefix call (HAS_PREFIX and WRITE_OUT): the prefix kernel first, the split kernel as its
        # dependent.
        cascade_flag = {"_shared_prefix_kernel": "LAUNCH_DEPENDENTS", "_paged_decode_kernel": "WAIT_PREFIX"}
        flag = cascade_flag.get(jit_fn.__name__)
        if flag == "LAUNCH_DEPENDENTS" or (flag and values["HAS_PREFIX"] and values["WRITE_OUT"]):
            patched = [True if p.name == flag else a for p, a in zip(jit_fn.params, args, strict=True)]
            out.append((jit_fn, tuple(patched), num_warps, num_stages, flag == "WAIT_PREFIX"))
        # paged_decode_triton uses PDL for several splits without a prefix: the split kernel triggers the merge
        # (LAUNCH_DEPENDENTS), the merge waits for it (WAIT_PRIMARY).
        for flag in ("LAUNCH_DEPENDENTS", "WAIT_PRIMARY"):
            several_splits = not values.get("WRITE_OUT", False)  # the merge has no WRITE_OUT: it runs for several
            if flag in values and "HAS_PREFIX" in values and not values["HAS_PREFIX"] and several_splits:
                patched = [True if p.name == flag else a for p, a in zip(jit_fn.params, args, strict=True)]
                out.append((jit_fn, tuple(patched), num_warps, num_stages, flag == "WAIT_PRIMARY"))
    return out


def _capabilities(launch_: tuple) -> tuple[int, ...]:
    """The compute capabilities a recorded launch compiles for: sm_90 only for one over an e4m3 tensor (Triton's
    float8e4nv exists from sm_89 on), sm_90 and sm_80 for the rest, e5m2 caches included."""
    e4m3 = any(isinstance(a, torch.Tensor) and a.dtype is torch.float8_e4m3fn for a in launch_[1])
    return (90,) if e4m3 else (90, 80)


def e4m3_on_sm80() -> str:
    """Compile the e4m3 write_kv launch for sm_80 and return the first error line that names the fp8 type, or
    "compiled" (a Triton that converts e4m3 on sm_80: hf_paged.core.kv_dtype's refusal could then go)."""
    fp8_writes = [
        launch_ for launch_ in record_launches()
        if launch_[0].__name__ == "_write_kv_kernel" and _capabilities(launch_) == (90,)
    ]  # fmt: skip
    try:
        compile_launch(*fp8_writes[0][:5], 80)
    except Exception as exc:
        return next((line.strip() for line in str(exc).splitlines() if "fp8e4nv" in line), repr(exc))
    return "compiled"


def _memory_cases() -> dict:
    """Kernels whose global-memory accesses tests/kernels/test_gpu_compile.py checks, each as a launch with 16-byte
    aligned tensors and int arguments divisible by 16 specializes it: (kernel, signature, constexprs by name)."""
    copy_sig = {"k_layers_ptr": "*i64", "v_layers_ptr": "*i64", "cache_ptr": "*bf16", "src_ptr": "*i64",
                "dst_ptr": "*i64", "stride_cache_block": "i32"}  # fmt: skip
    return {
        "copy_blocks_layers": (cache_ops.COPY_BLOCKS_LAYERS.jit_fn, copy_sig, {"BLOCK_NUMEL": 16384, "TILE": 4096}),
    }


def memory_ops(case: str) -> list[str]:
    """The distinct global-memory instructions (loads, stores, async copies) of ``case``'s sm_90 PTX."""
    import re

    jit_fn, signature, consts = _memory_cases()[case]
    names = [p.name for p in jit_fn.params]
    signature = {**signature, **{name: "constexpr" for name in consts}}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name not in consts}
    source = ASTSource(fn=jit_fn, signature=signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": 4, "num_stages": 3}
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    return sorted(set(re.findall(r"(?:ld\.global|st\.global|cp\.async\.cg)[.\w]*", ptx)))


def main(argv: list[str] | None = None) -> int:
    """``--shard I/N``: compile every N-th job from the I-th (the test runs the shards in parallel processes).
    ``--memory-ops CASE``: print one compile's global-memory instructions (``memory_ops``). ``--e4m3-sm80``: print
    ``e4m3_on_sm80()``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--memory-ops"]:
        print(" ".join(memory_ops(argv[1])))
        return 0
    if argv[:1] == ["--e4m3-sm80"]:
        print(e4m3_on_sm80())
        return 0
    shard, num_shards = (int(x) for x in argv[1].split("/")) if argv[:1] == ["--shard"] else (0, 1)
    launches = record_launches()
    jobs = [(launch_, cc) for launch_ in launches for cc in _capabilities(launch_)]
    jobs += [(v, 90) for v in _pdl_variants(launches)]
    jobs = jobs[shard::num_shards]
    failures = 0
    start = time.perf_counter()
    for (jit_fn, args, num_warps, num_stages, launch_pdl), capability in jobs:
        consts = {p.name: a for p, a in zip(jit_fn.params, args, strict=True) if p.is_constexpr}
        label = f"sm_{capability} {jit_fn.__name__} warps={num_warps} stages={num_stages} pdl={launch_pdl} {consts}"
        try:
            kernel = compile_launch(jit_fn, args, num_warps, num_stages, launch_pdl, capability)
            shared = kernel.metadata.shared
            if shared > SHARED_LIMIT[capability]:
                raise RuntimeError(f"{shared} bytes of shared memory, over the card's {SHARED_LIMIT[capability]}")
            print(f"ok   {label} shared={shared}", flush=True)
        except Exception as exc:  # every failure is reported, not just the first
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
    print(f"{len(jobs)} compiles ({len(launches)} distinct launches), {failures} failed, "
          f"{time.perf_counter() - start:.0f} s, triton {triton.__version__}")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
