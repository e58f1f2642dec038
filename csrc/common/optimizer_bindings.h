// The Python functions of the optimizer kernels, written once for both extension modules:
// their names, their named arguments (the same as lightning_fastopt/ops/torch_backend.py,
// so lightning_fastopt.functional calls any backend by keyword), the checks of the tensor
// lists and the argument structs (../common/kernel_args.h) built from them.
//
// A module defines them with `def_optimizer_functions<Device>(m)`.  `Device` is the
// module's policy:
//
//   Slots Device::slots(params, grads*, {state lists*}, copies)    checked tensor lists
//   bool  Device::run(params, slots, check_finite, scalars, step)  runs step(on) with the
//         GIL released; with check_finite, nothing is touched (and true is returned) when a
//         gradient holds inf/NaN.  `on` has one method per algorithm (adam, sgd, adagrad,
//         lion, lamb, lars) that runs its kernels; `scalars` are the keyword-only device
//         scalars (CUDA tensors read on the device; the CPU module refuses them).
//
// Positional order: the tensor lists, then the algorithm's scalars in the order of its
// struct, then check_finite (the order the modules have always had); everything after
// is keyword-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>

#include <torch/csrc/utils/pybind.h>

#include "kernel_args.h"
#include "sgd_rounding.h"
#include "tensor_slots.h"

// The algorithms a module binds: every one by default (the CUDA module, a full CPU build); a
// CPU build of some pieces only (lightning_fastopt/ops/cpu.py) defines the others as 0.
#ifndef FASTOPT_WITH_ADAM
#define FASTOPT_WITH_ADAM 1
#endif
#ifndef FASTOPT_WITH_SGD
#define FASTOPT_WITH_SGD 1
#endif
#ifndef FASTOPT_WITH_ADAGRAD
#define FASTOPT_WITH_ADAGRAD 1
#endif
#ifndef FASTOPT_WITH_LION
#define FASTOPT_WITH_LION 1
#endif
#ifndef FASTOPT_WITH_LAMB
#define FASTOPT_WITH_LAMB 1
#endif
#ifndef FASTOPT_WITH_LARS
#define FASTOPT_WITH_LARS 1
#endif

