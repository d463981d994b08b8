// The AVX-512 kernel for batched decode steps' linear layers (why and how: linear_mid_m.h).

#include "linear_mid_m.h"

#include "vec_math.h"
#include "work_pool.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace spindle {

#ifdef __AVX512F__
namespace {

constexpr int64_t kLanes = 16;          // rows per vector
constexpr int64_t kAccumulators = 24;   // of the 32 zmm registers; the rest hold x and a broadcast
constexpr int64_t kMaxGroups = 4;       // row groups per tile: up to 64 rows share each W element
constexpr int64_t kFeatureBlock = 24;   // features per widened block of W: a multiple of every tile width
constexpr int64_t kOutputBlock = 96;    // features per parallel work unit, staged, then copied to y by whole lines
constexpr int64_t kWideLayer = 16 * kOutputBlock;  // from this many features on, units of kOutputBlock
constexpr int64_t kPrefetchLines = 8;   // how far ahead W's rows are prefetched, in 64-byte lines

// Elements to add to a tile's prefetch address, `ahead` elements past k in row f, for it to
// stay in W: past the row's end it lands on row f of the next tile (the next F features' rows
// follow this tile's in W), at the same distance. Rows of a few lines (the small model's K = 256)
// are then fetched a tile ahead instead of not at all (each tile started on cold lines: the
// 8192 x 256 LM head at 64 rows took 949 us with W past the caches, 723 hot).
template <int F>
inline int64_t next_tile_jump(int64_t k, int64_t ahead, int64_t K) {
  return k + ahead >= K ? (F - 1) * K : 0;
}

// Rows [m0, m0 + 16 G) x F features into yt ([F][ldx]). xt: x^T ([K][ldx], rows padded with
// zeros); w: the F rows of W ([F][K]).
template <int G, int F>
inline void tile(const float* xt, int64_t ldx, const float* w, float* yt, int64_t K, int64_t m0) {
  __m512 acc[G][F];
  for (int g = 0; g < G; ++g)
    for (int f = 0; f < F; ++f) acc[g][f] = _mm512_setzero_ps();
  const float* xk = xt + m0;
  const auto step = [&](int64_t k) {
    __m512 xv[G];
    for (int g = 0; g < G; ++g) xv[g] = _mm512_loadu_ps(xk + k * ldx + g * kLanes);
    for (int f = 0; f < F; ++f) {
      const __m512 wv = _mm512_set1_ps(w[f * K + k]);
      for (int g = 0; g < G; ++g) acc[g][f] = _mm512_fmadd_ps(xv[g], wv, acc[g][f]);
    }
  };
  // W's F rows are F interleaved streams, more than the hardware prefetcher follows when they
  // come from memory: each line is fetched kPrefetchLines ahead by hand.
  const int64_t ahead = std::min(kPrefetchLines, K / kLanes) * kLanes;  // a line is kLanes floats
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const float* prefetched = w + k + ahead + next_tile_jump<F>(k, ahead, K);
    for (int f = 0; f < F; ++f) _mm_prefetch(reinterpret_cast<const char*>(prefetched + f * K), _MM_HINT_T0);
    for (int64_t j = 0; j < kLanes; ++j) step(k + j);
  }
  for (; k < K; ++k) step(k);
  for (int g = 0; g < G; ++g)
    for (int f = 0; f < F; ++f) _mm512_storeu_ps(yt + f * ldx + m0 + g * kLanes, acc[g][f]);
}

#ifdef __AVX512BF16__
// Pairs path (bf16 x and W, AVX512-BF16): xt holds x^T in k pairs ([ceil(K/2)][ldx] dwords, the
// low half k = 2p, the high half 2p + 1), so one vdpbf16ps takes two k of 16 rows against a
// 32-bit broadcast of W's adjacent (2p, 2p + 1) read in place: half the instructions of the fp32
// tile and no widened copy of W. Products of bf16 values are exact in fp32, as in the fp32 tile;
// only the order of the sums differs (k pairs).
inline int bf16_pair(const c10::BFloat16* w) {
  int pair;
  std::memcpy(&pair, w, sizeof(pair));  // (w[0], w[1]), little-endian: w[0] in the low half
  return pair;
}

