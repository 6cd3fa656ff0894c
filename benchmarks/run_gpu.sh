#!/usr/bin/env bash
# The device-machine run: GPU tests of the kernels, PagedCache and the engine (CUDA graphs, start-up warm-up,
# async scheduling and replay are GPU-only paths), then the benchmarks. In parts, each sized for one call of at
# most 10 minutes (the device tool's limit; a part's own timeouts add up to less):
#   tests     kernel tests with every direct launch checked against Triton's own lookup (HF_PAGED_CHECK_LAUNCH=1),
#             PagedCache's CUDA/compile tests, the engine's tests on CUDA                                   (~9 min)
#   tests-cache  PagedCache's CUDA/compile tests alone                                                     (~1 min)
#   tests-cache-fuzz  tests/test_cache_fuzz.py's fuzzer with both models on the GPU (fp32), 8 seeds x 20 operations
#             x 8 configurations, the seeds dealt over the visible GPUs: the CUDA-only paths (kept decode launch,
#             one-launch copy-on-write, compiled generate under CUDA-graph trees) meet beams, samples, chunking,
#             prefix hits, crop, prompt lookup and tiny pools (4 x H200: ~3 min; one GPU: ~9 min)
#   tests-engine-fuzz  tests/test_engine_fuzz.py on CUDA (CI's bounded profile: n, beams, preemption, chunking, async,
#             aborts and interrupts over small pools, with real CUDA graphs; not run on a card yet)        (~5 min?)
#   tests-kernels / tests-prefill / tests-engine   the other three pieces of tests, one each (for --spread:
#             tests-kernels tests-prefill+tests-cache tests-engine runs the whole suite in the engine's ~5 min)
#   kernels   benchmarks/kernels.py (decode vs SDPA, splits, PDL, cascade, prefill)                          (~1 min)
#   skinny-ab  the prefix workload with the engine's projections at <= 64 rows on kernels/skinny.py (engine.fuse.
#             SKINNY_MAX_ROWS) off and on, alternating (module_ab.py), then nano off and on; SKINNY_AB="0 256 256 0"
#             sets the values (not run yet)                                                                 (~6 min?)
#   pdl-ab / pdl-ab-nano  the prefix workload / nano with the engine's compiled layers under inductor's programmatic
#             dependent launch (LAYER_COMPILE_OPTIONS options triton.enable_pdl) off and on, A/B/B/A      (~4 min)
#   skinny-gemm  benchmarks/skinny_gemm.py: the decode steps' projections at 1-256 rows, cuBLAS vs kernels/skinny.py
#             at a few launch settings, in a CUDA graph, weights L2-cold (issue 13; not run on a card yet)  (~2 min?)
#   engine    hf-paged bench: nano, and prefix caching on vs off                                              (~6 min)
#   generate  benchmarks/generate.py --quick (Qwen3-0.6B, 1x512 and 32x512, greedy and beams4, every system)  (~5 min)
#   grid-qwen-a / grid-qwen-b / grid-llama-a / grid-llama-b   issue 14's generate grid, two points of one model shape
#             per part (qwen: 1x512 8x1024 / 32x512 64x512; llama: 1x512 32x512 / 8x1024 64x512), 3 modes x 4 systems
#             (StaticCache and compiled PagedCache compile per point; three Qwen points overran 9 min)     (~5-8 min)
#   grid-spread-qwen / grid-spread-llama / grid-spread   the same grid, one process a point, spread over every
#             visible GPU (4 points of one shape, or all 8); for the 2-, 4- and 8-GPU kinds: the whole grid in one call
#             on nvidia-h100-x8 (or x4 with GRID_BUDGET_S's share), a shape a call on x2. GRID_REPEATS (default 3)
#             sets --repeats, GRID_EAGER_REPEATS --eager-repeats (more rounds of the two eager systems)  (~5-9 min)
#   grid-spread-llama-modes   the Llama-8B points' samples4 and beams4 cells, a process each (8 over the visible GPUs;
#             the fifteenth session's 4 x H200 ran them in 307 s)                                             (~5 min)
#   grid-spread-modes-qwen / grid-spread-modes-llama / grid-spread-modes   the whole grid a process a (point, mode)
#             cell: 12 cells of one shape (a shape a call on x4: ~150 s a Llama cell, 3 a GPU), or all 24 (x8)  (~4-8 min)
#   grid-spread-greedy   the greedy cells of both shapes, a process each (8 cells)                           (~5 min)
#   memory    benchmarks/generate_memory.py: the allocator's live blocks at a generate() call's peak, by allocating
#             code, compiled StaticCache vs compiled PagedCache (Qwen3-0.6B 64x512, Llama-3.1-8B 32x512, greedy) (~5 min)
#   phases    benchmarks/generate_profile.py --phases --syncs at 64 x 512 greedy, Qwen3-0.6B then Llama-3.1-8B:
#             each eager step's host issue time, host rest and GPU time, and where the host syncs, paged vs dynamic (~4 min)
#   layer-host  benchmarks/layer_host_time.py: host µs of one layer's cache update + attention call, DynamicCache +
#             sdpa vs PagedCache + paged, and PagedCache's plan of a step (Llama-3.1-8B, Qwen3-0.6B; batch 64, 1) (~2 min)
#   eager-greedy  generate.py's greedy cells at batch 32 and 64 of both shapes, DynamicCache vs eager PagedCache
#             only, 15 alternating rounds (the paired ratio with the power to see a few percent)             (~4 min)
#   segments  generate_profile.py --segments: each eager decode forward's host time by module (plan, embedding
#             and mask, layers, end, LM head), DynamicCache vs PagedCache, Llama-3.1-8B and Qwen3-0.6B 64 x 512 (~3 min)
#   binding-ab  benchmarks/eager_ab.py: eager greedy 64 x 512 steps, DynamicCache beside PagedCache with
#             attention.DECODE_BINDING on and off, 10 alternating rounds, both shapes                     (~4 min)
#   eager-cells  generate.py cells one after another, DynamicCache vs eager PagedCache only, 15 alternating rounds
#             each, alone on the machine: EAGER_CELLS="SHAPE:POINT:MODE ..." (default: the four cells the eighteenth
#             session's grid put at paired 1.01-1.02, four processes sharing the host)                   (~6 min)
#   copy-ab   benchmarks/eager_ab.py --mode beams4: eager beam steps (a block copied every step), DynamicCache beside
#             PagedCache with kv_pool.ONE_COPY_LAUNCH on and off, 10 alternating rounds, Llama-3.1-8B 1 x 512 and
#             Qwen3-0.6B 32 x 512                                                                          (~3 min)
#   profile   benchmarks/generate_profile.py: a generate decode step's host and device ops, paged vs dynamic  (~2 min)
#   profile-python  the same call under cProfile (Python functions by own time): where eager PagedCache's greedy
#             steps at batch 32-64 spend the 4-9% they trail DynamicCache by (sixteenth session's grid)      (~3 min)
#   trace     benchmarks/engine_trace.py: nano and prefix on/off step by step, GPU time beside each step's floor (~4 min)
#   trace-prefix  engine_trace.py on the prefix workload alone, caching on and off (before the first forward, each
#             step kind's GPU time beside its floor)                                                         (~3 min)
#   prefix-5  hf-paged bench, the prefix workload caching on and off, 5 repeats                             (~2 min)
#   kernels-step  benchmarks/step_kernels.py: the kernels of a captured decode step at batch 256, 64, 1        (~1 min)
#   kernels-step-prefix  the same for the prefix workload's decode steps (224, 128 and 32 rows sharing a 341-token
#             prefix, ~400 keys), shared-prefix decode on and off                                               (~3 min)
#   fuse-ab   nano with EngineConfig.fuse_projections off and on, alternating twice (hf-paged bench --repeats 3)   (~4 min)
#   fuse-ab-8b  the same on the Llama-8B shape's sharegpt workload, --repeats 1                           (~6 min)
#   fused-write-ab  nano with the engine's decode K/V write fused into the decode kernel off and on, alternating
#             twice (benchmarks/module_ab.py: attention.ENGINE_FUSED_DECODE_WRITE; --repeats 3)              (~4 min)
#   prefix-cascade  the prefix workload: prefix caching with shared-prefix decode (the default on CUDA), with the
#             plain decode (cascade_attention=False), and without prefix caching, in one process (--repeats 3) (~2 min)
#   cascade-ab  nano and the 8B sharegpt workload with cascade_attention off and on, one process each workload,
#             then the prefix workload traced step by step with and without it (engine_trace.py)             (~7 min)
#   cascade-write-ab  the prefix workload (cascade_attention on by default), its shared-prefix decode steps writing K/V
#             in the decode kernel off and on, alternating twice (module_ab.py: CASCADE_FUSED_DECODE_WRITE)     (~3 min)
#   cascade-bytes-ab  the prefix workload with the shared-prefix decode's threshold (model_runner.
#             CASCADE_MIN_SAVED_BYTES) at 16 MiB a layer (before the sixteenth session) and 64 MiB (now: cascade from
#             ~48 rows of a 336-token prefix on Qwen3-0.6B), alternating, then both traced                     (~4 min)
#   cascade-suffix-ab  the decode kernel's settings for shared-prefix calls (decode_sweep.py --prefix-len 336: the
#             prefix workload's steps and longer suffixes; BLOCK_N/stages/warps[/KV heads a program packs], the list
#             in CASCADE_SWEEP), then the fastest at 224 rows end to end against 16/2/2, alternating (module_ab.py:
#             kernels.decode.CASCADE_SUFFIX_SETTINGS)                                                         (~6 min)
#   one-split-ab  plain decode calls of one split with KV heads packed (decode_sweep.py over LONG_SETTINGS at large
#             batches, BLOCK_N/stages/warps/heads, the list in ONE_SPLIT_SWEEP), then the fastest packed setting at
#             256 x 1024 as ONE_SPLIT_SETTINGS on the nano workload against None, alternating (module_ab.py)   (~8 min)
#   prefix-split-ab  keys a shared-prefix kernel split streams at least (kernels.cascade.MIN_KEYS_PER_PREFIX_SPLIT):
#             the cascade call at 256 / 128 / 64 (decode_sweep.py --prefix-len 336), then the prefix workload at the
#             values of PREFIX_SPLIT_AB (default 256 64 64 256), one process each (module_ab.py)             (~6 min)
#   l2-prefetch  benchmarks/l2_prefetch.py: a Qwen3-0.6B layer's GEMMs L2-cold / hot, and the layer with its
#             o / gate_up / down weights prefetched into L2 on a side stream while attention runs (rejected)  (~1 min)
#   prefill-map-ab  the prefill kernel's grid: the binary-search bound (kernels.prefill.SCAN_MAX_SEQS=0, a program
#             per sequence slot) against the exact tile map (1024): CUDA tests of the kernel, an 8B mixed step's
#             kernels (224 decode rows + a 128-token prompt), then the prefix workload 0 1024 1024 0 (module_ab.py) (~6 min)
#   cascade-merge-ab  the prefix workload with a one-split shared-prefix call's merge launch (CASCADE_MERGE_IN_SPLIT
#             off) and without it (on: the split kernel folds the prefix partials in), alternating (module_ab.py),
#             then the cascade call's sweep row at the default settings                                     (~3 min)
#   cascade-prefix-ab  the prefix workload with the shared-prefix kernel's default settings (64-key tiles, 4 warps:
#             spills, per ptxas, yet 5% faster on the H100) and the spill-free 32 keys, 8 warps, alternating
#             (module_ab.py: CASCADE_PREFIX_SETTINGS)                                                         (~3 min)
#   autotune-ab  the prefix workload (issue 13's unmet 3x: its decode steps spend 1.2-1.4 ms in GEMMs and
#             pointwise kernels at ~30% of the copy bandwidth) with the decoder layers compiled by default and with
#             inductor's max-autotune (Triton GEMM templates, epilogues fused), alternating (module_ab.py:
#             LAYER_COMPILE_OPTIONS; the first autotuning run has the longer timeout; start-up in the table)  (~9 min)
#   argmax-ab  greedy sampling's argmax: kernels/argmax_rows.py on CUDA (tests with every launch checked), against
#             torch.argmax in a CUDA graph (benchmarks/argmax_bench.py), then the prefix workload with
#             kernels.TRITON_ARGMAX False True True False (module_ab.py)                                      (~4 min)
#   gc-ab     generate() with the heap it found frozen (engine.FREEZE_GC_IN_GENERATE) off and on, the prefix workload
#             with 7 repeats each, False / True / True / False: the spread of repeats (a collection of the oldest
#             generation lands in some runs only)                                                             (~5 min)
#   feed-ab   generate() feeding its prompts as it goes (engine.FEED_PROMPTS): its tests on CUDA, the prefix workload
#             False / True / True / False (module_ab.py), then traced with it on (the wait before the first forward) (~5 min)
#   compile-ab  fewer kernels a layer without new code: the prefix workload with the decoder layers compiled (the
#             default), the whole model compiled (--compile full: the residual add that ends a layer fuses with the
#             next layer's norm) and the layers with inductor's combo kernels (LAYER_COMPILE_OPTIONS options
#             combo_kernels: the q and k rotary kernels as one launch), alternating, start-up in each row (~8 min)
#   pdl-tests  tests/test_decode.py's PDL tests: the merge's early and late trigger and no PDL, equal outputs (~1 min)
#   compile-ab-small  nano and short (Qwen3-0.6B), layers / full / full / layers, start-up in each row      (~7 min)
#   compile-ab-8b  the sharegpt 8B workload, layers vs full, one repeat each, alternating                   (~9 min)
#   mixed-ab-8b  the 8B sharegpt workload with the mixed-step graph sizes before the twelfth session and now,
#             alternating both ways (benchmarks/module_ab.py: MIXED_TOKEN_SIZES; --repeats 2)                 (~6 min)
#   sweep     benchmarks/decode_sweep.py: the decode kernel's long-split launch settings on this card    (~2 min)
#   split-sweep-mid  decode_sweep.py at Llama-8B's heads, 8-64 rows: split counts 1-8 x three long-split settings,
#             beside SDPA (the 8B run's small decode steps; the decode kernel is 0.78-0.94x SDPA there)      (~2 min)
#   split-sweep-mid-ragged  the same shapes, ragged rows, split counts 1-6 and 9, the long-split setting      (~1 min)
#   prefill-sweep  benchmarks/prefill_sweep.py: the prefill kernel's tiles (kernels.prefill.PREFILL_TILES) beside
#             SDPA, fresh prompts of both model shapes, K/V through the block table and from the new tokens  (~2 min)
#   stages-ab-8b  the 8B sharegpt workload with the long-split settings 64/3/4 (the default) and STAGES_AB
#             (default 32/3/1) forced, alternating (benchmarks/module_ab.py: LONG_SETTINGS,
#             LONG_SETTINGS_BY_DEVICE={}; --repeats 1)                                                       (~7 min)
#   table     the README's engine table, Qwen3-0.6B rows: nano, prefix caching on vs off, the short workload beside
#             transformers' continuous batching (one run of it)                                             (~6 min)
#   table-8b  the table's Llama-3.1-8B row: sharegpt, 512 requests                                          (~3 min)
#   cap-ab-prefix  the prefix workload at 400 requests (issue 13's count) with --max-num-seqs 256 and 512, caching on
#             and off in each process, 256 / 512 / 512 / 256 (one process each; CAP_AB sets the values)        (~5 min)
#   cap-ab-short  the short workload (1 000 requests) at --max-num-seqs 256 and 512 (CAP_AB)                 (~4 min)
#   cap-ab-8b  the 8B sharegpt workload (512 requests) at --max-num-seqs 256 and 512 (CAP_AB; --repeats 2)    (~7 min)
#   all       tests, kernels, generate (the default; longer than one call)
# Usage (repo root, CUDA machine): bash benchmarks/run_gpu.sh [OUTDIR] [PART ...]
#        bash benchmarks/run_gpu.sh OUTDIR --spread QUEUE...   (QUEUE = PART[+PART...], a GPU each, all at once; not the
#        grid parts, tests or all)
set -uo pipefail
# Every part run_part knows, as its case labels name them (tests/test_run_gpu.py checks that the two agree).
KNOWN_PARTS=(tests tests-cache tests-cache-fuzz tests-engine-fuzz tests-kernels tests-prefill tests-engine kernels
    skinny-gemm skinny-ab pdl-ab pdl-ab-nano engine generate grid-qwen-a grid-qwen-b grid-llama-a grid-llama-b
    grid-spread-qwen grid-spread-llama grid-spread grid-spread-llama-modes grid-spread-modes-qwen
    grid-spread-modes-llama grid-spread-modes grid-spread-greedy memory phases layer-host eager-greedy segments
    binding-ab eager-cells copy-ab profile profile-python trace kernels-step kernels-step-prefix fuse-ab fuse-ab-8b
    fused-write-ab prefix-cascade cascade-ab cascade-write-ab cascade-bytes-ab cascade-suffix-ab one-split-ab
    prefix-split-ab l2-prefetch prefill-map-ab cascade-merge-ab cascade-prefix-ab autotune-ab argmax-ab pdl-tests
    tests-gc gc-ab feed-ab compile-ab compile-ab-small compile-ab-8b mixed-ab-8b split-sweep-mid split-sweep-mid-ragged sweep prefill-sweep
    stages-ab-8b table table-8b trace-prefix prefix-5 cap-ab-prefix cap-ab-short cap-ab-8b all)
