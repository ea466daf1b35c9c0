// Paged decode attention kernels, shared by ops.cpp (the paged_decode_attention op) and
// decode_stack.cpp (the DecodeStack, which runs the same work items inside its own parallel region):
// one query per sequence over its cached tokens, read in place through int32 block tables;
// the G = H / KVH query heads of one KV head are processed together, so each K/V row is
// loaded once; online softmax in fp32. Also the dtype helpers the other ops.cpp kernels use.
// Its definitions sit in an anonymous namespace: each extension that includes it compiles
// its own copy, and the two libraries share no symbols.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "avx2_vec.h"  // load8f, hmax8, hsum8

namespace {

// Reads one 8-byte word of every 64-byte line of [p, p + n) (n a multiple of 8, so every
// word lies inside) and discards them. Cold data that a loop consumes load by load, each
// load among arithmetic that depends on it, arrives with few misses in flight; software
// prefetches there measured no better. Pulling a few hundred KB into the caches first with
// this tight loop of independent loads keeps many in flight (decode attention's K/V rows,
// the decode-once matmul's weight tiles).
inline void read_lines(const char* p, int64_t n) {
  uint64_t acc = 0;
  for (int64_t x = 0; x < n; x += 64) {
    uint64_t a;
    std::memcpy(&a, p + x, sizeof(a));
    acc |= a;
  }
  asm volatile("" : : "r"(acc));  // the loads must happen
}

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }
template <> inline float to_f<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }

// Round through T (identity for float): mimics a PyTorch op that produces a T tensor.
template <typename T> inline float round_to(float x) { return to_f<T>(from_f<T>(x)); }
template <> inline float round_to<float>(float x) { return x; }

// Query heads per KV head, and head dim: DeepSeek-V3's latent rows (one KV head of 512 + 64
// dims for 128 query heads) are the largest, Gemma 4's 512-dim global heads next.
constexpr int kMaxG = 128;
constexpr int kMaxD = 576;
constexpr int kTile = 32;     // keys scored at a time
// K + V bytes an item reads ahead of scoring them (see DecodeAttention::touch_rows): a few
// hundred KB, well inside a core's L2.
constexpr int64_t kTouchBytes = 256 << 10;

constexpr float kLog2e = 1.44269504088896341f;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// 2^t in 8 lanes for t <= 0 (t below -126 gives 2^-126, not 0: callers zero masked lanes):
// t = n + f, |f| <= 1/2, 2^f by exp2_512<5>'s polynomial (relative error 7.7e-8), 2^n built
// in the exponent field (AVX2 has no scalef).
inline __m256 exp2_256(__m256 t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(0.001326697994954884f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.009675469249486923f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.05550742521882057f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022121727466583f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931469440460205f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000001192092896f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
constexpr float kNegBig = -1e30f;  // not -inf: -ffast-math assumes finite values

// What a layer's attention asks beyond causal softmax(q.k * scale).v, shared by the decode
// and prompt kernels:
//   window > 0: a query at position p sees keys (p - window, p] (sliding window);
//   chunk > 0: it sees keys of its own chunk only, k / chunk == p / chunk (Llama 4);
//   softcap > 0: the scaled scores become softcap * tanh(s / softcap) (Gemma 2);
//   sinks (one fp32 logit per query head, or null): a logit that joins every query's softmax
//   denominator without a value, exp(s_i) / (sum_j exp(s_j) + exp(sink)) (gpt-oss).
struct AttnOptions {
  int window = 0;
  int chunk = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;
  // The first key a query at position p sees.
  int first_key(int p) const {
    int lo = 0;
    if (window > 0) lo = std::max(lo, p - window + 1);
    if (chunk > 0) lo = std::max(lo, p / chunk * chunk);
    return lo;
  }
};

// s[0..n) = cap * tanh(s / cap), in place (defined below, after the exp2 helpers).
inline void softcap_scores(float* s, int n, float cap);

// A softmax sum l over scores whose running max is m, plus a sink's exp(sink - m) (its
// exponent clamped, so that a sink far above every score gives a finite sum, and weights
// near 0, not NaN).
inline float with_sink(float l, float m, float sink) {
  return l + std::exp(std::min(sink - m, 80.f));
}

// One tile of an online softmax: scores s[0..n) become exp(s - new max) in place, the running
// max m and sum l are updated; returns the factor the accumulator must be rescaled by.
inline float online_softmax_tile(float* s, int n, float& m, float& l) {
  float mt = m;
  for (int j = 0; j < n; ++j) mt = std::max(mt, s[j]);
  const float alpha = std::exp(m - mt);
  float sum = 0.f;
  for (int j = 0; j < n; ++j) {
    const float p = std::exp(s[j] - mt);
    s[j] = p;
    sum += p;
  }
  l = l * alpha + sum;
  m = mt;
  return alpha;
}

// A K/V cache [NB, BS, KVH, D] whose block's rows are contiguous (strides KVH * D, D, 1)
// and whose blocks lie any stride >= BS * KVH * D apart: a pool's own region, or a view of
// pages that hold other layers too (a pool in block groups). K and V share the strides.
inline void check_paged_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* name) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1 &&
                  k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3) &&
                  k_cache.stride(0) >= k_cache.size(1) * k_cache.stride(1),
              name, ": caches must be [NB,BS,KVH,D] with contiguous blocks, K and V alike");
}

// Element offset of a cache slot (block * BS + row) in a cache checked by check_paged_caches.
inline int64_t slot_offset(const at::Tensor& cache, int64_t slot) {
  const int64_t bs = cache.size(1);
  return slot / bs * cache.stride(0) + slot % bs * cache.stride(1);
}

