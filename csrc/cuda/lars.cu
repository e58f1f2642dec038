// LARS on the GPU, with the semantics of ../cpu/lars.cpp.  Pass 1 adds up ||g||^2 and
// ||p||^2 per chunk (or the norms over whole tensors are given: upload_given_norms);
// pass 2 has every block sum its tensor's partials (double, fixed order), compute the
// local learning rate and apply the momentum update.
#include <cmath>

#include "elementwise.cuh"

namespace fastopt {
namespace cuda {
namespace {

// Pass 1 reads the gradient and the parameter; pass 2 updates the momentum buffer too.
using NormsLayout = Layout<Role::kParam, Role::kGrad>;
template <typename C>
using ApplyLayout = WithCopy<C, Role::kParam, Role::kGrad, Role::kState0>;

template <typename P, typename G>
struct LarsNorms {
  using Layout = NormsLayout;
  DeviceScalars dev;
  float* partials;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    if (skip_launch(dev)) return;
    const ChunkPos pos = chunk_pos(tl);
    const P* p = role_pointer<Layout, Role::kParam, const P>(tl, pos.t, pos.start);
    const G* g = role_pointer<Layout, Role::kGrad, const G>(tl, pos.t, pos.start);
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
  using Layout = ApplyLayout<C>;
  using CT = typename CopyOf<C>::type;
  static constexpr bool kCopy = CopyOf<C>::kEnabled;
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
    P* p = role_pointer<Layout, Role::kParam, P>(tl, pos.t, pos.start);
    const G* g = role_pointer<Layout, Role::kGrad, const G>(tl, pos.t, pos.start);
    float* buf = role_pointer<Layout, Role::kState0, float>(tl, pos.t, pos.start);
    CT* c = copy_pointer<Layout, CT>(tl, pos.t, pos.start);
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
  if (a.norms) {  // over the whole tensors, given (these are pieces of them)
    upload_given_norms(slots, a.norms, partials, stream);
  } else {
    for_each_dtype_group(slots, groups, [&](const std::vector<int32_t>& which, auto p, auto g, auto) {
      using F = LarsNorms<typename decltype(p)::type, typename decltype(g)::type>;
      launch_multi_tensor(layout_items<typename F::Layout>(slots, which, bases), F{d, partials}, stream, "lars");
    });
  }
  for_each_dtype_group(slots, groups, [&](const std::vector<int32_t>& which, auto p, auto g, auto c) {
    using F = LarsApply<typename decltype(p)::type, typename decltype(g)::type, typename decltype(c)::type>;
    launch_multi_tensor(layout_items<typename F::Layout>(slots, which, bases), F{lars_math(a), d, partials}, stream,
                        "lars");
  });
}

}  // namespace cuda
}  // namespace fastopt
