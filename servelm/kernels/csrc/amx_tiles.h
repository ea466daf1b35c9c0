// AMX tile helpers shared by amx_attention.cpp and amx_linear.cpp: whether the kernels are
// compiled (SERVELM_AMX: the compiler targets AMX-BF16 and AVX512-BF16), whether the OS lets
// this process use the tile state, and the tile configuration both load. Definitions sit in
// an anonymous namespace: each extension compiles its own copy.
#pragma once

#include <cstdint>

#include "amx_state.h"  // amx_permitted, TileConfig, load_config

#if defined(SERVELM_AMX_TILE) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SERVELM_AMX 1
#endif

namespace {

constexpr int kBlk = 256;  // dwords in one 16 x 16 dword tile (1 KB)

#ifdef SERVELM_AMX

// 8 tiles, each `rows` rows of 64 bytes (A: 16 x 32 bf16; B: 16 rows of K pairs x 16 dwords;
// C: 16 x 16 fp32). Loaded per thread, before its first tile instruction.
inline void load_tile_config(const uint8_t (&rows)[8]) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = rows[i];
  }
  load_config(cfg);
}

// One B tile from 16 rows of 16 dwords (row n at rows[n] + off): K pair p of row n lands at
// dword p * 16 + n of the 1 KB tile at dst, the layout tdpbf16ps reads for its B operand.
// (transpose16x16: decode_attention.h, included before this is used.)
inline void store_b_tile(const uint32_t* const* rows, int64_t off, uint32_t* dst) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(rows[n] + off);
  transpose16x16(r);
  for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 16, r[p]);
}

#endif  // SERVELM_AMX

// Whether the AMX kernels are built here and may run (the OS granted the tile state).
inline bool amx_available() {
#ifdef SERVELM_AMX
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace
