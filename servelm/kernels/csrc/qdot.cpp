// Weight-only int4 / int8 linear layers in integer dot products (vpmaddwd) for x86 CPUs
// with AVX2 (no AVX-512 needed), over activations quantised on the fly to int16.
// Namespace torch.ops.servelm_qdot:
//
//   q4_linear(x, qweight, scales, out_features, bias?) -> y
//   q8_linear(x, qweight, scales, out_features, bias?) -> y
// x: [..., K] float32 or bfloat16, K a multiple of 32; y: [..., N] in x's dtype.
//
// Activations: each row of x is quantised per block of 32 inputs to int16, x = d h + e with
// d = max|x| / 32767, h = round(x / d), |e| <= d / 2 (about 16 bits, finer than bf16; int8
// activations, as llama.cpp's Q8 are, flipped greedy tokens of the embedded model against
// dequantise + F.linear). Weights are widened to int16 as they are loaded and multiplied by
// vpmaddwd into int32 (exact: |w h| sums stay below 2^24 for int4). The block's exact fp32
// sum of x is kept for int4's mins.
//
// int4 (w = s * q + m, q in 0..15, s/m float16 per group of 32 inputs; servelm's int4):
//   qweight uint8 [N/4, K/32, 4, 16]: rows in blocks of 4, group-major within a block, so a
//   step streams one block's 4 rows together; row r's 16 bytes for group g hold q[k] for
//   k = 32g + i in byte i's low nibble and k = 32g + 16 + i in its high nibble.
//   scales float16 [N/4, K/32, 8]: s of rows 0..3, then m of rows 0..3.
//   y[n] = sum_g s_g d_g (q_g . h_g) + sum_g m_g (sum of x over g).
// int8 (w = s * q, q in -127..127, fp32 s per row; servelm's int8):
//   qweight int8 [N/4, K/32, 4, 32], the same order; scales float32 [N/4 * 4].
//   y[n] = s_n sum_g d_g (q_g . h_g).
//
// Rows of N are split over the torch (OpenMP) threads; each thread runs two activation rows
// at a time against a 4-row weight block, each weight vector widened once for both; the 4
// rows' integer dots are folded into one vector per activation row before the one float
// multiply-add per group (4 float accumulators per activation row spilled one of them to the
// stack, a store-to-load chain in every step).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// Strict float semantics here (the build's -ffast-math lets GCC contract and reassociate
// differently in each activation-row-count instantiation, so a row's result changed by an ulp
// with the batch): every row is computed by the same operations whatever the call; the
// scale-and-add that ends a row is one explicit fused multiply-add.
#pragma GCC optimize("no-fast-math")

#include "avx2_vec.h"  // load8f, hmax8, hsum8: under the pragma

namespace {

constexpr int64_t kBlock = 32;  // inputs per activation block (and int4 group)
constexpr int kRows = 4;        // weight rows per block

// Activations of M rows, quantised: q int16 [M, K] (x / d rounded, in x's order); per block
// g: d and the exact sum of x, as dxs [M, K/32, 8] = {d, d, d, d, sum, sum, sum, sum} (the
// int4 kernel's multiplier for one group's {s0..s3, m0..m3}).
struct QActs {
  std::vector<int16_t> q;
  std::vector<float> dxs;
  int64_t M = 0, K = 0, G = 0;
};

template <typename T>
void quantise_rows(const T* x, int64_t M, int64_t K, QActs& a) {
  a.M = M, a.K = K, a.G = K / kBlock;
  a.q.resize(M * K);
  a.dxs.resize(M * a.G * 8);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < a.G; ++g) {
        const T* xp = x + m * K + g * kBlock;
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = load8f(xp + 8 * i);
        const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        const float amax = hmax8(mx);
        const float sum = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        __m256i h[4];
        for (int i = 0; i < 4; ++i) h[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), rnd));
        // packs works per 128-bit lane: [0..3 8..11 4..7 12..15] -> permute back to order.
        int16_t* qp = a.q.data() + m * K + g * kBlock;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(h[0], h[1]), 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(h[2], h[3]), 0xD8));
        float* o = a.dxs.data() + (m * a.G + g) * 8;
        const float d = amax / 32767.f;
        for (int i = 0; i < 4; ++i) o[i] = d, o[4 + i] = sum;
      }
    }
  });
}

// A row's 32 int16 weights (lo: inputs 0..15, hi: 16..31) against an activation block's 32
// int16: 8 int32 partial sums.
inline __m256i dot32(__m256i lo, __m256i hi, const int16_t* x) {
  const __m256i a = _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  const __m256i b = _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
  return _mm256_add_epi32(a, b);
}

// Row r of a 4-row block's group as int16 (int4: byte i holds inputs i and 16 + i).
inline void widen_q4(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
  hi = _mm256_srli_epi16(v, 4);
}
inline void widen_q8(const int8_t* p, __m256i& lo, __m256i& hi) {
  lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
}

