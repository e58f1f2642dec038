#!/usr/bin/env bash
# Everything this project checks on a GPU, for a session lent a GPU machine (run from the
# repository root there; torch with CUDA, lightning, pytest, ninja and nvcc installed).
# Each part fits in one 10-minute call on an H100; results land in ${OUT:-gpu_results}/.
#
#   bash benchmarks/gpu_session.sh tests     # build the CUDA kernels, run every cuda-marked test and
#                                            # the Trainer-level comparisons on the GPU
#   bash benchmarks/gpu_session.sh kernels   # benchmarks/cuda_optimizers.py, offload_step.py, weight_watch.py
#   bash benchmarks/gpu_session.sh e2e       # benchmarks/gpt_offload.py (the ~1B GPT), every configuration
#   bash benchmarks/gpu_session.sh e2e CONFIGS NAME   # only CONFIGS (comma-separated, gpt_offload.py's
#                                            # --configs), into gpt_offload_NAME.*: to split the table
#                                            # over several 10-minute calls
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
part="${1:-tests}"
parallel=""
python3 -c "import xdist" 2>/dev/null && parallel="-n 6"  # pytest-xdist, where installed
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -m lightning_fastopt.ops build --cuda && python3 -m lightning_fastopt.ops info
} 2>&1 | tee "$OUT/build_$part.txt"
case "$part" in
    tests)
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
        FASTOPT_TEST_ACCELERATOR=gpu python3 -m pytest -q -p no:cacheprovider -rs $parallel \
            tests/test_lightning_patterns.py tests/test_precision.py tests/test_strategy.py \
            tests/test_streamed_step.py tests/test_speculative_step.py tests/test_half_weights.py \
            tests/test_delayed_update.py \
            tests/test_forward_waits.py 2>&1 \
            | tee "$OUT/lightning_on_gpu.txt"
        ;;
    kernels)
        python3 benchmarks/cuda_optimizers.py --out "$OUT/cuda_optimizers.json" 2>&1 | tee "$OUT/cuda_optimizers.md"
        python3 benchmarks/offload_step.py --out "$OUT/offload_step.json" 2>&1 | tee "$OUT/offload_step.md"
        python3 benchmarks/weight_watch.py 2>&1 | tee "$OUT/weight_watch.md"
        ;;
    e2e)
        # the timeline pictures where matplotlib is installed
        timeline=""
        python3 -c "import matplotlib" 2>/dev/null && timeline="--timeline $OUT"
        configs="${2:-}"
        name="gpt_offload${3:+_$3}"
        python3 benchmarks/gpt_offload.py ${configs:+--configs "$configs"} --out "$OUT/$name.json" $timeline 2>&1 \
            | tee "$OUT/$name.md"
        ;;
    *)
        echo "usage: $0 tests|kernels|e2e [CONFIGS NAME]" >&2
        exit 2
        ;;
esac
