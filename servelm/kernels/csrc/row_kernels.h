// Row kernels of a decoder layer (RMSNorm, residual add + RMSNorm, rotary + KV write, SiLU and
// mul), shared by ops.cpp (the servelm_ops operators) and decode_stack.cpp (the DecodeStack, which
// runs them inline on its own buffers), so both paths produce the same bits. Each rounds
// where the PyTorch reference rounds (e.g. bf16 RMSNorm output is rounded before the weight
// multiply), so bf16 results stay close to the eager path.
#pragma once

#include "decode_attention.h"  // to_f / from_f / round_to, load16, kMaxD

namespace {

// ---- RMSNorm

// y = w * round_to<T>(x * r), r = 1 / sqrt(mean(x^2) + eps) given the sum of squares.
template <typename T>
void rms_scale_row(const T* x, const T* w, T* y, int64_t N, float ss, float eps) {
  const float r = 1.f / std::sqrt(ss / static_cast<float>(N) + eps);
  for (int64_t i = 0; i < N; ++i)
    y[i] = from_f<T>(to_f<T>(w[i]) * round_to<T>(to_f<T>(x[i]) * r));
}

template <typename T>
void rms_row_scalar(const T* x, const T* w, T* y, int64_t N, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < N; ++i) { const float v = to_f<T>(x[i]); ss += v * v; }
  rms_scale_row<T>(x, w, y, N, ss, eps);
}

// residual += x, each sum rounded once to T (the reference's in-place add).
template <typename T>
inline void add_row(const T* x, T* residual, int64_t N) {
  for (int64_t i = 0; i < N; ++i) residual[i] = from_f<T>(to_f<T>(residual[i]) + to_f<T>(x[i]));
}

// residual += x (rounded to T), then y = RMSNorm(residual) * w.
template <typename T>
void add_rms_row_scalar(const T* x, T* residual, const T* w, T* y, int64_t N, float eps) {
  add_row<T>(x, residual, N);
  rms_row_scalar<T>(residual, w, y, N, eps);
}

template <typename T>
void rms_row(const T* x, const T* w, T* y, int64_t N, float eps) { rms_row_scalar<T>(x, w, y, N, eps); }

template <typename T>
void add_rms_row(const T* x, T* residual, const T* w, T* y, int64_t N, float eps) {
  add_rms_row_scalar<T>(x, residual, w, y, N, eps);
}

// LayerNorm of one row: y = (x - mean) / sqrt(var + eps) * w (+ b; b null: none), the mean
// and the variance over the row in fp32 (two passes), rounded once to T.
template <typename T>
void ln_row_scalar(const T* x, const T* w, const T* b, T* y, int64_t N, float eps) {
  float s = 0.f;
  for (int64_t i = 0; i < N; ++i) s += to_f<T>(x[i]);
  const float mean = s / static_cast<float>(N);
  float ss = 0.f;
  for (int64_t i = 0; i < N; ++i) {
    const float d = to_f<T>(x[i]) - mean;
    ss += d * d;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(N) + eps);
  for (int64_t i = 0; i < N; ++i) {
    float v = (to_f<T>(x[i]) - mean) * r * to_f<T>(w[i]);
    if (b) v += to_f<T>(b[i]);
    y[i] = from_f<T>(v);
  }
}

