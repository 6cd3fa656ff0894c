"""What the engine does with a model it cannot capture or compile: runs it eagerly when graphs and compilation were
left to their defaults (a warning says why), refuses by name when they were asked for.

What can go wrong: a capture error at start-up that takes down a model that runs fine eagerly (transformers 5.17's
grouped_mm MoE experts copy from the host inside the forward), or a quantization that cannot be traced reaching the
capture or the compiler and failing there without naming itself.
"""

import dataclasses
import logging
import types

import pytest
import torch
from helpers import assert_engine_drained
from models import tiny_model

from hf_paged import ContinuousBatcher, EngineConfig, SamplingParams
from hf_paged.engine.quantization import traceable_config

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
CAPTURE_ERROR = "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"


def _int8_bitsandbytes_model():
    """A stand-in with the config bitsandbytes' LLM.int8 loading leaves (no bitsandbytes needed to read it)."""
    config = types.SimpleNamespace(quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True,
                                                        "llm_int8_threshold": 6.0})  # fmt: skip
    return types.SimpleNamespace(config=config, parameters=lambda: iter(()))


def test_an_untraceable_quantization_runs_without_graphs_or_compile_on_cuda(caplog):
    model, cuda = _int8_bitsandbytes_model(), torch.device("cuda")
    with caplog.at_level(logging.WARNING):
        config = traceable_config(EngineConfig(), model, cuda)
    assert (config.use_cuda_graphs, config.compile_model) == (False, False)
    assert "llm_int8_threshold=6.0" in caplog.text
    assert traceable_config(EngineConfig(), model, torch.device("cpu")) == EngineConfig()  # nothing to turn off
    for asked in (dict(use_cuda_graphs=True), dict(compile_model="layers")):
        with pytest.raises(ValueError, match=r"bitsandbytes 8-bit .* pass use_cuda_graphs=False and compile_model"):
            traceable_config(EngineConfig(**asked), model, cuda)


def test_a_capture_that_fails_leaves_the_engine_running_eagerly(monkeypatch, caplog):
    model = tiny_model("llama")
    engine = ContinuousBatcher(model, num_blocks=32, block_size=8)
    expected = engine.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    def failing_capture():
        raise RuntimeError(CAPTURE_ERROR)

    # As on CUDA with graphs left to their default: the capture runs at start-up and fails.
    monkeypatch.setattr(engine.runner, "capture_all", failing_capture)
    engine.runner.use_cuda_graphs = True
    with caplog.at_level(logging.WARNING):
        engine._start_runner(engine.config)
    assert "LlamaForCausalLM cannot be captured in a CUDA graph" in caplog.text and CAPTURE_ERROR[:40] in caplog.text
    assert not engine.runner.use_cuda_graphs
    assert engine.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert_engine_drained(engine)
    # Asked for explicitly, the failure is the caller's to see.
    engine.runner.use_cuda_graphs = True
    with pytest.raises(RuntimeError, match="during CUDA graph capture"):
        engine._start_runner(dataclasses.replace(engine.config, use_cuda_graphs=True))
