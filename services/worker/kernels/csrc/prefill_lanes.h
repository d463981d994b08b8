// The vector operations of paged attention's prefill tiles (paged_attention.cpp, `run_tiles`),
// over one register of query vectors: 16 on AVX-512 (masks in mask registers), 8 on AVX2
// (masks as all-ones lanes), so a CPU with either runs the same tile code. The arithmetic comes
// from vec_math.h's Ops8 / Ops16; these add the exponential and the masks.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "vec_math.h"

namespace spindle {

#ifdef __AVX2__
// 8 query vectors a register (AVX2 with FMA).
struct Lanes8 : Ops8 {
  static constexpr int64_t N = 8;
  using M = __m256;  // the lanes it selects have every bit set
  static V exp(V x) { return exp_nonpositive(x); }
  // Lanes whose query sees key position `key`: low[lane] <= key <= pos[lane].
  static M sees(const int32_t* pos, const int32_t* low, int32_t key) {
    const __m256i k = _mm256_set1_epi32(key);
    const __m256i outside = _mm256_or_si256(
        _mm256_cmpgt_epi32(k, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos))),
        _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low)), k));
    return _mm256_castsi256_ps(_mm256_xor_si256(outside, _mm256_set1_epi32(-1)));
  }
  static bool any(M m) { return _mm256_movemask_ps(m) != 0; }
  static V select(M m, V yes, V no) { return _mm256_blendv_ps(no, yes, m); }
  static V keep(M m, V v) { return _mm256_and_ps(m, v); }  // 0 outside the mask
  static M not_equal(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_NEQ_OQ); }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// 16 query vectors a register (AVX-512), masks in mask registers.
struct Lanes16 : Ops16 {
  static constexpr int64_t N = 16;
  using M = __mmask16;
  static V exp(V x) { return exp_nonpositive(x); }
  static M sees(const int32_t* pos, const int32_t* low, int32_t key) {
    const __m512i k = _mm512_set1_epi32(key);
    return _mm512_cmp_epi32_mask(k, _mm512_loadu_si512(pos), _MM_CMPINT_LE) &
           _mm512_cmp_epi32_mask(_mm512_loadu_si512(low), k, _MM_CMPINT_LE);
  }
  static bool any(M m) { return m != 0; }
  static V select(M m, V yes, V no) { return _mm512_mask_mov_ps(no, m, yes); }
  static V keep(M m, V v) { return _mm512_maskz_mov_ps(m, v); }
  static M not_equal(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
};
#endif

}  // namespace spindle
