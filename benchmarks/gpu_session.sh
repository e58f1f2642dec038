#!/usr/bin/env bash
# Everything this project checks on a GPU, for a session lent a GPU machine (run from the
# repository root there; torch with CUDA, lightning, pytest, ninja and nvcc installed).
# Results land in ${OUT:-gpu_results}/ as two files a part, refreshed as it goes so that a
# run cut off still returns what it did (the device tool returns at most 8 files): PART.log,
# everything printed, and PART.tar.gz, each step's files (tables, JSON, pictures, test logs).
#
#   bash benchmarks/gpu_session.sh first     # FIRST, whenever a GPU is lent: at most 8 minutes on an
#                                            # H100 (FIRST_S=470 s of budget): the build (timed), issue
#                                            # 66's targets 1 and 2 (the ~1B GPT's exact full offload
#                                            # beside plain, clipped, at 8K to 64K tokens a step) and 4
#                                            # (the largest GPT at 24 GiB, float32 moments, one try),
#                                            # then the CUDA bit-exactness tests in the time left
#   bash benchmarks/gpu_session.sh rest [S]  # what did not fit in `first`, most telling first, within S
#                                            # seconds (default 540: one 10-minute call)
#   bash benchmarks/gpu_session.sh first --tiny   # the same plan on any machine: a tiny GPT, the tests
#                                            # collected, not run (CI checks the plan; times each part)
#
# The older parts, each one 10-minute call:
#   bash benchmarks/gpu_session.sh tests     # every cuda-marked test and the Trainer-level comparisons
#   bash benchmarks/gpu_session.sh kernels   # benchmarks/cuda_optimizers.py, offload_step.py, weight_watch.py
#   bash benchmarks/gpu_session.sh e2e [CONFIGS NAME]   # benchmarks/gpt_offload.py, every (or CONFIGS) configuration
#   bash benchmarks/gpu_session.sh largest   # the largest GPT that trains with the GPU capped at 24 GiB, its
#                                            # weights in host memory (issue 52): float32, then bfloat16 moments,
#                                            # then on the whole GPU with the state on disk (issue 66's >= 12B)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
part="${1:-tests}"
WORK="$(mktemp -d)"  # each step's files, packed into $OUT/$part.tar.gz after each step
tiny=""
[ "${2:-}" = "--tiny" ] && tiny=1
parallel=""
python3 -c "import xdist" 2>/dev/null && parallel="-n 6"  # pytest-xdist, where installed
gpu=""
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && gpu=1

