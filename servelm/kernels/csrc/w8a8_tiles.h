// The w8a8 kernel on AMX-INT8 tiles: the same weight panels and quantised rows as the VNNI
// forms (w8a8_kernel.h), the same bits.
//
// A panel's weights, uint8 [K / 4, 16, 4], are an AMX B operand as they lie: a row of 64
// bytes holds 16 columns x 4 inputs, so kt inputs of a panel are one B tile of kt / 4 rows
// (64 bytes apart). The quantised rows, int8 [M, K], are A tiles of 16 rows x kt bytes (K
// bytes apart). tdpbsud multiplies signed activation bytes by unsigned weight bytes into an
// int32 tile of 16 rows x 16 columns: a block's sums are the VNNI forms' sums exactly (the
// weights' +128 offset included, taken off as 128 sum(q) there too). Each block's tiles are
// stored and scaled as the wide form's micro-kernel scales its registers: the sums less the
// offset, times d times the block's weight scales, chained in fp32 in block order, then the
// bias, rounded once.
//
// A step takes up to 32 rows (two row tiles) x 32 outputs (two panels): four C tiles, two A
// and two B. kt, the inputs one tile product takes, is 64 where the block is a multiple of
// 64, else 32 or 16 (a block is never split across steps of different blocks).
//
// The loop is written against a tile interface: AmxTiles runs the instructions (built where
// the compiler targets AMX-INT8 and AVX-512 VNNI); EmulatedTiles does their arithmetic in
// C++, so that a machine without AMX runs and tests this loop, its layouts and its chain
// against the wide form (servelm_w8a8.linear_tiles_emulated).
#pragma once

#include "w8a8_kernel.h"

#ifdef SERVELM_W8A8

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_state.h"  // amx_permitted, TileConfig, load_config

#if defined(SERVELM_AMX_TILE) && defined(__AMX_INT8__)
#define SERVELM_W8A8_AMX 1
#endif

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace {
namespace w8a8_tiles {

constexpr int kRows = 16;   // rows of an A or C tile
constexpr int kCols = 16;   // int32 columns of a C tile: one panel
constexpr int kC = kRows * kCols;

// Inputs one tile product takes for activation blocks of B inputs (B a multiple of 16).
inline int k_step(int64_t B) { return B % 64 == 0 ? 64 : B % 32 == 0 ? 32 : 16; }

// Tile (row tile i, panel j) of the C tiles is c[2 i + j]; each step adds A_i . B_j over kt
// inputs (mt row tiles, np panels, 1 or 2 each).
struct EmulatedTiles {
  int kt = 64;
  int32_t c[4][kC];

  void configure(int k) { kt = k; }
  void zero() { std::memset(c, 0, sizeof(c)); }
  // a[i]: row tile i's first input of this step (rows lda bytes apart); b[j]: panel j's kt / 4
  // rows of 64 bytes, contiguous. tdpbsud's sum: int8 a times uint8 b, 4 adjacent pairs at a
  // time, into int32.
  void step(const int8_t* const* a, int64_t lda, const uint8_t* const* b, int mt, int np) {
    for (int i = 0; i < mt; ++i)
      for (int j = 0; j < np; ++j)
        for (int m = 0; m < kRows; ++m)
          for (int n = 0; n < kCols; ++n) {
            int32_t s = 0;
            for (int k = 0; k < kt; ++k)
              s += static_cast<int32_t>(a[i][m * lda + k]) * static_cast<int32_t>(b[j][(k / 4) * 64 + n * 4 + k % 4]);
            c[2 * i + j][m * kCols + n] += s;
          }
  }
  void store(int32_t* out) const { std::memcpy(out, c, sizeof(c)); }
  void release() {}
};

#ifdef SERVELM_W8A8_AMX

// tmm0-3: C (16 rows x 64 bytes); tmm4, 5: A (16 rows x kt bytes); tmm6, 7: B (kt / 4 rows x
// 64 bytes).
struct AmxTiles {
  void configure(int kt) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = static_cast<uint16_t>(t == 4 || t == 5 ? kt : 64);
      cfg.rows[t] = static_cast<uint8_t>(t >= 6 ? kt / 4 : kRows);
    }
    load_config(cfg);
  }
  void zero() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  void step(const int8_t* const* a, int64_t lda, const uint8_t* const* b, int mt, int np) {
    _tile_loadd(4, a[0], lda);
    _tile_loadd(6, b[0], 64);
    _tile_dpbsud(0, 4, 6);
    if (np > 1) {
      _tile_loadd(7, b[1], 64);
      _tile_dpbsud(1, 4, 7);
    }
    if (mt > 1) {
      _tile_loadd(5, a[1], lda);
      _tile_dpbsud(2, 5, 6);
      if (np > 1) _tile_dpbsud(3, 5, 7);
    }
  }
  void store(int32_t* out) const {
    _tile_stored(0, out, 64);
    _tile_stored(1, out + kC, 64);
    _tile_stored(2, out + 2 * kC, 64);
    _tile_stored(3, out + 3 * kC, 64);
  }
  void release() { _tile_release(); }
};

