// Adam in the rounding of torch's CPU step, for CUDA tensors where no CUDA rounding is asked
// for (adam_roundings.cuh).
#include "adam_roundings.cuh"

namespace fastopt {
namespace cuda {

template FASTOPT_ADAM_IN_ROUNDING(Rounding::kTorchCpu);

}  // namespace cuda
}  // namespace fastopt
