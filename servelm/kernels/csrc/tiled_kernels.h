// The tiled matmul kernels of servelm_quant (int4, int8 and bf16 weights in 16-row tiles),
// shared by quant.cpp (the int4_linear / int8_linear / bf16_linear operators) and
// decode_stack.cpp (the DecodeStack, which runs a thread's share of a matmul's tiles inline):
// both compile the same code, so their results are the same bits. Layouts and the
// arithmetic are described at the top of quant.cpp and next to each kernel.
// AVX-512 BF16 only: include it inside the sources' AVX-512 BF16 guard.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/all.h>

#include <type_traits>
#include <vector>

#include "decode_attention.h"  // read_lines

namespace {


// Software prefetch of the weight streams: distance in bytes, non-temporal, as each weight
// byte is read once per step: the stream then does not evict the caches' other contents (the
// activations, KV cache, and the Python interpreter's working set between calls): +3%
// one-stream int4, A/B in one run. The distance must cover the memory latency at the rate a
// core streams: one-stream int4 decode through the DecodeStack, alternating builds in one
// process, against 2 KB: 3 KB 1.05x, 4 KB 1.07x, 6 KB 1.13x, 8 KB 1.12x, 12 KB 1.08x,
// 16 KB 1.06x (16 streams 1.02x, int8 alike).
constexpr int kPrefetch = 6144;

// acc += w . (the bf16 pair at p, broadcast): vdpbf16ps with an embedded-broadcast memory
// operand, one instruction. GCC does not fold _mm512_set1_epi32 into vdpbf16ps as it does
// for FMAs, and the separate broadcasts cost issue slots in the weight-streaming loops.
inline __m512 dpbf16_bcast(__m512 acc, __m512bh w, const void* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*static_cast<const int32_t*>(p)));
  return acc;
}

// Output columns n0 .. n0 + 15 of a 16-row weight tile (fewer in N's last tile): their mask
// and bias, and the masked store of one activation row's 16 fp32 results into float or
// bf16 output, as every tiled kernel ends.
struct TileOut {
  __mmask16 mk;
  __m512 bv;
  TileOut(int64_t N, int64_t n0, const float* bias)
      : mk(N - n0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1)),
        bv(bias ? _mm512_maskz_loadu_ps(mk, bias + n0) : _mm512_setzero_ps()) {}
  // o[0 .. 16) = r (the bias already in r).
  template <typename OutT>
  void store_raw(OutT* o, __m512 r) const {
    if constexpr (std::is_same_v<OutT, float>)
      _mm512_mask_storeu_ps(o, mk, r);
    else
      _mm256_mask_storeu_epi16(o, mk, (__m256i)_mm512_cvtneps_pbh(r));
  }
  // o[0 .. 16) = r + bias.
  template <typename OutT>
  void store(OutT* o, __m512 r) const { store_raw(o, _mm512_add_ps(r, bv)); }
};

// ---------------------------------------------------------------- int4 (tiled)

