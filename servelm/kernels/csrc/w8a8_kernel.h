// The w8a8 kernel's inner parts (the layouts: w8a8.cpp's head): an activation row smoothed
// and quantised per block of B inputs to int8, and int8 weight panels times those rows with
// AVX-512 VNNI (namespace w8a8), or on 256-bit vectors with AVX-VNNI (w8a8_256, below).
// Inline, in an anonymous namespace (each extension compiles its own copy), strict float
// semantics whatever the including file's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {
namespace w8a8_loop {

template <int R, typename F>
inline void tail(int64_t r, int64_t m, F& f) {
  if constexpr (R > 0) {
    if (r == R) f(std::integral_constant<int, R>{}, m);
    else tail<R - 1>(r, m, f);
  }
}

// Rows [0, M) of a panel (or pair) in calls of MR rows, the last call the rest: f(rows, m)
// with rows an integral_constant.
template <int MR, typename F>
inline void rows(int64_t M, F& f) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) f(std::integral_constant<int, MR>{}, m);
  tail<MR - 1>(M - m, m, f);
}

// Panels [p0, p1) of NR outputs (the weights' layout, w ws: w8a8.cpp's head) for all M rows
// of q (d, cs: [M, K / B]) into out [M, N], MR rows a Micro::run<R> call (the last call the
// rest of the rows).
template <int NR, int MR, typename Micro, typename O>
inline void panels(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                   const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t p0, int64_t p1) {
  const int64_t NB = K / B;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* wp = w + p * K * NR;
    const float* wsp = ws + p * NB * NR;
    const int64_t n0 = p * NR;
    const int ncols = static_cast<int>(std::min<int64_t>(NR, N - n0));
    const float* bp = bias ? bias + n0 : nullptr;
    auto call = [&](auto rows, int64_t m) {
      Micro::template run<decltype(rows)::value>(q + m * K, d + m * NB, cs + m * NB, K, B, wp, wsp, bp,
                                                 out + m * N + n0, N, ncols);
    };
    rows<MR>(M, call);
  }
}

}  // namespace w8a8_loop
}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SERVELM_W8A8 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#if defined(__AVX512BF16__)
#define SERVELM_W8A8_SILU 1  // the pair form's gated epilogue (silu16: row_kernels.h)
#include "row_kernels.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace {
namespace w8a8 {

constexpr int kNR = 16;  // outputs per panel: one 512-bit vector of int32 sums
constexpr int kMR = 8;   // rows per micro-kernel call: 8 int32 + 8 fp32 accumulators

inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Row x [K] -> q int8 [K]: per block of B inputs (B a multiple of 16), a = x * inv (fp32),
// d = max|a| / 127, q = round-to-nearest-even(a * (127 / max|a|)) (a block of zeros: d = 0,
// q = 0); d [K / B] and cs = 128 * sum(q) [K / B] (int32: the unsigned weights' offset).
template <typename T>
inline void quantize_row(const T* x, const float* inv, int64_t K, int64_t B, int8_t* q, float* d,
                         int32_t* cs) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / B; ++b) {
    const int64_t k0 = b * B;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = k0; k < k0 + B; k += 16)
      amax = _mm512_max_ps(amax, _mm512_and_ps(_mm512_mul_ps(load16f(x + k), _mm512_loadu_ps(inv + k)), absmask));
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 id = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + B; k += 16) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(load16f(x + k), _mm512_loadu_ps(inv + k)), id));
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(qi));
    }
    d[b] = m / 127.f;
    cs[b] = 128 * _mm512_reduce_add_epi32(sum);
  }
}

inline void store16(float* c, __m512 v, int n) {
  if (n == kNR) _mm512_storeu_ps(c, v);
  else _mm512_mask_storeu_ps(c, static_cast<__mmask16>((1u << n) - 1), v);
}
// v rounded to bf16 in each lane's high half (low half: garbage), to nearest even as
// c10::BFloat16(float) does, denormals kept (NaN: none here, the sums are finite).
inline __m512i bf16_high(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  return _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                              _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
}
// v rounded to bf16 as store16 stores it, read back as fp32.
inline __m512 as_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_high(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store16(c10::BFloat16* c, __m512 v, int n) {
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_high(v), 16));
  if (n == kNR) _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), h);
  else _mm256_mask_storeu_epi16(c, static_cast<__mmask16>((1u << n) - 1), h);
}

