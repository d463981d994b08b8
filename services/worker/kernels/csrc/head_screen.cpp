// Greedy tokens from a float32 LM head that reads half its bytes: a bfloat16 screen, then the
// exact float32 logits of the few rows that could still be the largest.
//
// Why: a decode step of one stream reads every weight once, so its time is its bytes. The small
// benchmark model's LM head (8,192 x 256 float32, 8.4 MB) is 41 % of a step's 20.4 MB, and on a
// 2-core AMD EPYC Zen 3 whose last-level cache keeps ~12-16 MB of them, the step streams from
// memory. A greedy step needs only the index of the largest logit, not the logits.
//
// How: s_r = x . bf16(w_r) + b_r for every row r of the head (linear_small_m on the bfloat16
// copy), and a bound B on |s_r - l_r| for all r, where l_r is the float32 logit the full path
// computes (row_dot + bias, linear_small_m.cpp). bf16 rounds each weight by at most 2^-8 of
// itself, and a float32 sum of K products is off its real value by at most gamma_K = K 2^-24 /
// (1 - K 2^-24) of the sum of the products' magnitudes (in any order, with or without FMA), so
// with A = |x|_1 max |w| or |x|_inf max_r sum_k |w_rk|, whichever is smaller (both head norms are
// taken once, when the plan is built), each sum_k |x_k| |w_rk| <= A and
//   |s_r - l_r| <= (2^-8 + 2 gamma_K (1 + 2^-8)) A + 2^-24 (|s_r| + |l_r|)   (the bias adds).
// The largest l_r then belongs to a row with s_r >= max_j s_j - 2B; those rows' exact logits come
// from the same row_dot the full path runs at one row, and the first of their largest is the
// token (the first index of the maximum, as argmax_rows). Where B is not finite (a NaN or inf in
// x or in the screen) or more than kMaxCandidates rows qualify, the call answers nothing and the
// caller runs the full head.
//
// Cost: the screen reads 2 bytes a weight; the bound is two vector passes over the N screened
// logits; candidates are a handful of K-long dot products (random models and trained ones alike
// leave a few).

#include "kernel_ops.h"
#include "work_pool.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
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

// The largest of t[0..n) and the largest |t|; NaN for the first where t holds a NaN.
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
  alignas(32) float lanes[2][8];
  _mm256_store_ps(lanes[0], vbest);
  _mm256_store_ps(lanes[1], vmag);
  for (int j = 0; j < 8; ++j) {
    best = std::max(best, lanes[0][j]);
    magnitude = std::max(magnitude, lanes[1][j]);
  }
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(t[i]);
    best = std::max(best, t[i]);
    magnitude = std::max(magnitude, std::fabs(t[i]));
  }
  return nan ? std::pair<float, float>{NAN, NAN} : std::pair<float, float>{best, magnitude};
}

// The token of one row from its screened logits `t` (bias added), or -1 when they cannot decide it.
int64_t screened_row(const float* x, const float* t, const float* head, const float* bias, int64_t N, int64_t K,
                     double coefficient, double max_abs, double max_row_l1) {
  double x_l1 = 0.0, x_inf = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const double a = std::fabs(static_cast<double>(x[k]));
    x_l1 += a;
    x_inf = std::max(x_inf, a);
  }
  const double dots = std::min(x_l1 * (1.0 + 1e-12 * static_cast<double>(K)) * max_abs, x_inf * max_row_l1);
  const auto [top, magnitude] = max_and_magnitude(t, N);
  // The screen's error, the bias's rounding on both sides, and a margin for subnormal weights.
  const double bound = coefficient * dots + 2.0 * kUnit * (magnitude + coefficient * dots) + 1e-37;
  if (!std::isfinite(bound) || std::isnan(top)) return -1;
  // Every row whose screened logit reaches this may hold the largest logit (rounded down to float).
  const float floor = std::nextafter(static_cast<float>(static_cast<double>(top) - 2.0 * bound), -INFINITY);
  int64_t best = -1, count = 0;
  float best_logit = 0.0f;
  auto consider = [&](int64_t r) {
    if (++count > kMaxCandidates) return false;
    const float logit = row_dot_f32(x, head + r * K, K) + (bias != nullptr ? bias[r] : 0.0f);
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
                                          double max_abs, double max_row_l1, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "screened_argmax: x must be float32 [M, K]");
  TORCH_CHECK(head.dim() == 2 && head.scalar_type() == at::kFloat && head.is_contiguous() &&
                  head.size(1) == x_in.size(1),
              "screened_argmax: head must be a contiguous float32 [N, K]");
  TORCH_CHECK(screen.scalar_type() == at::kBFloat16 && screen.sizes() == head.sizes(),
              "screened_argmax: screen must be the head in bfloat16");
  const int64_t N = head.size(0), K = head.size(1), M = x_in.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "screened_argmax: bias must be a contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  const at::Tensor x = x_in.contiguous();
  // The bias goes in as the full path adds it (fp32, after the sum): its rounding is in the bound.
  at::Tensor screened = linear_small_m(x, screen, bias, /*float_out=*/true);
  const double gamma = static_cast<double>(K) * kUnit / (1.0 - static_cast<double>(K) * kUnit);
  const double coefficient = (1.0 / 256.0 + 2.0 * gamma * (1.0 + 1.0 / 256.0)) * (1.0 + 1e-6);
  at::Tensor tokens = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  std::atomic<bool> decided{true};
  spindle::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      out[m] = screened_row(x.data_ptr<float>() + m * K, screened.data_ptr<float>() + m * N, head.data_ptr<float>(),
                            b, N, K, coefficient, max_abs, max_row_l1);
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
  m.def("screened_argmax(Tensor x, Tensor head, Tensor screen, float max_abs, float max_row_l1, Tensor? bias) "
        "-> Tensor?");
  m.def("head_screen_counts() -> (int, int)", &spindle::head_screen_counts);
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) { m.impl("screened_argmax", &spindle::screened_argmax); }
