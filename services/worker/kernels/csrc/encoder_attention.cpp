// Bidirectional attention within each sequence of a packed batch: what encoder (BERT-family)
// layers compute for embeddings and cross-encoder scores on the CPU.
//
// Why: the packed path (attention/packed_encoder.py) ran torch's sdpa once per sequence, 768
// calls for 128 sentences x 6 layers of all-MiniLM-L6-v2, at ~38 GFLOP/s: 18 % of a round.
// Sentences are short (at most max_model_len, a few hundred tokens), so a query's whole row of
// scores fits in L1: scores of every key, one max, one pass of exponentials (vec_math.h), then
// the weighted sum of values; no online rescaling.
//
// Work: one item per (sequence, head), taken by threads from an atomic counter (a round mixes
// 10- and 250-token sentences, so a static split would leave a thread idle).
//
// Query vectors in lanes (`LaneHead`, AVX2 or AVX-512): an item takes its sequence's queries a
// slab at a time, 8 (AVX2) or 16 (AVX-512) of them transposed into [head_dim][lanes], so each
// score, the softmax's max, sum and exponentials, and each output dimension are one register
// over the slab, and every key or value element is broadcast once for the whole slab: no
// horizontal sums. The item first copies its head's keys and values into contiguous buffers
// (in the packed qkv output one token's row is thousands of floats from the next; read in
// place, the slabs ran no faster than the old kernel). This is the layout of paged attention's prefill tiles (paged_attention.cpp `run_tiles`,
// prefill_lanes.h). It replaced one query (or pair) at a time against 8 keys side by side,
// each dot product reduced across lanes. Measured against that kernel, both built alike and
// called in turn in one process (2-core AMD EPYC Zen 4, 12 heads of 32, median us a call, 2
// threads): one 120-token sentence 273 -> 170 (1.61x), 32 of 120 tokens 12,079 -> 8,468
// (1.43x), 8 of 30 252 -> 133 (1.90x), 4 of 250 4,950 -> 3,182 (1.56x); one thread 1.46-1.84x;
// the AVX2 form (built without AVX-512) 1.28x on the one sentence. The worker's whole round in
// process, all-MiniLM-L6-v2: one 116-token sentence 14.38 -> 13.36 ms, 32 sentences of 12-250
// tokens 393.7 -> 353.8 ms. Against torch's sdpa loop, the fallback: `python -m
// benchmarks.encoder_attention_bench`. Without AVX2, `ScalarHead` computes the same attention
// in plain loops (reading bf16 widened as it goes, scaling the dot products rather than the
// queries: equal within rounding, not bit for bit).
//
// Inputs: query, key, value [tokens, heads, head_dim], float32 or bf16 alike, with contiguous
// heads (any token stride: views of the fused qkv projection); query_start_loc [sequences + 1]
// int64. The output has their dtype. bf16 is widened as it is read and the arithmetic is
// float32 throughout; the output is rounded (to nearest even) only as it is stored, as an
// encoder's next GEMM on bf16 inputs (prepacked_linear.py) would round a float32 output: so a
// layer whose qkv projection hands over its bf16 result computes the same values, without
// widening the projection's output and rounding the attention's in two passes of their own.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#ifdef __AVX2__
#include "prefill_lanes.h"
#endif
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace spindle {
namespace {

// Where one item reads and writes: the packed tensors' data (float32 or bf16, T), token strides
// and head size.
template <typename T>
struct Packed {
  Packed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, float scale)
      : q(q.data_ptr<T>()), k(k.data_ptr<T>()), v(v.data_ptr<T>()), out(out.data_ptr<T>()),
        qs(q.stride(0)), ks(k.stride(0)), vs(v.stride(0)), os(out.stride(0)), D(q.size(2)), scale(scale) {}
  const T *q, *k, *v;
  T* out;
  const int64_t qs, ks, vs, os, D;
  const float scale;
};

// One query row at a time: its scores against every key, softmax, weighted sum of the values.
template <typename T>
class ScalarHead {
 public:
  explicit ScalarHead(const Packed<T>& p) : p_(p) {}

  // Head h of the L tokens from t0.
  void run(int64_t t0, int64_t L, int64_t h) {
    const int64_t D = p_.D;
    scores_.resize(L);
    acc_.resize(D);
    for (int64_t i = t0; i < t0 + L; ++i) {
      const T* q = p_.q + i * p_.qs + h * D;
      for (int64_t j = 0; j < L; ++j) {
        const T* kj = p_.k + (t0 + j) * p_.ks + h * D;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += to_float(q[d]) * to_float(kj[d]);
        scores_[j] = dot * p_.scale;
      }
      const float inv_sum = 1.0f / exp_shifted_sum(scores_.data(), 0, L, max_of(scores_.data(), 0, L));
      std::fill(acc_.begin(), acc_.end(), 0.0f);
      for (int64_t j = 0; j < L; ++j) {
        const float w = scores_[j] * inv_sum;
        const T* vj = p_.v + (t0 + j) * p_.vs + h * D;
        for (int64_t d = 0; d < D; ++d) acc_[d] += w * to_float(vj[d]);
      }
      T* dst = p_.out + i * p_.os + h * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(acc_[d]);
    }
  }

 private:
  const Packed<T>& p_;
  std::vector<float> scores_, acc_;
};

#ifdef __AVX2__
// Query vectors in lanes (the file's header says why): L::N queries a slab.
template <typename L, typename T>
class LaneHead {
  static constexpr int64_t N = L::N;
  static constexpr int64_t kKeys = 8;            // keys a pass over the head dimension: 8 score chains
  static constexpr int64_t kDims = N == 16 ? 16 : 8;  // value dimensions a pass over the keys (AVX2 has 16 registers)
  using V = typename L::V;

 public:
  explicit LaneHead(const Packed<T>& p) : p_(p) {}

  // Head h of the `len` tokens from t0.
  void run(int64_t t0, int64_t len, int64_t h) {
    const int64_t D = p_.D;
    qt_.resize(D * N);
    w_.resize(len * N);
    kc_.resize(len * D);
    vc_.resize(len * D);
    for (int64_t j = 0; j < len; ++j) {  // contiguous float32: every slab reads them all, in order, from L1
      widen_row(p_.k + (t0 + j) * p_.ks + h * D, kc_.data() + j * D, D);
      widen_row(p_.v + (t0 + j) * p_.vs + h * D, vc_.data() + j * D, D);
    }
    for (int64_t first = 0; first < len; first += N) slab(t0, len, h, first, std::min(N, len - first));
  }

 private:
  // Queries [first, first + n) of the sequence (lanes past n hold zero queries, never written out).
  void slab(int64_t t0, int64_t len, int64_t h, int64_t first, int64_t n) {
    const int64_t D = p_.D;
    if (n < N) std::fill(qt_.begin(), qt_.end(), 0.0f);  // a full slab overwrites every lane
    for (int64_t t = 0; t < n; ++t) {
      const T* q = p_.q + (t0 + first + t) * p_.qs + h * D;
      for (int64_t d = 0; d < D; ++d) qt_[d * N + t] = to_float(q[d]) * p_.scale;
    }
    float* w = w_.data();  // [len][N]: scores, then weights
    int64_t j = 0;
    for (; j + kKeys <= len; j += kKeys) scores<kKeys>(kc_.data() + j * D, w + j * N);
    for (; j < len; ++j) scores<1>(kc_.data() + j * D, w + j * N);
    V max = L::set1(-INFINITY);
    for (j = 0; j < len; ++j) max = L::max(max, L::load(w + j * N));
    V sum = L::zero();
    for (j = 0; j < len; ++j) {
      const V e = L::exp(L::sub(L::load(w + j * N), max));
      L::store(w + j * N, e);
      sum = L::add(sum, e);
    }
    const V inv_sum = L::div(L::set1(1.0f), sum);
    alignas(64) float lanes[N];
    T* out = p_.out + (t0 + first) * p_.os + h * D;
    for (int64_t d0 = 0; d0 < D; d0 += kDims) {
      V acc[kDims];
      const int64_t width = std::min(kDims, D - d0);
      if (width == kDims) {
        values<kDims>(vc_.data() + d0, len, acc);
      } else {
        for (int64_t dd = 0; dd < width; ++dd) values<1>(vc_.data() + d0 + dd, len, acc + dd);
      }
      for (int64_t dd = 0; dd < width; ++dd) {
        L::store(lanes, L::mul(acc[dd], inv_sum));
        for (int64_t t = 0; t < n; ++t) out[t * p_.os + d0 + dd] = from_float<T>(lanes[t]);
      }
    }
  }

  // w[jj][lanes] = q . k_jj for the K keys from k (rows head_dim apart): K independent FMA chains over d.
  template <int64_t K>
  void scores(const float* k, float* w) const {
    const int64_t D = p_.D;
    const float* qt = qt_.data();
    V acc[K];
    for (auto& a : acc) a = L::zero();
    for (int64_t d = 0; d < D; ++d) {
      const V q = L::load(qt + d * N);
      for (int64_t jj = 0; jj < K; ++jj) acc[jj] = L::fmadd(L::set1(k[jj * D + d]), q, acc[jj]);
    }
    for (int64_t jj = 0; jj < K; ++jj) L::store(w + jj * N, acc[jj]);
  }

  // acc[dd][lanes] = sum_j w[j][lanes] * v_j[dd] for the K value dimensions from v (rows head_dim apart).
  template <int64_t K>
  void values(const float* v, int64_t len, V* acc) const {
    const int64_t D = p_.D;
    const float* w_all = w_.data();
    V a[K];  // a local array: accumulating through `acc` (vector types may alias the floats read) kept them in memory
    for (auto& x : a) x = L::zero();
    for (int64_t j = 0; j < len; ++j) {
      const V w = L::load(w_all + j * N);
      const float* vj = v + j * D;
      for (int64_t dd = 0; dd < K; ++dd) a[dd] = L::fmadd(L::set1(vj[dd]), w, a[dd]);
    }
    std::copy_n(a, K, acc);
  }

  const Packed<T>& p_;
  std::vector<float> qt_;  // the slab's queries, scaled: [head_dim][N]
  std::vector<float> w_;   // [len][N]
  std::vector<float> kc_, vc_;  // the head's keys and values, contiguous: [len][head_dim]
};
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
template <typename T>
using Head = LaneHead<Lanes16, T>;
#elif defined(__AVX2__)
template <typename T>
using Head = LaneHead<Lanes8, T>;
#else
template <typename T>
using Head = ScalarHead<T>;
#endif

// Threads take (sequence, head) items from one counter until none is left.
template <typename T>
void run_items(const Packed<T>& packed, const int64_t* starts, int64_t num_seqs, int64_t heads) {
  const int64_t total = num_seqs * heads;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Head<T> kernel(packed);
    for (int64_t w = next.fetch_add(1); w < total; w = next.fetch_add(1)) {
      const int64_t s = w / heads;
      kernel.run(starts[s], starts[s + 1] - starts[s], w % heads);
    }
  });
}

