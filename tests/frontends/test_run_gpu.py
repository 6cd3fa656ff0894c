"""benchmarks/run_gpu.sh off the GPU: every suite runs its plumbing to the end with stand-ins for ``nvidia-smi`` and
``python3`` (a device call is 10 minutes: a suite that dies on a typo wastes one). The stand-in ``python3`` prints
the command it was given with the GPU, cores, commit and PYTHONPATH it ran with, and writes what ``--out`` and
``--json`` name, so the tests also see what each suite would run, where and with which outputs."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_gpu.sh"
ERRORS = ("unknown suite", "command not found", "syntax error", "unbound variable", "No such file", "bad substitution",
          "integer expression expected")  # fmt: skip


def _suites() -> list[str]:
    listed = re.search(r"^SUITES=\(([^)]*)\)", SCRIPT.read_text(), re.M)
    assert listed, "run_gpu.sh defines no SUITES array"
    return listed.group(1).split()


# Prints what it was asked to run, on which GPU and cores, with which commit and PYTHONPATH, from which directory;
# writes what --out and --json name.
PYTHON_STAND_IN = r"""#!/bin/bash
cpus=$(awk '/^Cpus_allowed_list/ {print $2}' /proc/self/status)
line="| hf_paged | ran: $* | gpu ${CUDA_VISIBLE_DEVICES:-all} | cpus $cpus | commit ${HF_PAGED_COMMIT:-none} \
| path ${PYTHONPATH:-none} | cwd $PWD |"
echo "$line"
while [ $# -gt 0 ]; do
    case $1 in --out) echo "$line" >>"$2" ;; --json) echo '{"ran": true}' >"$2" ;; esac
    shift
