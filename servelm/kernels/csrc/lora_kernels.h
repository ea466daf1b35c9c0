// LoRA deltas of an adapted linear layer (servelm/layers/lora.py's layout), shared by ops.cpp
// (servelm_ops.lora_add) and decode_stack.cpp (the DecodeStack adds them inside its step), so
// both paths give the same bits:
//
//   y[m, c] += sum_r B[s, r, c] (A[s, jR + r, :] . x[m])   row m of slot s >= 0, column c of part j
//
// with lora_a [S, J*R, K], lora_b [S, P, N, 2] (B in rank pairs, P = ceil(R / 2): rank r of
// column c at [s, r / 2, c, r % 2], what vdpbf16ps multiplies; an odd R's last pair half zero),
// x [M, K], y [M, N], all of one dtype T (bf16 or fp32), accumulated in fp32 and rounded into y
// once. Rows are grouped by slot (RowGroups), so each resident adapter's A and
// B stream through memory once per call:
//   shrink  t[m, j, r] = T(A[s, jR + r, :] . x[m]): an fp32 dot rounded to T, as a model's
//           lora_A output is; work items (a chunk of a slot's rows, a row of A);
//   expand  y[m, c] = round(y[m, c] + delta), work items panels of up to 64 columns of a part,
//           4 rows x 4 vectors of 16 columns a tile, where delta is
//           - bf16 on AVX512-BF16: vdpbf16ps over the rank pairs in order;
//           - otherwise: an fp32 FMA chain over r in order of t[m, j, r] B[s, r, c].
// Each value's arithmetic is fixed (a dot's accumulators over K in order, then their sum; an
// expand column's chain over r in order) whatever thread computes it, so a row's delta is the
// same on the op and in the stack however each splits the work.
//
// Prompt-sized calls (hundreds of rows of one slot) run the same loops, blocked kNR rows at a
// time: one load of a row of A (or of a B vector) serves kNR rows, and a slot's A and B
// (r x (K + N) elements, tens of KB) stay in L1/L2 while its rows stream past. at::matmul per
// slot would gather the slot's rows into a copy, scatter the result back, and round differently
// with the row count (a row's delta would then depend on the batch it is in).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include "decode_attention.h"  // transpose16x16, which amx_tiles.h's helpers use
#include "amx_tiles.h"         // SERVELM_AMX, amx_available, TileConfig
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
  // The most rows any one slot has.
  int64_t most() const {
    int64_t m = 0;
    for (size_t g = 0; g + 1 < begin.size(); ++g) m = std::max(m, begin[g + 1] - begin[g]);
    return m;
  }

  // row_slots [M] (-1: no adapter; else < S): rows [m0, m1) of them (default: all).
  void build(const int32_t* row_slots, int64_t M, int64_t S, const char* who, int64_t m0 = 0, int64_t m1 = -1) {
    if (m1 < 0) m1 = M;
    rows.clear(), slot.clear(), begin.clear();
    chunk_group.clear(), chunk_begin.clear(), chunk_end.clear();
    std::vector<int64_t> at(S + 1, 0);
    for (int64_t m = m0; m < m1; ++m) {
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
    for (int64_t m = m0; m < m1; ++m)
      if (row_slots[m] >= 0) rows[at[row_slots[m]]++] = static_cast<int32_t>(m);
    for (size_t g = 0; g + 1 < begin.size(); ++g)
      for (int64_t b = begin[g]; b < begin[g + 1]; b += kRowChunk) {
        chunk_group.push_back(static_cast<int64_t>(g));
        chunk_begin.push_back(b);
        chunk_end.push_back(std::min(b + kRowChunk, begin[g + 1]));
      }
  }
};

constexpr int kPanel = 64;  // columns of an expand work item: 4 vectors of 16

// One adapted linear layer's stacked adapters (pointers into tensors its owner keeps) and the
// expand's column panels: kPanel columns at most, never across a part's bounds.
template <typename T>
struct Adapter {
  const T* a = nullptr;  // [S, J * R, K]
  const T* b = nullptr;  // [S, P, N, 2]
  int64_t S = 0, J = 0, R = 0, K = 0, N = 0;
  std::vector<int64_t> block_part, block_col;  // per panel: its part and first column
  std::vector<int> block_width;

