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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// The same float operations for every row count (see gemv.cpp).
#pragma GCC optimize("no-fast-math")

#include "linear_frame.h"  // run_linear_into, check_x
#include "q8act_kernel.h"  // quantize_row, panels

namespace {

using q8act::kB;
using q8act::kNR;

template <typename X, typename O>
void gemm_q4(const X* x, const uint8_t* w, const c10::Half* scales, const c10::Half* mins,
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
    q8act::panels(q, d, ds, w, scales, mins, group_size, bias, out, M, N, K, p0, p1, wide);
  });
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t group_size, int64_t N,
                       const c10::optional<at::Tensor>& bias, bool wide) {
  const char* name = "servelm_q8act.int4_linear";
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte && qweight.dim() == 5 &&
                  qweight.size(2) == 2 && qweight.size(3) == 4 && qweight.size(4) == 32 &&
                  qweight.is_contiguous(),
              name, ": qweight must be contiguous uint8 [ceil(N / 16), K / 32, 2, 4, 32] on the CPU");
  const int64_t NP = qweight.size(0), K = qweight.size(1) * kB;
  TORCH_CHECK(N > 0 && (N + kNR - 1) / kNR == NP, name, ": out_features ", N, " does not match ",
              NP, " panels of 16");
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
    const uint8_t* w = qweight.data_ptr<uint8_t>();
    const c10::Half* s = scales.data_ptr<c10::Half>();
    const c10::Half* mn = mins.data_ptr<c10::Half>();
    if (x.scalar_type() == at::kFloat)
      gemm_q4(x.data_ptr<float>(), w, s, mn, group_size, b, out.data_ptr<float>(), M, N, K, wide);
    else
      gemm_q4(x.data_ptr<c10::BFloat16>(), w, s, mn, group_size, b,
              out.data_ptr<c10::BFloat16>(), M, N, K, wide);
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

}  // namespace

TORCH_LIBRARY(servelm_q8act, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group_size, "
        "int out_features, Tensor? bias=None, bool wide=True) -> Tensor");
  m.def("has_wide() -> bool", &has_wide);
  m.def("quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(servelm_q8act, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("quantize", &quantize);
}

#endif  // AVX2 + FMA + F16C
