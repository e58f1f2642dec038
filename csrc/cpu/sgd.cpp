// SGD with momentum, dampening and Nesterov, torch.optim.SGD's formula in float
// (apex's wd_after_momentum adds the decay term after the momentum update instead):
//   g = -g if maximize;  g = fma(wd, p, g)
//   buf = g on the first step, else buf = fma(g, 1 - dampening, buf * momentum)
//   g = fma(buf, momentum, g) if nesterov else buf;  p = fma(-lr, g, p)
// rounded as torch's CPU step and its CUDA foreach step round it (kTorchCpu), and as its CPU
// fused=True kernel (kTorchCpuFused, FusedSGDKernel.cpp): the same in its vector loop, and in
// its scalar loop over each tensor's last numel % 8 elements (tensor_walk.h)
//   buf = fma(buf, momentum, g * (1 - dampening))
#include "tensor_walk.h"

namespace fastopt {
namespace {

template <bool kMomentum, bool kWdAfter, bool kTorchTails>
void run(const Slots& slots, const SgdArgs& a) {
  const VecF gs = VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale);
  const VecF wd = VecF::set1(a.weight_decay);
  const VecF mom = VecF::set1(a.momentum), damp = VecF::set1(1.0f - a.dampening);
  const VecF neg_lr = VecF::set1(-a.lr);
  const bool use_wd = a.weight_decay != 0.0f, first = a.first_step, nesterov = a.nesterov;
  constexpr int NS = kMomentum ? 1 : 0;
  auto body = [&](auto scalar_loop) {
    return [&](VecF& p, VecF g, std::array<VecF, NS>& st) {
      g = g * gs;
      if (!kWdAfter && use_wd) g = VecF::fmadd(wd, p, g);
      if constexpr (kMomentum) {
        if (first) st[0] = g;
        else if constexpr (decltype(scalar_loop)::value) st[0] = VecF::fmadd(st[0], mom, g * damp);
        else st[0] = VecF::fmadd(g, damp, st[0] * mom);
        g = nesterov ? VecF::fmadd(st[0], mom, g) : st[0];
      }
      if (kWdAfter && use_wd) g = VecF::fmadd(wd, p, g);
      p = VecF::fmadd(neg_lr, g, p);
    };
  };
  if constexpr (kTorchTails)
    elementwise_step_with_torch_tails<NS>(slots, body(std::false_type{}), body(std::true_type{}));
  else
    elementwise_step<NS>(slots, body(std::false_type{}));
}

template <bool kMomentum, bool kWdAfter>
void run(const Slots& slots, const SgdArgs& a) {
  // the tails differ only in the momentum update
  if constexpr (kMomentum)
    if (a.rounding == Rounding::kTorchCpuFused) return run<kMomentum, kWdAfter, true>(slots, a);
  run<kMomentum, kWdAfter, false>(slots, a);
}

}  // namespace

void sgd_step(const Slots& slots, const SgdArgs& a) {
  const bool mom = a.momentum != 0.0f;
  if (mom) return a.wd_after_momentum ? run<true, true>(slots, a) : run<true, false>(slots, a);
  return a.wd_after_momentum ? run<false, true>(slots, a) : run<false, false>(slots, a);
}

}  // namespace fastopt
