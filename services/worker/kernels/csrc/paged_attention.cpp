// Paged attention on the CPU that reads the KV cache in place.
//
// Why: the padded backends copy every row's whole KV history out of the paged cache per layer
// per step, padded to the longest row, so a step costs batch x longest context. Here each
// query token walks its own row's block table and reads only the blocks it may see, so a
// step costs the sum of the rows' contexts (or windows), and nothing is copied but one
// block at a time into an L1-sized float buffer.
//
// Layout (services/worker/kv_cache.py): kv_cache [2, num_blocks, block_size, num_kv_heads,
// head_dim], keys then values; slot = block * block_size + offset. The kernel reads the cache
// through its strides (only head_dim must be contiguous), so the allocator picks the order in
// memory: the paged backend asks for head-major blocks (each block's keys of one KV head are
// block_size x head_dim floats in a row, its values likewise), which a block-by-block walk of one
// head reads as two sequential runs instead of block_size rows num_kv_heads x head_dim apart
// (decode, 64 rows, median of 30 interleaved samples, outputs bit for bit equal: medium shapes
// 4.15 -> 3.62 ms per layer at 256 tokens of context, 14.9 -> 13.1 at 1,024; small shapes 1.06
// -> 0.97 and 4.00 -> 3.58). Tokens are packed
// ([num_tokens, heads, head_dim]); row r owns tokens query_start_loc[r] ..
// query_start_loc[r + 1], the last query_len tokens of its seq_lens[r]-token sequence.
//
// Work is split into items (row, query tile) chosen by the Python side (largest first); with
// at least 4 items per thread each covers every KV head, walking a block's heads in turn, else
// each KV head of an item is a piece of work of its own. A row's blocks lie anywhere in the
// pool, so the kernel prefetches them itself. In decode (one query vector per head), while one
// head-block (one block's keys and values of one KV head) computes, the next in that walk is
// asked for: its keys before the scores, its values before the weighted sum. Asking for the next
// block of the same head, all its lines at once, kept the threads waiting on memory with the KV
// cold (decode, 64 rows x 1,024 tokens, medium shapes, blocks spread over the pool: 85-94 ->
// 71-76 ns per token and KV head per thread in interleaved runs; the small model's 64-stream
// decode step at 1,024 tokens, served, median of six interleaved runs 30.7 -> 26.7 ms); with the
// KV in L2 it then cost ~10 % (35 -> 38-41 ns), and with the walk in every item the medium
// model's 64-stream table cell (128-token prompts, about half its time in prefill) lost ~4 % in
// four of four interleaved pairs (cause not isolated). So a prefill tile (several query vectors
// per head, each head-block read once for all of them) keeps asking for the same head's next
// block, all at once, and only decode walks head-blocks: 2026-11-27, interleaved against the
// walk-less kernel, medium shapes, 64 rows: cold at 1,024 tokens 87-92 -> 76-81 ns, hot at 256
// tokens 40-49 -> 36-42 ns (3 of 3 each); the table cell 240.1 / 235.4 / 256.6 -> 265.8 /
// 242.1 / 240.6 tok/s; the small model's served decode step at 1,024 tokens faster in 5 of 6
// pairs (median 24.8 -> 23.2 ms). Threads take the next piece from one atomic counter,
// so one long row never leaves the other thread idle. Each piece keeps, per query vector (token
// x query head), a flash-style online softmax in fp32: running max, running sum and an fp32
// accumulator, rescaled once per block.
//
// Measured (2-core AMD EPYC, AVX2; medium shapes, 16 / 4 heads of 64, one decode token per
// row, direct calls of the op, interleaved runs) against one KV head per item, no prefetch and
// a scalar softmax: 64 rows x 256 tokens 3.7-5.6 -> 2.4-2.8 ms, 64 x 1,024 15-18 -> 12-13 ms,
// prefill of 1 x 512 tokens 12-14 -> 7.7-8.5 ms. The weighted sum over values with its
// accumulators in named registers (weigh_values), against the portable loop, outputs bit for bit
// equal (2026-11-29, 2-core AMD EPYC Zen 4, decode, one thread, 64 rows x 256 tokens, blocks
// spread over the pool, ns per token and KV head, two interleaved runs each): small shapes
// (8 / 2 heads of 32) fp32 cache 18.3-19.0 -> 15.8-15.9, bf16 23.2-23.3 -> 19.8-20.1; medium
// fp32 66.9-68.7 -> 54.9-61.1, bf16 35.7-38.8 -> 34.1-34.3; built without AVX-512 (the AVX2
// path of a Zen 3) small 17.0 -> 15.2-16.2, bf16 20.8-21.0 -> 18.6-18.7.
//
// Decode with bf16 queries over a bf16 cache (`--dtype bfloat16`) on a CPU with AVX512-BF16
// reads each head-block where it lies, scores and weighted sum on vdpbf16ps pairs
// (`accumulate_pairs`, decode_pairs.h) instead of widening it into the fp32 buffer first; the
// 16-lane prefill tiles take their scores on pairs too (`score_tile_pairs`).
//
// Rotary embedding (optional: positions, cos and sin given): queries are rotated as they are
// loaded into the item's fp32 buffer and keys as they are written to the cache, so the decoder
// skips torch's rotary ops (models/rope.py) and the rotated q and k never exist as tensors.
// fp32 or bf16 queries; the rotation rounds as torch's does (fused_ops.cpp).
//
// Build: compiled on the machine that runs it (-O3 -march=native, see kernels/build.py), so
// the loops below are written for the compiler's vectoriser: fixed-stride inner loops over
// head_dim or block_size under `omp simd`, no -inf masking (key ranges are clipped instead);
// where the compiler would not vectorise (the softmax's exp, 8 keys' dot products), AVX2
// intrinsics, with the portable loop kept for other CPUs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "decode_pairs.h"
#include "env_flag.h"
#include "fused_ops.h"
#include "kernel_ops.h"
#ifdef __AVX2__
#include "prefill_lanes.h"
#endif
#include "vec_math.h"
#include "work_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace spindle {
namespace {

// Query dtypes the fused rotary takes (rope_args refuses the others).
template <typename q_t>
constexpr bool kRotates = std::is_same_v<q_t, float> || std::is_same_v<q_t, c10::BFloat16>;

// Query and cache dtypes the bf16 pairs take (decode_pairs.h; `pairs_usable` says when).
template <typename q_t, typename kv_t>
constexpr bool kPairTypes = std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<kv_t, c10::BFloat16>;

// SPINDLE_DISABLE_L2_PREFETCH=1: ask for the KV's lines into L1 (prefetcht0), as before
// 2026-11-29, instead of into L2 (prefetch_line; side-by-side runs).
inline bool l2_prefetch_disabled() {
  static const bool disabled = env_flag("SPINDLE_DISABLE_L2_PREFETCH");
  return disabled;
}

#if defined(__AVX2__) && defined(__FMA__)
#define SPINDLE_PREFILL_TILES 1
#endif

// SPINDLE_DISABLE_ATTENTION_PAIRS=1: bf16 queries over a bf16 cache widen each block and score on
// fp32, as before 2026-11-30: decode through `accumulate`, not `accumulate_pairs`, and prefill
// tiles without `score_tile_pairs` (side-by-side runs).
inline bool attention_pairs_disabled() {
  static const bool disabled = env_flag("SPINDLE_DISABLE_ATTENTION_PAIRS");
  return disabled;
}

// SPINDLE_DISABLE_PREFILL_TILES=1: prefill tiles take the per-query loop (`accumulate`) as
// before 2026-11-30, instead of `run_tiles` (side-by-side runs).
inline bool prefill_tiles_disabled() {
  static const bool disabled = env_flag("SPINDLE_DISABLE_PREFILL_TILES");
  return disabled;
}

// SPINDLE_PREFILL_TILES_AVX2=1: the tiles' 8-lane AVX2 form on a CPU with AVX-512 too (tests
// of the form an AVX2-only CPU runs; side-by-side runs).
inline bool avx2_tiles_forced() {
  static const bool forced = env_flag("SPINDLE_PREFILL_TILES_AVX2");
  return forced;
}

// Asks for the cache line at p, into L2 (prefetcht1). Why not L1: a head-block is 64-128 lines,
// and each prefetcht0 holds one of L1's few miss buffers until its line arrives, so the
// prefetch loops themselves stalled (perf: ~24 % of the decode kernel's samples on the
// prefetcht0 instructions, ~25 % more on value loads that missed anyway), and with the KV
// outside L2 the kernel read ~6-8 GB/s a thread against 29 GB/s for a plain sum. Into L2 the
// requests queue in L2's deeper miss queue, and the first loads of a block find them there
// (2-core AMD EPYC Zen 4, decode, one thread, 64 rows x 256 tokens, blocks spread over the
// pool, ns per token and KV head, two interleaved runs: medium shapes fp32 cache 74-76 ->
// 34-36, bf16 36-40 -> 34-37; small shapes 18 -> 16-18, within noise; prefetcht2 measured as
// prefetcht1). The decode step's attention, 8 layers of the medium model, 64 rows x 1,024
// tokens, fp32 cache: 82-84 -> 45-59 ms (`python -m benchmarks.attention_bench --model
// medium-long --contexts 256,1024,4096 --kv-cache-dtypes float32`, two runs each way).
// The switch is read at each line, not hoisted out of prefetch_lines: a build with one loop per
// hint measured slower with the KV outside L2 (medium shapes 33-39 -> 46-53 ns, three
// interleaved runs), as if the check spaced the requests out.
// Not __builtin_prefetch: GCC 12 deletes a loop whose body is only that builtin (measured: no
// prefetch instruction left in the binary at -O1 and above).
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  if (l2_prefetch_disabled()) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  __builtin_prefetch(p);
#endif
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  int64_t q_stride, out_stride;  // elements between consecutive tokens
  int64_t bt_stride;             // elements between block-table rows
  float scale, softcap;          // softcap 0: none
  int64_t window;                // 0: no sliding window
  // The cache's strides in elements (its layout is the allocator's choice, see kv_cache.py):
  // keys to values, block to block, token to token within a block, KV head to KV head.
  int64_t kv_stride, block_stride, token_stride, head_stride;
};