# The headline rows of the ~1B GPT table (issue 37), in the order of what they decide. The second
# lease of 2026-11-28 (benchmarks/results/2026-11-28-h200-2) measured the streamed step on 14 of
# the 16 cores (372 ms, against 465 on all 16 in the first lease) and ending before its updates
# (347 ms, 1.70x its bound), and weights in host memory under FSDP (430 ms against 543 for
# CPUOffloadPolicy with torch's AdamW: FSDP copies each unit's float32 shards in series with its
# compute on one GPU). So now: the streamed step, the same clipped (540 ms then: clipping's
# multiply is now read in the update's pass, 8 of 36 bytes a parameter fewer), against the step
# at the step on the new default thread count (whether stream_cpu_step may default on), half
# shards under FSDP (half the copies)
# against the same reference, the new default against all 16 cores in the same run, FSDP's rows
# with FSDP's explicit prefetch (whether FSDP then overlaps its copies with compute at one
# rank) and updated at the step (no gradient hooks: torch versions that block the gradient's
# copy to the host where a post-accumulate-grad hook is registered, as the streamed step's
# are, then copy it beside compute), then the targets not measured since the early end: 0.5,
# auto, the bf16-true peak (<= 12 GiB), and the rest. gpt_offload.py measures the bound's terms
# first (the CPU update's rate, the pinned copies), about 20 s. A row took 38-51 s (start and
# imports 16-22 s of it, Lightning's teardown up to 13 s), before rows were forked from one
# process that imported them and ended at their last timed step: GPT_S=300 reached five rows.
# Issue 66's targets 1 and 2, first: the exact full offload streamed beside plain, unclipped and clipped,
# then clipped at 16K, 32K and 64K tokens a step (":aN": N micro-batches of 8 x 1024 tokens accumulated;
# each row against plain at the same N), and "auto" at the two ends; gpt_offload.py prints the sweep's
# table and draws tokens/s against tokens a step (tokens_per_step.png)
FIRST_ROWS="plain,fastopt:1:stream:module,plain:clip,fastopt:1:stream:module:clip,plain:clip:a8,fastopt:1:stream:module:clip:a8,plain:clip:a2,fastopt:1:stream:module:clip:a2,plain:clip:a4,fastopt:1:stream:module:clip:a4,fastopt:auto:stream:clip,fastopt:auto:stream:clip:a8"
FIRST_STEPS="--warmup 6 --steps 5"
# then, in rest: the CPU step's threads bound apart from the launching thread (issue 66's target 6: on the
# H200, 2026-11-28, the GPU's own work stretched from 110 to ~300 ms while the update ran beside it), each
# beside the same row unbound in `first`, and the headline rows first left out
HEADLINE="plain,fastopt:1:stream:module:bind,fastopt:1:stream:module:clip:bind,fastopt:1,fastopt_fsdp:1:params:stream:module:bf16-true,fsdp:cpu_offload:bf16-true,fastopt:1:stream:module:t16,fastopt_fsdp:1:params:stream:module:bf16-true:prefetch,fastopt_fsdp:1:params:bf16-true,fastopt:0.5:stream:module,fastopt:auto:stream,fastopt:1:stream:module:bf16-true,fastopt:1:stream:module:t12,fastopt:1:delayed,fastopt:1:stream:clip,fastopt:1:stream"
# then (plain again: each row's bound needs the GPU's own step of the same machine, and `rest` may
# run on another) ZeRO-3 on one rank (issue 41): ModelParallelStrategy with fused AdamW, the host
# shards updated at the step and streamed into backward, and fastopt_fsdp at fraction 1 (exact,
# streamed), before the rest
OTHERS="plain,fsdp,fastopt_fsdp:1:params,fastopt_fsdp:1:params:stream,fastopt_fsdp:1,fastopt_fsdp:1:stream,fastopt:1:stream:t8,fastopt:1:delayed:t8,plain:clip,fastopt:0,fastopt:0.5,fastopt:1:clip,fastopt:1:module,fastopt:auto:delayed,fastopt:1:delayed:bf16-true,fastopt:0.5:module,fastopt:1:delayed:bf16-true:module,fastopt:0.25:stream,fastopt:0.5:stream,fastopt_fsdp:1:params:stream:module,fsdp:cpu_offload,fastopt:1:stream:bf16-true"
HEADLINE_STEPS="--warmup 7 --steps 8"

# The CUDA bit-exactness tests against torch: Adam, AdamW, SGD and Adagrad in torch's foreach,
# for-loop and fused steps, the kernels alone and under the offload optimizer at fractions 0
# and 1; then the Trainer-level comparisons with Trainer() on the GPU.
FIRST_TESTS=(  # one pytest process each (a start cost ~15 s on the H200, 2026-11-28: six took 120 s)
    # not reached on 2026-11-28 (the FSDP ones on one GPU), the fallback's foreach Adam fixed after
    # it, and clipping's factors on CUDA tensors (multiplied copies) added after it
    "tests/test_rounding.py tests/test_fsdp_strategy.py tests/test_fsdp_host_parameters.py tests/test_grad_factors.py -m cuda -k 'pytorch_fallback or test_fsdp or test_grad_factors'"
    "tests/test_grad_norms.py tests/test_rounding.py tests/test_offload_cuda.py -m cuda -k 'test_grad_norms or kernels- or offload1- or offload0- or test_trainer_on_gpu or test_offloaded_training_matches_the_reference'"
)
# what `first` leaves to `rest`, most telling first
REST_TESTS=(
    "tests/test_rounding.py -m cuda -k offload0.5-"
    "tests/test_offload_cuda.py -m cuda -k 'not (test_trainer_on_gpu_matches_plain_lightning or test_offloaded_training_matches_the_reference)'"
    "tests/test_torch_fused.py tests/test_bf16_state.py tests/test_half_weights.py tests/test_weight_watch.py tests/test_forward_waits.py -m cuda"
    "tests/test_cuda_kernels.py tests/test_cuda_math.py tests/test_cuda_build.py"
    "tests/test_resume.py::test_sigkill_and_resume_on_gpu_is_bit_exact tests/test_fabric.py::test_on_gpu_equals_fabric_with_torch_adamw tests/test_fabric.py::test_bf16_mixed_equals_fabrics_own tests/test_fabric.py::test_on_gpu_fp16_overflow_skips_the_step_and_save_load_continues_exactly"
)
TRAINER_ON_GPU="tests/test_lightning_patterns.py tests/test_precision.py tests/test_strategy.py tests/test_streamed_step.py tests/test_speculative_step.py tests/test_half_weights.py tests/test_delayed_update.py tests/test_forward_waits.py"

