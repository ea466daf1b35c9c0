// servelm bf16 linear layers on AMX tiles (namespace torch.ops.servelm_amx_linear): the
// "amx" linear method (servelm/layers/amx.py).
//
//   available() -> bool
//       Whether this build has the AMX kernels (compiled where the compiler targets
//       AMX-BF16) and they may run: the OS granted this process the AMX tile state.
//   pack(Tensor w bf16 [N, K]) -> Tensor int32
//       The weight in tile order, once at start-up: for each pair of 16-column blocks
//       (32 outputs) and each 32-wide K step, the two B tiles (16 rows of K pairs x 16
//       columns, 1 KB each) side by side, so one pair's weights are one contiguous stream.
//       N and K must be multiples of 32.
//   linear(Tensor x bf16 [M, K], Tensor packed, Tensor? bias fp32 [N], int N) -> bf16 [M, N]
//       x @ w.T (+ bias): fp32 sums, rounded once to bf16. Threads take contiguous runs of
//       column pairs; each row block runs over the thread's pairs, their weights streamed
//       (prefetched ahead of the tile loads) past the block's A tiles. Blocks by row count:
//         up to 32   the tiles configured to the call's rows, read straight from x;
//         33 to 192  blocks of 64 rows, 4 A tiles x 1 B tile (the weight streams in one pass);
//         above      blocks of 32 rows, 2 A tiles x 2 B tiles (one tile load per multiply).
//       Above 32 rows x is first packed into contiguous 1 KB A tiles (a tile of 16 rows of a
//       long x was the kernel's slowest load). A row's result depends on that row only (the
//       same K order in every path): batch-invariant.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>

#include "decode_attention.h"  // transpose16x16
#include "amx_tiles.h"        // SERVELM_AMX, amx_available, load_tile_config, store_b_tile, kBlk

namespace {

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
constexpr int kQuadMaxRows = 192;
constexpr int64_t kChunkBytes = 512 << 10;  // packed activation rows a pass over the pairs keeps  // calls of 33 .. this many rows take 64-row blocks

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
// column pair wp (K/32 steps of two B tiles): C = A W^T as fp32 [32][32] in c.
inline void pair_block(const ATiles& a, int rows, const uint32_t* wp, int ksteps, float* c) {
  const bool two = rows > 16;  // a second row tile
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int kb = 0; kb < ksteps; ++kb) {
    const uint32_t* b = wp + static_cast<int64_t>(kb) * 2 * kBlk;
    prefetch_step(b + kPrefetchSteps * 2 * kBlk);
    _tile_loadd(4, a.at(kb, 0), a.stride);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + kBlk, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a.at(kb, 1), a.stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (two) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// 64 rows against column pair wp, in two passes (one per 16-column block) of 4 A tiles x 1
// B tile -> 4 C tiles: each B tile is used by all 64 rows as it arrives, so the weight
// streams in one pass (2 x 2 blocks would read it during the first 32 rows' pass and compute
// the second's from cache, streaming half the time). C = A W^T as fp32 [64][32].
inline void quad_block(const ATiles& a, const uint32_t* wp, int ksteps, float* c) {
  for (int col = 0; col < 2; ++col) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < ksteps; ++kb) {
      const uint32_t* b = wp + static_cast<int64_t>(kb) * 2 * kBlk;
      if (col == 0) prefetch_step(b + kPrefetchSteps * 2 * kBlk);
      _tile_loadd(6, b + col * kBlk, 64);
      _tile_loadd(4, a.at(kb, 0), a.stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a.at(kb, 1), a.stride);
      _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(4, a.at(kb, 2), a.stride);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, a.at(kb, 3), a.stride);
      _tile_dpbf16ps(3, 5, 6);
    }
    _tile_stored(0, c + col * 16, 128);
    _tile_stored(1, c + 16 * 32 + col * 16, 128);
    _tile_stored(2, c + 32 * 32 + col * 16, 128);
    _tile_stored(3, c + 48 * 32 + col * 16, 128);
  }
}

#endif  // SERVELM_AMX

bool available() { return amx_available(); }

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(available(), "servelm_amx_linear.pack: AMX-BF16 is not available here");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "servelm_amx_linear.pack: the weight must be a bf16 CPU matrix [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "servelm_amx_linear.pack: N and K must be multiples of 32, got ",
              N, " x ", K);
  at::Tensor out = at::empty({N * K / 2}, w.options().dtype(at::kInt));
#ifdef SERVELM_AMX
  const at::Tensor wc = w.contiguous();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(wc.data_ptr<c10::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  const int64_t K2 = K / 2, ksteps = K / 32;
  at::parallel_for(0, N / 16, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {  // 16 output rows of w -> their B tiles
      const uint32_t* rows[16];  // output n's K pairs
      for (int n = 0; n < 16; ++n) rows[n] = src + (nb * 16 + n) * K2;
      for (int64_t kb = 0; kb < ksteps; ++kb)
        store_b_tile(rows, kb * 16, dst + ((nb / 2) * ksteps + kb) * 2 * kBlk + (nb % 2) * kBlk);
    }
  });
