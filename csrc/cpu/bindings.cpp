// Python bindings of the CPU optimizer kernels.
//
// The only translation unit that sees torch tensors: it checks every tensor list
// (device, layout, dtype, size) and turns them into TensorSlots (../common/tensor_slots.h),
// releases the GIL and calls the kernels.  The Python layer (lightning_fastopt/ops/cpu.py)
// resolves the scalars and gives friendlier errors; the checks here are the last line of
// defence against memory corruption.
#include <optional>
#include <string>

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include "../common/tensor_slots.h"
#include "kernel_api.h"

namespace py = pybind11;

namespace fastopt {
namespace {

bool usable_on_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous();
}
constexpr const char* kCpuKind = "a dense, contiguous CPU tensor";

Slots cpu_slots(const TensorList& params, const TensorList* grads, const std::vector<const TensorList*>& states,
                const OptTensorList& copies) {
  return make_slots(params, grads, states, copies, usable_on_cpu, kCpuKind);
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

}  // namespace
}  // namespace fastopt

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fastopt;
  m.doc() = "lightning_fastopt CPU fused optimizer kernels";
  m.attr("isa") = compiled_isa();
  // module-local: several builds (ISAs) of this module may be loaded in one process
  py::register_local_exception<UnsupportedTensor>(m, "UnsupportedTensor", PyExc_ValueError);

  m.def("all_finite", [](const TensorList& tensors) {
    Slots slots = cpu_slots(tensors, &tensors, {}, std::nullopt);
    py::gil_scoped_release nogil;
    sync_threads();
    return grads_all_finite(slots);
  }, "True when every element of every tensor is finite");

  m.def("sum_squares", [](const TensorList& tensors) {
    Slots slots = cpu_slots(tensors, nullptr, {}, std::nullopt);
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
    Slots slots = cpu_slots(params, &grads, {&exp_avgs, &exp_avg_sqs, amsgrad ? opt_list(max_exp_avg_sqs) : &kNoTensors}, copies);
    AdamArgs a{lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, inv_grad_scale,
               amsgrad, adamw, maximize};
    return guarded(slots, check_finite, [&] { adam_step(slots, a); });
  });

  m.def("sgd_", [](const TensorList& params, const TensorList& grads, const OptTensorList& momentum_buffers,
                   const OptTensorList& copies, float lr, float momentum, float dampening, float weight_decay,
                   float inv_grad_scale, bool nesterov, bool maximize, bool wd_after_momentum, bool first_step,
                   bool check_finite) {
    if (momentum != 0.0f && !momentum_buffers) throw py::value_error("momentum needs momentum_buffers");
    Slots slots = cpu_slots(params, &grads, {momentum != 0.0f ? opt_list(momentum_buffers) : &kNoTensors}, copies);
    SgdArgs a{lr, momentum, dampening, weight_decay, inv_grad_scale, nesterov, maximize, wd_after_momentum, first_step};
    return guarded(slots, check_finite, [&] { sgd_step(slots, a); });
  });

  m.def("adagrad_", [](const TensorList& params, const TensorList& grads, const TensorList& state_sums,
                       const OptTensorList& copies, float clr, float weight_decay, float eps,
                       float inv_grad_scale, bool maximize, bool check_finite) {
    Slots slots = cpu_slots(params, &grads, {&state_sums}, copies);
    AdagradArgs a{clr, weight_decay, eps, inv_grad_scale, maximize};
    return guarded(slots, check_finite, [&] { adagrad_step(slots, a); });
  });

  m.def("lion_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const OptTensorList& copies, float lr, float beta1, float beta2, float weight_decay,
                    float inv_grad_scale, bool maximize, bool check_finite) {
    Slots slots = cpu_slots(params, &grads, {&exp_avgs}, copies);
    LionArgs a{lr, beta1, beta2, weight_decay, inv_grad_scale, maximize};
    return guarded(slots, check_finite, [&] { lion_step(slots, a); });
  });

  m.def("lamb_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const OptTensorList& copies, float lr, float beta1,
                    float beta2, float beta3, float eps, float weight_decay, float bias_correction1,
                    float bias_correction2, float grad_factor, bool adam_w_mode, bool use_trust_ratio,
                    bool maximize) {
    Slots slots = cpu_slots(params, &grads, {&exp_avgs, &exp_avg_sqs}, copies);
    LambArgs a{lr, beta1, beta2, beta3, eps, weight_decay, bias_correction1, bias_correction2, grad_factor,
               adam_w_mode, use_trust_ratio, maximize};
    py::gil_scoped_release nogil;
    sync_threads();
    lamb_step(slots, a);
  });

  m.def("lars_", [](const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
                    const OptTensorList& copies, float lr, float momentum, float eeta, float weight_decay,
                    float epsilon, float inv_grad_scale, bool maximize, bool check_finite) {
    Slots slots = cpu_slots(params, &grads, {&momentum_buffers}, copies);
    LarsArgs a{lr, momentum, eeta, weight_decay, epsilon, inv_grad_scale, maximize};
    return guarded(slots, check_finite, [&] { lars_step(slots, a); });
  });
}
