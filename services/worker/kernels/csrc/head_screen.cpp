// Greedy tokens from an LM head read at one byte a weight: an int8 screen, then the exact logits
// of the few rows that could still be the largest.
//
// Why: a decode step of one stream reads every weight once, so its time is its bytes. The small
// benchmark model's LM head (8,192 x 256 float32, 8.4 MB) is 41 % of a step's 20.4 MB, and on a
// 2-core AMD EPYC Zen 3 whose last-level cache keeps ~12-16 MB of them, the step streams from
// memory. A greedy step needs only the index of the largest logit, not the logits.
//
// How: each row r of the head (float32 or bfloat16) has an int8 copy q_r with one scale s_r =
// max_k |w_rk| / 127, so |w_rk - q_rk s_r| <= s_r / 2 (models/greedy_step.py `head_screen` builds
// them once). The screened logit t_r = (x . q_r) s_r + b_r is off the logit l_r the full path
// computes at one row (linear_small_m.cpp) by the quantisation, at most |x|_1 max_r s_r / 2, by
// the screen's own arithmetic (screen_error: float32 rounding on AVX2, x's int8 rounding on VNNI),
// and by the full path's float32 rounding: a sum of K products is off its real value by at most
// gamma_K = K 2^-24 / (1 - K 2^-24) of the sum of the products' magnitudes (in any order, with or
// without FMA, in k pairs or not), bounded by |x|_1 max |w| or |x|_inf max_r sum_k |w_rk|,
// whichever is smaller (both head norms taken at build time); plus a few roundings of the scales
// and the bias, each at most 2^-24 of a magnitude, and for bfloat16 activations, whose logits the
// full path rounds to bfloat16, 2^-9 of the largest. With that bound B on every |t_r - l_r|, the
// largest l_r belongs to a row with t_r >= max_j t_j - 2B; those rows' exact logits come from the
// same code the full path runs at one row (row_dot, or for bfloat16 x its one-row kernel, then
// the same rounding), and the first of their largest is the token (the first index of the
// maximum, as argmax_rows: bfloat16 logits tie often). Where B is not finite (a NaN or inf in x)
// or more than kMaxCandidates rows qualify, the call answers nothing and the caller runs the full
// head. At 2-4 rows the full path's tiles round their sums in another order than one row does, so
// a near-tie there could go the other way; the screen answers each row as a one-row step would.
//
// Cost: the screen reads 1 byte a weight (a quarter of a float32 head, half a bfloat16 one);
// the bound is two vector passes over the N screened logits; candidates are a handful of K-long
// dot products (a random model's bound leaves ~5 of 8,192). A bfloat16 screen (2 bytes a weight,
// its rounding relative to each weight) decided as many rows but was 7 % slower a step in
// process (small model, Zen 3).

#include "kernel_ops.h"
#include "vec_math.h"
#include "work_pool.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace spindle {
namespace {

constexpr int64_t kMaxCandidates = 64;
// Rows decided by the screen, and rows it left to the full head, since the library loaded.
std::atomic<int64_t> rows_decided{0}, rows_undecided{0};
constexpr double kUnit = 1.0 / 16777216.0;  // 2^-24: float32's unit roundoff
constexpr double kBf16Unit = 1.0 / 256.0;   // 2^-8: bfloat16's unit roundoff (2^-9) with room to spare
constexpr double kQuantum = 1.01 / 254.0;   // s_r / 2 = max_k |w_rk| / 254, and the scale's rounding

// gamma_K = K 2^-24 / (1 - K 2^-24): a float32 sum of K products is off its real value by at most
// this much of the sum of their magnitudes.
inline double gamma_k(int64_t K) { return static_cast<double>(K) * kUnit / (1.0 - static_cast<double>(K) * kUnit); }

// The largest lower end max_r (t_r - a d_r) (each rounded once) and the largest |t_r|, or
// (NaN, NaN) where t holds a NaN.
std::pair<float, float> lower_and_magnitude(const float* t, const float* d, float a, int64_t n) {
  float lower = -INFINITY, magnitude = 0.0f;
  bool nan = false;
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 sign = _mm256_set1_ps(-0.0f), va = _mm256_set1_ps(a);
  __m256 vlower = _mm256_set1_ps(-INFINITY), vmag = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(t + i);
    vlower = _mm256_max_ps(vlower, _mm256_fnmadd_ps(va, _mm256_loadu_ps(d + i), v));
    vmag = _mm256_max_ps(vmag, _mm256_andnot_ps(sign, v));
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  lower = max_lane(vlower);
  magnitude = max_lane(vmag);
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(t[i]);
    lower = std::max(lower, std::fma(-a, d[i], t[i]));
    magnitude = std::max(magnitude, std::fabs(t[i]));
  }
  return nan ? std::pair<float, float>{NAN, NAN} : std::pair<float, float>{lower, magnitude};
}

