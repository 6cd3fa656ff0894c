"""hf_paged: PagedAttention for Hugging Face transformers.

Public API (imported lazily, so ``import hf_paged.core.block_pool`` loads neither torch nor transformers):

- ``PagedCache``: a transformers ``Cache`` whose KV lives in the blocks of a preallocated pool;
- ``ContinuousBatcher`` / ``SamplingParams``: a continuous-batching engine over any HF causal LM;
  ``StructuredOutput``: a JSON schema, regex, choice or grammar its output must follow;
- ``AsyncEngine``: a ContinuousBatcher on its own thread, serving asyncio callers (the HTTP server's engine);
- ``DataParallelEngine``: replica processes (one ContinuousBatcher per GPU) behind one asyncio front, as AsyncEngine;
- ``attn_implementation="paged"``: the attention function that reads KV straight from the blocks;
- ``BlockPool``: the pure-Python block allocator (ref counts, LRU free list, prefix hashing);
- ``load_model``: a model and tokenizer by the name a user gives (the embedded default, a folder, a GGUF file or a
  cached hub id), offline.

Importing ``hf_paged`` registers the "paged" attention and mask functions with transformers: at once
when transformers is already imported, else right after transformers' own import finishes.
"""

import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

_LAZY = {
    "PagedCache": "hf_paged.cache",
    "ContinuousBatcher": "hf_paged.engine.engine",
    "AsyncEngine": "hf_paged.serving.async_engine",
    "DataParallelEngine": "hf_paged.serving.data_parallel",
    "EngineConfig": "hf_paged.engine.config",
    "SamplingParams": "hf_paged.engine.params",
    "StructuredOutput": "hf_paged.engine.params",
    "RequestOutput": "hf_paged.engine.request",
    "BlockPool": "hf_paged.core.block_pool",
    "register": "hf_paged.core.attention",
    "paged_attention_forward": "hf_paged.core.attention",
    "load_model": "hf_paged.frontends.models",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_paged' has no attribute {name!r}")


def _register() -> None:
    from hf_paged.core.attention import register

    register()


class _RegisterAfterTransformersImport(importlib.abc.MetaPathFinder):
    """Runs ``_register`` right after ``import transformers`` completes, then steps aside.

    A meta-path finder sees the import of "transformers" first; it removes itself, lets the normal finders
    locate the module, and wraps the loader's ``exec_module`` so that registration follows execution.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


if "transformers" in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterAfterTransformersImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterTransformersImport())
