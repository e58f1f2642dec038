// SGD with momentum, dampening and Nesterov, torch.optim.SGD's formula in float
// (apex's wd_after_momentum adds the decay term after the momentum update instead):
//   g = -g if maximize;  g = fma(wd, p, g)
//   buf = g on the first step, else buf = fma(g, 1 - dampening, buf * momentum)
//   g = fma(buf, momentum, g) if nesterov else buf;  p = fma(-lr, g, p)
// rounded as torch's CPU step and its CUDA foreach step round it (kTorchCpu), as its CPU
// fused=True kernel (kTorchCpuFused, FusedSGDKernel.cpp) and its CUDA fused one
// (kTorchCudaFused): the same operations, but for the factor 1 - dampening and, in some
// tensors or elements, the momentum update (../common/sgd_rounding.h)
//   buf = fma(buf, momentum, g * (1 - dampening))
#include "../common/sgd_rounding.h"
#include "tensor_walk.h"

namespace fastopt {
namespace {

enum class Form { kEveryElement, kTorchTails, kCudaFusedTensors };

template <bool kMomentum, bool kWdAfter, Form kForm>
void run(const Slots& slots, const SgdArgs& a) {
  const VecF gs = VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale);
  const VecF wd = VecF::set1(a.weight_decay);
  const VecF mom = VecF::set1(a.momentum), damp = VecF::set1(a.one_minus_dampening);
  const VecF neg_lr = VecF::set1(-a.lr);
  const bool use_wd = a.weight_decay != 0.0f, first = a.first_step, nesterov = a.nesterov;
  constexpr int NS = kMomentum ? 1 : 0;
  auto body = [&](auto damped_grad_first) {  // std::true_type: buf = fma(buf, momentum, g * damp)
    return [&](VecF& p, VecF g, std::array<VecF, NS>& st) {
      g = g * gs;
      if (!kWdAfter && use_wd) g = VecF::fmadd(wd, p, g);
      if constexpr (kMomentum) {
        if (first) st[0] = g;
        else if constexpr (decltype(damped_grad_first)::value) st[0] = VecF::fmadd(st[0], mom, g * damp);
        else st[0] = VecF::fmadd(g, damp, st[0] * mom);
        g = nesterov ? VecF::fmadd(st[0], mom, g) : st[0];
      }
      if (kWdAfter && use_wd) g = VecF::fmadd(wd, p, g);
      p = VecF::fmadd(neg_lr, g, p);
    };
  };
  if constexpr (kForm == Form::kTorchTails) {
    elementwise_step_with_torch_tails<NS>(slots, body(std::false_type{}), body(std::true_type{}));
  } else if constexpr (kForm == Form::kCudaFusedTensors) {
    const auto split = [&](const TensorSlot& s) {
      return sgd_cuda_fused_rounds_damped_grad_first(a, s.numel) ? int64_t{0} : s.numel;
    };
    elementwise_step_split<NS>(slots, split, body(std::false_type{}), body(std::true_type{}));
  } else {
    elementwise_step<NS>(slots, body(std::false_type{}));
  }
}

template <bool kMomentum, bool kWdAfter>
void run(const Slots& slots, const SgdArgs& a) {
  // the roundings differ only in the momentum update (and the factor, in the arguments)
  if constexpr (kMomentum) {
    if (a.rounding == Rounding::kTorchCpuFused) return run<kMomentum, kWdAfter, Form::kTorchTails>(slots, a);
    if (a.rounding == Rounding::kTorchCudaFused && !a.first_step)
      return run<kMomentum, kWdAfter, Form::kCudaFusedTensors>(slots, a);
  }
  run<kMomentum, kWdAfter, Form::kEveryElement>(slots, a);
}

}  // namespace

void sgd_step(const Slots& slots, const SgdArgs& a) {
  const bool mom = a.momentum != 0.0f;
  if (mom) return a.wd_after_momentum ? run<true, true>(slots, a) : run<true, false>(slots, a);
  return a.wd_after_momentum ? run<false, true>(slots, a) : run<false, false>(slots, a);
}

}  // namespace fastopt
