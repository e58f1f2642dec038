// Adam / AdamW on the CPU, rounded as torch's CUDA steps round (the offloaded share of a GPU
// run: kTorchCudaForeach, kTorchCudaFused, kTorchCudaForLoop, adam_math.h): their own
// translation unit, compiled in parallel with the CPU roundings.
#include "adam_math.h"

namespace fastopt::adam_detail {

template void one_pass_step<Rounding::kTorchCudaForeach>(const Slots&, const AdamArgs&);
template void one_pass_step<Rounding::kTorchCudaFused>(const Slots&, const AdamArgs&);
template void one_pass_step<Rounding::kTorchCudaForLoop>(const Slots&, const AdamArgs&);

}  // namespace fastopt::adam_detail
