// Weight-only int8 / int4 linear layers for x86 CPUs with AVX-512 and AVX512-BF16, and
// bf16 and fp32 ones in the same 16-row tiles.
//
//   int4_linear(x, qweight, scales, mins, group_size, out_features, bias?) -> y
//   int8_linear(x, qweight, scales, out_features, bias?) -> y
//   bf16_linear(x, weight, out_features, bias?) -> y   (bf16 x only)
//   f32_linear(x, weight, out_features, bias?) -> y    (fp32 x only)
// x: [..., K] float32 or bfloat16; y: [..., N] in x's dtype; bias: [N] or None.
// Formats (packed by servelm/quantization.py; layouts next to each kernel below):
//   int4: w = s * q + m, q in 0..15, s/m float16 per group of G inputs, 16-row tiles.
//   int8: w = scale * q, q in -127..127, fp32 scale per row, 16-row tiles.
//
// The weight is streamed once per (up to 6 / 4) activation rows and decoded in registers:
// a nibble q becomes the bf16 value 128 + q with one OR (bf16 0x4300 is 128.0 and its last
// mantissa bit is worth 1), vdpbf16ps multiplies 16 rows x a k-pair by a broadcast
// activation pair (products exact in fp32, 16 output rows in the 16 lanes, so no
// horizontal sums), and the +128 is removed with the group's sum of x. fp32 activations are
// split into bf16 hi + lo parts, so fp32 results stay accurate (~1e-5 relative for int4,
// ~1e-4 for int8). Output tiles are split over the torch (OpenMP) threads.
// With bf16 activations and prefill-sized M (>= 48 rows int4, >= 24 int8) each tile is
// instead decoded once to bf16 and multiplied by all the rows (see "decode once").

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/all.h>

#include <type_traits>
#include <vector>

// Built with -march=native: on a CPU without these the file compiles to nothing, no op is
// registered, and servelm.quantization uses its PyTorch paths.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)

#include "tiled_kernels.h"

namespace {

template <bool SPLIT, typename OutT>
void int4_run(int64_t G, const uint8_t* qw, const c10::Half* sc, const c10::Half* mn,
              const c10::BFloat16* xh, const c10::BFloat16* xl, const float* xs,
              const float* bias, OutT* out, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + 15) / 16;
  if constexpr (!SPLIT) {
    if (M >= kDecodeOnceRows4) {  // prefill-sized: decode each tile once, bf16 GEMM on it
      decoded_gemm(Int4Tiles{qw, sc, mn, G, K}, xh, bias, out, M, N, K);
      return;
    }
  }
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    int4_range<SPLIT>(G, qw, sc, mn, xh, xl, xs, bias, out, M, N, K, t0, t1);
  });
}

// Per-call scratch (activation copies, group sums), kept per calling thread: a decode step
// makes ~120 calls, so no ATen ops or heap allocations on the way in.
struct Scratch {
  std::vector<float> xf, xs, bias;
  std::vector<c10::BFloat16> xh, xl;
};
Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t N, Scratch& s) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "bias must be contiguous with ", N, " elements");
  if (bias->scalar_type() == at::kFloat) return bias->data_ptr<float>();
  at::Tensor b = bias->to(at::kFloat);
  s.bias.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
  return s.bias.data();
}

// Activations as the kernels read them: bf16 (fp32 ones split into bf16 hi + lo) and fp32
// sums over each group of G inputs.
struct Acts {
  const c10::BFloat16* xh;
  const c10::BFloat16* xl;
  const float* xs;
};

Acts prepare(const at::Tensor& x, int64_t M, int64_t K, int64_t G, Scratch& S) {
  const int64_t ng = K / G;
  if (x.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
    group_sums(xp, M, K, G, S.xs);
    return {xp, nullptr, S.xs.data()};
  }
  S.xs.resize(M * ng);
  const float* xp = x.data_ptr<float>();
  S.xh.resize(M * K);
  S.xl.resize(M * K);
  for (int64_t i = 0; i < M * ng; ++i) {
    float a = 0.f;
    for (int64_t k = 0; k < G; ++k) {
      const int64_t j = i * G + k;
      const c10::BFloat16 h(xp[j]);
      S.xh[j] = h;
      S.xl[j] = c10::BFloat16(xp[j] - static_cast<float>(h));
      a += xp[j];
    }
    S.xs[i] = a;
  }
  return {S.xh.data(), S.xl.data(), S.xs.data()};
}

