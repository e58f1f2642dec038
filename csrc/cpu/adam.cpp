// Adam / AdamW (with amsgrad): the dispatch on the rounding, and torch's CPU step
// (kTorchCpu), with the IEEE square root in one pass or MKL's between two.  The arithmetic
// and what each rounding is: adam_math.h.
//
// FASTOPT_ADAM_CUDA_ROUNDINGS=0 builds without adam_cuda_roundings.cpp (torch's CUDA
// roundings, needed only for the offloaded share of a GPU run): about a quarter of the build's
// time.  The bindings then refuse those roundings before touching anything
// (adam_cuda_roundings_built), and Python loads the build that has them
// (lightning_fastopt.ops.with_adam_cuda_roundings).
#include <algorithm>
#include <stdexcept>

#include "adam_math.h"

namespace fastopt {
namespace {

using adam_detail::AdamConstants;

// Block by block, MKL's square root between the two passes (torch_sqrt.h; torch's CPU step).
template <bool kAmsgrad, bool kDecoupled, bool kL2>
void run_mkl_roots(const Slots& slots, const AdamArgs& a) {
  const AdamConstants c(a);
  constexpr int NS = kAmsgrad ? 3 : 2;
  constexpr Rounding R = Rounding::kTorchCpu;
  two_passes_with_torch_roots<NS, 1, false>(
      slots,
      [&](const VecF& p, const VecF& g, std::array<VecF, NS>& st) { return c.moments<R, kAmsgrad, kL2, NS>(p, g, st); },
      [&](VecF& p, const VecF&, std::array<VecF, 1>& st, const VecF& root) {
        p = c.param<R, kDecoupled>(p, st[0], root);
      });
}

// torch's CPU step: MKL's square root between two passes where torch's ops take it, else
// the IEEE one in one pass.
void torch_cpu_step(const Slots& slots, const AdamArgs& a) {
  const bool bf16_state = std::any_of(slots.begin(), slots.end(),
                                      [](const TensorSlot& s) { return s.state_dtype == DType::kBFloat16; });
  adam_detail::with_adam_flags(a, [&](auto ams, auto dec, auto l2) {
    constexpr bool kAmsgrad = decltype(ams)::value;
    if (!a.torch_sqrt || !torch_sqrt_is_mkl() || (!kAmsgrad && bf16_state))
      return adam_detail::run_one_pass<Rounding::kTorchCpu, kAmsgrad, decltype(dec)::value, decltype(l2)::value>(
          slots, a);
    run_mkl_roots<kAmsgrad, decltype(dec)::value, decltype(l2)::value>(slots, a);
  });
}

}  // namespace

#ifndef FASTOPT_ADAM_CUDA_ROUNDINGS
#define FASTOPT_ADAM_CUDA_ROUNDINGS 1
#endif

#ifndef FASTOPT_ADAM_CPU_FUSED
#define FASTOPT_ADAM_CPU_FUSED 1
#endif

bool adam_cuda_roundings_built() { return FASTOPT_ADAM_CUDA_ROUNDINGS != 0; }
bool adam_cpu_fused_built() { return FASTOPT_ADAM_CPU_FUSED != 0; }

void adam_step(const Slots& slots, const AdamArgs& a) {
  switch (a.rounding) {
    case Rounding::kTorchCudaForeach:
    case Rounding::kTorchCudaFused:
    case Rounding::kTorchCudaForLoop:
#if FASTOPT_ADAM_CUDA_ROUNDINGS
      if (a.rounding == Rounding::kTorchCudaForeach)
        return adam_detail::one_pass_step<Rounding::kTorchCudaForeach>(slots, a);
      if (a.rounding == Rounding::kTorchCudaFused)
        return adam_detail::one_pass_step<Rounding::kTorchCudaFused>(slots, a);
      return adam_detail::one_pass_step<Rounding::kTorchCudaForLoop>(slots, a);
#else
      throw std::logic_error("built without Adam's CUDA roundings (the bindings check adam_cuda_roundings_built)");
#endif
    case Rounding::kTorchCpuFused:
#if FASTOPT_ADAM_CPU_FUSED
      return adam_detail::one_pass_step<Rounding::kTorchCpuFused>(slots, a);
#else
      throw std::logic_error("built without Adam in torch's CPU fused rounding (the bindings check adam_cpu_fused_built)");
#endif
    case Rounding::kTorchCpu:
      break;
  }
  torch_cpu_step(slots, a);
}

}  // namespace fastopt
