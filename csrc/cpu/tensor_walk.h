// How the CPU kernels walk over many tensors.
//
// `parallel_over` splits the concatenation of all slots into units of kUnit elements
// (a tensor's start is padded to a unit boundary, so a unit never spans two tensors and
// threads never share a cache line), and those into chunks of kChunkUnits units, which
// torch's threads (torch.set_num_threads()) share out as chunk_schedule.h says.  Balance
// is by element count, so one huge tensor and thousands of small ones are treated alike.
// The chunks do not depend on the thread count, so neither do the sums of
// `parallel_sums_per_slot`.
//
// `for_each_vec` runs an algorithm body over one piece of one tensor, vector by vector,
// loading the parameter and gradient in their storage types, the float32 states, and
// storing the results (plus the optional half-precision parameter copy).  The tail is
// padded into a small buffer and goes through the same vector body, so every element
// sees exactly the same arithmetic.
#pragma once

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#include "../common/dtype_combinations.h"
#include "chunk_schedule.h"
#include "kernel_api.h"
#include "vec.h"

namespace fastopt {

constexpr int64_t kUnit = 64;            // elements per unit (256 bytes of float32)
constexpr int64_t kChunkUnits = 512;     // units per chunk: 32K elements, a thread's turn

// The units of the slots laid end to end: start[t] is the first unit of slot t, start[n]
// the total; chunk c covers units [c * kChunkUnits, (c + 1) * kChunkUnits).
struct UnitLayout {
  std::vector<int64_t> start;
  explicit UnitLayout(const Slots& slots) : start(slots.size() + 1, 0) {
    for (size_t t = 0; t < slots.size(); ++t) start[t + 1] = start[t] + (slots[t].numel + kUnit - 1) / kUnit;
  }
  int64_t chunks() const { return (start.back() + kChunkUnits - 1) / kChunkUnits; }
  // The first slot chunk c reaches.
  int64_t first_slot(int64_t c) const {
    return std::upper_bound(start.begin(), start.end(), c * kChunkUnits) - start.begin() - 1;
  }
  // fn(slot_index, begin, end) for each slot's piece in chunk c, in slot order.
  template <typename Fn>
  void walk_chunk(const Slots& slots, int64_t c, const Fn& fn) const {
    const int64_t n = static_cast<int64_t>(slots.size());
    const int64_t ub = c * kChunkUnits, ue = std::min(start[n], ub + kChunkUnits);
    for (int64_t t = first_slot(c); t < n && start[t] < ue; ++t) {
      const int64_t b = (std::max(ub, start[t]) - start[t]) * kUnit;
      const int64_t e = std::min((std::min(ue, start[t + 1]) - start[t]) * kUnit, slots[t].numel);
      if (b < e) fn(t, b, e);
    }
  }
};

// chunk(c) for every c in [0, chunks), each once, on torch's threads (chunk_schedule.h).
template <typename Fn>
void each_chunk(int64_t chunks, const Fn& chunk) {
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), chunks));
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < chunks; ++c) chunk(c);
    return;
  }
  auto on_torch_threads = [](int team, const auto& worker) {
    at::parallel_for(0, team, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) worker(static_cast<int>(i));
    });
  };
  steal_chunks(chunks, threads, on_torch_threads, chunk);
}

template <typename Fn>  // fn(slot_index, begin, end)
void parallel_over(const Slots& slots, const Fn& fn) {
  const UnitLayout units(slots);
  each_chunk(units.chunks(), [&](int64_t c) { units.walk_chunk(slots, c, fn); });
}

// Per-slot sums of K quantities: each chunk's pieces summed apart, then the chunks' in
// chunk order, so the totals do not depend on which thread took what, nor on how many
// there were.  fn(slot_index, begin, end) returns this piece's K contributions; the
// totals land in out[K * slot_index + k].
template <int K, typename Fn>
void parallel_sums_per_slot(const Slots& slots, double* out, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(slots.size());
  const UnitLayout units(slots);
  const int64_t chunks = units.chunks();
  // chunk c's pieces are slots first_slot(c) .. first_slot(c + 1) (inclusive: a slot may
  // go on into the next chunk); each piece gets K doubles from row[c] on.
  std::vector<int64_t> first(chunks + 1), row(chunks + 1, 0);
  for (int64_t c = 0; c <= chunks; ++c) first[c] = c < chunks ? units.first_slot(c) : n;
  for (int64_t c = 0; c < chunks; ++c) row[c + 1] = row[c] + (std::min(first[c + 1], n - 1) - first[c] + 1);
  std::vector<double> partial(static_cast<size_t>(row[chunks]) * K, 0.0);
  each_chunk(chunks, [&](int64_t c) {
    units.walk_chunk(slots, c, [&](int64_t t, int64_t b, int64_t e) {
      const std::array<double, K> piece = fn(t, b, e);
      double* at = partial.data() + static_cast<size_t>(row[c] + t - first[c]) * K;
      for (int k = 0; k < K; ++k) at[k] += piece[k];
    });
  });
  std::fill(out, out + K * n, 0.0);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t t = first[c]; t <= std::min(first[c + 1], n - 1); ++t)
      for (int k = 0; k < K; ++k) out[K * t + k] += partial[static_cast<size_t>(row[c] + t - first[c]) * K + k];
}

