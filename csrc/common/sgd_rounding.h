// Where torch's implementations of SGD round differently (torch 2.11 to 2.14; the CUDA fused
// kernel read from the sm_90 SASS of libtorch_cuda.so, FusedSgdKernel.cu, the same in both):
//
// - The factor 1 - dampening.  torch's CPU and foreach steps (alpha=1 - dampening) and its
//   CPU fused kernel compute it in double from the Python float and round it to float once;
//   its CUDA fused kernel converts dampening to float and subtracts in float (F2F.F32.F64,
//   then FADD).  The two differ for dampening 0.6, 0.8, 0.9, 0.99 among others.
// - The momentum update buf = momentum * buf + (1 - dampening) * g.  Everywhere
//   fma(g, 1 - dampening, buf * momentum), except where the compiler contracted the other
//   product, fma(buf, momentum, g * (1 - dampening)): the scalar loop of torch's CPU fused
//   kernel (each tensor's last numel % 8 elements, ../cpu/tensor_walk.h), and the vectorised
//   path of its CUDA fused kernel (a tensor of numel % 4 == 0 in 16-byte-aligned storage,
//   as the caching allocator hands out) with maximize and no weight decay.
//
// Shared by the CPU kernels (the offloaded share of a GPU run) and the CUDA kernels.
#pragma once

#include <cstdint>

#include "kernel_args.h"
#include "kernel_types.h"

namespace fastopt {

inline float sgd_one_minus_dampening(double dampening, Rounding r) {
  if (r == Rounding::kTorchCudaFused) return 1.0f - static_cast<float>(dampening);
  return static_cast<float>(1.0 - dampening);
}

// Whether torch's CUDA fused kernel computes this tensor's momentum update as
// fma(buf, momentum, g * (1 - dampening)).
FASTOPT_HOST_DEVICE inline bool sgd_cuda_fused_rounds_damped_grad_first(const SgdArgs& a, int64_t numel) {
  return a.rounding == Rounding::kTorchCudaFused && a.maximize && a.weight_decay == 0.0f && numel % 4 == 0;
}

}  // namespace fastopt
