// servelm CPU kernels for the decode hot loop (namespace torch.ops.servelm_ops).
//
//   paged_decode_attention(q [B,H,D], k_cache, v_cache [NB,BS,KVH,D], block_tables int32 [B,MB],
//                          context_lens int32 [B], scale, window=0, k_scale=None, v_scale=None,
//                          chunk=0, softcap=0, sinks=None) -> [B,H,D]
//       One query per sequence over its first context_lens[b] cached tokens (with a window
//       > 0, only the last `window` of them: sliding-window attention; window, chunk,
//       softcap and sinks [H] as AttnOptions in decode_attention.h says), read in place
//       through the block table (no gather). The G = H / KVH query heads of one KV head are
//       processed together, so each K/V row is loaded once; online softmax in fp32. Work is
//       (sequence, KV head, context split), scheduled dynamically over OpenMP threads; long
//       contexts are split when there are fewer (sequence, KV head) pairs than threads want.
//   rms_norm(x [T,N], weight [N], eps) -> [T,N]
//   layer_norm(x [T,N], weight [N], bias [N]?, eps) -> [T,N]; fused_add_layer_norm as below
//   fused_add_rms_norm(x [T,N], residual [T,N] (mutated: residual += x), weight, eps) -> [T,N]
//   rotary_kv_write(qkv [T,(H+2KVH)*D] (q part rotated in place), cos, sin [T,D],
//                   k_cache, v_cache (mutated), slot_mapping int64 [T], H, KVH) -> ()
//   silu_and_mul(x [T,2I]) -> [T,I]
//   argmax_rows(x float32 [M,N]) -> int64 [M]: torch.argmax(x, -1) (first maximum; NaN is largest)
//   lora_add(y [M,N] (mutated), x [M,K], lora_a [S,J*R,K], lora_b [S,ceil(R/2),N,2], row_slots int32 [M],
//            bounds [J+1]) -> ()
//       Each row's LoRA delta (servelm.layers.lora.lora_add_ref): y[m, c] += B[s, c] . (A[s, part
//       j of c] x[m]) for a row of slot s >= 0, in fp32, rounded into y once; rows grouped by slot
//       so each adapter's A and B are read once a call (lora_kernels.h, which the DecodeStack
//       runs too). x, y, A, B all bf16 or all fp32; y may be a view with a row stride.
//   paged_prefill_attention(q [T,H,D], k_cache, v_cache [NB,BS,KVH,D], block_tables int32 [B,MB],
//                           cu_seqlens_q int32 [B+1], start_pos int32 [B], scale,
//                           k_scale=None, v_scale=None, window=0, chunk=0, softcap=0,
//                           sinks=None) -> [T, H*D]
//       Prompt (prefill) attention, flash-style: sequence b's queries are the tokens
//       cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q, at positions start_pos[b], start_pos[b]+1, ...;
//       each attends causally to keys 0..its position (from its window's or chunk's first key:
//       AttnOptions), read in place through the block table
//       (the chunk's own K/V are already in the cache). Online softmax in fp32, the masked upper
//       triangle skipped; bf16 through AVX512-BF16 dot products. Head dim: a multiple of 16, <= 256.
//
// The caches are q's dtype, or int8 (kv_cache_dtype "int8") with fp32 scales k_scale, v_scale
// [NB,BS,KVH], one per token and KV head: the attention ops dequantise the rows they read,
// rotary_kv_write quantises the rows it writes.
//
// Element-wise kernels round where the PyTorch reference rounds (e.g. bf16 RMSNorm output is
// rounded before the weight multiply), so bf16 results stay close to the eager path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "decode_attention.h"
#include "row_kernels.h"
#include "lora_kernels.h"

namespace {

#define SERVELM_DISPATCH(dtype, NAME, ...)                                      \
  [&] {                                                                          \
    if ((dtype) == at::kFloat) { using scalar_t = float; return __VA_ARGS__(); }  \
    if ((dtype) == at::kBFloat16) { using scalar_t = c10::BFloat16; return __VA_ARGS__(); } \
    if ((dtype) == at::kHalf) { using scalar_t = c10::Half; return __VA_ARGS__(); } \
    TORCH_CHECK(false, NAME, ": unsupported dtype ", (dtype));                    \
  }()

using OptTensor = std::optional<at::Tensor>;

// A cache the kernels read: q's dtype without scales, or int8 with both scales, fp32
// contiguous [NB,BS,KVH]. Returns whether it is quantised.
bool check_kv_dtype(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const OptTensor& k_scale, const OptTensor& v_scale, const char* name) {
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), name, ": K and V caches must share a dtype");
  const bool quant = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quant || k_cache.scalar_type() == q.scalar_type(), name,
              ": the caches must be q's dtype or int8 (kv_cache_dtype 'int8'), got ",
              k_cache.scalar_type());
  TORCH_CHECK(quant == (k_scale.has_value() && v_scale.has_value()) &&
                  k_scale.has_value() == v_scale.has_value(),
              name, ": an int8 cache takes k_scale and v_scale, and only an int8 cache does");
  if (quant)
    for (const at::Tensor* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 &&
                      t->size(0) == k_cache.size(0) && t->size(1) == k_cache.size(1) &&
                      t->size(2) == k_cache.size(2) && t->stride(2) == 1 &&
                      t->stride(1) == t->size(2) && t->stride(0) >= t->size(1) * t->size(2) &&
                      t->strides() == k_scale->strides(),
                  name, ": scales must be float32 [NB,BS,KVH] with contiguous blocks, K's and V's alike");
  return quant;
}

template <typename C>
PagedKV<C> paged_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const OptTensor& k_scale,
                    const OptTensor& v_scale) {
  if (k_scale.has_value()) return PagedKV<C>(k_cache, v_cache, block_tables, *k_scale, *v_scale);
  return PagedKV<C>(k_cache, v_cache, block_tables);
}

// The attention ops' AttnOptions from their arguments, checked: sinks (any float dtype, one
// per query head) converted into sink_f, which must outlive the options.
AttnOptions attn_options(int64_t window, int64_t chunk, double softcap, const OptTensor& sinks,
                         int H, at::Tensor& sink_f, const char* name) {
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, name, ": window must be >= 0 (0: no window)");
  TORCH_CHECK(chunk >= 0 && chunk <= INT32_MAX, name, ": chunk must be >= 0 (0: no chunks)");
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), name, ": softcap must be >= 0 (0: none)");
  AttnOptions opt;
  opt.window = static_cast<int>(window);
  opt.chunk = static_cast<int>(chunk);
  opt.softcap = static_cast<float>(softcap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == H && at::isFloatingType(sinks->scalar_type()), name,
                ": sinks must hold one float per query head (", H, "), got ", sinks->sizes());
    sink_f = sinks->to(at::kFloat).contiguous();
    opt.sinks = sink_f.data_ptr<float>();
  }
  return opt;
}

