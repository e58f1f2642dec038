// Launching a functor over many tensors: the kernel, and the launch of each packed list
// (see launch_plan.h for how tensors and chunks are packed into launches).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "launch_plan.h"

namespace fastopt {
namespace cuda {

constexpr int kBlockSize = 512;
constexpr int kILP = 4;  // elements per thread per iteration (one vector load)
static_assert(kChunkSize % (kBlockSize * kILP) == 0, "a chunk is a whole number of block iterations");

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("lightning_fastopt CUDA kernel ") + what + " failed to launch: " +
                             cudaGetErrorString(err));
}

template <int D, typename Functor>
__global__ void __launch_bounds__(kBlockSize) multi_tensor_kernel(TensorList<D> tl, Functor f) {
  f(tl);
}

// Launches Functor over the items on `stream`.
template <int D, typename Functor>
void launch_multi_tensor(const std::vector<LaunchItem<D>>& items, const Functor& f, cudaStream_t stream,
                         const char* what) {
  multi_tensor_apply<D>(items, [&](const TensorList<D>& tl, int blocks) {
    multi_tensor_kernel<D, Functor><<<blocks, kBlockSize, 0, stream>>>(tl, f);
    check_launch(what);
  });
}

}  // namespace cuda
}  // namespace fastopt
