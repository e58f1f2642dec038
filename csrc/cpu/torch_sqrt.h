// torch's CPU square root for the kernels that must round as torch does: ATen's CPU sqrt
// is MKL's vsSqrt where torch was built with MKL, which is not correctly rounded (about
// one result in six differs from the IEEE root by one ulp).  A step that takes it goes
// block by block: a first pass updates the state and collects what the root is taken of,
// MKL's routine (the one libtorch_cpu exports) takes the roots of the block, and a second
// pass updates the parameters.  The block stays in the first-level cache, so the memory
// traffic is one pass's; MKL's careful root costs about as much as the rest of the step.
#pragma once

#include <algorithm>

#include "tensor_walk.h"

// MKL's single-precision square root (Fortran interface), exported by libtorch_cpu when
// torch was built with MKL; null otherwise (a weak reference).
extern "C" void VSSQRT_(const int* n, const float* a, float* r) __attribute__((weak));

namespace fastopt {

// Whether torch's CPU square root differs from the IEEE one here (torch has MKL).
inline bool torch_sqrt_is_mkl() { return VSSQRT_ != nullptr; }

constexpr int64_t kRootBlock = 2048;  // elements per block: about the first-level cache with p, g and state

// Over every slot, block by block: first(p, g, st) (NS1 states; the parameter is not
// stored) returns what to take the root of; second(p, g, st, root) (the first NS2 states;
// the gradient only with kSecondReadsGrad) updates the parameter, which is stored.
template <int NS1, int NS2, bool kSecondReadsGrad, typename First, typename Second>
void two_passes_with_torch_roots(const Slots& slots, const First& first, const Second& second) {
  constexpr int W = VecF::W;
  parallel_over(slots, [&](int64_t t, int64_t b, int64_t e) {
    const TensorSlot& s = slots[t];
    dispatch_dtypes(s, [&](auto pt, auto gt, auto ct) {
      using P = decltype(pt);
      using G = decltype(gt);
      using C = decltype(ct);
      using G2 = std::conditional_t<kSecondReadsGrad, G, None>;
      alignas(64) float roots[kRootBlock];
      for (int64_t bb = b; bb < e; bb += kRootBlock) {
        const int64_t be = std::min(e, bb + kRootBlock);
        float* out = roots;
        for_each_vec<NS1, false, P, G, C, F32>(s, bb, be, [&](VecF& p, VecF g, std::array<VecF, NS1>& st) {
          first(p, g, st).store(out);
          out += W;
        });
        const int n = static_cast<int>(out - roots);
        VSSQRT_(&n, roots, roots);
        const float* root = roots;
        for_each_vec<NS2, true, P, G2, C, F32>(s, bb, be, [&](VecF& p, VecF g, std::array<VecF, NS2>& st) {
          second(p, g, st, VecF::load(root));
          root += W;
        });
      }
    });
  });
}

}  // namespace fastopt
