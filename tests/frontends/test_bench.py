"""hf-paged bench off the GPU: its workloads, the physical floor, the table and JSON record, and the step-by-step
engine tools in benchmarks/ on a tiny model (the timed runs need a GPU: benchmarks/run_gpu.sh engine)."""

import json
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from hf_paged.frontends.bench import format_table, main, summarize
from hf_paged.frontends.bench_record import make_record, source_commit, write_record
from hf_paged.frontends.bench_workloads import SHAPES, build_model, floor_seconds, make_workload


def test_workloads_have_the_documented_shapes():
    nano = make_workload("nano", 1000, None)
    assert len(nano.prompts) == 256
    assert all(100 <= len(p) <= 1024 for p in nano.prompts) and all(100 <= n <= 1024 for n in nano.output_lens)
    share = make_workload("sharegpt", 1000, None)
    assert 120 < statistics.mean(len(p) for p in share.prompts) < 200
    assert 280 < statistics.mean(share.output_lens) < 400
    assert max(len(p) for p in share.prompts) <= 2048
    assert len(make_workload("prefix", 1000, None).prompts) == 400
    prefix = make_workload("prefix", 1000, 50)
    assert all(p[:341] == prefix.prompts[0][:341] for p in prefix.prompts)
    assert all(351 <= len(p) <= 381 for p in prefix.prompts) and all(20 <= n <= 80 for n in prefix.output_lens)
    short = make_workload("short", 1000, None)
    assert len(short.prompts) == 1000
    assert all(10 <= len(p) <= 100 for p in short.prompts) and all(20 <= n <= 200 for n in short.output_lens)
    long = make_workload("long", 1000, None)
    assert len(long.prompts) == 1024 and {len(p) for p in long.prompts} == {2048} and set(long.output_lens) == {512}
    assert len(make_workload("long", 1000, 8).prompts) == 8
    custom = make_workload("long", 1000, 4, lengths=(64, 300))
    assert {len(p) for p in custom.prompts} == {64} and custom.output_lens == [300] * 4
    with pytest.raises(ValueError, match="long workload only"):
        make_workload("nano", 1000, 4, lengths=(64, 300))
    assert make_workload("nano", 1000, 8).prompts == make_workload("nano", 1000, 8).prompts  # seeded
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        make_workload("chat", 1000, None)


def test_floor_grows_with_the_work():
    model = build_model("tiny", device="cpu")
    small = make_workload("nano", SHAPES["tiny"][2]["vocab_size"], 8)
    large = make_workload("nano", SHAPES["tiny"][2]["vocab_size"], 32)
    bandwidth, flops = 3e12, 7e14
    assert 0 < floor_seconds(model, small, bandwidth, flops, 256) < floor_seconds(model, large, bandwidth, flops, 256)
    # Fewer concurrent sequences means more decode steps, each reading the weights again.
    assert floor_seconds(model, large, bandwidth, flops, 4) > floor_seconds(model, large, bandwidth, flops, 256)


