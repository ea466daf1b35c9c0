// fp32, bf16, int4 and int8 linear layers for any row count on x86 CPUs with AVX2 + FMA (+ F16C),
// over weights packed once into column panels: a register-blocked outer-product kernel (6 rows x 16
// outputs in 12 vector accumulators), the classic GEMM micro-kernel shape, with the panel's
// slice of K kept in L1 and the activations' block in L2. Namespace torch.ops.servelm_panels:
//
//   linear(x, panels, out_features, bias?) -> y
// panels: [ceil(N / 16), K, 16] float32 or bfloat16, contiguous: output columns n .. n + 15
//   of the layer's [N, K] weight, k-major (servelm/layers/panels.py packs them; the columns
//   past N are zeros and never stored).
// x: [..., K] float32 (either panel dtype) or bfloat16 (bf16 panels); y: [..., N] in x's dtype.
// bf16 weights are widened to fp32 as they are read (a shift; from kWidenRows rows, a K block
// at a time into L1, once per row block), the products summed in fp32 and rounded once to
// x's dtype (without AVX512-BF16 oneDNN's bf16 matmul converted as it went, at a fraction
// of the FMA peak).
//
//   int4_linear(x, qpanels, scales, mins, group_size, out_features, bias?) -> y
// servelm's int4 weights (w = s * q + m, q in 0..15, s / m float16 per group of group_size
// inputs) as panels: qpanels uint8 [ceil(N / 16), K, 8], byte j of row k holding output j's q
// in its low nibble and output j + 8's in its high one; scales, mins float16
// [ceil(N / 16), K / group_size, 16] (Int4Linear's own). Each K block of a panel is decoded
// to fp32 into L1 (s * q, then + m, as servelm.quantization.dequantize_int4 rounds them),
// once per row block, and multiplied as an fp32 panel: the same bits as `linear` on the
// dequantised fp32 weight. Calls of a few rows decode in registers instead (the same bits).
// x: float32 or bfloat16; y in x's dtype.
//
//   int8_linear(x, qpanels, scales, out_features, bias?) -> y
// servelm's int8 weights (w = s * q, q in -127..127, s float32 per output) as panels: qpanels
// int8 [ceil(N / 16), K, 16], scales float32 [16 ceil(N / 16)] (zeros past N). Decoded as
// int4's are (q * s: dequantize_int8's values), into the block buffer whatever the rows.
//
// Panels are split over the torch (OpenMP) threads. Every output is one chain of fused
// multiply-adds over k in order (the K blocks continue it through the fp32 output), so a
// row's result is the same bits whatever the row count and whatever rows share its call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// The same float operations for every row count (see gemv.cpp).
#pragma GCC optimize("no-fast-math")

#include "avx2_vec.h"     // load8f: under the pragma
#include "linear_frame.h"  // run_linear, check_x

