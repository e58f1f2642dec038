// The interface between the Python bindings and the CPU optimizer kernels.
//
// Deliberately free of torch's tensor headers: the bindings (bindings.cpp) turn tensors
// into `TensorSlot`s after checking them, and every kernel file only sees raw pointers.
// This keeps each kernel translation unit at a few seconds of compile time.
#pragma once

#include <cstdint>
#include <vector>

namespace fastopt {

enum class DType : int8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kNone = 3 };

// One parameter tensor and everything updated with it.  All tensors of a slot have
// `numel` elements and are contiguous.  Optimizer state is always float32; `state[k]`
// is null when that state is not used by the call (e.g. no amsgrad maximum).
struct TensorSlot {
  void* param = nullptr;
  const void* grad = nullptr;
  void* copy = nullptr;  // optional fp16/bf16 copy of the updated parameter
  float* state[3] = {nullptr, nullptr, nullptr};
  int64_t numel = 0;
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  DType copy_dtype = DType::kNone;
};
using Slots = std::vector<TensorSlot>;

// ---------------------------------------------------------------- reductions
// True when every gradient element of every slot is finite.
bool grads_all_finite(const Slots& slots);
// Sum of squares per slot, of the gradient (which=0) or the parameter (which=1),
// accumulated in double.  `out` has slots.size() entries.
void sum_squares(const Slots& slots, int which, double* out);

// ---------------------------------------------------------------- algorithms
// All scalars are already resolved by the caller (bias corrections, unscaling factor).
struct AdamArgs {
  float lr, beta1, beta2, eps, weight_decay;
  float step_size;              // lr / bias_correction1
  float bias_correction2_sqrt;  // sqrt(bias_correction2)
  float inv_grad_scale;         // 1 / loss scale (1 when unscaled)
  bool amsgrad, adamw, maximize;
};
// state: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad only)
void adam_step(const Slots& slots, const AdamArgs& a);

struct SgdArgs {
  float lr, momentum, dampening, weight_decay, inv_grad_scale;
  bool nesterov, maximize, wd_after_momentum;
  bool first_step;  // the momentum buffer is initialised from the gradient (torch semantics)
};
// state: momentum_buffer (momentum != 0 only)
void sgd_step(const Slots& slots, const SgdArgs& a);

struct AdagradArgs {
  float clr, weight_decay, eps, inv_grad_scale;  // clr = lr / (1 + (step - 1) * lr_decay)
  bool maximize;
};
// state: sum
void adagrad_step(const Slots& slots, const AdagradArgs& a);

struct LionArgs {
  float lr, beta1, beta2, weight_decay, inv_grad_scale;
  bool maximize;
};
// state: exp_avg
void lion_step(const Slots& slots, const LionArgs& a);

struct LambArgs {
  float lr, beta1, beta2, beta3, eps, weight_decay;
  float bias_correction1, bias_correction2;
  float grad_factor;  // 1 / (loss scale * clipping divisor)
  bool adam_w_mode, use_trust_ratio, maximize;
};
// state: exp_avg, exp_avg_sq
void lamb_step(const Slots& slots, const LambArgs& a);

struct LarsArgs {
  float lr, momentum, eeta, weight_decay, epsilon, inv_grad_scale;
  bool maximize;
};
// state: momentum_buffer
void lars_step(const Slots& slots, const LarsArgs& a);

const char* compiled_isa();

}  // namespace fastopt
