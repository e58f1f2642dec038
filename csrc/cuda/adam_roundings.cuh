// Adam / AdamW (with amsgrad) on the GPU in one rounding: the formula of ../cpu/adam.cpp,
// element by element.  Each rounding is compiled in a source of its own (adam_foreach.cu,
// adam_fused.cu, adam_for_loop.cu, adam_torch_cpu.cu), so that a build compiles them side by
// side: in one source, Adam took 29 of the CUDA build's 46 s on the H200 host (2026-11-28),
// one compiler process while the other cores had finished.  adam.cu dispatches on the rounding.
#pragma once

#include "elementwise.cuh"

namespace fastopt {
namespace cuda {

template <Rounding R>
void adam_in_rounding(const Slots& slots, const AdamArgs& a, bool bias_correction, const DeviceScalars& d,
                      cudaStream_t stream) {
  if (a.amsgrad) return elementwise_step<3>(slots, adam_math<R>(a, bias_correction), d, stream, "adam");
  elementwise_step<2>(slots, adam_math<R>(a, bias_correction), d, stream, "adam");
}

// instantiated in their own sources (above), not in the sources that call them
extern template void adam_in_rounding<Rounding::kTorchCudaForeach>(const Slots&, const AdamArgs&, bool,
                                                                   const DeviceScalars&, cudaStream_t);
extern template void adam_in_rounding<Rounding::kTorchCudaFused>(const Slots&, const AdamArgs&, bool,
                                                                 const DeviceScalars&, cudaStream_t);
extern template void adam_in_rounding<Rounding::kTorchCudaForLoop>(const Slots&, const AdamArgs&, bool,
                                                                   const DeviceScalars&, cudaStream_t);
extern template void adam_in_rounding<Rounding::kTorchCpu>(const Slots&, const AdamArgs&, bool,
                                                           const DeviceScalars&, cudaStream_t);

}  // namespace cuda
}  // namespace fastopt