// Tile layout: output rows in tiles of 16; tile t is K/8 blocks of 64 bytes; block b holds
// k = 8b..8b+7 as 32 uint16 lanes L = 2r + e (row r of the tile, e = 0/1), whose nibble j
// (bits 4j..4j+3) is q[16t + r][8b + 2j + e]. Decoding nibble j of every lane gives a vector
// of 32 bf16 = 16 rows x the k-pair (8b+2j, 8b+2j+1): exactly what vdpbf16ps multiplies by a
// broadcast activation pair, accumulating 16 output rows in the 16 fp32 lanes (no
// horizontal sums). Scales/mins: [N/16, K/G, 16] float16.
//
// xh/xl: bf16 activations [M, K] (xl: the low part of fp32 ones, only when SPLIT);
// xs: fp32 group sums [M, K/G]. Writes rows [m0, m0+MT) of out [M, N] for tiles [t0, t1).
template <int MT, bool SPLIT, typename OutT>
void int4_tiles(const uint8_t* qw, const c10::Half* sc, const c10::Half* mn,
                const c10::BFloat16* xh, const c10::BFloat16* xl, const float* xs,
                const float* bias, OutT* out, int64_t m0, int64_t N, int64_t K, int64_t G,
                int64_t t0, int64_t t1) {
  constexpr int CH = MT <= 2 ? 4 : 2;  // independent dpbf16 chains per activation row
  const int64_t ng = K / G, bpg = G / 8;
  const __m512i nib = _mm512_set1_epi16(0x000F);
  const __m512i b128 = _mm512_set1_epi16(0x4300);
  const __m512 m128 = _mm512_set1_ps(-128.0f);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = qw + t * 8 * K;
    const c10::Half* st = sc + t * ng * 16;
    const c10::Half* mt = mn + t * ng * 16;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + 16 * g)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mt + 16 * g)));
      const __m512 ov = _mm512_fmadd_ps(sv, m128, mv);  // m - 128 s: removes the +128 of the decode
      __m512 tc[MT][CH];
      for (int m = 0; m < MT; ++m) {
        acc[m] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xs[(m0 + m) * ng + g]), acc[m]);
        for (int c = 0; c < CH; ++c) tc[m][c] = _mm512_setzero_ps();
      }
      for (int64_t b = 0; b < bpg; ++b) {
        const int64_t blk = g * bpg + b, k0 = 8 * blk;
        _mm_prefetch(reinterpret_cast<const char*>(wt + 64 * blk) + kPrefetch, _MM_HINT_NTA);
        const __m512i v = _mm512_loadu_si512(wt + 64 * blk);
        __m512bh d[4];
        d[0] = (__m512bh)_mm512_ternarylogic_epi32(v, nib, b128, 0xEA);
        d[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nib, b128, 0xEA);
        d[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), nib, b128, 0xEA);
        d[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), b128);
        for (int m = 0; m < MT; ++m) {
          const int32_t* xp = reinterpret_cast<const int32_t*>(xh + (m0 + m) * K + k0);
          for (int j = 0; j < 4; ++j) tc[m][j % CH] = dpbf16_bcast(tc[m][j % CH], d[j], xp + j);
          if constexpr (SPLIT) {
            const int32_t* xq = reinterpret_cast<const int32_t*>(xl + (m0 + m) * K + k0);
            for (int j = 0; j < 4; ++j)
              tc[m][(j + 1) % CH] = dpbf16_bcast(tc[m][(j + 1) % CH], d[j], xq + j);
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        __m512 sum = tc[m][0];
        for (int c = 1; c < CH; ++c) sum = _mm512_add_ps(sum, tc[m][c]);
        acc[m] = _mm512_fmadd_ps(sum, sv, acc[m]);
      }
    }
    const int64_t n0 = 16 * t;
    const TileOut to(N, n0, bias);
    for (int m = 0; m < MT; ++m) to.store(out + (m0 + m) * N + n0, acc[m]);
  }
}

// ---------------------------------------------------------------- decode once, then GEMM

// For prefill-sized M with bf16 activations, streaming the packed weight once per few rows
// would decode it M/6 times (and int8's nibble split doubles its dot products): instead
// each thread decodes a pair of 16-row tiles once into bf16, in the vdpbf16ps operand
// layout (k-pair kp: 32 bf16 = 16 rows x (k = 2kp, 2kp+1)), and runs a bf16 micro-kernel
// over all M rows, 8 at a time: 2 tiles x 8 rows = 16 fp32 accumulator chains, one
// broadcast activation pair feeding both tiles (12 rows, 24 chains, measured 2-5% slower at
// 64 rows, where they leave a 4-row remainder, and alike at 48 and 512). The weights are
// rounded to bf16 once decoded (s * q + m), as dequantise-then-matmul in the model dtype would.
// From these many rows (measured over the embedded model's layers, against the row-streaming
// kernels below): int4 keeps streaming up to ~48 rows (its decode is cheap and the stream
// bound), int8 only to ~24 (its nibble split doubles the dot products).
constexpr int64_t kDecodeOnceRows4 = 48, kDecodeOnceRows8 = 24;
constexpr int kGemmRows = 8;

