// Bidirectional attention within each sequence of a packed batch: what encoder (BERT-family)
// layers compute for embeddings and cross-encoder scores on the CPU.
//
// Why: the packed path (attention/packed_encoder.py) ran torch's sdpa once per sequence, 768
// calls for 128 sentences x 6 layers of all-MiniLM-L6-v2, at ~38 GFLOP/s: 18 % of a round.
// At head_dim 32 most of a row's work is the softmax's exponentials, which torch's CPU flash
// kernel does in blocks with rescaling. Sentences are short (at most max_model_len, a few
// hundred tokens), so here a query's whole row of scores fits in L1: scores of every key, one
// max, one pass of 8-lane exponentials (vec_math.h), then the weighted sum of values; no online
// rescaling.
//
// Work: one item per (sequence, head), taken by threads from an atomic counter (a round mixes
// 10- and 250-token sentences, so a static split would leave a thread idle). An item copies its
// head's keys and values into contiguous buffers (in the packed qkv output one token's row is
// thousands of floats from the next), then takes its queries two at a time: 8 keys' dot
// products side by side per query, and 2 queries x 4 vectors of head_dim accumulating the
// values, so every FMA chain has independent neighbours.
//
// Inputs: query, key, value [tokens, heads, head_dim] float32 with contiguous heads (any token
// stride: views of the fused qkv projection); query_start_loc [sequences + 1] int64.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace spindle {
namespace {

constexpr int64_t kPair = 2;     // queries whose value sums share each value row loaded
constexpr int64_t kChunk = 32;   // head_dim floats per accumulator pass (4 AVX2 vectors)

class SequenceHead {
 public:
  SequenceHead(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, float scale)
      : q_(q.data_ptr<float>()), k_(k.data_ptr<float>()), v_(v.data_ptr<float>()), out_(out.data_ptr<float>()),
        qs_(q.stride(0)), ks_(k.stride(0)), vs_(v.stride(0)), os_(out.stride(0)), D_(q.size(2)), scale_(scale) {}

  // Head h of the L tokens from t0.
  void run(int64_t t0, int64_t L, int64_t h) {
    kc_.resize(L * D_);
    vc_.resize(L * D_);
    qc_.resize(kPair * D_);
    scores_.resize(kPair * L);
    for (int64_t j = 0; j < L; ++j) {
      std::copy_n(k_ + (t0 + j) * ks_ + h * D_, D_, kc_.data() + j * D_);
      std::copy_n(v_ + (t0 + j) * vs_ + h * D_, D_, vc_.data() + j * D_);
    }
    for (int64_t i = 0; i < L; i += kPair) {
      const int64_t nq = std::min(kPair, L - i);
      float inv_sum[kPair];
      for (int64_t p = 0; p < nq; ++p) {
        const float* src = q_ + (t0 + i + p) * qs_ + h * D_;
        float* qp = qc_.data() + p * D_;
        for (int64_t d = 0; d < D_; ++d) qp[d] = src[d] * scale_;
        float* s = scores_.data() + p * L;
        dots(qp, s, L);
        inv_sum[p] = 1.0f / softmax(s, L);
      }
      for (int64_t c = 0; c < D_; c += kChunk) {
        const int64_t width = std::min(kChunk, D_ - c);
        float acc[kPair][kChunk];
        weighted_values(nq, L, c, width, acc);
        for (int64_t p = 0; p < nq; ++p) {
          float* dst = out_ + (t0 + i + p) * os_ + h * D_ + c;
          for (int64_t d = 0; d < width; ++d) dst[d] = acc[p][d] * inv_sum[p];
        }
      }
    }
  }

 private:
  // s[j] = q . k_j for the L keys.
  void dots(const float* q, float* s, int64_t L) const {
    const int64_t D = D_;
    int64_t j = 0;
#ifdef __AVX2__
    if (D % 8 == 0) {
      for (; j + 8 <= L; j += 8) {  // 8 keys side by side, reduced in one transposing add tree
        const float* k0 = kc_.data() + j * D;
        __m256 dot[8];
        for (auto& x : dot) x = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + d);
          for (int jj = 0; jj < 8; ++jj) dot[jj] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + jj * D + d), dot[jj]);
        }
        _mm256_storeu_ps(s + j, sum_each(dot));
      }
    }