namespace {

constexpr int kNR = 16;     // outputs per panel: two vectors
constexpr int kMR = 6;      // activation rows per micro-kernel call
constexpr int64_t kKC = 256;  // K per block: 16 KB of an fp32 panel, in L1
constexpr int64_t kMC = 96;   // activation rows per block: 96 KB of fp32 x at kKC, in L2
constexpr int64_t kDirectRows = 5;  // int4 calls of fewer rows decode in registers
constexpr int64_t kWidenRows = 24;  // bf16 calls of this many rows widen a block once

// C[0 .. MR) x [0, 16) (+)= A[0 .. MR) x [k0, k0 + kc) . B panel rows [k0, k0 + kc).
// `first`: start the sums at zero, else continue them from C; `bias` (last block only):
// added after the final product. C is fp32 with leading dimension ldc; only ncols columns
// are real (the last panel), the rest go through a local tile. `next` (or null): the B block
// the thread multiplies after this one, pulled into L1 one line per k while this one runs, so
// the weights' trip from memory overlaps the row blocks' FMAs instead of stalling the first.
template <int MR, typename W>
inline void micro(const float* a, int64_t lda, const W* b, int64_t kc, float* c, int64_t ldc,
                  int ncols, bool first, const float* bias, const W* next) {
  alignas(32) float tile[MR][kNR];
  const bool full = ncols == kNR;
  float* cc = full ? c : &tile[0][0];
  const int64_t ld = full ? ldc : kNR;
  if (!full && !first)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < kNR; ++j) tile[i][j] = j < ncols ? c[i * ldc + j] : 0.f;
  // Named accumulators, not an array: GCC kept an array of them on the stack, storing every
  // one back each k.
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define SERVELM_LOAD(i)                                                        \
  if (MR > i) {                                                               \
    if (first) {                                                              \
      c##i##0 = c##i##1 = _mm256_setzero_ps();                                \
    } else {                                                                  \
      c##i##0 = _mm256_loadu_ps(cc + i * ld);                                 \
      c##i##1 = _mm256_loadu_ps(cc + i * ld + 8);                             \
    }                                                                         \
  }
  SERVELM_LOAD(0) SERVELM_LOAD(1) SERVELM_LOAD(2) SERVELM_LOAD(3) SERVELM_LOAD(4) SERVELM_LOAD(5)
#undef SERVELM_LOAD
  for (int64_t k = 0; k < kc; ++k) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * kNR), _MM_HINT_T0);
    const __m256 b0 = load8f(b + k * kNR), b1 = load8f(b + k * kNR + 8);
#define SERVELM_FMA(i)                                                         \
  if (MR > i) {                                                               \
    const __m256 av = _mm256_broadcast_ss(a + i * lda + k);                   \
    c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);                               \
    c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);                               \
  }
    SERVELM_FMA(0) SERVELM_FMA(1) SERVELM_FMA(2) SERVELM_FMA(3) SERVELM_FMA(4) SERVELM_FMA(5)
#undef SERVELM_FMA
  }
  __m256 bias0 = _mm256_setzero_ps(), bias1 = _mm256_setzero_ps();
  if (bias) {
    alignas(32) float bt[kNR] = {0};
    for (int j = 0; j < ncols; ++j) bt[j] = bias[j];
    bias0 = _mm256_load_ps(bt);
    bias1 = _mm256_load_ps(bt + 8);
  }
#define SERVELM_STORE(i)                                                       \
  if (MR > i) {                                                               \
    if (bias) {                                                               \
      c##i##0 = _mm256_add_ps(c##i##0, bias0);                                \
      c##i##1 = _mm256_add_ps(c##i##1, bias1);                                \
    }                                                                         \
    _mm256_storeu_ps(cc + i * ld, c##i##0);                                   \
    _mm256_storeu_ps(cc + i * ld + 8, c##i##1);                               \
  }
  SERVELM_STORE(0) SERVELM_STORE(1) SERVELM_STORE(2) SERVELM_STORE(3) SERVELM_STORE(4) SERVELM_STORE(5)
#undef SERVELM_STORE
  if (!full)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < ncols; ++j) c[i * ldc + j] = tile[i][j];
}

// One activation row against 4 whole panels over all of K: 8 accumulators, so the FMA
// latency is hidden when there is a single row to multiply (decode). Each output is the same
// chain as micro's, bit for bit.
template <typename W>
inline void row_x4(const float* a, const W* b, int64_t K, float* c, const float* bias) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  const int64_t stride = K * kNR;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 av = _mm256_broadcast_ss(a + k);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      acc[j] = _mm256_fmadd_ps(av, load8f(b + (j >> 1) * stride + k * kNR + (j & 1) * 8), acc[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const int col = (j >> 1) * kNR + (j & 1) * 8;
    __m256 v = acc[j];
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + col));
    _mm256_storeu_ps(c + col, v);
  }
}