def test_bench_without_a_gpu_is_one_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip(
            "checks the message printed without CUDA; runs on CPU machines (CI), the GPU path is the benchmark itself"
        )
    assert main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _script(name: str):
    """A script of benchmarks/ or benchmarks/tools/ as a module (they are not a package)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    path = next(p for p in (root / f"{name}.py", root / "tools" / f"{name}.py") if p.exists())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(seconds: list[float], startup: float | None = 2.5) -> dict:
    result = dict(elapsed=seconds, generated=1000, peak=3 * 2**30, note="512 blocks")
    if startup is not None:  # hf_paged's systems: a start-up and a pool
        result.update(startup=startup, pool_tokens=512 * 16)
    return result


def test_a_system_summary_is_one_table_row_and_one_record_entry(tmp_path):
    """The table and the JSON record come from the same summaries: median [min, max] throughput, the share of the
    floor, start-up where the system has one, and a failed system as a row without runs."""
    rows = [
        summarize("hf_paged", _result([2.0, 1.0, 4.0]), total_tokens=3000, floor_tps=2000.0),
        summarize("hf_cb", _result([10.0], startup=None), total_tokens=3000, floor_tps=2000.0),
        summarize("hf_generate", dict(elapsed=[], generated=0, peak=0, note="failed: OOM"), 3000, 2000.0),
    ]
    assert rows[0]["output_tok_s"] == {"median": 500.0, "min": 250.0, "max": 1000.0}
    assert rows[0]["floor_pct"] == 25.0 and rows[0]["total_tok_s"] == 1500.0 and rows[0]["peak_memory_gib"] == 3.0
    lines = format_table("### header", rows).splitlines()
    assert lines[0] == "### header" and lines[2].startswith("| system | runs | time (s), median [min, max] |")
    assert lines[4] == "| hf_paged | 3 | 2.00 [1.00, 4.00] | 500 [250, 1000] | 1500 | 25.0% | 2.5 | 3.0 | 512 blocks |"
    assert lines[5].startswith("| hf_cb | 1 | 10.00 [10.00, 10.00] | 100 [100, 100] | 300 | 5.0% | - |")
    assert lines[6] == "| hf_generate | 0 | - | - | - | - | - | - | failed: OOM |"
    record = make_record("NVIDIA H100 80GB HBM3", "hf-paged bench --workload nano", {"name": "nano"}, systems=rows)
    path = tmp_path / "results" / "nano.json"
    write_record(path, record)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(record))
    assert set(loaded) == {"card", "date", "versions", "commit", "command", "workload", "systems"}
    assert set(loaded["versions"]) == {"torch", "triton", "transformers", "hf_paged"}
    assert [s["system"] for s in loaded["systems"]] == ["hf_paged", "hf_cb", "hf_generate"]
    assert loaded["systems"][1]["startup_s"] is None and loaded["systems"][2]["runs"] == 0
    assert loaded["systems"][0]["pool_tokens"] == 8192 and loaded["systems"][1]["pool_tokens"] is None


def test_the_record_commit_is_the_environment_variable_else_the_checkout_head(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PAGED_COMMIT", "abc123")  # named by the caller: wins over a (possibly stale) checkout
    assert source_commit() == "abc123"
    monkeypatch.delenv("HF_PAGED_COMMIT")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    if head.returncode == 0:
        assert source_commit() == head.stdout.strip()
    monkeypatch.setenv("PATH", str(tmp_path))  # no git and no variable: unknown
    assert source_commit() is None


def test_engine_trace_and_step_kernels_run_on_the_cpu(capsys):
    """The step-by-step engine tools on a tiny model: the CPU replay of a schedule (benchmarks/tools/engine_trace.py),
    and a profiled decode step over a shared prefix with cascade forced on (benchmarks/tools/step_kernels.py)."""
    _script("engine_trace").main(["--device", "cpu", "--model", "tiny", "--workload", "prefix", "--num-requests", "4",
                                  "--repeats", "0", "--cascade-attention", "on"])  # fmt: skip
    out = capsys.readouterr().out
    assert "prefix caching True, cascade True, cpu" in out and "| decode <= " in out
    _script("step_kernels").main(["--device", "cpu", "--model", "tiny", "--batch", "3", "--prompt", "40",
                                  "--shared-prefix", "32", "--sizes", "3", "1", "--steps", "1",
                                  "--cascade-attention", "on"])  # fmt: skip
    out = capsys.readouterr().out
    assert "### tiny, decode batch 3, context ~40 (32 shared)" in out and "### tiny, decode batch 1" in out
    with pytest.raises(SystemExit):
        _script("step_kernels").main(["--device", "cpu", "--prompt", "8", "--shared-prefix", "9"])
    # --chunk: each profiled step also carries a new prompt (a mixed step); a full batch (max_num_seqs) is refused
    _script("step_kernels").main(["--device", "cpu", "--model", "tiny", "--batch", "3", "--prompt", "20",
                                  "--sizes", "2", "--steps", "1", "--chunk", "12"])  # fmt: skip
    assert "### tiny, mixed: decode batch 2 + a 12-token prompt" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _script("step_kernels").main(["--device", "cpu", "--sizes", "256", "--chunk", "12"])


def test_the_floor_counts_the_active_experts_and_one_latent_row_for_mla():
    import transformers

    from hf_paged.frontends.bench_workloads import active_parameters, kv_bytes_per_token

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=1)  # fmt: skip
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    routed = 2 * 4 * 3 * 32 * 48  # layers x experts x (gate, up, down) x hidden x intermediate
    assert active_parameters(model) == total - routed + routed // 4
    assert kv_bytes_per_token(config) == 2 * 2 * 2 * 8 * 2  # K and V x layers x KV heads x head_dim x bf16
    mla = transformers.DeepseekV2Config(num_hidden_layers=3, kv_lora_rank=16, qk_rope_head_dim=8)
    assert kv_bytes_per_token(mla) == 3 * (16 + 8) * 2
