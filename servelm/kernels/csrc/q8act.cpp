// int4 weights times activations quantised per call to int8, on x86 CPUs with AVX2 (+ F16C):
// the AVX2 integer multiply-add (vpmaddubsw: 32 unsigned-byte x signed-byte products a
// vector, summed in pairs) does four times the multiplications of an fp32 FMA a vector, so
// batches and prompts, compute-bound, run up to twice as fast as on the fp32 panels. This is
// what llama.cpp's Q4_0 x Q8_0 and OpenVINO's CPU "dynamic quantization" (on by default for
// compressed weights, groups of 32) do. Namespace torch.ops.servelm_q8act:
//
//   int4_linear(x, qweight, scales, mins, group_size, out_features, bias?) -> y
// x: [..., K] float32 or bfloat16; each row is quantised per block of 32 inputs to int8
//   (d = max|x| / 127, q = round-to-nearest-even(x * (127 / max|x|)), all in fp32; a block of
//   zeros gives d = 0, q = 0), with d * sum(q) kept for the weights' mins.
// qweight: uint8 [ceil(N / 16), K / 32, 2, 4, 32]: panels of 16 outputs; per block of 32
//   inputs, per half h (outputs 8h .. 8h + 7), per chunk c, byte 4 o + t holds output o's q at
//   input 8c + t in its low nibble and at 8c + 4 + t in its high one (servelm/layers/q8act.py
//   packs them). The columns past N are zeros and never stored.
// scales, mins: Int4Linear's own float16 [ceil(N / 16), K / group_size, 16] (w = s q + m);
//   group_size a multiple of 32.
// y = sum over blocks of (s d) * sum(q_w q_x) + m * (d sum(q_x)): the exact dot product of the
//   dequantised weights with the dequantised activations, the block sums exact in integers
//   and chained over the blocks in fp32 in order (two fused multiply-adds a block), so a row's
//   result is the same bits whatever the row count and whatever rows share its call. y in x's
//   dtype, rounded once.
// wide: the AVX-512 VNNI micro-kernel where this build has it (has_wide()), 8 rows a call;
//   False runs the AVX2 one (4 rows a call): the same bits, which the tests compare.
//
//   moe_experts(x, ids, weights, gate_up_q, gate_up_s, gate_up_m, down_q, down_s, down_m, act, ...)
// a MoE layer's routed int4 experts for a few tokens in one call (see the function's head).
//
//   moe_route(x, weight, bias?, top_k, norm, scale, shared_gate, groups, topk_groups, score_bias?,
//             in_scale?, in_root, in_eps, expert_scale?)
//   -> (weights, ids, gate): a MoE layer's router for a few tokens (see the function's head).
//
//   mxfp4_linear(x, qweight, exps, out_features, bias?) -> y;  moe_experts_mxfp4(...)
// the same with MXFP4 weights (gpt-oss's experts): E2M1 codes in the panels' nibbles, an E8M0
// exponent byte a block of 32 (q8act_kernel.h's MX4Fmt); exact products, as for int4.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// The same float operations for every row count (see gemv.cpp).
#pragma GCC optimize("no-fast-math")

#include "linear_frame.h"  // run_linear_into, check_x
#include "q8act_kernel.h"  // quantize_row, panels
#include "moe_kernel.h"    // moe::route_row, moe::Panels (and moe_act.h: moe_routing)

namespace {

using q8act::kB;
using q8act::kNR;

template <typename Fmt, typename X, typename O>
void gemm_q4(const X* x, const uint8_t* w, const typename Fmt::S* scales, const typename Fmt::S* mins,
             int64_t group_size, const float* bias, O* out, int64_t M, int64_t N, int64_t K,
             bool wide) {
  const int64_t NP = (N + kNR - 1) / kNR, NB = K / kB;
  std::vector<int8_t> qv(M * K);
  std::vector<float> dv(M * NB), dsv(M * NB);
  int8_t* q = qv.data();
  float* d = dv.data();
  float* ds = dsv.data();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) q8act::quantize_row(x + r * K, K, q + r * K, d + r * NB, ds + r * NB);
  });
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    q8act::panels<O, Fmt>(q, d, ds, w, scales, mins, group_size, bias, out, M, N, K, p0, p1, wide);
  });
}

