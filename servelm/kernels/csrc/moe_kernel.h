// A mixture-of-experts layer's decode-time parts for a few tokens: the router (logits, softmax,
// top k) and the routed experts over q8act's panels (int4 or MXFP4), in three phases whose
// work items any thread may take. Shared by servelm_q8act's fused ops (q8act.cpp: moe_route,
// moe_experts, moe_experts_mxfp4) and the DecodeStack's MoE layers (decode_stack.cpp), so a
// layer gives the same bits on either. Strict float semantics (no-fast-math) for everything
// here, whatever the including file's, as q8act_kernel.h's. Inline, in an anonymous namespace,
// names inside `moe`.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "q8act_kernel.h"

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

#include "moe_act.h"  // moe_act, moe_weighted_sum, moe::Scratch (under the pragma where this file comes first)

namespace {
namespace moe {

// A MoE layer's router: E experts, k chosen a token, the chosen weights renormalised to sum 1
// where norm, times scale; bias (fp32 [E], or null) added to the logits; groups > 0: DeepSeek-V3's
// router instead of the softmax (SparseMoE's sigmoid_grouped: sigmoid scores, the choice by
// score + score_bias (fp32 [E], or null) among the topk_groups of `groups` groups whose two
// best biased scores sum highest, the weights the chosen experts' unbiased scores).
struct Router {
  int64_t E = 0, k = 0;
  bool norm = true;
  float scale = 1.f;
  const float* bias = nullptr;
  int64_t groups = 0, topk_groups = 0;
  const float* score_bias = nullptr;
  // Gemma 4's: the router's input normalised (no weight, in_eps) and times in_scale [H] and
  // in_root, rounded to bf16 after each as SparseMoE's PyTorch ops round (null: x as it is);
  // the chosen weights times expert_scale [E] (null: none).
  const float* in_scale = nullptr;
  float in_root = 1.f, in_eps = 1e-6f;
  const float* expert_scale = nullptr;
};

// The k largest of v[0, n) among those allowed (allowed[i / per], or all where allowed is
// null): ties to the lower index; each taken is marked in taken (n flags).
inline void top_k(const float* v, int64_t n, int64_t k, const uint8_t* allowed, int64_t per,
                  uint8_t* taken, int64_t* ids) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; ++e)
      if (!taken[e] && (!allowed || allowed[e / per]) && (best < 0 || v[e] > v[best])) best = e;
    ids[j] = best;
    taken[best] = 1;
  }
}

