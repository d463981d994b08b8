// The decoder step's elementwise work on the CPU in single passes: residual add + RMSNorm, and
// act(gate) * up over the fused gate_up output (SiLU, or Gemma's tanh GELU); and the encoder
// layer's residual add + LayerNorm, with the bf16 copy its next GEMM reads. Also the rotary
// helper that the paged attention kernel applies at its KV write (fused_ops.h).
//
// Why: in torch each of these is a chain of separate ops (an RMSNorm is pow, mean, add, rsqrt,
// mul, mul; rotary is two index lookups and ~10 ops), each a dispatch of several microseconds
// and a pass over memory. At decode sizes (1-64 rows) that overhead, not arithmetic, is their
// cost. Which of them the decoder uses was chosen by measurement (models/fused.py).
//
// Activations may be float32 or bfloat16 (a --dtype bfloat16 model): bf16 values are widened,
// computed in fp32 and rounded to bf16 wherever torch's separate bf16 ops round (`rounded`).
// Numerics follow Hugging Face's code, rounding where it rounds: products are not
// contracted into FMAs (the pragma below; torch rounds each op's result), so rotary and the
// activations round like torch's separate ops. The RMSNorm's mean of squares is summed in a
// different order than torch's reduction, so it may differ in the last bit.
//
// Paths by CPU: the loops are plain `omp simd` loops that -march=native vectorises for the CPU
// that builds them (kernels/build.py); exp and tanh come from SLEEF (the vector library torch
// itself links, so its silu and gelu kernels use the same functions) where the CPU has AVX2,
// else from <cmath> one value at a time.

#pragma GCC optimize("fp-contract=off")

#include "fused_ops.h"
#include "kernel_ops.h"
#include "vec_math.h"
#include "work_pool.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && __has_include(<sleef.h>)
#include <immintrin.h>
#include <sleef.h>
#define SPINDLE_HAVE_SLEEF_AVX2 1
#endif

namespace spindle {

void rope_row(const float* x, const float* cos, const float* sin, float* out, int64_t rotary_dim, int64_t head_dim,
              float scale) {
  const int64_t half = rotary_dim / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) out[d] = (x[d] * cos[d] - x[d + half] * sin[d]) * scale;
#pragma omp simd
  for (int64_t d = half; d < rotary_dim; ++d) out[d] = (x[d] * cos[d] + x[d - half] * sin[d]) * scale;
  for (int64_t d = rotary_dim; d < head_dim; ++d) out[d] = x[d] * scale;
}

void rope_row(const c10::BFloat16* x, const float* cos, const float* sin, float* out, int64_t rotary_dim,
              int64_t head_dim, float scale) {
  using T = c10::BFloat16;
  const int64_t half = rotary_dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float c = rounded<T>(cos[d]), s = rounded<T>(sin[d]);
    out[d] = rounded<T>(rounded<T>(to_float(x[d]) * c) - rounded<T>(to_float(x[d + half]) * s)) * scale;
  }
  for (int64_t d = half; d < rotary_dim; ++d) {
    const float c = rounded<T>(cos[d]), s = rounded<T>(sin[d]);
    out[d] = rounded<T>(rounded<T>(to_float(x[d]) * c) + rounded<T>(to_float(x[d - half]) * s)) * scale;
  }
  for (int64_t d = rotary_dim; d < head_dim; ++d) out[d] = to_float(x[d]) * scale;
}

namespace {

constexpr int64_t kGrainElements = 32768;  // elements per thread below which a call stays on one thread (torch's)


// Rows of `n` elements over threads, at least kGrainElements per thread.
template <typename F>
void for_rows(int64_t rows, int64_t n, const F& body) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, n));
  spindle::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

// p[0, n) as fp32: itself for float rows, else widened into `buf`.
template <typename T>
const float* as_float(const T* p, std::vector<float>& buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else {
    buf.resize(n);
    widen_row(p, buf.data(), n);
    return buf.data();
  }
}

// out = RMSNorm(s) as HF computes it: in float32, s * rsqrt(mean(s^2) + eps), then w * that
// (for bf16 activations: that rounded to bf16 first, then the product rounded, as torch does),
// or that * (1 + w) rounded once for Gemma's unit-offset weights.
template <typename W, typename T>
void norm_row(const float* s, T* out, const W* w, int64_t n, float eps, bool unit_offset) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += s[i] * s[i];
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
  if (unit_offset) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>((s[i] * inv) * (1.0f + to_float(w[i])));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(to_float(w[i]) * rounded<T>(s[i] * inv));
  }
}