// A K/V cache pair [NB, BS, KVH, D] read in place through int32 block tables [B, MB]: token
// t of sequence b is row t % BS of block tables[b][t / BS] (the same element offset in K and V;
// check_paged_caches' layout). An int8 cache (T = int8_t) also has fp32 scales [NB, BS, KVH],
// one per token and KV head, rows contiguous in a block (servelm.models.kv_quant): element x
// of a row stands for x * scale.
template <typename T>
struct PagedKV {
  const T* k;
  const T* v;
  const int32_t* tables;
  int num_blocks, bs, kv_heads, MB;
  int64_t blk_stride, tok_stride;
  const float* ks = nullptr;  // scales of a quantised cache, else null
  const float* vs = nullptr;
  int64_t scale_blk_stride = 0;  // the scales' block stride
  int head_dim = 1;
  PagedKV(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables)
      : k(k_cache.data_ptr<T>()), v(v_cache.data_ptr<T>()), tables(block_tables.data_ptr<int32_t>()),
        num_blocks(k_cache.size(0)), bs(k_cache.size(1)), kv_heads(k_cache.size(2)),
        MB(block_tables.size(1)), blk_stride(k_cache.stride(0)), tok_stride(k_cache.stride(1)),
        head_dim(k_cache.size(3)) {}
  PagedKV(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
          const at::Tensor& k_scale, const at::Tensor& v_scale)
      : PagedKV(k_cache, v_cache, block_tables) {
    ks = k_scale.data_ptr<float>();
    vs = v_scale.data_ptr<float>();
    scale_blk_stride = k_scale.stride(0);
  }
  // The scale index of the row at element offset off, head 0.
  int64_t scale_index(int64_t off) const {
    const int64_t blk = off / blk_stride;
    return blk * scale_blk_stride + (off - blk * blk_stride) / head_dim;
  }
  const int32_t* table(int b) const { return tables + static_cast<int64_t>(b) * MB; }
  // Element offset of token t's row (all KV heads) in either cache.
  int64_t offset(const int32_t* table, int t) const {
    return static_cast<int64_t>(table[t / bs]) * blk_stride + static_cast<int64_t>(t % bs) * tok_stride;
  }
  // f(off, n) for each run of tokens [t0, t1) that lies in one block, in order: n rows,
  // contiguous from element offset off (one division per block, not per token).
  template <typename F>
  void for_runs(const int32_t* table, int t0, int t1, F&& f) const {
    for (int t = t0; t < t1;) {
      const int n = std::min(t1 - t, bs - t % bs);
      f(offset(table, t), n);
      t += n;
    }
  }
};

// Attend G pre-scaled fp32 queries to one tile of n <= kTile tokens of one sequence's KV
// head: token j's rows are kc + roff[j] and vc + roff[j] (kc, vc: the caches offset to the head).
// acc [G*D] (unnormalised), m [G] (running max), l [G] (running sum) are updated. A quantised
// cache gives each token's K and V scales (ksc[j], vsc[j]): applied to the score and to p.
template <typename T, int DT>
void attend_tile(const float* qf, int G, int d_rt, const T* kc, const T* vc, const int64_t* roff,
                 int n, float* acc, float* m, float* l, const float* ksc = nullptr,
                 const float* vsc = nullptr, float cap = 0.f) {
  const int D = DT ? DT : d_rt;
  alignas(64) float kf[kMaxD];
  alignas(64) float s[kMaxG][kTile];
  const T* krow[kTile];
  const T* vrow[kTile];
  for (int j = 0; j < n; ++j) {
    krow[j] = kc + roff[j];
    vrow[j] = vc + roff[j];
  }
  for (int j = 0; j < n; ++j) {
    const T* kr = krow[j];
    for (int d = 0; d < D; ++d) kf[d] = to_f<T>(kr[d]);
    for (int g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot += qg[d] * kf[d];
      s[g][j] = ksc ? dot * ksc[j] : dot;
    }
  }
  for (int g = 0; g < G; ++g) {
    if (cap > 0.f) softcap_scores(s[g], n, cap);
    const float alpha = online_softmax_tile(s[g], n, m[g], l[g]);
    if (alpha != 1.f) {
      float* ag = acc + g * D;
      for (int d = 0; d < D; ++d) ag[d] *= alpha;
    }
  }
  for (int j = 0; j < n; ++j) {
    const T* vr = vrow[j];
    for (int d = 0; d < D; ++d) kf[d] = to_f<T>(vr[d]);
    for (int g = 0; g < G; ++g) {
      const float p = vsc ? s[g][j] * vsc[j] : s[g][j];
      float* ag = acc + g * D;
      for (int d = 0; d < D; ++d) ag[d] += p * kf[d];
    }
  }
}

#ifdef __AVX512F__
template <typename T> inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <> inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 2^t (very negative t -> 0, t beyond 128 -> inf): t = n + f, |f| <= 1/2, 2^f by a polynomial fitted
// for relative error (degree 3: 7.5e-5, below a bf16 rounding; degree 4: 2.7e-6, enough for
// bf16 probabilities; degree 5: 7.7e-8).
template <int kDeg>
inline __m512 exp2_512(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p;
  if constexpr (kDeg == 3) {
    p = _mm512_set1_ps(0.05517134442925453f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24261033535003662f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6932609677314758f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999281167984009f));
  } else if constexpr (kDeg == 4) {
    p = _mm512_set1_ps(0.009560519829392433f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05591712146997452f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024981260299683f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219696998596f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991655349731f));
  } else {
    p = _mm512_set1_ps(0.001326697994954884f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009675469249486923f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550742521882057f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022121727466583f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931469440460205f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  }
  return _mm512_scalef_ps(p, n);
}

