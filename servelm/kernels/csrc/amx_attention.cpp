// servelm prompt attention on AMX tiles (namespace torch.ops.servelm_amx_attention).
//
//   available() -> bool
//       Whether this build has the AMX kernel (compiled where the compiler targets AMX-BF16)
//       and the kernel may run: the OS granted this process the AMX tile state.
//   paged_prefill_attention(q bf16 [T,H,D], k_cache, v_cache bf16 [NB,BS,KVH,D],
//                           block_tables int32 [B,MB], cu_seqlens_q int32 [B+1],
//                           start_pos int32 [B], scale) -> [T, H*D]
//       servelm_ops.paged_prefill_attention's contract (causal over keys 0..each query's
//       position, read through the block tables), for bf16 and head dims 64 and 128, with
//       both matmuls on AMX:
//   1. Every (sequence, KV head)'s keys are packed once, over the threads, into the tile
//      layouts: K^T as 16 keys x 32 dims blocks of bf16 pairs (the B operand of S = Q K^T)
//      and V as 32 keys x 16 dims blocks of key pairs (the B operand of O = P V), zero past
//      the last key.
//   2. Work item = (sequence, KV head, 16 consecutive queries), a head's largest first over
//      the threads; for each of the G query heads: S [16 x keys] = Q K^T in fp32 tiles (only
//      the key blocks the last query sees), a softmax per row in fp32 (AVX-512: the whole
//      row is in memory, no online rescaling; 2^x to 7.5e-5 relative), P rounded to bf16
//      (as the cpu op and a bf16 matmul with V round it), O = P V in fp32 tiles,
//      normalised by the row's sum.
// The score rows of an item live in per-thread scratch (16 x keys fp32: 256 KB at 4,096
// keys), so a long prompt's rows stay in the core's L2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "decode_attention.h"  // PagedKV, exp2_512, transpose16x16, kNegBig, kLog2e
#include "amx_tiles.h"        // SERVELM_AMX, amx_available, load_tile_config, store_b_tile, kBlk