out=${1:-${OUT:-/tmp/hf_paged_out}}
shift || true
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(all)
# Every part named, of every --spread queue, is checked before anything runs: a name the script does not know (a
# part added to the tree after the device call copied it, a typo) fails the call at once instead of ending one queue
# early while the others run.
for queue in "${parts[@]}"; do
    [ "$queue" = "--spread" ] && continue
    IFS=+ read -ra named <<<"$queue"
    for part in "${named[@]}"; do
        [[ " ${KNOWN_PARTS[*]} " == *" $part "* ]] || {
            echo "run_gpu.sh: unknown part '$part' (${KNOWN_PARTS[*]})" >&2
            exit 2
        }
    done
done
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/env.txt"
# The image has no network: install without build isolation (its setuptools), else import through a link.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || ln -sfn ../kernels hf_paged/kernels
python3 -c "import hf_paged.kernels" || exit 1

run_cache_tests() {  # PagedCache on CUDA: generate with the Triton kernels, the compiled path (inductor, CUDA graphs)
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_cache.py tests/test_cache_compile.py \
        tests/test_cache_memory.py -k "cuda or compile or custom" -W ignore::FutureWarning 2>&1 | tee "$out/tests-cache.log" | tail -4 \
        | tee -a "$out/tests.txt"
}

