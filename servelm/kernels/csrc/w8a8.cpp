// Int8 weights times int8 activations for prompts and batches: SmoothQuant's W8A8 with
// activation blocks of B inputs, on AVX-512 VNNI. Namespace torch.ops.servelm_w8a8:
//
//   linear(x, inv_scale, weight, weight_scale, block, out_features, bias?) -> y
// x: [..., K] float32 or bfloat16. Each row is first divided, input channel by input channel,
//   by the layer's smoothing factors (inv_scale fp32 [K] holds 1 / s: SmoothQuant's migration
//   of the activations' outlier channels into the weights), then quantised per block of
//   `block` inputs (a multiple of 16 dividing K) to int8: a = x * inv_scale,
//   d = max|a| / 127, q = round-to-nearest-even(a * (127 / max|a|)), all in fp32 (a block of
//   zeros gives d = 0, q = 0).
// weight: uint8 [ceil(N / 16), K / 4, 16, 4]: panels of 16 outputs; byte (k4, o, t) holds
//   w[o][4 k4 + t] + 128, w the smoothed weights (w * s) quantised to int8 per output channel
//   and block of `block` inputs, the activations' blocks (weight_scale fp32
//   [ceil(N / 16), K / block, 16]: panel, block, column; w * s ~ w_int8 * the scale of its
//   column and block; servelm/layers/w8a8.py packs them). The columns past N are zeros.
// y = sum over blocks of d * weight_scale * (the block's int32 sum of w_int8 q) + bias: the
//   block sums exact in int32 (VNNI's vpdpbusd, unsigned weight bytes times signed
//   activations, less 128 sum(q)), chained over the blocks in fp32 in order, so a row's result
//   is the same bits whatever the row count and whatever rows share its call; y in x's dtype,
//   rounded once.
//
//   quantize(x, inv_scale, block) -> (q int8 [M, K], d fp32 [M, K / block]): the rows'
//   quantisation alone, what the tests check the rounding against.
//
// On AVX-512 VNNI the kernel runs 512-bit vectors; on AVX-VNNI without AVX-512 the same
// panels and arithmetic on 256-bit vectors (w8a8_kernel.h's w8a8_256: the same bits).
// Where both build (AVX-512 VNNI with VL), linear256 runs the 256-bit form, for the tests.
//
//   linear_pairs(...): linear's arguments and result on AVX-512 VNNI, two panels a
//   micro-kernel call (w8a8_kernel.h's w8a8::pairs: the same bits), a form the tuner
//   measures beside linear's (linear_methods' "w8a8_pairs").
//   linear_pairs_silu(x, inv_scale, weight, weight_scale, block, out_features) -> [..., N / 2]:
//   a SwiGLU gate_up's ([gate; up], no bias, bf16 x) silu(gate) * up, the pair form with the
//   SiLU in its epilogue: the bits of linear_pairs then servelm_ops.silu_and_mul.
//
//   linear_tiles(...): linear's arguments and result, on AMX-INT8 tiles (w8a8_tiles.h: the
//   same weights, rows and bits); where the compiler targets AMX-INT8, run where the OS
//   grants the tile state (tiles_available()).
//   linear_tiles_emulated(...): the same loop on tiles emulated in C++, for the tests of a
//   machine without AMX (wherever the wide form builds).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "w8a8_kernel.h"
#include "w8a8_tiles.h"  // the AMX-INT8 form (and its emulation)

#if defined(SERVELM_W8A8) || defined(SERVELM_W8A8_256)

