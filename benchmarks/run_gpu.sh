#!/usr/bin/env bash
# hf_paged on a CUDA machine: the GPU test suite and the benchmarks, as named suites. Each suite fits one call of at
# most 10 minutes on one H200, or spreads its processes over the GPUs of the host (timeouts inside add up to less).
#
# Usage (repo root):
#   bash benchmarks/run_gpu.sh OUTDIR SUITE...            the suites one after another
#   bash benchmarks/run_gpu.sh OUTDIR --spread QUEUE...   each QUEUE (SUITE[+SUITE...]) on a GPU and a share of the
#                                                         host's cores of its own, all queues at once (the queues share
#                                                         the host: compare figures within a queue, not across)
#   BASELINE_SRC=TREE bash benchmarks/run_gpu.sh OUTDIR engine
#       every engine / generate workload runs twice, from this tree and from TREE (another checkout: its hf_paged/,
#       kernels/ and benchmarks/), one process each on the same GPU, the order flipping from one workload to the next,
#       so a change is measured beside its baseline in the same call. BASELINE_COMMIT names TREE's commit in its
#       records (else its `git rev-parse HEAD`).
#
# Suites (time on one H200):
#   tests          tests-kernels, tests-cache and tests-engine: a GPU each on a host of 3 or more, else in turn
#                  (~9 min on one GPU: call the three one by one there if a call is 10 minutes)
#   tests-kernels  tests/kernels on CUDA, every direct launch checked against Triton's own lookup      (~5 min)
#   tests-cache    tests/cache and tests/core on CUDA: PagedCache with the Triton kernels, compiled generate,
#                  the KV pool (its torch.compile tests dominate: beside other suites on the host it exceeds 8 min;
#                  give it a call of its own)                                                            (> 4 min)
#   tests-engine   tests/engine on CUDA: CUDA graphs, start-up warm-up, async scheduling, every direct launch
#                  checked (the engine fuzzer runs in tests-fuzz; tests/serving runs on the CPU, data-parallel
#                  replicas on GPUs in benchmarks/tools/multi_gpu_check.py)                             (~5 min)
#   tests-fuzz     the engine fuzzer (CI's bounded profile) and the PagedCache fuzzer (20 operations, seeds 0
#                  and 1) on CUDA, where they meet CUDA graphs and the CUDA-only launch paths          (~8 min)
#   kernels        benchmarks/kernels.py: decode, shared-prefix decode and prefill beside SDPA           (~1 min)
#   engine         hf-paged bench, the engine table: short beside transformers' continuous batching, nano and
#                  prefix caching on vs off (Qwen3-0.6B), sharegpt (Llama-3.1-8B); a process a workload, dealt
#                  over the GPUs                                                                       (~9 min)
#   engine-qwen / engine-llama   the Qwen3-0.6B workloads / the Llama-3.1-8B one                   (~6 / ~3 min)
#   engine-models  hf-paged bench, sharegpt-like (64 requests) on the shapes of gpt-oss-20b (sinks), DeepSeek-V2-Lite
#                  (MLA), Gemma-3-4B and Mixtral-8x7B, each beside transformers' continuous batching; a process
#                  a model, dealt over the GPUs (MODELS="SHAPE ...": those shapes only)   (~5 min on 4 GPUs)
#   generate       benchmarks/generate.py, the whole grid (2 shapes x 4 points x 3 modes x 4 systems), a
#                  process a (shape, point), dealt over the GPUs: one call on 8 GPUs
#   generate-qwen / generate-llama   one shape's 4 points: one call on 4 GPUs
#   generate-quick  Qwen3-0.6B at 1x512 and 32x512, greedy and beams4, every system                (~5 min)
#   fp8-kernels    benchmarks/tools/fp8_kv_kernels.py: the paged decode kernel over an FP8 (e4m3) pool beside bf16 at
#                  32 x 4096 and 1 x 32768 (Llama-3.1-8B's heads; CUDA graph, L2-cold, share of the bandwidth
#                  floor) and the prefill kernel at 4 x 1024 (FP8_SETTINGS="N/S/W ...": also each split-kernel
#                  setting forced, both pools)                                                        (~1 min)
#   fp8-engine     hf-paged bench, the long workload where the pool caps the batch (512 requests of 1024 prompt + 1024
#                  output tokens, Llama-3.1-8B, an 8.9 GiB pool): a bf16 pool beside an FP8 one in the same memory
#                  (twice the tokens), one run each; a process a pool, dealt over the GPUs (LONG_REQUESTS=N: N requests)
#                                                                                 (~7 min on one GPU, ~3 on two)
#   quant-engine   benchmarks/tools/quant_decode_steps.py: the engine's steady decode step (ms) at batch 1, 8 and
#                  64, Llama-3.1-8B with bf16, float8 and int4 weights (torchao, quantized on the GPU), beside
#                  each one's weight-bound floor; a process a quantization, dealt over the GPUs (QUANTS="Q ...":
#                  those only)
#                                                                                 (~5 min on one GPU, ~2 on three)
#   quant-generate benchmarks/generate.py --quantization: compiled PagedCache's ms per decode step, the same
#                  weights and batches (512-token prompts, greedy, a compile a batch); a process a quantization,
#                  dealt over the GPUs: one call on 3 GPUs (~3 min); on one GPU the three need ~8 min, and the
#                  call's budget may leave the last unrun
#   structured     benchmarks/tools/structured_bench.py: 256 JSON-schema requests beside the same batch unconstrained,
#                  and the TTFT of new schemas, and the host's time by function of a constrained run (structured.log;
#                  needs xgrammar; SERVE_TOKENIZER=DIR without the embedded model's package)         (~3 min)
#   serve          benchmarks/serve_compare.py: hf-paged serve beside transformers serve and the offline engine
#                  (needs the serve extra; SERVE_TOKENIZER=DIR without the embedded model's package)  (~8 min)
#
# OUTDIR gets env.txt (card, driver, versions), tests.txt (each test run's summary) and tests-*.log (tracebacks);
# a benchmark suite writes SUITE.md (its tables) and SUITE/NAME.json (a record a workload: card, date, versions,
# commit, command and figures; NAME.baseline.* for BASELINE_SRC's runs). Set HF_PAGED_COMMIT where the tree is
# not a git checkout, so that its records name their commit.
set -uo pipefail
SUITES=(tests tests-kernels tests-cache tests-engine tests-fuzz kernels engine engine-qwen engine-llama engine-models
    generate generate-qwen generate-llama generate-quick fp8-kernels fp8-engine quant-engine quant-generate structured
    serve)
