// The interface between the Python bindings and the CPU optimizer kernels (the types and
// argument structs they share with the CUDA side live in ../common).
//
// Deliberately free of torch's tensor headers: the bindings (bindings.cpp) turn tensors
// into `TensorSlot`s after checking them, and every kernel file only sees raw pointers.
// This keeps each kernel translation unit at a few seconds of compile time.
#pragma once

#include <cstdint>

#include "../common/kernel_args.h"
#include "../common/kernel_types.h"

namespace fastopt {

// ---------------------------------------------------------------- reductions
// True when every gradient element of every slot is finite.
bool grads_all_finite(const Slots& slots);
// Sum of squares per slot, of the gradient (which=0) or the parameter (which=1),
// accumulated in double.  `out` has slots.size() entries.
void sum_squares(const Slots& slots, int which, double* out);
// Per-slot fingerprints of the parameters' bits: the sum, wrapping at 2^64, of
// SplitMix64(bits ^ (index << 32)) over each tensor's elements, as
// lightning_fastopt.ops.torch_backend.fingerprint defines it.  `out`: slots.size() entries.
void fingerprint(const Slots& slots, int64_t* out);

// ---------------------------------------------------------------- algorithms
// The argument structs, and the state each algorithm updates, are in ../common/kernel_args.h.
void adam_step(const Slots& slots, const AdamArgs& a);
// Whether this build has Adam in torch's CUDA roundings (adam.cpp: built without them
// where no GPU is visible); adam_step must not be called with one when it has not.
bool adam_cuda_roundings_built();
// Whether this build has Adam in torch's CPU fused=True rounding (adam_cpu_fused.cpp; a build
// of some pieces only may leave it out); likewise.
bool adam_cpu_fused_built();
void sgd_step(const Slots& slots, const SgdArgs& a);
void adagrad_step(const Slots& slots, const AdagradArgs& a);
void lion_step(const Slots& slots, const LionArgs& a);
void lamb_step(const Slots& slots, const LambArgs& a);
// per slot (||p||^2, ||u||^2) of the step lamb_step would take, into sums[2t], sums[2t + 1]; nothing written
void lamb_norms(const Slots& slots, const LambArgs& a, double* sums);
void lars_step(const Slots& slots, const LarsArgs& a);

const char* compiled_isa();

}  // namespace fastopt
