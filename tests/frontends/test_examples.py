"""Every script in examples/ runs on the default model (SmolLM2-135M-Instruct) on the CPU and prints its key lines.

Each runs as a subprocess, as a user would run it, under a timeout that only guards against a hang (a loaded 2-core
machine takes several times the 9-24 s each takes on a free one). The ``default_model_dir`` fixture (conftest.py)
converts the default model once per test run into the default cache (``$HF_PAGED_CACHE`` or ``~/.cache/hf_paged``),
which the subprocesses then read.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import HANG_TIMEOUT_S, needs_smollm2

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = needs_smollm2


def run_example(name: str, *args: str) -> str:
    """Run examples/<name> with the CPU as its device; returns its stdout."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_example_has_a_test():
    tested = {"generate_paged.py", "batch_offline.py", "chat_stream.py", "parallel_sampling.py",
              "structured_output.py"}  # fmt: skip
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_generate_paged(default_model_dir):
    out = run_example("generate_paged.py")
    assert re.search(r"greedy: What is the capital of France\? -> .*Paris", out), out
    assert re.search(r"beam search, width 4: KV cache .* KV blocks used \d+/256 .* sharing saves [1-9]", out), out
    hits = [int(h) for h in re.findall(r"prefix cache: (\d+)/\d+ prompt tokens", out)]
    assert len(hits) == 3 and hits[0] == 0 and min(hits[1:]) > 0, out  # the system prompt's blocks are reused


def test_batch_offline(default_model_dir):
    out = run_example("batch_offline.py", "--max-new-tokens", "12")
    assert out.count("Q: ") == 8 and "Paris" in out, out
    assert re.search(r"engine: 8 requests, .* prefix hit rate [1-9]", out), out


def test_chat_stream(default_model_dir):
    out = run_example("chat_stream.py", "--max-new-tokens", "12")
    assert out.count("bot> ") == 3, out
    hits = [int(h) for h in re.findall(r"\[(\d+)/\d+ prompt tokens from the prefix cache\]", out)]
    assert len(hits) == 3 and hits[1] > 0 and hits[2] > hits[1], out  # each turn reuses the conversation so far
    assert "chat: 3 turns" in out


def test_parallel_sampling(default_model_dir):
    out = run_example("parallel_sampling.py")
    tables = re.findall(r"sample \d: blocks \[(.*)\]  ref counts \[(.*)\]", out)
    assert len(tables) == 4, out
    first_blocks = {blocks.split(", ")[0] for blocks, _ in tables}
    assert len(first_blocks) == 1, out  # every sample starts with the same prompt block
    assert all(refs.startswith("4, ") for _, refs in tables), out  # ... held by all 4 of them
    assert re.search(r"sharing saves [1-9]\d*%", out), out
    assert len(re.findall(r"^sample \d: '|^sample \d: \"", out, flags=re.M)) == 4, out


def test_structured_output(default_model_dir):
    out = run_example("structured_output.py")
    assert re.search(r"^json: \{.*\}$", out, flags=re.M), out
    assert "matches the schema: 5 fields, finish_reason stop" in out, out
    assert re.search(r"choice: '(yes|no)' \(stop\)", out), out
