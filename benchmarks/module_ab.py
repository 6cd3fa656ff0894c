"""Run `hf-paged bench` with module-level switches set: A/B runs of one tree without editing it.

    python benchmarks/module_ab.py hf_paged.core.attention.ENGINE_FUSED_DECODE_WRITE=True -- --workload nano --repeats 3
    python benchmarks/module_ab.py "hf_paged.kernels.decode.LONG_SETTINGS=(64, 3, 4)" \\
        "hf_paged.kernels.decode.LONG_SETTINGS_BY_DEVICE={}" -- --workload nano --systems hf_paged

Each ``MODULE.NAME=VALUE`` (VALUE a Python literal) replaces an attribute that already exists (a typo is an error,
not a silent new attribute) before the bench imports anything else; the bench's arguments follow ``--``. A script
path first after ``--`` runs that script instead of the bench, as ``python SCRIPT ARGS`` would:

    python benchmarks/module_ab.py hf_paged.engine.model_runner.CASCADE_MIN_SAVED_BYTES=0 -- \
        benchmarks/engine_trace.py --workload prefix
 Alternate
the two sides in separate processes (benchmarks/run_gpu.sh's `fused-write-ab` part does), so that a slow spell of
the host hits both alike.
"""

import ast
import importlib
import os
import runpy
import sys


def apply(assignment: str) -> None:
    target, _, literal = assignment.partition("=")
    module_name, _, name = target.strip().rpartition(".")
    if not module_name or not literal:
        raise SystemExit(f"module_ab.py: expected MODULE.NAME=VALUE, got {assignment!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"module_ab.py: {module_name} has no attribute {name!r}")
    value = ast.literal_eval(literal.strip())
    setattr(module, name, value)
    print(f"module_ab.py: {module_name}.{name} = {value!r}", flush=True)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: module_ab.py MODULE.NAME=VALUE ... -- BENCH ARGS")
    split = argv.index("--")
    for assignment in argv[:split]:
        apply(assignment)
    rest = argv[split + 1 :]
    if rest and rest[0].endswith(".py"):  # a script: its own argv, run as __main__
        sys.argv = rest
        sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
        runpy.run_path(rest[0], run_name="__main__")
        return 0
    from hf_paged.frontends.bench import main as bench

    return bench(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
