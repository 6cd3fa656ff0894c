"""KV-cache scales that a checkpoint stores but the loaded model does not carry.

A compressed-tensors checkpoint with a ``kv_cache_scheme`` (llm-compressor's FP8 KV calibration) stores one
``k_scale`` and one ``v_scale`` per attention module, as ``<module name>.k_scale`` next to its weights. compressed-
tensors attaches them to the modules only where it recognises the attention, by a ``past_key_values`` argument of
the module's ``forward``; transformers 5.24's attention modules take ``cache`` instead, so there the scales are
dropped on load ("UNEXPECTED" in the load report) and the model runs without them (compressed-tensors 0.20).
hf_paged's FP8 KV cache still honours them: they are read here from the checkpoint's safetensors files, by the same
names.

The checkpoint is the folder (or the hub id in the local Hugging Face cache; nothing is downloaded) the model was
loaded from, ``model.name_or_path``; only the scale tensors are read, not the weights.
"""

import json
import os

import torch

__all__ = ["checkpoint_kv_scales", "stores_kv_scales"]

_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def stores_kv_scales(model: torch.nn.Module) -> bool:
    """Whether ``model``'s config says its checkpoint stores static KV scales: a quantization config whose
    ``kv_cache_scheme`` is set and not dynamic (a dynamic scheme computes its scales per forward and stores none)."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return False
    as_dict = config if isinstance(config, dict) else config.to_dict() if hasattr(config, "to_dict") else {}
    scheme = as_dict.get("kv_cache_scheme")
    return isinstance(scheme, dict) and not scheme.get("dynamic", False)


def checkpoint_kv_scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's ``*.k_scale`` / ``*.v_scale`` tensors by name, on the CPU; empty when its config declares
    none (``stores_kv_scales``).

    Raises:
        ValueError: the config declares KV scales but the checkpoint's safetensors files cannot be found (the folder
            moved, or a hub id no longer in the local cache), or hold none.
    """
    if not stores_kv_scales(model):
        return {}
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    files = _safetensors_files(source)
    if not files:
        raise ValueError(
            f"the model's quantization config has a kv_cache_scheme, whose k_scale/v_scale tensors the loaded model "
            f"does not carry, and its checkpoint {source!r} has no safetensors files to read them from: load the "
            "model from its folder, or use kv_cache_dtype='auto'"
        )
    from safetensors import safe_open

    scales = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(_SCALE_SUFFIXES):
                    scales[key] = f.get_tensor(key)
    if not scales:
        raise ValueError(
            f"the model's quantization config has a kv_cache_scheme but its checkpoint {source!r} stores no "
            "k_scale/v_scale tensors: use kv_cache_dtype='auto', or a checkpoint calibrated for its KV cache"
        )
    return scales


def _safetensors_files(source: str) -> list[str]:
    """The safetensors files of the checkpoint at ``source`` (a folder, or a hub id in the local cache)."""
    index_name, single_name = "model.safetensors.index.json", "model.safetensors"
    locate = _in_folder if os.path.isdir(source) else _in_hub_cache
    index = locate(source, index_name)
    if index is not None:
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        found = [locate(source, name) for name in shards]
        return [path for path in found if path is not None]
    single = locate(source, single_name)
    return [single] if single is not None else []


def _in_folder(folder: str, name: str) -> str | None:
    path = os.path.join(folder, name)
    return path if os.path.isfile(path) else None


def _in_hub_cache(repo_id: str, name: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(repo_id, name)
    except Exception:  # not a valid repo id (HFValidationError): nothing cached under it
        return None
    return path if isinstance(path, str) else None