// In-register transpose of 16 rows of 16 dwords (r[i] lane j -> r[j] lane i).
inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4g + e], 128-bit lane L: rows 4g..4g+3 of column 4L + e. Gather the lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Horizontal sums of 16 vectors at once: lane j of the result = sum of p[j]'s 16 lanes
// (a transpose-and-add tree: ~3 instructions per vector instead of ~10 for one reduction).
inline __m512 hsum16(const __m512* p) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                         _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// P.V for NG heads of one KV head over n keys of a tile, dims [c0, c0 + D) of rows S wide:
// acc (NG rows of stride S from the slice's first dim, fp32) = alpha * acc +
// sum_j p[g][j] * V[j]. Each V row is converted to fp32 once, in registers, and used by every
// head; the accumulators stay in registers over the tile (the same multiply-adds, in the same
// order, as accumulating in memory).
template <typename T, int D, int NG, int S = D>
inline void pv_heads(const T* const* vrow, int c0, int n, const float (*p)[kTile], const float* alpha,
                     float* acc) {
  constexpr int NV = D / 16;
  __m512 a[NG][NV];
  for (int g = 0; g < NG; ++g) {
    const __m512 al = _mm512_set1_ps(alpha[g]);
    for (int v = 0; v < NV; ++v) {
      a[g][v] = _mm512_load_ps(acc + g * S + v * 16);
      if (alpha[g] != 1.f) a[g][v] = _mm512_mul_ps(al, a[g][v]);
    }
  }
  for (int j = 0; j < n; ++j) {
    __m512 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load16<T>(vrow[j] + c0 + v * 16);
    for (int g = 0; g < NG; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g][j]);
      for (int v = 0; v < NV; ++v) a[g][v] = _mm512_fmadd_ps(pj, x[v], a[g][v]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(acc + g * S + v * 16, a[g][v]);
}

// AVX-512 version of attend_tile for D a multiple of 16 (known at compile time), a tile of
// up to kTile keys: scores for the G heads (bf16: pairwise dot products of the raw
// q and K rows; else fp32 from K converted once), a vectorised online softmax per head, then
// P.V with V converted once per key for up to 4 heads whose accumulators stay in registers.
template <typename T, int D>
void attend_tile_avx512(const float* qf, const T* qraw, int64_t q_stride, float scale, int G,
                        const T* kc, const T* vc, const int64_t* roff, int n, float* acc, float* m,
                        float* l, float cap = 0.f) {
  static_assert(kTile == 32, "the softmax below handles a tile as two 16-lane vectors");
  constexpr int NV = D / 16;
  // P.V runs in slices of DB dims (wide heads: a slice's accumulators fit the registers).
  constexpr int DB = D <= 256 ? D : D % 128 == 0 ? 128 : 64;
  static_assert(D % DB == 0, "P.V slices divide the head");
  constexpr int kChunkG = DB / 16 >= 16 ? 1 : std::min(4, 16 / (DB / 16));  // heads per register block
#if defined(__AVX512BF16__)
  constexpr bool kDp = std::is_same<T, c10::BFloat16>::value && D % 32 == 0;
#else
  constexpr bool kDp = false;
#endif
  alignas(64) float kf[kDp ? 1 : kTile][D];
  alignas(64) float s[kMaxG][kTile];
  alignas(64) float alpha[kMaxG];
  const __m512 neg = _mm512_set1_ps(kNegBig), log2e = _mm512_set1_ps(kLog2e);
  const T* vrow[kTile];
  const T* krow[kTile];
  for (int j = 0; j < n; ++j) {
    krow[j] = kc + roff[j];
    vrow[j] = vc + roff[j];
  }
  if constexpr (!kDp) {
    for (int j = 0; j < n; ++j)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(&kf[j][v * 16], load16<T>(krow[j] + v * 16));
  }
  for (int g = 0; g < G; ++g) {
#if defined(__AVX512BF16__)
    if constexpr (kDp) {
      // bf16 K and q: pairwise bf16 dot products into fp32 (products exact), scaled after.
      constexpr int NB = D / 32;
      __m512bh qb[NB];
      for (int v = 0; v < NB; ++v)
        qb[v] = (__m512bh)_mm512_loadu_si512(qraw + g * q_stride + v * 32);
      const __m512 sv = _mm512_set1_ps(scale);
      for (int j0 = 0; j0 < n; j0 += 16) {
        __m512 part[16];
        for (int jj = 0; jj < 16; ++jj) {
          const int j = j0 + jj;
          __m512 a = _mm512_setzero_ps();
          if (j < n)
            for (int v = 0; v < NB; ++v)
              a = _mm512_dpbf16_ps(a, qb[v], (__m512bh)_mm512_loadu_si512(krow[j] + v * 32));
          part[jj] = a;
        }
        _mm512_store_ps(&s[g][j0], _mm512_mul_ps(sv, hsum16(part)));
      }
    }
#endif
    if constexpr (!kDp) {
      __m512 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_ps(qf + g * D + v * 16);
      for (int j0 = 0; j0 < n; j0 += 16) {
        __m512 part[16];
        for (int jj = 0; jj < 16; ++jj) {
          const int j = j0 + jj;
          if (j < n) {
            __m512 a = _mm512_mul_ps(qv[0], _mm512_load_ps(&kf[j][0]));
            for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(qv[v], _mm512_load_ps(&kf[j][v * 16]), a);
            part[jj] = a;
          } else {
            part[jj] = _mm512_setzero_ps();
          }
        }
        _mm512_store_ps(&s[g][j0], hsum16(part));
      }
    }
    if (cap > 0.f) softcap_scores(s[g], n, cap);
    // Online softmax over the tile's n scores (two 16-lane vectors; lanes >= n are masked).
    const __mmask16 k0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __mmask16 k1 = n <= 16 ? 0 : n >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << (n - 16)) - 1);
    const __m512 x0 = _mm512_mask_mov_ps(neg, k0, _mm512_load_ps(&s[g][0]));
    const __m512 x1 = _mm512_mask_mov_ps(neg, k1, _mm512_load_ps(&s[g][16]));
    const float mt = std::max(m[g], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
    const __m512 mv = _mm512_set1_ps(mt);
    const __m512 p0 = _mm512_maskz_mov_ps(k0, exp2_512<5>(_mm512_mul_ps(_mm512_sub_ps(x0, mv), log2e)));
    const __m512 p1 = _mm512_maskz_mov_ps(k1, exp2_512<5>(_mm512_mul_ps(_mm512_sub_ps(x1, mv), log2e)));
    _mm512_store_ps(&s[g][0], p0);
    _mm512_store_ps(&s[g][16], p1);
    alpha[g] = std::exp(m[g] - mt);
    l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    m[g] = mt;
  }
  for (int c0 = 0; c0 < D; c0 += DB) {
    for (int g0 = 0; g0 < G; g0 += kChunkG) {
      float* a = acc + g0 * D + c0;
      switch (std::min(kChunkG, G - g0)) {
        case 1: pv_heads<T, DB, 1, D>(vrow, c0, n, s + g0, alpha + g0, a); break;
        case 2: pv_heads<T, DB, std::min(2, kChunkG), D>(vrow, c0, n, s + g0, alpha + g0, a); break;
        case 3: pv_heads<T, DB, std::min(3, kChunkG), D>(vrow, c0, n, s + g0, alpha + g0, a); break;
        default: pv_heads<T, DB, kChunkG, D>(vrow, c0, n, s + g0, alpha + g0, a); break;
      }
    }
  }
}
#endif