// Rotary tables for the fused rotation; cos == nullptr: q and k arrive rotated already.
struct Rope {
  const int64_t* positions = nullptr;  // [num_tokens]
  const float* cos = nullptr;          // [max_positions, rotary_dim]
  const float* sin = nullptr;
  int64_t rotary_dim = 0;

  const float* cos_row(int64_t token) const { return cos + positions[token] * rotary_dim; }
  const float* sin_row(int64_t token) const { return sin + positions[token] * rotary_dim; }
};

// One work item: the query tokens [q_begin, q_end) of `row` (offsets within the row) for the
// query heads that share KV head `kv_head`.
template <typename q_t, typename kv_t>
class ItemKernel {
 public:
  ItemKernel(const Shape& s, const Rope& rope, const q_t* query, q_t* out, const kv_t* cache,
             const int64_t* block_tables, const int64_t* seq_lens, const int64_t* query_start_loc)
      : s_(s), rope_(rope), query_(query), out_(out), cache_(cache), block_tables_(block_tables),
        seq_lens_(seq_lens), query_start_loc_(query_start_loc) {}

  // Query tokens [q_begin, q_end) of `row` against KV heads [kh_begin, kh_end). Blocks are the
  // outer loop, KV heads the inner one, so an item over all KV heads reads each block of the
  // cache front to back (one token's heads lie side by side).
  void run(int64_t row, int64_t q_begin, int64_t q_end, int64_t kh_begin, int64_t kh_end) {
    const int64_t D = s_.head_dim, BS = s_.block_size, G = s_.num_heads / s_.num_kv_heads;
    const int64_t query_len = query_start_loc_[row + 1] - query_start_loc_[row];
    const int64_t first_pos = seq_lens_[row] - query_len;  // position of the row's first query
    const int64_t heads = (kh_end - kh_begin) * G;            // query heads per token in this item
    const int64_t nq = q_end - q_begin, nv = nq * heads;     // query vectors: [nq][heads]
    q_.resize(nv * D);
    acc_.assign(nv * D, 0.0f);
    max_.assign(nv, -INFINITY);
    sum_.assign(nv, 0.0f);
    k_.resize(BS * D);
    v_.resize(BS * D);
    scores_.resize(kHeadTile * BS);
    // Prefill tiles: several query vectors a KV head, each key read once for all of them (run_tiles).
    bool tiles = false, lanes16 = false;
#ifdef SPINDLE_PREFILL_TILES
    tiles = nq > 1 && nq * G >= kMinTileVectors && BS == kTileKeys && D % 8 == 0 && s_.softcap == 0.0f &&
            !prefill_tiles_disabled();
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    lanes16 = !avx2_tiles_forced();
#endif
#endif
    // bf16 pairs (decode_pairs.h) for decode and the 16-lane tiles' scores: queries kept unscaled, in bf16.
    const bool pairs = pairs_usable() && (nq == 1 || (tiles && lanes16));
    const float q_scale = pairs ? 1.0f : s_.scale;
    for (int64_t i = 0; i < nq; ++i) {  // queries in fp32, rotated where asked, scaled unless `pairs`
      const int64_t token = query_start_loc_[row] + q_begin + i;
      const q_t* src = query_ + token * s_.q_stride + kh_begin * G * D;
      float* dst = q_.data() + i * heads * D;
      if constexpr (kRotates<q_t>) {
        if (rope_.cos != nullptr) {
          for (int64_t h = 0; h < heads; ++h)
            rope_row(src + h * D, rope_.cos_row(token), rope_.sin_row(token), dst + h * D, rope_.rotary_dim, D,
                     q_scale);
          continue;
        }
      }
#pragma omp simd
      for (int64_t e = 0; e < heads * D; ++e) dst[e] = to_float(src[e]) * q_scale;
    }
    if (pairs) {  // exact: a bf16 query, rotated as torch rounds, is a bf16 value in fp32
      qb_.resize(nv * D);
      for (int64_t e = 0; e < nv * D; ++e) qb_[e] = from_float<c10::BFloat16>(q_[e]);
    }
    const int64_t last_pos = first_pos + q_end - 1;
    const int64_t lo = key_lo(first_pos + q_begin), hi = last_pos + 1;  // keys any query here sees
    const int64_t* table = block_tables_ + row * s_.bt_stride;
#ifdef SPINDLE_PREFILL_TILES
    if (tiles) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
      if (lanes16) {
        run_tiles<Lanes16>(table, lo, hi, first_pos + q_begin, nq, heads, G, kh_begin, kh_end, pairs);
      } else
#endif
      run_tiles<Lanes8>(table, lo, hi, first_pos + q_begin, nq, heads, G, kh_begin, kh_end, false);
      write_out(row, q_begin, nq, heads, kh_begin * G);
      return;
    }
#endif
    for (int64_t b = lo / BS; b * BS < hi; ++b) {
      const int64_t j0 = b * BS;
      for (int64_t kh = kh_begin; kh < kh_end; ++kh) {
        // One query vector per head (decode): the head-block computed next (this block's next
        // KV head, or the next block's first) is asked for by the first `accumulate` call on
        // this one, in two halves (see there). Several (a prefill tile): the same head's next
        // block, all at once, before this one is read (top of this file).
        Raw next;
        if (nq > 1) {
          if ((b + 1) * BS < hi) prefetch_head_block(raw(table[b + 1], kh));
        } else if (kh + 1 < kh_end) {
          next = raw(table[b], kh + 1);
        } else if ((b + 1) * BS < hi) {
          next = raw(table[b + 1], kh_begin);
        }
        const Raw* pending = next.k != nullptr ? &next : nullptr;
        const Raw here = raw(table[b], kh);
        const Block block = pairs ? Block{} : load_block(table[b], kh);
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t pos = first_pos + q_begin + i;
          const int64_t a = std::max(key_lo(pos), j0) - j0, e = std::min(pos + 1, j0 + BS) - j0;
          if (a >= e) continue;  // this block is outside query i's window or in its future
          const int64_t qv = i * heads + (kh - kh_begin) * G;
          for (int64_t h = 0; h < G; h += kHeadTile) {  // query heads of the group, up to 4 at once
            switch (std::min<int64_t>(kHeadTile, G - h)) {
              case 4: step<4>(pairs, qv + h, a, e, block, here, pending); break;
              case 3: step<3>(pairs, qv + h, a, e, block, here, pending); break;
              case 2: step<2>(pairs, qv + h, a, e, block, here, pending); break;
              default: step<1>(pairs, qv + h, a, e, block, here, pending); break;
            }
            pending = nullptr;
          }
        }
        if (pending != nullptr) prefetch_head_block(*pending);  // no query of this block saw a key
      }
    }
    write_out(row, q_begin, nq, heads, kh_begin * G);
  }

 private:
  // Each query vector's accumulator over its softmax sum, into the output from query head `h0`.
  void write_out(int64_t row, int64_t q_begin, int64_t nq, int64_t heads, int64_t h0) {
    const int64_t D = s_.head_dim;
    for (int64_t i = 0; i < nq; ++i) {
      q_t* dst = out_ + (query_start_loc_[row] + q_begin + i) * s_.out_stride + h0 * D;
      for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / sum_[i * heads + h];  // >= 1 key (the query's own) is always seen
        const float* a = acc_.data() + (i * heads + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[h * D + d] = from_float<q_t>(a[d] * inv);
      }
    }
  }

  // A block's keys and values as fp32 rows `stride` elements apart.
  struct Block {
    const float* k;
    const float* v;
    int64_t stride;
  };

  int64_t key_lo(int64_t pos) const { return s_.window > 0 ? std::max<int64_t>(0, pos - s_.window + 1) : 0; }

  // Where one block's keys and values of one KV head lie in the cache.
  struct Raw {
    const char* k = nullptr;
    const char* v = nullptr;
  };

  Raw raw(int64_t block, int64_t kv_head) const {
    const kv_t* k = cache_ + block * s_.block_stride + kv_head * s_.head_stride;
    return {reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(k + s_.kv_stride)};
  }

  // Asks for a head-block's keys or values (every line of its block_size rows): the blocks of a
  // row lie anywhere in the pool, so no hardware prefetcher can guess the next one.
  void prefetch_lines(const char* base) const {
    const int64_t row_bytes = s_.head_dim * static_cast<int64_t>(sizeof(kv_t));
    const int64_t stride = s_.token_stride * static_cast<int64_t>(sizeof(kv_t));
    for (int64_t j = 0; j < s_.block_size; ++j)
      for (int64_t at = 0; at < row_bytes; at += 64) prefetch_line(base + j * stride + at);
  }
  void prefetch_keys(const Raw& r) const { prefetch_lines(r.k); }
  void prefetch_values(const Raw& r) const { prefetch_lines(r.v); }
  void prefetch_head_block(const Raw& r) const {
    prefetch_keys(r);
    prefetch_values(r);
  }

  // An fp32 cache is read where it lies; other dtypes are converted once per block into an
  // L1-resident buffer that every query vector of the item then reuses (the values alone when
  // `keys` is false: the tiles' scores on pairs read the keys in place).
  Block load_block(int64_t block, int64_t kv_head, bool keys = true) {
    const int64_t D = s_.head_dim, BS = s_.block_size, tok = s_.token_stride;
    const kv_t* k = cache_ + block * s_.block_stride + kv_head * s_.head_stride;
    const kv_t* v = k + s_.kv_stride;
    if constexpr (std::is_same_v<kv_t, float>) {
      return {k, v, tok};
    } else {
      for (int64_t j = 0; j < BS; ++j) {
        if (keys) widen_row(k + j * tok, k_.data() + j * D, D);
        widen_row(v + j * tok, v_.data() + j * D, D);
      }
      return {k_.data(), v_.data(), D};
    }
  }

  // Whether decode takes `accumulate_pairs` (decode_pairs.h): bf16 queries over a bf16 cache on
  // a CPU with AVX512-BF16, head_dim in whole 32-element steps, 16-key blocks.
  bool pairs_usable() const {
#ifdef SPINDLE_DECODE_PAIRS
    if constexpr (kPairTypes<q_t, kv_t>) {
      return s_.head_dim % 32 == 0 && s_.block_size == kPairsBlock && !attention_pairs_disabled();
    }
#endif
    return false;
  }

  // One online softmax step of NH query vectors over keys [a, e) of a head-block: on bf16 pairs
  // read in place (`pairs`), else on the fp32 rows of `blk`.
  template <int NH>
  void step(bool pairs, int64_t qv0, int64_t a, int64_t e, const Block& blk, const Raw& here, const Raw* next) {
#ifdef SPINDLE_DECODE_PAIRS
    if constexpr (kPairTypes<q_t, kv_t>) {
      if (pairs) return accumulate_pairs<NH>(qv0, a, e, here, next);
    }
#endif
    accumulate<NH>(qv0, a, e, blk, next);
  }

