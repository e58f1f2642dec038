// Python bindings of the CUDA optimizer kernels.
//
// The optimizer functions are ../common/optimizer_bindings.h, shared with the CPU module
// (same names, arguments and checks, so lightning_fastopt.functional calls either alike);
// this file gives them the CUDA policy, which reads the keyword-only device scalars that
// make a step free of host synchronisation (and capturable in a CUDA graph):
//   grad_scale   float32 [1]: gradients are divided by it (torch.amp's GradScaler.scale)
//   found_inf    float32 [1]: when nonzero the call changes nothing (GradScaler's flag)
//   lr_tensor, step_tensor   float32 [1]: the learning rate and the step number after this
//                update, read on the device (bias corrections computed there)
// Every kernel is enqueued on torch's current stream of the tensors' device.
#include <optional>
#include <string>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include "../common/optimizer_bindings.h"
#include "../common/tensor_slots.h"
#include "cuda_api.h"

namespace py = pybind11;

namespace fastopt {
namespace {

constexpr const char* kCudaKind = "a dense, contiguous CUDA tensor on the device of params[0]";

// The tensors the kernels take: contiguous, strided, on the device of the first parameter.
Slots cuda_slots(const TensorList& params, const TensorList* grads, const std::vector<const TensorList*>& states,
                 const OptTensorList& copies) {
  if (params.empty()) return {};
  const at::Device device = params[0].device();
  auto usable = [&](const at::Tensor& t) {
    return t.is_cuda() && t.device() == device && t.layout() == at::kStrided && t.is_contiguous();
  };
  Slots slots = make_slots(params, grads, states, copies, usable, kCudaKind);
  require_float32_state(slots, "the CUDA kernels");
  return slots;
}

// A device scalar argument: one float32 element on the device of the call.
const float* scalar_ptr(const OptTensor& t, const char* name, const at::Device& device) {
  if (!t) return nullptr;
  if (t->numel() != 1 || t->scalar_type() != at::kFloat || t->device() != device)
    throw py::value_error(std::string(name) + " must be a one-element float32 tensor on " + device.str() +
                          ", got " + std::to_string(t->numel()) + " element(s) of " +
                          std::string(c10::toString(t->scalar_type())) + " on " + t->device().str());
  return t->data_ptr<float>();
}

// Workspace for per-chunk partial sums (pairs of floats).
at::Tensor partials_for(const Slots& slots, const at::Tensor& like) {
  return at::empty({std::max<int64_t>(1, 2 * cuda::total_chunks(slots))}, like.options().dtype(at::kFloat));
}

// Per-slot sums of squares of the slots' tensors (float64, on their device), enqueued on
// the current stream; `total` (device, may be null) receives their sum.
at::Tensor per_tensor_squares(const Slots& slots, const at::Tensor& like, double* total) {
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor per = at::empty({static_cast<int64_t>(slots.size())}, like.options().dtype(at::kDouble));
  at::Tensor partials = partials_for(slots, like);
  cuda::sum_squares(slots, 1, partials.data_ptr<float>(), per.data_ptr<double>(), total,
                    c10::cuda::getCurrentCUDAStream().stream());
  return per;
}

// The kernels of each algorithm, enqueued on `stream` with the call's device scalars.
struct CudaKernels {
  cuda::DeviceScalars d;
  cudaStream_t stream;
  at::Tensor like;  // params[0]: the device and options of workspaces

  void adam(const Slots& s, const AdamArgs& a, bool bias_correction) const {
    cuda::adam_step(s, a, bias_correction, d, stream);
  }
  void sgd(const Slots& s, const SgdArgs& a) const { cuda::sgd_step(s, a, d, stream); }
  void adagrad(const Slots& s, const AdagradArgs& a, double lr, double lr_decay) const {
    cuda::adagrad_step(s, a, lr, lr_decay, d, stream);
  }
  void lion(const Slots& s, const LionArgs& a) const { cuda::lion_step(s, a, d, stream); }
  void lamb(const Slots& s, const LambArgs& a, const LambDeviceClip& device_clip, bool bias_correction) const {
    cuda::LambClip clip;
    clip.max_grad_norm = device_clip.max_grad_norm;
    clip.inv_grad_scale = device_clip.inv_grad_scale;
    if (const OptTensor& sums = device_clip.grad_sum_squares) {
      if (sums->numel() != 1 || sums->scalar_type() != at::kDouble || sums->device() != like.device())
        throw py::value_error("grad_sum_squares must be a one-element float64 tensor on the device of params");
      clip.grad_sum_squares = sums->data_ptr<double>();
    }
    at::Tensor partials = partials_for(s, like);
    cuda::lamb_step(s, a, clip, bias_correction, d, partials.data_ptr<float>(), stream);
  }
  void lars(const Slots& s, const LarsArgs& a) const {
    at::Tensor partials = partials_for(s, like);
    cuda::lars_step(s, a, d, partials.data_ptr<float>(), stream);
  }
};

// The CUDA module's policy for ../common/optimizer_bindings.h.
struct CudaDevice {
  static constexpr bool reads_grad_factors = false;  // grad_factors: multiplied into copies by the caller
  static bool follows(Rounding r) { return r != Rounding::kTorchCpuFused; }

  static Slots slots(const TensorList& params, const TensorList* grads, const std::vector<const TensorList*>& states,
                     const OptTensorList& copies) {
    return cuda_slots(params, grads, states, copies);
  }

