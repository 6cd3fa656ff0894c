"""The benchmark suite's workloads and physical floor (CPU: the timed part needs a GPU)."""

import statistics

import pytest

from hf_paged.frontends.bench import SHAPES, build_model, floor_seconds, main, make_workload


def test_workloads_have_the_documented_shapes():
    nano = make_workload("nano", 1000, None)
    assert len(nano.prompts) == 256
    assert all(100 <= len(p) <= 1024 for p in nano.prompts) and all(100 <= n <= 1024 for n in nano.output_lens)
    share = make_workload("sharegpt", 1000, None)
    assert 120 < statistics.mean(len(p) for p in share.prompts) < 200
    assert 280 < statistics.mean(share.output_lens) < 400
    assert max(len(p) for p in share.prompts) <= 2048
    assert len(make_workload("prefix", 1000, None).prompts) == 400  # issue 13's count
    prefix = make_workload("prefix", 1000, 50)
    assert all(p[:341] == prefix.prompts[0][:341] for p in prefix.prompts)
    assert all(351 <= len(p) <= 381 for p in prefix.prompts) and all(20 <= n <= 80 for n in prefix.output_lens)
    short = make_workload("short", 1000, None)
    assert len(short.prompts) == 1000
    assert all(10 <= len(p) <= 100 for p in short.prompts) and all(20 <= n <= 200 for n in short.output_lens)
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


def test_module_ab_sets_existing_switches_and_runs_the_bench(monkeypatch, capsys, tmp_path):
    """benchmarks/module_ab.py (run_gpu.sh's A/B parts): literals set on existing module attributes, then the bench
    with the arguments after ``--``; a missing attribute or a malformed assignment stops it before any run."""
    import hf_paged.kernels.decode as decode

    import hf_paged.core.attention as attention

    module_ab = _script("module_ab")
    monkeypatch.setattr(attention, "ENGINE_FUSED_DECODE_WRITE", True)
    monkeypatch.setattr(decode, "LONG_SETTINGS", decode.LONG_SETTINGS)
    with pytest.raises(SystemExit) as exit_info:  # the bench got the arguments after "--" (a bad one: no run)
        module_ab.main(
            ["hf_paged.core.attention.ENGINE_FUSED_DECODE_WRITE=False", "hf_paged.kernels.decode.LONG_SETTINGS=(64, 2, 4)",
             "--", "--workload", "no-such-workload"]
        )  # fmt: skip
    assert exit_info.value.code == 2 and "no-such-workload" in capsys.readouterr().err
    assert attention.ENGINE_FUSED_DECODE_WRITE is False and decode.LONG_SETTINGS == (64, 2, 4)
    with pytest.raises(SystemExit, match="has no attribute 'ENGINE_FUSED_WRITE'"):
        module_ab.main(["hf_paged.core.attention.ENGINE_FUSED_WRITE=False", "--", "--workload", "nano"])
    with pytest.raises(SystemExit, match="expected MODULE.NAME=VALUE"):
        module_ab.main(["ENGINE_FUSED_DECODE_WRITE", "--"])
    with pytest.raises(SystemExit, match="usage"):
        module_ab.main(["hf_paged.core.attention.ENGINE_FUSED_DECODE_WRITE=False"])
    script = tmp_path / "show.py"  # a script after "--" runs as __main__ with its own argv, the switch set
    script.write_text("import sys\nimport hf_paged.core.attention as a\nprint(sys.argv[1:], a.ENGINE_FUSED_DECODE_WRITE)\n")
    assert module_ab.main(["hf_paged.core.attention.ENGINE_FUSED_DECODE_WRITE=True", "--", str(script), "--x", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "['--x', '1'] True"


def _script(name: str):
    """A benchmarks/ script as a module (they are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_trace_and_step_kernels_run_on_the_cpu(capsys):
    """The GPU calls' step-by-step tools (run_gpu.sh parts trace, cascade-ab, kernels-step-prefix) on a tiny model:
    the CPU replay of a schedule, and a profiled decode step over a shared prefix with cascade forced on."""
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
