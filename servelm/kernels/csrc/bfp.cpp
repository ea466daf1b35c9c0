// bf16 (and int8) linear layers on integer multiply-adds, on x86 CPUs with AVX2 (+ FMA, F16C)
// but no AVX512-BF16: block floating point. An fp32 FMA does 8 multiplications
// a vector; `vpmaddwd` does 16 (int16 x int16, summed in pairs into int32), and on a Zen 3 it
// issues two a cycle as the FMA does (1.6 a cycle with the vpaddd each needs), so a batch or
// a prompt, compute-bound, can outrun the fp32 FMA peak that bounds the panels kernel.
// Namespace torch.ops.servelm_bfp:
//
//   pack(weight) -> (wq, ws)
// weight: [N, K] bfloat16 (or float32). Each output's inputs are cut into blocks of 64 (K
//   padded with zeros to Kp, a multiple of 64); a block shares one power-of-two scale
//   ws = 2^(E - 12), E = floor(log2 max|w|) + 1, and each weight becomes the int16 mantissa
//   q = round(w / ws), |q| <= 4095 (12 bits and a sign). A bf16 weight at least 1/16 of its
//   block's largest is exact; a smaller one is rounded by at most ws / 2 (2^-12 of the
//   largest: far below bf16's own rounding of the block's large weights).
// wq: int16 [ceil(N / 16), Kp / 2, 16, 2]: panels of 16 outputs; per input pair (k, k + 1),
//   each output's two mantissas side by side (a 32-bit lane of vpmaddwd).
// ws: float32 [ceil(N / 16), Kp / 64, 16]. Columns past N are zeros and never stored.
//
//   linear(x, wq, ws, out_features, bias?) -> y
// x: [..., K] bfloat16 or float32. Each call cuts every row into the same blocks of 64 and
//   gives each block a power-of-two scale d = 2^(E - 13) and int16 mantissas |q| <= 8192
//   (a bf16 activation at least 1/32 of its block's largest: exact). A block's 64 products sum
//   exactly in int32 (64 x 8192 x 4095 < 2^31); then y = sum over blocks, in order, of
//   fp32(sum) * (ws d), one fused multiply-add a block and vector (ws d is exact: powers of
//   two). So a row's result is the same bits whatever the row count and whatever rows share
//   its call (row-invariant). Against the exact bf16 dot product, SmolLM2-135M's layers' sums
//   were off by 1.5-4.2e-4 of the output's largest before rounding; bf16's own output
//   rounding is 2.8e-3 there. y in x's dtype, rounded once.
//   A block (of weights or activations) holding inf or nan gives nan; one whose largest
//   magnitude is below 2^-100 counts as zeros.
//
//   pack_int8(q, scales) -> (wq, ws)
// An int8 layer (servelm's Int8Linear: w = s q, q in -127..127, s float32 per output) in the
// same panels, wq int8 (a byte a weight, sign-extended to int16 as it is read) and ws each
// output's s for every block: the codes are the mantissas, exact. linear then gives the
//   activations 15-bit mantissas (a block's largest in [16384, 32767]; 64 x 32767 x 127 <
//   2^31): fine enough for fp32 runs, as qdot's int16 activations are.
//
//   quantize(x, int8_weights=False) -> (q int16 [M, Kp], d float32 [M, Kp / 64])
// The activations' blocks alone, as linear makes them: what the tests check against.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// The same float operations for every row count (see gemv.cpp).
#pragma GCC optimize("no-fast-math")

#include "avx2_vec.h"      // load8f, hmax8: under the pragma
#include "linear_frame.h"  // run_linear_into, check_x

