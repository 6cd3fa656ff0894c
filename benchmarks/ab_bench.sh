#!/usr/bin/env bash
# Old code against new on one machine: `hf-paged bench` alternating between two source trees, round by round, so
# that a slow spell of the host hits both alike (single runs of one workload move by ~7% between processes).
#
# Usage (repo root, CUDA machine): bash benchmarks/ab_bench.sh OLD_TREE ROUNDS [bench arguments...]
#   OLD_TREE: a directory holding another commit's hf_paged/ and kernels/ (e.g. `mkdir old && git archive COMMIT
#   hf_paged kernels | tar -x -C old`); the work tree is the new side.
#   e.g. bash benchmarks/ab_bench.sh old 2 --workload prefix --systems hf_paged --repeats 3
#
# Each side runs from its own directory: `python -m` and `python -c` put the working directory first on sys.path,
# ahead of PYTHONPATH, so running the old tree from here would import the work tree (an earlier A/B did exactly
# that). Each run prints the file it imported and stops if it is not the side's own. No editable install is made
# here; one made earlier by pip (`pip install -e .`) is checked for the same way.
set -uo pipefail
old=$(cd "${1:?usage: ab_bench.sh OLD_TREE ROUNDS [bench args...]}" && pwd)
rounds=${2:?usage: ab_bench.sh OLD_TREE ROUNDS [bench args...]}
shift 2
new=$(pwd)
for tree in "$old" "$new"; do
    [ -d "$tree/hf_paged" ] && [ -d "$tree/kernels" ] || { echo "ab_bench.sh: $tree has no hf_paged/ and kernels/" >&2; exit 2; }
    [ -e "$tree/hf_paged/kernels" ] || ln -sfn ../kernels "$tree/hf_paged/kernels"  # hf_paged.kernels without install
done
for round in $(seq 1 "$rounds"); do
    for side in old new; do
        tree=$old
        [ "$side" = new ] && tree=$new
        echo "== round $round, $side ($tree)"
        (cd "$tree" && PYTHONPATH="$tree" python3 - "$tree" "$@" <<'PY'
import runpy
import sys

tree = sys.argv[1]
import hf_paged

if not hf_paged.__file__.startswith(tree + "/"):
    sys.exit(f"ab_bench.sh: imported {hf_paged.__file__}, not the tree {tree}: stopping")
print("imported", hf_paged.__file__, flush=True)
sys.argv = ["hf_paged.frontends.bench", *sys.argv[2:]]
runpy.run_module("hf_paged.frontends.bench", run_name="__main__")
PY
        ) 2>&1 | grep -E "^\| |^imported|ab_bench|Error" || exit 1
    done
done