// gemm_q4 over x [M, K] and out [M, N] of x's dtype (float32 or bfloat16).
template <typename Fmt>
void gemm_panels(const at::Tensor& x, const uint8_t* w, const typename Fmt::S* scales,
                 const typename Fmt::S* mins, int64_t group_size, const float* bias, at::Tensor& out,
                 int64_t M, int64_t N, int64_t K, bool wide) {
  if (x.scalar_type() == at::kFloat)
    gemm_q4<Fmt>(x.data_ptr<float>(), w, scales, mins, group_size, bias, out.data_ptr<float>(), M, N, K,
                 wide);
  else
    gemm_q4<Fmt>(x.data_ptr<c10::BFloat16>(), w, scales, mins, group_size, bias,
                 out.data_ptr<c10::BFloat16>(), M, N, K, wide);
}

// Checks a weight in the panels, qweight uint8 [ceil(N / 16), K / 32, 2, 4, 32], against
// out_features N; returns K.
int64_t check_panels(const at::Tensor& qweight, int64_t N, const char* name) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte && qweight.dim() == 5 &&
                  qweight.size(2) == 2 && qweight.size(3) == 4 && qweight.size(4) == 32 &&
                  qweight.is_contiguous(),
              name, ": qweight must be contiguous uint8 [ceil(N / 16), K / 32, 2, 4, 32] on the CPU");
  TORCH_CHECK(N > 0 && (N + kNR - 1) / kNR == qweight.size(0), name, ": out_features ", N,
              " does not match ", qweight.size(0), " panels of 16");
  return qweight.size(1) * kB;
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t group_size, int64_t N,
                       const c10::optional<at::Tensor>& bias, bool wide) {
  const char* name = "servelm_q8act.int4_linear";
  const int64_t K = check_panels(qweight, N, name), NP = qweight.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kB == 0 && K % group_size == 0, name, ": group_size ",
              group_size, " must be a multiple of 32 dividing in_features ", K);
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kHalf && t->is_contiguous() &&
                    t->dim() == 3 && t->size(0) == NP && t->size(1) == K / group_size && t->size(2) == kNR,
                name, ": scales and mins must be contiguous float16 [ceil(N / 16), K / group_size, 16]");
  check_x(x_in, name);
  // x read and each output rounded and stored in x's own dtype (a bf16 batch's fp32 output
  // would be a pass over memory as large as the call's weights, then another to round it).
  return run_linear_into(x_in, K, N, bias, name, true,
                         [&](const at::Tensor& x, const float* b, at::Tensor& out, int64_t M) {
    gemm_panels<q8act::Q4Fmt>(x, qweight.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(),
                              mins.data_ptr<c10::Half>(), group_size, b, out, M, N, K, wide);
  });
}

// An MXFP4 layer (E2M1 codes in the panels, where int4_linear has its q; an E8M0 exponent a
// block of 32, exps uint8 [ceil(N / 16), K / 32, 16]: q8act_kernel.h's MX4Fmt) times x
// quantised per block to int8, as int4_linear: y in x's dtype.
at::Tensor mxfp4_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& exps,
                        int64_t N, const c10::optional<at::Tensor>& bias, bool wide) {
  const char* name = "servelm_q8act.mxfp4_linear";
  const int64_t K = check_panels(qweight, N, name);
  TORCH_CHECK(exps.device().is_cpu() && exps.scalar_type() == at::kByte && exps.is_contiguous() &&
                  exps.dim() == 3 && exps.size(0) == qweight.size(0) && exps.size(1) == qweight.size(1) &&
                  exps.size(2) == kNR,
              name, ": exps must be contiguous uint8 [ceil(N / 16), K / 32, 16]");
  check_x(x_in, name);
  return run_linear_into(x_in, K, N, bias, name, true,
                         [&](const at::Tensor& x, const float* b, at::Tensor& out, int64_t M) {
    gemm_panels<q8act::MX4Fmt>(x, qweight.data_ptr<uint8_t>(), exps.data_ptr<uint8_t>(), nullptr, kB, b,
                               out, M, N, K, wide);
  });
}

