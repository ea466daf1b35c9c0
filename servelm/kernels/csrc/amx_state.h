// AMX's process state and tile configuration, for every kernel on AMX tiles (amx_tiles.h's
// bf16 ones, w8a8_tiles.h's int8 one): whether the OS lets this process use the tile data
// state, and a palette-1 configuration loaded as GCC 12 needs it. Built where the compiler
// targets AMX-TILE (SERVELM_AMX_TILE); in an anonymous namespace (each extension compiles its
// own copy).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#define SERVELM_AMX_TILE 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// Linux keeps the AMX tile data state off until a process asks for it (arch_prctl).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return ok;
}

// Palette 1: up to 8 tiles, tile i `rows[i]` rows of `colsb[i]` bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads cfg on this thread, before its first tile instruction. GCC 12's _tile_loadconfig
// tells the compiler it reads 8 bytes of cfg, which then drops the stores to the rest as
// dead (ldtilecfg faults on the garbage): a memory barrier keeps them.
inline void load_config(const TileConfig& cfg) {
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace

#endif  // __AMX_TILE__
