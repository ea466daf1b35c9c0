// DecodeStack: every decoder layer of a decode-only step in one C++ call (torch class
// servelm_stack.DecodeStack), for any layer the model can describe to it (a
// servelm.models.decode_stack.StackDescription): RMSNorm before attention and MLP, optional
// q/k norms (per head, before the rotary), qkv bias, sandwich norms after attention and the
// MLP, full or partial rotary from one of two tables (the model's, or the sliding layers'),
// a sliding window per layer, any softmax scale, soft-capped scores (Gemma 2), a SiLU, tanh-GELU or
// GELU MLP, gated or plain, a bias on any linear, attention's output gate, gated DeltaNet layers
// (Qwen3.5), attention sinks and routed experts (gpt-oss, Qwen3-MoE, Qwen3.5-MoE, GLM-4-MoE: int4
// or MXFP4 experts in q8act's panels, moe_kernel.h, or int8 / bf16 ones as rows, gemv_kernel.h,
// as the fused ops run them; a shared expert beside them), each layer's MLP at its own width,
// Gemma 4's layers (each layer's own head size and KV heads, weightless v norms, values from the
// keys, KV-shared layers, per-layer inputs, layer scalars, experts beside the dense MLP), an
// embedding scale, and LoRA adapters on any of a layer's linears (bind_lora; the deltas
// of set_lora_rows' rows added after the linear's matmul, lora_kernels.h, as servelm_ops.lora_add
// adds them). Its matmuls are tiled_kernels.h's (the servelm_quant operators' code),
// its row steps row_kernels.h's (the servelm_ops operators'), its attention
// decode_attention.h's: each thread runs the share of the work the per-op path's threads
// would, so results are those of the per-op path bit for bit (where that path runs the same
// kernels). AVX-512 BF16 only, as quant.cpp: elsewhere this compiles to nothing and no class
// is registered (the model then runs decode steps op by op).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/all.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)

#include "tiled_kernels.h"     // the int4 / int8 / bf16 tiled matmuls, as servelm_quant runs them
#include "decode_attention.h"
#include "q8act_kernel.h"      // q8act layers
#include "w8a8_kernel.h"       // w8a8 layers (AVX-512 VNNI)
#include "amx_linear_kernel.h"  // amx layers (where AMX-BF16 is built)
#include "row_kernels.h"
#include "lora_kernels.h"      // LoRA deltas, as servelm_ops.lora_add runs them
#include "delta_rule_kernel.h"  // linear-attention layers, as servelm_delta_rule.decode runs them
#include "moe_kernel.h"        // routed experts, as servelm_q8act.moe_route / moe_experts run them
#include "gemv_kernel.h"       // bf16 / int8 routed experts, as servelm_gemv.moe_experts runs them

namespace {

// The layer description's fields, as the constructor takes them (mirrored by the IntEnums
// of servelm/models/decode_stack.py).
// Per layer, its norm weights in this order (an empty tensor: the layer has none).
enum NormSlot : int64_t {
  kInputNorm, kPostAttentionNorm, kQNorm, kKNorm, kAttnOutNorm, kMlpOutNorm,
  kInputNormBias, kPostAttentionNormBias,  // LayerNorms' biases (empty: none)
  kLayerScalar,  // [1]: the residual stream times it at the layer's end (Gemma 4; empty: none)
  kPleNorm,      // [hidden]: the norm of its per-layer input's projection (Gemma 4's PLE)
  kMoeMlpNorm, kMoeInputNorm, kMoeOutNorm,  // experts beside the MLP: kExpertsBeside's norms
  kNormSlots
};
// Per layer, these integers.
enum LayerOption : int64_t {
  kWindow, kRotaryTable, kKvGroup,
  kKind,  // a LayerKind
  // A linear-attention layer's shape (gated DeltaNet): key heads, value heads, their sizes, and
  // its convolution's kernel (0 for an attention layer).
  kLinearKeyHeads, kLinearValueHeads, kLinearKeyDim, kLinearValueDim, kConvKernel,
  kMlpKind,  // an MlpKind
  kSinks,    // 1: its attention has sinks, a logit per query head in the softmax (bind_sinks)
  kKvShared,  // 1: it attends its caches (an earlier layer's, written this step) and writes none;
              // its qkv linear is q alone (Gemma 4)
  kKEqV,      // 1: its values are its keys as projected (before the k norm and the rotary); its
              // qkv linear is q | k (Gemma 4's global layers)
  kLayerOptions
};
// What mixes a layer's tokens: attention over its KV cache, or a gated DeltaNet over each
// sequence's recurrent state (Qwen3.5: in_proj_qkvz in the qkv linear's place, in_proj_ba the
// extra linear, out_proj o's; its state and parameters bound by bind_linear_attention).
enum LayerKind : int64_t { kAttentionLayer, kLinearAttentionLayer };
// What a layer's MLP is: the dense one (gate_up and down linears), or routed experts (a router
// and experts bound by bind_moe; gate_up and down, where given, a shared expert beside them).
// Or (Gemma 4) the dense MLP with routed experts beside it: the experts read the stream's own
// norm (kMoeInputNorm), routed on the stream itself, and the MLP's output is
// norm(mlp) + norm(experts) (kMoeMlpNorm, kMoeOutNorm).
enum MlpKind : int64_t { kDenseMlp, kRoutedExperts, kExpertsBeside };
// For the model, these integers ...
enum ModelOption : int64_t { kNumHeads, kNumKvHeads, kRotaryDim, kActivation, kQScalePeriod, kPreNorms,
                              kQkNormWhole, kLayerNorm, kParallel,
                              kPlainMlp,  // 1: the MLP is not gated: down(act(up(x))) (Starcoder2, Phi)
                              kLocalRotaryDim,  // the sliding layers' table's width (0: kRotaryDim)
                              kVNorm,  // 1: each head's v over its root mean square, no weight (Gemma 4)
                              kPerLayerInput,  // P > 0: each layer adds a per-layer input of P (Gemma 4)
                              kModelOptions };
// ... and these floats.
enum ModelScalar : int64_t { kEps, kScale, kEmbedScale, kAttnSoftcap, kResidualScale, kQScaleBeta,
                              kModelScalars };
// The MLP's activation.
enum Activation : int64_t { kSilu, kGeluTanh, kGelu /* erf */ };
// The weight format codes (servelm.layers.stack.StackFormat): > 0 int4 with that group
// size, kInt8, kBf16 (tiles), kAmx, kAmxGated, kQ8Act + the group size, kW8A8 + the
// activation block (kW8A8Pairs + the block: the same panels run by w8a8's pair form).
namespace format {
constexpr int64_t kInt8 = 0, kBf16 = -1, kAmx = -2, kAmxGated = -3, kQ8Act = int64_t{1} << 20,
                  kW8A8 = int64_t{2} << 20, kW8A8Pairs = int64_t{3} << 20;
constexpr int64_t kNone = -4;  // no such linear (the extra linear of a layer without one)
}

// ---------------------------------------------------------------- decoder layers, decode rows

// A model's decoder layers for M single-token (decode) rows, when all their
// linear layers are int4 / int8 / bf16 kernel layers (int4 in the tiles or in q8act's panels,
// q8act_kernel.h; bf16 in the tiles or in AMX tile order, amx_linear_kernel.h): one C++ call
// per step (DecodeStack.run) and one parallel region for all the layers. From Python the same
// work is ~12 operator calls per layer: each pays Python and dispatcher time, and each matmul
// opens its own parallel region whose threads then stream a weight of 0.2-1 MB starting cold.
// Here the threads split each matmul's tiles exactly as int4_linear / int8_linear would (so
// results are bit-identical to theirs; q8act's panels and amx's column pairs give the same
// bits however they are split) and meet at a barrier between steps. Between matmuls the row
// steps (norms, rotary + KV write, SiLU, the activation sums, q8act's quantised rows, amx's
// A tiles) split the rows over the threads, and a thread without rows
// prefetches the head of its share of the next weight into L2. Attention runs the
// paged_decode_attention op's work items (decode_attention.h), each thread its share, fixed per
// step, so while streaming the previous layer's gate_up_proj each thread also pulls the first of
// its items' K/V rows into L2 (each item reads the rest ahead itself: the weights stream evicts
// them every step). Norms, rotary + KV write and SiLU run the servelm_ops operators' row kernels
// (row_kernels.h) inline on per-step buffers: through the dispatcher, with an output allocated
// per call, they cost more than their arithmetic.

struct QLinear {
  static constexpr int64_t kBf16 = format::kBf16;  // G of a bf16 (tiled) layer
  static constexpr int64_t kAmx = format::kAmx;    // a bf16 layer in AMX tile order (G: kBf16)
  // A SwiGLU gate_up in AMX tile order, its gate and up blocks alternating
  // (amx_linear::pairs' gated): its output is silu(gate) * up, [M, N / 2].
  static constexpr int64_t kAmxGated = format::kAmxGated;
  // An int4 layer in q8act's panels (activations quantised per call to int8,
  // q8act_kernel.h): this plus its group size.
  static constexpr int64_t kQ8Act = format::kQ8Act;
  // A calibrated layer in w8a8's int8 panels (activations smoothed and quantised per block
  // of inputs to int8, w8a8_kernel.h): this plus the block.
  static constexpr int64_t kW8A8 = format::kW8A8;
  static constexpr int64_t kW8A8Pairs = format::kW8A8Pairs;  // ... run two panels a call
  int64_t G = 0;  // int4 group size; 0: int8; kBf16: bf16; w8a8: the activation block
  bool q8 = false;  // int4 in q8act's panels (G its group size)
  bool w8 = false;  // w8a8's panels (G the activation block; sc: the weight scales)
  bool w8_pairs = false;  // w8, run by w8a8::pairs (the same bits)
  const float* inv = nullptr;  // w8a8: 1 / the smoothing factors
  bool amx = false;  // bf16 in AMX tile order (amx_linear_kernel.h; G is kBf16)
  bool gated = false;  // amx, a gated gate_up: out gets silu(gate) * up
  const uint8_t* qw = nullptr;
  const void* sc = nullptr;
  const c10::Half* mn = nullptr;
  const float* bias = nullptr;
  int64_t N = 0, K = 0;

  bool present() const { return N > 0; }
  // 16 outputs a tile (int4 / int8 / bf16), a panel (q8act: 8K bytes, as an int4 tile) or
  // half a column pair (amx: 32K bytes, as a bf16 tile; pairs are whole in share()).
  int64_t tiles() const { return (N + 15) / 16; }
  int64_t tile_bytes() const { return w8 ? 16 * K : G > 0 ? 8 * K : G == 0 ? 16 * K : 32 * K; }
  int64_t group() const { return G > 0 ? G : K; }
  // From these many rows on, int4_linear / int8_linear decode each tile once and
  // bf16_linear runs its GEMM micro-kernel (a different kernel, rounded differently): so does
  // the stack. q8act and amx run one kernel for every row count.
  bool decode_once(int64_t M) const {
    return !q8 && !amx && !w8 && M >= (G > 0 ? kDecodeOnceRows4 : G == 0 ? kDecodeOnceRows8 : kGemmRows16);
  }
  // Thread tid's tiles, whole pairs (the decode-once GEMM decodes two at a time).
  void share(int tid, int nt, int64_t& t0, int64_t& t1) const {
    const int64_t pairs = (tiles() + 1) / 2;
    t0 = std::min(tiles(), 2 * (pairs * tid / nt));
    t1 = std::min(tiles(), 2 * (pairs * (tid + 1) / nt));
  }
  // Floats of per-step scratch for M rows' input (scratch() sizes the buffer sums() fills
  // and run() reads): the row-streaming kernels' group sums; q8act's quantised rows (d, d
  // sum(q) per block of 32, then the int8 q); amx's packed A tiles (from 33 rows); none from
  // the decode-once sizes on or for bf16 tiles.
  int64_t scratch(int64_t M) const {
    if (!present()) return 0;
    if (q8) return 2 * M * (K / q8act::kB) + (M * K + 3) / 4;
    if (w8) return 2 * M * (K / G) + (M * K + 3) / 4;
#ifdef SERVELM_AMX
    if (amx) return (amx_linear::packed_elems(M, K) + 1) / 2;
#endif
    return G >= 0 && !decode_once(M) ? M * (K / group()) : 0;
  }
  // drows (gated amx only): each row's LoRA delta, fp32 [gate | up] in the source's column
  // order, or null (amx_linear::epilogue adds it before the SiLU).
  void run(const c10::BFloat16* x, const float* xs, c10::BFloat16* out, int64_t M, int64_t t0,
           int64_t t1, const float* const* drows = nullptr) const {
    const auto* s4 = static_cast<const c10::Half*>(sc);
    const auto* s8 = static_cast<const float*>(sc);
#ifdef SERVELM_AMX
    if (amx) {
      amx_linear::pairs(x, reinterpret_cast<const c10::BFloat16*>(xs), M, K,
                        reinterpret_cast<const uint32_t*>(qw), bias, out, N, t0 / 2, (t1 + 1) / 2, gated,
                        gated ? drows : nullptr);
      return;
    }
#endif
    (void)drows;
#ifdef SERVELM_W8A8
    if (w8) {
      const int64_t NB = K / G;
      const auto* q = reinterpret_cast<const int8_t*>(xs + 2 * M * NB);
      const auto* cs = reinterpret_cast<const int32_t*>(xs + M * NB);
      const auto* ws = static_cast<const float*>(sc);
      if (w8_pairs) w8a8::pairs(q, xs, cs, qw, ws, bias, out, M, N, K, G, t0, t1);
      else w8a8::panels(q, xs, cs, qw, ws, bias, out, M, N, K, G, t0, t1);
      return;
    }
#endif
    if (q8) {
      const int64_t NB = K / q8act::kB;
      q8act::panels(reinterpret_cast<const int8_t*>(xs + 2 * M * NB), xs, xs + M * NB, qw, s4, mn, G,
                    bias, out, M, N, K, t0, t1);
    } else if (G < 0) {
      bf16_range(reinterpret_cast<const c10::BFloat16*>(qw), x, bias, out, M, N, K, t0, t1);
    } else if (decode_once(M)) {
      if (G) decoded_range(Int4Tiles{qw, s4, mn, G, K}, x, bias, out, M, N, K, t0, t1);
      else decoded_range(Int8Tiles{qw, s8, K}, x, bias, out, M, N, K, t0, t1);
    } else if (G) {
      int4_range<false>(G, qw, s4, mn, x, nullptr, xs, bias, out, M, N, K, t0, t1);
    } else {
      int8_range<false>(qw, s8, x, nullptr, xs, bias, out, M, N, K, t0, t1);
    }
  }
  // What run() needs of rows [m0, m1) of x besides x (laid out for all M rows in xs): the
  // activation sums the row-streaming kernels need (as prepare() computes them for bf16
  // rows), q8act's quantised rows, or amx's A tiles (the rows' thread also zeroes the
  // padding after the last); nothing for decode-once sizes or bf16 tiles.
  void sums(const c10::BFloat16* x, int64_t M, int64_t m0, int64_t m1, float* xs) const {
#ifdef SERVELM_AMX
    if (amx) {
      if (const int64_t padded = amx_linear::padded_rows(M)) {
        const int64_t from = std::max(m0, amx_linear::packed_from(M, K)), end = m1 == M ? padded : m1;
        if (from < end) amx_linear::pack_rows(x, reinterpret_cast<c10::BFloat16*>(xs), M, K, from, end);
      }
      return;
    }
#endif
#ifdef SERVELM_W8A8
    if (w8) {
      const int64_t NB = K / G;
      int8_t* q = reinterpret_cast<int8_t*>(xs + 2 * M * NB);
      int32_t* cs = reinterpret_cast<int32_t*>(xs + M * NB);
      for (int64_t m = m0; m < m1; ++m)
        w8a8::quantize_row(x + m * K, inv, K, G, q + m * K, xs + m * NB, cs + m * NB);
      return;
    }
#endif
    if (q8) {
      const int64_t NB = K / q8act::kB;
      int8_t* q = reinterpret_cast<int8_t*>(xs + 2 * M * NB);
      for (int64_t m = m0; m < m1; ++m)
        q8act::quantize_row(x + m * K, K, q + m * K, xs + m * NB, xs + M * NB + m * NB);
    } else if (G >= 0 && !decode_once(M)) {
      group_sums(x + m0 * K, m1 - m0, K, group(), xs + m0 * (K / group()));
    }
  }
  // Around a thread's run() calls of one matmul: amx's tile configuration, and its release.
  void begin(int64_t M) const {
#ifdef SERVELM_AMX
    if (amx) amx_linear::configure(M);
#endif
    (void)M;
  }
  void end() const {
#ifdef SERVELM_AMX
    if (amx) _tile_release();
#endif
  }
  // Pulls the first `bytes` of this thread's share into L2 (the stream then starts warm).
  void prefetch(int tid, int nt, int64_t bytes) const {
    int64_t t0, t1;
    share(tid, nt, t0, t1);
    const char* p = reinterpret_cast<const char*>(qw) + t0 * tile_bytes();
    const int64_t n = std::min(bytes, (t1 - t0) * tile_bytes());
    for (int64_t o = 0; o < n; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
  }
};

// q8act's panels: uint8 [ceil(N / 16), K / 32, 2, 4, 32], scales and mins float16
// [ceil(N / 16), K / G, 16] (as servelm_q8act.int4_linear takes them).
void check_q8act(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                 int64_t N, int64_t G, int64_t K) {
  const int64_t NP = (N + 15) / 16;
  TORCH_CHECK(G > 0 && G % q8act::kB == 0 && K % G == 0, "q8act group size must be a multiple of 32 "
              "dividing K=", K, ", got ", G);
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.dim() == 5 && qweight.size(0) == NP && qweight.size(1) * q8act::kB == K &&
                  qweight.size(2) == 2 && qweight.size(3) == 4 && qweight.size(4) == 32,
              "q8act qweight must be contiguous uint8 [ceil(N/16), K/32, 2, 4, 32]");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == NP * 16 * (K / G),
                "q8act scales/mins must be contiguous float16 [ceil(N/16), K/group_size, 16]");
}

