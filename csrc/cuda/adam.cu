// Adam / AdamW (with amsgrad) on the GPU: the formula of ../cpu/adam.cpp, element by element.
#include <cmath>

#include "elementwise.cuh"

namespace fastopt {
namespace cuda {

void adam_step(const Slots& slots, const AdamArgs& a, bool bias_correction, const DeviceScalars& d,
               cudaStream_t stream) {
  if (a.amsgrad) return elementwise_step<3>(slots, adam_math(a, bias_correction), d, stream, "adam");
  elementwise_step<2>(slots, adam_math(a, bias_correction), d, stream, "adam");
}

}  // namespace cuda
}  // namespace fastopt