template <typename T, int DT, typename C = T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, const AttnOptions& opt,
                           at::Tensor& out, const OptTensor& k_scale, const OptTensor& v_scale) {
  const PagedKV<C> kv = paged_kv<C>(k_cache, v_cache, block_tables, k_scale, v_scale);
  const int B = q.size(0);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  check_context_lens(lens, B, kv.MB, kv.bs, "paged_decode_attention");
  const int nthreads = std::max(1, at::get_num_threads());
  DecodeAttention<T, DT, C> att(q.data_ptr<T>(), q.stride(0), q.stride(1), B, q.size(1), q.size(2), kv,
                             lens, static_cast<float>(scale), nthreads, out.data_ptr<T>(), opt);
  const int64_t items = att.items();
  // Tiny problems (one short sequence) run on the calling thread: a parallel region would
  // cost more than the work, and much more when other processes hold the cores.
  if (items == 1 || nthreads == 1 || att.work() < 1024) {
    for (int64_t it = 0; it < items; ++it) att.run_item(it);
  } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t it = 0; it < items; ++it) att.run_item(it);
  }
  att.finish(0, B);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window,
                                  const OptTensor& k_scale, const OptTensor& v_scale, int64_t chunk,
                                  double softcap, const OptTensor& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode_attention: q must be [B,H,D], last dim contiguous");
  check_paged_caches(k_cache, v_cache, "paged_decode_attention");
  const bool quant = check_kv_dtype(q, k_cache, v_cache, k_scale, v_scale, "paged_decode_attention");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == q.size(0),
              "paged_decode_attention: block_tables must be contiguous int32 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "paged_decode_attention: context_lens must be contiguous int32 [B]");
  const int H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && H / KVH <= kMaxG && D <= kMaxD,
              "paged_decode_attention: unsupported head layout");
  at::Tensor sink_f;
  const AttnOptions opt = attn_options(window, chunk, softcap, sinks, H, sink_f, "paged_decode_attention");
  auto out = at::empty({q.size(0), H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.size(0) == 0) return out;
  SERVELM_DISPATCH(q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto c) {
      using C = decltype(c);
      // Head dims of the families served (Gemma 2/3: 256; Gemma 4's global heads: 512;
      // DeepSeek's latent rows: 576) compiled for their width; others run the any-width path.
      auto impl = [&](auto dt) {
        decode_attention_impl<scalar_t, decltype(dt)::value, C>(q, k_cache, v_cache, block_tables,
                                                                context_lens, scale, opt, out, k_scale, v_scale);
      };
      if (D == 64) impl(std::integral_constant<int, 64>{});
      else if (D == 128) impl(std::integral_constant<int, 128>{});
      else if (D == 256) impl(std::integral_constant<int, 256>{});
      else if (D == 512) impl(std::integral_constant<int, 512>{});
      else if (D == 576) impl(std::integral_constant<int, 576>{});
      else impl(std::integral_constant<int, 0>{});
    };
    if (quant) run(int8_t{});
    else run(scalar_t{});
  });
  return out;
}

// ---- RMSNorm -------------------------------------------------------------------------------

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [T,N] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": weight must be contiguous [N] of x's dtype");
}

// y [T, N] from x's rows, split over threads ~32K elements a task: rows(yp, t0, t1) fills rows
// [t0, t1) of y (yp: y's data as x's scalar type); a row's result does not depend on the thread.
template <typename Rows>
at::Tensor norm_rows(const at::Tensor& x, const char* name, const Rows& rows) {
  auto y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t T_ = x.size(0), N = x.size(1);
  SERVELM_DISPATCH(x.scalar_type(), name, [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T_, std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1)),
                     [&](int64_t t0, int64_t t1) { rows(yp, t0, t1); });
  });
  return y;
}

void check_residual(const at::Tensor& x, const at::Tensor& residual, const char* name) {
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              name, ": residual must be contiguous, shaped and typed like x");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  const int64_t N = x.size(1), xs = x.stride(0);
  return norm_rows(x, "rms_norm", [&](auto* yp, int64_t t0, int64_t t1) {
    using T = std::remove_pointer_t<decltype(yp)>;
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    for (int64_t t = t0; t < t1; ++t) rms_row<T>(xp + t * xs, wp, yp + t * N, N, (float)eps);
  });
}

at::Tensor fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                              double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  check_residual(x, residual, "fused_add_rms_norm");
  const int64_t N = x.size(1), xs = x.stride(0);
  return norm_rows(x, "fused_add_rms_norm", [&](auto* yp, int64_t t0, int64_t t1) {
    using T = std::remove_pointer_t<decltype(yp)>;
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    for (int64_t t = t0; t < t1; ++t) add_rms_row<T>(xp + t * xs, rp + t * N, wp, yp + t * N, N, (float)eps);
  });
}

// ---- LayerNorm --------------------------------------------------------------------------------

void check_ln_bias(const at::Tensor& x, const OptTensor& bias, const char* name) {
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->numel() == x.size(1) && bias->is_contiguous() &&
                        bias->scalar_type() == x.scalar_type()),
              name, ": bias must be contiguous [N] of x's dtype");
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, double eps) {
  check_rows(x, weight, "layer_norm");
  check_ln_bias(x, bias, "layer_norm");
  const int64_t N = x.size(1), xs = x.stride(0);
  return norm_rows(x, "layer_norm", [&](auto* yp, int64_t t0, int64_t t1) {
    using T = std::remove_pointer_t<decltype(yp)>;
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    const T* bp = bias ? bias->data_ptr<T>() : nullptr;
    for (int64_t t = t0; t < t1; ++t) ln_row<T>(xp + t * xs, wp, bp, yp + t * N, N, (float)eps);
  });
}

at::Tensor fused_add_layer_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                                const OptTensor& bias, double eps) {
  check_rows(x, weight, "fused_add_layer_norm");
  check_ln_bias(x, bias, "fused_add_layer_norm");
  check_residual(x, residual, "fused_add_layer_norm");
  const int64_t N = x.size(1), xs = x.stride(0);
  return norm_rows(x, "fused_add_layer_norm", [&](auto* yp, int64_t t0, int64_t t1) {
    using T = std::remove_pointer_t<decltype(yp)>;
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    const T* bp = bias ? bias->data_ptr<T>() : nullptr;
    T* rp = residual.data_ptr<T>();
    for (int64_t t = t0; t < t1; ++t) add_ln_row<T>(xp + t * xs, rp + t * N, wp, bp, yp + t * N, N, (float)eps);
  });
}

// ---- rotary + KV cache write ------------------------------------------------------------------

void rotary_kv_write(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                     int64_t num_heads, int64_t num_kv_heads, const OptTensor& k_scale,
                     const OptTensor& v_scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rotary_kv_write: qkv must be [T, W] with contiguous rows");
  check_paged_caches(k_cache, v_cache, "rotary_kv_write");
  const int64_t T_ = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "rotary_kv_write: qkv width does not match the heads");
  TORCH_CHECK(D % 2 == 0, "rotary_kv_write: odd head dim");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T_ && cos.size(1) == D && cos.is_contiguous() &&
                  sin.is_contiguous() && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rotary_kv_write: cos/sin must be contiguous [T, D] of qkv's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == T_,
              "rotary_kv_write: slot_mapping must be contiguous int64 [T]");
  const bool quant = check_kv_dtype(qkv, k_cache, v_cache, k_scale, v_scale, "rotary_kv_write");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  check_slots(slots, T_, k_cache.size(0) * k_cache.size(1), "rotary_kv_write");
  const int64_t H = num_heads, KVH = num_kv_heads, rs = qkv.stride(0);
  SERVELM_DISPATCH(qkv.scalar_type(), "rotary_kv_write", [&] {
    scalar_t* qp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    if (quant) {  // K and V rows quantised per KV head as they are written
      int8_t* kc = k_cache.data_ptr<int8_t>();
      int8_t* vc = v_cache.data_ptr<int8_t>();
      float* ks = k_scale->data_ptr<float>();
      float* vs = v_scale->data_ptr<float>();
      at::parallel_for(0, T_, 16, [&](int64_t a, int64_t b) {
        std::vector<scalar_t> tmp(2 * KVH * D);
        for (int64_t t = a; t < b; ++t) {
          const int64_t off = slot_offset(k_cache, slots[t]), soff = slot_offset(*k_scale, slots[t]);
          rotary_token_i8<scalar_t>(qp + t * rs, cp + t * D, sp + t * D, kc + off, vc + off, ks + soff,
                                    vs + soff, H, KVH, D, tmp.data());
        }
      });
      return;
    }
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, T_, 16, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) {
        const int64_t off = slot_offset(k_cache, slots[t]);
        rotary_token<scalar_t>(qp + t * rs, cp + t * D, sp + t * D, kc + off, vc + off, H, KVH, D);
      }
    });
  });
}