// w8a8's panels: uint8 [ceil(N / 16), K / 4, 16, 4], the weight scales float32
// [ceil(N / 16), K / B, 16] and 1 / the smoothing factors float32 [K] (as servelm_w8a8.linear
// takes them).
void check_w8a8(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& inv, int64_t N,
                int64_t B, int64_t K) {
#ifndef SERVELM_W8A8
  TORCH_CHECK(false, "w8a8 weights, but this build has no AVX-512 VNNI");
#endif
  const int64_t NP = (N + 15) / 16;
  TORCH_CHECK(B > 0 && B % 16 == 0 && K % B == 0, "w8a8 block must be a multiple of 16 dividing K=", K,
              ", got ", B);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == NP * 16 * K,
              "w8a8 weight must be contiguous uint8 [ceil(N/16), K/4, 16, 4]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == NP * (K / B) * 16,
              "w8a8 weight scales must be contiguous float32 [ceil(N/16), K/B, 16]");
  TORCH_CHECK(inv.scalar_type() == at::kFloat && inv.is_contiguous() && inv.numel() == K,
              "w8a8 inverse smoothing factors must be contiguous float32 [K]");
}

// amx's packed weight: int32 [N * K / 2] (servelm_amx_linear.pack), N and K multiples of 32.
void check_amx(const at::Tensor& packed, int64_t N, int64_t K) {
  TORCH_CHECK(amx_available(), "amx weights, but AMX-BF16 is not available here");
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "amx N and K must be multiples of 32, got ", N, " x ", K);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kInt && packed.is_contiguous() &&
                  packed.numel() == N * K / 2,
              "amx packed weight must be contiguous int32 with N*K/2 elements");
}

QLinear parse_linear(const std::vector<at::Tensor>& w, size_t& j, int64_t G, int64_t N, int64_t K,
                     const char* name) {
  QLinear L;
  if (G == format::kNone) return L;  // absent: N = 0, no tensors
  L.w8 = G > QLinear::kW8A8;
  L.w8_pairs = G > QLinear::kW8A8Pairs;
  L.q8 = !L.w8 && G > QLinear::kQ8Act;
  L.amx = G == QLinear::kAmx || G == QLinear::kAmxGated;
  L.gated = G == QLinear::kAmxGated;
  L.G = L.w8_pairs ? G - QLinear::kW8A8Pairs
        : L.w8     ? G - QLinear::kW8A8
        : L.q8     ? G - QLinear::kQ8Act
        : L.amx    ? QLinear::kBf16
                   : G;
  L.N = N;
  L.K = K;
  TORCH_CHECK(G >= QLinear::kAmxGated && G != QLinear::kQ8Act && G != QLinear::kW8A8 &&
                  G != QLinear::kW8A8Pairs && (L.w8 || G < QLinear::kW8A8),
              "DecodeStack ", name, ": group size ", G,
              " is none of int4's (> 0), int8's (0), bf16's (-1), amx's (-2), gated amx's (-3), q8act's (",
              QLinear::kQ8Act, " + group size) or w8a8's (", QLinear::kW8A8, " + block; ", QLinear::kW8A8Pairs,
              " + block: its pair form)");
  const size_t n = G > 0 ? 3 : G == 0 ? 2 : 1;
  TORCH_CHECK(j + n <= w.size(), "DecodeStack: too few weight tensors for ", name);
  try {
    if (L.amx) check_amx(w[j], N, K);
    else if (L.w8) check_w8a8(w[j], w[j + 1], w[j + 2], N, L.G, K);
    else if (L.q8) check_q8act(w[j], w[j + 1], w[j + 2], N, L.G, K);
    else if (G > 0) check_int4(w[j], w[j + 1], w[j + 2], N, G, K);
    else if (G == 0) check_int8(w[j], w[j + 1], N, K);
    else check_tiled<c10::BFloat16>(w[j], N, K, "bf16");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "DecodeStack ", name, ": ", e.what_without_backtrace());
  }
  if (L.w8) {
    L.qw = w[j].data_ptr<uint8_t>();
    L.sc = w[j + 1].data_ptr<float>();
    L.inv = w[j + 2].data_ptr<float>();
  } else if (G > 0) {
    L.qw = w[j].data_ptr<uint8_t>();
    L.sc = w[j + 1].data_ptr<c10::Half>();
    L.mn = w[j + 2].data_ptr<c10::Half>();
  } else if (G == 0) {
    L.qw = w[j].data_ptr<uint8_t>();
    L.sc = w[j + 1].data_ptr<float>();
  } else if (L.amx) {
    L.qw = reinterpret_cast<const uint8_t*>(w[j].data_ptr<int32_t>());
  } else {
    L.qw = reinterpret_cast<const uint8_t*>(w[j].data_ptr<c10::BFloat16>());
  }
  j += n;
  return L;
}

// A spinning barrier for the team (a centralised, sense-reversing one): the threads meet
// ~8 times a layer after a few microseconds of work each, and libgomp's barrier cost ~0.5 us
// a time here.
struct SpinBarrier {
  alignas(64) std::atomic<int> count{0};
  alignas(64) std::atomic<int> sense{0};
  void wait(int& local_sense, int n) {
    local_sense ^= 1;
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count.store(0, std::memory_order_relaxed);
      sense.store(local_sense, std::memory_order_release);
    } else {
      while (sense.load(std::memory_order_acquire) != local_sense) _mm_pause();
    }
  }
};

// One thread's part in a parallel region of matmuls (each thread computes its share of the
// output tiles; a tile's result does not depend on which thread computes it) and row steps
// (each thread its rows), with a barrier after each.
struct Team {
  int tid, n;
  std::atomic<bool>& failed;
  std::exception_ptr& err;
  SpinBarrier& bar;
  int sense = 0;
  void barrier() { bar.wait(sense, n); }
  // Bytes of its share of the next weight an idle thread pulls into L2 during a row step
  // (more measured no better: the stream then starts warm anyway).
  static constexpr int64_t kWarm = 16 << 10;

  template <typename F>
  void guarded(F&& f) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {  // an exception must not leave the region: kept, rethrown after it
#pragma omp critical(servelm_team_error)
      if (!err) err = std::current_exception();
      failed = true;
    }
  }
  // f(m0, m1) for this thread's rows of M (row kernels: a row's result does not depend on
  // the thread), and once() on the calling thread; threads without rows pull the head of
  // their share of `next` into L2 meanwhile.
  template <typename F, typename Once>
  void rows(int64_t M, F&& f, const QLinear& next, Once&& once) {
    const int64_t m0 = M * tid / n, m1 = M * (tid + 1) / n;
    guarded([&] {
      if (m0 < m1) f(m0, m1);
      if (tid == 0) once();
    });
    if (m0 >= m1) next.prefetch(tid, n, kWarm);
    barrier();
  }
  template <typename F>
  void rows(int64_t M, F&& f, const QLinear& next) {
    rows(M, f, next, [] {});
  }
  // before(): this thread's work ahead of its tiles (a gated gate_up's LoRA deltas, which its
  // epilogue adds: drows, QLinear::run); extra(): its other work on its own output tiles (a
  // LoRA expand), before the barrier.
  template <typename Extra, typename Before>
  void matmul(const QLinear& L, const c10::BFloat16* x, const std::vector<float>& xs,
              c10::BFloat16* y, int64_t M, const QLinear* next, Extra&& extra, Before&& before,
              const float* const* drows) {
    guarded([&] {
      int64_t t0, t1;
      L.share(tid, n, t0, t1);
      before();
      constexpr int64_t kStep = 4;  // tiles a run() call (a few column pairs: panels in L1/L2)
      if (t0 < t1) L.begin(M);
      for (int64_t c = t0; c < t1; c += kStep) L.run(x, xs.data(), y, M, c, std::min(t1, c + kStep), drows);
      if (t0 < t1) L.end();
      extra();
      if (next) next->prefetch(tid, n, kWarm);
    });
    barrier();
  }
  template <typename Extra>
  void matmul(const QLinear& L, const c10::BFloat16* x, const std::vector<float>& xs,
              c10::BFloat16* y, int64_t M, const QLinear* next, Extra&& extra) {
    matmul(L, x, xs, y, M, next, extra, [] {}, nullptr);
  }
  void matmul(const QLinear& L, const c10::BFloat16* x, const std::vector<float>& xs,
              c10::BFloat16* y, int64_t M, const QLinear* next) {
    matmul(L, x, xs, y, M, next, [] {});
  }
};

// One thread's attention items for a step (the same for every layer: the plan depends only
// on the context lengths). Each item is a sequence's context range; items go to threads in
// order, split where the tokens attended (their cost) reach equal shares. (Prefetching the
// first of a thread's K/V rows while it streamed the matmul before the attention measured
// slower on an AMX Xeon at 1, 8 and 64 rows: the matmul lost more than the attention gained.)
struct AttnShare {
  int64_t i0 = 0, i1 = 0;  // items [i0, i1)

  template <typename Att>
  void plan(const Att& att, int tid, int nt) {
    const int64_t items = att.items();
    std::vector<int64_t> cost(items);
    int64_t total = 0;
    for (int64_t it = 0; it < items; ++it) {
      int b, t0, t1;
      att.item_range(it, b, t0, t1);
      cost[it] = std::max(t1 - t0, 0) + 1;
      total += cost[it];
    }
    // Item it goes to the thread whose share of the total cost holds its midpoint.
    int64_t before = 0;
    i0 = i1 = -1;
    for (int64_t it = 0; it < items; ++it) {
      const int owner = static_cast<int>(std::min<int64_t>(nt - 1, (2 * before + cost[it]) * nt / (2 * total)));
      before += cost[it];
      if (owner == tid) {
        if (i0 < 0) i0 = it;
        i1 = it + 1;
      }
    }
    if (i0 < 0) i0 = i1 = 0;
  }
};

template <typename Body>
void team_region(const Body& body) {
  std::atomic<bool> failed{false};
  std::exception_ptr err;
  SpinBarrier bar;
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  {
    Team t{omp_get_thread_num(), omp_get_num_threads(), failed, err, bar};
    body(t);
  }
  if (err) std::rethrow_exception(err);
}

// ---------------------------------------------------------------- the layers' row steps

// act(gate) * up for rows [m0, m1) of gu [M, 2 I] (gate, then up) into out [M, I], or (plain:
// gu [M, I]) act(gu): the PyTorch operators the per-op path runs (F.gelu(gate, approximate=..)
// * up; F.silu / F.gelu), called on this thread's rows (inside the parallel region ATen runs
// them on the calling thread; each row's result does not depend on the rows beside it), so the
// bits are theirs.
void act_rows(const c10::BFloat16* gu, c10::BFloat16* act, int64_t m0, int64_t m1, int64_t I,
              int64_t kind, bool plain) {
  const auto opts = at::TensorOptions().dtype(at::kBFloat16);
  auto* g = const_cast<c10::BFloat16*>(gu) + m0 * (plain ? 1 : 2) * I;
  const at::Tensor gate = at::from_blob(g, {m1 - m0, I}, {(plain ? 1 : 2) * I, 1}, opts);
  at::Tensor out = at::from_blob(act + m0 * I, {m1 - m0, I}, opts);
  const at::Tensor a = kind == kSilu ? at::silu(gate) : at::gelu(gate, kind == kGeluTanh ? "tanh" : "none");
  if (plain) out.copy_(a);
  else at::mul_out(out, a, at::from_blob(g + I, {m1 - m0, I}, {2 * I, 1}, opts));
}

// x [M, n] times sigmoid(gate) for rows [m0, m1) (an attention output gate, Qwen3.5's): the
// PyTorch operators the per-op path runs (out * torch.sigmoid(gate)), on this thread's rows.
void sigmoid_gate_rows(c10::BFloat16* x, const c10::BFloat16* gate, int64_t m0, int64_t m1, int64_t n) {
  const auto opts = at::TensorOptions().dtype(at::kBFloat16);
  at::Tensor xt = at::from_blob(x + m0 * n, {m1 - m0, n}, opts);
  const at::Tensor g = at::from_blob(const_cast<c10::BFloat16*>(gate) + m0 * n, {m1 - m0, n}, opts);
  at::mul_out(xt, xt, at::sigmoid(g));
}

// ---------------------------------------------------------------- the stack

// The layers that share an attention plan: their window, head dim, KV heads and q's row
// stride (their qkv linear's width).
using AttnKey = std::array<int64_t, 4>;

// A step's attention for the layers of one AttnKey (decode_attention.h's DecodeAttention,
// compiled for its head dim where the paged_decode_attention op is, so both give the same bits).
struct StepAttention {
  virtual ~StepAttention() = default;
  virtual int64_t items() const = 0;
  virtual void item_range(int64_t it, int& b, int& t0, int& t1) const = 0;
  virtual void set_caches(const PagedKV<c10::BFloat16>& kv) = 0;
  virtual void set_sinks(const float* sinks) = 0;
  virtual void run_item(int64_t it) = 0;
  virtual void finish(int b0, int b1) = 0;
};

