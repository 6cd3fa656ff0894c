"""benchmarks/generate.py off the GPU: argument parsing, the markdown table and JSON record, and a CPU smoke run of the
whole path; and benchmarks/tools/generate_profile.py's split of decode forwards."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from models import cache_kwarg, tiny_model

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "generate.py"
_spec = importlib.util.spec_from_file_location("generate_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_grid_arguments():
    args = bench.parse_args([])
    assert args.shapes == ["qwen3-0.6b", "llama-8b"] and args.points == [(1, 512), (8, 1024), (32, 512), (64, 512)]
    assert args.modes == ["greedy", "beams4", "samples4"] and args.systems == [
        "dynamic", "static", "paged", "paged-compiled"]  # fmt: skip
    quick = bench.parse_args(["--quick"])
    assert quick.shapes == ["qwen3-0.6b"] and quick.points == [(1, 512), (32, 512)] and quick.new_tokens == 32
    with pytest.raises(SystemExit):
        bench.parse_args(["--points", "8by1024"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--new-tokens", "1"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "3", "--eager-repeats", "2"])


def test_table_has_ratios_to_dynamic_and_failed_cells():
    def cell(system, step_ms, cpu_ms, peak, **kwargs):
        c = bench.Cell("qwen3-0.6b", 8, 1024, "greedy", system, system, new_tokens=11, rows=8, **kwargs)
        c.step_ms, c.prefill_ms, c.total_s, c.peak_allocated = step_ms, [50.0, 52.0, 51.0], [1.0, 1.2, 1.1], peak
        c.step_cpu_ms = cpu_ms
        return c

    cells = [
        cell("dynamic", [10.0, 12.0, 11.0], [9.0, 8.0, 10.0], 2 * 2**30),
        cell("paged", [8.0, 8.5, 9.0], [6.0, 7.2, 8.0], 2**30, same_tokens=0.995, note="pool grew to 9 blocks"),
        bench.Cell("qwen3-0.6b", 8, 1024, "greedy", "static", "static", 11, 8, error="out of memory"),
    ]
    table = bench.format_table(cells, "### title")
    lines = table.splitlines()
    assert lines[0] == "### title" and lines[2].startswith("| model | batch x prompt | mode | system | ms/step")
    assert lines[4] == (
        "| qwen3-0.6b | 8 x 1024 | greedy | dynamic | 11.00 (10.00-12.00) | 9.00 (8.00-10.00) | 51.0 | 80 | 2.000 "
        "| n/a | 1.00 | 1.00 | 1.00 | 1.00 |  |"
    )
    assert lines[5] == (
        "| qwen3-0.6b | 8 x 1024 | greedy | paged | 8.50 (8.00-9.00) | 7.20 (6.00-8.00) | 51.0 | 80 | 1.000 | n/a "
        "| 0.77 | 0.80 | 0.80 | 0.50 | pool grew to 9 blocks; 99.5% tokens equal to dynamic |"
    )
    assert lines[6].endswith("| out of memory |")
    cells[1].prefill_peak_allocated = 3 * 2**29  # the peak split: by the prefill's end, and over the whole call
    assert "pool grew to 9 blocks; 1.500 GiB by the prefill's end;" in bench.format_table(cells, "").splitlines()[5]
    cells[1].kv_bytes = 3 * 2**28  # and into the cache's K/V and the rest
    assert "; K/V 0.750 GiB, peak 0.250 GiB above it;" in bench.format_table(cells, "").splitlines()[5]


def test_kv_bytes_of_each_cache():
    """The K/V each system's cache holds: PagedCache's pool, DynamicCache's tensors, and StaticCache's reservation
    (every row and copy at prompt + new tokens - 1), computed as generate builds it."""
    from transformers import DynamicCache

    from hf_paged import PagedCache
    from hf_paged.core.model_info import ModelInfo

    model = tiny_model("llama")
    per_token = ModelInfo.from_model(model).bytes_per_block(1)
    prompts = torch.randint(3, 90, (2, 10))
    paged = PagedCache(model, num_blocks=7, block_size=8)
    assert bench.kv_bytes(model, paged, "paged", prompts, 5, "greedy") == 7 * 8 * per_token
    assert bench.kv_bytes(model, None, "static", prompts, 5, "beams4") == 2 * 4 * 14 * per_token
    static = model.generate(prompts, max_new_tokens=5, min_new_tokens=5, do_sample=False, num_beams=4,
                            cache_implementation="static", return_dict_in_generate=True).past_key_values  # fmt: skip
    held = sum(t.numel() * t.element_size() for layer in static.layers for t in (layer.keys, layer.values))
    assert bench.kv_bytes(model, None, "static", prompts, 5, "beams4") == held
    dynamic = DynamicCache(config=model.config)
    model.generate(prompts, max_new_tokens=5, min_new_tokens=5, do_sample=False, **{cache_kwarg(): dynamic})
    assert bench.kv_bytes(model, dynamic, "dynamic", prompts, 5, "greedy") == 2 * 14 * per_token
    assert bench.kv_bytes(model, DynamicCache(config=model.config), "dynamic", prompts, 5, "greedy") is None


def test_cpu_smoke_run_writes_the_table_and_the_record(tmp_path):
    out, record_path = tmp_path / "results.md", tmp_path / "record.json"
    argv = [
        "--device",
        "cpu",
        "--points",
        "1x8",
        "--modes",
        "greedy",
        "--systems",
        "dynamic",
        "paged",
        "paged-compiled",
    ]
    argv += ["--repeats", "1", "--new-tokens", "3", "--out", str(out), "--json", str(record_path)]
    assert bench.main(argv) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 3 and "PagedCache + paged, eager" in rows[1] and "100.0% tokens equal to dynamic" in rows[1]
    assert "PagedCache(max_cache_len) + paged (planned steps" in rows[2] and "100.0% tokens equal" in rows[2]
    record = json.loads(record_path.read_text())
    assert record["card"] == "CPU" and record["command"].startswith("python benchmarks/generate.py --device cpu")
    assert set(record["versions"]) == {"torch", "triton", "transformers", "hf_paged"} and "commit" in record
    assert record["workload"]["points"] == ["1x8"] and record["workload"]["new_tokens"] == 3
    assert [(r["system"], r["ms_per_step"]["runs"]) for r in record["rows"]] == [
        ("dynamic", 1), ("paged", 1), ("paged-compiled", 1)]  # fmt: skip
    assert record["rows"][1]["same_tokens_as_dynamic"] == 1.0 and record["rows"][1]["output_tok_s"] > 0


def test_eager_repeats_add_rounds_of_the_eager_systems_only(monkeypatch):
    """--eager-repeats: DynamicCache and eager PagedCache go on alternating after the rounds of every system; the
    paired ratio of a compiled system pairs its rounds with DynamicCache's first ones."""
    calls = []

    def fake_measure(model, cell, prompts):
        calls.append(cell.system)
        cell.step_ms.append(10.0 if cell.system == "dynamic" else 5.0)
        cell.step_cpu_ms.append(1.0)
        cell.prefill_ms.append(1.0)
        cell.total_s.append(1.0)

    monkeypatch.setattr(bench, "generate_once", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench, "measure_once", fake_measure)
    cells = [bench.Cell("tiny", 1, 8, "greedy", s, s, 3, 1) for s in ("dynamic", "static", "paged")]
    bench.run_cells(None, cells, None, repeats=2, device="cpu", eager_repeats=4)
    assert calls == ["dynamic", "static", "paged"] * 2 + ["dynamic", "paged"] * 2
    assert [len(c.step_ms) for c in cells] == [4, 2, 4]
    rows = bench.format_table(cells, "").splitlines()[4:]
    assert all("| 0.50 | 0.50 |" in row for row in rows[1:])  # time / dynamic, and paired


