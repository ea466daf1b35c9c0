// A routed expert's activation of one gate / up pair, shared by the fused MoE ops
// (gemv.cpp's moe_experts over bf16 / int8 experts, q8act.cpp's over int4 ones), so both give
// the same bits for a pair. act 0: SiLU, 1: GELU (tanh), 2: GELU (erf), 3: gpt-oss's clamped
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

}  // namespace
