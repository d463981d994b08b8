// Attention straight from a bf16 KV cache, for bf16 queries, on a CPU with AVX512-BF16
// (paged_attention.cpp: decode in `ItemKernel::accumulate_pairs`, prefill tiles' scores in
// `score_tile_pairs`).
//
// Why: the per-query loop (`accumulate`) reads fp32 rows, so a bf16 cache was first widened
// block by block into an L1 buffer, then scored 8 fp32 products a step. perf on it (2-core AMD
// EPYC Zen 4, decode, medium shapes, 8 rows x 256 tokens, KV in L3, one thread): a third of the
// kernel's time in the widening loop, stalled on its loads, a half in `accumulate`. With the
// activations in bf16 (`--dtype bfloat16`) the query is itself bf16, so here both products run
// on vdpbf16ps pairs straight from the cache, 32 products an instruction, each exact in fp32
// and summed there: the scores on (query, key) pairs along head_dim, reduced 16 keys at once;
// the weighted sum on (weight, value) pairs of two keys, the values interleaved by dimension in
// registers. Nothing is widened or copied. Same shapes, ns per token and KV head per thread:
// 34-37 -> 21 (the scores alone on pairs, values widened in registers: 26).
//
// Prefill tiles (16 query vectors in the lanes, paged_attention.cpp `run_tiles`) take their
// scores the same way, one key's pair broadcast to the 16 lanes' query pairs; their weighted sum
// stays on fp32 FMAs over values widened block by block. A 2,048-token chunk (medium shapes, 2
// threads) at 2,048 / 4,096 tokens of context: 151-163 -> 159-189 and 163-177 -> 200-213 GFLOP/s
// (three interleaved pairs each).
//
// Numerics: the scale multiplies the finished dot product instead of the query, and the
// weights are rounded to bf16 before their product with the values, as torch's bf16 attention
// (its flash kernel on a CPU) does both; the softmax's max, sum and accumulators stay fp32.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define SPINDLE_DECODE_PAIRS 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace spindle {

// Keys per block this path takes: one register of scores.
constexpr int64_t kPairsBlock = 16;

// [sum(v[0]), sum(v[1]), ..., sum(v[15])]: sixteen horizontal sums in one transposing add tree.
[[gnu::always_inline]] inline __m512 sum_each16(const __m512 v[16]) {
  __m512 x[8], y[4];
  // Lanes of v[2i] and v[2i + 1] interleaved and added: per 128-bit lane [a, b, a, b] partials.
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // Then pairs of those by 64 bits: per 128-bit lane, the lane's sum of v[4i], .., v[4i + 3].
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Then the four 128-bit lanes of each y[i] added into 128-bit lane i of the result.
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xdd));
}

// s[j] <- scale x (q . key j) for j in [a, e) of a 16-key block, q and keys bf16 of head_dim D
// (a multiple of 32), key j at k + j * stride. All 16 rows of the block are read (they are
// the pool's memory whether written or not) and only [a, e) stored, so the loop has no bounds.
[[gnu::always_inline]] inline void score_pairs(const c10::BFloat16* q, const c10::BFloat16* k, int64_t stride, int64_t D, int64_t a,
                        int64_t e, float scale, float* s) {
  __m512 dot[kPairsBlock];
  for (auto& x : dot) x = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512bh qd = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + d));
    for (int j = 0; j < kPairsBlock; ++j)
      dot[j] = _mm512_dpbf16_ps(dot[j], qd, reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + j * stride + d)));
  }
  const __mmask16 keep = static_cast<__mmask16>(((1u << (e - a)) - 1) << a);
  _mm512_mask_storeu_ps(s, keep, _mm512_mul_ps(sum_each16(dot), _mm512_set1_ps(scale)));
}

// The 32 fp32 accumulators acc[0, 32) in the lane order of `weigh_pairs`' products, as two
// registers: per 128-bit lane L, dimensions 8L .. 8L + 3 in the first, 8L + 4 .. 8L + 7 in the
// second (vpunpck{l,h}wd interleave within 128-bit lanes).
inline void load_interleaved(const float* acc, __m512 scale, __m512& lo, __m512& hi) {
  const __m512 a = _mm512_loadu_ps(acc), b = _mm512_loadu_ps(acc + 16);
  lo = _mm512_mul_ps(_mm512_shuffle_f32x4(a, b, 0x88), scale);
  hi = _mm512_mul_ps(_mm512_shuffle_f32x4(a, b, 0xdd), scale);
}

// load_interleaved's inverse.
inline void store_interleaved(float* acc, __m512 lo, __m512 hi) {
  const __m512 a = _mm512_shuffle_f32x4(lo, hi, 0x44), b = _mm512_shuffle_f32x4(lo, hi, 0xee);
  _mm512_storeu_ps(acc, _mm512_shuffle_f32x4(a, a, 0xd8));
  _mm512_storeu_ps(acc + 16, _mm512_shuffle_f32x4(b, b, 0xd8));
}