#endif
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t N) {
  const char* name = "servelm_amx_linear.linear";
  TORCH_CHECK(available(), name, ": AMX-BF16 is not available here");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.device().is_cpu(), name,
              ": x must be bf16 on the CPU");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0 && packed.numel() == N * K / 2, name,
              ": packed weight does not match x's ", K, " features and N = ", N);
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                        name, ": bias must be contiguous fp32 [N]");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (M == 0) return out;
#ifdef SERVELM_AMX
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int ksteps = static_cast<int>(K / 32);
  const int64_t pairs = N / 32;
  // Row blocks of 64 (quad_block) where the weight stream is the cost: more than one 32-row
  // block and few enough rows that the tiles' compute stays under the stream; else of 32.
  const int bh = M > 32 && M <= kQuadMaxRows ? 64 : 32, nt = bh / 16;
  const int64_t nblocks = (M + bh - 1) / bh;
  // More than 32 rows: A packed once a call into [block][K step][row tile] 1 KB tiles, the
  // rows past M zero (every thread reads all of it, a block at a time).
  at::Tensor apack;
  if (M > 32) apack = at::empty({nblocks * bh * K}, xc.options());
  c10::BFloat16* ap = M > 32 ? apack.data_ptr<c10::BFloat16>() : nullptr;
  auto pack_block = [&](int64_t blk) {
    for (int kb = 0; kb < ksteps; ++kb)
      for (int t = 0; t < nt; ++t) {
        c10::BFloat16* dst = ap + ((blk * ksteps + kb) * nt + t) * 512;
        for (int i = 0; i < 16; ++i) {
          const int64_t row = blk * bh + t * 16 + i;
          if (row < M) std::memcpy(dst + i * 32, xp + row * K + kb * 32, 64);
          else std::memset(static_cast<void*>(dst + i * 32), 0, 64);
        }
      }
  };
  auto tiles_of = [&](int64_t blk) -> ATiles {
    if (M <= 32) return {xp, 32, 16 * K, K * static_cast<int64_t>(sizeof(c10::BFloat16))};
    return {ap + blk * ksteps * nt * 512, nt * 512, 512, 64};
  };
  auto run = [&](int64_t p0, int64_t p1) {
    if (M <= 32) configure_rows(static_cast<int>(std::min<int64_t>(M, 16)), static_cast<int>(M - 16));
    else configure_rows();
    alignas(64) float c[64 * 32];
    // Row block after row block, each over the thread's column pairs: the block's A tiles
    // stay in cache while the weight streams past them.
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t r0 = blk * bh;
      const int rows = static_cast<int>(std::min<int64_t>(bh, M - r0));
      for (int64_t p = p0; p < p1; ++p) {
        const uint32_t* wpair = wp + p * ksteps * 2 * kBlk;
        if (bh == 64) quad_block(tiles_of(blk), wpair, ksteps, c);
        else pair_block(tiles_of(blk), M <= 32 ? rows : 32, wpair, ksteps, c);
        for (int i = 0; i < rows; ++i) {
          c10::BFloat16* dst = op + (r0 + i) * N + p * 32;
          __m512 v0 = _mm512_load_ps(c + i * 32), v1 = _mm512_load_ps(c + i * 32 + 16);
          if (bp) {
            v0 = _mm512_add_ps(v0, _mm512_loadu_ps(bp + p * 32));
            v1 = _mm512_add_ps(v1, _mm512_loadu_ps(bp + p * 32 + 16));
          }
          _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
        }
      }
    }
    _tile_release();
  };
  const int nthreads = std::max(1, at::get_num_threads());
  // One thread only for small layers at few rows: a weight over 256 KB streams faster on
  // every core, even for one row.
  const bool small = M * N * K < (int64_t(1) << 21) && N * K < (int64_t(1) << 17);
  if (nthreads == 1 || pairs == 1 || small) {
    if (ap)
      for (int64_t blk = 0; blk < nblocks; ++blk) pack_block(blk);
    run(0, pairs);
  } else {
#pragma omp parallel num_threads(nthreads)
    {
      if (ap) {
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < nblocks; ++blk) pack_block(blk);
      }  // (the for's barrier: every block packed before any is read)
      // Contiguous runs of column pairs: each thread streams its share of the weight, once
      // per row block.
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      run(pairs * t / n, pairs * (t + 1) / n);
    }
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(servelm_amx_linear, m) {
  m.def("available() -> bool", &available);  // no tensor to dispatch on: a catch-all kernel
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_amx_linear, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
