// LAMB on the GPU, with the semantics of ../cpu/lamb.cpp.  Two launches series:
//   1. per chunk: update the moments, and add up ||p||^2 and ||u||^2 (u = the Adam-style
//      update) into partials[chunk];
//   2. per chunk: every block sums its tensor's partials (double, fixed order: all blocks
//      of a tensor get the same trust ratio), then applies p -= lr * ratio * u, recomputing
//      u from the stored moments, and writes the optional half-precision copy.
// The global-norm clipping divisor comes either from the host (a.grad_factor) or from a
// device sum of squares (LambClip), so the step need not synchronise.
#include <cmath>

#include "elementwise.cuh"

namespace fastopt {
namespace cuda {
namespace {

struct LambMath {
  LambArgs a;
  LambClip clip;
  bool bias_correction;
  bool l2, decoupled;
  float gf, inv_bc1, inv_bc2, lr;

  __device__ void prepare(const DeviceScalars& d) {
    float bc1 = a.bias_correction1, bc2 = a.bias_correction2;
    lr = a.lr;
    if (d.step != nullptr) {
      const double step = static_cast<double>(*d.step);
      bc1 = bias_correction ? static_cast<float>(1.0 - pow(static_cast<double>(a.beta1), step)) : 1.0f;
      bc2 = bias_correction ? static_cast<float>(1.0 - pow(static_cast<double>(a.beta2), step)) : 1.0f;
      if (d.lr != nullptr) lr = *d.lr;
    }
    inv_bc1 = 1.0f / bc1;
    inv_bc2 = 1.0f / bc2;
    float factor = a.grad_factor;
    if (clip.grad_sum_squares != nullptr) {  // 1 / (loss scale * clipping divisor), on the device
      const float inv = d.grad_scale != nullptr ? static_cast<float>(1.0 / static_cast<double>(*d.grad_scale))
                                                : clip.inv_grad_scale;
      const double norm = sqrt(*clip.grad_sum_squares) * inv;
      const double divisor = (clip.max_grad_norm > 0.0f && norm > clip.max_grad_norm) ? norm / clip.max_grad_norm
                                                                                       : 1.0;
      factor = static_cast<float>(static_cast<double>(inv) / divisor);
    }
    gf = a.maximize ? -factor : factor;
  }

  __device__ __forceinline__ float update(float p, float m, float v) const {
    const float u = (m * inv_bc1) / (sqrtf(v * inv_bc2) + a.eps);
    return decoupled ? fmaf(a.weight_decay, p, u) : u;
  }
};

template <typename P, typename G>
struct LambMoments {
  LambMath math;
  DeviceScalars dev;
  float* partials;
  __device__ void operator()(const TensorList<4>& tl) const {
    if (skip_launch(dev)) return;
    LambMath m = math;
    m.prepare(dev);
    const ChunkPos pos = chunk_pos(tl);
    const P* p = static_cast<const P*>(tl.addr[0][pos.t]) + pos.start;
    const G* g = static_cast<const G*>(tl.addr[1][pos.t]) + pos.start;
    float* mo = static_cast<float*>(tl.addr[2][pos.t]) + pos.start;
    float* ve = static_cast<float*>(tl.addr[3][pos.t]) + pos.start;
    float ps = 0.0f, us = 0.0f;
    for_each_index(pos.n, [&](int64_t i) {
      const float pv = to_float(p[i]);
      float gv = to_float(g[i]) * m.gf;
      if (m.l2) gv = fmaf(m.a.weight_decay, pv, gv);
      const float mv = fmaf(m.a.beta3, gv, mo[i] * m.a.beta1);
      const float vv = fmaf(1.0f - m.a.beta2, gv * gv, ve[i] * m.a.beta2);
      mo[i] = mv;
      ve[i] = vv;
      const float u = m.update(pv, mv, vv);
      ps = fmaf(pv, pv, ps);
      us = fmaf(u, u, us);
    });
    store_chunk_pair(tl, pos, partials, ps, us);
  }
};

template <typename P, typename C>
struct LambApply {
  static constexpr bool kCopy = !std::is_same<C, NoCopy>::value;
  static constexpr int kDepth = 3 + (kCopy ? 1 : 0);
  using CT = typename std::conditional<kCopy, C, float>::type;
  LambMath math;
  DeviceScalars dev;
  const float* partials;
  __device__ void operator()(const TensorList<kDepth>& tl) const {
    if (skip_launch(dev)) return;
    LambMath m = math;
    m.prepare(dev);
    const ChunkPos pos = chunk_pos(tl);
    const double2 sums = tensor_totals(partials, tl.chunk_base[pos.t], chunks_of(tl.numel[pos.t]));
    const double pn = sqrt(sums.x), un = sqrt(sums.y);
    const double ratio = (m.a.use_trust_ratio && pn != 0.0 && un != 0.0) ? pn / un : 1.0;
    const float neg = static_cast<float>(-static_cast<double>(m.lr) * ratio);
    P* p = static_cast<P*>(tl.addr[0][pos.t]) + pos.start;
    const float* mo = static_cast<const float*>(tl.addr[1][pos.t]) + pos.start;
    const float* ve = static_cast<const float*>(tl.addr[2][pos.t]) + pos.start;
    CT* c = kCopy ? static_cast<CT*>(tl.addr[kDepth - 1][pos.t]) + pos.start : nullptr;
    for_each_index(pos.n, [&](int64_t i) {
      float pv = to_float(p[i]);
      pv = fmaf(neg, m.update(pv, mo[i], ve[i]), pv);
      p[i] = from_float<P>(pv);
      if (kCopy) c[i] = from_float<CT>(pv);
    });
  }
};

void* moments_pick(const TensorSlot& s, int k) {
  return k == 0 ? s.param : k == 1 ? const_cast<void*>(s.grad) : s.state[k - 2];
}

template <bool kCopy>
void* apply_pick(const TensorSlot& s, int k) {
  return k == 0 ? s.param : k < 3 ? s.state[k - 1] : (kCopy ? s.copy : nullptr);
}

}  // namespace

void lamb_step(const Slots& slots, const LambArgs& a, const LambClip& clip, bool bias_correction,
               const DeviceScalars& d, float* partials, cudaStream_t stream) {
  LambMath m{};
  m.a = a;
  m.clip = clip;
  m.bias_correction = bias_correction;
  m.l2 = !a.adam_w_mode && a.weight_decay != 0.0f;
  m.decoupled = a.adam_w_mode && a.weight_decay != 0.0f;
  const std::vector<int32_t> bases = chunk_bases(slots);
  const std::vector<std::vector<int32_t>> groups = group_by_dtypes(slots);
  // every tensor's moments and norms first: pass 2 of any group reads only its own tensors'
  // partials, but keeping the passes apart keeps the launches independent of grouping
  for (const std::vector<int32_t>& group : groups) {
    dispatch_dtypes(slots[group[0]], [&](auto p, auto g, auto) {
      using F = LambMoments<typename decltype(p)::type, typename decltype(g)::type>;
      launch_multi_tensor<4>(launch_items<4>(slots, group, bases, moments_pick), F{m, d, partials}, stream,
                             "lamb");
    });
  }
  for (const std::vector<int32_t>& group : groups) {
    dispatch_dtypes(slots[group[0]], [&](auto p, auto, auto c) {
      using F = LambApply<typename decltype(p)::type, typename decltype(c)::type>;
      launch_multi_tensor<F::kDepth>(launch_items<F::kDepth>(slots, group, bases, apply_pick<F::kCopy>),
                                     F{m, d, partials}, stream, "lamb");
    });
  }
}

}  // namespace cuda
}  // namespace fastopt