template <typename T>
void ln_row(const T* x, const T* w, const T* b, T* y, int64_t N, float eps) {
  ln_row_scalar<T>(x, w, b, y, N, eps);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// a * b, a + b and a - b, each rounded once. -ffast-math lets the compiler reassociate plain
// vector arithmetic (g * (r * y) into (g * r) * y) and contract a product and a sum into a
// fused multiply-add, and it did so differently in ops.cpp and the DecodeStack; an explicit
// rounding mode makes each operation opaque to it, so both paths give the same bits.
inline __m512 mul_rn(__m512 a, __m512 b) {
  return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline __m512 add_rn(__m512 a, __m512 b) {
  return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline __m512 sub_rn(__m512 a, __m512 b) {
  return _mm512_sub_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// bf16 rows 16 lanes at a time (N a multiple of 16, else the scalar loops): the sums in 16
// lanes, then reduced; the output (x - mean) * r * w + b with separate multiplies and adds
// (mul_rn, add_rn: no fused multiply-add, whatever the includer's flags), rounded once.
template <>
inline void ln_row<c10::BFloat16>(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* b,
                                  c10::BFloat16* y, int64_t N, float eps) {
  if (N % 16) return ln_row_scalar(x, w, b, y, N, eps);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < N; i += 16) acc = add_rn(acc, load16<c10::BFloat16>(x + i));
  const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(acc) / static_cast<float>(N));
  acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < N; i += 16) {
    const __m512 d = sub_rn(load16<c10::BFloat16>(x + i), mean);
    acc = add_rn(acc, mul_rn(d, d));
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(N) + eps));
  for (int64_t i = 0; i < N; i += 16) {
    __m512 v = mul_rn(mul_rn(sub_rn(load16<c10::BFloat16>(x + i), mean), r), load16<c10::BFloat16>(w + i));
    if (b) v = add_rn(v, load16<c10::BFloat16>(b + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(v));
  }
}
#endif

// residual += x (rounded to T), then y = LayerNorm(residual).
template <typename T>
void add_ln_row(const T* x, T* residual, const T* w, const T* b, T* y, int64_t N, float eps) {
  add_row<T>(x, residual, N);
  ln_row<T>(residual, w, b, y, N, eps);
}

// ---- rotary + KV cache write

// A vectorised rotate-half for a dtype and head size, when there is one (returns false).
template <typename T>
inline bool rotate_vec(const T*, T*, const float*, const float*, int64_t) { return false; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// fp32 -> bf16 (round to nearest even, as c10::BFloat16) -> fp32.
inline __m512 round_bf16(__m512 v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// bf16 rows 16 lanes at a time (N a multiple of 16, else the scalar loops), rounding where
// those do; only the sum of squares adds in another order (16 lanes, two accumulators). The
// scalar loops ran ~1 cycle an element: 4x as long at 512 rows of 576.
inline void rms_scale_bf16(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y,
                           int64_t N, float ss, float eps) {
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(ss / static_cast<float>(N) + eps));
  for (int64_t i = 0; i < N; i += 16) {
    const __m512 v = round_bf16(_mm512_mul_ps(load16<c10::BFloat16>(x + i), r));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load16<c10::BFloat16>(w + i), v)));
  }
}

template <>
inline void rms_row<c10::BFloat16>(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y,
                                   int64_t N, float eps) {
  if (N % 16) return rms_row_scalar(x, w, y, N, eps);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 32 <= N; i += 32) {
    const __m512 v0 = load16<c10::BFloat16>(x + i), v1 = load16<c10::BFloat16>(x + i + 16);
    a0 = _mm512_fmadd_ps(v0, v0, a0);
    a1 = _mm512_fmadd_ps(v1, v1, a1);
  }
  if (i < N) {
    const __m512 v0 = load16<c10::BFloat16>(x + i);
    a0 = _mm512_fmadd_ps(v0, v0, a0);
  }
  rms_scale_bf16(x, w, y, N, _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)), eps);
}

template <>
inline void add_rms_row<c10::BFloat16>(const c10::BFloat16* x, c10::BFloat16* residual,
                                       const c10::BFloat16* w, c10::BFloat16* y, int64_t N,
                                       float eps) {
  if (N % 16) return add_rms_row_scalar(x, residual, w, y, N, eps);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t i = 0; i < N; i += 16) {  // the sum rounded to bf16, stored, and squared
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(
        _mm512_add_ps(load16<c10::BFloat16>(residual + i), load16<c10::BFloat16>(x + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(residual + i), h);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    if ((i / 16) % 2) a1 = _mm512_fmadd_ps(v, v, a1);
    else a0 = _mm512_fmadd_ps(v, v, a0);
  }
  rms_scale_bf16(residual, w, y, N, _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)), eps);
}

// The rotate-half of one bf16 head, 16 lanes at a time, rounding exactly as the scalar loop
// below (x*cos and rotated*sin rounded to bf16, then summed and rounded). y may alias x: each
// step loads both halves before storing either.
inline void rotate_bf16(const c10::BFloat16* x, c10::BFloat16* y, const float* c, const float* s,
                        int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x1 = load16<c10::BFloat16>(x + i), x2 = load16<c10::BFloat16>(x + i + half);
    const __m512 a1 = round_bf16(_mm512_mul_ps(x1, _mm512_loadu_ps(c + i)));
    const __m512 b1 = round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), _mm512_loadu_ps(s + i)));
    const __m512 a2 = round_bf16(_mm512_mul_ps(x2, _mm512_loadu_ps(c + i + half)));
    const __m512 b2 = round_bf16(_mm512_mul_ps(x1, _mm512_loadu_ps(s + i + half)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a1, b1)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i + half),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a2, b2)));
  }
}

