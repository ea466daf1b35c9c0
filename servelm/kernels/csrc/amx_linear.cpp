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
//         above      blocks of 32 rows, 2 A tiles x 2 B tiles (one tile load per multiply),
//                    over panels of ~1 MB of weights that stay in L2 while every block passes.
//       Above 32 rows x is first packed into contiguous 1 KB A tiles (a tile of 16 rows of a
//       long x was the kernel's slowest load), except in streaming calls (kernel header's
//       streams(): 4 blocks or more, a block's A tiles small enough to stay in L1), which read
//       whole blocks from x and pack only a last, partial one. A row's result depends on that
//       row only (the same K order in every path): batch-invariant.
//   gated_linear(Tensor x bf16 [M, K], Tensor packed, Tensor? bias fp32 [N], int N)
//       -> bf16 [M, N / 2]
//       A SwiGLU gate_up in one pass: the weight packed from [gate; up] with their 16-row
//       blocks alternating (gate 0, up 0, gate 1, up 1, ..: each column pair is one gate block
//       and its up block; the bias in the same order), and silu(gate) * up written instead of
//       gate_up: the same bits as linear() then servelm_ops.silu_and_mul on the unpermuted
//       weight, without writing and reading back the [M, N] product.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>

#include "amx_linear_kernel.h"  // the kernel; amx_tiles.h: SERVELM_AMX, amx_available, store_b_tile

namespace {

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

at::Tensor run_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t N, bool gated) {
  const char* name = gated ? "servelm_amx_linear.gated_linear" : "servelm_amx_linear.linear";
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
  shape.back() = gated ? N / 2 : N;
  at::Tensor out = at::empty(shape, x.options());
  if (M == 0) return out;
#ifdef SERVELM_AMX
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t pairs = N / 32;
  // More than 32 rows: A packed once a call into 1 KB tiles (every thread reads all of it,
  // a block at a time).
  at::Tensor apack;
  const int64_t elems = amx_linear::packed_elems(M, K);
  if (elems) apack = at::empty({elems}, xc.options());
  c10::BFloat16* ap = elems ? apack.data_ptr<c10::BFloat16>() : nullptr;
  const int64_t bh = amx_linear::kBlockRows, padded = amx_linear::padded_rows(M);
  const int64_t from = amx_linear::packed_from(M, K);
  auto run = [&](int64_t p0, int64_t p1) {
    amx_linear::configure(M);
    amx_linear::pairs(xp, ap, M, K, wp, bp, op, N, p0, p1, gated);
    _tile_release();
  };
  const int nthreads = std::max(1, at::get_num_threads());
  // One thread only for small layers at few rows: a weight over 256 KB streams faster on
  // every core, even for one row.
  const bool small = M * N * K < (int64_t(1) << 21) && N * K < (int64_t(1) << 17);
  if (nthreads == 1 || pairs == 1 || small) {
    if (ap && from < padded) amx_linear::pack_rows(xp, ap, M, K, from, padded);
    run(0, pairs);
  } else {
#pragma omp parallel num_threads(nthreads)
    {
      if (ap && from < padded) {
#pragma omp for schedule(static)
        for (int64_t r = from; r < padded; r += bh) amx_linear::pack_rows(xp, ap, M, K, r, r + bh);
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

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t N) {
  return run_linear(x, packed, bias, N, false);
}

at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t N) {
  return run_linear(x, packed, bias, N, true);
}

}  // namespace

TORCH_LIBRARY(servelm_amx_linear, m) {
  m.def("available() -> bool", &available);  // no tensor to dispatch on: a catch-all kernel
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
  m.def("gated_linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_amx_linear, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
  m.impl("gated_linear", &gated_linear);
}