  bool bound() const { return a != nullptr; }
  int64_t JR() const { return J * R; }
  int64_t P() const { return (R + 1) / 2; }
  int64_t blocks() const { return static_cast<int64_t>(block_part.size()); }
};

// The adapter of a layer with N outputs and K inputs, its tensors checked.
template <typename T>
Adapter<T> make_adapter(const at::Tensor& lora_a, const at::Tensor& lora_b, at::IntArrayRef bounds,
                        int64_t N, int64_t K, const char* who) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 4 && lora_a.is_contiguous() && lora_b.is_contiguous() &&
                  lora_a.scalar_type() == dtype && lora_b.scalar_type() == dtype &&
                  lora_a.device().is_cpu() && lora_b.device().is_cpu(),
              who, ": lora_a [S, J*R, K] and lora_b [S, P, N, 2] must be contiguous ", dtype, " on the CPU");
  const int64_t J = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(J >= 1 && bounds[0] == 0 && bounds[J] == N, who, ": bounds must run from 0 to N = ", N,
              " (J + 1 ints), got ", bounds);
  for (int64_t j = 0; j < J; ++j)
    TORCH_CHECK(bounds[j] <= bounds[j + 1], who, ": bounds must not decrease, got ", bounds);
  Adapter<T> L;
  L.S = lora_a.size(0), L.J = J, L.R = lora_a.size(1) / J, L.K = K, L.N = N;
  TORCH_CHECK(lora_a.size(1) % J == 0 && L.R >= 1 && lora_a.size(2) == K && lora_b.size(0) == L.S &&
                  lora_b.size(1) == L.P() && lora_b.size(2) == N && lora_b.size(3) == 2,
              who, ": lora_a ", lora_a.sizes(), " and lora_b ", lora_b.sizes(), " do not fit a layer of ",
              K, " inputs and ", N, " outputs in ", J, " parts (lora_a [S, J*R, K], lora_b [S, ceil(R/2), N, 2])");
  L.a = lora_a.data_ptr<T>();
  L.b = lora_b.data_ptr<T>();
  for (int64_t j = 0; j < J; ++j)
    for (int64_t c = bounds[j]; c < bounds[j + 1]; c += kPanel) {
      L.block_part.push_back(j);
      L.block_col.push_back(c);
      L.block_width.push_back(static_cast<int>(std::min<int64_t>(kPanel, bounds[j + 1] - c)));
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

// out[r] = a . x[r] for NR rows: 16-lane chunk q of K goes to accumulator q % 4 (the last,
// partial chunk masked), then (acc0 + acc1) + (acc2 + acc3) summed across lanes.
template <typename T, int NR>
inline void dot_rows(const T* a, const T* const* x, int64_t K, float* out) {
  // Every loop over acc unrolled, so its sums live in registers.
  __m512 acc[NR][4];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64)
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const __m512 av = ld16<T>(a + k + 16 * u);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) acc[r][u] = _mm512_fmadd_ps(av, ld16<T>(x[r] + k + 16 * u), acc[r][u]);
    }
  // The tail (under 64): chunk u of 16 (the last masked) to accumulator u.