say() { echo "[gpu_session $part, ${SECONDS} s] $*" | tee -a "$WORK/${part}_times.txt"; }

pack() {  # $OUT/$part.tar.gz: every file of $WORK so far, replaced whole
    tar -czf "$OUT/.$part.tar.gz" -C "$WORK" . && mv "$OUT/.$part.tar.gz" "$OUT/$part.tar.gz"
}

# The commit measured (a copy of the tree may come without .git: then the caller records it).
record_commit() {
    { git rev-parse HEAD 2>/dev/null || echo "no .git here: the commit is the caller's"; \
      git status --short 2>/dev/null | head -20; } > "$WORK/${part}_commit.txt"
}

build() {  # the CPU kernels (with Adam's CUDA roundings where a GPU is visible) and the CUDA ones
    # side by side: on the H200 host (2026-11-28) one after the other took 47 + 21 s, the CUDA
    # build's last 29 s a single compile while the other cores had finished
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
      python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
      local start=$SECONDS cuda_log
      cuda_log="$(mktemp)"
      [ -n "$gpu" ] && { timeout 240 python3 -m lightning_fastopt.ops build --cuda-only > "$cuda_log" 2>&1 & }
      timeout 240 python3 -m lightning_fastopt.ops build
      wait
      cat "$cuda_log"
      echo "build: $((SECONDS - start)) s wall"
      python3 -m lightning_fastopt.ops info; } 2>&1 | tee "$WORK/$1"
    pack
}

# pytest over the given selections (each a string of pytest arguments, quoted as in a shell),
# within $1 seconds in all (SIGINT at the end: pytest then prints what it has), each
# selection's output appended to $WORK/$2 (and $OUT/$part.log) as it runs.
run_tests() {
    local budget="$1" file="$2"
    shift 2
    local until=$((SECONDS + budget)) selection left
    if [ -n "$tiny" ]; then  # the plan only: each selection must name tests that exist (one process collects all)
        say "tests collected: $#"
        python3 benchmarks/collect_selections.py "$@" 2>&1 | tee -a "$WORK/$file"
        pack
        return
    fi
    for selection in "$@"; do
        left=$((until - SECONDS))
        if [ "$left" -le 10 ]; then
            say "tests left out (no time): $selection"
            echo "LEFT OUT (no time): $selection" >> "$WORK/$file"
            continue
        fi
        say "tests ($left s left): $selection"
        echo "=== $selection" >> "$WORK/$file"
        eval "timeout -s INT $left python3 -m pytest -q -p no:cacheprovider -rfEs $selection" 2>&1 \
            | tee -a "$WORK/$file" | grep -E "passed|failed|error|FAILED|ERROR|Interrupt"
        pack
    done
}

