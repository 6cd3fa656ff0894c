"""benchmarks/tools/ptxas_check.py on the CPU: the prefill kernel compiled for sm_90 and read back through ptxas -v."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "ptxas_check.py"


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path).exists()
    except Exception:  # no NVIDIA backend in this Triton build
        return False


needs_ptxas = pytest.mark.skipif(
    not _ptxas_available(),
    reason="needs Triton's NVIDIA backend and its bundled ptxas (the Linux x86-64 Triton wheel, as CI and the device "
    "image install it); a Triton build without it cannot compile for sm_90",
)


@needs_ptxas
def test_prefill_forms_compile_for_hopper_and_report_usage(tmp_path):
    # A fresh process without TRITON_INTERPRET (the suite's interpreter mode makes the kernels uncompilable), and a
    # fresh Triton cache: the compile really runs.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, str(PATH), "--quick"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| current")]
    assert [r[1].strip() for r in rows] == ["bound grid", "tile map, SEQS_PAD 256"]
    for row in rows:
        registers, stack, spill_stores, spill_loads = (int(cell) for cell in row[4:8])
        assert 1 <= registers <= 255 and stack >= spill_stores >= 0 and spill_loads >= 0, row


def test_ptxas_check_refuses_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    script = _script()
    with pytest.raises(SystemExit):
        script.main(["--quick"])


@needs_ptxas
def test_ptxas_usage_parses_ptxas_lines(monkeypatch):
    script = _script()

    class Done:
        stderr = (
            "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
            "ptxas info    : Function properties for k\n"
            "    112 bytes stack frame, 108 bytes spill stores, 120 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 112 bytes cumulative stack size\n"
        )

    monkeypatch.setattr(script.subprocess, "run", lambda *a, **k: Done())
    assert script.ptxas_usage("// ptx") == {"registers": 255, "stack": 112, "spill_stores": 108, "spill_loads": 120}


def _script():
    spec = importlib.util.spec_from_file_location("ptxas_check", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