template <int G, int F>
inline void tile(const uint32_t* xt, int64_t ldx, const c10::BFloat16* w, float* yt, int64_t K, int64_t m0) {
  __m512 acc[G][F];
  for (int g = 0; g < G; ++g)
    for (int f = 0; f < F; ++f) acc[g][f] = _mm512_setzero_ps();
  const uint32_t* xp = xt + m0;
  const auto step = [&](int64_t p, bool last_odd) {
    __m512i xv[G];
    for (int g = 0; g < G; ++g) xv[g] = _mm512_loadu_si512(xp + p * ldx + g * kLanes);
    for (int f = 0; f < F; ++f) {
      const c10::BFloat16* wk = w + f * K + 2 * p;
      const __m512i wv = _mm512_set1_epi32(last_odd ? int{wk[0].x} : bf16_pair(wk));  // an odd K's last k pairs with 0
      for (int g = 0; g < G; ++g) acc[g][f] = _mm512_dpbf16_ps(acc[g][f], (__m512bh)xv[g], (__m512bh)wv);
    }
  };
  const int64_t pairs = K / 2;
  const int64_t ahead = std::min(kPrefetchLines, pairs / kLanes) * 2 * kLanes;  // a line is kLanes pairs
  int64_t p = 0;
  for (; p + kLanes <= pairs; p += kLanes) {  // 16 pairs: one 64-byte line of each W row
    const c10::BFloat16* prefetched = w + 2 * p + ahead + next_tile_jump<F>(2 * p, ahead, K);
    for (int f = 0; f < F; ++f) _mm_prefetch(reinterpret_cast<const char*>(prefetched + f * K), _MM_HINT_T0);
    for (int64_t j = 0; j < kLanes; ++j) step(p + j, false);
  }
  for (; p < pairs; ++p) step(p, false);
  if (K % 2 != 0) step(pairs, true);
  for (int g = 0; g < G; ++g)
    for (int f = 0; f < F; ++f) _mm512_storeu_ps(yt + f * ldx + m0 + g * kLanes, acc[g][f]);
}

#endif

// xt[p][m] = (x[m][2p], x[m][2p + 1]) for an odd K (the last pair's high half 0), zeros past M:
// the rows' pairs straddle 4-byte boundaries, so they are assembled one by one (even K: rows_to_columns
// on x's dwords, as they lie).
inline void transpose_pairs_odd(const c10::BFloat16* x, uint32_t* xt, int64_t M, int64_t K, int64_t ldx) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t m = 0; m < M; ++m) {
      const uint32_t lo = x[m * K + 2 * p].x;
      const uint32_t hi = 2 * p + 1 < K ? x[m * K + 2 * p + 1].x : 0;
      xt[p * ldx + m] = lo | (hi << 16);
    }
    std::fill(xt + p * ldx + M, xt + (p + 1) * ldx, 0u);
  }
}

// Every row group against F features: tiles of up to 24 / F groups, W's F rows re-read from L1.
template <int F, typename X, typename WT>
void feature_tile(const X* xt, int64_t ldx, int64_t groups, const WT* w, float* yt, int64_t K) {
  constexpr int64_t kGroupsPerTile = std::min<int64_t>(kMaxGroups, kAccumulators / F);
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupsPerTile) {
    const int64_t m0 = g0 * kLanes;
    switch (std::min(kGroupsPerTile, groups - g0)) {
      case 1: tile<1, F>(xt, ldx, w, yt, K, m0); break;
      case 2: if constexpr (2 * F <= kAccumulators) tile<2, F>(xt, ldx, w, yt, K, m0); break;
      case 3: if constexpr (3 * F <= kAccumulators) tile<3, F>(xt, ldx, w, yt, K, m0); break;
      default: if constexpr (4 * F <= kAccumulators) tile<4, F>(xt, ldx, w, yt, K, m0); break;
    }
  }
}

