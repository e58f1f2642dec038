// Python bindings of the CPU optimizer kernels.
//
// The only translation unit that sees torch tensors: it checks every tensor list
// (device, layout, dtype, size), turns them into TensorSlots, releases the GIL and calls
// the kernels.  The Python layer (lightning_fastopt/ops/cpu.py) resolves the scalars and
// gives friendlier errors; the checks here are the last line of defence against memory
// corruption.
#include <optional>
#include <string>

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include "kernel_api.h"

namespace py = pybind11;
using TensorList = std::vector<at::Tensor>;
using OptTensorList = std::optional<TensorList>;

namespace fastopt {

// A tensor the kernels do not take (not CPU, not strided, not contiguous); Python catches
// it (before anything was modified) and uses the pure-PyTorch backend for that call.
struct UnsupportedTensor : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace {

DType to_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      throw py::type_error(std::string(what) + " must be float32, float16 or bfloat16, got " +
                           std::string(c10::toString(t.scalar_type())));
  }
}

void check_dense(const at::Tensor& t, const char* what, size_t i, int64_t numel) {
  if (!t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous())
    throw UnsupportedTensor(std::string(what) + "[" + std::to_string(i) +
                            "] is not a dense, contiguous CPU tensor");
  if (t.numel() != numel)
    throw py::value_error(std::string(what) + "[" + std::to_string(i) + "] has " +
                          std::to_string(t.numel()) + " elements, expected " + std::to_string(numel));
}

// Builds the slots of one call.  `states` are float32 lists of the same length as
// params (an empty list means "not used"); `copies` are fp16/bf16 tensors written with
// the updated float32 parameters.
Slots make_slots(const TensorList& params, const TensorList* grads, const std::vector<const TensorList*>& states,
                 const OptTensorList& copies) {
  const size_t n = params.size();
  if (grads && grads->size() != n) throw py::value_error("grads must have as many tensors as params");
  for (const TensorList* s : states)
    if (!s->empty() && s->size() != n) throw py::value_error("every state list must match params in length");
  if (copies && copies->size() != n) throw py::value_error("param_copies must match params in length");
  Slots slots(n);
  for (size_t i = 0; i < n; ++i) {
    TensorSlot& slot = slots[i];
    const at::Tensor& p = params[i];
    slot.numel = p.numel();
    check_dense(p, "params", i, slot.numel);
    slot.param = p.data_ptr();
    slot.param_dtype = to_dtype(p, "params");
    if (grads) {
      const at::Tensor& g = (*grads)[i];
      check_dense(g, "grads", i, slot.numel);
      slot.grad = g.data_ptr();
      slot.grad_dtype = to_dtype(g, "grads");
      if (slot.param_dtype != DType::kFloat32 && slot.grad_dtype != DType::kFloat32 &&
          slot.grad_dtype != slot.param_dtype)
        throw py::type_error("a half-precision parameter needs a gradient of its own dtype or float32");
    }
    for (size_t k = 0; k < states.size(); ++k) {
      if (states[k]->empty()) continue;
      const at::Tensor& s = (*states[k])[i];
      check_dense(s, "optimizer state", i, slot.numel);
      if (s.scalar_type() != at::kFloat) throw py::type_error("optimizer state must be float32");
      slot.state[k] = s.data_ptr<float>();
    }
    if (copies) {
      const at::Tensor& c = (*copies)[i];
      check_dense(c, "param_copies", i, slot.numel);
      slot.copy_dtype = to_dtype(c, "param_copies");
      if (slot.copy_dtype == DType::kFloat32 || slot.param_dtype != DType::kFloat32)
        throw py::type_error("param_copies must be float16/bfloat16 copies of float32 params");
      slot.copy = c.data_ptr();
    }
  }
  return slots;
}

// Our OpenMP runtime may not be torch's (CUDA wheels ship a renamed libgomp), so give
// it torch's intra-op thread count, as set by torch.set_num_threads(), on every call.
void sync_threads() { omp_set_num_threads(std::max(1, at::get_num_threads())); }

// Runs `step` without the GIL unless check_finite finds an inf/NaN gradient, in which
// case nothing is touched.  Returns true when the step was skipped.
template <typename Step>
bool guarded(const Slots& slots, bool check_finite, const Step& step) {
  py::gil_scoped_release nogil;
  sync_threads();
  if (check_finite && !grads_all_finite(slots)) return true;
  step();
  return false;
}