done
"""


@pytest.fixture
def fake_path(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        '#!/bin/bash\nif [ "$1" = "-L" ]; then for ((i = 0; i < ${FAKE_NUM_GPUS:-2}; i++)); do '
        'echo "GPU $i: stand-in"; done; else echo "stand-in GPU, 80 GiB, 1"; fi\n'
    )
    (bin_dir / "python3").write_text(PYTHON_STAND_IN)
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def _run(fake_path, *args, **env_vars) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=fake_path, **env_vars)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("BASELINE_SRC", None)
    env.update(env_vars)
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def _ran(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "ran:" in line and "pip install" not in line
            and "import " not in line]  # fmt: skip


def test_the_suites_are_run_suites_case_labels():
    """SUITES (what a call is checked against before it runs) names exactly the suites run_suite branches on."""
    text = SCRIPT.read_text()
    body = text[text.index("run_suite() {") : text.index("\n    esac\n", text.index("run_suite() {"))]
    labels = [name.strip() for group in re.findall(r"^ {8}([a-z][a-z0-9 |-]*)\)", body, re.M)
              for name in group.split("|")]  # fmt: skip
    assert sorted(labels) == sorted(_suites())
    assert {"tests", "tests-kernels", "tests-cache", "tests-engine", "kernels", "engine", "generate", "serve"} <= set(
        labels
    )


def test_every_suite_runs_through(fake_path, tmp_path):
    for suite in _suites():
        out = tmp_path / suite
        result = _run(fake_path, out, suite)
        assert result.returncode == 0, f"{suite}: {result.stderr[-2000:]}"
        assert not any(error in result.stderr for error in ERRORS), f"{suite}: {result.stderr[-2000:]}"
        assert _ran(result.stdout), f"{suite} ran nothing: {result.stdout[-2000:]}"
    assert "tests/kernels" in (tmp_path / "tests-kernels" / "tests-kernels.log").read_text()
    assert len((tmp_path / "tests" / "tests.txt").read_text().splitlines()) == 3


@pytest.mark.parametrize("suite, jobs", [("engine", 4), ("generate", 8), ("generate-quick", 1)])
def test_a_benchmark_suite_writes_a_table_and_a_record_per_job(fake_path, tmp_path, suite, jobs):
    result = _run(fake_path, tmp_path, suite)
    assert result.returncode == 0, result.stderr[-2000:]
    records = sorted((tmp_path / suite).glob("*.json"))
    assert len(records) == jobs and all(json.loads(r.read_text()) == {"ran": True} for r in records)
    table = (tmp_path / f"{suite}.md").read_text().splitlines()
    assert len(table) == jobs and all("--out" in line and "--json" in line for line in table)


def test_the_engine_suite_deals_its_workloads_over_the_gpus_and_their_cores(fake_path, tmp_path):
    result = _run(fake_path, tmp_path, "engine")
    ran = [line for line in _ran(result.stdout) if line.startswith("[gpu")]  # not the table printed at the end
    workloads = {gpu: [re.search(r"--workload (\w+)", line).group(1) for line in ran if f"gpu {gpu} " in line]
                 for gpu in (0, 1)}  # fmt: skip
    assert workloads == {0: ["sharegpt", "nano"], 1: ["short", "prefix"]}
    assert all("--model llama-8b" in line for line in ran if "sharegpt" in line)
    assert all("hf_paged,hf_paged_no_prefix" in line for line in ran if "--workload prefix" in line)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2 and cpus == list(range(len(cpus))):
        half = len(cpus) // 2
        for gpu in (0, 1):
            want = f"cpus {gpu * half}-{gpu * half + half - 1} " if half > 1 else f"cpus {gpu * half} "
            assert all(want in line for line in ran if f"gpu {gpu} " in line), (want, ran)


def test_a_baseline_tree_runs_each_workload_beside_the_new_one(fake_path, tmp_path):
    """BASELINE_SRC: each workload once from each tree, on the same GPU, the order flipping from one workload to the
    next; each side from its own directory with its own PYTHONPATH and commit; a baseline whose bench has no --json
    writes its table only; the baseline gets hf_paged.kernels through a link."""
    baseline = tmp_path / "old"
    (baseline / "kernels").mkdir(parents=True)
    (baseline / "hf_paged" / "frontends").mkdir(parents=True)
    (baseline / "hf_paged" / "frontends" / "bench.py").write_text('parser.add_argument("--out")\n')
    out = tmp_path / "out"
    result = _run(fake_path, out, "engine-qwen", BASELINE_SRC=str(baseline), FAKE_NUM_GPUS="1",
                  HF_PAGED_COMMIT="new123", BASELINE_COMMIT="old456")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    ran = [line for line in _ran(result.stdout) if line.startswith("[gpu")]
    sides = [("old" if f"cwd {baseline} " in line else "new", re.search(r"--workload (\w+)", line).group(1))
             for line in ran]  # fmt: skip
    assert sides == [("new", "short"), ("old", "short"), ("old", "nano"), ("new", "nano"), ("new", "prefix"),
                     ("old", "prefix")]  # fmt: skip
    for line in ran:
        if f"cwd {baseline} " in line:
            assert f"path {baseline} " in line and "commit old456 " in line and "--json" not in line
        else:
            assert f"path {ROOT} " in line and "commit new123 " in line and "--json" in line
    assert sorted(p.name for p in (out / "engine-qwen").iterdir()) == sorted(
        [f"{w}.md" for w in ("short", "nano", "prefix")] + [f"{w}.json" for w in ("short", "nano", "prefix")]
        + [f"{w}.baseline.md" for w in ("short", "nano", "prefix")])  # fmt: skip
    assert (baseline / "hf_paged" / "kernels").resolve() == (baseline / "kernels").resolve()


def test_a_baseline_that_is_no_source_tree_is_refused(fake_path, tmp_path):
    out = tmp_path / "out"
    result = _run(fake_path, out, "engine", BASELINE_SRC=str(tmp_path))
    assert result.returncode == 2 and "BASELINE_SRC has no hf_paged/" in result.stderr and not out.exists()


def test_a_dealt_suite_stops_starting_jobs_when_its_time_is_spent(fake_path, tmp_path):
    result = _run(fake_path, tmp_path, "engine", BUDGET_S="5")
    assert result.returncode == 0 and not _ran(result.stdout)
    assert result.stdout.count("not run, the suite's time is spent") == 4


@pytest.mark.parametrize("gpus, spread", [("1", False), ("2", False), ("3", True)])
def test_the_tests_suite_takes_a_gpu_a_part_where_it_has_three(fake_path, tmp_path, gpus, spread):
    result = _run(fake_path, tmp_path, "tests", FAKE_NUM_GPUS=gpus)
    assert result.returncode == 0, result.stderr[-2000:]
    logs = {part: (tmp_path / f"{part}.log").read_text() for part in ("tests-kernels", "tests-cache", "tests-engine")}
    assert "tests/engine --ignore" in logs["tests-engine"] and "test_engine_fuzz" in logs["tests-engine"]
    where = {part: re.search(r"gpu (\w+) ", log).group(1) for part, log in logs.items()}
    assert where == ({"tests-kernels": "0", "tests-cache": "1", "tests-engine": "2"} if spread else
                     {"tests-kernels": "all", "tests-cache": "all", "tests-engine": "all"})  # fmt: skip


@pytest.mark.parametrize(
    "args", [["kernels", "no-such-suite"], ["--spread", "kernels+engine", "tests-cache+no-such-suite"]]
)
def test_an_unknown_suite_anywhere_fails_the_call_before_anything_runs(fake_path, tmp_path, args):
    out = tmp_path / "out"
    result = _run(fake_path, out, *args)
    assert result.returncode == 2 and "unknown suite 'no-such-suite'" in result.stderr
    assert "ran:" not in result.stdout and not out.exists()


def test_spread_runs_each_queue_on_its_own_gpu_and_cores(fake_path, tmp_path):
    result = _run(fake_path, tmp_path, "--spread", "kernels+tests-cache", "tests-engine")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    on = {gpu: [line for line in lines if line.startswith(f"[gpu{gpu}] ")] for gpu in (0, 1)}
    assert any("kernels.py" in line for line in on[0])
    assert "gpu 0 " in (tmp_path / "tests-cache.log").read_text()
    assert "gpu 1 " in (tmp_path / "tests-engine.log").read_text()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2 and cpus == list(range(len(cpus))):
        half = len(cpus) // 2
        want = f"cpus {half}-{2 * half - 1} " if half > 1 else f"cpus {half} "
        assert want in (tmp_path / "tests-engine.log").read_text()


def test_spread_refuses_the_tests_suite_which_spreads_itself(fake_path, tmp_path):
    result = _run(fake_path, tmp_path / "out", "--spread", "kernels", "tests")
    assert result.returncode == 2 and "spreads itself" in result.stderr and not (tmp_path / "out").exists()