// cap * tanh(x / cap) in every lane: tanh(y) = 1 - 2 / (1 + e^(2y)), e^(2y) = 2^(2y log2 e)
// with the exponent clamped to +-60, where tanh is +-1 in fp32.
#ifdef __AVX512F__
inline __m512 softcap512(__m512 x, float cap) {
  const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(2.f * kLog2e / cap)),
                                               _mm512_set1_ps(-60.f)), _mm512_set1_ps(60.f));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(one, exp2_512<5>(t))));
  return _mm512_mul_ps(_mm512_set1_ps(cap), th);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 softcap256(__m256 x, float cap) {
  const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(2.f * kLog2e / cap)),
                                               _mm256_set1_ps(-60.f)), _mm256_set1_ps(60.f));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(one, exp2_256(t))));
  return _mm256_mul_ps(_mm256_set1_ps(cap), th);
}
#endif

inline void softcap_scores(float* s, int n, float cap) {
#ifdef __AVX512F__
  for (int j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(s + j, live, softcap512(_mm512_maskz_loadu_ps(live, s + j), cap));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  alignas(32) float tail[8] = {};
  for (int j = 0; j < n; j += 8) {
    const int k = std::min(8, n - j);
    if (k == 8) {
      _mm256_storeu_ps(s + j, softcap256(_mm256_loadu_ps(s + j), cap));
    } else {  // the same lanes' arithmetic for a short tail
      std::memcpy(tail, s + j, sizeof(float) * k);
      _mm256_store_ps(tail, softcap256(_mm256_load_ps(tail), cap));
      std::memcpy(s + j, tail, sizeof(float) * k);
    }
  }
#else
  for (int j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] / cap);
#endif
}

// Element d of a head in the AVX2 bf16 path's even/odd order (bf16_pair, below): each
// 16-element chunk's 8 even elements, then its 8 odd ones. Plain index arithmetic, declared
// for every ISA because DecodeAttention::slot names it under `if constexpr`.
inline int eo_index(int d) { return (d & ~15) + ((d & 1) << 3) + ((d & 15) >> 1); }

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// Lane j of the result = the sum of p[j]'s 8 lanes.
inline __m256 hsum8x8(const __m256* p) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// P.V for NG heads over 32 dims [c, c + 32) of n keys: acc (already rescaled by alpha) +=
// p[g][j] * V[j] (times the key's V scale for an int8 cache); each V slice converted once, in
// registers, for the NG heads.
template <typename C, int NG>
inline void pv_heads_avx2(const C* const* vrow, int n, const float (*p)[kTile], const float* vsc,
                          int c, int D, float* acc) {
  __m256 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < 4; ++v) a[g][v] = _mm256_loadu_ps(acc + g * D + c + 8 * v);
  for (int j = 0; j < n; ++j) {
    __m256 x[4];
    for (int v = 0; v < 4; ++v) x[v] = load8f<C>(vrow[j] + c + 8 * v);
    const float vs = vsc ? vsc[j] : 1.f;
    for (int g = 0; g < NG; ++g) {
      const __m256 pj = _mm256_set1_ps(p[g][j] * vs);
      for (int v = 0; v < 4; ++v) a[g][v] = _mm256_fmadd_ps(pj, x[v], a[g][v]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + g * D + c + 8 * v, a[g][v]);
}

// Online softmax over one head's n <= kTile scores s (lanes >= n masked): s becomes the
// probabilities, the running max m and sum l are updated and the head's D accumulators
// rescaled.
inline void softmax_tile_avx2(float* s, int n, float& m, float& l, float* acc, int D) {
  const __m256 neg = _mm256_set1_ps(kNegBig), log2e = _mm256_set1_ps(kLog2e);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int nv = (n + 7) / 8;
  __m256 xs[kTile / 8], mx = neg;
  for (int v = 0; v < nv; ++v) {
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * v), lanes));
    xs[v] = _mm256_blendv_ps(neg, _mm256_load_ps(s + 8 * v), keep);
    mx = _mm256_max_ps(mx, xs[v]);
  }
  const float mt = std::max(m, hmax8(mx));
  const __m256 mv = _mm256_set1_ps(mt);
  __m256 sum = _mm256_setzero_ps();
  for (int v = 0; v < nv; ++v) {
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * v), lanes));
    const __m256 p = _mm256_and_ps(keep, exp2_256(_mm256_mul_ps(_mm256_sub_ps(xs[v], mv), log2e)));
    _mm256_store_ps(s + 8 * v, p);
    sum = _mm256_add_ps(sum, p);
  }
  const float alpha = std::exp(m - mt);
  l = l * alpha + hsum8(sum);
  m = mt;
  if (alpha != 1.f) {
    const __m256 al = _mm256_set1_ps(alpha);
    for (int d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(al, _mm256_loadu_ps(acc + d)));
  }
}

