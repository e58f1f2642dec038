// The scalar arguments of each algorithm, shared by the CPU kernels (../cpu/kernel_api.h),
// the CUDA kernels (../cuda/cuda_api.h) and both bindings (optimizer_calls.h builds them).
// All scalars are already resolved by the caller (lightning_fastopt.functional): bias
// corrections, the unscaling factor, LAMB's clipping divisor.
#pragma once

namespace fastopt {

// Which implementation of torch's an algorithm reproduces, rounding for rounding: the
// operations torch evaluates, in its order, with a fused multiply-add exactly where its
// kernels have one.  Chosen once per optimizer (lightning_fastopt.ops.rounding) and
// carried into the kernels as a template flag.
enum class Rounding : int {
  kTorchCpu = 0,          // torch's CPU step (the for-loop one)
  kTorchCudaForeach = 1,  // torch's CUDA foreach step (the default on CUDA), torch >= 2.11
  kTorchCudaFused = 2,    // torch's CUDA fused=True kernel, torch >= 2.11
  kTorchCpuFused = 3,     // torch's CPU fused=True kernel: kTorchCpu's operations (the IEEE square
                          // root) in its vector loop, others in its scalar loop over each tensor's
                          // last numel % 8 elements (../cpu/tensor_walk.h); CPU tensors only
  kTorchCudaForLoop = 4,  // torch's CUDA for-loop step (foreach=False), torch >= 2.11: Adam's
                          // bias correction through a reciprocal, Adagrad's addcdiv one fma
};

// torch's CUDA steps made of ATen's pointwise ops (foreach and for-loop), whose addcmul and
// addcdiv are one fused multiply-add of the scalar and the product or quotient.
template <Rounding R>
inline constexpr bool kCudaAtenOps = R == Rounding::kTorchCudaForeach || R == Rounding::kTorchCudaForLoop;

struct AdamArgs {
  float lr, beta1, beta2, eps, weight_decay;
  float step_size;              // lr / bias_correction1
  float bias_correction2_sqrt;  // sqrt(bias_correction2)
  // what torch's CUDA for-loop step multiplies by where it divides by bias_correction2_sqrt
  // (a host scalar): the double reciprocal rounded once (ops/rounding.py's float_reciprocal)
  float inv_bias_correction2_sqrt;
  float inv_grad_scale;         // 1 / loss scale (1 when unscaled)
  bool amsgrad, adamw, maximize;
  double beta1_exact, beta2_exact;  // the betas as given: bias corrections computed on the device (capturable)
  float decay;                  // AdamW's factor 1 - lr * weight_decay, computed in double (as torch)
  bool torch_sqrt;              // CPU: the square root torch's CPU ops compute (MKL's), not the IEEE one
  // kTorchCudaFused: step_size and bias_correction2_sqrt computed in float from CUDA's powf
  // by the caller (lightning_fastopt.ops.rounding), or on the device from a device step
  Rounding rounding = Rounding::kTorchCpu;
};
// state: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad only)

struct SgdArgs {
  float lr, momentum;
  float one_minus_dampening;  // rounded as the rounding followed rounds it (sgd_rounding.h)
  float weight_decay, inv_grad_scale;
  bool nesterov, maximize, wd_after_momentum;
  bool first_step;  // the momentum buffer is initialised from the gradient (torch semantics)
  // kTorchCpu (the CPU and CUDA foreach steps), kTorchCudaFused or kTorchCpuFused (sgd_rounding.h)
  Rounding rounding = Rounding::kTorchCpu;
};
// state: momentum_buffer (momentum != 0 only)

struct AdagradArgs {
  float clr, weight_decay, eps, inv_grad_scale;  // clr = lr / (1 + (step - 1) * lr_decay)
  bool maximize;
  bool torch_sqrt;  // CPU: the square root torch's CPU ops compute (MKL's), not the IEEE one
  // kTorchCpu (torch's CPU step, and its CUDA foreach step), kTorchCudaForLoop (its CUDA
  // for-loop step) or kTorchCudaFused (its fused CUDA kernel, in double: fused_cuda_adagrad.h),
  // which takes these as given, in double
  Rounding rounding = Rounding::kTorchCpu;
  double clr_exact = 0.0, weight_decay_exact = 0.0, eps_exact = 0.0;
};
// state: sum

struct LionArgs {
  float lr, beta1, beta2, weight_decay, inv_grad_scale;
  bool maximize;
};
// state: exp_avg

struct LambArgs {
  float lr, beta1, beta2, beta3, eps, weight_decay;
  float bias_correction1, bias_correction2;
  float grad_factor;  // 1 / (loss scale * clipping divisor)
  bool adam_w_mode, use_trust_ratio, maximize;
  double beta1_exact, beta2_exact;  // the betas as given: bias corrections computed on the device
  // per tensor, (||p||^2, ||u||^2) over the whole tensor, given (summed over the ranks
  // holding pieces of it: FSDP's rows); null: the kernel takes them over what it steps
  const double* norms = nullptr;
};
// state: exp_avg, exp_avg_sq

struct LarsArgs {
  float lr, momentum, eeta, weight_decay, epsilon, inv_grad_scale;
  bool maximize;
  // per tensor, (||g||^2 of the scaled gradient, ||p||^2) over the whole tensor, given (as
  // LambArgs::norms); null: the kernel takes them over what it steps
  const double* norms = nullptr;
};
// state: momentum_buffer

}  // namespace fastopt
