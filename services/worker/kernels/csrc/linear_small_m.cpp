// y = x @ W^T (+ bias) for the few rows of a decode step: weights read once for every row.
//
// Why: decoding runs linear layers on 1..64 rows (one per stream). There the cost is reading
// W, not the arithmetic, yet torch's fp32 GEMM (MKL on an AMD CPU) measured 12.7 GB/s for one
// row and 2.7 GB/s for eight (it re-reads W per panel) on a machine that streams 21 GB/s.
// This kernel takes 4 output features at a time and, for each block of 3 rows of x, keeps a
// 3x4 tile of 8-wide accumulators in registers (12 of AVX2's 16, plus the 4 W vectors: a 4x4
// tile spilled and ran 1.7x slower at 8+ rows), so each W vector loaded feeds 3 FMAs and W
// streams from memory once per call (the 4 W rows stay in L1 across the row blocks).
// Output features are split across torch's threads. W may be fp32 or bf16: bf16 is widened
// (a shift), so bf16 weights halve the bytes read on CPUs without bf16 math. With one row block
// the widening happens in registers; with more, each 4-feature slice of W is widened once into
// an fp32 scratch that stays in L1/L2 and every row block reads that (widening per row block
// measured 1.3x slower than fp32 weights at 16 rows; once per slice it costs 1/M of that).
// One row (a single stream) goes another way: one output feature at a time, so each thread reads
// its share of W as one sequential stream, with 4 accumulators over k for the FMA latency. The
// tile's 4 interleaved row streams kept the hardware prefetcher from following (on a 2-core AMD
// EPYC that sums memory at 53 GB/s: 23-33 GB/s with the tile, 30-43 with one stream for fp32
// weights, 15-21 vs 27-42 for bf16, at the medium model's shapes); from two rows on, the tile's
// reuse of x and W in registers won or tied at most shapes, so it keeps those.
// Which calls use it is decided by measurement at run time (models/fast_linear.py).

#include "env_flag.h"
#include "kernel_ops.h"
#include "linear_mid_m.h"
#include "linear_out.h"
#include "vec_math.h"
#include "work_pool.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace spindle {
namespace {

constexpr int64_t kRowsPerBlock = 3;      // rows of x per register tile (see above)
constexpr int64_t kFeaturesPerBlock = 4;  // output features per register tile
// How far ahead of a tile W is prefetched into L2 (the AVX-512 few-rows tiles below say why). On
// the AVX2 tile (an x86-64-v3 build on a 2-core AMD EPYC Zen 4, fp32, --stack, two runs) 3 / 4
// / 8 rows took 13.9-14.0 / 16.1-16.2 / 21.8-21.9 ms -> 11.0-11.9 / 14.2-14.4 / 19.7; not
// measured on an AVX2-only CPU.
constexpr int64_t kPrefetchBytes = 12288;
// From this many rows on, CPUs with AVX-512 run linear_mid_m.cpp's kernel (its tiles are 16 rows
// wide, and it broadcasts W a pair at a time: two loads for every two products at 16 rows), or,
// for rows of at least kLongRow values, from kMidRowsLongRows on. On such rows the few-rows tiles
// below took a decode step's weights (medium model, `linear_bench --stack`, 2-core AMD EPYC Zen
// 4, 2026-12-01) at 12 / 16 / 24 / 32 rows in, bf16, 8.4 / 9.8 / 14.0 / 18.1 ms against its 11.8
// / 12.0 / 17.3 / 17.5, and fp32 16.2 / 20.0 / 34.3 / 42.3 against 22.1 / 22.2 / 34.7 / 36.0:
// between 24 and 32 (where its time stays flat) they cross. On short rows a tile's fixed cost
// (24 sums reduced and stored) weighs on few k steps: at 16 rows of K = 256, in cache (`python -m
// benchmarks.linear_bench --model small --dtype bfloat16`), the LM head took 274 us against
// its 213, the fused gate_up 59-61 against 48 (K = 768 already gained: 24 against 37).
constexpr int64_t kMidRows = 12;
constexpr int64_t kMidRowsLongRows = 28;
constexpr int64_t kLongRow = 512;

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
#endif

// y[m][f0 + f] (+ bias) for rows [m0, m0 + nm) and features f < nf (nm <= 3, nf <= 4); `w`
// points at feature f0's row of W, which `from_memory` says is streamed (not a widened copy in cache).
template <typename W, typename Y>
inline void tile(const float* x, const W* w, const float* bias, Y* y, int64_t K, int64_t N, int64_t m0, int64_t nm,
                 int64_t f0, int64_t nf, bool from_memory) {
  int64_t k = 0;
  float acc[kRowsPerBlock][kFeaturesPerBlock] = {};
#ifdef __AVX2__
  __m256 v[kRowsPerBlock][kFeaturesPerBlock];
  for (auto& row : v)
    for (auto& a : row) a = _mm256_setzero_ps();
  const bool prefetch = from_memory && m0 == 0;  // later row blocks read these rows of W from cache
  if (nm == kRowsPerBlock && nf == kFeaturesPerBlock) {
    for (; k + 8 <= K; k += 8) {
      if (prefetch)
        for (int64_t f = 0; f < kFeaturesPerBlock; ++f)
          _mm_prefetch(reinterpret_cast<const char*>(w + f * K + k) + kPrefetchBytes, _MM_HINT_T1);
      __m256 wv[kFeaturesPerBlock];
      for (int64_t f = 0; f < kFeaturesPerBlock; ++f) wv[f] = load8(w + f * K + k);
      for (int64_t m = 0; m < kRowsPerBlock; ++m) {
        __m256 xv = _mm256_loadu_ps(x + (m0 + m) * K + k);
        for (int64_t f = 0; f < kFeaturesPerBlock; ++f) v[m][f] = _mm256_fmadd_ps(xv, wv[f], v[m][f]);
      }
    }
  } else {
    for (; k + 8 <= K; k += 8) {
      for (int64_t f = 0; f < nf; ++f) {
        __m256 wv = load8(w + f * K + k);
        for (int64_t m = 0; m < nm; ++m) v[m][f] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (m0 + m) * K + k), wv, v[m][f]);
      }
    }
  }
  for (int64_t m = 0; m < nm; ++m)
    for (int64_t f = 0; f < nf; ++f) acc[m][f] = hsum(v[m][f]);
