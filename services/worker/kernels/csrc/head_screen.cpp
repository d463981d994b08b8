// Greedy tokens from an LM head read at one byte a weight: an int8 screen, then the exact logits
// of the few rows that could still be the largest.
//
// Why: a decode step of one stream reads every weight once, so its time is its bytes. The small
// benchmark model's LM head (8,192 x 256 float32, 8.4 MB) is 41 % of a step's 20.4 MB, and on a
// 2-core AMD EPYC Zen 3 whose last-level cache keeps ~12-16 MB of them, the step streams from
// memory. A greedy step needs only the index of the largest logit, not the logits.
//
// How: each row r of the head (float32, or bfloat16 under --weight-dtype; float32 activations)
// has an int8 copy q_r with one scale s_r = max_k |w_rk| / 127, so |w_rk - q_rk s_r| <= s_r / 2
// (models/greedy_step.py `head_screen` builds them once). The screened logit t_r = (x . q_r) s_r
// + b_r is off the logit l_r the full path computes (row_dot + bias, linear_small_m.cpp) by the
// quantisation, at most |x|_1 max_r s_r / 2, plus float32 rounding: a sum of K products is off
// its real value by at most gamma_K = K 2^-24 / (1 - K 2^-24) of the sum of the products'
// magnitudes (in any order, with or without FMA), bounded by A = |x|_1 max |w| or |x|_inf
// max_r sum_k |w_rk|, whichever is smaller (both head norms taken at build time), plus a few
// roundings of the scale and the bias, each at most 2^-24 of the largest |t|. With that bound B
// on every |t_r - l_r|, the largest l_r belongs to a row with t_r >= max_j t_j - 2B; those rows'
// exact logits come from the same row_dot the full path runs at one row, and the first of their
// largest is the token (the first index of the maximum, as argmax_rows). Where B is not finite
// (a NaN or inf in x) or more than kMaxCandidates rows qualify, the call answers nothing and the
// caller runs the full head.
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

#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace spindle {
namespace {

constexpr int64_t kMaxCandidates = 64;
// Rows decided by the screen, and rows it left to the full head, since the library loaded.
std::atomic<int64_t> rows_decided{0}, rows_undecided{0};
constexpr double kUnit = 1.0 / 16777216.0;  // 2^-24: float32's unit roundoff

// The largest of t[0..n) and the largest |t|, or (NaN, NaN) where t holds a NaN.
std::pair<float, float> max_and_magnitude(const float* t, int64_t n) {
  float best = -INFINITY, magnitude = 0.0f;
  bool nan = false;
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vbest = _mm256_set1_ps(-INFINITY), vmag = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(t + i);
    vbest = _mm256_max_ps(vbest, v);
    vmag = _mm256_max_ps(vmag, _mm256_andnot_ps(sign, v));
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  best = max_lane(vbest);
  magnitude = max_lane(vmag);
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(t[i]);
    best = std::max(best, t[i]);
    magnitude = std::max(magnitude, std::fabs(t[i]));
  }
  return nan ? std::pair<float, float>{NAN, NAN} : std::pair<float, float>{best, magnitude};
}

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

// t[m][r] = (x[m] . q[r]) * scales[r] + bias[r] for an int8 screen.
at::Tensor int8_logits(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  at::Tensor t = at::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const int8_t* qs = q.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  float* ts = t.data_ptr<float>();
  spindle::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t m = 0; m < M; ++m)
        ts[m * N + r] = dot_i8(xs + m * K, qs + r * K, K) * sc[r] + (bias != nullptr ? bias[r] : 0.0f);
  });
  return t;
}