// nf <= 24 features (W's rows from `w`, [nf][K]) in tiles of F features (the last ones one at
// a time), into yt ([nf][ldx]).
template <int F, typename X, typename WT>
void feature_block(const X* xt, int64_t ldx, int64_t groups, const WT* w, int64_t nf, int64_t K, float* yt) {
  int64_t f = 0;
  for (; f + F <= nf; f += F) feature_tile<F>(xt, ldx, groups, w + f * K, yt + f * ldx, K);
  for (; f < nf; ++f) feature_tile<1>(xt, ldx, groups, w + f * K, yt + f * ldx, K);
}

// In place: r[j] lane i <- r[i] lane j, for 16 rows of 16 32-bit values (any bits: only moved).
// Pairs of rows interleave, then quads, then the four 128-bit lanes of each group of four
// vectors swap as a 4 x 4 block: 64 shuffles where the scalar loop took 256 moves (a call at 64
// rows of fp32 x spent ~3 us less at K = 256 and ~9 us less at K = 768 without that loop).
inline void transpose_16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // Now in 128-bit lane L of u[4g + e]: rows 4g..4g+3, value 4L + e.
  __m512 u[16];
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {  // lanes: (group g, lane L) -> (lane g, vector 4L + e)
    const __m512 s0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x44), s1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xEE);
    const __m512 s2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x44);
    const __m512 s3 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_f32x4(s0, s2, 0x88);
    r[4 + e] = _mm512_shuffle_f32x4(s0, s2, 0xDD);
    r[8 + e] = _mm512_shuffle_f32x4(s1, s3, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(s1, s3, 0xDD);
  }
}

// xt[k][m] = x[m][k] for m < M, zeros for the padding rows up to ldx (a multiple of 16), for
// 32-bit values x [M][K]: fp32 rows, or bf16 rows read as K pairs.
void rows_to_columns(const float* x, float* xt, int64_t M, int64_t K, int64_t ldx) {
  for (int64_t m0 = 0; m0 < ldx; m0 += kLanes) {
    for (int64_t k0 = 0; k0 < K; k0 += kLanes) {
      const int64_t nk = std::min(kLanes, K - k0);
      const __mmask16 columns = static_cast<__mmask16>((1u << nk) - 1);
      __m512 r[16];
      for (int64_t i = 0; i < kLanes; ++i)
        r[i] = m0 + i < M ? _mm512_maskz_loadu_ps(columns, x + (m0 + i) * K + k0) : _mm512_setzero_ps();
      transpose_16x16(r);
      for (int64_t j = 0; j < nk; ++j) _mm512_storeu_ps(xt + (k0 + j) * ldx + m0, r[j]);
    }
  }
}

