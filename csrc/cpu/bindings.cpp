// Python bindings of the CPU optimizer kernels.
//
// The only translation unit that sees torch tensors: it checks every tensor list
// (device, layout, dtype, size) and turns them into TensorSlots (../common/tensor_slots.h),
// releases the GIL and calls the kernels.  The optimizer functions' signatures are
// ../common/optimizer_bindings.h, shared with the CUDA module; this file gives them the
// CPU's policy.  The checks here are the last line of defence against memory corruption.
#include <optional>
#include <string>
#include <utility>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include "../common/optimizer_bindings.h"
#include "../common/tensor_slots.h"
#include "kernel_api.h"

namespace py = pybind11;

namespace fastopt {
namespace {

bool usable_on_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous();
}
constexpr const char* kCpuKind = "a dense, contiguous CPU tensor";

// Our OpenMP runtime may not be torch's (CUDA wheels ship a renamed libgomp), so give
// it torch's intra-op thread count, as set by torch.set_num_threads(), on every call.
void sync_threads() { omp_set_num_threads(std::max(1, at::get_num_threads())); }

// The kernels of each algorithm, for def_optimizer_functions.
struct CpuKernels {
  void adam(const Slots& s, const AdamArgs& a, bool /*bias_correction: in step_size already*/) const {
    for (const TensorSlot& slot : s)
      if (slot.state_dtype == DType::kBFloat16 && (a.amsgrad || slot.param_dtype != DType::kFloat32))
        throw py::type_error("bfloat16 Adam state needs float32 params (masters) and amsgrad=False");
    if (a.rounding != Rounding::kTorchCpu && a.rounding != Rounding::kTorchCpuFused && !adam_cuda_roundings_built())
      throw py::value_error("this build of the CPU kernels has no Adam in torch's CUDA roundings (built where no "
                            "GPU is visible): lightning_fastopt.ops loads the build that has them, "
                            "LIGHTNING_FASTOPT_CUDA_ROUNDINGS=1 makes it part of every full build");
    if (a.rounding == Rounding::kTorchCpuFused && !adam_cpu_fused_built())
      throw py::value_error("this build of the CPU kernels has no Adam in torch's CPU fused rounding (a build of "
                            "some pieces): lightning_fastopt.ops loads the build that has it");
    adam_step(s, a);
  }
  void sgd(const Slots& s, const SgdArgs& a) const {
    require_float32_state(s, "SGD");
    sgd_step(s, a);
  }
  void adagrad(const Slots& s, const AdagradArgs& a, double /*lr*/, double /*lr_decay: in clr already*/) const {
    require_float32_state(s, "Adagrad");
    adagrad_step(s, a);
  }
  void lion(const Slots& s, const LionArgs& a) const {
    require_float32_state(s, "Lion");
    lion_step(s, a);
  }
  void lamb(const Slots& s, const LambArgs& a, const LambDeviceClip& clip, bool /*bias_correction*/) const {
    if (clip.grad_sum_squares)
      throw py::value_error("grad_sum_squares is read on a CUDA device; the CPU kernels take the clipping "
                            "divisor in grad_factor");
    require_float32_state(s, "LAMB");
    lamb_step(s, a);
  }
  void lars(const Slots& s, const LarsArgs& a) const {
    require_float32_state(s, "LARS");
    lars_step(s, a);
  }
};

// The CPU's policy for ../common/optimizer_bindings.h.
struct CpuDevice {
  static constexpr bool reads_grad_factors = true;  // the kernels read TensorSlot::grad_factors
  static bool follows(Rounding) { return true; }

  static Slots slots(const TensorList& params, const TensorList* grads, const std::vector<const TensorList*>& states,
                     const OptTensorList& copies) {
    return make_slots(params, grads, states, copies, usable_on_cpu, kCpuKind);
  }

