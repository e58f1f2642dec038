// The per-element math of every CUDA optimizer, as host-and-device code: the kernels run
// it on the GPU, and tests/cpp/cuda_math_check.cu runs the very same structs on the host
// (compiled by nvcc, no GPU needed) to compare them with the CPU kernels bit for bit.
//
// Each struct mirrors the vector body of its CPU kernel (../cpu/*.cpp) line by line (Adam's
// in each of its roundings, kernel_args.h):
//   prepare(d)               resolves the scalars, reading device-resident ones (DeviceScalars)
//   for_tensor(numel)        optional: what depends on the tensor of the chunk (SGD's
//                            rounding in torch's fused kernel, ../common/sgd_rounding.h)
//   operator()(p, g, s)      one element, in float (s: the float32 states)
// The CUDA build turns off FMA contraction, so fmaf appears exactly where the CPU code has
// fmadd and every other operation is rounded on its own, as there.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../common/fused_cuda_adagrad.h"
#include "../common/sgd_rounding.h"
#include "cuda_api.h"

namespace fastopt {
namespace cuda {

// 1 / loss scale: from the device when given there, else the host value.
FASTOPT_HOST_DEVICE inline float inverse_scale(const DeviceScalars& d, float host_inv) {
  return d.grad_scale != nullptr ? 1.0f / *d.grad_scale : host_inv;
}

// Whether an algorithm's math has for_tensor(numel).
template <typename Math, typename = void>
struct HasForTensor : std::false_type {};
template <typename Math>
struct HasForTensor<Math, std::void_t<decltype(std::declval<Math&>().for_tensor(int64_t{}))>> : std::true_type {};

// What a gradient is multiplied by: the inverse loss scale, negated to maximize.
FASTOPT_HOST_DEVICE inline float gradient_factor(const DeviceScalars& d, float host_inv, bool maximize) {
  const float inv = inverse_scale(d, host_inv);
  return maximize ? -inv : inv;
}

// Decoupled weight decay's factor 1 - lr * wd, rounded once from double (as on the CPU).
FASTOPT_HOST_DEVICE inline float decoupled_decay(float lr, float weight_decay) {
  return static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
}

// Adam in the rounding R names (kernel_args.h; ../cpu/adam.cpp spells out each one).
template <Rounding R>
struct AdamMath {
  AdamArgs a;
  bool bias_correction;
  bool decoupled, l2, small1, w2_is_one;
  float gs, decay, w1, lerp_coeff, w2, bc2s, inv_bc2s, neg_step, neg_lr_wd;

  FASTOPT_HOST_DEVICE void prepare(const DeviceScalars& d) {
    gs = gradient_factor(d, a.inv_grad_scale, a.maximize);
    float lr = a.lr, step_size = a.step_size;
    bc2s = a.bias_correction2_sqrt;
    inv_bc2s = a.inv_bias_correction2_sqrt;  // the double reciprocal, rounded once (the for-loop step)
    decay = a.decay;  // from the exact lr, computed by the caller
    if (d.step != nullptr) {  // the bias corrections of a device-resident step count
      lr = d.lr != nullptr ? *d.lr : a.lr;
      if (R == Rounding::kTorchCudaFused) {  // in float, as torch's fused kernel
        const float bc1 = bias_correction ? 1.0f - powf(a.beta1, *d.step) : 1.0f;
        step_size = lr / bc1;
        bc2s = sqrtf(bias_correction ? 1.0f - powf(a.beta2, *d.step) : 1.0f);
      } else {
        const double step = static_cast<double>(*d.step);
        const double bc1 = bias_correction ? 1.0 - pow(a.beta1_exact, step) : 1.0;
        const double bc2 = bias_correction ? 1.0 - pow(a.beta2_exact, step) : 1.0;
        step_size = static_cast<float>(static_cast<double>(lr) / bc1);
        bc2s = static_cast<float>(sqrt(bc2));
        inv_bc2s = static_cast<float>(1.0 / sqrt(bc2));
      }
      decay = decoupled_decay(lr, a.weight_decay);
    }
    w1 = static_cast<float>(1.0 - a.beta1_exact);
    small1 = w1 < 0.5f;
    lerp_coeff = small1 ? w1 : w1 - 1.0f;
    w2 = static_cast<float>(1.0 - a.beta2_exact);
    w2_is_one = w2 == 1.0f;
    neg_step = -step_size;
    neg_lr_wd = -(lr * a.weight_decay);
  }