// The activations' quantisation alone (q, d, d * sum(q)): what tests check the kernel's
// rounding against.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) &&
                  x_in.dim() >= 1 && x_in.size(-1) % kB == 0,
              "servelm_q8act.quantize: x must be float32 or bfloat16 on the CPU with a last dim "
              "a multiple of 32");
  const int64_t K = x_in.size(-1);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();  // read as the kernel reads it
  const int64_t M = x.size(0), NB = K / kB;
  at::Tensor q = at::empty({M, K}, at::kChar), d = at::empty({M, NB}, at::kFloat),
             ds = at::empty({M, NB}, at::kFloat);
  for (int64_t r = 0; r < M; ++r) {
    int8_t* qr = q.data_ptr<int8_t>() + r * K;
    float* dr = d.data_ptr<float>() + r * NB;
    float* dsr = ds.data_ptr<float>() + r * NB;
    if (x.scalar_type() == at::kFloat)
      q8act::quantize_row(x.data_ptr<float>() + r * K, K, qr, dr, dsr);
    else
      q8act::quantize_row(x.data_ptr<c10::BFloat16>() + r * K, K, qr, dr, dsr);
  }
  return {q, d, ds};
}

bool has_wide() { return q8act::kVnni; }

// The fused routed experts over the panels of either format (Fmt: moe_kernel.h's moe::Panels,
// which the DecodeStack's MoE layers run too), in moe::run_op's frame: each token's row
// quantised once, each pair's gate_up panels, its activation quantised once, the down panels
// and the weighted sum; out in x's dtype. gs / gm and ds / dm:
// the gate_up and down scales and mins (mins null for MX4), s1 / s2 an expert's count of them,
// group the group size.
template <typename Fmt>
at::Tensor moe_panels(const char* name, const at::Tensor& x_in, const at::Tensor& ids_in,
                      const at::Tensor& w_in, const at::Tensor& gq, const typename Fmt::S* gsp,
                      const typename Fmt::S* gmp, int64_t s1, const at::Tensor& dq,
                      const typename Fmt::S* dsp, const typename Fmt::S* dmp, int64_t s2,
                      int64_t group, int64_t act, const c10::optional<at::Tensor>& gbias_in,
                      const c10::optional<at::Tensor>& dbias_in, double limit_d, double alpha_d,
                      bool wide) {
  const int64_t T = x_in.size(0), H = x_in.size(1), E = gq.size(0), I = dq.size(2) * kB;
  const MoeRouting route = moe_routing(name, ids_in, w_in, T, E, I, H, act, gbias_in, dbias_in);
  moe::Panels<Fmt> L;
  L.gq = gq.data_ptr<uint8_t>(), L.dq = dq.data_ptr<uint8_t>();
  L.gs = gsp, L.gm = gmp, L.ds = dsp, L.dm = dmp, L.s1 = s1, L.s2 = s2, L.group = group;
  L.gbias = route.gbias(), L.dbias = route.dbias(), L.act = act, L.H = H, L.I = I;
  L.limit = static_cast<float>(limit_d), L.alpha = static_cast<float>(alpha_d), L.wide = wide;
  return moe::run_op(L, x_in, route.id(), route.weight(), ids_in.size(1));
}

