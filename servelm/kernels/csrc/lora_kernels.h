// LoRA deltas of an adapted linear layer (servelm/layers/lora.py's layout), shared by ops.cpp
// (servelm_ops.lora_add) and decode_stack.cpp (the DecodeStack adds them inside its step), so
// both paths give the same bits:
//
//   y[m, c] += B[s, c, :] . (A[s, jR:(j+1)R, :] x[m])   row m of slot s >= 0, column c of part j
//
// with lora_a [S, J*R, K], lora_b [S, N, R], x [M, K], y [M, N], all of one dtype T (bf16 or
// fp32), accumulated in fp32 and rounded into y once. Rows are grouped by slot (RowGroups), so
// each resident adapter's A and B stream through memory once per call:
//   shrink  t[m, i] = A[s, i, :] . x[m] (fp32), work items (a chunk of a slot's rows, a row i of A);
//   expand  y[m, c] = round(y[m, c] + sum_r t[m, jR + r] B[s, c, r]), work items 16-column blocks.
// Each value's arithmetic is fixed (a dot's four 16-lane accumulators over K in order, then their
// sum; an expand column's FMA chain over r in order) whatever thread computes it, so a row's delta
// is the same on the op and in the stack however each splits the work.
//
// Prompt-sized calls (hundreds of rows of one slot) run the same loops, blocked kNR rows at a
// time: one load of a row of A (or of B's transposed block) serves kNR rows, and a slot's A and
// B (r x (K + N) elements, tens of KB) stay in L1/L2 while its rows stream past. at::matmul per
// slot would gather the slot's rows into a copy, scatter the result back, and round differently
// with the row count (a row's delta would then depend on the batch it is in).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include "decode_attention.h"  // transpose16x16
#define SERVELM_LORA_AVX512 1
#endif

namespace {
namespace lora {

constexpr int64_t kRowChunk = 64;  // rows of one slot a shrink item takes
constexpr int kNR = 4;             // rows computed together (one load of A or B serves them)

// The step's rows grouped by slot: rows[begin[g] .. begin[g + 1]) are group g's (slot slot[g],
// rows ascending); chunks of at most kRowChunk of them are the shrink's work items.
struct RowGroups {
  std::vector<int32_t> rows;
  std::vector<int64_t> slot, begin;
  std::vector<int64_t> chunk_group, chunk_begin, chunk_end;

  bool empty() const { return slot.empty(); }
  int64_t chunks() const { return static_cast<int64_t>(chunk_group.size()); }

  // row_slots [M] (-1: no adapter; else < S).
  void build(const int32_t* row_slots, int64_t M, int64_t S, const char* who) {
    rows.clear(), slot.clear(), begin.clear();
    chunk_group.clear(), chunk_begin.clear(), chunk_end.clear();
    std::vector<int64_t> at(S + 1, 0);
    for (int64_t m = 0; m < M; ++m) {
      const int32_t s = row_slots[m];
      TORCH_CHECK(s >= -1 && s < S, who, ": row slot ", s, " of row ", m, " is outside [-1, ", S, ")");
      if (s >= 0) ++at[s + 1];
    }
    for (int64_t s = 0; s < S; ++s) {
      if (at[s + 1]) slot.push_back(s), begin.push_back(at[s]);
      at[s + 1] += at[s];
    }
    if (slot.empty()) return;
    begin.push_back(at[S]);
    rows.resize(at[S]);
    for (int64_t m = 0; m < M; ++m)
      if (row_slots[m] >= 0) rows[at[row_slots[m]]++] = static_cast<int32_t>(m);
    for (size_t g = 0; g + 1 < begin.size(); ++g)
      for (int64_t b = begin[g]; b < begin[g + 1]; b += kRowChunk) {
        chunk_group.push_back(static_cast<int64_t>(g));
        chunk_begin.push_back(b);
        chunk_end.push_back(std::min(b + kRowChunk, begin[g + 1]));
      }
  }
};

// One adapted linear layer's stacked adapters (pointers into tensors its owner keeps) and the
// expand's column blocks: 16 columns at most, never across a part's bounds.
template <typename T>
struct Adapter {
  const T* a = nullptr;  // [S, J * R, K]
  const T* b = nullptr;  // [S, N, R]
  int64_t S = 0, J = 0, R = 0, K = 0, N = 0;
  std::vector<int64_t> block_part, block_col;  // per block: its part and first column
  std::vector<int> block_width;