#endif
  for (; k < K; ++k)
    for (int64_t m = 0; m < nm; ++m)
      for (int64_t f = 0; f < nf; ++f) acc[m][f] += x[(m0 + m) * K + k] * static_cast<float>(w[f * K + k]);
  for (int64_t m = 0; m < nm; ++m)
    for (int64_t f = 0; f < nf; ++f)
      store_sum(y + (m0 + m) * N + f0 + f, acc[m][f] + (bias != nullptr ? bias[f0 + f] : 0.0f));
}

// x . w over K: one sequential read of the row w (see the top for why one row runs this way).
template <typename W>
inline float row_dot(const float* x, const W* w, int64_t K) {
  int64_t k = 0;
  float sum = 0.0f;
#ifdef __AVX2__
  constexpr int64_t kUnroll = 4;  // independent accumulators: FMA latency x throughput
  __m256 acc[kUnroll];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (; k + 8 * kUnroll <= K; k += 8 * kUnroll)
    for (int64_t u = 0; u < kUnroll; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * u), load8(w + k + 8 * u), acc[u]);
  for (; k + 8 <= K; k += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w + k), acc[0]);
  sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
  for (; k < K; ++k) sum += x[k] * static_cast<float>(w[k]);
  return sum;
}


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPINDLE_FEW_ROWS_TILES 1
// 2 to 11 rows on AVX-512, or to 27 on rows of kLongRow+ values (kMidRows, kMidRowsLongRows):
// tiles of up to 8 rows x 3 features (24 accumulators, 3 W vectors and one x of the 32 zmm), R
// a compile-time constant so that the accumulators stay in registers; the three features' rows of W read side by side over k, so each x vector loaded
// feeds three products and each W vector up to eight; more rows than 8 in row blocks that
// re-read the tile's W rows from cache. Two ways to step over k: fp32 lanes (16 k a step; bf16
// W widened by a shift), or, for bf16 x with bf16 W on a CPU with AVX512-BF16, vdpbf16ps on k
// pairs (32 k a step, nothing widened), as linear_mid_m's tiles do. What made it: W prefetched
// into L2 (not L1) kPrefetchBytes ahead. Without that, memory and arithmetic took turns: the
// previous tile (4 features in turn, 4 rows a pass) read medium 5632 x 1024 at 8 rows at 13-19
// GB/s from memory against 13 hot on one thread, and this one with an L1 prefetch 512 bytes
// ahead at 7-13. With the L2 prefetch, 2 threads, copies of W cycled past the caches (2-core AMD
// EPYC Zen 4, 2026-12-01, /tmp script): 8 rows 619-892 -> 348-388 us (33 GB/s), down_proj's 1024
// x 2816 543 -> 190-237 us. SPINDLE_DISABLE_FEW_ROWS_TILES=1: the AVX2 tiles and row_dot, for
// side-by-side runs.