namespace {

#ifdef SERVELM_AMX

// Every tile used here is 16 rows.
void configure_tiles() { load_tile_config({16, 16, 16, 16, 16, 16, 16, 16}); }


// Pack keys [k0, k0 + 32) of one KV head (zero past nk): K^T blocks for key blocks k0/16 and
// k0/16 + 1, V pairs block k0/32. kt: [nk32 / 16][D / 32][16 pairs][16 keys] dwords; vp:
// [nk32 / 32][D / 16][16 key pairs][16 dims] dwords.
template <int D>
void pack32(const PagedKV<c10::BFloat16>& kv, const int32_t* table, int h, int k0, int nk,
            uint32_t* kt, uint32_t* vp) {
  constexpr int DP = D / 32, ND = D / 16;
  alignas(64) static const uint16_t zero_row[D] = {};
  const int64_t head_off = static_cast<int64_t>(h) * D;
  auto krow = [&](int key) -> const uint16_t* {
    return key < nk ? reinterpret_cast<const uint16_t*>(kv.k + kv.offset(table, key) + head_off) : zero_row;
  };
  auto vrow = [&](int key) -> const uint16_t* {
    return key < nk ? reinterpret_cast<const uint16_t*>(kv.v + kv.offset(table, key) + head_off) : zero_row;
  };
  for (int half = 0; half < 2; ++half) {
    const int kb = k0 / 16 + half;
    const uint32_t* rows[16];  // key n's dim pairs
    for (int n = 0; n < 16; ++n) rows[n] = reinterpret_cast<const uint32_t*>(krow(k0 + half * 16 + n));
    for (int dp = 0; dp < DP; ++dp)
      store_b_tile(rows, dp * 16, kt + (static_cast<int64_t>(kb) * DP + dp) * kBlk);
  }
  const int pb = k0 / 32;
  for (int j = 0; j < 16; ++j) {
    const uint16_t* r0 = vrow(k0 + 2 * j);
    const uint16_t* r1 = vrow(k0 + 2 * j + 1);
    for (int db = 0; db < ND; ++db) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + db * 16)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + db * 16)));
      _mm512_store_si512(vp + (static_cast<int64_t>(pb) * ND + db) * kBlk + j * 16,
                         _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// S[16][ld] (fp32) = Q K^T for key blocks [0, nkb), two blocks at a time (tmm4 and tmm5):
// Q's DP tiles in tmm0..DP-1, K^T's in tmm6/7. (GCC's tile intrinsics paste the register
// number into the instruction's text, so it must be a literal: a macro, not a template.)
template <int DP>
void scores(const uint32_t* kt, int nkb, float* s, int ld) {
#define SERVELM_SCORE_BLOCK(TC, b)          \
  do {                                      \
    _tile_zero(TC);                         \
    _tile_loadd(6, (b), 64);                \
    _tile_dpbf16ps(TC, 0, 6);               \
    _tile_loadd(7, (b) + kBlk, 64);         \
    _tile_dpbf16ps(TC, 1, 7);               \
    if constexpr (DP == 4) {                \
      _tile_loadd(6, (b) + 2 * kBlk, 64);   \
      _tile_dpbf16ps(TC, 2, 6);             \
      _tile_loadd(7, (b) + 3 * kBlk, 64);   \
      _tile_dpbf16ps(TC, 3, 7);             \
    }                                       \
  } while (0)
  const int stride = ld * static_cast<int>(sizeof(float));
  int kb = 0;
  for (; kb + 2 <= nkb; kb += 2) {
    SERVELM_SCORE_BLOCK(4, kt + static_cast<int64_t>(kb) * DP * kBlk);
    SERVELM_SCORE_BLOCK(5, kt + static_cast<int64_t>(kb + 1) * DP * kBlk);
    _tile_stored(4, s + kb * 16, stride);
    _tile_stored(5, s + (kb + 1) * 16, stride);
  }
  if (kb < nkb) {
    SERVELM_SCORE_BLOCK(4, kt + static_cast<int64_t>(kb) * DP * kBlk);
    _tile_stored(4, s + kb * 16, stride);
  }
#undef SERVELM_SCORE_BLOCK
}

// O[16][D] (fp32) = P V over npb blocks of 32 keys; P: [16][ldp] bf16.
template <int D>
void pv(const uint16_t* p, int ldp, const uint32_t* vp, int npb, float* o) {
  constexpr int ND = D / 16;
  const int pstride = ldp * static_cast<int>(sizeof(uint16_t));
  for (int r = 0; r < ND; r += 4) {  // four 16-dim output tiles at a time: tmm0..3
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int pb = 0; pb < npb; ++pb) {
      const uint32_t* b = vp + (static_cast<int64_t>(pb) * ND + r) * kBlk;
      _tile_loadd(4, p + pb * 32, pstride);
      _tile_loadd(5, b, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + kBlk, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 2 * kBlk, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 3 * kBlk, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    const int ostride = D * static_cast<int>(sizeof(float));
    _tile_stored(0, o + r * 16, ostride);
    _tile_stored(1, o + (r + 1) * 16, ostride);
    _tile_stored(2, o + (r + 2) * 16, ostride);
    _tile_stored(3, o + (r + 3) * 16, ostride);
  }
}

inline __mmask16 first_lanes(int n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// Row i of S (keys [0, nv) valid, ld a multiple of 32) -> P row (bf16, p = 2^(s*c - max),
// zero from nv up to ld); returns the sum of the unrounded p. Whole 32-key runs unmasked,
// two accumulators each, both halves packed to bf16 by one instruction. 2^x of degree 3:
// P is rounded to bf16 (2^-9 relative) right after, so degree 5 bought nothing, and at head
// dim 64 the softmax costs about what the tile matmuls do.
inline float softmax_row(const float* s, int nv, int ld, float c, uint16_t* p) {
  __m512 mx0 = _mm512_set1_ps(kNegBig), mx1 = mx0;
  int j = 0;
  for (; j + 32 <= nv; j += 32) {
    mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(s + j));
    mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(s + j + 16));
  }
  for (; j < nv; j += 16)
    mx0 = _mm512_max_ps(mx0, _mm512_mask_loadu_ps(_mm512_set1_ps(kNegBig), first_lanes(nv - j), s + j));
  const __m512 cv = _mm512_set1_ps(c);
  const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1)) * c);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (j = 0; j + 32 <= nv; j += 32) {
    const __m512 e0 = exp2_512<3>(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), cv, mv));
    const __m512 e1 = exp2_512<3>(_mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), cv, mv));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  for (; j < ld; j += 16) {
    __m512 e = _mm512_setzero_ps();
    if (j < nv) {
      const __mmask16 m = first_lanes(nv - j);
      e = _mm512_maskz_mov_ps(m, exp2_512<3>(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + j), cv, mv)));
      sum0 = _mm512_add_ps(sum0, e);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// What both prompt kernels share: for each (sequence, KV head) a region of its keys rounded
