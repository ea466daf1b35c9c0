// The gated delta rule's decode step, a row and a head at a time: shared by delta_rule.cpp
// (the servelm_delta_rule operators) and decode_stack.cpp (the DecodeStack's linear-attention
// layers), so both paths produce the same bits. The functions are kept out of line: each path
// then runs the same machine code whatever it is inlined beside.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "row_kernels.h"  // round_bf16, silu16, mul_rn (AVX-512)

namespace {
namespace delta_rule {

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }
// x rounded to T (identity for float), as a PyTorch op producing a T tensor rounds it.
template <typename T> inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

#if defined(__AVX512F__)
// 16 (masked) state values as fp32: a float32 state's, or a bf16 state's widened.
inline __m512 load_state(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_state(const c10::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

// One head's step (see the header): St [Dk, Dv] (float32, or bf16: read widened, the new state
// computed in fp32 and rounded once) updated in place, o [Dv] written. kv, qs, delta: scratch
// of Dv floats.
template <typename ST>
__attribute__((noinline)) void head_step(ST* st, const float* qi, const float* ki, const float* vi, float g,
                                         float bt, bool fresh, int64_t Dk, int64_t Dv, float* oi, float* kv,
                                         float* qs, float* delta) {
  if (fresh) std::fill(st, st + Dk * Dv, ST(0.0f));
  std::fill(kv, kv + Dv, 0.0f);
  std::fill(qs, qs + Dv, 0.0f);
  float qk = 0.0f;
  for (int64_t r = 0; r < Dk; ++r) qk += ki[r] * qi[r];
#if defined(__AVX512F__)
  // St^T k and St^T q, 64 columns at a time held in registers over all rows (accumulated in
  // memory, each row's add waited on the last one's store).
  for (int64_t j0 = 0; j0 < Dv; j0 += 64) {
    __mmask16 m[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t left = Dv - j0 - 16 * v;
      m[v] = left >= 16 ? __mmask16(0xffff) : left > 0 ? __mmask16((1u << left) - 1) : __mmask16(0);
    }
    __m512 akv[4], aqs[4];
    for (int v = 0; v < 4; ++v) akv[v] = aqs[v] = _mm512_setzero_ps();
    for (int64_t r = 0; r < Dk; ++r) {
      const __m512 a = _mm512_set1_ps(ki[r]), c = _mm512_set1_ps(qi[r]);
      const ST* row = st + r * Dv + j0;
      for (int v = 0; v < 4; ++v) {
        const __m512 x = load_state(row + 16 * v, m[v]);
        akv[v] = _mm512_fmadd_ps(x, a, akv[v]);
        aqs[v] = _mm512_fmadd_ps(x, c, aqs[v]);
      }
    }
    for (int v = 0; v < 4; ++v) {
      _mm512_mask_storeu_ps(kv + j0 + 16 * v, m[v], akv[v]);
      _mm512_mask_storeu_ps(qs + j0 + 16 * v, m[v], aqs[v]);
    }
  }
#else
  for (int64_t r = 0; r < Dk; ++r) {
    const float a = ki[r], c = qi[r];
    const ST* row = st + r * Dv;
    for (int64_t j = 0; j < Dv; ++j) {
      kv[j] += static_cast<float>(row[j]) * a;
      qs[j] += static_cast<float>(row[j]) * c;
    }
  }
#endif
  const float d = std::exp(g);
  for (int64_t j = 0; j < Dv; ++j) {
    delta[j] = bt * (vi[j] - d * kv[j]);
    oi[j] = d * qs[j] + qk * delta[j];
  }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same<ST, c10::BFloat16>::value) {  // 16 at a time, widened, rounded once
    const __m512 dv = _mm512_set1_ps(d);
    for (int64_t r = 0; r < Dk; ++r) {
      const __m512 a = _mm512_set1_ps(ki[r]);
      ST* row = st + r * Dv;
      for (int64_t j = 0; j < Dv; j += 16) {
        const int64_t n = std::min<int64_t>(16, Dv - j);
        const __mmask16 m = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
        const __m512 y = _mm512_fmadd_ps(dv, load_state(row + j, m),
                                         _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, delta + j)));
        _mm256_mask_storeu_epi16(row + j, m, (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < Dk; ++r) {
    const float a = ki[r];
    ST* row = st + r * Dv;
    for (int64_t j = 0; j < Dv; ++j) row[j] = static_cast<ST>(d * static_cast<float>(row[j]) + a * delta[j]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// conv_row's channel loop for bf16 and a kernel of 4, 16 channels at a time (a masked tail:
// every channel takes the same instructions, so a channel's result does not depend on the
// rows or channels beside it): st [C, 3] and w [C, 4] read as 16 channels' taps by
// permutation, the products and their sum rounded where the scalar loop rounds them, SiLU by
// silu16. Returns C.
inline int64_t conv_bf16_k4(const c10::BFloat16* x, c10::BFloat16* st, bool fresh,
                            const c10::BFloat16* w, int64_t C, float* a) {
  auto mask32 = [](int64_t n) {  // the first n of 32 lanes
    return n >= 32 ? __mmask32(0xffffffffu) : n > 0 ? __mmask32((1u << n) - 1) : __mmask32(0);
  };
  auto widen = [](__m512i v) {  // the low 16 bf16 lanes of v, as fp32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
  };
  auto add = [](__m512 p, __m512 q) {  // opaque to -ffast-math: the scalar loop's order kept
    return _mm512_add_round_ps(p, q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  };
  alignas(64) int16_t it[4][32], iw[4][32];
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) it[j][l] = static_cast<int16_t>(l < 16 ? 3 * l + j : 0),
                                 iw[j][l] = static_cast<int16_t>(l < 16 ? 4 * l + j : 0);
  for (int64_t c = 0; c < C; c += 16) {
    const int64_t n = std::min<int64_t>(16, C - c);
    c10::BFloat16* sp = st + c * 3;
    const c10::BFloat16* wp = w + c * 4;
    const __m512i s0 = _mm512_maskz_loadu_epi16(mask32(3 * n), sp);
    const __m512i s1 = _mm512_maskz_loadu_epi16(mask32(3 * n - 32), sp + 32);
    const __m512i w0 = _mm512_maskz_loadu_epi16(mask32(4 * n), wp);
    const __m512i w1 = _mm512_maskz_loadu_epi16(mask32(4 * n - 32), wp + 32);
    const __m512i xv = _mm512_maskz_loadu_epi16(mask32(n), x + c);
    __m512 tap[3];
    for (int j = 0; j < 3; ++j)
      tap[j] = widen(_mm512_permutex2var_epi16(s0, _mm512_load_si512(it[j]), s1));
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < 3; ++j) {
      const __m512 wj = widen(_mm512_permutex2var_epi16(w0, _mm512_load_si512(iw[j]), w1));
      if (!fresh) acc = add(acc, round_bf16(mul_rn(tap[j], wj)));
    }
    const __m512 w3 = widen(_mm512_permutex2var_epi16(w0, _mm512_load_si512(iw[3]), w1));
    acc = add(acc, round_bf16(mul_rn(widen(xv), w3)));
    _mm512_mask_storeu_ps(a + c, static_cast<__mmask16>(mask32(n)), round_bf16(silu16(round_bf16(acc))));
    // The state moves on a tap: taps 1, 2 and the input (zeros before them where fresh).
    for (int64_t i = 0; i < n; ++i) {
      c10::BFloat16* p = sp + 3 * i;
      p[0] = fresh ? c10::BFloat16(0.f) : p[1];
      p[1] = fresh ? c10::BFloat16(0.f) : p[2];
      p[2] = x[c + i];
    }
  }
  return C;
}
#endif

// One row's work before the heads: its causal convolution step over its slot's last K1 inputs
// (st [C, K1], updated: zeroed first where fresh), SiLU, q and k of each of the Hk key heads
// L2-normalised (q scaled by Dk^-1/2), into a [C] (fp32: q | k | v); and each of the H value
// heads' gate g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) into gb [2 H], from
// x [C] (the mixed projection's row), w [C, K1 + 1] and ba [2 H] (b | a).
template <typename T>
__attribute__((noinline)) void conv_row(const T* x, T* st, bool fresh, const T* w, int64_t C,
                                        int64_t K1, int64_t Hk, int64_t Dk, const T* ba,
                                        const float* A_log, const float* dt_bias, int64_t H,
                                        float* a, float* gb) {
  const int64_t K = K1 + 1, key_dim = Hk * Dk;
  int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  if constexpr (std::is_same<T, c10::BFloat16>::value)
    if (K1 == 3) c = conv_bf16_k4(x, st, fresh, w, C, a);  // every channel, 16 at a time
#endif
  for (; c < C; ++c) {
    T* prev = st + c * K1;
    const T* wc = w + c * K;
    float acc = 0.0f;
    for (int64_t j = 0; j < K1; ++j)
      acc += fresh ? 0.0f : rnd<T>(to_f(prev[j]) * to_f(wc[j]));
    acc += rnd<T>(to_f(x[c]) * to_f(wc[K1]));
    for (int64_t j = 0; j + 1 < K1; ++j) prev[j] = fresh ? T(0) : prev[j + 1];
    if (K1 > 0) prev[K1 - 1] = x[c];
    a[c] = rnd<T>(silu(rnd<T>(acc)));
  }
  // q and k of each key head, L2-normalised (l2_normalize), q scaled by Dk^-1/2.
  const float qscale = 1.0f / std::sqrt(static_cast<float>(Dk));
  for (int64_t part = 0; part < 2; ++part)
    for (int64_t h = 0; h < Hk; ++h) {
      float* v = a + part * key_dim + h * Dk;
      float ss = 0.0f;
      for (int64_t d = 0; d < Dk; ++d) ss += v[d] * v[d];
      const float inv = 1.0f / std::sqrt(ss + 1e-6f) * (part == 0 ? qscale : 1.0f);
      for (int64_t d = 0; d < Dk; ++d) v[d] *= inv;
    }
  for (int64_t h = 0; h < H; ++h) {
    gb[h] = -std::exp(A_log[h]) * softplus(to_f(ba[H + h]) + dt_bias[h]);
    gb[H + h] = 1.0f / (1.0f + std::exp(-to_f(ba[h])));
  }
}

// One row's value head h: the delta-rule step of its state st [Dk, Dv] (the slot's, float32 or
// bf16; zeroed
// first where fresh) from the row's a and gb (conv_row's), then the gated RMSNorm (the core in
// T, normed in fp32, rounded, weighted by nw [Dv] in T, times silu(z) in fp32, rounded) into
// orow [Dv]; zr: the row's z for this head [Dv]. scratch: 4 Dv floats.
template <typename T, typename ST>
__attribute__((noinline)) void head_out(ST* st, const float* a, const float* gb, int64_t h,
                                        int64_t H, int64_t Hk, int64_t Dk, int64_t Dv, bool fresh,
                                        const T* zr, const T* nw, float eps, T* orow,
                                        float* scratch) {
  const int64_t key_dim = Hk * Dk, hk = h / (H / Hk);
  float* core = scratch;
  head_step(st, a + hk * Dk, a + key_dim + hk * Dk, a + 2 * key_dim + h * Dv, gb[h], gb[H + h],
            fresh, Dk, Dv, core, scratch + Dv, scratch + 2 * Dv, scratch + 3 * Dv);
  float ms = 0.0f;
  for (int64_t j = 0; j < Dv; ++j) {
    core[j] = rnd<T>(core[j]);
    ms += core[j] * core[j];
  }
  const float inv = 1.0f / std::sqrt(ms / static_cast<float>(Dv) + eps);
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  if constexpr (std::is_same<T, c10::BFloat16>::value) {  // 16 at a time, the tail masked
    const __m512 iv = _mm512_set1_ps(inv);
    for (; j < Dv; j += 16) {
      const int64_t n = std::min<int64_t>(16, Dv - j);
      const __mmask16 m = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
      const __m512 hn = round_bf16(mul_rn(load_state(nw + j, m),
                                          round_bf16(mul_rn(_mm512_maskz_loadu_ps(m, core + j), iv))));
      _mm256_mask_storeu_epi16(orow + j, m, (__m256i)_mm512_cvtneps_pbh(mul_rn(hn, silu16(load_state(zr + j, m)))));
    }
  }
#endif
  for (; j < Dv; ++j) {
    const float hn = rnd<T>(to_f(nw[j]) * rnd<T>(core[j] * inv));
    orow[j] = static_cast<T>(hn * silu(to_f(zr[j])));
  }
}

}  // namespace delta_rule
}  // namespace
