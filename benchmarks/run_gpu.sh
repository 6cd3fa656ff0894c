#!/usr/bin/env bash
# One device-machine session: GPU tests of the kernels, PagedCache and the engine (CUDA graphs, start-up warm-up,
# async scheduling and replay are GPU-only paths), then the benchmarks.
# Usage (repo root, CUDA machine): bash benchmarks/run_gpu.sh [OUTDIR]
set -uo pipefail
out=${1:-${OUT:-/tmp/hf_paged_out}}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/env.txt"
# The image has no network: install without build isolation (its setuptools), else import through a link.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || ln -sfn ../kernels hf_paged/kernels
python3 -c "import hf_paged.kernels" || exit 1
HF_PAGED_CHECK_LAUNCH=1 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_launch.py tests/test_cache_ops.py tests/test_prefill.py tests/test_decode.py \
    2>&1 | tail -15 | tee "$out/tests.txt"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cache.py -k cuda -W ignore::FutureWarning 2>&1 | tail -8 | tee -a "$out/tests.txt"
# The engine's tests on the GPU: every engine there captures CUDA graphs, warms up and runs async scheduling.
HF_PAGED_CHECK_LAUNCH=1 HF_PAGED_TEST_DEVICE=cuda timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_async.py \
    tests/test_engine_reliability.py tests/test_graph_steps.py -W ignore::FutureWarning 2>&1 | tail -12 | tee -a "$out/tests.txt"
timeout 120 python3 benchmarks/kernels.py --out "$out/kernels.md" 2>&1 | tail -40
# --quick: Qwen3-0.6B, 1x512 and 32x512, greedy and beams 4, all systems; the full grid (both shapes, 4 points,
# 3 modes, StaticCache compiles per shape) takes far longer: run it on its own.
timeout 900 python3 benchmarks/generate.py --quick --out "$out/generate.md" 2>&1 | grep -v Warning | tail -25
