// Adam / AdamW (with amsgrad), rounded exactly as the torch implementation named by
// AdamArgs::rounding rounds (kernel_args.h), so that the results are torch's bits at every
// ISA we build and every thread count.
//
// This header holds the arithmetic; each rounding family is its own translation unit, so
// that they compile in parallel (adam.cpp: the dispatch and kTorchCpu, adam_cpu_fused.cpp,
// adam_cuda_roundings.cpp).
//
// kTorchCpu: torch.optim.Adam/AdamW's default step on the CPU (its for-loop implementation:
// one ATen op after another, each rounding once, the vectorized ones with the fused
// multiply-adds ATen's kernels use):
//   g  = -g if maximize (after unscaling)
//   L2:    g = fma(p, wd, g)                        grad.add(param, alpha=wd)
//   AdamW: p = p * float(1 - lr * wd)               param.mul_(1 - lr * wd), the factor in double
//   m  = lerp(m, g, float(1 - beta1))               exp_avg.lerp_(grad, 1 - beta1)
//   v  = fma(float(1 - beta2) * g, g, v * beta2)    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
//   vmax = max(vmax, v)                             amsgrad
//   d  = sqrt(v or vmax) / bc2_sqrt + eps           (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   p  = p + (-step_size * m) / d                   param.addcdiv_(exp_avg, denom, value=-step_size)
// The scalars come from Python as doubles (step_size, bias_correction2_sqrt, the decay
// factor, the betas) and are rounded to float once, as ATen rounds a Python scalar.
//
// kTorchCpuFused: torch's CPU fused=True kernel (ATen/native/cpu/FusedAdamKernel.cpp, AVX2
// build): its vector loop as kTorchCpu with the IEEE square root; its scalar loop over each
// tensor's last numel % 8 elements (tensor_walk.h) contracted otherwise by GCC:
//   v  = fma(v, beta2, (float(1 - beta2) * g) * g)
//
// kTorchCudaForeach: torch's default step on CUDA, its _foreach ops (torch >= 2.11: the
// lerp contracted as above; addcmul and addcdiv one fma of the scalar and the product or
// quotient, ATen/native/cuda/DeviceAddCmulCdiv.cuh; scalars as for kTorchCpu):
//   v  = fma(float(1 - beta2), g * g, v * beta2)    (fma(g, g, v * beta2) when the scalar is 1)
//   p  = fma(-step_size, m / d, p)                  the other lines as kTorchCpu
//
// kTorchCudaForLoop: torch's CUDA step with foreach=False (its for-loop implementation, torch
// >= 2.11): kTorchCudaForeach's operations but for the bias correction, where ATen's CUDA
// division by a host scalar multiplies by the scalar's double reciprocal rounded once (as
// measured by benchmarks/rounding_probe.py on torch 2.11.0+cu130; the source reads as
// float's 1.0f / float(b), which the GPU did not follow):
//   d  = sqrt(v or vmax) * float(1.0 / bc2_sqrt) + eps
//
// kTorchCudaFused: torch's fused CUDA kernel (ATen/native/cuda/fused_adam_utils.cuh, torch
// >= 2.11), its scalars rounded to float first, the bias corrections computed in float from
// the device's powf (lightning_fastopt.ops.rounding; step_size = lr / bc1 in float):
//   L2:    g = fma(p, wd, g)                        grad += param * weight_decay (contracted)
//   AdamW: p = fma(-(lr * wd), p, p)                param -= lr * weight_decay * param
//   m  = fma(beta1, m, fma(-beta1, g, g))
//   v  = fma(beta2, v, fma(-beta2, g * g, g * g))
//   d and p as kTorchCpu ((-s * m) / d is -((s * m) / d) exactly: torch's param -= s * m / d)
// A loss scale divides the gradient there and multiplies by its inverse here: the same bits
// for a power of two (GradScaler's and our scaler's scales are).
//
// The square root: the IEEE one (correctly rounded) by default, in one pass (CUDA's sqrtf
// is IEEE too).  With `torch_sqrt` (kTorchCpu only), torch's CPU one (MKL's, torch_sqrt.h):
// the first pass updates m and v, MKL takes the roots of v (or vmax) block by block, the
// second pass updates the parameters (measured: 1.7x the one-pass step, 50M parameters on
// 2 AVX2 cores).  Without MKL ATen's square root is the IEEE one, and so is ours.
// m and v are float32, or bfloat16 stored with stochastic rounding (vec.h; no amsgrad;
// one pass, the IEEE square root: torch has no such algorithm to follow).
#pragma once

#include <type_traits>

#include "torch_sqrt.h"

namespace fastopt {
namespace adam_detail {

// ATen's vectorized lerp(a, b, w) for a scalar weight (LerpKernel.cpp): one fused
// multiply-add from the nearer end.
struct Lerp {
  VecF coeff;
  bool small;
  explicit Lerp(float weight) : coeff(VecF::set1(weight < 0.5f ? weight : weight - 1.0f)), small(weight < 0.5f) {}
  VecF operator()(VecF a, VecF b) const { return VecF::fmadd(coeff, b - a, small ? a : b); }
};

// The constants of one step, as torch rounds them.
struct AdamConstants {
  VecF gs, wd, decay, b1, neg_b1, b2, neg_b2, w2, bc2s, inv_bc2s, eps, neg_step, neg_lr_wd;
  bool w2_is_one;
  Lerp lerp1;
  explicit AdamConstants(const AdamArgs& a)
      : gs(VecF::set1(a.maximize ? -a.inv_grad_scale : a.inv_grad_scale)),
        wd(VecF::set1(a.weight_decay)),
        decay(VecF::set1(a.decay)),
        b1(VecF::set1(a.beta1)),
        neg_b1(VecF::set1(-a.beta1)),
        b2(VecF::set1(a.beta2)),
        neg_b2(VecF::set1(-a.beta2)),
        w2(VecF::set1(static_cast<float>(1.0 - a.beta2_exact))),
        bc2s(VecF::set1(a.bias_correction2_sqrt)),
        inv_bc2s(VecF::set1(a.inv_bias_correction2_sqrt)),
        eps(VecF::set1(a.eps)),
        neg_step(VecF::set1(-a.step_size)),
        neg_lr_wd(VecF::set1(-(a.lr * a.weight_decay))),
        w2_is_one(static_cast<float>(1.0 - a.beta2_exact) == 1.0f),
        lerp1(static_cast<float>(1.0 - a.beta1_exact)) {}