  FASTOPT_HOST_DEVICE inline void operator()(float& p, float g, float* s) const {
    g = g * gs;
    if (l2) g = fmaf(p, a.weight_decay, g);
    if (R == Rounding::kTorchCudaFused) {
      if (decoupled) p = fmaf(neg_lr_wd, p, p);
      s[0] = fmaf(a.beta1, s[0], fmaf(-a.beta1, g, g));
      const float gg = g * g;
      s[1] = fmaf(a.beta2, s[1], fmaf(-a.beta2, gg, gg));
    } else {
      if (decoupled) p = p * decay;
      s[0] = fmaf(lerp_coeff, g - s[0], small1 ? s[0] : g);  // ATen's lerp, contracted
      if (kCudaAtenOps<R>)
        s[1] = w2_is_one ? fmaf(g, g, s[1] * a.beta2) : fmaf(w2, g * g, s[1] * a.beta2);
      else
        s[1] = fmaf(w2 * g, g, s[1] * a.beta2);
    }
    float v = s[1];
    if (a.amsgrad) {
      s[2] = fmaxf(s[2], s[1]);
      v = s[2];
    }
    const float denom = (R == Rounding::kTorchCudaForLoop ? sqrtf(v) * inv_bc2s : sqrtf(v) / bc2s) + a.eps;
    if (kCudaAtenOps<R>)
      p = fmaf(neg_step, s[0] / denom, p);
    else
      p = p + (neg_step * s[0]) / denom;
  }
};

struct SgdMath {
  SgdArgs a;
  bool use_wd;
  bool damped_grad_first;  // buf = fma(buf, momentum, g * (1 - dampening)) in this tensor
  float gs, neg_lr;

  FASTOPT_HOST_DEVICE void prepare(const DeviceScalars& d) {
    gs = gradient_factor(d, a.inv_grad_scale, a.maximize);
    neg_lr = -(d.lr != nullptr ? *d.lr : a.lr);
  }

  FASTOPT_HOST_DEVICE void for_tensor(int64_t numel) {
    damped_grad_first = sgd_cuda_fused_rounds_damped_grad_first(a, numel);
  }

  FASTOPT_HOST_DEVICE inline void operator()(float& p, float g, float* s) const {
    g = g * gs;
    if (!a.wd_after_momentum && use_wd) g = fmaf(a.weight_decay, p, g);
    if (a.momentum != 0.0f) {
      const float damp = a.one_minus_dampening;
      s[0] = a.first_step        ? g
             : damped_grad_first ? fmaf(s[0], a.momentum, g * damp)
                                 : fmaf(g, damp, s[0] * a.momentum);
      g = a.nesterov ? fmaf(s[0], a.momentum, g) : s[0];
    }
    if (a.wd_after_momentum && use_wd) g = fmaf(a.weight_decay, p, g);
    p = fmaf(neg_lr, g, p);
  }
};

struct AdagradMath {
  AdagradArgs a;
  double lr, lr_decay;
  bool use_wd, fused;  // fused: torch's fused CUDA kernel (../common/fused_cuda_adagrad.h)
  bool for_loop;       // torch's CUDA for-loop step: addcdiv one fused multiply-add
  float gs, neg_clr;
  double clr_exact;

  FASTOPT_HOST_DEVICE void prepare(const DeviceScalars& d) {
    gs = gradient_factor(d, a.inv_grad_scale, a.maximize);
    float clr = a.clr;
    clr_exact = a.clr_exact;
    if (d.step != nullptr) {  // clr = lr / (1 + (step - 1) * lr_decay) from a device step count
      const double base = d.lr != nullptr ? static_cast<double>(*d.lr) : static_cast<double>(static_cast<float>(lr));
      clr = static_cast<float>(base / (1.0 + (static_cast<double>(*d.step) - 1.0) * static_cast<float>(lr_decay)));
      // torch's fused kernel: the lr and lr_decay as given, the step count a float
      clr_exact = (d.lr != nullptr ? static_cast<double>(*d.lr) : lr) /
                  fma(static_cast<double>(*d.step - 1.0f), lr_decay, 1.0);
    }
    neg_clr = -clr;
  }

