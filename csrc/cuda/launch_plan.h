// How multi-tensor apply packs many tensors into each kernel launch (host code only, free
// of CUDA headers, so the packing is unit-tested on machines without CUDA:
// tests/cpp/launch_plan_check.cpp).
//
// The host packs the addresses and sizes of up to kMaxTensors tensors, and a map from
// each CUDA block to one (tensor, chunk) pair, into a `TensorList` that travels as the
// kernel argument (its size limit, 4 KB or 32 KB, sets the capacities).  A launch is
// issued whenever the tensors or the blocks of the current list are full, so any number
// of tensors of any sizes costs about chunks / kMaxBlocks launches (plus one per
// kMaxTensors tensors).  The kernel itself is one line: it calls the
// algorithm's functor, which works on the chunk its block was given.
//
// Depth D is the number of tensors updated together per slot (param, grad, states, copy);
// `TensorList::addr[k][i]` is the k-th tensor of slot i, `index[i]` the slot's position in
// the caller's list (for per-tensor results) and `chunk_base[i]` the number of chunks of
// all earlier slots of the call: a per-chunk partial result (a sum of squares) has the
// global position chunk_base + chunk, so later passes find every chunk of a tensor
// without any other bookkeeping on the device.
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/kernel_types.h"  // FASTOPT_HOST_DEVICE

namespace fastopt {
namespace cuda {

constexpr int kBlockSize = 512;        // threads per block
constexpr int kILP = 4;                // elements per thread per iteration (one vector load)
constexpr int64_t kChunkSize = 65536;  // elements per block
static_assert(kChunkSize % (kBlockSize * kILP) == 0, "a chunk is a whole number of block iterations");

// Two list capacities.  The classic kernel argument holds at most 4 KB; CUDA 12.1 with a
// driver of version 530 or newer on a Volta or newer GPU takes 32 KB, and a launch then
// carries 8 times the blocks (fewer launches, fewer partly filled waves).  Both are
// compiled; multi_tensor_apply.cuh picks one at run time.
constexpr int max_blocks(bool big) { return big ? 2560 : 320; }

// Tensors per launch for each depth, so that sizeof(TensorList) stays under the limit with
// room for the functor's own arguments.
constexpr int max_tensors(int depth, bool big) {
  return big ? (depth <= 1 ? 640 : depth == 2 ? 480 : depth == 3 ? 384 : depth == 4 ? 320 : depth == 5 ? 272 : 240)
             : (depth <= 1 ? 80 : depth == 2 ? 64 : depth == 3 ? 48 : depth == 4 ? 36 : depth == 5 ? 30 : 24);
}

template <int D, bool kBig = false>
struct TensorList {
  static constexpr int kDepth = D;
  static constexpr int kMaxTensors = max_tensors(D, kBig);
  static constexpr int kMaxBlocks = max_blocks(kBig);
  using TensorIndex = typename std::conditional<kBig, uint16_t, uint8_t>::type;
  void* addr[D][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t index[kMaxTensors];
  int32_t chunk_base[kMaxTensors];
  TensorIndex block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};

static_assert(sizeof(TensorList<1>) <= 3800 && sizeof(TensorList<6>) <= 3800, "kernel argument over 4 KB");
static_assert(sizeof(TensorList<1, true>) <= 31500 && sizeof(TensorList<2, true>) <= 31500 &&
              sizeof(TensorList<6, true>) <= 31500, "kernel argument over 32 KB");
static_assert(max_tensors(1, false) < 256 && max_tensors(1, true) < 65536, "block_tensor's type is too small");

FASTOPT_HOST_DEVICE inline int64_t chunks_of(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

// What the launcher needs of each slot: its D tensors, its size, its position in the
// caller's list and the number of chunks of the slots before it in that list.
template <int D>
struct LaunchItem {
  std::array<void*, D> addr;
  int64_t numel;
  int32_t index;
  int32_t chunk_base;
};

// Calls launch(list, blocks) for consecutive pieces of the work.  Empty tensors are skipped.
template <int D, bool kBig, typename Launch>
void multi_tensor_apply(const std::vector<LaunchItem<D>>& items, const Launch& launch) {
  using List = TensorList<D, kBig>;
  List tl;
  int tensors = 0, blocks = 0;
  for (const LaunchItem<D>& item : items) {
    const int64_t numel = item.numel;
    if (numel == 0) continue;
    for (int k = 0; k < D; ++k) tl.addr[k][tensors] = item.addr[k];
    tl.numel[tensors] = numel;
    tl.index[tensors] = item.index;
    tl.chunk_base[tensors] = item.chunk_base;
    ++tensors;
    const int64_t chunks = chunks_of(numel);
    for (int64_t c = 0; c < chunks; ++c) {
      tl.block_tensor[blocks] = static_cast<typename List::TensorIndex>(tensors - 1);
      tl.block_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      const bool blocks_full = blocks == List::kMaxBlocks;
      const bool tensors_full = tensors == List::kMaxTensors;
      if (blocks_full || (last_chunk && tensors_full)) {
        launch(tl, blocks);
        blocks = 0;
        if (last_chunk) {
          tensors = 0;
        } else {  // the current tensor continues in the next launch, as its first entry
          for (int k = 0; k < D; ++k) tl.addr[k][0] = tl.addr[k][tensors - 1];
          tl.numel[0] = tl.numel[tensors - 1];
          tl.index[0] = tl.index[tensors - 1];
          tl.chunk_base[0] = tl.chunk_base[tensors - 1];
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) launch(tl, blocks);
}

}  // namespace cuda
}  // namespace fastopt