// Rows [0, R) of q (leading dimension K; d, cs: [R, NB]) against one panel w (uint8
// [K / 4, 16, 4]: byte (k4, o, t) = weight[o][4 k4 + t] + 128; ws fp32 [NB, 16]: each
// block's weight scales of the panel's columns) -> c (leading dimension ldc, ncols real
// columns): per block, the int32 sums less the offset's 128 sum(q), times d times the
// block's weight scales, chained in fp32 in block order; then plus the bias.
struct Micro {
template <int R, typename O>
__attribute__((noinline)) static void run(const int8_t* q, const float* d, const int32_t* cs, int64_t K,
                                          int64_t B, const uint8_t* w, const float* ws, const float* bias, O* c,
                                          int64_t ldc, int ncols) {
  const int64_t NB = K / B;
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    const uint8_t* wb = w + b * B * kNR;
    const int8_t* qb = q + b * B;
    for (int64_t k4 = 0; k4 < B / 4; ++k4) {
      const __m512i wv = _mm512_loadu_si512(wb + k4 * 64);
      for (int r = 0; r < R; ++r) {
        int32_t a;
        std::memcpy(&a, qb + r * K + 4 * k4, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], wv, _mm512_set1_epi32(a));
      }
    }
    const __m512 wsv = _mm512_loadu_ps(ws + b * kNR);
    for (int r = 0; r < R; ++r)
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], _mm512_set1_epi32(cs[r * NB + b]))),
                             _mm512_mul_ps(_mm512_set1_ps(d[r * NB + b]), wsv), f[r]);
  }
  if (bias) {
    const __m512 bv = ncols == kNR ? _mm512_loadu_ps(bias)
                                   : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << ncols) - 1), bias);
    for (int r = 0; r < R; ++r) f[r] = _mm512_add_ps(f[r], bv);
  }
  for (int r = 0; r < R; ++r) store16(c + r * ldc, f[r], ncols);
}
};

// Panels [p0, p1) of the weights for all M rows of q (ws fp32 [ceil(N / 16), NB, 16]).
template <typename O>
inline void panels(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                   const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t p0, int64_t p1) {
  w8a8_loop::panels<kNR, kMR, Micro>(q, d, cs, w, ws, bias, out, M, N, K, B, p0, p1);
}

// The pair form: two panels (32 outputs) a micro-kernel call, kPairMR rows, so each row's
// broadcast serves two products and a step holds 2 kPairMR independent sums, for cores that
// retire two 512-bit vpdpbusd a cycle. Per column, the same operations in the same order as
// Micro: the same bits.
constexpr int kPairMR = 7;  // 14 int32 + 14 fp32 accumulators, two weight vectors, a broadcast

// vpdpbusd on a sum that stays in its register: through the intrinsic, in the pair form's
// unrolled loop, GCC copies every sum out and back around each product, and the copies
// (three instructions a product) hold a wide core's front end under its vector units' rate.
inline __m512i dpbusd_in_place(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// Rows [0, R) of q against panels w and w1 (their scales ws and ws1) -> c's 32 columns, the
// second panel's first ncols real; the bias (if any) covers both panels. Gated (a SwiGLU
// gate_up's gate panel and the up panel of the same features): c gets silu(g) * u for the
// 16 features instead, g and u rounded to bf16 first, as the layer's output is stored and
// silu_row reads it back (the same bits as the two ops, without the round trip).
struct PairMicro {
template <int R, bool Gated, typename O>
__attribute__((noinline)) static void run(const int8_t* q, const float* d, const int32_t* cs, int64_t K,
                                          int64_t B, const uint8_t* w, const uint8_t* w1, const float* ws,
                                          const float* ws1, const float* bias, O* c, int64_t ldc, int ncols) {
  const int64_t NB = K / B;
  __m512 f[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    __m512i acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    const uint8_t* wb0 = w + b * B * kNR;
    const uint8_t* wb1 = w1 + b * B * kNR;
    const int8_t* qb = q + b * B;
    for (int64_t k4 = 0; k4 < B / 4; ++k4) {
      const __m512i wv0 = _mm512_loadu_si512(wb0 + k4 * 64);
      const __m512i wv1 = _mm512_loadu_si512(wb1 + k4 * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t a;
        std::memcpy(&a, qb + r * K + 4 * k4, 4);
        const __m512i av = _mm512_set1_epi32(a);
        acc[r][0] = dpbusd_in_place(acc[r][0], wv0, av);
        acc[r][1] = dpbusd_in_place(acc[r][1], wv1, av);
      }
    }
    const __m512 wsv0 = _mm512_loadu_ps(ws + b * kNR), wsv1 = _mm512_loadu_ps(ws1 + b * kNR);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i cv = _mm512_set1_epi32(cs[r * NB + b]);
      const __m512 dv = _mm512_set1_ps(d[r * NB + b]);
      f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], cv)), _mm512_mul_ps(dv, wsv0), f[r][0]);
      f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], cv)), _mm512_mul_ps(dv, wsv1), f[r][1]);
    }
  }