  FASTOPT_HOST_DEVICE inline void operator()(float& p, float g, float* s) const {
    if (fused) return fused_cuda_adagrad(p, g, s[0], gs, a.weight_decay_exact, a.eps_exact, clr_exact);
    g = g * gs;
    if (use_wd) g = fmaf(a.weight_decay, p, g);
    s[0] = fmaf(g, g, s[0]);
    const float std = sqrtf(s[0]) + a.eps;
    // param.addcdiv_(grad, std, value=-clr): as the CPU's, or as CUDA's addcdiv kernel
    p = for_loop ? fmaf(neg_clr, g / std, p) : p + (neg_clr * g) / std;
  }
};

struct LionMath {
  LionArgs a;
  bool use_wd, small1, small2;
  float gs, decay, neg_lr, w1, w1c, w2, w2c;

  FASTOPT_HOST_DEVICE void prepare(const DeviceScalars& d) {
    gs = gradient_factor(d, a.inv_grad_scale, a.maximize);
    const float lr = d.lr != nullptr ? *d.lr : a.lr;
    decay = decoupled_decay(lr, a.weight_decay);
    neg_lr = -lr;
    w1 = 1.0f - a.beta1;
    w2 = 1.0f - a.beta2;
    w1c = 1.0f - w1;
    w2c = 1.0f - w2;
    small1 = w1 < 0.5f;
    small2 = w2 < 0.5f;
  }

  FASTOPT_HOST_DEVICE inline void operator()(float& p, float g, float* s) const {
    g = g * gs;
    if (use_wd) p = p * decay;
    const float diff = g - s[0];
    const float c = small1 ? fmaf(w1, diff, s[0]) : g - diff * w1c;
    const float sign = (c > 0.0f ? 1.0f : 0.0f) - (c < 0.0f ? 1.0f : 0.0f);
    p = fmaf(neg_lr, sign, p);
    s[0] = small2 ? fmaf(w2, diff, s[0]) : g - diff * w2c;
  }
};

// LAMB (see lamb.cu for the two passes).
struct LambMath {
  LambArgs a;
  LambClip clip;
  bool bias_correction;
  bool l2, decoupled;
  float gf, inv_bc1, inv_bc2, lr;

  FASTOPT_HOST_DEVICE void prepare(const DeviceScalars& d) {
    float bc1 = a.bias_correction1, bc2 = a.bias_correction2;
    lr = a.lr;
    if (d.step != nullptr) {
      const double step = static_cast<double>(*d.step);
      bc1 = bias_correction ? static_cast<float>(1.0 - pow(a.beta1_exact, step)) : 1.0f;
      bc2 = bias_correction ? static_cast<float>(1.0 - pow(a.beta2_exact, step)) : 1.0f;
      if (d.lr != nullptr) lr = *d.lr;
    }
    inv_bc1 = 1.0f / bc1;
    inv_bc2 = 1.0f / bc2;
    float factor = a.grad_factor;
    if (clip.grad_sum_squares != nullptr) {  // 1 / (loss scale * clipping divisor), on the device
      const float inv = d.grad_scale != nullptr ? static_cast<float>(1.0 / static_cast<double>(*d.grad_scale))
                                                : clip.inv_grad_scale;
      const double norm = sqrt(*clip.grad_sum_squares) * inv;
      const double divisor = (clip.max_grad_norm > 0.0f && norm > clip.max_grad_norm) ? norm / clip.max_grad_norm
                                                                                       : 1.0;
      factor = static_cast<float>(static_cast<double>(inv) / divisor);
    }
    gf = a.maximize ? -factor : factor;
  }