// One row of x as the screen reads it: float32 (a bfloat16 row widened), its norms, and, for the
// VNNI screen, the row in int8.
struct ScreenRow {
  const float* x = nullptr;
  const c10::BFloat16* x_bf16 = nullptr;  // the row as the full head reads it, for bf16 activations
  double l1 = 0.0, l2 = 0.0, inf = 0.0;   // |x|_1, |x|_2 and max_k |x_k|, summed in double
  // VNNI: x ~ scale (q + q_low / 256) in int8, each zero-padded to a multiple of 64, and their sums.
  const int8_t* q = nullptr;
  const int8_t* q_low = nullptr;
  float scale = 1.0f;
  int32_t q_sum = 0, q_low_sum = 0;
};

void measure(ScreenRow& row, int64_t K) {
  double l1 = 0.0, squares = 0.0, inf = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const double a = std::fabs(static_cast<double>(row.x[k]));
    l1 += a;
    squares += a * a;
    inf = std::max(inf, a);
  }
  const double rounding = 1.0 + 1e-12 * static_cast<double>(K);  // the double sums' (and root's)
  row.l1 = l1 * rounding;
  row.l2 = std::sqrt(squares) * rounding + 1e-150;  // squares of subnormal floats underflow no double
  row.inf = inf;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SPINDLE_SCREEN_VNNI 1
// The screen's logits on AVX512-VNNI: x in int8 too, as two bytes an element, x_k ~ s_x (q_k +
// q'_k / 256) with s_x = max |x| / 127 (q' the rounding residue's 256ths, so x's own rounding,
// at most ~s_x / 213, stays far below the screen's), and x . q_r summed exactly in int32 by
// vpdpbusd (unsigned x signed bytes: q_r + 128 by flipping its sign bit, and 128 sum_k x_k taken
// off after), 64 products an instruction. Against the float screen below (AVX2: widen 8 bytes to
// floats, then an FMA), one row of the small model's head, hot in cache, took 37 against 63 us
// (the full float32 head 58; 2-core AMD EPYC Zen 4, /tmp script).
constexpr int64_t kBytes = 64;
constexpr double kLowStep = 1.2 / 256.0;  // |x_k - s_x (q_k + q'_k / 256)| <= kLowStep s_x (see quantize)

// One 16-lane step of int8 rounding: v (x / step, or a residue's) to the nearest even, clamped.
inline __m512i to_int8_lanes(__m512 v, __m512i lo, __m512i hi) {
  return _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(v), lo), hi);
}

