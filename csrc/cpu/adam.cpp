// Adam / AdamW (with amsgrad), torch.optim.Adam's formula in float:
//   g  = -g if maximize (after unscaling);  L2 mode: g += wd * p;  AdamW: p *= 1 - lr * wd
//   m  = lerp(m, g, 1 - beta1);  v = v * beta2 + (1 - beta2) * g * g;  vmax = max(vmax, v)
//   p -= step_size * m / (sqrt(v or vmax) / sqrt(bias_correction2) + eps)
// m and v are float32, or bfloat16 stored with stochastic rounding (vec.h; no amsgrad).
#include "tensor_walk.h"

namespace fastopt {
namespace {

// torch's lerp(a, b, w) for a scalar weight, evaluated the way ATen does.
struct Lerp {
  VecF w, one_minus_w;
  bool small;
  explicit Lerp(float weight)
      : w(VecF::set1(weight)), one_minus_w(VecF::set1(1.0f - weight)), small(weight < 0.5f) {}
  VecF operator()(VecF a, VecF b) const {
    return small ? VecF::fmadd(w, b - a, a) : b - (b - a) * one_minus_w;
  }
};

template <bool kAmsgrad, bool kDecoupled, bool kL2>
void run(const Slots& slots, const AdamArgs& a) {
  const VecF gs = VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale);
  const VecF wd = VecF::set1(a.weight_decay);
  const VecF decay = VecF::set1(static_cast<float>(1.0 - static_cast<double>(a.lr) * a.weight_decay));
  const Lerp lerp1(1.0f - a.beta1);
  const VecF b2 = VecF::set1(a.beta2), w2 = VecF::set1(1.0f - a.beta2);
  const VecF bc2s = VecF::set1(a.bias_correction2_sqrt), eps = VecF::set1(a.eps);
  const VecF neg_step = VecF::set1(-a.step_size);
  constexpr int NS = kAmsgrad ? 3 : 2;
  // bfloat16 state (stochastic rounding) for float32 params without amsgrad
  elementwise_step<NS, !kAmsgrad>(slots, [&](VecF& p, VecF g, std::array<VecF, NS>& st) {
    g = g * gs;
    if constexpr (kL2) g = VecF::fmadd(wd, p, g);
    if constexpr (kDecoupled) p = p * decay;
    st[0] = lerp1(st[0], g);
    st[1] = VecF::fmadd(w2, g * g, st[1] * b2);
    VecF v = st[1];
    if constexpr (kAmsgrad) {
      st[2] = VecF::max(st[2], st[1]);
      v = st[2];
    }
    const VecF denom = VecF::sqrt(v) / bc2s + eps;
    p = VecF::fmadd(neg_step, st[0] / denom, p);
  });
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