bool few_rows_disabled() {
  static const bool disabled = env_flag("SPINDLE_DISABLE_FEW_ROWS_TILES");
  return disabled;
}

inline __m512 load16(const c10::BFloat16* p, __mmask16 m) { return widen16(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

// fp32 x; W fp32 or bf16, widened: 16 k a step.
struct Fp32Lanes {
  static constexpr int64_t kStep = 16;
  using Mask = __mmask16;
  static Mask mask(int64_t left) { return left >= kStep ? Mask(0xffff) : Mask((1u << left) - 1); }
  template <typename T>
  static __m512 load(const T* p, Mask m) { return load16(p, m); }
  static __m512 fma(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
};

#ifdef __AVX512BF16__
// bf16 x and W: 32 k a step, each pair's two products summed into fp32 (vdpbf16ps).
struct Bf16Pairs {
  static constexpr int64_t kStep = 32;
  using Mask = __mmask32;
  static Mask mask(int64_t left) { return left >= kStep ? Mask(0xffffffffu) : Mask((1u << left) - 1); }
  static __m512i load(const c10::BFloat16* p, Mask m) { return _mm512_maskz_loadu_epi16(m, p); }
  static __m512 fma(__m512 acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(x), reinterpret_cast<__m512bh>(w));
  }
};
#endif

#ifdef __AVX512BF16__
// One row of bf16 x with bf16 W (a --dtype bfloat16 model's single stream) where the model's
// weights fit in the last-level cache: as run()'s one-row path, one feature at a time so each
// thread reads its share of W as one sequential stream, with 4 accumulators, but on k pairs
// (vdpbf16ps, 32 k a step, nothing widened) where row_dot widens x and W and takes 8 k a step.
// With the weights in cache a call took 1.3-1.9x less time and a served stream of the small
// model (10 MB of weights) gained in 5 of 6 pairs; with them streamed from memory the medium
// model (180 MB) lost 3-8 % in process and served, so the loader turns it on only for weights
// that fit (set_one_row_pairs, models/fast_linear.py; figures in the README). The same loop on
// fp32 lanes for fp32 x, though faster in cache, lost served in 5 of 6 pairs: fp32 x keeps row_dot.
std::atomic<bool> one_row_pairs_on{false};

// x . wf over K on k pairs, 4 accumulators (one sequential read of the row wf).
inline float pairs_row_dot(const c10::BFloat16* x, const c10::BFloat16* wf, int64_t K) {
  using L = Bf16Pairs;
  constexpr int64_t kUnroll = 4;  // independent accumulators: dot-product latency x throughput
  constexpr int64_t kBlock = kUnroll * L::kStep;
  __m512 acc[kUnroll];
  for (auto& a : acc) a = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kBlock <= K; k += kBlock)
    for (int64_t u = 0; u < kUnroll; ++u) {
      const auto all = L::mask(L::kStep);
      acc[u] = L::fma(acc[u], L::load(x + k + u * L::kStep, all), L::load(wf + k + u * L::kStep, all));
    }
  for (; k < K; k += L::kStep) acc[0] = L::fma(acc[0], L::load(x + k, L::mask(K - k)), L::load(wf + k, L::mask(K - k)));
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

template <typename Y>
void run_one_row_pairs(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, Y* y, int64_t N,
                       int64_t K) {
  spindle::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t f = begin; f < end; ++f)
      store_sum(y + f, pairs_row_dot(x, w + f * K, K) + (bias != nullptr ? bias[f] : 0.0f));
  });
}
#endif

// Whether one row of bf16 x with bf16 W runs on k pairs (run_one_row_pairs) rather than row_dot.
bool one_row_takes_pairs() {
#ifdef __AVX512BF16__
  return !few_rows_disabled() && !bf16_pairs_disabled() && one_row_pairs_on.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// [sum of a, sum of b, sum of c, sum of d]: 128-bit blocks folded pairwise, then lanes.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512i first_of_block = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(first_of_block, s));
}