#pragma GCC unroll 4
  for (int u = 0; u < 4; ++u, k += 16) {
    if (k >= K) break;
    const __mmask16 m = K - k >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 av = ld16<T>(a + k, m);
#pragma GCC unroll 16
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

// Shrink items [i0, i1) of (G.chunks() x L.JR()): item c * JR + i sets t[m, j, r] (i = jR + r) for
// the rows m of chunk c (slot s). x rows are ldx apart; t [M, J, P2] (P2 = R rounded up to even:
// an odd R's last element of each part is set to zero, the other half of the expand's last pair).
inline int64_t paired_ranks(int64_t R) { return (R + 1) & ~int64_t{1}; }

template <typename T>
__attribute__((noinline)) void shrink(const Adapter<T>& L, const RowGroups& G, const T* x, int64_t ldx,
                                      T* t, int64_t i0, int64_t i1) {
  const int64_t JR = L.JR(), K = L.K, R = L.R, P2 = paired_ranks(R), JP = L.J * P2;
  auto put = [&](int32_t m, int64_t i, float v) {
    const int64_t j = i / R, r = i % R;
    t[m * JP + j * P2 + r] = static_cast<T>(v);
    if (r + 1 == R && P2 != R) t[m * JP + j * P2 + R] = static_cast<T>(0.f);
  };
  auto row_of_a = [&](int64_t item) { return L.a + (G.slot[G.chunk_group[item / JR]] * JR + item % JR) * K; };
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t c = item / JR, i = item % JR;
    const T* a = row_of_a(item);
    if (item + 2 < i1)  // the row of A two items on (a slot's rows are in order, slots are not)
      for (int64_t o = 0; o < K * static_cast<int64_t>(sizeof(T)); o += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row_of_a(item + 2)) + o, 0, 3);
    const int32_t* rows = G.rows.data() + G.chunk_begin[c];
    const int64_t n = G.chunk_end[c] - G.chunk_begin[c];
    float out[kNR];
    int64_t r = 0;
    for (; r + kNR <= n; r += kNR) {
      const T* xr[kNR];
      for (int q = 0; q < kNR; ++q) xr[q] = x + rows[r + q] * ldx;
      dot_rows<T, kNR>(a, xr, K, out);
      for (int q = 0; q < kNR; ++q) put(rows[r + q], i, out[q]);
    }
    for (; r < n; ++r) {
      const T* xr[1] = {x + rows[r] * ldx};
      dot_rows<T, 1>(a, xr, K, out);
      put(rows[r], i, out[0]);
    }
  }
}

// Expand panels [b0, b1) of L.blocks(), every group's rows: y[m, c] = round(y[m, c] + delta[m, c])
// (the header's two forms) from the shrink's t.
#if defined(SERVELM_LORA_AVX512) && defined(__AVX512BF16__)
#define SERVELM_LORA_PAIRED 1
#endif

#ifdef SERVELM_LORA_AVX512
// The masks of a panel of w columns: vector k's 16 columns (m16), its 32 bf16 of pairs (m32),
// and as fp32 pairs its first and last 8 columns' 16 floats (lo, hi).
struct PanelMasks {
  __mmask16 m16[4], lo[4], hi[4];
  __mmask32 m32[4];
  explicit PanelMasks(int w) {
    for (int k = 0; k < 4; ++k) {
      const int wk = std::max(0, std::min(16, w - 16 * k));
      m16[k] = static_cast<__mmask16>((1u << wk) - 1);
      m32[k] = wk == 16 ? 0xffffffffu : static_cast<__mmask32>((1u << (2 * wk)) - 1);
      lo[k] = static_cast<__mmask16>((1u << (2 * std::min(wk, 8))) - 1);
      hi[k] = static_cast<__mmask16>((1u << (2 * std::max(wk - 8, 0))) - 1);
    }
  }
};

// Ranks 2i and 2i + 1 of vector k's 16 columns as fp32 (even, odd), from pair row bp.
inline void rank_pair(const float* bp, const PanelMasks& pm, int k, __m512& even, __m512& odd) {
  const __m512 v0 = _mm512_maskz_loadu_ps(pm.lo[k], bp + 32 * k);
  const __m512 v1 = _mm512_maskz_loadu_ps(pm.hi[k], bp + 32 * k + 16);
  even = _mm512_permutex2var_ps(v0, _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), v1);
  odd = _mm512_permutex2var_ps(v0, _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1), v1);
}
inline void rank_pair(const c10::BFloat16* bp, const PanelMasks& pm, int k, __m512& even, __m512& odd) {
  const __m512i v = _mm512_maskz_loadu_epi16(pm.m32[k], bp + 32 * k);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// y[p][16k ..] = round(y + acc[p][k]) for NR rows' NV vectors; bf16 with AVX512-BF16: two vectors
// a vcvtne2ps2bf16 (round to nearest even, as st16; fp32 denormals read as zero).
template <typename T, int NR, int NV, bool Full = false>
inline void add_rows(__m512 (&acc)[NR][NV], T* const* yr, const PanelMasks& pm) {
#ifdef SERVELM_LORA_PAIRED
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
#pragma GCC unroll 4
    for (int p = 0; p < NR; ++p) {
#pragma GCC unroll 2
      for (int k = 0; k + 1 < NV; k += 2) {
        T* yp = yr[p] + 16 * k;
        const __mmask32 m = static_cast<__mmask32>(pm.m16[k]) | (static_cast<__mmask32>(pm.m16[k + 1]) << 16);
        const __m512i v = Full ? _mm512_loadu_si512(yp) : _mm512_maskz_loadu_epi16(m, yp);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
        const __m512 hi =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
        const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_add_ps(hi, acc[p][k + 1]), _mm512_add_ps(lo, acc[p][k]));
        if (Full) _mm512_storeu_si512(yp, (__m512i)r);
        else _mm512_mask_storeu_epi16(yp, m, (__m512i)r);
      }
      if (NV % 2) {
        T* yp = yr[p] + 16 * (NV - 1);
        const __mmask16 m = pm.m16[NV - 1];
        const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(Full ? ld16<T>(yp) : ld16<T>(yp, m), acc[p][NV - 1]));
        if (Full) _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp), (__m256i)r);
        else _mm256_mask_storeu_epi16(yp, m, (__m256i)r);
      }
    }
    return;
  }
