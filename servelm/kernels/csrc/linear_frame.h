// The frame the AVX2 linear ops share (panels.cpp, q8act.cpp, bfp.cpp): x's last dim checked, x as fp32
// [M, K] (a bf16 row widened once per call, not once per panel), the bias checked and as
// fp32, an fp32 [M, N] output that run(x, bias or null, out, M) fills (the sums may run
// through it), returned rounded once to x's dtype in x's leading shape. x's dtype is the caller's to check (check_x: the
// quantised ops' float32 or bfloat16). Inline, in an anonymous namespace like avx2_vec.h.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace {

// The same frame for an op that reads x and writes y in x's own dtype (native): run(x, bias
// or null, out, M) gets x as a contiguous [M, K] tensor (fp32, or x's dtype if native) and the
// [M, N] output (x's dtype if native: the op rounds each output as it stores it, once, as
// .to() would; else fp32, rounded after run).
template <typename Run>
at::Tensor run_linear_into(const at::Tensor& x_in, int64_t K, int64_t N,
                           const c10::optional<at::Tensor>& bias, const char* name, bool native,
                           const Run& run) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, name, ": x's last dim must be "
              "in_features: ", x_in.size(-1), " vs ", K);
  at::Tensor bf;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, name, ": bias must have out_features elements");
    bf = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor x = native ? x_in.reshape({-1, K}).contiguous()
                              : x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0) run(x, bf.defined() ? bf.data_ptr<float>() : nullptr, out, M);
  return out.to(x_in.scalar_type()).reshape(shape);
}

template <typename Run>
at::Tensor run_linear(const at::Tensor& x_in, int64_t K, int64_t N,
                      const c10::optional<at::Tensor>& bias, const char* name, const Run& run) {
  return run_linear_into(x_in, K, N, bias, name, false,
                         [&](const at::Tensor& x, const float* b, at::Tensor& out, int64_t M) {
    run(x.data_ptr<float>(), b, out.data_ptr<float>(), M);
  });
}

// x float32 or bfloat16 on the CPU (the quantised ops).
inline void check_x(const at::Tensor& x_in, const char* name) {
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat ||
                                         x_in.scalar_type() == at::kBFloat16),
              name, ": x must be float32 or bfloat16 on the CPU, got ", x_in.scalar_type());
}

}  // namespace
