// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
//   g = -g if maximize;  p *= 1 - lr * wd
//   p -= lr * sign(lerp(m, g, 1 - beta1));  m = lerp(m, g, 1 - beta2)
#include "tensor_walk.h"

namespace fastopt {

void lion_step(const Slots& slots, const LionArgs& a) {
  const VecF gs = VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale);
  const VecF decay = VecF::set1(static_cast<float>(1.0 - static_cast<double>(a.lr) * a.weight_decay));
  const VecF neg_lr = VecF::set1(-a.lr);
  const float w1 = 1.0f - a.beta1, w2 = 1.0f - a.beta2;
  const VecF vw1 = VecF::set1(w1), vw2 = VecF::set1(w2);
  const VecF vw1c = VecF::set1(1.0f - w1), vw2c = VecF::set1(1.0f - w2);
  const bool s1 = w1 < 0.5f, s2 = w2 < 0.5f, use_wd = a.weight_decay != 0.0f;
  elementwise_step<1>(slots, [&](VecF& p, VecF g, std::array<VecF, 1>& st) {
    g = g * gs;
    if (use_wd) p = p * decay;
    const VecF d = g - st[0];
    const VecF c = s1 ? VecF::fmadd(vw1, d, st[0]) : g - d * vw1c;
    p = VecF::fmadd(neg_lr, VecF::sign(c), p);
    st[0] = s2 ? VecF::fmadd(vw2, d, st[0]) : g - d * vw2c;
  });
}

}  // namespace fastopt
