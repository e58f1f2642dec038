// Adam / AdamW (with amsgrad) on the GPU: the formula of ../cpu/adam.cpp, element by element.
#include <cmath>

#include "elementwise.cuh"

namespace fastopt {
namespace cuda {
namespace {

struct AdamMath {
  AdamArgs a;
  bool bias_correction;
  bool decoupled, l2, small1;
  float gs, decay, w1, w1c, w2, bc2s, neg_step;

  __device__ void prepare(const DeviceScalars& d) {
    gs = gradient_factor(d, a.inv_grad_scale, a.maximize);
    float lr = a.lr, step_size = a.step_size;
    bc2s = a.bias_correction2_sqrt;
    if (d.step != nullptr) {  // the bias corrections of a device-resident step count
      lr = d.lr != nullptr ? *d.lr : a.lr;
      const double step = static_cast<double>(*d.step);
      const double bc1 = bias_correction ? 1.0 - pow(static_cast<double>(a.beta1), step) : 1.0;
      const double bc2 = bias_correction ? 1.0 - pow(static_cast<double>(a.beta2), step) : 1.0;
      step_size = static_cast<float>(static_cast<double>(lr) / bc1);
      bc2s = static_cast<float>(sqrt(bc2));
    }
    decay = decoupled_decay(lr, a.weight_decay);
    w1 = 1.0f - a.beta1;
    w1c = 1.0f - w1;
    small1 = w1 < 0.5f;
    w2 = 1.0f - a.beta2;
    neg_step = -step_size;
  }

  __device__ __forceinline__ void operator()(float& p, float g, float* s) const {
    g = g * gs;
    if (l2) g = fmaf(a.weight_decay, p, g);
    if (decoupled) p = p * decay;
    s[0] = small1 ? fmaf(w1, g - s[0], s[0]) : g - (g - s[0]) * w1c;  // torch's lerp
    s[1] = fmaf(w2, g * g, s[1] * a.beta2);
    float v = s[1];
    if (a.amsgrad) {
      s[2] = fmaxf(s[2], s[1]);
      v = s[2];
    }
    const float denom = sqrtf(v) / bc2s + a.eps;
    p = fmaf(neg_step, s[0] / denom, p);
  }
};

}  // namespace

void adam_step(const Slots& slots, const AdamArgs& a, bool bias_correction, const DeviceScalars& d,
               cudaStream_t stream) {
  const bool wd = a.weight_decay != 0.0f;
  AdamMath m{};
  m.a = a;
  m.bias_correction = bias_correction;
  m.decoupled = a.adamw && wd;
  m.l2 = !a.adamw && wd;
  if (a.amsgrad) return elementwise_step<3>(slots, m, d, stream, "adam");
  elementwise_step<2>(slots, m, d, stream, "adam");
}

}  // namespace cuda
}  // namespace fastopt