inline __m512i kRowLo() {  // lane i -> row i / 2 (lanes 2r, 2r+1 hold row r)
  return _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
}
inline __m512i kRowHi() {
  return _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
}

// 32 integer lanes q (uint16, lane 2r + e) -> bf16 s[r] * q + m[r], stored at dst (64 bytes).
inline void store_pair_row(c10::BFloat16* dst, __m512i q, __m512 s_lo, __m512 s_hi,
                           __m512 m_lo, __m512 m_hi) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)));
  const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s_hi, m_hi), _mm512_fmadd_ps(lo, s_lo, m_lo));
  _mm512_storeu_si512(dst, (__m512i)w);
}

// out rows [m0, m0 + MT), tiles t0 .. t0 + NT - 1, from decoded tiles w[0..NT).
template <int MT, int NT, typename OutT>
void decoded_rows(const c10::BFloat16* const* w, const c10::BFloat16* xh, const float* bias,
                  OutT* out, int64_t m0, int64_t N, int64_t K, int64_t t0) {
  __m512 acc[NT][MT];
  for (int u = 0; u < NT; ++u)
    for (int m = 0; m < MT; ++m) acc[u][m] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512bh wv[NT];
    for (int u = 0; u < NT; ++u) wv[u] = (__m512bh)_mm512_loadu_si512(w[u] + kp * 32);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(
          reinterpret_cast<const int32_t*>(xh + (m0 + m) * K)[kp]);
      for (int u = 0; u < NT; ++u) acc[u][m] = _mm512_dpbf16_ps(acc[u][m], wv[u], xv);
    }
  }
  for (int u = 0; u < NT; ++u) {
    const int64_t n0 = 16 * (t0 + u);
    const TileOut to(N, n0, bias);
    for (int m = 0; m < MT; ++m) to.store(out + (m0 + m) * N + n0, acc[u][m]);
  }
}

template <int NT, typename OutT, int MT = kGemmRows>
void decoded_rows_n(int mt, const c10::BFloat16* const* w, const c10::BFloat16* xh,
                    const float* bias, OutT* out, int64_t m0, int64_t N, int64_t K, int64_t t0) {
  if constexpr (MT >= 1) {
    if (mt == MT) return decoded_rows<MT, NT>(w, xh, bias, out, m0, N, K, t0);
    decoded_rows_n<NT, OutT, MT - 1>(mt, w, xh, bias, out, m0, N, K, t0);
  }
}

// Output tiles [t0, t1) of all M rows (one thread's share), their weights decoded a pair of
// tiles at a time into per-thread scratch. decode(t, buf) writes tile t as K/2 k-pairs of
// 32 bf16; K is even for both formats. A tile's result does not depend on its pairing.
// A pair's packed weights (contiguous: decode.data(t), decode.tile_bytes() a tile) are read
// ahead with read_lines before they are decoded: 1.04x for every int4 matmul of a 64-row step.
template <typename Decode, typename OutT>
void decoded_range(const Decode& decode, const c10::BFloat16* xh, const float* bias, OutT* out,
                   int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  static thread_local std::vector<c10::BFloat16> buf;
  buf.resize(2 * 16 * K);
  const c10::BFloat16* w[2] = {buf.data(), buf.data() + 16 * K};
  for (int64_t t = t0; t < t1; t += 2) {
    const int nt = t1 - t >= 2 ? 2 : 1;
    read_lines(decode.data(t), nt * decode.tile_bytes());
    for (int u = 0; u < nt; ++u) decode(t + u, buf.data() + u * 16 * K);
    for (int64_t m0 = 0; m0 < M; m0 += kGemmRows) {
      const int mt = static_cast<int>(std::min<int64_t>(kGemmRows, M - m0));
      if (nt == 2) decoded_rows_n<2>(mt, w, xh, bias, out, m0, N, K, t);
      else decoded_rows_n<1>(mt, w, xh, bias, out, m0, N, K, t);
    }
  }
}

template <typename Decode, typename OutT>
void decoded_gemm(const Decode& decode, const c10::BFloat16* xh, const float* bias, OutT* out,
                  int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + 15) / 16, pairs = (tiles + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    decoded_range(decode, xh, bias, out, M, N, K, 2 * p0, std::min(tiles, 2 * p1));
  });
}