#endif
#pragma GCC unroll 4
  for (int p = 0; p < NR; ++p)
#pragma GCC unroll 4
    for (int k = 0; k < NV; ++k) {
      T* yp = yr[p] + 16 * k;
      st16<T>(yp, _mm512_add_ps(ld16<T>(yp, pm.m16[k]), acc[p][k]), pm.m16[k]);
    }
}

// NR rows x NV vectors of a panel: acc over the rank pairs in order, then into y.
// acc[p] stored (fp32, the panel's columns masked) at dr[p] instead of added into y.
template <int NR, int NV>
inline void store_rows(__m512 (&acc)[NR][NV], float* const* dr, const PanelMasks& pm) {
  for (int p = 0; p < NR; ++p)
    for (int k = 0; k < NV; ++k) _mm512_mask_storeu_ps(dr[p] + 16 * k, pm.m16[k], acc[p][k]);
}

// NR rows x NV vectors of a panel: acc over the rank pairs in order, then into y (or, dr not
// null, stored at dr: the delta itself, for a kernel that adds it later, lora::Deltas).
template <typename T, int NR, int NV, bool Full = false>
inline void expand_tile(const T* b, int64_t ldb, const T* const* tr, int64_t P, T* const* yr,
                        const PanelMasks& pm, float* const* dr = nullptr) {
  __m512 acc[NR][NV];
#pragma GCC unroll 4
  for (int p = 0; p < NR; ++p)
#pragma GCC unroll 4
    for (int k = 0; k < NV; ++k) acc[p][k] = _mm512_setzero_ps();
#ifdef SERVELM_LORA_PAIRED
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    for (int64_t i = 0; i < P; ++i) {
      __m512bh bv[NV];
#pragma GCC unroll 4
      for (int k = 0; k < NV; ++k)
        bv[k] = Full ? (__m512bh)_mm512_loadu_si512(b + i * ldb + 32 * k)
                     : (__m512bh)_mm512_maskz_loadu_epi16(pm.m32[k], b + i * ldb + 32 * k);
#pragma GCC unroll 4
      for (int p = 0; p < NR; ++p) {
        uint32_t v;
        std::memcpy(&v, tr[p] + 2 * i, sizeof(v));
        const __m512bh tp = (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
#pragma GCC unroll 4
        for (int k = 0; k < NV; ++k) acc[p][k] = _mm512_dpbf16_ps(acc[p][k], bv[k], tp);
      }
    }
  } else
#endif
  {
    for (int64_t i = 0; i < P; ++i) {
      __m512 even[NV], odd[NV];
#pragma GCC unroll 4
      for (int k = 0; k < NV; ++k) rank_pair(b + i * ldb, pm, k, even[k], odd[k]);
#pragma GCC unroll 4
      for (int p = 0; p < NR; ++p) {
        const __m512 te = _mm512_set1_ps(as_float(tr[p][2 * i]));
        const __m512 to = _mm512_set1_ps(as_float(tr[p][2 * i + 1]));
#pragma GCC unroll 4
        for (int k = 0; k < NV; ++k) acc[p][k] = _mm512_fmadd_ps(to, odd[k], _mm512_fmadd_ps(te, even[k], acc[p][k]));
      }
    }
  }
  // The sums handed on by reference from a copy: with acc's own address taken, GCC stored
  // every sum to the stack after each product.
  __m512 sums[NR][NV];
#pragma GCC unroll 4
  for (int p = 0; p < NR; ++p)
#pragma GCC unroll 4
    for (int k = 0; k < NV; ++k) sums[p][k] = acc[p][k];
  if (dr) store_rows<NR, NV>(sums, dr, pm);
  else add_rows<T, NR, NV, Full>(sums, yr, pm);
}

