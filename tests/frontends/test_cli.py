"""The ``hf-paged`` command line on the default model (SmolLM2-135M-Instruct), with short greedy outputs.

``main([...])`` runs in-process (capsys reads its output). The one-prompt greedy answer runs once as a subprocess,
through the installed console script as a user runs it, and the tests about that answer read its output. The model is
converted once per test run into the default cache (``$HF_PAGED_CACHE`` or ``~/.cache/hf_paged``) by the
``default_model_dir`` fixture (conftest.py), so the commands below load it in about a second.
"""

import json
import shutil
import subprocess
import sys
import types

import pytest
from helpers import HANG_TIMEOUT_S, needs_smollm2

from hf_paged.frontends.cli import main

QUESTION = "What is the capital of France?"
GREEDY = ["--temperature", "0", "--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def greedy_answer(default_model_dir) -> subprocess.CompletedProcess:
    """``hf-paged generate`` of QUESTION, run once as a user runs it: the installed console script, else (not
    installed) ``python -m hf_paged.frontends.cli``."""
    script = shutil.which("hf-paged")
    command = [script] if script else [sys.executable, "-m", "hf_paged.frontends.cli"]
    return subprocess.run(
        [*command, "generate", *GREEDY, QUESTION], capture_output=True, text=True, timeout=HANG_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def unpageable_model_dir(default_model_dir, tmp_path_factory):
    """A tiny random Mamba model (state-space layers: nothing to page) with the default model's tokenizer."""
    from transformers import AutoTokenizer, MambaConfig, MambaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    path = tmp_path_factory.mktemp("mamba")
    config = MambaConfig(vocab_size=len(tokenizer), hidden_size=16, state_size=4, num_hidden_layers=1)
    MambaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _one_error_line(err: str) -> str:
    """The single ``hf-paged: error: ...`` line of a failed command's stderr (asserts there is nothing else)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hf-paged: error: "), err
    assert "Traceback" not in err
    return lines[0]


@needs_smollm2
def test_generate_one_prompt_streams_the_answer(greedy_answer):
    assert greedy_answer.returncode == 0, greedy_answer.stderr
    out, err = greedy_answer.stdout, greedy_answer.stderr
    assert "Paris" in out
    assert not out.startswith("[1/1]")  # streamed: the bare answer
    assert "1 request(s)" in err and "tok/s" in err and "KV blocks used" in err and "preemptions 0" in err


@needs_smollm2
def test_generate_two_prompts_shows_progress_and_each_answer(default_model_dir, capsys):
    argv = ["generate", *GREEDY, "--system", "You are a helpful assistant.", QUESTION, "What is the capital of Japan?"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    first, second = out.split("[2/2]")
    assert first.startswith(f"[1/2] {QUESTION}") and "Paris" in first
    assert "Tokyo" in second
    assert "2/2" in err  # the progress bar
    assert "2 request(s)" in err and "prefix hit rate" in err


@needs_smollm2
def test_generate_json_prints_outputs_and_metrics_as_one_object(default_model_dir, tmp_path, capsys):
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
def test_generate_parallel_samples_and_beams(default_model_dir, capsys):
    sampling = ["--n", "2", "--temperature", "0.8", "--seed", "0", "--max-new-tokens", "4"]
    assert main(["generate", *sampling, QUESTION]) == 0
    out, _ = capsys.readouterr()
    assert out.count("--- ") == 2
    assert main(["generate", "--beam-width", "2", "--n", "2", "--max-new-tokens", "4", "--json", QUESTION]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["outputs"][0]["completions"]) == 2


def test_info_prints_versions_kernel_path_and_default_model(capsys):
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
def test_model_dependent_errors_after_loading_are_one_line_and_exit_2(default_model_dir, unpageable_model_dir, capsys):
    assert main(["generate", "--block-size", "12", QUESTION]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "`block_size` must be a positive multiple of 8" in line and line.endswith("got 12")
    assert main(["generate", "--num-blocks", "2", QUESTION]) == 2
    assert "but the whole pool has 2" in _one_error_line(capsys.readouterr().err)
    assert main(["generate", "--model", unpageable_model_dir, QUESTION]) == 2
    assert "model type 'mamba' has layers of type" in _one_error_line(capsys.readouterr().err)


@needs_smollm2
@pytest.mark.parametrize(
    "argv, match",
    [
        # The prompt (~30 tokens with the chat template) plus 8192 new tokens: beyond SmolLM2's context of 8192.
        (["--max-new-tokens", "8192"], "exceeds the model's context of 8192 tokens"),
        # 6 samples of one request run in one forward; a 4-token budget allows 4 sequences per step.
        (["--max-num-batched-tokens", "4", "--n", "6", "--max-new-tokens", "4"], "max_num_seqs"),
    ],
)
def test_requests_the_engine_rejects_are_one_line_and_exit_2(default_model_dir, argv, match, capsys):
    """The engine's add_request raises ValueError for a request that can never run; the CLI prints one line."""
    assert main(["generate", *argv, QUESTION]) == 2
    out, err = capsys.readouterr()
    assert match in _one_error_line(err)
    assert out == ""


def test_bench_passes_its_arguments_through(monkeypatch):
    seen = []
    fake = types.ModuleType("hf_paged.frontends.bench")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "hf_paged.frontends.bench", fake)
    assert main(["bench", "--workload", "nano", "--quick"]) == 7
    assert seen == [["--workload", "nano", "--quick"]]


def test_bench_without_the_suite_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hf_paged.frontends.bench", None)  # makes its import fail
    assert main(["bench"]) == 2
    assert "hf_paged.frontends.bench" in _one_error_line(capsys.readouterr().err)


@needs_smollm2
def test_console_script(greedy_answer):
    script = shutil.which("hf-paged")
    if script is None:
        pytest.skip("the hf-paged console script is not installed; runs after pip install -e . (as .ci/run does)")
    assert greedy_answer.args[0] == script
    assert greedy_answer.returncode == 0, greedy_answer.stderr
    assert "Paris" in greedy_answer.stdout
    done = subprocess.run(
        [script, "generate", "--temperature", "-1", QUESTION], capture_output=True, text=True, timeout=HANG_TIMEOUT_S
    )
    assert done.returncode == 2 and done.stdout == ""
    _one_error_line(done.stderr)


def test_serve_help_lists_the_server_and_engine_flags(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--max-queue", "--max-prompt-tokens", "--max-body-bytes",
                 "--shutdown-timeout", "--engine-process", "--num-blocks", "--max-num-seqs",
                 "--preemption-mode", "--no-cascade-attention"):  # fmt: skip
        assert flag in out, flag
    assert "127.0.0.1" in out


def test_serve_without_the_serve_extra_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` now fails as if it were not installed
    monkeypatch.delitem(sys.modules, "hf_paged.frontends.serve", raising=False)
    import hf_paged.frontends

    # `from hf_paged.frontends import serve` takes the package's attribute, set by any earlier import of the module
    monkeypatch.delattr(hf_paged.frontends, "serve", raising=False)
    assert main(["serve", "--port", "1"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "needs the serve extra (fastapi is missing)" in line and "pip install 'hf_paged[serve]'" in line


@pytest.mark.parametrize(
    ("flag", "device", "cuda", "expected"),
    [("auto", None, False, False), ("auto", None, True, True), ("auto", "cpu", True, False),
     ("auto", "cuda:0", False, True), ("on", "cpu", False, True), ("off", "cuda", True, False)],
)  # fmt: skip
def test_serve_engine_process_is_on_with_cuda_unless_told(monkeypatch, flag, device, cuda, expected):
    """--engine-process auto: the engine gets a process of its own on CUDA (HTTP and the engine share no GIL)."""
    import argparse

    import torch

    from hf_paged.frontends import cli_serve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert cli_serve.uses_engine_process(argparse.Namespace(engine_process=flag, device=device)) is expected


@pytest.mark.parametrize(("argv", "cascade", "prefix"), [([], None, True), (["--no-cascade-attention"], False, True),
                                                         (["--no-prefix-caching"], None, False)])  # fmt: skip
def test_engine_flags_reach_the_engine_config(monkeypatch, argv, cascade, prefix):
    """The engine flags of generate and serve become EngineConfig fields (cascade None: on for a model on CUDA)."""
    from hf_paged.frontends import cli, cli_engine

    made = {}
    monkeypatch.setattr("hf_paged.ContinuousBatcher", lambda model, tokenizer, config: made.setdefault("c", config))
    args = cli.build_parser().parse_args(["generate", *argv, QUESTION])
    config = cli_engine.make_engine(None, None, 8, args)
    assert config is made["c"] and config.num_blocks == 8
    assert config.cascade_attention is cascade and config.enable_prefix_caching is prefix