#endif  // SERVELM_W8A8_AMX

// Rows [m0, m0 + rows) (rows <= 32; q holds 16 mt rows from m0, the rows past M any bytes)
// times panels [p, p + np) into out: per block, the tiles' int32 sums scaled and chained into
// f (fp32 [32 rows, 32 columns]), as w8a8::Micro chains its registers.
template <class Tiles, typename O>
inline void step(Tiles& tiles, const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w,
                 const float* ws, const float* bias, O* out, int64_t N, int64_t K, int64_t B, int kt, int64_t m0,
                 int rows, int64_t p, int np, int32_t* sums, float* f) {
  const int64_t NB = K / B;
  const int mt = rows > kRows ? 2 : 1;
  for (int i = 0; i < 32 * 32; ++i) f[i] = 0.f;
  const int8_t* a[2] = {q + m0 * K, q + (m0 + kRows) * K};
  for (int64_t b = 0; b < NB; ++b) {
    tiles.zero();
    for (int64_t k = b * B; k < (b + 1) * B; k += kt) {
      const int8_t* ak[2] = {a[0] + k, a[1] + k};
      const uint8_t* bk[2] = {w + p * K * kCols + k * kCols, w + (p + 1) * K * kCols + k * kCols};
      tiles.step(ak, K, bk, mt, np);
    }
    tiles.store(sums);
    for (int j = 0; j < np; ++j) {
      const __m512 wsv = _mm512_loadu_ps(ws + (p + j) * NB * kCols + b * kCols);
      for (int r = 0; r < rows; ++r) {
        const int64_t row = m0 + r;
        const __m512i acc = _mm512_loadu_si512(sums + (2 * (r / kRows) + j) * kC + (r % kRows) * kCols);
        float* fr = f + r * 32 + j * kCols;
        _mm512_storeu_ps(fr, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(cs[row * NB + b]))),
                                             _mm512_mul_ps(_mm512_set1_ps(d[row * NB + b]), wsv), _mm512_loadu_ps(fr)));
      }
    }
  }
  for (int j = 0; j < np; ++j) {
    const int64_t n0 = (p + j) * kCols;
    const int ncols = static_cast<int>(std::min<int64_t>(kCols, N - n0));
    __m512 bv = _mm512_setzero_ps();
    if (bias)
      bv = ncols == kCols ? _mm512_loadu_ps(bias + n0)
                          : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << ncols) - 1), bias + n0);
    for (int r = 0; r < rows; ++r) {
      __m512 v = _mm512_loadu_ps(f + r * 32 + j * kCols);
      if (bias) v = _mm512_add_ps(v, bv);
      w8a8::store16(out + (m0 + r) * N + n0, v, ncols);
    }
  }
}

// Panel pairs [g0, g1) (pair g: panels 2 g and 2 g + 1, where they exist) for all M rows of q
// (its rows padded to a multiple of 16), on this thread's tiles.
template <class Tiles, typename O>
inline void pairs(Tiles& tiles, const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w,
                  const float* ws, const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t g0,
                  int64_t g1) {
  const int kt = k_step(B);
  const int64_t NP = (N + kCols - 1) / kCols;
  alignas(64) int32_t sums[4 * kC];
  alignas(64) float f[32 * 32];
  tiles.configure(kt);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t p = 2 * g;
    const int np = static_cast<int>(std::min<int64_t>(2, NP - p));
    for (int64_t m0 = 0; m0 < M; m0 += 2 * kRows)
      step(tiles, q, d, cs, w, ws, bias, out, N, K, B, kt, m0, static_cast<int>(std::min<int64_t>(2 * kRows, M - m0)),
           p, np, sums, f);
  }
  tiles.release();
}

}  // namespace w8a8_tiles
}  // namespace

#pragma GCC pop_options

#endif  // SERVELM_W8A8