// row.q and row.q_low (each K rounded up to 64 bytes, zeros past K) for x ~ s_x (q + q_low / 256):
// q = round(x / s_x) in [-127, 127], so the residue r = x - s_x q is within ~s_x / 2 (computed
// with an FMA, off by a unit in its last place), and q_low = round(256 r / s_x) clamped to
// [-128, 127]: off by at most 1.13 steps of s_x / 256 where the clamp bites, half a step elsewhere.
void quantize(ScreenRow& row, int8_t* q, int8_t* q_low, int64_t K) {
  row.scale = row.inf > 0.0 ? static_cast<float>(row.inf / 127.0) : 1.0f;
  const __m512 scale = _mm512_set1_ps(row.scale), inverse = _mm512_set1_ps(1.0f / row.scale);
  const __m512 low_inverse = _mm512_set1_ps(256.0f / row.scale);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), low_lo = _mm512_set1_epi32(-128);
  __m512i sums = _mm512_setzero_si512(), low_sums = _mm512_setzero_si512();
  const int64_t padded = (K + kBytes - 1) / kBytes * kBytes;
  for (int64_t k = 0; k < padded; k += 16) {
    const __mmask16 m = K - k >= 16 ? __mmask16(0xffff) : K > k ? __mmask16((1u << (K - k)) - 1) : __mmask16(0);
    const __m512 x = _mm512_maskz_loadu_ps(m, row.x + k);
    const __m512i v = to_int8_lanes(_mm512_mul_ps(x, inverse), lo, hi);
    const __m512 residue = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(v), scale, x);
    const __m512i v_low = to_int8_lanes(_mm512_mul_ps(residue, low_inverse), low_lo, hi);
    sums = _mm512_add_epi32(sums, v);
    low_sums = _mm512_add_epi32(low_sums, v_low);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q_low + k), _mm512_cvtepi32_epi8(v_low));
  }
  row.q = q;
  row.q_low = q_low;
  row.q_sum = _mm512_reduce_add_epi32(sums);
  row.q_low_sum = _mm512_reduce_add_epi32(low_sums);
}

// t_r from the two exact sums of x's bytes against row r's: s_x (hi + lo / 256) s_r + b_r.
inline float screened_logit(const ScreenRow& row, int32_t hi, int32_t lo, float scale, float bias) {
  return (static_cast<float>(hi) + static_cast<float>(lo) * (1.0f / 256.0f)) * (row.scale * scale) + bias;
}

// t[m][r..r+J) for rows m < M of x: J rows of the screen side by side, each byte read once
// (2 M J accumulators of the 32 registers).
template <int M, int J>
inline void vnni_rows(const ScreenRow* rows, const int8_t* screen, const float* scales, const float* bias, float* t,
                      int64_t r, int64_t K, int64_t N) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[M][J], acc_low[M][J];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = acc_low[m][j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += kBytes) {
    const __mmask64 mask = K - k >= kBytes ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
    __m512i w[J];
    for (int j = 0; j < J; ++j) w[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, screen + (r + j) * K + k), flip);
    for (int m = 0; m < M; ++m) {
      const __m512i xq = _mm512_loadu_si512(rows[m].q + k), xq_low = _mm512_loadu_si512(rows[m].q_low + k);
      for (int j = 0; j < J; ++j) {
        acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], w[j], xq);
        acc_low[m][j] = _mm512_dpbusd_epi32(acc_low[m][j], w[j], xq_low);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j)
      t[m * N + r + j] = screened_logit(rows[m], _mm512_reduce_add_epi32(acc[m][j]) - 128 * rows[m].q_sum,
                                        _mm512_reduce_add_epi32(acc_low[m][j]) - 128 * rows[m].q_low_sum,
                                        scales[r + j], bias != nullptr ? bias[r + j] : 0.0f);
}

template <int M>
void vnni_logits(const ScreenRow* rows, const int8_t* screen, const float* scales, const float* bias, float* t,
                 int64_t K, int64_t N) {
  constexpr int J = M < 4 ? 4 : 2;
  spindle::parallel_for(0, N / J, 64 / J, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) vnni_rows<M, J>(rows, screen, scales, bias, t, J * b, K, N);
  });
  for (int64_t r = N / J * J; r < N; ++r)  // the last N % J rows, one row of x at a time
    for (int m = 0; m < M; ++m) vnni_rows<1, 1>(rows + m, screen, scales, bias, t + m * N, r, K, N);
}