template <>
inline bool rotate_vec<c10::BFloat16>(const c10::BFloat16* x, c10::BFloat16* y, const float* c,
                                      const float* s, int64_t half) {
  if (half % 16) return false;
  rotate_bf16(x, y, c, s, half);
  return true;
}
#endif

// One token: its H query heads rotated in place in row (q | k | v, D each), its KVH key heads
// rotated into kdst and its values copied to vdst (the token's cache rows); cos/sin [R]. A
// partial rotary (R < D: the first R of each head's D dims turn, the rest pass through). vsrc:
// the values from there instead (a layer whose values are not in its projection's row).
template <typename T>
void rotary_token(T* row, const T* cos, const T* sin, T* kdst, T* vdst, int64_t H, int64_t KVH,
                  int64_t D, int64_t R = -1, const T* vsrc = nullptr) {
  if (R < 0) R = D;
  float c[kMaxD], s[kMaxD];
  for (int64_t i = 0; i < R; ++i) { c[i] = to_f<T>(cos[i]); s[i] = to_f<T>(sin[i]); }
  const int64_t half = R / 2;
  auto rotate = [&](const T* x, T* y) {  // y may alias x
    if (y != x && R < D) std::memcpy(y + R, x + R, sizeof(T) * (D - R));
    if (rotate_vec(x, y, c, s, half)) return;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f<T>(x[i]), x2 = to_f<T>(x[i + half]);
      // As the reference rounds: x*cos and rotated*sin are separate T tensors, then summed.
      const float a1 = round_to<T>(x1 * c[i]), b1 = round_to<T>(-x2 * s[i]);
      const float a2 = round_to<T>(x2 * c[i + half]), b2 = round_to<T>(x1 * s[i + half]);
      y[i] = from_f<T>(a1 + b1);
      y[i + half] = from_f<T>(a2 + b2);
    }
  };
  for (int64_t h = 0; h < H; ++h) rotate(row + h * D, row + h * D);
  const T* ksrc = row + H * D;
  for (int64_t h = 0; h < KVH; ++h) rotate(ksrc + h * D, kdst + h * D);
  std::memcpy(vdst, vsrc ? vsrc : row + (H + KVH) * D, sizeof(T) * KVH * D);
}

// One head's row x [D] into an int8 cache row: q = round(x / s), s = max |x| / 127 (a zero
// row: s = 0, q = 0), as servelm.models.kv_quant.quantize does.
template <typename T>
inline void quantize_row_i8(const T* x, int8_t* q, float* scale, int64_t D) {
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(to_f<T>(x[i])));
  const float s = amax / 127.f;
  *scale = s;
  for (int64_t i = 0; i < D; ++i) {
    const float y = s > 0.f ? std::nearbyint(to_f<T>(x[i]) / s) : 0.f;
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, y)));
  }
}

// rotary_token into an int8 cache: the rotated K and the V rows (rounded to T, as the
// reference computes them) quantised per KV head into kdst / vdst, scales into ksc / vsc [KVH].
template <typename T>
void rotary_token_i8(T* row, const T* cos, const T* sin, int8_t* kdst, int8_t* vdst, float* ksc,
                     float* vsc, int64_t H, int64_t KVH, int64_t D, T* tmp) {
  rotary_token<T>(row, cos, sin, tmp, tmp + KVH * D, H, KVH, D);
  for (int64_t h = 0; h < KVH; ++h) {
    quantize_row_i8<T>(tmp + h * D, kdst + h * D, ksc + h, D);
    quantize_row_i8<T>(tmp + (KVH + h) * D, vdst + h * D, vsc + h, D);
  }
}

// Every token's cache slot within the cache's nslots (the message names the calling op).
inline void check_slots(const int64_t* slots, int64_t T, int64_t nslots, const char* name) {
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < nslots, name, ": slot_mapping[", t, "] = ", slots[t],
                " is outside the KV cache (", nslots, " slots)");
}

