// Vector math shared by the kernels: a softmax's exponential on 8 lanes (the compiler leaves
// std::exp scalar) and horizontal reductions (paged_attention.cpp, encoder_attention.cpp's
// fallback), and narrow storage widened to fp32 (bf16 weights, 16-bit KV caches). Header-only: each kernel
// inlines them into its loops.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace spindle {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of an fp32: a shift the vectoriser turns into one instruction.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);  // c10's conversions round to nearest even
}

// x rounded to T and back: where torch rounds a T op's result (T = float: x itself). Kernels on
// bf16 activations compute in fp32 and round at the points torch's separate bf16 ops do.
template <typename T>
inline float rounded(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return to_float(from_float<T>(x));
  }
}

#ifdef __AVX512F__
// 16 bf16 values (their bits) widened to fp32 (exact: a shift).
inline __m512 widen16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
#endif

// dst[0, n) <- src[0, n) widened to fp32 (exact), 8 at a time by hand: bf16 by a shift with
// AVX2; float16 with F16C's vcvtph2ps, since c10::Half's conversion is bit manipulation GCC
// does not vectorise (a float16 KV cache read 2.3x slower than a bf16 one at 64 rows x 192
// tokens before this).
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 8 <= n; i += 8) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
    }
  }
#endif
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// e^x for x <= 0 (softmax after subtracting the running max), vectorisable: 2^n * e^r with
// |r| <= ln2 / 2 and a degree-7 Taylor polynomial (truncation error ~5e-9, below fp32's eps).
// Inputs below -87 give e^-87 (~1.6e-38): a weight that vanishes next to the max's 1.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#ifdef __AVX2__
// The arithmetic of one fp32 register, per width, for code written once for both (the vector
// exponential below; paged attention's prefill tiles, prefill_lanes.h).
struct Ops8 {
  using V = __m256;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V zero() { return _mm256_setzero_ps(); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V floor(V x) { return _mm256_floor_ps(x); }
  // 2^n for integral n in fp32's exponent range.
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};

#if defined(__AVX512F__) && defined(__AVX512DQ__)
struct Ops16 {
  using V = __m512;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V floor(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};
#endif

// exp_nonpositive on a register of lanes: the same range reduction and polynomial as the
// scalar form, so every path agrees.
template <typename O>
inline typename O::V exp_nonpositive_lanes(typename O::V x) {
  x = O::max(x, O::set1(-87.0f));
  const typename O::V n = O::floor(O::fmadd(x, O::set1(1.44269504088896341f), O::set1(0.5f)));
  typename O::V r = O::fnmadd(n, O::set1(0.693145751953125f), x);
  r = O::fnmadd(n, O::set1(1.428606765330187045e-06f), r);
  typename O::V p = O::set1(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = O::fmadd(p, r, O::set1(c));
  return O::mul(p, O::pow2(n));
}

inline __m256 exp_nonpositive(__m256 x) { return exp_nonpositive_lanes<Ops8>(x); }
#if defined(__AVX512F__) && defined(__AVX512DQ__)
inline __m512 exp_nonpositive(__m512 x) { return exp_nonpositive_lanes<Ops16>(x); }
#endif

// The largest of a vector's 8 lanes.
inline float max_lane(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The sum of a vector's 8 lanes.
inline float sum_lanes(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
#endif

#ifdef __AVX2__
// [sum(v[0]), sum(v[1]), ..., sum(v[7])]: eight horizontal sums in one transposing add tree.
inline __m256 sum_each(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a = [0 1 2 3 | 0 1 2 3] halves of v[0..3], b likewise for v[4..7]: add the 128-bit halves.
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// The largest of s[a, e), e > a.
inline float max_of(const float* s, int64_t a, int64_t e) {
  float m = s[a];
  int64_t j = a;
#ifdef __AVX2__
  if (e - a >= 8) {  // the compiler leaves this scalar: 8 lanes by hand
    __m256 v = _mm256_loadu_ps(s + a);
    for (j = a + 8; j + 8 <= e; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
    m = max_lane(v);
  }
#endif
  for (; j < e; ++j) m = std::max(m, s[j]);
  return m;
}

// s[j] <- e^(s[j] - shift) for j in [a, e), shift >= every s[j] (a softmax's max); returns their sum.
inline float exp_shifted_sum(float* s, int64_t a, int64_t e, float shift) {
  float sum = 0.0f;
  int64_t j = a;
#ifdef __AVX2__
  __m256 sums = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(shift);
  for (; j + 8 <= e; j += 8) {
    const __m256 w = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, w);
    sums = _mm256_add_ps(sums, w);
  }
  sum = sum_lanes(sums);
#endif
#pragma omp simd reduction(+ : sum)
  for (int64_t t = j; t < e; ++t) {  // the rest (all of it without AVX2)
    s[t] = exp_nonpositive(s[t] - shift);
    sum += s[t];
  }
  return sum;
}

}  // namespace spindle