// |t_r - x . w_r| <= |x|_2 d_r + this (d_r: see screened_argmax): with x's rounded copy x~ and
// w_r's w~_r, x . w_r - x~ . w~_r = x . (w_r - w~_r) + (x - x~) . w~_r, the first at most |x|_2
// d_r, the second at most kLowStep s_x |w~_r|_1 <= kLowStep s_x (max_row_l1 + K max_abs / 254);
// the int32 sums are exact. Also returns a bound on the |.| of the screen's products' sum, for
// the roundings after it.
std::pair<double, double> screen_error(const ScreenRow& row, int64_t K, double max_abs, double max_row_l1) {
  const double step = kLowStep * static_cast<double>(row.scale);
  const double rounded_l1 = row.l1 + step * static_cast<double>(K);
  return {step * (max_row_l1 + static_cast<double>(K) * kQuantum * max_abs), rounded_l1 * max_abs * (1.0 + kQuantum)};
}
#else
#ifdef __AVX2__
inline __m256 load8_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// x . q over K for int8 q (one sequential read of q, as row_dot reads a float32 row).
inline float dot_i8(const float* x, const int8_t* q, int64_t K) {
  int64_t k = 0;
  float sum = 0.0f;
#ifdef __AVX2__
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; k + 32 <= K; k += 32)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * u), load8_i8(q + k + 8 * u), acc[u]);
  for (; k + 8 <= K; k += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8_i8(q + k), acc[0]);
  sum = sum_lanes(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
  for (; k < K; ++k) sum += x[k] * static_cast<float>(q[k]);
  return sum;
}

// |t_r - x . w_r| <= |x|_2 d_r (w_r's int8 rounding; d_r: see screened_argmax) + this: the
// float32 sum's own rounding, gamma_K of its products' magnitudes; and a bound on those magnitudes.
std::pair<double, double> screen_error(const ScreenRow& row, int64_t K, double max_abs, double max_row_l1) {
  const double magnitudes = std::min(row.l1 * max_abs, row.inf * max_row_l1) * (1.0 + kQuantum);
  return {gamma_k(K) * (1.0 + 1e-6) * magnitudes, magnitudes};
}
#endif

// t[m][r] = (x[m] . q[r]) * scales[r] + bias[r] for an int8 screen, on VNNI or float lanes.
at::Tensor int8_logits(const std::vector<ScreenRow>& rows, const at::Tensor& q, const at::Tensor& scales,
                       const float* bias, const at::TensorOptions& options) {
  const int64_t M = static_cast<int64_t>(rows.size()), K = q.size(1), N = q.size(0);
  at::Tensor t = at::empty({M, N}, options.dtype(at::kFloat));
  const int8_t* qs = q.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  float* ts = t.data_ptr<float>();
#ifdef SPINDLE_SCREEN_VNNI
  for (int64_t m = 0; m < M; m += 4) {  // x's rows four at a time (greedy_decode passes at most kScreenRows)
    const ScreenRow* group = rows.data() + m;
    float* tm = ts + m * N;
    switch (std::min<int64_t>(M - m, 4)) {
      case 1: vnni_logits<1>(group, qs, sc, bias, tm, K, N); break;
      case 2: vnni_logits<2>(group, qs, sc, bias, tm, K, N); break;
      case 3: vnni_logits<3>(group, qs, sc, bias, tm, K, N); break;
      default: vnni_logits<4>(group, qs, sc, bias, tm, K, N); break;
    }
  }
#else
  spindle::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t m = 0; m < M; ++m)
        ts[m * N + r] = dot_i8(rows[m].x, qs + r * K, K) * sc[r] + (bias != nullptr ? bias[r] : 0.0f);
  });
#endif
  return t;
}

