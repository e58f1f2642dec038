// Reductions over many tensors, reading only the array reduced: the finite check of the
// gradients (for loss scaling), per-tensor sums of squares (clipping, LAMB, LARS), and the
// fingerprints that notice writes to the weights (lightning_fastopt.offload.weight_watch).
#include <atomic>
#include <memory>

#include "tensor_walk.h"

namespace fastopt {

namespace {
// The array a reduction reads: the gradient (which == 0) or the parameter.
inline std::pair<const void*, DType> reduced_array(const TensorSlot& s, int which) {
  return which == 0 ? std::make_pair(s.grad, s.grad_dtype)
                    : std::make_pair(static_cast<const void*>(s.param), s.param_dtype);
}
}  // namespace

double piece_sum_squares(const TensorSlot& s, int which, int64_t b, int64_t e) {
  const auto [ptr, dtype] = reduced_array(s, which);
  double total = 0.0;
  dispatch_storage(dtype, [&](auto tag) {
    const auto* x = static_cast<const storage_t<decltype(tag)>*>(ptr);
    for (int64_t blk = b; blk < e; blk += kSumBlock) {
      VecF acc = VecF::zero();
      for_each_vec_read(x, blk, std::min(e, blk + kSumBlock), [&](VecF v) { acc = VecF::fmadd(v, v, acc); });
      total += acc.sum();
    }
  });
  return total;
}

// An element is inf or NaN exactly when its exponent bits are all ones: test the raw
// bits with integer ops (no float conversion, no dependency chain) and OR the results;
// the compiler vectorises this loop for every instruction set.
template <typename Bits, Bits kExpMask>
bool bits_all_finite(const void* ptr, int64_t b, int64_t e) {
  const Bits* x = static_cast<const Bits*>(ptr);
  Bits bad = 0;
  for (int64_t i = b; i < e; ++i) bad |= static_cast<Bits>((x[i] & kExpMask) == kExpMask);
  return bad == 0;
}

bool piece_all_finite(const TensorSlot& s, int64_t b, int64_t e) {
  switch (s.grad_dtype) {
    case DType::kFloat16: return bits_all_finite<uint16_t, 0x7C00>(s.grad, b, e);
    case DType::kBFloat16: return bits_all_finite<uint16_t, 0x7F80>(s.grad, b, e);
    default: return bits_all_finite<uint32_t, 0x7F800000u>(s.grad, b, e);
  }
}

bool grads_all_finite(const Slots& slots) {
  std::atomic<bool> finite{true};
  parallel_over(slots, [&](int64_t t, int64_t b, int64_t e) {
    if (finite.load(std::memory_order_relaxed) && !piece_all_finite(slots[t], b, e))
      finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

void sum_squares(const Slots& slots, int which, double* out) {
  parallel_sums_per_slot<1>(slots, out, [&](int64_t t, int64_t b, int64_t e) {
    return std::array<double, 1>{piece_sum_squares(slots[t], which, b, e)};
  });
}

namespace {
// SplitMix64's finalizer: a bijection of 64-bit words that spreads every input bit.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The sum (mod 2^64) of mix64(bits ^ (index << 32)) over elements [b, e) of one tensor.
template <typename Bits>
uint64_t piece_fingerprint(const void* ptr, int64_t b, int64_t e) {
  const Bits* x = static_cast<const Bits*>(ptr);
  uint64_t acc = 0;
  for (int64_t i = b; i < e; ++i) acc += mix64(static_cast<uint64_t>(x[i]) ^ (static_cast<uint64_t>(i) << 32));
  return acc;
}
}  // namespace

void fingerprint(const Slots& slots, int64_t* out) {
  const size_t n = slots.size();
  std::unique_ptr<std::atomic<uint64_t>[]> sums(new std::atomic<uint64_t>[n]);
  for (size_t t = 0; t < n; ++t) sums[t].store(0, std::memory_order_relaxed);
  parallel_over(slots, [&](int64_t t, int64_t b, int64_t e) {
    const TensorSlot& s = slots[t];
    const uint64_t piece = s.param_dtype == DType::kFloat32 ? piece_fingerprint<uint32_t>(s.param, b, e)
                                                            : piece_fingerprint<uint16_t>(s.param, b, e);
    sums[t].fetch_add(piece, std::memory_order_relaxed);  // integer sums: any order gives the same bits
  });
  for (size_t t = 0; t < n; ++t) out[t] = static_cast<int64_t>(sums[t].load());
}

const char* compiled_isa() { return isa_name(); }

}  // namespace fastopt