// AVX2 version of attend_tile (D a multiple of 32, known at compile time; any cache type,
// int8 with its scales): K rows converted to fp32 once, scores 8 keys at a time from 8
// partial vectors summed by one hadd tree, a vectorised online softmax per head (exp2_256),
// then P.V 32 dims x 2 heads at a time with the accumulators in registers.
template <typename C, int D>
void attend_tile_avx2(const float* qf, int G, const C* kc, const C* vc, const int64_t* roff, int n,
                      float* acc, float* m, float* l, const float* ksc = nullptr,
                      const float* vsc = nullptr, float cap = 0.f) {
  static_assert(D % 32 == 0 && kTile == 32, "32-dim slices, a tile of four 8-lane vectors");
  constexpr int NV = D / 8;
  alignas(32) float kf[kTile][D];
  alignas(32) float s[kMaxG][kTile];
  const C* vrow[kTile];
  for (int j = 0; j < n; ++j) {
    vrow[j] = vc + roff[j];
    const C* kr = kc + roff[j];
    for (int v = 0; v < NV; ++v) _mm256_store_ps(&kf[j][8 * v], load8f<C>(kr + 8 * v));
  }
  for (int g = 0; g < G; ++g) {
    const float* qg = qf + g * D;
    for (int j0 = 0; j0 < n; j0 += 8) {
      __m256 part[8];
      for (int jj = 0; jj < 8; ++jj) {
        const int j = j0 + jj;
        if (j < n) {
          __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_load_ps(&kf[j][0]));
          for (int v = 1; v < NV; ++v)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * v), _mm256_load_ps(&kf[j][8 * v]), a);
          part[jj] = a;
        } else {
          part[jj] = _mm256_setzero_ps();
        }
      }
      __m256 x = hsum8x8(part);
      if (ksc) {
        alignas(32) float kv[8] = {};
        for (int jj = 0; jj < 8 && j0 + jj < n; ++jj) kv[jj] = ksc[j0 + jj];
        x = _mm256_mul_ps(x, _mm256_load_ps(kv));
      }
      _mm256_store_ps(&s[g][j0], x);
    }
    if (cap > 0.f) softcap_scores(s[g], n, cap);
    softmax_tile_avx2(s[g], n, m[g], l[g], acc + g * D, D);
  }
  for (int c = 0; c < D; c += 32) {
    int g0 = 0;
    for (; g0 + 2 <= G; g0 += 2) pv_heads_avx2<C, 2>(vrow, n, s + g0, vsc, c, D, acc + g0 * D);
    if (g0 < G) pv_heads_avx2<C, 1>(vrow, n, s + g0, vsc, c, D, acc + g0 * D);
  }
}