// ---- SiLU and mul -------------------------------------------------------------------------------

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [T, 2I] with contiguous rows");
  const int64_t T_ = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  auto y = at::empty({T_, I}, x.options().memory_format(at::MemoryFormat::Contiguous));
  SERVELM_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T_, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) silu_row<scalar_t>(xp + t * xs, xp + t * xs + I, yp + t * I, I);
    });
  });
  return y;
}

// ---- bf16 / fp16 / fp32 vector stores --------------------------------------------------------

#ifdef __AVX512F__
template <typename T> inline void store16_mask(T* p, __m512 v, __mmask16 k);
template <> inline void store16_mask<float>(float* p, __m512 v, __mmask16 k) {
  _mm512_mask_storeu_ps(p, k, v);
}
template <> inline void store16_mask<c10::BFloat16>(c10::BFloat16* p, __m512 v, __mmask16 k) {
  // Round to nearest even, as c10::BFloat16's conversion does (finite inputs).
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
template <> inline void store16_mask<c10::Half>(c10::Half* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// ---- prompt (prefill) attention: flash-style, K/V read through the block tables -----------------
//
// Work item = (sequence, KV head, block of up to kItemQ queries): the G query heads of the KV
// head over those queries, as G * ceil(n / 16) "query tiles" of 16 consecutive queries. Items
// run largest first (later blocks see more keys) over OpenMP threads. Queries sit
// in the 16 fp32 lanes, so the online softmax (max, exp, sum, rescale) is all vertical. Keys
// are walked in chunks of kChunkK (only up to the item's last position: the masked upper
// triangle is skipped); each chunk of the KV head is copied from its scattered blocks into a
// contiguous buffer once and reused by every query tile of the item:
//   scores   S^T[key] (16 lanes) += Qpacked[d] * broadcast(K[key][d])   (16 keys per pass)
//   softmax  per lane, online over chunks; masked keys (key pos > query pos) get p = 0
//   output   O^T[d]   (16 lanes) += P^T[key] * broadcast(V[key][d])     (16 d per pass)
// bf16 with AVX512-BF16: q and K as bf16 pairs (two dims per dword) through vdpbf16ps; p is
// rounded to bf16 (as a bf16 matmul with V would) and V is packed as key pairs (V[2j][d],
// V[2j+1][d]) so P.V is vdpbf16ps too; softmax state and accumulators stay fp32. fp32 (and
// fp16 / bf16 without AVX512-BF16, converted to fp32 when packed) use fp32 FMAs.

constexpr int kItemQ = 64;    // most queries per work item (a multiple of 16)
constexpr int kChunkK = 128;  // keys per packed K/V chunk (a multiple of 16)

struct PrefillTile {  // one query head x 16 queries
  float* o;           // [D][16] unnormalised output, transposed
  float m[16], l[16];
  int32_t pos[16];    // absolute query positions (padding lanes repeat the last one)
  int32_t lo[16];     // the first key each query sees (AttnOptions::first_key)
  int pos_min, pos_max, lo_min, lo_max;
  void* q;            // packed query: [D/2][16] bf16 pairs (dp) or [D][16] fp32
};

#ifdef __AVX512F__
// Online-softmax update of one tile over nk scores S^T[0..nk) (fp32, pre-scaled by
// scale * log2(e), masked ones at kNegBig): returns alpha, writes p = 2^(s - m) back into s
// (masked -> 0), or, with kPairs, p rounded to bf16 as key pairs into `pairs`.
template <bool kPairs>
inline __m512 prefill_softmax(float* s, uint32_t* pairs, int nk, int key0, PrefillTile& t, __m512 mx) {
  const __m512 mold = _mm512_loadu_ps(t.m);
  const __m512 mnew = _mm512_max_ps(mold, mx);
  constexpr int kDeg = kPairs ? 4 : 5;
  const __m512 alpha = exp2_512<kDeg>(_mm512_sub_ps(mold, mnew));
  __m512 sum = _mm512_setzero_ps();
  const __m512i qp = _mm512_loadu_si512(t.pos), lo = _mm512_loadu_si512(t.lo);
  // Keys [ulo, uhi) of the tile every lane sees.
  const int ulo = std::max(0, t.lo_max - key0), uhi = std::max(0, std::min(nk, t.pos_min - key0 + 1));
  auto prob = [&](int j) {
    const __m512 p = exp2_512<kDeg>(_mm512_sub_ps(_mm512_load_ps(s + j * 16), mnew));
    if (j >= ulo && j < uhi) return p;
    const __m512i key = _mm512_set1_epi32(key0 + j);
    return _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(key, qp) & _mm512_cmpge_epi32_mask(key, lo), p);
  };
  if constexpr (kPairs) {
#if defined(__AVX512BF16__)
    // p rounded to bf16 as key pairs: lane i of dword j/2 = (p[j][i], p[j+1][i]).
    const __m512i perm = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int j = 0; j < nk; j += 2) {
      const __m512 p0 = prob(j), p1 = prob(j + 1);
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      const __m512bh pr = _mm512_cvtne2ps_pbh(p1, p0);
      _mm512_store_si512(pairs + (j / 2) * 16, _mm512_permutexvar_epi16(perm, (__m512i)pr));
    }
#endif
  } else {
    for (int j = 0; j < nk; ++j) {
      const __m512 p = prob(j);
      _mm512_store_ps(s + j * 16, p);
      sum = _mm512_add_ps(sum, p);
    }
  }
  _mm512_storeu_ps(t.m, mnew);
  _mm512_storeu_ps(t.l, _mm512_fmadd_ps(_mm512_loadu_ps(t.l), alpha, sum));
  return alpha;
}

// Scores of 16 keys (rows of kc, D each) for one tile, scaled, masked; into s[16][16].
template <bool kDp, int DT>
inline __m512 prefill_scores16(const void* qpk, const void* kc, int d_rt, float scale, float cap,
                               int key0, const PrefillTile& t, float* s) {
  const int D = DT ? DT : d_rt;
  // Every loop over a[] unrolled, so the 16 sums live in registers: a rolled one would have
  // them indexed in memory, and the compiler then stores each sum back after every update.
  __m512 a[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (kDp) {
    const uint32_t* qp = static_cast<const uint32_t*>(qpk);
    const int32_t* k = static_cast<const int32_t*>(kc);  // bf16 pairs
    const int D2 = D / 2;
    for (int p = 0; p < D2; ++p) {
      const __m512bh qv = (__m512bh)_mm512_load_si512(qp + p * 16);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
        a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_set1_epi32(k[j * D2 + p]));
    }
  }
#endif
  if constexpr (!kDp) {
    const float* qp = static_cast<const float*>(qpk);
    const float* k = static_cast<const float*>(kc);
    for (int d = 0; d < D; ++d) {
      const __m512 qv = _mm512_load_ps(qp + d * 16);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(k[j * D + d]), a[j]);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(kNegBig);
  const bool masked = key0 + 15 > t.pos_min || key0 < t.lo_max;
  const __m512i qp = _mm512_loadu_si512(t.pos), lo = _mm512_loadu_si512(t.lo);
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    __m512 x = _mm512_mul_ps(a[j], sv);
    if (cap > 0.f) x = softcap512(x, cap);
    if (masked) {
      const __m512i key = _mm512_set1_epi32(key0 + j);
      const __mmask16 drop = _mm512_cmpgt_epi32_mask(key, qp) | _mm512_cmplt_epi32_mask(key, lo);
      x = _mm512_mask_mov_ps(x, drop, _mm512_set1_ps(kNegBig));
    }
    mx = _mm512_max_ps(mx, x);
    _mm512_store_ps(s + j * 16, x);
  }
  return mx;
}