// Tile t of an int4 weight decoded to bf16 k-pairs (decoded_range's decode).
struct Int4Tiles {
  const uint8_t* qw;
  const c10::Half* sc;
  const c10::Half* mn;
  int64_t G, K;
  const char* data(int64_t t) const { return reinterpret_cast<const char*>(qw + t * 8 * K); }
  int64_t tile_bytes() const { return 8 * K; }
  void operator()(int64_t t, c10::BFloat16* buf) const {
    const int64_t ng = K / G;
    const __m512i lo4 = _mm512_set1_epi16(0x000F);
    const uint8_t* wt = qw + t * 8 * K;
    for (int64_t g = 0; g < ng; ++g) {
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + (t * ng + g) * 16));
      const __m256i m16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + (t * ng + g) * 16));
      const __m512 sv = _mm512_cvtph_ps(s16), mv = _mm512_cvtph_ps(m16);
      const __m512 s_lo = _mm512_permutexvar_ps(kRowLo(), sv), s_hi = _mm512_permutexvar_ps(kRowHi(), sv);
      const __m512 m_lo = _mm512_permutexvar_ps(kRowLo(), mv), m_hi = _mm512_permutexvar_ps(kRowHi(), mv);
      for (int64_t b = g * (G / 8); b < (g + 1) * (G / 8); ++b) {
        const __m512i v = _mm512_loadu_si512(wt + 64 * b);
        for (int j = 0; j < 4; ++j) {  // nibble j of every lane: the k-pair 4b + j
          const __m512i q = _mm512_and_si512(_mm512_srli_epi16(v, 4 * j), lo4);
          store_pair_row(buf + (4 * b + j) * 32, q, s_lo, s_hi, m_lo, m_hi);
        }
      }
    }
  }
};

// Tile t of an int8 weight decoded to bf16 k-pairs.
struct Int8Tiles {
  const uint8_t* qw;
  const float* sc;
  int64_t K;
  const char* data(int64_t t) const { return reinterpret_cast<const char*>(qw + t * 16 * K); }
  int64_t tile_bytes() const { return 16 * K; }
  void operator()(int64_t t, c10::BFloat16* buf) const {
    const __m512i lo8 = _mm512_set1_epi16(0x00FF);
    const uint8_t* wt = qw + t * 16 * K;
    const __m512 sv = _mm512_loadu_ps(sc + 16 * t);  // scales are padded to the tile
    const __m512 s_lo = _mm512_permutexvar_ps(kRowLo(), sv), s_hi = _mm512_permutexvar_ps(kRowHi(), sv);
    const __m512 m_lo = _mm512_mul_ps(s_lo, _mm512_set1_ps(-128.f));  // u = q + 128
    const __m512 m_hi = _mm512_mul_ps(s_hi, _mm512_set1_ps(-128.f));
    for (int64_t b = 0; b < K / 4; ++b) {  // low bytes: k-pair 2b; high bytes: 2b + 1
      const __m512i v = _mm512_loadu_si512(wt + 64 * b);
      store_pair_row(buf + (2 * b) * 32, _mm512_and_si512(v, lo8), s_lo, s_hi, m_lo, m_hi);
      store_pair_row(buf + (2 * b + 1) * 32, _mm512_srli_epi16(v, 8), s_lo, s_hi, m_lo, m_hi);
    }
  }
};

constexpr int kMaxRows4 = 6;  // activation rows per pass over a weight tile