// acc[h][d0, d0 + 32C) <- acc * alpha[h] + sum over keys [a, e) of weight w[h][j] x value j, for
// NH heads, the weights in bf16 (`w`, 16 a head), values bf16 at v + j * stride: two keys a
// step on vdpbf16ps, their values interleaved by dimension and their weights paired, so each
// product pair is exact in fp32 and nothing is widened. NH x 2C accumulators in registers.
template <int NH, int C>
inline void weigh_pairs(float* acc, int64_t D, const float* alpha, const uint16_t* w, int64_t a, int64_t e,
                        const c10::BFloat16* v, int64_t stride, int64_t d0) {
  __m512 x[NH][2 * C];
  for (int h = 0; h < NH; ++h) {
    const __m512 scale = _mm512_set1_ps(alpha[h]);
    for (int c = 0; c < C; ++c) load_interleaved(acc + h * D + d0 + 32 * c, scale, x[h][2 * c], x[h][2 * c + 1]);
  }
  for (int64_t j = a; j < e; j += 2) {
    const bool pair = j + 1 < e;  // an odd last key pairs with a zero row and weight
    __m512i lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i r0 = _mm512_loadu_si512(v + j * stride + d0 + 32 * c);
      const __m512i r1 = pair ? _mm512_loadu_si512(v + (j + 1) * stride + d0 + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(r0, r1);
      hi[c] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int h = 0; h < NH; ++h) {
      uint32_t bits = w[h * kPairsBlock + j];
      if (pair) bits |= static_cast<uint32_t>(w[h * kPairsBlock + j + 1]) << 16;
      const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(bits)));
      for (int c = 0; c < C; ++c) {
        x[h][2 * c] = _mm512_dpbf16_ps(x[h][2 * c], reinterpret_cast<__m512bh>(lo[c]), p);
        x[h][2 * c + 1] = _mm512_dpbf16_ps(x[h][2 * c + 1], reinterpret_cast<__m512bh>(hi[c]), p);
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    for (int c = 0; c < C; ++c) store_interleaved(acc + h * D + d0 + 32 * c, x[h][2 * c], x[h][2 * c + 1]);
  }
}

// The weighted sum over values for NH heads, all of head_dim D (a multiple of 32), 64
// dimensions a pass: the weights s[h][a, e) (rows `s_stride` apart) rounded to bf16 first, as
// torch's bf16 attention rounds them before its product with the values.
template <int NH>
inline void weigh_values_pairs(float* acc, int64_t D, const float* alpha, const float* s, int64_t s_stride,
                               int64_t a, int64_t e, const c10::BFloat16* v, int64_t stride) {
  alignas(64) uint16_t w[NH * kPairsBlock];
  for (int h = 0; h < NH; ++h)
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + h * kPairsBlock),
                       reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(s + h * s_stride))));
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) weigh_pairs<NH, 2>(acc, D, alpha, w, a, e, v, stride, d0);
  if (d0 < D) weigh_pairs<NH, 1>(acc, D, alpha, w, a, e, v, stride, d0);
}

// The bits of x rounded to bf16 (exact where x is a bf16 value, as a query here is).
inline uint16_t bf16_bits(float x) { return c10::BFloat16(x).x; }

// w[j][lane] <- scale x (query `lane` . key j) for a block's 16 keys (bf16, key j at k + j *
// stride) and a prefill tile's 16 query vectors, one a lane, as bf16 pairs: qp[d2 * 16 + lane]
// holds dimensions 2 d2 and 2 d2 + 1 of its query (paged_attention.cpp, `run_tiles`). Each step
// broadcasts one key's pair to every lane: 32 products an instruction against 16 on fp32 FMAs.
inline void score_tile_pairs(const uint32_t* qp, const c10::BFloat16* k, int64_t stride, int64_t D, float scale,
                             float* w) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < kPairsBlock; j += 8) {  // 8 keys at a time: 8 independent chains over d
    __m512 acc[8];
    for (auto& x : acc) x = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      const __m512bh q = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qp + d2 * kPairsBlock));
      for (int jj = 0; jj < 8; ++jj) {
        uint32_t pair;
        std::memcpy(&pair, k + (j + jj) * stride + 2 * d2, sizeof(pair));
        acc[jj] = _mm512_dpbf16_ps(acc[jj], q, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(pair))));
      }
    }
    for (int jj = 0; jj < 8; ++jj) _mm512_storeu_ps(w + (j + jj) * kPairsBlock, _mm512_mul_ps(acc[jj], s));
  }
}

}  // namespace spindle

#endif