#ifdef SPINDLE_DECODE_PAIRS
  // `accumulate` for bf16 queries (qb_, unscaled) over the bf16 head-block `here`, read where it
  // lies: scores and the weighted sum over values on vdpbf16ps pairs (decode_pairs.h). The same
  // prefetch of `next` as `accumulate`.
  template <int NH>
  void accumulate_pairs(int64_t qv0, int64_t a, int64_t e, const Raw& here, const Raw* next) {
    const int64_t D = s_.head_dim, BS = s_.block_size;
    const auto* k = reinterpret_cast<const c10::BFloat16*>(here.k);
    const auto* v = reinterpret_cast<const c10::BFloat16*>(here.v);
    float* s = scores_.data();  // [NH][BS]
    if (next != nullptr) prefetch_keys(*next);
    for (int h = 0; h < NH; ++h) score_pairs(qb_.data() + (qv0 + h) * D, k, s_.token_stride, D, a, e, s_.scale, s + h * BS);
    float alpha[NH];
    for (int h = 0; h < NH; ++h) alpha[h] = softmax_step(qv0 + h, s + h * BS, a, e);
    if (next != nullptr) prefetch_values(*next);
    weigh_values_pairs<NH>(acc_.data() + qv0 * D, D, alpha, s, BS, a, e, v, s_.token_stride);
  }
