// How one CUDA block walks its chunk: storage types and conversions, the element-wise
// functor, the dtype dispatch and the launch items of a call.  Device code, but free of
// kernel launches and of shared memory, so a host compiler with CUDA's headers compiles
// it too: tests/cpp/cuda_walk_check.cpp runs these very functors on the host, block by
// block and thread by thread, for the launches the real launcher would make.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/dtype_combinations.h"
#include "cuda_api.h"
#include "launch_plan.h"
#include "optimizer_math.cuh"
#include "tensor_roles.h"

namespace fastopt {
namespace cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// kILP consecutive elements, loaded and stored with one vector instruction when aligned.
template <typename T>
struct alignas(sizeof(T) * kILP) Pack {
  T v[kILP];
};

template <typename T>
__device__ __forceinline__ bool pack_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kILP) == 0;
}

__device__ __forceinline__ bool skip_launch(const DeviceScalars& d) {
  return d.found_inf != nullptr && *d.found_inf != 0.0f;
}

// Where this block works: tensor t of the list, elements [start, start + n).
struct ChunkPos {
  int t;
  int64_t chunk, start, n;
};

template <typename List>
__device__ __forceinline__ ChunkPos chunk_pos(const List& tl) {
  ChunkPos c;
  c.t = tl.block_tensor[blockIdx.x];
  c.chunk = tl.block_chunk[blockIdx.x];
  c.start = c.chunk * kChunkSize;
  const int64_t left = tl.numel[c.t] - c.start;
  c.n = left < kChunkSize ? left : kChunkSize;
  return c;
}

// Calls fn(i) for every element index of a chunk of n elements that this thread owns,
// kILP independent (coalesced) indices per iteration.
template <typename Fn>
__device__ __forceinline__ void for_each_index(int64_t n, const Fn& fn) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * kILP;
  for (int64_t base = 0; base < n; base += stride) {
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i < n) fn(i);
    }
  }
}

// Where the tensor of role R of tensor t's chunk starts, as a T*.
template <typename Layout, Role R, typename T, typename List>
__device__ __forceinline__ T* role_pointer(const List& tl, int t, int64_t start) {
  static_assert(Layout::has(R), "this layout carries no tensor of that role");
  return static_cast<T*>(tl.addr[Layout::at(R)][t]) + start;
}

// The half-precision copy's chunk (null when the layout has none).
template <typename Layout, typename CT, typename List>
__device__ __forceinline__ CT* copy_pointer(const List& tl, int t, int64_t start) {
  if constexpr (Layout::has(Role::kCopy)) return role_pointer<Layout, Role::kCopy, CT>(tl, t, start);
  return nullptr;
}

// One chunk of an element-wise update: param P (float32 master or a half-precision param),
// gradient G, NS float32 states, and an optional half-precision copy C of the result.
template <typename P, typename G, typename C, int NS, typename Math>
struct ElementwiseFunctor {
  using Layout = typename ElementwiseLayout<NS, C>::type;
  static constexpr bool kCopy = CopyOf<C>::kEnabled;
  using CT = typename CopyOf<C>::type;
  Math math;
  DeviceScalars dev;

  template <typename List>
  __device__ __forceinline__ void operator()(const List& tl) const {
    if (skip_launch(dev)) return;
    Math m = math;
    m.prepare(dev);
    const ChunkPos pos = chunk_pos(tl);
    if constexpr (HasForTensor<Math>::value) m.for_tensor(tl.numel[pos.t]);
    const int t = pos.t;
    const int64_t start = pos.start, n = pos.n;
    P* p = role_pointer<Layout, Role::kParam, P>(tl, t, start);
    const G* g = role_pointer<Layout, Role::kGrad, const G>(tl, t, start);
    float* s[NS > 0 ? NS : 1];
#pragma unroll
    for (int k = 0; k < NS; ++k) s[k] = static_cast<float*>(tl.addr[Layout::state(k)][t]) + start;
    CT* c = copy_pointer<Layout, CT>(tl, t, start);

    bool aligned = pack_aligned(p) && pack_aligned(g) && (!kCopy || pack_aligned(c));
#pragma unroll
    for (int k = 0; k < NS; ++k) aligned = aligned && pack_aligned(s[k]);
    int64_t done = 0;
    if (aligned) {
      const int64_t packs = n / kILP;
      for (int64_t v = threadIdx.x; v < packs; v += blockDim.x) {
        const Pack<P> pp = reinterpret_cast<const Pack<P>*>(p)[v];
        const Pack<G> gp = reinterpret_cast<const Pack<G>*>(g)[v];
        Pack<float> sp[NS > 0 ? NS : 1];
#pragma unroll
        for (int k = 0; k < NS; ++k) sp[k] = reinterpret_cast<const Pack<float>*>(s[k])[v];
        Pack<P> po;
        Pack<CT> co;
#pragma unroll
        for (int j = 0; j < kILP; ++j) {
          float pv = to_float(pp.v[j]);
          float sv[NS > 0 ? NS : 1];
#pragma unroll
          for (int k = 0; k < NS; ++k) sv[k] = sp[k].v[j];
          m(pv, to_float(gp.v[j]), sv);
#pragma unroll
          for (int k = 0; k < NS; ++k) sp[k].v[j] = sv[k];
          po.v[j] = from_float<P>(pv);
          if (kCopy) co.v[j] = from_float<CT>(pv);
        }
        reinterpret_cast<Pack<P>*>(p)[v] = po;
#pragma unroll
        for (int k = 0; k < NS; ++k) reinterpret_cast<Pack<float>*>(s[k])[v] = sp[k];
        if (kCopy) reinterpret_cast<Pack<CT>*>(c)[v] = co;
      }
      done = packs * kILP;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {  // tail, or unaligned tensors
      float pv = to_float(p[i]);
      float sv[NS > 0 ? NS : 1];
#pragma unroll
      for (int k = 0; k < NS; ++k) sv[k] = s[k][i];
      m(pv, to_float(g[i]), sv);
#pragma unroll
      for (int k = 0; k < NS; ++k) s[k][i] = sv[k];
      p[i] = from_float<P>(pv);
      if (kCopy) c[i] = from_float<CT>(pv);
    }
  }
};

template <typename T>
struct Tag {
  using type = T;
};

// CUDA's element types for the dtype table of ../common/dtype_combinations.h.
struct DeviceStorage {
  using F32 = Tag<float>;
  using F16 = Tag<__half>;
  using BF16 = Tag<__nv_bfloat16>;
  using None = Tag<NoCopy>;
};

// The key that puts slots of one dtype combination into one launch.
inline int dtype_key(const TensorSlot& s) {
  return static_cast<int>(s.param_dtype) * 16 + static_cast<int>(s.grad_dtype) * 4 + static_cast<int>(s.copy_dtype);
}

// Slot positions grouped by dtype combination, each group in the caller's order.
inline std::vector<std::vector<int32_t>> group_by_dtypes(const Slots& slots) {
  std::vector<std::vector<int32_t>> groups(64);
  for (size_t i = 0; i < slots.size(); ++i) groups[dtype_key(slots[i])].push_back(static_cast<int32_t>(i));
  std::vector<std::vector<int32_t>> out;
  for (auto& g : groups)
    if (!g.empty()) out.push_back(std::move(g));
  return out;
}

// Chunks before each slot, in the caller's order (see TensorList::chunk_base).
inline std::vector<int32_t> chunk_bases(const Slots& slots) {
  std::vector<int32_t> base(slots.size());
  int64_t total = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    base[i] = static_cast<int32_t>(total);
    total += chunks_of(slots[i].numel);
  }
  return base;
}