// O^T (D x 16 lanes) = alpha * O^T + P . V over nk keys. dp: pk = bf16 key pairs of p
// ([nk/2][16] dwords), vc = [nk/2][D] dwords (V[2j][d], V[2j+1][d]); else pk = p fp32
// [nk][16], vc = [nk][D] fp32.
template <bool kDp, int DT>
inline void prefill_pv(float* o, __m512 alpha, bool rescale, const void* pk, const void* vc,
                       int nk, int d_rt) {
  const int D = DT ? DT : d_rt;
  for (int c = 0; c < D; c += 16) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) {
      a[i] = _mm512_load_ps(o + (c + i) * 16);
      if (rescale) a[i] = _mm512_mul_ps(a[i], alpha);
    }
#if defined(__AVX512BF16__)
    if constexpr (kDp) {
      const uint32_t* x = static_cast<const uint32_t*>(pk);
      const int32_t* v = static_cast<const int32_t*>(vc);
      for (int jp = 0, n2 = (nk + 1) / 2; jp < n2; ++jp) {
        const __m512bh xv = (__m512bh)_mm512_load_si512(x + jp * 16);
        const int32_t* vr = v + jp * D + c;
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          a[i] = _mm512_dpbf16_ps(a[i], xv, (__m512bh)_mm512_set1_epi32(vr[i]));
      }
    }
#endif
    if constexpr (!kDp) {
      const float* p = static_cast<const float*>(pk);
      const float* v = static_cast<const float*>(vc);
      for (int j = 0; j < nk; ++j) {
        const __m512 pv = _mm512_load_ps(p + j * 16);
        const float* vr = v + j * D + c;
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(pv, _mm512_set1_ps(vr[i]), a[i]);
      }
    }
    for (int i = 0; i < 16; ++i) _mm512_store_ps(o + (c + i) * 16, a[i]);
  }
}
#endif  // __AVX512F__

#ifndef __AVX512F__
// Portable version (no AVX-512): the same layouts, fp32 only.
inline void prefill_scores16_ref(const float* qp, const float* k, int D, float scale, float cap,
                                 int key0, const PrefillTile& t, float* s, float* mx) {
  for (int i = 0; i < 16; ++i) mx[i] = kNegBig;
  for (int j = 0; j < 16; ++j) {
    float a[16] = {0};
    for (int d = 0; d < D; ++d)
      for (int i = 0; i < 16; ++i) a[i] += qp[d * 16 + i] * k[j * D + d];
    for (int i = 0; i < 16; ++i) {
      float x = a[i] * scale;
      if (cap > 0.f) x = cap * std::tanh(x / cap);
      if (key0 + j > t.pos[i] || key0 + j < t.lo[i]) x = kNegBig;
      s[j * 16 + i] = x;
      mx[i] = std::max(mx[i], x);
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 version of the fp32 path: a tile's 16 query lanes are two 8-lane vectors (lo, hi).
// Scores are pre-scaled by scale * log2(e) so the softmax is exp2 (exp2_256).

// Keeps v in a register: GCC (-march=znver3) otherwise folded the loads of a vector used by
// 4 FMAs into each of them, 12 loads per 8 FMAs, more than the load ports take.
inline void pin(__m256& v) { asm("" : "+x"(v)); }

// In-register transpose of 8 rows of 8 floats (r[i] lane j -> r[j] lane i).
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Scores of 16 keys (rows of k, D each) for one tile, scaled, masked; into s[16][16];
// folds their maxima into mx[2]. Keys go 4 at a time: 8 accumulators cover the FMA latency.
inline void prefill_scores16_avx2(const float* qp, const float* k, int D, float scale, float cap,
                                  int key0, const PrefillTile& t, float* s, __m256* mx) {
  const __m256 sv = _mm256_set1_ps(scale), neg = _mm256_set1_ps(kNegBig);
  const bool masked = key0 + 15 > t.pos_min || key0 < t.lo_max;
  const __m256i pos0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.pos));
  const __m256i pos1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.pos + 8));
  const __m256i lo0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.lo));
  const __m256i lo1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.lo + 8));
  for (int j0 = 0; j0 < 16; j0 += 4) {
    __m256 a[4][2];  // every loop over it unrolled: the sums stay in registers
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
    const float* kj = k + j0 * D;
    for (int d = 0; d < D; ++d) {
      __m256 q0 = _mm256_load_ps(qp + d * 16), q1 = _mm256_load_ps(qp + d * 16 + 8);
      pin(q0), pin(q1);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 kv = _mm256_broadcast_ss(kj + j * D + d);
        a[j][0] = _mm256_fmadd_ps(q0, kv, a[j][0]);
        a[j][1] = _mm256_fmadd_ps(q1, kv, a[j][1]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256 x0 = _mm256_mul_ps(a[j][0], sv), x1 = _mm256_mul_ps(a[j][1], sv);
      if (cap > 0.f) x0 = softcap256(x0, cap), x1 = softcap256(x1, cap);
      if (masked) {
        const __m256i key = _mm256_set1_epi32(key0 + j0 + j);
        x0 = _mm256_blendv_ps(x0, neg, _mm256_castsi256_ps(_mm256_or_si256(
            _mm256_cmpgt_epi32(key, pos0), _mm256_cmpgt_epi32(lo0, key))));
        x1 = _mm256_blendv_ps(x1, neg, _mm256_castsi256_ps(_mm256_or_si256(
            _mm256_cmpgt_epi32(key, pos1), _mm256_cmpgt_epi32(lo1, key))));
      }
      mx[0] = _mm256_max_ps(mx[0], x0);
      mx[1] = _mm256_max_ps(mx[1], x1);
      _mm256_store_ps(s + (j0 + j) * 16, x0);
      _mm256_store_ps(s + (j0 + j) * 16 + 8, x1);
    }
  }
}