namespace {

constexpr int64_t kNR = 16;  // outputs per panel, every form

// The forms, for the templates below: each quantises a row (quantize_row) and runs the
// quantised rows against items [i0, i1) of the weights (items: kItem panels each), its rows
// padded to a multiple of kRowPad.
#ifdef SERVELM_W8A8
struct Wide {
  static constexpr int64_t kRowPad = 1, kItem = 1, kOutDiv = 1;  // kOutDiv: N / the outputs
  template <typename T>
  static void quantize_row(const T* x, const float* inv, int64_t K, int64_t B, int8_t* q, float* d, int32_t* cs) {
    w8a8::quantize_row(x, inv, K, B, q, d, cs);
  }
  template <typename O>
  static void items(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                    const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t i0, int64_t i1) {
    w8a8::panels(q, d, cs, w, ws, bias, out, M, N, K, B, i0, i1);
  }
};
// The pair form: the same rows, an item a pair of panels (w8a8::pairs).
struct WidePairs : Wide {
  static constexpr int64_t kItem = 2;
  template <typename O>
  static void items(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                    const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t i0, int64_t i1) {
    w8a8::pairs(q, d, cs, w, ws, bias, out, M, N, K, B, 2 * i0, std::min(2 * i1, (N + kNR - 1) / kNR));
  }
};
#ifdef SERVELM_W8A8_SILU
// The pair form of a SwiGLU gate_up with SiLU in its epilogue: out [M, N / 2], an item 16
// features (their gate panel and up panel).
struct WidePairsSilu : Wide {
  static constexpr int64_t kItem = 2, kOutDiv = 2;
  static void items(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                    const float*, c10::BFloat16* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t i0,
                    int64_t i1) {
    w8a8::pairs_silu(q, d, cs, w, ws, out, M, N, K, B, i0, i1);
  }
  static void items(const int8_t*, const float*, const int32_t*, const uint8_t*, const float*, const float*,
                    float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {
    TORCH_CHECK(false, "servelm_w8a8.linear_pairs_silu: bf16 activations only");
  }
};
#endif
// The tile form on Tiles (w8a8_tiles::AmxTiles or EmulatedTiles): the wide form's rows, an
// item a pair of panels, a thread's items on its own tiles.
template <class Tiles>
struct TileForm : Wide {
  static constexpr int64_t kRowPad = w8a8_tiles::kRows, kItem = 2;
  template <typename O>
  static void items(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                    const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t i0, int64_t i1) {
    Tiles tiles;
    w8a8_tiles::pairs(tiles, q, d, cs, w, ws, bias, out, M, N, K, B, i0, i1);
  }
};
#endif
#ifdef SERVELM_W8A8_256
struct Narrow {
  static constexpr int64_t kRowPad = 1, kItem = 1, kOutDiv = 1;
  template <typename T>
  static void quantize_row(const T* x, const float* inv, int64_t K, int64_t B, int8_t* q, float* d, int32_t* cs) {
    w8a8_256::quantize_row(x, inv, K, B, q, d, cs);
  }
  template <typename O>
  static void items(const int8_t* q, const float* d, const int32_t* cs, const uint8_t* w, const float* ws,
                    const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t B, int64_t i0, int64_t i1) {
    w8a8_256::panels(q, d, cs, w, ws, bias, out, M, N, K, B, i0, i1);
  }
};
#endif
#ifdef SERVELM_W8A8
using Best = Wide;
#else
using Best = Narrow;
#endif

void check_inputs(const at::Tensor& x, const at::Tensor& inv, int64_t block, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() >= 1,
              name, ": x must be float32 or bfloat16 on the CPU, got ", x.scalar_type());
  TORCH_CHECK(inv.device().is_cpu() && inv.scalar_type() == at::kFloat && inv.is_contiguous() &&
                  inv.dim() == 1 && inv.size(0) == x.size(-1),
              name, ": inv_scale must be contiguous float32 [in_features] on the CPU");
  TORCH_CHECK(block > 0 && block % 16 == 0 && x.size(-1) % block == 0, name, ": block ", block,
              " must be a multiple of 16 dividing in_features ", x.size(-1));
}

template <typename Kn, typename T>
void quantize_rows(const T* x, const float* inv, int64_t M, int64_t K, int64_t B, int8_t* q, float* d,
                   int32_t* cs) {
  const int64_t NB = K / B;
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) Kn::quantize_row(x + r * K, inv, K, B, q + r * K, d + r * NB, cs + r * NB);
  });
}

