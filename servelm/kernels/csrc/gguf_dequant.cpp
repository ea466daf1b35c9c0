// GGUF block formats to float32 (namespace torch.ops.servelm_gguf_dequant): the C++ twins of
// servelm/models/dequant.py's torch functions, bit for bit, and so of gguf-py's numpy
// reference (the same float32 operations in the same order: a product rounded on its own,
// then the sum). The torch versions took ~11 s of a Qwen2.5-1.5B Q4_K_M file's load, most
// of it in temporaries of several bytes a weight.
//
//   dequantize(blocks uint8 [n, bytes per block], type) -> float32 [n * elements per block]
//   for type Q4_0, Q4_1, Q8_0 (32 elements, 18 / 20 / 34 bytes) and Q4_K, Q5_K, Q6_K (256
//   elements, 144 / 176 / 210 bytes), laid out as ggml's block_q4_0 ... block_q6_k.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>

// IEEE arithmetic as the torch and numpy versions do it: no fused multiply-adds, no
// reassociation (the build's -ffast-math, and GCC's default contraction).
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Q4_0: d, 16 bytes of nibbles (the low ones are elements 0-15, the high ones 16-31), q - 8.
void q4_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(static_cast<int>(b[2 + i] & 15) - 8);
    y[16 + i] = d * static_cast<float>(static_cast<int>(b[2 + i] >> 4) - 8);
  }
}

// Q4_1: d, m, 16 bytes of nibbles as Q4_0's; d q + m.
void q4_1(const uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(b[4 + i] & 15) + m;
    y[16 + i] = d * static_cast<float>(b[4 + i] >> 4) + m;
  }
}

// Q8_0: d, 32 int8.
void q8_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
}

// Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4).
inline void k_scale_min(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[4 + j] & 0x3F;
    sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
  }
}

// Q4_K: d, dmin, scales (12), 128 bytes of nibbles: sub-block j (32 elements) is the low
// (j even) or high (j odd) nibbles of bytes 32 (j / 2) ..; (d sc_j) q - (dmin mn_j).
void q4_k(const uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  uint8_t sc[8], mn[8];
  k_scale_min(b + 4, sc, mn);
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    const float ds = d * static_cast<float>(sc[j]), dm = dmin * static_cast<float>(mn[j]);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    for (int i = 0; i < 32; ++i) y[32 * j + i] = ds * static_cast<float>((q[i] >> shift) & 15) - dm;
  }
}

// Q5_K: Q4_K's, with a fifth bit: bit j of qh[i] (32 bytes) for element i of sub-block j.
void q5_k(const uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  uint8_t sc[8], mn[8];
  k_scale_min(b + 4, sc, mn);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    const float ds = d * static_cast<float>(sc[j]), dm = dmin * static_cast<float>(mn[j]);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    for (int i = 0; i < 32; ++i) {
      const int v = ((q[i] >> shift) & 15) | (((qh[i] >> j) & 1) << 4);
      y[32 * j + i] = ds * static_cast<float>(v) - dm;
    }
  }
}

// Q6_K: ql (128), qh (64), int8 scales (16), d. Half h (128 elements) takes ql[64h ..] and
// qh[32h ..]: its element 32k + i is the low (k < 2) or high nibble of ql[64h + 32(k % 2) + i]
// with bits 2k, 2k + 1 of qh[32h + i] above, less 32; times d sc_(e / 16).
void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k) {
      const int e0 = 128 * h + 32 * k;
      const uint8_t* l = ql + 64 * h + 32 * (k % 2);
      const int shift = 4 * (k / 2);
      const float d0 = d * static_cast<float>(sc[e0 / 16]), d1 = d * static_cast<float>(sc[e0 / 16 + 1]);
      for (int i = 0; i < 32; ++i) {
        const int q = (((l[i] >> shift) & 15) | (((qh[32 * h + i] >> (2 * k)) & 3) << 4)) - 32;
        y[e0 + i] = (i < 16 ? d0 : d1) * static_cast<float>(q);
      }
    }
}

struct Format {
  const char* name;
  int64_t elements, bytes;
  void (*fn)(const uint8_t*, float*);
};

constexpr Format kFormats[] = {
    {"Q4_0", 32, 18, q4_0}, {"Q4_1", 32, 20, q4_1}, {"Q8_0", 32, 34, q8_0},
    {"Q4_K", 256, 144, q4_k}, {"Q5_K", 256, 176, q5_k}, {"Q6_K", 256, 210, q6_k},
};

at::Tensor dequantize(const at::Tensor& blocks, const std::string& type) {
  const char* name = "servelm_gguf_dequant.dequantize";
  const Format* f = nullptr;
  for (const Format& c : kFormats)
    if (type == c.name) f = &c;
  TORCH_CHECK(f != nullptr, name, ": unknown block type ", type);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.size(1) == f->bytes && blocks.stride(1) == 1 && blocks.stride(0) == f->bytes,
              name, ": blocks must be contiguous uint8 [n, ", f->bytes, "] for ", type);
  const int64_t n = blocks.size(0);
  at::Tensor out = at::empty({n * f->elements}, blocks.options().dtype(at::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) f->fn(src + i * f->bytes, dst + i * f->elements);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(servelm_gguf_dequant, m) {
  m.def("dequantize(Tensor blocks, str type) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_gguf_dequant, CPU, m) {
  m.impl("dequantize", &dequantize);
}