// Output tiles [t0, t1) of all M rows, streaming the weight (one thread's share).
template <bool SPLIT, typename OutT>
void int4_range(int64_t G, const uint8_t* qw, const c10::Half* sc, const c10::Half* mn,
                const c10::BFloat16* xh, const c10::BFloat16* xl, const float* xs,
                const float* bias, OutT* out, int64_t M, int64_t N, int64_t K, int64_t t0,
                int64_t t1) {
  // A few tiles at a time, so each stays in L1 while every activation row uses it.
  for (int64_t tb = t0; tb < t1; tb += 2) {
    const int64_t te = std::min(tb + 2, t1);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows4) {
      switch (std::min<int64_t>(kMaxRows4, M - m0)) {
        case 1: int4_tiles<1, SPLIT>(qw, sc, mn, xh, xl, xs, bias, out, m0, N, K, G, tb, te); break;
        case 2: int4_tiles<2, SPLIT>(qw, sc, mn, xh, xl, xs, bias, out, m0, N, K, G, tb, te); break;
        case 3: int4_tiles<3, SPLIT>(qw, sc, mn, xh, xl, xs, bias, out, m0, N, K, G, tb, te); break;
        case 4: int4_tiles<4, SPLIT>(qw, sc, mn, xh, xl, xs, bias, out, m0, N, K, G, tb, te); break;
        case 5: int4_tiles<5, SPLIT>(qw, sc, mn, xh, xl, xs, bias, out, m0, N, K, G, tb, te); break;
        default: int4_tiles<6, SPLIT>(qw, sc, mn, xh, xl, xs, bias, out, m0, N, K, G, tb, te); break;
      }
    }
  }
}


void check_int4(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                int64_t N, int64_t group_size, int64_t K) {
  TORCH_CHECK(qweight.device().is_cpu(), "servelm_quant: CPU tensors only");
  TORCH_CHECK(group_size >= 8 && group_size % 8 == 0 && K % group_size == 0,
              "int4 group_size must be a multiple of 8 dividing K=", K, ", got ", group_size);
  const int64_t tiles = (N + 15) / 16;
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.numel() == tiles * 8 * K,
              "int4 qweight must be contiguous uint8 with ceil(N/16)*8*K elements (tiled layout)");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() &&
                    t->numel() == tiles * 16 * (K / group_size),
                "int4 scales/mins must be contiguous float16 [ceil(N/16), K/group_size, 16]");
}

// xs[i] = the fp32 sum of bf16 x[i*G .. i*G + G) for i < M * (K / G): the group sums the
// kernels take with bf16 activations.
void group_sums(const c10::BFloat16* x, int64_t M, int64_t K, int64_t G, float* xs) {
  for (int64_t i = 0; i < M * (K / G); ++i) {
    float a = 0.f;
    for (int64_t k = 0; k < G; ++k) a += static_cast<float>(x[i * G + k]);
    xs[i] = a;
  }
}
void group_sums(const c10::BFloat16* x, int64_t M, int64_t K, int64_t G, std::vector<float>& xs) {
  xs.resize(M * (K / G));
  group_sums(x, M, K, G, xs.data());
}
// ---------------------------------------------------------------- int8 (tiled)

