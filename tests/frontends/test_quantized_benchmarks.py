"""The FP8-pool and weight-quantization benchmarks off the GPU (run_gpu.sh fp8-kernels, quant-engine,
quant-generate): the FP8 decode call they time, at a tiny shape through the Triton launcher, and CPU smoke runs of the
engine's decode-step timer and of generate.py's ``--quantization``."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import needs_triton

from hf_paged.frontends.bench_workloads import build_quantized

ROOT = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_triton
def test_fp8_kernels_decode_call_matches_the_reference_and_tabulates():
    """The call fp8_kv_kernels.py times (the engine's decode with its fused K/V write), over a bf16 and an fp8 pool,
    equals the reference over the pool it left; the table pairs the two pools of a shape."""
    tool = _load(ROOT / "tools" / "fp8_kv_kernels.py")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads = tool.CHECK_HEADS
    rows = []
    for pool, dtype in tool.POOLS.items():
        row = tool.bench_decode(dtype, 2, 40, heads, 40, 0, device, None)
        rows.append({**row, "pool": pool, "splits": 3 if pool == "bf16" else 2, "us": 10.0 if pool == "bf16" else 6.0})
        assert row["max_abs_diff"] < 2e-2, (pool, row)
    assert rows[0]["bytes"] - rows[1]["bytes"] == 2 * 2 * 40 * heads[1] * heads[2]  # fp8: K and V at one byte
    table = tool.format_tables(rows, 4000.0, "### header").splitlines()
    assert table[4].startswith("| 2 x 40 | 3 / 2 | 10.0 | 6.0 | 1.67x |")  # each pool's own split count
    with pytest.raises(ValueError, match="BATCHxCONTEXT"):
        tool.parse_shape("32by4096")


def test_quant_decode_steps_cpu_smoke_run_writes_a_row_per_batch(tmp_path):
    tool = _load(ROOT / "tools" / "quant_decode_steps.py")
    record_path = tmp_path / "record.json"
    assert tool.main(["--device", "cpu", "--quantization", "int4", "--batches", "2", "--json", str(record_path)]) == 0
    record = json.loads(record_path.read_text())
    assert record["card"] == "CPU" and record["workload"]["quantization"] == ["int4"]
    # every timed step decodes both rows
    assert [(r["weights"], r["batch"], r["tokens_per_step"]) for r in record["rows"]] == [("int4", 2, 2.0)]
    full = build_quantized("tiny", "none", "cpu")
    assert record["rows"][0]["weight_gb"] < 0.6 * sum(p.numel() * 4 for p in full.parameters()) / 1e9
    assert record["rows"][0]["floor_ms"]["copy"] is None and record["rows"][0]["ms_per_step"]["median"] > 0


def test_generate_quantization_runs_each_grid_with_its_weight_floor(tmp_path):
    bench = _load(ROOT / "generate.py")
    args = bench.parse_args(["--quantization", "none", "float8"])
    assert args.quantization == ["none", "float8"] and bench.parse_args([]).quantization is None
    record_path, out = tmp_path / "record.json", tmp_path / "table.md"
    argv = ["--device", "cpu", "--points", "1x8", "--modes", "greedy", "--systems", "dynamic", "paged-compiled",
            "--quantization", "none", "int4", "--repeats", "1", "--new-tokens", "3", "--json", str(record_path),
            "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads(record_path.read_text())["rows"]
    assert [(r["quantization"], r["system"]) for r in rows] == [
        ("none", "dynamic"),
        ("none", "paged-compiled"),
        ("int4", "dynamic"),
        ("int4", "paged-compiled"),
    ]
    assert rows[2]["weight_gb"] < 0.6 * rows[0]["weight_gb"]
    assert rows[0]["floor_ms"]["nominal"] == pytest.approx(rows[0]["weight_gb"] / 4800 * 1e3)
    assert all(r["same_tokens_as_dynamic"] == 1.0 for r in rows)  # each against its own quantization's dynamic
    lines = [line for line in out.read_text().splitlines() if line.startswith("| tiny")]
    assert lines[2].startswith("| tiny int4 |") and "floor" in lines[2] and "| 1.00 |" in lines[2]