// bf16 rows read in pairs: a 32-bit lane of a 16-element chunk holds elements 2i (its low
// half) and 2i + 1 (its high half), so (lane << 16) and (lane & 0xffff0000) are the chunk's
// even and odd elements in fp32, exactly: two operations a chunk where load8f's widening
// takes two shuffles a half-chunk. The query and the accumulators are kept in that order
// ("even/odd": each 16-element chunk's 8 even elements, then its 8 odd ones; eo_index).
inline void bf16_pair(const c10::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Scores of NG <= 4 heads (queries qeo, even/odd order, stride D) for keys [j0, j0 + 8) of the
// tile (rows kc + roff[j], j < n), into s[g][j0 ..].
template <int D, int NG>
inline void scores8_bf16(const float* qeo, const c10::BFloat16* kc, const int64_t* roff, int j0,
                         int n, float (*s)[kTile]) {
  __m256 part[NG][8];
  for (int jj = 0; jj < 8; ++jj) {
    __m256 a[NG][2];
    for (int g = 0; g < NG; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
    if (j0 + jj < n) {
      const c10::BFloat16* kr = kc + roff[j0 + jj];
#pragma GCC unroll 8
      for (int c = 0; c < D; c += 16) {
        __m256 ke, ko;
        bf16_pair(kr + c, ke, ko);
        for (int g = 0; g < NG; ++g) {
          a[g][0] = _mm256_fmadd_ps(_mm256_load_ps(qeo + g * D + c), ke, a[g][0]);
          a[g][1] = _mm256_fmadd_ps(_mm256_load_ps(qeo + g * D + c + 8), ko, a[g][1]);
        }
      }
    }
    for (int g = 0; g < NG; ++g) part[g][jj] = _mm256_add_ps(a[g][0], a[g][1]);
  }
  for (int g = 0; g < NG; ++g) _mm256_store_ps(&s[g][j0], hsum8x8(part[g]));
}

// P.V for NG <= 3 heads over the 32 dims [c, c + 32) of n keys (even/odd order): each V slice
// converted once for the NG heads, 4 x NG accumulators in registers.
template <int NG>
inline void pv_heads_bf16(const c10::BFloat16* vc, const int64_t* roff, int n,
                          const float (*p)[kTile], int c, int D, float* acc) {
  __m256 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < 4; ++v) a[g][v] = _mm256_load_ps(acc + g * D + c + 8 * v);
  for (int j = 0; j < n; ++j) {
    __m256 x[4];
    bf16_pair(vc + roff[j] + c, x[0], x[1]);
    bf16_pair(vc + roff[j] + c + 16, x[2], x[3]);
    for (int g = 0; g < NG; ++g) {
      const __m256 pj = _mm256_set1_ps(p[g][j]);
      for (int v = 0; v < 4; ++v) a[g][v] = _mm256_fmadd_ps(pj, x[v], a[g][v]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < 4; ++v) _mm256_store_ps(acc + g * D + c + 8 * v, a[g][v]);
}

// attend_tile_avx2 for a bf16 cache (D a multiple of 32): qeo and acc (32-byte aligned) in
// even/odd order; K and V converted in registers as they are read (K once per 4 heads, V once
// per 3), no fp32 copy of the tile.
template <int D>
void attend_tile_avx2_bf16(const float* qeo, int G, const c10::BFloat16* kc,
                           const c10::BFloat16* vc, const int64_t* roff, int n, float* acc,
                           float* m, float* l, float cap = 0.f) {
  static_assert(D % 32 == 0 && kTile == 32, "32-dim slices, a tile of four 8-lane vectors");
  alignas(32) float s[kMaxG][kTile];
  for (int g = 0; g < G; g += 4) {
    const float* qg = qeo + g * D;
    for (int j0 = 0; j0 < n; j0 += 8) {
      switch (std::min(4, G - g)) {
        case 4: scores8_bf16<D, 4>(qg, kc, roff, j0, n, s + g); break;
        case 3: scores8_bf16<D, 3>(qg, kc, roff, j0, n, s + g); break;
        case 2: scores8_bf16<D, 2>(qg, kc, roff, j0, n, s + g); break;
        default: scores8_bf16<D, 1>(qg, kc, roff, j0, n, s + g); break;
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    if (cap > 0.f) softcap_scores(s[g], n, cap);
    softmax_tile_avx2(s[g], n, m[g], l[g], acc + g * D, D);
  }
  for (int c = 0; c < D; c += 32) {
    int g = 0;
    for (; g + 3 <= G; g += 3) pv_heads_bf16<3>(vc, roff, n, s + g, c, D, acc + g * D);
    if (G - g == 2) pv_heads_bf16<2>(vc, roff, n, s + g, c, D, acc + g * D);
    else if (G - g == 1) pv_heads_bf16<1>(vc, roff, n, s + g, c, D, acc + g * D);
  }
}
#endif

// Decode attention for B single-token queries q [B, H, D] (strides qs0, qs1; last dim
// contiguous) over their first lens[b] cached tokens, as independent work items: one
// sequence (all its KV heads, so each block's rows are read as one contiguous run) over a
// range of its context. Contexts are split when there are too few sequences to keep every
// thread busy (the plan depends only on B, the lengths and the thread count); finish()
// combines the splits by log-sum-exp. An item's result does not depend on which thread runs
// it or when, so the op (items scheduled dynamically) and the DecodeStack (items assigned
// ahead, each thread prefetching its own K/V) produce the same bits. lens must already be
// checked against the block tables (check_context_lens).
//
// C is the cache's element type: T, or int8_t for an int8 cache (PagedKV's scales applied
// per token and head; the generic tile kernel, no AVX-512 variant).
template <typename T, int DT, typename C = T>
class DecodeAttention {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  // A bf16 cache on AVX2: the queries and accumulators in even/odd order (eo_index).
  static constexpr bool kEvenOdd = std::is_same<C, c10::BFloat16>::value &&
                                   std::is_same<C, T>::value && DT != 0 && DT % 32 == 0;
#else
  static constexpr bool kEvenOdd = false;
#endif
  // Where element d of a head's accumulator lives.
  static int slot(int d) {
    if constexpr (kEvenOdd) return eo_index(d);
    return d;
  }

 public:
  // opt: a window or chunk (each query sees only its keys from opt.first_key(len - 1); the
  // splits still cover [0, len), and those wholly before it are empty), a soft-cap, sinks.
  DecodeAttention(const T* q, int64_t qs0, int64_t qs1, int B, int H, int D, const PagedKV<C>& kv,
                  const int32_t* lens, float scale, int nthreads, T* out, AttnOptions opt = {})
      : q_(q), qs0_(qs0), qs1_(qs1), B_(B), H_(H), D_(D), kv_(kv), lens_(lens), sc_(scale), out_(out),
        opt_(opt) {
    int max_len = 0;
    for (int b = 0; b < B; ++b) {
      max_len = std::max(max_len, static_cast<int>(lens[b]));
      work_ += static_cast<int64_t>(lens[b]) * kv.kv_heads;
    }
    split_ = std::max(max_len, 1);
    if (B < nthreads && max_len >= 64 && max_len < 256) {
      // Fewer sequences than threads: one split per thread (the DecodeStack runs them in
      // parallel; the op runs work below its threshold on the calling thread).
      split_ = ((max_len + nthreads - 1) / nthreads + kv.bs - 1) / kv.bs * kv.bs;
    } else if (B < 4 * nthreads && max_len >= 256) {
      const int want = (4 * nthreads + B - 1) / B;
      split_ = std::max(128, (max_len + want - 1) / want);
      split_ = (split_ + kv.bs - 1) / kv.bs * kv.bs;
    }
    nsplit_ = (std::max(max_len, 1) + split_ - 1) / split_;
    items_ = static_cast<int64_t>(B) * nsplit_;
    // Partial results when split: [B, nsplit, H, D + 2] (unnormalised acc, max, sum).
    if (nsplit_ > 1) part_.resize(static_cast<size_t>(items_) * H * (D + 2));
  }

  // Another layer's caches (same shape and block tables): the plan stays, as it depends
  // only on the lengths.
  void set_caches(const PagedKV<C>& kv) { kv_ = kv; }
  // A layer's sinks (AttnOptions::sinks), for a DecodeStack whose layers share this plan.
  void set_sinks(const float* sinks) { opt_.sinks = sinks; }
  int64_t items() const { return items_; }
  int64_t work() const { return work_; }  // cached tokens x KV heads, over all sequences
  // The sequence b and its tokens [t0, t1) that item `it` attends to (t0 >= t1: none).
  void item_range(int64_t it, int& b, int& t0, int& t1) const {
    b = it / nsplit_;
    t0 = (it % nsplit_) * split_;
    t1 = std::min<int>(lens_[b], t0 + split_);
    if (lens_[b] > 0) t0 = std::max(t0, opt_.first_key(lens_[b] - 1));
  }

  // read_lines for sequence b's K/V rows of tokens [t0, t1) (all heads, contiguous within a
  // block). The rows are cold (a step reads every layer's cache once); each chunk of an item
  // is pulled in this way and then scored: the attention 1.6x faster at 64 streams, where
  // software prefetches two tiles ahead had made no difference.
  void touch_rows(int b, int t0, int t1) const {
    const PagedKV<C>& kv = kv_;
    const int64_t row_bytes = kv.tok_stride * static_cast<int64_t>(sizeof(C));
    // One 8-byte word a line, K and V alternating, in a loop kept this tight (whole-line
    // loads, one run after the other, or a bounds clamp in the loop all measured slower).
    // A run is a whole number of rows, so with rows a multiple of 8 bytes every word read
    // lies inside it; other row sizes read a byte a line.
    const bool words = row_bytes % 8 == 0;
    uint64_t acc = 0;
    kv.for_runs(kv.table(b), t0, t1, [&](int64_t off, int rows) {
      const char* kp = reinterpret_cast<const char*>(kv.k + off);
      const char* vp = reinterpret_cast<const char*>(kv.v + off);
      const int64_t n = rows * row_bytes;
      if (words) {
        for (int64_t x = 0; x < n; x += 64) {
          uint64_t a, c;
          std::memcpy(&a, kp + x, sizeof(a));
          std::memcpy(&c, vp + x, sizeof(c));
          acc |= a | c;
        }
      } else {
        for (int64_t x = 0; x < n; x += 64)
          acc |= static_cast<unsigned char>(kp[x]) | static_cast<unsigned char>(vp[x]);
      }
    });
    asm volatile("" : : "r"(acc));  // the loads must happen
  }

  void run_item(int64_t it) {
    const int H = H_, D = D_, KVH = kv_.kv_heads, G = H / KVH;
    const PagedKV<C>& kv = kv_;
    const float sc = sc_, cap = opt_.softcap;
    int b, t0, t1;
    item_range(it, b, t0, t1);
    if (t0 >= t1 && nsplit_ > 1) {  // beyond this sequence's end or window: an empty partial
      float* p = part_.data() + static_cast<size_t>(it) * H * (D + 2);
      for (int hg = 0; hg < H; ++hg) { p[hg * (D + 2) + D] = kNegBig; p[hg * (D + 2) + D + 1] = 0.f; }
      return;
    }
    static thread_local std::vector<float> buf;  // per-thread scratch, kept between items
    buf.resize(std::max(buf.size(), static_cast<size_t>(2 * H * D + 2 * H) + 16));
    float* qf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    float* acc = qf + H * D;
    float* m = acc + H * D;
    float* l = m + H;
    const T* qb = q_ + b * qs0_;
    for (int hg = 0; hg < H; ++hg) {
      for (int d = 0; d < D; ++d) qf[hg * D + slot(d)] = to_f<T>(qb[hg * qs1_ + d]) * sc;
      m[hg] = kNegBig;
      l[hg] = 0.f;
    }
    std::fill(acc, acc + H * D, 0.f);
    const int32_t* table = kv.table(b);
    const int64_t row_bytes = kv.tok_stride * static_cast<int64_t>(sizeof(C));
    const int chunk = static_cast<int>(std::max<int64_t>(1, kTouchBytes / (2 * row_bytes * kTile)) * kTile);
    for (int base = t0; base < t1; base += kTile) {
      const int end = std::min(t1, base + kTile);
      if ((base - t0) % chunk == 0) touch_rows(b, base, std::min(t1, base + chunk));
      // The tile's row offsets.
      alignas(64) int64_t roff[kTile];
      int j = 0;
      kv.for_runs(table, base, end, [&](int64_t off, int rows) {
        for (int i = 0; i < rows; ++i) roff[j++] = off + i * kv.tok_stride;
      });
      alignas(64) int64_t soff[kTile];  // a quantised cache's: the rows' scale indices
      if constexpr (!std::is_same<C, T>::value)
        for (int i = 0; i < end - base; ++i) soff[i] = kv.scale_index(roff[i]);
      for (int h = 0; h < KVH; ++h) {
        const int hg = h * G;
        const C* kh = kv.k + static_cast<int64_t>(h) * D;
        const C* vh = kv.v + static_cast<int64_t>(h) * D;
        if constexpr (!std::is_same<C, T>::value) {  // quantised: the tile's scales
          alignas(64) float ksc[kTile], vsc[kTile];
          for (int i = 0; i < end - base; ++i) {
            const int64_t si = soff[i] + h;
            ksc[i] = kv.ks[si];
            vsc[i] = kv.vs[si];
          }
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
          if constexpr (DT != 0 && DT % 32 == 0) {
            attend_tile_avx2<C, DT>(qf + hg * D, G, kh, vh, roff, end - base, acc + hg * D, m + hg,
                                    l + hg, ksc, vsc, cap);
            continue;
          }
#endif
          attend_tile<C, DT>(qf + hg * D, G, D, kh, vh, roff, end - base, acc + hg * D, m + hg,
                             l + hg, ksc, vsc, cap);
          continue;
        }
#ifdef __AVX512F__
        if constexpr (DT != 0 && DT % 16 == 0 && std::is_same<C, T>::value) {
          attend_tile_avx512<T, DT>(qf + hg * D, qb + hg * qs1_, qs1_, sc, G, kh, vh, roff,
                                    end - base, acc + hg * D, m + hg, l + hg, cap);
          continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (kEvenOdd) {
          attend_tile_avx2_bf16<DT>(qf + hg * D, G, kh, vh, roff, end - base, acc + hg * D,
                                    m + hg, l + hg, cap);
          continue;
        } else if constexpr (DT != 0 && DT % 32 == 0 && std::is_same<C, T>::value) {
          attend_tile_avx2<T, DT>(qf + hg * D, G, kh, vh, roff, end - base, acc + hg * D, m + hg,
                                  l + hg, nullptr, nullptr, cap);
          continue;
        }
#endif
        if constexpr (std::is_same<C, T>::value)
          attend_tile<T, DT>(qf + hg * D, G, D, kh, vh, roff, end - base, acc + hg * D, m + hg,
                             l + hg, nullptr, nullptr, cap);
      }
    }
    if (nsplit_ == 1) {
      for (int hg = 0; hg < H; ++hg) {
        T* o = out_ + (static_cast<int64_t>(b) * H + hg) * D;
        const float lt = opt_.sinks ? with_sink(l[hg], m[hg], opt_.sinks[hg]) : l[hg];
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        for (int d = 0; d < D; ++d) o[d] = from_f<T>(acc[hg * D + slot(d)] * inv);
      }
    } else {
      float* p = part_.data() + static_cast<size_t>(it) * H * (D + 2);
      for (int hg = 0; hg < H; ++hg) {
        std::memcpy(p + hg * (D + 2), acc + hg * D, sizeof(float) * D);
        p[hg * (D + 2) + D] = m[hg];
        p[hg * (D + 2) + D + 1] = l[hg];
      }
    }
  }

  // After every item has run: the outputs of split sequences [b0, b1) from their partials.
  void finish(int b0, int b1) {
    if (nsplit_ == 1) return;
    const int H = H_, D = D_, nsplit = nsplit_;
    for (int b = b0; b < b1; ++b) {
      for (int hg = 0; hg < H; ++hg) {
        float mx = kNegBig;
        for (int sp = 0; sp < nsplit; ++sp)
          mx = std::max(mx, part_[((static_cast<size_t>(b) * nsplit + sp) * H + hg) * (D + 2) + D]);
        float L = 0.f;
        alignas(64) float o[kMaxD];
        std::fill(o, o + D, 0.f);
        for (int sp = 0; sp < nsplit; ++sp) {
          const float* p = part_.data() + ((static_cast<size_t>(b) * nsplit + sp) * H + hg) * (D + 2);
          if (p[D + 1] == 0.f) continue;
          const float w = std::exp(p[D] - mx);
          L += p[D + 1] * w;
          for (int d = 0; d < D; ++d) o[d] += p[d] * w;
        }
        if (opt_.sinks) L = with_sink(L, mx, opt_.sinks[hg]);
        const float inv = L > 0.f ? 1.f / L : 0.f;
        T* dst = out_ + (static_cast<int64_t>(b) * H + hg) * D;
        for (int d = 0; d < D; ++d) dst[d] = from_f<T>(o[slot(d)] * inv);  // partials: acc's order
      }
    }
  }

 private:
  const T* q_;
  int64_t qs0_, qs1_;
  int B_, H_, D_;
  PagedKV<C> kv_;
  const int32_t* lens_;
  float sc_;
  T* out_;
  AttnOptions opt_;
  int64_t work_ = 0, items_ = 0;
  int split_ = 1, nsplit_ = 1;
  std::vector<float> part_;
};

// A prompt-attention call's layout (servelm_ops' and servelm_amx_attention's ops share it;
// dtypes and head dims are each op's own): q [T,H,D] with its last dim contiguous, caches of
// one contiguous shape [NB,BS,KVH,D], int32 start_pos [B], block_tables [B, max_blocks] and
// cu_seqlens_q [B + 1] running from 0 to T, the q heads a multiple of the KV heads.
inline void check_prefill_args(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& start_pos,
                               const char* name) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, name, ": q must be [T,H,D], last dim contiguous");
  check_paged_caches(k_cache, v_cache, name);
  TORCH_CHECK(start_pos.scalar_type() == at::kInt && start_pos.is_contiguous() && start_pos.dim() == 1,
              name, ": start_pos must be contiguous int32 [B]");
  const int64_t B = start_pos.numel();
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == B,
              name, ": block_tables must be contiguous int32 [B, max_blocks]");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.is_contiguous() &&
                  cu_seqlens_q.numel() == B + 1,
              name, ": cu_seqlens_q must be contiguous int32 [B + 1]");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, name,
              ": q heads must be a multiple of the KV heads, same head dim");
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == q.size(0), name, ": cu_seqlens_q must run from 0 to T");
}