template <typename Kn, typename T>
void gemm(const T* x, const float* inv, const uint8_t* w, const float* ws, const float* bias, T* out,
          int64_t M, int64_t N, int64_t K, int64_t B) {
  const int64_t NB = K / B, padded = (M + Kn::kRowPad - 1) / Kn::kRowPad * Kn::kRowPad;
  // The quantised rows in a buffer kept by the calling thread: a fresh allocation of a
  // prompt's rows each call is fresh pages each call, faulted in.
  thread_local std::vector<int32_t> buf;
  const int64_t words = (padded * K + 3) / 4 + 2 * M * NB;
  if (static_cast<int64_t>(buf.size()) < words) buf.resize(words);
  float* d = reinterpret_cast<float*>(buf.data());
  int32_t* cs = buf.data() + M * NB;
  int8_t* q = reinterpret_cast<int8_t*>(buf.data() + 2 * M * NB);
  quantize_rows<Kn>(x, inv, M, K, B, q, d, cs);
  std::fill(q + M * K, q + padded * K, int8_t{0});  // the last tile's rows past M
  const int64_t NP = (N + kNR - 1) / kNR;
  at::parallel_for(0, (NP + Kn::kItem - 1) / Kn::kItem, 1, [&](int64_t i0, int64_t i1) {
    Kn::items(q, d, cs, w, ws, bias, out, M, N, K, B, i0, i1);
  });
}

template <typename Kn>
at::Tensor linear_with(const at::Tensor& x_in, const at::Tensor& inv, const at::Tensor& weight,
                       const at::Tensor& wscale, int64_t block, int64_t N, const c10::optional<at::Tensor>& bias,
                       const char* name) {
  check_inputs(x_in, inv, block, name);
  const int64_t K = x_in.size(-1), NP = (N + kNR - 1) / kNR;
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 4 &&
                  weight.is_contiguous() && weight.size(0) == NP && weight.size(1) * 4 == K &&
                  weight.size(2) == kNR && weight.size(3) == 4,
              name, ": weight must be contiguous uint8 [ceil(out_features / 16), in_features / 4, 16, 4]");
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.is_contiguous() &&
                  wscale.numel() == NP * (K / block) * kNR,
              name, ": weight_scale must be contiguous float32 [ceil(out_features / 16), in_features / block, 16]");
  at::Tensor bf;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, name, ": bias must have out_features elements");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N / Kn::kOutDiv;
  at::Tensor y = at::empty({M, N / Kn::kOutDiv}, x.options());
  if (M > 0) {
    if (x.scalar_type() == at::kFloat)
      gemm<Kn>(x.data_ptr<float>(), inv.data_ptr<float>(), weight.data_ptr<uint8_t>(), wscale.data_ptr<float>(), b,
               y.data_ptr<float>(), M, N, K, block);
    else
      gemm<Kn>(x.data_ptr<c10::BFloat16>(), inv.data_ptr<float>(), weight.data_ptr<uint8_t>(),
               wscale.data_ptr<float>(), b, y.data_ptr<c10::BFloat16>(), M, N, K, block);
  }
  return y.reshape(shape);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& weight, const at::Tensor& wscale,
                  int64_t block, int64_t N, const c10::optional<at::Tensor>& bias) {
  return linear_with<Best>(x, inv, weight, wscale, block, N, bias, "servelm_w8a8.linear");
}

#ifdef SERVELM_W8A8_SILU
at::Tensor linear_pairs_silu(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& weight,
                             const at::Tensor& wscale, int64_t block, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "servelm_w8a8.linear_pairs_silu: x must be bfloat16");
  TORCH_CHECK(N % 32 == 0, "servelm_w8a8.linear_pairs_silu: out_features ", N,
              " must be twice a multiple of 16 (a gate_up's [gate; up])");
  return linear_with<WidePairsSilu>(x, inv, weight, wscale, block, N, c10::nullopt,
                                    "servelm_w8a8.linear_pairs_silu");
}
#endif

#ifdef SERVELM_W8A8
at::Tensor linear_pairs(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& weight, const at::Tensor& wscale,
                        int64_t block, int64_t N, const c10::optional<at::Tensor>& bias) {
  return linear_with<WidePairs>(x, inv, weight, wscale, block, N, bias, "servelm_w8a8.linear_pairs");
}

at::Tensor linear_tiles_emulated(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& weight,
                                 const at::Tensor& wscale, int64_t block, int64_t N,
                                 const c10::optional<at::Tensor>& bias) {
  return linear_with<TileForm<w8a8_tiles::EmulatedTiles>>(x, inv, weight, wscale, block, N, bias,
                                                          "servelm_w8a8.linear_tiles_emulated");
}
#endif