// The int4 scheme twice: u = q + 128 (0..255) is split into nibbles, u = 16 h + l, each decoded
// to the bf16 value 128 + nibble. Tile t (16 rows) is K/4 blocks of 64 bytes; block b holds
// k = 4b..4b+3 as 32 uint16 lanes L = 2r + e: low byte u[16t + r][4b + e], high byte
// u[16t + r][4b + 2 + e]. Then sum_k w x = s (16 T_h + T_l - 2304 sum_k x), where T_h, T_l
// are the dot products of the decoded high and low nibbles (2304 = 17 * 128 + 128).
template <int MT, bool SPLIT, typename OutT>
void int8_tiles(const uint8_t* qw, const float* sc, const c10::BFloat16* xh,
                const c10::BFloat16* xl, const float* xs, const float* bias, OutT* out,
                int64_t m0, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const __m512i nib = _mm512_set1_epi16(0x000F);
  const __m512i b128 = _mm512_set1_epi16(0x4300);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = qw + t * 16 * K;
    constexpr int NC = 2;  // independent chains per row (dpbf16 latency)
    __m512 tl[MT][NC], th[MT][NC];
    for (int m = 0; m < MT; ++m)
      for (int c = 0; c < NC; ++c) tl[m][c] = th[m][c] = _mm512_setzero_ps();
    // Block b accumulates into chain C (compile-time, so the accumulators stay in registers).
    auto step = [&](int64_t b, auto chain) {
      constexpr int C = decltype(chain)::value % NC, C1 = (C + 1) % NC;
      _mm_prefetch(reinterpret_cast<const char*>(wt + 64 * b) + kPrefetch, _MM_HINT_NTA);
      const __m512i v = _mm512_loadu_si512(wt + 64 * b);
      const __m512bh d0 = (__m512bh)_mm512_ternarylogic_epi32(v, nib, b128, 0xEA);
      const __m512bh d1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nib, b128, 0xEA);
      const __m512bh d2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), nib, b128, 0xEA);
      const __m512bh d3 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), b128);
      for (int m = 0; m < MT; ++m) {
        const int32_t* xp = reinterpret_cast<const int32_t*>(xh + (m0 + m) * K + 4 * b);
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(xp[0]), x1 = (__m512bh)_mm512_set1_epi32(xp[1]);
        tl[m][C] = _mm512_dpbf16_ps(tl[m][C], d0, x0);
        th[m][C] = _mm512_dpbf16_ps(th[m][C], d1, x0);
        tl[m][C] = _mm512_dpbf16_ps(tl[m][C], d2, x1);
        th[m][C] = _mm512_dpbf16_ps(th[m][C], d3, x1);
        if constexpr (SPLIT) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(xl + (m0 + m) * K + 4 * b);
          const __m512bh y0 = (__m512bh)_mm512_set1_epi32(xq[0]), y1 = (__m512bh)_mm512_set1_epi32(xq[1]);
          tl[m][C1] = _mm512_dpbf16_ps(tl[m][C1], d0, y0);
          th[m][C1] = _mm512_dpbf16_ps(th[m][C1], d1, y0);
          tl[m][C1] = _mm512_dpbf16_ps(tl[m][C1], d2, y1);
          th[m][C1] = _mm512_dpbf16_ps(th[m][C1], d3, y1);
        }
      }
    };
    const int64_t nb = K / 4;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      step(b, std::integral_constant<int, 0>{});
      step(b + 1, std::integral_constant<int, 1>{});
    }
    if (b < nb) step(b, std::integral_constant<int, 0>{});
    const int64_t n0 = 16 * t;
    const __m512 sv = _mm512_loadu_ps(sc + n0);  // scales are padded to the tile
    const TileOut to(N, n0, bias);
    for (int m = 0; m < MT; ++m) {
      __m512 h = th[m][0], l = tl[m][0];
      if constexpr (NC == 2) {
        h = _mm512_add_ps(h, th[m][1]);
        l = _mm512_add_ps(l, tl[m][1]);
      }
      __m512 r = _mm512_fmadd_ps(h, _mm512_set1_ps(16.0f), l);
      r = _mm512_fmadd_ps(_mm512_set1_ps(-2304.0f), _mm512_set1_ps(xs[m0 + m]), r);
      to.store_raw(out + (m0 + m) * N + n0, _mm512_fmadd_ps(r, sv, to.bv));
    }
  }
}

// Output tiles [t0, t1) of all M rows (one thread's share).
template <bool SPLIT, typename OutT>
void int8_range(const uint8_t* qw, const float* sc, const c10::BFloat16* xh, const c10::BFloat16* xl,
                const float* xs, const float* bias, OutT* out, int64_t M, int64_t N, int64_t K,
                int64_t t0, int64_t t1) {
  for (int64_t tb = t0; tb < t1; ++tb) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: int8_tiles<1, SPLIT>(qw, sc, xh, xl, xs, bias, out, m0, N, K, tb, tb + 1); break;
        case 2: int8_tiles<2, SPLIT>(qw, sc, xh, xl, xs, bias, out, m0, N, K, tb, tb + 1); break;
        case 3: int8_tiles<3, SPLIT>(qw, sc, xh, xl, xs, bias, out, m0, N, K, tb, tb + 1); break;
        default: int8_tiles<4, SPLIT>(qw, sc, xh, xl, xs, bias, out, m0, N, K, tb, tb + 1); break;
      }
    }
  }
}