namespace fastopt {

using OptTensor = std::optional<at::Tensor>;

// Device-resident scalars (one-element float32 tensors on the parameters' device): the
// loss scale, torch.amp's overflow flag, the learning rate and the step number after this
// update.  Unset: the host values of the argument struct are used.
struct ScalarTensors {
  OptTensor grad_scale, found_inf, lr_tensor, step_tensor;
  bool any() const { return grad_scale || found_inf || lr_tensor || step_tensor; }
};

// LAMB's clipping computed on the device: the sum of squares of every gradient (float64,
// one element, on the device) with max_grad_norm and the inverse loss scale.
struct LambDeviceClip {
  OptTensor grad_sum_squares;
  float max_grad_norm, inv_grad_scale;
};

// The per-tensor squared norms a LAMB or LARS step is given (LambArgs::norms): a float64
// CPU tensor of shape [tensors, 2], or null.
inline const double* given_norms(const OptTensor& norms, size_t tensors) {
  if (!norms) return nullptr;
  const at::Tensor& t = *norms;
  if (t.device().type() != at::kCPU || t.scalar_type() != at::kDouble || !t.is_contiguous() || t.dim() != 2 ||
      t.size(0) != static_cast<int64_t>(tensors) || t.size(1) != 2)
    throw py::value_error("norms must be a contiguous float64 CPU tensor of shape [" + std::to_string(tensors) +
                          ", 2] (two squared norms per tensor)");
  return t.data_ptr<double>();
}

// A rounding code (kernel_args.h) among those an algorithm takes, that the module's device
// follows (Device::follows: the CUDA kernels not kTorchCpuFused, torch's CPU kernel).
template <typename Device>
void check_rounding(int rounding, std::initializer_list<int> taken) {
  static const char* const names[] = {"torch's CPU step", "its CUDA foreach step", "its CUDA fused kernel",
                                      "its CPU fused kernel", "its CUDA for-loop step"};
  if (std::find(taken.begin(), taken.end(), rounding) == taken.end()) {
    std::string accepted;
    for (int r : taken) accepted += (accepted.empty() ? "" : ", ") + std::to_string(r) + " (" + names[r] + ")";
    throw pybind11::value_error("rounding must be one of " + accepted + ", got " + std::to_string(rounding));
  }
  if (!Device::follows(static_cast<Rounding>(rounding)))
    throw pybind11::value_error("rounding " + std::to_string(rounding) + " (" + names[rounding] +
                                ") is for CPU tensors");
}

// The keyword argument grad_factors of the elementwise algorithms (Adam, SGD, Adagrad,
// Lion: each gradient element read once per use) onto every slot (TensorSlot::grad_factors;
// `factors` outlives the call), for a module whose kernels read them (Device::reads_grad_factors).
template <typename Device>
void take_grad_factors(Slots& slots, const std::vector<float>& factors, bool check_finite) {
  if (factors.empty()) return;
  if (!Device::reads_grad_factors)
    throw pybind11::value_error("grad_factors: these kernels take none (the CPU kernels do); multiply the "
                                "gradients first");
  if (check_finite)
    throw pybind11::value_error("check_finite reads the gradients before grad_factors: pass one or the other");
  for (float f : factors)
    if (!std::isfinite(f)) throw pybind11::value_error("grad_factors must be finite, got " + std::to_string(f));
  for (TensorSlot& s : slots) {
    s.grad_factors = factors.data();
    s.grad_factor_count = static_cast<int32_t>(factors.size());
  }
}

template <typename Device>
void def_optimizer_functions(pybind11::module_& m) {
  namespace py = pybind11;
#if FASTOPT_WITH_ADAM
  m.def("adam_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const OptTensorList& max_exp_avg_sqs,
                    const OptTensorList& copies, float lr, double beta1, double beta2, float eps,
                    float weight_decay, float step_size, double bias_correction2_sqrt, float inv_grad_scale,
                    bool amsgrad, bool adamw, bool maximize, bool check_finite, uint32_t state_seed,
                    std::optional<double> decay, bool torch_sqrt, int rounding, bool bias_correction,
                    const OptTensor& grad_scale, const OptTensor& found_inf, const OptTensor& lr_tensor,
                    const OptTensor& step_tensor, const std::vector<int64_t>& index_bases,
                    const std::vector<float>& grad_factors) {
    if (amsgrad && !max_exp_avg_sqs) throw py::value_error("amsgrad needs max_exp_avg_sqs");
    check_rounding<Device>(rounding, {0, 1, 2, 3, 4});
    if (!index_bases.empty() && index_bases.size() != params.size()) {
      throw py::value_error("index_bases: one per parameter (or none)");
    }
    Slots slots = Device::slots(
        params, &grads, {&exp_avgs, &exp_avg_sqs, amsgrad ? opt_list(max_exp_avg_sqs) : &kNoTensors}, copies);
    for (size_t i = 0; i < slots.size(); ++i) {  // the stochastic rounding of bfloat16 state
      slots[i].state_seed = state_seed;
      if (!index_bases.empty()) slots[i].index_base = static_cast<uint32_t>(index_bases[i] & 0xFFFFFFFF);
    }
    take_grad_factors<Device>(slots, grad_factors, check_finite);
    const AdamArgs a{lr, static_cast<float>(beta1), static_cast<float>(beta2), eps, weight_decay, step_size,
                     static_cast<float>(bias_correction2_sqrt), static_cast<float>(1.0 / bias_correction2_sqrt),
                     inv_grad_scale, amsgrad, adamw, maximize, beta1, beta2,
                     // AdamW's factor as the caller computed it from the exact lr (else from the float one)
                     static_cast<float>(decay.value_or(1.0 - static_cast<double>(lr) * weight_decay)), torch_sqrt,
                     static_cast<Rounding>(rounding)};
    return Device::run(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, step_tensor},
                       [&](const auto& on) { on.adam(slots, a, bias_correction); });
  }, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"),
     py::arg("copies"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
     py::arg("step_size"), py::arg("bias_correction2_sqrt"), py::arg("inv_grad_scale"), py::arg("amsgrad"),
     py::arg("adamw"), py::arg("maximize"), py::arg("check_finite"), py::arg("state_seed") = 0u,
     py::arg("decay") = py::none(), py::arg("torch_sqrt") = false, py::arg("rounding") = 0, py::kw_only(),
     py::arg("bias_correction") = true, py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),
     py::arg("lr_tensor") = py::none(), py::arg("step_tensor") = py::none(),
     py::arg("index_bases") = std::vector<int64_t>{}, py::arg("grad_factors") = std::vector<float>{});
