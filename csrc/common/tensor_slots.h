// Turning lists of torch tensors into the kernels' TensorSlots, checked: shared by the CPU
// bindings (../cpu/bindings.cpp) and the CUDA bindings (../cuda/bindings.cpp), which differ
// only in which tensors they take (`usable`).  A tensor that is not usable raises
// UnsupportedTensor before anything is modified; Python then runs the pure-PyTorch path.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/utils/pybind.h>

#include "kernel_types.h"

namespace fastopt {

using TensorList = std::vector<at::Tensor>;
using OptTensorList = std::optional<TensorList>;

struct UnsupportedTensor : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline DType to_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      throw pybind11::type_error(std::string(what) + " must be float32, float16 or bfloat16, got " +
                                 std::string(c10::toString(t.scalar_type())));
  }
}

// usable(t) says whether the kernels can read and write t in place; `kind` names those
// tensors in the message ("a dense, contiguous CPU tensor").
template <typename Usable>
void check_tensor(const at::Tensor& t, const char* what, size_t i, int64_t numel, const Usable& usable,
                  const char* kind) {
  if (!usable(t)) throw UnsupportedTensor(std::string(what) + "[" + std::to_string(i) + "] is not " + kind);
  if (t.numel() != numel)
    throw pybind11::value_error(std::string(what) + "[" + std::to_string(i) + "] has " +
                                std::to_string(t.numel()) + " elements, expected " + std::to_string(numel));
}

// The slots of one call.  `states` are float32 (or, for a kernel that takes them,
// bfloat16) lists of the same length as params (an empty list means "not used"); `copies` are fp16/bf16 tensors written with the updated
// float32 parameters.
template <typename Usable>
Slots make_slots(const TensorList& params, const TensorList* grads, const std::vector<const TensorList*>& states,
                 const OptTensorList& copies, const Usable& usable, const char* kind) {
  const size_t n = params.size();
  if (grads && grads->size() != n) throw pybind11::value_error("grads must have as many tensors as params");
  for (const TensorList* s : states)
    if (!s->empty() && s->size() != n) throw pybind11::value_error("every state list must match params in length");
  if (copies && copies->size() != n) throw pybind11::value_error("param_copies must match params in length");
  Slots slots(n);
  for (size_t i = 0; i < n; ++i) {
    TensorSlot& slot = slots[i];
    const at::Tensor& p = params[i];
    slot.numel = p.numel();
    check_tensor(p, "params", i, slot.numel, usable, kind);
    slot.param = p.data_ptr();
    slot.param_dtype = to_dtype(p, "params");
    if (grads) {
      const at::Tensor& g = (*grads)[i];
      check_tensor(g, "grads", i, slot.numel, usable, kind);
      slot.grad = g.data_ptr();
      slot.grad_dtype = to_dtype(g, "grads");
      if (slot.param_dtype != DType::kFloat32 && slot.grad_dtype != DType::kFloat32 &&
          slot.grad_dtype != slot.param_dtype)
        throw pybind11::type_error("a half-precision parameter needs a gradient of its own dtype or float32");
    }
    bool typed = false;  // state_dtype set by an earlier state of this slot
    for (size_t k = 0; k < states.size(); ++k) {
      if (states[k]->empty()) continue;
      const at::Tensor& s = (*states[k])[i];
      check_tensor(s, "optimizer state", i, slot.numel, usable, kind);
      const DType d = s.scalar_type() == at::kFloat ? DType::kFloat32
                      : s.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kNone;
      if (d == DType::kNone) throw pybind11::type_error("optimizer state must be float32 (or bfloat16: Adam on the CPU)");
      if (typed && d != slot.state_dtype) throw pybind11::type_error("a parameter's optimizer states must share a dtype");
      slot.state_dtype = d;
      typed = true;
      slot.state[k] = static_cast<float*>(s.data_ptr());  // bfloat16 elements when state_dtype says so
    }
    if (copies) {
      const at::Tensor& c = (*copies)[i];
      check_tensor(c, "param_copies", i, slot.numel, usable, kind);
      slot.copy_dtype = to_dtype(c, "param_copies");
      if (slot.copy_dtype == DType::kFloat32 || slot.param_dtype != DType::kFloat32)
        throw pybind11::type_error("param_copies must be float16/bfloat16 copies of float32 params");
      slot.copy = c.data_ptr();
    }
  }
  return slots;
}

// For the kernels that keep float32 state only (every one but the CPU's Adam).
inline void require_float32_state(const Slots& slots, const char* algorithm) {
  for (const TensorSlot& s : slots)
    if (s.state_dtype != DType::kFloat32)
      throw pybind11::type_error(std::string(algorithm) + " keeps float32 optimizer state; bfloat16 state is for "
                                 "Adam on the CPU");
}

inline const TensorList kNoTensors;
inline const TensorList* opt_list(const OptTensorList& l) { return l ? &*l : &kNoTensors; }

}  // namespace fastopt
