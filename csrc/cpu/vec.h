// A small float-vector abstraction for the CPU optimizer kernels.
//
// One `VecF` type per instruction set, chosen at compile time by the build (the
// Python builder passes -DFASTOPT_ISA_AVX512 or -DFASTOPT_ISA_AVX2 together with the
// matching -m flags and keys its cache on the ISA, so a binary never runs on a CPU it
// was not built for).  Without either macro a portable fixed-width array version is
// used; the compiler auto-vectorises it for the target's baseline (SSE2, NEON, ...).
//
// Every kernel does its arithmetic in float.  Loads and stores convert from and to the
// storage type (float, IEEE half, bfloat16) in the same pass, rounding to nearest even
// exactly as torch's `.to(dtype)` does.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(FASTOPT_ISA_AVX512) || defined(FASTOPT_ISA_AVX2)
#include <immintrin.h>
#endif

namespace fastopt {

// Stochastic rounding to bfloat16 (Adam's state kept in bfloat16): a float rounds away
// from zero with probability equal to the fraction of the bfloat16 step it lies beyond
// the neighbour toward zero (unbiased), from 16 bits of noise added below the bfloat16
// mantissa.  The noise of element i of state k is the top half of i * kIndexMix + seed_k
// (mod 2^32): a Weyl sequence over the elements (evenly spread), offset by a hash of this
// step's seed and k (so each element's noise is uniform over steps).  It depends on
// (step, k, i) only: results do not depend on threads, vectors or bucketing, and
// torch_backend.stochastic_noise computes the same bits.  No multiply per vector: the
// lanes' offsets are constants.
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
// The seed of state k from the step's seed.
inline uint32_t state_rounding_seed(uint32_t step_seed, int k) {
  return lowbias32(step_seed + 0x632BE5ABU * static_cast<uint32_t>(k + 1));
}
constexpr uint32_t kIndexMix = 0x9E3779B1U;  // 2^32 / golden ratio
inline uint32_t rounding_noise(uint32_t seed, uint32_t i) { return (i * kIndexMix + seed) >> 16; }
constexpr int lane_mix(int lane) { return static_cast<int>(static_cast<uint32_t>(lane) * kIndexMix); }
inline uint16_t round_bf16_stochastic(float x, uint32_t noise) {
  if (x != x) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return static_cast<uint16_t>((u + noise) >> 16);
}

// Storage tags: the element type a tensor holds in memory.
struct F32 { using type = float; };
struct F16 { using type = c10::Half; };
struct BF16 { using type = c10::BFloat16; };
// "No tensor here" (an absent parameter copy).
struct None { using type = void; };

#if defined(FASTOPT_ISA_AVX512)

struct VecF {
  static constexpr int W = 16;
  __m512 v;
  VecF() = default;
  VecF(__m512 x) : v(x) {}
  static VecF set1(float x) { return _mm512_set1_ps(x); }
  static VecF zero() { return _mm512_setzero_ps(); }

