"""Building blocks shared by model families: RMSNorm, rotary embedding, attention (its
projections, norms and rotary; the attention over the paged cache is servelm.attention's),
gated MLP.

The op modules (OpModule: RMSNorm, Attention's rotary + KV write, GatedMLP's activation,
the MoE's) each have a PyTorch reference and, where servelm's C++ ops run, a version on
them. Which one a module runs is chosen once, when the model is final (`select_ops`, the
ModelRunner's, before it pins the modules' attributes): the module keeps the chosen
function and its forward calls it, with no flag per call. A module not selected runs the
reference."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from servelm.models import kv_quant

if TYPE_CHECKING:
    from servelm.attention.metadata import ForwardBatch


# ---- fused CPU kernels (servelm/kernels/csrc/ops.cpp) and their PyTorch references ----------

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the weight dtype, as the reference does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual)."""
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def fused_add_layer_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """residual += x (in place); returns layer_norm(residual)."""
    return layer_norm_ref(residual.add_(x), weight, bias, eps)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_kv_write_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_heads: int, num_kv_heads: int, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> None:
    """Rotates the q part of qkv [T, (H + 2 KVH) * D] in place; writes rotated k and v into
    their cache slots (quantised, with their scales, into a quantised cache)."""
    T, d = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q.copy_(apply_rotary(q.view(T, num_heads, d), cos, sin).view(T, -1))
    kv_quant.write(k_cache, k_scale, slot_mapping, apply_rotary(k.view(T, num_kv_heads, d), cos, sin))
    kv_quant.write(v_cache, v_scale, slot_mapping, v.view(T, num_kv_heads, d))


def kv_write_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_heads: int, num_kv_heads: int, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """`rotary_kv_write_ref` of a layer without rotary (cos and sin unused): k and v written
    into their cache slots as projected, q left as it is."""
    T, d = qkv.shape[0], k_cache.shape[-1]
    _, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    kv_quant.write(k_cache, k_scale, slot_mapping, k.reshape(T, num_kv_heads, d))
    kv_quant.write(v_cache, v_scale, slot_mapping, v.reshape(T, num_kv_heads, d))


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, window: int = 0, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], one query per sequence attending its first context_lens[b] tokens
    (window > 0: only the last `window` of them). A quantised cache comes with its scales
    [num_blocks, block_size, KVH] and is dequantised to q's dtype as it is read."""
    bs, kvh, d = k_cache.shape[1:]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        blocks = block_tables[b, :-(-n // bs)].long()
        k, v = kv_quant.gather_rows(k_cache, blocks), kv_quant.gather_rows(v_cache, blocks)
        if k_scale is not None:
            k = kv_quant.dequantize(k, k_scale[blocks], q.dtype)
            v = kv_quant.dequantize(v, v_scale[blocks], q.dtype)
        k = k.reshape(-1, kvh, d)[:n].transpose(0, 1)                  # [KVH, n, D]
        v = v.reshape(-1, kvh, d)[:n].transpose(0, 1)
        if window:
            k, v = k[:, -window:], v[:, -window:]
        qb = q[b].view(kvh, -1, d)                                       # [KVH, G, D]
        out[b] = F.scaled_dot_product_attention(qb, k, v, scale=scale).reshape(-1, d)
    return out


def _ops():
    return torch.ops.servelm_ops


class OpModule(nn.Module):
    """A module whose arithmetic has a PyTorch reference and a version on servelm's C++ ops
    (servelm/kernels/csrc/ops.cpp): `select(kernels)` binds one, once, as plain function
    attributes its forward calls (functions, not bound methods: no reference cycle, and
    nothing that pin_module_attributes replaces). Built, a module runs the reference."""

    uses_kernels = False  # the last selection

    def select(self, kernels: bool) -> None:
        raise NotImplementedError


def select_ops(model: nn.Module, kernels: bool) -> None:
    """Every op module under `model` (itself included) runs servelm's C++ ops (kernels True;
    the caller has checked they load) or the PyTorch references, from now on. Call it once
    the weights are final (loaded, quantised, tuned), before pin_module_attributes."""
    from servelm.layers.lora import LoRALinear

    for m in model.modules():
        if isinstance(m, (OpModule, LoRALinear)):
            m.select(kernels)


class RMSNorm(OpModule):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.select(False)

    def select(self, kernels: bool) -> None:
        self.uses_kernels = kernels
        self._norm = _ops().rms_norm if kernels else rms_norm_ref
        self._add_norm = _ops().fused_add_rms_norm if kernels else fused_add_rms_norm_ref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place), then normalise it: one pass with the kernels."""
        return self._add_norm(x, residual, self.weight, self.eps)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of x [T, heads, D] on the C++ op, a head a row (the arithmetic
    the DecodeStack's q/k norms run)."""
    return _ops().rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


class LayerNorm(OpModule):
    """LayerNorm, with a bias (Starcoder2) or without (Cohere), with RMSNorm's interface:
    PyTorch's op as the reference, servelm's C++ op (the arithmetic the DecodeStack runs) on
    the kernels."""

    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps
        self.select(False)

    def select(self, kernels: bool) -> None:
        self.uses_kernels = kernels
        self._norm = _ops().layer_norm if kernels else layer_norm_ref
        self._add_norm = _ops().fused_add_layer_norm if kernels else fused_add_layer_norm_ref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # the op takes rows: [T, N] (a per-head norm's [T, heads, D] too)
        return self._norm(x.reshape(-1, shape[-1]), self.weight, self.bias, self.eps).view(shape)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place), then normalise it: one pass with the kernels."""
        return self._add_norm(x.contiguous(), residual, self.weight, self.bias, self.eps)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """The model's norm: RMSNorm ("rms"), LayerNorm with a bias ("layer") or without
    ("layer_no_bias")."""
    if kind == "rms":
        return RMSNorm(dim, eps)
    return LayerNorm(dim, eps, bias=kind == "layer")


class NoNorm(nn.Module):
    """In a norm's place where a layer has none (OLMo 2's pre-norms): forward returns x,
    add_forward adds x into the residual (in place) and returns the residual itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual.add_(x)