template <typename T, int NV, bool Full = false>
inline void expand_rows(const T* b, int64_t ldb, const T* t, int64_t ldt, const int32_t* rows, int64_t n,
                        int64_t P, T* y, int64_t ldy, const PanelMasks& pm, float* d, int64_t ldd) {
  int64_t q = 0;
  for (; q + kNR <= n; q += kNR) {
    const T* tr[kNR];
    T* yr[kNR];
    float* dr[kNR];
    for (int p = 0; p < kNR; ++p)
      tr[p] = t + rows[q + p] * ldt, yr[p] = y + rows[q + p] * ldy, dr[p] = d ? d + rows[q + p] * ldd : nullptr;
    expand_tile<T, kNR, NV, Full>(b, ldb, tr, P, yr, pm, d ? dr : nullptr);
  }
  for (; q < n; ++q) {
    const T* tr[1] = {t + rows[q] * ldt};
    T* yr[1] = {y + rows[q] * ldy};
    float* dr[1] = {d ? d + rows[q] * ldd : nullptr};
    expand_tile<T, 1, NV, Full>(b, ldb, tr, P, yr, pm, d ? dr : nullptr);
  }
}

// The vector form over a panel of w columns. A panel of whole vectors (w a multiple of 16)
// loads B and y and stores y unmasked (Full): a step's expand waited on its masked loads of
// B (docs/benchmarks.md, LoRA adapters); a partial panel masks its last vector.
template <typename T, bool Full>
inline void expand_vectors(const T* b, int64_t ldb, const T* t, int64_t ldt, const int32_t* rows, int64_t n,
                           int64_t P, T* y, int64_t ldy, const PanelMasks& pm, int nv, float* d, int64_t ldd) {
  switch (nv) {
    case 1: expand_rows<T, 1, Full>(b, ldb, t, ldt, rows, n, P, y, ldy, pm, d, ldd); break;
    case 2: expand_rows<T, 2, Full>(b, ldb, t, ldt, rows, n, P, y, ldy, pm, d, ldd); break;
    case 3: expand_rows<T, 3, Full>(b, ldb, t, ldt, rows, n, P, y, ldy, pm, d, ldd); break;
    default: expand_rows<T, 4, Full>(b, ldb, t, ldt, rows, n, P, y, ldy, pm, d, ldd); break;
  }
}
template <typename T>
inline void expand_panel(const T* b, int64_t ldb, const T* t, int64_t ldt, const int32_t* rows, int64_t n,
                         int64_t P, T* y, int64_t ldy, int w, float* d = nullptr, int64_t ldd = 0) {
  const PanelMasks pm(w);
  if (w % 16 == 0) expand_vectors<T, true>(b, ldb, t, ldt, rows, n, P, y, ldy, pm, w / 16, d, ldd);
  else expand_vectors<T, false>(b, ldb, t, ldt, rows, n, P, y, ldy, pm, (w + 15) / 16, d, ldd);
}
#endif

