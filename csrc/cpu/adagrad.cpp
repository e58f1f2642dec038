// Adagrad, rounded exactly as torch.optim.Adagrad's default step on the CPU rounds (its
// for-loop implementation: one ATen op after another, each rounding once, the vectorized
// ones with the fused multiply-adds ATen's kernels use), at every ISA and thread count:
//   g = -g if maximize (after unscaling)
//   g = fma(p, wd, g)                 grad.add(param, alpha=weight_decay)
//   s = fma(g, g, s)                  state_sum.addcmul_(grad, grad, value=1)
//   d = sqrt(s) + eps                 state_sum.sqrt().add_(eps)
//   p = p + (-clr * g) / d            param.addcdiv_(grad, std, value=-clr)
// clr = lr / (1 + (step - 1) * lr_decay) comes from Python as a double, rounded to float
// once, as ATen rounds a Python scalar.  The square root: the IEEE one by default, in one
// pass; with `torch_sqrt`, torch's CPU one (MKL's, where torch has MKL), taken block by
// block between two passes (torch_sqrt.h; the second pass forms g again from the
// unchanged gradient and parameter).
// kTorchCudaForLoop: torch's CUDA step with foreach=False (its for-loop implementation), where
// addcdiv is one fused multiply-add of the scalar and the quotient (DeviceAddCmulCdiv.cuh);
// its CUDA foreach step multiplies, divides and adds, each rounded, as the CPU step:
//   p = fma(-clr, g / d, p)
// kTorchCudaFused: torch's fused CUDA kernel, in double (../common/fused_cuda_adagrad.h),
// element by element: the offloaded share of a GPU run with torch.optim.Adagrad(fused=True).
#include "../common/fused_cuda_adagrad.h"
#include "torch_sqrt.h"

namespace fastopt {
namespace {

struct AdagradConstants {
  VecF gs, wd, eps, neg_clr;
  bool use_wd;
  explicit AdagradConstants(const AdagradArgs& a)
      : gs(VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale)),
        wd(VecF::set1(a.weight_decay)),
        eps(VecF::set1(a.eps)),
        neg_clr(VecF::set1(-a.clr)),
        use_wd(a.weight_decay != 0.0f) {}

  // The gradient the step uses.
  FASTOPT_ALWAYS_INLINE VecF grad(const VecF& p, VecF g) const {
    g = g * gs;
    return use_wd ? VecF::fmadd(p, wd, g) : g;
  }

  // The parameter from the gradient and the square root of the new sum.
  template <Rounding R = Rounding::kTorchCpu>
  FASTOPT_ALWAYS_INLINE VecF param(const VecF& p, const VecF& g, const VecF& root) const {
    if constexpr (R == Rounding::kTorchCudaForLoop) return VecF::fmadd(neg_clr, g / (root + eps), p);
    return p + (neg_clr * g) / (root + eps);
  }
};

template <Rounding R>
void run_one_pass(const Slots& slots, const AdagradArgs& a) {
  const AdagradConstants c(a);
  elementwise_step<1>(slots, [&](VecF& p, VecF g, std::array<VecF, 1>& st) {
    g = c.grad(p, g);
    st[0] = VecF::fmadd(g, g, st[0]);
    p = c.param<R>(p, g, VecF::sqrt(st[0]));
  });
}

void run_mkl_roots(const Slots& slots, const AdagradArgs& a) {
  const AdagradConstants c(a);
  two_passes_with_torch_roots<1, 0, true>(
      slots,
      [&](const VecF& p, const VecF& g, std::array<VecF, 1>& st) {
        const VecF used = c.grad(p, g);
        st[0] = VecF::fmadd(used, used, st[0]);
        return st[0];
      },
      [&](VecF& p, const VecF& g, std::array<VecF, 0>&, const VecF& root) { p = c.param(p, c.grad(p, g), root); });
}

void run_fused_cuda(const Slots& slots, const AdagradArgs& a) {
  const float gs = a.maximize ? -a.inv_grad_scale : a.inv_grad_scale;
  elementwise_step<1>(slots, [&](VecF& p, VecF g, std::array<VecF, 1>& st) {
    alignas(64) float pv[VecF::W], gv[VecF::W], sv[VecF::W];
    p.store(pv);
    g.store(gv);
    st[0].store(sv);
    for (int i = 0; i < VecF::W; ++i)
      fused_cuda_adagrad(pv[i], gv[i], sv[i], gs, a.weight_decay_exact, a.eps_exact, a.clr_exact);
    p = VecF::load(pv);
    st[0] = VecF::load(sv);
  });
}

}  // namespace

void adagrad_step(const Slots& slots, const AdagradArgs& a) {
  if (a.rounding == Rounding::kTorchCudaFused) return run_fused_cuda(slots, a);
  if (a.rounding == Rounding::kTorchCudaForLoop) return run_one_pass<Rounding::kTorchCudaForLoop>(slots, a);
  if (!a.torch_sqrt || !torch_sqrt_is_mkl()) return run_one_pass<Rounding::kTorchCpu>(slots, a);
  run_mkl_roots(slots, a);
}

}  // namespace fastopt