// Online-softmax update of one tile over nk scores (see prefill_softmax): p = 2^(s - m)
// written back into s (masked -> 0); alpha into al[2].
inline void prefill_softmax_avx2(float* s, int nk, int key0, PrefillTile& t, const __m256* mx, __m256* al) {
  const __m256i pos0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.pos));
  const __m256i pos1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.pos + 8));
  const __m256 mold0 = _mm256_loadu_ps(t.m), mold1 = _mm256_loadu_ps(t.m + 8);
  const __m256 m0 = _mm256_max_ps(mold0, mx[0]), m1 = _mm256_max_ps(mold1, mx[1]);
  al[0] = exp2_256(_mm256_sub_ps(mold0, m0));
  al[1] = exp2_256(_mm256_sub_ps(mold1, m1));
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  const __m256i lo0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.lo));
  const __m256i lo1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.lo + 8));
  // Keys [ulo, uhi) of the tile every lane sees.
  const int ulo = std::max(0, t.lo_max - key0), uhi = std::max(0, std::min(nk, t.pos_min - key0 + 1));
  for (int j = 0; j < nk; ++j) {
    __m256 p0 = exp2_256(_mm256_sub_ps(_mm256_load_ps(s + j * 16), m0));
    __m256 p1 = exp2_256(_mm256_sub_ps(_mm256_load_ps(s + j * 16 + 8), m1));
    if (j < ulo || j >= uhi) {
      const __m256i key = _mm256_set1_epi32(key0 + j);
      p0 = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_or_si256(
          _mm256_cmpgt_epi32(key, pos0), _mm256_cmpgt_epi32(lo0, key))), p0);
      p1 = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_or_si256(
          _mm256_cmpgt_epi32(key, pos1), _mm256_cmpgt_epi32(lo1, key))), p1);
    }
    _mm256_store_ps(s + j * 16, p0);
    _mm256_store_ps(s + j * 16 + 8, p1);
    sum0 = _mm256_add_ps(sum0, p0);
    sum1 = _mm256_add_ps(sum1, p1);
  }
  _mm256_storeu_ps(t.m, m0);
  _mm256_storeu_ps(t.m + 8, m1);
  _mm256_storeu_ps(t.l, _mm256_fmadd_ps(_mm256_loadu_ps(t.l), al[0], sum0));
  _mm256_storeu_ps(t.l + 8, _mm256_fmadd_ps(_mm256_loadu_ps(t.l + 8), al[1], sum1));
}

// O^T (D x 16 lanes) = alpha * O^T + P . V over nk keys (p fp32 [nk][16], v fp32 [nk][D]),
// 4 dims at a time: 8 accumulators in registers over every key.
inline void prefill_pv_avx2(float* o, const __m256* al, bool rescale, const float* p, const float* v,
                            int nk, int D) {
  for (int c = 0; c < D; c += 4) {
    __m256 a[4][2];  // every loop over it unrolled: the sums stay in registers
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      a[i][0] = _mm256_load_ps(o + (c + i) * 16);
      a[i][1] = _mm256_load_ps(o + (c + i) * 16 + 8);
      if (rescale) a[i][0] = _mm256_mul_ps(a[i][0], al[0]), a[i][1] = _mm256_mul_ps(a[i][1], al[1]);
    }
    for (int j = 0; j < nk; ++j) {
      __m256 p0 = _mm256_load_ps(p + j * 16), p1 = _mm256_load_ps(p + j * 16 + 8);
      pin(p0), pin(p1);
      const float* vr = v + j * D + c;
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256 vb = _mm256_broadcast_ss(vr + i);
        a[i][0] = _mm256_fmadd_ps(p0, vb, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(p1, vb, a[i][1]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      _mm256_store_ps(o + (c + i) * 16, a[i][0]);
      _mm256_store_ps(o + (c + i) * 16 + 8, a[i][1]);
    }
  }
}
#endif

// C: the cache's element type (T, or int8_t with scales: dequantised as each chunk is packed
// into the fp32 buffers, so kDp, which packs bf16 rows as they are, needs C = T).
template <typename T, bool kDp, int DT, typename C = T>
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& cu_q,
                            const at::Tensor& start_pos, double scale, const AttnOptions& opt,
                            at::Tensor& out, const OptTensor& k_scale = {},
                            const OptTensor& v_scale = {}) {
  static_assert(!kDp || std::is_same<C, T>::value, "bf16 pairs are packed from bf16 caches");
  const PagedKV<C> kv = paged_kv<C>(k_cache, v_cache, block_tables, k_scale, v_scale);
  const int H = q.size(1), D = DT ? DT : q.size(2);
  const int KVH = kv.kv_heads;
  const int G = H / KVH;
  const int B = start_pos.numel();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const T* qptr = q.data_ptr<T>();
  const int32_t* cu = cu_q.data_ptr<int32_t>();
  const int32_t* sp = start_pos.data_ptr<int32_t>();
  T* optr = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  // Scores, maxima and the soft-cap in log2 units (scale * log2 e: the softmax is exp2).
  constexpr float kUnit = kLog2e;
#else
  constexpr float kUnit = 1.f;
#endif
  const float cap = opt.softcap * kUnit;
  // Packed element: a bf16 pair (dp) or one fp32 value per dword.
  const int DQ = kDp ? D / 2 : D;  // dwords per packed q / K row

  struct Item { int b, h, q0, q1; int64_t cost; };
  std::vector<Item> items;
  int64_t work = 0;
  const int nthreads = std::max(1, at::get_num_threads());
  // Larger items share each packed K/V chunk among more queries; smaller ones keep every
  // thread busy: halve the item size while there are fewer than 4 items per thread.
  int iq = kItemQ;
  for (;;) {
    int64_t count = 0;
    for (int b = 0; b < B; ++b) count += (cu[b + 1] - cu[b] + iq - 1) / iq;
    if (iq <= 16 || count * KVH >= 4 * nthreads) break;
    iq /= 2;
  }
  check_prefill_tables(kv, cu, sp, B, "paged_prefill_attention");
  for (int b = 0; b < B; ++b) {
    const int n = cu[b + 1] - cu[b];
    for (int q0 = 0; q0 < n; q0 += iq) {
      const int q1 = std::min(n, q0 + iq);
      // Queries times the keys the middle one sees (a window or chunk: from its first key).
      const int mid = sp[b] + (q0 + q1) / 2;
      const int64_t cost = static_cast<int64_t>(q1 - q0) * (mid + 1 - opt.first_key(mid));
      for (int h = 0; h < KVH; ++h) items.push_back({b, h, q0, q1, cost});
      work += cost * KVH * G;
    }
  }
  // Largest first (later query blocks see more keys): dynamic scheduling then balances.
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });

  auto run_item = [&](const Item& it) {
    const int b = it.b, h = it.h, start = sp[b];
    const int nq = it.q1 - it.q0, ntile = (nq + 15) / 16, nt = G * ntile;
    const int kend = start + it.q1;  // keys [kbeg, kend)
    const int kbeg = opt.first_key(start + it.q0);
    const int32_t* table = kv.table(b);
    // One allocation: tiles' o and q, K chunk, V chunk, scores, bf16 pairs of p.
    const size_t o_sz = static_cast<size_t>(D) * 16, q_sz = static_cast<size_t>(DQ) * 16;
    const size_t k_sz = static_cast<size_t>(kChunkK) * DQ;
    const size_t v_sz = static_cast<size_t>(kDp ? kChunkK / 2 : kChunkK) * D;
    const size_t s_sz = static_cast<size_t>(kChunkK) * 16, x_sz = s_sz / 2;
    // Per-thread scratch, kept between items and calls (no allocation or zeroing per item).
    static thread_local std::unique_ptr<float[]> mem;
    static thread_local size_t mem_size = 0;
    const size_t need = nt * (o_sz + q_sz) + k_sz + v_sz + s_sz + x_sz + 16;
    if (mem_size < need) {
      mem.reset(new float[need]);
      mem_size = need;
    }
    float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(mem.get()) + 63) & ~uintptr_t(63));
    std::vector<PrefillTile> tiles(nt);
    float* kbuf = base + nt * (o_sz + q_sz);
    float* vbuf = kbuf + k_sz;
    float* sbuf = vbuf + v_sz;
    [[maybe_unused]] float* xbuf = sbuf + s_sz;
    for (int g = 0; g < G; ++g) {
      const int hq = h * G + g;
      for (int tt = 0; tt < ntile; ++tt) {
        PrefillTile& t = tiles[g * ntile + tt];
        t.o = base + (g * ntile + tt) * (o_sz + q_sz);
        t.q = t.o + o_sz;
        std::fill(t.o, t.o + o_sz, 0.f);
        const int r0 = it.q0 + tt * 16, rn = std::min(16, it.q1 - r0);
        t.pos_min = start + r0;
        t.pos_max = start + r0 + rn - 1;
        t.lo_min = opt.first_key(t.pos_min);  // first_key grows with the position
        t.lo_max = opt.first_key(t.pos_max);
        for (int i = 0; i < 16; ++i) {
          t.m[i] = kNegBig;
          t.l[i] = 0.f;
          t.pos[i] = start + r0 + std::min(i, rn - 1);
          t.lo[i] = opt.first_key(t.pos[i]);
        }
        const T* qrow0 = qptr + static_cast<int64_t>(cu[b] + r0) * qs0 + static_cast<int64_t>(hq) * qs1;
#ifdef __AVX512F__
        // Transposed 16 x 16 dword blocks: dword p of query row i -> qp[p * 16 + i].
        // (D is a multiple of 16: with bf16 pairs, DQ = D / 2 may end in a half block.)
        for (int p0 = 0; p0 < DQ; p0 += 16) {
          const int np = std::min(16, DQ - p0);
          __m512i r[16];
          for (int i = 0; i < 16; ++i) {
            const T* src = qrow0 + i * qs0;
            if (i >= rn) r[i] = _mm512_setzero_si512();
            else if constexpr (kDp) r[i] = _mm512_maskz_loadu_epi32(__mmask16((1u << np) - 1), src + 2 * p0);
            else r[i] = _mm512_castps_si512(load16<T>(src + p0));
          }
          transpose16x16(r);
          uint32_t* qp = static_cast<uint32_t*>(t.q);
          for (int i = 0; i < np; ++i) _mm512_store_si512(qp + (p0 + i) * 16, r[i]);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        // Transposed 8 x 8 blocks: element d of query row i -> qp[d * 16 + i] (D % 16 == 0).
        float* qp = static_cast<float*>(t.q);
        for (int i0 = 0; i0 < 16; i0 += 8)
          for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i)
              r[i] = i0 + i < rn ? load8f<T>(qrow0 + (i0 + i) * qs0 + d0) : _mm256_setzero_ps();
            transpose8(r);
            for (int k = 0; k < 8; ++k) _mm256_store_ps(qp + (d0 + k) * 16 + i0, r[k]);
          }
#else
        float* qp = static_cast<float*>(t.q);
        for (int i = 0; i < 16; ++i)
          for (int d = 0; d < D; ++d) qp[d * 16 + i] = i < rn ? to_f<T>(qrow0[i * qs0 + d]) : 0.f;
#endif
      }
    }
    const int64_t head_off = static_cast<int64_t>(h) * D;
    auto row = [&](const C* cache, int key) { return cache + kv.offset(table, key) + head_off; };
    for (int c0 = kbeg; c0 < kend; c0 += kChunkK) {
      const int n = std::min(kChunkK, kend - c0);
      const int npad = (n + 15) / 16 * 16;
      // Pack the chunk of this KV head (zero rows past n: their p is 0, 0 * V must be 0).
      if constexpr (kDp) {
#if defined(__AVX512BF16__)
        // K rows as they are (bf16 pairs); V as key pairs: dword d of pair j/2 = (V[j][d], V[j+1][d]).
        alignas(64) static const T zero_row[kMaxD] = {};
        uint16_t* kb = reinterpret_cast<uint16_t*>(kbuf);
        uint32_t* vb = reinterpret_cast<uint32_t*>(vbuf);
        for (int j = 0; j < npad; ++j) {
          if (j < n) std::memcpy(kb + j * D, row(kv.k, c0 + j), sizeof(T) * D);
          else std::memset(kb + j * D, 0, sizeof(T) * D);
        }
        for (int j = 0; j < npad; j += 2) {
          const __m256i* r0 = reinterpret_cast<const __m256i*>(j < n ? row(kv.v, c0 + j) : zero_row);
          const __m256i* r1 = reinterpret_cast<const __m256i*>(j + 1 < n ? row(kv.v, c0 + j + 1) : zero_row);
          __m512i* dst = reinterpret_cast<__m512i*>(vb + (j / 2) * D);
          for (int c = 0; c < D / 16; ++c)
            _mm512_store_si512(dst + c, _mm512_or_si512(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(r0 + c)),
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(r1 + c)), 16)));
        }
