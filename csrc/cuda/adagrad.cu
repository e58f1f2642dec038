// Adagrad on the GPU: the formula of ../cpu/adagrad.cpp.
#include "elementwise.cuh"

namespace fastopt {
namespace cuda {
namespace {

struct AdagradMath {
  AdagradArgs a;
  float lr, lr_decay;
  bool use_wd;
  float gs, neg_clr;

  __device__ void prepare(const DeviceScalars& d) {
    gs = gradient_factor(d, a.inv_grad_scale, a.maximize);
    float clr = a.clr;
    if (d.step != nullptr) {  // clr = lr / (1 + (step - 1) * lr_decay) from a device step count
      const double base = static_cast<double>(d.lr != nullptr ? *d.lr : lr);
      clr = static_cast<float>(base / (1.0 + (static_cast<double>(*d.step) - 1.0) * lr_decay));
    }
    neg_clr = -clr;
  }

  __device__ __forceinline__ void operator()(float& p, float g, float* s) const {
    g = g * gs;
    if (use_wd) g = fmaf(a.weight_decay, p, g);
    s[0] = fmaf(g, g, s[0]);
    p = fmaf(neg_clr, g / (sqrtf(s[0]) + a.eps), p);
  }
};

}  // namespace

void adagrad_step(const Slots& slots, const AdagradArgs& a, float lr, float lr_decay, const DeviceScalars& d,
                  cudaStream_t stream) {
  AdagradMath m{};
  m.a = a;
  m.lr = lr;
  m.lr_decay = lr_decay;
  m.use_wd = a.weight_decay != 0.0f;
  elementwise_step<1>(slots, m, d, stream, "adagrad");
}

}  // namespace cuda
}  // namespace fastopt