class HeadRMSNorm(RMSNorm):
    """The per-head q/k norm of an attention layer (x [T, heads, D]; the kernels' rotary + KV
    write then takes q and k normalised in place)."""

    def select(self, kernels: bool) -> None:
        super().select(kernels)
        if kernels:
            self._norm = head_rms_norm


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table over all positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        mscale = 1.0
        if scaling and scaling["rope_type"] == "yarn":
            inv_freq, mscale = _yarn(theta, head_dim, scaling)
        elif scaling:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, head_dim]
        # YaRN scales the rotated q and k (so the logits) by mscale: folded into the table.
        self.register_buffer("cos", emb.cos() * mscale, persistent=False)
        self.register_buffer("sin", emb.sin() * mscale, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _yarn(theta: float, dim: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those turning more than
    beta_fast times kept, a linear ramp between; attention scaled by 0.1 ln(factor) + 1
    (or attention_factor, or the mscale / mscale_all_dim ratio)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale(m) / mscale(m_all) if m and m_all else mscale()

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns this many times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv_freq, float(attn)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling["rope_type"]
    if kind == "freq_factors":  # a divisor per frequency (GGUF's rope_freqs tensor)
        factors = torch.tensor(scaling["factors"], dtype=inv_freq.dtype)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors for "
                             f"{inv_freq.numel()} rotary frequencies")
        return inv_freq / factors
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "proportional":
        # Gemma 4's full layers: the first partial_rotary_factor of the head's frequencies
        # (exponents over the whole head_dim) turn, the rest are 0 (cos 1, sin 0: those
        # dims pass through unchanged), all divided by factor.
        head_dim, part = 2 * len(inv_freq), scaling.get("partial_rotary_factor")
        keep = int((1.0 if part is None else float(part)) * head_dim // 2)
        inv_freq = torch.cat((inv_freq[:keep], torch.zeros(len(inv_freq) - keep)))
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half_rows(w: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """q or k projection rows (weight or bias, whole heads of head_dim) of a checkpoint
    whose rotary turns adjacent pairs (dims 2i, 2i + 1 at frequency i), reordered so each
    head's first rotary_dim rows are the pairs' first members then their second: the
    rotate-half rotary (dims i, i + rotary_dim / 2 at frequency i) then turns the same
    pairs, and q . k is unchanged since q and k move alike."""
    perm = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, head_dim)))
    heads = w.shape[0] // head_dim
    return w.reshape(heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, rotary_dim]. With rotary_dim < head_dim
    (partial rotary) only the first rotary_dim dims turn; the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class Attention(OpModule):
    """Multi-head attention with grouped-query KV heads over a paged KV cache.

    Options (the shared block every family builds from): a q/k/v bias, an RMSNorm over each
    head's q and k before the rotary (qk_norm), a sliding window (the last `window` keys),
    a softmax scale other than head_dim ** -0.5, and a soft-cap on the scores (softcap:
    scores = softcap * tanh(scores / softcap), Gemma 2; q/k norms over the whole projection
    rather than each head, qk_norm_whole, OLMo 2; an o_proj bias, out_bias, Starcoder2;
    queries scaled by their position after the rotary, q_scale_beta / q_scale_period,
    Ministral 3, or Llama 4's attention temperature, q_scale_offset 1; every attention
    backend runs the soft-cap), no rotary
    at all (rope False: SmolLM3's NoPE layers; the KV write then takes k as projected),
    chunked local attention (chunk: a query attends only the keys of its own chunk of
    `chunk` positions, Llama 4's rope layers; every attention backend runs it) and a weightless RMS ("L2") norm of each head's q and k after the
    rotary (qk_l2_norm, Llama 4; the projection's norms, rotary and KV write then run in
    PyTorch, since the C++ op writes k rotated but not normalised); Gemma 4's a weightless
    RMS norm of each head's v (v_norm), the value taken from the key projection as
    projected, before the k norm and the rotary (k_eq_v: qkv_proj has q and k rows only),
    and a layer reading an earlier layer's K/V (kv_shared: qkv_proj
    has q rows only, no k norm, nothing written; the cache it is handed is that layer's).
    The rotary table is
    the caller's (a model may hold one per layer kind); an output gate (output_gate: the
    output times sigmoid(attn_gate(x)) before o_proj, Qwen3-Next); with a partial rotary (rotary_dim <
    head_dim) it is narrower than head_dim. The op chosen once (select): the projection's norms, rotary
    and KV write in PyTorch (qkv_ref) or in one C++ pass (qkv_kernels); the attention
    itself is the batch's backend's.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, qk_norm: bool = False, eps: float = 1e-6,
                 window: int | None = None, scale: float | None = None,
                 rotary_dim: int | None = None, softcap: float | None = None,
                 rope: bool = True, qk_norm_whole: bool = False, out_bias: bool = False,
                 q_scale_beta: float = 0.0, q_scale_period: int = 0,
                 q_scale_offset: float = 0.0, chunk: int | None = None,
                 qk_l2_norm: bool = False, v_norm: bool = False, k_eq_v: bool = False,
                 kv_shared: bool = False, output_gate: bool = False):
        super().__init__()
        # Everything the constructor took, so tensor parallelism can rebuild it on fewer heads.
        self.options = dict(hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, bias=bias, qk_norm=qk_norm, eps=eps,
                            window=window, scale=scale, rotary_dim=rotary_dim,
                            softcap=softcap, rope=rope, qk_norm_whole=qk_norm_whole,
                            out_bias=out_bias, q_scale_beta=q_scale_beta,
                            q_scale_period=q_scale_period, q_scale_offset=q_scale_offset,
                            chunk=chunk, qk_l2_norm=qk_l2_norm, v_norm=v_norm,
                            k_eq_v=k_eq_v, kv_shared=kv_shared,
                            output_gate=output_gate)
        if qk_norm_whole and (k_eq_v or kv_shared):
            raise ValueError("k_eq_v and kv_shared take per-head q/k norms")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # The checkpoint's projections fused into one matmul, their rows in this order: q,
        # k and v; q and k where v is k's projection (k_eq_v); q alone (kv_shared).
        self.qkv_parts = (("q_proj",) if kv_shared else ("q_proj", "k_proj") if k_eq_v
                          else ("q_proj", "k_proj", "v_proj"))
        self.qkv_proj = nn.Linear(hidden, self.q_size + (len(self.qkv_parts) - 1) * self.kv_size,
                                  bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=out_bias)
        # The output gated by sigmoid(attn_gate(x)) before o_proj (Qwen3-Next, Qwen3.5).
        self.attn_gate = nn.Linear(hidden, self.q_size, bias=False) if output_gate else None
        self.qk_norm_whole = qk_norm_whole
        if qk_norm and qk_norm_whole:
            self.q_norm, self.k_norm = RMSNorm(self.q_size, eps), RMSNorm(self.kv_size, eps)
        else:
            self.q_norm = HeadRMSNorm(head_dim, eps) if qk_norm else None
            self.k_norm = HeadRMSNorm(head_dim, eps) if qk_norm and not kv_shared else None
        self.v_norm, self.k_eq_v, self.kv_shared = v_norm, k_eq_v, kv_shared
        self.window = window
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.rotary_dim = rotary_dim or head_dim
        self.softcap = softcap
        self.rope = rope
        self.q_scale_beta, self.q_scale_period = q_scale_beta, q_scale_period
        # The position scale's form, chosen once: Ministral 3's, or Llama 4's (offset 1).
        self._q_scale = temperature_scale if q_scale_offset else query_scale
        self.q_scale_offset = q_scale_offset
        self.chunk = chunk
        self.qk_l2_norm, self.eps = qk_l2_norm, eps
        self.select(False)

    def select(self, kernels: bool) -> None:
        self.uses_kernels = kernels
        self._qkv = (q_only if self.kv_shared
                     else qkv_kernels if kernels and not self.qk_l2_norm
                     else qkv_ref)
        # The kernel's rotary turns every dim of a head; a partial rotary runs the reference
        # rotary + KV write on the kernels' in-place layout.
        self._rotary_kv_write = (kv_write_ref if not self.rope
                                 else _ops().rotary_kv_write
                                 if kernels and self.rotary_dim == self.head_dim
                                 else rotary_kv_write_ref)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv_cache: tuple[torch.Tensor, torch.Tensor],
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's K/V is written; with rows, only those tokens' outputs are computed
        past attention (o_proj) and returned. Attention itself is the batch's backend's."""
        # (k, v) or, quantised, (k, v, k_scale, v_scale): see KVCache.layers.
        k_cache, v_cache, *scales = kv_cache
        scales = tuple(scales) or None
        q = self._qkv(self, x, cos, sin, batch.slot_mapping, k_cache, v_cache, scales)
        if self.q_scale_beta:
            q = self._q_scale(q, batch.positions, self.q_scale_beta, self.q_scale_period,
                              self.q_scale_offset)
        out = batch.attn.backend.forward(self, q, k_cache, v_cache, scales, batch.attn)
        if rows is not None:
            out = out[rows]
        if self.attn_gate is not None:
            gate = self.attn_gate(x if rows is None else x[rows])
            out = out.reshape(out.shape[0], self.q_size) * torch.sigmoid(gate)
        return self.o_proj(out)


