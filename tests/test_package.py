"""Packaging: `pip install .` puts kernels/ at hf_paged.kernels; `import hf_paged` registers "paged"."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **kwargs) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, **kwargs).stdout


def test_regular_install_imports_kernels_as_a_subpackage(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(tmp_path),
         str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    assert (tmp_path / "hf_paged" / "kernels" / "decode.py").is_file()
    assert not (tmp_path / "kernels").exists()  # the name `kernels` belongs to Hugging Face's package
    out = _run("import hf_paged.kernels as k; print(k.__file__)", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert out.strip() == str(tmp_path / "hf_paged" / "kernels" / "__init__.py")


def test_import_registers_paged_before_or_after_transformers():
    check = "from transformers import AttentionInterface; print('paged' in AttentionInterface._global_mapping)"
    assert _run("import hf_paged; " + check).strip() == "True"
    assert _run("import transformers; import hf_paged; " + check).strip() == "True"
    # Importing the pure-Python block pool loads neither torch nor transformers.
    out = _run("import sys, hf_paged.block_pool; print('torch' in sys.modules, 'transformers' in sys.modules)")
    assert out.strip() == "False False"