#ifdef SERVELM_W8A8_AMX
bool tiles_available() { return amx_permitted(); }

at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& weight,
                        const at::Tensor& wscale, int64_t block, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(tiles_available(), "servelm_w8a8.linear_tiles: the OS does not grant this process AMX's tile state");
  return linear_with<TileForm<w8a8_tiles::AmxTiles>>(x, inv, weight, wscale, block, N, bias,
                                                     "servelm_w8a8.linear_tiles");
}
#endif

#if defined(SERVELM_W8A8) && defined(SERVELM_W8A8_256)
at::Tensor linear256(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& weight, const at::Tensor& wscale,
                     int64_t block, int64_t N, const c10::optional<at::Tensor>& bias) {
  return linear_with<Narrow>(x, inv, weight, wscale, block, N, bias, "servelm_w8a8.linear256");
}
#endif

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x_in, const at::Tensor& inv, int64_t block) {
  check_inputs(x_in, inv, block, "servelm_w8a8.quantize");
  const int64_t K = x_in.size(-1);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), NB = K / block;
  at::Tensor q = at::empty({M, K}, at::kChar), d = at::empty({M, NB}, at::kFloat);
  std::vector<int32_t> cs(M * NB);
  if (x.scalar_type() == at::kFloat)
    quantize_rows<Best>(x.data_ptr<float>(), inv.data_ptr<float>(), M, K, block, q.data_ptr<int8_t>(),
                        d.data_ptr<float>(), cs.data());
  else
    quantize_rows<Best>(x.data_ptr<c10::BFloat16>(), inv.data_ptr<float>(), M, K, block, q.data_ptr<int8_t>(),
                        d.data_ptr<float>(), cs.data());
  return {q, d};
}

}  // namespace

TORCH_LIBRARY(servelm_w8a8, m) {
  m.def("linear(Tensor x, Tensor inv_scale, Tensor weight, Tensor weight_scale, int block, "
        "int out_features, Tensor? bias=None) -> Tensor");
  m.def("quantize(Tensor x, Tensor inv_scale, int block) -> (Tensor, Tensor)");
#ifdef SERVELM_W8A8_SILU
  m.def("linear_pairs_silu(Tensor x, Tensor inv_scale, Tensor weight, Tensor weight_scale, int block, "
        "int out_features) -> Tensor");
#endif
#ifdef SERVELM_W8A8
  m.def("linear_pairs(Tensor x, Tensor inv_scale, Tensor weight, Tensor weight_scale, int block, "
        "int out_features, Tensor? bias=None) -> Tensor");
  m.def("linear_tiles_emulated(Tensor x, Tensor inv_scale, Tensor weight, Tensor weight_scale, int block, "
        "int out_features, Tensor? bias=None) -> Tensor");
#endif
#ifdef SERVELM_W8A8_AMX
  m.def("linear_tiles(Tensor x, Tensor inv_scale, Tensor weight, Tensor weight_scale, int block, "
        "int out_features, Tensor? bias=None) -> Tensor");
  m.def("tiles_available() -> bool", &tiles_available);
#endif
#if defined(SERVELM_W8A8) && defined(SERVELM_W8A8_256)
  m.def("linear256(Tensor x, Tensor inv_scale, Tensor weight, Tensor weight_scale, int block, "
        "int out_features, Tensor? bias=None) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(servelm_w8a8, CPU, m) {
  m.impl("linear", &linear);
  m.impl("quantize", &quantize);
#ifdef SERVELM_W8A8_SILU
  m.impl("linear_pairs_silu", &linear_pairs_silu);
#endif
#ifdef SERVELM_W8A8
  m.impl("linear_pairs", &linear_pairs);
  m.impl("linear_tiles_emulated", &linear_tiles_emulated);
#endif
#ifdef SERVELM_W8A8_AMX
  m.impl("linear_tiles", &linear_tiles);
#endif
#if defined(SERVELM_W8A8) && defined(SERVELM_W8A8_256)
  m.impl("linear256", &linear256);
#endif
}

#endif  // SERVELM_W8A8 || SERVELM_W8A8_256
