// Adam / AdamW (with amsgrad) on the GPU: the formula of ../cpu/adam.cpp in each of its roundings,
// element by element.
#include <cmath>

#include "elementwise.cuh"

namespace fastopt {
namespace cuda {

namespace {

template <Rounding R>
void run(const Slots& slots, const AdamArgs& a, bool bias_correction, const DeviceScalars& d, cudaStream_t stream) {
  if (a.amsgrad) return elementwise_step<3>(slots, adam_math<R>(a, bias_correction), d, stream, "adam");
  elementwise_step<2>(slots, adam_math<R>(a, bias_correction), d, stream, "adam");
}

}  // namespace

void adam_step(const Slots& slots, const AdamArgs& a, bool bias_correction, const DeviceScalars& d,
               cudaStream_t stream) {
  switch (a.rounding) {
    case Rounding::kTorchCudaForeach:
      return run<Rounding::kTorchCudaForeach>(slots, a, bias_correction, d, stream);
    case Rounding::kTorchCudaFused:
      return run<Rounding::kTorchCudaFused>(slots, a, bias_correction, d, stream);
    case Rounding::kTorchCudaForLoop:
      return run<Rounding::kTorchCudaForLoop>(slots, a, bias_correction, d, stream);
    case Rounding::kTorchCpu:
    case Rounding::kTorchCpuFused:  // refused by the bindings: torch's CPU kernel, for CPU tensors
      break;
  }
  run<Rounding::kTorchCpu>(slots, a, bias_correction, d, stream);
}

}  // namespace cuda
}  // namespace fastopt