template <int DT>
struct StepAttentionOf final : StepAttention {
  DecodeAttention<c10::BFloat16, DT> a;
  template <typename... Args>
  explicit StepAttentionOf(Args&&... args) : a(std::forward<Args>(args)...) {}
  int64_t items() const override { return a.items(); }
  void item_range(int64_t it, int& b, int& t0, int& t1) const override { a.item_range(it, b, t0, t1); }
  void set_caches(const PagedKV<c10::BFloat16>& kv) override { a.set_caches(kv); }
  void set_sinks(const float* sinks) override { a.set_sinks(sinks); }
  void run_item(int64_t it) override { a.run_item(it); }
  void finish(int b0, int b1) override { a.finish(b0, b1); }
};

template <typename... Args>
std::unique_ptr<StepAttention> make_step_attention(int64_t D, Args&&... args) {
  switch (D) {  // the head dims paged_decode_attention compiles for their width
    case 64: return std::make_unique<StepAttentionOf<64>>(std::forward<Args>(args)...);
    case 128: return std::make_unique<StepAttentionOf<128>>(std::forward<Args>(args)...);
    case 256: return std::make_unique<StepAttentionOf<256>>(std::forward<Args>(args)...);
    case 512: return std::make_unique<StepAttentionOf<512>>(std::forward<Args>(args)...);
    default: return std::make_unique<StepAttentionOf<0>>(std::forward<Args>(args)...);
  }
}

// A layer's linears in the order the constructor and bind_lora take them; the extra one is
// an attention layer's output gate (attn_gate, or none) or a linear-attention layer's in_proj_ba;
// the last two its per-layer input's gate (hidden -> P) and projection (P -> hidden), or none.
enum Linear : int64_t { kQkv, kO, kGateUp, kDown, kExtra, kPleGate, kPleProj, kLinears };

struct StackLayer {
  at::Tensor norms[kNormSlots];  // bf16 weights; undefined where the layer has none
  at::Tensor k_cache, v_cache;
  QLinear qkv, o, gu, down, extra, ple_gate, ple_proj;
  lora::Adapter<c10::BFloat16> lora[kLinears];  // bind_lora's; unbound where none
  std::vector<float> bias[kLinears];  // fp32 copies; each linear's bias points into its own
  int64_t window = 0;           // > 0: attends its last `window` keys
  int64_t table = 0;            // its rotary table: 0 the model's, 1 the sliding layers', 2 none (NoPE)
  int64_t kv_group = 0;         // its block group: which of a step's block tables and slots it uses
  int attention = 0;            // its attention in run_impl (one per distinct window and shape)
  int64_t kind = kAttentionLayer;
  // An attention layer's shape (its caches'): KV heads and head dim; the width of its rotary
  // table (0: none turn); whether it reads an earlier layer's caches (writing none) and whether
  // its values are its keys' projection.
  int64_t KVH = 0, D = 0, R = 0;
  bool kv_shared = false, k_eq_v = false;
  float scalar = 1.f;  // the layer scalar (kLayerScalar), as a float
  // Whether it ends by adding its MLP's output (and per-layer input) to the residual stream
  // itself and scaling it (Gemma 4): the next layer then starts from the stream alone.
  bool closes() const { return norms[kLayerScalar].defined() || ple_gate.present(); }
  // A linear-attention layer's: its shape (layer options), state tensors (conv_state [N, C,
  // K - 1] bf16, ssm_state [N, H, Dk, Dv] fp32 or bf16, a row per state slot) and parameters, bound by
  // bind_linear_attention.
  int64_t Hk = 0, H = 0, Dk = 0, Dv = 0, K1 = 0;
  int64_t conv_dim() const { return 2 * Hk * Dk + H * Dv; }
  at::Tensor conv_state, ssm_state, conv_weight, norm_weight;
  std::vector<float> A_log, dt_bias;
  // A MoE layer's router and routed experts (bind_moe's): panels (int4, MXFP4) or rows (int8,
  // bf16), the one `format` names.
  struct Experts {
    bool bound = false;
    int64_t format = 0;  // bind_moe's: 0 int4, 1 MXFP4 (panels), 2 int8, 3 bf16 (rows)
    moe::Panels<q8act::Q4Fmt> q4;
    moe::Panels<q8act::MX4Fmt> mx4;
    moe::Rows<int8_t> r8;
    moe::Rows<c10::BFloat16> rb;
    const c10::BFloat16* router = nullptr;  // [E, hidden]
    moe::Router route;                      // its options (the biases point into the vectors)
    std::vector<float> router_bias, score_bias, gate_up_bias, down_bias;  // fp32 (empty: none)
    std::vector<float> in_scale, expert_scale;  // Gemma 4's router's (empty: none)
    bool shared_gate = false;  // the router's row E gates the shared expert (the layer's gate_up / down)
    int64_t I() const {
      int64_t i = 0;
      with([&](const moe::ExpertMlp& L) { i = L.I; });
      return i;
    }
    template <typename F>
    void with(F&& f) const {
      switch (format) {
        case 0: f(q4); break;
        case 1: f(mx4); break;
        case 2: f(r8); break;
        default: f(rb); break;
      }
    }
  };
  int64_t mlp_kind = kDenseMlp;
  Experts moe;
  bool has_sinks = false;
  std::vector<float> sinks;  // bind_sinks' (fp32, a query head each)
  // Its linears in Linear order (the extra one absent: N = 0).
  std::array<QLinear*, kLinears> linears() { return {&qkv, &o, &gu, &down, &extra, &ple_gate, &ple_proj}; }
  const c10::BFloat16* norm(NormSlot k) const {
    return norms[k].defined() ? norms[k].data_ptr<c10::BFloat16>() : nullptr;
  }
};

// The decoder layers of a model, bound once (weights, norms, KV cache views, its layer
// description), run for a batch of decode rows by one call per step. Python holds it as
// torch.classes.servelm_stack.DecodeStack (bound by servelm.models.decode_stack).
class DecodeStack : public torch::CustomClassHolder {
 public:
  // weights: per layer, per linear (qkv, o, gate_up, down) int4 [qweight, scales, mins] (tiles
  // or q8act's panels), int8 [qweight, scales], bf16 [weight] or amx [packed]; formats: per
  // layer and linear, its code (format::, servelm.quantization.StackFormat; kAmxGated
  // gate_up only); norms: per layer kNormSlots weights (NormSlot order; empty: none);
  // biases: per layer, per linear, an empty tensor for none; k_caches / v_caches: per layer
  // [NB, BS, KVH, D]; layer_options: per layer kLayerOptions integers; model_options
  // (kModelOptions) and model_scalars (kModelScalars): the model's.
  DecodeStack(std::vector<at::Tensor> weights, std::vector<int64_t> formats,
              std::vector<at::Tensor> norms, std::vector<at::Tensor> biases,
              std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
              std::vector<int64_t> layer_options, std::vector<int64_t> model_options,
              std::vector<double> model_scalars)
      : keep_(std::move(weights)) {
    TORCH_CHECK(model_options.size() == kModelOptions && model_scalars.size() == kModelScalars,
                "DecodeStack: ", static_cast<int64_t>(kModelOptions), " model options and ",
                static_cast<int64_t>(kModelScalars), " model scalars, got ", model_options.size(),
                " and ", model_scalars.size());
    heads_ = model_options[kNumHeads];
    kv_heads_ = model_options[kNumKvHeads];
    act_ = model_options[kActivation];
    q_scale_period_ = model_options[kQScalePeriod];
    pre_norms_ = model_options[kPreNorms] != 0;
    qk_norm_whole_ = model_options[kQkNormWhole] != 0;
    layer_norm_ = model_options[kLayerNorm] != 0;
    parallel_ = model_options[kParallel] != 0;
    plain_mlp_ = model_options[kPlainMlp] != 0;
    v_norm_ = model_options[kVNorm] != 0;
    ple_ = model_options[kPerLayerInput];
    rot_[0] = model_options[kRotaryDim];
    rot_[1] = model_options[kLocalRotaryDim] ? model_options[kLocalRotaryDim] : rot_[0];
    TORCH_CHECK(ple_ >= 0, "DecodeStack: the per-layer input's width must be >= 0 (0: none)");
    for (const int64_t r : rot_)
      TORCH_CHECK(r > 0 && r % 2 == 0 && r <= kMaxD, "DecodeStack: rotary_dim must be even and in (0, ",
                  static_cast<int64_t>(kMaxD), "], got ", r);
    TORCH_CHECK(!parallel_ || pre_norms_, "DecodeStack: a parallel block takes pre-norms");
    q_scale_beta_ = model_scalars[kQScaleBeta];
    TORCH_CHECK(q_scale_beta_ == 0.0 || q_scale_period_ > 0,
                "DecodeStack: a query scale needs a positive period");
    eps_ = model_scalars[kEps];
    scale_ = model_scalars[kScale];
    embed_scale_ = model_scalars[kEmbedScale];
    softcap_ = model_scalars[kAttnSoftcap];
    residual_scale_ = model_scalars[kResidualScale];
    TORCH_CHECK(std::isfinite(residual_scale_) && residual_scale_ != 0.0,
                "DecodeStack: the residual scale must be finite and non-zero (1: none)");
    TORCH_CHECK(softcap_ >= 0.0 && std::isfinite(softcap_), "DecodeStack: the soft-cap must be >= 0 (0: none)");
    TORCH_CHECK(heads_ >= 1 && kv_heads_ >= 1 && heads_ % kv_heads_ == 0,
                "DecodeStack: num_heads must be a multiple of num_kv_heads");
    TORCH_CHECK(act_ == kSilu || act_ == kGeluTanh || act_ == kGelu, "DecodeStack: activation ", act_,
                " is none of SiLU (0), tanh-GELU (1) and GELU (2)");
    const size_t L = k_caches.size();
    TORCH_CHECK(L >= 1 && norms.size() == kNormSlots * L && formats.size() == kLinears * L &&
                    biases.size() == kLinears * L && v_caches.size() == L &&
                    layer_options.size() == kLayerOptions * L,
                "DecodeStack: per layer ", static_cast<int64_t>(kNormSlots), " norms, ",
                static_cast<int64_t>(kLinears), " formats and biases, K/V caches and ",
                static_cast<int64_t>(kLayerOptions), " layer options, got ", norms.size(), " norms, ",
                formats.size(), " formats, ", biases.size(), " biases, ", k_caches.size(), "/",
                v_caches.size(), " caches, ", layer_options.size(), " options for ", L, " layers");
    // The model's width: its input norm's, or (norms after attention and the MLP alone, OLMo 2)
    // its attention output norm's.
    TORCH_CHECK(!norms.empty(), "DecodeStack: no layers");
    hidden_ = norms[pre_norms_ ? kInputNorm : kAttnOutNorm].numel();
    const int64_t hidden = hidden_;
    layers_.reserve(L);
    size_t j = 0;
    std::map<AttnKey, int> attn_keys;
    attn0_ = -1;
    for (size_t l = 0; l < L; ++l) {
      StackLayer s;
      const int64_t* opt = layer_options.data() + kLayerOptions * l;
      s.kind = opt[kKind];
      TORCH_CHECK(s.kind == kAttentionLayer || s.kind == kLinearAttentionLayer,
                  "DecodeStack: layer kind ", s.kind, " is neither attention (0) nor linear attention (1)");
      const bool linear = s.kind == kLinearAttentionLayer;
      s.mlp_kind = opt[kMlpKind];
      s.has_sinks = opt[kSinks] != 0;
      s.kv_shared = opt[kKvShared] != 0, s.k_eq_v = opt[kKEqV] != 0;
      TORCH_CHECK(!s.has_sinks || !linear, "DecodeStack: a linear-attention layer has no sinks");
      TORCH_CHECK(!linear || (!s.kv_shared && !s.k_eq_v), "DecodeStack: a linear-attention layer has "
                  "no K/V to share or to take from its keys");
      TORCH_CHECK(!s.kv_shared || !s.k_eq_v, "DecodeStack: a KV-shared layer projects no keys to take "
                  "its values from");
      TORCH_CHECK(s.mlp_kind == kDenseMlp || s.mlp_kind == kRoutedExperts || s.mlp_kind == kExpertsBeside,
                  "DecodeStack: MLP kind ", s.mlp_kind, " is none of dense (0), routed experts (1) and "
                  "experts beside the MLP (2)");
      const bool routed = s.mlp_kind == kRoutedExperts, beside = s.mlp_kind == kExpertsBeside;
      TORCH_CHECK(!(routed || beside) || !parallel_, "DecodeStack: routed experts in a parallel block");
      has_moe_ |= routed || beside;
      s.k_cache = k_caches[l];
      s.v_cache = v_caches[l];
      int64_t D = 0, qkv_n = 0, o_k = 0;
      if (linear) {
        s.Hk = opt[kLinearKeyHeads], s.H = opt[kLinearValueHeads], s.Dk = opt[kLinearKeyDim];
        s.Dv = opt[kLinearValueDim], s.K1 = opt[kConvKernel] - 1;
        TORCH_CHECK(s.Hk >= 1 && s.H >= 1 && s.H % s.Hk == 0 && s.Dk >= 1 && s.Dv >= 1 && s.K1 >= 0,
                    "DecodeStack: a linear-attention layer needs key and value heads (value heads a "
                    "multiple of key heads), their sizes and a convolution kernel >= 1");
        TORCH_CHECK(!s.k_cache.numel() && !s.v_cache.numel(),
                    "DecodeStack: a linear-attention layer has no K/V cache (empty tensors)");
        qkv_n = s.conv_dim() + s.H * s.Dv;  // in_proj_qkvz: the mixed projection, then z
        o_k = s.H * s.Dv;
        has_linear_ = true;
      } else {
        // Each layer's KV heads and head dim are its caches' (Gemma 4's global layers differ).
        TORCH_CHECK(s.k_cache.dim() == 4 && s.k_cache.scalar_type() == at::kBFloat16 &&
                        s.k_cache.sizes() == s.v_cache.sizes() && s.k_cache.size(2) >= 1 &&
                        heads_ % s.k_cache.size(2) == 0 && heads_ / s.k_cache.size(2) <= kMaxG &&
                        s.k_cache.size(3) <= kMaxD,
                    "DecodeStack: K/V caches must be bfloat16 [NB, BS, KVH, D], num_heads a multiple of "
                    "KVH (at most ", static_cast<int64_t>(kMaxG), " a KV head), D at most ",
                    static_cast<int64_t>(kMaxD));
        check_paged_caches(s.k_cache, s.v_cache, "DecodeStack");
        s.KVH = s.k_cache.size(2), s.D = D = s.k_cache.size(3);
        // qkv: q, k and v; q and k (values from the keys); q alone (a KV-shared layer).
        qkv_n = (heads_ + (s.kv_shared ? 0 : s.k_eq_v ? 1 : 2) * s.KVH) * D, o_k = heads_ * D;
        if (attn0_ < 0) attn0_ = static_cast<int64_t>(l);
        const at::Tensor& k0 = attn0_ == static_cast<int64_t>(l) ? s.k_cache : layers_[attn0_].k_cache;
        TORCH_CHECK(s.k_cache.size(0) == k0.size(0) && s.k_cache.size(1) == k0.size(1),
                    "DecodeStack: every layer's caches have the same blocks (one block table)");
      }
      for (int k = 0; k < kNormSlots; ++k) {
        const at::Tensor& t = norms[kNormSlots * l + k];
        const bool pre = k == kInputNorm || k == kPostAttentionNorm;
        // (A parallel block's MLP may read attention's normed input: no norm of its own.)
        const bool required = pre_norms_ ? k == kInputNorm || (k == kPostAttentionNorm && !parallel_)
                                         : k == kAttnOutNorm || k == kMlpOutNorm;
        TORCH_CHECK(pre_norms_ || !pre || !t.numel(), "DecodeStack: a model without pre-norms has "
                    "no input or post-attention norm weights");
        if (!required && !t.numel()) continue;
        TORCH_CHECK(!linear || (k != kQNorm && k != kKNorm), "DecodeStack: a linear-attention layer "
                    "has no q / k norms");
        TORCH_CHECK(k != kKNorm || !s.kv_shared, "DecodeStack: a KV-shared layer has no k norm");
        // q / k norms: a head's (D), or over the whole projection (OLMo 2); the layer scalar: one.
        const int64_t n = k == kQNorm ? (qk_norm_whole_ ? heads_ * D : D)
                          : k == kKNorm ? (qk_norm_whole_ ? s.KVH * D : D) : k == kLayerScalar ? 1 : hidden;
        TORCH_CHECK(t.dim() == 1 && t.numel() == n && t.is_contiguous() && t.scalar_type() == at::kBFloat16,
                    "DecodeStack: norm weights must be contiguous bfloat16 [", n, "]");
        s.norms[k] = t;
      }
      const int moe_norms = s.norms[kMoeMlpNorm].defined() + s.norms[kMoeInputNorm].defined() +
                            s.norms[kMoeOutNorm].defined();
      TORCH_CHECK(moe_norms == (beside ? 3 : 0),
                  "DecodeStack: experts beside the MLP, and only they, take their three norms");
      TORCH_CHECK(!s.norms[kQNorm].defined() == !(s.norms[kKNorm].defined() || s.kv_shared),
                  "DecodeStack: q and k norms come together (a KV-shared layer's q norm alone)");
      if (s.norms[kLayerScalar].defined()) s.scalar = static_cast<float>(s.norms[kLayerScalar].data_ptr<c10::BFloat16>()[0]);
      s.window = linear ? 0 : opt[kWindow];
      s.table = opt[kRotaryTable];
      s.kv_group = opt[kKvGroup];
      TORCH_CHECK(s.kv_group >= 0, "DecodeStack: a layer's block group must be >= 0");
      if (!linear) kv_groups_ = std::max(kv_groups_, s.kv_group + 1);
      TORCH_CHECK(s.window >= 0 && s.window <= INT32_MAX, "DecodeStack: window must be >= 0 (0: none)");
      TORCH_CHECK(s.table >= 0 && s.table <= 2, "DecodeStack: rotary table must be 0, 1 or 2 (none)");
      uses_local_ |= !linear && s.table == 1;
      s.R = linear || s.table == 2 ? 0 : rot_[s.table];
      TORCH_CHECK(linear || (s.R <= D && s.R % 2 == 0), "DecodeStack: layer ", l, "'s rotary table (", s.R,
                  " dims) is wider than its heads (", D, ") or odd");
      // One attention a distinct window and shape (its plan and q layout).
      if (!linear)
        s.attention = attn_keys.emplace(AttnKey{s.window, D, s.KVH, qkv_n}, static_cast<int>(attn_keys.size()))
                          .first->second;
      const int64_t* g = formats.data() + kLinears * l;
      TORCH_CHECK(g[0] != QLinear::kAmxGated && g[1] != QLinear::kAmxGated && g[3] != QLinear::kAmxGated &&
                      g[4] != QLinear::kAmxGated,
                  "DecodeStack: only gate_up_proj may be gated amx (-3)");
      TORCH_CHECK(g[0] != format::kNone && g[1] != format::kNone && (!linear || g[4] != format::kNone),
                  "DecodeStack: only an attention layer's extra linear (its output gate) may be absent");
      TORCH_CHECK(g[5] != QLinear::kAmxGated && g[6] != QLinear::kAmxGated &&
                      (g[5] == format::kNone) == (g[6] == format::kNone) &&
                      (g[5] == format::kNone || ple_ > 0) &&
                      (g[5] == format::kNone) == !norms[kNormSlots * l + kPleNorm].numel(),
                  "DecodeStack: a per-layer input has its gate and projection (a model's per-layer input "
                  "width > 0) and its norm");
      TORCH_CHECK(!parallel_ || (g[5] == format::kNone && !norms[kNormSlots * l + kLayerScalar].numel()),
                  "DecodeStack: a parallel block has no per-layer input or layer scalar");
      TORCH_CHECK((g[2] == format::kNone) == (g[3] == format::kNone) && (routed || g[2] != format::kNone),
                  "DecodeStack: a layer has gate_up and down linears (routed experts: a shared expert's, "
                  "or none)");
      TORCH_CHECK(g[2] != QLinear::kAmxGated || (act_ == kSilu && !plain_mlp_),
                  "DecodeStack: gated amx is a SiLU-gated MLP's");
      s.qkv = parse_linear(keep_, j, g[0], qkv_n, hidden, linear ? "in_proj_qkvz" : "qkv_proj");
      s.o = parse_linear(keep_, j, g[1], hidden, o_k, linear ? "out_proj" : "o_proj");
      // gate_up's width is implied by its weight: int4 tiles hold 8K bytes each, int8 (and
      // w8a8's panels) 16K bytes, bf16 16K elements.
      if (g[2] != format::kNone) {  // (a MoE layer's: its shared expert's)
        TORCH_CHECK(j < keep_.size(), "DecodeStack: too few weight tensors for gate_up_proj");
        const bool amx_gu = g[2] == QLinear::kAmx || g[2] == QLinear::kAmxGated;
        const bool w8_gu = g[2] > QLinear::kW8A8;
        const int64_t gu_tiles = keep_[j].numel() / ((!w8_gu && (g[2] > 0 || amx_gu) ? 8 : 16) * hidden);
        s.gu = parse_linear(keep_, j, g[2], 16 * gu_tiles, hidden, plain_mlp_ ? "up_proj" : "gate_up_proj");
        s.down = parse_linear(keep_, j, g[3], hidden, plain_mlp_ ? s.gu.N : s.gu.N / 2, "down_proj");
      }
      // The output gate: sigmoid(x W) [heads * D] times attention's output; in_proj_ba: b | a
      // of each value head.
      s.extra = parse_linear(keep_, j, g[4], linear ? 2 * s.H : heads_ * D, hidden,
                             linear ? "in_proj_ba" : "attn_gate");
      s.ple_gate = parse_linear(keep_, j, g[5], ple_, hidden, "per_layer_input.input_gate");
      s.ple_proj = parse_linear(keep_, j, g[6], hidden, ple_, "per_layer_input.input_proj");
      const auto lins = s.linears();
      for (int k = 0; k < kLinears; ++k) {
        const at::Tensor& b = biases[kLinears * l + k];
        if (!b.numel()) continue;
        TORCH_CHECK(lins[k]->present() && b.numel() == lins[k]->N, "DecodeStack: layer ", l, " linear ", k,
                    "'s bias must have its ", lins[k]->N, " outputs");
        TORCH_CHECK(!lins[k]->gated, "DecodeStack: a gated amx gate_up takes no bias");
        const at::Tensor bf = b.to(at::kFloat).contiguous();
        s.bias[k].assign(bf.data_ptr<float>(), bf.data_ptr<float>() + lins[k]->N);
      }
      layers_.push_back(std::move(s));
      StackLayer& kept = layers_.back();  // (the biases' copies moved with it)
      for (int k = 0; k < kLinears; ++k)
        kept.linears()[k]->bias = kept.bias[k].empty() ? nullptr : kept.bias[k].data();
    }
    TORCH_CHECK(j == keep_.size(), "DecodeStack: ", keep_.size() - j, " weight tensors left over");
    TORCH_CHECK(attn0_ >= 0, "DecodeStack: at least one layer must be an attention layer");
    attn_keys_.resize(attn_keys.size());
    for (const auto& [key, i] : attn_keys) attn_keys_[i] = key;
  }

