// Adagrad, torch.optim.Adagrad's formula in float:
//   g = -g if maximize;  g += wd * p;  sum += g * g;  p -= clr * g / (sqrt(sum) + eps)
#include "tensor_walk.h"

namespace fastopt {

void adagrad_step(const Slots& slots, const AdagradArgs& a) {
  const VecF gs = VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale);
  const VecF wd = VecF::set1(a.weight_decay), eps = VecF::set1(a.eps);
  const VecF neg_clr = VecF::set1(-a.clr);
  const bool use_wd = a.weight_decay != 0.0f;
  elementwise_step<1>(slots, [&](VecF& p, VecF g, std::array<VecF, 1>& st) {
    g = g * gs;
    if (use_wd) g = VecF::fmadd(wd, p, g);
    st[0] = VecF::fmadd(g, g, st[0]);
    p = VecF::fmadd(neg_clr, g / (VecF::sqrt(st[0]) + eps), p);
  });
}

}  // namespace fastopt