constexpr int kTileRows = 8;      // rows of x per register tile (see the top of this section)
constexpr int kTileFeatures = 3;  // output features per register tile
// Up to this many rows a tile takes one feature: W read as one stream, where the arithmetic is
// light enough not to need three features' reuse of x (medium model, bf16, --stack, rows 2 / 3:
// 0.86-0.88 / 0.88-0.90 of the bandwidth against 0.82-0.85 / 0.80-0.84 with three).
constexpr int64_t kOneFeatureRows = 3;

// Four rows' sums of one feature (y points at the first row's), stored N apart with the bias.
template <typename Y>
inline void store_column4(Y* y, int64_t N, __m128 sums, float bias) {
  alignas(16) float s[4];
  _mm_store_ps(s, sums);
  for (int i = 0; i < 4; ++i) store_sum(y + i * N, s[i] + bias);
}

// y[m][f0 .. f0 + F) for the R rows of x (each K long; y's rows N apart); `w` points at feature
// f0's row of W. Every loop over m and f is unrolled so that each accumulator is named by
// constants: a rolled loop indexing acc[m] made GCC keep acc in memory and store all of it at
// every k step (two cycles per 512-bit store).
template <int R, int F, typename L, typename X, typename W, typename Y>
inline void rows_tile(const X* x, const W* w, const float* bias, Y* y, int64_t K, int64_t N, int64_t f0) {
  __m512 acc[R][F];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 3
    for (int f = 0; f < F; ++f) acc[m][f] = _mm512_setzero_ps();
  const auto step = [&](int64_t k, auto mask) {
    decltype(L::load(w, mask)) wv[F];
#pragma GCC unroll 3
    for (int f = 0; f < F; ++f) wv[f] = L::load(w + f * K + k, mask);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const auto xv = L::load(x + m * K + k, mask);
#pragma GCC unroll 3
      for (int f = 0; f < F; ++f) acc[m][f] = L::fma(acc[m][f], xv, wv[f]);
    }
  };
  // Two rows of one feature leave the arithmetic light enough for the hardware prefetcher alone:
  // prefetching there took 0.86-0.88 of the bandwidth against 0.92-0.99 without (--stack).
  constexpr bool kPrefetch = R * F > 2;
  constexpr int64_t kAhead = kPrefetchBytes / sizeof(W);
  const auto all = L::mask(L::kStep);
  int64_t k = 0;
  for (; k + L::kStep <= K; k += L::kStep) {
    if constexpr (kPrefetch) {
#pragma GCC unroll 3
      for (int f = 0; f < F; ++f) _mm_prefetch(reinterpret_cast<const char*>(w + f * K + k + kAhead), _MM_HINT_T1);
    }
    step(k, all);
  }
  if (k < K) step(k, L::mask(K - k));
#pragma GCC unroll 3
  for (int f = 0; f < F; ++f) {
    const float b = bias != nullptr ? bias[f0 + f] : 0.0f;
    int m = 0;
#pragma GCC unroll 2
    for (; m + 4 <= R; m += 4)
      store_column4(y + m * N + f0 + f, N, sum4(acc[m][f], acc[m + 1][f], acc[m + 2][f], acc[m + 3][f]), b);
#pragma GCC unroll 3
    for (; m < R; ++m) store_sum(y + m * N + f0 + f, _mm512_reduce_add_ps(acc[m][f]) + b);
  }
}

// Rows [m0, m0 + rows) of x against F features (rows <= kTileRows).
template <int F, typename L, typename X, typename W, typename Y>
inline void rows_block(const X* x, const W* w, const float* bias, Y* y, int64_t rows, int64_t K, int64_t N,
                       int64_t f0) {
  switch (rows) {
    case 1: return rows_tile<1, F, L>(x, w, bias, y, K, N, f0);
    case 2: return rows_tile<2, F, L>(x, w, bias, y, K, N, f0);
    case 3: return rows_tile<3, F, L>(x, w, bias, y, K, N, f0);
    case 4: return rows_tile<4, F, L>(x, w, bias, y, K, N, f0);
    case 5: return rows_tile<5, F, L>(x, w, bias, y, K, N, f0);
    case 6: return rows_tile<6, F, L>(x, w, bias, y, K, N, f0);
    case 7: return rows_tile<7, F, L>(x, w, bias, y, K, N, f0);
    default: return rows_tile<8, F, L>(x, w, bias, y, K, N, f0);
  }
}

