// Adam in the rounding of torch's CPU step (the rounding asked for where none of the CUDA ones is) (adam_roundings.cuh).
#include "adam_roundings.cuh"

namespace fastopt {
namespace cuda {

template void adam_in_rounding<Rounding::kTorchCpu>(
    const Slots&, const AdamArgs&, bool, const DeviceScalars&, cudaStream_t);

}  // namespace cuda
}  // namespace fastopt
