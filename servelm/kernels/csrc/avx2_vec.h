// AVX2 helpers shared by the CPU kernels: 8 elements of a float, bf16, fp16 or int8 row as
// fp32 (int8 unscaled), and the horizontal max / sum of 8 floats. Inline, in an anonymous
// namespace like decode_attention.h (each extension compiles its own copy). A file that
// wants strict float semantics (qdot.cpp, gemv.cpp) includes it after its `no-fast-math`
// pragma, so these compile under it too. Each is always inlined: GCC does not inline a
// function compiled under other optimize options, so where a strict-float header (q8act's)
// comes after this one in a fast-math file (the DecodeStack), each call was an out-of-line
// call per 8 elements. None of them does arithmetic that fast-math could change.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

namespace {

#define SERVELM_VEC_INLINE inline __attribute__((always_inline))

template <typename T> SERVELM_VEC_INLINE __m256 load8f(const T* p);
template <> SERVELM_VEC_INLINE __m256 load8f<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> SERVELM_VEC_INLINE __m256 load8f<c10::BFloat16>(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#ifdef __F16C__
template <> SERVELM_VEC_INLINE __m256 load8f<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
template <> SERVELM_VEC_INLINE __m256 load8f<int8_t>(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

SERVELM_VEC_INLINE float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

SERVELM_VEC_INLINE float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

}  // namespace
#endif  // AVX2 + FMA
