"""The package layout's rules: imports point down the layers; only the KV manager changes the engine's pool."""

import ast
import pathlib
import sys

import pytest
from models import tiny_model

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.core.block_pool import BlockPool

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Lower layers first (docs/architecture.md); a module may import its own layer and those below.
LAYERS = [
    ("hf_paged.kernels",),
    (
        "hf_paged.core.block",
        "hf_paged.core.block_allocator",
        "hf_paged.core.block_pool",
        "hf_paged.core.free_list",
        "hf_paged.core.pool_args",
        "hf_paged.core.pool_stats",
        "hf_paged.core.prefix_hash",
        "hf_paged.core.prefix_index",
        "hf_paged.core.transfer",
    ),  # fmt: skip
    ("hf_paged.core",),
    ("hf_paged.cache",),
    ("hf_paged.engine",),
    ("hf_paged.serving",),
    ("hf_paged.frontends",),
]


def _layer(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def _modules():
    for path in sorted((ROOT / "hf_paged").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        yield name, path
    for path in sorted((ROOT / "kernels").glob("*.py")):
        yield "hf_paged.kernels." + path.stem, path


def _imports(path: pathlib.Path, module: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                base = module.split(".")[: -node.level] if not path.name == "__init__.py" else module.split(".")
                names.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.append(node.module)
    return [n for n in names if n.startswith("hf_paged")]


def test_every_module_has_a_layer():
    assert [m for m, _ in _modules() if m != "hf_paged" and _layer(m) is None] == []


def test_imports_point_down():
    upward = []
    for module, path in _modules():
        own = _layer(module)
        if own is None:
            continue
        for target in _imports(path, module):
            rank = _layer(target)
            if rank is not None and rank > own:
                upward.append(f"{module} imports {target}")
    assert upward == []


def test_kernels_import_neither_transformers_nor_hf_paged():
    for path in (ROOT / "kernels").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.startswith(("transformers", "hf_paged")) for n in names), (path.name, names)


MUTATORS = ("allocate", "append", "cache_blocks", "fork", "free", "reset_prefix_cache")


def test_only_the_kv_manager_changes_the_engine_pool(monkeypatch):
    """Every mutating BlockPool call of an engine run (n samples, beams, preemption, prefix hits, aborts)
    comes from hf_paged/engine/kv_manager.py."""
    callers = set()
    for name in MUTATORS:
        original = getattr(BlockPool, name)

        def wrapped(self, *args, _original=original, **kwargs):
            callers.add(pathlib.Path(sys._getframe(1).f_code.co_filename).name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(BlockPool, name, wrapped)
    engine = ContinuousBatcher(tiny_model("llama"), num_blocks=12, block_size=8, max_num_batched_tokens=16)
    prompt = list(range(10, 40))
    params = [
        SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(n=2, max_new_tokens=10, temperature=1.0, seed=0, ignore_eos=True),
        SamplingParams(beam_width=2, max_new_tokens=8, ignore_eos=True),
    ]
    rid = engine.add_request(prompt, params[0])
    engine.step()
    engine.abort(rid)
    engine.generate([prompt, prompt[:20], prompt[5:]], params, use_tqdm=False)
    engine.reset_prefix_cache()
    assert engine.metrics().num_preemptions > 0
    assert callers == {"kv_manager.py"}


@pytest.mark.parametrize("path", ["hf_paged/engine", "hf_paged/serving", "hf_paged/frontends"])
def test_no_engine_or_frontend_module_reaches_into_the_pool(path):
    """Statically too: no ``.pool.<mutator>(`` call outside the KV manager."""
    offenders = []
    for file in (ROOT / path).rglob("*.py"):
        if file.name == "kv_manager.py":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                owner = ast.unparse(node.func.value)
                if owner.endswith("pool"):
                    offenders.append(f"{file.name}: {ast.unparse(node.func)}")
    assert offenders == []