#endif

  // Online softmax step of the NH query vectors qv0.. (heads sharing one KV head) over keys
  // [a, e) of the loaded block. Each key row is loaded once for all NH heads, and the fixed-size
  // partial-sum arrays give the vectoriser NH x kLanes independent FMA chains (one chain per dot
  // product would wait on FMA latency at every step). `next` (or null): a head-block to ask for
  // meanwhile, its keys before the scores and its values before the weighted sum, half the lines
  // at a time (both halves at once, or the same head's next block, measured slower: see the top
  // of this file).
  template <int NH>
  void accumulate(int64_t qv0, int64_t a, int64_t e, const Block& blk, const Raw* next) {
    const int64_t D = s_.head_dim, BS = s_.block_size;
    const float* q = q_.data() + qv0 * D;
    float* s = scores_.data();  // [NH][BS]
    if (next != nullptr) prefetch_keys(*next);
    int64_t j = a;
#ifdef __AVX2__
    // 8 keys at a time: 8 dot products accumulate side by side and end in one transposing
    // reduction into a vector of 8 scores, instead of a horizontal sum each (which cost as many
    // instructions as the dot product's FMAs at head_dim 32-64).
    if (D % 8 == 0) {
      for (; j + 8 <= e; j += 8) {
        const float* k0 = blk.k + j * blk.stride;
        for (int h = 0; h < NH; ++h) {
          const float* qh = q + h * D;
          __m256 dot[8];
          for (auto& x : dot) x = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qh + d);
            for (int jj = 0; jj < 8; ++jj)
              dot[jj] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + jj * blk.stride + d), dot[jj]);
          }
          _mm256_storeu_ps(s + h * BS + j, sum_each(dot));
        }
      }
    }