// Rows [m0, m1) of one panel over one K block, kMR rows at a time and the rest in one call;
// the first call prefetches `next` (see micro).
template <typename W>
void rows(const float* x, int64_t K, const W* b, int64_t k0, int64_t kc, float* c, int64_t N,
          int64_t m0, int64_t m1, int ncols, const float* bias, const W* next) {
  const bool first = k0 == 0;
  const float* bl = k0 + kc == K ? bias : nullptr;
  int64_t m = m0;
  for (; m + kMR <= m1; m += kMR, next = nullptr)
    micro<kMR>(x + m * K + k0, K, b, kc, c + m * N, N, ncols, first, bl, next);
  const float* a = x + m * K + k0;
  float* cm = c + m * N;
  switch (m1 - m) {
    case 5: micro<5>(a, K, b, kc, cm, N, ncols, first, bl, next); break;
    case 4: micro<4>(a, K, b, kc, cm, N, ncols, first, bl, next); break;
    case 3: micro<3>(a, K, b, kc, cm, N, ncols, first, bl, next); break;
    case 2: micro<2>(a, K, b, kc, cm, N, ncols, first, bl, next); break;
    case 1: micro<1>(a, K, b, kc, cm, N, ncols, first, bl, next); break;
    default: break;
  }
}

template <typename W>
void gemm(const float* x, const W* panels, const float* bias, float* out, int64_t M, int64_t N,
          int64_t K) {
  const int64_t NP = (N + kNR - 1) / kNR;
  // bf16 panels for many rows: each K block widened to fp32 once into L1 and multiplied from
  // there, instead of widened again by every 6-row micro-kernel call (exact, so the same bits).
  const bool widen = !std::is_same<W, float>::value && M >= kWidenRows;
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    if (M == 1) {
      // Whole panels 4 at a time; the last, partial panel (if any) by micro below.
      const int64_t whole = N / kNR;
      for (; p0 + 4 <= std::min(p1, whole); p0 += 4)
        row_x4(x, panels + p0 * K * kNR, K, out + p0 * kNR, bias ? bias + p0 * kNR : nullptr);
    }
    alignas(64) float buf[std::is_same<W, float>::value ? 1 : kKC * kNR];
    for (int64_t m0 = 0; m0 < M; m0 += kMC) {
      const int64_t m1 = std::min(M, m0 + kMC);
      for (int64_t p = p0; p < p1; ++p) {
        const int ncols = static_cast<int>(std::min<int64_t>(kNR, N - p * kNR));
        const W* panel = panels + p * K * kNR;
        const float* bp = bias ? bias + p * kNR : nullptr;
        for (int64_t k0 = 0; k0 < K; k0 += kKC) {
          const int64_t kc = std::min(kKC, K - k0);
          if (widen) {
            const W* b = panel + k0 * kNR;
            for (int64_t i = 0; i < kc * kNR; i += 8) _mm256_store_ps(buf + i, load8f(b + i));
            rows(x, K, static_cast<const float*>(buf), k0, kc, out + p * kNR, N, m0, m1, ncols,
                 bp, static_cast<const float*>(nullptr));
            continue;
          }
          // The block after this one: the panel's next K block, else the next panel's first.
          const W* next = k0 + kKC < K ? panel + (k0 + kKC) * kNR
                                       : (p + 1 < p1 ? panel + K * kNR : nullptr);
          rows(x, K, panel + k0 * kNR, k0, kc, out + p * kNR, N, m0, m1, ncols, bp, next);
        }
      }
    }
  });
}

// Row k of an int4 panel (8 bytes: 16 nibbles) decoded to fp32: s * q, then + m.
inline void decode16(const uint8_t* qk, __m256 s0, __m256 s1, __m256 m0, __m256 m1, __m256& w0,
                     __m256& w1) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qk)));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  w0 = _mm256_add_ps(_mm256_mul_ps(lo, s0), m0);
  w1 = _mm256_add_ps(_mm256_mul_ps(hi, s1), m1);
}

