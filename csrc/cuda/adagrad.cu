// Adagrad on the GPU: the formula of ../cpu/adagrad.cpp in each of its roundings.
#include "elementwise.cuh"

namespace fastopt {
namespace cuda {

void adagrad_step(const Slots& slots, const AdagradArgs& a, double lr, double lr_decay, const DeviceScalars& d,
                  cudaStream_t stream) {
  elementwise_step<1>(slots, adagrad_math(a, lr, lr_decay), d, stream, "adagrad");
}

}  // namespace cuda
}  // namespace fastopt
