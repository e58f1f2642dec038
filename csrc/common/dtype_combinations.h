// The dtype combinations the kernels compute, written once for the CPU kernels
// (../cpu/tensor_walk.h) and the CUDA kernels (../cuda/chunk_walk.cuh):
//
//   float32 master param x (float32 | fp16 | bf16 gradient) x (no copy | fp16 | bf16 copy)   9
//   fp16 param (no master) x (fp16 | float32 gradient), no copy                               2
//   bf16 param (no master) x (bf16 | float32 gradient), no copy                               2
//
// `Storage` is a family of tag types, one per element type: Storage::F32, F16, BF16, and
// Storage::None for "no copy".  Each side passes its own (the CPU's vector load/store tags,
// CUDA's element types), so both instantiate exactly these 13.
#pragma once

#include "kernel_types.h"

namespace fastopt {

// Calls fn(P{}, G{}, C{}) with the Storage tags of a slot's param, gradient and copy.
template <typename Storage, typename Fn>
auto dispatch_dtype_combination(const TensorSlot& s, const Fn& fn) {
  using F32 = typename Storage::F32;
  using F16 = typename Storage::F16;
  using BF16 = typename Storage::BF16;
  using None = typename Storage::None;
  auto with_copy = [&](auto p, auto g) {
    switch (s.copy_dtype) {
      case DType::kFloat16: return fn(p, g, F16{});
      case DType::kBFloat16: return fn(p, g, BF16{});
      default: return fn(p, g, None{});
    }
  };
  switch (s.param_dtype) {
    case DType::kFloat32:
      switch (s.grad_dtype) {
        case DType::kFloat16: return with_copy(F32{}, F16{});
        case DType::kBFloat16: return with_copy(F32{}, BF16{});
        default: return with_copy(F32{}, F32{});
      }
    case DType::kFloat16:
      return s.grad_dtype == DType::kFloat32 ? fn(F16{}, F32{}, None{}) : fn(F16{}, F16{}, None{});
    default:
      return s.grad_dtype == DType::kFloat32 ? fn(BF16{}, F32{}, None{}) : fn(BF16{}, BF16{}, None{});
  }
}

}  // namespace fastopt