template <typename OutT>
inline void store_row(OutT* o, float v) { *o = static_cast<OutT>(v); }

// One group of a 4-row weight block against MT activation rows: each weight row widened once,
// its dot with every activation row, then per activation row the 4 rows' partial sums folded
// by two rounds of integer hadd into one vector, lanes {r0, r1, r2, r3} in each 128-bit half
// (exact; one conversion and one multiply-add per activation row and group follow, into a
// single accumulator, instead of one per weight row).
template <int MT, typename Widen>
inline void group_dots(const Widen& widen, const int16_t* const* xg, __m256i* out) {
  __m256i d[MT][kRows];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
    __m256i lo, hi;
    widen(r, lo, hi);
#pragma GCC unroll 2
    for (int m = 0; m < MT; ++m) d[m][r] = dot32(lo, hi, xg[m]);
  }
#pragma GCC unroll 2
  for (int m = 0; m < MT; ++m)
    out[m] = _mm256_hadd_epi32(_mm256_hadd_epi32(d[m][0], d[m][1]), _mm256_hadd_epi32(d[m][2], d[m][3]));
}

// An accumulator of group_dots' layout -> the 4 rows' sums.
inline __m128 row_sums(__m256 acc) {
  return _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
}

// Rows [m0, m0 + MT) of out [M, N] for weight block b (rows 4b .. 4b + 3), int4. One pass:
// a group's scales are read with its codes, {s0..s3, m0..m3} times the activation block's
// {d x4, sum x4} scaling the integer dots (s in both halves) and adding to the mins' term
// (a separate first pass over the scales read them from memory ahead of the codes, outside
// the prefetched stream: one fifth of a memory-bound call's time).
template <int MT, typename OutT>
void q4_block(const uint8_t* qw, const c10::Half* sc, const QActs& a, const float* bias,
              OutT* out, int64_t m0, int64_t N, int64_t b) {
  const int64_t G = a.G, K = a.K;
  const uint8_t* wb = qw + b * G * kRows * 16;
  const c10::Half* sb = sc + b * G * 8;
  __m256 acc[MT], mins[MT];
  for (int m = 0; m < MT; ++m) acc[m] = mins[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    // 4 KB ahead (1, 4 and 8 KB, T0 or non-temporal, measured alike within this VM's noise).
    _mm_prefetch(reinterpret_cast<const char*>(wb + 64 * g) + 4096, _MM_HINT_T0);
    const int16_t* xg[MT];
    for (int m = 0; m < MT; ++m) xg[m] = a.q.data() + (m0 + m) * K + kBlock * g;
    const uint8_t* wg = wb + 64 * g;
    const __m256 sm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 8 * g)));
    __m256i dots[MT];
    group_dots<MT>([&](int r, __m256i& lo, __m256i& hi) { widen_q4(wg + 16 * r, lo, hi); }, xg, dots);
    for (int m = 0; m < MT; ++m) {
      const __m256 p = _mm256_mul_ps(sm, _mm256_loadu_ps(a.dxs.data() + ((m0 + m) * G + g) * 8));
      mins[m] = _mm256_add_ps(mins[m], p);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m]), _mm256_permute2f128_ps(p, p, 0x00), acc[m]);
    }
  }
  alignas(32) float mt[MT][8];
  for (int m = 0; m < MT; ++m) _mm256_store_ps(mt[m], mins[m]);
  const int64_t n0 = kRows * b;
  for (int m = 0; m < MT; ++m) {
    alignas(16) float v[4];
    _mm_store_ps(v, row_sums(acc[m]));
    for (int r = 0; r < kRows && n0 + r < N; ++r)
      store_row(out + (m0 + m) * N + n0 + r, v[r] + mt[m][4 + r] + (bias ? bias[n0 + r] : 0.f));
  }
}

// The same for int8 weights, scaled by d_g per group, then by the row's scale.
template <int MT, typename OutT>
void q8_block(const int8_t* qw, const float* sc, const QActs& a, const float* bias, OutT* out,
              int64_t m0, int64_t N, int64_t b) {
  const int64_t G = a.G, K = a.K;
  const int8_t* wb = qw + b * G * kRows * 32;
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + 128 * g) + 2048, _MM_HINT_T0);
    const int16_t* xg[MT];
    for (int m = 0; m < MT; ++m) xg[m] = a.q.data() + (m0 + m) * K + kBlock * g;
    const int8_t* wg = wb + 128 * g;
    __m256i dots[MT];
    group_dots<MT>([&](int r, __m256i& lo, __m256i& hi) { widen_q8(wg + 32 * r, lo, hi); }, xg, dots);
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m]),
                               _mm256_broadcast_ss(a.dxs.data() + ((m0 + m) * G + g) * 8), acc[m]);
  }
  const int64_t n0 = kRows * b;
  for (int m = 0; m < MT; ++m) {
    alignas(16) float v[4];
    _mm_store_ps(v, row_sums(acc[m]));
    // One fused multiply-add, spelt out: the compiler must not choose per row count.
    for (int r = 0; r < kRows && n0 + r < N; ++r)
      store_row(out + (m0 + m) * N + n0 + r,
                _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(v[r]), _mm_set_ss(sc[n0 + r]),
                                           _mm_set_ss(bias ? bias[n0 + r] : 0.f))));
  }
}