// Rows [k0, k0 + kc) of an int4 panel decoded to fp32 [kc][16] (groups of gs inputs).
inline void decode_q4(const uint8_t* q, const c10::Half* sc, const c10::Half* mn, int64_t k0,
                      int64_t kc, int64_t gs, float* dst) {
  for (int64_t k = k0; k < k0 + kc;) {
    const int64_t g = k / gs, kend = std::min(k0 + kc, (g + 1) * gs);
    const __m256 s0 = load8f(sc + g * kNR), s1 = load8f(sc + g * kNR + 8);
    const __m256 m0 = load8f(mn + g * kNR), m1 = load8f(mn + g * kNR + 8);
    for (; k < kend; ++k) {
      __m256 w0, w1;
      decode16(q + k * 8, s0, s1, m0, m1, w0, w1);
      _mm256_store_ps(dst + (k - k0) * kNR, w0);
      _mm256_store_ps(dst + (k - k0) * kNR + 8, w1);
    }
  }
}

// R rows (R <= 4) against P int4 panels (P <= 2), the weights decoded in registers as they
// are used: for a few rows, where a decoded block would serve too few of them. Each output
// is micro's chain over k (the same decoded weights, the same fused multiply-adds in order,
// then the bias), so the same bits as the buffered path.
template <int R, int P>
inline void rows_q4_direct(const float* x, int64_t K, const uint8_t* q, const c10::Half* sc,
                           const c10::Half* mn, int64_t gs, float* c, int64_t ldc, int ncols,
                           const float* bias) {
  const int64_t G = K / gs;
  __m256 acc[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 s[P][2], m[P][2];
    for (int j = 0; j < P; ++j)
      for (int h = 0; h < 2; ++h) {
        s[j][h] = load8f(sc + (j * G + g) * kNR + 8 * h);
        m[j][h] = load8f(mn + (j * G + g) * kNR + 8 * h);
      }
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
#pragma GCC unroll 2
      for (int j = 0; j < P; ++j) {
        __m256 w0, w1;
        decode16(q + (j * K + k) * 8, s[j][0], s[j][1], m[j][0], m[j][1], w0, w1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256 av = _mm256_broadcast_ss(x + r * K + k);
          acc[r][j][0] = _mm256_fmadd_ps(av, w0, acc[r][j][0]);
          acc[r][j][1] = _mm256_fmadd_ps(av, w1, acc[r][j][1]);
        }
      }
    }
  }
  for (int j = 0; j < P; ++j) {
    const int nc = std::min(kNR, ncols - j * kNR);
    alignas(32) float bt[kNR] = {0};
    if (bias)
      for (int n = 0; n < nc; ++n) bt[n] = bias[j * kNR + n];
    for (int r = 0; r < R; ++r) {
      alignas(32) float t[kNR];
      __m256 v0 = acc[r][j][0], v1 = acc[r][j][1];
      if (bias) v0 = _mm256_add_ps(v0, _mm256_load_ps(bt)), v1 = _mm256_add_ps(v1, _mm256_load_ps(bt + 8));
      _mm256_store_ps(t, v0);
      _mm256_store_ps(t + 8, v1);
      std::copy(t, t + nc, c + r * ldc + j * kNR);
    }
  }
}

// Rows [m0, m1) (fewer than kDirectRows) of panels [p0, p1) on rows_q4_direct: 4 rows at a
// time, the rest together; one or two rows take two panels at a time (4 or 8 accumulators
// cover the FMA latency).
void q4_direct(const float* x, const uint8_t* qp, const c10::Half* sc, const c10::Half* mn,
               int64_t gs, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
               int64_t p0, int64_t p1) {
  const int64_t G = K / gs;
  for (int64_t p = p0; p < p1;) {
    const int P = (M <= 2 && p + 1 < p1) ? 2 : 1;
    const int ncols = static_cast<int>(std::min<int64_t>(P * kNR, N - p * kNR));
    const uint8_t* q = qp + p * K * 8;
    const c10::Half* s = sc + p * G * kNR;
    const c10::Half* m = mn + p * G * kNR;
    const float* bp = bias ? bias + p * kNR : nullptr;
    for (int64_t r = 0; r < M;) {
      const int64_t n = std::min<int64_t>(4, M - r);
      const float* a = x + r * K;
      float* c = out + r * N + p * kNR;
      if (P == 2) {
        if (n == 2) rows_q4_direct<2, 2>(a, K, q, s, m, gs, c, N, ncols, bp);
        else rows_q4_direct<1, 2>(a, K, q, s, m, gs, c, N, ncols, bp);
        r += n == 2 ? 2 : 1;
        continue;
      }
      switch (n) {
        case 4: rows_q4_direct<4, 1>(a, K, q, s, m, gs, c, N, ncols, bp); break;
        case 3: rows_q4_direct<3, 1>(a, K, q, s, m, gs, c, N, ncols, bp); break;
        case 2: rows_q4_direct<2, 1>(a, K, q, s, m, gs, c, N, ncols, bp); break;
        default: rows_q4_direct<1, 1>(a, K, q, s, m, gs, c, N, ncols, bp); break;
      }
      r += n;
    }
    p += P;
  }
}