  bool bound() const { return a != nullptr; }
  int64_t JR() const { return J * R; }
  int64_t blocks() const { return static_cast<int64_t>(block_part.size()); }
};

// The adapter of a layer with N outputs and K inputs, its tensors checked.
template <typename T>
Adapter<T> make_adapter(const at::Tensor& lora_a, const at::Tensor& lora_b, at::IntArrayRef bounds,
                        int64_t N, int64_t K, const char* who) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.is_contiguous() && lora_b.is_contiguous() &&
                  lora_a.scalar_type() == dtype && lora_b.scalar_type() == dtype &&
                  lora_a.device().is_cpu() && lora_b.device().is_cpu(),
              who, ": lora_a [S, J*R, K] and lora_b [S, N, R] must be contiguous ", dtype, " on the CPU");
  const int64_t J = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(J >= 1 && bounds[0] == 0 && bounds[J] == N, who, ": bounds must run from 0 to N = ", N,
              " (J + 1 ints), got ", bounds);
  for (int64_t j = 0; j < J; ++j)
    TORCH_CHECK(bounds[j] <= bounds[j + 1], who, ": bounds must not decrease, got ", bounds);
  Adapter<T> L;
  L.S = lora_a.size(0), L.J = J, L.R = lora_b.size(2), L.K = K, L.N = N;
  TORCH_CHECK(lora_b.size(0) == L.S && lora_b.size(1) == N && lora_a.size(1) == J * L.R &&
                  lora_a.size(2) == K && L.R >= 1,
              who, ": lora_a ", lora_a.sizes(), " and lora_b ", lora_b.sizes(), " do not fit a layer of ",
              K, " inputs and ", N, " outputs in ", J, " parts (lora_a [S, J*R, K], lora_b [S, N, R])");
  L.a = lora_a.data_ptr<T>();
  L.b = lora_b.data_ptr<T>();
  for (int64_t j = 0; j < J; ++j)
    for (int64_t c = bounds[j]; c < bounds[j + 1]; c += 16) {
      L.block_part.push_back(j);
      L.block_col.push_back(c);
      L.block_width.push_back(static_cast<int>(std::min<int64_t>(16, bounds[j + 1] - c)));
    }
  return L;
}

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#ifdef SERVELM_LORA_AVX512
// 16 (or the first `k` of 16) elements as fp32; fp32 stored back to T, rounded to nearest even as
// c10::BFloat16 rounds.
template <typename T> inline __m512 ld16(const T* p, __mmask16 k);
template <> inline __m512 ld16<float>(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
template <> inline __m512 ld16<c10::BFloat16>(const c10::BFloat16* p, __mmask16 k) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <typename T> inline __m512 ld16(const T* p);
template <> inline __m512 ld16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 ld16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <typename T> inline void st16(T* p, __m512 v, __mmask16 k);
template <> inline void st16<float>(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
template <> inline void st16<c10::BFloat16>(c10::BFloat16* p, __m512 v, __mmask16 k) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(r));
}

// bt[r * 16 + i] = B[i, r] (fp32) for a block of w <= 16 columns of B (rows R apart), zero
// for i >= w: 16 x 16 tiles transposed in registers.
template <typename T>
inline void transpose_block(const T* b, int64_t R, int w, float* bt) {
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const int64_t n = std::min<int64_t>(16, R - r0);
    const __mmask16 k = static_cast<__mmask16>(n == 16 ? 0xffffu : (1u << n) - 1);
    __m512i v[16];
    for (int i = 0; i < 16; ++i)
      v[i] = i < w ? _mm512_castps_si512(ld16<T>(b + i * R + r0, k)) : _mm512_setzero_si512();
    transpose16x16(v);
    for (int64_t r = 0; r < n; ++r) _mm512_storeu_ps(bt + (r0 + r) * 16, _mm512_castsi512_ps(v[r]));
  }
}

