// The q8act kernel's inner parts: an activation row quantised per block of 32 inputs to int8,
// and int4 panels times those rows (the layouts: q8act.cpp's head). Shared by the
// servelm_q8act operator (q8act.cpp) and the DecodeStack (decode_stack.cpp), so a layer gives the same
// bits on either. Strict float semantics (no-fast-math) for everything here, whatever the
// including file's: the rounding of d = max|x| / 127 and of the products must not depend on
// which extension compiled them. Inline, in an anonymous namespace (each extension compiles
// its own copy), names inside `q8act`.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

#include "avx2_vec.h"  // load8f, hmax8 (under the pragma where this file comes first)

namespace {
namespace q8act {

constexpr int kNR = 16;  // outputs per panel: two vectors of 8
constexpr int kB = 32;   // inputs per activation block
constexpr int kMR = 4;   // activation rows per micro-kernel call (at most 4: the accumulators)
// Software prefetch distance of the weight stream, in bytes. A one-row call is a stream of
// panels read once, and the hardware prefetchers alone left it well short of the memory's
// bandwidth; a few KB ahead (the distance quant.cpp's tiles use) covers the latency at the
// rate a core consumes int4 weights. Only a panel's first micro-kernel call prefetches: the
// later row blocks read the panel from the cache.
constexpr int kPrefetch = 6144;

// Row x [K] (fp32 or bf16: widened exactly) -> q int8 [K], d [K / 32], ds = d * sum(q) [K / 32].
template <typename T>
inline void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* ds) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / kB; ++b) {
    const T* xb = x + b * kB;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8f(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], absmask));
    }
    const float m = hmax8(amax);
    const __m256 id = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    d[b] = m / 127.f;
    ds[b] = d[b] * static_cast<float>(_mm_cvtsi128_si32(s));
    // packs interleave the 128-bit lanes: dwords come out a0 b0 c0 d0 a1 b1 c1 d1 (a0: qi[0]'s
    // first four); the permutation restores input order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kB), _mm256_permutevar8x32_epi32(p, order));
  }
}

// Keeps v in a register at this point (an empty asm that reads and writes it).
inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// Four int8s (one 32-bit load) in every 32-bit lane.
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The panels' weight formats, a policy each (the micro-kernels' template argument): how a
// chunk's nibbles become the byte multiply-add's operands, and where a block's scales (and
// mins) come from.
//
// Q4: int4 codes w = s q + m (Int4Linear's; s, m float16 per group of 32k inputs): the nibble
//   q is the unsigned operand itself, the mins added through d * sum(q_x).
// MX4: MXFP4 codes (OCP microscaling: E2M1 values, one E8M0 exponent byte e a block of 32,
//   w = E2M1(code) 2^(e - 127)): a table lookup (vpshufb) gives the doubled E2M1 value, an
//   integer in [-12, 12], so w = v 2^(e - 128), exactly. The AVX2 byte multiply-add takes
//   |v| and the activation with v's sign (so eight pairs' int16 sums stay under 2^15); the
//   VNNI one v + 12 (unsigned, in [0, 24]) with a min of -12 2^(e - 128), the int4 kernel's
//   own sums. The scale 2^(e - 128) is e's bits as a float's exponent, halved (e = 0 gives 0,
//   not 2^-128). Scales: uint8 e [ceil(N / 16), K / 32, 16] (mins: none).
struct Q4Fmt {
  using S = c10::Half;
  static constexpr bool kMins = true;
  SERVELM_VEC_INLINE static void decode(__m256i nib, __m256i& wu, __m256i& ws) { wu = ws = nib; }
  SERVELM_VEC_INLINE static __m256i pairs(__m256i wu, __m256i, __m256i v) {
    return _mm256_maddubs_epi16(wu, v);
  }
  SERVELM_VEC_INLINE static void scales8(const S* s, const S* mn, int64_t g, int64_t, __m256& s0,
                                         __m256& s1, __m256& m0, __m256& m1) {
    s0 = load8f(s + g * kNR), s1 = load8f(s + g * kNR + 8);
    m0 = load8f(mn + g * kNR), m1 = load8f(mn + g * kNR + 8);
  }
};

