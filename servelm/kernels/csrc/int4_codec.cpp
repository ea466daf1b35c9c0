// servelm's int4 weight format to and from its codes (namespace torch.ops.servelm_int4_codec):
// the C++ twins of servelm/quantization.py's quantize_int4, _unpack_int4 and dequantize_int4,
// bit for bit. Those PyTorch versions stay the reference (and the path without a compiler);
// with int32 and fp32 temporaries of several bytes a weight, they were most of the time a 1.5B
// model took to quantise at load and to build the tuner's candidate layouts.
//
//   unpack(packed uint8 [T, 8K]) -> uint8 [16T, K]: the codes q in 0..15
//   dequantize(packed, scales, mins float16 [T, K/G, 16], group_size, dtype) -> [16T, K]:
//       w = s q + m in fp32 (a rounded product, then a rounded sum), then cast to dtype
//       (float32 or bfloat16)
//   quantize(w float32 or bfloat16 [N, K], group_size, symmetric) -> (packed, scales, mins): rows padded
//       with zeros to a multiple of 16; per group of G inputs s = (max - min) / 15, m = min
//       (symmetric: s = max(-min / 8, max / 7), m = -8 s), s at least 1e-8, both stored as
//       float16; q = round-half-even((w - m) / s) clamped to 0..15, from the stored s and m
//       (a NaN, as 0 / 0 in an all-zero group whose s underflows float16, gives 0)
//   to_q8act(packed) -> uint8 [T, K/32, 2, 4, 32]: the same codes in q8act.cpp's panels
//       (servelm/layers/q8act.py's pack_q4 of the unpacked codes: per panel of 16 outputs,
//       block of 32 inputs, half h, chunk c, byte 4o + i holds output 8h + o's code at input
//       8c + i in its low nibble and at 8c + 4 + i in its high one)
//   mxfp4_to_panels(blocks, exps, out?, out_exps?) -> (panels, exps): an MXFP4 matrix's codes in
//       the same panels
//
// Layout (quantization.py): tile t, block b (inputs 8b .. 8b + 7) is 32 little-endian uint16
// lanes at bytes t * 8K + 64 b + 2 L; lane L = 2r + e holds in nibble j the code of row
// 16t + r, input 8b + 2j + e.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

// IEEE arithmetic as PyTorch's separate operators do it: no reassociation, no reciprocal
// divisions, no fused multiply-adds (the build's -ffast-math, and GCC's default contraction).
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

// Row r of a block is the 32-bit (little-endian) word at byte 4r: lane 2r (its even inputs'
// codes, a nibble each) in the low half, lane 2r + 1 (the odd inputs') in the high one. These
// turn that word into the row's 8 codes, a byte each in input order, and back, by shifts and
// masks (BMI2's pdep/pext do it in one instruction, but are microcoded and slow on AMD before
// Zen 3).
inline uint64_t spread_nibbles(uint64_t y) {  // nibble j of 16 bits -> bits 16j..16j+3
  y = (y | (y << 24)) & 0x000000FF000000FFULL;
  return (y | (y << 12)) & 0x000F000F000F000FULL;
}
inline uint64_t gather_nibbles(uint64_t y) {  // spread_nibbles' inverse
  y = (y | (y >> 12)) & 0x000000FF000000FFULL;
  return (y | (y >> 24)) & 0xFFFF;
}
inline uint64_t expand_row(uint32_t w) { return spread_nibbles(w & 0xFFFF) | (spread_nibbles(w >> 16) << 8); }
inline uint32_t compress_row(uint64_t u) {
  return static_cast<uint32_t>(gather_nibbles(u & 0x000F000F000F000FULL) |
                               (gather_nibbles((u >> 8) & 0x000F000F000F000FULL) << 16));
}

// The 16 rows x 8 inputs of tile t, block b, as codes: q[r * ldq + i].
inline void unpack_block(const uint8_t* blk, uint8_t* q, int64_t ldq) {
  for (int r = 0; r < 16; ++r) {
    uint32_t w;
    std::memcpy(&w, blk + 4 * r, 4);
    const uint64_t u = expand_row(w);
    std::memcpy(q + r * ldq, &u, 8);
  }
}

// unpack_block's inverse: codes q[r * ldq + i] (16 rows x 8 inputs) into one block's lanes.
inline void pack_block(const uint8_t* q, int64_t ldq, uint8_t* blk) {
  for (int r = 0; r < 16; ++r) {
    uint64_t u;
    std::memcpy(&u, q + r * ldq, 8);
    const uint32_t w = compress_row(u);
    std::memcpy(blk + 4 * r, &w, 4);
  }
}

void check_packed(const at::Tensor& packed, const char* name) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous() && packed.size(1) % 64 == 0,
              name, ": packed must be contiguous uint8 [T, 8K] on the CPU, K a multiple of 8");
}

