// gemv.cpp's weight-row blocks (4 rows x a few activation rows, or a row at a time: by_row) and
// a MoE layer's routed experts over them (moe::Rows: bf16 or int8 experts, the fused op's three
// phases), shared by servelm_gemv's ops (gemv.cpp) and the DecodeStack's MoE layers
// (decode_stack.cpp), so a layer gives the same bits on either. Strict float semantics
// (no-fast-math) whatever the including file's. Inline, in an anonymous namespace.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

#include "avx2_vec.h"  // load8f, hsum8 (under the pragma where this file comes first)
#include "moe_act.h"   // moe_act, moe_weighted_sum, moe::Scratch

namespace {
namespace gemv {

constexpr int kRows = 4;

// Lane sums of 4 vectors: {sum a, sum b, sum c, sum d}.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// out[m0 .. m0 + MT) x [n0, n0 + nr) for one block of up to 4 weight rows.
// scale (int8 weights): each row's products times its scale, before the bias.
template <int MT, typename W, typename O>
inline void block(const float* x, const W* w, const float* bias, O* out, int64_t m0, int64_t n0,
           int nr, int64_t K, int64_t N, const float* scale = nullptr) {
  const W* w0 = w + n0 * K;
  // Rows past N (the last block) read row 0 again and are not stored.
  const W* w1 = nr > 1 ? w0 + K : w0;
  const W* w2 = nr > 2 ? w0 + 2 * K : w0;
  const W* w3 = nr > 3 ? w0 + 3 * K : w0;
  __m256 a0[MT], a1[MT], a2[MT], a3[MT];
  for (int m = 0; m < MT; ++m) a0[m] = a1[m] = a2[m] = a3[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v0 = load8f(w0 + k), v1 = load8f(w1 + k);
    const __m256 v2 = load8f(w2 + k), v3 = load8f(w3 + k);
#pragma GCC unroll 2
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + m) * K + k);
      a0[m] = _mm256_fmadd_ps(v0, xv, a0[m]);
      a1[m] = _mm256_fmadd_ps(v1, xv, a1[m]);
      a2[m] = _mm256_fmadd_ps(v2, xv, a2[m]);
      a3[m] = _mm256_fmadd_ps(v3, xv, a3[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    alignas(16) float s[4];
    _mm_store_ps(s, hsum4(a0[m], a1[m], a2[m], a3[m]));
    for (int r = 0; r < nr; ++r)
      out[(m0 + m) * N + n0 + r] = static_cast<O>((scale ? s[r] * scale[n0 + r] : s[r]) +
                                                  (bias ? bias[n0 + r] : 0.f));
  }
}

// The same outputs as block(), a weight row at a time.
template <int MT, typename W, typename O>
inline void block_rows(const float* x, const W* w, const float* bias, O* out, int64_t m0, int64_t n0,
                int nr, int64_t K, int64_t N, const float* scale = nullptr) {
  for (int r = 0; r < nr; ++r) {
    const W* wr = w + (n0 + r) * K;
    __m256 a[MT][4];
    for (int m = 0; m < MT; ++m) a[m][0] = a[m][1] = a[m][2] = a[m][3] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m256 v0 = load8f(wr + k), v1 = load8f(wr + k + 8);
      const __m256 v2 = load8f(wr + k + 16), v3 = load8f(wr + k + 24);
#pragma GCC unroll 2
      for (int m = 0; m < MT; ++m) {
        const float* xr = x + (m0 + m) * K + k;
        a[m][0] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(xr), a[m][0]);
        a[m][1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xr + 8), a[m][1]);
        a[m][2] = _mm256_fmadd_ps(v2, _mm256_loadu_ps(xr + 16), a[m][2]);
        a[m][3] = _mm256_fmadd_ps(v3, _mm256_loadu_ps(xr + 24), a[m][3]);
      }
    }
    for (; k < K; k += 8) {
      const __m256 v0 = load8f(wr + k);
      for (int m = 0; m < MT; ++m)
        a[m][0] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x + (m0 + m) * K + k), a[m][0]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 s = _mm256_add_ps(_mm256_add_ps(a[m][0], a[m][1]),
                                     _mm256_add_ps(a[m][2], a[m][3]));
      const float d = hsum8(s);
      out[(m0 + m) * N + n0 + r] = static_cast<O>((scale ? d * scale[n0 + r] : d) +
                                                  (bias ? bias[n0 + r] : 0.f));
    }
  }
}

}  // namespace gemv