  // Pass 1 for one element: the moments, updated in place; returns the update u.
  FASTOPT_HOST_DEVICE inline float moments(float p, float g, float& m, float& v) const {
    g = g * gf;
    if (l2) g = fmaf(a.weight_decay, p, g);
    m = fmaf(a.beta3, g, m * a.beta1);
    v = fmaf(1.0f - a.beta2, g * g, v * a.beta2);
    return update(p, m, v);
  }

  FASTOPT_HOST_DEVICE inline float update(float p, float m, float v) const {
    const float u = (m * inv_bc1) / (sqrtf(v * inv_bc2) + a.eps);
    return decoupled ? fmaf(a.weight_decay, p, u) : u;
  }
};

// LARS: the local learning rate of a tensor from its sums of squares, then per element
// buf = momentum * buf + (g + wd * p);  p -= lr * local * buf.
struct LarsMath {
  LarsArgs a;
  float gs, neg;

  FASTOPT_HOST_DEVICE void prepare(const DeviceScalars& d, double grad_sum_squares, double param_sum_squares) {
    const float inv = inverse_scale(d, a.inv_grad_scale);
    const float lr = d.lr != nullptr ? *d.lr : a.lr;
    const double pn = sqrt(param_sum_squares), gn = sqrt(grad_sum_squares) * inv;
    const double local = (pn > 0.0 && gn > 0.0)
        ? a.eeta * pn / (gn + static_cast<double>(a.weight_decay) * pn + a.epsilon) : 1.0;
    neg = static_cast<float>(-static_cast<double>(lr) * local);
    gs = a.maximize ? -inv : inv;
  }

  FASTOPT_HOST_DEVICE inline void operator()(float& p, float g, float* s) const {
    s[0] = fmaf(s[0], a.momentum, fmaf(a.weight_decay, p, g * gs));
    p = fmaf(neg, s[0], p);
  }
};

// LAMB's per-tensor step: -lr * trust ratio, from the sums of squares of p and of u.
FASTOPT_HOST_DEVICE inline float lamb_tensor_step(float lr, bool use_trust_ratio, double param_sum_squares,
                                                  double update_sum_squares) {
  const double pn = sqrt(param_sum_squares), un = sqrt(update_sum_squares);
  const double ratio = (use_trust_ratio && pn != 0.0 && un != 0.0) ? pn / un : 1.0;
  return static_cast<float>(-static_cast<double>(lr) * ratio);
}

// ---------------------------------------------------------------- construction
// What the launchers (and the host check) build the structs with.
template <Rounding R = Rounding::kTorchCpu>
inline AdamMath<R> adam_math(const AdamArgs& a, bool bias_correction) {
  AdamMath<R> m{};
  m.a = a;
  m.bias_correction = bias_correction;
  m.decoupled = a.adamw && a.weight_decay != 0.0f;
  m.l2 = !a.adamw && a.weight_decay != 0.0f;
  return m;
}

inline SgdMath sgd_math(const SgdArgs& a) {
  SgdMath m{};
  m.a = a;
  m.use_wd = a.weight_decay != 0.0f;
  return m;
}

inline AdagradMath adagrad_math(const AdagradArgs& a, double lr, double lr_decay) {
  AdagradMath m{};
  m.a = a;
  m.lr = lr;
  m.lr_decay = lr_decay;
  m.use_wd = a.weight_decay != 0.0f;
  m.fused = a.rounding == Rounding::kTorchCudaFused;
  m.for_loop = a.rounding == Rounding::kTorchCudaForLoop;
  return m;
}

inline LionMath lion_math(const LionArgs& a) {
  LionMath m{};
  m.a = a;
  m.use_wd = a.weight_decay != 0.0f;
  return m;
}

inline LambMath lamb_math(const LambArgs& a, const LambClip& clip, bool bias_correction) {
  LambMath m{};
  m.a = a;
  m.clip = clip;
  m.bias_correction = bias_correction;
  m.l2 = !a.adam_w_mode && a.weight_decay != 0.0f;
  m.decoupled = a.adam_w_mode && a.weight_decay != 0.0f;
  return m;
}

inline LarsMath lars_math(const LarsArgs& a) {
  LarsMath m{};
  m.a = a;
  return m;
}

}  // namespace cuda
}  // namespace fastopt
