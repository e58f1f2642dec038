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

// The instantiation of one rounding, with its one signature: `template FASTOPT_ADAM_IN_ROUNDING(R);`
// in that rounding's source, declared instantiated there (`extern`) for the sources that call it.
#define FASTOPT_ADAM_IN_ROUNDING(R) \
  void adam_in_rounding<R>(const Slots&, const AdamArgs&, bool, const DeviceScalars&, cudaStream_t)

extern template FASTOPT_ADAM_IN_ROUNDING(Rounding::kTorchCudaForeach);
extern template FASTOPT_ADAM_IN_ROUNDING(Rounding::kTorchCudaFused);
extern template FASTOPT_ADAM_IN_ROUNDING(Rounding::kTorchCudaForLoop);
extern template FASTOPT_ADAM_IN_ROUNDING(Rounding::kTorchCpu);

}  // namespace cuda
}  // namespace fastopt