at::Tensor make_out(const at::Tensor& x_in, int64_t K, int64_t N, at::Tensor& x, int64_t& M) {
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "servelm_quant kernels take float32 or bfloat16 activations, got ", dtype);
  x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  M = x.numel() / K;
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = N;
  return at::empty(out_shape, x.options());
}

// The entry points' shared part: output allocated, activations and bias prepared (G: the
// group of inputs summed per activation row), then run(split, out, acts, bias, M, K) with
// split a std::bool_constant (fp32 activations: split into bf16 hi + lo). From
// decode_once_rows bf16 rows on, the kernels decode each weight tile to bf16 and multiply
// it by the rows as they are: no group sums are computed (acts.xs is null).
template <typename Run>
at::Tensor linear_call(const at::Tensor& x_in, int64_t N, int64_t G, int64_t decode_once_rows,
                       const std::optional<at::Tensor>& bias, const Run& run) {
  const int64_t K = x_in.size(-1);
  at::Tensor x;
  int64_t M;
  at::Tensor out = make_out(x_in, K, N, x, M);
  if (M == 0) return out;
  Scratch& S = scratch();
  const float* bp = bias_ptr(bias, N, S);
  const bool decode_once = x.scalar_type() == at::kBFloat16 && M >= decode_once_rows;
  const Acts a = decode_once ? Acts{x.data_ptr<c10::BFloat16>(), nullptr, nullptr}
                             : prepare(x, M, K, G, S);
  if (x.scalar_type() == at::kBFloat16)
    run(std::false_type{}, out.data_ptr<c10::BFloat16>(), a, bp, M, K);
  else
    run(std::true_type{}, out.data_ptr<float>(), a, bp, M, K);
  return out;
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t group_size, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  check_int4(qweight, scales, mins, N, group_size, x_in.size(-1));
  const auto* qw = qweight.data_ptr<uint8_t>();
  const auto* sc = scales.data_ptr<c10::Half>();
  const auto* mn = mins.data_ptr<c10::Half>();
  return linear_call(x_in, N, group_size, kDecodeOnceRows4, bias,
                     [&](auto split, auto* out, const Acts& a, const float* bp, int64_t M, int64_t K) {
                       int4_run<decltype(split)::value>(group_size, qw, sc, mn, a.xh, a.xl, a.xs, bp,
                                                        out, M, N, K);
                     });
}

template <bool SPLIT, typename OutT>
void int8_run(const uint8_t* qw, const float* sc, const c10::BFloat16* xh, const c10::BFloat16* xl,
              const float* xs, const float* bias, OutT* out, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + 15) / 16;
  if constexpr (!SPLIT) {
    if (M >= kDecodeOnceRows8) {  // prefill-sized: decode each tile once, bf16 GEMM on it
      decoded_gemm(Int8Tiles{qw, sc, K}, xh, bias, out, M, N, K);
      return;
    }
  }
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    int8_range<SPLIT>(qw, sc, xh, xl, xs, bias, out, M, N, K, t0, t1);
  });
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t N, const std::optional<at::Tensor>& bias) {
  check_int8(qweight, scales, N, x_in.size(-1));
  const auto* qw = qweight.data_ptr<uint8_t>();
  const auto* sc = scales.data_ptr<float>();
  return linear_call(x_in, N, x_in.size(-1), kDecodeOnceRows8, bias,  // one group a row
                     [&](auto split, auto* out, const Acts& a, const float* bp, int64_t M, int64_t K) {
                       int8_run<decltype(split)::value>(qw, sc, a.xh, a.xl, a.xs, bp, out, M, N, K);
                     });
}


template <typename T, typename Range>
at::Tensor tiled_linear(const at::Tensor& x_in, const at::Tensor& weight, int64_t N,
                        const std::optional<at::Tensor>& bias, const char* name, const Range& range) {
  const int64_t K = x_in.size(-1);
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16>;
  check_tiled<T>(weight, N, K, name);
  const int64_t tiles = (N + 15) / 16;
  TORCH_CHECK(x_in.scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat), name, " takes ",
              bf16 ? "bfloat16" : "float32", " activations, got ", x_in.scalar_type());
  at::Tensor x;
  int64_t M;
  at::Tensor out = make_out(x_in, K, N, x, M);
  if (M == 0) return out;
  const float* bp = bias_ptr(bias, N, scratch());
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  if (M >= kGemmRows16) {
    at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      range(xp, bp, op, M, 2 * p0, std::min(tiles, 2 * p1));
    });
  } else {
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { range(xp, bp, op, M, t0, t1); });
  }
  return out;
}


