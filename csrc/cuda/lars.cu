// LARS on the GPU, with the semantics of ../cpu/lars.cpp.  Pass 1 adds up ||g||^2 and
// ||p||^2 per chunk; pass 2 has every block sum its tensor's partials (double, fixed
// order), compute the local learning rate and apply the momentum update.
#include <cmath>

#include "elementwise.cuh"

namespace fastopt {
namespace cuda {
namespace {

template <typename P, typename G>
struct LarsNorms {
  DeviceScalars dev;
  float* partials;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    if (skip_launch(dev)) return;
    const ChunkPos pos = chunk_pos(tl);
    const P* p = static_cast<const P*>(tl.addr[0][pos.t]) + pos.start;
    const G* g = static_cast<const G*>(tl.addr[1][pos.t]) + pos.start;
    float gs = 0.0f, ps = 0.0f;
    for_each_index(pos.n, [&](int64_t i) {
      const float gv = to_float(g[i]), pv = to_float(p[i]);
      gs = fmaf(gv, gv, gs);
      ps = fmaf(pv, pv, ps);
    });
    store_chunk_pair(tl, pos, partials, gs, ps);
  }
};

template <typename P, typename G, typename C>
struct LarsApply {
  static constexpr bool kCopy = !std::is_same<C, NoCopy>::value;
  static constexpr int kDepth = 3 + (kCopy ? 1 : 0);
  using CT = typename std::conditional<kCopy, C, float>::type;
  LarsMath math;
  DeviceScalars dev;
  const float* partials;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    if (skip_launch(dev)) return;
    const ChunkPos pos = chunk_pos(tl);
    const double2 sums = tensor_totals(partials, tl.chunk_base[pos.t], chunks_of(tl.numel[pos.t]));
    LarsMath m = math;
    m.prepare(dev, sums.x, sums.y);
    P* p = static_cast<P*>(tl.addr[0][pos.t]) + pos.start;
    const G* g = static_cast<const G*>(tl.addr[1][pos.t]) + pos.start;
    float* buf = static_cast<float*>(tl.addr[2][pos.t]) + pos.start;
    CT* c = kCopy ? static_cast<CT*>(tl.addr[kDepth - 1][pos.t]) + pos.start : nullptr;
    for_each_index(pos.n, [&](int64_t i) {
      float pv = to_float(p[i]);
      m(pv, to_float(g[i]), buf + i);
      p[i] = from_float<P>(pv);
      if (kCopy) c[i] = from_float<CT>(pv);
    });
  }
};

}  // namespace

void lars_step(const Slots& slots, const LarsArgs& a, const DeviceScalars& d, float* partials,
               cudaStream_t stream) {
  const std::vector<int32_t> bases = chunk_bases(slots);
  const std::vector<std::vector<int32_t>> groups = group_by_dtypes(slots);
  for (const std::vector<int32_t>& group : groups) {
    dispatch_dtypes(slots[group[0]], [&](auto p, auto g, auto) {
      using F = LarsNorms<typename decltype(p)::type, typename decltype(g)::type>;
      launch_multi_tensor<2>(launch_items<2>(slots, group, bases, standard_pick<0, false>), F{d, partials}, stream,
                             "lars");
    });
  }
  for (const std::vector<int32_t>& group : groups) {
    dispatch_dtypes(slots[group[0]], [&](auto p, auto g, auto c) {
      using F = LarsApply<typename decltype(p)::type, typename decltype(g)::type, typename decltype(c)::type>;
      launch_multi_tensor<F::kDepth>(launch_items<F::kDepth>(slots, group, bases, standard_pick<1, F::kCopy>),
                                     F{lars_math(a), d, partials}, stream, "lars");
    });
  }
}

}  // namespace cuda
}  // namespace fastopt