// One row's routing, as SparseMoE's softmax (or sigmoid_grouped) router computes it: the
// logits of the router w bf16 [E, H] (H a multiple of 16) for x bf16 [H], each a dot product in
// fp32 (two 8-lane accumulators over alternate blocks of 8, in order) plus bias, rounded to
// bf16 as a bf16 linear's output is; their softmax in fp32 and the k largest probabilities
// (ties: the lower expert first), or the grouped sigmoid choice (Router); renormalised where
// norm (the sigmoid's sum plus 1e-20), times scale, rounded to bf16 (the weights the experts'
// sum takes): ids [k], weights [k] (fp32 holding bf16 values). gate (or null): w has a row E
// after the experts', a shared expert's gate (Qwen2-MoE's shared_expert_gate): its logit,
// rounded to bf16, no bias, outside the routing. scratch: [4 (E + 1) + H] floats (the last H
// for a normalised input: Router::in_scale).
__attribute__((noinline)) inline void route_row(const c10::BFloat16* x, const c10::BFloat16* w, int64_t H,
                                                const Router& r, float* scratch, int64_t* ids,
                                                float* weights, c10::BFloat16* gate = nullptr) {
  const int64_t E = r.E, k = r.k, rows = gate ? E + 1 : E;
  float* logits = scratch;
  if (r.in_scale) {  // bf16(bf16(bf16(x / rms(x)) * in_scale) * in_root), as l2_norm(x) * scale * root
    auto* xn = reinterpret_cast<c10::BFloat16*>(scratch + 4 * (E + 1));
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += static_cast<float>(x[i]) * static_cast<float>(x[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + r.in_eps);
    for (int64_t i = 0; i < H; ++i) {
      const float n = static_cast<float>(c10::BFloat16(static_cast<float>(x[i]) * inv));
      const float t = static_cast<float>(c10::BFloat16(n * r.in_scale[i]));
      xn[i] = c10::BFloat16(t * r.in_root);
    }
    x = xn;
  }
  int64_t e = 0;
  for (; e + 4 <= rows; e += 4) {  // four experts at a time: eight independent sums
    __m256 a[4][2];
    for (auto& v : a) v[0] = v[1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < H; c += 16) {
      const __m256 x0 = load8f(x + c), x1 = load8f(x + c + 8);
      for (int j = 0; j < 4; ++j) {
        const c10::BFloat16* wr = w + (e + j) * H + c;
        a[j][0] = _mm256_fmadd_ps(x0, load8f(wr), a[j][0]);
        a[j][1] = _mm256_fmadd_ps(x1, load8f(wr + 8), a[j][1]);
      }
    }
    for (int j = 0; j < 4; ++j) logits[e + j] = hsum8(_mm256_add_ps(a[j][0], a[j][1]));
  }
  for (; e < rows; ++e) {  // the same operations, one expert
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t c = 0; c < H; c += 16) {
      a0 = _mm256_fmadd_ps(load8f(x + c), load8f(w + e * H + c), a0);
      a1 = _mm256_fmadd_ps(load8f(x + c + 8), load8f(w + e * H + c + 8), a1);
    }
    logits[e] = hsum8(_mm256_add_ps(a0, a1));
  }
  if (gate) *gate = c10::BFloat16(logits[E]);
  for (e = 0; e < E; ++e) logits[e] = static_cast<float>(c10::BFloat16(r.bias ? logits[e] + r.bias[e] : logits[e]));
  uint8_t* taken = reinterpret_cast<uint8_t*>(scratch + 3 * (E + 1));
  std::fill(taken, taken + E, uint8_t{0});
  if (r.groups > 0) {
    float* biased = scratch + (E + 1);
    float* group = scratch + 2 * (E + 1);
    const int64_t per = E / r.groups;
    for (e = 0; e < E; ++e) {
      logits[e] = 1.f / (1.f + std::exp(-logits[e]));
      biased[e] = r.score_bias ? logits[e] + r.score_bias[e] : logits[e];
    }
    for (int64_t g = 0; g < r.groups; ++g) {  // a group's two best biased scores, summed
      float b1 = -INFINITY, b2 = -INFINITY;
      for (e = g * per; e < (g + 1) * per; ++e) {
        if (biased[e] > b1) b2 = b1, b1 = biased[e];
        else if (biased[e] > b2) b2 = biased[e];
      }
      group[g] = per > 1 ? b1 + b2 : b1;
    }
    int64_t chosen[64];
    uint8_t* gtaken = taken + E;  // (scratch past the experts' flags)
    std::fill(gtaken, gtaken + r.groups, uint8_t{0});
    top_k(group, r.groups, r.topk_groups, nullptr, 1, gtaken, chosen);
    top_k(biased, E, k, gtaken, per, taken, ids);
  } else {
    float mx = -INFINITY;
    for (e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
    float sum = 0.f;
    for (e = 0; e < E; ++e) sum += logits[e] = std::exp(logits[e] - mx);
    for (e = 0; e < E; ++e) logits[e] /= sum;
    top_k(logits, E, k, nullptr, 1, taken, ids);
  }
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) total += weights[j] = logits[ids[j]];
  if (r.groups > 0) total += 1e-20f;
  for (int64_t j = 0; j < k; ++j) {
    float v = r.norm ? weights[j] / total : weights[j];
    if (r.scale != 1.f) v *= r.scale;
    if (r.expert_scale) v *= r.expert_scale[ids[j]];
    weights[j] = static_cast<float>(c10::BFloat16(v));
  }
}