// Sums are accumulated in float vectors over blocks of this many elements, then in double.
constexpr int64_t kSumBlock = 4096;

template <typename Tag>
using storage_t = typename Tag::type;

// The CPU's storage tags (vec.h) for the dtype table of ../common/dtype_combinations.h.
struct CpuStorage {
  using F32 = fastopt::F32;
  using F16 = fastopt::F16;
  using BF16 = fastopt::BF16;
  using None = fastopt::None;
};

// Calls fn(P{}, G{}, C{}) with the storage tags of the slot (one of the 13 combinations).
template <typename Fn>
void dispatch_dtypes(const TensorSlot& s, const Fn& fn) {
  dispatch_dtype_combination<CpuStorage>(s, fn);
}

// Forced inline: the per-vector steps below (GCC otherwise stops inlining the body once
// enough instantiations share one caller, and the loop pays a call per vector).
#define FASTOPT_ALWAYS_INLINE __attribute__((always_inline))

// x * f rounded to the storage of G (x holds values of G: a gradient's), back in float32,
// as an in-place multiply of a G tensor by a float32 scalar leaves it.
template <typename G>
FASTOPT_ALWAYS_INLINE inline VecF times_in(const VecF& x, float f) {
  const VecF y = x * VecF::set1(f);
  if constexpr (std::is_same_v<storage_t<G>, float>) {
    return y;
  } else {
    alignas(64) storage_t<G> rounded[VecF::W];
    y.store(rounded);
    return VecF::load(rounded);
  }
}

