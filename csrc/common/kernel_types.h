// The vocabulary every kernel and binding shares, CPU and CUDA alike: the element types,
// the tensor slot (one parameter and everything updated with it, as raw pointers), and
// the macro that makes a function host-and-device code under nvcc.
//
// Free of torch's and CUDA's headers: kernel files include it and compile in seconds,
// and the host checks in tests/cpp compile it with a plain C++ compiler.
#pragma once

#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define FASTOPT_HOST_DEVICE __host__ __device__
#else
#define FASTOPT_HOST_DEVICE
#endif

namespace fastopt {

enum class DType : int8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kNone = 3 };

// One parameter tensor and everything updated with it.  All tensors of a slot have
// `numel` elements and are contiguous.  Optimizer state is float32; `state[k]` is null
// when that state is not used by the call (e.g. no amsgrad maximum).  The CPU's Adam
// also keeps it in bfloat16 (`state_dtype`; `state[k]` then points at bfloat16 elements),
// stored with stochastic rounding whose noise derives from `state_seed` (this step's),
// the state's index and the element's index in its whole tensor (stochastic_round.h):
// `index_base` plus its index here, where the slot is a piece of a larger tensor.
struct TensorSlot {
  void* param = nullptr;
  const void* grad = nullptr;
  void* copy = nullptr;  // optional fp16/bf16 copy of the updated parameter
  float* state[3] = {nullptr, nullptr, nullptr};
  int64_t numel = 0;
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  DType copy_dtype = DType::kNone;
  DType state_dtype = DType::kFloat32;
  uint32_t state_seed = 0;
  uint32_t index_base = 0;  // the whole tensor's index of element 0 (modulo 2**32, as the noise takes it)
  // Factors the gradient is multiplied by before the algorithm reads it, in order, each
  // product rounded to the gradient's dtype: what multiplying it in place by each would
  // leave (clipping's coefficient, torch._foreach_mul_), read in the pass that reads the
  // gradient anyway instead of a pass of its own.  CPU kernels only; none by default.
  const float* grad_factors = nullptr;
  int32_t grad_factor_count = 0;
};
using Slots = std::vector<TensorSlot>;

}  // namespace fastopt
