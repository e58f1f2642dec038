// Launching a functor over many tensors: the kernel, and the launch of each packed list
// (see launch_plan.h for how tensors and chunks are packed into launches).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "launch_plan.h"

namespace fastopt {
namespace cuda {

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("lightning_fastopt CUDA kernel ") + what + " failed to launch: " +
                             cudaGetErrorString(err));
}

template <typename List, typename Functor>
__global__ void __launch_bounds__(kBlockSize) multi_tensor_kernel(List tl, Functor f) {
  f(tl);
}

// Whether this process launches with 32 KB kernel arguments: CUDA 12.1+ at build time, a
// driver of 530+ (CUDA 12.1's) and a Volta or newer GPU at run time, and not switched off
// with LIGHTNING_FASTOPT_CUDA_KERNEL_ARGS=4k (read at every launch, so tests can compare).
inline bool large_kernel_args() {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
  static const bool supported = [] {
    int driver = 0, device = 0, major = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess || cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
      return false;
    return driver >= 12010 && major >= 7;
  }();
  const char* forced = std::getenv("LIGHTNING_FASTOPT_CUDA_KERNEL_ARGS");
  return supported && !(forced != nullptr && std::string(forced) == "4k");
#else
  return false;
#endif
}

// Launches Functor over the items on `stream`.
template <int D, typename Functor>
void launch_multi_tensor(const std::vector<LaunchItem<D>>& items, const Functor& f, cudaStream_t stream,
                         const char* what) {
  auto run = [&](auto big) {
    using List = TensorList<D, decltype(big)::value>;
    multi_tensor_apply<D, decltype(big)::value>(items, [&](const List& tl, int blocks) {
      multi_tensor_kernel<List, Functor><<<blocks, kBlockSize, 0, stream>>>(tl, f);
      check_launch(what);
    });
  };
  if (large_kernel_args()) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

}  // namespace cuda
}  // namespace fastopt