// All M rows against F features: in as few row blocks as fit kTileRows, of even sizes (10 rows:
// 5 + 5, not 8 + 2, whose 2-row tile would leave the arithmetic units waiting on the loads).
template <int F, typename L, typename X, typename W, typename Y>
inline void feature_rows(const X* x, const W* w, const float* bias, Y* y, int64_t M, int64_t K, int64_t N,
                         int64_t f0) {
  const int64_t blocks = (M + kTileRows - 1) / kTileRows;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t m0 = b * M / blocks, m1 = (b + 1) * M / blocks;
    rows_block<F, L>(x + m0 * K, w, bias, y + m0 * N, m1 - m0, K, N, f0);
  }
}

// Features in blocks of kTileFeatures (one at a time up to kOneFeatureRows rows) split across the
// threads; the last N % 3 one at a time.
template <typename L, typename X, typename W, typename Y>
void run_few_rows(const X* x, const W* w, const float* bias, Y* y, int64_t M, int64_t N, int64_t K) {
  if (M <= kOneFeatureRows) {
    spindle::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t f = begin; f < end; ++f) feature_rows<1, L>(x, w + f * K, bias, y, M, K, N, f);
    });
    return;
  }
  const int64_t num_blocks = N / kTileFeatures;
  spindle::parallel_for(0, num_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t f0 = b * kTileFeatures;
      feature_rows<kTileFeatures, L>(x, w + f0 * K, bias, y, M, K, N, f0);
    }
  });
  for (int64_t f = num_blocks * kTileFeatures; f < N; ++f) feature_rows<1, L>(x, w + f * K, bias, y, M, K, N, f);
}
#endif

template <typename W, typename Y>
void run(const float* x, const W* w, const float* bias, Y* y, int64_t M, int64_t N, int64_t K) {
  if (M == 1) {
    spindle::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t f = begin; f < end; ++f)
        store_sum(y + f, row_dot(x, w + f * K, K) + (bias != nullptr ? bias[f] : 0.0f));
    });
    return;
  }
  const int64_t num_blocks = (N + kFeaturesPerBlock - 1) / kFeaturesPerBlock;
  constexpr bool kWiden = !std::is_same_v<W, float>;
  const bool widen_once = kWiden && M > kRowsPerBlock;  // several row blocks share each slice of W
  spindle::parallel_for(0, num_blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(widen_once ? kFeaturesPerBlock * K : 0);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t f0 = b * kFeaturesPerBlock;
      const int64_t nf = std::min(kFeaturesPerBlock, N - f0);
      if constexpr (kWiden) {
        if (widen_once) {
          widen_row(w + f0 * K, scratch.data(), nf * K);
          for (int64_t m0 = 0; m0 < M; m0 += kRowsPerBlock)
            tile(x, scratch.data(), bias, y, K, N, m0, std::min(kRowsPerBlock, M - m0), f0, nf, false);
        }
      }
      if (!widen_once)
        for (int64_t m0 = 0; m0 < M; m0 += kRowsPerBlock)
          tile(x, w + f0 * K, bias, y, K, N, m0, std::min(kRowsPerBlock, M - m0), f0, nf, true);
    }
  });
}

}  // namespace

float row_dot_f32(const float* x, const float* w, int64_t K) { return row_dot(x, w, K); }
float row_dot_f32(const float* x, const c10::BFloat16* w, int64_t K) { return row_dot(x, w, K); }

float row_dot_bf16(const c10::BFloat16* x, const float* x_widened, const c10::BFloat16* w, int64_t K) {
#if defined(SPINDLE_FEW_ROWS_TILES) && defined(__AVX512BF16__)
  if (one_row_takes_pairs()) return pairs_row_dot(x, w, K);
#endif
  (void)x;
  return row_dot(x_widened, w, K);
}

namespace {

// x's rows in fp32: fp32 x in place, bf16 x widened into this thread's buffer (a few KB at
// decode sizes; a torch conversion was an op and a tensor a call).
const float* float_rows(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>(x.numel()));
  widen_row(x.data_ptr<c10::BFloat16>(), widened.data(), x.numel());
  return widened.data();
}