  // Once per linear-attention layer: its recurrent states (conv_state bf16 [N, C, K - 1],
  // ssm_state float32 or bf16 [N, H, Dk, Dv]: a row per state slot, held by reference and updated in
  // place by each run) and its parameters (conv_weight bf16 [C, K], A_log and dt_bias [H],
  // the gated norm's weight bf16 [Dv]).
  void bind_linear_attention(int64_t layer, at::Tensor conv_state, at::Tensor ssm_state,
                             at::Tensor conv_weight, at::Tensor A_log, at::Tensor dt_bias,
                             at::Tensor norm_weight) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && layers_[layer].kind == kLinearAttentionLayer,
                "DecodeStack.bind_linear_attention: layer ", layer, " is not a linear-attention layer");
    StackLayer& s = layers_[layer];
    const int64_t C = s.conv_dim();
    TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous() && conv_state.scalar_type() == at::kBFloat16 &&
                    conv_state.size(1) == C && conv_state.size(2) == s.K1,
                "DecodeStack.bind_linear_attention: conv_state must be contiguous bfloat16 [N, ", C, ", ",
                s.K1, "]");
    TORCH_CHECK(ssm_state.dim() == 4 && ssm_state.is_contiguous() &&
                    (ssm_state.scalar_type() == at::kFloat || ssm_state.scalar_type() == at::kBFloat16) &&
                    ssm_state.size(0) == conv_state.size(0) && ssm_state.size(1) == s.H &&
                    ssm_state.size(2) == s.Dk && ssm_state.size(3) == s.Dv,
                "DecodeStack.bind_linear_attention: ssm_state must be contiguous float32 or bfloat16 [N, ", s.H, ", ", s.Dk,
                ", ", s.Dv, "], N as conv_state's");
    TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.is_contiguous() &&
                    conv_weight.scalar_type() == at::kBFloat16 && conv_weight.size(0) == C &&
                    conv_weight.size(1) == s.K1 + 1,
                "DecodeStack.bind_linear_attention: conv_weight must be contiguous bfloat16 [", C, ", ",
                s.K1 + 1, "]");
    TORCH_CHECK(norm_weight.is_contiguous() && norm_weight.scalar_type() == at::kBFloat16 &&
                    norm_weight.numel() == s.Dv,
                "DecodeStack.bind_linear_attention: norm_weight must be contiguous bfloat16 [", s.Dv, "]");
    TORCH_CHECK(A_log.numel() == s.H && dt_bias.numel() == s.H,
                "DecodeStack.bind_linear_attention: A_log and dt_bias need ", s.H, " values");
    s.conv_state = conv_state, s.ssm_state = ssm_state, s.conv_weight = conv_weight;
    s.norm_weight = norm_weight;
    const at::Tensor a = A_log.to(at::kFloat).contiguous(), d = dt_bias.to(at::kFloat).contiguous();
    s.A_log.assign(a.data_ptr<float>(), a.data_ptr<float>() + s.H);
    s.dt_bias.assign(d.data_ptr<float>(), d.data_ptr<float>() + s.H);
  }

  // Once per MoE layer (MLP kind kRoutedExperts): its router (bf16 [E, hidden], hidden a multiple
  // of 16; bias [E] or None), top_k, whether the chosen weights are renormalised (norm) and
  // their scale, as servelm_q8act.moe_route takes them; and its routed experts as the fused
  // ops take them: format 0, int4 panels with scales and mins (servelm_q8act.moe_experts); 1,
  // MXFP4 panels with exponents as scales, no mins (moe_experts_mxfp4); 2, int8 rows [E, N, K]
  // with fp32 scales [E, N], or 3, bf16 rows, no scales (servelm_gemv.moe_experts, by_row its
  // weight order); with act, the experts' biases, limit and alpha. Held by reference. A layer
  // with gate_up and down linears has a shared expert (those linears, the model's activation)
  // added to the experts' sum: times sigmoid(its gate's logit) where shared_gate (the router's
  // last row, E + 1 rows), else as it is. groups > 0: DeepSeek-V3's grouped sigmoid router
  // (moe::Router; score_bias [E] or None), as moe_route takes it; so are Gemma 4's in_scale [H]
  // (or None), in_root, in_eps and expert_scale [E] (or None). A layer of MLP kind
  // kExpertsBeside: the experts beside its dense MLP (no shared gate).
  void bind_moe(int64_t layer, at::Tensor router, c10::optional<at::Tensor> router_bias, int64_t top_k,
                bool norm, double scale, int64_t format, at::Tensor gate_up_q, c10::optional<at::Tensor> gate_up_s,
                c10::optional<at::Tensor> gate_up_m, at::Tensor down_q, c10::optional<at::Tensor> down_s,
                c10::optional<at::Tensor> down_m, int64_t act, c10::optional<at::Tensor> gate_up_bias,
                c10::optional<at::Tensor> down_bias, double limit, double alpha, bool shared_gate,
                bool by_row, int64_t groups, int64_t topk_groups, c10::optional<at::Tensor> score_bias,
                c10::optional<at::Tensor> in_scale, double in_root, double in_eps,
                c10::optional<at::Tensor> expert_scale) {
    const char* fn = "DecodeStack.bind_moe";
    TORCH_CHECK(layer >= 0 && layer < num_layers() &&
                    (layers_[layer].mlp_kind == kRoutedExperts || layers_[layer].mlp_kind == kExpertsBeside),
                fn, ": layer ", layer, " has no routed experts");
    TORCH_CHECK(!shared_gate || layers_[layer].mlp_kind == kRoutedExperts, fn,
                ": experts beside an MLP have no shared expert's gate");
    TORCH_CHECK(format >= 0 && format <= 3, fn, ": format must be 0 (int4), 1 (MXFP4), 2 (int8) or 3 (bf16)");
    TORCH_CHECK(act >= 0 && act <= 3, fn, ": act must be 0, 1, 2 or 3");
    TORCH_CHECK(!shared_gate || layers_[layer].gu.present(), fn, ": a shared expert's gate, but layer ", layer,
                " has no shared expert (gate_up and down linears)");
    const int64_t H = hidden_, E = router.size(0) - (shared_gate ? 1 : 0);
    TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kBFloat16 && router.is_contiguous() &&
                    router.size(1) == H && H % 16 == 0,
                fn, ": the router must be contiguous bfloat16 [E, ", H, "], hidden a multiple of 16");
    TORCH_CHECK(top_k >= 1 && top_k <= E, fn, ": top_k must be in [1, ", E, "]");
    TORCH_CHECK(groups == 0 || (groups <= 64 && E % groups == 0 && topk_groups >= 1 && topk_groups <= groups &&
                                top_k <= topk_groups * (E / groups)),
                fn, ": groups (at most 64) must divide the ", E, " experts, topk_groups be in [1, groups], and "
                "those groups hold top_k experts");
    const bool panels = format <= 1, mx = format == 1;
    auto given = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
    int64_t I = 0, group = q8act::kB;
    if (panels) {
      for (const at::Tensor* t : {&gate_up_q, &down_q})
        TORCH_CHECK(t->scalar_type() == at::kByte && t->dim() == 6 && t->size(0) == E && t->size(3) == 2 &&
                        t->size(4) == 4 && t->size(5) == 32 && t->is_contiguous(),
                    fn, ": expert panels must be contiguous uint8 [E, N / 16, K / 32, 2, 4, 32]");
      I = down_q.size(2) * q8act::kB;
      TORCH_CHECK(gate_up_q.size(2) * q8act::kB == H && gate_up_q.size(1) * q8act::kNR == 2 * I &&
                      down_q.size(1) == (H + q8act::kNR - 1) / q8act::kNR,
                  fn, ": expert shapes do not fit (gate_up [E, 2I, hidden], down [E, hidden, I])");
      const at::ScalarType st = mx ? at::kByte : at::kHalf;
      for (const auto& [q, sc, mn] : {std::tuple<const at::Tensor*, const c10::optional<at::Tensor>*,
                                                 const c10::optional<at::Tensor>*>{&gate_up_q, &gate_up_s, &gate_up_m},
                                      {&down_q, &down_s, &down_m}}) {
        TORCH_CHECK(given(*sc), fn, ": panels take their scales");
        const at::Tensor& c = **sc;
        TORCH_CHECK(c.scalar_type() == st && c.dim() == 4 && c.is_contiguous() && c.size(0) == E &&
                        c.size(1) == q->size(1) && c.size(3) == q8act::kNR &&
                        (mx ? c.size(2) == q->size(2) : q->size(2) % c.size(2) == 0),
                    fn, ": expert scales must be contiguous ", mx ? "uint8" : "float16", " [E, N / 16, K / G, 16]");
        TORCH_CHECK(mx != given(*mn), fn, ": int4 experts take mins, MXFP4 ones none");
        if (!mx)
          TORCH_CHECK((*mn)->sizes() == c.sizes() && (*mn)->scalar_type() == at::kHalf && (*mn)->is_contiguous(),
                      fn, ": expert mins must be as their scales");
      }
      group = mx ? q8act::kB : H / gate_up_s->size(2);
      TORCH_CHECK(mx || (group % q8act::kB == 0 && I / down_s->size(2) == group), fn,
                  ": int4 experts need one group size, a multiple of 32, for both projections");
    } else {
      const at::ScalarType wt = format == 2 ? at::kChar : at::kBFloat16;
      TORCH_CHECK(gate_up_q.scalar_type() == wt && down_q.scalar_type() == wt && gate_up_q.dim() == 3 &&
                      down_q.dim() == 3 && gate_up_q.is_contiguous() && down_q.is_contiguous() &&
                      gate_up_q.size(0) == E && down_q.size(0) == E,
                  fn, ": expert rows must be contiguous ", wt, " gate_up [E, 2I, hidden] and down [E, hidden, I]");
      I = down_q.size(2);
      TORCH_CHECK(gate_up_q.size(1) == 2 * I && gate_up_q.size(2) == H && down_q.size(1) == H && I % 8 == 0,
                  fn, ": expert shapes do not fit (gate_up [E, 2I, hidden], down [E, hidden, I], I a multiple of 8)");
      TORCH_CHECK((format == 2) == given(gate_up_s) && (format == 2) == given(down_s) && !given(gate_up_m) &&
                      !given(down_m),
                  fn, ": int8 experts take their rows' scales, bf16 ones none, neither mins");
      if (format == 2)
        TORCH_CHECK(gate_up_s->scalar_type() == at::kFloat && gate_up_s->is_contiguous() &&
                        gate_up_s->numel() == E * 2 * I && down_s->scalar_type() == at::kFloat &&
                        down_s->is_contiguous() && down_s->numel() == E * H,
                    fn, ": int8 experts' scales must be contiguous float32 [E, 2I] and [E, hidden]");
    }
    StackLayer::Experts& x = layers_[layer].moe;
    auto floats = [&](const c10::optional<at::Tensor>& t, int64_t n, const char* what) {
      std::vector<float> v;
      if (!given(t)) return v;
      TORCH_CHECK(t->numel() == n, fn, ": ", what, " must have ", n, " values");
      const at::Tensor f = t->to(at::kFloat).contiguous();
      v.assign(f.data_ptr<float>(), f.data_ptr<float>() + n);
      return v;
    };
    x.router_bias = floats(router_bias, E, "the router's bias");
    x.gate_up_bias = floats(gate_up_bias, E * 2 * I, "gate_up_bias");
    x.down_bias = floats(down_bias, E * H, "down_bias");
    const float* gb = x.gate_up_bias.empty() ? nullptr : x.gate_up_bias.data();
    const float* db = x.down_bias.empty() ? nullptr : x.down_bias.data();
    moe::ExpertMlp mlp;
    mlp.gbias = gb, mlp.dbias = db, mlp.act = act, mlp.limit = static_cast<float>(limit);
    mlp.alpha = static_cast<float>(alpha), mlp.H = H, mlp.I = I;
    auto fill = [&](auto& P, const auto* gs, const auto* gm, const auto* ds, const auto* dm) {
      static_cast<moe::ExpertMlp&>(P) = mlp;
      P.gq = gate_up_q.data_ptr<uint8_t>(), P.dq = down_q.data_ptr<uint8_t>();
      P.gs = gs, P.gm = gm, P.ds = ds, P.dm = dm;
      P.s1 = (*gate_up_s)[0].numel(), P.s2 = (*down_s)[0].numel(), P.group = group;
    };
    auto fill_rows = [&](auto& R, const auto* gw, const auto* dw) {
      static_cast<moe::ExpertMlp&>(R) = mlp;
      R.gw = gw, R.dw = dw, R.by_row = by_row;
      R.gscale = format == 2 ? gate_up_s->data_ptr<float>() : nullptr;
      R.dscale = format == 2 ? down_s->data_ptr<float>() : nullptr;
    };
    if (format == 0)
      fill(x.q4, gate_up_s->data_ptr<c10::Half>(), gate_up_m->data_ptr<c10::Half>(), down_s->data_ptr<c10::Half>(),
           down_m->data_ptr<c10::Half>());
    else if (format == 1)
      fill(x.mx4, gate_up_s->data_ptr<uint8_t>(), static_cast<const uint8_t*>(nullptr), down_s->data_ptr<uint8_t>(),
           static_cast<const uint8_t*>(nullptr));
    else if (format == 2)
      fill_rows(x.r8, gate_up_q.data_ptr<int8_t>(), down_q.data_ptr<int8_t>());
    else
      fill_rows(x.rb, gate_up_q.data_ptr<c10::BFloat16>(), down_q.data_ptr<c10::BFloat16>());
    x.score_bias = floats(score_bias, E, "the router's score bias");
    x.in_scale = floats(in_scale, H, "in_scale");
    x.expert_scale = floats(expert_scale, E, "expert_scale");
    x.route.in_scale = x.in_scale.empty() ? nullptr : x.in_scale.data();
    x.route.in_root = static_cast<float>(in_root), x.route.in_eps = static_cast<float>(in_eps);
    x.route.expert_scale = x.expert_scale.empty() ? nullptr : x.expert_scale.data();
    x.route.E = E, x.route.k = top_k, x.route.norm = norm, x.route.scale = static_cast<float>(scale);
    x.route.bias = x.router_bias.empty() ? nullptr : x.router_bias.data();
    x.route.groups = groups, x.route.topk_groups = topk_groups;
    x.route.score_bias = x.score_bias.empty() ? nullptr : x.score_bias.data();
    x.format = format, x.router = router.data_ptr<c10::BFloat16>(), x.shared_gate = shared_gate, x.bound = true;
    moe_keep_.insert(moe_keep_.end(), {router, gate_up_q, down_q});
    for (const auto* t : {&gate_up_s, &gate_up_m, &down_s, &down_m})
      if (given(*t)) moe_keep_.push_back(**t);
  }

  // Once per layer whose attention has sinks (layer option kSinks): one logit per query head,
  // joining each query's softmax denominator (gpt-oss), as paged_decode_attention takes them.
  void bind_sinks(int64_t layer, at::Tensor sinks) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && layers_[layer].has_sinks, "DecodeStack.bind_sinks: layer ",
                layer, " has no sinks");
    TORCH_CHECK(sinks.numel() == heads_ && at::isFloatingType(sinks.scalar_type()),
                "DecodeStack.bind_sinks: one float per query head (", heads_, "), got ", sinks.sizes());
    const at::Tensor f = sinks.to(at::kFloat).contiguous();
    layers_[layer].sinks.assign(f.data_ptr<float>(), f.data_ptr<float>() + heads_);
  }

  // Before each run of a stack with linear-attention layers (read by that run only): each
  // row's state slot, whether it starts afresh (its token at position 0: the state zeroed
  // first), and the row its state is copied into after the step (a prefix-cache snapshot;
  // -1: none).
  void set_state_rows(std::vector<int64_t> slots, std::vector<int64_t> fresh, std::vector<int64_t> snapshots) {
    TORCH_CHECK(fresh.size() == slots.size() && snapshots.size() == slots.size(),
                "DecodeStack.set_state_rows: a slot, a fresh flag and a snapshot row per row");
    state_slots_ = std::move(slots), state_fresh_ = std::move(fresh), state_snapshots_ = std::move(snapshots);
  }

  // Before each run of a stack whose layers take per-layer inputs (model option
  // kPerLayerInput): the step's, bfloat16 [M, layers, P] (read by that run only).
  void set_per_layer_inputs(at::Tensor inputs) {
    TORCH_CHECK(ple_ > 0, "DecodeStack.set_per_layer_inputs: the layers take no per-layer inputs");
    TORCH_CHECK(inputs.dim() == 3 && inputs.is_contiguous() && inputs.scalar_type() == at::kBFloat16 &&
                    inputs.device().is_cpu() && inputs.size(1) == num_layers() && inputs.size(2) == ple_,
                "DecodeStack.set_per_layer_inputs: inputs must be contiguous bfloat16 [M, ", num_layers(), ", ",
                ple_, "] on the CPU");
    per_layer_inputs_ = inputs;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // The most rows one call takes. From kDecodeOnceRows4 (int4) or kDecodeOnceRows8 (int8) rows
  // on, its matmuls decode each weight tile once, as int4_linear / int8_linear do.
  int64_t max_rows() const { return kMaxRows; }

  // Once, for run_tokens: the embedding table [V, hidden], the rotary tables cos, sin [P, R]
  // (P positions, R the rotary dims, already rounded to bfloat16) and the final norm weight
  // [hidden].
  void bind_io(at::Tensor embed, at::Tensor cos, at::Tensor sin, at::Tensor final_norm) {
    const int64_t hidden = hidden_;
    TORCH_CHECK(embed.dim() == 2 && embed.size(1) == hidden && embed.is_contiguous() &&
                    embed.scalar_type() == at::kBFloat16,
                "DecodeStack.bind_io: embed must be contiguous bfloat16 [V, ", hidden, "]");
    check_table(cos, sin, 0, "bind_io");
    TORCH_CHECK(final_norm.dim() == 1 && final_norm.numel() == hidden &&
                    final_norm.is_contiguous() && final_norm.scalar_type() == at::kBFloat16,
                "DecodeStack.bind_io: final_norm must be contiguous bfloat16 [", hidden, "]");
    embed_ = embed, cos_[0] = cos, sin_[0] = sin, final_norm_ = final_norm;
  }
  // Once, for run_tokens of a model whose final norm is a LayerNorm with a bias.
  void bind_final_norm_bias(at::Tensor bias) {
    TORCH_CHECK(layer_norm_, "DecodeStack.bind_final_norm_bias: the norms are RMSNorms");
    TORCH_CHECK(bias.dim() == 1 && bias.numel() == hidden_ && bias.is_contiguous() &&
                    bias.scalar_type() == at::kBFloat16,
                "DecodeStack.bind_final_norm_bias: bias must be contiguous bfloat16 [", hidden_, "]");
    final_norm_bias_ = bias;
  }
  // Once per adapted linear (servelm.layers.lora.LoRALinear) of layer `layer`, `linear` a
  // Linear: its adapters' stacks lora_a [S, J*R, K], lora_b [S, ceil(R/2), N, 2] (bf16, held by
  // reference: adapters are copied into them, never reallocated) and its parts' column bounds
  // (J + 1). Every adapted linear has the same S slots. A run then adds the deltas of
  // set_lora_rows' rows to that linear's output.
  void bind_lora(int64_t layer, int64_t linear, at::Tensor lora_a, at::Tensor lora_b,
                 std::vector<int64_t> bounds) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && linear >= 0 && linear < kLinears,
                "DecodeStack.bind_lora: layer ", layer, " linear ", linear, " is not one of ", num_layers(),
                " layers' ", static_cast<int64_t>(kLinears), " linears");
    StackLayer& s = layers_[layer];
    const QLinear& q = *s.linears()[linear];
    TORCH_CHECK(q.present(), "DecodeStack.bind_lora: layer ", layer, " has no linear ", linear);
    auto L = lora::make_adapter<c10::BFloat16>(lora_a, lora_b, bounds, q.N, q.K, "DecodeStack.bind_lora");
    TORCH_CHECK(lora_slots_ == 0 || L.S == lora_slots_, "DecodeStack.bind_lora: every adapted linear needs the "
                "same number of slots, got ", L.S, " and ", lora_slots_);
    lora_slots_ = L.S;
    lora_jp_ = std::max(lora_jp_, L.J * lora::paired_ranks(L.R));
    lora_keep_.insert(lora_keep_.end(), {lora_a, lora_b});
    s.lora[linear] = std::move(L);
  }

  // Before a run (and for every run after it, until set again): each row's adapter slot, int32
  // [M] (-1: none), or None / empty when no row of the step has one.
  void set_lora_rows(c10::optional<at::Tensor> rows) {
    if (!rows || !rows->numel()) {
      lora_rows_ = at::Tensor();
      return;
    }
    TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kInt && rows->is_contiguous() &&
                    rows->device().is_cpu(),
                "DecodeStack.set_lora_rows: row slots must be contiguous int32 [M] on the CPU");
    lora_rows_ = *rows;
  }

  // Once, for run_tokens where layers take the sliding layers' rotary table: it, as bind_io's.
  void bind_local_rotary(at::Tensor cos, at::Tensor sin) {
    check_table(cos, sin, 1, "bind_local_rotary");
    cos_[1] = cos, sin_[1] = sin;
  }

  // A whole decode step from token ids and positions (int64 [M]): the embedding rows (times
  // the embedding scale) and rotary rows gathered here, every layer as run(), then the final
  // residual add + RMSNorm. Returns the normalised hidden states [M, hidden], the same bits
  // as embedding, indexing cos/sin, run() and fused_add_rms_norm one op after another.
  at::Tensor run_tokens(at::Tensor input_ids, at::Tensor positions, at::Tensor slot_mapping,
                        at::Tensor block_tables, at::Tensor context_lens) {
    TORCH_CHECK(embed_.defined(), "DecodeStack.run_tokens: call bind_io first");
    TORCH_CHECK(!uses_local_ || cos_[1].defined(), "DecodeStack.run_tokens: call bind_local_rotary first");
    const int64_t M = input_ids.numel(), hidden = embed_.size(1);
    for (const auto* t : {&input_ids, &positions})
      TORCH_CHECK(t->dim() == 1 && t->numel() == M && t->is_contiguous() && t->scalar_type() == at::kLong,
                  "DecodeStack.run_tokens: input_ids and positions must be contiguous int64 [M]");
    TORCH_CHECK(M >= 1 && M <= kMaxRows, "DecodeStack takes 1 to ", kMaxRows, " rows, got ", M);
    using BF = c10::BFloat16;
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t V = embed_.size(0), tables = uses_local_ ? 2 : 1;
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(ids[m] >= 0 && ids[m] < V, "DecodeStack.run_tokens: input_ids[", m, "] = ", ids[m],
                  " is outside the vocabulary (", V, ")");
      for (int64_t k = 0; k < tables; ++k)
        TORCH_CHECK(pos[m] >= 0 && pos[m] < cos_[k].size(0), "DecodeStack.run_tokens: positions[", m,
                    "] = ", pos[m], " is outside the rotary table (", cos_[k].size(0), " positions)");
    }
    at::Tensor residual = at::empty({M, hidden}, embed_.options());
    // Each table's cos and sin rows of the step's positions: [cos, sin] of the model's table,
    // then of the sliding layers'.
    // (One allocation, each [M, R] a contiguous slice of it.)
    at::Tensor rot = at::empty({2 * M * (rot_[0] + (tables == 2 ? rot_[1] : 0))}, embed_.options());
    std::vector<at::Tensor> t;
    int64_t off = 0;
    for (int64_t k = 0; k < tables; ++k)
      for (const at::Tensor* src : {&cos_[k], &sin_[k]}) {
        const int64_t R = rot_[k];
        at::Tensor rows = rot.narrow(0, off, M * R).view({M, R});
        off += M * R;
        for (int64_t m = 0; m < M; ++m)
          std::memcpy(rows.data_ptr<BF>() + m * R, src->data_ptr<BF>() + pos[m] * R, sizeof(BF) * R);
        t.push_back(rows);
      }
    BF* res = residual.data_ptr<BF>();
    const BF* emb = embed_.data_ptr<BF>();
    for (int64_t m = 0; m < M; ++m) std::memcpy(res + m * hidden, emb + ids[m] * hidden, sizeof(BF) * hidden);
    if (embed_scale_ != 1.0) {  // the scale rounded to bf16, times each element, rounded
      const float sc = static_cast<float>(BF(static_cast<float>(embed_scale_)));
      for (int64_t i = 0; i < M * hidden; ++i) res[i] = BF(static_cast<float>(res[i]) * sc);
    }
    // Each row's query scale as the reference computes it: in fp32 from the position, then
    // rounded to bf16.
    std::vector<float> qscale;
    if (q_scale_beta_ != 0.0) {
      const float beta = static_cast<float>(q_scale_beta_), period = static_cast<float>(q_scale_period_);
      for (int64_t m = 0; m < M; ++m)
        qscale.push_back(static_cast<float>(
            BF(1.f + beta * std::log(1.f + std::floor(static_cast<float>(pos[m]) / period)))));
    }
    const at::Tensor delta = run_rotary_impl(residual, t, slot_mapping, block_tables, context_lens,
                                             qscale.empty() ? nullptr : qscale.data());
    at::Tensor out = at::empty({M, hidden}, embed_.options());
    const BF* dp = delta.data_ptr<BF>();
    const BF* w = final_norm_.data_ptr<BF>();
    const BF* fb = final_norm_bias_.defined() ? final_norm_bias_.data_ptr<BF>() : nullptr;
    BF* op = out.data_ptr<BF>();
    const float eps = static_cast<float>(eps_);
    const bool closed = layers_.back().closes();  // (the stream alone: the last layer added its output)
    at::parallel_for(0, M, std::max<int64_t>(1, 32768 / hidden), [&](int64_t a, int64_t b) {
      for (int64_t m = a; m < b; ++m) {
        if (layer_norm_ && closed) ln_row<BF>(res + m * hidden, w, fb, op + m * hidden, hidden, eps);
        else if (layer_norm_) add_ln_row<BF>(dp + m * hidden, res + m * hidden, w, fb, op + m * hidden, hidden, eps);
        else if (closed) rms_row<BF>(res + m * hidden, w, op + m * hidden, hidden, eps);
        else add_rms_row<BF>(dp + m * hidden, res + m * hidden, w, op + m * hidden, hidden, eps);
      }
    });
    return out;
  }

  // run_tokens with its inputs as lists (ids, positions, context lengths: M each; slots: M
  // per block group, group after group; tables: M rows of equal width per group, flattened),
  // turned into tensors here rather than by one PyTorch call each.
  at::Tensor run_lists(std::vector<int64_t> input_ids, std::vector<int64_t> positions,
                       std::vector<int64_t> slots, std::vector<int64_t> tables,
                       std::vector<int64_t> context_lens) {
    const int64_t M = static_cast<int64_t>(input_ids.size());
    TORCH_CHECK(M >= 1 && positions.size() == input_ids.size() && slots.size() % M == 0 &&
                    context_lens.size() == input_ids.size(),
                "DecodeStack.run_lists: input_ids, positions and context_lens need one entry per "
                "row, slots one per row and block group");
    const int64_t G = static_cast<int64_t>(slots.size()) / M;
    TORCH_CHECK(G >= 1 && tables.size() % (G * M) == 0,
                "DecodeStack.run_lists: tables need M equal rows per block group");
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    const auto i32 = at::TensorOptions().dtype(at::kInt);
    at::Tensor ids_t = at::empty({M}, i64), pos_t = at::empty({M}, i64), slot_t = at::empty({G * M}, i64);
    std::memcpy(ids_t.data_ptr<int64_t>(), input_ids.data(), sizeof(int64_t) * M);
    std::memcpy(pos_t.data_ptr<int64_t>(), positions.data(), sizeof(int64_t) * M);
    std::memcpy(slot_t.data_ptr<int64_t>(), slots.data(), sizeof(int64_t) * G * M);
    const int64_t MB = static_cast<int64_t>(tables.size()) / (G * M);
    at::Tensor tab_t = G == 1 ? at::empty({M, MB}, i32) : at::empty({G, M, MB}, i32);
    at::Tensor len_t = at::empty({M}, i32);
    int32_t* tp = tab_t.data_ptr<int32_t>();
    int32_t* lp = len_t.data_ptr<int32_t>();
    for (size_t i = 0; i < tables.size(); ++i) {
      TORCH_CHECK(tables[i] >= 0 && tables[i] <= INT32_MAX, "DecodeStack.run_lists: block id ",
                  tables[i], " out of range");
      tp[i] = static_cast<int32_t>(tables[i]);
    }
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(context_lens[m] >= 1 && context_lens[m] <= INT32_MAX,
                  "DecodeStack.run_lists: context_lens[", m, "] = ", context_lens[m], " out of range");
      lp[m] = static_cast<int32_t>(context_lens[m]);
    }
    return run_tokens(ids_t, pos_t, slot_t, tab_t, len_t);
  }

  // All layers for M decode rows: residual [M, hidden] (the embeddings, scaled) is updated in
  // place and the last layer's MLP output returned (the model adds it before its final norm);
  // cos, sin: the model's rotary rows [M, R]. A stack whose layers take the sliding layers'
  // table too runs from run_rotary.
  at::Tensor run(at::Tensor residual, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                 at::Tensor block_tables, at::Tensor context_lens) {
    return run_rotary(residual, {cos, sin}, slot_mapping, block_tables, context_lens);
  }

  // run with the rotary rows as a list: [cos, sin] of the model's table, then (where layers
  // take it) [cos, sin] of the sliding layers' table.
  at::Tensor run_rotary(at::Tensor residual, std::vector<at::Tensor> tables, at::Tensor slot_mapping,
                        at::Tensor block_tables, at::Tensor context_lens) {
    TORCH_CHECK(q_scale_beta_ == 0.0, "DecodeStack: queries scaled by their position need the "
                "positions: run_tokens");
    return run_rotary_impl(residual, tables, slot_mapping, block_tables, context_lens, nullptr);
  }

 private:
  // run_rotary with each row's query scale (qscale [M], bf16 values; null: none).
  at::Tensor run_rotary_impl(at::Tensor residual, const std::vector<at::Tensor>& tables,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, const float* qscale) {
    const int64_t hidden = hidden_;
    TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kBFloat16 &&
                    residual.device().is_cpu() && residual.size(1) == hidden,
                "DecodeStack: residual must be contiguous bfloat16 [M, ", hidden, "] on the CPU");
    const int64_t M = residual.size(0);
    TORCH_CHECK(M >= 1 && M <= kMaxRows, "DecodeStack takes 1 to ", kMaxRows, " rows, got ", M);
    // A hybrid model's block groups: a table and a slot per row and group ([G, M, W], [G * M]).
    const int64_t G = block_tables.dim() == 3 ? block_tables.size(0) : 1;
    TORCH_CHECK((block_tables.dim() == 2 || block_tables.dim() == 3) &&
                    block_tables.size(block_tables.dim() - 2) == M && context_lens.numel() == M &&
                    slot_mapping.numel() == G * M,
                "DecodeStack: block_tables, context_lens and slot_mapping need one row per token "
                "(tables and slots: per block group)");
    TORCH_CHECK(G >= kv_groups_, "DecodeStack: the layers read ", kv_groups_, " block groups, got ", G);
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                    context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(),
                "DecodeStack: block_tables and context_lens must be contiguous int32");
    check_context_lens(context_lens.data_ptr<int32_t>(), M, block_tables.size(-1),
                       layers_[attn0_].k_cache.size(1), "DecodeStack");
    TORCH_CHECK(tables.size() == (uses_local_ ? 4u : 2u), "DecodeStack: ", uses_local_ ? 4 : 2,
                " rotary tensors (cos, sin", uses_local_ ? ", then the sliding layers' cos, sin)" : ")",
                ", got ", tables.size());
    for (size_t k = 0; k < tables.size(); ++k) {
      const at::Tensor& t = tables[k];
      TORCH_CHECK(t.dim() == 2 && t.size(0) == M && t.size(1) == rot_[k / 2] && t.is_contiguous() &&
                      t.scalar_type() == at::kBFloat16,
                  "DecodeStack: cos/sin must be contiguous bfloat16 [M, ", rot_[k / 2], "]");
    }
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                "DecodeStack: slot_mapping must be contiguous int64");
    check_slots(slot_mapping.data_ptr<int64_t>(), G * M,
                layers_[attn0_].k_cache.size(0) * layers_[attn0_].k_cache.size(1), "DecodeStack");
    at::Tensor out = run_impl(residual, tables, slot_mapping, block_tables, context_lens, qscale);
    state_slots_.clear();  // one run's (set_state_rows, set_per_layer_inputs before each)
    per_layer_inputs_ = at::Tensor();
    return out;
  }

  void check_table(const at::Tensor& cos, const at::Tensor& sin, int k, const char* fn) const {
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == rot_[k] && cos.sizes() == sin.sizes() &&
                    cos.is_contiguous() && sin.is_contiguous() &&
                    cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
                "DecodeStack.", fn, ": cos/sin must be contiguous bfloat16 [P, ", rot_[k], "]");
  }

  // One parallel region for the whole step. Per layer: the norm and qkv_proj; q/k norms,
  // rotary + KV write; attention, each thread running its share of the work items; then
  // o_proj .. down_proj, the norms and the activation between them. Row steps split the
  // rows, matmuls the tiles.
  at::Tensor run_impl(at::Tensor& residual, const std::vector<at::Tensor>& tables,
                      const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, const float* qscale) {
    using BF = c10::BFloat16;
    const int64_t M = residual.size(0), hidden = residual.size(1);
    // The widest qkv (or in_proj_qkvz), o input, extra output; the widest K=V layer's values.
    // (inter: the widest dense MLP (or shared expert); moe_*: the routed experts' most experts,
    // chosen, width.)
    int64_t qkv_max = 0, o_max = 0, extra_max = 0, inter = 0, moe_e = 0, moe_k = 0, moe_i = 0, kv_max = 0;
    for (const StackLayer& s : layers_) {
      qkv_max = std::max(qkv_max, s.qkv.N), o_max = std::max(o_max, s.o.K);
      if (s.k_eq_v) kv_max = std::max(kv_max, s.KVH * s.D);
      extra_max = std::max(extra_max, s.extra.N);
      inter = std::max(inter, plain_mlp_ ? s.gu.N : s.gu.N / 2);
      TORCH_CHECK(!s.has_sinks || !s.sinks.empty(), "DecodeStack: call bind_sinks for every layer with sinks first");
      if (s.mlp_kind == kRoutedExperts || s.mlp_kind == kExpertsBeside) {
        TORCH_CHECK(s.moe.bound, "DecodeStack: call bind_moe for every layer with routed experts first");
        moe_e = std::max(moe_e, s.moe.route.E), moe_k = std::max(moe_k, s.moe.route.k);
        moe_i = std::max(moe_i, s.moe.I());
      }
    }
    // Each row's chosen experts and their weights (a MoE layer's router fills them).
    std::vector<int64_t> moe_ids(M * moe_k);
    std::vector<float> moe_weights(M * moe_k);
    if (has_moe_) moe_scratch_.size(M, M * moe_k, hidden, moe_i);
    // The per-layer inputs [M, layers, P] (set_per_layer_inputs, before the run).
    const bool ple_on = ple_ > 0;
    if (ple_on)
      TORCH_CHECK(per_layer_inputs_.defined() && per_layer_inputs_.dim() == 3 && per_layer_inputs_.size(0) == M &&
                      per_layer_inputs_.size(1) == num_layers() && per_layer_inputs_.size(2) == ple_,
                  "DecodeStack: set_per_layer_inputs gives each run its [M, ", num_layers(), ", ", ple_,
                  "] per-layer inputs first");
    // A shared expert's output and its gate's logit (MoE layers with one).
    // (Experts beside an MLP: their input, then their output in shared_out.)
    const at::Tensor shared_buf = at::empty({has_moe_ ? M * (2 * hidden + 1) : 0}, residual.options());
    BF* shared_out = shared_buf.data_ptr<BF>();
    BF* shared_logit = shared_out + M * hidden;
    BF* h3 = shared_logit + M;
    moe::Scratch& moe_s = moe_scratch_;
    const auto opts = residual.options();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const BF* cos_p[2] = {tables[0].data_ptr<BF>(), tables.size() > 2 ? tables[2].data_ptr<BF>() : nullptr};
    const BF* sin_p[2] = {tables[1].data_ptr<BF>(), tables.size() > 2 ? tables[3].data_ptr<BF>() : nullptr};
    const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
    const int nthreads = std::max(1, at::get_num_threads());
    // The step's activations, one buffer each for all layers (each is consumed before the
    // next layer writes it); `out` is returned.
    at::Tensor out = at::empty({M, hidden}, opts);
    const at::Tensor bufs = at::empty(
        {M, 2 * hidden + qkv_max + o_max + extra_max + 2 * hidden + 3 * inter + kv_max + 2 * ple_}, opts);
    BF* h1 = bufs.data_ptr<BF>();
    BF* qkv_out = h1 + M * hidden;
    BF* attn = qkv_out + M * qkv_max;  // attention's output (or the DeltaNet's): o's input
    BF* extra_out = attn + M * o_max;  // the output gate's pre-activation, or b | a
    BF* o_out = extra_out + M * extra_max;
    BF* h2 = o_out + M * hidden;
    BF* gu_out = h2 + M * hidden;
    BF* act = gu_out + M * 2 * inter;
    BF* kv_vals = act + M * inter;  // a K=V layer's values, [M, KVH * D]
    BF* ple_g = kv_vals + M * kv_max;  // the per-layer input's gate, then act(gate) * input, [M, P]
    BF* ple_a = ple_g + M * ple_;
    BF* res = residual.data_ptr<BF>();
    BF* delta = out.data_ptr<BF>();
    // Each linear's input scratch (QLinear::scratch: group sums or q8act's quantised rows),
    // sized for the largest layer.
    auto sums_size = [&](QLinear StackLayer::*q) {
      int64_t n = 0;
      for (const StackLayer& s : layers_) n = std::max(n, (s.*q).scratch(M));
      return n;
    };
    std::vector<float> xs1(sums_size(&StackLayer::qkv)), xs2(sums_size(&StackLayer::o)),
        xs3(sums_size(&StackLayer::gu)), xs4(sums_size(&StackLayer::down)),
        xs5(sums_size(&StackLayer::extra)), xs6(sums_size(&StackLayer::ple_gate)),
        xs7(sums_size(&StackLayer::ple_proj));
    // Linear-attention layers: each row's state slot (set_state_rows, checked here), and the
    // per-row fp32 buffers between the convolution and the heads (conv_row's a and gb).
    int64_t conv_max = 0, lin_heads_max = 0, dv_max = 0;
    for (const StackLayer& s : layers_)
      if (s.kind == kLinearAttentionLayer) {
        TORCH_CHECK(s.ssm_state.defined(), "DecodeStack: call bind_linear_attention for every "
                    "linear-attention layer first");
        conv_max = std::max(conv_max, s.conv_dim()), lin_heads_max = std::max(lin_heads_max, s.H);
        dv_max = std::max(dv_max, s.Dv);
      }
    if (has_linear_) {
      TORCH_CHECK(static_cast<int64_t>(state_slots_.size()) == M, "DecodeStack: set_state_rows gave ",
                  state_slots_.size(), " state slots for a step of ", M, " rows");
      for (const StackLayer& s : layers_)
        if (s.kind == kLinearAttentionLayer) {
          const int64_t N = s.ssm_state.size(0);
          for (int64_t m = 0; m < M; ++m)
            TORCH_CHECK(state_slots_[m] >= 0 && state_slots_[m] < N && state_snapshots_[m] < N &&
                            state_snapshots_[m] != state_slots_[m],
                        "DecodeStack: row ", m, "'s state slot ", state_slots_[m], " or snapshot row ",
                        state_snapshots_[m], " is outside the ", N, " state rows");
        }
    }
    std::vector<float> lin_a(M * conv_max), lin_gb(M * 2 * lin_heads_max);
    const int64_t* st_slot = state_slots_.data();
    const int64_t* st_fresh = state_fresh_.data();
    const int64_t* st_snap = state_snapshots_.data();
    // One attention per distinct window, its plan for every layer of that window (the plan
    // depends only on the lengths and the window); each layer sets its caches.
    // Each block group's tables (one group: block_tables itself).
    std::vector<at::Tensor> group_tables;
    for (int64_t g = 0; g < (block_tables.dim() == 3 ? block_tables.size(0) : 1); ++g)
      group_tables.push_back(block_tables.dim() == 3 ? block_tables[g] : block_tables);
    std::vector<std::unique_ptr<StepAttention>> atts;
    for (size_t a = 0; a < attn_keys_.size(); ++a) {
      const auto& [w, D, KVH, qs] = attn_keys_[a];
      const StackLayer& first = *std::find_if(layers_.begin(), layers_.end(), [&](const StackLayer& s) {
        return s.kind == kAttentionLayer && s.attention == static_cast<int>(a);
      });
      const PagedKV<BF> kv(first.k_cache, first.v_cache, group_tables[first.kv_group]);
      atts.push_back(make_step_attention(D, qkv_out, qs, D, static_cast<int>(M), static_cast<int>(heads_),
                                         static_cast<int>(D), kv, lens, scale, nthreads, attn,
                                         AttnOptions{static_cast<int>(w), 0, static_cast<float>(softcap_)}));
    }
    const BF* final_mlp_norm = layers_.back().norm(kMlpOutNorm);
    // A branch's output times the residual scale (Granite), rounded as the reference's
    // bf16 tensor times a float is.
    const float rscale = static_cast<float>(residual_scale_);
    auto scale_row = [&](BF* x) {
      for (int64_t i = 0; i < hidden; ++i) x[i] = BF(static_cast<float>(x[i]) * rscale);
    };
    // The step's LoRA rows grouped by slot, and the shrink's output t [M, J*R] (fp32), shared
    // by each adapted linear in turn.
    lora::RowGroups lora_groups;
    if (lora_slots_ && lora_rows_.defined()) {
      TORCH_CHECK(lora_rows_.numel() == M, "DecodeStack: set_lora_rows gave ", lora_rows_.numel(),
                  " row slots for a step of ", M, " rows");
      lora_groups.build(lora_rows_.data_ptr<int32_t>(), M, lora_slots_, "DecodeStack");
    }
    const bool lora_on = !lora_groups.empty();
    std::vector<BF> lora_t(lora_on ? M * lora_jp_ : 0);
    // A gated amx gate_up with an adapter: its deltas go to lora_d_ (fp32 [M, 2 * inter], each
    // thread its own columns' ahead of its tiles), which the epilogue adds before the SiLU,
    // lora_drows[m] the row's (null: no adapter).
    std::vector<const float*> lora_drows;
    bool gated_lora = false;
    for (const StackLayer& s : layers_) gated_lora |= s.gu.gated && s.lora[kGateUp].bound();
    if (lora_on && gated_lora) {
      if (lora_d_.size() < static_cast<size_t>(M * 2 * inter)) lora_d_.resize(M * 2 * inter);
      lora_drows.assign(M, nullptr);
      const int32_t* slot = lora_rows_.data_ptr<int32_t>();
      for (int64_t m = 0; m < M; ++m)
        if (slot[m] >= 0) lora_drows[m] = lora_d_.data() + m * 2 * inter;
    }

    team_region([&](Team& t) {
      // A linear's LoRA delta: the shrink in a phase of its own before the matmul, split by
      // (rows of a slot, row of A) items, so that each adapter's A is read once a step (split by
      // rows, every thread would read every slot's A; a one-row step's shrink on one thread, at
      // the end of the row step, was slower: one core streamed A alone);
      // the expand of this thread's share of the output columns right after its tiles in the
      // matmul's phase.
      auto shrink_phase = [&](const lora::Adapter<BF>& L, const BF* x, int64_t ldx) {
        if (!lora_on || !L.bound()) return;
        t.guarded([&] {
          const int64_t n = lora_groups.chunks() * L.JR();
          lora::shrink<BF>(L, lora_groups, x, ldx, lora_t.data(), n * t.tid / t.n, n * (t.tid + 1) / t.n);
        });
        t.barrier();
      };
      auto expand = [&](const lora::Adapter<BF>& adapter, const QLinear& q, BF* y, int64_t ldy) {
        return [&, L = &adapter, q = &q, y, ldy] {
          if (!lora_on || !L->bound() || q->gated) return;
          int64_t t0, t1;
          q->share(t.tid, t.n, t0, t1);
          if (t0 < t1) lora::expand<BF>(*L, lora_groups, lora_t.data(), y, ldy, 0, L->blocks(), 16 * t0, 16 * t1);
        };
      };
      // A layer that closes the stream itself (Gemma 4), as DecoderLayer.forward does: its MLP's
      // output (normed, scaled) added to the stream; then its per-layer input,
      // norm(proj(act(gate(stream)) * input)), added; then the stream times its scalar. The
      // next layer starts from the stream alone (delta zeroed: run() returns zeros after it).
      auto close_layer = [&](const StackLayer& s, size_t l) {
        const BF* on = s.norm(kMlpOutNorm);
        const bool ple = s.ple_gate.present();
        const QLinear& next = l + 1 < layers_.size() ? layers_[l + 1].qkv : layers_[0].qkv;
        auto finish = [&](int64_t m0, int64_t m1) {
          for (int64_t m = m0; m < m1; ++m) {
            BF* r = res + m * hidden;
            if (s.norms[kLayerScalar].defined())
              for (int64_t i = 0; i < hidden; ++i) r[i] = BF(static_cast<float>(r[i]) * s.scalar);
            std::memset(static_cast<void*>(delta + m * hidden), 0, sizeof(BF) * hidden);
          }
        };
        t.rows(M, [&](int64_t m0, int64_t m1) {
          for (int64_t m = m0; m < m1; ++m) {
            if (on) rms_row<BF>(delta + m * hidden, on, delta + m * hidden, hidden, eps);
            if (rscale != 1.f) scale_row(delta + m * hidden);
            add_row<BF>(delta + m * hidden, res + m * hidden, hidden);
          }
          if (ple) s.ple_gate.sums(res, M, m0, m1, xs6.data());
          else finish(m0, m1);
        }, ple ? s.ple_gate : next);
        if (!ple) return;
        t.matmul(s.ple_gate, res, xs6, ple_g, M, &s.ple_proj);
        t.rows(M, [&](int64_t m0, int64_t m1) {
          // act(gate) * the layer's input: PyTorch's operators on this thread's rows, as
          // PerLayerInput runs them.
          const auto o = at::TensorOptions().dtype(at::kBFloat16);
          const int64_t P = ple_, L = num_layers();
          const at::Tensor g = at::from_blob(ple_g + m0 * P, {m1 - m0, P}, o);
          const at::Tensor in = at::from_blob(per_layer_inputs_.data_ptr<BF>() + (m0 * L + l) * P, {m1 - m0, P},
                                              {L * P, 1}, o);
          at::Tensor a = at::from_blob(ple_a + m0 * P, {m1 - m0, P}, o);
          at::mul_out(a, act_ == kSilu ? at::silu(g) : at::gelu(g, act_ == kGeluTanh ? "tanh" : "none"), in);
          s.ple_proj.sums(ple_a, M, m0, m1, xs7.data());
        }, s.ple_proj);
        t.matmul(s.ple_proj, ple_a, xs7, o_out, M, &next);
        t.rows(M, [&](int64_t m0, int64_t m1) {
          for (int64_t m = m0; m < m1; ++m) {
            rms_row<BF>(o_out + m * hidden, s.norm(kPleNorm), o_out + m * hidden, hidden, eps);
            add_row<BF>(o_out + m * hidden, res + m * hidden, hidden);
          }
          finish(m0, m1);
        }, next);
      };
      std::vector<float> head_scratch(4 * dv_max);  // delta_rule::head_out's
      std::vector<float> logits(4 * (moe_e + 1) + hidden);   // moe::route_row's scratch
      std::vector<AttnShare> shares(atts.size());
      for (size_t a = 0; a < atts.size(); ++a) shares[a].plan(*atts[a], t.tid, t.n);
      for (size_t l = 0; l < layers_.size(); ++l) {
        const StackLayer& s = layers_[l];
        StepAttention& att = *atts[s.kind == kAttentionLayer ? s.attention : 0];
        const AttnShare& share = shares[s.kind == kAttentionLayer ? s.attention : 0];
        // (The previous layer's MLP output norm,) residual add, norm, qkv_proj. After the first
        // layer, and a layer that closed the stream itself, the stream alone.
        const bool fresh = l == 0 || layers_[l - 1].closes();
        const BF* prev_out_norm = fresh ? nullptr : layers_[l - 1].norm(kMlpOutNorm);
        t.rows(M, [&](int64_t m0, int64_t m1) {
          const BF* w = s.norm(kInputNorm);
          for (int64_t m = m0; m < m1; ++m) {
            if (prev_out_norm) rms_row<BF>(delta + m * hidden, prev_out_norm, delta + m * hidden, hidden, eps);
            if (!fresh && rscale != 1.f) scale_row(delta + m * hidden);
            if (!pre_norms_) {  // attention reads the residual stream itself
              if (!fresh) add_row<BF>(delta + m * hidden, res + m * hidden, hidden);
              std::memcpy(h1 + m * hidden, res + m * hidden, sizeof(BF) * hidden);
            } else if (layer_norm_) {
              const BF* b = s.norm(kInputNormBias);
              if (!fresh) add_ln_row<BF>(delta + m * hidden, res + m * hidden, w, b, h1 + m * hidden, hidden, eps);
              else ln_row<BF>(res + m * hidden, w, b, h1 + m * hidden, hidden, eps);
            } else if (!fresh) {
              add_rms_row<BF>(delta + m * hidden, res + m * hidden, w, h1 + m * hidden, hidden, eps);
            } else {
              rms_row<BF>(res + m * hidden, w, h1 + m * hidden, hidden, eps);
            }
          }
          s.qkv.sums(h1, M, m0, m1, xs1.data());
          if (s.extra.present()) s.extra.sums(h1, M, m0, m1, xs5.data());
        }, s.qkv);
        shrink_phase(s.lora[kQkv], h1, hidden);
        t.matmul(s.qkv, h1, xs1, qkv_out, M, s.extra.present() ? &s.extra : nullptr,
                 expand(s.lora[kQkv], s.qkv, qkv_out, s.qkv.N));
        // The output gate's pre-activation, or the DeltaNet's b | a.
        if (s.extra.present()) {
          shrink_phase(s.lora[kExtra], h1, hidden);
          t.matmul(s.extra, h1, xs5, extra_out, M, nullptr, expand(s.lora[kExtra], s.extra, extra_out, s.extra.N));
        }
        if (s.kind == kLinearAttentionLayer) {
          // The gated DeltaNet between its projections, as servelm_delta_rule.decode: each
          // row's convolution step and gates (rows split), then each (row, value head)'s
          // delta-rule step and gated norm (items split), then the snapshots.
          BF* cs = s.conv_state.data_ptr<BF>();
          const bool bf16_state = s.ssm_state.scalar_type() == at::kBFloat16;
          char* S = static_cast<char*>(s.ssm_state.data_ptr());
          const int64_t C = s.conv_dim(), H = s.H, N = s.qkv.N, state = H * s.Dk * s.Dv;
          const int64_t es = bf16_state ? 2 : 4;  // the state's element size
          t.rows(M, [&](int64_t m0, int64_t m1) {
            for (int64_t m = m0; m < m1; ++m)
              delta_rule::conv_row<BF>(qkv_out + m * N, cs + st_slot[m] * C * s.K1, st_fresh[m] != 0,
                                       s.conv_weight.data_ptr<BF>(), C, s.K1, s.Hk, s.Dk, extra_out + m * 2 * H,
                                       s.A_log.data(), s.dt_bias.data(), H, lin_a.data() + m * C,
                                       lin_gb.data() + m * 2 * H);
          }, s.o);
          t.guarded([&] {
            const int64_t items = M * H;
            for (int64_t i = items * t.tid / t.n; i < items * (t.tid + 1) / t.n; ++i) {
              const int64_t m = i / H, h = i % H;
              char* st = S + (st_slot[m] * state + h * s.Dk * s.Dv) * es;
              auto out = [&](auto* sp) {
                delta_rule::head_out<BF>(sp, lin_a.data() + m * C, lin_gb.data() + m * 2 * H, h, H, s.Hk, s.Dk,
                                         s.Dv, st_fresh[m] != 0, qkv_out + m * N + C + h * s.Dv,
                                         s.norm_weight.data_ptr<BF>(), eps, attn + m * s.o.K + h * s.Dv,
                                         head_scratch.data());
              };
              if (bf16_state) out(reinterpret_cast<BF*>(st));
              else out(reinterpret_cast<float*>(st));
            }
          });
          t.barrier();
          t.rows(M, [&](int64_t m0, int64_t m1) {
            for (int64_t m = m0; m < m1; ++m)
              if (st_snap[m] >= 0) {  // the state after this token, kept for the prefix cache
                std::memcpy(cs + st_snap[m] * C * s.K1, cs + st_slot[m] * C * s.K1, sizeof(BF) * C * s.K1);
                std::memcpy(S + st_snap[m] * state * es, S + st_slot[m] * state * es, es * state);
              }
            s.o.sums(attn, M, m0, m1, xs2.data());
          }, s.o);
        } else {
        // q/k norms, rotary + KV write, then attention: each thread its items.
        t.rows(M, [&](int64_t m0, int64_t m1) {
          BF* kc = s.k_cache.data_ptr<BF>();
          BF* vc = s.v_cache.data_ptr<BF>();
          const BF* qn = s.norm(kQNorm);
          const BF* kn = s.norm(kKNorm);
          const int64_t D = s.D, KVH = s.kv_shared ? 0 : s.KVH, N = s.qkv.N;
          // A NoPE layer (table 2): no dims turn (rotary_token with R = 0 copies K and V).
          const int64_t tab = s.table == 2 ? 0 : s.table, R = rot_[tab], Rl = s.R;
          for (int64_t m = m0; m < m1; ++m) {
            BF* row = qkv_out + m * N;
            // A K=V layer's values: its keys as projected; each head's v normalised (v_norm).
            BF* v = s.k_eq_v ? kv_vals + m * KVH * D : row + (heads_ + KVH) * D;
            if (s.k_eq_v) std::memcpy(v, row + heads_ * D, sizeof(BF) * KVH * D);
            if (v_norm_)
              for (int64_t h = 0; h < KVH; ++h) rms_row<BF>(v + h * D, ones_.data(), v + h * D, D, eps);
            if (qn && qk_norm_whole_) {  // over all of q, then all of k
              rms_row<BF>(row, qn, row, heads_ * D, eps);
              rms_row<BF>(row + heads_ * D, kn, row + heads_ * D, KVH * D, eps);
            } else if (qn) {
              for (int64_t h = 0; h < heads_; ++h) rms_row<BF>(row + h * D, qn, row + h * D, D, eps);
              for (int64_t h = heads_; h < heads_ + KVH; ++h)
                rms_row<BF>(row + h * D, kn, row + h * D, D, eps);
            }
            // (A KV-shared layer: q turned alone, nothing written.)
            const int64_t slot = slots[s.kv_group * M + m];
            const int64_t off = slot_offset(s.k_cache, slot);  // (V's the same: one layout)
            BF* kd = kc + off;
            BF* vd = vc + off;
            rotary_token<BF>(row, cos_p[tab] + m * R, sin_p[tab] + m * R, kd, vd, heads_, KVH, D, Rl, v);
            if (qscale)  // after the KV write, as the reference scales q alone
              for (int64_t i = 0; i < heads_ * D; ++i) row[i] = BF(static_cast<float>(row[i]) * qscale[m]);
          }
        }, s.o, [&] {
          att.set_caches(PagedKV<BF>(s.k_cache, s.v_cache, group_tables[s.kv_group]));
          att.set_sinks(s.has_sinks ? s.sinks.data() : nullptr);
        });
        t.guarded([&] {
          for (int64_t it = share.i0; it < share.i1; ++it) att.run_item(it);
        });
        t.barrier();
        // o_proj .. down_proj.
        t.rows(M, [&](int64_t m0, int64_t m1) {
          att.finish(static_cast<int>(m0), static_cast<int>(m1));
          if (s.extra.present()) sigmoid_gate_rows(attn, extra_out, m0, m1, s.o.K);
          s.o.sums(attn, M, m0, m1, xs2.data());
        }, s.o);
        }
        shrink_phase(s.lora[kO], attn, s.o.K);
        t.matmul(s.o, attn, xs2, o_out, M, &s.gu, expand(s.lora[kO], s.o, o_out, hidden));
        t.rows(M, [&](int64_t m0, int64_t m1) {
          const BF* w = s.norm(kPostAttentionNorm);
          const BF* on = s.norm(kAttnOutNorm);
          for (int64_t m = m0; m < m1; ++m) {
            if (on) rms_row<BF>(o_out + m * hidden, on, o_out + m * hidden, hidden, eps);
            if (rscale != 1.f) scale_row(o_out + m * hidden);
            if (parallel_) {  // the MLP reads attention's input, or its own norm of the stream
              if (!w) std::memcpy(h2 + m * hidden, h1 + m * hidden, sizeof(BF) * hidden);
              else if (layer_norm_)
                ln_row<BF>(res + m * hidden, w, s.norm(kPostAttentionNormBias), h2 + m * hidden, hidden, eps);
              else rms_row<BF>(res + m * hidden, w, h2 + m * hidden, hidden, eps);
            } else if (layer_norm_) {
              add_ln_row<BF>(o_out + m * hidden, res + m * hidden, w, s.norm(kPostAttentionNormBias),
                             h2 + m * hidden, hidden, eps);
            } else if (pre_norms_) {
              add_rms_row<BF>(o_out + m * hidden, res + m * hidden, w, h2 + m * hidden, hidden, eps);
            } else {  // the MLP reads the residual stream itself
              add_row<BF>(o_out + m * hidden, res + m * hidden, hidden);
              std::memcpy(h2 + m * hidden, res + m * hidden, sizeof(BF) * hidden);
            }
          }
          if (s.mlp_kind == kRoutedExperts) {  // each row's experts, and its row quantised for them
            const StackLayer::Experts& x = s.moe;
            for (int64_t m = m0; m < m1; ++m) {
              moe::route_row(h2 + m * hidden, x.router, hidden, x.route, logits.data(), moe_ids.data() + m * x.route.k,
                             moe_weights.data() + m * x.route.k, x.shared_gate ? shared_logit + m : nullptr);
              x.with([&](const auto& P) { P.quantize(h2 + m * hidden, m, moe_s); });
            }
          } else if (s.mlp_kind == kExpertsBeside) {  // routed on the stream, the experts on its own norm
            const StackLayer::Experts& x = s.moe;
            for (int64_t m = m0; m < m1; ++m) {
              moe::route_row(res + m * hidden, x.router, hidden, x.route, logits.data(), moe_ids.data() + m * x.route.k,
                             moe_weights.data() + m * x.route.k);
              rms_row<BF>(res + m * hidden, s.norm(kMoeInputNorm), h3 + m * hidden, hidden, eps);
              x.with([&](const auto& P) { P.quantize(h3 + m * hidden, m, moe_s); });
            }
          }
          if (s.gu.present()) s.gu.sums(h2, M, m0, m1, xs3.data());
        }, s.gu);
        // The dense MLP (or a MoE layer's shared expert) into out: gate_up, the activation, down.
        auto dense_mlp = [&](BF* out) {
          const int64_t li = plain_mlp_ ? s.gu.N : s.gu.N / 2;  // this MLP's width
          // A gated gate_up writes silu(gate) * up itself, an adapter's delta added before the
          // SiLU: this thread's pairs' gate and up columns' deltas computed ahead of its tiles.
          shrink_phase(s.lora[kGateUp], h2, hidden);
          const bool gu_delta = lora_on && s.gu.gated && s.lora[kGateUp].bound();
          t.matmul(s.gu, h2, xs3, s.gu.gated ? act : gu_out, M, &s.down,
                   expand(s.lora[kGateUp], s.gu, gu_out, s.gu.N), [&] {
                     if (!gu_delta) return;
                     int64_t t0, t1;  // tiles in the packed order: pair q = (gate block q, up block q)
                     s.gu.share(t.tid, t.n, t0, t1);
                     const lora::Adapter<BF>& L = s.lora[kGateUp];
                     for (const int64_t base : {int64_t{0}, li})
                       lora::expand<BF>(L, lora_groups, lora_t.data(), gu_out, s.gu.N, 0, L.blocks(),
                                        base + 8 * t0, base + 8 * t1, lora_d_.data(), 2 * inter);
                   }, gu_delta ? lora_drows.data() : nullptr);
          if (!s.gu.gated || s.down.scratch(M))
            t.rows(M, [&](int64_t m0, int64_t m1) {
              if (!s.gu.gated) {
                if (act_ != kSilu || plain_mlp_) act_rows(gu_out, act, m0, m1, li, act_, plain_mlp_);
                else
                  for (int64_t m = m0; m < m1; ++m)
                    silu_row<BF>(gu_out + m * 2 * li, gu_out + m * 2 * li + li, act + m * li, li);
              }
              s.down.sums(act, M, m0, m1, xs4.data());
            }, s.down);
          shrink_phase(s.lora[kDown], act, li);
          t.matmul(s.down, act, xs4, out, M, l + 1 < layers_.size() ? &layers_[l + 1].qkv : nullptr,
                   expand(s.lora[kDown], s.down, out, hidden));
        };
        if (s.mlp_kind == kRoutedExperts) {
          // The shared expert into shared_out; the routed experts, as servelm_q8act's fused op
          // runs them: each (row, expert) pair's gate_up panels, the activations, then the down
          // panels and the weighted sums into delta, each phase split over the threads; then
          // the shared expert's output added (times sigmoid of its gate's logit), as
          // SparseMoE adds it: PyTorch's operators on each thread's rows.
          const StackLayer::Experts& x = s.moe;
          if (s.gu.present()) dense_mlp(shared_out);
          x.with([&](const auto& L) {  // (the phases throw nothing: no guard around the barriers)
            moe::run_phases(L, moe_ids.data(), moe_weights.data(), M, x.route.k, t.tid, t.n, delta, moe_s,
                            [&] { t.barrier(); });
          });
          if (l + 1 < layers_.size()) layers_[l + 1].qkv.prefetch(t.tid, t.n, Team::kWarm);
          t.barrier();
          if (s.gu.present())
            t.rows(M, [&](int64_t m0, int64_t m1) {
              const auto opts = at::TensorOptions().dtype(at::kBFloat16);
              at::Tensor r = at::from_blob(delta + m0 * hidden, {m1 - m0, hidden}, opts);
              at::Tensor sh = at::from_blob(shared_out + m0 * hidden, {m1 - m0, hidden}, opts);
              if (x.shared_gate)
                at::add_out(r, r, at::mul(at::sigmoid(at::from_blob(shared_logit + m0, {m1 - m0, 1}, opts)), sh));
              else
                at::add_out(r, r, sh);
            }, l + 1 < layers_.size() ? layers_[l + 1].qkv : layers_[0].qkv);
          // (no parallel block: the constructor refuses routed experts in one)
        } else if (s.mlp_kind == kExpertsBeside) {
          // The dense MLP into delta, the experts (on their input, h3) into shared_out; then
          // delta = norm(delta) + norm(experts), as ExpertsBesideMLP sums them.
          const StackLayer::Experts& x = s.moe;
          dense_mlp(delta);
          x.with([&](const auto& L) {
            moe::run_phases(L, moe_ids.data(), moe_weights.data(), M, x.route.k, t.tid, t.n, shared_out, moe_s,
                            [&] { t.barrier(); });
          });
          t.barrier();
          t.rows(M, [&](int64_t m0, int64_t m1) {
            for (int64_t m = m0; m < m1; ++m) {
              rms_row<BF>(delta + m * hidden, s.norm(kMoeMlpNorm), delta + m * hidden, hidden, eps);
              rms_row<BF>(shared_out + m * hidden, s.norm(kMoeOutNorm), shared_out + m * hidden, hidden, eps);
              add_row<BF>(shared_out + m * hidden, delta + m * hidden, hidden);
            }
          }, l + 1 < layers_.size() ? layers_[l + 1].qkv : layers_[0].qkv);
        } else {
          dense_mlp(delta);
          if (parallel_)  // the block's output: attention's plus the MLP's, rounded once
            t.rows(M, [&](int64_t m0, int64_t m1) {
              for (int64_t m = m0; m < m1; ++m) add_row<BF>(o_out + m * hidden, delta + m * hidden, hidden);
            }, l + 1 < layers_.size() ? layers_[l + 1].qkv : layers_[0].qkv);
        }
        if (s.closes()) close_layer(s, l);
      }
      // The last layer's MLP output norm and residual scale (the others' run in the next layer).
      if (!layers_.back().closes() && (final_mlp_norm || rscale != 1.f))
        t.rows(M, [&](int64_t m0, int64_t m1) {
          for (int64_t m = m0; m < m1; ++m) {
            if (final_mlp_norm) rms_row<BF>(delta + m * hidden, final_mlp_norm, delta + m * hidden, hidden, eps);
            if (rscale != 1.f) scale_row(delta + m * hidden);
          }
        }, layers_[0].qkv);
    });
    return out;
  }

  std::vector<at::Tensor> keep_;  // the quantised weights the layers point into
  std::vector<StackLayer> layers_;
  std::vector<AttnKey> attn_keys_;  // the distinct windows and shapes, in the layers' attention order
  int64_t kv_groups_ = 1;         // the block groups the layers read (a step gives each a table)
  double eps_, scale_, embed_scale_, softcap_ = 0.0;
  double residual_scale_ = 1.0;  // each branch's output times this before the residual add (Granite)
  // Queries times 1 + beta ln(1 + floor(position / period)) after the rotary (Ministral 3);
  // beta 0: none. Only run_tokens knows the positions.
  double q_scale_beta_ = 0.0;
  int64_t q_scale_period_ = 0;
  bool pre_norms_ = true;       // false: norms after attention and the MLP alone (OLMo 2, EXAONE 4)
  bool qk_norm_whole_ = false;  // q / k norms over the whole projection, not a head (OLMo 2)
  bool layer_norm_ = false;     // the pre-norms and the final norm are LayerNorms (StableLM, Cohere)
  bool parallel_ = false;       // attention and the MLP read one normed input, outputs summed (Cohere)
  bool plain_mlp_ = false;      // down(act(up(x))), not gated (Starcoder2, Phi, GPT-NeoX)
  bool v_norm_ = false;         // each head's v over its root mean square, no weight (Gemma 4)
  std::vector<c10::BFloat16> ones_ = std::vector<c10::BFloat16>(kMaxD, c10::BFloat16(1.f));  // v_norm's weight
  int64_t ple_ = 0;             // the per-layer inputs' width (0: none)
  at::Tensor per_layer_inputs_;  // set_per_layer_inputs' [M, layers, P] (one run's)
  at::Tensor final_norm_bias_;  // bind_final_norm_bias's (a LayerNorm's; undefined: none)
  int64_t hidden_ = 0;
  int64_t heads_, kv_heads_, act_;
  int64_t rot_[2] = {0, 0};  // the rotary tables' widths: the model's, the sliding layers'
  bool uses_local_ = false;
  at::Tensor embed_, cos_[2], sin_[2], final_norm_;  // bind_io's / bind_local_rotary's
  std::vector<at::Tensor> lora_keep_;  // bind_lora's stacks, which the layers point into
  int64_t lora_slots_ = 0, lora_jp_ = 0;  // S; the largest J * paired_ranks(R) bound (the shrink's
                                          // t [M, J, P2])
  at::Tensor lora_rows_;  // set_lora_rows'; undefined: no row has an adapter
  int64_t attn0_ = 0;     // the first attention layer (its caches: the block size, the head dim)
  bool has_linear_ = false;  // some layer is linear attention (a run needs set_state_rows first)
  std::vector<int64_t> state_slots_, state_fresh_, state_snapshots_;  // set_state_rows'; one run's
  std::vector<float> lora_d_;  // a gated gate_up's deltas for its epilogue (grown, kept)
  bool has_moe_ = false;       // some layer's MLP is routed experts (bind_moe for each)
  std::vector<at::Tensor> moe_keep_;  // bind_moe's tensors, which the layers point into
  moe::Scratch moe_scratch_;   // the routed experts' per-step buffers (grown, kept)
  static constexpr int64_t kMaxRows = 4096;
};

}  // namespace

TORCH_LIBRARY(servelm_stack, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<int64_t>, std::vector<double>>())
      .def("run", &DecodeStack::run)
      .def("run_rotary", &DecodeStack::run_rotary)
      .def("bind_io", &DecodeStack::bind_io)
      .def("bind_local_rotary", &DecodeStack::bind_local_rotary)
      .def("bind_final_norm_bias", &DecodeStack::bind_final_norm_bias)
      .def("bind_lora", &DecodeStack::bind_lora)
      .def("set_lora_rows", &DecodeStack::set_lora_rows)
      .def("bind_linear_attention", &DecodeStack::bind_linear_attention)
      .def("set_state_rows", &DecodeStack::set_state_rows)
      .def("set_per_layer_inputs", &DecodeStack::set_per_layer_inputs)
      .def("bind_moe", &DecodeStack::bind_moe)
      .def("bind_sinks", &DecodeStack::bind_sinks)
      .def("run_tokens", &DecodeStack::run_tokens)
      .def("run_lists", &DecodeStack::run_lists)
      .def("num_layers", &DecodeStack::num_layers)
      .def("max_rows", &DecodeStack::max_rows);
}

#endif  // AVX-512 BF16