// residual_out = x + residual (when given; rounded to T), out = RMSNorm(residual_out); x [rows, n] of T.
template <typename W, typename T>
void run_norm(const at::Tensor& x, const at::Tensor* residual, at::Tensor* residual_out, const at::Tensor& weight,
              at::Tensor& out, double eps, bool unit_offset) {
  const int64_t n = x.size(1), rows = x.size(0);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* sp = residual_out ? residual_out->data_ptr<T>() : nullptr;
  const W* w = weight.data_ptr<W>();
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  for_rows(rows, n, [&](int64_t r) {
    std::vector<float> wide;
    const T* s = xp + r * n;
    if (rp != nullptr) {
      T* dst = sp + r * n;
      const T* a = rp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(to_float(a[i]) + to_float(s[i]));
      s = dst;
    }
    norm_row(as_float(s, wide, n), op + r * n, w, n, e, unit_offset);
  });
}

// Activations a kernel here takes: float32, or bfloat16 (a --dtype bfloat16 model).
at::Tensor rows_of(const at::Tensor& t, const char* what) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && t.device().is_cpu(), what,
              ": expected a float32 or bfloat16 CPU tensor");
  return t.reshape({-1, t.size(-1)}).contiguous();
}

template <typename T>
void norm_for_weight(const at::Tensor& x, const at::Tensor* residual, at::Tensor* residual_out,
                     const at::Tensor& weight, at::Tensor& out, double eps, bool unit_offset) {
  if (weight.scalar_type() == at::kFloat) {
    run_norm<float, T>(x, residual, residual_out, weight, out, eps, unit_offset);
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "rms_norm: weight must be float32 or bfloat16");
    run_norm<c10::BFloat16, T>(x, residual, residual_out, weight, out, eps, unit_offset);
  }
}

void norm_dispatch(const at::Tensor& x, const at::Tensor* residual, at::Tensor* residual_out,
                   const at::Tensor& weight, at::Tensor& out, double eps, bool unit_offset) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be a contiguous [hidden] tensor");
  TORCH_CHECK(residual == nullptr || residual->scalar_type() == x.scalar_type(),
              "add_rms_norm: x and residual must have one dtype");
  if (x.scalar_type() == at::kFloat) {
    norm_for_weight<float>(x, residual, residual_out, weight, out, eps, unit_offset);
  } else {
    norm_for_weight<c10::BFloat16>(x, residual, residual_out, weight, out, eps, unit_offset);
  }
}

// --- activations -------------------------------------------------------------------------

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

#ifdef SPINDLE_HAVE_SLEEF_AVX2
// 8 gate values -> act(gate) * up, in the form and with the functions of torch's vectorised kernels.
inline __m256 act_mul8(__m256 g, __m256 u, int64_t act) {
  const __m256 one = _mm256_set1_ps(1.0f);
  if (act == kSilu) {
    const __m256 neg = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, Sleef_expf8_u10(neg))), u);
  }
  const __m256 beta = _mm256_set1_ps(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5));
  const __m256 kappa = _mm256_set1_ps(0.044715f);
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 inner = _mm256_mul_ps(beta, _mm256_add_ps(g, _mm256_mul_ps(kappa, cube)));
  const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, Sleef_tanhf8_u10(inner)));
  return _mm256_mul_ps(gelu, u);
}
#endif

#if defined(SPINDLE_HAVE_SLEEF_AVX2) && defined(__AVX512F__)
// act_mul8 on 16 lanes, where the CPU has AVX-512 (as torch's own kernels there: at 64 rows x
// 2,816 on an AMD Zen 5 the 8-lane form took 43.5 us against torch's 33.6). SLEEF's 16-lane
// functions compute each lane as its 8-lane ones do, so the results are the same.
inline __m512 act_mul16(__m512 g, __m512 u, int64_t act) {
  const __m512 one = _mm512_set1_ps(1.0f);
  if (act == kSilu) {
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), g);
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, Sleef_expf16_u10(neg))), u);
  }
  const __m512 beta = _mm512_set1_ps(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5));
  const __m512 kappa = _mm512_set1_ps(0.044715f);
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(g, _mm512_mul_ps(kappa, cube)));
  const __m512 gelu =
      _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, Sleef_tanhf16_u10(inner)));
  return _mm512_mul_ps(gelu, u);
}
#define SPINDLE_HAVE_SLEEF_AVX512 1
#endif