namespace {

constexpr int kNR = 16;        // outputs per panel: two vectors of 8
constexpr int kB = 64;         // inputs per block (one shared exponent each side)
constexpr int kMR = 6;         // activation rows per micro-kernel call (12 int32 accumulators)
constexpr int64_t kKC = 1024;  // inputs per K chunk: a panel's chunk (32 KB) stays in L1-L2
constexpr int64_t kMC = 96;    // activation rows per row block: 192 KB of int16 x, in L2
constexpr int kWBits = 12;     // weight mantissas: |q| < 2^12
constexpr int kXBits = 13;     // activation mantissas: |q| <= 2^13 (bf16 weights)
constexpr int kX8Bits = 15;    // activation mantissas: |q| < 2^15 (int8 weights)
constexpr int kRowPanels = 4;  // panels a one-row call streams at once
constexpr int kPrefetch = 256;  // bytes ahead a one-row call prefetches each stream

inline float pow2(int e) {  // 2^e for e in [-126, 127]
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A block of n <= 64 elements of x (fp32 or bf16) widened into v, zeros past n; returns the
// exponent field of its largest magnitude (0 for zeros), or -1 where it holds inf or nan.
template <typename T>
inline int load_block(const T* x, int64_t n, float* v) {
  if (n == kB) {
    for (int i = 0; i < kB; i += 8) _mm256_store_ps(v + i, load8f(x + i));
  } else {
    for (int i = 0; i < kB; ++i) v[i] = i < n ? static_cast<float>(x[i]) : 0.f;
  }
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < kB; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_load_ps(v + i), absmask);
    amax = _mm256_max_ps(amax, a);  // drops a nan's lane: looked for apart
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));
  }
  if (_mm256_movemask_ps(bad)) return -1;
  const float m = hmax8(amax);
  uint32_t bits;
  std::memcpy(&bits, &m, 4);
  return static_cast<int>(bits >> 23);
}

// The block v as mantissas q [64] of a power-of-two scale, returned: the block's largest
// magnitude (exponent field f) lands in [2^top, 2^(top + 1)), each value rounded to nearest
// even (exact where it has no bits below the scale) and clamped to +-lim. A block holding
// inf or nan (f = -1) gets scale nan, one whose largest is below 2^-100 (or zeros) scale 0;
// both zero mantissas.
inline float to_mantissas(const float* v, int f, int top, int lim, int16_t* q) {
  if (f < 127 - 100) {
    std::memset(q, 0, kB * sizeof(int16_t));
    return f < 0 ? NAN : 0.f;
  }
  const __m256 inv = _mm256_set1_ps(pow2(127 + top - f));
  const __m256i hi = _mm256_set1_epi32(lim), lo = _mm256_set1_epi32(-lim);
  for (int i = 0; i < kB; i += 16) {
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + i), inv));
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + i + 8), inv));
    a = _mm256_max_epi32(_mm256_min_epi32(a, hi), lo);
    c = _mm256_max_epi32(_mm256_min_epi32(c, hi), lo);
    // packs interleaves the 128-bit lanes: a0 c0 a1 c1 (quarters); 0xD8 restores the order.
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), p);
  }
  return pow2(f - 127 - top);
}

// The activations' mantissas for weights of type W: a block's largest in [2^top, 2^(top + 1)],
// at most lim. bf16 weights (|q| < 2^12): [4096, 8192] (8192 only where an fp32 value rounds
// up), 64 x 8192 x 4095 < 2^31. int8 weights (|q| <= 127): [16384, 32767] (an fp32 value that
// would round to 32768 is clamped), 64 x 32767 x 127 < 2^31.
template <typename W> struct XBlocks;
template <> struct XBlocks<int16_t> { static constexpr int top = kXBits - 1, lim = 1 << kXBits; };
template <> struct XBlocks<int8_t> { static constexpr int top = kX8Bits - 1, lim = 32767; };

// One row x [K] (fp32 or bf16) -> q int16 [Kp], d [Kp / 64], for weights of type W.
template <typename W, typename T>
inline void quantize_row(const T* x, int64_t K, int16_t* q, float* d) {
  alignas(32) float v[kB];
  for (int64_t b = 0, k0 = 0; k0 < K; ++b, k0 += kB) {
    const int f = load_block(x + k0, std::min<int64_t>(kB, K - k0), v);
    d[b] = to_mantissas(v, f, XBlocks<W>::top, XBlocks<W>::lim, q + k0);
  }
}