#ifdef SERVELM_AMX
// The AMX form (bf16, R <= 32, where the OS grants the tile state): per 16 rows of a slot and
// 16 columns, C [rows x 16] = T [rows x 2P] . B [2P x 16] in one tdpbf16ps (B's rank pairs are
// the tile's B layout as they lie: pair row i of the vector's columns at b + i * 2N), C then
// added into y as add_rows does. A panel that is not whole vectors on the 16-column grid runs
// the vector form (the same columns always do, whatever the batch or the column range).
// A slot's rows fewer than kAmxRows take the vector form (the same bits: both accumulate the
// rank pairs in order in fp32): a tile's fixed costs (its C stored and read back, the tile
// configuration) are not repaid by a row or two (docs/benchmarks.md, LoRA adapters).
constexpr int64_t kAmxRows = 4;
inline bool expands_on_amx(int64_t R, const RowGroups& G) {
  return R <= 32 && G.most() >= kAmxRows && amx_available();
}

// Vector k of a panel: C tile TC, B tile TB (tile numbers are literals in the instructions).
#define SERVELM_LORA_AMX_VEC(k, TC, TB)          \
  if (k < nv) {                                  \
    _tile_zero(TC);                              \
    _tile_loadd(TB, b + 32 * k, 4 * N);          \
    _tile_dpbf16ps(TC, 0, TB);                   \
    _tile_stored(TC, cbuf + 256 * k, 64);        \
  }

inline void expand_amx(const Adapter<c10::BFloat16>& L, const RowGroups& G, const c10::BFloat16* t,
                       c10::BFloat16* y, int64_t ldy, int64_t b0, int64_t b1, int64_t c_lo, int64_t c_hi,
                       float* d, int64_t ldd) {
  using BF = c10::BFloat16;
  const int64_t N = L.N, P = L.P(), P2 = 2 * P, JP = L.J * P2, J = L.J;
  const int64_t nrows = static_cast<int64_t>(G.rows.size());
  const int tr = static_cast<int>(std::min<int64_t>(16, G.most()));  // A's and C's rows
  // Each part's t rows in the groups' row order, packed once a call: tile A of rows
  // [q0, q0 + tr) of a group is tp + (j * (nrows + 16) + begin + q0) * P2 (rows past a group's
  // end are the next group's or zero: their C rows are not read). Written well before any tile
  // load reads them (a tile load right after the stores that wrote its bytes stalls).
  thread_local std::vector<BF> tp;
  tp.assign(J * (nrows + 16) * P2, BF(0.f));
  for (int64_t j = 0; j < J; ++j)
    for (int64_t r = 0; r < nrows; ++r)
      std::memcpy(tp.data() + (j * (nrows + 16) + r) * P2, t + G.rows[r] * JP + j * P2, P2 * sizeof(BF));
  TileConfig cfg;
  cfg.colsb[0] = static_cast<uint16_t>(4 * P), cfg.rows[0] = static_cast<uint8_t>(tr);  // A: T's rows
  for (int i = 1; i < 3; ++i) cfg.colsb[i] = 64, cfg.rows[i] = static_cast<uint8_t>(P);  // B: P pairs
  for (int i = 4; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = static_cast<uint8_t>(tr);  // C
  load_config(cfg);
  alignas(64) float cbuf[4 * 256];
  // Slot by slot, its panels in column order: one adapter's B pair rows stream at a time, the
  // panel after next's prefetched (all slots' at once, panel by panel, are more streams than
  // the prefetchers follow: the tile loads of B waited on memory).
  for (size_t g = 0; g + 1 < G.begin.size(); ++g) {
    const int32_t* rows = G.rows.data() + G.begin[g];
    const int64_t n = G.begin[g + 1] - G.begin[g];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t j = L.block_part[blk];
      const bool whole = L.block_col[blk] % 16 == 0 && L.block_width[blk] % 16 == 0;
      const int64_t c0 = std::max(L.block_col[blk], c_lo), c1 = std::min(L.block_col[blk] + L.block_width[blk], c_hi);
      if (c0 >= c1) continue;
      const int w = static_cast<int>(c1 - c0);
      const int nv = w / 16;
      const PanelMasks pm(w);  // (whole: vectors past nv masked off, their acc zero)
      const BF* b = L.b + (G.slot[g] * P * N + c0) * 2;
      if (!whole || n < kAmxRows) {
        expand_panel<BF>(b, 2 * N, t + j * P2, JP, rows, n, P, y + c0, ldy, w, d ? d + c0 : nullptr, ldd);
        continue;
      }
      if (c0 + 3 * kPanel <= std::min(c_hi, N))
        for (int64_t i = 0; i < P; ++i)
          for (int o = 0; o < 4 * kPanel; o += 64)
            _mm_prefetch(reinterpret_cast<const char*>(b + (i * N + 2 * kPanel) * 2) + o, _MM_HINT_T0);
      for (int64_t q0 = 0; q0 < n; q0 += tr) {
        const int64_t nq = std::min<int64_t>(tr, n - q0);
        _tile_loadd(0, tp.data() + (j * (nrows + 16) + G.begin[g] + q0) * P2, 4 * P);
        SERVELM_LORA_AMX_VEC(0, 4, 1)
        SERVELM_LORA_AMX_VEC(1, 5, 2)
        SERVELM_LORA_AMX_VEC(2, 6, 1)
        SERVELM_LORA_AMX_VEC(3, 7, 2)
        for (int64_t r = 0; r < nq; ++r) {
          __m512 acc[1][4];
          for (int k = 0; k < 4; ++k) acc[0][k] = k < nv ? _mm512_loadu_ps(cbuf + 256 * k + 16 * r) : _mm512_setzero_ps();
          if (d) {
            float* dr[1] = {d + rows[q0 + r] * ldd + c0};
            store_rows<1, 4>(acc, dr, pm);
            continue;
          }
          BF* yr[1] = {y + rows[q0 + r] * ldy + c0};
          add_rows<BF, 1, 4>(acc, yr, pm);
        }
      }
    }
  }
  _tile_release();
}
#undef SERVELM_LORA_AMX_VEC
#endif