// From 2 rows to where linear_mid_m takes over (kMidRows, kMidRowsLongRows) on the few-rows
// tiles, and one row of bf16 x with bf16 W on k pairs, where this build has them; false: the
// caller runs run().
template <typename Y>
bool few_rows(const at::Tensor& x, const at::Tensor& w, const float* bias, Y* y, int64_t M, int64_t N, int64_t K) {
#ifdef SPINDLE_FEW_ROWS_TILES
  if (few_rows_disabled()) return false;
  const bool w_is_bf16 = w.scalar_type() == at::kBFloat16;
#ifdef __AVX512BF16__
  if (w_is_bf16 && x.scalar_type() == at::kBFloat16 && !bf16_pairs_disabled()) {
    const auto* xb = x.data_ptr<c10::BFloat16>();
    const auto* wb = w.data_ptr<c10::BFloat16>();
    if (M > 1) {
      run_few_rows<Bf16Pairs>(xb, wb, bias, y, M, N, K);
      return true;
    }
    if (one_row_takes_pairs()) {
      run_one_row_pairs(xb, wb, bias, y, N, K);
      return true;
    }
  }
#endif
  if (M < 2) return false;  // one row of fp32 x: row_dot (run_one_row_pairs says why)
  const float* xf = float_rows(x);
  if (w_is_bf16) {
    run_few_rows<Fp32Lanes>(xf, w.data_ptr<c10::BFloat16>(), bias, y, M, N, K);
  } else {
    run_few_rows<Fp32Lanes>(xf, w.data_ptr<float>(), bias, y, M, N, K);
  }
  return true;
#else
  return false;
#endif
}

}  // namespace

// x may be float32 or bfloat16 (a --dtype bfloat16 model): the sums stay fp32 and y is rounded to
// x's dtype as each kernel stores it (linear_out.h), as a native bf16 GEMM rounds its fp32
// accumulators; the bias, if any, is in x's dtype. `float_out`: y in float32 whatever x's dtype,
// still rounded to it (logits for the sampler, without a pass to widen them). linear_mid_m takes
// bf16 rows as they are (in k pairs, or widened as it transposes them); the small-M tiles get
// them widened once (a few KB for a decode step's rows).
at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          bool float_out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_small_m: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_small_m: x must be float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "linear_small_m: weight must be float32 or bfloat16");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  const bool x_is_bf16 = xc.scalar_type() == at::kBFloat16;
  const LinearOut out = !x_is_bf16 ? LinearOut::kFloat : float_out ? LinearOut::kBFloat16AsFloat : LinearOut::kBFloat16;
  at::Tensor y = at::empty({M, N}, xc.options().dtype(out == LinearOut::kBFloat16 ? at::kBFloat16 : at::kFloat));
  const float* b = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N,
                "linear_small_m: bias must be [N] in x's dtype");
    bc = bias->contiguous().to(at::kFloat);
    b = bc.data_ptr<float>();
  }
  const bool w_is_bf16 = wc.scalar_type() == at::kBFloat16;
  if (M >= (K >= kLongRow ? kMidRowsLongRows : kMidRows) && mid_m_available()) {
    linear_mid_m(xc.data_ptr(), x_is_bf16, wc.data_ptr(), w_is_bf16, b, y.data_ptr(), out, M, N, K);
    return y;
  }
  with_output(out, y.data_ptr(), [&](auto* yo) {
    if (few_rows(xc, wc, b, yo, M, N, K)) return;
    const float* xf = float_rows(xc);
    if (w_is_bf16) {
      run(xf, wc.data_ptr<c10::BFloat16>(), b, yo, M, N, K);
    } else {
      run(xf, wc.data_ptr<float>(), b, yo, M, N, K);
    }
  });
  return y;
}

// Whether one row of bf16 x with bf16 W takes k pairs (run_one_row_pairs says when it pays);
// false where this build has no AVX512-BF16. Returns what is now in force.
bool set_one_row_pairs(bool on) {
#ifdef __AVX512BF16__
  one_row_pairs_on.store(on, std::memory_order_relaxed);
  return on;
#else
  (void)on;
  return false;
#endif
}

}  // namespace spindle

TORCH_LIBRARY_FRAGMENT(spindle, m) {
  m.def("linear_small_m(Tensor x, Tensor weight, Tensor? bias, bool float_out=False) -> Tensor");
  m.def("set_one_row_pairs(bool on) -> bool", &spindle::set_one_row_pairs);
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) { m.impl("linear_small_m", &spindle::linear_small_m); }
