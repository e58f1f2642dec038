#!/usr/bin/env bash
# Everything this project checks on a GPU, for a session lent a GPU machine (run from the
# repository root there; torch with CUDA, lightning, pytest, ninja and nvcc installed).
# Each part fits in one 10-minute call on an H100; results land in ${OUT:-gpu_results}/.
#
#   bash benchmarks/gpu_session.sh tests     # build the CUDA kernels, run every cuda-marked test
#   bash benchmarks/gpu_session.sh kernels   # benchmarks/cuda_optimizers.py and offload_step.py
#   bash benchmarks/gpu_session.sh e2e       # benchmarks/gpt_offload.py (the ~1B GPT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
part="${1:-tests}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -m lightning_fastopt.ops build --cuda && python3 -m lightning_fastopt.ops info
} 2>&1 | tee "$OUT/build_$part.txt"
case "$part" in
    tests)
        # the GPU tests, and the CUDA checks that also run without a GPU (bindings, host math)
        python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_kernels.py tests/test_offload_cuda.py \
            tests/test_cuda_build.py tests/test_cuda_math.py tests/test_torch_fused.py \
            "tests/test_resume.py::test_sigkill_and_resume_on_gpu_is_bit_exact" 2>&1 | tee "$OUT/tests.txt"
        ;;
    kernels)
        python3 benchmarks/cuda_optimizers.py --out "$OUT/cuda_optimizers.json" 2>&1 | tee "$OUT/cuda_optimizers.md"
        python3 benchmarks/offload_step.py --out "$OUT/offload_step.json" 2>&1 | tee "$OUT/offload_step.md"
        ;;
    e2e)
        python3 benchmarks/gpt_offload.py --out "$OUT/gpt_offload.json" 2>&1 | tee "$OUT/gpt_offload.md"
        ;;
    *)
        echo "usage: $0 tests|kernels|e2e" >&2
        exit 2
        ;;
esac
