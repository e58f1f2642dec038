// Python bindings of the CUDA optimizer kernels.
//
// The same functions, arguments and checks as the CPU module (../cpu/bindings.cpp), so
// lightning_fastopt.functional calls either alike, plus keyword-only device scalars that
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

#include "../common/tensor_slots.h"
#include "cuda_api.h"

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

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
  return make_slots(params, grads, states, copies, usable, kCudaKind);
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

struct Scalars {
  OptTensor grad_scale, found_inf, lr_tensor, step_tensor;
};

// Runs `launch(device_scalars)` on the current stream of the tensors' device.  With
// check_finite, a flag is first set on the device from the gradients, the update skips
// itself when it is set, and the flag is read back (the one host synchronisation) to
// return whether the step was skipped.  Without it nothing waits for the device.
template <typename Launch>
bool run_step(const TensorList& params, const Slots& slots, bool check_finite, const Scalars& s,
              const Launch& launch) {
  if (params.empty()) return false;
  const at::Device device = params[0].device();
  const c10::cuda::CUDAGuard guard(device);
  cuda::DeviceScalars d;
  d.grad_scale = scalar_ptr(s.grad_scale, "grad_scale", device);
  d.found_inf = scalar_ptr(s.found_inf, "found_inf", device);
  d.lr = scalar_ptr(s.lr_tensor, "lr_tensor", device);
  d.step = scalar_ptr(s.step_tensor, "step_tensor", device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  if (!check_finite) {
    py::gil_scoped_release nogil;
    launch(d, stream);
    return false;
  }
  if (d.found_inf != nullptr) throw py::value_error("pass either check_finite=True or found_inf, not both");
  at::Tensor flag = at::zeros({1}, params[0].options().dtype(at::kFloat));
  d.found_inf = flag.data_ptr<float>();
  {
    py::gil_scoped_release nogil;
    cuda::check_finite(slots, flag.data_ptr<float>(), stream);
    launch(d, stream);
  }
  return flag.item<float>() != 0.0f;
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

}  // namespace
}  // namespace fastopt

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fastopt;
  m.doc() = "lightning_fastopt CUDA fused optimizer kernels (multi-tensor apply)";
  m.attr("isa") = "cuda";
  py::register_local_exception<UnsupportedTensor>(m, "UnsupportedTensor", PyExc_ValueError);

  m.def("all_finite", [](const TensorList& tensors) {
    Slots slots = cuda_slots(tensors, &tensors, {}, std::nullopt);
    if (slots.empty()) return true;
    const c10::cuda::CUDAGuard guard(tensors[0].device());
    at::Tensor flag = at::zeros({1}, tensors[0].options().dtype(at::kFloat));
    cuda::check_finite(slots, flag.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream());
    return flag.item<float>() == 0.0f;
  }, "True when every element of every tensor is finite");

  m.def("check_finite_", [](const TensorList& tensors, const at::Tensor& found_inf) {
    Slots slots = cuda_slots(tensors, &tensors, {}, std::nullopt);
    if (slots.empty()) return;
    const c10::cuda::CUDAGuard guard(tensors[0].device());
    float* flag = const_cast<float*>(scalar_ptr(found_inf, "found_inf", tensors[0].device()));
    cuda::check_finite(slots, flag, c10::cuda::getCurrentCUDAStream().stream());
  }, "Sets found_inf to 1 when any element is inf or NaN (on the device, no synchronisation)");

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
    Slots slots = cuda_slots(tensors, nullptr, {}, std::nullopt);
    if (slots.empty()) throw py::value_error("sum_squares_device needs at least one tensor");
    at::Tensor total = at::empty({}, tensors[0].options().dtype(at::kDouble));
    at::Tensor per = per_tensor_squares(slots, tensors[0], total.data_ptr<double>());
    return py::make_tuple(per, total);
  }, "(per-tensor sums of squares, their total) as float64 device tensors, without synchronising");

  m.def("sum_squares", [](const TensorList& tensors) {
    Slots slots = cuda_slots(tensors, nullptr, {}, std::nullopt);
    std::vector<double> out;
    if (slots.empty()) return out;
    at::Tensor host = per_tensor_squares(slots, tensors[0], nullptr).cpu();
    out.assign(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
    return out;
  }, "Per-tensor sum of squares, accumulated in double");

  m.def("adam_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const OptTensorList& max_exp_avg_sqs,
                    const OptTensorList& copies, float lr, float beta1, float beta2, float eps,
                    float weight_decay, float step_size, float bias_correction2_sqrt, float inv_grad_scale,
                    bool amsgrad, bool adamw, bool maximize, bool check_finite, bool bias_correction,
                    const OptTensor& grad_scale, const OptTensor& found_inf, const OptTensor& lr_tensor,
                    const OptTensor& step_tensor) {
    if (amsgrad && !max_exp_avg_sqs) throw py::value_error("amsgrad needs max_exp_avg_sqs");
    Slots slots = cuda_slots(params, &grads,
                             {&exp_avgs, &exp_avg_sqs, amsgrad ? opt_list(max_exp_avg_sqs) : &kNoTensors}, copies);
    AdamArgs a{lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, inv_grad_scale,
               amsgrad, adamw, maximize};
    return run_step(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, step_tensor},
                    [&](const cuda::DeviceScalars& d, cudaStream_t s) {
                      cuda::adam_step(slots, a, bias_correction, d, s);
                    });
  }, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"),
     py::arg("copies"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
     py::arg("step_size"), py::arg("bias_correction2_sqrt"), py::arg("inv_grad_scale"), py::arg("amsgrad"),
     py::arg("adamw"), py::arg("maximize"), py::arg("check_finite"), py::kw_only(),
     py::arg("bias_correction") = true, py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),
     py::arg("lr_tensor") = py::none(), py::arg("step_tensor") = py::none());

  m.def("sgd_", [](const TensorList& params, const TensorList& grads, const OptTensorList& momentum_buffers,
                   const OptTensorList& copies, float lr, float momentum, float dampening, float weight_decay,
                   float inv_grad_scale, bool nesterov, bool maximize, bool wd_after_momentum, bool first_step,
                   bool check_finite, const OptTensor& grad_scale, const OptTensor& found_inf,
                   const OptTensor& lr_tensor) {
    if (momentum != 0.0f && !momentum_buffers) throw py::value_error("momentum needs momentum_buffers");
    Slots slots = cuda_slots(params, &grads, {momentum != 0.0f ? opt_list(momentum_buffers) : &kNoTensors}, copies);
    SgdArgs a{lr, momentum, dampening, weight_decay, inv_grad_scale, nesterov, maximize, wd_after_momentum,
              first_step};
    return run_step(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, std::nullopt},
                    [&](const cuda::DeviceScalars& d, cudaStream_t s) { cuda::sgd_step(slots, a, d, s); });
  }, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::arg("copies"), py::arg("lr"),
     py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("inv_grad_scale"),
     py::arg("nesterov"), py::arg("maximize"), py::arg("wd_after_momentum"), py::arg("first_step"),
     py::arg("check_finite"), py::kw_only(), py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),
     py::arg("lr_tensor") = py::none());

  m.def("adagrad_", [](const TensorList& params, const TensorList& grads, const TensorList& state_sums,
                       const OptTensorList& copies, float clr, float weight_decay, float eps, float inv_grad_scale,
                       bool maximize, bool check_finite, float lr, float lr_decay, const OptTensor& grad_scale,
                       const OptTensor& found_inf, const OptTensor& lr_tensor, const OptTensor& step_tensor) {
    Slots slots = cuda_slots(params, &grads, {&state_sums}, copies);
    AdagradArgs a{clr, weight_decay, eps, inv_grad_scale, maximize};
    return run_step(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, step_tensor},
                    [&](const cuda::DeviceScalars& d, cudaStream_t s) {
                      cuda::adagrad_step(slots, a, lr, lr_decay, d, s);
                    });
  }, py::arg("params"), py::arg("grads"), py::arg("state_sums"), py::arg("copies"), py::arg("clr"),
     py::arg("weight_decay"), py::arg("eps"), py::arg("inv_grad_scale"), py::arg("maximize"),
     py::arg("check_finite"), py::kw_only(), py::arg("lr") = 0.0f, py::arg("lr_decay") = 0.0f,
     py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(), py::arg("lr_tensor") = py::none(),
     py::arg("step_tensor") = py::none());

  m.def("lion_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const OptTensorList& copies, float lr, float beta1, float beta2, float weight_decay,
                    float inv_grad_scale, bool maximize, bool check_finite, const OptTensor& grad_scale,
                    const OptTensor& found_inf, const OptTensor& lr_tensor) {
    Slots slots = cuda_slots(params, &grads, {&exp_avgs}, copies);
    LionArgs a{lr, beta1, beta2, weight_decay, inv_grad_scale, maximize};
    return run_step(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, std::nullopt},
                    [&](const cuda::DeviceScalars& d, cudaStream_t s) { cuda::lion_step(slots, a, d, s); });
  }, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("copies"), py::arg("lr"), py::arg("beta1"),
     py::arg("beta2"), py::arg("weight_decay"), py::arg("inv_grad_scale"), py::arg("maximize"),
     py::arg("check_finite"), py::kw_only(), py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),
     py::arg("lr_tensor") = py::none());

  m.def("lamb_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const OptTensorList& copies, float lr, float beta1,
                    float beta2, float beta3, float eps, float weight_decay, float bias_correction1,
                    float bias_correction2, float grad_factor, bool adam_w_mode, bool use_trust_ratio,
                    bool maximize, bool bias_correction, const OptTensor& grad_sum_squares, float max_grad_norm,
                    float inv_grad_scale, const OptTensor& grad_scale, const OptTensor& found_inf,
                    const OptTensor& lr_tensor, const OptTensor& step_tensor) {
    Slots slots = cuda_slots(params, &grads, {&exp_avgs, &exp_avg_sqs}, copies);
    if (slots.empty()) return;
    LambArgs a{lr, beta1, beta2, beta3, eps, weight_decay, bias_correction1, bias_correction2, grad_factor,
               adam_w_mode, use_trust_ratio, maximize};
    cuda::LambClip clip;
    clip.max_grad_norm = max_grad_norm;
    clip.inv_grad_scale = inv_grad_scale;
    if (grad_sum_squares) {
      if (grad_sum_squares->numel() != 1 || grad_sum_squares->scalar_type() != at::kDouble ||
          grad_sum_squares->device() != params[0].device())
        throw py::value_error("grad_sum_squares must be a one-element float64 tensor on the device of params");
      clip.grad_sum_squares = grad_sum_squares->data_ptr<double>();
    }
    at::Tensor partials = partials_for(slots, params[0]);
    run_step(params, slots, false, {grad_scale, found_inf, lr_tensor, step_tensor},
             [&](const cuda::DeviceScalars& d, cudaStream_t s) {
               cuda::lamb_step(slots, a, clip, bias_correction, d, partials.data_ptr<float>(), s);
             });
  }, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("copies"),
     py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("beta3"), py::arg("eps"), py::arg("weight_decay"),
     py::arg("bias_correction1"), py::arg("bias_correction2"), py::arg("grad_factor"), py::arg("adam_w_mode"),
     py::arg("use_trust_ratio"), py::arg("maximize"), py::kw_only(), py::arg("bias_correction") = true,
     py::arg("grad_sum_squares") = py::none(), py::arg("max_grad_norm") = 0.0f, py::arg("inv_grad_scale") = 1.0f,
     py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(), py::arg("lr_tensor") = py::none(),
     py::arg("step_tensor") = py::none());

  m.def("lars_", [](const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
                    const OptTensorList& copies, float lr, float momentum, float eeta, float weight_decay,
                    float epsilon, float inv_grad_scale, bool maximize, bool check_finite,
                    const OptTensor& grad_scale, const OptTensor& found_inf, const OptTensor& lr_tensor) {
    Slots slots = cuda_slots(params, &grads, {&momentum_buffers}, copies);
    if (slots.empty()) return false;
    LarsArgs a{lr, momentum, eeta, weight_decay, epsilon, inv_grad_scale, maximize};
    at::Tensor partials = partials_for(slots, params[0]);
    return run_step(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, std::nullopt},
                    [&](const cuda::DeviceScalars& d, cudaStream_t s) {
                      cuda::lars_step(slots, a, d, partials.data_ptr<float>(), s);
                    });
  }, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::arg("copies"), py::arg("lr"),
     py::arg("momentum"), py::arg("eeta"), py::arg("weight_decay"), py::arg("epsilon"), py::arg("inv_grad_scale"),
     py::arg("maximize"), py::arg("check_finite"), py::kw_only(), py::arg("grad_scale") = py::none(),
     py::arg("found_inf") = py::none(), py::arg("lr_tensor") = py::none());
}
