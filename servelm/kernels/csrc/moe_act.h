// A routed expert's activation of one gate / up pair, the weighted sum of a token's experts,
// the routing operands' checks and the frame that runs a layer's experts (moe::run_phases,
// moe::run_op), shared by the fused MoE ops (gemv.cpp's moe_experts over bf16 / int8 experts,
// q8act.cpp's over int4 and MXFP4 ones) and the DecodeStack, so all give the same bits. act 0: SiLU, 1: GELU (tanh), 2: GELU (erf), 3: gpt-oss's clamped
// SwiGLU ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// The routing operands both fused ops take, checked (the errors named after the op) and
// converted once: ids [T, k] int64, each an expert of E; weights [T, k] float32; act 0-3;
// the experts' biases gate_up_bias [E, 2I] and down_bias [E, H], float32, where given.
struct MoeRouting {
  at::Tensor ids, weights, gate_up_bias, down_bias;
  const int64_t* id() const { return ids.data_ptr<int64_t>(); }
  const float* weight() const { return weights.data_ptr<float>(); }
  const float* gbias() const { return gate_up_bias.defined() ? gate_up_bias.data_ptr<float>() : nullptr; }
  const float* dbias() const { return down_bias.defined() ? down_bias.data_ptr<float>() : nullptr; }
};

inline MoeRouting moe_routing(const char* name, const at::Tensor& ids_in, const at::Tensor& w_in,
                              int64_t T, int64_t E, int64_t I, int64_t H, int64_t act,
                              const c10::optional<at::Tensor>& gbias_in,
                              const c10::optional<at::Tensor>& dbias_in) {
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == T && w_in.sizes() == ids_in.sizes(),
              name, ": ids and weights must be [T, k]");
  TORCH_CHECK(act >= 0 && act <= 3, name, ": act must be 0, 1, 2 or 3");
  MoeRouting r;
  if (gbias_in && gbias_in->defined()) {
    TORCH_CHECK(gbias_in->numel() == E * 2 * I, name, ": gate_up_bias [E, 2I]");
    r.gate_up_bias = gbias_in->to(at::kFloat).contiguous();
  }
  if (dbias_in && dbias_in->defined()) {
    TORCH_CHECK(dbias_in->numel() == E * H, name, ": down_bias [E, H]");
    r.down_bias = dbias_in->to(at::kFloat).contiguous();
  }
  r.ids = ids_in.to(at::kLong).contiguous();
  r.weights = w_in.to(at::kFloat).contiguous();
  const int64_t* idp = r.id();
  for (int64_t p = 0, P = r.ids.numel(); p < P; ++p)
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, name, ": expert id out of range");
  return r;
}

inline float moe_act(int64_t act, float v, float u, float limit, float alpha) {
  if (act == 3) {
    const float gate = std::min(v, limit);
    const float up = std::min(std::max(u, -limit), limit);
    return (up + 1.f) * gate / (1.f + std::exp(-alpha * gate));
  }
  if (act == 0) return v / (1.f + std::exp(-v)) * u;
  if (act == 1) return 0.5f * v * (1.f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v))) * u;
  return 0.5f * v * (1.f + std::erf(v * 0.7071067811865476f)) * u;
}

// out[t][c] = sum_j weights[t, j] y[t k + j][c] for columns [c0, c1) of every token, in slot
// order, rounded once to O: the fused ops' last step over a thread's share of the columns.
template <typename O>
inline void moe_weighted_sum(const float* weights, const float* y, O* out, int64_t T, int64_t k,
                             int64_t H, int64_t c0, int64_t c1) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = c0; c < c1; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) acc += weights[t * k + j] * y[(t * k + j) * H + c];
      out[t * H + c] = static_cast<O>(acc);
    }
}

namespace moe {

// What a layer's routed experts share whatever their weights' layout: the experts' fp32 biases
// gate_up [E, 2I] and down [E, H] (or null), the activation (moe_act's act, limit, alpha), the
// hidden size H and each expert's intermediate size I.
struct ExpertMlp {
  const float* gbias = nullptr;
  const float* dbias = nullptr;
  int64_t act = 0;
  float limit = 0.f, alpha = 1.f;
  int64_t H = 0, I = 0;
};

// The per-step buffers of a MoE layer's routed experts for T tokens of k experts each (P = T k
// pairs), for moe_kernel.h's Panels and gemv_kernel.h's Rows: each token's row quantised (qx,
// dx, dsx) or widened (xf), each pair's gate_up output h, activation a and its quantised row
// (qa, da, dsa), and each pair's down output y. Grown, never shrunk.
struct Scratch {
  std::vector<int8_t> qx, qa;
  std::vector<float> xf, dx, dsx, da, dsa, h, a, y;
  void size(int64_t T, int64_t P, int64_t H, int64_t I) {
    const int64_t NBH = H / 32, NBI = I / 32;  // (the panels' activation blocks)
    auto grow = [](auto& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    };
    grow(qx, T * H), grow(xf, T * H), grow(qa, P * I), grow(dx, T * NBH), grow(dsx, T * NBH);
    grow(da, P * NBI), grow(dsa, P * NBI), grow(h, P * 2 * I), grow(a, P * I), grow(y, P * H);
  }
};

// A layer's experts L (moe_kernel.h's Panels, gemv_kernel.h's Rows) for T tokens of k experts
// each (ids, weights [T k]) on thread tid of n: its share of each phase's items (gate_up,
// activate, down into out), barrier() between the phases. Each token's row prepared first
// (L.quantize).
template <typename Layer, typename O, typename Barrier>
void run_phases(const Layer& L, const int64_t* ids, const float* weights, int64_t T, int64_t k, int64_t tid,
                int64_t n, O* out, Scratch& s, Barrier&& barrier) {
  const int64_t P = T * k, n1 = L.gate_up_items(P), n2 = L.act_items(P), n3 = L.down_items();
  L.gate_up(ids, k, n1 * tid / n, n1 * (tid + 1) / n, s);
  barrier();
  L.activate(n2 * tid / n, n2 * (tid + 1) / n, s);
  barrier();
  L.down(ids, weights, T, k, n3 * tid / n, n3 * (tid + 1) / n, out, s);
}

// A fused op's body: x [T, H] (float32 or bfloat16) through the layer's experts, each token's
// row prepared once, then the three phases in one parallel region (a few tokens' step is
// short: three regions' fork and join cost as much as the expert rows' stream); out [T, H] in
// x's dtype.
template <typename Layer>
at::Tensor run_op(const Layer& L, const at::Tensor& x_in, const int64_t* ids, const float* weights, int64_t k) {
  const int64_t T = x_in.size(0), H = x_in.size(1), P = T * k;
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({T, H}, x_in.options());
  if (P == 0) return out.zero_();
  Scratch s;
  s.size(T, P, H, L.I);
  for (int64_t t = 0; t < T; ++t) {
    if (x.scalar_type() == at::kFloat) L.quantize(x.data_ptr<float>() + t * H, t, s);
    else L.quantize(x.data_ptr<c10::BFloat16>() + t * H, t, s);
  }
  auto store = [&](auto* o) {
    const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
    run_phases(L, ids, weights, T, k, omp_get_thread_num(), omp_get_num_threads(), o, s, [] {
#pragma omp barrier
    });
  };
  if (out.scalar_type() == at::kFloat) store(out.data_ptr<float>());
  else store(out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace moe
}  // namespace