struct MX4Fmt {
  using S = uint8_t;
  static constexpr bool kMins = false;
  SERVELM_VEC_INLINE static __m256i table() {
    return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  }
  SERVELM_VEC_INLINE static void decode(__m256i nib, __m256i& wu, __m256i& ws) {
    ws = _mm256_shuffle_epi8(table(), nib);
    wu = _mm256_abs_epi8(ws);
  }
  SERVELM_VEC_INLINE static __m256i pairs(__m256i wu, __m256i ws, __m256i v) {
    return _mm256_maddubs_epi16(wu, _mm256_sign_epi8(v, ws));
  }
  // 2^(e - 128) of eight exponent bytes.
  SERVELM_VEC_INLINE static __m256 scale8(const uint8_t* e) {
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e))), 23);
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f));
  }
  SERVELM_VEC_INLINE static void scales8(const S* s, const S*, int64_t, int64_t b, __m256& s0,
                                         __m256& s1, __m256& m0, __m256& m1) {
    s0 = scale8(s + b * kNR), s1 = scale8(s + b * kNR + 8);
    m0 = m1 = _mm256_setzero_ps();
  }
};

// Rows [0, R) of q (leading dimension K) against one panel over all of K, into c (x's dtype,
// leading dimension ldc, ncols real columns; bias added in fp32 before the one rounding).
template <int R, typename O, typename Fmt = Q4Fmt>
inline void micro(const int8_t* q, const float* d, const float* ds, int64_t K, const uint8_t* w,
                  const typename Fmt::S* s, const typename Fmt::S* mn, int64_t blocks_per_group, O* c,
                  int64_t ldc, int ncols, const float* bias, bool prefetch) {
  static_assert(R >= 1 && R <= 4, "four rows of accumulators at most");
  const int64_t NB = K / kB;
  // The fp32 sums: named, so a few rows keep them in registers (the block's chain through
  // memory would be a store-to-load latency a block); four rows' spill where GCC chooses.
  __m256 f00, f01, f10, f11, f20, f21, f30, f31;
  f00 = f01 = f10 = f11 = f20 = f21 = f30 = f31 = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < NB; ++b) {
    // int16 sums of a block: |q_w q_x| <= 15 * 127, two products a pair, eight pairs: < 2^15.
    // Named accumulators pinned in registers: GCC otherwise reassociates the integer adds into
    // trees and spills every product to the stack.
    __m256i a00, a01, a10, a11, a20, a21, a30, a31;
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = _mm256_setzero_si256();
    const uint8_t* wb = w + b * (kNR * kB / 2);
    const int8_t* qb = q + b * kB;
    if (prefetch)  // the block's four lines, kPrefetch ahead (into the next panels at the end)
      for (int l = 0; l < kNR * kB / 2; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb) + kPrefetch + l, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int ch = 0; ch < 4; ++ch) {
      const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + ch * 32));
      const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + ch * 32));
      __m256i lo0, hi0, lo1, hi1, slo0, shi0, slo1, shi1;  // unsigned operands, signed values
      Fmt::decode(_mm256_and_si256(raw0, lo4), lo0, slo0);
      Fmt::decode(_mm256_and_si256(_mm256_srli_epi16(raw0, 4), lo4), hi0, shi0);
      Fmt::decode(_mm256_and_si256(raw1, lo4), lo1, slo1);
      Fmt::decode(_mm256_and_si256(_mm256_srli_epi16(raw1, 4), lo4), hi1, shi1);
