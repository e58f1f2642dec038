// Adam in the rounding of torch's CUDA fused=True kernel (adam_roundings.cuh).
#include "adam_roundings.cuh"

namespace fastopt {
namespace cuda {

template FASTOPT_ADAM_IN_ROUNDING(Rounding::kTorchCudaFused);

}  // namespace cuda
}  // namespace fastopt