#endif
    for (; j < e; ++j) {
      const float* kj = blk.k + j * blk.stride;
      float part[NH][kLanes] = {};
      int64_t d0 = 0;
      for (; d0 + kLanes <= D; d0 += kLanes) {
        for (int h = 0; h < NH; ++h) {
          const float* qh = q + h * D + d0;
          float* ph = part[h];
#pragma omp simd
          for (int t = 0; t < kLanes; ++t) ph[t] += qh[t] * kj[d0 + t];
        }
      }
      for (int h = 0; h < NH; ++h) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int t = 0; t < kLanes; ++t) dot += part[h][t];
        for (int64_t d = d0; d < D; ++d) dot += q[h * D + d] * kj[d];  // head_dim not a multiple of kLanes
        s[h * BS + j] = dot;
      }
    }
    float alpha[NH];
    for (int h = 0; h < NH; ++h) alpha[h] = softmax_step(qv0 + h, s + h * BS, a, e);
    float* acc = acc_.data() + qv0 * D;
    if (next != nullptr) prefetch_values(*next);
    int64_t d0 = 0;
#ifdef __AVX2__
    for (; d0 + 8 * kValueChunks <= D; d0 += 8 * kValueChunks)
      weigh_values<NH, kValueChunks>(acc, alpha, s, a, e, blk, d0);
    for (; d0 + 8 <= D; d0 += 8) weigh_values<NH, 1>(acc, alpha, s, a, e, blk, d0);
#endif
    for (; d0 + kLanes <= D; d0 += kLanes) {  // NH x kLanes accumulators stay in registers over the keys
      float x[NH][kLanes];
      for (int h = 0; h < NH; ++h) {
#pragma omp simd
        for (int t = 0; t < kLanes; ++t) x[h][t] = acc[h * D + d0 + t] * alpha[h];
      }
      for (int64_t j = a; j < e; ++j) {
        const float* vj = blk.v + j * blk.stride + d0;
        for (int h = 0; h < NH; ++h) {
          const float p = s[h * BS + j];
          float* xh = x[h];
#pragma omp simd
          for (int t = 0; t < kLanes; ++t) xh[t] += p * vj[t];
        }
      }
      for (int h = 0; h < NH; ++h) {
#pragma omp simd
        for (int t = 0; t < kLanes; ++t) acc[h * D + d0 + t] = x[h][t];
      }
    }
    for (int h = 0; h < NH; ++h) {
      for (int64_t d = d0; d < D; ++d) {
        float x = acc[h * D + d] * alpha[h];
        for (int64_t j = a; j < e; ++j) x += s[h * BS + j] * blk.v[j * blk.stride + d];
        acc[h * D + d] = x;
      }
    }
  }

#ifdef __AVX2__
  // acc[h][d0, d0 + 8C) <- acc * alpha[h] + sum over keys [a, e) of weight s[h][j] x value j, for
  // the NH heads: NH x C accumulators held in named registers over the keys. The portable loop
  // in `accumulate` left them on the stack in some of GCC's unrolled copies, a store-to-load
  // chain per key; it now runs only without AVX2.
  template <int NH, int C>
  void weigh_values(float* acc, const float* alpha, const float* s, int64_t a, int64_t e, const Block& blk,
                    int64_t d0) const {
    const int64_t D = s_.head_dim, BS = s_.block_size;
    __m256 x[NH][C];
    for (int h = 0; h < NH; ++h) {
      const __m256 scale = _mm256_set1_ps(alpha[h]);
      for (int c = 0; c < C; ++c) x[h][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + d0 + 8 * c), scale);
    }
    for (int64_t j = a; j < e; ++j) {
      const float* vj = blk.v + j * blk.stride + d0;
      __m256 v[C];
      for (int c = 0; c < C; ++c) v[c] = _mm256_loadu_ps(vj + 8 * c);
      for (int h = 0; h < NH; ++h) {
        const __m256 p = _mm256_broadcast_ss(s + h * BS + j);
        for (int c = 0; c < C; ++c) x[h][c] = _mm256_fmadd_ps(p, v[c], x[h][c]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + h * D + d0 + 8 * c, x[h][c]);
    }
  }
#endif

