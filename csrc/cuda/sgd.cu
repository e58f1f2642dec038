// SGD with momentum, dampening and Nesterov on the GPU: the formula of ../cpu/sgd.cpp.
#include "elementwise.cuh"

namespace fastopt {
namespace cuda {

void sgd_step(const Slots& slots, const SgdArgs& a, const DeviceScalars& d, cudaStream_t stream) {
  if (a.momentum != 0.0f) return elementwise_step<1>(slots, sgd_math(a), d, stream, "sgd");
  elementwise_step<0>(slots, sgd_math(a), d, stream, "sgd");
}

}  // namespace cuda
}  // namespace fastopt
