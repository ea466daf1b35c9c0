// The gated delta rule's decode step over recurrent-state slots (namespace
// torch.ops.servelm_delta_rule): servelm/models/linear_attention.py's delta_rule_step on
// the slots in place, each state matrix read once and written once (the PyTorch form
// gathers the slots, reads them twice and writes them twice, then scatters them back).
//
//   step(S float32 [N, H, Dk, Dv] (updated in place), slots int64 [B], q, k float32
//        [B, H, Dk] (normalised, q scaled), v float32 [B, H, Dv], g, beta float32 [B, H],
//        fresh bool [B]) -> o float32 [B, H, Dv]
//
//   decode(S, conv_state [N, C, K-1] (updated in place), slots, fresh, mixed [B, C],
//          ba [B, 2 Hv], z [B, Hv Dv], conv_weight [C, K], A_log, dt_bias [Hv],
//          norm_weight [Dv], num_k_heads, eps) -> out [B, Hv Dv]
//       A decode-only step of GatedDeltaNet (linear_attention.py's forward between its two
//       projections) in one call: each row's causal convolution step over its slot's last
//       K-1 inputs, SiLU, q / k L2-normalised per key head (q scaled), the gate
//       g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), the delta-rule step
//       above, then the gated RMSNorm of each value head times silu(z). mixed, ba, z,
//       conv_state, conv_weight, norm_weight and the output share the activations' dtype
//       (fp32 or bf16; rows may be strided), and values are rounded to it where the PyTorch
//       path rounds them (the convolution's products and sum, the SiLU, the core's output,
//       the normed head, its weighting).
//
// For each row b and head h, with St = S[slots[b], h] (zeroed first where fresh[b]) and
// d = exp(g): a pass over St's rows accumulates St^T k and St^T q; then
// delta = beta (v - d St^T k), o = d St^T q + (q . k) delta, and a second pass writes
// St = d St + k delta^T (the head's matrix is still in cache from the first).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "delta_rule_kernel.h"  // the row and head steps (shared with the DecodeStack)

namespace {

void check(const at::Tensor& t, const char* name, int dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim,
              name, ": a contiguous float32 tensor of ", dim, " dims");
}

// The recurrent states: float32, or bf16 (read widened, each new value rounded once).
void check_state(const at::Tensor& S) {
  TORCH_CHECK((S.scalar_type() == at::kFloat || S.scalar_type() == at::kBFloat16) && S.is_contiguous() &&
                  S.dim() == 4,
              "S: a contiguous float32 or bfloat16 tensor of 4 dims");
}

template <typename ST>
void step_impl(ST* s, const int64_t* sl, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& g, const at::Tensor& beta, const at::Tensor& fresh, at::Tensor& o);

at::Tensor step(at::Tensor S, const at::Tensor& slots, const at::Tensor& q,
                const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                const at::Tensor& beta, const at::Tensor& fresh) {
  check_state(S);
  check(q, "q", 3);
  check(k, "k", 3);
  check(v, "v", 3);
  check(g, "g", 2);
  check(beta, "beta", 2);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "slots: a contiguous int64 vector");
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.is_contiguous() &&
                  fresh.numel() == slots.numel(), "fresh: a bool per slot");
  const int64_t N = S.size(0), H = S.size(1), Dk = S.size(2), Dv = S.size(3);
  const int64_t B = slots.size(0);
  TORCH_CHECK(q.size(0) == B && q.size(1) == H && q.size(2) == Dk && k.sizes() == q.sizes() &&
                  v.size(0) == B && v.size(1) == H && v.size(2) == Dv && g.size(0) == B &&
                  g.size(1) == H && beta.sizes() == g.sizes(),
              "q, k [B, H, Dk], v [B, H, Dv] and g, beta [B, H] for S [N, H, Dk, Dv]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sl[b] >= 0 && sl[b] < N, "slot ", sl[b], " out of range [0, ", N, ")");
  }
  auto o = at::empty({B, H, Dv}, q.options());
  if (S.scalar_type() == at::kBFloat16) step_impl(S.data_ptr<c10::BFloat16>(), sl, q, k, v, g, beta, fresh, o);
  else step_impl(S.data_ptr<float>(), sl, q, k, v, g, beta, fresh, o);
  return o;
}

template <typename ST>
void step_impl(ST* s, const int64_t* sl, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& g, const at::Tensor& beta, const at::Tensor& fresh, at::Tensor& o) {
  const int64_t B = q.size(0), H = q.size(1), Dk = q.size(2), Dv = v.size(2);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const bool* fr = fresh.data_ptr<bool>();
  float* op = o.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> kv(Dv), qs(Dv), delta(Dv);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / H, h = i % H;
      delta_rule::head_step<ST>(s + (sl[b] * H + h) * Dk * Dv, qp + i * Dk, kp + i * Dk, vp + i * Dv,
                                gp[i], bp[i], fr[b], Dk, Dv, op + i * Dv, kv.data(), qs.data(),
                                delta.data());
    }
  });
}

