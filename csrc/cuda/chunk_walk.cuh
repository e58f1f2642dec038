// How one CUDA block walks its chunk: storage types and conversions, the element-wise
// functor, the dtype dispatch and the launch items of a call.  Device code, but free of
// kernel launches and of shared memory, so a host compiler with CUDA's headers compiles
// it too: tests/cpp/cuda_walk_check.cpp runs these very functors on the host, block by
// block and thread by thread, for the launches the real launcher would make.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "cuda_api.h"
#include "launch_plan.h"
#include "optimizer_math.cuh"

namespace fastopt {
namespace cuda {

struct NoCopy {};

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

// One chunk of an element-wise update: param P (float32 master or a half-precision param),
// gradient G, NS float32 states, and an optional half-precision copy C of the result.
template <typename P, typename G, typename C, int NS, typename Math>
struct ElementwiseFunctor {
  static constexpr bool kCopy = !std::is_same<C, NoCopy>::value;
  static constexpr int kDepth = 2 + NS + (kCopy ? 1 : 0);
  using CT = typename std::conditional<kCopy, C, float>::type;
  Math math;
  DeviceScalars dev;

  template <typename List>
  __device__ __forceinline__ void operator()(const List& tl) const {
    if (skip_launch(dev)) return;
    Math m = math;
    m.prepare(dev);
    const ChunkPos pos = chunk_pos(tl);
    const int t = pos.t;
    const int64_t start = pos.start, n = pos.n;
    P* p = static_cast<P*>(tl.addr[0][t]) + start;
    const G* g = static_cast<const G*>(tl.addr[1][t]) + start;
    float* s[NS > 0 ? NS : 1];
#pragma unroll
    for (int k = 0; k < NS; ++k) s[k] = static_cast<float*>(tl.addr[2 + k][t]) + start;
    CT* c = kCopy ? static_cast<CT*>(tl.addr[kDepth - 1][t]) + start : nullptr;

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

// Calls fn(Tag<P>, Tag<G>, Tag<C>) for a slot's dtypes; the combinations are the CPU
// kernels' (tensor_walk.h): float32 masters with float32/fp16/bf16 gradients and an
// optional fp16/bf16 copy, or fp16/bf16 params with gradients of their dtype or float32.
template <typename Fn>
void dispatch_dtypes(const TensorSlot& s, const Fn& fn) {
  auto with_copy = [&](auto p, auto g) {
    switch (s.copy_dtype) {
      case DType::kFloat16: return fn(p, g, Tag<__half>{});
      case DType::kBFloat16: return fn(p, g, Tag<__nv_bfloat16>{});
      default: return fn(p, g, Tag<NoCopy>{});
    }
  };
  auto grad = [&](auto p, auto own) {
    switch (s.grad_dtype) {
      case DType::kFloat16: return with_copy(p, Tag<__half>{});
      case DType::kBFloat16: return with_copy(p, Tag<__nv_bfloat16>{});
      case DType::kFloat32: return with_copy(p, Tag<float>{});
      default: return with_copy(p, own);
    }
  };
  switch (s.param_dtype) {
    case DType::kFloat16: return s.grad_dtype == DType::kFloat32 ? fn(Tag<__half>{}, Tag<float>{}, Tag<NoCopy>{})
                                                                 : fn(Tag<__half>{}, Tag<__half>{}, Tag<NoCopy>{});
    case DType::kBFloat16:
      return s.grad_dtype == DType::kFloat32 ? fn(Tag<__nv_bfloat16>{}, Tag<float>{}, Tag<NoCopy>{})
                                             : fn(Tag<__nv_bfloat16>{}, Tag<__nv_bfloat16>{}, Tag<NoCopy>{});
    default: return grad(Tag<float>{}, Tag<float>{});
  }
}

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

// The launch items of some slots.  Tensor k of a slot is chosen by pick(slot, k).
template <int D, typename Pick>
std::vector<LaunchItem<D>> launch_items(const Slots& slots, const std::vector<int32_t>& which,
                                        const std::vector<int32_t>& bases, const Pick& pick) {
  std::vector<LaunchItem<D>> items;
  items.reserve(which.size());
  for (int32_t i : which) {
    LaunchItem<D> item;
    for (int k = 0; k < D; ++k) item.addr[k] = pick(slots[i], k);
    item.numel = slots[i].numel;
    item.index = i;
    item.chunk_base = bases[i];
    items.push_back(item);
  }
  return items;
}

// The usual layout: param, grad, NS states, copy.
template <int NS, bool kCopy>
void* standard_pick(const TensorSlot& s, int k) {
  if (k == 0) return s.param;
  if (k == 1) return const_cast<void*>(s.grad);
  if (k < 2 + NS) return s.state[k - 2];
  return kCopy ? s.copy : nullptr;
}

// Runs an element-wise algorithm over every slot: one series of launches per dtype
// combination, each handed to launch(items, functor) (the CUDA launcher, or the host check).
template <int NS, typename Math, typename Launch>
void elementwise_launches(const Slots& slots, const Math& math, const DeviceScalars& d, const Launch& launch) {
  const std::vector<int32_t> bases = chunk_bases(slots);
  for (const std::vector<int32_t>& group : group_by_dtypes(slots)) {
    dispatch_dtypes(slots[group[0]], [&](auto p, auto g, auto c) {
      using F = ElementwiseFunctor<typename decltype(p)::type, typename decltype(g)::type,
                                   typename decltype(c)::type, NS, Math>;
      launch(launch_items<F::kDepth>(slots, group, bases, standard_pick<NS, F::kCopy>), F{math, d});
    });
  }
}

}  // namespace cuda
}  // namespace fastopt
