// Reductions over many tensors, reading only the array reduced: the finite check of the
// gradients (for loss scaling) and per-tensor sums of squares (clipping, LAMB, LARS).
#include <atomic>

#include "tensor_walk.h"

namespace fastopt {

namespace {
constexpr int64_t kBlock = 4096;  // float accumulation per block, double across blocks

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
    for (int64_t blk = b; blk < e; blk += kBlock) {
      VecF acc = VecF::zero();
      for_each_vec_read(x, blk, std::min(e, blk + kBlock), [&](VecF v) { acc = VecF::fmadd(v, v, acc); });
      total += acc.sum();
    }
  });
  return total;
}

bool grads_all_finite(const Slots& slots) {
  std::atomic<bool> finite{true};
  parallel_over(slots, [&](int64_t t, int64_t b, int64_t e) {
    if (!finite.load(std::memory_order_relaxed)) return;
    dispatch_storage(slots[t].grad_dtype, [&](auto tag) {
      const auto* x = static_cast<const storage_t<decltype(tag)>*>(slots[t].grad);
      // v * 0 is 0 for finite v and NaN for inf or NaN: the sum stays 0 only if all are finite.
      VecF acc = VecF::zero();
      const VecF zero = VecF::zero();
      for_each_vec_read(x, b, e, [&](VecF v) { acc = VecF::fmadd(v, zero, acc); });
      if (!(acc.sum() == 0.0f)) finite.store(false, std::memory_order_relaxed);
    });
  });
  return finite.load();
}

void sum_squares(const Slots& slots, int which, double* out) {
  parallel_sum_per_slot(slots, out, [&](int64_t t, int64_t b, int64_t e) {
    return piece_sum_squares(slots[t], which, b, e);
  });
}

const char* compiled_isa() { return isa_name(); }

}  // namespace fastopt