#define SERVELM_ROW(i)                                                                  \
  if (R > i) {                                                                         \
    const __m256i v0 = bcast4(qb + i * K + ch * 8), v1 = bcast4(qb + i * K + ch * 8 + 4); \
    a##i##0 = _mm256_add_epi16(a##i##0, Fmt::pairs(lo0, slo0, v0));                    \
    a##i##1 = _mm256_add_epi16(a##i##1, Fmt::pairs(lo1, slo1, v0));                    \
    a##i##0 = _mm256_add_epi16(a##i##0, Fmt::pairs(hi0, shi0, v1));                    \
    a##i##1 = _mm256_add_epi16(a##i##1, Fmt::pairs(hi1, shi1, v1));                    \
    pin(a##i##0);                                                                      \
    pin(a##i##1);                                                                      \
  }
      SERVELM_ROW(0) SERVELM_ROW(1) SERVELM_ROW(2) SERVELM_ROW(3)
#undef SERVELM_ROW
    }
    const int64_t g = b / blocks_per_group;
    __m256 s0, s1, m0, m1;
    Fmt::scales8(s, mn, g, b, s0, s1, m0, m1);
#define SERVELM_SCALE(i)                                                                        \
  if (R > i) {                                                                                 \
    const __m256 dr = _mm256_set1_ps(d[i * NB + b]), dsr = _mm256_set1_ps(ds[i * NB + b]);      \
    f##i##0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a##i##0, ones)),             \
                              _mm256_mul_ps(s0, dr), f##i##0);                                  \
    f##i##1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a##i##1, ones)),             \
                              _mm256_mul_ps(s1, dr), f##i##1);                                  \
    if (Fmt::kMins) {                                                                          \
      f##i##0 = _mm256_fmadd_ps(m0, dsr, f##i##0);                                             \
      f##i##1 = _mm256_fmadd_ps(m1, dsr, f##i##1);                                             \
    }                                                                                          \
    (void)dsr;                                                                                 \
  }
    SERVELM_SCALE(0) SERVELM_SCALE(1) SERVELM_SCALE(2) SERVELM_SCALE(3)
#undef SERVELM_SCALE
  }
  alignas(32) float acc[4][kNR];
  _mm256_store_ps(acc[0], f00), _mm256_store_ps(acc[0] + 8, f01);
  if (R > 1) _mm256_store_ps(acc[1], f10), _mm256_store_ps(acc[1] + 8, f11);
  if (R > 2) _mm256_store_ps(acc[2], f20), _mm256_store_ps(acc[2] + 8, f21);
  if (R > 3) _mm256_store_ps(acc[3], f30), _mm256_store_ps(acc[3] + 8, f31);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < ncols; ++j) c[r * ldc + j] = static_cast<O>(bias ? acc[r][j] + bias[j] : acc[r][j]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SERVELM_Q8ACT_VNNI 1
// Whether panels() runs the AVX-512 VNNI micro-kernel (wide) by default in this build.
constexpr bool kVnni = true;
constexpr int kMRW = 8;  // rows per wide micro-kernel call: 8 int32 + 8 fp32 accumulators

// The wide kernels' half of each format policy: the unsigned operand of 64 nibbles, and a
// block's 16 scales and mins.
template <typename Fmt> struct Wide;
template <> struct Wide<Q4Fmt> {
  SERVELM_VEC_INLINE static __m512i decode(__m512i nib) { return nib; }
  SERVELM_VEC_INLINE static void scales(const c10::Half* s, const c10::Half* mn, int64_t g, int64_t,
                                        __m512& sv, __m512& mv) {
    sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g * kNR)));
    mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + g * kNR)));
  }
};
template <> struct Wide<MX4Fmt> {
  SERVELM_VEC_INLINE static __m512i decode(__m512i nib) {  // v + 12
    return _mm512_shuffle_epi8(
        _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)), nib);
  }
  SERVELM_VEC_INLINE static void scales(const uint8_t* s, const uint8_t*, int64_t, int64_t b, __m512& sv,
                                        __m512& mv) {
    const __m512i bits = _mm512_slli_epi32(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b * kNR))), 23);
    sv = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0.5f));
    mv = _mm512_mul_ps(sv, _mm512_set1_ps(-12.f));
  }
};

// The same sums on AVX-512 VNNI: one vpdpbusd multiplies 64 unsigned weight bytes by signed
// activation bytes and adds each lane's four products into an int32 lane, so a block's 32
// products per output are summed exactly in int32 (|sum| <= 32 x 15 x 127), the integer the
// AVX2 kernel's int16 pairs add up to, and the block's fp32 steps (s d, two fused
// multiply-adds) are the AVX2 kernel's lane for lane: the same bits (int4's; MXFP4's differ,
// its AVX2 sums being of |v| and signed activations). A 512-bit vector holds a
// panel's 16 outputs (its two 8-output halves side by side), so a block is 8 multiply-adds a
// row, against the AVX2 kernel's 16 byte multiply-adds, 16 int16 adds and a widening.
template <int R, typename O, typename Fmt = Q4Fmt>
inline void micro_wide(const int8_t* q, const float* d, const float* ds, int64_t K, const uint8_t* w,
                       const typename Fmt::S* s, const typename Fmt::S* mn, int64_t blocks_per_group, O* c,
                       int64_t ldc, int ncols, const float* bias, bool prefetch) {
  static_assert(R >= 1 && R <= kMRW, "eight rows of accumulators at most");
  const int64_t NB = K / kB;
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < NB; ++b) {
    __m512i a[R];
    for (int i = 0; i < R; ++i) a[i] = _mm512_setzero_si512();
    const uint8_t* wb = w + b * (kNR * kB / 2);
    const int8_t* qb = q + b * kB;
    if (prefetch)
      for (int l = 0; l < kNR * kB / 2; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb) + kPrefetch + l, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int ch = 0; ch < 4; ++ch) {
      const __m512i raw = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + ch * 32))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + ch * 32)), 1);
      const __m512i lo = Wide<Fmt>::decode(_mm512_and_si512(raw, lo4));
      const __m512i hi = Wide<Fmt>::decode(_mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4));
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        int32_t v0, v1;
        __builtin_memcpy(&v0, qb + i * K + ch * 8, 4);
        __builtin_memcpy(&v1, qb + i * K + ch * 8 + 4, 4);
        a[i] = _mm512_dpbusd_epi32(a[i], lo, _mm512_set1_epi32(v0));
        a[i] = _mm512_dpbusd_epi32(a[i], hi, _mm512_set1_epi32(v1));
      }
    }
    __m512 sv, mv;
    Wide<Fmt>::scales(s, mn, b / blocks_per_group, b, sv, mv);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 dr = _mm512_set1_ps(d[i * NB + b]), dsr = _mm512_set1_ps(ds[i * NB + b]);
      f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), _mm512_mul_ps(sv, dr), f[i]);
      f[i] = _mm512_fmadd_ps(mv, dsr, f[i]);
    }
  }
  alignas(64) float acc[kNR];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(acc, f[r]);
    for (int j = 0; j < ncols; ++j) c[r * ldc + j] = static_cast<O>(bias ? acc[j] + bias[j] : acc[j]);
  }
}