def _load_tool(name: str):
    """benchmarks/tools/NAME.py as a module (it imports benchmarks/generate.py as ``generate`` itself)."""
    spec = importlib.util.spec_from_file_location(name, _PATH.parent / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_profile_segments_split_each_decode_forward(capsys):
    """tools/generate_profile.py --segments on the CPU (a tiny model): every decode forward splits at the module marks,
    the segments add up to the whole forward, and the table has a row per segment for both systems."""
    import types

    profile = _load_tool("generate_profile")
    model = tiny_model("llama")
    prompts = torch.randint(3, 90, (2, 9))
    for system in ("dynamic", "paged"):  # warm-up: hf_paged's hooks first
        profile.generate.generate_once(model, system, prompts, 3, "greedy")
    forwards = profile.forward_segments(model, "paged", prompts, 5, "greedy")
    assert len(forwards) == 4  # 5 new tokens: the prefill and 4 decode forwards, the prefill left out
    for forward in forwards:
        times = [forward[name] for name in profile.SEGMENT_MARKS]
        assert times == sorted(times)
    args = types.SimpleNamespace(rounds=1, new_tokens=4, mode="greedy", shape="tiny", batch=2, prompt=9)
    profile.print_segments(model, ("dynamic", "paged"), prompts, args)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "->" in line]
    assert len(rows) == len(profile.SEGMENT_MARKS) and all(line.count("(") == 2 for line in rows)
