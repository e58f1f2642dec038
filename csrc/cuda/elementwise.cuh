// What the CUDA optimizer kernels share beyond the chunk walk (chunk_walk.cuh): the launch
// of element-wise algorithms, and deterministic block sums for the two-pass ones.  The
// algorithms' per-element math lives in optimizer_math.cuh.
#pragma once

#include <type_traits>
#include <vector>

#include "chunk_walk.cuh"
#include "multi_tensor_apply.cuh"

namespace fastopt {
namespace cuda {

// Runs an element-wise algorithm over every slot on `stream`.
template <int NS, typename Math>
void elementwise_step(const Slots& slots, const Math& math, const DeviceScalars& d, cudaStream_t stream,
                      const char* what) {
  elementwise_launches<NS>(slots, math, d, [&](const auto& items, const auto& f) {
    launch_multi_tensor(items, f, stream, what);
  });
}

// ---------------------------------------------------------------- block sums
// The sum of `v` over the block, the same on every thread, added in a fixed order.
template <typename T>
__device__ __forceinline__ T block_sum(T v) {
  __shared__ T warp_sums[kBlockSize / 32];
  __shared__ T result;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    T s = 0;
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) s += warp_sums[w];
    result = s;
  }
  __syncthreads();
  const T out = result;
  __syncthreads();  // the shared slots may be reused by the next call
  return out;
}

// Adds a and b over the block and stores them as this chunk's pair of partial sums (the
// functors of two-pass algorithms; every thread of the block must call it).
template <typename List>
__device__ __forceinline__ void store_chunk_pair(const List& tl, const ChunkPos& pos, float* partials,
                                                 float a, float b) {
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) {
    const int64_t at = 2 * (static_cast<int64_t>(tl.chunk_base[pos.t]) + pos.chunk);
    partials[at] = a;
    partials[at + 1] = b;
  }
}

// The sums of the two per-chunk partial series of a tensor (pairs at partials[2 * chunk]),
// over its chunks [base, base + chunks), in double and in a fixed order: every block of
// the tensor gets the same bits.
__device__ __forceinline__ double2 tensor_totals(const float* partials, int64_t base, int64_t chunks) {
  double a = 0.0, b = 0.0;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    a += static_cast<double>(partials[2 * (base + c)]);
    b += static_cast<double>(partials[2 * (base + c) + 1]);
  }
  a = block_sum(a);
  b = block_sum(b);
  return make_double2(a, b);
}

}  // namespace cuda
}  // namespace fastopt
