// The amx linear kernel's inner parts (the layout: amx_linear.cpp's head): activation rows
// packed into A tiles, and column pairs of the packed weight times them. Shared by the
// servelm_amx_linear operator (amx_linear.cpp) and the DecodeStack (decode_stack.cpp), so a layer
// gives the same bits on either. Inline, in an anonymous namespace (each extension compiles
// its own copy), names inside `amx_linear`.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "decode_attention.h"  // transpose16x16 (amx_tiles.h's store_b_tile)
#include "amx_tiles.h"        // SERVELM_AMX, load_tile_config, kBlk
#include "row_kernels.h"      // silu16, silu_mul_store: a gated layer's epilogue

namespace {
namespace amx_linear {

#ifdef SERVELM_AMX

// Every tile 64 bytes wide; the first row block's A and C tiles (tmm0, 1, 4) `lo` rows, the
// second's (tmm2, 3, 5) `hi` rows, the B tiles (tmm6, 7) 16: a call of at most 32 rows runs
// on exactly its rows (no padding copy, no multiplies of zero rows).
void configure_rows(int lo = 16, int hi = 16) {
  const uint8_t l = static_cast<uint8_t>(lo), h = static_cast<uint8_t>(std::max(hi, 1));
  load_tile_config({l, l, h, h, l, h, 16, 16});
}

// K steps of weight prefetched ahead of the tile loads (two 1 KB tiles a step): AMX tile
// loads from memory keep few lines in flight.
constexpr int kPrefetchSteps = 8;

inline void prefetch_step(const uint32_t* b) {
  const char* p = reinterpret_cast<const char*>(b);
  for (int i = 0; i < 2 * kBlk * 4; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// Where a row block's A tiles are: tile t (16 rows) of K step kb at base + kb * ks + t * ts
// elements, its rows `stride` bytes apart. x itself (a call of at most 32 rows), or the
// call's packed copy (contiguous 1 KB tiles, read far faster than 16 rows of a long x).
struct ATiles {
  const c10::BFloat16* base;
  int64_t ks, ts, stride;
  const c10::BFloat16* at(int kb, int t) const { return base + kb * ks + t * ts; }
};

// 32 rows (`rows` of them configured: tmm0/1/4 the first 16, tmm2/3/5 the rest) against
// column pair wp (K/32 steps of two B tiles): C = A W^T as fp32 [32][32] in c. prefetch: the
// pair streams from memory (else it is in cache, and prefetching it only costs issue slots).
// stream: the B tiles loaded with the non-temporal hint (TILELOADDT1, see pairs()).
// during(kb) after each K step's multiplies: vector work (the previous block's epilogue)
// that then runs while the tile unit is busy with them.
template <typename During>
inline void pair_block(const ATiles& a, int rows, const uint32_t* wp, int ksteps, float* c,
                       bool prefetch, bool stream, During&& during) {
  const bool two = rows > 16;  // a second row tile
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int kb = 0; kb < ksteps; ++kb) {
    const uint32_t* b = wp + static_cast<int64_t>(kb) * 2 * kBlk;
    if (prefetch) prefetch_step(b + kPrefetchSteps * 2 * kBlk);
    _tile_loadd(4, a.at(kb, 0), a.stride);
    if (stream) _tile_stream_loadd(6, b, 64); else _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (stream) _tile_stream_loadd(7, b + kBlk, 64); else _tile_loadd(7, b + kBlk, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a.at(kb, 1), a.stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    during(kb);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (two) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// Row blocks are 32 rows (two A tiles x two B tiles -> four C tiles). At 64 rows a single
// 64-row block (four A tiles x one B tile, the weight streamed in one pass) reloaded its four
// A tiles from L2 for every B tile, and those loads, not the weight stream, set its pace:
// inside the DecodeStack at 64 rows (its run() calls two column pairs at a time) the 32-row
// blocks ran the linears 1.2x faster.
constexpr int kBlockRows = 32;

// Streaming calls: from kStreamMinBlocks row blocks, where a block's A tiles (32 rows x K
// bf16) fit in L1 (48 KB) with room to spare, the weight's tiles are loaded with the
// non-temporal hint (TILELOADDT1). They come from L2 (the panel, see pairs()) for every block
// anyway; loaded plainly they evicted the block's A tiles, which were then reloaded from L2
// for every pair. Kept in L1, the A tiles are read straight from x (16 rows K * 2 bytes
// apart) as fast as from a packed copy, so such a call packs only its last, partial block.
// At K = 1536 neither operand fits, and streaming either was no faster.
constexpr int64_t kL1ABytes = 40 << 10;
constexpr int64_t kStreamMinBlocks = 4;
inline bool streams(int64_t M, int64_t K) {
  return (M + kBlockRows - 1) / kBlockRows >= kStreamMinBlocks && kBlockRows * K * 2 <= kL1ABytes;
}

// Rows of the packed A tiles of a call of M rows, M rounded up to its row blocks (none up to
// 32 rows: those are read from x); packed_elems: their elements. Rows before packed_from(M,
// K) are never packed (read from x: up to 32 rows, and a streaming call's whole blocks).
inline int64_t padded_rows(int64_t M) {
  if (M <= 32) return 0;
  return (M + kBlockRows - 1) / kBlockRows * kBlockRows;
}
inline int64_t packed_elems(int64_t M, int64_t K) { return padded_rows(M) * K; }
inline int64_t packed_from(int64_t M, int64_t K) {
  return streams(M, K) ? M / kBlockRows * kBlockRows : 0;
}

// Rows [r0, r1) of a call of M rows packed from x [M, K] into ap ([block][K step][row tile]
// contiguous 1 KB tiles); rows from M on (the last block's padding) are zeros.
inline void pack_rows(const c10::BFloat16* xp, c10::BFloat16* ap, int64_t M, int64_t K, int64_t r0,
                      int64_t r1) {
  constexpr int bh = kBlockRows, nt = bh / 16;
  const int64_t ksteps = K / 32;
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t blk = row / bh, t = row % bh / 16, i = row % 16;
    for (int64_t kb = 0; kb < ksteps; ++kb) {
      c10::BFloat16* dst = ap + ((blk * ksteps + kb) * nt + t) * 512 + i * 32;
      if (row < M) std::memcpy(dst, xp + row * K + kb * 32, 64);
      else std::memset(static_cast<void*>(dst), 0, 64);
    }
  }
}

// This thread's tile configuration for calls of M rows (up to 32: tiles of exactly its
// rows); _tile_release() after its last tile instruction.
inline void configure(int64_t M) {
  if (M <= 32) configure_rows(static_cast<int>(std::min<int64_t>(M, 16)), static_cast<int>(M - 16));
  else configure_rows();
}

// v rounded to bf16 (to nearest even, as vcvtneps2bf16) and widened back.
inline __m512 bf16_float(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// Weights per panel of column pairs (pairs): a panel stays in L2 while every row block passes it.
constexpr int64_t kPanelBytes = int64_t(1) << 20;

// A block's C sums waiting for their epilogue: rows r0 .. r0 + rows of column pair p, in c;
// rows [0, done) written out already.
struct Pending {
  const float* c = nullptr;
  int64_t r0 = 0, p = 0;
  int rows = 0, done = 0;
};

// Rows [i0, i1) of a pending block + bias, rounded to bf16 into out [M, N] (gated: silu(g) *
// u into out [M, N / 2], see pairs(); with a row's delta in drows, g and u are rounded
// again after it is added).
inline void epilogue(const Pending& b, int i0, int i1, const float* bp, c10::BFloat16* op, int64_t N,
                     bool gated, const float* const* drows = nullptr) {
  const int64_t p = b.p;
  for (int i = i0; i < i1; ++i) {
    const float* c = b.c + i * 32;
    __m512 v0 = _mm512_load_ps(c), v1 = _mm512_load_ps(c + 16);
    if (bp) {
      v0 = _mm512_add_ps(v0, _mm512_loadu_ps(bp + p * 32));
      v1 = _mm512_add_ps(v1, _mm512_loadu_ps(bp + p * 32 + 16));
    }
    const __m512i gu = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
    if (gated) {  // g and u as gate_up would store them, read back
      __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm512_castsi512_si256(gu)), 16));
      __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(gu, 1)), 16));
      if (drows && drows[b.r0 + i]) {  // + a LoRA delta (gate's, up's), rounded as lora_add stores
        const float* d = drows[b.r0 + i];
        g = bf16_float(_mm512_add_ps(g, _mm512_loadu_ps(d + p * 16)));
        u = bf16_float(_mm512_add_ps(u, _mm512_loadu_ps(d + N / 2 + p * 16)));
      }
      silu_mul_store(op + (b.r0 + i) * (N / 2) + p * 16, silu16(g), u);
    } else {
      _mm512_storeu_si512(op + (b.r0 + i) * N + p * 32, gu);
    }
  }
}