// out[r] = a . x[r] for NR rows: 16-lane chunk q of K goes to accumulator q % 4 (the last,
// partial chunk masked), then (acc0 + acc1) + (acc2 + acc3) summed across lanes.
template <typename T, int NR>
inline void dot_rows(const T* a, const T* const* x, int64_t K, float* out) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64)
    for (int u = 0; u < 4; ++u) {
      const __m512 av = ld16<T>(a + k + 16 * u);
      for (int r = 0; r < NR; ++r) acc[r][u] = _mm512_fmadd_ps(av, ld16<T>(x[r] + k + 16 * u), acc[r][u]);
    }
  int u = 0;
  for (; k + 16 <= K; k += 16, ++u) {
    const __m512 av = ld16<T>(a + k);
    for (int r = 0; r < NR; ++r) acc[r][u] = _mm512_fmadd_ps(av, ld16<T>(x[r] + k), acc[r][u]);
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 av = ld16<T>(a + k, m);
    for (int r = 0; r < NR; ++r) acc[r][u] = _mm512_fmadd_ps(av, ld16<T>(x[r] + k, m), acc[r][u]);
  }
  for (int r = 0; r < NR; ++r)
    out[r] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}
#ifdef __AVX512BF16__
// bf16 rows where the CPU has AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs a step (each
// product exact in fp32) into 16 fp32 lanes, with no widening of either operand; lane sums
// then as above. The op and the DecodeStack share it, so their bits still agree.
template <>
inline void dot_rows<c10::BFloat16, kNR>(const c10::BFloat16* a, const c10::BFloat16* const* x, int64_t K,
                                         float* out) {
  __m512 acc[kNR][2];
  for (int r = 0; r < kNR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64)
    for (int u = 0; u < 2; ++u) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(a + k + 32 * u);
      for (int r = 0; r < kNR; ++r)
        acc[r][u] = _mm512_dpbf16_ps(acc[r][u], av, (__m512bh)_mm512_loadu_si512(x[r] + k + 32 * u));
    }
  for (; k < K; k += 32) {
    const int64_t n = std::min<int64_t>(32, K - k);
    const __mmask32 m = n == 32 ? 0xffffffffu : static_cast<__mmask32>((1u << n) - 1);
    const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m, a + k);
    for (int r = 0; r < kNR; ++r)
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, (__m512bh)_mm512_maskz_loadu_epi16(m, x[r] + k));
  }
  for (int r = 0; r < kNR; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

template <>
inline void dot_rows<c10::BFloat16, 1>(const c10::BFloat16* a, const c10::BFloat16* const* x, int64_t K,
                                       float* out) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + 64 <= K; k += 64)
    for (int u = 0; u < 2; ++u)
      acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(a + k + 32 * u),
                                (__m512bh)_mm512_loadu_si512(x[0] + k + 32 * u));
  for (; k < K; k += 32) {
    const int64_t n = std::min<int64_t>(32, K - k);
    const __mmask32 m = n == 32 ? 0xffffffffu : static_cast<__mmask32>((1u << n) - 1);
    acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_maskz_loadu_epi16(m, a + k),
                              (__m512bh)_mm512_maskz_loadu_epi16(m, x[0] + k));
  }
  out[0] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}
#endif
#else
template <typename T, int NR>
inline void dot_rows(const T* a, const T* const* x, int64_t K, float* out) {
  for (int r = 0; r < NR; ++r) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += as_float(a[k]) * as_float(x[r][k]);
    out[r] = acc;
  }
}
#endif

