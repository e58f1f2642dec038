// Runs the multi-tensor-apply packing (csrc/cuda/launch_plan.h) on the host and prints
// every launch it would make, for tests/test_cuda_build.py to check:
//   launch_plan_check DEPTH SIZE N0 N1 ...   (DEPTH 1, 4 or 6; SIZE 4k or 32k: the kernel
//                                            argument's capacity; then the tensor sizes)
// prints per launch a line "launch BLOCKS TENSORS", then per block a line
// "block INDEX CHUNK CHUNK_BASE NUMEL ADDR0 ADDRLAST" (addresses are fake: 16 * index + k).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "cuda/launch_plan.h"

using namespace fastopt::cuda;

template <int D, bool kBig>
int run(const std::vector<int64_t>& sizes) {
  std::vector<LaunchItem<D>> items;
  int64_t base = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    LaunchItem<D> item;
    for (int k = 0; k < D; ++k) item.addr[k] = reinterpret_cast<void*>(static_cast<uintptr_t>(16 * i + k));
    item.numel = sizes[i];
    item.index = static_cast<int32_t>(i);
    item.chunk_base = static_cast<int32_t>(base);
    base += chunks_of(sizes[i]);
    items.push_back(item);
  }
  multi_tensor_apply<D, kBig>(items, [](const TensorList<D, kBig>& tl, int blocks) {
    std::set<int> tensors;
    for (int b = 0; b < blocks; ++b) tensors.insert(tl.block_tensor[b]);
    std::printf("launch %d %zu\n", blocks, tensors.size());
    for (int b = 0; b < blocks; ++b) {
      const int t = tl.block_tensor[b];
      std::printf("block %d %d %d %lld %llu %llu\n", tl.index[t], tl.block_chunk[b], tl.chunk_base[t],
                  static_cast<long long>(tl.numel[t]),
                  static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(tl.addr[0][t])),
                  static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(tl.addr[D - 1][t])));
    }
  });
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const int depth = std::atoi(argv[1]);
  const bool big = std::string(argv[2]) == "32k";
  std::vector<int64_t> sizes;
  for (int i = 3; i < argc; ++i) sizes.push_back(std::atoll(argv[i]));
  std::printf("chunk %lld max_blocks %d max_tensors %d\n", static_cast<long long>(kChunkSize), max_blocks(big),
              max_tensors(depth, big));
  switch (depth * 2 + (big ? 1 : 0)) {
    case 2: return run<1, false>(sizes);
    case 3: return run<1, true>(sizes);
    case 8: return run<4, false>(sizes);
    case 9: return run<4, true>(sizes);
    case 12: return run<6, false>(sizes);
    case 13: return run<6, true>(sizes);
    default: return 2;
  }
}