#endif

#if FASTOPT_WITH_SGD
  m.def("sgd_", [](const TensorList& params, const TensorList& grads, const OptTensorList& momentum_buffers,
                   const OptTensorList& copies, float lr, float momentum, double dampening, float weight_decay,
                   float inv_grad_scale, bool nesterov, bool maximize, bool wd_after_momentum, bool first_step,
                   bool check_finite, int rounding, const OptTensor& grad_scale, const OptTensor& found_inf,
                   const OptTensor& lr_tensor, const std::vector<float>& grad_factors) {
    if (momentum != 0.0f && !momentum_buffers) throw py::value_error("momentum needs momentum_buffers");
    check_rounding<Device>(rounding, {0, 2, 3});
    Slots slots =
        Device::slots(params, &grads, {momentum != 0.0f ? opt_list(momentum_buffers) : &kNoTensors}, copies);
    take_grad_factors<Device>(slots, grad_factors, check_finite);
    const Rounding r = static_cast<Rounding>(rounding);
    const SgdArgs a{lr, momentum, sgd_one_minus_dampening(dampening, r), weight_decay, inv_grad_scale, nesterov,
                    maximize, wd_after_momentum, first_step, r};
    return Device::run(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, std::nullopt},
                       [&](const auto& on) { on.sgd(slots, a); });
  }, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::arg("copies"), py::arg("lr"),
     py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("inv_grad_scale"),
     py::arg("nesterov"), py::arg("maximize"), py::arg("wd_after_momentum"), py::arg("first_step"),
     py::arg("check_finite"), py::arg("rounding") = 0, py::kw_only(), py::arg("grad_scale") = py::none(),
     py::arg("found_inf") = py::none(), py::arg("lr_tensor") = py::none(),
     py::arg("grad_factors") = std::vector<float>{});
#endif

#if FASTOPT_WITH_ADAGRAD
  m.def("adagrad_", [](const TensorList& params, const TensorList& grads, const TensorList& state_sums,
                       const OptTensorList& copies, double clr, double weight_decay, double eps, float inv_grad_scale,
                       bool maximize, bool check_finite, bool torch_sqrt, int rounding, double lr, double lr_decay,
                       const OptTensor& grad_scale, const OptTensor& found_inf, const OptTensor& lr_tensor,
                       const OptTensor& step_tensor, const std::vector<float>& grad_factors) {
    check_rounding<Device>(rounding, {0, 2, 4});
    Slots slots = Device::slots(params, &grads, {&state_sums}, copies);
    take_grad_factors<Device>(slots, grad_factors, check_finite);
    // the float scalars as before (the bindings took floats); kTorchCudaFused takes them as given
    const AdagradArgs a{static_cast<float>(clr), static_cast<float>(weight_decay), static_cast<float>(eps),
                        inv_grad_scale, maximize, torch_sqrt, static_cast<Rounding>(rounding), clr, weight_decay, eps};
    return Device::run(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, step_tensor},
                       [&](const auto& on) { on.adagrad(slots, a, lr, lr_decay); });
  }, py::arg("params"), py::arg("grads"), py::arg("state_sums"), py::arg("copies"), py::arg("clr"),
     py::arg("weight_decay"), py::arg("eps"), py::arg("inv_grad_scale"), py::arg("maximize"),
     py::arg("check_finite"), py::arg("torch_sqrt") = false, py::arg("rounding") = 0, py::kw_only(),
     py::arg("lr") = 0.0, py::arg("lr_decay") = 0.0, py::arg("grad_scale") = py::none(),
     py::arg("found_inf") = py::none(), py::arg("lr_tensor") = py::none(), py::arg("step_tensor") = py::none(),
     py::arg("grad_factors") = std::vector<float>{});
#endif

