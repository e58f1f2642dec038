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

// Pass 1 reads the gradient and updates the moments; pass 2 reads the moments.
using MomentsLayout = Layout<Role::kParam, Role::kGrad, Role::kState0, Role::kState1>;
template <typename C>
using ApplyLayout = WithCopy<C, Role::kParam, Role::kState0, Role::kState1>;

template <typename P, typename G>
struct LambMoments {
  using Layout = MomentsLayout;
  LambMath math;
  DeviceScalars dev;
  float* partials;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    if (skip_launch(dev)) return;
    LambMath m = math;
    m.prepare(dev);
    const ChunkPos pos = chunk_pos(tl);
    const P* p = role_pointer<Layout, Role::kParam, const P>(tl, pos.t, pos.start);
    const G* g = role_pointer<Layout, Role::kGrad, const G>(tl, pos.t, pos.start);
    float* mo = role_pointer<Layout, Role::kState0, float>(tl, pos.t, pos.start);
    float* ve = role_pointer<Layout, Role::kState1, float>(tl, pos.t, pos.start);
    float ps = 0.0f, us = 0.0f;
    for_each_index(pos.n, [&](int64_t i) {
      const float pv = to_float(p[i]);
      float mv = mo[i], vv = ve[i];
      const float u = m.moments(pv, to_float(g[i]), mv, vv);
      mo[i] = mv;
      ve[i] = vv;
      ps = fmaf(pv, pv, ps);
      us = fmaf(u, u, us);
    });
    store_chunk_pair(tl, pos, partials, ps, us);
  }
};

template <typename P, typename C>
struct LambApply {
  using Layout = ApplyLayout<C>;
  using CT = typename CopyOf<C>::type;
  static constexpr bool kCopy = CopyOf<C>::kEnabled;
  LambMath math;
  DeviceScalars dev;
  const float* partials;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    if (skip_launch(dev)) return;
    LambMath m = math;
    m.prepare(dev);
    const ChunkPos pos = chunk_pos(tl);
    const double2 sums = tensor_totals(partials, tl.chunk_base[pos.t], chunks_of(tl.numel[pos.t]));
    const float neg = lamb_tensor_step(m.lr, m.a.use_trust_ratio, sums.x, sums.y);
    P* p = role_pointer<Layout, Role::kParam, P>(tl, pos.t, pos.start);
    const float* mo = role_pointer<Layout, Role::kState0, const float>(tl, pos.t, pos.start);
    const float* ve = role_pointer<Layout, Role::kState1, const float>(tl, pos.t, pos.start);
    CT* c = copy_pointer<Layout, CT>(tl, pos.t, pos.start);
    for_each_index(pos.n, [&](int64_t i) {
      float pv = to_float(p[i]);
      pv = fmaf(neg, m.update(pv, mo[i], ve[i]), pv);
      p[i] = from_float<P>(pv);
      if (kCopy) c[i] = from_float<CT>(pv);
    });
  }
};

}  // namespace

void lamb_step(const Slots& slots, const LambArgs& a, const LambClip& clip, bool bias_correction,
               const DeviceScalars& d, float* partials, cudaStream_t stream) {
  const LambMath m = lamb_math(a, clip, bias_correction);
  const std::vector<int32_t> bases = chunk_bases(slots);
  const std::vector<std::vector<int32_t>> groups = group_by_dtypes(slots);
  // every tensor's moments and norms first: pass 2 of any group reads only its own tensors'
  // partials, but keeping the passes apart keeps the launches independent of grouping
  for_each_dtype_group(slots, groups, [&](const std::vector<int32_t>& which, auto p, auto g, auto) {
    using F = LambMoments<typename decltype(p)::type, typename decltype(g)::type>;
    launch_multi_tensor(layout_items<typename F::Layout>(slots, which, bases), F{m, d, partials}, stream, "lamb");
  });
  if (a.norms) upload_given_norms(slots, a.norms, partials, stream);  // over the whole tensors (pieces here)
  for_each_dtype_group(slots, groups, [&](const std::vector<int32_t>& which, auto p, auto, auto c) {
    using F = LambApply<typename decltype(p)::type, typename decltype(c)::type>;
    launch_multi_tensor(layout_items<typename F::Layout>(slots, which, bases), F{m, d, partials}, stream, "lamb");
  });
}

}  // namespace cuda
}  // namespace fastopt
