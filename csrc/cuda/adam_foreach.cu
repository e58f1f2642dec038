// Adam in the rounding of torch's CUDA foreach step (adam_roundings.cuh).
#include "adam_roundings.cuh"

namespace fastopt {
namespace cuda {

template void adam_in_rounding<Rounding::kTorchCudaForeach>(
    const Slots&, const AdamArgs&, bool, const DeviceScalars&, cudaStream_t);

}  // namespace cuda
}  // namespace fastopt