// up to 32, D dwords a key (K and V in the kernel's layouts); the pack items (32 keys) and
// the work items (16 queries of one KV head) over the sequences of a call.
struct PrefillPlan {
  struct PackItem { int b, h, k0; };
  struct Item { int b, h, r0; int64_t cost; };
  int KVH;
  std::vector<int> nkeys;
  std::vector<int64_t> pack_off;
  at::Tensor packed;
  uint32_t* base;
  std::vector<PackItem> packs;
  std::vector<Item> items;

  PrefillPlan(const PagedKV<c10::BFloat16>& kv, const int32_t* cu, const int32_t* sp, int B, int D,
              const at::Tensor& q)
      : KVH(kv.kv_heads), nkeys(B), pack_off(static_cast<size_t>(B) * kv.kv_heads + 1, 0) {
    check_prefill_tables(kv, cu, sp, B, "servelm_amx_attention.paged_prefill_attention");
    for (int b = 0; b < B; ++b) {
      nkeys[b] = sp[b] + cu[b + 1] - cu[b];
      for (int h = 0; h < KVH; ++h)
        pack_off[b * KVH + h + 1] = pack_off[b * KVH + h] + keys32(b) * D;
    }
    packed = at::empty({pack_off.back() + 16}, q.options().dtype(at::kInt));
    base = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(packed.data_ptr<int32_t>()) + 63) & ~uintptr_t(63));
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < KVH; ++h) {
        for (int k0 = 0; k0 < nkeys[b]; k0 += 32) packs.push_back({b, h, k0});
        for (int r0 = 0; r0 < cu[b + 1] - cu[b]; r0 += 16) items.push_back({b, h, r0, sp[b] + r0 + 16});
      }
    // One (sequence, KV head) at a time, its longest rows first: the threads share that
    // head's packed K/V while it sits in their L2 (ordering by cost alone cycled through every
    // head's, and at 4,000 keys, 1 MB a head, each item read them from L3 again: 1.09-1.11x).
    std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
      return x.b != y.b ? x.b < y.b : x.h != y.h ? x.h < y.h : x.cost > y.cost;
    });
  }
  int64_t keys32(int b) const { return (nkeys[b] + 31) / 32 * 32; }
  uint32_t* region(int b, int h) const { return base + pack_off[b * KVH + h]; }
};

// Every pack item, then every work item (the tiles configured for each thread), over the
// threads: packs split evenly, items handed out one at a time.
template <typename Pack, typename Run>
void run_plan(const PrefillPlan& plan, Pack pack_one, Run run_item) {
  const int nthreads = std::max(1, at::get_num_threads());
  const int64_t npacks = static_cast<int64_t>(plan.packs.size());
  const int64_t nitems = static_cast<int64_t>(plan.items.size());
  if (nthreads == 1 || nitems <= 1) {
    for (const auto& pk : plan.packs) pack_one(pk);
    configure_tiles();
    for (const auto& it : plan.items) run_item(it);
    _tile_release();
  } else {
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < npacks; ++i) pack_one(plan.packs[i]);
      configure_tiles();
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < nitems; ++i) run_item(plan.items[i]);
      _tile_release();
    }
  }
}