#endif
      } else {  // fp32 rows

        for (int j = 0; j < npad; ++j) {
          float* kd = kbuf + j * D;
          float* vd = vbuf + j * D;
          if (j < n) {
            const C* kr = row(kv.k, c0 + j);
            const C* vr = row(kv.v, c0 + j);
            if constexpr (std::is_same<C, T>::value) {
              for (int d = 0; d < D; ++d) { kd[d] = to_f<T>(kr[d]); vd[d] = to_f<T>(vr[d]); }
            } else {
              const int64_t si = kv.scale_index(kv.offset(table, c0 + j)) + h;
              const float ksc = kv.ks[si], vsc = kv.vs[si];
              for (int d = 0; d < D; ++d) { kd[d] = to_f<C>(kr[d]) * ksc; vd[d] = to_f<C>(vr[d]) * vsc; }
            }
          } else {
            std::fill(kd, kd + D, 0.f);
            std::fill(vd, vd + D, 0.f);
          }
        }
      }
      for (int ti = 0; ti < nt; ++ti) {
        PrefillTile& t = tiles[ti];
        const int nk = std::min(n, t.pos_max + 1 - c0);  // keys of this chunk any lane sees
        // Keys before every lane's first (a window or chunk), in whole 16s, are skipped.
        const int js = std::max(0, t.lo_min - c0) / 16 * 16;
        if (nk <= js) continue;
        const int nk16 = (nk - js + 15) / 16 * 16, key0 = c0 + js;
        const float* kb = kbuf + static_cast<size_t>(js) * DQ;
        const float* vb = vbuf + static_cast<size_t>(kDp ? js / 2 : js) * D;
#ifdef __AVX512F__
        __m512 mx = _mm512_set1_ps(kNegBig);
        for (int j = 0; j < nk16; j += 16)
          mx = _mm512_max_ps(mx, prefill_scores16<kDp, DT>(t.q, kb + j * DQ, D, sc * kLog2e, cap, key0 + j,
                                                           t, sbuf + j * 16));
        const __m512 alpha = prefill_softmax<kDp>(sbuf, reinterpret_cast<uint32_t*>(xbuf), nk16, key0, t, mx);
        prefill_pv<kDp, DT>(t.o, alpha, key0 > kbeg, kDp ? xbuf : sbuf, vb, nk16, D);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 mx[2] = {_mm256_set1_ps(kNegBig), _mm256_set1_ps(kNegBig)}, alpha[2];
        for (int j = 0; j < nk16; j += 16)
          prefill_scores16_avx2(static_cast<const float*>(t.q), kb + j * D, D, sc * kLog2e, cap, key0 + j,
                                t, sbuf + j * 16, mx);
        prefill_softmax_avx2(sbuf, nk16, key0, t, mx, alpha);
        prefill_pv_avx2(t.o, alpha, key0 > kbeg, sbuf, vb, nk16, D);
#else
        float mx[16], mnew[16], alpha[16];
        for (int j = 0; j < nk16; j += 16) {
          float m2[16];
          prefill_scores16_ref(static_cast<const float*>(t.q), kb + j * D, D, sc, cap, key0 + j, t,
                               sbuf + j * 16, m2);
          for (int i = 0; i < 16; ++i) mx[i] = j ? std::max(mx[i], m2[i]) : m2[i];
        }
        for (int i = 0; i < 16; ++i) {
          mnew[i] = std::max(t.m[i], mx[i]);
          alpha[i] = std::exp(t.m[i] - mnew[i]);
          float sum = 0.f;
          for (int j = 0; j < nk16; ++j) {
            float& s = sbuf[j * 16 + i];
            s = key0 + j > t.pos[i] || key0 + j < t.lo[i] ? 0.f : std::exp(s - mnew[i]);
            sum += s;
          }
          t.l[i] = t.l[i] * alpha[i] + sum;
          t.m[i] = mnew[i];
        }
        for (int d = 0; d < D; ++d) {
          float* od = t.o + d * 16;
          for (int i = 0; i < 16; ++i) od[i] *= alpha[i];
          for (int j = 0; j < nk16; ++j) {
            const float v = vb[j * D + d];
            for (int i = 0; i < 16; ++i) od[i] += sbuf[j * 16 + i] * v;
          }
        }
#endif
      }
    }
    // Normalise (the sink, if any, joins each sum) and write [token, H * D].
    auto inv_sum = [&](const PrefillTile& t, int i, int hq) {
      float l = t.l[i];
      if (opt.sinks) {  // m in kUnit units: the sink's exp(sink - m) is 2^(sink log2 e - m) there
        l = kUnit == 1.f ? with_sink(l, t.m[i], opt.sinks[hq])
                         : l + std::exp2(std::min(opt.sinks[hq] * kUnit - t.m[i], 115.f));
      }
      return l > 0.f ? 1.f / l : 0.f;
    };
    for (int g = 0; g < G; ++g) {
      const int hq = h * G + g;
      for (int tt = 0; tt < ntile; ++tt) {
        const PrefillTile& t = tiles[g * ntile + tt];
        const int r0 = it.q0 + tt * 16, rn = std::min(16, it.q1 - r0);
        T* dst0 = optr + static_cast<int64_t>(cu[b] + r0) * H * D + static_cast<int64_t>(hq) * D;
#ifdef __AVX512F__
        alignas(64) float inv[16];
        for (int i = 0; i < 16; ++i) inv[i] = inv_sum(t, i, hq);
        for (int c = 0; c < D; c += 16) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(t.o + (c + i) * 16);
          transpose16x16(r);
          for (int i = 0; i < rn; ++i)
            store16_mask<T>(dst0 + static_cast<int64_t>(i) * H * D + c,
                            _mm512_mul_ps(_mm512_castsi512_ps(r[i]), _mm512_set1_ps(inv[i])), 0xFFFF);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        // Transposed back in 8 x 8 blocks, each product as the scalar loop below rounds it.
        alignas(32) float inv[16], rowbuf[8];
        for (int i = 0; i < 16; ++i) inv[i] = inv_sum(t, i, hq);
        for (int i0 = 0; i0 < rn; i0 += 8) {
          const __m256 iv = _mm256_load_ps(inv + i0);
          for (int c = 0; c < D; c += 8) {
            __m256 r[8];
            for (int k = 0; k < 8; ++k) r[k] = _mm256_mul_ps(_mm256_load_ps(t.o + (c + k) * 16 + i0), iv);
            transpose8(r);
            for (int i = 0; i < 8 && i0 + i < rn; ++i) {
              T* dst = dst0 + static_cast<int64_t>(i0 + i) * H * D + c;
              if constexpr (std::is_same<T, float>::value) {
                _mm256_storeu_ps(dst, r[i]);
              } else {
                _mm256_store_ps(rowbuf, r[i]);
                for (int d = 0; d < 8; ++d) dst[d] = from_f<T>(rowbuf[d]);
              }
            }
          }
        }
#else
        for (int i = 0; i < rn; ++i) {
          T* dst = dst0 + static_cast<int64_t>(i) * H * D;
          const float inv = inv_sum(t, i, hq);
          for (int d = 0; d < D; ++d) dst[d] = from_f<T>(t.o[d * 16 + i] * inv);
        }
#endif
      }
    }
  };

  const int64_t nitems = static_cast<int64_t>(items.size());
  if (nitems <= 1 || nthreads == 1 || work * D < (1 << 18)) {
    for (const Item& it : items) run_item(it);
  } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t i = 0; i < nitems; ++i) run_item(items[i]);
  }
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& cu_seqlens_q, const at::Tensor& start_pos,
                                   double scale, const OptTensor& k_scale, const OptTensor& v_scale,
                                   int64_t window, int64_t chunk, double softcap, const OptTensor& sinks) {
  check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, "paged_prefill_attention");
  const bool quant = check_kv_dtype(q, k_cache, v_cache, k_scale, v_scale, "paged_prefill_attention");
  const int H = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 16 == 0 && D <= kMaxD,
              "paged_prefill_attention: head dim ", D, " unsupported (a multiple of 16, at most ", kMaxD, ")");
  at::Tensor sink_f;
  const AttnOptions opt = attn_options(window, chunk, softcap, sinks, H, sink_f, "paged_prefill_attention");
  auto out = at::empty({q.size(0), static_cast<int64_t>(H) * D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.size(0) == 0) return out;
  if (quant) {
    SERVELM_DISPATCH(q.scalar_type(), "paged_prefill_attention", [&] {
      using I8 = int8_t;
      if (D == 64) prefill_attention_impl<scalar_t, false, 64, I8>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, opt, out, k_scale, v_scale);
      else if (D == 128) prefill_attention_impl<scalar_t, false, 128, I8>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, opt, out, k_scale, v_scale);
      else prefill_attention_impl<scalar_t, false, 0, I8>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, opt, out, k_scale, v_scale);
    });
    return out;
  }
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16) {
    using BF = c10::BFloat16;
    if (D == 64) prefill_attention_impl<BF, true, 64>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, opt, out);
    else if (D == 128) prefill_attention_impl<BF, true, 128>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, opt, out);
    else prefill_attention_impl<BF, true, 0>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, opt, out);
    return out;
  }