// body(VecF& param, VecF grad, std::array<VecF, NS>& state) updates param and state in
// registers; the first NS state pointers of the slot are loaded and stored (S: their
// storage, F32, or BF16 stored with stochastic rounding, see vec.h); the gradient is
// multiplied by the slot's grad_factors (times_in) as it is loaded.  With
// kStoreParam false the parameter (and its copy) is only read; with G = None no
// gradient is read and the body sees zeros.
// One out-of-line function per dtype combination (a fresh inlining budget for each), with
// the per-vector step forced inline.
template <int NS, bool kStoreParam, typename P, typename G, typename C, typename S, typename Body>
__attribute__((noinline)) void for_each_vec(const TensorSlot& s, int64_t b, int64_t e, const Body& body) {
  using PT = storage_t<P>;
  using GT = std::conditional_t<std::is_same_v<G, None>, float, storage_t<G>>;
  using ST = storage_t<S>;
  constexpr bool kHasGrad = !std::is_same_v<G, None>;
  constexpr bool kHasCopy = kStoreParam && !std::is_same_v<C, None>;
  constexpr bool kRoundState = std::is_same_v<S, BF16>;
  constexpr int W = VecF::W;
  PT* p = static_cast<PT*>(s.param);
  const GT* g = static_cast<const GT*>(s.grad);
  std::array<ST*, NS> st;
  std::array<uint32_t, NS> seed{};
  for (int k = 0; k < NS; ++k) {
    st[k] = reinterpret_cast<ST*>(s.state[k]);
    if constexpr (kRoundState) seed[k] = state_rounding_seed(s.state_seed, k);
  }

  // One vector at offset `off` of the given pointers, element `index` of the tensor;
  // Stream selects a non-temporal store for the copy.
  auto one = [&](auto stream, PT* pp, const GT* gp, const std::array<ST*, NS>& sp, int64_t off, int64_t index,
                 void* cp) FASTOPT_ALWAYS_INLINE {
    VecF pv = VecF::load(pp + off);
    VecF gv;
    if constexpr (kHasGrad) {
      gv = VecF::load(gp + off);
      for (int32_t f = 0; f < s.grad_factor_count; ++f) gv = times_in<G>(gv, s.grad_factors[f]);
    } else {
      gv = VecF::zero();
    }
    std::array<VecF, NS> sv;
    for (int k = 0; k < NS; ++k) sv[k] = VecF::load(sp[k] + off);
    body(pv, gv, sv);
    for (int k = 0; k < NS; ++k) {
      if constexpr (kRoundState) {
        sv[k].store_stochastic(sp[k] + off, seed[k], s.index_base + static_cast<uint32_t>(index));
      }
      else sv[k].store(sp[k] + off);
    }
    if constexpr (kStoreParam) pv.store(pp + off);
    if constexpr (kHasCopy) {
      if constexpr (decltype(stream)::value) pv.stream(static_cast<storage_t<C>*>(cp) + off);
      else pv.store(static_cast<storage_t<C>*>(cp) + off);
    }
  };
  constexpr std::true_type kStream{};
  constexpr std::false_type kPlain{};

  int64_t i = b;
  if constexpr (kHasCopy) {
    // The parameter copy is write-only: non-temporal stores save reading each of its
    // lines first (b is a multiple of kUnit, so every vector is aligned like the base).
    if (reinterpret_cast<uintptr_t>(s.copy) % VecF::kStreamAlign == 0) {
      for (; i + W <= e; i += W) one(kStream, p, g, st, i, i, s.copy);
      stream_fence();
    }
  }
  // The whole vectors, then the tail padded into buffers, through one loop: the body is
  // emitted once for both (inlining it a second time for the tail doubled the compile time).
  const int64_t r = (e - i) % W;
  alignas(64) PT pb[W];
  alignas(64) GT gb[W];
  alignas(64) ST sb[NS > 0 ? NS : 1][W];
  alignas(64) storage_t<std::conditional_t<kHasCopy, C, F32>> cb[W];
  PT* pp = p;
  const GT* gp = g;
  std::array<ST*, NS> sp = st;
  void* cp = s.copy;
  int64_t off = i, stop = e - r, index_shift = 0;
  for (bool tail = false;; tail = true) {
    for (; off < stop; off += W) one(kPlain, pp, gp, sp, off, off + index_shift, cp);
    if (tail || r == 0) break;
    i = stop;  // the tail's first element
    std::memset(static_cast<void*>(pb), 0, sizeof(pb));
    std::memset(static_cast<void*>(gb), 0, sizeof(gb));
    std::memset(static_cast<void*>(sb), 0, sizeof(sb));
    std::memcpy(static_cast<void*>(pb), p + i, r * sizeof(PT));
    if constexpr (kHasGrad) std::memcpy(static_cast<void*>(gb), g + i, r * sizeof(GT));
    for (int k = 0; k < NS; ++k) {
      std::memcpy(static_cast<void*>(sb[k]), st[k] + i, r * sizeof(ST));
      sp[k] = sb[k];
    }
    pp = pb;
    gp = gb;
    cp = cb;
    off = 0;
    stop = W;
    index_shift = i;
  }
  if (r != 0) {
    if constexpr (kHasCopy)
      std::memcpy(static_cast<void*>(static_cast<storage_t<C>*>(s.copy) + i), cb, r * sizeof(storage_t<C>));
    if constexpr (kStoreParam) std::memcpy(static_cast<void*>(p + i), pb, r * sizeof(PT));
    for (int k = 0; k < NS; ++k) std::memcpy(static_cast<void*>(st[k] + i), sb[k], r * sizeof(ST));
  }
}

// The update pass of an algorithm with a per-tensor factor (LAMB's and LARS's -lr * ratio):
// over every slot t, body(VecF& param, VecF grad, std::array<VecF, NS>& state, VecF factor)
// with factor = factors[t], the parameter and its half copy stored, the float32 state
// loaded and stored; kReadGrad false: no gradient is read (the body sees zeros).
template <int NS, bool kReadGrad, typename Body>
void update_with_factors(const Slots& slots, const std::vector<float>& factors, const Body& body) {
  parallel_over(slots, [&](int64_t t, int64_t b, int64_t e) {
    const TensorSlot& s = slots[t];
    const VecF factor = VecF::set1(factors[t]);
    dispatch_dtypes(s, [&](auto p, auto g, auto c) {
      using G = std::conditional_t<kReadGrad, decltype(g), None>;
      for_each_vec<NS, true, decltype(p), G, decltype(c), F32>(s, b, e,
          [&](VecF& pv, VecF gv, std::array<VecF, NS>& st) FASTOPT_ALWAYS_INLINE { body(pv, gv, st, factor); });
    });
  });
}