const TensorList kEmpty;
const TensorList* opt_list(const OptTensorList& l) { return l ? &*l : &kEmpty; }

}  // namespace
}  // namespace fastopt

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fastopt;
  m.doc() = "lightning_fastopt CPU fused optimizer kernels";
  m.attr("isa") = compiled_isa();
  // module-local: several builds (ISAs) of this module may be loaded in one process
  py::register_local_exception<UnsupportedTensor>(m, "UnsupportedTensor", PyExc_ValueError);

  m.def("all_finite", [](const TensorList& tensors) {
    Slots slots = make_slots(tensors, &tensors, {}, std::nullopt);
    py::gil_scoped_release nogil;
    sync_threads();
    return grads_all_finite(slots);
  }, "True when every element of every tensor is finite");

  m.def("sum_squares", [](const TensorList& tensors) {
    Slots slots = make_slots(tensors, nullptr, {}, std::nullopt);
    std::vector<double> out(slots.size());
    {
      py::gil_scoped_release nogil;
      sync_threads();
      sum_squares(slots, 1, out.data());
    }
    return out;
  }, "Per-tensor sum of squares, accumulated in double");

  m.def("adam_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const OptTensorList& max_exp_avg_sqs,
                    const OptTensorList& copies, float lr, float beta1, float beta2, float eps,
                    float weight_decay, float step_size, float bias_correction2_sqrt, float inv_grad_scale,
                    bool amsgrad, bool adamw, bool maximize, bool check_finite) {
    if (amsgrad && !max_exp_avg_sqs) throw py::value_error("amsgrad needs max_exp_avg_sqs");
    Slots slots = make_slots(params, &grads, {&exp_avgs, &exp_avg_sqs, amsgrad ? opt_list(max_exp_avg_sqs) : &kEmpty}, copies);
    AdamArgs a{lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, inv_grad_scale,
               amsgrad, adamw, maximize};
    return guarded(slots, check_finite, [&] { adam_step(slots, a); });
  });

  m.def("sgd_", [](const TensorList& params, const TensorList& grads, const OptTensorList& momentum_buffers,
                   const OptTensorList& copies, float lr, float momentum, float dampening, float weight_decay,
                   float inv_grad_scale, bool nesterov, bool maximize, bool wd_after_momentum, bool first_step,
                   bool check_finite) {
    if (momentum != 0.0f && !momentum_buffers) throw py::value_error("momentum needs momentum_buffers");
    Slots slots = make_slots(params, &grads, {momentum != 0.0f ? opt_list(momentum_buffers) : &kEmpty}, copies);
    SgdArgs a{lr, momentum, dampening, weight_decay, inv_grad_scale, nesterov, maximize, wd_after_momentum, first_step};
    return guarded(slots, check_finite, [&] { sgd_step(slots, a); });
  });

  m.def("adagrad_", [](const TensorList& params, const TensorList& grads, const TensorList& state_sums,
                       const OptTensorList& copies, float clr, float weight_decay, float eps,
                       float inv_grad_scale, bool maximize, bool check_finite) {
    Slots slots = make_slots(params, &grads, {&state_sums}, copies);
    AdagradArgs a{clr, weight_decay, eps, inv_grad_scale, maximize};
    return guarded(slots, check_finite, [&] { adagrad_step(slots, a); });
  });

  m.def("lion_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const OptTensorList& copies, float lr, float beta1, float beta2, float weight_decay,
                    float inv_grad_scale, bool maximize, bool check_finite) {
    Slots slots = make_slots(params, &grads, {&exp_avgs}, copies);
    LionArgs a{lr, beta1, beta2, weight_decay, inv_grad_scale, maximize};
    return guarded(slots, check_finite, [&] { lion_step(slots, a); });
  });

  m.def("lamb_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const OptTensorList& copies, float lr, float beta1,
                    float beta2, float beta3, float eps, float weight_decay, float bias_correction1,
                    float bias_correction2, float grad_factor, bool adam_w_mode, bool use_trust_ratio,
                    bool maximize) {
    Slots slots = make_slots(params, &grads, {&exp_avgs, &exp_avg_sqs}, copies);
    LambArgs a{lr, beta1, beta2, beta3, eps, weight_decay, bias_correction1, bias_correction2, grad_factor,
               adam_w_mode, use_trust_ratio, maximize};
    py::gil_scoped_release nogil;
    sync_threads();
    lamb_step(slots, a);
  });

  m.def("lars_", [](const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
                    const OptTensorList& copies, float lr, float momentum, float eeta, float weight_decay,
                    float epsilon, float inv_grad_scale, bool maximize, bool check_finite) {
    Slots slots = make_slots(params, &grads, {&momentum_buffers}, copies);
    LarsArgs a{lr, momentum, eeta, weight_decay, epsilon, inv_grad_scale, maximize};
    return guarded(slots, check_finite, [&] { lars_step(slots, a); });
  });
}