void check_packed(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.scalar_type() == like.scalar_type() && t.device().is_cpu(),
              "encoder_attention: ", name, " must be a float32 or bfloat16 CPU tensor, of query's dtype");
  TORCH_CHECK(t.dim() == 3 && t.sizes() == like.sizes(), "encoder_attention: ", name, " must be [tokens, heads, head_dim]",
              " like query");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "encoder_attention: ", name,
              " must have contiguous heads (any token stride)");
}

}  // namespace

// out[t, h] = softmax(scale * q[t, h] . k[s, h]^T) v[s, h] over the tokens s of t's sequence. Rows past the
// last sequence (padding that lets the GEMMs around it run at a cached row count) are zero.
at::Tensor encoder_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& query_start_loc, double scale) {
  for (const auto& [t, name] : {std::pair{&query, "query"}, {&key, "key"}, {&value, "value"}})
    check_packed(*t, query, name);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.dim() == 1 && query_start_loc.size(0) >= 1,
              "encoder_attention: query_start_loc must be int64 [sequences + 1]");
  const at::Tensor qsl = query_start_loc.contiguous();
  const int64_t* starts = qsl.data_ptr<int64_t>();
  const int64_t num_seqs = qsl.size(0) - 1, heads = query.size(1), tokens = query.size(0);
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] <= tokens, "encoder_attention: query_start_loc must run from 0 to at",
              " most ", tokens);
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(starts[s + 1] > starts[s], "encoder_attention: sequence ", s, " is empty or out of order");
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (starts[num_seqs] < tokens) out.narrow(0, starts[num_seqs], tokens - starts[num_seqs]).zero_();  // padding rows
  const float fscale = static_cast<float>(scale);
  if (query.scalar_type() == at::kBFloat16) {
    run_items(Packed<c10::BFloat16>(query, key, value, out, fscale), starts, num_seqs, heads);
  } else {
    run_items(Packed<float>(query, key, value, out, fscale), starts, num_seqs, heads);
  }
  return out;
}

}  // namespace spindle

TORCH_LIBRARY_FRAGMENT(spindle, m) {
  m.def("encoder_attention(Tensor query, Tensor key, Tensor value, Tensor query_start_loc, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) { m.impl("encoder_attention", &spindle::encoder_attention); }