void check_int8(const at::Tensor& qweight, const at::Tensor& scales, int64_t N, int64_t K) {
  TORCH_CHECK(qweight.device().is_cpu(), "servelm_quant: CPU tensors only");
  TORCH_CHECK(K % 4 == 0, "int8 kernel needs K (in_features) divisible by 4, got ", K);
  const int64_t tiles = (N + 15) / 16;
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.numel() == tiles * 16 * K,
              "int8 qweight must be contiguous uint8 with ceil(N/16)*16*K elements (tiled layout)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == tiles * 16,
              "int8 scales must be contiguous float32 with ceil(N/16)*16 elements");
}

// ---------------------------------------------------------------- tiled GEMM helpers

// Prefetches [p, p + bytes) into L2 in `parts` slices, one per call of next(): the GEMM over
// a pair of tiles calls it once per block of rows, so the next pair's cold weights arrive
// while this pair's rows are computed instead of stalling the first row block (read_lines
// before each pair cost ~5% of an fp32 512-token prompt).
struct SpreadPrefetch {
  const char* p = nullptr;
  int64_t bytes = 0, per = 0, at = 0;
  SpreadPrefetch(const void* ptr, int64_t n, int64_t parts)
      : p(static_cast<const char*>(ptr)), bytes(ptr ? n : 0), per((bytes + parts - 1) / std::max<int64_t>(parts, 1)) {}
  void next() {
    const int64_t end = std::min(bytes, at + per);
    for (; at < end; at += 64) _mm_prefetch(p + at, _MM_HINT_T1);
  }
};

constexpr int64_t kGemmRows16 = 8;  // bf16/fp32 tiles: from these many rows, the GEMM
constexpr int kMaxRows16 = 4;       // activation rows per pass over a tile below kGemmRows16

template <int V>
using Int = std::integral_constant<int, V>;


// The bf16/fp32 tiled matmul's output tiles [t0, t1) of all M rows (one thread's share; t0
// even from kGemmRows16 rows on, where tiles go in pairs), for weights w of element type T:
// gemm(Int<NT>, mt, wp, m0, t) runs mt rows of NT tiles at wp, stream(Int<MT>, m0, t) MT rows
// of tile t. A tile's result depends only on M, not on the split.
template <typename T, typename Gemm, typename Stream>
void tiled_range(const T* w, int64_t M, int64_t K, int64_t t0, int64_t t1, const Gemm& gemm,
                 const Stream& stream) {
  if (M >= kGemmRows16) {
    const int64_t tile = 16 * K * static_cast<int64_t>(sizeof(T));
    const int64_t blocks = (M + kGemmRows - 1) / kGemmRows;
    if (t0 < t1) read_lines(reinterpret_cast<const char*>(w + t0 * 16 * K), std::min<int64_t>(2, t1 - t0) * tile);
    for (int64_t t = t0; t < t1; t += 2) {
      const int nt = t1 - t >= 2 ? 2 : 1;
      const T* wp[2] = {w + t * 16 * K, w + (t + nt - 1) * 16 * K};
      SpreadPrefetch ahead(t + 2 < t1 ? w + (t + 2) * 16 * K : nullptr,
                           std::min<int64_t>(2, t1 - t - 2) * tile, blocks);
      for (int64_t m0 = 0; m0 < M; m0 += kGemmRows) {
        const int mt = static_cast<int>(std::min<int64_t>(kGemmRows, M - m0));
        if (nt == 2) gemm(Int<2>{}, mt, wp, m0, t);
        else gemm(Int<1>{}, mt, wp, m0, t);
        ahead.next();
      }
    }
    return;
  }
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows16) {
      switch (std::min<int64_t>(kMaxRows16, M - m0)) {
        case 1: stream(Int<1>{}, m0, t); break;
        case 2: stream(Int<2>{}, m0, t); break;
        case 3: stream(Int<3>{}, m0, t); break;
        default: stream(Int<4>{}, m0, t); break;
      }
    }
  }
}