// The token of one row from its screened logits `t` (bias added), or -1 when they cannot decide it.
template <typename W>
int64_t screened_row(const float* x, const float* t, const W* head, const float* bias, int64_t N, int64_t K,
                     double coefficient, double quantum, double max_abs, double max_row_l1) {
  double x_l1 = 0.0, x_inf = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const double a = std::fabs(static_cast<double>(x[k]));
    x_l1 += a;
    x_inf = std::max(x_inf, a);
  }
  const double x_l1_max_abs = x_l1 * (1.0 + 1e-12 * static_cast<double>(K)) * max_abs;  // the double sum's rounding
  const double dots = std::min(x_l1_max_abs, x_inf * max_row_l1);
  const auto [top, magnitude] = max_and_magnitude(t, N);
  // The screen's error, the bias's rounding on both sides, and a margin for subnormal weights.
  const double step_error = quantum * x_l1_max_abs;
  const double bound = coefficient * (dots + step_error) + step_error + 4.0 * kUnit * (magnitude + coefficient * dots + step_error) + 1e-37;
  if (!std::isfinite(bound) || std::isnan(top)) return -1;
  // Every row whose screened logit reaches this may hold the largest logit (rounded down to float).
  const float floor = std::nextafter(static_cast<float>(static_cast<double>(top) - 2.0 * bound), -INFINITY);
  int64_t best = -1, count = 0;
  float best_logit = 0.0f;
  auto consider = [&](int64_t r) {
    if (++count > kMaxCandidates) return false;
    const float logit = row_dot_f32(x, head + r * K, K) + (bias != nullptr ? bias[r] : 0.0f);  // as run() stores it
    if (std::isnan(logit)) return false;
    if (best < 0 || logit > best_logit) {
      best = r;
      best_logit = logit;
    }
    return true;
  };
  int64_t r = 0;
#ifdef __AVX2__
  const __m256 vfloor = _mm256_set1_ps(floor);
  for (; r + 8 <= N; r += 8) {
    unsigned mask = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(t + r), vfloor, _CMP_GE_OQ)));
    for (; mask != 0; mask &= mask - 1)
      if (!consider(r + __builtin_ctz(mask))) return -1;
  }
#endif
  for (; r < N; ++r)
    if (t[r] >= floor && !consider(r)) return -1;
  return best;
}

}  // namespace

c10::optional<at::Tensor> screened_argmax(const at::Tensor& x_in, const at::Tensor& head, const at::Tensor& screen,
                                          const at::Tensor& scales, double max_abs, double max_row_l1,
                                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "screened_argmax: x must be float32 [M, K]");
  TORCH_CHECK(head.dim() == 2 && head.is_contiguous() && head.size(1) == x_in.size(1) &&
                  (head.scalar_type() == at::kFloat || head.scalar_type() == at::kBFloat16),
              "screened_argmax: head must be a contiguous float32 or bfloat16 [N, K]");
  TORCH_CHECK(screen.scalar_type() == at::kChar && screen.sizes() == head.sizes() && screen.is_contiguous(),
              "screened_argmax: screen must be the head in int8");
  const int64_t N = head.size(0), K = head.size(1), M = x_in.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "screened_argmax: scales must be float32 [N]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "screened_argmax: bias must be a contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor screened = int8_logits(x, screen, scales, b);
  const double gamma = static_cast<double>(K) * kUnit / (1.0 - static_cast<double>(K) * kUnit);
  const double coefficient = 2.0 * gamma * (1.0 + 1.0 / 254.0) * (1.0 + 1e-6);
  const double quantum = 1.01 / 254.0;  // s_r / 2 = max_k |w_rk| / 254, and the scale's rounding
  at::Tensor tokens = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  std::atomic<bool> decided{true};
  spindle::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xm = x.data_ptr<float>() + m * K;
      const float* tm = screened.data_ptr<float>() + m * N;
      out[m] = head.scalar_type() == at::kFloat
                   ? screened_row(xm, tm, head.data_ptr<float>(), b, N, K, coefficient, quantum, max_abs, max_row_l1)
                   : screened_row(xm, tm, head.data_ptr<c10::BFloat16>(), b, N, K, coefficient, quantum, max_abs,
                                  max_row_l1);
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
  m.def("screened_argmax(Tensor x, Tensor head, Tensor screen, Tensor scales, float max_abs, float max_row_l1, Tensor? bias) "
        "-> Tensor?");
  m.def("head_screen_counts() -> (int, int)", &spindle::head_screen_counts);
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) { m.impl("screened_argmax", &spindle::screened_argmax); }