template <int D>
void prefill_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& cu_q, const at::Tensor& start_pos,
                 double scale, at::Tensor& out) {
  using BF = c10::BFloat16;
  constexpr int DP = D / 32;
  const PagedKV<BF> kv(k_cache, v_cache, block_tables);
  const int H = q.size(1), KVH = kv.kv_heads, G = H / KVH;
  const int B = start_pos.numel();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const BF* qptr = q.data_ptr<BF>();
  const int32_t* cu = cu_q.data_ptr<int32_t>();
  const int32_t* sp = start_pos.data_ptr<int32_t>();
  BF* optr = out.data_ptr<BF>();
  const float c = static_cast<float>(scale) * kLog2e;

  // Packed K^T / V per (sequence, KV head).
  const PrefillPlan plan(kv, cu, sp, B, D, q);
  auto kt_of = [&](int b, int h) { return plan.region(b, h); };
  auto vp_of = [&](int b, int h) { return kt_of(b, h) + plan.keys32(b) * D / 2; };

  auto run_item = [&](const PrefillPlan::Item& it) {
    const int b = it.b, h = it.h, r0 = it.r0;
    const int rn = std::min(16, cu[b + 1] - cu[b] - r0);
    const int pos0 = sp[b] + r0;           // the first query's position
    const int kend = pos0 + rn;            // keys [0, kend) the last query sees
    const int nkb = (kend + 15) / 16;
    const int ld = (kend + 31) / 32 * 32;
    static thread_local std::unique_ptr<float[]> mem;
    static thread_local size_t mem_size = 0;
    // S [16][ld] fp32, P [16][ld] bf16, O [16][D] fp32, padded Q [16][D] bf16.
    const size_t need = 16 * ld + 8 * ld + 16 * D + 8 * D + 16;
    if (mem_size < need) {
      mem.reset(new float[need]);
      mem_size = need;
    }
    float* s = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(mem.get()) + 63) & ~uintptr_t(63));
    uint16_t* p = reinterpret_cast<uint16_t*>(s + 16 * ld);
    float* o = s + 16 * ld + 8 * ld;
    BF* qpad = reinterpret_cast<BF*>(o + 16 * D);
    const uint32_t* kt = kt_of(b, h);
    const uint32_t* vp = vp_of(b, h);
    for (int g = 0; g < G; ++g) {
      const int hq = h * G + g;
      const BF* q0 = qptr + static_cast<int64_t>(cu[b] + r0) * qs0 + static_cast<int64_t>(hq) * qs1;
      const BF* qa = q0;
      int64_t qstride = qs0 * static_cast<int64_t>(sizeof(BF));
      if (rn < 16) {  // a short last tile: its rows copied, the rest zero
        std::memset(static_cast<void*>(qpad), 0, sizeof(BF) * 16 * D);
        for (int i = 0; i < rn; ++i) std::memcpy(qpad + i * D, q0 + i * qs0, sizeof(BF) * D);
        qa = qpad;
        qstride = D * sizeof(BF);
      }
      _tile_loadd(0, qa, qstride);
      _tile_loadd(1, qa + 32, qstride);
      if constexpr (DP == 4) {
        _tile_loadd(2, qa + 64, qstride);
        _tile_loadd(3, qa + 96, qstride);
      }
      scores<DP>(kt, nkb, s, ld);
      float l[16];
      for (int i = 0; i < 16; ++i) {
        if (i < rn) {
          l[i] = softmax_row(s + i * ld, pos0 + i + 1, ld, c, p + i * ld);
        } else {
          std::memset(p + i * ld, 0, sizeof(uint16_t) * ld);
          l[i] = 1.f;
        }
      }
      pv<D>(p, ld, vp, ld / 32, o);
      for (int i = 0; i < rn; ++i) {
        BF* dst = optr + static_cast<int64_t>(cu[b] + r0 + i) * H * D + static_cast<int64_t>(hq) * D;
        const __m512 inv = _mm512_set1_ps(1.f / l[i]);
        for (int d = 0; d < D; d += 16) {
          const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d), inv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(x));
        }
      }
    }
  };

  run_plan(plan, [&](const PrefillPlan::PackItem& pk) {
    pack32<D>(kv, kv.table(pk.b), pk.h, pk.k0, plan.nkeys[pk.b], kt_of(pk.b, pk.h), vp_of(pk.b, pk.h));
  }, run_item);
}