#ifdef SERVELM_W8A8_SILU
  if constexpr (Gated) {
    static_assert(std::is_same<O, c10::BFloat16>::value, "the gated form writes bf16");
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) silu_mul_store(c + r * ldc, silu16(as_bf16(f[r][0])), as_bf16(f[r][1]));
    return;
  }
#endif
  if (bias) {
    const __m512 bv0 = _mm512_loadu_ps(bias);
    const __m512 bv1 = ncols == kNR ? _mm512_loadu_ps(bias + kNR)
                                    : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << ncols) - 1), bias + kNR);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) f[r][0] = _mm512_add_ps(f[r][0], bv0), f[r][1] = _mm512_add_ps(f[r][1], bv1);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    store16(c + r * ldc, f[r][0], kNR);
    store16(c + r * ldc + kNR, f[r][1], ncols);
  }
}
};

// panels' work in the pair form: panels [p0, p1) two at a time, an odd last one by Micro.
template <typename O>
inline void pairs(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                  const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t p0, int64_t p1) {
  const int64_t NB = K / B;
  int64_t p = p0;
  for (; p + 1 < p1; p += 2) {
    const uint8_t* wp = w + p * K * kNR;
    const float* wsp = ws + p * NB * kNR;
    const int64_t n0 = p * kNR;
    const int ncols = static_cast<int>(std::min<int64_t>(kNR, N - n0 - kNR));
    const float* bp = bias ? bias + n0 : nullptr;
    auto call = [&](auto rows, int64_t m) {
      PairMicro::template run<decltype(rows)::value, false>(q + m * K, d + m * NB, cs + m * NB, K, B, wp,
                                                            wp + K * kNR, wsp, wsp + NB * kNR, bp,
                                                            out + m * N + n0, N, ncols);
    };
    w8a8_loop::rows<kPairMR>(M, call);
  }
  if (p < p1) panels(q, d, cs, w, ws, bias, out, M, N, K, B, p, p1);
}

#ifdef SERVELM_W8A8_SILU
// A SwiGLU gate_up ([gate; up], N = 2 I, I a multiple of 16, no bias) in the pair form with
// SiLU in its epilogue: features [16 f0, 16 f1) of out [M, I] get silu(gate) * up, each a
// call over gate panel f and up panel f + I / 16.
inline void pairs_silu(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                       c10::BFloat16* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t f0, int64_t f1) {
  const int64_t NB = K / B, I = N / 2, half = I / kNR;
  for (int64_t f = f0; f < f1; ++f) {
    const uint8_t* wg = w + f * K * kNR;
    const float* wsg = ws + f * NB * kNR;
    auto call = [&](auto rows, int64_t m) {
      PairMicro::template run<decltype(rows)::value, true>(q + m * K, d + m * NB, cs + m * NB, K, B, wg,
                                                           wg + half * K * kNR, wsg, wsg + half * NB * kNR,
                                                           nullptr, out + m * I + f * kNR, I, kNR);
    };
    w8a8_loop::rows<kPairMR>(M, call);
  }
}
#endif

}  // namespace w8a8
}  // namespace

#pragma GCC pop_options

#endif  // AVX-512 VNNI

