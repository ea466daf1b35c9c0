// fp32 and bf16 linear layers for a few activation rows (decode) on x86 CPUs with AVX2 + FMA,
// over the layer's own row-major weight: a step is bound by reading the weight once, and
// oneDNN's fp32 matrix-vector path read it at about half the machine's bandwidth (Zen 3, 2
// cores). Namespace torch.ops.servelm_gemv:
//
//   f32_linear(x, weight, bias?, by_row=False) -> y
// x: [..., K] float32; weight: [N, K] float32, contiguous, K a multiple of 8; y: [..., N].
//   bf16_linear(x, weight, bias?, by_row=False) -> y
// weight: [N, K] bfloat16, contiguous; x: [..., K] bfloat16 or float32; y in x's dtype. The
// weights are widened to fp32 as they are read (a shift), the products summed in fp32 and
// rounded once to x's dtype (bf16 without AVX512-BF16: oneDNN's bf16 path converted too, at
// a fraction of the bandwidth).
//
// Rows of N in blocks of 4 are split over the torch (OpenMP) threads; each block is read once
// per two activation rows, its 4 x 2 dot products kept in 8 vector accumulators (the
// weights' 4 vectors and the rows' 2 read by the step), folded at the end by hadds. by_row:
// the block's weight rows one after another instead (the matrix read as one sequential
// stream; each row's products in 4 accumulators, k unrolled by 4), which streams short rows
// faster on some CPUs and long ones slower: the tuner measures both ("gemv", "gemv_rows").
// Every output is computed by the same operations whatever the row count, so results do
// not depend on the batch (row-invariant, bit for bit), in either order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)

// The same float operations for every row-count instantiation (see qdot.cpp).
#pragma GCC optimize("no-fast-math")

#include "avx2_vec.h"     // load8f: under the pragma
#include "moe_act.h"      // moe_routing: under the pragma too
#include "gemv_kernel.h"  // gemv::block, block_rows, moe::Rows

namespace {

using gemv::block;
using gemv::block_rows;
using gemv::kRows;

// y = x weight^T (+ bias) for W = float (x float32) or c10::BFloat16 (x bfloat16 or float32).
template <typename W>
at::Tensor run(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
               bool by_row, const char* op) {
  const at::ScalarType wt = std::is_same<W, float>::value ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat ||
                                         (wt == at::kBFloat16 && x_in.scalar_type() == at::kBFloat16)),
              "servelm_gemv.", op, ": x must be ", wt == at::kFloat ? "float32" : "bfloat16 or float32",
              " on the CPU, got ", x_in.scalar_type());
  TORCH_CHECK(weight.scalar_type() == wt && weight.dim() == 2 && weight.is_contiguous(),
              "servelm_gemv.", op, ": weight must be contiguous ", wt, " [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x_in.size(-1) == K && K % 8 == 0, "servelm_gemv.", op,
              ": x's last dim must be in_features (a multiple of 8): ", x_in.size(-1), " vs ", K);
  // The activations in fp32 (a bf16 row widened once per call, not once per weight block).
  const at::Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x_in.options());
  if (M == 0 || N == 0) return out;
  at::Tensor bf;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "servelm_gemv.", op, ": bias must have out_features elements");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const W* wp = reinterpret_cast<const W*>(weight.data_ptr());
  const int64_t NB = (N + kRows - 1) / kRows;
  // Enough weight rows per task to amortise the scheduling (a few tens of KB).
  const int64_t grain = std::max<int64_t>(1, 8192 / K);
  auto go = [&](auto* op_) {
    at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kRows;
        const int nr = static_cast<int>(std::min<int64_t>(kRows, N - n0));
        int64_t m0 = 0;
        if (by_row) {
          for (; m0 + 2 <= M; m0 += 2) block_rows<2>(xp, wp, bp, op_, m0, n0, nr, K, N);
          if (m0 < M) block_rows<1>(xp, wp, bp, op_, m0, n0, nr, K, N);
        } else {
          for (; m0 + 2 <= M; m0 += 2) block<2>(xp, wp, bp, op_, m0, n0, nr, K, N);
          if (m0 < M) block<1>(xp, wp, bp, op_, m0, n0, nr, K, N);
        }
      }
    });
  };
  if (out.scalar_type() == at::kFloat)
    go(out.data_ptr<float>());
  else
    go(out.data_ptr<c10::BFloat16>());
  return out;
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias, bool by_row) {
  return run<float>(x, weight, bias, by_row, "f32_linear");
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, bool by_row) {
  return run<c10::BFloat16>(x, weight, bias, by_row, "bf16_linear");
}