// Calls fn(tag) with the storage tag of a dtype.
template <typename Fn>
void dispatch_storage(DType d, const Fn& fn) {
  switch (d) {
    case DType::kFloat16: return fn(F16{});
    case DType::kBFloat16: return fn(BF16{});
    default: return fn(F32{});
  }
}

// Reads x[b:e) vector by vector (the tail zero-padded) and calls fn(VecF).
template <typename T, typename Fn>
inline void for_each_vec_read(const T* x, int64_t b, int64_t e, const Fn& fn) {
  constexpr int W = VecF::W;
  int64_t i = b;
  for (; i + W <= e; i += W) fn(VecF::load(x + i));
  if (i < e) {
    alignas(64) T buf[W];
    std::memset(static_cast<void*>(buf), 0, sizeof(buf));
    std::memcpy(static_cast<void*>(buf), x + i, (e - i) * sizeof(T));
    fn(VecF::load(buf));
  }
}

// Runs fn(walk, slot, b, e) for each piece of each slot, where walk(pb, pe, body) runs an
// element-wise body over [pb, pe) of that piece's slot with NS float32 states
// (kBf16State: or, with float32 params, bfloat16 ones as the slot says).
template <int NS, bool kBf16State, typename Fn>
void elementwise_pieces(const Slots& slots, const Fn& fn) {
  parallel_over(slots, [&](int64_t t, int64_t b, int64_t e) {
    const TensorSlot& s = slots[t];
    dispatch_dtypes(s, [&](auto p, auto g, auto c) {
      using P = decltype(p);
      auto with_state = [&](auto state) {
        auto walk = [&](int64_t pb, int64_t pe, const auto& body) {
          for_each_vec<NS, true, P, decltype(g), decltype(c), decltype(state)>(s, pb, pe, body);
        };
        fn(walk, s, b, e);
      };
      if constexpr (kBf16State && std::is_same_v<P, F32>) {
        if (s.state_dtype == DType::kBFloat16) return with_state(BF16{});
      }
      with_state(F32{});
    });
  });
}

// The common case: one body for every element.
template <int NS, bool kBf16State = false, typename Body>
void elementwise_step(const Slots& slots, const Body& body) {
  elementwise_pieces<NS, kBf16State>(slots, [&](const auto& walk, const TensorSlot&, int64_t b, int64_t e) {
    walk(b, e, body);
  });
}

// body for each slot's elements before split(slot), other from there on (a slot is a whole
// tensor here: the rules below are about tensors, as torch's kernels see them).
template <int NS, bool kBf16State = false, typename Split, typename Body, typename Other>
void elementwise_step_split(const Slots& slots, const Split& split, const Body& body, const Other& other) {
  elementwise_pieces<NS, kBf16State>(slots, [&](const auto& walk, const TensorSlot& s, int64_t b, int64_t e) {
    const int64_t from = split(s);
    if (b < std::min(e, from)) walk(b, std::min(e, from), body);
    if (std::max(b, from) < e) walk(std::max(b, from), e, other);
  });
}

// torch's CPU fused=True kernels (ATen/native/cpu/Fused{Adam,SGD}Kernel.cpp) split each
// tensor into tasks of whole cache lines and run a vector loop over each, then a scalar
// loop over what is left: the tensor's last numel % 8 elements (8 floats: the width of
// their AVX2 build, which torch runs on every x86 host with AVX2 -- it has no AVX-512 build
// of them), whatever the thread count.  GCC contracts the scalar loop's multiplies and adds
// otherwise than the vector intrinsics (read from libtorch_cpu.so's disassembly, torch 2.11
// and 2.13), so those elements round otherwise.
constexpr int64_t kTorchFusedWidth = 8;

// body for every element but each slot's last numel % kTorchFusedWidth, which get `tail`.
template <int NS, bool kBf16State = false, typename Body, typename Tail>
void elementwise_step_with_torch_tails(const Slots& slots, const Body& body, const Tail& tail) {
  elementwise_step_split<NS, kBf16State>(
      slots, [](const TensorSlot& s) { return s.numel - s.numel % kTorchFusedWidth; }, body, tail);
}

}  // namespace fastopt