// Scalar form: the fallback where SLEEF or AVX2 is missing.
inline float act_mul1(float g, float u, int64_t act) {
  if (act == kSilu) return g / (1.0f + std::exp(-g)) * u;
  const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  const float inner = beta * (g + 0.044715f * (g * g * g));
  return 0.5f * g * (1.0f + std::tanh(inner)) * u;
}

void act_mul_row(const float* gate, const float* up, float* out, int64_t n, int64_t act) {
  int64_t i = 0;
#ifdef SPINDLE_HAVE_SLEEF_AVX512
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, act_mul16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i), act));
#endif
#ifdef SPINDLE_HAVE_SLEEF_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, act_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i), act));
  if (i < n) {  // the tail through the same vector code, so every element rounds alike
    alignas(32) float g[8] = {}, u[8] = {}, o[8];
    std::memcpy(g, gate + i, (n - i) * sizeof(float));
    std::memcpy(u, up + i, (n - i) * sizeof(float));
    _mm256_store_ps(o, act_mul8(_mm256_load_ps(g), _mm256_load_ps(u), act));
    std::memcpy(out + i, o, (n - i) * sizeof(float));
    i = n;
  }
#endif
  for (; i < n; ++i) out[i] = act_mul1(gate[i], up[i], act);
}

// One row of act_and_mul on T: float as above; bf16 widened, act(gate) rounded, then the
// product rounded (torch's F.silu(gate) * up on bf16 tensors rounds after each op).
#ifdef SPINDLE_HAVE_SLEEF_AVX512
// 16 bf16 values widened to fp32 (vec_math.h's widen16 on their bits, in scope beside this overload).
using spindle::widen16;
inline __m512 widen16(const c10::BFloat16* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 fp32 lanes as bf16 bits, rounded to nearest even, NaN to 0x7FC0: c10::BFloat16's rounding.
inline __m256i narrow16(__m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(bits);
}
#endif

template <typename T>
void act_mul_row_of(const T* gate, const T* up, T* out, int64_t n, int64_t act) {
  if constexpr (std::is_same_v<T, float>) {
    act_mul_row(gate, up, out, n, act);
  } else {
    int64_t i = 0;
#ifdef SPINDLE_HAVE_SLEEF_AVX512
    for (; i + 16 <= n; i += 16) {  // the loop below, 16 lanes at a time
      const __m512 a = widen16(narrow16(act_mul16(widen16(gate + i), _mm512_set1_ps(1.0f), act)));  // rounded
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), narrow16(_mm512_mul_ps(a, widen16(up + i))));
    }
#endif
    const int64_t rest = n - i;
    std::vector<float> g(rest), ones(rest, 1.0f), a(rest);  // act(g) * 1: the same code, the product exact
    widen_row(gate + i, g.data(), rest);
    act_mul_row(g.data(), ones.data(), a.data(), rest, act);
    for (int64_t j = 0; j < rest; ++j) out[i + j] = from_float<T>(rounded<T>(a[j]) * to_float(up[i + j]));
  }
}

template <typename T>
void run_act_and_mul(const at::Tensor& gate_up, at::Tensor& out, int64_t activation) {
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  const T* in = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for_rows(rows, n, [&](int64_t r) { act_mul_row_of(in + r * 2 * n, in + r * 2 * n + n, op + r * n, n, activation); });
}

// --- the encoder's residual add and LayerNorm --------------------------------------------

// One row of out = LayerNorm(x + residual): BertLayer's post-norm, as torch computes it in
// float32 (mean and biased variance of the sum, then (s * rstd - mean * rstd) * w + b; the
// variance is summed in two passes where torch uses Welford's, so the last bit may differ).
// x is a GEMM's output (float32, or bf16 widened); `narrow` (or null) also gets out rounded to
// bf16, the next GEMM's input under bf16 GEMM inputs.
template <typename T>
void add_layer_norm_row(const T* x, const float* residual, const float* w, const float* b, float* out,
                        c10::BFloat16* narrow, int64_t n, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    out[i] = to_float(x[i]) + residual[i];
    sum += out[i];
  }
  const float mean = sum / static_cast<float>(n);
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += (out[i] - mean) * (out[i] - mean);
  const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
  const float shift = -mean * rstd;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = (out[i] * rstd + shift) * w[i] + b[i];
  if (narrow != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) narrow[i] = from_float<c10::BFloat16>(out[i]);
  }
}