#ifdef SPINDLE_PREFILL_TILES
  // A prefill tile (several query tokens) as small GEMMs with the query vectors in the lanes:
  // the tile's query vectors of one KV head (tokens x its G query heads) are transposed once per
  // item into slabs of L::N (16 on AVX-512, 8 on AVX2), one per lane, so against a block's 16
  // keys each score, the online softmax's running max and sum, and each value dimension of the
  // accumulator are one register holding a slab: no horizontal sums, no per-query passes over a
  // key, each key element broadcast once for the whole slab. Why: `accumulate` takes one query
  // token at a time and reduces every dot product across lanes; on the chunks of a long prompt
  // it ran at 73-96 GFLOP/s, these at 130-165 (medium shapes, 2 threads, AVX-512; `python -m
  // benchmarks.attention_bench --prefill-contexts`). Lanes that do not see a key (causal or
  // sliding-window bound, or padding past the tile) take -inf scores and weigh 0; a key row no
  // lane sees is never read (it may not be written yet). The same online softmax and
  // exponential as `accumulate`: only the order of the sums differs. Results go to acc_ and sum_
  // as `accumulate`'s do. `pairs` (bf16 queries, unscaled, over a bf16 cache; 16 lanes): the
  // scores on vdpbf16ps pairs read from the cache in place (decode_pairs.h, score_tile_pairs).
  template <typename L>
  void run_tiles(const int64_t* table, int64_t lo, int64_t hi, int64_t pos0, int64_t nq, int64_t heads, int64_t G,
                 int64_t kh_begin, int64_t kh_end, bool pairs) {
    constexpr int64_t N = L::N;
    const int64_t D = s_.head_dim, n = nq * G, groups = (n + N - 1) / N;
    const int64_t num_kh = kh_end - kh_begin, slabs = num_kh * groups;  // a slab: N query vectors of one KV head
    qt_.assign(slabs * D * N, 0.0f);
    ot_.assign(slabs * D * N, 0.0f);
    mx_.assign(slabs * N, -INFINITY);
    sm_.assign(slabs * N, 0.0f);
    pos_.assign(groups * N, INT32_MIN);  // padding lanes see no key
    low_.assign(groups * N, INT32_MAX);
    for (int64_t t = 0; t < n; ++t) {  // lane t: token t / G, query head t % G of the KV head
      pos_[t] = static_cast<int32_t>(pos0 + t / G);
      low_[t] = static_cast<int32_t>(key_lo(pos0 + t / G));
    }
#ifdef SPINDLE_DECODE_PAIRS
    if (pairs) {  // per slab [D / 2][N]: lane t's dimensions 2 d2 and 2 d2 + 1 as one bf16 pair
      qtp_.assign(slabs * (D / 2) * N, 0u);
      for (int64_t kh = 0; kh < num_kh; ++kh)
        for (int64_t t = 0; t < n; ++t) {
          const float* q = q_.data() + ((t / G) * heads + kh * G + t % G) * D;
          uint32_t* dst = qtp_.data() + (kh * groups + t / N) * (D / 2) * N + t % N;
          for (int64_t d2 = 0; d2 < D / 2; ++d2)
            dst[d2 * N] = bf16_bits(q[2 * d2]) | static_cast<uint32_t>(bf16_bits(q[2 * d2 + 1])) << 16;
        }
    } else
#endif
    {
      for (int64_t kh = 0; kh < num_kh; ++kh)
        for (int64_t t = 0; t < n; ++t) {
          const float* q = q_.data() + ((t / G) * heads + kh * G + t % G) * D;
          float* dst = qt_.data() + (kh * groups + t / N) * D * N + t % N;
          for (int64_t d = 0; d < D; ++d) dst[d * N] = q[d];
        }
    }
    for (int64_t b = lo / kTileKeys; b * kTileKeys < hi; ++b) {
      for (int64_t kh = kh_begin; kh < kh_end; ++kh) {
        if ((b + 1) * kTileKeys < hi) prefetch_head_block(raw(table[b + 1], kh));
        const Block block = load_block(table[b], kh, !pairs);
        const Raw here = pairs ? raw(table[b], kh) : Raw{};
        for (int64_t g = 0; g < groups; ++g)
          tile_block<L>((kh - kh_begin) * groups + g, g, b * kTileKeys, block, here);
      }
    }
    for (int64_t kh = 0; kh < num_kh; ++kh)
      for (int64_t t = 0; t < n; ++t) {
        const int64_t qv = (t / G) * heads + kh * G + t % G, slab = kh * groups + t / N;
        const float* src = ot_.data() + slab * D * N + t % N;
        for (int64_t d = 0; d < D; ++d) acc_[qv * D + d] = src[d * N];
        sum_[qv] = sm_[slab * N + t % N];
      }
  }

  // One block's keys [j0, j0 + 16) against the query vectors of `slab` (lanes of group `g`);
  // `here` given (run_tiles' `pairs`): the scores from its bf16 keys on pairs.
  template <typename L>
  void tile_block(int64_t slab, int64_t g, int64_t j0, const Block& blk, const Raw& here) {
    constexpr int64_t N = L::N;
    using V = typename L::V;
    const int64_t D = s_.head_dim;
    typename L::M seen[kTileKeys];
    bool any = false;
    for (int64_t j = 0; j < kTileKeys; ++j) {
      seen[j] = L::sees(pos_.data() + g * N, low_.data() + g * N, static_cast<int32_t>(j0 + j));
      any = any || L::any(seen[j]);
    }
    if (!any) return;  // every query vector here is past this block's window or before its keys
    float* w = pt_;  // [16 keys][N lanes]: scores, then weights
    bool scored = false;
#ifdef SPINDLE_DECODE_PAIRS
    if constexpr (kPairTypes<q_t, kv_t> && N == kPairsBlock) {
      if (here.k != nullptr) {
        score_tile_pairs(qtp_.data() + slab * (D / 2) * N, reinterpret_cast<const c10::BFloat16*>(here.k),
                         s_.token_stride, D, s_.scale, w);
        scored = true;
      }
    }
#endif
    const float* qt = qt_.data() + slab * D * N;
    for (int64_t j = 0; j < kTileKeys && !scored; j += 8) {  // 8 keys at a time: 8 independent FMA chains over d
      const float* k[8];
      for (int jj = 0; jj < 8; ++jj) k[jj] = blk.k + (j + jj) * blk.stride;
      V acc[8];
      for (auto& x : acc) x = L::zero();
      for (int64_t d = 0; d < D; ++d) {
        const V q = L::load(qt + d * N);
        for (int jj = 0; jj < 8; ++jj) acc[jj] = L::fmadd(L::set1(k[jj][d]), q, acc[jj]);
      }
      for (int jj = 0; jj < 8; ++jj) L::store(w + (j + jj) * N, acc[jj]);
    }
    const V ninf = L::set1(-INFINITY);
    V block_max = ninf;
    for (int64_t j = 0; j < kTileKeys; ++j) block_max = L::max(block_max, L::select(seen[j], L::load(w + j * N), ninf));
    float* mx = mx_.data() + slab * N;
    float* sm = sm_.data() + slab * N;
    const V old_max = L::load(mx), new_max = L::max(old_max, block_max);
    // A lane that has seen no key yet keeps max -inf: its factor is 1 (nothing to rescale), not exp(NaN).
    const V alpha = L::select(L::not_equal(new_max, ninf), L::exp(L::sub(old_max, new_max)), L::set1(1.0f));
    V sum = L::mul(L::load(sm), alpha);
    for (int64_t j = 0; j < kTileKeys; ++j) {
      const V p = L::keep(seen[j], L::exp(L::sub(L::load(w + j * N), new_max)));
      L::store(w + j * N, p);
      sum = L::add(sum, p);
    }
    L::store(mx, new_max);
    L::store(sm, sum);
    float* ot = ot_.data() + slab * D * N;
    for (int64_t d0 = 0; d0 < D; d0 += 8) {  // 8 value dimensions x N lanes in registers over the keys
      V acc[8];
      for (int dd = 0; dd < 8; ++dd) acc[dd] = L::mul(L::load(ot + (d0 + dd) * N), alpha);
      for (int64_t j = 0; j < kTileKeys; ++j) {
        if (!L::any(seen[j])) continue;  // no lane sees this key: its value row may not be written
        const V p = L::load(w + j * N);
        const float* v = blk.v + j * blk.stride + d0;
        for (int dd = 0; dd < 8; ++dd) acc[dd] = L::fmadd(L::set1(v[dd]), p, acc[dd]);
      }
      for (int dd = 0; dd < 8; ++dd) L::store(ot + (d0 + dd) * N, acc[dd]);
    }
  }

  static constexpr int64_t kTileKeys = 16;      // keys per block on this path (block_size 16)
  // Fewer query vectors, or one query token (decode, however many heads share a KV head: its
  // walk over head-blocks is tuned for memory), take `accumulate`.
  static constexpr int64_t kMinTileVectors = 8;
  std::vector<float> qt_, ot_, mx_, sm_;  // per slab: queries and accumulator [D][N], max and sum [N]
  std::vector<uint32_t> qtp_;              // per slab, `pairs`: the queries as bf16 pairs [D / 2][N]
  std::vector<int32_t> pos_, low_;        // per lane: its position and its first visible key
  alignas(64) float pt_[kTileKeys * 16];  // a block's scores, then weights: [16 keys][N <= 16 lanes]
