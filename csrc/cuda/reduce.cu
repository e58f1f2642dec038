// Multi-tensor reductions: per-tensor sums of squares (L2 norms for clipping, LAMB's
// global norm, LARS), the inf/NaN check, unscaling with the overflow check, and the
// fingerprints that notice writes to the weights (lightning_fastopt.offload.weight_watch).
#include "elementwise.cuh"

namespace fastopt {
namespace cuda {
namespace {

// A reduction reads one tensor of each slot: the gradient (which == 0) or the parameter.
using GradLayout = Layout<Role::kGrad>;
using ParamLayout = Layout<Role::kParam>;
constexpr int kReduced = 0;  // its position in the launch (both layouts put it first)
static_assert(GradLayout::at(Role::kGrad) == kReduced && ParamLayout::at(Role::kParam) == kReduced, "");

// Pass 1 of sum_squares: partials[chunk_base + chunk] = sum of x^2 over the chunk.
template <typename T>
struct ChunkSquares {
  float* partials;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    const ChunkPos pos = chunk_pos(tl);
    const T* x = static_cast<const T*>(tl.addr[kReduced][pos.t]) + pos.start;
    float acc = 0.0f;
    for_each_index(pos.n, [&](int64_t i) {
      const float v = to_float(x[i]);
      acc = fmaf(v, v, acc);
    });
    acc = block_sum(acc);
    if (threadIdx.x == 0) partials[tl.chunk_base[pos.t] + pos.chunk] = acc;
  }
};

// Pass 2: the first block of each tensor adds its chunks' partials (double, fixed order).
struct TensorSquares {
  const float* partials;
  double* per_slot;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    const ChunkPos pos = chunk_pos(tl);
    if (pos.chunk != 0) return;
    const int64_t base = tl.chunk_base[pos.t], chunks = chunks_of(tl.numel[pos.t]);
    double acc = 0.0;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) acc += static_cast<double>(partials[base + c]);
    acc = block_sum(acc);
    if (threadIdx.x == 0) per_slot[tl.index[pos.t]] = acc;
  }
};

// One block: total = sum of per_slot[0..n), in order.
__global__ void add_up(const double* per_slot, int64_t n, double* total) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += per_slot[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *total = acc;
}

template <typename T>
struct FiniteCheck {
  float* found_inf;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    const ChunkPos pos = chunk_pos(tl);
    const T* x = static_cast<const T*>(tl.addr[kReduced][pos.t]) + pos.start;
    bool bad = false;
    for_each_index(pos.n, [&](int64_t i) { bad |= !isfinite(to_float(x[i])); });
    if (bad) *found_inf = 1.0f;  // every writer writes the same value
  }
};

template <typename T>
struct Unscale {
  float inv_grad_scale;
  const float* grad_scale;
  float* found_inf;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    const ChunkPos pos = chunk_pos(tl);
    T* x = static_cast<T*>(tl.addr[kReduced][pos.t]) + pos.start;
    const float inv = grad_scale != nullptr ? 1.0f / *grad_scale : inv_grad_scale;
    bool bad = false;
    for_each_index(pos.n, [&](int64_t i) {
      const float v = to_float(x[i]) * inv;
      bad |= !isfinite(v);
      x[i] = from_float<T>(v);
    });
    if (bad) *found_inf = 1.0f;
  }
};

// The bit pattern of an element, zero-extended.
__device__ __forceinline__ uint64_t bits_of(float x) { return __float_as_uint(x); }
__device__ __forceinline__ uint64_t bits_of(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ uint64_t bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

// SplitMix64's finalizer: a bijection of 64-bit words that spreads every input bit.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// per_slot[slot] += the sum (mod 2^64) over the chunk of mix64(bits ^ (index << 32)), the
// index counted from the tensor's first element: the definition is torch_backend.fingerprint.
// Integer sums are exact, so the order in which blocks add up does not matter.
template <typename T>
struct Fingerprint {
  unsigned long long* per_slot;
  template <typename List>
  __device__ void operator()(const List& tl) const {
    const ChunkPos pos = chunk_pos(tl);
    const T* x = static_cast<const T*>(tl.addr[kReduced][pos.t]) + pos.start;
    unsigned long long acc = 0;
    for_each_index(pos.n, [&](int64_t i) {
      acc += mix64(bits_of(x[i]) ^ (static_cast<uint64_t>(pos.start + i) << 32));
    });
    acc = block_sum(acc);
    if (threadIdx.x == 0) atomicAdd(per_slot + tl.index[pos.t], acc);
  }
};

// Runs Functor<T>(args...) over one tensor of every slot (the gradient when which == 0,
// else the parameter), one series of launches per dtype.
template <template <typename> class Functor, typename... Args>
void over_tensors(const Slots& slots, int which, cudaStream_t stream, const char* what, Args... args) {
  const std::vector<int32_t> bases = chunk_bases(slots);
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    std::vector<int32_t> idx;
    for (size_t i = 0; i < slots.size(); ++i)
      if ((which == 0 ? slots[i].grad_dtype : slots[i].param_dtype) == dt) idx.push_back(static_cast<int32_t>(i));
    if (idx.empty()) continue;
    auto items = which == 0 ? layout_items<GradLayout>(slots, idx, bases)
                            : layout_items<ParamLayout>(slots, idx, bases);
    auto run = [&](auto tag) {
      launch_multi_tensor<1>(items, Functor<typename decltype(tag)::type>{args...}, stream, what);
    };
    if (dt == DType::kFloat16) run(Tag<__half>{});
    else if (dt == DType::kBFloat16) run(Tag<__nv_bfloat16>{});
    else run(Tag<float>{});
  }
}

template <typename T>
using SquaresTotal = TensorSquares;

}  // namespace

int64_t total_chunks(const Slots& slots) {
  int64_t total = 0;
  for (const TensorSlot& s : slots) total += chunks_of(s.numel);
  return total;
}

void sum_squares(const Slots& slots, int which, float* partials, double* per_slot, double* total,
                 cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(slots.size());
  if (n == 0) {
    if (total != nullptr) {
      cudaMemsetAsync(total, 0, sizeof(double), stream);
      check_launch("sum_squares");
    }
    return;
  }
  cudaMemsetAsync(per_slot, 0, sizeof(double) * n, stream);  // empty tensors get no block
  over_tensors<ChunkSquares>(slots, which, stream, "sum_squares", partials);
  over_tensors<SquaresTotal>(slots, which, stream, "sum_squares", static_cast<const float*>(partials), per_slot);
  if (total != nullptr) {
    add_up<<<1, kBlockSize, 0, stream>>>(per_slot, n, total);
    check_launch("sum_squares");
  }
}

void check_finite(const Slots& slots, float* found_inf, cudaStream_t stream) {
  over_tensors<FiniteCheck>(slots, 0, stream, "check_finite", found_inf);
}

void unscale(const Slots& slots, float inv_grad_scale, const float* grad_scale, float* found_inf,
             cudaStream_t stream) {
  over_tensors<Unscale>(slots, 0, stream, "unscale", inv_grad_scale, grad_scale, found_inf);
}

void fingerprint(const Slots& slots, int64_t* per_slot, cudaStream_t stream) {
  if (slots.empty()) return;
  cudaMemsetAsync(per_slot, 0, sizeof(int64_t) * slots.size(), stream);  // empty tensors get no block
  check_launch("fingerprint");
  over_tensors<Fingerprint>(slots, 1, stream, "fingerprint", reinterpret_cast<unsigned long long*>(per_slot));
}

}  // namespace cuda
}  // namespace fastopt