// Shrink items [i0, i1) of (G.chunks() x L.JR()): item c * JR + i sets t[m * JR + i] = A[s, i] . x[m]
// for the rows m of chunk c (slot s). x rows are ldx apart.
template <typename T>
__attribute__((noinline)) void shrink(const Adapter<T>& L, const RowGroups& G, const T* x, int64_t ldx,
                                      float* t, int64_t i0, int64_t i1) {
  const int64_t JR = L.JR(), K = L.K;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t c = item / JR, i = item % JR;
    const T* a = L.a + (G.slot[G.chunk_group[c]] * JR + i) * K;
    const int32_t* rows = G.rows.data() + G.chunk_begin[c];
    const int64_t n = G.chunk_end[c] - G.chunk_begin[c];
    float out[kNR];
    int64_t r = 0;
    for (; r + kNR <= n; r += kNR) {
      const T* xr[kNR];
      for (int q = 0; q < kNR; ++q) xr[q] = x + rows[r + q] * ldx;
      dot_rows<T, kNR>(a, xr, K, out);
      for (int q = 0; q < kNR; ++q) t[rows[r + q] * JR + i] = out[q];
    }
    for (; r < n; ++r) {
      const T* xr[1] = {x + rows[r] * ldx};
      dot_rows<T, 1>(a, xr, K, out);
      t[rows[r] * JR + i] = out[0];
    }
  }
}

// Expand blocks [b0, b1) of L.blocks(), every group's rows: y[m, c] = round(y[m, c] + the FMA
// chain over r of t[m * JR + jR + r] * B[s, c, r]). bt: 16 * R floats of scratch (B's block
// transposed, 16 columns a rank).
template <typename T>
__attribute__((noinline)) void expand(const Adapter<T>& L, const RowGroups& G, const float* t, T* y,
                                      int64_t ldy, int64_t b0, int64_t b1, float* bt) {
  const int64_t R = L.R, JR = L.JR();
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t c0 = L.block_col[blk];
    const int w = L.block_width[blk];
    const float* tj0 = t + L.block_part[blk] * R;
    for (size_t g = 0; g + 1 < G.begin.size(); ++g) {
      const T* b = L.b + (G.slot[g] * L.N + c0) * R;
      const int32_t* rows = G.rows.data() + G.begin[g];
      const int64_t n = G.begin[g + 1] - G.begin[g];
#ifdef SERVELM_LORA_AVX512
      transpose_block<T>(b, R, w, bt);
      const __mmask16 mask = static_cast<__mmask16>(w == 16 ? 0xffffu : (1u << w) - 1);
      int64_t q = 0;
      for (; q + kNR <= n; q += kNR) {
        __m512 acc[kNR];
        for (int p = 0; p < kNR; ++p) acc[p] = _mm512_setzero_ps();
        for (int64_t r = 0; r < R; ++r) {
          const __m512 bv = _mm512_loadu_ps(bt + r * 16);
          for (int p = 0; p < kNR; ++p)
            acc[p] = _mm512_fmadd_ps(_mm512_set1_ps(tj0[rows[q + p] * JR + r]), bv, acc[p]);
        }
        for (int p = 0; p < kNR; ++p) {
          T* yp = y + rows[q + p] * ldy + c0;
          st16<T>(yp, _mm512_add_ps(ld16<T>(yp, mask), acc[p]), mask);
        }
      }
      for (; q < n; ++q) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t r = 0; r < R; ++r)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(tj0[rows[q] * JR + r]), _mm512_loadu_ps(bt + r * 16), acc);
        T* yp = y + rows[q] * ldy + c0;
        st16<T>(yp, _mm512_add_ps(ld16<T>(yp, mask), acc), mask);
      }
#else
      for (int i = 0; i < 16; ++i)
        for (int64_t r = 0; r < R; ++r) bt[r * 16 + i] = i < w ? as_float(b[i * R + r]) : 0.f;
      for (int64_t q = 0; q < n; ++q) {
        const float* tm = tj0 + rows[q] * JR;
        T* yp = y + rows[q] * ldy + c0;
        for (int i = 0; i < w; ++i) {
          float acc = 0.f;
          for (int64_t r = 0; r < R; ++r) acc += tm[r] * bt[r * 16 + i];
          yp[i] = static_cast<T>(as_float(yp[i]) + acc);
        }
      }
#endif
    }
  }
}

}  // namespace lora
}  // namespace