// A tiled linear op: weight checked ([ceil(N/16), 16K] of T, the tiled layout), activations
// of type T, output tiles split over the threads (pairs from kGemmRows16 rows), range(x, bias,
// out, M, t0, t1) computing a share.
// A bf16/fp32 tiled weight (T elements, [ceil(N/16), 16K], contiguous, on the CPU; bf16
// needs K even): the ops' check and the DecodeStack's.
template <typename T>
void check_tiled(const at::Tensor& weight, int64_t N, int64_t K, const char* name) {
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16>;
  TORCH_CHECK(weight.device().is_cpu(), "servelm_quant: CPU tensors only");
  TORCH_CHECK(!bf16 || K % 2 == 0, name, " needs K (in_features) even, got ", K);
  const int64_t tiles = (N + 15) / 16;
  TORCH_CHECK(weight.scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat) && weight.is_contiguous() &&
                  weight.numel() == tiles * 16 * K,
              name, " weight must be contiguous ", bf16 ? "bfloat16" : "float32",
              " with ceil(N/16)*16*K elements (tiled layout)");
}
// ---------------------------------------------------------------- bf16 (tiled)

// bf16 weights of a bf16 model, in the layout the decoders above write: output rows in tiles
// of 16, tile t is K/2 k-pairs of 32 bf16 (64 bytes), lane L = 2r + e holding w[16t + r][2kp + e],
// which is vdpbf16ps's operand as it is: nothing to decode, the weight streams straight into
// the dot products. oneDNN's prepacked bf16 matmul read ~35 GB/s at one row here; this reads
// what the int4/int8 streams read. From kGemmRows16 rows on, the GEMM micro-kernel of the
// decode-once path runs over pairs of tiles in place.
// Rows [m0, m0 + MT) of output tile t, streaming the tile once: one 64-byte weight vector a
// step, a k-pair through vdpbf16ps (bf16) or one k through broadcast FMAs (fp32), CH
// independent chains per row.
template <int MT, typename T, typename OutT>
void stream_tiles(const T* w, const T* x, const float* bias, OutT* out, int64_t m0, int64_t N,
                  int64_t K, int64_t t) {
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16>;
  constexpr int CH = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  const T* wt = w + t * 16 * K;
  __m512 acc[MT][CH];
  for (int m = 0; m < MT; ++m)
    for (int c = 0; c < CH; ++c) acc[m][c] = _mm512_setzero_ps();
  auto step = [&](int64_t i, int c) {
    const T* wp = wt + i * (bf16 ? 32 : 16);
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetch, _MM_HINT_NTA);
    if constexpr (bf16) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wp);
      for (int m = 0; m < MT; ++m) acc[m][c] = dpbf16_bcast(acc[m][c], wv, x + (m0 + m) * K + 2 * i);
    } else {
      const __m512 wv = _mm512_loadu_ps(wp);
      for (int m = 0; m < MT; ++m)
        acc[m][c] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[(m0 + m) * K + i]), acc[m][c]);
    }
  };
  const int64_t n = bf16 ? K / 2 : K;
  int64_t i = 0;
  for (; i + CH <= n; i += CH)
    for (int c = 0; c < CH; ++c) step(i + c, c);
  for (; i < n; ++i) step(i, 0);
  const int64_t n0 = 16 * t;
  const TileOut to(N, n0, bias);
  for (int m = 0; m < MT; ++m) {
    __m512 r = acc[m][0];
    for (int c = 1; c < CH; ++c) r = _mm512_add_ps(r, acc[m][c]);
    to.store(out + (m0 + m) * N + n0, r);
  }
}

// Output tiles [t0, t1) of all M rows (tiled_range: one thread's share).
template <typename OutT>
void bf16_range(const c10::BFloat16* w, const c10::BFloat16* x, const float* bias, OutT* out,
                int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  tiled_range(
      w, M, K, t0, t1,
      [&](auto nt, int mt, const c10::BFloat16* const* wp, int64_t m0, int64_t t) {
        decoded_rows_n<decltype(nt)::value>(mt, wp, x, bias, out, m0, N, K, t);
      },
      [&](auto mt, int64_t m0, int64_t t) { stream_tiles<decltype(mt)::value>(w, x, bias, out, m0, N, K, t); });
}

}  // namespace