#if FASTOPT_WITH_LION
  m.def("lion_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const OptTensorList& copies, float lr, float beta1, float beta2, float weight_decay,
                    float inv_grad_scale, bool maximize, bool check_finite, const OptTensor& grad_scale,
                    const OptTensor& found_inf, const OptTensor& lr_tensor, const std::vector<float>& grad_factors) {
    Slots slots = Device::slots(params, &grads, {&exp_avgs}, copies);
    take_grad_factors<Device>(slots, grad_factors, check_finite);
    const LionArgs a{lr, beta1, beta2, weight_decay, inv_grad_scale, maximize};
    return Device::run(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, std::nullopt},
                       [&](const auto& on) { on.lion(slots, a); });
  }, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("copies"), py::arg("lr"), py::arg("beta1"),
     py::arg("beta2"), py::arg("weight_decay"), py::arg("inv_grad_scale"), py::arg("maximize"),
     py::arg("check_finite"), py::kw_only(), py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),
     py::arg("lr_tensor") = py::none(), py::arg("grad_factors") = std::vector<float>{});
#endif

#if FASTOPT_WITH_LAMB
  m.def("lamb_", [](const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const OptTensorList& copies, float lr, double beta1,
                    double beta2, float beta3, float eps, float weight_decay, float bias_correction1,
                    float bias_correction2, float grad_factor, bool adam_w_mode, bool use_trust_ratio,
                    bool maximize, bool bias_correction, const OptTensor& grad_sum_squares, float max_grad_norm,
                    float inv_grad_scale, const OptTensor& grad_scale, const OptTensor& found_inf,
                    const OptTensor& lr_tensor, const OptTensor& step_tensor, const OptTensor& norms) {
    const Slots slots = Device::slots(params, &grads, {&exp_avgs, &exp_avg_sqs}, copies);
    const LambArgs a{lr, static_cast<float>(beta1), static_cast<float>(beta2), beta3, eps, weight_decay,
                     bias_correction1, bias_correction2, grad_factor, adam_w_mode, use_trust_ratio, maximize,
                     beta1, beta2, given_norms(norms, params.size())};
    const LambDeviceClip clip{grad_sum_squares, max_grad_norm, inv_grad_scale};
    Device::run(params, slots, false, {grad_scale, found_inf, lr_tensor, step_tensor},
                [&](const auto& on) { on.lamb(slots, a, clip, bias_correction); });
  }, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("copies"),
     py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("beta3"), py::arg("eps"), py::arg("weight_decay"),
     py::arg("bias_correction1"), py::arg("bias_correction2"), py::arg("grad_factor"), py::arg("adam_w_mode"),
     py::arg("use_trust_ratio"), py::arg("maximize"), py::kw_only(), py::arg("bias_correction") = true,
     py::arg("grad_sum_squares") = py::none(), py::arg("max_grad_norm") = 0.0f, py::arg("inv_grad_scale") = 1.0f,
     py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(), py::arg("lr_tensor") = py::none(),
     py::arg("step_tensor") = py::none(), py::arg("norms") = py::none());
#endif

#if FASTOPT_WITH_LARS
  m.def("lars_", [](const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
                    const OptTensorList& copies, float lr, float momentum, float eeta, float weight_decay,
                    float epsilon, float inv_grad_scale, bool maximize, bool check_finite,
                    const OptTensor& grad_scale, const OptTensor& found_inf, const OptTensor& lr_tensor,
                    const OptTensor& norms) {
    const Slots slots = Device::slots(params, &grads, {&momentum_buffers}, copies);
    const LarsArgs a{lr, momentum, eeta, weight_decay, epsilon, inv_grad_scale, maximize,
                     given_norms(norms, params.size())};
    return Device::run(params, slots, check_finite, {grad_scale, found_inf, lr_tensor, std::nullopt},
                       [&](const auto& on) { on.lars(slots, a); });
  }, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::arg("copies"), py::arg("lr"),
     py::arg("momentum"), py::arg("eeta"), py::arg("weight_decay"), py::arg("epsilon"), py::arg("inv_grad_scale"),
     py::arg("maximize"), py::arg("check_finite"), py::kw_only(), py::arg("grad_scale") = py::none(),
     py::arg("found_inf") = py::none(), py::arg("lr_tensor") = py::none(), py::arg("norms") = py::none());
#endif
}

}  // namespace fastopt