// The logit the full head computes for row r at one row of x (linear_small_m.cpp): row_dot and
// the bias for float32 x; for bfloat16 x its one-row kernel's sum, rounded to bfloat16.
template <typename W>
inline float full_logit(const ScreenRow& row, const W* w, const float* bias, int64_t r, int64_t K) {
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    if (row.x_bf16 != nullptr) return rounded<c10::BFloat16>(row_dot_bf16(row.x_bf16, row.x, w, K));
  }
  return row_dot_f32(row.x, w, K) + (bias != nullptr ? bias[r] : 0.0f);
}

// The token of one row from its screened logits `t` (bias added), or -1 when they cannot decide it.
// With |t_r - l_r| <= a d_r + c for every row r (a = |x|_2, c below), the full head's largest
// logit l_w is at least max_j (t_j - a d_j) - c, so row w has t_w + a d_w >= that - c: only rows
// that pass this are computed.
template <typename W>
int64_t screened_row(const ScreenRow& row, const float* t, const float* d, const W* head, const float* bias, int64_t N,
                     int64_t K, double max_abs, double max_row_l1) {
  const auto [error, magnitudes] = screen_error(row, K, max_abs, max_row_l1);
  const float a = std::nextafter(static_cast<float>(row.l2), INFINITY);
  const auto [lower, magnitude] = lower_and_magnitude(t, d, a, N);
  // The full head's float32 rounding (gamma_K of its products' magnitudes, bounded as the
  // screen's), the screen's error past a d_r, the roundings of the scales' products, of the bias
  // on both sides and of t_r -+ a d_r here (d_r <= sqrt(K) max |w| / 254), and a margin for
  // subnormal products flushed to zero.
  const double dots = std::min(row.l1 * max_abs, row.inf * max_row_l1);
  const double spread = static_cast<double>(a) * std::sqrt(static_cast<double>(K)) * kQuantum * max_abs;
  double common = gamma_k(K) * (1.0 + 1e-6) * dots + error +
                  6.0 * kUnit * (magnitude + dots + magnitudes + error + spread) + static_cast<double>(K) * 1e-37 + 1e-37;
  if (row.x_bf16 != nullptr) common += kBf16Unit * (magnitude + spread + common);  // the full head's logits are bf16
  if (!std::isfinite(common) || std::isnan(lower)) return -1;
  const float floor = std::nextafter(static_cast<float>(static_cast<double>(lower) - 2.0 * common), -INFINITY);
  int64_t best = -1, count = 0;
  float best_logit = 0.0f;
  auto consider = [&](int64_t r) {
    if (++count > kMaxCandidates) return false;
    const float logit = full_logit(row, head + r * K, bias, r, K);
    if (std::isnan(logit)) return false;
    if (best < 0 || logit > best_logit) {
      best = r;
      best_logit = logit;
    }
    return true;
  };
  int64_t r = 0;
#ifdef __AVX2__
  const __m256 vfloor = _mm256_set1_ps(floor), va = _mm256_set1_ps(a);
  for (; r + 8 <= N; r += 8) {
    const __m256 upper = _mm256_fmadd_ps(va, _mm256_loadu_ps(d + r), _mm256_loadu_ps(t + r));
    unsigned mask = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(upper, vfloor, _CMP_GE_OQ)));
    for (; mask != 0; mask &= mask - 1)
      if (!consider(r + __builtin_ctz(mask))) return -1;
  }
#endif
  for (; r < N; ++r)
    if (std::fma(a, d[r], t[r]) >= floor && !consider(r)) return -1;
  return best;
}

}  // namespace