  // m, v (and vmax) from the gradient; returns what the square root is taken of.
  // kScalarLoop: the elements torch's CPU fused kernel updates in its scalar loop.
  template <Rounding R, bool kAmsgrad, bool kL2, int NS, bool kScalarLoop = false>
  FASTOPT_ALWAYS_INLINE VecF moments(const VecF& p, VecF g, std::array<VecF, NS>& st) const {
    g = g * gs;
    if constexpr (kL2) g = VecF::fmadd(p, wd, g);
    if constexpr (R == Rounding::kTorchCudaFused) {
      st[0] = VecF::fmadd(b1, st[0], VecF::fmadd(neg_b1, g, g));
      const VecF gg = g * g;
      st[1] = VecF::fmadd(b2, st[1], VecF::fmadd(neg_b2, gg, gg));
    } else {
      st[0] = lerp1(st[0], g);
      if constexpr (kCudaAtenOps<R>)
        st[1] = w2_is_one ? VecF::fmadd(g, g, st[1] * b2) : VecF::fmadd(w2, g * g, st[1] * b2);
      else if constexpr (kScalarLoop)
        st[1] = VecF::fmadd(st[1], b2, (w2 * g) * g);
      else
        st[1] = VecF::fmadd(w2 * g, g, st[1] * b2);
    }
    if constexpr (kAmsgrad) {
      st[2] = VecF::max(st[2], st[1]);
      return st[2];
    }
    return st[1];
  }

  // The parameter from m and the square root.
  template <Rounding R, bool kDecoupled>
  FASTOPT_ALWAYS_INLINE VecF param(VecF p, const VecF& m, const VecF& root) const {
    if constexpr (kDecoupled) p = R == Rounding::kTorchCudaFused ? VecF::fmadd(neg_lr_wd, p, p) : p * decay;
    const VecF d = (R == Rounding::kTorchCudaForLoop ? root * inv_bc2s : root / bc2s) + eps;
    if constexpr (kCudaAtenOps<R>)
      return VecF::fmadd(neg_step, m / d, p);
    return p + (neg_step * m) / d;
  }
};

// One pass, the IEEE square root (every rounding but kTorchCpu with torch_sqrt; bfloat16
// state; a torch without MKL).
template <Rounding R, bool kAmsgrad, bool kDecoupled, bool kL2>
void run_one_pass(const Slots& slots, const AdamArgs& a) {
  const AdamConstants c(a);
  constexpr int NS = kAmsgrad ? 3 : 2;
  auto body = [&c](auto scalar_loop) {
    return [&c](VecF& p, VecF g, std::array<VecF, NS>& st) {
      const VecF v = c.moments<R, kAmsgrad, kL2, NS, decltype(scalar_loop)::value>(p, g, st);
      p = c.param<R, kDecoupled>(p, st[0], VecF::sqrt(v));
    };
  };
  if constexpr (R == Rounding::kTorchCpuFused)
    elementwise_step_with_torch_tails<NS, !kAmsgrad>(slots, body(std::false_type{}), body(std::true_type{}));
  else
    elementwise_step<NS, !kAmsgrad>(slots, body(std::false_type{}));
}

// Calls fn(amsgrad, decoupled, l2) with the three as std::bool_constant, from the arguments.
template <typename Fn>
void with_adam_flags(const AdamArgs& a, const Fn& fn) {
  const bool wd = a.weight_decay != 0.0f;
  const bool dec = a.adamw && wd, l2 = !a.adamw && wd;
  using T = std::true_type;
  using F = std::false_type;
  if (a.amsgrad) {
    if (dec) return fn(T{}, T{}, F{});
    if (l2) return fn(T{}, F{}, T{});
    return fn(T{}, F{}, F{});
  }
  if (dec) return fn(F{}, T{}, F{});
  if (l2) return fn(F{}, F{}, T{});
  return fn(F{}, F{}, F{});
}

// The one-pass step of rounding R, for any flags; instantiated in the translation unit of
// R's family.
template <Rounding R>
void one_pass_step(const Slots& slots, const AdamArgs& a) {
  with_adam_flags(a, [&](auto ams, auto dec, auto l2) {
    run_one_pass<R, decltype(ams)::value, decltype(dec)::value, decltype(l2)::value>(slots, a);
  });
}

extern template void one_pass_step<Rounding::kTorchCpuFused>(const Slots&, const AdamArgs&);
extern template void one_pass_step<Rounding::kTorchCudaForeach>(const Slots&, const AdamArgs&);
extern template void one_pass_step<Rounding::kTorchCudaFused>(const Slots&, const AdamArgs&);
extern template void one_pass_step<Rounding::kTorchCudaForLoop>(const Slots&, const AdamArgs&);

}  // namespace adam_detail
}  // namespace fastopt
