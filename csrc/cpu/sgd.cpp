// SGD with momentum, dampening and Nesterov, torch.optim.SGD's formula in float
// (apex's wd_after_momentum adds the decay term after the momentum update instead):
//   g = -g if maximize;  g += wd * p
//   buf = g on the first step, else buf = momentum * buf + (1 - dampening) * g
//   g = g + momentum * buf if nesterov else buf;  p -= lr * g
#include "tensor_walk.h"

namespace fastopt {
namespace {

template <bool kMomentum, bool kWdAfter>
void run(const Slots& slots, const SgdArgs& a) {
  const VecF gs = VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale);
  const VecF wd = VecF::set1(a.weight_decay);
  const VecF mom = VecF::set1(a.momentum), damp = VecF::set1(1.0f - a.dampening);
  const VecF neg_lr = VecF::set1(-a.lr);
  const bool use_wd = a.weight_decay != 0.0f, first = a.first_step, nesterov = a.nesterov;
  constexpr int NS = kMomentum ? 1 : 0;
  elementwise_step<NS>(slots, [&](VecF& p, VecF g, std::array<VecF, NS>& st) {
    g = g * gs;
    if (!kWdAfter && use_wd) g = VecF::fmadd(wd, p, g);
    if constexpr (kMomentum) {
      st[0] = first ? g : VecF::fmadd(g, damp, st[0] * mom);
      g = nesterov ? VecF::fmadd(st[0], mom, g) : st[0];
    }
    if (kWdAfter && use_wd) g = VecF::fmadd(wd, p, g);
    p = VecF::fmadd(neg_lr, g, p);
  });
}

}  // namespace

void sgd_step(const Slots& slots, const SgdArgs& a) {
  const bool mom = a.momentum != 0.0f;
  if (mom) return a.wd_after_momentum ? run<true, true>(slots, a) : run<true, false>(slots, a);
  return a.wd_after_momentum ? run<false, true>(slots, a) : run<false, false>(slots, a);
}

}  // namespace fastopt
