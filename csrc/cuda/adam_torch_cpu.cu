// Adam in the rounding of torch's CPU step, for CUDA tensors where no CUDA rounding is asked
// for (adam_roundings.cuh).
#include "adam_roundings.cuh"

namespace fastopt {
namespace cuda {

template void adam_in_rounding<Rounding::kTorchCpu>(
    const Slots&, const AdamArgs&, bool, const DeviceScalars&, cudaStream_t);

}  // namespace cuda
}  // namespace fastopt