// A MoE layer's router for a few tokens (moe::route_row, which the DecodeStack's MoE layers run
// too): x bfloat16 [T, H], weight bfloat16 [E, H] (H a multiple of 16), bias [E] or None; the
// top_k experts of each token, their weights renormalised where norm, times scale ->
// (weights float32 [T, top_k] holding bfloat16 values, ids int64 [T, top_k], gate bfloat16
// [T, 1]). The softmax router, or with groups > 0 DeepSeek-V3's grouped sigmoid one
// (topk_groups of them, score_bias [E] or None: moe::Router). shared_gate: weight's last row
// (E + 1 rows) is a shared expert's gate, whose logits go to gate (else empty [T, 0]).
// Gemma 4's router: in_scale [H] (its input normalised, times in_scale and in_root; in_eps the
// norm's) and expert_scale [E] (the chosen weights times it), each or None.
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& x_in, const at::Tensor& weight,
                                                         const c10::optional<at::Tensor>& bias_in,
                                                         int64_t top_k, bool norm, double scale,
                                                         bool shared_gate, int64_t groups, int64_t topk_groups,
                                                         const c10::optional<at::Tensor>& score_bias_in,
                                                         const c10::optional<at::Tensor>& in_scale_in, double in_root,
                                                         double in_eps,
                                                         const c10::optional<at::Tensor>& expert_scale_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
              "servelm_q8act.moe_route: x must be bfloat16 [T, H] on the CPU");
  const int64_t T = x_in.size(0), H = x_in.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == H && H % 16 == 0,
              "servelm_q8act.moe_route: weight must be contiguous bfloat16 [E, H], H a multiple of 16");
  moe::Router r;
  r.E = weight.size(0) - (shared_gate ? 1 : 0), r.k = top_k, r.norm = norm, r.scale = static_cast<float>(scale);
  TORCH_CHECK(top_k >= 1 && top_k <= r.E, "servelm_q8act.moe_route: top_k must be in [1, ", r.E, "]");
  TORCH_CHECK(groups == 0 || (groups <= 64 && r.E % groups == 0 && topk_groups >= 1 && topk_groups <= groups &&
                              top_k <= topk_groups * (r.E / groups)),
              "servelm_q8act.moe_route: groups (at most 64) must divide the ", r.E, " experts, topk_groups "
              "be in [1, groups], and those groups hold top_k experts");
  at::Tensor bias, score_bias, in_scale, expert_scale;
  for (auto [in, out, what] : {std::tuple<const c10::optional<at::Tensor>*, at::Tensor*, const char*>{
                                   &bias_in, &bias, "bias"}, {&score_bias_in, &score_bias, "score_bias"},
                               {&expert_scale_in, &expert_scale, "expert_scale"}})
    if (in->has_value() && (*in)->defined()) {
      TORCH_CHECK((*in)->numel() == r.E, "servelm_q8act.moe_route: ", what, " must have E = ", r.E, " values");
      *out = (*in)->to(at::kFloat).contiguous();
    }
  if (in_scale_in.has_value() && in_scale_in->defined()) {
    TORCH_CHECK(in_scale_in->numel() == H, "servelm_q8act.moe_route: in_scale must have H = ", H, " values");
    in_scale = in_scale_in->to(at::kFloat).contiguous();
  }
  r.in_scale = in_scale.defined() ? in_scale.data_ptr<float>() : nullptr;
  r.in_root = static_cast<float>(in_root), r.in_eps = static_cast<float>(in_eps);
  r.expert_scale = expert_scale.defined() ? expert_scale.data_ptr<float>() : nullptr;
  r.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  r.groups = groups, r.topk_groups = topk_groups;
  r.score_bias = score_bias.defined() ? score_bias.data_ptr<float>() : nullptr;
  const at::Tensor x = x_in.contiguous();
  at::Tensor weights = at::empty({T, top_k}, at::kFloat), ids = at::empty({T, top_k}, at::kLong);
  at::Tensor gate = at::empty({T, shared_gate ? 1 : 0}, x_in.options());
  std::vector<float> scratch(4 * (r.E + 1) + H);
  for (int64_t t = 0; t < T; ++t)
    moe::route_row(x.data_ptr<c10::BFloat16>() + t * H, weight.data_ptr<c10::BFloat16>(), H, r, scratch.data(),
                   ids.data_ptr<int64_t>() + t * top_k, weights.data_ptr<float>() + t * top_k,
                   shared_gate ? gate.data_ptr<c10::BFloat16>() + t : nullptr);
  return {weights, ids, gate};
}

