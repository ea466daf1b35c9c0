// The frame the AVX2 linear ops share (panels.cpp, q8act.cpp): x's last dim checked, x as fp32
// [M, K] (a bf16 row widened once per call, not once per panel), the bias checked and as
// fp32, an fp32 [M, N] output that run(x, bias or null, out, M) fills (the sums may run
// through it), returned rounded once to x's dtype in x's leading shape. x's dtype is the caller's to check (check_x: the
// quantised ops' float32 or bfloat16). Inline, in an anonymous namespace like avx2_vec.h.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace {

// The operands as run_linear's (x fp32 [M, K], bias fp32 or null) and the [M, N] output
// tensor itself; out_dtype_direct: allocated in x's dtype, for an op that rounds each output
// to it as it stores it (once, as .to() would), else fp32 and rounded after run.
template <typename Run>
at::Tensor run_linear_into(const at::Tensor& x_in, int64_t K, int64_t N,
                           const c10::optional<at::Tensor>& bias, const char* name,
                           bool out_dtype_direct, const Run& run) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, name, ": x's last dim must be "
              "in_features: ", x_in.size(-1), " vs ", K);
  at::Tensor bf;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, name, ": bias must have out_features elements");
    bf = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_dtype_direct ? x_in.scalar_type()
                                                                          : at::kFloat));
  if (M > 0) run(x.data_ptr<float>(), bf.defined() ? bf.data_ptr<float>() : nullptr, out, M);
  return out.to(x_in.scalar_type()).reshape(shape);
}

template <typename Run>
at::Tensor run_linear(const at::Tensor& x_in, int64_t K, int64_t N,
                      const c10::optional<at::Tensor>& bias, const char* name, const Run& run) {
  return run_linear_into(x_in, K, N, bias, name, false,
                         [&](const float* x, const float* b, at::Tensor& out, int64_t M) {
    run(x, b, out.data_ptr<float>(), M);
  });
}

// x float32 or bfloat16 on the CPU (the quantised ops).
inline void check_x(const at::Tensor& x_in, const char* name) {
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat ||
                                         x_in.scalar_type() == at::kBFloat16),
              name, ": x must be float32 or bfloat16 on the CPU, got ", x_in.scalar_type());
}

}  // namespace