// A mixture-of-experts layer's routed experts for a few tokens (decode), in one call:
//   out[t] = sum_j weights[t, j] * down[e] (act(gate[e] x[t]) * up[e] x[t]),  e = ids[t, j]
// gate_up [E, 2I, H] (gate rows, then up), down [E, H, I], both of x's dtype (bfloat16, or
// float32 for float32 x), or both int8 with gate_up_scale [E, 2I] and down_scale [E, H]
// (float32: each row's symmetric scale; x bfloat16 or float32), contiguous; ids [T, k]
// int64, weights [T, k] float32; act 0: SiLU,
// 1: GELU (tanh), 2: GELU (erf), 3: gpt-oss's clamped SwiGLU ((clamp(up, -limit, limit) + 1)
// * g * sigmoid(alpha g), g = min(gate, limit)); gate_up_bias [E, 2I] and down_bias [E, H]
// (float32) where the experts have biases; by_row: each block's weight rows one after
// another (bf16_linear's by_row). Every (token, expert) pair reads its expert's rows (no reuse
// across tokens: for a few rows that is what the op-by-op path reads too, without its
// per-expert calls); the three phases (gate_up blocks, the activation, down rows and the
// weighted sum) split over the threads of one parallel region; everything in fp32, rounded
// once to x's dtype.
template <typename W>
at::Tensor moe_run(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& w_in,
                   const at::Tensor& gate_up, const at::Tensor& down, int64_t act,
                   const c10::optional<at::Tensor>& gbias_in,
                   const c10::optional<at::Tensor>& dbias_in, double limit_d, double alpha_d,
                   bool by_row, const c10::optional<at::Tensor>& gscale_in,
                   const c10::optional<at::Tensor>& dscale_in) {
  constexpr bool q8 = std::is_same<W, int8_t>::value;
  const at::ScalarType wt = q8 ? at::kChar : std::is_same<W, float>::value ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 &&
              (q8 ? (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16)
                  : x_in.scalar_type() == wt),
              "servelm_gemv.moe_experts: x must be [T, H] on the CPU, of the experts' dtype "
              "(bfloat16 or float32 for int8 experts)");
  TORCH_CHECK(gate_up.scalar_type() == wt && down.scalar_type() == wt && gate_up.dim() == 3 &&
              down.dim() == 3 && gate_up.is_contiguous() && down.is_contiguous(),
              "servelm_gemv.moe_experts: gate_up [E, 2I, H] and down [E, H, I], contiguous");
  const int64_t T = x_in.size(0), H = x_in.size(1), E = gate_up.size(0);
  const int64_t I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(2) == H && down.size(0) == E && down.size(1) == H &&
              down.size(2) == I && gate_up.size(1) == 2 * I && H % 8 == 0 && I % 8 == 0,
              "servelm_gemv.moe_experts: shapes do not fit (H and I multiples of 8)");
  const MoeRouting route = moe_routing("servelm_gemv.moe_experts", ids_in, w_in, T, E, I, H, act,
                                       gbias_in, dbias_in);
  at::Tensor gscale, dscale;
  TORCH_CHECK(q8 == (gscale_in && gscale_in->defined()) && q8 == (dscale_in && dscale_in->defined()),
              "servelm_gemv.moe_experts: int8 experts take gate_up_scale and down_scale, others none");
  if (q8) {
    TORCH_CHECK(gscale_in->numel() == E * 2 * I && dscale_in->numel() == E * H,
                "servelm_gemv.moe_experts: gate_up_scale [E, 2I] and down_scale [E, H]");
    gscale = gscale_in->to(at::kFloat).contiguous();
    dscale = dscale_in->to(at::kFloat).contiguous();
  }
  moe::Rows<W> L;
  L.gw = reinterpret_cast<const W*>(gate_up.data_ptr()), L.dw = reinterpret_cast<const W*>(down.data_ptr());
  L.gscale = q8 ? gscale.data_ptr<float>() : nullptr, L.dscale = q8 ? dscale.data_ptr<float>() : nullptr;
  L.gbias = route.gbias(), L.dbias = route.dbias(), L.act = act;
  L.limit = static_cast<float>(limit_d), L.alpha = static_cast<float>(alpha_d), L.by_row = by_row;
  L.H = H, L.I = I;
  return moe::run_op(L, x_in, route.id(), route.weight(), ids_in.size(1));
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t act,
                       const c10::optional<at::Tensor>& gate_up_bias,
                       const c10::optional<at::Tensor>& down_bias, double limit, double alpha,
                       bool by_row, const c10::optional<at::Tensor>& gate_up_scale,
                       const c10::optional<at::Tensor>& down_scale) {
  if (gate_up.scalar_type() == at::kChar)
    return moe_run<int8_t>(x, ids, weights, gate_up, down, act, gate_up_bias, down_bias, limit,
                           alpha, by_row, gate_up_scale, down_scale);
  if (x.scalar_type() == at::kFloat)
    return moe_run<float>(x, ids, weights, gate_up, down, act, gate_up_bias, down_bias, limit,
                          alpha, by_row, gate_up_scale, down_scale);
  return moe_run<c10::BFloat16>(x, ids, weights, gate_up, down, act, gate_up_bias, down_bias,
                                limit, alpha, by_row, gate_up_scale, down_scale);
}

}  // namespace

TORCH_LIBRARY(servelm_gemv, m) {
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias=None, bool by_row=False) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias=None, bool by_row=False) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, Tensor down, "
        "int act, Tensor? gate_up_bias=None, Tensor? down_bias=None, float limit=0., "
        "float alpha=1., bool by_row=False, Tensor? gate_up_scale=None, "
        "Tensor? down_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_gemv, CPU, m) {
  m.impl("f32_linear", &f32_linear);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("moe_experts", &moe_experts);
}

#endif  // AVX2 + FMA
