// LAMB (You et al. 2019) with apex FusedLAMB's semantics.  The caller folds loss-scale
// unscaling and global-norm clipping into `grad_factor`.  Per element, in float:
//   g *= grad_factor (negated if maximize);  L2 mode: g += wd * p
//   m = beta1 * m + beta3 * g;  v = beta2 * v + (1 - beta2) * g * g
//   u = (m / bc1) / (sqrt(v / bc2) + eps);  AdamW mode: u += wd * p
// and per tensor: ratio = ||p|| / ||u|| when use_trust_ratio and both norms are non-zero,
// else 1;  p -= lr * ratio * u.
// Pass 1 updates the moments and accumulates ||p||^2 and ||u||^2; pass 2 recomputes u
// from the stored moments (cheaper than writing and re-reading a temporary).  Where the
// tensors are pieces of larger ones (FSDP's rows), lamb_norms gives pass 1's sums without
// advancing the moments, and the caller hands lamb_step the sums over the whole tensors
// (`norms`): the ratios are then known before the moments move, and one pass advances
// them and applies the update (the same arithmetic as the two passes).
#include <cmath>

#include "tensor_walk.h"

namespace fastopt {

namespace {

struct LambMath {
  VecF gf, wd, b1, b3, b2, w2, inv_bc1, inv_bc2, eps;
  bool l2, decoupled;
  explicit LambMath(const LambArgs& a)
      : gf(VecF::set1(a.maximize ? -a.grad_factor : a.grad_factor)), wd(VecF::set1(a.weight_decay)),
        b1(VecF::set1(a.beta1)), b3(VecF::set1(a.beta3)), b2(VecF::set1(a.beta2)),
        w2(VecF::set1(1.0f - a.beta2)), inv_bc1(VecF::set1(1.0f / a.bias_correction1)),
        inv_bc2(VecF::set1(1.0f / a.bias_correction2)), eps(VecF::set1(a.eps)),
        l2(!a.adam_w_mode && a.weight_decay != 0.0f), decoupled(a.adam_w_mode && a.weight_decay != 0.0f) {}
  // This step's moments from the gradient g (as stored) and the moments before it.
  void advance(VecF p, VecF g, VecF& m, VecF& v) const {
    g = g * gf;
    if (l2) g = VecF::fmadd(wd, p, g);
    m = VecF::fmadd(b3, g, m * b1);
    v = VecF::fmadd(w2, g * g, v * b2);
  }
  VecF update(VecF p, VecF m, VecF v) const {
    VecF u = (m * inv_bc1) / (VecF::sqrt(v * inv_bc2) + eps);
    return decoupled ? VecF::fmadd(wd, p, u) : u;
  }
};

// -lr * ratio for each slot from the squared norms ||p||^2, ||u||^2 in sums[2t], sums[2t + 1].
std::vector<float> scales(const double* sums, int64_t n, const LambArgs& a) {
  std::vector<float> scale(n);
  for (int64_t t = 0; t < n; ++t) {
    const double pn = std::sqrt(sums[2 * t]), un = std::sqrt(sums[2 * t + 1]);
    const double ratio = (a.use_trust_ratio && pn != 0.0 && un != 0.0) ? pn / un : 1.0;
    scale[t] = static_cast<float>(-static_cast<double>(a.lr) * ratio);
  }
  return scale;
}

// Per slot, ||p||^2 and ||u||^2 of this step's update into sums[2t], sums[2t + 1]; the
// moments advanced and stored when `advance`, else left as they are (lamb_norms).
void moments_and_norms(const Slots& slots, const LambMath& mth, bool advance, double* sums) {
  parallel_sums_per_slot<2>(slots, sums, [&](int64_t t, int64_t b, int64_t e) {
    const TensorSlot& s = slots[t];
    double ps = 0.0, us = 0.0;
    dispatch_dtypes(s, [&](auto p, auto g, auto) {
      for (int64_t blk = b; blk < e; blk += kSumBlock) {
        VecF pacc = VecF::zero(), uacc = VecF::zero();
        for_each_vec<2, false, decltype(p), decltype(g), None, F32>(s, blk, std::min(e, blk + kSumBlock),
            [&](VecF& pv, VecF gv, std::array<VecF, 2>& st) {
              VecF m = st[0], v = st[1];
              mth.advance(pv, gv, m, v);
              if (advance) {
                st[0] = m;
                st[1] = v;
              }
              const VecF u = mth.update(pv, m, v);
              pacc = VecF::fmadd(pv, pv, pacc);
              uacc = VecF::fmadd(u, u, uacc);
            });
        ps += pacc.sum();
        us += uacc.sum();
      }
    });
    return std::array<double, 2>{ps, us};
  });
}
}  // namespace

void lamb_norms(const Slots& slots, const LambArgs& a, double* sums) {
  moments_and_norms(slots, LambMath(a), false, sums);
}

void lamb_step(const Slots& slots, const LambArgs& a) {
  const LambMath mth(a);
  const int64_t n = static_cast<int64_t>(slots.size());

  if (a.norms) {  // the norms over the whole tensors, given: one pass advances the moments and updates
    update_with_factors<2, true>(slots, scales(a.norms, n, a),
        [&](VecF& pv, VecF gv, std::array<VecF, 2>& st, VecF neg) FASTOPT_ALWAYS_INLINE {
          mth.advance(pv, gv, st[0], st[1]);
          pv = VecF::fmadd(neg, mth.update(pv, st[0], st[1]), pv);
        });
    return;
  }

  // Pass 1: moments, and the squared norms of the parameter and of the update per slot.
  std::vector<double> sums(2 * n);
  moments_and_norms(slots, mth, true, sums.data());

  // Pass 2: apply p -= lr * ratio * u, writing the optional half-precision copy.
  update_with_factors<2, false>(slots, scales(sums.data(), n, a),
      [&](VecF& pv, VecF, std::array<VecF, 2>& st, VecF neg) FASTOPT_ALWAYS_INLINE {
        pv = VecF::fmadd(neg, mth.update(pv, st[0], st[1]), pv);
      });
}

}  // namespace fastopt