// ---- head dim 64: key-major, flash-style ---------------------------------------------------
// S^T = K Q^T (rows: 16 keys, lanes: the item's 16 queries), so the softmax runs lane-wise
// over key vectors with no horizontal reductions; online over chunks of 32 keys, the running
// max raised only when a key passes it by 2^8 (kTau), which real rows rarely need after their
// first keys; O^T += V^T P^T with O^T (64 dims x 16 queries) held in tmm0..3 for the whole
// row of keys. A chunk's P V runs one chunk late, so the tiles multiply while the next
// chunk's exponentials are computed. K is packed row-major, V^T chunk-major (32 keys).

// Pack keys [k0, k0 + 32) of one KV head: K rows into kp (row-major [nk32][64] bf16) and V^T
// into vt (chunk k0 / 32: [64 dims][32 keys] bf16), zero past nk.
void pack_fa64(const PagedKV<c10::BFloat16>& kv, const int32_t* table, int h, int k0, int nk,
               uint16_t* kp, uint16_t* vt) {
  constexpr int D = 64;
  alignas(64) static const uint16_t zero_row[D] = {};
  const int64_t head_off = static_cast<int64_t>(h) * D;
  auto krow = [&](int key) -> const uint16_t* {
    return key < nk ? reinterpret_cast<const uint16_t*>(kv.k + kv.offset(table, key) + head_off) : zero_row;
  };
  auto vrow = [&](int key) -> const uint16_t* {
    return key < nk ? reinterpret_cast<const uint16_t*>(kv.v + kv.offset(table, key) + head_off) : zero_row;
  };
  for (int n = 0; n < 32; ++n) std::memcpy(kp + static_cast<int64_t>(k0 + n) * D, krow(k0 + n), D * 2);
  // pairs[j][d] = (v[k0 + 2j][d], v[k0 + 2j + 1][d]), then transposed to [d][j].
  alignas(64) uint32_t pairs[16][D];
  for (int j = 0; j < 16; ++j) {
    const uint16_t* r0 = vrow(k0 + 2 * j);
    const uint16_t* r1 = vrow(k0 + 2 * j + 1);
    for (int db = 0; db < D / 16; ++db) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + db * 16)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + db * 16)));
      _mm512_store_si512(&pairs[j][db * 16], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  uint32_t* dst = reinterpret_cast<uint32_t*>(vt + static_cast<int64_t>(k0 / 32) * D * 32);
  for (int db = 0; db < D / 16; ++db) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(&pairs[j][db * 16]);
    transpose16x16(r);
    for (int d = 0; d < 16; ++d) _mm512_store_si512(dst + (db * 16 + d) * 16, r[d]);
  }
}

// O^T rows (tmm0..3 stored to o: [64][16] fp32) times a per-lane factor, reloaded.
inline void rescale_o(float* o, __m512 alpha) {
  _tile_stored(0, o, 64);
  _tile_stored(1, o + 256, 64);
  _tile_stored(2, o + 512, 64);
  _tile_stored(3, o + 768, 64);
  for (int r = 0; r < 64; ++r) _mm512_store_ps(o + r * 16, _mm512_mul_ps(_mm512_load_ps(o + r * 16), alpha));
  _tile_loadd(0, o, 64);
  _tile_loadd(1, o + 256, 64);
  _tile_loadd(2, o + 512, 64);
  _tile_loadd(3, o + 768, 64);
}