BUDGET_S=${BUDGET_S:-560}  # a dealt suite's processes all end by then: a call is 600 s

# The engine table's workloads and the generate grid's points, as jobs: NAME TIMEOUT PROGRAM ARGUMENTS...
# (PROGRAM: bench = hf-paged bench, generate = benchmarks/generate.py, else a script's path). Heaviest first: dealt
# round-robin, each GPU gets a heavy job and a light one.
ENGINE_LLAMA=("sharegpt-8b 260 bench --model llama-8b --workload sharegpt --systems hf_paged --repeats 3")
ENGINE_QWEN=(
    "short 240 bench --workload short --systems hf_paged,hf_cb --repeats 3 --baseline-repeats 1"
    "nano 150 bench --workload nano --systems hf_paged --repeats 3"
    "prefix 150 bench --workload prefix --systems hf_paged,hf_paged_no_prefix --repeats 3"
)
# transformers' continuous batching takes minutes on these shapes (recompiling as it goes): stopped after 120 s and
# reported unfinished, with the throughput it stayed below.
ENGINE_MODELS=() HF_CB="--systems hf_paged,hf_cb --baseline-repeats 1 --baseline-timeout 120"
for shape in ${MODELS:-mixtral-8x7b gpt-oss-20b deepseek-v2-lite gemma-3-4b}; do
    ENGINE_MODELS+=("$shape 330 bench --model $shape --workload sharegpt --num-requests 64 --repeats 1 $HF_CB")
done
GRID="--modes greedy samples4 beams4 --systems dynamic static paged paged-compiled --new-tokens 32 --repeats 3"
GENERATE_QWEN=() GENERATE_LLAMA=()
for point in 64x512 32x512 8x1024 1x512; do
    GENERATE_LLAMA+=("llama-8b-$point 540 generate --shapes llama-8b --points $point $GRID")
done
for point in 1x512 8x1024 32x512 64x512; do
    GENERATE_QWEN+=("qwen3-0.6b-$point 540 generate --shapes qwen3-0.6b --points $point $GRID")
