// Adam / AdamW (with amsgrad), rounded exactly as torch.optim.Adam/AdamW's default step on
// the CPU rounds (its for-loop implementation: one ATen op after another, each rounding
// once, the vectorized ones with the fused multiply-adds ATen's kernels use), so that the
// results are torch's bits at every ISA we build and every thread count:
//   g  = -g if maximize (after unscaling)
//   L2:    g = fma(p, wd, g)                        grad.add(param, alpha=wd)
//   AdamW: p = p * float(1 - lr * wd)               param.mul_(1 - lr * wd), the factor in double
//   m  = lerp(m, g, float(1 - beta1))               exp_avg.lerp_(grad, 1 - beta1)
//   v  = fma(float(1 - beta2) * g, g, v * beta2)    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
//   vmax = max(vmax, v)                             amsgrad
//   d  = sqrt(v or vmax) / bc2_sqrt + eps           (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   p  = p + (-step_size * m) / d                   param.addcdiv_(exp_avg, denom, value=-step_size)
// The scalars come from Python as doubles (step_size, bias_correction2_sqrt, the decay
// factor, the betas) and are rounded to float once, as ATen rounds a Python scalar.
//
// The square root: the IEEE one (correctly rounded) by default, in one pass.  With
// `torch_sqrt`, torch's (MKL's, torch_sqrt.h): the first pass updates m and v, MKL takes
// the roots of v (or vmax) block by block, the second pass updates the parameters
// (measured: 1.7x the one-pass step, 50M parameters on 2 AVX2 cores).  Without MKL ATen's
// square root is the IEEE one, and so is ours.
// m and v are float32, or bfloat16 stored with stochastic rounding (vec.h; no amsgrad;
// one pass, the IEEE square root: torch has no such algorithm to follow).
#include <algorithm>

#include "torch_sqrt.h"

namespace fastopt {
namespace {

// ATen's vectorized lerp(a, b, w) for a scalar weight (LerpKernel.cpp): one fused
// multiply-add from the nearer end.
struct Lerp {
  VecF coeff;
  bool small;
  explicit Lerp(float weight) : coeff(VecF::set1(weight < 0.5f ? weight : weight - 1.0f)), small(weight < 0.5f) {}
  VecF operator()(VecF a, VecF b) const { return VecF::fmadd(coeff, b - a, small ? a : b); }
};

// The constants of one step, as torch rounds them.
struct AdamConstants {
  VecF gs, wd, decay, b2, w2, bc2s, eps, neg_step;
  Lerp lerp1;
  explicit AdamConstants(const AdamArgs& a)
      : gs(VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale)),
        wd(VecF::set1(a.weight_decay)),
        decay(VecF::set1(a.decay)),
        b2(VecF::set1(a.beta2)),
        w2(VecF::set1(static_cast<float>(1.0 - a.beta2_exact))),
        bc2s(VecF::set1(a.bias_correction2_sqrt)),
        eps(VecF::set1(a.eps)),
        neg_step(VecF::set1(-a.step_size)),
        lerp1(static_cast<float>(1.0 - a.beta1_exact)) {}

  // m, v (and vmax) from the gradient; returns what the square root is taken of.
  template <bool kAmsgrad, bool kL2, int NS>
  FASTOPT_ALWAYS_INLINE VecF moments(const VecF& p, VecF g, std::array<VecF, NS>& st) const {
    g = g * gs;
    if constexpr (kL2) g = VecF::fmadd(p, wd, g);
    st[0] = lerp1(st[0], g);
    st[1] = VecF::fmadd(w2 * g, g, st[1] * b2);
    if constexpr (kAmsgrad) {
      st[2] = VecF::max(st[2], st[1]);
      return st[2];
    }
    return st[1];
  }

  // The parameter from m and the square root.
  template <bool kDecoupled>
  FASTOPT_ALWAYS_INLINE VecF param(VecF p, const VecF& m, const VecF& root) const {
    if constexpr (kDecoupled) p = p * decay;
    return p + (neg_step * m) / (root / bc2s + eps);
  }
};

// One pass, the IEEE square root (bfloat16 state; a torch without MKL).
template <bool kAmsgrad, bool kDecoupled, bool kL2>
void run_one_pass(const Slots& slots, const AdamArgs& a) {
  const AdamConstants c(a);
  constexpr int NS = kAmsgrad ? 3 : 2;
  elementwise_step<NS, !kAmsgrad>(slots, [&](VecF& p, VecF g, std::array<VecF, NS>& st) {
    const VecF v = c.moments<kAmsgrad, kL2, NS>(p, g, st);
    p = c.param<kDecoupled>(p, st[0], VecF::sqrt(v));
  });
}

// Block by block, MKL's square root between the two passes (torch_sqrt.h).
template <bool kAmsgrad, bool kDecoupled, bool kL2>
void run_mkl_roots(const Slots& slots, const AdamArgs& a) {
  const AdamConstants c(a);
  constexpr int NS = kAmsgrad ? 3 : 2;
  two_passes_with_torch_roots<NS, 1, false>(
      slots,
      [&](const VecF& p, const VecF& g, std::array<VecF, NS>& st) { return c.moments<kAmsgrad, kL2, NS>(p, g, st); },
      [&](VecF& p, const VecF&, std::array<VecF, 1>& st, const VecF& root) {
        p = c.param<kDecoupled>(p, st[0], root);
      });
}

template <bool kAmsgrad, bool kDecoupled, bool kL2>
void run(const Slots& slots, const AdamArgs& a) {
  const bool bf16_state = std::any_of(slots.begin(), slots.end(),
                                      [](const TensorSlot& s) { return s.state_dtype == DType::kBFloat16; });
  if (!a.torch_sqrt || !torch_sqrt_is_mkl() || (!kAmsgrad && bf16_state))
    return run_one_pass<kAmsgrad, kDecoupled, kL2>(slots, a);
  run_mkl_roots<kAmsgrad, kDecoupled, kL2>(slots, a);
}

}  // namespace

void adam_step(const Slots& slots, const AdamArgs& a) {
  const bool wd = a.weight_decay != 0.0f;
  const bool dec = a.adamw && wd, l2 = !a.adamw && wd;
  if (a.amsgrad) {
    if (dec) return run<true, true, false>(slots, a);
    if (l2) return run<true, false, true>(slots, a);
    return run<true, false, false>(slots, a);
  }
  if (dec) return run<false, true, false>(slots, a);
  if (l2) return run<false, false, true>(slots, a);
  return run<false, false, false>(slots, a);
}

}  // namespace fastopt