at::Tensor unpack(const at::Tensor& packed) {
  check_packed(packed, "servelm_int4_codec.unpack");
  const int64_t T = packed.size(0), K = packed.size(1) / 8, NB = K / 8;
  at::Tensor q = at::empty({16 * T, K}, packed.options());
  const uint8_t* p = packed.data_ptr<uint8_t>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < NB; ++b) unpack_block(p + t * 8 * K + 64 * b, qp + 16 * t * K + 8 * b, K);
  });
  return q;
}

at::Tensor to_q8act(const at::Tensor& packed) {
  check_packed(packed, "servelm_int4_codec.to_q8act");
  const int64_t T = packed.size(0), K = packed.size(1) / 8, NB = K / 8;
  TORCH_CHECK(K % 32 == 0, "servelm_int4_codec.to_q8act: in_features ", K, " must be a multiple of 32");
  at::Tensor out = at::empty({T, K / 32, 2, 4, 32}, packed.options());
  const uint8_t* p = packed.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) uint8_t q[16 * 8];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < NB; ++b) {  // tile block b: q8act block b / 4, chunk b % 4
        unpack_block(p + t * 8 * K + 64 * b, q, 8);
        uint8_t* dst = o + ((t * (K / 32) + b / 4) * 2 * 4 + b % 4) * 32;
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < 8; ++r)
            for (int i = 0; i < 4; ++i)
              dst[h * 4 * 32 + 4 * r + i] = q[8 * (8 * h + r) + i] | (q[8 * (8 * h + r) + 4 + i] << 4);
      }
  });
  return out;
}

// An MXFP4 matrix in the same panels: blocks uint8 [N, K / 32, 16] in ggml's order (byte j of
// a block holds code j in its low nibble and code 16 + j in its high one) and exps uint8
// [N, K / 32], either strided (a GGUF file's 17-byte blocks read in place: the bytes of a
// block contiguous) -> (the codes as to_q8act lays out int4's, uint8 [T, K / 32, 2, 4, 32];
// the exponents a block and output, uint8 [T, K / 32, 16]), rows past N zero
// (servelm/quantization/mxfp4.py's to_panels).
std::tuple<at::Tensor, at::Tensor> mxfp4_to_panels(const at::Tensor& blocks, const at::Tensor& exps,
                                                   const c10::optional<at::Tensor>& out_in,
                                                   const c10::optional<at::Tensor>& eo_in) {
  const char* name = "servelm_int4_codec.mxfp4_to_panels";
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 3 &&
                  blocks.size(2) == 16 && blocks.stride(2) == 1,
              name, ": blocks must be uint8 [N, K / 32, 16] on the CPU, each block's bytes contiguous");
  const int64_t N = blocks.size(0), G = blocks.size(1), T = (N + 15) / 16;
  TORCH_CHECK(exps.device().is_cpu() && exps.scalar_type() == at::kByte && exps.dim() == 2 &&
                  exps.size(0) == N && exps.size(1) == G,
              name, ": exps must be uint8 [N, K / 32] on the CPU");
  // Written in place where given (a MoE layer's expert: no temporary, no second copy).
  at::Tensor out = out_in && out_in->defined() ? *out_in : at::empty({T, G, 2, 4, 32}, blocks.options());
  at::Tensor eo = eo_in && eo_in->defined() ? *eo_in : at::empty({T, G, 16}, blocks.options());
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.device().is_cpu() &&
                  out.sizes() == at::IntArrayRef({T, G, 2, 4, 32}) && eo.scalar_type() == at::kByte &&
                  eo.is_contiguous() && eo.device().is_cpu() && eo.sizes() == at::IntArrayRef({T, G, 16}),
              name, ": out and out_exps must be contiguous uint8 [T, K / 32, 2, 4, 32] and [T, K / 32, 16]");
  const uint8_t* b = blocks.data_ptr<uint8_t>();
  const uint8_t* e = exps.data_ptr<uint8_t>();
  const int64_t bn = blocks.stride(0), bg = blocks.stride(1), en = exps.stride(0), eg = exps.stride(1);
  uint8_t* o = out.data_ptr<uint8_t>();
  uint8_t* eop = eo.data_ptr<uint8_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    uint8_t codes[32];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* dst = o + (t * G + g) * 256;
        for (int r = 0; r < 16; ++r) {
          const int64_t n = 16 * t + r;
          uint8_t* row = dst + (r / 8) * 128 + 4 * (r % 8);  // half, then output within it
          if (n >= N) {  // padding: zero codes and exponents
            for (int c = 0; c < 4; ++c) std::memset(row + c * 32, 0, 4);
            eop[(t * G + g) * 16 + r] = 0;
            continue;
          }
          const uint8_t* src = b + n * bn + g * bg;
          for (int j = 0; j < 16; ++j) {
            codes[j] = src[j] & 15;
            codes[16 + j] = src[j] >> 4;
          }
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) row[c * 32 + i] = codes[8 * c + i] | (codes[8 * c + 4 + i] << 4);
          eop[(t * G + g) * 16 + r] = e[n * en + g * eg];
        }
      }
  });
  return {out, eo};
}

