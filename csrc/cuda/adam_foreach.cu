// Adam in the rounding of torch's CUDA foreach step (adam_roundings.cuh).
#include "adam_roundings.cuh"

namespace fastopt {
namespace cuda {

template FASTOPT_ADAM_IN_ROUNDING(Rounding::kTorchCudaForeach);

}  // namespace cuda
}  // namespace fastopt