// A layer's routed experts in q8act's panels (Fmt: Q4Fmt int4 with scales and mins, MX4Fmt
// MXFP4 with exponents): gate_up [E, 2I / 16, H / 32, 2, 4, 32] (gate rows, then up), down
// [E, H / 16, I / 32, 2, 4, 32], each expert's scales (and mins) s1 / s2 apart; biases and
// activation as ExpertMlp's.
// The phases for T tokens whose pair p = t k + j runs expert ids[p], weighted weights[p], each
// over items [i0, i1) of its count (gate_up_items, act_items, down_items):
//   quantize(t): token t's row;
//   gate_up(b0, b1): (pair, panel) items, pair-major: h[p] = gate_up[e] x[t];
//   activate(p0, p1): pairs, a[p] = act(gate, up), quantised;
//   down(pan0, pan1, out): panels of down for every pair, then out[t][those columns] =
//   sum_j weights[t k + j] y[t k + j], in slot order, rounded once to O.
// Each phase reads only what the one before it wrote in full (a barrier between them).
template <typename Fmt>
struct Panels : ExpertMlp {
  using S = typename Fmt::S;
  const uint8_t* gq = nullptr;
  const uint8_t* dq = nullptr;
  const S* gs = nullptr;
  const S* gm = nullptr;
  const S* ds = nullptr;
  const S* dm = nullptr;
  int64_t s1 = 0, s2 = 0, group = 0;
  bool wide = q8act::kVnni;

  int64_t np1() const { return 2 * I / q8act::kNR; }
  int64_t gate_up_items(int64_t P) const { return P * np1(); }
  int64_t act_items(int64_t P) const { return P; }
  int64_t down_items() const { return np2(); }
  int64_t np2() const { return (H + q8act::kNR - 1) / q8act::kNR; }
  int64_t g1() const { return np1() * (H / q8act::kB) * (q8act::kNR * q8act::kB / 2); }
  int64_t g2() const { return np2() * (I / q8act::kB) * (q8act::kNR * q8act::kB / 2); }
  const S* at(const S* p, int64_t off) const { return p ? p + off : nullptr; }

  template <typename X>
  void quantize(const X* x, int64_t t, Scratch& s) const {
    const int64_t NBH = H / q8act::kB;
    q8act::quantize_row(x, H, s.qx.data() + t * H, s.dx.data() + t * NBH, s.dsx.data() + t * NBH);
  }
  void gate_up(const int64_t* ids, int64_t k, int64_t b0, int64_t b1, Scratch& s) const {
    const int64_t NP1 = np1(), NBH = H / q8act::kB, G1 = g1();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p = b / NP1, pan = b % NP1, e = ids[p], t = p / k;
      q8act::panels<float, Fmt>(s.qx.data() + t * H, s.dx.data() + t * NBH, s.dsx.data() + t * NBH,
                                gq + e * G1, gs + e * s1, at(gm, e * s1), group,
                                gbias ? gbias + e * 2 * I : nullptr, s.h.data() + p * 2 * I, 1, 2 * I, H,
                                pan, pan + 1, wide);
    }
  }
  void activate(int64_t p0, int64_t p1, Scratch& s) const {
    const int64_t NBI = I / q8act::kB;
    for (int64_t p = p0; p < p1; ++p) {
      const float* hp = s.h.data() + p * 2 * I;
      float* ap = s.a.data() + p * I;
      for (int64_t i = 0; i < I; ++i) ap[i] = moe_act(act, hp[i], hp[I + i], limit, alpha);
      q8act::quantize_row(ap, I, s.qa.data() + p * I, s.da.data() + p * NBI, s.dsa.data() + p * NBI);
    }
  }
  template <typename O>
  void down(const int64_t* ids, const float* weights, int64_t T, int64_t k, int64_t pan0, int64_t pan1,
            O* out, Scratch& s) const {
    if (pan0 >= pan1) return;
    const int64_t NBI = I / q8act::kB, G2 = g2();
    for (int64_t p = 0; p < T * k; ++p) {
      const int64_t e = ids[p];
      q8act::panels<float, Fmt>(s.qa.data() + p * I, s.da.data() + p * NBI, s.dsa.data() + p * NBI,
                                dq + e * G2, ds + e * s2, at(dm, e * s2), group,
                                dbias ? dbias + e * H : nullptr, s.y.data() + p * H, 1, H, I, pan0, pan1,
                                wide);
    }
    moe_weighted_sum(weights, s.y.data(), out, T, k, H, pan0 * q8act::kNR, std::min(H, pan1 * q8act::kNR));
  }
};

}  // namespace moe
}  // namespace

#pragma GCC pop_options

#endif  // AVX2 + FMA + F16C
