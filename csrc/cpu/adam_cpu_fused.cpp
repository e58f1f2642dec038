// Adam / AdamW rounded as torch's CPU fused=True kernel (kTorchCpuFused, adam_math.h): its own
// translation unit, compiled in parallel with the other roundings.
#include "adam_math.h"

namespace fastopt::adam_detail {

template void one_pass_step<Rounding::kTorchCpuFused>(const Slots&, const AdamArgs&);

}  // namespace fastopt::adam_detail