#endif

  // Turns scores s[a, e) of query vector `qv` into weights against its new running max, adds
  // them to its running sum, and returns the factor that rescales its accumulator.
  float softmax_step(int64_t qv, float* s, int64_t a, int64_t e) {
    if (s_.softcap > 0.0f) {
      for (int64_t j = a; j < e; ++j) s[j] = s_.softcap * std::tanh(s[j] / s_.softcap);
    }
    const float block_max = max_of(s, a, e);
    const float new_max = std::max(max_[qv], block_max);
    const float alpha = exp_nonpositive(max_[qv] - new_max);
    const float block_sum = exp_shifted_sum(s, a, e, new_max);
    max_[qv] = new_max;
    sum_[qv] = sum_[qv] * alpha + block_sum;
    return alpha;
  }

  static constexpr int kHeadTile = 4;  // query heads per pass over a block (GQA group tile)
  static constexpr int kLanes = 16;    // fp32 lanes per partial sum: two AVX2 or one AVX-512 register
  // 8-float registers of each head's accumulator per pass over a block's values: with 4 heads,
  // 16 accumulators + 4 values + 1 weight fit AVX-512's 32 vector registers, 8 + 2 + 1 AVX2's 16.
#ifdef __AVX512VL__
  static constexpr int kValueChunks = 4;
#else
  static constexpr int kValueChunks = 2;
#endif

  const Shape& s_;
  const Rope& rope_;
  const q_t* query_;
  q_t* out_;
  const kv_t* cache_;
  const int64_t* block_tables_;
  const int64_t* seq_lens_;
  const int64_t* query_start_loc_;
  std::vector<float> q_, acc_, max_, sum_, k_, v_, scores_;
  std::vector<c10::BFloat16> qb_;  // decode on bf16 pairs: the queries, unscaled
};

// Stores this pass's keys (rotated first where `rope` says) and values at their slots,
// converting to the cache's dtype.
template <typename q_t, typename kv_t>
void write_kv(const Shape& s, const at::Tensor& key, const at::Tensor& value, kv_t* cache, const int64_t* slots,
              const Rope& rope) {
  const int64_t T = key.size(0), D = key.size(2), tok = key.size(1) * D;
  const q_t* k = key.data_ptr<q_t>();
  const q_t* v = value.data_ptr<q_t>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  spindle::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(tok);
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding token: nothing to store
      kv_t* slot = cache + slots[t] / s.block_size * s.block_stride + slots[t] % s.block_size * s.token_stride;
      const q_t* src = k + t * ks;
      const float* rotated_src = nullptr;  // the rotated key (exact in fp32: bf16 keys round inside rope_row)
      if constexpr (kRotates<q_t>) {
        if (rope.cos != nullptr) {
          for (int64_t e = 0; e < tok; e += D)
            rope_row(src + e, rope.cos_row(t), rope.sin_row(t), rotated.data() + e, rope.rotary_dim, D, 1.0f);
          rotated_src = rotated.data();
        }
      }
      for (int64_t h = 0; h < key.size(1); ++h) {  // a head-major cache keeps a token's heads apart
        kv_t* dk = slot + h * s.head_stride;
        kv_t* dv = dk + s.kv_stride;
        if (rotated_src != nullptr) {
          for (int64_t e = 0; e < D; ++e) dk[e] = from_float<kv_t>(rotated_src[h * D + e]);
        } else {
          for (int64_t e = 0; e < D; ++e) dk[e] = from_float<kv_t>(to_float(src[h * D + e]));
        }
        for (int64_t e = 0; e < D; ++e) dv[e] = from_float<kv_t>(to_float(v[t * vs + h * D + e]));
      }
    }
  });
}

// Work items per thread from which an item covers all KV heads: the items are ordered largest
// first, so with several per thread the last ones (the smallest) even out the threads' finish.
constexpr int64_t kItemsPerThread = 4;

