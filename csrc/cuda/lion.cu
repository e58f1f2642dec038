// Lion on the GPU: the formula of ../cpu/lion.cpp (sign(0) = sign(NaN) = 0, as there).
#include "elementwise.cuh"

namespace fastopt {
namespace cuda {

void lion_step(const Slots& slots, const LionArgs& a, const DeviceScalars& d, cudaStream_t stream) {
  elementwise_step<1>(slots, lion_math(a), d, stream, "lion");
}

}  // namespace cuda
}  // namespace fastopt