// Keeps v in a register at this point (an empty asm that reads and writes it): GCC otherwise
// reassociates the integer adds and spills the products.
inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// 16 weights as int16s: int16 panels as they are, int8 ones sign-extended as they are read.
inline __m256i load16(const int16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256i load16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i bcast2(const int16_t* p) {  // two int16s (one 32-bit load) in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows [0, R) of q (leading dimension ldq) against one panel's blocks [b0, b1) (w: the panel,
// s: its scales), continuing the fp32 sums in c [R][16] (first: from zero).
template <int R, typename W>
inline void micro(const int16_t* q, int64_t ldq, const float* d, int64_t ldd, const W* w,
                  const float* s, int64_t b0, int64_t b1, float* c, bool first) {
  static_assert(R >= 1 && R <= kMR, "six rows of accumulators at most");
  if (first)
    for (int i = 0; i < R * kNR; i += 8) _mm256_storeu_ps(c + i, _mm256_setzero_ps());
  for (int64_t b = b0; b < b1; ++b) {
    __m256i a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51;
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = _mm256_setzero_si256();
    const W* wb = w + b * kB * kNR;
    const int16_t* qb = q + b * kB;
#pragma GCC unroll 4
    for (int kp = 0; kp < kB / 2; ++kp) {
      const __m256i w0 = load16(wb + kp * 32), w1 = load16(wb + kp * 32 + 16);
#define SERVELM_ROW(i)                                                 \
  if (R > i) {                                                        \
    const __m256i v = bcast2(qb + i * ldq + 2 * kp);                  \
    a##i##0 = _mm256_add_epi32(a##i##0, _mm256_madd_epi16(v, w0));    \
    a##i##1 = _mm256_add_epi32(a##i##1, _mm256_madd_epi16(v, w1));    \
    pin(a##i##0);                                                     \
    pin(a##i##1);                                                     \
  }
      SERVELM_ROW(0) SERVELM_ROW(1) SERVELM_ROW(2) SERVELM_ROW(3) SERVELM_ROW(4) SERVELM_ROW(5)
#undef SERVELM_ROW
    }
    const __m256 s0 = _mm256_loadu_ps(s + b * kNR), s1 = _mm256_loadu_ps(s + b * kNR + 8);
#define SERVELM_SCALE(i)                                                                       \
  if (R > i) {                                                                                \
    const __m256 dr = _mm256_set1_ps(d[i * ldd + b]);                                         \
    float* ci = c + i * kNR;                                                                  \
    _mm256_storeu_ps(ci, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##i##0), _mm256_mul_ps(s0, dr),  \
                                         _mm256_loadu_ps(ci)));                               \
    _mm256_storeu_ps(ci + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##i##1),                     \
                                             _mm256_mul_ps(s1, dr), _mm256_loadu_ps(ci + 8))); \
  }
    SERVELM_SCALE(0) SERVELM_SCALE(1) SERVELM_SCALE(2)
    SERVELM_SCALE(3) SERVELM_SCALE(4) SERVELM_SCALE(5)
#undef SERVELM_SCALE
  }
}

// One row against P whole panels (w: the first; the others follow at a panel's stride) over
// all NB blocks, into c [P][16]: for decode, P independent weight streams in flight. Each
// output is micro<1>'s chain, bit for bit.
template <int P, typename W>
inline void row_panels(const int16_t* q, const float* d, const W* w, const float* s,
                       int64_t NB, float* c) {
  const int64_t wstride = NB * kB * kNR, sstride = NB * kNR;
  __m256 f[P][2];
  for (int j = 0; j < P; ++j) f[j][0] = f[j][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    __m256i a[P][2];
    for (int j = 0; j < P; ++j) a[j][0] = a[j][1] = _mm256_setzero_si256();
    const int16_t* qb = q + b * kB;
#pragma GCC unroll 4
    for (int kp = 0; kp < kB / 2; ++kp) {
      const __m256i v = bcast2(qb + 2 * kp);
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) {
        const W* wb = w + j * wstride + (b * kB / 2 + kp) * 32;
        _mm_prefetch(reinterpret_cast<const char*>(wb) + kPrefetch, _MM_HINT_T0);
        a[j][0] = _mm256_add_epi32(a[j][0], _mm256_madd_epi16(v, load16(wb)));
        a[j][1] = _mm256_add_epi32(a[j][1], _mm256_madd_epi16(v, load16(wb + 16)));
        pin(a[j][0]);
        pin(a[j][1]);
      }
    }
    const __m256 dr = _mm256_set1_ps(d[b]);
    for (int j = 0; j < P; ++j) {
      const float* sb = s + j * sstride + b * kNR;
      const __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(sb), dr);
      const __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(sb + 8), dr);
      f[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[j][0]), s0, f[j][0]);
      f[j][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[j][1]), s1, f[j][1]);
    }
  }
  for (int j = 0; j < P; ++j) {
    _mm256_storeu_ps(c + j * kNR, f[j][0]);
    _mm256_storeu_ps(c + j * kNR + 8, f[j][1]);
  }
}