// Two activation rows at a time against a 4-row weight block: their 8 int32 dot vectors, a
// row's widened weights and the two accumulators fit the 16 vector registers (activations
// are read from L1 by vpmaddwd); 4 rows would spill. A block's weights are re-read from L1
// for the next pair.
template <typename Fn>
void by_rows(int64_t M, const Fn& fn) {
  int64_t m0 = 0;
  for (; m0 + 2 <= M; m0 += 2) fn(std::integral_constant<int, 2>{}, m0);
  if (m0 < M) fn(std::integral_constant<int, 1>{}, m0);
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu(), "servelm_qdot: x must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "servelm_qdot: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == K && K % kBlock == 0,
              "servelm_qdot: x's last dim must be in_features (a multiple of 32): ", x.size(-1),
              " vs ", K);
}

template <typename Body>
at::Tensor run_linear(const at::Tensor& x_in, int64_t K, int64_t N,
                      const c10::optional<at::Tensor>& bias, const Body& body) {
  check_x(x_in, K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x_in.options());
  if (M == 0) return out;
  at::Tensor bf;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "servelm_qdot: bias must have out_features elements");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  QActs a;
  if (x.scalar_type() == at::kFloat)
    quantise_rows(x.data_ptr<float>(), M, K, a);
  else
    quantise_rows(x.data_ptr<c10::BFloat16>(), M, K, a);
  // Enough weight blocks per task to amortise the scheduling (one row: a few KB of weights).
  const int64_t grain = std::max<int64_t>(1, 16384 / (K * std::max<int64_t>(M, 1)));
  if (x.scalar_type() == at::kFloat)
    body(a, bp, out.data_ptr<float>(), M, grain);
  else
    body(a, bp, out.data_ptr<c10::BFloat16>(), M, grain);
  return out;
}

// qweight [N/4, K/32, 4, inner] of `dtype`, contiguous, holding out_features N: its blocks.
int64_t check_qweight(const at::Tensor& qweight, at::ScalarType dtype, int64_t inner, int64_t N,
                      const char* op) {
  TORCH_CHECK(qweight.scalar_type() == dtype && qweight.dim() == 4 && qweight.size(2) == kRows &&
                  qweight.size(3) == inner && qweight.is_contiguous(),
              "servelm_qdot.", op, ": qweight must be contiguous ", dtype, " [N/4, K/32, 4, ", inner, "]");
  const int64_t NB = qweight.size(0);
  TORCH_CHECK(NB * kRows >= N && (NB - 1) * kRows < N, "servelm_qdot.", op, ": out_features ", N,
              " does not match ", NB, " blocks of 4 rows");
  return NB;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     int64_t N, const c10::optional<at::Tensor>& bias) {
  const int64_t NB = check_qweight(qweight, at::kByte, 16, N, "q4_linear"), G = qweight.size(1),
                K = G * kBlock;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == NB * G * 8,
              "servelm_qdot.q4_linear: scales must be contiguous float16 [N/4, K/32, 8]");
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  const c10::Half* sc = scales.data_ptr<c10::Half>();
  return run_linear(x, K, N, bias, [&](const QActs& a, const float* bp, auto* out, int64_t M,
                                           int64_t grain) {
    at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        by_rows(M, [&](auto mt, int64_t m0) {
          q4_block<decltype(mt)::value>(qw, sc, a, bp, out, m0, N, b);
        });
    });
  });
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     int64_t N, const c10::optional<at::Tensor>& bias) {
  const int64_t NB = check_qweight(qweight, at::kChar, 32, N, "q8_linear"), G = qweight.size(1),
                K = G * kBlock;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == NB * kRows,
              "servelm_qdot.q8_linear: scales must be contiguous float32 [N/4 * 4]");
  const int8_t* qw = qweight.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  return run_linear(x, K, N, bias, [&](const QActs& a, const float* bp, auto* out, int64_t M,
                                           int64_t grain) {
    at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        by_rows(M, [&](auto mt, int64_t m0) {
          q8_block<decltype(mt)::value>(qw, sc, a, bp, out, m0, N, b);
        });
    });
  });
}

}  // namespace

TORCH_LIBRARY(servelm_qdot, m) {
  m.def("q4_linear(Tensor x, Tensor qweight, Tensor scales, int out_features, "
        "Tensor? bias=None) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qweight, Tensor scales, int out_features, "
        "Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_qdot, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}

#endif  // AVX2 + FMA + F16C
