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
//   quantize(w float32 [N, K], group_size, symmetric) -> (packed, scales, mins): rows padded
//       with zeros to a multiple of 16; per group of G inputs s = (max - min) / 15, m = min
//       (symmetric: s = max(-min / 8, max / 7), m = -8 s), s at least 1e-8, both stored as
//       float16; q = round-half-even((w - m) / s) clamped to 0..15, from the stored s and m
//       (a NaN, as 0 / 0 in an all-zero group whose s underflows float16, gives 0)
//   to_q8act(packed) -> uint8 [T, K/32, 2, 4, 32]: the same codes in q8act.cpp's panels
//       (servelm/layers/q8act.py's pack_q4 of the unpacked codes: per panel of 16 outputs,
//       block of 32 inputs, half h, chunk c, byte 4o + i holds output 8h + o's code at input
//       8c + i in its low nibble and at 8c + 4 + i in its high one)
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

// The 16 rows x 8 inputs of tile t, block b, as codes: q[r * ldq + i].
inline void unpack_block(const uint8_t* blk, uint8_t* q, int64_t ldq) {
  for (int L = 0; L < 32; ++L) {
    const int r = L >> 1, e = L & 1;
    const uint32_t v = blk[2 * L] | (static_cast<uint32_t>(blk[2 * L + 1]) << 8);
    uint8_t* row = q + r * ldq;
    for (int j = 0; j < 4; ++j) row[2 * j + e] = (v >> (4 * j)) & 15;
  }
}

// unpack_block's inverse: codes q[r * ldq + i] (16 rows x 8 inputs) into one block's lanes.
inline void pack_block(const uint8_t* q, int64_t ldq, uint8_t* blk) {
  for (int L = 0; L < 32; ++L) {
    const int r = L >> 1, e = L & 1;
    const uint8_t* row = q + r * ldq;
    const uint32_t v = row[e] | (row[2 + e] << 4) | (row[4 + e] << 8) | (row[6 + e] << 12);
    blk[2 * L] = static_cast<uint8_t>(v & 0xFF);
    blk[2 * L + 1] = static_cast<uint8_t>(v >> 8);
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

// Keeps x as it is here: the product below is rounded on its own before the sum.
inline float opaque(float x) {
  asm("" : "+x"(x));
  return x;
}

template <typename O>
void dequantize_tiles(const uint8_t* p, const c10::Half* sc, const c10::Half* mn, int64_t T,
                      int64_t K, int64_t G, O* out) {
  const int64_t NB = K / 8, KG = K / G;
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& w, int64_t group_size,
                                                        bool symmetric) {
  const char* name = "servelm_int4_codec.quantize";
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(),
              name, ": w must be contiguous float32 [N, K] on the CPU");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && K % group_size == 0, name, ": group_size ",
              group_size, " must be a multiple of 8 dividing in_features ", K);
  const int64_t T = (N + 15) / 16, KG = K / group_size, G = group_size, NB = K / 8;
  at::Tensor packed = at::empty({T, 8 * K}, w.options().dtype(at::kByte));
  at::Tensor scales = at::empty({T, KG, 16}, w.options().dtype(at::kHalf));
  at::Tensor mins = at::empty({T, KG, 16}, w.options().dtype(at::kHalf));
  const float* wp = w.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  c10::Half* sp = scales.data_ptr<c10::Half>();
  c10::Half* mp = mins.data_ptr<c10::Half>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> q(16 * K);
    const std::vector<float> zeros(G, 0.f);  // a padding row's group
    for (int64_t t = t0; t < t1; ++t) {
      for (int r = 0; r < 16; ++r) {
        const int64_t n = 16 * t + r;
        for (int64_t g = 0; g < KG; ++g) {
          const float* x = n < N ? wp + n * K + g * G : zeros.data();
          float lo = x[0], hi = x[0];
          for (int64_t i = 1; i < G; ++i) {
            lo = std::min(lo, x[i]);
            hi = std::max(hi, x[i]);
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
          int64_t i = 0;
#ifdef __AVX512F__
          // The same operations 16 lanes at a time (max / min return the second operand
          // for a NaN first one: 0).
          const __m512 mv = _mm512_set1_ps(mf), sv = _mm512_set1_ps(sf);
          for (; i + 16 <= G; i += 16) {
            __m512 v = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), sv);
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), _mm512_set1_ps(15.f));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
          }
#endif
          for (; i < G; ++i) {
            float v = std::nearbyint((x[i] - mf) / sf);
            v = v > 0.f ? v : 0.f;  // NaN too
            v = v < 15.f ? v : 15.f;
            qr[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
          }
        }
      }
      for (int64_t b = 0; b < NB; ++b) pack_block(q.data() + 8 * b, K, pp + t * 8 * K + 64 * b);
    }
  });
  return {packed, scales, mins};
}

}  // namespace

TORCH_LIBRARY(servelm_int4_codec, m) {
  m.def("unpack(Tensor packed) -> Tensor");
  m.def("dequantize(Tensor packed, Tensor scales, Tensor mins, int group_size, ScalarType dtype) -> Tensor");
  m.def("quantize(Tensor w, int group_size, bool symmetric) -> (Tensor, Tensor, Tensor)");
  m.def("to_q8act(Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_int4_codec, CPU, m) {
  m.impl("unpack", &unpack);
  m.impl("dequantize", &dequantize);
  m.impl("quantize", &quantize);
  m.impl("to_q8act", &to_q8act);
}