at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& weight, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  const int64_t K = x_in.size(-1);
  return tiled_linear<c10::BFloat16>(
      x_in, weight, N, bias, "bf16_linear",
      [&](const c10::BFloat16* x, const float* bp, c10::BFloat16* out, int64_t M, int64_t t0,
          int64_t t1) { bf16_range(weight.data_ptr<c10::BFloat16>(), x, bp, out, M, N, K, t0, t1); });
}

// ---------------------------------------------------------------- fp32 (tiled)

// fp32 weights of an fp32 model, in 16-row tiles: tile t is K vectors of 16 fp32 (64 bytes),
// vector k holding w[16t .. 16t + 15][k]. Below kGemmRows16 rows the weight streams through
// broadcast FMAs (16 output rows in the 16 lanes, no horizontal sums); from there a GEMM
// micro-kernel takes 8 rows x a pair of tiles (16 accumulators) in place. oneDNN's prepacked
// fp32 matmul streamed the LM head at ~49 GB/s at one row here.
// out rows [m0, m0 + MT), tiles t0 .. t0 + NT - 1 (weights w[0..NT)), broadcast FMAs.
template <int MT, int NT>
void f32_rows(const float* const* w, const float* x, const float* bias, float* out, int64_t m0,
              int64_t N, int64_t K, int64_t t0) {
  __m512 acc[NT][MT];
  for (int u = 0; u < NT; ++u)
    for (int m = 0; m < MT; ++m) acc[u][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NT];
    for (int u = 0; u < NT; ++u) wv[u] = _mm512_loadu_ps(w[u] + 16 * k);
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_set1_ps(x[(m0 + m) * K + k]);
      for (int u = 0; u < NT; ++u) acc[u][m] = _mm512_fmadd_ps(wv[u], xv, acc[u][m]);
    }
  }
  for (int u = 0; u < NT; ++u) {
    const int64_t n0 = 16 * (t0 + u);
    const TileOut to(N, n0, bias);
    for (int m = 0; m < MT; ++m) to.store(out + (m0 + m) * N + n0, acc[u][m]);
  }
}

template <int NT, int MT = kGemmRows>
void f32_rows_n(int mt, const float* const* w, const float* x, const float* bias, float* out,
                int64_t m0, int64_t N, int64_t K, int64_t t0) {
  if constexpr (MT >= 1) {
    if (mt == MT) return f32_rows<MT, NT>(w, x, bias, out, m0, N, K, t0);
    f32_rows_n<NT, MT - 1>(mt, w, x, bias, out, m0, N, K, t0);
  }
}

at::Tensor f32_linear(const at::Tensor& x_in, const at::Tensor& weight, int64_t N,
                      const std::optional<at::Tensor>& bias) {
  const int64_t K = x_in.size(-1);
  return tiled_linear<float>(
      x_in, weight, N, bias, "f32_linear",
      [&](const float* x, const float* bp, float* out, int64_t M, int64_t t0, int64_t t1) {
        const float* w = weight.data_ptr<float>();
        tiled_range(
            w, M, K, t0, t1,
            [&](auto nt, int mt, const float* const* wp, int64_t m0, int64_t t) {
              f32_rows_n<decltype(nt)::value>(mt, wp, x, bp, out, m0, N, K, t);
            },
            [&](auto mt, int64_t m0, int64_t t) { stream_tiles<decltype(mt)::value>(w, x, bp, out, m0, N, K, t); });
      });
}

}  // namespace

TORCH_LIBRARY(servelm_quant, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, int out_features, "
        "Tensor? bias=None) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group_size, "
        "int out_features, Tensor? bias=None) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor weight, int out_features, Tensor? bias=None) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor weight, int out_features, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_quant, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("f32_linear", &f32_linear);
}

#endif  // AVX-512 BF16