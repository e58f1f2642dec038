// LARS (You et al. 2017, "Large Batch Training of Convolutional Networks"):
//   per tensor: local_lr = eeta * ||p|| / (||g|| + wd * ||p|| + epsilon) if both norms > 0, else 1
//   buf = momentum * buf + (g + wd * p);  p -= lr * local_lr * buf
// with g unscaled (and negated if maximize).  The norms come from a first pass, or are
// given (LarsArgs::norms: the tensors are pieces of larger ones).
#include <cmath>

#include "tensor_walk.h"

namespace fastopt {

void lars_step(const Slots& slots, const LarsArgs& a) {
  const int64_t n = static_cast<int64_t>(slots.size());
  std::vector<double> g_sq(n), p_sq(n);
  if (a.norms) {  // over the whole tensors, given (pieces of them here)
    for (int64_t t = 0; t < n; ++t) {
      g_sq[t] = a.norms[2 * t];
      p_sq[t] = a.norms[2 * t + 1];
    }
  } else {
    sum_squares(slots, 0, g_sq.data());
    sum_squares(slots, 1, p_sq.data());
  }
  std::vector<float> neg_step(n);
  for (int64_t t = 0; t < n; ++t) {
    const double pn = std::sqrt(p_sq[t]);
    const double gn = std::sqrt(g_sq[t]) * a.inv_grad_scale;
    const double local = (pn > 0.0 && gn > 0.0)
        ? a.eeta * pn / (gn + static_cast<double>(a.weight_decay) * pn + a.epsilon) : 1.0;
    neg_step[t] = static_cast<float>(-static_cast<double>(a.lr) * local);
  }
  const VecF gs = VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale);
  const VecF wd = VecF::set1(a.weight_decay), mom = VecF::set1(a.momentum);
  update_with_factors<1, true>(slots, neg_step,
      [&](VecF& pv, VecF gv, std::array<VecF, 1>& st, VecF neg) FASTOPT_ALWAYS_INLINE {
        st[0] = VecF::fmadd(st[0], mom, VecF::fmadd(wd, pv, gv * gs));
        pv = VecF::fmadd(neg, st[0], pv);
      });
}

}  // namespace fastopt
