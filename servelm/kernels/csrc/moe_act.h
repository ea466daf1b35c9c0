// A routed expert's activation of one gate / up pair and the weighted sum of a token's
// experts, shared by the fused MoE ops (gemv.cpp's moe_experts over bf16 / int8 experts,
// q8act.cpp's over int4 ones), so both give the same bits for them. act 0: SiLU, 1: GELU (tanh), 2: GELU (erf), 3: gpt-oss's clamped
// SwiGLU ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

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

}  // namespace