// Panels [b0, b1), their columns within [c_lo, c_hi) (a DecodeStack thread's share of the
// matmul's columns); a column's arithmetic does not depend on the range. d not null: each
// row's delta stored there in fp32 (d[m * ldd + c], the rows of G only) and y left alone:
// y + delta rounded later is what the add gives (a gated amx gate_up's epilogue does it).
template <typename T>
__attribute__((noinline)) void expand(const Adapter<T>& L, const RowGroups& G, const T* t, T* y, int64_t ldy,
                                      int64_t b0, int64_t b1, int64_t c_lo = 0,
                                      int64_t c_hi = std::numeric_limits<int64_t>::max(), float* d = nullptr,
                                      int64_t ldd = 0) {
#ifdef SERVELM_AMX
  if constexpr (std::is_same<T, c10::BFloat16>::value)
    if (expands_on_amx(L.R, G)) return expand_amx(L, G, t, y, ldy, b0, b1, c_lo, c_hi, d, ldd);
#endif
  const int64_t N = L.N, P = L.P(), JP = L.J * 2 * P;
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t j = L.block_part[blk];
    const int64_t c0 = std::max(L.block_col[blk], c_lo), c1 = std::min(L.block_col[blk] + L.block_width[blk], c_hi);
    if (c0 >= c1) continue;
    const int w = static_cast<int>(c1 - c0);
    for (size_t g = 0; g + 1 < G.begin.size(); ++g) {
      const T* b = L.b + (G.slot[g] * P * N + c0) * 2;  // pair i of column c0 + c at b + (i N + c) 2
      const int32_t* rows = G.rows.data() + G.begin[g];
      const int64_t n = G.begin[g + 1] - G.begin[g];
      const T* tj = t + j * 2 * P;
#ifdef SERVELM_LORA_AVX512
      expand_panel<T>(b, 2 * N, tj, JP, rows, n, P, y + c0, ldy, w, d ? d + c0 : nullptr, ldd);
#else
      for (int64_t q = 0; q < n; ++q) {
        const T* tm = tj + rows[q] * JP;
        T* yp = y + rows[q] * ldy + c0;
        for (int c = 0; c < w; ++c) {
          float acc = 0.f;
          for (int64_t r = 0; r < 2 * P; ++r) acc += as_float(tm[r]) * as_float(b[((r / 2) * N + c) * 2 + r % 2]);
          if (d) d[rows[q] * ldd + c0 + c] = acc;
          else yp[c] = static_cast<T>(as_float(yp[c]) + acc);
        }
      }
#endif
    }
  }
}

}  // namespace lora
}  // namespace