#endif
    for (; j < L; ++j) {
      const float* kj = kc_.data() + j * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += q[d] * kj[d];
      s[j] = dot;
    }
  }

  // s <- exp(s - max(s)) in place; returns the sum of the weights.
  static float softmax(float* s, int64_t L) {
    return exp_shifted_sum(s, 0, L, max_of(s, 0, L));
  }

  // acc[p][0..width) = sum_j s_p[j] * v_j[c..c+width) for the nq queries whose weights are in scores_.
  void weighted_values(int64_t nq, int64_t L, int64_t c, int64_t width, float (&acc)[kPair][kChunk]) const {
    const int64_t D = D_;
    const float* s = scores_.data();
#ifdef __AVX2__
    if (width == kChunk && nq == kPair) {
      __m256 a[kPair][4];
      for (auto& row : a)
        for (auto& x : row) x = _mm256_setzero_ps();
      for (int64_t j = 0; j < L; ++j) {
        const float* vj = vc_.data() + j * D + c;
        const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8), v2 = _mm256_loadu_ps(vj + 16),
                     v3 = _mm256_loadu_ps(vj + 24);
        for (int64_t p = 0; p < kPair; ++p) {
          const __m256 w = _mm256_broadcast_ss(s + p * L + j);
          a[p][0] = _mm256_fmadd_ps(w, v0, a[p][0]);
          a[p][1] = _mm256_fmadd_ps(w, v1, a[p][1]);
          a[p][2] = _mm256_fmadd_ps(w, v2, a[p][2]);
          a[p][3] = _mm256_fmadd_ps(w, v3, a[p][3]);
        }
      }
      for (int64_t p = 0; p < kPair; ++p)
        for (int x = 0; x < 4; ++x) _mm256_storeu_ps(acc[p] + 8 * x, a[p][x]);
      return;
    }
#endif
    for (int64_t p = 0; p < nq; ++p) {
      float* ap = acc[p];
      std::fill_n(ap, width, 0.0f);
      for (int64_t j = 0; j < L; ++j) {
        const float w = s[p * L + j];
        const float* vj = vc_.data() + j * D + c;
#pragma omp simd
        for (int64_t d = 0; d < width; ++d) ap[d] += w * vj[d];
      }
    }
  }

  const float *q_, *k_, *v_;
  float* out_;
  const int64_t qs_, ks_, vs_, os_, D_;
  const float scale_;
  std::vector<float> kc_, vc_, qc_, scores_;
};

void check_packed(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "encoder_attention: ", name,
              " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 3 && t.sizes() == like.sizes(), "encoder_attention: ", name, " must be [tokens, heads, head_dim]",
              " like query");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "encoder_attention: ", name,
              " must have contiguous heads (any token stride)");
}

}  // namespace

// out[t, h] = softmax(scale * q[t, h] . k[s, h]^T) v[s, h] over the tokens s of t's sequence.
at::Tensor encoder_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& query_start_loc, double scale) {
  for (const auto& [t, name] : {std::pair{&query, "query"}, {&key, "key"}, {&value, "value"}})
    check_packed(*t, query, name);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.dim() == 1 && query_start_loc.size(0) >= 1,
              "encoder_attention: query_start_loc must be int64 [sequences + 1]");
  const at::Tensor qsl = query_start_loc.contiguous();
  const int64_t* starts = qsl.data_ptr<int64_t>();
  const int64_t num_seqs = qsl.size(0) - 1, heads = query.size(1), tokens = query.size(0);
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == tokens, "encoder_attention: query_start_loc must run from 0 to ",
              tokens);
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(starts[s + 1] > starts[s], "encoder_attention: sequence ", s, " is empty or out of order");
  at::Tensor out = at::empty(query.sizes(), query.options());
  const int64_t total = num_seqs * heads;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    SequenceHead kernel(query, key, value, out, static_cast<float>(scale));
    for (int64_t w = next.fetch_add(1); w < total; w = next.fetch_add(1)) {
      const int64_t s = w / heads;
      kernel.run(starts[s], starts[s + 1] - starts[s], w % heads);
    }
  });
  return out;
}

}  // namespace spindle

TORCH_LIBRARY_FRAGMENT(spindle, m) {
  m.def("encoder_attention(Tensor query, Tensor key, Tensor value, Tensor query_start_loc, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) { m.impl("encoder_attention", &spindle::encoder_attention); }