// `errors[r]` >= |w_r - q_r s_r|_2, w_r's int8 rounding (greedy_step.py `head_screen`): by
// Cauchy-Schwarz it moves x . w_r by at most |x|_2 errors[r], a bound of each row's own. For
// random weights and activations that is ~0.72 s_r / max_j s_j of the bound it replaced, |x|_1
// max |w| / 254, or ~0.4 at the medium benchmark model's shapes (K = 1,024), whose one-stream
// steps left 20-28 % of their rows to the full head with the old bound (paying for both heads)
// and none with this one.
c10::optional<at::Tensor> screened_argmax(const at::Tensor& x_in, const at::Tensor& head, const at::Tensor& screen,
                                          const at::Tensor& scales, const at::Tensor& errors, double max_abs,
                                          double max_row_l1, const c10::optional<at::Tensor>& bias) {
  const bool x_is_bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_is_bf16),
              "screened_argmax: x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(head.dim() == 2 && head.is_contiguous() && head.size(1) == x_in.size(1) &&
                  (head.scalar_type() == at::kBFloat16 || (head.scalar_type() == at::kFloat && !x_is_bf16)),
              "screened_argmax: head must be a contiguous float32 or bfloat16 [N, K] (bfloat16 for bfloat16 x)");
  TORCH_CHECK(screen.scalar_type() == at::kChar && screen.sizes() == head.sizes() && screen.is_contiguous(),
              "screened_argmax: screen must be the head in int8");
  const int64_t N = head.size(0), K = head.size(1), M = x_in.size(0);
  TORCH_CHECK(K <= 65536, "screened_argmax: rows of at most 65,536 (the int32 sums' range)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "screened_argmax: scales must be float32 [N]");
  TORCH_CHECK(errors.scalar_type() == at::kFloat && errors.is_contiguous() && errors.numel() == N,
              "screened_argmax: errors must be float32 [N]");
  const float* d = errors.data_ptr<float>();
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(!x_is_bf16, "screened_argmax: no bias with bfloat16 x");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "screened_argmax: bias must be a contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor widened = x_is_bf16 ? x.to(at::kFloat) : x;
#ifdef SPINDLE_SCREEN_VNNI
  const int64_t padded = (K + kBytes - 1) / kBytes * kBytes;
  std::vector<int8_t> quantized(static_cast<size_t>(2 * M * padded));
#endif
  std::vector<ScreenRow> rows(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    ScreenRow& row = rows[m];
    row.x = widened.data_ptr<float>() + m * K;
    if (x_is_bf16) row.x_bf16 = x.data_ptr<c10::BFloat16>() + m * K;
    measure(row, K);
    if (!std::isfinite(row.l1)) {  // a NaN or inf: no bound; the full head answers (NaN logits and all)
      rows_undecided.fetch_add(M, std::memory_order_relaxed);
      return c10::nullopt;
    }
#ifdef SPINDLE_SCREEN_VNNI
    quantize(row, quantized.data() + 2 * m * padded, quantized.data() + (2 * m + 1) * padded, K);
#endif
  }
  const at::Tensor screened = int8_logits(rows, screen, scales, b, x.options());
  at::Tensor tokens = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  std::atomic<bool> decided{true};
  spindle::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* tm = screened.data_ptr<float>() + m * N;
      out[m] = head.scalar_type() == at::kFloat
                   ? screened_row(rows[m], tm, d, head.data_ptr<float>(), b, N, K, max_abs, max_row_l1)
                   : screened_row(rows[m], tm, d, head.data_ptr<c10::BFloat16>(), b, N, K, max_abs, max_row_l1);
      if (out[m] < 0) decided.store(false, std::memory_order_relaxed);
    }
  });
  if (!decided.load()) {
    rows_undecided.fetch_add(M, std::memory_order_relaxed);
    return c10::nullopt;
  }
  rows_decided.fetch_add(M, std::memory_order_relaxed);
  return tokens;
}

// (rows the screen decided, rows it left to the full head) so far, for tests and diagnostics.
std::tuple<int64_t, int64_t> head_screen_counts() { return {rows_decided.load(), rows_undecided.load()}; }

}  // namespace spindle

TORCH_LIBRARY_FRAGMENT(spindle, m) {
  m.def("screened_argmax(Tensor x, Tensor head, Tensor screen, Tensor scales, Tensor errors, float max_abs, "
        "float max_row_l1, Tensor? bias) "
        "-> Tensor?");
  m.def("head_screen_counts() -> (int, int)", &spindle::head_screen_counts);
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) { m.impl("screened_argmax", &spindle::screened_argmax); }
