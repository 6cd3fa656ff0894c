"""Packaging: `pip install .` installs every subpackage and puts kernels/ at hf_paged.kernels; `import hf_paged`
registers "paged"."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HANG_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **kwargs) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=HANG_TIMEOUT_S, **kwargs
    ).stdout


@pytest.fixture(scope="module")
def regular_install(tmp_path_factory) -> Path:
    """A regular (not editable) `pip install .` into a target folder, once for the module; returns the folder.

    It installs a copy of the sources without build outputs: setuptools builds through ./build, and modules left
    there by an earlier build (since moved or removed) would be installed too.
    """
    source = tmp_path_factory.mktemp("source") / "hf_paged"
    outputs = ("build", "dist", "*.egg-info", ".git", "__pycache__", ".hypothesis", ".pytest_cache", ".ruff_cache")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*outputs))
    target = tmp_path_factory.mktemp("target")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(source)],
        check=True, capture_output=True, timeout=HANG_TIMEOUT_S,
    )  # fmt: skip
    return target


def test_regular_install_imports_kernels_as_a_subpackage(regular_install):
    target = regular_install
    assert (target / "hf_paged" / "kernels" / "decode.py").is_file()
    assert not (target / "kernels").exists()  # the name `kernels` belongs to Hugging Face's package
    out = _run("import hf_paged.kernels as k; print(k.__file__)", cwd=target, env={"PYTHONPATH": str(target)})
    assert out.strip() == str(target / "hf_paged" / "kernels" / "__init__.py")


def test_regular_install_has_every_module_and_the_console_script(regular_install):
    """setuptools' `packages` is an explicit list: a subpackage missing from it is silently left out of a regular
    install, while the editable install the tests run on still finds it."""
    expected = {f"hf_paged/{p.relative_to(ROOT / 'hf_paged')}" for p in (ROOT / "hf_paged").rglob("*.py")}
    expected |= {f"hf_paged/kernels/{p.relative_to(ROOT / 'kernels')}" for p in (ROOT / "kernels").rglob("*.py")}
    installed = {str(p.relative_to(regular_install)) for p in (regular_install / "hf_paged").rglob("*.py")}
    assert installed == expected
    (entry_points,) = regular_install.glob("hf_paged-*.dist-info/entry_points.txt")
    assert "hf-paged = hf_paged.frontends.cli:main" in entry_points.read_text()


def test_import_registers_paged_before_or_after_transformers():
    check = "from transformers import AttentionInterface; print('paged' in AttentionInterface._global_mapping)"
    assert _run("import hf_paged; " + check).strip() == "True"
    assert _run("import transformers; import hf_paged; " + check).strip() == "True"
    # Importing the pure-Python block pool loads neither torch nor transformers.
    out = _run("import sys, hf_paged.core.block_pool; print('torch' in sys.modules, 'transformers' in sys.modules)")
    assert out.strip() == "False False"