// gemm's loops over quantised panels: each K block of a panel decoded by
// decode(p, k0, kc, buf) into an L1 buffer, then multiplied by the row block as gemm multiplies
// an fp32 panel's block (the same operations, so the same bits, and row-invariant as gemm is).
template <typename Decode>
void gemm_decoded(const float* x, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                  int64_t p0, int64_t p1, const Decode& decode) {
  alignas(64) float buf[kKC * kNR];
  for (int64_t m0 = 0; m0 < M; m0 += kMC) {
    const int64_t m1 = std::min(M, m0 + kMC);
    for (int64_t p = p0; p < p1; ++p) {
      const int ncols = static_cast<int>(std::min<int64_t>(kNR, N - p * kNR));
      const float* bp = bias ? bias + p * kNR : nullptr;
      for (int64_t k0 = 0; k0 < K; k0 += kKC) {
        const int64_t kc = std::min(kKC, K - k0);
        decode(p, k0, kc, buf);
        rows(x, K, static_cast<const float*>(buf), k0, kc, out + p * kNR, N, m0, m1, ncols, bp,
             static_cast<const float*>(nullptr));
      }
    }
  }
}

// int4 panels: 1-4 rows decode in registers (q4_direct), more through the block buffer.
void gemm_q4(const float* x, const uint8_t* qp, const c10::Half* sc, const c10::Half* mn,
             int64_t gs, const float* bias, float* out, int64_t M, int64_t N, int64_t K) {
  const int64_t NP = (N + kNR - 1) / kNR, G = K / gs;
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    if (M < kDirectRows) return q4_direct(x, qp, sc, mn, gs, bias, out, M, N, K, p0, p1);
    gemm_decoded(x, bias, out, M, N, K, p0, p1, [&](int64_t p, int64_t k0, int64_t kc, float* buf) {
      decode_q4(qp + p * K * 8, sc + p * G * kNR, mn + p * G * kNR, k0, kc, gs, buf);
    });
  });
}

// Row k of an int8 panel (16 bytes) as fp32: q * s (s: the 16 outputs' scales).
inline void decode16_q8(const int8_t* qk, __m256 s0, __m256 s1, __m256& w0, __m256& w1) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qk));
  w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s0);
  w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), s1);
}