run_cache_fuzz() {  # the PagedCache fuzzer on CUDA (kept decode launch, one-launch copy-on-write, compiled generate
    # under CUDA-graph trees): 8 seeds x 20 ops, dealt over the GPUs this part sees (~80 s a seed)
    local gpus seed i
    IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(($(nvidia-smi -L | wc -l) - 1)))}"
    for i in "${!gpus[@]}"; do
        for seed in 0 1 2 3 4 5 6 7; do
            [ $((seed % ${#gpus[@]})) -eq "$i" ] || continue
            CUDA_VISIBLE_DEVICES=${gpus[$i]} HF_PAGED_TEST_DEVICE=cuda HF_PAGED_FUZZ_STEPS=20 HF_PAGED_FUZZ_SEED=$seed \
                timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cache_fuzz.py -k fuzz_generate \
                -W ignore::FutureWarning > "$out/tests-cache-fuzz-$seed.log" 2>&1
            echo "seed $seed: $(tail -1 "$out/tests-cache-fuzz-$seed.log")" | tee -a "$out/tests.txt"
        done &
    done
    wait
    cat "$out"/tests-cache-fuzz-?.log > "$out/tests-cache-fuzz.log" && rm "$out"/tests-cache-fuzz-?.log
}

run_engine_fuzz() {  # the engine fuzzer on CUDA (graphs, async replay, one-launch copy-on-write), CI's bounded profile
    HF_PAGED_CHECK_LAUNCH=1 HF_PAGED_TEST_DEVICE=cuda timeout 400 python3 -m pytest -q -p no:cacheprovider \
        tests/test_engine_fuzz.py -W ignore::FutureWarning -rf 2>&1 | tee "$out/tests-engine-fuzz.log" | tail -4 \
        | tee -a "$out/tests.txt"
}

run_kernel_tests() {
    # ~170 s alone on a GPU; 200 s cut it at ~85% with three other parts compiling on the host (nineteenth session)
    HF_PAGED_CHECK_LAUNCH=1 timeout 320 python3 -m pytest -q -p no:cacheprovider tests/test_launch.py \
        tests/test_cache_ops.py tests/test_decode.py tests/test_cascade.py tests/test_skinny.py 2>&1 | tee "$out/tests-kernels.log" | tail -4 \
        | tee -a "$out/tests.txt"
}

run_prefill_tests() {
    HF_PAGED_CHECK_LAUNCH=1 timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_prefill.py 2>&1 \
        | tee "$out/tests-prefill.log" | tail -4 | tee -a "$out/tests.txt"
}

run_engine_tests() {  # every engine on the GPU captures CUDA graphs, warms up and runs async scheduling
    HF_PAGED_CHECK_LAUNCH=1 HF_PAGED_TEST_DEVICE=cuda timeout 420 python3 -m pytest -q -p no:cacheprovider \
        tests/test_engine.py tests/test_async.py tests/test_engine_reliability.py tests/test_graph_steps.py \
        tests/test_engine_cascade.py tests/test_fuse.py -W ignore::FutureWarning -rf 2>&1 | tee "$out/tests-engine.log" | tail -6 \
        | tee -a "$out/tests.txt"
}

run_tests() {  # the summary lines here (and in $out/tests.txt); every failure's traceback in $out/tests-*.log
    run_kernel_tests
    run_prefill_tests
    run_cache_tests
    run_engine_tests
}

grid() {  # grid SHAPE NAME POINT...: every mode and system of issue 14's grid at these points of one model shape
    local shape=$1 name=$2
    shift 2
    # The rows print as they finish: a part cut by its timeout still reports what it measured.
    timeout 560 python3 benchmarks/generate.py --shapes "$shape" --points "$@" \
        --modes greedy samples4 beams4 --systems dynamic static paged paged-compiled --new-tokens 32 --repeats 3 \
        --out "$out/$name.md" 2>&1 | grep "^|" | tee "$out/$name.rows"
}

grid_spread() {  # grid_spread NAME SHAPE:POINT...: one process a point, the points dealt round-robin to one queue per
    # visible GPU, each queue on its own share of the host's cores; each point's systems still take turns in one
    # process on one GPU, so a multi-GPU machine runs the grid in a fraction of the time, with the same comparisons.
    local name=$1
    shift
    local ngpu ncpu per queue_len deadline
    ngpu=$(nvidia-smi -L | wc -l)
    ncpu=$(nproc)
    per=$((ncpu / ngpu))
    queue_len=$((($# + ngpu - 1) / ngpu))
    # Every queue ends by the deadline: a point may use what the points before it on its GPU left (a Qwen point
    # ends sooner than a Llama one), and a point cut by it still reports the rows it finished.
    deadline=$((SECONDS + ${GRID_BUDGET_S:-560}))
    mkdir -p "$out/$name"
    echo "grid $name: $# points on $ngpu GPUs, up to $queue_len a GPU, ${GRID_BUDGET_S:-560} s in all," \
        "--repeats ${GRID_REPEATS:-3}"
    for ((g = 0; g < ngpu; g++)); do
        (
            local i=0 item pin=()
            ((per > 0)) && command -v taskset >/dev/null && pin=(taskset -c "$((g * per))-$((g * per + per - 1))")
            for item in "$@"; do  # SHAPE:POINT, or SHAPE:POINT:MODE for one mode
                local rest=${item#*:} modes=(greedy samples4 beams4)
                [[ $rest == *:* ]] && modes=("${rest#*:}")
                if ((i % ngpu == g && deadline - SECONDS > 10)); then
                    CUDA_VISIBLE_DEVICES=$g timeout "$((deadline - SECONDS))" "${pin[@]}" python3 benchmarks/generate.py \
                        --shapes "${item%%:*}" --points "${rest%%:*}" --modes "${modes[@]}" \
                        --systems dynamic static paged paged-compiled --new-tokens 32 --repeats "${GRID_REPEATS:-3}" \
                        --eager-repeats "${GRID_EAGER_REPEATS:-${GRID_REPEATS:-3}}" \
                        --out "$out/$name/${item//:/-}.md" 2>&1 | grep "^|" >"$out/$name/${item//:/-}.rows"
                fi
                i=$((i + 1))
            done
        ) &
    done
    wait
    cat "$out/$name"/*.rows | tee "$out/$name.rows"
}

prefix_ab() {  # prefix_ab MODULE.SWITCH VALUE...: the prefix workload (one process each) with the switch at each value
    local switch=$1 value  # PREFIX_AB_REPEATS: timed runs a process (default 3)
    shift
    for value in "$@"; do
        echo "${switch##*.}=$value"
        PYTHONPATH=$PWD timeout 100 python3 benchmarks/module_ab.py "$switch=$value" -- --workload prefix \
            --systems hf_paged --repeats "${PREFIX_AB_REPEATS:-3}" 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
    done
}

run_part() {  # run_part PART: one part, its figures under $out
    local part=$1
    case "$part" in
        tests) run_tests ;;
        tests-cache) run_cache_tests ;;
        tests-cache-fuzz) run_cache_fuzz ;;
        tests-engine-fuzz) run_engine_fuzz ;;
        tests-kernels) run_kernel_tests ;;
        tests-prefill) run_prefill_tests ;;
        tests-engine) run_engine_tests ;;
        kernels) timeout 150 python3 benchmarks/kernels.py --out "$out/kernels.md" 2>&1 | tail -40 ;;
        skinny-gemm) timeout 300 python3 benchmarks/skinny_gemm.py 2>&1 | grep -v Warn | tee "$out/skinny-gemm.md" ;;
        engine)
            timeout 200 python3 -m hf_paged.frontends.bench --workload nano --systems hf_paged --repeats 3 \
                --out "$out/nano.md" 2>&1 | grep -v Warning | tail -4
            timeout 200 python3 -m hf_paged.frontends.bench --workload prefix --systems hf_paged,hf_paged_no_prefix \
                --repeats 3 --out "$out/prefix.md" 2>&1 | grep -v Warning | tail -5
            ;;
        generate) timeout 400 python3 benchmarks/generate.py --quick --out "$out/generate.md" 2>&1 | grep -v Warning | tail -25 ;;
        grid-qwen-a) grid qwen3-0.6b grid-qwen-a 1x512 8x1024 ;;
        grid-qwen-b) grid qwen3-0.6b grid-qwen-b 32x512 64x512 ;;
        grid-llama-a) grid llama-8b grid-llama-a 1x512 32x512 ;;
        grid-llama-b) grid llama-8b grid-llama-b 8x1024 64x512 ;;
        grid-spread-qwen) grid_spread grid-spread-qwen qwen3-0.6b:{1x512,8x1024,32x512,64x512} ;;
        grid-spread-llama) grid_spread grid-spread-llama llama-8b:{1x512,8x1024,32x512,64x512} ;;
        # Qwen points in order, then Llama points in reverse: each GPU of four gets a light point and a heavy one.
        grid-spread) grid_spread grid-spread qwen3-0.6b:{1x512,8x1024,32x512,64x512} llama-8b:{64x512,32x512,8x1024,1x512} ;;
        # The Llama points' sampling and beam modes, a process each (a whole Llama point overruns a call's share on x4).
        grid-spread-llama-modes) grid_spread grid-spread-llama-modes llama-8b:{64x512,32x512,8x1024,1x512}:{samples4,beams4} ;;
        # Every cell a process, point-major and heavy points first: dealt round-robin, each GPU gets a mix.
        grid-spread-modes-qwen) grid_spread grid-spread-modes-qwen \
            qwen3-0.6b:{64x512,32x512,8x1024,1x512}:{greedy,samples4,beams4} ;;
        grid-spread-modes-llama) grid_spread grid-spread-modes-llama \
            llama-8b:{64x512,32x512,8x1024,1x512}:{greedy,samples4,beams4} ;;
        # The greedy row of both shapes (issue 14's memory target is greedy's): 8 cells; on 4 GPUs each gets a Llama
        # cell and a Qwen cell, the heaviest Llama with the lightest Qwen.
        grid-spread-greedy) grid_spread grid-spread-greedy llama-8b:{64x512,32x512,8x1024,1x512}:greedy \
            qwen3-0.6b:{1x512,8x1024,32x512,64x512}:greedy ;;
        grid-spread-modes) grid_spread grid-spread-modes llama-8b:{64x512,32x512,8x1024,1x512}:{greedy,samples4,beams4} \
            qwen3-0.6b:{64x512,32x512,8x1024,1x512}:{greedy,samples4,beams4} ;;
        trace)
            timeout 150 python3 benchmarks/engine_trace.py --workload nano --repeats 1 2>&1 | tail -16 | tee "$out/trace.md"
            for flag in "" --no-prefix-caching; do
                timeout 90 python3 benchmarks/engine_trace.py --workload prefix $flag 2>&1 | tail -14 | tee -a "$out/trace.md"
            done
            ;;
        trace-prefix)
            for flag in "" --no-prefix-caching; do
                timeout 120 python3 benchmarks/engine_trace.py --workload prefix $flag 2>&1 | tail -16 \
                    | tee -a "$out/trace-prefix.md"
            done
            ;;
        prefix-5)
            timeout 240 python3 -m hf_paged.frontends.bench --workload prefix --repeats 5 \
                --systems hf_paged,hf_paged_no_prefix --out "$out/prefix-5.md" 2>&1 | grep "^| hf_paged"
            ;;
        kernels-step) timeout 150 python3 benchmarks/step_kernels.py --sizes 256 64 1 2>&1 | grep -v "USDT\|^STAGE" \
            | tee "$out/step_kernels.md" ;;
        kernels-step-prefix)
            for flag in on off; do
                timeout 150 python3 benchmarks/step_kernels.py --batch 224 --prompt 400 --shared-prefix 341 \
                    --sizes 224 128 32 --cascade-attention $flag 2>&1 | grep -v "USDT\|^STAGE" \
                    | tee -a "$out/step_kernels_prefix.md"
            done
            ;;
        fuse-ab | fuse-ab-8b)
            args=(--workload nano --repeats 3)
            [ "$part" = fuse-ab-8b ] && args=(--workload sharegpt --model llama-8b --repeats 1)
            for flag in off on off on; do
                echo "fuse_projections=$flag"
                timeout 140 python3 -m hf_paged.frontends.bench "${args[@]}" --systems hf_paged --fuse-projections $flag \
                    2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
            done
            ;;
        fused-write-ab)
            for flag in False True False True; do
                echo "ENGINE_FUSED_DECODE_WRITE=$flag"
                PYTHONPATH=$PWD timeout 140 python3 benchmarks/module_ab.py \
                    "hf_paged.core.attention.ENGINE_FUSED_DECODE_WRITE=$flag" -- --workload nano --systems hf_paged \
                    --repeats 3 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
            done
            ;;
        stages-ab-8b)
            candidate=${STAGES_AB:-(32, 3, 1)}  # the fifteenth session's H200 sweep: ahead of 64/3/4 at 9 of 10 shapes
            for setting in "(64, 3, 4)" "$candidate" "$candidate" "(64, 3, 4)"; do
                echo "LONG_SETTINGS=$setting"
                PYTHONPATH=$PWD timeout 130 python3 benchmarks/module_ab.py "hf_paged.kernels.decode.LONG_SETTINGS=$setting" \
                    "hf_paged.kernels.decode.LONG_SETTINGS_BY_DEVICE={}" -- --workload sharegpt --model llama-8b \
                    --systems hf_paged --repeats 1 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
            done
            ;;
        prefix-cascade) timeout 240 python3 -m hf_paged.frontends.bench --workload prefix --repeats 3 \
            --systems hf_paged,hf_paged_no_cascade,hf_paged_no_prefix --out "$out/prefix-cascade.md" 2>&1 | grep "^| hf_paged" ;;
        cascade-ab)
            timeout 200 python3 -m hf_paged.frontends.bench --workload nano --systems hf_paged_no_cascade,hf_paged \
                --repeats 3 --out "$out/cascade-ab.md" 2>&1 | grep "^| hf_paged"
            timeout 260 python3 -m hf_paged.frontends.bench --workload sharegpt --model llama-8b \
                --systems hf_paged_no_cascade,hf_paged --repeats 3 --out "$out/cascade-ab.md" 2>&1 | grep "^| hf_paged"
            for flag in on off; do
                timeout 70 python3 benchmarks/engine_trace.py --workload prefix --repeats 1 --cascade-attention $flag 2>&1 | tail -14 \
                    | tee -a "$out/trace.md"
            done
            ;;
        cascade-write-ab) prefix_ab hf_paged.core.attention.CASCADE_FUSED_DECODE_WRITE False True False True ;;
        cascade-bytes-ab)
            prefix_ab hf_paged.engine.model_runner.CASCADE_MIN_SAVED_BYTES 16777216 67108864 67108864 16777216
            for bytes in 16777216 67108864; do
                PYTHONPATH=$PWD timeout 70 python3 benchmarks/module_ab.py \
                    "hf_paged.engine.model_runner.CASCADE_MIN_SAVED_BYTES=$bytes" -- benchmarks/engine_trace.py \
                    --workload prefix --repeats 1 2>&1 | tail -14 | tee -a "$out/trace.md"
            done
            ;;
        cascade-suffix-ab)
            # shellcheck disable=SC2086
            timeout 300 python3 benchmarks/decode_sweep.py --prefix-len 336 --shapes 16x8:224x400 16x8:128x420 \
                16x8:32x440 16x8:224x1360 32x8:128x1360 32x8:256x400 --settings ${CASCADE_SWEEP:-16/2/2 16/2/4/8 \
                16/2/8/8 16/1/4/8 16/3/4/8 8/2/4/8 8/3/4/8 8/2/2/8 16/2/4/4 16/2/2/4 32/2/4/4 16/2/4/2 32/2/4/2} \
                --out "$out/cascade-sweep.md" 2>&1 | tail -20
            # The setting fastest at the prefix workload's big steps (first column), end to end against the default.
            best=$(python3 -c "import re,sys; rows=[r.split('|') for r in open(sys.argv[1]) if re.match(r'\| \d[^|]*\| \d', r)]
print(min(rows, key=lambda r: float(r[2].split()[0]))[1].split('(')[0].strip().replace(' / ', ', '))" \
                "$out/cascade-sweep.md")
            [ -n "$best" ] || continue
            prefix_ab hf_paged.kernels.decode.CASCADE_SUFFIX_SETTINGS "(16, 2, 2)" "($best)" "($best)" "(16, 2, 2)"
            ;;
        one-split-ab)
            # shellcheck disable=SC2086
            timeout 200 python3 benchmarks/decode_sweep.py --shapes 16x8:256x256 16x8:256x512 16x8:256x1024 \
                16x8:256x2048 16x8:128x1024 32x8:256x512 32x8:256x2048 --settings ${ONE_SPLIT_SWEEP:-64/3/4 16/2/4/8 \
                16/3/4/8 32/2/4/4 32/3/4/4 32/2/8/8 64/3/4/2 64/2/8/2 16/2/2/4 32/3/8/4} \
                --out "$out/one-split-sweep.md" 2>&1 | tail -14
            # The packed setting fastest at nano's shape (third column), end to end against none, alternating.
            best=$(python3 -c "import re,sys; rows=[r.split('|') for r in open(sys.argv[1]) if re.match(r'\| \d+ / \d+ / \d+ / \d', r)]
print(min(rows, key=lambda r: float(r[4].split()[0]))[1].split('(')[0].strip().replace(' / ', ', '))" \
                "$out/one-split-sweep.md")
            [ -n "$best" ] || continue
            for value in None "($best)" "($best)" None; do
                echo "ONE_SPLIT_SETTINGS=$value (nano)"
                PYTHONPATH=$PWD timeout 150 python3 benchmarks/module_ab.py "hf_paged.kernels.decode.ONE_SPLIT_SETTINGS=$value" \
                    -- --workload nano --systems hf_paged --repeats 3 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
            done
            ;;
        prefix-split-ab)
            for keys in 256 128 64; do
                echo "MIN_KEYS_PER_PREFIX_SPLIT=$keys"
                PYTHONPATH=$PWD timeout 90 python3 benchmarks/module_ab.py \
                    "hf_paged.kernels.cascade.MIN_KEYS_PER_PREFIX_SPLIT=$keys" -- benchmarks/decode_sweep.py \
                    --prefix-len 336 --shapes 16x8:224x400 16x8:128x420 16x8:64x400 16x8:32x440 --settings 16/2/2 \
                    2>&1 | grep "^| \(16\|SDPA\)" | tee -a "$out/$part-sweep.md"
            done
            # shellcheck disable=SC2086
            prefix_ab hf_paged.kernels.cascade.MIN_KEYS_PER_PREFIX_SPLIT ${PREFIX_SPLIT_AB:-256 64 64 256}
            ;;
        skinny-ab)  # SKINNY_AB: the switch's values, in run order (default 0 64 64 0); nano runs each distinct one
            # shellcheck disable=SC2086
            prefix_ab hf_paged.engine.fuse.SKINNY_MAX_ROWS ${SKINNY_AB:-0 64 64 0}
            # shellcheck disable=SC2086
            for value in $(printf "%s\n" ${SKINNY_AB:-0 64 64 0} | awk '!seen[$0]++'); do
                echo "SKINNY_MAX_ROWS=$value (nano)"
                PYTHONPATH=$PWD timeout 200 python3 benchmarks/module_ab.py "hf_paged.engine.fuse.SKINNY_MAX_ROWS=$value" \
                    -- --workload nano --systems hf_paged --repeats 3 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
            done
            ;;
        l2-prefetch)
            timeout 200 python3 benchmarks/l2_prefetch.py 2>&1 | grep -v -i warn | tee "$out/$part.md"
            ;;
        prefill-map-ab)
            HF_PAGED_CHECK_LAUNCH=1 HF_PAGED_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q tests/test_prefill.py \
                2>&1 | tail -3 | tee -a "$out/$part.md"
            for value in 0 1024; do
                echo "SCAN_MAX_SEQS=$value (8B mixed step)" | tee -a "$out/$part-step.md"
                PYTHONPATH=$PWD timeout 150 python3 benchmarks/module_ab.py "hf_paged.kernels.prefill.SCAN_MAX_SEQS=$value" \
                    -- benchmarks/step_kernels.py --model llama-8b --batch 240 --sizes 224 --chunk 128 --top 8 2>&1 \
                    | grep "^kernel time\|^| \`" | tee -a "$out/$part-step.md"
            done
            prefix_ab hf_paged.kernels.prefill.SCAN_MAX_SEQS 0 1024 1024 0
            ;;
        cascade-merge-ab)
            prefix_ab hf_paged.kernels.decode.CASCADE_MERGE_IN_SPLIT False True True False
            timeout 150 python3 benchmarks/decode_sweep.py --prefix-len 336 --shapes 16x8:224x400 16x8:128x420 \
                16x8:32x440 --settings 16/2/2 --out "$out/cascade-sweep.md" 2>&1 | tail -5
            ;;
        cascade-prefix-ab) prefix_ab hf_paged.kernels.decode.CASCADE_PREFIX_SETTINGS None "(32, 8)" "(32, 8)" None ;;
        pdl-ab | pdl-ab-nano)  # inductor's programmatic dependent launch in the engine's compiled layers, A/B/B/A
            local pdl="{'options': {'triton.enable_pdl': True}}" workload=prefix
            [ "$part" = pdl-ab-nano ] && workload=nano
            python3 -c "import torch._inductor.config as c; print('inductor triton.enable_pdl default:', c.triton.enable_pdl)" \
                | tee -a "$out/$part.md"
            for options in "{}" "$pdl" "$pdl" "{}"; do
                echo "LAYER_COMPILE_OPTIONS=$options" | tee -a "$out/$part.md"
                PYTHONPATH=$PWD timeout 150 python3 benchmarks/module_ab.py \
                    "hf_paged.engine.model_runner.LAYER_COMPILE_OPTIONS=$options" -- --workload $workload \
                    --systems hf_paged --repeats 3 2>&1 | grep "^| hf_paged\|Error" | tee -a "$out/$part.md"
            done
            ;;
        autotune-ab)
            tuned="{'mode': 'max-autotune-no-cudagraphs'}"
            for run in "80 {}" "250 $tuned" "130 $tuned" "80 {}"; do  # seconds, options (autotuning, then cached)
                echo "LAYER_COMPILE_OPTIONS=${run#* }"
                PYTHONPATH=$PWD timeout "${run%% *}" python3 benchmarks/module_ab.py \
                    "hf_paged.engine.model_runner.LAYER_COMPILE_OPTIONS=${run#* }" -- --workload prefix \
                    --systems hf_paged --repeats 3 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
            done
            ;;
        argmax-ab)
            HF_PAGED_CHECK_LAUNCH=1 timeout 200 python3 -m pytest -q tests/test_argmax.py 2>&1 | tail -3 \
                | tee -a "$out/$part.md"
            timeout 150 python3 benchmarks/argmax_bench.py 2>&1 | grep -v -i warn | tee -a "$out/$part.md"
            prefix_ab hf_paged.kernels.TRITON_ARGMAX False True True False
            ;;
        tests-gc)  # the heap-freeze test on CUDA (the image's python starts with 375 objects frozen)
            HF_PAGED_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py \
                -k freezes 2>&1 | tail -3 | tee -a "$out/tests.txt"
            ;;
        gc-ab) PREFIX_AB_REPEATS=7 prefix_ab hf_paged.engine.engine.FREEZE_GC_IN_GENERATE False True True False ;;
        feed-ab)
            HF_PAGED_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py \
                -k fed_prompts 2>&1 | tail -3 | tee -a "$out/$part.md"
            prefix_ab hf_paged.engine.engine.FEED_PROMPTS False True True False
            PYTHONPATH=$PWD timeout 100 python3 benchmarks/module_ab.py hf_paged.engine.engine.FEED_PROMPTS=True -- \
                benchmarks/engine_trace.py --workload prefix 2>&1 | tail -16 | tee -a "$out/$part.md"
            ;;
        compile-ab)
            combo="{'options': {'combo_kernels': True}}"
            for run in layers full combo combo full layers; do
                echo "compile: $run"
                if [ "$run" = combo ]; then
                    PYTHONPATH=$PWD timeout 150 python3 benchmarks/module_ab.py \
                        "hf_paged.engine.model_runner.LAYER_COMPILE_OPTIONS=$combo" -- --workload prefix \
                        --systems hf_paged --repeats 3 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
                else
                    timeout 150 python3 -m hf_paged.frontends.bench --workload prefix --systems hf_paged --repeats 3 \
                        --compile "$run" 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
                fi
            done
            ;;
        pdl-tests)  # the split merge's PDL forms on the card (early and late trigger, no PDL): equal outputs
            HF_PAGED_CHECK_LAUNCH=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py \
                -k "pdl or trigger" 2>&1 | tail -3 | tee -a "$out/tests.txt"
            ;;
        compile-ab-small)  # the compile modes on the table's other Qwen3-0.6B workloads (compile-ab is the prefix one)
            for workload in nano short; do
                for run in layers full full layers; do
                    echo "compile: $run ($workload)"
                    timeout 150 python3 -m hf_paged.frontends.bench --workload $workload --systems hf_paged \
                        --repeats 3 --compile "$run" 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
                done
            done
            ;;
        compile-ab-8b)
            for run in layers full full layers; do
                echo "compile: $run"
                timeout 200 python3 -m hf_paged.frontends.bench --model llama-8b --workload sharegpt \
                    --systems hf_paged --repeats 1 --compile "$run" 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
            done
            ;;
        mixed-ab-8b)
            old="(16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)"
            new=$(python3 -c "from hf_paged.engine.model_runner import MIXED_TOKEN_SIZES as s; print(s)")
            for sizes in "$old" "$new" "$new" "$old"; do
                echo "MIXED_TOKEN_SIZES=$sizes"
                PYTHONPATH=$PWD timeout 160 python3 benchmarks/module_ab.py \
                    "hf_paged.engine.model_runner.MIXED_TOKEN_SIZES=$sizes" -- --workload sharegpt --model llama-8b \
                    --systems hf_paged --repeats 2 2>&1 | grep "^| hf_paged" | tee -a "$out/$part.md"
            done
            ;;
        split-sweep-mid)  # Llama-8B heads at 8-64 rows (the 8B run's small steps): split counts x long-split settings
            timeout 200 python3 benchmarks/decode_sweep.py --shapes 32x8:8x2048 32x8:16x1024 32x8:32x512 32x8:32x1024 \
                32x8:32x2048 32x8:64x1024 --splits 1 2 3 4 6 8 --settings 64/3/4 32/3/4 64/3/8 \
                --out "$out/split-sweep-mid.md" 2>&1 | tail -8
            ;;
        split-sweep-mid-ragged)  # the same shapes with ragged rows (lengths uniform in [context / 8, context])
            timeout 200 python3 benchmarks/decode_sweep.py --ragged --shapes 32x8:8x2048 32x8:16x1024 32x8:32x512 \
                32x8:32x1024 32x8:32x2048 32x8:64x1024 --splits 1 2 3 4 5 6 9 --settings 64/3/4 \
                --out "$out/split-sweep-mid-ragged.md" 2>&1 | tail -4
            ;;
        sweep) timeout 240 python3 benchmarks/decode_sweep.py --out "$out/sweep.md" 2>&1 | tail -21 ;;
        prefill-sweep) timeout 240 python3 benchmarks/prefill_sweep.py --out "$out/prefill-sweep.md" 2>&1 | tail -14 ;;
        table)
            bench=(timeout 150 python3 -m hf_paged.frontends.bench --repeats 3 --out "$out/table.md")
            "${bench[@]}" --workload nano --systems hf_paged 2>&1 | grep "^| hf_paged"
            "${bench[@]}" --workload prefix --systems hf_paged,hf_paged_no_prefix 2>&1 | grep "^| hf_paged"
            timeout 240 python3 -m hf_paged.frontends.bench --repeats 3 --out "$out/table.md" --workload short \
                --systems hf_paged,hf_cb --baseline-repeats 1 2>&1 | grep "^| hf_"
            ;;
        cap-ab-prefix)
            for cap in ${CAP_AB:-256 512 512 256}; do
                timeout 200 python3 -m hf_paged.frontends.bench --workload prefix --num-requests 400 --repeats 3 \
                    --systems hf_paged,hf_paged_no_prefix --max-num-seqs "$cap" --out "$out/cap-ab-prefix.md" 2>&1 \
                    | grep "^| hf_paged" | sed "s/^/cap $cap /"
            done
            ;;
        cap-ab-short)
            for cap in ${CAP_AB:-256 512}; do
                timeout 200 python3 -m hf_paged.frontends.bench --workload short --repeats 3 --systems hf_paged \
                    --max-num-seqs "$cap" --out "$out/cap-ab-short.md" 2>&1 | grep "^| hf_paged" | sed "s/^/cap $cap /"
            done
            ;;
        cap-ab-8b)
            for cap in ${CAP_AB:-256 512}; do
                timeout 270 python3 -m hf_paged.frontends.bench --model llama-8b --workload sharegpt --repeats 2 \
                    --systems hf_paged --max-num-seqs "$cap" --out "$out/cap-ab-8b.md" 2>&1 | grep "^| hf_paged" \
                    | sed "s/^/cap $cap /"
            done
            ;;
        table-8b) timeout 240 python3 -m hf_paged.frontends.bench --repeats 3 --out "$out/table.md" --model llama-8b \
            --workload sharegpt --systems hf_paged 2>&1 | grep "^| hf_paged" ;;
        memory)
            timeout 150 python3 benchmarks/generate_memory.py --shape qwen3-0.6b --point 64x512 2>&1 | grep -v Warn \
                | tee "$out/memory.txt" | tail -40
            timeout 200 python3 benchmarks/generate_memory.py --shape llama-8b --point 32x512 2>&1 | grep -v Warn \
                | tee -a "$out/memory.txt" | tail -40
            ;;
        profile-python) timeout 240 python3 benchmarks/generate_profile.py --python --rounds 3 --rows 30 2>&1 \
            | grep -v Warning | tee "$out/profile-python.txt" | tail -80 ;;
        phases)
            for shape in qwen3-0.6b llama-8b; do
                timeout 200 python3 benchmarks/generate_profile.py --shape "$shape" --phases --syncs --rounds 3 \
                    --new-tokens 32 2>&1 | grep -v Warning | tee -a "$out/phases.txt" | tail -40
            done
            ;;
        layer-host)
            for shape in llama-8b qwen3-0.6b; do
                for batch in 64 1; do
                    timeout 100 python3 benchmarks/layer_host_time.py --shape "$shape" --batch "$batch" 2>&1 \
                        | grep -v Warn | tail -4 | tee -a "$out/layer-host.md"
                done
            done
            ;;
        eager-greedy) timeout 500 python3 benchmarks/generate.py --shapes qwen3-0.6b llama-8b --points 64x512 32x512 \
            --modes greedy --systems dynamic paged --new-tokens 32 --repeats 15 --eager-repeats 15 \
            --out "$out/eager-greedy.md" 2>&1 | grep "^|" | tee "$out/eager-greedy.rows" ;;
        segments)
            for shape in llama-8b qwen3-0.6b; do
                timeout 200 python3 benchmarks/generate_profile.py --shape "$shape" --segments --rounds 6 \
                    --new-tokens 32 2>&1 | grep "^|\|host ms" | tee -a "$out/segments.md"
            done
            ;;
        binding-ab)
            for shape in llama-8b qwen3-0.6b; do
                timeout 200 python3 benchmarks/eager_ab.py --shape "$shape" --batch 64 --rounds 10 \
                    --switch hf_paged.core.attention.DECODE_BINDING --values True False 2>&1 | grep -v Warn | tail -7 \
                    | tee -a "$out/binding-ab.md"
            done
            ;;
        eager-cells)
            local cell shape point mode
            for cell in ${EAGER_CELLS:-qwen3-0.6b:64x512:greedy qwen3-0.6b:32x512:samples4 llama-8b:8x1024:greedy \
                llama-8b:32x512:greedy}; do
                IFS=: read -r shape point mode <<<"$cell"
                timeout 170 python3 benchmarks/generate.py --shapes "$shape" --points "$point" --modes "$mode" \
                    --systems dynamic paged --new-tokens 32 --repeats 15 --eager-repeats 15 \
                    --out "$out/eager-cells.md" 2>&1 | grep "^|" | tee -a "$out/eager-cells.rows"
            done
            ;;
        copy-ab)
            for cell in ${COPY_AB_CELLS:-llama-8b:1 qwen3-0.6b:32}; do
                timeout 150 python3 benchmarks/eager_ab.py --shape "${cell%%:*}" --batch "${cell#*:}" --mode beams4 \
                    --rounds 10 --switch hf_paged.core.kv_pool.ONE_COPY_LAUNCH --values True False 2>&1 | grep -v Warn \
                    | tail -7 | tee -a "$out/copy-ab.md"
            done
            ;;
        profile) timeout 200 python3 benchmarks/generate_profile.py 2>&1 | grep -v Warning | tee "$out/profile.txt" | tail -80 ;;
        all)
            run_tests
            timeout 150 python3 benchmarks/kernels.py --out "$out/kernels.md" 2>&1 | tail -40
            timeout 400 python3 benchmarks/generate.py --quick --out "$out/generate.md" 2>&1 | grep -v Warning | tail -25
            ;;
        *)
            echo "run_gpu.sh: unknown part '$part' (${KNOWN_PARTS[*]})" >&2
            exit 2
            ;;
    esac
}

if [ "${parts[0]}" = "--spread" ]; then
    # --spread QUEUE...: each queue (parts joined by '+') on a GPU of its own, all queues at once, so a multi-GPU kind
    # runs several single-GPU parts in one call. An A/B keeps its alternation on its one GPU; the queues share the
    # host, so compare figures within a queue, never across queues.
    queues=("${parts[@]:1}")
    ngpu=$(nvidia-smi -L | wc -l)
    for ((i = 0; i < ${#queues[@]}; i++)); do
        IFS=+ read -ra queue <<<"${queues[$i]}"
        for part in "${queue[@]}"; do
            [[ $part == grid* || $part == all || $part == tests ]] && {
                echo "run_gpu.sh: part '$part' spreads over every GPU or runs too long for --spread" >&2
                exit 2
            }
        done
    done
    ncpu=$(nproc)
    echo "spread: ${#queues[@]} queues over $ngpu GPUs, $((ncpu / ${#queues[@]})) cores each"
    pids=()
    # Each queue also runs on its own share of the host's cores (as grid_spread does), so one queue's compile
    # workers do not take the cores of another queue's host-bound run.
    per=$((ncpu / ${#queues[@]}))
    for ((i = 0; i < ${#queues[@]}; i++)); do
        (
            IFS=+ read -ra queue <<<"${queues[$i]}"
            export CUDA_VISIBLE_DEVICES=$((i % ngpu))
            ((per > 0)) && command -v taskset >/dev/null \
                && taskset -cp "$((i * per))-$((i * per + per - 1))" $BASHPID >/dev/null
            for part in "${queue[@]}"; do run_part "$part"; done 2>&1 | sed -u "s/^/[gpu$CUDA_VISIBLE_DEVICES] /"
            exit $((PIPESTATUS[0] == 2 ? 2 : 0))  # 2: an unknown part (a grep finding no row is not a failure)
        ) &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    exit $status
else
    for part in "${parts[@]}"; do run_part "$part"; done
fi
