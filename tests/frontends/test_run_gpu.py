"""benchmarks/run_gpu.sh off the GPU: every part it names runs its plumbing to the end with stand-ins for
``nvidia-smi`` and ``python3`` (each device call is 10 minutes of a 30-minute budget: a part that dies on a typo wastes
one). The stand-in ``python3`` prints the command it was given, so the test also sees what each part would run."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_gpu.sh"


def _parts() -> list[str]:
    """The parts the script knows: its KNOWN_PARTS array (which its usage error lists)."""
    listed = re.search(r"^KNOWN_PARTS=\(([^)]*)\)", SCRIPT.read_text(), re.M)
    assert listed, "run_gpu.sh no longer defines KNOWN_PARTS"
    return listed.group(1).split()


def test_the_known_parts_are_run_parts_case_labels():
    """KNOWN_PARTS (what a call is checked against before it runs) names exactly the parts run_part branches on."""
    text = SCRIPT.read_text()
    body = text[text.index("run_part() {") : text.index("\n        *)\n", text.index("run_part() {"))]
    labels = [name.strip() for group in re.findall(r"^ {8}([a-z0-9][a-z0-9 |-]*)\)", body, re.M)
              for name in group.split("|")]  # fmt: skip
    assert len(labels) > 50 and sorted(labels) == sorted(_parts())


@pytest.fixture
def fake_path(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        '#!/bin/bash\nif [ "$1" = "-L" ]; then echo "GPU 0: stand-in"; echo "GPU 1: stand-in"; '
        'else echo "stand-in GPU, 80 GiB, 1"; fi\n'
    )
    (bin_dir / "python3").write_text(
        '#!/bin/bash\necho "| hf_paged | ran: $* | gpu ${CUDA_VISIBLE_DEVICES:-all} |'
        " cpus $(awk '/^Cpus_allowed_list/ {print $2}' /proc/self/status) |\"\n"
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_every_part_runs_through(fake_path, tmp_path):
    parts = [p for p in _parts() if p != "all"]
    assert {"tests", "kernels", "table", "grid-spread", "grid-spread-modes-llama", "cascade-merge-ab"} <= set(parts)
    env = dict(os.environ, PATH=fake_path, GRID_BUDGET_S="30")
    for part in parts:
        out = tmp_path / part
        result = subprocess.run(["bash", str(SCRIPT), str(out), part], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        assert result.returncode == 0, f"{part}: {result.stderr[-2000:]}"
        for error in ("unknown part", "command not found", "syntax error", "unbound variable", "No such file",
                      "bad substitution", "integer expression expected"):  # fmt: skip
            assert error not in result.stderr, f"{part}: {result.stderr[-2000:]}"
        assert "ran:" in result.stdout or any(out.rglob("*.md")) or any(out.rglob("*.rows")), f"{part} ran nothing"


def test_an_unknown_part_is_refused(fake_path, tmp_path):
    env = dict(os.environ, PATH=fake_path)
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "no-such-part"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "unknown part 'no-such-part'" in result.stderr


@pytest.mark.parametrize("args", [["kernels", "no-such-part"], ["--spread", "kernels+table", "pdl-ab+no-such-part"]])
def test_an_unknown_part_anywhere_fails_the_call_before_anything_runs(args, fake_path, tmp_path):
    """A part the script does not know, in any position or --spread queue (e.g. added to the tree after the device
    call copied it), fails the whole call at once: no part runs, nothing is installed, no output folder is made."""
    env = dict(os.environ, PATH=fake_path)
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), str(out), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 2 and "unknown part 'no-such-part'" in result.stderr
    assert "ran:" not in result.stdout and not out.exists()


def test_spread_runs_each_queue_on_its_own_gpu(fake_path, tmp_path):
    env = dict(os.environ, PATH=fake_path)
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "--spread", "kernels+sweep", "prefill-sweep"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    on = {gpu: [line for line in lines if line.startswith(f"[gpu{gpu}] ")] for gpu in (0, 1)}
    assert any("decode_sweep.py" in line for line in on[0]) and any("kernels.py" in line for line in on[0])
    assert any("prefill_sweep.py" in line for line in on[1]) and not any("prefill_sweep" in line for line in on[0])
    assert all("gpu 0 " in line for line in on[0] if "ran:" in line)
    assert all("gpu 1 " in line for line in on[1] if "ran:" in line)
    # each queue on its own half of the cores this test may use (one queue's compile must not take the other's)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2 and cpus == list(range(len(cpus))):
        half = len(cpus) // 2
        for gpu in (0, 1):
            want = f"cpus {gpu * half}-{gpu * half + half - 1} " if half > 1 else f"cpus {gpu * half} "
            ran = [line for line in on[gpu] if "ran:" in line]
            assert ran and all(want in line for line in ran), (want, ran)


@pytest.mark.parametrize("queue", ["grid-spread-modes-qwen", "kernels+tests", "no-such-part"])
def test_spread_refuses_what_cannot_share_the_host(fake_path, tmp_path, queue):
    env = dict(os.environ, PATH=fake_path)
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "--spread", "kernels", queue], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2, (result.stdout[-1000:], result.stderr[-1000:])


@pytest.mark.parametrize("visible, expected", [(None, {"0", "1"}), ("3", {"3"})])
def test_cache_fuzz_deals_its_seeds_over_the_visible_gpus(fake_path, tmp_path, visible, expected):
    """Eight seeds, each once, each on one of the GPUs the part sees (all of them, or its queue's one)."""
    env = dict(os.environ, PATH=fake_path)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "tests-cache-fuzz"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    log = (tmp_path / "tests-cache-fuzz.log").read_text().splitlines()  # a pytest run a line (the stand-in's echo)
    assert len(log) == 8 and all("tests/test_cache_fuzz.py" in line for line in log), log
    assert {re.search(r"gpu (\d+) ", line).group(1) for line in log} == expected
    summary = (tmp_path / "tests.txt").read_text().splitlines()
    assert sorted(int(re.match(r"seed (\d): ", line).group(1)) for line in summary) == list(range(8)), summary