// The same kernel on 256-bit vectors, for CPUs with AVX-VNNI and no AVX-512 (Alder Lake and
// later client cores, Sierra Forest): the weights in the same panels of 16 outputs (two
// vectors of 8 int32 sums a row), the rows in the same blocks, every value computed by the
// same fp32 operations in the same order, so its results are the AVX-512 form's bits. Built
// where the compiler targets AVX-VNNI (VEX vpdpbusd, 16 registers), or AVX-512 VNNI with VL
// (the EVEX form of the same instruction), where the tests check it against the wide form.
#if defined(__AVX2__) && defined(__FMA__) && \
    (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define SERVELM_W8A8_256 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace {
namespace w8a8_256 {

constexpr int kNR = 16;  // outputs per panel (the wide form's panels): two vectors of 8
constexpr int kMR = 4;   // rows per micro-kernel call: 8 int32 sums in registers (16 on VEX)

inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}

inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// The wide form's quantize_row (B a multiple of 16): the same products, maxima and rounding.
template <typename T>
inline void quantize_row(const T* x, const float* inv, int64_t K, int64_t B, int8_t* q, float* d, int32_t* cs) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / B; ++b) {
    const int64_t k0 = b * B;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + B; k += 8)
      amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_mul_ps(load8f(x + k), _mm256_loadu_ps(inv + k)), absmask));
    const float m = hmax(amax);
    const __m256 id = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = k0; k < k0 + B; k += 16) {
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(load8f(x + k), _mm256_loadu_ps(inv + k)), id));
      const __m256i q1 =
          _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(load8f(x + k + 8), _mm256_loadu_ps(inv + k + 8)), id));
      sum = _mm256_add_epi32(sum, _mm256_add_epi32(q0, q1));
      // int32 -> int16 -> int8 (|q| <= 127: no saturation), the lanes put back in order.
      const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xd8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k),
                       _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1)));
    }
    d[b] = m / 127.f;
    cs[b] = 128 * hsum(sum);
  }
}

inline void store16(float* c, __m256 lo, __m256 hi, int n) {
  if (n == kNR) {
    _mm256_storeu_ps(c, lo);
    _mm256_storeu_ps(c + 8, hi);
    return;
  }
  alignas(32) float tmp[kNR];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  std::memcpy(c, tmp, sizeof(float) * n);
}
inline __m256i round_bf16(__m256 v) {  // as c10::BFloat16(float): round to nearest even (finite)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                          _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  return _mm256_srli_epi32(r, 16);
}
inline void store16(c10::BFloat16* c, __m256 lo, __m256 hi, int n) {
  const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(lo), round_bf16(hi)), 0xd8);
  if (n == kNR) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), h);
    return;
  }
  alignas(32) uint16_t tmp[kNR];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
  std::memcpy(c, tmp, sizeof(uint16_t) * n);
}

// The wide form's micro: per block, the int32 sums less 128 sum(q), times d times the block's
// weight scales, chained in fp32 in block order; then plus the bias.
struct Micro {
template <int R, typename O>
__attribute__((noinline)) static void run(const int8_t* q, const float* d, const int32_t* cs, int64_t K,
                                          int64_t B, const uint8_t* w, const float* ws, const float* bias, O* c,
                                          int64_t ldc, int ncols) {
  const int64_t NB = K / B;
  __m256 f[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    __m256i acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const uint8_t* wb = w + b * B * kNR;
    const int8_t* qb = q + b * B;
    for (int64_t k4 = 0; k4 < B / 4; ++k4) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k4 * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k4 * 64 + 32));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t a;
        std::memcpy(&a, qb + r * K + 4 * k4, 4);
        const __m256i av = _mm256_set1_epi32(a);
        acc[r][0] = dpbusd(acc[r][0], w0, av);
        acc[r][1] = dpbusd(acc[r][1], w1, av);
      }
    }
    const __m256 ws0 = _mm256_loadu_ps(ws + b * kNR), ws1 = _mm256_loadu_ps(ws + b * kNR + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i cv = _mm256_set1_epi32(cs[r * NB + b]);
      const __m256 dv = _mm256_set1_ps(d[r * NB + b]);
      f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][0], cv)), _mm256_mul_ps(dv, ws0), f[r][0]);
      f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][1], cv)), _mm256_mul_ps(dv, ws1), f[r][1]);
    }
  }
  if (bias) {
    alignas(32) float bb[kNR] = {};
    std::memcpy(bb, bias, sizeof(float) * ncols);
    const __m256 b0 = _mm256_load_ps(bb), b1 = _mm256_load_ps(bb + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) f[r][0] = _mm256_add_ps(f[r][0], b0), f[r][1] = _mm256_add_ps(f[r][1], b1);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store16(c + r * ldc, f[r][0], f[r][1], ncols);
}
};

// Panels [p0, p1) of the weights for all M rows of q, as the wide form's panels().
template <typename O>
inline void panels(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                   const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t p0, int64_t p1) {
  w8a8_loop::panels<kNR, kMR, Micro>(q, d, cs, w, ws, bias, out, M, N, K, B, p0, p1);
}

}  // namespace w8a8_256
}  // namespace

#pragma GCC pop_options

#endif  // AVX-VNNI (or AVX-512 VNNI with VL)