// Checks x [T, H] and the stacked panels of both projections (gate_up [E, 2I / 16, H / 32, 2,
// 4, 32], down [E, H / 16, I / 32, 2, 4, 32], I a multiple of 32).
void check_moe_panels(const char* name, const at::Tensor& x_in, const at::Tensor& gq, const at::Tensor& dq) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              name, ": x must be float32 or bfloat16 [T, H] on the CPU");
  for (const at::Tensor* t : {&gq, &dq})
    TORCH_CHECK(t->scalar_type() == at::kByte && t->dim() == 6 && t->size(3) == 2 && t->size(4) == 4 &&
                    t->size(5) == 32 && t->is_contiguous(),
                name, ": gate_up_q and down_q must be contiguous uint8 [E, N / 16, K / 32, 2, 4, 32]");
  const int64_t H = x_in.size(1), E = gq.size(0), NP1 = gq.size(1), I = dq.size(2) * kB, NP2 = dq.size(1);
  TORCH_CHECK(gq.size(2) * kB == H && dq.size(0) == E && NP1 * kNR == 2 * I && NP2 == (H + kNR - 1) / kNR,
              name, ": shapes do not fit (gate_up [E, 2I, H], down [E, H, I], I a multiple of 32)");
}

// A mixture-of-experts layer's routed experts for a few tokens (decode) in one call, with int4
// experts in the layout above (each expert's gate_up [2I, H] and down [H, I] as int4_linear's
// qweight, scales and mins, stacked over E):
//   out[t] = sum_j weights[t, j] * down[e] (act(gate[e] x[t]) * up[e] x[t]),  e = ids[t, j]
// gate_up_q uint8 [E, 2I / 16, H / 32, 2, 4, 32], gate_up_s / _m float16 [E, 2I / 16, H / G, 16];
// down_q [E, H / 16, I / 32, 2, 4, 32], down_s / _m [E, H / 16, I / G, 16]; H and I multiples of
// 32, G their common group size. x [T, H] float32 or bfloat16; ids [T, k] int64, weights [T, k]
// float32; act and the biases, limit and alpha as servelm_gemv.moe_experts'. Each token's row
// is quantised once (as int4_linear does), each pair's activation row once after its gate_up
// (moe_panels).
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& w_in,
                       const at::Tensor& gq, const at::Tensor& gs, const at::Tensor& gm,
                       const at::Tensor& dq, const at::Tensor& dsc, const at::Tensor& dm, int64_t act,
                       const c10::optional<at::Tensor>& gbias_in,
                       const c10::optional<at::Tensor>& dbias_in, double limit_d, double alpha_d,
                       bool wide) {
  const char* name = "servelm_q8act.moe_experts";
  check_moe_panels(name, x_in, gq, dq);
  const int64_t H = x_in.size(1), E = gq.size(0), NP1 = gq.size(1), I = dq.size(2) * kB, NP2 = dq.size(1);
  for (const at::Tensor* t : {&gs, &gm, &dsc, &dm})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 4 && t->is_contiguous() && t->size(0) == E &&
                    t->size(3) == kNR,
                name, ": scales and mins must be contiguous float16 [E, N / 16, K / G, 16]");
  TORCH_CHECK(gs.sizes() == gm.sizes() && dsc.sizes() == dm.sizes() && gs.size(1) == NP1 &&
                  dsc.size(1) == NP2 && H % gs.size(2) == 0 && I % dsc.size(2) == 0 &&
                  H / gs.size(2) == I / dsc.size(2) && (H / gs.size(2)) % kB == 0,
              name, ": scales and mins must be one group size, a multiple of 32, for both");
  return moe_panels<q8act::Q4Fmt>(name, x_in, ids_in, w_in, gq, gs.data_ptr<c10::Half>(),
                                  gm.data_ptr<c10::Half>(), gs[0].numel(), dq, dsc.data_ptr<c10::Half>(),
                                  dm.data_ptr<c10::Half>(), dsc[0].numel(), H / gs.size(2), act, gbias_in,
                                  dbias_in, limit_d, alpha_d, wide);
}