done
# The FP8 pool takes the same share of the card as the bf16 one, so it holds twice the tokens. A KV-bound workload: an
# 8.9 GiB pool (a 40-48 GB card's) that alone caps the batch (max_num_seqs 1024), 1024 + 1024 tokens a request; one run
# each (~110 and ~80 s after a ~60 s start-up). Timeouts sum to BUDGET_S: one GPU runs both.
LONG="--model llama-8b --workload long --num-requests ${LONG_REQUESTS:-512} --input-len 1024 --output-len 1024"
LONG+=" --gpu-memory-utilization 0.3 --max-num-seqs 1024 --systems hf_paged --repeats 1"
FP8_ENGINE=("long-bf16 280 bench $LONG" "long-fp8 240 bench $LONG --kv-cache-dtype fp8")
# Weight quantizations: a process each, the 8B model built in bf16 on the GPU and quantized there.
# On one GPU the engine's three fit the budget (~100 s each); generate's compile three graphs each (~50 s a compile).
QUANT_ENGINE=() QUANT_GENERATE=()
QGRID="--shapes llama-8b --points 1x512 8x512 64x512 --modes greedy --systems paged-compiled --new-tokens 32"
QGRID+=" --repeats 3"
for q in ${QUANTS:-none float8 int4}; do
    QUANT_ENGINE+=("$q 186 benchmarks/tools/quant_decode_steps.py --model llama-8b --quantization $q")
    QUANT_GENERATE+=("$q 540 generate $QGRID --quantization $q")
done