#endif
  SERVELM_DISPATCH(q.scalar_type(), "paged_prefill_attention", [&] {
    if (D == 64) prefill_attention_impl<scalar_t, false, 64>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, opt, out);
    else if (D == 128) prefill_attention_impl<scalar_t, false, 128>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, opt, out);
    else prefill_attention_impl<scalar_t, false, 0>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, opt, out);
  });
  return out;
}

// ---- argmax over rows ----------------------------------------------------------------------
//
// torch.argmax(x, -1) for fp32 [M, N] rows, as the sampler takes a greedy token: the first
// index of the maximum, or of the first NaN when a row has one (NaN compares as the largest,
// as in PyTorch). PyTorch's CPU argmax is scalar and runs rows on one thread (~28 us for a
// 49152-entry row, ~850 us for 64); here rows go over the threads, 16 lanes at a time.

int64_t argmax_row(const float* x, int64_t N) {
  auto first_nan = [&](int64_t from) -> int64_t {  // integer test: -ffast-math drops isnan
    for (int64_t i = from; i < N; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, sizeof(u));
      if ((u & 0x7fffffffu) > 0x7f800000u) return i;
    }
    return -1;
  };
  int64_t i = 0, best = 0;
  float bv = x[0];
#ifdef __AVX512F__
  constexpr int U = 4;  // independent (max, index) chains: the compare + select latency
  if (N >= 16 * U) {
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 vmax[U];
    __m512i vidx[U];
    __mmask16 nan = 0;
    for (int u = 0; u < U; ++u) {
      vmax[u] = _mm512_loadu_ps(x + 16 * u);
      vidx[u] = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * u));
      nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(vmax[u]), absmask), inf);
    }
    for (i = 16 * U; i + 16 * U <= N; i += 16 * U) {
      for (int u = 0; u < U; ++u) {
        const __m512 v = _mm512_loadu_ps(x + i + 16 * u);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax[u], _CMP_GT_OQ);  // strictly: first wins
        vmax[u] = _mm512_mask_mov_ps(vmax[u], gt, v);
        vidx[u] = _mm512_mask_mov_epi32(vidx[u], gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i) + 16 * u)));
        nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), absmask), inf);
      }
    }
    if (nan) return first_nan(0);
    alignas(64) float mv[16 * U];
    alignas(64) int32_t mi[16 * U];
    for (int u = 0; u < U; ++u) {
      _mm512_store_ps(mv + 16 * u, vmax[u]);
      _mm512_store_si512(mi + 16 * u, vidx[u]);
    }
    bv = mv[0];
    best = mi[0];
    for (int l = 1; l < 16 * U; ++l)  // the largest value; among equal ones the first index
      if (mv[l] > bv || (mv[l] == bv && mi[l] < best)) { bv = mv[l]; best = mi[l]; }
  }
