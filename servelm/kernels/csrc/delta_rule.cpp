// The gated delta rule's decode step over recurrent-state slots (namespace
// torch.ops.servelm_delta_rule): servelm/models/linear_attention.py's delta_rule_step on
// the slots in place, each state matrix read once and written once (the PyTorch form
// gathers the slots, reads them twice and writes them twice, then scatters them back).
//
//   step(S float32 [N, H, Dk, Dv] (updated in place), slots int64 [B], q, k float32
//        [B, H, Dk] (normalised, q scaled), v float32 [B, H, Dv], g, beta float32 [B, H],
//        fresh bool [B]) -> o float32 [B, H, Dv]
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

namespace {

void check(const at::Tensor& t, const char* name, int dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim,
              name, ": a contiguous float32 tensor of ", dim, " dims");
}

at::Tensor step(at::Tensor S, const at::Tensor& slots, const at::Tensor& q,
                const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                const at::Tensor& beta, const at::Tensor& fresh) {
  check(S, "S", 4);
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
  float* s = S.data_ptr<float>();
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
      float* st = s + (sl[b] * H + h) * Dk * Dv;
      const float* qi = qp + i * Dk;
      const float* ki = kp + i * Dk;
      const float* vi = vp + i * Dv;
      float* oi = op + i * Dv;
      if (fr[b]) std::fill(st, st + Dk * Dv, 0.0f);
      std::fill(kv.begin(), kv.end(), 0.0f);
      std::fill(qs.begin(), qs.end(), 0.0f);
      float qk = 0.0f;
      for (int64_t r = 0; r < Dk; ++r) {
        const float a = ki[r], c = qi[r];
        const float* row = st + r * Dv;
        qk += a * c;
        for (int64_t j = 0; j < Dv; ++j) {
          kv[j] += row[j] * a;
          qs[j] += row[j] * c;
        }
      }
      const float d = std::exp(gp[i]), bt = bp[i];
      for (int64_t j = 0; j < Dv; ++j) {
        delta[j] = bt * (vi[j] - d * kv[j]);
        oi[j] = d * qs[j] + qk * delta[j];
      }
      for (int64_t r = 0; r < Dk; ++r) {
        const float a = ki[r];
        float* row = st + r * Dv;
        for (int64_t j = 0; j < Dv; ++j) row[j] = d * row[j] + a * delta[j];
      }
    }
  });
  return o;
}

}  // namespace

TORCH_LIBRARY(servelm_delta_rule, m) {
  m.def("step(Tensor(a!) S, Tensor slots, Tensor q, Tensor k, Tensor v, Tensor g, "
        "Tensor beta, Tensor fresh) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_delta_rule, CPU, m) { m.impl("step", &step); }
