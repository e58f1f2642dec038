// Adam in the rounding of torch's CUDA for-loop step (adam_roundings.cuh).
#include "adam_roundings.cuh"

namespace fastopt {
namespace cuda {

template FASTOPT_ADAM_IN_ROUNDING(Rounding::kTorchCudaForLoop);

}  // namespace cuda
}  // namespace fastopt