  static VecF load(const float* p) { return _mm512_loadu_ps(p); }
  static VecF load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static VecF load(const c10::BFloat16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  // The 16 half-precision values, rounded to nearest even (NaN stays NaN), as raw bits.
  __m256i bits(const c10::Half*) const { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  __m256i bits(const c10::BFloat16*) const {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  template <typename H>
  void store(H* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits(p)); }
  // Non-temporal store (p 32-byte aligned): for write-only outputs it skips reading the
  // destination line before writing it.
  template <typename H>
  void stream(H* p) const { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bits(p)); }
  static constexpr int kStreamAlign = 32;
  // bfloat16 with stochastic rounding; the lanes are elements first, first + 1, ...
  void store_stochastic(c10::BFloat16* p, uint32_t seed, uint32_t first) const {
    const __m512i lanes = _mm512_setr_epi32(0, lane_mix(1), lane_mix(2), lane_mix(3), lane_mix(4),
                                            lane_mix(5), lane_mix(6), lane_mix(7), lane_mix(8),
                                            lane_mix(9), lane_mix(10), lane_mix(11), lane_mix(12),
                                            lane_mix(13), lane_mix(14), lane_mix(15));
    const __m512i noise = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first * kIndexMix + seed)), lanes), 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(v), noise), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }

  friend VecF operator+(VecF a, VecF b) { return _mm512_add_ps(a.v, b.v); }
  friend VecF operator-(VecF a, VecF b) { return _mm512_sub_ps(a.v, b.v); }
  friend VecF operator*(VecF a, VecF b) { return _mm512_mul_ps(a.v, b.v); }
  friend VecF operator/(VecF a, VecF b) { return _mm512_div_ps(a.v, b.v); }
  // a * b + c with one rounding.
  static VecF fmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }
  static VecF sqrt(VecF a) { return _mm512_sqrt_ps(a.v); }
  static VecF max(VecF a, VecF b) { return _mm512_max_ps(a.v, b.v); }
  // -1, 0 or +1 (0 for +-0 and NaN).
  static VecF sign(VecF a) {
    __mmask16 pos = _mm512_cmp_ps_mask(a.v, _mm512_setzero_ps(), _CMP_GT_OQ);
    __mmask16 neg = _mm512_cmp_ps_mask(a.v, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 r = _mm512_mask_blend_ps(pos, _mm512_setzero_ps(), _mm512_set1_ps(1.0f));
    return _mm512_mask_blend_ps(neg, r, _mm512_set1_ps(-1.0f));
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
};

#elif defined(FASTOPT_ISA_AVX2)

struct VecF {
  static constexpr int W = 8;
  __m256 v;
  VecF() = default;
  VecF(__m256 x) : v(x) {}
  static VecF set1(float x) { return _mm256_set1_ps(x); }
  static VecF zero() { return _mm256_setzero_ps(); }

  static VecF load(const float* p) { return _mm256_loadu_ps(p); }
  static VecF load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static VecF load(const c10::BFloat16* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  // The 8 half-precision values, rounded to nearest even (NaN stays NaN), as raw bits.
  __m128i bits(const c10::Half*) const { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  __m128i bits(const c10::BFloat16*) const {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // 32 -> 16 bit: packus works per 128-bit lane, so put the two halves back in order.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
  }
  template <typename H>
  void store(H* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bits(p)); }
  // Non-temporal store (p 16-byte aligned): for write-only outputs it skips reading the
  // destination line before writing it.
  template <typename H>
  void stream(H* p) const { _mm_stream_si128(reinterpret_cast<__m128i*>(p), bits(p)); }
  static constexpr int kStreamAlign = 16;
  // bfloat16 with stochastic rounding; the lanes are elements first, first + 1, ...
  void store_stochastic(c10::BFloat16* p, uint32_t seed, uint32_t first) const {
    const __m256i lanes = _mm256_setr_epi32(0, lane_mix(1), lane_mix(2), lane_mix(3), lane_mix(4),
                                            lane_mix(5), lane_mix(6), lane_mix(7));
    const __m256i noise = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first * kIndexMix + seed)), lanes), 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(v), noise), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8)));
  }

  friend VecF operator+(VecF a, VecF b) { return _mm256_add_ps(a.v, b.v); }
  friend VecF operator-(VecF a, VecF b) { return _mm256_sub_ps(a.v, b.v); }
  friend VecF operator*(VecF a, VecF b) { return _mm256_mul_ps(a.v, b.v); }
  friend VecF operator/(VecF a, VecF b) { return _mm256_div_ps(a.v, b.v); }
  static VecF fmadd(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
  static VecF sqrt(VecF a) { return _mm256_sqrt_ps(a.v); }
  static VecF max(VecF a, VecF b) { return _mm256_max_ps(a.v, b.v); }
  static VecF sign(VecF a) {
    __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, _mm256_setzero_ps(), _CMP_LT_OQ), _mm256_set1_ps(1.0f));
    return _mm256_sub_ps(pos, neg);
  }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

#else  // portable

struct VecF {
  static constexpr int W = 8;
  float v[W];
  static VecF set1(float x) { VecF r; for (int i = 0; i < W; ++i) r.v[i] = x; return r; }
  static VecF zero() { return set1(0.0f); }
  template <typename T>
  static VecF load(const T* p) { VecF r; for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i]); return r; }
  template <typename T>
  void store(T* p) const { for (int i = 0; i < W; ++i) p[i] = static_cast<T>(v[i]); }
  template <typename H>
  void stream(H* p) const { store(p); }
  static constexpr int kStreamAlign = 1;
  void store_stochastic(c10::BFloat16* p, uint32_t seed, uint32_t first) const {
    for (int i = 0; i < W; ++i) {
      const uint16_t b = round_bf16_stochastic(v[i], rounding_noise(seed, first + static_cast<uint32_t>(i)));
      std::memcpy(p + i, &b, sizeof(b));
    }
  }

#define FASTOPT_BINOP(op)                                        \
  friend VecF operator op(const VecF& a, const VecF& b) {        \
    VecF r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] op b.v[i]; return r; }
  FASTOPT_BINOP(+) FASTOPT_BINOP(-) FASTOPT_BINOP(*) FASTOPT_BINOP(/)
#undef FASTOPT_BINOP
  static VecF fmadd(const VecF& a, const VecF& b, const VecF& c) {
    VecF r; for (int i = 0; i < W; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
  static VecF sqrt(const VecF& a) { VecF r; for (int i = 0; i < W; ++i) r.v[i] = std::sqrt(a.v[i]); return r; }
  static VecF max(const VecF& a, const VecF& b) {
    VecF r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] < b.v[i] ? b.v[i] : a.v[i]; return r; }
  static VecF sign(const VecF& a) {
    VecF r; for (int i = 0; i < W; ++i) r.v[i] = float(a.v[i] > 0.0f) - float(a.v[i] < 0.0f); return r; }
  float sum() const { float s = 0.0f; for (int i = 0; i < W; ++i) s += v[i]; return s; }
};

#endif

// Orders non-temporal stores before whatever follows (a no-op without them).
inline void stream_fence() {
#if defined(FASTOPT_ISA_AVX512) || defined(FASTOPT_ISA_AVX2)
  _mm_sfence();
#endif
}

// Name of the instruction set this translation unit was compiled for.
inline const char* isa_name() {
#if defined(FASTOPT_ISA_AVX512)
  return "avx512";
#elif defined(FASTOPT_ISA_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace fastopt