// ---- SiLU and mul

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// silu(g) = g / (1 + e^-g) in 16 lanes, e^-g = 2^(-g log2e) by exp2_512<5> (relative error
// ~1e-7 for |g| < 10, about an fp32 ulp). The scalar loop's expf, vectorised by the
// compiler through libmvec, took 1.5x as long.
inline __m512 silu16(__m512 g) {
  // e^-g capped at 2^126, so 1 + e^-g stays finite (silu(g < -87) is then -g 2^-126, not
  // -0: both below bf16's smallest normal); NaN stays NaN (min returns its second operand).
  const __m512 t = _mm512_min_ps(_mm512_set1_ps(126.f), mul_rn(g, _mm512_set1_ps(-kLog2e)));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp2_512<5>(t));
  // 1/d: a 14-bit estimate and one Newton step r + r (1 - d r) (~2^-27 relative), cheaper
  // than a divide.
  const __m512 r = _mm512_rcp14_ps(d);
  const __m512 inv = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.f)), r);
  return mul_rn(g, inv);
}
// o = s * u, s rounded to the element type first.
inline void silu_mul_store(float* o, __m512 s, __m512 u) { _mm512_storeu_ps(o, mul_rn(s, u)); }
inline void silu_mul_store(c10::BFloat16* o, __m512 s, __m512 u) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                      (__m256i)_mm512_cvtneps_pbh(mul_rn(round_bf16(s), u)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// fp32 rounded to bf16 as c10::BFloat16 rounds (to nearest even; nan -> 0x7fc0), in 8 lanes
// still fp32 (the low 16 bits zero): integer operations only, so -ffast-math cannot change
// them. to_bf16_8 packs them into 8 uint16s.
inline __m256 round_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7fff));
  __m256i r = _mm256_and_si256(_mm256_add_epi32(u, bias), _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan));
}
inline __m128i to_bf16_8(__m256 v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(v)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// silu(g) = g / (1 + e^-g) in 8 lanes, e^-g = 2^(-g log2e) by exp2_256 (relative error ~1e-7
// for |g| < 10), e^-g capped at 2^126 as silu16 caps it; 1 / d from a 12-bit estimate and
// one Newton step (~2^-23). The scalar loop's expf took about 4x as long.
inline __m256 silu8(__m256 g) {
  const __m256 t = _mm256_min_ps(_mm256_set1_ps(126.f), _mm256_mul_ps(g, _mm256_set1_ps(-kLog2e)));
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), exp2_256(t));
  const __m256 r = _mm256_rcp_ps(d);
  const __m256 inv = _mm256_fmadd_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(1.f)), r);
  return _mm256_mul_ps(g, inv);
}
inline void silu_mul_store8(float* o, __m256 s, __m256 u) { _mm256_storeu_ps(o, _mm256_mul_ps(s, u)); }
inline void silu_mul_store8(c10::BFloat16* o, __m256 s, __m256 u) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), to_bf16_8(_mm256_mul_ps(round_bf16_8(s), u)));
}
#endif

// o = silu(g) * u over I elements (silu rounded to T first, as the reference's two ops).
template <typename T>
void silu_row(const T* g, const T* u, T* o, int64_t I) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value)
    for (; i + 16 <= I; i += 16) silu_mul_store(o + i, silu16(load16<T>(g + i)), load16<T>(u + i));
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value) {
    // Four vectors at a time: one vector's chain (exp2, reciprocal, two bf16 roundings) is
    // ~50 cycles, and one at a time left the core waiting on it (bf16 1.4x as long).
    for (; i + 32 <= I; i += 32) {
      __m256 sv[4];
      for (int v = 0; v < 4; ++v) sv[v] = silu8(load8f<T>(g + i + 8 * v));
      for (int v = 0; v < 4; ++v) silu_mul_store8(o + i + 8 * v, sv[v], load8f<T>(u + i + 8 * v));
    }
    for (; i + 8 <= I; i += 8) silu_mul_store8(o + i, silu8(load8f<T>(g + i)), load8f<T>(u + i));
  }
#endif
  for (; i < I; ++i) {
    const float gv = to_f<T>(g[i]);
    // e^-g capped (at e^88, as the vector paths cap it): -ffast-math's division by an
    // infinite 1 + e^-g (g < -88) gave nan, not -0.
    const float sv = round_to<T>(gv / (1.f + std::exp(std::min(-gv, 88.f))));
    o[i] = from_f<T>(sv * to_f<T>(u[i]));
  }
}

}  // namespace
