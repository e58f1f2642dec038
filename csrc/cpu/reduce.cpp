// Reductions over many tensors, reading only the array reduced: the finite check of the
// gradients (for loss scaling) and per-tensor sums of squares (clipping, LAMB, LARS).
#include <atomic>

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

const char* compiled_isa() { return isa_name(); }

}  // namespace fastopt