// int8 panels: every call decodes into the block buffer.
void gemm_q8(const float* x, const int8_t* qp, const float* sc, const float* bias, float* out,
             int64_t M, int64_t N, int64_t K) {
  const int64_t NP = (N + kNR - 1) / kNR;
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    gemm_decoded(x, bias, out, M, N, K, p0, p1, [&](int64_t p, int64_t k0, int64_t kc, float* buf) {
      const __m256 s0 = _mm256_loadu_ps(sc + p * kNR), s1 = _mm256_loadu_ps(sc + p * kNR + 8);
      const int8_t* q = qp + (p * K + k0) * kNR;
      for (int64_t k = 0; k < kc; ++k) {
        __m256 w0, w1;
        decode16_q8(q + k * kNR, s0, s1, w0, w1);
        _mm256_store_ps(buf + k * kNR, w0);
        _mm256_store_ps(buf + k * kNR + 8, w1);
      }
    });
  });
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& qpanels, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t group_size, int64_t N,
                       const c10::optional<at::Tensor>& bias) {
  const char* name = "servelm_panels.int4_linear";
  TORCH_CHECK(qpanels.device().is_cpu() && qpanels.scalar_type() == at::kByte && qpanels.dim() == 3 &&
                  qpanels.size(2) == 8 && qpanels.is_contiguous(),
              name, ": qpanels must be contiguous uint8 [ceil(N / 16), K, 8] on the CPU");
  const int64_t NP = qpanels.size(0), K = qpanels.size(1);
  TORCH_CHECK(N > 0 && (N + kNR - 1) / kNR == NP, name, ": out_features ", N, " does not match ",
              NP, " panels of 16");
  TORCH_CHECK(group_size > 0 && K % group_size == 0, name, ": group_size ", group_size,
              " does not divide in_features ", K);
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == NP && t->size(1) == K / group_size && t->size(2) == kNR,
                name, ": scales and mins must be contiguous float16 [ceil(N / 16), K / group_size, 16]");
  check_x(x_in, name);
  return run_linear(x_in, K, N, bias, name, [&](const float* x, const float* b, float* out, int64_t M) {
    gemm_q4(x, qpanels.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(),
            mins.data_ptr<c10::Half>(), group_size, b, out, M, N, K);
  });
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& qpanels, const at::Tensor& scales,
                       int64_t N, const c10::optional<at::Tensor>& bias) {
  const char* name = "servelm_panels.int8_linear";
  TORCH_CHECK(qpanels.device().is_cpu() && qpanels.scalar_type() == at::kChar && qpanels.dim() == 3 &&
                  qpanels.size(2) == kNR && qpanels.is_contiguous(),
              name, ": qpanels must be contiguous int8 [ceil(N / 16), K, 16] on the CPU");
  const int64_t NP = qpanels.size(0), K = qpanels.size(1);
  TORCH_CHECK(N > 0 && (N + kNR - 1) / kNR == NP, name, ": out_features ", N, " does not match ",
              NP, " panels of 16");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 1 &&
                  scales.size(0) == NP * kNR,
              name, ": scales must be contiguous float32 [16 ceil(N / 16)]");
  check_x(x_in, name);
  return run_linear(x_in, K, N, bias, name, [&](const float* x, const float* b, float* out, int64_t M) {
    gemm_q8(x, qpanels.data_ptr<int8_t>(), scales.data_ptr<float>(), b, out, M, N, K);
  });
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t N,
                  const c10::optional<at::Tensor>& bias) {
  const at::ScalarType pt = panels.scalar_type();
  TORCH_CHECK(panels.device().is_cpu() && (pt == at::kFloat || pt == at::kBFloat16) &&
                  panels.dim() == 3 && panels.size(2) == kNR && panels.is_contiguous(),
              "servelm_panels.linear: panels must be contiguous float32 or bfloat16 "
              "[ceil(N / 16), K, 16] on the CPU");
  const int64_t K = panels.size(1);
  TORCH_CHECK(N > 0 && (N + kNR - 1) / kNR == panels.size(0),
              "servelm_panels.linear: out_features ", N, " does not match ", panels.size(0),
              " panels of 16");
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat ||
                                         (pt == at::kBFloat16 && x_in.scalar_type() == at::kBFloat16)),
              "servelm_panels.linear: x must be ", pt == at::kFloat ? "float32" : "bfloat16 or float32",
              " on the CPU, got ", x_in.scalar_type());
  return run_linear(x_in, K, N, bias, "servelm_panels.linear",
                    [&](const float* x, const float* b, float* out, int64_t M) {
    if (pt == at::kFloat)
      gemm(x, panels.data_ptr<float>(), b, out, M, N, K);
    else
      gemm(x, reinterpret_cast<const c10::BFloat16*>(panels.data_ptr()), b, out, M, N, K);
  });
}

}  // namespace

TORCH_LIBRARY(servelm_panels, m) {
  m.def("linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor qpanels, Tensor scales, Tensor mins, int group_size, "
        "int out_features, Tensor? bias=None) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qpanels, Tensor scales, int out_features, "
        "Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_panels, CPU, m) {
  m.impl("linear", &linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}

#endif  // AVX2 + FMA + F16C
