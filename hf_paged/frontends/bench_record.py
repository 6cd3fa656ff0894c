"""Benchmark results as files: a markdown table (``--out``) and a JSON record (``--json``).

A record holds one run's figures with what it takes to reproduce and compare them::

    {"card": "NVIDIA H100 80GB HBM3", "date": "2026-11-28",
     "versions": {"torch": ..., "triton": ..., "transformers": ..., "hf_paged": ...},
     "commit": "<git rev-parse HEAD>" or null, "command": "hf-paged bench --workload nano ...",
     "workload": {...}, "systems": [...]}          # benchmarks/generate.py writes "rows" instead of "systems"

``commit`` is ``$HF_PAGED_COMMIT`` when set (a copy of a tree on a benchmark machine, whose own ``.git``, if any,
may be stale), else the ``git rev-parse HEAD`` of the tree hf_paged was imported from, else null.
"""

import datetime
import json
import os
import subprocess
from pathlib import Path


def source_commit() -> str | None:
    """``$HF_PAGED_COMMIT`` when set, else the commit of the git checkout hf_paged runs from, else None."""
    import hf_paged

    if os.environ.get("HF_PAGED_COMMIT"):
        return os.environ["HF_PAGED_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(hf_paged.__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        done = None
    if done is not None and done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip()
    return None


def versions() -> dict[str, str | None]:
    """The versions of the libraries a figure depends on (None for one that is not installed)."""
    import torch
    import transformers

    import hf_paged

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "hf_paged": hf_paged.__version__}  # fmt: skip


def make_record(card: str, command: str, workload: dict, **figures) -> dict:
    """A JSON-ready record: the environment, the command, the workload, then ``figures`` (``systems=`` or
    ``rows=``: a list of dicts, one per measured system or grid cell)."""
    return {
        "card": card,
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "commit": source_commit(),
        "command": command,
        "workload": workload,
        **figures,
    }


def write_record(path: str | os.PathLike, record: dict) -> None:
    """Write ``record`` to ``path`` as indented JSON (its folder is made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def emit_table(table: str, out: str | None) -> None:
    """Print a markdown table and, with ``out``, append it to that file (the benchmarks' ``--out``)."""
    print(table)
    if out:
        with open(out, "a") as f:
            f.write(table.rstrip("\n") + "\n\n")