  // Runs `step` without the GIL unless check_finite finds an inf/NaN gradient, in which
  // case nothing is touched.  Returns true when the step was skipped.
  template <typename Step>
  static bool run(const TensorList&, const Slots& slots, bool check_finite, const ScalarTensors& scalars,
                  const Step& step) {
    if (scalars.any())
      throw py::value_error("grad_scale, found_inf, lr_tensor and step_tensor are read on a CUDA device; "
                            "the CPU kernels take these scalars as numbers");
    py::gil_scoped_release nogil;
    sync_threads();
    if (check_finite && !grads_all_finite(slots)) return true;
    step(CpuKernels{});
    return false;
  }
};

}  // namespace
}  // namespace fastopt

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fastopt;
  m.doc() = "lightning_fastopt CPU fused optimizer kernels";
  m.attr("isa") = compiled_isa();
  // what this build holds (ops/cpu.py builds some pieces only, where a run needs no more)
  py::list pieces;
#if FASTOPT_WITH_ADAM
  pieces.append("adam");
  if (adam_cpu_fused_built()) pieces.append("adam_cpu_fused");
  if (adam_cuda_roundings_built()) pieces.append("adam_cuda_roundings");
  m.attr("adam_cuda_roundings") = adam_cuda_roundings_built();
#else
  m.attr("adam_cuda_roundings") = false;
#endif
  for (const auto& [name, built] : {std::pair<const char*, bool>{"sgd", FASTOPT_WITH_SGD},
                                    {"adagrad", FASTOPT_WITH_ADAGRAD}, {"lion", FASTOPT_WITH_LION},
                                    {"lamb", FASTOPT_WITH_LAMB}, {"lars", FASTOPT_WITH_LARS}})
    if (built) pieces.append(name);
  m.attr("pieces") = pieces;
  // module-local: several builds (ISAs) of this module may be loaded in one process
  py::register_local_exception<UnsupportedTensor>(m, "UnsupportedTensor", PyExc_ValueError);

  m.def("all_finite", [](const TensorList& tensors) {
    Slots slots = CpuDevice::slots(tensors, &tensors, {}, std::nullopt);
    py::gil_scoped_release nogil;
    sync_threads();
    return grads_all_finite(slots);
  }, py::arg("tensors"), "True when every element of every tensor is finite");

  m.def("sum_squares", [](const TensorList& tensors) {
    Slots slots = CpuDevice::slots(tensors, nullptr, {}, std::nullopt);
    std::vector<double> out(slots.size());
    {
      py::gil_scoped_release nogil;
      sync_threads();
      sum_squares(slots, 1, out.data());
    }
    return out;
  }, py::arg("tensors"), "Per-tensor sum of squares, accumulated in double");

#if FASTOPT_WITH_LAMB
  m.def("lamb_norms_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                          const TensorList& exp_avg_sqs, float beta1, float beta2, float beta3, float eps,
                          float weight_decay, float bias_correction1, float bias_correction2, float grad_factor,
                          bool adam_w_mode, bool maximize) {
    const Slots slots = CpuDevice::slots(params, &grads, {&exp_avgs, &exp_avg_sqs}, std::nullopt);
    require_float32_state(slots, "LAMB");
    const LambArgs a{0.0f, beta1, beta2, beta3, eps, weight_decay, bias_correction1, bias_correction2, grad_factor,
                     adam_w_mode, true, maximize, beta1, beta2};
    at::Tensor out = at::empty({static_cast<int64_t>(slots.size()), 2}, at::kDouble);
    out.zero_();
    {
      py::gil_scoped_release nogil;
      sync_threads();
      lamb_norms(slots, a, out.data_ptr<double>());
    }
    return out;
  }, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("beta1"),
     py::arg("beta2"), py::arg("beta3"), py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction1"),
     py::arg("bias_correction2"), py::arg("grad_factor"), py::arg("adam_w_mode"), py::arg("maximize"),
     "Per tensor (||p||^2, ||u||^2) of the LAMB update lamb_ would make, nothing written (float64, [n, 2])");
#endif

  m.def("fingerprint", [](const TensorList& tensors) {
    Slots slots = CpuDevice::slots(tensors, nullptr, {}, std::nullopt);
    at::Tensor out = at::empty({static_cast<int64_t>(slots.size())}, at::kLong);
    {
      py::gil_scoped_release nogil;
      sync_threads();
      fingerprint(slots, out.data_ptr<int64_t>());
    }
    return out;
  }, py::arg("tensors"), "Per-tensor int64 fingerprints of the bits (torch_backend.fingerprint)");

  def_optimizer_functions<CpuDevice>(m);
}
