// One element of torch's fused CUDA Adagrad (ATen/native/cuda/fused_adagrad_utils.cuh,
// torch >= 2.11; read from the sm_90 SASS of torch 2.11's libtorch_cuda.so): float loads
// and stores, the arithmetic between them in double where its scalars are doubles.
//   g = g / scale, -g if maximize           float (a power-of-two scale: our multiplication)
//   g = float(fma(double(p), wd, double(g)))  DFMA, then F2F.F32.F64
//   s = fmaf(g, g, s)                         FFMA
//   p = float(double(p) - (clr * double(g)) / (double(sqrtf(s)) + eps))
// with clr = lr / fma(double(float(step) - 1), lr_decay, 1.0) in double, from the caller.
// Shared by the CPU kernels (the offloaded share of a GPU run) and the CUDA kernels.
#pragma once

#include <cmath>

#include "kernel_types.h"

namespace fastopt {

// The float a double rounds to, kept as that float: GCC 12's portable (-O3, no FMA) build of
// the CPU kernels once used the double itself where the update widens g again (seen in two
// of every eight lanes, after an unrelated change to the loop around it).  The empty asm
// makes the rounded value opaque to the optimizer; nvcc needs no such thing.
FASTOPT_HOST_DEVICE inline float rounded_to_float(double x) {
  float f = static_cast<float>(x);
#if !defined(__CUDA_ARCH__) && defined(__GNUC__)
  __asm__ volatile("" : "+m"(f));
#endif
  return f;
}

// gs: the inverse loss scale, negated for maximize.
FASTOPT_HOST_DEVICE inline void fused_cuda_adagrad(float& p, float g, float& s, float gs, double weight_decay,
                                                   double eps, double clr) {
  g = g * gs;
  if (weight_decay != 0.0) g = rounded_to_float(fma(static_cast<double>(p), weight_decay, static_cast<double>(g)));
  s = fmaf(g, g, s);
  const double denom = static_cast<double>(sqrtf(s)) + eps;
  p = static_cast<float>(static_cast<double>(p) - (clr * static_cast<double>(g)) / denom);
}

}  // namespace fastopt