// S^T for keys [k0, k0 + 32) into sb [32][16] fp32: K rows (tmm7) times Q^T (tmm4, tmm5).
inline void scores_t(const uint16_t* kp, int k0, float* sb) {
  constexpr int D = 64;
  for (int half = 0; half < 2; ++half) {
    const uint16_t* kr = kp + static_cast<int64_t>(k0 + 16 * half) * D;
    _tile_zero(6);
    _tile_loadd(7, kr, D * 2);
    _tile_dpbf16ps(6, 7, 4);
    _tile_loadd(7, kr + 32, D * 2);
    _tile_dpbf16ps(6, 7, 5);
    _tile_stored(6, sb + half * 256, 64);
  }
}

template <int D>
void prefill_amx_fa(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& cu_q, const at::Tensor& start_pos,
                    double scale, at::Tensor& out) {
  static_assert(D == 64, "the key-major kernel holds O^T for 64 dims in tmm0..3");
  using BF = c10::BFloat16;
  const PagedKV<BF> kv(k_cache, v_cache, block_tables);
  const int H = q.size(1), KVH = kv.kv_heads, G = H / KVH;
  const int B = start_pos.numel();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const BF* qptr = q.data_ptr<BF>();
  const int32_t* cu = cu_q.data_ptr<int32_t>();
  const int32_t* sp = start_pos.data_ptr<int32_t>();
  BF* optr = out.data_ptr<BF>();
  const float c = static_cast<float>(scale) * kLog2e;

  // K rows and V^T per (sequence, KV head).
  const PrefillPlan plan(kv, cu, sp, B, D, q);
  auto kp_of = [&](int b, int h) { return reinterpret_cast<uint16_t*>(plan.region(b, h)); };
  auto vt_of = [&](int b, int h) { return kp_of(b, h) + plan.keys32(b) * D; };
  constexpr float kTau = 8.f;  // a row's max is raised only when a key passes it by 2^8
  alignas(64) static const uint16_t zero_q[D] = {};
  const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                            23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);

  auto run_item = [&](const PrefillPlan::Item& it) {
    const int b = it.b, h = it.h, r0 = it.r0;
    const int rn = std::min(16, cu[b + 1] - cu[b] - r0);
    const int pos0 = sp[b] + r0;
    const int kend = pos0 + rn;
    const int nch = (kend + 31) / 32;
    const int full = pos0 / 32;  // chunks every query sees whole
    alignas(64) float sb[2][512];
    alignas(64) uint32_t pbs[2][256];
    alignas(64) uint32_t qt[2 * kBlk];
    alignas(64) float ob[64 * 16];
    const uint16_t* kp = kp_of(b, h);
    const uint16_t* vt = vt_of(b, h);
    const __m512i qpos = _mm512_add_epi32(_mm512_set1_epi32(pos0), lane);
    for (int g = 0; g < G; ++g) {
      const int hq = h * G + g;
      const BF* q0 = qptr + static_cast<int64_t>(cu[b] + r0) * qs0 + static_cast<int64_t>(hq) * qs1;
      const uint32_t* rows[16];
      for (int j = 0; j < 16; ++j)
        rows[j] = reinterpret_cast<const uint32_t*>(j < rn ? reinterpret_cast<const uint16_t*>(q0 + j * qs0) : zero_q);
      store_b_tile(rows, 0, qt);
      store_b_tile(rows, 16, qt + kBlk);
      _tile_loadd(4, qt, 64);
      _tile_loadd(5, qt + kBlk, 64);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      __m512 m = _mm512_set1_ps(kNegBig), l = _mm512_setzero_ps();
      const __m512 cv = _mm512_set1_ps(c);
      int pending = -1;
      auto pv_chunk = [&](int pc) {
        const uint16_t* vc = vt + static_cast<int64_t>(pc) * D * 32;
        _tile_loadd(6, pbs[pc & 1], 64);
        _tile_loadd(7, vc, 64);
        _tile_dpbf16ps(0, 7, 6);
        _tile_loadd(7, vc + 16 * 32, 64);
        _tile_dpbf16ps(1, 7, 6);
        _tile_loadd(7, vc + 32 * 32, 64);
        _tile_dpbf16ps(2, 7, 6);
        _tile_loadd(7, vc + 48 * 32, 64);
        _tile_dpbf16ps(3, 7, 6);
      };
      auto exp_whole = [&](const float* s, uint32_t* pb, __m512& s0, __m512& s1) {
        for (int r = 0; r < 16; ++r) {
          const __m512 e0 = exp2_512<3>(_mm512_fmsub_ps(_mm512_load_ps(s + 32 * r), cv, m));
          const __m512 e1 = exp2_512<3>(_mm512_fmsub_ps(_mm512_load_ps(s + 32 * r + 16), cv, m));
          s0 = _mm512_add_ps(s0, e0);
          s1 = _mm512_add_ps(s1, e1);
          _mm512_store_si512(pb + r * 16, _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
        }
      };
      scores_t(kp, 0, sb[0]);
      for (int ch = 0; ch < nch; ++ch) {
        const float* s = sb[ch & 1];
        if (ch + 1 < nch) scores_t(kp, 32 * (ch + 1), sb[(ch + 1) & 1]);
        if (pending >= 0) pv_chunk(pending);  // pbs[pending & 1] was written a chunk ago
        pending = ch;
        const int k0 = 32 * ch;
        uint32_t* pb = pbs[ch & 1];
        const bool whole = ch < full;
        if (whole && ch > 0) {
          // Against the running max as it is: unless some query's sum over these keys passes
          // 2^13 (a key above the max by more than that allows, or many near it), done.
          __m512 s0 = _mm512_setzero_ps(), s1 = s0;
          exp_whole(s, pb, s0, s1);
          const __m512 cs = _mm512_add_ps(s0, s1);
          if (!_mm512_cmp_ps_mask(cs, _mm512_set1_ps(8192.f), _CMP_NLE_UQ)) {
            l = _mm512_add_ps(l, cs);
            continue;
          }
        }
        __m512 cm0 = _mm512_set1_ps(kNegBig), cm1 = cm0, cm2 = cm0, cm3 = cm0;
        if (whole) {
          for (int k = 0; k < 32; k += 4) {
            cm0 = _mm512_max_ps(cm0, _mm512_load_ps(s + k * 16));
            cm1 = _mm512_max_ps(cm1, _mm512_load_ps(s + (k + 1) * 16));
            cm2 = _mm512_max_ps(cm2, _mm512_load_ps(s + (k + 2) * 16));
            cm3 = _mm512_max_ps(cm3, _mm512_load_ps(s + (k + 3) * 16));
          }
        } else {
          for (int k = 0; k < 32; ++k) {  // key k0 + k: the lanes whose position reaches it
            const __mmask16 km = _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32(k0 + k));
            cm0 = _mm512_mask_max_ps(cm0, km, cm0, _mm512_load_ps(s + k * 16));
          }
        }
        // In units of the raw scores (c > 0): t = s c - m c.
        const __m512 cm = _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(cm0, cm1), _mm512_max_ps(cm2, cm3)), cv);
        if (_mm512_cmp_ps_mask(cm, _mm512_add_ps(m, _mm512_set1_ps(kTau)), _CMP_GT_OQ)) {
          const __m512 mn = _mm512_max_ps(m, cm);
          const __m512 alpha = exp2_512<3>(_mm512_max_ps(_mm512_sub_ps(m, mn), _mm512_set1_ps(-126.f)));
          if (ch > 0) {
            l = _mm512_mul_ps(l, alpha);
            rescale_o(ob, alpha);
          }
          m = mn;
        }
        __m512 s0 = _mm512_setzero_ps(), s1 = s0;
        if (whole) {
          exp_whole(s, pb, s0, s1);
        } else {
          for (int r = 0; r < 16; ++r) {
            const __mmask16 k0m = _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32(k0 + 2 * r));
            const __mmask16 k1m = _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32(k0 + 2 * r + 1));
            const __m512 e0 = _mm512_maskz_mov_ps(k0m, exp2_512<3>(_mm512_fmsub_ps(_mm512_load_ps(s + 32 * r), cv, m)));
            const __m512 e1 = _mm512_maskz_mov_ps(k1m, exp2_512<3>(_mm512_fmsub_ps(_mm512_load_ps(s + 32 * r + 16), cv, m)));
            s0 = _mm512_add_ps(s0, e0);
            s1 = _mm512_add_ps(s1, e1);
            _mm512_store_si512(pb + r * 16, _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
          }
        }
        l = _mm512_add_ps(l, _mm512_add_ps(s0, s1));
      }
      if (pending >= 0) pv_chunk(pending);
      // O[j][d] = O^T[d][j] / l[j]: scale the rows of O^T, then transpose 16 x 16 blocks.
      _tile_stored(0, ob, 64);
      _tile_stored(1, ob + 256, 64);
      _tile_stored(2, ob + 512, 64);
      _tile_stored(3, ob + 768, 64);
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
      for (int db = 0; db < 4; ++db) {
        __m512i r[16];
        for (int d = 0; d < 16; ++d)
          r[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(ob + (db * 16 + d) * 16), inv));
        transpose16x16(r);
        for (int j = 0; j < rn; ++j) {
          BF* dst = optr + static_cast<int64_t>(cu[b] + r0 + j) * H * D + static_cast<int64_t>(hq) * D + db * 16;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[j])));
        }
      }
    }
  };

  run_plan(plan, [&](const PrefillPlan::PackItem& pk) {
    pack_fa64(kv, kv.table(pk.b), pk.h, pk.k0, plan.nkeys[pk.b], kp_of(pk.b, pk.h), vt_of(pk.b, pk.h));
  }, run_item);
}

