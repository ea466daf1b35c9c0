// The w8a8 kernel's inner parts (the layouts: w8a8.cpp's head): an activation row smoothed
// and quantised per block of B inputs to int8, and int8 weight panels times those rows with
// AVX-512 VNNI. Inline, in an anonymous namespace (each extension compiles its own copy),
// names inside `w8a8`, strict float semantics whatever the including file's.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SERVELM_W8A8 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>

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
inline void store16(c10::BFloat16* c, __m512 v, int n) {
  // Round to nearest even, as c10::BFloat16(float) does (NaN: none here, the sums are finite).
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
  if (n == kNR) _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), h);
  else _mm256_mask_storeu_epi16(c, static_cast<__mmask16>((1u << n) - 1), h);
}

// Rows [0, R) of q (leading dimension K; d, cs: [R, NB]) against one panel w (uint8
// [K / 4, 16, 4]: byte (k4, o, t) = weight[o][4 k4 + t] + 128; ws fp32 [NB, 16]: each
// block's weight scales of the panel's columns) -> c (leading dimension ldc, ncols real
// columns): per block, the int32 sums less the offset's 128 sum(q), times d times the
// block's weight scales, chained in fp32 in block order; then plus the bias.
template <int R, typename O>
inline void micro(const int8_t* q, const float* d, const int32_t* cs, int64_t K, int64_t B,
                  const uint8_t* w, const float* ws, const float* bias, O* c, int64_t ldc, int ncols) {
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

// Panels [p0, p1) of the weights for all M rows of q (ws fp32 [ceil(N / 16), NB, 16]).
template <typename O>
inline void panels(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                   const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t p0,
                   int64_t p1) {
  const int64_t NB = K / B;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* wp = w + p * K * kNR;
    const float* wsp = ws + p * NB * kNR;
    const int64_t n0 = p * kNR;
    const int ncols = static_cast<int>(std::min<int64_t>(kNR, N - n0));
    const float* bp = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + kMR <= M; m += kMR)
      micro<kMR>(q + m * K, d + m * NB, cs + m * NB, K, B, wp, wsp, bp, out + m * N + n0, N, ncols);
#define SERVELM_TAIL(r) \
  case r: micro<r>(q + m * K, d + m * NB, cs + m * NB, K, B, wp, wsp, bp, out + m * N + n0, N, ncols); break;
    switch (M - m) {
      SERVELM_TAIL(7) SERVELM_TAIL(6) SERVELM_TAIL(5) SERVELM_TAIL(4)
      SERVELM_TAIL(3) SERVELM_TAIL(2) SERVELM_TAIL(1)
      default: break;
    }
#undef SERVELM_TAIL
  }
}

}  // namespace w8a8
}  // namespace

#pragma GCC pop_options

#endif  // AVX-512 VNNI