template <typename T, typename ST>
void decode_impl(at::Tensor& S, at::Tensor& conv_state, const int64_t* sl, const bool* fr,
                 const at::Tensor& mixed, const at::Tensor& ba, const at::Tensor& z,
                 const at::Tensor& conv_weight, const float* A_log, const float* dt_bias,
                 const at::Tensor& norm_weight, int64_t Hk, double eps_d, at::Tensor& out) {
  const int64_t B = mixed.size(0), C = mixed.size(1), K1 = conv_state.size(2);
  const int64_t H = S.size(1), Dk = S.size(2), Dv = S.size(3);
  const float eps = static_cast<float>(eps_d);
  const T* xm = mixed.data_ptr<T>();
  const T* xba = ba.data_ptr<T>();
  const T* xz = z.data_ptr<T>();
  const T* w = conv_weight.data_ptr<T>();
  const T* nw = norm_weight.data_ptr<T>();
  T* cs = conv_state.data_ptr<T>();
  T* o = out.data_ptr<T>();
  ST* s = S.data_ptr<ST>();
  // Per row: q, k [Hk, Dk] (normalised, q scaled), v [H Dv], g and beta [H], fp32.
  std::vector<float> act(B * C), gb(B * 2 * H);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      delta_rule::conv_row<T>(xm + b * mixed.stride(0), cs + sl[b] * C * K1, fr[b], w, C, K1, Hk,
                              Dk, xba + b * ba.stride(0), A_log, dt_bias, H, act.data() + b * C,
                              gb.data() + b * 2 * H);
  });
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch(4 * Dv);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / H, h = i % H;
      delta_rule::head_out<T, ST>(s + (sl[b] * H + h) * Dk * Dv, act.data() + b * C,
                              gb.data() + b * 2 * H, h, H, Hk, Dk, Dv, fr[b],
                              xz + b * z.stride(0) + h * Dv, nw, eps,
                              o + b * out.stride(0) + h * Dv, scratch.data());
    }
  });
}

at::Tensor decode(at::Tensor S, at::Tensor conv_state, const at::Tensor& slots,
                  const at::Tensor& fresh, const at::Tensor& mixed, const at::Tensor& ba,
                  const at::Tensor& z, const at::Tensor& conv_weight, const at::Tensor& A_log,
                  const at::Tensor& dt_bias, const at::Tensor& norm_weight, int64_t num_k_heads,
                  double eps) {
  check_state(S);
  const int64_t N = S.size(0), H = S.size(1), Dk = S.size(2), Dv = S.size(3);
  const auto dt = mixed.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "decode: fp32 or bf16 activations");
  for (const at::Tensor* t : {&ba, &z, &conv_weight, &norm_weight,
                              static_cast<const at::Tensor*>(&conv_state)})
    TORCH_CHECK(t->scalar_type() == dt, "decode: mixed, ba, z, conv_state, conv_weight and "
                "norm_weight share one dtype");
  TORCH_CHECK(num_k_heads >= 1 && H % num_k_heads == 0, "decode: the value heads (", H,
              ") must be a multiple of the key heads (", num_k_heads, ")");
  const int64_t B = slots.numel(), C = mixed.size(1);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "slots: a contiguous int64 vector");
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.is_contiguous() && fresh.numel() == B,
              "fresh: a bool per slot");
  TORCH_CHECK(mixed.dim() == 2 && mixed.size(0) == B && mixed.stride(1) == 1 &&
                  C == 2 * num_k_heads * Dk + H * Dv,
              "decode: mixed must be [B, 2 Hk Dk + H Dv] with contiguous rows");
  TORCH_CHECK(ba.dim() == 2 && ba.size(0) == B && ba.size(1) == 2 * H && ba.stride(1) == 1,
              "decode: ba must be [B, 2 H] with contiguous rows");
  TORCH_CHECK(z.dim() == 2 && z.size(0) == B && z.size(1) == H * Dv && z.stride(1) == 1,
              "decode: z must be [B, H Dv] with contiguous rows");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous() && conv_state.size(0) == N &&
                  conv_state.size(1) == C,
              "decode: conv_state must be contiguous [N, C, K - 1]");
  TORCH_CHECK(conv_weight.is_contiguous() && conv_weight.dim() == 2 && conv_weight.size(0) == C &&
                  conv_weight.size(1) == conv_state.size(2) + 1,
              "decode: conv_weight must be contiguous [C, K]");
  TORCH_CHECK(norm_weight.is_contiguous() && norm_weight.numel() == Dv,
              "decode: norm_weight must hold Dv values");
  TORCH_CHECK(A_log.numel() == H && dt_bias.numel() == H, "decode: A_log and dt_bias: H values");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sl[b] >= 0 && sl[b] < N, "slot ", sl[b], " out of range [0, ", N, ")");
  const at::Tensor a32 = A_log.to(at::kFloat).contiguous(), d32 = dt_bias.to(at::kFloat).contiguous();
  auto out = at::empty({B, H * Dv}, mixed.options());
  if (B == 0) return out;
  const bool bf16_state = S.scalar_type() == at::kBFloat16;
  auto run = [&](auto act, auto state) {
    using T = decltype(act);
    using ST = decltype(state);
    decode_impl<T, ST>(S, conv_state, sl, fresh.data_ptr<bool>(), mixed, ba, z, conv_weight,
                       a32.data_ptr<float>(), d32.data_ptr<float>(), norm_weight, num_k_heads, eps,
                       out);
  };
  if (dt == at::kFloat) {
    if (bf16_state) run(float{}, c10::BFloat16{});
    else run(float{}, float{});
  } else {
    if (bf16_state) run(c10::BFloat16{}, c10::BFloat16{});
    else run(c10::BFloat16{}, float{});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(servelm_delta_rule, m) {
  m.def("step(Tensor(a!) S, Tensor slots, Tensor q, Tensor k, Tensor v, Tensor g, "
        "Tensor beta, Tensor fresh) -> Tensor");
  m.def("decode(Tensor(a!) S, Tensor(b!) conv_state, Tensor slots, Tensor fresh, Tensor mixed, "
        "Tensor ba, Tensor z, Tensor conv_weight, Tensor A_log, Tensor dt_bias, "
        "Tensor norm_weight, int num_k_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_delta_rule, CPU, m) {
  m.impl("step", &step);
  m.impl("decode", &decode);
}