// One parallel unit: features [first, first + count), 24 at a time (bf16 rows widened into
// `widened`), staged in yt, then into y's rows with the bias.
template <typename X, typename W, typename Y>
void output_block(const X* xt, int64_t ldx, int64_t groups, const W* w, const float* bias, Y* y, int64_t M,
                  int64_t N, int64_t K, int64_t first, int64_t count, float* widened, float* yt) {
  const int64_t tile_groups = std::min(groups, kMaxGroups);
  for (int64_t f0 = first; f0 < first + count; f0 += kFeatureBlock) {
    const int64_t nf = std::min(kFeatureBlock, first + count - f0);
    const std::conditional_t<std::is_same_v<X, float>, float, W>* rows;
    if constexpr (!std::is_same_v<X, float> || std::is_same_v<W, float>) {
      rows = w + f0 * K;  // read in place: copied first, 1.1-1.4x slower from cache
    } else {
      widen_row(w + f0 * K, widened, nf * K);
      rows = widened;
    }
    float* staged = yt + (f0 - first) * ldx;
    switch (tile_groups) {
      case 1:
      case 2: feature_block<12>(xt, ldx, groups, rows, nf, K, staged); break;
      case 3: feature_block<8>(xt, ldx, groups, rows, nf, K, staged); break;
      default: feature_block<6>(xt, ldx, groups, rows, nf, K, staged); break;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    Y* out = y + m * N + first;
    for (int64_t j = 0; j < count; ++j) store_sum(out + j, yt[j * ldx + m] + (bias != nullptr ? bias[first + j] : 0.0f));
  }
}

// x^T for the tiles: X = float (fp32 x, or bf16 x widened first), X = uint32_t (bf16 x in k pairs).
template <typename X>
X* transposed(const void* x, bool x_is_bf16, int64_t M, int64_t K, int64_t ldx) {
  thread_local std::vector<X> xt_buffer;
  if constexpr (std::is_same_v<X, float>) {
    xt_buffer.resize(static_cast<size_t>(K * ldx));
    const float* rows = static_cast<const float*>(x);
    thread_local std::vector<float> widened;
    if (x_is_bf16) {
      widened.resize(static_cast<size_t>(M * K));
      widen_row(static_cast<const c10::BFloat16*>(x), widened.data(), M * K);
      rows = widened.data();
    }
    rows_to_columns(rows, xt_buffer.data(), M, K, ldx);
  } else {
    const int64_t pairs = (K + 1) / 2;
    xt_buffer.resize(static_cast<size_t>(pairs * ldx));
    const auto* rows = static_cast<const c10::BFloat16*>(x);
    if (K % 2 == 0) {
      rows_to_columns(reinterpret_cast<const float*>(rows), reinterpret_cast<float*>(xt_buffer.data()), M, pairs, ldx);
    } else {
      transpose_pairs_odd(rows, xt_buffer.data(), M, K, ldx);
    }
  }
  return xt_buffer.data();
}

template <typename X, typename W, typename Y>
void run(const void* x, bool x_is_bf16, const W* w, const float* bias, Y* y, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = (M + kLanes - 1) / kLanes;
  const int64_t ldx = groups * kLanes;
  const X* xt = transposed<X>(x, x_is_bf16, M, K, ldx);
  // Units of 96 features where there are many (whole lines of y's rows), else of 24: a 256-wide
  // layer in 3 units kept one of 2 threads idle for a third of the call (1.4-1.5x oneDNN's time).
  const int64_t unit = N >= kWideLayer ? kOutputBlock : kFeatureBlock;
  const int64_t units = (N + unit - 1) / unit;
  spindle::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> widened, yt;
    if constexpr (std::is_same_v<X, float> && !std::is_same_v<W, float>)
      widened.resize(static_cast<size_t>(kFeatureBlock * K));
    yt.resize(static_cast<size_t>(kOutputBlock * ldx));
    for (int64_t index = begin; index < end; ++index) {
      const int64_t first = index * unit;
      output_block(xt, ldx, groups, w, bias, y, M, N, K, first, std::min(unit, N - first), widened.data(), yt.data());
    }
  });
}

}  // namespace

bool mid_m_available() { return true; }

void linear_mid_m(const void* x, bool x_is_bf16, const void* w, bool w_is_bf16, const float* bias, void* y,
                  LinearOut out, int64_t M, int64_t N, int64_t K) {
  with_output(out, y, [&](auto* yo) {
    if (w_is_bf16) {
      const auto* wb = static_cast<const c10::BFloat16*>(w);
#ifdef __AVX512BF16__
      if (x_is_bf16 && !bf16_pairs_disabled()) {
        run<uint32_t>(x, x_is_bf16, wb, bias, yo, M, N, K);
        return;
      }
#endif
      run<float>(x, x_is_bf16, wb, bias, yo, M, N, K);
    } else {
      run<float>(x, x_is_bf16, static_cast<const float*>(w), bias, yo, M, N, K);
    }
  });
}

#else

bool mid_m_available() { return false; }

void linear_mid_m(const void*, bool, const void*, bool, const float*, void*, LinearOut, int64_t, int64_t, int64_t) {}

#endif

}  // namespace spindle