def query_scale(q: torch.Tensor, positions: torch.Tensor, beta: float, period: int,
                offset: float = 0.0) -> torch.Tensor:
    """q [T, H, D] times 1 + beta * ln(1 + floor(position / period)) (Ministral 3), the
    scale computed in fp32 as transformers does, then in q's dtype."""
    s = 1 + beta * torch.log(1 + torch.floor(positions / period))
    return q * s.to(q.dtype).view(-1, 1, 1)


def temperature_scale(q: torch.Tensor, positions: torch.Tensor, beta: float, period: int,
                      offset: float = 1.0) -> torch.Tensor:
    """Llama 4's attention temperature (attn_temperature_tuning): q [T, H, D] times
    log1p(floor((position + offset) / period)) * beta + 1 (floor_scale the period,
    attn_scale beta), multiplied in fp32 and rounded to q's dtype, as transformers does."""
    s = torch.log1p(torch.floor((positions.float() + offset) / period)) * beta + 1.0
    return (q * s.view(-1, 1, 1)).to(q.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of x's last dim over its root mean square, no weight (Llama 4's q/k
    "L2" norm), in fp32 then x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def qkv_ref(attn: Attention, x, cos, sin, slot_mapping, k_cache, v_cache, scales
            ) -> torch.Tensor:
    """q [T, H, D] after its norm and rotary; k and v written into their slots (the
    PyTorch reference)."""
    T = x.shape[0]
    q, k, *v = attn.qkv_proj(x).split([attn.q_size] + [attn.kv_size] * (len(attn.qkv_parts) - 1),
                                      dim=-1)
    v = v[0] if v else k  # k_eq_v: the value is the key projection, before k's norm and rotary
    if attn.qk_norm_whole:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.reshape(T, attn.num_heads, attn.head_dim), k.reshape(T, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and not attn.qk_norm_whole:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if attn.rope:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if attn.qk_l2_norm:  # after the rotary (Llama 4)
        q, k = l2_norm(q, attn.eps), l2_norm(k, attn.eps)
    v = v.reshape(T, attn.num_kv_heads, attn.head_dim)
    if attn.v_norm:
        v = l2_norm(v, attn.eps)
    ks, vs = scales or (None, None)
    # Each token's K/V is written once, into its slot; attention then reads the cache.
    kv_quant.write(k_cache, ks, slot_mapping, k)
    kv_quant.write(v_cache, vs, slot_mapping, v)
    return q


def qkv_kernels(attn: Attention, x, cos, sin, slot_mapping, k_cache, v_cache, scales
                ) -> torch.Tensor:
    """`qkv_ref` on the C++ fused ops: q is a view of the projection, rotated in place."""
    T, d = x.shape[0], attn.head_dim
    qkv = attn.qkv_proj(x)
    if attn.k_eq_v:  # v: the key projection as projected, beside it (q | k | v)
        qkv = torch.cat([qkv, qkv[:, attn.q_size:]], dim=-1)
    elif qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    ks, vs = scales or (None, None)  # scales: (k, v) of an int8 cache, else none
    if attn.qk_norm_whole:  # norms of all of q and of k, in place, before the rotary
        q_k = qkv[:, :attn.q_size + attn.kv_size]
        q_k[:, :attn.q_size] = attn.q_norm(q_k[:, :attn.q_size].contiguous())
        q_k[:, attn.q_size:] = attn.k_norm(q_k[:, attn.q_size:].contiguous())
    elif attn.q_norm is not None:  # per-head norms of q and k, in place, before the rotary
        q_k = qkv[:, :attn.q_size + attn.kv_size]
        q_k[:, :attn.q_size] = attn.q_norm(q_k[:, :attn.q_size].view(T, -1, d)).view(T, -1)
        q_k[:, attn.q_size:] = attn.k_norm(q_k[:, attn.q_size:].view(T, -1, d)).view(T, -1)
    if attn.v_norm:  # each head's v over its root mean square, no weight (the C++ RMSNorm
        # with a weight of ones: the DecodeStack's arithmetic), in place
        v = qkv[:, attn.q_size + attn.kv_size:]
        ones = attn.__dict__.get("_v_norm_ones")
        if ones is None or ones.dtype != qkv.dtype:
            ones = attn._v_norm_ones = torch.ones(d, dtype=qkv.dtype)
        v.copy_(head_rms_norm(v.reshape(T, -1, d), ones, attn.eps).view(T, -1))
    # Rotary on q (in place) and k, and k/v written into their slots: one pass.
    attn._rotary_kv_write(qkv, cos, sin, k_cache, v_cache, slot_mapping,
                          attn.num_heads, attn.num_kv_heads, ks, vs)
    return qkv[:, :attn.q_size].view(T, attn.num_heads, d)


def q_only(attn: Attention, x, cos, sin, slot_mapping, k_cache, v_cache, scales
           ) -> torch.Tensor:
    """A KV-shared layer's q [T, H, D] after its norm and rotary; no K/V of its own (the
    cache it attends is an earlier layer's, already written this step)."""
    q = attn.qkv_proj(x).reshape(x.shape[0], attn.num_heads, attn.head_dim)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    return apply_rotary(q, cos, sin) if attn.rope else q


class GatedMLP(OpModule):
    """down(act(gate(x)) * up(x)), gate and up fused into one matmul; act is SiLU (SwiGLU)
    or tanh-approximated GELU (GeGLU, Gemma). The op chosen once (select): the activation
    in PyTorch (mlp_ref), or a SwiGLU's on the C++ silu_and_mul (mlp_kernels), or written
    by the gate_up itself where it can (a gated amx module, or w8a8's pair form:
    writes_silu_mul; mlp_gated, or mlp_bucket_gated where only some of its row buckets
    run such a module)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        self.options = dict(hidden=hidden, intermediate=intermediate, act=act)
        self.intermediate, self.act = intermediate, act
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.select(False)

    def select(self, kernels: bool) -> None:
        """Reads the gate_up module as it is now: select again after swapping it (the
        tuner's methods) or gating it (fuse_activation does)."""
        self.uses_kernels = kernels
        self._gated_ids = frozenset()
        self._silu_mul = None
        if not kernels or self.act != "silu":
            self._mlp = mlp_ref
            return
        from servelm.layers.linear_methods import BucketedLinear

        self._silu_mul = _ops().silu_and_mul
        gu = self.gate_up_proj
        bucketed = isinstance(gu, BucketedLinear)
        mods = list(gu.impls) if bucketed else [gu]
        # A module writing silu(gate) * up itself (silu_mul): a gated amx layer, w8a8's pair form.
        gated = [m for m in mods if getattr(m, "writes_silu_mul", False)]
        if not gated:
            self._mlp = mlp_kernels
        elif not bucketed:
            self._mlp = mlp_gated
        else:
            self._gated_ids = frozenset(id(m) for m in gated)
            self._mlp = mlp_bucket_gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(self, x)

    @torch.no_grad()
    def fuse_activation(self) -> int:
        """Where gate_up runs on the amx method (any row bucket), have it write
        silu(gate) * up itself (AmxLinear.gate_silu; SwiGLU only). Returns the modules
        changed."""
        from servelm.layers.amx import AmxLinear

        if self.act != "silu":
            return 0
        mods = getattr(self.gate_up_proj, "impls", [self.gate_up_proj])
        fused = [m for m in mods if isinstance(m, AmxLinear) and not m.gated]
        for m in fused:
            m.gate_silu()
        if fused:
            self.select(self.uses_kernels)
        return len(fused)


def mlp_ref(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(gated_act(mlp.gate_up_proj(x), mlp.act))


def mlp_kernels(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    gu = mlp.gate_up_proj(x)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    return mlp.down_proj(mlp._silu_mul(gu))


def mlp_gated(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """gate_up is one module that writes silu(gate) * up itself."""
    return mlp.down_proj(mlp.gate_up_proj.silu_mul(x))


def mlp_bucket_gated(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """Some of gate_up's row buckets run a module that writes the activation itself: the
    one for x's rows does where it is one."""
    gu = mlp.gate_up_proj.module_for(x.numel() // mlp.gate_up_proj.in_features)
    if id(gu) in mlp._gated_ids:
        return mlp.down_proj(gu.silu_mul(x))
    out = gu(x)
    if out.stride(-1) != 1:
        out = out.contiguous()
    return mlp.down_proj(mlp._silu_mul(out))


class MLP(nn.Module):
    """c_proj(act(c_fc(x))), not gated, with or without biases (Starcoder2; the checkpoint's
    names). The PyTorch activation on every path."""

    def __init__(self, hidden: int, intermediate: int, act: str = "gelu_tanh",
                 bias: bool = True):
        super().__init__()
        self.options = dict(hidden=hidden, intermediate=intermediate, act=act, bias=bias)
        self.intermediate, self.act = intermediate, act
        self.c_fc = nn.Linear(hidden, intermediate, bias=bias)
        self.c_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(activation(self.c_fc(x), self.act))


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of a fused [.., 2 * intermediate] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate, act) * up