out=${1:?usage: bash benchmarks/run_gpu.sh OUTDIR SUITE... | OUTDIR --spread QUEUE...}
shift
args=("$@")
[ ${#args[@]} -gt 0 ] || { echo "run_gpu.sh: name a suite (${SUITES[*]})" >&2; exit 2; }
# Every suite named, in every --spread queue, is checked before anything runs: a typo fails the call at once
# instead of ending one queue early while the others run.
for queue in "${args[@]}"; do
    [ "$queue" = "--spread" ] && continue
    IFS=+ read -ra named <<<"$queue"
    for suite in "${named[@]}"; do
        [[ " ${SUITES[*]} " == *" $suite "* ]] || {
            echo "run_gpu.sh: unknown suite '$suite' (${SUITES[*]})" >&2
            exit 2
        }
        [[ ${args[0]} == --spread && $suite == tests ]] && {
            echo "run_gpu.sh: suite 'tests' spreads itself; spread tests-kernels, tests-cache, tests-engine" >&2
            exit 2
        }
    done
done
if [ -n "${BASELINE_SRC:-}" ]; then
    BASELINE_SRC=$(cd "$BASELINE_SRC" 2>/dev/null && pwd -P) && [ -d "$BASELINE_SRC/hf_paged" ] \
        && [ -d "$BASELINE_SRC/kernels" ] || {
        echo "run_gpu.sh: BASELINE_SRC has no hf_paged/ and kernels/" >&2
        exit 2
    }
    # hf_paged.kernels without an install (kernels/ installs under that name)
    [ -e "$BASELINE_SRC/hf_paged/kernels" ] || ln -sfn ../kernels "$BASELINE_SRC/hf_paged/kernels"
fi
mkdir -p "$out"
out=$(cd "$out" && pwd -P)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', t.__version__)" | tee -a "$out/env.txt"
# Without network: install without build isolation (the machine's setuptools), else import through a link.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || ln -sfn ../kernels hf_paged/kernels
python3 -c "import hf_paged.kernels" || exit 1

visible_gpus() {  # the GPU indices this process may use: CUDA_VISIBLE_DEVICES's, else every GPU of the host
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        tr , ' ' <<<"$CUDA_VISIBLE_DEVICES"
    else
        seq -s ' ' 0 $(($(nvidia-smi -L | wc -l) - 1))
    fi
}

pytest_cuda() {  # pytest_cuda NAME TIMEOUT ARGS...: a test run on CUDA; its summary in tests.txt, its log in NAME.log
    local name=$1 seconds=$2
    shift 2
    HF_PAGED_TEST_DEVICE=cuda timeout "$seconds" python3 -m pytest -q -p no:cacheprovider -W ignore::FutureWarning \
        -rf "$@" 2>&1 | tee "$out/$name.log" | tail -4 | sed "s/^/$name: /" | tee -a "$out/tests.txt"
}

run_side() {  # run_side TREE TIMEOUT PROGRAM BASE ARGS...: one benchmark process of TREE, its table to BASE.md
    local tree=$1 seconds=$2 program=$3 base=$4 file=hf_paged/frontends/bench.py commit=${HF_PAGED_COMMIT:-}
    shift 4
    [ "$program" = generate ] && file=benchmarks/generate.py
    [[ $program == *.py ]] && file=$program
    local extra=(--out "$base.md")
    grep -q -- '"--json"' "$tree/$file" 2>/dev/null && extra+=(--json "$base.json")  # a baseline may predate it
    [ "$tree" != "$PWD" ] && commit=${BASELINE_COMMIT:-}
    # From the tree's own directory: `python3 -` puts the working directory first on sys.path, ahead of an editable
    # install of another tree; the import is checked all the same.
    (cd "$tree" && HF_PAGED_COMMIT=$commit PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout "$seconds" python3 - "$tree" "$program" "$@" \
        "${extra[@]}" <<'PY'
import os
import runpy
import sys

tree, program = os.path.realpath(sys.argv[1]), sys.argv[2]
import hf_paged

if not os.path.realpath(hf_paged.__file__).startswith(tree + os.sep):
    sys.exit(f"run_gpu.sh: imported {hf_paged.__file__}, not the tree {tree}: stopping")
if program == "bench":
    sys.argv = ["hf-paged bench", *sys.argv[3:]]
    runpy.run_module("hf_paged.frontends.bench", run_name="__main__")
else:  # benchmarks/generate.py, or a script's path in the tree
    script = "benchmarks/generate.py" if program == "generate" else program
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(os.path.join(tree, script), run_name="__main__")
PY
    ) 2>&1 | grep -v -i "warn"
}

run_job() {  # run_job SUITE JOB DEADLINE FLIP: one job (NAME TIMEOUT PROGRAM ARGS...), and its baseline's run
    local suite=$1 deadline=$3 flip=$4 name seconds program side tree base left
    local -a words sides=(new)
    read -ra words <<<"$2"
    name=${words[0]} seconds=${words[1]} program=${words[2]}
    if [ -n "${BASELINE_SRC:-}" ]; then sides=(new baseline); ((flip)) && sides=(baseline new); fi
    for side in "${sides[@]}"; do
        left=$((deadline - SECONDS))
        ((left > 10)) || { echo "$suite/$name ($side): not run, the suite's time is spent"; continue; }
        tree=$PWD base=$out/$suite/$name
        [ "$side" = baseline ] && tree=$BASELINE_SRC base=$base.baseline
        echo "== $suite/$name ($side: $tree)"
        run_side "$tree" "$((seconds < left ? seconds : left))" "$program" "$base" "${words[@]:3}"
    done
}

deal() {  # deal SUITE JOB...: the jobs round-robin over the visible GPUs, each GPU's in turn, all ending by BUDGET_S
    local suite=$1 deadline=$((SECONDS + BUDGET_S)) i g per
    shift
    local -a gpus
    read -ra gpus <<<"$(visible_gpus)"
    per=$(($(nproc) / ${#gpus[@]}))
    mkdir -p "$out/$suite"
    echo "$suite: $# jobs over ${#gpus[@]} GPUs, ${BUDGET_S} s${BASELINE_SRC:+, each beside $BASELINE_SRC}"
    for ((g = 0; g < ${#gpus[@]}; g++)); do
        (
            export CUDA_VISIBLE_DEVICES=${gpus[$g]}
            # Several GPUs: each queue on its own share of the host's cores, so that one queue's compile workers do
            # not slow another queue's host-bound steps.
            ((${#gpus[@]} > 1 && per > 0)) && command -v taskset >/dev/null \
                && taskset -cp "$((g * per))-$((g * per + per - 1))" $BASHPID >/dev/null
            i=0
            for job; do
                ((i % ${#gpus[@]} == g)) && run_job "$suite" "$job" "$deadline" $(((i / ${#gpus[@]}) % 2))
                i=$((i + 1))
            done 2>&1 | sed -u "s/^/[gpu$CUDA_VISIBLE_DEVICES] /"
        ) &
    done
    wait
    cat "$out/$suite"/*.md >"$out/$suite.md" 2>/dev/null
    grep -h "^| " "$out/$suite.md" 2>/dev/null || true  # no table: every job's failure is in the lines above
}

spread() {  # spread QUEUE...: each queue (SUITE[+SUITE...]) on a GPU of its own, all at once
    local -a gpus pids
    read -ra gpus <<<"$(visible_gpus)"
    local n=$# per i status=0
    per=$(($(nproc) / n))
    echo "spread: $n queues over ${#gpus[@]} GPUs, $per cores each"
    for ((i = 1; i <= n; i++)); do
        local queue=${!i}
        (
            IFS=+ read -ra named <<<"$queue"
            export CUDA_VISIBLE_DEVICES=${gpus[$(((i - 1) % ${#gpus[@]}))]}
            ((per > 0)) && command -v taskset >/dev/null \
                && taskset -cp "$(((i - 1) * per))-$(((i - 1) * per + per - 1))" $BASHPID >/dev/null
            for suite in "${named[@]}"; do run_suite "$suite"; done 2>&1 | sed -u "s/^/[gpu$CUDA_VISIBLE_DEVICES] /"
        ) &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    return $status
}

run_suite() {  # run_suite SUITE: one suite, its results under $out
    local suite=$1 ngpu
    case "$suite" in
        tests)
            ngpu=$(visible_gpus | wc -w)
            if ((ngpu >= 3)); then
                spread tests-kernels tests-cache tests-engine
            else
                run_suite tests-kernels; run_suite tests-cache; run_suite tests-engine
            fi
            ;;
        tests-kernels) HF_PAGED_CHECK_LAUNCH=1 pytest_cuda tests-kernels 540 tests/kernels ;;
        tests-cache) pytest_cuda tests-cache 540 tests/cache tests/core ;;
        tests-engine) HF_PAGED_CHECK_LAUNCH=1 pytest_cuda tests-engine 540 tests/engine \
            --ignore=tests/engine/test_engine_fuzz.py ;;
        tests-fuzz)
            HF_PAGED_CHECK_LAUNCH=1 pytest_cuda tests-engine-fuzz 300 tests/engine/test_engine_fuzz.py
            for seed in 0 1; do
                HF_PAGED_FUZZ_STEPS=20 HF_PAGED_FUZZ_SEED=$seed pytest_cuda "tests-cache-fuzz-$seed" 120 \
                    tests/cache/test_cache_fuzz.py -k fuzz_generate
            done
            ;;
        kernels)
            local json=()
            grep -q -- '"--json"' benchmarks/kernels.py && json=(--json "$out/kernels.json")
            timeout 150 python3 benchmarks/kernels.py --out "$out/kernels.md" "${json[@]}" 2>&1 | grep -v -i warn \
                | tail -40
            ;;
        engine) deal engine "${ENGINE_LLAMA[@]}" "${ENGINE_QWEN[@]}" ;;
        engine-qwen) deal engine-qwen "${ENGINE_QWEN[@]}" ;;
        engine-llama) deal engine-llama "${ENGINE_LLAMA[@]}" ;;
        engine-models) deal engine-models "${ENGINE_MODELS[@]}" ;;
        # Qwen points light to heavy, then Llama points heavy to light: on 4 GPUs each gets a light and a heavy one.
        generate) deal generate "${GENERATE_QWEN[@]}" "${GENERATE_LLAMA[@]}" ;;
        generate-qwen) deal generate-qwen "${GENERATE_QWEN[@]}" ;;
        generate-llama) deal generate-llama "${GENERATE_LLAMA[@]}" ;;
        generate-quick) deal generate-quick "quick 480 generate --quick" ;;
        fp8-kernels) deal fp8-kernels "fp8-kernels 300 benchmarks/tools/fp8_kv_kernels.py${FP8_SETTINGS:+ --settings $FP8_SETTINGS}" ;;
        fp8-engine) deal fp8-engine "${FP8_ENGINE[@]}" ;;
        quant-engine) deal quant-engine "${QUANT_ENGINE[@]}" ;;
        quant-generate) deal quant-generate "${QUANT_GENERATE[@]}" ;;
        structured)
            local tokenizer=()
            [ -n "${SERVE_TOKENIZER:-}" ] && tokenizer=(--tokenizer "$SERVE_TOKENIZER")
            timeout 540 python3 benchmarks/tools/structured_bench.py "${tokenizer[@]}" --json "$out/structured.json" \
                --profile 2>&1 | grep -v -i warn | tee "$out/structured.log" | tail -6
            ;;
        serve)
            local tokenizer=()
            [ -n "${SERVE_TOKENIZER:-}" ] && tokenizer=(--tokenizer "$SERVE_TOKENIZER")
            mkdir -p "$out/serve"
            timeout 540 python3 benchmarks/serve_compare.py "${tokenizer[@]}" --log-dir "$out/serve" \
                --out "$out/serve.md" --json "$out/serve/serve.json" 2>&1 | grep -v -i warn | grep "^| \|failed"
            ;;
    esac
}

if [ "${args[0]}" = "--spread" ]; then
    spread "${args[@]:1}"
else
    for suite in "${args[@]}"; do run_suite "$suite"; done
fi
