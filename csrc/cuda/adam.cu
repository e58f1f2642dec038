// Adam / AdamW (with amsgrad) on the GPU: the dispatch on the rounding, each compiled in a
// source of its own (adam_roundings.cuh).
#include "adam_roundings.cuh"

namespace fastopt {
namespace cuda {

void adam_step(const Slots& slots, const AdamArgs& a, bool bias_correction, const DeviceScalars& d,
               cudaStream_t stream) {
  switch (a.rounding) {
    case Rounding::kTorchCudaForeach:
      return adam_in_rounding<Rounding::kTorchCudaForeach>(slots, a, bias_correction, d, stream);
    case Rounding::kTorchCudaFused:
      return adam_in_rounding<Rounding::kTorchCudaFused>(slots, a, bias_correction, d, stream);
    case Rounding::kTorchCudaForLoop:
      return adam_in_rounding<Rounding::kTorchCudaForLoop>(slots, a, bias_correction, d, stream);
    case Rounding::kTorchCpu:
    case Rounding::kTorchCpuFused:  // refused by the bindings: torch's CPU kernel, for CPU tensors
      break;
  }
  adam_in_rounding<Rounding::kTorchCpu>(slots, a, bias_correction, d, stream);
}

}  // namespace cuda
}  // namespace fastopt
