"""Every kernel launch of the library compiles for sm_90 and sm_80 within the cards' shared memory, e4m3 caches'
for sm_90 only: Triton refuses them for sm_80 (tests/kernels/gpu_compile.py). Without a GPU: the CPU tests'
interpreter never compiles the kernels, so a GPU-only compile error or an over-large pipeline would otherwise first
show on the device."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HANG_TIMEOUT_S


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except Exception:  # Triton without its NVIDIA backend (e.g. not Linux x86-64)
        return False
    return True


@pytest.mark.skipif(
    not _nvidia_backend(),
    reason="this Triton has no NVIDIA backend (ptxas); runs wherever it has one, as in CI (Linux x86-64)",
)
def test_every_launch_compiles_for_nvidia_gpus():
    script = Path(__file__).with_name("gpu_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    num_shards = max(1, min(4, os.cpu_count() or 1))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "--shard", f"{i}/{num_shards}"],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for i in range(num_shards)
    ]
    outputs = [proc.communicate(timeout=HANG_TIMEOUT_S)[0] for proc in procs]
    failed = [line for out in outputs for line in out.splitlines() if line.startswith("FAIL")]
    assert not failed, "\n".join(failed)
    assert all(proc.returncode == 0 for proc in procs), "\n".join(out[-2000:] for out in outputs)
    compiled = [line for out in outputs for line in out.splitlines() if line.startswith("ok ")]
    names = " ".join(compiled)
    for kernel in (
        "_paged_decode_kernel",
        "_merge_splits_kernel",
        "_shared_prefix_kernel",
        "_paged_prefill_kernel",
        "_write_kv_kernel",
        "_copy_blocks_kernel",
        "_copy_blocks_layers_kernel",
        "WAIT_PREFIX': True",
        "LAUNCH_DEPENDENTS': True",
        "WAIT_PRIMARY': True",
        "KV_FP8': True",  # fp8 K/V caches
    ):
        assert kernel in names, f"no compile of {kernel}"
    assert any(line.startswith("ok   sm_80") for line in compiled) and any("sm_90" in line for line in compiled)
    # e5m2 caches (kv_cache_dtype="fp8_e5m2") compile for the A100: decode with its fused write, prefill, write_kv
    sm80_fp8 = " ".join(line for line in compiled if line.startswith("ok   sm_80") and "KV_FP8': True" in line)
    for kernel in ("_paged_decode_kernel", "_paged_prefill_kernel", "_write_kv_kernel"):
        assert kernel in sm80_fp8, f"no sm_80 compile of {kernel} over an e5m2 cache"


@pytest.mark.skipif(
    not _nvidia_backend(),
    reason="this Triton has no NVIDIA backend (ptxas); runs wherever it has one, as in CI (Linux x86-64)",
)
def test_e4m3_cache_kernels_do_not_compile_for_sm80():
    """Why hf_paged.core.kv_dtype.check_fp8_devices refuses "fp8"/"fp8_e4m3" below compute capability 8.9: Triton
    has no e4m3 type for sm_80. If a Triton release adds it, this fails: the refusal can then be relaxed."""
    script = Path(__file__).with_name("gpu_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), "--e4m3-sm80"], env=env, capture_output=True, text=True,
                         timeout=HANG_TIMEOUT_S)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "type fp8e4nv not supported in this architecture" in run.stdout, run.stdout[-2000:]


def _memory_ops(case: str) -> str:
    script = Path(__file__).with_name("gpu_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), "--memory-ops", case], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(
    not _nvidia_backend(),
    reason="this Triton has no NVIDIA backend (ptxas); runs wherever it has one, as in CI (Linux x86-64)",
)
def test_all_layers_copy_moves_16_bytes_an_access():
    """copy_blocks_layers' kernel, compiled for sm_90 as a launch with aligned tensors specializes it, loads and
    stores 16 bytes at a time. Its first version cast each layer's address to a pointer: the compiler took that as
    unaligned and copied 2 bytes at a time, and one launch for all layers ran slower than a launch a layer (H100,
    eager beam steps)."""
    accesses = _memory_ops("copy_blocks_layers")
    assert "ld.global.v4.b32" in accesses and "st.global.v4.b32" in accesses, accesses
    assert ".b16" not in accesses, accesses
