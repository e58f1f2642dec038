// The interface between the Python bindings (bindings.cpp) and the CUDA kernels.
//
// Like the CPU side, the kernel files see raw device pointers only (the TensorSlot and the
// argument structs of ../common), never torch's headers: each .cu file compiles in seconds.  Every function enqueues its kernels on `stream` and returns
// without waiting for them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/kernel_args.h"
#include "../common/kernel_types.h"

namespace fastopt {
namespace cuda {

// Optional device-resident scalars.  A kernel reads them on the device, so a step that
// uses them never synchronises with the host and can be captured in a CUDA graph.
struct DeviceScalars {
  const float* grad_scale = nullptr;  // gradients are divided by *grad_scale (overrides inv_grad_scale)
  const float* found_inf = nullptr;   // *found_inf != 0: the launch changes nothing at all
  const float* lr = nullptr;          // the learning rate (used together with `step`)
  const float* step = nullptr;        // the step number after this update: bias corrections on the device
};

// Chunks of all slots together: the size (in pairs of floats) of the `partials` workspace
// that the two-pass algorithms and the reductions need.
int64_t total_chunks(const Slots& slots);

// ---------------------------------------------------------------- element-wise algorithms
// The scalars mean what they mean on the CPU (kernel_api.h).  With DeviceScalars::step set,
// the step-dependent scalars (Adam's step_size and bias_correction2_sqrt, Adagrad's clr)
// are recomputed on the device from lr, the betas and the step.
void adam_step(const Slots& slots, const AdamArgs& a, bool bias_correction, const DeviceScalars& d,
               cudaStream_t stream);
void sgd_step(const Slots& slots, const SgdArgs& a, const DeviceScalars& d, cudaStream_t stream);
void adagrad_step(const Slots& slots, const AdagradArgs& a, double lr, double lr_decay, const DeviceScalars& d,
                  cudaStream_t stream);
void lion_step(const Slots& slots, const LionArgs& a, const DeviceScalars& d, cudaStream_t stream);

// ---------------------------------------------------------------- two-pass algorithms
// LAMB.  `grad_sum_squares` (optional, device): the sum of squares of every gradient that
// global clipping sees, still loss-scaled; when given, the clipping divisor and the
// unscaling are computed on the device (max_grad_norm, DeviceScalars::grad_scale) instead
// of taken from a.grad_factor.  `partials`: 2 * total_chunks(slots) floats.
struct LambClip {
  const double* grad_sum_squares = nullptr;
  float max_grad_norm = 0.0f;
  float inv_grad_scale = 1.0f;  // used with grad_sum_squares when DeviceScalars::grad_scale is null
};
void lamb_step(const Slots& slots, const LambArgs& a, const LambClip& clip, bool bias_correction,
               const DeviceScalars& d, float* partials, cudaStream_t stream);
// LARS.  `partials`: 2 * total_chunks(slots) floats.
void lars_step(const Slots& slots, const LarsArgs& a, const DeviceScalars& d, float* partials,
               cudaStream_t stream);

// ---------------------------------------------------------------- reductions
// Per-slot sums of squares of the gradients (which = 0) or the parameters (which = 1),
// summed in float within a chunk and in double across chunks, in a fixed order (the
// result does not depend on timing).  `per_slot` (device, slots.size() doubles) and
// `total` (device, one double, may be null) are written; `partials`: total_chunks floats.
void sum_squares(const Slots& slots, int which, float* partials, double* per_slot, double* total,
                 cudaStream_t stream);
// Sets *found_inf = 1 when any gradient element is inf or NaN (leaves it alone otherwise).
void check_finite(const Slots& slots, float* found_inf, cudaStream_t stream);
// Multiplies every gradient by 1 / *grad_scale (or inv_grad_scale when grad_scale is null)
// in place, and sets *found_inf = 1 when any element was inf or NaN.
void unscale(const Slots& slots, float inv_grad_scale, const float* grad_scale, float* found_inf,
             cudaStream_t stream);

// Per-slot fingerprints of the parameters' bits (`per_slot`: device, slots.size() int64):
// the sum, wrapping at 2^64, of SplitMix64(bits ^ (index << 32)) over each tensor's
// elements, as lightning_fastopt.ops.torch_backend.fingerprint defines it.
void fingerprint(const Slots& slots, int64_t* per_slot, cudaStream_t stream);

}  // namespace cuda
}  // namespace fastopt