// Rows [0, M) against blocks [b0, b1) of one panel, kMR rows at a time, the rest in one call.
template <typename W>
inline void rows(const int16_t* q, int64_t ldq, const float* d, int64_t ldd, const W* w,
                 const float* s, int64_t b0, int64_t b1, float* c, int64_t M, bool first) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR)
    micro<kMR>(q + m * ldq, ldq, d + m * ldd, ldd, w, s, b0, b1, c + m * kNR, first);
  const int16_t* qm = q + m * ldq;
  const float* dm = d + m * ldd;
  float* cm = c + m * kNR;
  switch (M - m) {
    case 5: micro<5>(qm, ldq, dm, ldd, w, s, b0, b1, cm, first); break;
    case 4: micro<4>(qm, ldq, dm, ldd, w, s, b0, b1, cm, first); break;
    case 3: micro<3>(qm, ldq, dm, ldd, w, s, b0, b1, cm, first); break;
    case 2: micro<2>(qm, ldq, dm, ldd, w, s, b0, b1, cm, first); break;
    case 1: micro<1>(qm, ldq, dm, ldd, w, s, b0, b1, cm, first); break;
    default: break;
  }
}

template <typename W, typename X, typename O>
void gemm(const X* x, const W* wq, const float* ws, const float* bias, O* out, int64_t M,
          int64_t N, int64_t K, int64_t Kp) {
  const int64_t NP = (N + kNR - 1) / kNR, NB = Kp / kB, BC = kKC / kB;
  std::vector<int16_t> qv(M * Kp);
  std::vector<float> dv(M * NB);
  int16_t* q = qv.data();
  float* d = dv.data();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row<W>(x + r * K, K, q + r * Kp, d + r * NB);
  });
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float c[kMC * kNR];
    if (M == 1) {  // decode: kRowPanels panels at a time
      for (int64_t p = p0; p < p1;) {
        const int P = p + kRowPanels <= p1 ? kRowPanels : 1;
        const W* w = wq + p * Kp * kNR;
        const float* s = ws + p * NB * kNR;
        if (P == kRowPanels) row_panels<kRowPanels>(q, d, w, s, NB, c);
        else row_panels<1>(q, d, w, s, NB, c);
        for (int j = 0; j < P; ++j, ++p) {
          const int ncols = static_cast<int>(std::min<int64_t>(kNR, N - p * kNR));
          const float* bp = bias ? bias + p * kNR : nullptr;
          const float* cj = c + j * kNR;
          for (int n = 0; n < ncols; ++n)
            out[p * kNR + n] = static_cast<O>(bp ? cj[n] + bp[n] : cj[n]);
        }
      }
      return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += kMC) {
      const int64_t mr = std::min(kMC, M - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const W* w = wq + p * Kp * kNR;
        const float* s = ws + p * NB * kNR;
        for (int64_t b = 0; b < NB; b += BC)
          rows(q + m0 * Kp, Kp, d + m0 * NB, NB, w, s, b, std::min(NB, b + BC), c, mr, b == 0);
        const int ncols = static_cast<int>(std::min<int64_t>(kNR, N - p * kNR));
        const float* bp = bias ? bias + p * kNR : nullptr;
        for (int64_t i = 0; i < mr; ++i) {
          O* o = out + (m0 + i) * N + p * kNR;
          const float* ci = c + i * kNR;
          for (int j = 0; j < ncols; ++j) o[j] = static_cast<O>(bp ? ci[j] + bp[j] : ci[j]);
        }
      }
    }
  });
}