gpt() {  # gpt() CONFIGS NAME BUDGET_S EXTRA...
    local configs="$1" name="$2" budget="$3"
    shift 3
    local timeline="" size=""
    python3 -c "import matplotlib" 2>/dev/null && timeline="--timeline $WORK"
    [ -n "$tiny" ] && size="--tiny"
    # shellcheck disable=SC2086  # the budget bounds what starts; the timeout, a configuration that hangs
    timeout -s INT $((budget + 90)) python3 benchmarks/gpt_offload.py $size --configs "$configs" --budget-s "$budget" "$@" \
        --out "$WORK/$name.json" $timeline 2>&1 | tee "$WORK/$name.md"
    pack
}

largest_try() {  # largest_try STATE LAYERS SECONDS [NAME EXTRA...]: the deepest of LAYERS estimated to fit, one try
    local state="$1" layers="$2" seconds="$3" name="${4:-largest_$1}"
    shift 3
    [ $# -gt 0 ] && shift
    # shellcheck disable=SC2086
    timeout $((seconds + 60)) python3 benchmarks/largest_model.py ${tiny:+--tiny} --gpu-gib 24 --state "$state" \
        --layers "$layers" --tries 1 --timeout-s "$seconds" --out "$WORK/$name.json" "$@" 2>&1 | tee "$WORK/$name.md"
    pack
}

main() {  # everything printed goes to $OUT/$part.log too (the pipeline at the end waits for it)
case "$part" in
    first)
        # 8 minutes on an H100 at most: the build (86 s on the H200 host, 2026-11-28, before Adam's
        # CUDA source was split and the two builds ran side by side), the GPT rows (GPT_S, 200 s
        # by default: 38-51 s a configuration before rows were forked, 16-22 s less since), the
        # largest GPT at 24 GiB with float32 moments (LARGEST_S, 120 s: one try, the deepest
        # estimated to fit), the tests in what is left of FIRST_S
        FIRST_S="${FIRST_S:-470}"
        record_commit
        say "build"
        build first_build.txt
        say "the rounding of each ATen operation of torch's CUDA Adam steps (a few seconds)"
        timeout 60 python3 benchmarks/rounding_probe.py 2>&1 | tee "$WORK/rounding_probe.md"
        pack
        say "GPT rows: the exact full offload beside plain, clipped, at 8K to 64K tokens a step"
        gpt "$FIRST_ROWS" gpt_first "${GPT_S:-200}" $FIRST_STEPS
        say "the largest GPT at 24 GiB of GPU, AdamW moments float32 (one try)"
        largest_try float32 32 "${LARGEST_S:-120}"
        say "bit-exactness tests and Trainer-level comparisons"
        run_tests $((FIRST_S - SECONDS)) first_tests.txt "${FIRST_TESTS[@]}"
        say "done"
        pack
        ;;
    rest)
        REST_S="${2:-540}"
        [ -n "$tiny" ] && REST_S=540
        record_commit
        until=$((SECONDS + REST_S))
        say "build (cached after first on the same machine)"
        build rest_build.txt
        say "tests first left out"
        run_tests $(((until - SECONDS) / 2)) rest_tests.txt "${REST_TESTS[@]}"
        say "the headline rows first left out"
        gpt "$HEADLINE" gpt_headline $(((until - SECONDS) / 3)) $HEADLINE_STEPS
        say "the other GPT rows"
        gpt "$OTHERS" gpt_others $(((until - SECONDS) * 2 / 3)) $HEADLINE_STEPS
        say "the CPU step with the state on this machine's disk, beside it in host memory (issue 53)"
        disk_size="--params 2e8"  # 2.4 GB of masters and moments
        [ -n "$tiny" ] && disk_size="--quick --params 4e5"
        mkdir -p "$WORK/nvme"
        # shellcheck disable=SC2086
        timeout 150 python3 benchmarks/disk_tier.py --dir "$WORK/nvme" $disk_size 2>&1 | tee "$WORK/disk_tier.md"
        pack
        say "the Trainer-level comparisons on the GPU"
        FASTOPT_TEST_ACCELERATOR=gpu run_tests $((until - SECONDS)) rest_trainer_on_gpu.txt "$TRAINER_ON_GPU $parallel"
        say "done"
        pack
        ;;
    tests)
        build "build_$part.txt"
        # the GPU tests, and the CUDA checks that also run without a GPU (bindings, host math)
        # (one process: on an H100, 8 xdist workers took 6 minutes where one takes 4)
        python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_kernels.py tests/test_offload_cuda.py \
            tests/test_cuda_build.py tests/test_cuda_math.py tests/test_torch_fused.py tests/test_weight_watch.py \
            "tests/test_resume.py::test_sigkill_and_resume_on_gpu_is_bit_exact" \
            tests/test_fabric.py::test_on_gpu_equals_fabric_with_torch_adamw \
            tests/test_fabric.py::test_bf16_mixed_equals_fabrics_own \
            tests/test_fabric.py::test_on_gpu_fp16_overflow_skips_the_step_and_save_load_continues_exactly \
            tests/test_rounding.py tests/test_bf16_state.py 2>&1 | tee "$OUT/tests.txt"  # the last on this host's best ISA (AVX-512?)
        # the Trainer-level comparisons with Trainer() (everyday patterns, precision, strategy) on the GPU
        # shellcheck disable=SC2086
        FASTOPT_TEST_ACCELERATOR=gpu python3 -m pytest -q -p no:cacheprovider -rs $parallel $TRAINER_ON_GPU 2>&1 \
            | tee "$OUT/lightning_on_gpu.txt"
        ;;
    kernels)
        build "build_$part.txt"
        python3 benchmarks/cuda_optimizers.py --out "$OUT/cuda_optimizers.json" 2>&1 | tee "$OUT/cuda_optimizers.md"
        python3 benchmarks/offload_step.py --out "$OUT/offload_step.json" 2>&1 | tee "$OUT/offload_step.md"
        python3 benchmarks/weight_watch.py 2>&1 | tee "$OUT/weight_watch.md"
        ;;
    largest)
        # the issue's targets first (2026-11-28: the deepest estimated to fit, 7.25B, had not trained a
        # step when the call's time ran out): 32 layers of width 4096 (6.45B) with float32 moments,
        # 40 (8.06B) with bfloat16 ones; each try stopped by largest_model.py itself, which then says
        # how far it got
        record_commit
        build largest_build.txt
        for state in ${LARGEST_STATES:-float32 bfloat16}; do
            say "the largest GPT at 24 GiB of GPU, AdamW moments $state"
            layers=32
            [ "$state" = bfloat16 ] && layers=40
            largest_try "$state" "$layers" "${LARGEST_S:-280}"
        done
        # then the whole GPU with the state on this machine's disk and what host memory has free of it
        # (issues 66 and 72: the goal is 12B or more; width 4096: 60 layers are 12.1B parameters)
        say "the largest GPT on the whole GPU, AdamW moments bfloat16 on disk and in host memory"
        mkdir -p "$WORK/nvme"
        largest_try bfloat16 "${LARGEST_DISK_LAYERS:-48,52,56,60,64,68,72}" "${LARGEST_S:-280}" largest_disk \
            --gpu-gib 0 --nvme-path "$WORK/nvme"
        rm -rf "$WORK/nvme"
        say "done"
        ;;
    e2e)
        build "build_$part.txt"
        # the timeline pictures where matplotlib is installed
        timeline=""
        python3 -c "import matplotlib" 2>/dev/null && timeline="--timeline $OUT"
        configs="${2:-}"
        name="gpt_offload${3:+_$3}"
        # shellcheck disable=SC2086
        python3 benchmarks/gpt_offload.py ${configs:+--configs "$configs"} --out "$OUT/$name.json" $timeline 2>&1 \
            | tee "$OUT/$name.md"
        ;;
    *)
        echo "usage: $0 first [--tiny] | rest [SECONDS|--tiny] | largest [--tiny] | tests | kernels | e2e [CONFIGS NAME]" >&2
        return 2
        ;;
esac
}

main "$@" 2>&1 | tee -a "$OUT/$part.log"