template <typename T>
void run_add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        const at::Tensor& bias, at::Tensor& out, at::Tensor* narrow, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  float* op = out.data_ptr<float>();
  c10::BFloat16* np = narrow != nullptr ? narrow->data_ptr<c10::BFloat16>() : nullptr;
  const float e = static_cast<float>(eps);
  for_rows(rows, n, [&](int64_t r) {
    add_layer_norm_row(xp + r * n, rp + r * n, w, b, op + r * n, np != nullptr ? np + r * n : nullptr, n, e);
  });
}

}  // namespace

// h = RMSNorm(x) for x [..., hidden] float32 or bfloat16.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps, bool unit_offset) {
  const at::Tensor x = rows_of(x_in, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  norm_dispatch(x, nullptr, nullptr, weight, out, eps, unit_offset);
  return out.view(x_in.sizes());
}

// (residual + x, RMSNorm(residual + x)): a pre-norm layer's residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(x_in.sizes() == residual_in.sizes(), "add_rms_norm: x and residual must have one shape");
  const at::Tensor x = rows_of(x_in, "add_rms_norm"), residual = rows_of(residual_in, "add_rms_norm");
  at::Tensor sum = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  norm_dispatch(x, &residual, &sum, weight, out, eps, unit_offset);
  return {sum.view(x_in.sizes()), out.view(x_in.sizes())};
}

// act(gate) * up for gate_up [..., 2 * I] (gate first, as the fused projection stores them) -> [..., I].
at::Tensor act_and_mul(const at::Tensor& gate_up_in, int64_t activation) {
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh, "act_and_mul: activation 0 (silu) or 1 (gelu tanh)");
  const at::Tensor gate_up = rows_of(gate_up_in, "act_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "act_and_mul: last dimension must be even");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  std::vector<int64_t> shape(gate_up_in.sizes().begin(), gate_up_in.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    run_act_and_mul<float>(gate_up, out, activation);
  } else {
    run_act_and_mul<c10::BFloat16>(gate_up, out, activation);
  }
  return out.view(shape);
}

// [LayerNorm(residual + x)] or, where `narrow`, [that, that rounded to bf16]: a post-norm encoder
// layer's residual add and norm in one pass; x [..., hidden] float32 or bf16 (a GEMM's output),
// residual, weight and bias float32.
std::vector<at::Tensor> add_layer_norm(const at::Tensor& x_in, const at::Tensor& residual_in, const at::Tensor& weight,
                                       const at::Tensor& bias, double eps, bool narrow) {
  TORCH_CHECK(x_in.sizes() == residual_in.sizes(), "add_layer_norm: x and residual must have one shape");
  TORCH_CHECK(residual_in.scalar_type() == at::kFloat, "add_layer_norm: residual must be float32");
  const at::Tensor x = rows_of(x_in, "add_layer_norm"), residual = rows_of(residual_in, "add_layer_norm");
  for (const at::Tensor* t : {&weight, &bias}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == x.size(1) && t->is_contiguous(),
                "add_layer_norm: weight and bias must be contiguous float32 [hidden] tensors");
  }
  at::Tensor out = at::empty(x.sizes(), residual.options());
  at::Tensor low = narrow ? at::empty(x.sizes(), residual.options().dtype(at::kBFloat16)) : at::Tensor();
  at::Tensor* low_out = narrow ? &low : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run_add_layer_norm<float>(x, residual, weight, bias, out, low_out, eps);
  } else {
    run_add_layer_norm<c10::BFloat16>(x, residual, weight, bias, out, low_out, eps);
  }
  std::vector<at::Tensor> outs{out.view(x_in.sizes())};
  if (narrow) outs.push_back(low.view(x_in.sizes()));
  return outs;
}

}  // namespace spindle

TORCH_LIBRARY_FRAGMENT(spindle, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool unit_offset) -> (Tensor, Tensor)");
  m.def("act_and_mul(Tensor gate_up, int activation) -> Tensor");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps, bool narrow) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) {
  m.impl("rms_norm", &spindle::rms_norm);
  m.impl("add_rms_norm", &spindle::add_rms_norm);
  m.impl("act_and_mul", &spindle::act_and_mul);
  m.impl("add_layer_norm", &spindle::add_layer_norm);
}