  // Runs `step` on the current stream of the tensors' device.  With check_finite, a flag is
  // first set on the device from the gradients, the update skips itself when it is set,
  // and the flag is read back (the one host synchronisation) to return whether the step
  // was skipped.  Without it nothing waits for the device.
  template <typename Step>
  static bool run(const TensorList& params, const Slots& slots, bool check_finite, const ScalarTensors& s,
                  const Step& step) {
    if (params.empty()) return false;
    const at::Device device = params[0].device();
    const c10::cuda::CUDAGuard guard(device);
    CudaKernels on{{}, c10::cuda::getCurrentCUDAStream(device.index()).stream(), params[0]};
    on.d.grad_scale = scalar_ptr(s.grad_scale, "grad_scale", device);
    on.d.found_inf = scalar_ptr(s.found_inf, "found_inf", device);
    on.d.lr = scalar_ptr(s.lr_tensor, "lr_tensor", device);
    on.d.step = scalar_ptr(s.step_tensor, "step_tensor", device);
    if (!check_finite) {
      py::gil_scoped_release nogil;
      step(on);
      return false;
    }
    if (on.d.found_inf != nullptr) throw py::value_error("pass either check_finite=True or found_inf, not both");
    at::Tensor flag = at::zeros({1}, params[0].options().dtype(at::kFloat));
    on.d.found_inf = flag.data_ptr<float>();
    {
      py::gil_scoped_release nogil;
      cuda::check_finite(slots, flag.data_ptr<float>(), on.stream);
      step(on);
    }
    return flag.item<float>() != 0.0f;
  }
};

}  // namespace
}  // namespace fastopt

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fastopt;
  m.doc() = "lightning_fastopt CUDA fused optimizer kernels (multi-tensor apply)";
  m.attr("isa") = "cuda";
  py::register_local_exception<UnsupportedTensor>(m, "UnsupportedTensor", PyExc_ValueError);

  m.def("all_finite", [](const TensorList& tensors) {
    Slots slots = CudaDevice::slots(tensors, &tensors, {}, std::nullopt);
    if (slots.empty()) return true;
    const c10::cuda::CUDAGuard guard(tensors[0].device());
    at::Tensor flag = at::zeros({1}, tensors[0].options().dtype(at::kFloat));
    cuda::check_finite(slots, flag.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream());
    return flag.item<float>() == 0.0f;
  }, py::arg("tensors"), "True when every element of every tensor is finite");

  m.def("check_finite_", [](const TensorList& tensors, const at::Tensor& found_inf) {
    Slots slots = CudaDevice::slots(tensors, &tensors, {}, std::nullopt);
    if (slots.empty()) return;
    const c10::cuda::CUDAGuard guard(tensors[0].device());
    float* flag = const_cast<float*>(scalar_ptr(found_inf, "found_inf", tensors[0].device()));
    cuda::check_finite(slots, flag, c10::cuda::getCurrentCUDAStream().stream());
  }, py::arg("tensors"), py::arg("found_inf"),
     "Sets found_inf to 1 when any element is inf or NaN (on the device, no synchronisation)");

  m.def("unscale_", [](const TensorList& grads, float inv_grad_scale, const OptTensor& grad_scale,
                       const at::Tensor& found_inf) {
    Slots slots = cuda_slots(grads, &grads, {}, std::nullopt);
    if (slots.empty()) return;
    const at::Device device = grads[0].device();
    const c10::cuda::CUDAGuard guard(device);
    float* flag = const_cast<float*>(scalar_ptr(found_inf, "found_inf", device));
    cuda::unscale(slots, inv_grad_scale, scalar_ptr(grad_scale, "grad_scale", device), flag,
                  c10::cuda::getCurrentCUDAStream().stream());
  }, py::arg("grads"), py::arg("inv_grad_scale"), py::arg("grad_scale") = py::none(), py::arg("found_inf"),
     "Multiplies the gradients by 1/grad_scale in place and flags inf/NaN in found_inf");

  m.def("sum_squares_device", [](const TensorList& tensors) {
    Slots slots = CudaDevice::slots(tensors, nullptr, {}, std::nullopt);
    if (slots.empty()) throw py::value_error("sum_squares_device needs at least one tensor");
    at::Tensor total = at::empty({}, tensors[0].options().dtype(at::kDouble));
    at::Tensor per = per_tensor_squares(slots, tensors[0], total.data_ptr<double>());
    return py::make_tuple(per, total);
  }, py::arg("tensors"), "(per-tensor sums of squares, their total) as float64 device tensors, without synchronising");

  m.def("sum_squares", [](const TensorList& tensors) {
    Slots slots = CudaDevice::slots(tensors, nullptr, {}, std::nullopt);
    std::vector<double> out;
    if (slots.empty()) return out;
    at::Tensor host = per_tensor_squares(slots, tensors[0], nullptr).cpu();
    out.assign(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
    return out;
  }, py::arg("tensors"), "Per-tensor sum of squares, accumulated in double");

  m.def("fingerprint", [](const TensorList& tensors) {
    Slots slots = CudaDevice::slots(tensors, nullptr, {}, std::nullopt);
    if (slots.empty()) throw py::value_error("fingerprint needs at least one tensor");
    const c10::cuda::CUDAGuard guard(tensors[0].device());
    at::Tensor out = at::empty({static_cast<int64_t>(slots.size())}, tensors[0].options().dtype(at::kLong));
    cuda::fingerprint(slots, out.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream().stream());
    return out;
  }, py::arg("tensors"), "Per-tensor int64 fingerprints of the bits (torch_backend.fingerprint), without synchronising");

  def_optimizer_functions<CudaDevice>(m);
}