// Keeps x as it is here: the product below is rounded on its own before the sum.
inline float opaque(float x) {
  asm("" : "+x"(x));
  return x;
}

#ifdef __AVX512F__
#define SERVELM_CODEC_SIMD 1
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
// c10::BFloat16's rounding of a float (round_to_nearest_even): a NaN is 0x7FC0, else the
// upper half of u + 0x7FFF + (bit 16 of u).
inline void store16(c10::BFloat16* o, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
}
#endif

template <typename O>
void dequantize_tiles(const uint8_t* p, const c10::Half* sc, const c10::Half* mn, int64_t T,
                      int64_t K, int64_t G, O* out) {
  const int64_t NB = K / 8, KG = K / G;
#ifdef SERVELM_CODEC_SIMD
  if (G % 16 == 0) {  // two blocks (16 inputs) at a time, in one group: row by row
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const uint8_t* tile = p + t * 8 * K;
        for (int r = 0; r < 16; ++r) {
          O* o = out + (16 * t + r) * K;
          for (int64_t b = 0; b < NB; b += 2) {
            uint32_t w0, w1;
            std::memcpy(&w0, tile + 64 * b + 4 * r, 4);
            std::memcpy(&w1, tile + 64 * (b + 1) + 4 * r, 4);
            const __m128i codes = _mm_set_epi64x(static_cast<int64_t>(expand_row(w1)),
                                                 static_cast<int64_t>(expand_row(w0)));
            const int64_t at = (t * KG + (8 * b) / G) * 16 + r;
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
            const __m512 prod = _mm512_mul_ps(q, _mm512_set1_ps(static_cast<float>(sc[at])));
            store16(o + 8 * b, _mm512_add_ps(prod, _mm512_set1_ps(static_cast<float>(mn[at]))));
          }
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) uint8_t q[16 * 8];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b = 0; b < NB; ++b) {
        unpack_block(p + t * 8 * K + 64 * b, q, 8);
        const int64_t g = (8 * b) / G;
        for (int r = 0; r < 16; ++r) {
          const float s = static_cast<float>(sc[(t * KG + g) * 16 + r]);
          const float m = static_cast<float>(mn[(t * KG + g) * 16 + r]);
          O* o = out + (16 * t + r) * K + 8 * b;
          for (int i = 0; i < 8; ++i) o[i] = static_cast<O>(opaque(static_cast<float>(q[8 * r + i]) * s) + m);
        }
      }
    }
  });
}

at::Tensor dequantize(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                      int64_t group_size, at::ScalarType dtype) {
  const char* name = "servelm_int4_codec.dequantize";
  check_packed(packed, name);
  const int64_t T = packed.size(0), K = packed.size(1) / 8;
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && K % group_size == 0, name, ": group_size ",
              group_size, " must be a multiple of 8 dividing in_features ", K);
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kHalf && t->is_contiguous() &&
                    t->dim() == 3 && t->size(0) == T && t->size(1) == K / group_size && t->size(2) == 16,
                name, ": scales and mins must be contiguous float16 [T, K / group_size, 16]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, name, ": dtype must be float32 or bfloat16");
  at::Tensor out = at::empty({16 * T, K}, packed.options().dtype(dtype));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const c10::Half* s = scales.data_ptr<c10::Half>();
  const c10::Half* m = mins.data_ptr<c10::Half>();
  if (dtype == at::kFloat) dequantize_tiles(p, s, m, T, K, group_size, out.data_ptr<float>());
  else dequantize_tiles(p, s, m, T, K, group_size, out.data_ptr<c10::BFloat16>());
  return out;
}