#elif defined(__AVX2__)
  constexpr int U = 4;  // independent (max, index) chains: the compare + blend latency
  if (N >= 8 * U) {
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 vmax[U];
    __m256i vidx[U], nan = _mm256_setzero_si256();
    for (int u = 0; u < U; ++u) {
      vmax[u] = _mm256_loadu_ps(x + 8 * u);
      vidx[u] = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * u));
      nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(vmax[u]), absmask), inf));
    }
    for (i = 8 * U; i + 8 * U <= N; i += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256 v = _mm256_loadu_ps(x + i + 8 * u);
        const __m256 gt = _mm256_cmp_ps(v, vmax[u], _CMP_GT_OQ);  // strictly: first wins
        vmax[u] = _mm256_blendv_ps(vmax[u], v, gt);
        vidx[u] = _mm256_blendv_epi8(vidx[u], _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(i) + 8 * u)),
                                     _mm256_castps_si256(gt));
        nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), absmask), inf));
      }
    }
    if (_mm256_movemask_epi8(nan)) return first_nan(0);
    alignas(32) float mv[8 * U];
    alignas(32) int32_t mi[8 * U];
    for (int u = 0; u < U; ++u) {
      _mm256_store_ps(mv + 8 * u, vmax[u]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(mi + 8 * u), vidx[u]);
    }
    bv = mv[0];
    best = mi[0];
    for (int l = 1; l < 8 * U; ++l)  // the largest value; among equal ones the first index
      if (mv[l] > bv || (mv[l] == bv && mi[l] < best)) { bv = mv[l]; best = mi[l]; }
  }
#endif
  const int64_t tail = i;
  for (; i < N; ++i)
    if (x[i] > bv) { bv = x[i]; best = i; }
  const int64_t n = first_nan(tail);
  return n >= 0 ? n : best;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: x must be float32 [M, N] with contiguous rows");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  const int64_t M = x.size(0), N = x.size(1), rs = x.stride(0);
  auto out = at::empty({M}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / N), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) op[m] = argmax_row(xp + m * rs, N);
  });
  return out;
}

template <typename T>
void lora_add_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                   const int32_t* row_slots, at::IntArrayRef bounds) {
  const int64_t M = y.size(0), N = y.size(1), K = x.size(1);
  const auto L = lora::make_adapter<T>(lora_a, lora_b, bounds, N, K, "lora_add");
  lora::RowGroups G;
  G.build(row_slots, M, L.S, "lora_add");
  if (G.empty()) return;
  const int64_t JR = L.JR();
  std::vector<T> t(M * L.J * lora::paired_ranks(L.R));
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  // Grains: ~32K multiply-adds a task, so a decode row's small layer stays on one thread.
  const int64_t rows_per_chunk = (static_cast<int64_t>(G.rows.size()) + G.chunks() - 1) / G.chunks();
  at::parallel_for(0, G.chunks() * JR, std::max<int64_t>(1, (int64_t{1} << 15) / (K * rows_per_chunk)),
                   [&](int64_t i0, int64_t i1) { lora::shrink<T>(L, G, xp, ldx, t.data(), i0, i1); });
  const int64_t rows = static_cast<int64_t>(G.rows.size());
  at::parallel_for(0, L.blocks(), std::max<int64_t>(1, (int64_t{1} << 15) / (lora::kPanel * L.R * rows)),
                   [&](int64_t b0, int64_t b1) { lora::expand<T>(L, G, t.data(), yp, ldy, b0, b1); });
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& row_slots, at::IntArrayRef bounds) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0) && y.stride(1) == 1 && x.stride(1) == 1 &&
                  y.device().is_cpu() && x.device().is_cpu(),
              "lora_add: y [M, N] and x [M, K] must be CPU matrices of M rows, each row contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && lora_a.scalar_type() == y.scalar_type() &&
                  lora_b.scalar_type() == y.scalar_type() &&
                  (y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kFloat),
              "lora_add: y, x, lora_a and lora_b must be all bfloat16 or all float32, got ", y.scalar_type(),
              ", ", x.scalar_type(), ", ", lora_a.scalar_type(), ", ", lora_b.scalar_type());
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.numel() == y.size(0) && row_slots.scalar_type() == at::kInt &&
                  row_slots.is_contiguous(),
              "lora_add: row_slots must be contiguous int32 [M]");
  if (y.size(0) == 0) return;
  const int32_t* rs = row_slots.data_ptr<int32_t>();
  if (y.scalar_type() == at::kBFloat16) lora_add_impl<c10::BFloat16>(y, x, lora_a, lora_b, rs, bounds);
  else lora_add_impl<float>(y, x, lora_a, lora_b, rs, bounds);
}

}  // namespace

TORCH_LIBRARY(servelm_ops, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, Tensor? k_scale=None, "
        "Tensor? v_scale=None, int chunk=0, float softcap=0., Tensor? sinks=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("layer_norm(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor");
  m.def("fused_add_layer_norm(Tensor x, Tensor(a!) residual, Tensor weight, Tensor? bias, float eps) -> Tensor");
  m.def("rotary_kv_write(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, "
        "Tensor(d!)? k_scale=None, Tensor(e!)? v_scale=None) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor start_pos, float scale, Tensor? k_scale=None, "
        "Tensor? v_scale=None, int window=0, int chunk=0, float softcap=0., "
        "Tensor? sinks=None) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor row_slots, "
        "int[] bounds) -> ()");
}

TORCH_LIBRARY_IMPL(servelm_ops, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("layer_norm", &layer_norm);
  m.impl("fused_add_layer_norm", &fused_add_layer_norm);
  m.impl("rotary_kv_write", &rotary_kv_write);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("lora_add", &lora_add);
}