template <typename q_t, typename kv_t>
void run_typed(const Shape& s, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
               const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& work_items,
               const Rope& rope, at::Tensor& out) {
  kv_t* cache = kv_cache.data_ptr<kv_t>();
  if (slot_mapping.numel() > 0) {
    write_kv<q_t, kv_t>(s, key, value, cache, slot_mapping.data_ptr<int64_t>(), rope);
  }
  // With items enough to keep every thread busy, each takes all KV heads (whole blocks, read in
  // order); with few (one long row), each KV head is its own piece of work so threads share it.
  const int64_t num_items = work_items.size(0), threads = at::get_num_threads();
  const int64_t splits = num_items >= kItemsPerThread * threads ? 1 : s.num_kv_heads;
  const int64_t heads_per_split = s.num_kv_heads / splits, total = num_items * splits;
  const int64_t* items = work_items.data_ptr<int64_t>();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, total));
  spindle::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    ItemKernel<q_t, kv_t> kernel(s, rope, query.data_ptr<q_t>(), out.data_ptr<q_t>(), cache,
                                 block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                                 query_start_loc.data_ptr<int64_t>());
    for (int64_t w = next.fetch_add(1); w < total; w = next.fetch_add(1)) {
      const int64_t* item = items + (w / splits) * 3;
      const int64_t kh = (w % splits) * heads_per_split;
      kernel.run(item[0], item[1], item[2], kh, kh + heads_per_split);
    }
  });
}

template <typename q_t>
void dispatch_cache(const Shape& s, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& work_items,
                    const Rope& rope, at::Tensor& out) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      return run_typed<q_t, float>(s, query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                   query_start_loc, work_items, rope, out);
    case at::kBFloat16:
      return run_typed<q_t, c10::BFloat16>(s, query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                           query_start_loc, work_items, rope, out);
    case at::kHalf:
      return run_typed<q_t, c10::Half>(s, query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                       query_start_loc, work_items, rope, out);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported KV cache dtype ", kv_cache.scalar_type());
  }
}

// Tokens along dim 0, heads x head_dim packed behind it (a view of a fused qkv output is fine).
at::Tensor packed_rows(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3, "paged_attention: expected [tokens, heads, head_dim]");
  return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

// The fused rotation's inputs, checked; all three absent: no rotation.
Rope rope_args(const c10::optional<at::Tensor>& positions, const c10::optional<at::Tensor>& cos,
               const c10::optional<at::Tensor>& sin, const at::Tensor& query, const at::Tensor& key) {
  const bool given = positions.has_value() && positions->defined();
  TORCH_CHECK(given == (cos.has_value() && cos->defined()) && given == (sin.has_value() && sin->defined()),
              "paged_attention: positions, cos and sin come together");
  if (!given) return {};
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_attention: rotary embedding needs float32 or bfloat16 queries");
  TORCH_CHECK(positions->scalar_type() == at::kLong && positions->is_contiguous() && positions->dim() == 1 &&
                  positions->size(0) == query.size(0),
              "paged_attention: positions must be contiguous int64 [num_tokens]");
  TORCH_CHECK(cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat && cos->is_contiguous() &&
                  sin->is_contiguous() && cos->dim() == 2 && cos->sizes() == sin->sizes(),
              "paged_attention: cos and sin must be contiguous float32 [max_positions, rotary_dim]");
  const int64_t rotary_dim = cos->size(1), rows = cos->size(0);
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= key.size(2), "paged_attention: rotary_dim must be even, <= head_dim");
  const int64_t* pos = positions->data_ptr<int64_t>();
  for (int64_t t = 0; t < positions->size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < rows, "paged_attention: position ", pos[t], " outside the rotary table");
  }
  return {pos, cos->data_ptr<float>(), sin->data_ptr<float>(), rotary_dim};
}

}  // namespace

// Writes key/value at slot_mapping (skipped when it is empty; keys rotated first when positions,
// cos and sin are given, as are the queries), then attends every query token
// of every row to the keys its row's block table holds up to its own position. work_items
// [n, 3] int64: (row, first query offset, end query offset), processed largest first.
at::Tensor paged_attention(const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                           at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           const at::Tensor& work_items, double scale, int64_t window, double softcap,
                           const c10::optional<at::Tensor>& positions, const c10::optional<at::Tensor>& cos,
                           const c10::optional<at::Tensor>& sin) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.stride(4) == 1,
              "paged_attention: kv_cache must be a CPU tensor [2, blocks, block_size, kv_heads, dim] with each "
              "head's dim contiguous");
  for (const at::Tensor* t : {&slot_mapping, &block_tables, &seq_lens, &query_start_loc, &work_items}) {
    TORCH_CHECK(t->scalar_type() == at::kLong, "paged_attention: index tensors must be int64");
  }
  TORCH_CHECK(seq_lens.is_contiguous() && query_start_loc.is_contiguous() && work_items.is_contiguous() &&
                  slot_mapping.is_contiguous() && block_tables.stride(-1) == 1,
              "paged_attention: index tensors must be contiguous");
  const at::Tensor query = packed_rows(query_in), key = packed_rows(key_in), value = packed_rows(value_in);
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "paged_attention: query, key and value must share a dtype");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4) &&
                  query.size(2) == kv_cache.size(4) && query.size(1) % kv_cache.size(3) == 0,
              "paged_attention: head shapes do not match the cache");
  const Rope rope = rope_args(positions, cos, sin, query, key);
  at::Tensor out = at::empty(query.sizes(), query.options());
  const Shape s{query.size(1),      kv_cache.size(3),       kv_cache.size(4),
                kv_cache.size(2),   query.stride(0),        out.stride(0),
                block_tables.stride(0), static_cast<float>(scale), static_cast<float>(softcap),
                window,             kv_cache.stride(0),     kv_cache.stride(1),
                kv_cache.stride(2), kv_cache.stride(3)};
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(s, query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                            work_items, rope, out);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(s, query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                    query_start_loc, work_items, rope, out);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(s, query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                query_start_loc, work_items, rope, out);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: unsupported query dtype ", query.scalar_type());
  }
  return out;
}

}  // namespace spindle

TORCH_LIBRARY(spindle, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor work_items, float scale, "
      "int window, float softcap, Tensor? positions=None, Tensor? cos=None, Tensor? sin=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) { m.impl("paged_attention", &spindle::paged_attention); }