int64_t padded(int64_t K) { return (K + kB - 1) / kB * kB; }

// One output's block of n <= 64 weights -> its scale and 64 mantissas (zeros past n, |q| <
// 2^12), stored as the panel's pairs: pair (k, k + 1) of output j at 32-bit unit
// 16 (k / 2) + j from qp.
template <typename T>
inline void pack_block(const T* w, int64_t n, float* scale, int16_t* qp) {
  alignas(32) float v[kB];
  alignas(32) int16_t q[kB];
  // lim: an fp32 weight may round up to 2^12
  *scale = to_mantissas(v, load_block(w, n, v), kWBits - 1, (1 << kWBits) - 1, q);
  for (int k = 0; k < kB; k += 2) std::memcpy(qp + k * kNR, q + k, 4);
}

template <typename T>
void pack_panels(const T* w, int64_t N, int64_t K, int16_t* wq, float* ws) {
  const int64_t Kp = padded(K), NB = Kp / kB, NP = (N + kNR - 1) / kNR;
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int j = 0; j < kNR; ++j) {
        const int64_t n = p * kNR + j;
        for (int64_t b = 0; b < NB; ++b) {
          const int64_t kn = n < N ? std::min<int64_t>(kB, K - b * kB) : 0;  // rows past N: zeros
          pack_block(w + (n < N ? n : 0) * K + b * kB, kn, ws + (p * NB + b) * kNR + j,
                     wq + (p * Kp + b * kB) * kNR + 2 * j);
        }
      }
  });
}

std::tuple<at::Tensor, at::Tensor> pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "servelm_bfp.pack: weight must be a bfloat16 or float32 [N, K] tensor on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N > 0 && K > 0, "servelm_bfp.pack: weight must not be empty");
  const at::Tensor w = weight.contiguous();
  const int64_t NP = (N + kNR - 1) / kNR, Kp = padded(K);
  at::Tensor wq = at::empty({NP, Kp / 2, kNR, 2}, at::kShort);
  at::Tensor ws = at::empty({NP, Kp / kB, kNR}, at::kFloat);
  if (w.scalar_type() == at::kFloat)
    pack_panels(w.data_ptr<float>(), N, K, wq.data_ptr<int16_t>(), ws.data_ptr<float>());
  else
    pack_panels(w.data_ptr<c10::BFloat16>(), N, K, wq.data_ptr<int16_t>(), ws.data_ptr<float>());
  return {wq, ws};
}