// quantize's rows, from float32 or bfloat16 weights (a bfloat16 weight converts exactly).
template <typename In>
void quantize_tiles(const In* wp, int64_t N, int64_t K, int64_t G, bool symmetric, uint8_t* pp,
                    c10::Half* sp, c10::Half* mp) {
  const int64_t T = (N + 15) / 16, KG = K / G, NB = K / 8;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> q(16 * K);
    const std::vector<In> zeros(G, In(0.f));  // a padding row's group
    for (int64_t t = t0; t < t1; ++t) {
      for (int r = 0; r < 16; ++r) {
        const int64_t n = 16 * t + r;
        for (int64_t g = 0; g < KG; ++g) {
          const In* x = n < N ? wp + n * K + g * G : zeros.data();
          float lo = static_cast<float>(x[0]), hi = lo;
          int64_t i = 1;
#ifdef SERVELM_CODEC_SIMD
          // Lane by lane as below (min_ps(v, lo) is v < lo ? v : lo), then across the lanes:
          // the same minimum and maximum, unless the group mixes +0 and -0 or holds a NaN.
          if (G % 16 == 0) {
            __m512 vlo = load16(x), vhi = vlo;
            for (int64_t k = 16; k < G; k += 16) {
              const __m512 v = load16(x + k);
              vlo = _mm512_min_ps(v, vlo);
              vhi = _mm512_max_ps(v, vhi);
            }
            lo = _mm512_reduce_min_ps(vlo);
            hi = _mm512_reduce_max_ps(vhi);
            i = G;
          }
#endif
          for (; i < G; ++i) {
            const float v = static_cast<float>(x[i]);
            lo = std::min(lo, v);
            hi = std::max(hi, v);
          }
          float s, m;
          if (symmetric) {
            s = std::max(-lo / 8.f, hi / 7.f);
            s = std::max(s, 1e-8f);
            m = -8.f * s;
          } else {
            s = std::max((hi - lo) / 15.f, 1e-8f);
            m = lo;
          }
          const c10::Half s16(s), m16(m);
          sp[(t * KG + g) * 16 + r] = s16;
          mp[(t * KG + g) * 16 + r] = m16;
          const float sf = static_cast<float>(s16), mf = static_cast<float>(m16);
          uint8_t* qr = q.data() + r * K + g * G;
          i = 0;
#ifdef SERVELM_CODEC_SIMD
          // The same operations 16 lanes at a time (max / min return the second operand
          // for a NaN first one: 0).
          const __m512 mv = _mm512_set1_ps(mf), sv = _mm512_set1_ps(sf);
          for (; i + 16 <= G; i += 16) {
            __m512 v = _mm512_div_ps(_mm512_sub_ps(load16(x + i), mv), sv);
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), _mm512_set1_ps(15.f));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
          }
#endif
          for (; i < G; ++i) {
            float v = std::nearbyint((static_cast<float>(x[i]) - mf) / sf);
            v = v > 0.f ? v : 0.f;  // NaN too
            v = v < 15.f ? v : 15.f;
            qr[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
          }
        }
      }
      for (int64_t b = 0; b < NB; ++b) pack_block(q.data() + 8 * b, K, pp + t * 8 * K + 64 * b);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& w, int64_t group_size,
                                                        bool symmetric) {
  const char* name = "servelm_int4_codec.quantize";
  TORCH_CHECK(w.device().is_cpu() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) &&
                  w.dim() == 2 && w.is_contiguous(),
              name, ": w must be contiguous float32 or bfloat16 [N, K] on the CPU");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && K % group_size == 0, name, ": group_size ",
              group_size, " must be a multiple of 8 dividing in_features ", K);
  const int64_t T = (N + 15) / 16, KG = K / group_size;
  at::Tensor packed = at::empty({T, 8 * K}, w.options().dtype(at::kByte));
  at::Tensor scales = at::empty({T, KG, 16}, w.options().dtype(at::kHalf));
  at::Tensor mins = at::empty({T, KG, 16}, w.options().dtype(at::kHalf));
  uint8_t* pp = packed.data_ptr<uint8_t>();
  c10::Half* sp = scales.data_ptr<c10::Half>();
  c10::Half* mp = mins.data_ptr<c10::Half>();
  if (w.scalar_type() == at::kFloat)
    quantize_tiles(w.data_ptr<float>(), N, K, group_size, symmetric, pp, sp, mp);
  else
    quantize_tiles(w.data_ptr<c10::BFloat16>(), N, K, group_size, symmetric, pp, sp, mp);
  return {packed, scales, mins};
}

}  // namespace

TORCH_LIBRARY(servelm_int4_codec, m) {
  m.def("unpack(Tensor packed) -> Tensor");
  m.def("dequantize(Tensor packed, Tensor scales, Tensor mins, int group_size, ScalarType dtype) -> Tensor");
  m.def("quantize(Tensor w, int group_size, bool symmetric) -> (Tensor, Tensor, Tensor)");
  m.def("to_q8act(Tensor packed) -> Tensor");
  m.def("mxfp4_to_panels(Tensor blocks, Tensor exps, Tensor(a!)? out=None, Tensor(b!)? out_exps=None) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(servelm_int4_codec, CPU, m) {
  m.impl("unpack", &unpack);
  m.impl("dequantize", &dequantize);
  m.impl("quantize", &quantize);
  m.impl("to_q8act", &to_q8act);
  m.impl("mxfp4_to_panels", &mxfp4_to_panels);
}