template <typename O, typename Fmt>
inline void panel_wide(const int8_t* q, const float* d, const float* ds, int64_t K, const uint8_t* wp,
                       const typename Fmt::S* sp, const typename Fmt::S* mp, int64_t bpg, O* cp, int64_t N,
                       int ncols, const float* bp, int64_t M) {
  const int64_t NB = K / kB;
  int64_t m = 0;
  for (; m + kMRW <= M; m += kMRW)
    micro_wide<kMRW, O, Fmt>(q + m * K, d + m * NB, ds + m * NB, K, wp, sp, mp, bpg, cp + m * N, N, ncols, bp, m == 0);
#define SERVELM_TAIL(r) \
  case r: micro_wide<r, O, Fmt>(q + m * K, d + m * NB, ds + m * NB, K, wp, sp, mp, bpg, cp + m * N, N, ncols, bp, m == 0); break;
  switch (M - m) {
    SERVELM_TAIL(7) SERVELM_TAIL(6) SERVELM_TAIL(5) SERVELM_TAIL(4)
    SERVELM_TAIL(3) SERVELM_TAIL(2) SERVELM_TAIL(1)
    default: break;
  }
#undef SERVELM_TAIL
}
#else
constexpr bool kVnni = false;
#endif

// Panels [p0, p1) of the weight (q8act's layout) for rows [0, M) of the quantised activations
// (q [M, K], d and ds [M, K / 32], as quantize_row writes them), into out [M, N] (N its leading
// dimension). A panel's outputs do not depend on which panels or rows share the call, nor on
// wide: the AVX-512 VNNI micro-kernel where this build has it (the default), else AVX2's,
// the same bits.
template <typename O, typename Fmt = Q4Fmt>
inline void panels(const int8_t* q, const float* d, const float* ds, const uint8_t* w,
                   const typename Fmt::S* scales, const typename Fmt::S* mins, int64_t group_size,
                   const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t p0,
                   int64_t p1, bool wide = kVnni) {
  const int64_t NB = K / kB, G = K / group_size, bpg = group_size / kB;
  (void)wide;
  for (int64_t p = p0; p < p1; ++p) {
    const int ncols = static_cast<int>(std::min<int64_t>(kNR, N - p * kNR));
    const uint8_t* wp = w + p * NB * (kNR * kB / 2);
    const typename Fmt::S* sp = scales + p * G * kNR;
    const typename Fmt::S* mp = mins ? mins + p * G * kNR : nullptr;
    const float* bp = bias ? bias + p * kNR : nullptr;
    O* cp = out + p * kNR;
#ifdef SERVELM_Q8ACT_VNNI
    if (wide) {
      panel_wide<O, Fmt>(q, d, ds, K, wp, sp, mp, bpg, cp, N, ncols, bp, M);
      continue;
    }
#endif
    int64_t m = 0;
    for (; m + kMR <= M; m += kMR)
      micro<kMR, O, Fmt>(q + m * K, d + m * NB, ds + m * NB, K, wp, sp, mp, bpg, cp + m * N, N, ncols, bp, m == 0);
    switch (M - m) {
      case 3: micro<3, O, Fmt>(q + m * K, d + m * NB, ds + m * NB, K, wp, sp, mp, bpg, cp + m * N, N, ncols, bp, m == 0); break;
      case 2: micro<2, O, Fmt>(q + m * K, d + m * NB, ds + m * NB, K, wp, sp, mp, bpg, cp + m * N, N, ncols, bp, m == 0); break;
      case 1: micro<1, O, Fmt>(q + m * K, d + m * NB, ds + m * NB, K, wp, sp, mp, bpg, cp + m * N, N, ncols, bp, m == 0); break;
      default: break;
    }
  }
}

}  // namespace q8act
}  // namespace

#pragma GCC pop_options

#endif  // AVX2 + FMA + F16C
