// Lion on the GPU: the formula of ../cpu/lion.cpp (sign(0) = sign(NaN) = 0, as there).
#include "elementwise.cuh"

namespace fastopt {
namespace cuda {
namespace {

struct LionMath {
  LionArgs a;
  bool use_wd, small1, small2;
  float gs, decay, neg_lr, w1, w1c, w2, w2c;

  __device__ void prepare(const DeviceScalars& d) {
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

  __device__ __forceinline__ void operator()(float& p, float g, float* s) const {
    g = g * gs;
    if (use_wd) p = p * decay;
    const float diff = g - s[0];
    const float c = small1 ? fmaf(w1, diff, s[0]) : g - diff * w1c;
    const float sign = (c > 0.0f ? 1.0f : 0.0f) - (c < 0.0f ? 1.0f : 0.0f);
    p = fmaf(neg_lr, sign, p);
    s[0] = small2 ? fmaf(w2, diff, s[0]) : g - diff * w2c;
  }
};

}  // namespace

void lion_step(const Slots& slots, const LionArgs& a, const DeviceScalars& d, cudaStream_t stream) {
  LionMath m{};
  m.a = a;
  m.use_wd = a.weight_decay != 0.0f;
  elementwise_step<1>(slots, m, d, stream, "lion");
}

}  // namespace cuda
}  // namespace fastopt