// Per-tensor squared norms given over whole tensors (LambArgs/LarsArgs::norms, a host
// array of two per slot) written where the kernels keep their per-chunk partial sums:
// each tensor's pair in its first chunk, zeros in the others, so that the sum the apply
// pass takes of a tensor's partials (in double) is the pair, rounded to float.  Enqueued
// on `stream` (the host buffer is staged before the call returns).
inline void upload_given_norms(const Slots& slots, const double* norms, float* partials, cudaStream_t stream) {
  const std::vector<int32_t> bases = chunk_bases(slots);
  std::vector<float> host(static_cast<size_t>(std::max<int64_t>(1, 2 * total_chunks(slots))), 0.0f);
  for (size_t t = 0; t < slots.size(); ++t) {
    if (chunks_of(slots[t].numel) == 0) continue;  // nothing of it to update
    host[2 * static_cast<size_t>(bases[t])] = static_cast<float>(norms[2 * t]);
    host[2 * static_cast<size_t>(bases[t]) + 1] = static_cast<float>(norms[2 * t + 1]);
  }
  const cudaError_t err =
      cudaMemcpyAsync(partials, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("lightning_fastopt: copying the given norms to the device failed: ") +
                             cudaGetErrorString(err));
}

// The launch items of some slots (`which`, positions in `slots`), packed by Layout.
template <typename Layout>
std::vector<LaunchItem<Layout::kDepth>> layout_items(const Slots& slots, const std::vector<int32_t>& which,
                                                     const std::vector<int32_t>& bases) {
  std::vector<LaunchItem<Layout::kDepth>> items;
  items.reserve(which.size());
  for (int32_t i : which) {
    LaunchItem<Layout::kDepth> item;
    for (int k = 0; k < Layout::kDepth; ++k) item.addr[k] = Layout::address(slots[i], k);
    item.numel = slots[i].numel;
    item.index = i;
    item.chunk_base = bases[i];
    items.push_back(item);
  }
  return items;
}

// Calls fn(which, Tag<P>{}, Tag<G>{}, Tag<C>{}) for each group of slots that share a dtype
// combination (`groups`: group_by_dtypes(slots), computed once per call by the caller;
// `which`: a group's positions, in the caller's order): every pass of every algorithm
// launches per group, since a functor is compiled for one combination.
template <typename Fn>
void for_each_dtype_group(const Slots& slots, const std::vector<std::vector<int32_t>>& groups, const Fn& fn) {
  for (const std::vector<int32_t>& which : groups) {
    dispatch_dtype_combination<DeviceStorage>(slots[which[0]], [&](auto p, auto g, auto c) { fn(which, p, g, c); });
  }
}

// Runs an element-wise algorithm over every slot: one series of launches per dtype
// combination, each handed to launch(items, functor) (the CUDA launcher, or the host check).
template <int NS, typename Math, typename Launch>
void elementwise_launches(const Slots& slots, const Math& math, const DeviceScalars& d, const Launch& launch) {
  const std::vector<int32_t> bases = chunk_bases(slots);
  const std::vector<std::vector<int32_t>> groups = group_by_dtypes(slots);
  for_each_dtype_group(slots, groups, [&](const std::vector<int32_t>& which, auto p, auto g, auto c) {
    using F = ElementwiseFunctor<typename decltype(p)::type, typename decltype(g)::type,
                                 typename decltype(c)::type, NS, Math>;
    launch(layout_items<typename F::Layout>(slots, which, bases), F{math, d});
  });
}

}  // namespace cuda
}  // namespace fastopt