#endif  // SERVELM_AMX

bool available() { return amx_available(); }

// The key-major kernel from this many keys in the longest sequence: below it its per-item
// transposes (Q^T in, O^T out) cost more than it saves (16 sequences of 128 keys: 0.95x;
// 8 of 256: 1.06x; one of 2,048: 1.33x).
[[maybe_unused]] constexpr int kKeyMajorMinKeys = 256;

[[maybe_unused]] int longest_keys(const at::Tensor& cu_q, const at::Tensor& start_pos) {
  const int32_t* cu = cu_q.data_ptr<int32_t>();
  const int32_t* sp = start_pos.data_ptr<int32_t>();
  int most = 0;
  for (int64_t b = 0; b < start_pos.numel(); ++b) most = std::max(most, sp[b] + cu[b + 1] - cu[b]);
  return most;
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& cu_seqlens_q, const at::Tensor& start_pos,
                                   double scale) {
  const char* name = "servelm_amx_attention.paged_prefill_attention";
  TORCH_CHECK(available(), name, ": AMX-BF16 is not available here (not built for it, or the OS "
              "refused the tile state)");
  check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, name);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              name, ": q and the caches must be bf16");
  const int H = q.size(1), D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128, name, ": head dim ", D, " unsupported (64 or 128)");
  auto out = at::empty({q.size(0), static_cast<int64_t>(H) * D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.size(0) == 0) return out;
#ifdef SERVELM_AMX
  if (D == 64 && longest_keys(cu_seqlens_q, start_pos) >= kKeyMajorMinKeys)
    prefill_amx_fa<64>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, out);
  else if (D == 64) prefill_amx<64>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, out);
  else prefill_amx<128>(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, out);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(servelm_amx_attention, m) {
  m.def("available() -> bool", &available);  // no tensor to dispatch on: a catch-all kernel
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor start_pos, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelm_amx_attention, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