// The same with MXFP4 experts: their codes in the same panels, and E8M0 exponents gate_up_e
// uint8 [E, 2I / 16, H / 32, 16] and down_e [E, H / 16, I / 32, 16] (mxfp4_linear's).
at::Tensor moe_experts_mxfp4(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& w_in,
                             const at::Tensor& gq, const at::Tensor& ge, const at::Tensor& dq,
                             const at::Tensor& de, int64_t act, const c10::optional<at::Tensor>& gbias_in,
                             const c10::optional<at::Tensor>& dbias_in, double limit_d, double alpha_d,
                             bool wide) {
  const char* name = "servelm_q8act.moe_experts_mxfp4";
  check_moe_panels(name, x_in, gq, dq);
  for (const auto& [q, e] : {std::pair<const at::Tensor*, const at::Tensor*>{&gq, &ge}, {&dq, &de}})
    TORCH_CHECK(e->scalar_type() == at::kByte && e->dim() == 4 && e->is_contiguous() &&
                    e->size(0) == q->size(0) && e->size(1) == q->size(1) && e->size(2) == q->size(2) &&
                    e->size(3) == kNR,
                name, ": gate_up_e and down_e must be contiguous uint8 [E, N / 16, K / 32, 16]");
  return moe_panels<q8act::MX4Fmt>(name, x_in, ids_in, w_in, gq, ge.data_ptr<uint8_t>(), nullptr,
                                   ge[0].numel(), dq, de.data_ptr<uint8_t>(), nullptr, de[0].numel(), kB,
                                   act, gbias_in, dbias_in, limit_d, alpha_d, wide);
}

}  // namespace

TORCH_LIBRARY(servelm_q8act, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group_size, "
        "int out_features, Tensor? bias=None, bool wide=True) -> Tensor");
  m.def("has_wide() -> bool", &has_wide);
  m.def("quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up_q, Tensor gate_up_s, "
        "Tensor gate_up_m, Tensor down_q, Tensor down_s, Tensor down_m, int act, "
        "Tensor? gate_up_bias=None, Tensor? down_bias=None, float limit=0., float alpha=1., "
        "bool wide=True) -> Tensor");
  m.def("moe_route(Tensor x, Tensor weight, Tensor? bias, int top_k, bool norm, float scale, "
        "bool shared_gate=False, int groups=0, int topk_groups=0, Tensor? score_bias=None, "
        "Tensor? in_scale=None, float in_root=1., float in_eps=1e-6, Tensor? expert_scale=None) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("mxfp4_linear(Tensor x, Tensor qweight, Tensor exps, int out_features, Tensor? bias=None, "
        "bool wide=True) -> Tensor");
  m.def("moe_experts_mxfp4(Tensor x, Tensor ids, Tensor weights, Tensor gate_up_q, Tensor gate_up_e, "
        "Tensor down_q, Tensor down_e, int act, Tensor? gate_up_bias=None, Tensor? down_bias=None, "
        "float limit=0., float alpha=1., bool wide=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_q8act, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("quantize", &quantize);
  m.impl("moe_experts", &moe_experts);
  m.impl("mxfp4_linear", &mxfp4_linear);
  m.impl("moe_route", &moe_route);
  m.impl("moe_experts_mxfp4", &moe_experts_mxfp4);
}

#endif  // AVX2 + FMA + F16C