// Column pairs [p0, p1) of the packed weight wp for all M rows of x [M, K] (ap: its packed
// A tiles from 33 rows on, else unused), + bias (fp32, or null), rounded once to bf16 into
// out [M, N]. gated: a SwiGLU gate_up whose pairs are (gate block p, up block p) (packed from
// a weight whose 16-row blocks alternate gate and up): out [M, N / 2] gets silu(g) * u for
// the pair's 16 features, g and u rounded to bf16 first (the same bits as storing gate_up and
// running silu_row over it, without the [M, N] round trip through memory). In panels of
// pairs holding about kPanelBytes of weights, each panel row block after row block: the
// weight streams from memory once, in the first block's pass (a thread's share of a large
// layer streamed again for every 32-row block had made 512-row calls memory-bound), and the
// block's A tiles stay in cache while the panel passes them.
// The same sums in the same order whatever the panels. The tiles must be configure(M)d.
inline void pairs(const c10::BFloat16* xp, const c10::BFloat16* ap, int64_t M, int64_t K,
                  const uint32_t* wp, const float* bp, c10::BFloat16* op, int64_t N, int64_t p0,
                  int64_t p1, bool gated = false, const float* const* drows = nullptr) {
  constexpr int bh = kBlockRows, nt = bh / 16;
  const int ksteps = static_cast<int>(K / 32);
  const int64_t nblocks = (M + bh - 1) / bh;
  // (a pair holds K * 64 bytes; one row block: no panels)
  const int64_t panel = nblocks > 1 ? std::max<int64_t>(1, kPanelBytes / (K * 64)) : p1 - p0;
  // Each block's epilogue (bias, rounding to bf16, SiLU) runs a few rows per K step of the
  // next block's multiplies (pair_block's during), on the vector units while the tile unit
  // works: run after the block, it had stalled the tiles for its whole length.
  const bool stream = streams(M, K);
  const int64_t from = packed_from(M, K);  // the blocks before it read their A tiles from x
  alignas(64) float cbuf[2][32 * 32];
  int cur = 0;
  Pending prev;  // the block whose epilogue is still to run
  for (int64_t q0 = p0; q0 < p1; q0 += panel) {
    const int64_t q1 = std::min(p1, q0 + panel);
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t r0 = blk * bh;
      const int rows = static_cast<int>(std::min<int64_t>(bh, M - r0));
      const ATiles a = M <= 32 || r0 + bh <= from
                           ? ATiles{xp + r0 * K, 32, 16 * K, K * static_cast<int64_t>(sizeof(c10::BFloat16))}
                           : ATiles{ap + blk * ksteps * nt * 512, nt * 512, 512, 64};
      for (int64_t p = q0; p < q1; ++p) {
        const uint32_t* wpair = wp + p * ksteps * 2 * kBlk;
        const int per = prev.rows ? (prev.rows + ksteps - 1) / ksteps : 0;
        pair_block(a, M <= 32 ? rows : 32, wpair, ksteps, cbuf[cur], blk == 0, stream, [&](int) {
          if (prev.done < prev.rows) {
            const int i1 = std::min(prev.rows, prev.done + per);
            epilogue(prev, prev.done, i1, bp, op, N, gated, drows);
            prev.done = i1;
          }
        });
        epilogue(prev, prev.done, prev.rows, bp, op, N, gated, drows);  // (none left: per covers it)
        prev = Pending{cbuf[cur], r0, p, rows, 0};
        cur ^= 1;
      }
    }
  }
  epilogue(prev, prev.done, prev.rows, bp, op, N, gated, drows);
}

#endif  // SERVELM_AMX

}  // namespace amx_linear
}  // namespace
