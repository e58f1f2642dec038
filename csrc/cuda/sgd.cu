// SGD with momentum, dampening and Nesterov on the GPU: the formula of ../cpu/sgd.cpp.
#include "elementwise.cuh"

namespace fastopt {
namespace cuda {
namespace {

struct SgdMath {
  SgdArgs a;
  bool use_wd;
  float gs, damp, neg_lr;

  __device__ void prepare(const DeviceScalars& d) {
    gs = gradient_factor(d, a.inv_grad_scale, a.maximize);
    damp = 1.0f - a.dampening;
    neg_lr = -(d.lr != nullptr ? *d.lr : a.lr);
  }

  __device__ __forceinline__ void operator()(float& p, float g, float* s) const {
    g = g * gs;
    if (!a.wd_after_momentum && use_wd) g = fmaf(a.weight_decay, p, g);
    if (a.momentum != 0.0f) {
      s[0] = a.first_step ? g : fmaf(g, damp, s[0] * a.momentum);
      g = a.nesterov ? fmaf(s[0], a.momentum, g) : s[0];
    }
    if (a.wd_after_momentum && use_wd) g = fmaf(a.weight_decay, p, g);
    p = fmaf(neg_lr, g, p);
  }
};

}  // namespace

void sgd_step(const Slots& slots, const SgdArgs& a, const DeviceScalars& d, cudaStream_t stream) {
  SgdMath m{};
  m.a = a;
  m.use_wd = a.weight_decay != 0.0f;
  if (a.momentum != 0.0f) return elementwise_step<1>(slots, m, d, stream, "sgd");
  elementwise_step<0>(slots, m, d, stream, "sgd");
}

}  // namespace cuda
}  // namespace fastopt