// An int8 layer's q [N, K] (w = s q, s [N] float32 per output) as int8 panels in wq's layout
// ([ceil(N / 16), Kp / 2, 16, 2], zeros past N and K) and each output's s repeated per block
// of 64 as ws: the mantissas are the weights' own codes, exact.
std::tuple<at::Tensor, at::Tensor> pack_int8(const at::Tensor& q_in, const at::Tensor& scales) {
  const char* name = "servelm_bfp.pack_int8";
  TORCH_CHECK(q_in.device().is_cpu() && q_in.dim() == 2 && q_in.scalar_type() == at::kChar &&
                  q_in.size(0) > 0 && q_in.size(1) > 0,
              name, ": q must be a non-empty int8 [N, K] tensor on the CPU");
  const int64_t N = q_in.size(0), K = q_in.size(1);
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
                  scales.size(0) >= N,
              name, ": scales must be float32 [N] on the CPU");
  const at::Tensor q = q_in.contiguous(), sc = scales.contiguous();
  const int64_t NP = (N + kNR - 1) / kNR, Kp = padded(K), NB = Kp / kB;
  at::Tensor wq = at::zeros({NP, Kp / 2, kNR, 2}, at::kChar);
  at::Tensor ws = at::zeros({NP, NB, kNR}, at::kFloat);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  int8_t* wp = wq.data_ptr<int8_t>();
  float* wsp = ws.data_ptr<float>();
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int j = 0; j < kNR && p * kNR + j < N; ++j) {
        const int64_t n = p * kNR + j;
        for (int64_t k = 0; k < K; ++k) wp[((p * Kp + k) / 2 * kNR + j) * 2 + (k & 1)] = qp[n * K + k];
        for (int64_t b = 0; b < NB; ++b) wsp[(p * NB + b) * kNR + j] = sp[n];
      }
  });
  return {wq, ws};
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& ws, int64_t N,
                  const c10::optional<at::Tensor>& bias) {
  const char* name = "servelm_bfp.linear";
  const bool i8 = wq.scalar_type() == at::kChar;
  TORCH_CHECK(wq.device().is_cpu() && (i8 || wq.scalar_type() == at::kShort) && wq.dim() == 4 &&
                  wq.size(2) == kNR && wq.size(3) == 2 && wq.size(1) % (kB / 2) == 0 &&
                  wq.is_contiguous(),
              name, ": wq must be contiguous int16 (or int8) [ceil(N / 16), Kp / 2, 16, 2] on the "
              "CPU (Kp a multiple of 64)");
  const int64_t NP = wq.size(0), Kp = wq.size(1) * 2;
  TORCH_CHECK(N > 0 && (N + kNR - 1) / kNR == NP, name, ": out_features ", N, " does not match ",
              NP, " panels of 16");
  TORCH_CHECK(ws.device().is_cpu() && ws.scalar_type() == at::kFloat && ws.is_contiguous() &&
                  ws.dim() == 3 && ws.size(0) == NP && ws.size(1) == Kp / kB && ws.size(2) == kNR,
              name, ": ws must be contiguous float32 [ceil(N / 16), Kp / 64, 16]");
  check_x(x_in, name);
  const int64_t K = x_in.dim() >= 1 ? x_in.size(-1) : 0;
  TORCH_CHECK(K > Kp - kB && K <= Kp, name, ": x's last dim must be in_features: ", K,
              " does not pad to the weight's ", Kp, " inputs");
  return run_linear_into(x_in, K, N, bias, name, true,
                         [&](const at::Tensor& x, const float* b, at::Tensor& out, int64_t M) {
    const float* s = ws.data_ptr<float>();
    auto run = [&](auto* w) {
      if (x.scalar_type() == at::kFloat)
        gemm(x.data_ptr<float>(), w, s, b, out.data_ptr<float>(), M, N, K, Kp);
      else
        gemm(x.data_ptr<c10::BFloat16>(), w, s, b, out.data_ptr<c10::BFloat16>(), M, N, K, Kp);
    };
    if (i8) run(wq.data_ptr<int8_t>());
    else run(wq.data_ptr<int16_t>());
  });
}

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x_in, bool int8_weights) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() >= 1 && x_in.size(-1) > 0 &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "servelm_bfp.quantize: x must be a float32 or bfloat16 tensor on the CPU");
  const int64_t K = x_in.size(-1), Kp = padded(K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor q = at::empty({M, Kp}, at::kShort), d = at::empty({M, Kp / kB}, at::kFloat);
  auto rows = [&](auto w, auto* xp) {
    using W = decltype(w);
    for (int64_t r = 0; r < M; ++r)
      quantize_row<W>(xp + r * K, K, q.data_ptr<int16_t>() + r * Kp, d.data_ptr<float>() + r * (Kp / kB));
  };
  if (x.scalar_type() == at::kFloat) {
    if (int8_weights) rows(int8_t{}, x.data_ptr<float>());
    else rows(int16_t{}, x.data_ptr<float>());
  } else {
    if (int8_weights) rows(int8_t{}, x.data_ptr<c10::BFloat16>());
    else rows(int16_t{}, x.data_ptr<c10::BFloat16>());
  }
  return {q, d};
}

}  // namespace

TORCH_LIBRARY(servelm_bfp, m) {
  m.def("pack(Tensor weight) -> (Tensor, Tensor)");
  m.def("linear(Tensor x, Tensor wq, Tensor ws, int out_features, Tensor? bias=None) -> Tensor");
  m.def("pack_int8(Tensor q, Tensor scales) -> (Tensor, Tensor)");
  m.def("quantize(Tensor x, bool int8_weights=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(servelm_bfp, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
  m.impl("pack_int8", &pack_int8);
  m.impl("quantize", &quantize);
}

#endif  // AVX2 + FMA + F16C