namespace moe {

// A layer's routed experts as weight rows (W: c10::BFloat16, or int8_t with each row's fp32
// scale): gate_up [E, 2I, H] (gate rows, then up), down [E, H, I]; gscale [E, 2I] and dscale
// [E, H] (int8); biases and activation as ExpertMlp's; by_row: each block's weight rows one
// after another. The phases for
// T tokens whose pair p = t k + j runs expert ids[p], weighted weights[p] (as Panels'):
//   quantize(t): token t's row widened to fp32;
//   gate_up(b0, b1): items of P * NB1 (blocks of kRows gate_up rows), pair-major;
//   activate(q0, q1): items of P * I, the activations a[p][i] = act(gate, up);
//   down(c0, c1, out): items of NB2 (blocks of kRows down rows) for every pair in turn, then
//   out[t][those columns] = sum_j weights[t k + j] y[t k + j], in slot order, rounded once to O.
template <typename W>
struct Rows : ExpertMlp {
  const W* gw = nullptr;
  const W* dw = nullptr;
  const float* gscale = nullptr;
  const float* dscale = nullptr;
  bool by_row = false;

  int64_t gate_up_items(int64_t P) const { return P * ((2 * I + gemv::kRows - 1) / gemv::kRows); }
  int64_t act_items(int64_t P) const { return P * I; }
  int64_t down_items() const { return (H + gemv::kRows - 1) / gemv::kRows; }
  void gemv1(const float* x, const W* w, const float* bias, float* o, int64_t n0, int64_t K, int64_t N,
             const float* scale) const {
    const int nr = static_cast<int>(std::min<int64_t>(gemv::kRows, N - n0));
    if (by_row) gemv::block_rows<1>(x, w, bias, o, 0, n0, nr, K, N, scale);
    else gemv::block<1>(x, w, bias, o, 0, n0, nr, K, N, scale);
  }
  template <typename X>
  void quantize(const X* x, int64_t t, Scratch& s) const {
    for (int64_t i = 0; i < H; ++i) s.xf[t * H + i] = static_cast<float>(x[i]);
  }
  void gate_up(const int64_t* ids, int64_t k, int64_t b0, int64_t b1, Scratch& s) const {
    const int64_t NB1 = (2 * I + gemv::kRows - 1) / gemv::kRows;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p = b / NB1, e = ids[p];
      gemv1(s.xf.data() + (p / k) * H, gw + e * 2 * I * H, gbias ? gbias + e * 2 * I : nullptr,
            s.h.data() + p * 2 * I, (b % NB1) * gemv::kRows, H, 2 * I, gscale ? gscale + e * 2 * I : nullptr);
    }
  }
  void activate(int64_t q0, int64_t q1, Scratch& s) const {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = q / I, i = q % I;
      s.a[q] = moe_act(act, s.h[p * 2 * I + i], s.h[p * 2 * I + I + i], limit, alpha);
    }
  }
  template <typename O>
  void down(const int64_t* ids, const float* weights, int64_t T, int64_t k, int64_t i0, int64_t i1,
            O* out, Scratch& s) const {
    const int64_t c0 = i0 * gemv::kRows, c1 = std::min(H, i1 * gemv::kRows);
    if (c0 >= c1) return;
    for (int64_t p = 0; p < T * k; ++p)
      for (int64_t n0 = c0; n0 < c1; n0 += gemv::kRows)
        gemv1(s.a.data() + p * I, dw + ids[p] * H * I, dbias ? dbias + ids[p] * H : nullptr,
              s.y.data() + p * H, n0, I, H, dscale ? dscale + ids[p] * H : nullptr);
    moe_weighted_sum(weights, s.y.data(), out, T, k, H, c0, c1);
  }
};

}  // namespace moe
}  // namespace

#pragma GCC pop_options

#endif  // AVX2 + FMA
