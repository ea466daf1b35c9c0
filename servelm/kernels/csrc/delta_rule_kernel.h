// The gated delta rule's decode step, a row and a head at a time: shared by delta_rule.cpp
// (the servelm_delta_rule operators) and decode_stack.cpp (the DecodeStack's linear-attention
// layers), so both paths produce the same bits. The functions are kept out of line: each path
// then runs the same machine code whatever it is inlined beside.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {
namespace delta_rule {

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }
// x rounded to T (identity for float), as a PyTorch op producing a T tensor rounds it.
template <typename T> inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// One head's step (see the header): St updated in place, o [Dv] written. kv, qs, delta:
// scratch of Dv floats.
__attribute__((noinline)) inline void head_step(float* st, const float* qi, const float* ki, const float* vi, float g,
                      float bt, bool fresh, int64_t Dk, int64_t Dv, float* oi, float* kv,
                      float* qs, float* delta) {
  if (fresh) std::fill(st, st + Dk * Dv, 0.0f);
  std::fill(kv, kv + Dv, 0.0f);
  std::fill(qs, qs + Dv, 0.0f);
  float qk = 0.0f;
  for (int64_t r = 0; r < Dk; ++r) {
    const float a = ki[r], c = qi[r];
    const float* row = st + r * Dv;
    qk += a * c;
    for (int64_t j = 0; j < Dv; ++j) {
      kv[j] += row[j] * a;
      qs[j] += row[j] * c;
    }
  }
  const float d = std::exp(g);
  for (int64_t j = 0; j < Dv; ++j) {
    delta[j] = bt * (vi[j] - d * kv[j]);
    oi[j] = d * qs[j] + qk * delta[j];
  }
  for (int64_t r = 0; r < Dk; ++r) {
    const float a = ki[r];
    float* row = st + r * Dv;
    for (int64_t j = 0; j < Dv; ++j) row[j] = d * row[j] + a * delta[j];
  }
}

// One row's work before the heads: its causal convolution step over its slot's last K1 inputs
// (st [C, K1], updated: zeroed first where fresh), SiLU, q and k of each of the Hk key heads
// L2-normalised (q scaled by Dk^-1/2), into a [C] (fp32: q | k | v); and each of the H value
// heads' gate g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) into gb [2 H], from
// x [C] (the mixed projection's row), w [C, K1 + 1] and ba [2 H] (b | a).
template <typename T>
__attribute__((noinline)) void conv_row(const T* x, T* st, bool fresh, const T* w, int64_t C,
                                        int64_t K1, int64_t Hk, int64_t Dk, const T* ba,
                                        const float* A_log, const float* dt_bias, int64_t H,
                                        float* a, float* gb) {
  const int64_t K = K1 + 1, key_dim = Hk * Dk;
  for (int64_t c = 0; c < C; ++c) {
    T* prev = st + c * K1;
    const T* wc = w + c * K;
    float acc = 0.0f;
    for (int64_t j = 0; j < K1; ++j)
      acc += fresh ? 0.0f : rnd<T>(to_f(prev[j]) * to_f(wc[j]));
    acc += rnd<T>(to_f(x[c]) * to_f(wc[K1]));
    for (int64_t j = 0; j + 1 < K1; ++j) prev[j] = fresh ? T(0) : prev[j + 1];
    if (K1 > 0) prev[K1 - 1] = x[c];
    a[c] = rnd<T>(silu(rnd<T>(acc)));
  }
  // q and k of each key head, L2-normalised (l2_normalize), q scaled by Dk^-1/2.
  const float qscale = 1.0f / std::sqrt(static_cast<float>(Dk));
  for (int64_t part = 0; part < 2; ++part)
    for (int64_t h = 0; h < Hk; ++h) {
      float* v = a + part * key_dim + h * Dk;
      float ss = 0.0f;
      for (int64_t d = 0; d < Dk; ++d) ss += v[d] * v[d];
      const float inv = 1.0f / std::sqrt(ss + 1e-6f) * (part == 0 ? qscale : 1.0f);
      for (int64_t d = 0; d < Dk; ++d) v[d] *= inv;
    }
  for (int64_t h = 0; h < H; ++h) {
    gb[h] = -std::exp(A_log[h]) * softplus(to_f(ba[H + h]) + dt_bias[h]);
    gb[H + h] = 1.0f / (1.0f + std::exp(-to_f(ba[h])));
  }
}

// One row's value head h: the delta-rule step of its state st [Dk, Dv] (the slot's; zeroed
// first where fresh) from the row's a and gb (conv_row's), then the gated RMSNorm (the core in
// T, normed in fp32, rounded, weighted by nw [Dv] in T, times silu(z) in fp32, rounded) into
// orow [Dv]; zr: the row's z for this head [Dv]. scratch: 4 Dv floats.
template <typename T>
__attribute__((noinline)) void head_out(float* st, const float* a, const float* gb, int64_t h,
                                        int64_t H, int64_t Hk, int64_t Dk, int64_t Dv, bool fresh,
                                        const T* zr, const T* nw, float eps, T* orow,
                                        float* scratch) {
  const int64_t key_dim = Hk * Dk, hk = h / (H / Hk);
  float* core = scratch;
  head_step(st, a + hk * Dk, a + key_dim + hk * Dk, a + 2 * key_dim + h * Dv, gb[h], gb[H + h],
            fresh, Dk, Dv, core, scratch + Dv, scratch + 2 * Dv, scratch + 3 * Dv);
  float ms = 0.0f;
  for (int64_t j = 0; j < Dv; ++j) {
    core[j] = rnd<T>(core[j]);
    ms += core[j] * core[j];
  }
  const float inv = 1.0f / std::sqrt(ms / static_cast<float>(Dv) + eps);
  for (int64_t j = 0; j < Dv; ++j) {
    const float hn = rnd<T>(to_f(nw[j]) * rnd<T>(core[j] * inv));
    orow[j] = static_cast<T>(hn * silu(to_f(zr[j])));
  }
}

}  // namespace delta_rule
}  // namespace