// Every prompt sequence's keys (start_pos[b] + its queries) within its block table, and the
// blocks they read within the pool.
template <typename C>
inline void check_prefill_tables(const PagedKV<C>& kv, const int32_t* cu, const int32_t* sp, int B,
                                 const char* name) {
  for (int b = 0; b < B; ++b) {
    const int n = cu[b + 1] - cu[b];
    TORCH_CHECK(n >= 0 && sp[b] >= 0, name, ": bad cu_seqlens_q / start_pos");
    TORCH_CHECK(sp[b] + n <= static_cast<int64_t>(kv.MB) * kv.bs, name, ": sequence ", b,
                " needs ", sp[b] + n, " keys, its block table holds ", kv.MB * kv.bs);
    for (int i = 0, nb = (sp[b] + n + kv.bs - 1) / kv.bs; i < nb; ++i) {
      const int32_t blk = kv.table(b)[i];
      TORCH_CHECK(blk >= 0 && blk < kv.num_blocks, name, ": block ", blk, " out of range (",
                  kv.num_blocks, " blocks)");
    }
  }
}

// Every context length within its block table (the message names the calling op).
inline void check_context_lens(const int32_t* lens, int B, int max_blocks, int block_size,
                               const char* name) {
  for (int b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_blocks * block_size, name, ": context_lens[", b,
                "] = ", lens[b], " exceeds its block table (", max_blocks, " blocks of ",
                block_size, ")");
}

}  // namespace
