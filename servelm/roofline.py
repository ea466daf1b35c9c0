"""Roofline: what the machine's bandwidth and arithmetic allow for a model, phase by phase.

Decode reads every weight once per step (plus each sequence's KV cache) and does ~2 FLOPs
per weight per sequence, so at small batch it is bound by memory bandwidth; prefill does
the same arithmetic for every prompt token while reading the weights once, so it is bound
by matmul throughput. The model: time = max(bytes / bandwidth, FLOPs / peak).
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from dataclasses import dataclass

BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class Hardware:
    bandwidth: float  # bytes/s of memory read
    flops: float      # FLOP/s of matmul in the compute dtype
    source: str = "given"
    # Multiply-adds x 2 per second of an int8 x int8 -> int32 matmul over whole rows
    # (torch._int_mm): the machine's int8 arithmetic roof; None where not measured.
    int8_ops: float | None = None
    # The same of servelm's q8act kernel (int4 weights x activations quantised per block of
    # 32, fp32 scaling a block): the roof the engine's int8-activation layers reach, under
    # int8_ops; None where not measured or not built.
    q8act_ops: float | None = None
    # The same of servelm's w8a8 kernel (int8 weights x smoothed int8 activations per block
    # of up to 128): the roof of the layers it runs (w8a8_share), where it runs (AVX-512 VNNI).
    w8a8_ops: float | None = None


def prompt_flops(num_tokens: int, flops_per_token: float, sampled_row_flops: float,
                 sampled_rows: int = 1) -> float:
    """Matmul FLOPs of a prompt chunk: every token through the layers (flops_per_token, which
    includes sampled_row_flops), only `sampled_rows` of them through the LM head and the last
    layer past attention (sampled_row_flops each)."""
    return num_tokens * (flops_per_token - sampled_row_flops) + sampled_rows * sampled_row_flops


def _keys(context: int, reach: int) -> int:
    """Keys a query `context` tokens in reads in a layer of this reach (0: all of them)."""
    return min(context, reach) if reach else context


@dataclass(frozen=True)
class ModelShape:
    """Just the sizes the roofline needs; weights are not required."""

    num_params: int            # all parameters (tied embedding counted once)
    weight_bits: float         # bits per weight as stored for compute
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    num_heads: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    tied_embeddings: bool = False
    kv_bits: float = 16
    intermediate_size: int | None = None
    # Mixture of experts: the routed experts' weights (within num_params), each token
    # reading experts_per_tok of num_experts in every MoE layer.
    expert_params: int = 0
    num_experts: int = 0
    experts_per_tok: int = 0
    expert_bits: float | None = None  # a routed expert's bits per weight (None: weight_bits)
    # Linear-attention layers (Qwen3-Next, Qwen3.5): one sequence's recurrent state in all
    # of them (read and written by every step of that sequence, whatever its length), and
    # the FLOPs of one token's update and readout of it. num_layers then counts only the
    # layers with a KV cache.
    state_bytes_per_seq: float = 0.0
    state_flops_per_token: float = 0.0
    # The cache's planes per KV head: 2 (K and V), 1 where V is read from K's rows
    # (DeepSeek's latent cache: 1 KV head of kv_lora_rank + qk_rope_head_dim).
    kv_planes: int = 2
    # Per layer with a KV cache, the keys its queries read at most: a sliding window or an
    # attention chunk, 0 for all of them; () every layer full.
    kv_windows: tuple[int, ...] = ()
    # A hybrid model's pool in block groups (ModelConfig.kv_groups): its windowed layers
    # hold only about their window, beside the full layers' every key.
    kv_window_groups: bool = False
    # Per layer with a KV cache (kv_windows' order), its KV heads x head dim where the
    # layers differ (Gemma 4's global layers); () every layer num_kv_heads x head_dim.
    kv_widths: tuple[int, ...] = ()
    # Per attention layer (KV-shared ones too, not linear attention's), where they differ
    # from the KV layers or among themselves (Gemma 4: global layers of their own head
    # size, the last layers reading earlier layers' caches): (its reach or 0, its query
    # head dim, the KV heads x head dim of the cache it reads). () otherwise.
    attn_layers: tuple[tuple[int, int, int], ...] = ()
    # Parameters a token only indexes besides the input embedding (within num_params):
    # Gemma 4's per-layer embedding table (ModelConfig.lookup_params).
    lookup_params: int = 0

    def _read_params(self) -> float:
        params = self.num_params - self.lookup_params
        if self.vocab_size and self.hidden_size and not self.tied_embeddings:
            params -= self.vocab_size * self.hidden_size
        return params

    def expert_fraction(self, tokens: int) -> float:
        """The expected share of the experts a step of `tokens` tokens reads (each token's
        k experts drawn uniformly: 1 - (1 - k/E)^tokens); 1 for a dense model."""
        if not self.num_experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_tok / self.num_experts) ** max(tokens, 1)

    def weight_bytes(self, tokens: int = 1) -> float:
        """Bytes read by a step of `tokens` tokens: every weight once (a MoE model only the
        experts its tokens chose). An untied input embedding is only indexed (one row per
        token), so it is not read whole; nor is a per-layer embedding table (lookup_params)."""
        experts = self.expert_params * self.expert_fraction(tokens)  # (0 for a dense model)
        bits = self.weight_bits if self.expert_bits is None else self.expert_bits
        return ((self._read_params() - self.expert_params) * self.weight_bits / 8
                + experts * bits / 8)

    @property
    def weight_bytes_per_step(self) -> float:
        """weight_bytes of a one-token decode step."""
        return self.weight_bytes(1)

    @property
    def kv_bytes_per_token(self) -> float | None:
        """K and V of one token in every layer, counting only the KV heads (K alone where
        V is read from it)."""
        if self.kv_widths:
            return self.kv_planes * sum(self.kv_widths) * self.kv_bits / 8
        if None in (self.num_layers, self.num_kv_heads, self.head_dim):
            return None
        return (self.kv_planes * self.num_layers * self.num_kv_heads * self.head_dim
                * self.kv_bits / 8)

    @functools.cached_property
    def _window_counts(self) -> tuple[tuple[int, int], ...]:
        """kv_windows as (window, layers) pairs (0: full), a few at most."""
        return tuple(sorted(Counter(self.kv_windows).items()))

    def attended(self, context: int) -> float:
        """Keys a query `context` tokens in reads, summed over the layers with a KV cache
        (a windowed layer's at most its window)."""
        if not self.kv_windows:
            return float((self.num_layers or 0) * context)
        return float(sum(n * _keys(context, w)
                         for w, n in self._window_counts))

    @property
    def kv_bytes_per_key(self) -> float:
        """K and V of one token in one layer (0 when unknown)."""
        kv = self.kv_bytes_per_token
        return kv / self.num_layers if kv and self.num_layers else 0.0

    @property
    def attention_flops_per_key(self) -> float:
        """A query's attention FLOPs per key it reads in one layer (QK^T and PV: 4 x heads
        x head dim; 0 when unknown)."""
        if None in (self.num_heads, self.head_dim):
            return 0.0
        return 4.0 * self.num_heads * self.head_dim

    def kv_read_bytes(self, context: int) -> float:
        """K and V a decode step of one sequence `context` tokens long reads (each
        attention layer its cache's width where they differ: attn_layers)."""
        if self.attn_layers:
            return (self.kv_planes * self.kv_bits / 8
                    * sum(_keys(context, w) * width
                          for w, _, width in self.attn_layers))
        return self.kv_bytes_per_key * self.attended(context)

    def attention_flops(self, context: int) -> float:
        """Attention FLOPs of a query `context` tokens in (QK^T and PV: 4 x heads x head
        dim a key it reads, over the attention layers)."""
        if self.attn_layers:
            return 4.0 * (self.num_heads or 0) * sum(
                _keys(context, w) * d for w, d, _ in self.attn_layers)
        return self.attention_flops_per_key * self.attended(context)

    def kv_held_tokens(self, context: int) -> int:
        """Tokens of KV (of every layer) a sequence `context` tokens long holds in the pool:
        all of them, or, with every KV layer windowed, about the widest window (the block
        manager gives the blocks behind it back); in block groups, the full layers' every
        token and the windowed layers' widest window, averaged over the layers (weighted
        by their KV widths where they differ: kv_bytes_per_token times this is the bytes)."""
        if self.kv_windows and all(self.kv_windows):
            return min(context, max(self.kv_windows))
        if self.kv_windows and self.kv_window_groups:
            widths = self.kv_widths or (1,) * len(self.kv_windows)
            held = sum(width * (min(context, max(self.kv_windows)) if w else context)
                       for w, width in zip(self.kv_windows, widths))
            return -(-held // sum(widths))
        return context

    def flops_per_token(self, context: int = 0) -> float:
        """Matmul FLOPs for one token: 2 per weight it multiplies, plus attention over
        `context` earlier tokens (QK^T and PV: 4 * layers * context * heads * head_dim) and
        a linear-attention layer's state update and readout."""
        # The input embedding is a lookup; a MoE token multiplies only its experts' weights.
        params = self._read_params() - self.expert_params * (1.0 - self.expert_fraction(1))
        attn = self.attention_flops(context) if self.num_layers is not None else 0.0
        return 2.0 * params + attn + self.state_flops_per_token

    @property
    def lm_head_flops(self) -> float:
        """FLOPs of one row through the LM head (2 x vocab x hidden; 0 when unknown). A
        prompt needs it only for its last position: the others' logits are never used."""
        return 2.0 * self.vocab_size * self.hidden_size if self.vocab_size and self.hidden_size else 0.0

    @property
    def sampled_row_flops(self) -> float:
        """FLOPs of one row that a prompt spends on its sampled rows only: the LM head and,
        past attention, the last layer's o_proj and MLP (servelm computes them only for the
        rows whose logits are read; 0 for the layer when its sizes are unknown)."""
        tail = 0.0
        if None not in (self.num_heads, self.head_dim, self.hidden_size, self.intermediate_size):
            tail = 2.0 * (self.num_heads * self.head_dim * self.hidden_size
                          + 3 * self.hidden_size * self.intermediate_size)
        return self.lm_head_flops + tail

    def prefill_flops(self, num_tokens: int, context: float, sampled_rows: int = 1) -> float:
        """Matmul FLOPs of a prompt chunk (attention over `context` tokens on average):
        `prompt_flops` with this model's figures."""
        return prompt_flops(num_tokens, self.flops_per_token(context), self.sampled_row_flops,
                            sampled_rows)

    @classmethod
    def from_config(cls, cfg, weight_bits: float, kv_bits: float,
                    state_bytes: float = 0.0, expert_bits: float | None = None,
                    window_groups: bool | None = None) -> "ModelShape":
        """The shape of a ModelConfig; its KV heads and head dim are the cache's
        (cfg.cache_layout: the heads attention reads, DeepSeek's latent rows too), on the
        layers that keep K and V. state_bytes: one sequence's recurrent state
        (StateCache.bytes_per_slot); expert_bits: the routed experts' bits per weight where
        they differ from the other layers'; window_groups: whether the pool keeps a hybrid
        model's layers in block groups (None: wherever ModelConfig.kv_groups applies)."""
        planes, kv_heads, head_dim = cfg.cache_layout
        windows = tuple(cfg.layer_reach(i) or 0 for i in cfg.kv_layers)
        widths = tuple(kvh * d for kvh, d in map(cfg.cache_shape_of, cfg.kv_layers))
        attn = tuple((cfg.layer_reach(i) or 0, cfg.head_dim_of(i),
                      math.prod(cfg.cache_shape_of(cfg.kv_source(i))))
                     for i in range(cfg.num_layers) if not cfg.is_linear_layer(i))
        if len(attn) == len(cfg.kv_layers) and len({(d, w) for _, d, w in attn}) == 1:
            attn = ()  # every attention layer its own cache, of one shape
        state_flops = 0.0
        if cfg.has_recurrent_state:  # per layer: S *= decay, S^T k, k delta^T, S^T q
            hv, dk, dv = cfg.linear_state_shapes[1]
            state_flops = 4.0 * 2 * hv * dk * dv * len(cfg.linear_layers)
        return cls(num_params=cfg.num_params, weight_bits=weight_bits,
                   num_layers=len(cfg.kv_layers), state_bytes_per_seq=state_bytes,
                   state_flops_per_token=state_flops,
                   num_kv_heads=kv_heads, head_dim=head_dim, num_heads=cfg.num_heads,
                   kv_planes=planes,
                   hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                   tied_embeddings=cfg.tie_word_embeddings, kv_bits=kv_bits,
                   intermediate_size=cfg.intermediate_size, expert_params=cfg.expert_params,
                   num_experts=cfg.num_experts, experts_per_tok=cfg.num_experts_per_tok,
                   expert_bits=expert_bits, kv_windows=windows if any(windows) else (),
                   kv_window_groups=(cfg.kv_groups is not None if window_groups is None
                                     else window_groups),
                   lookup_params=cfg.lookup_params,
                   kv_widths=widths if len(set(widths)) > 1 else (), attn_layers=attn)


@dataclass(frozen=True)
class Prediction:
    seconds: float
    memory_seconds: float
    compute_seconds: float

    @property
    def bound(self) -> str:
        return "memory" if self.memory_seconds >= self.compute_seconds else "compute"


def predict_prefill(m: ModelShape, hw: Hardware, prompt_len: int) -> Prediction:
    """Time to first token for one prompt: all its tokens in one pass, weights read once,
    the LM head (and the last layer past attention) for the last position only. Attention
    FLOPs use the causal average context (prompt_len / 2)."""
    flops = m.prefill_flops(prompt_len, context=prompt_len // 2)
    mem = (m.weight_bytes(prompt_len) + prompt_len * (m.kv_bytes_per_token or 0)
           + 2 * m.state_bytes_per_seq)
    return Prediction(max(mem / hw.bandwidth, flops / hw.flops), mem / hw.bandwidth,
                      flops / hw.flops)


def predict_decode(m: ModelShape, hw: Hardware, batch: int, context: int) -> Prediction:
    """One decode step for `batch` sequences each attending to `context` tokens (and
    reading and writing its recurrent state, where the model has one)."""
    mem = (m.weight_bytes(batch) + batch * m.kv_read_bytes(context)
           + 2 * batch * m.state_bytes_per_seq)
    flops = batch * m.flops_per_token(context=context)
    return Prediction(max(mem / hw.bandwidth, flops / hw.flops), mem / hw.bandwidth,
                      flops / hw.flops)


def w8a8_share(m: ModelShape) -> float:
    """The share of a decoder layer's matmul FLOPs in the layers w8a8 runs, from the model's
    sizes: all of them on unquantised weights; qkv, o and gate_up on quantised ones (their
    down_proj, in blocks of 32, is counted at the rest's rate: the tuner keeps it on q8act
    where that measures faster; servelm.engine.calibration.QUANTISED_LONGEST); 0 where they
    are not known."""
    if not (m.hidden_size and m.intermediate_size and m.num_heads and m.head_dim):
        return 0.0
    if m.weight_bits >= 16:
        return 1.0
    kv = m.num_kv_heads or m.num_heads
    attn = m.hidden_size * (2 * m.num_heads + 2 * kv) * m.head_dim
    gate_up = 2 * m.hidden_size * m.intermediate_size
    return (attn + gate_up) / (attn + gate_up + m.hidden_size * m.intermediate_size)


def int8_hardware(hw: Hardware, m: ModelShape | None = None) -> Hardware | None:
    """The machine with the compute roof of layers on int8 activations: where w8a8's rate is
    measured and the model's sizes known, its rate on the layers it runs (w8a8_share) blended
    (by their FLOPs) with the rest's (q8act's for quantised weights, else the dtype's); else q8act's
    measured rate, else the int8 matmul's; None where none is known."""
    rate = hw.q8act_ops or hw.int8_ops
    share = w8a8_share(m) if m is not None and hw.w8a8_ops else 0.0
    if share:
        rest = (hw.q8act_ops or hw.flops) if m.weight_bits <= 8 else hw.flops
        rate = 1 / (share / hw.w8a8_ops + (1 - share) / rest)
    if not rate:
        return None
    return Hardware(hw.bandwidth, rate, f"{hw.source}, int8", hw.int8_ops, hw.q8act_ops,
                    hw.w8a8_ops)


def ridge_tokens(m: ModelShape, hw: Hardware) -> float:
    """Tokens one step can compute per weight read before arithmetic, not memory, bounds it:
    where tokens x FLOPs per token / peak = weight bytes / bandwidth (KV reads and attention
    left out). A decode step of b sequences computes b tokens per weight read; speculating k
    tokens per sequence makes it b(k + 1), free while that stays below this."""
    return hw.flops * m.weight_bytes(1) / (hw.bandwidth * m.flops_per_token(0))


def max_batch(m: ModelShape, kv_pool_bytes: float, context: int) -> int | None:
    """How many sequences of `context` tokens the KV pool holds."""
    per_token = m.kv_bytes_per_token
    if not per_token or context <= 0:
        return None
    return int(kv_pool_bytes // (per_token * m.kv_held_tokens(context)))


# ---- measuring the machine ---------------------------------------------------------------


def measure_hardware(dtype: str = "bfloat16", device: str = "cpu",
                     seconds: float = 0.5) -> Hardware:
    """Measure read bandwidth (summing a buffer far larger than the caches) and matmul
    throughput in `dtype` (square matmuls), best of several repeats."""
    import torch

    dev = torch.device(device)

    def best(fn, work: float, budget: float = seconds) -> float:
        fn()
        rate, start = 0.0, time.perf_counter()
        while time.perf_counter() - start < budget or rate == 0.0:
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            rate = max(rate, work / (time.perf_counter() - t))
        return rate

    buf = torch.ones(256 << 20 if dev.type == "cpu" else 1 << 30, dtype=torch.uint8, device=dev)
    words = buf.view(torch.int64)
    bandwidth = best(lambda: words.sum(), buf.numel())
    # Square matmuls of the largest size (up to 2048, CUDA 8192) whose one call stays within
    # the budget (the next size costs 8x): a dtype the CPU only emulates (bf16 without
    # AVX512-BF16) took minutes a 2048 matmul, and `servelm serve` probes at start-up.
    tdtype = getattr(torch, dtype)
    n, top = 256, (2048 if dev.type == "cpu" else 8192)
    while True:
        a = torch.randn(n, n, device=dev).to(tdtype)
        b = torch.randn(n, n, device=dev).to(tdtype)
        if n == 256:  # the library's first call sets itself up (cuBLAS: ~0.1 s), untimed
            a @ b
            if dev.type == "cuda":
                torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if n >= top or (time.perf_counter() - t) * 8 > seconds:
            break
        n *= 2
    flops = best(lambda: a @ b, 2.0 * n ** 3)

    def quarter(fn, work):  # the int8 probes: a quarter of the budget each
        return best(fn, work, seconds / 4)
    return Hardware(bandwidth, flops, source=f"measured on {device} ({dtype})",
                    int8_ops=_int8_ops(dev, quarter), q8act_ops=_method_ops(dev, quarter, "q8act"),
                    w8a8_ops=_w8a8_ops(dev, quarter))


def _int8_ops(dev, best) -> float | None:
    """int8 x int8 -> int32 matmul throughput (torch._int_mm: oneDNN's VNNI / AMX-INT8 kernels
    on a CPU, int8 tensor cores on CUDA), one 1024-square size; None where it does not run."""
    import torch

    n = 1024
    try:
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=dev)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=dev)
        return best(lambda: torch._int_mm(a, b), 2.0 * n ** 3)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def _method_ops(dev, best, method: str) -> float | None:
    """A linear method's rate (servelm.layers.linear_methods: q8act, w8a8) on a 1024-square
    int4 layer (with a unit calibration, which w8a8 needs; its work does not depend on the
    values) at 512 rows of bf16 activations, a compute-bound prompt chunk; None off the CPU
    or where the method does not run."""
    import torch

    if dev.type != "cpu":
        return None
    from servelm.layers import linear_methods as lm
    from servelm.quantization.surgery import quantize_linear

    n, rows = 1024, 512
    src = quantize_linear(torch.nn.Linear(n, n, bias=False), "int4")
    setattr(src, lm.w8a8.AMAX, torch.ones(n))
    if not lm.applies(method, src, torch.bfloat16, True):
        return None
    layer = lm.build(method, src, torch.bfloat16)
    x = (torch.rand(rows, n) - 0.5).to(torch.bfloat16)
    return best(lambda: layer(x), 2.0 * rows * n * n)


def _w8a8_ops(dev, best) -> float | None:
    """The fastest w8a8 form's rate (the VNNI kernel's, or its AMX-INT8 tiles' where they
    run): what the tuner would take for prompts."""
    from servelm.layers import linear_methods as lm

    return max(filter(None, (_method_ops(dev, best, m) for m in lm.W8A8_FORMS)), default=None)


# ---- the report --------------------------------------------------------------------------


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def report(m: ModelShape, hw: Hardware, prompt_lens=(128, 512, 2048),
           batches=(1, 4, 16, 64, 256), context: int = 512,
           kv_pool_bytes: float | None = None, kv_dtype: str | None = None) -> str:
    """The roofline table as text (kv_dtype: a quantised KV cache's name, for the labels)."""
    lines = [f"machine: {hw.bandwidth / 1e9:.1f} GB/s memory read, "
             f"{hw.flops / 1e12:.2f} TFLOP/s matmul ({hw.source})",
             f"model: {m.num_params / 1e9:.3f} B parameters at {m.weight_bits:g} bits"
             + (f" ({m.num_experts} experts"
                + (f" at {m.expert_bits:g} bits" if m.expert_bits not in (None, m.weight_bits)
                   else "")
                + f", {m.experts_per_tok} a token: "
                f"{(m.num_params - m.expert_params * (1 - m.expert_fraction(1))) / 1e9:.3f} B active)"
                if m.num_experts else ""),
             f"  weight bytes read per decode step: {_fmt_bytes(m.weight_bytes_per_step)}",
             f"  FLOPs per token (no context): {m.flops_per_token() / 1e9:.3f} GFLOP"]
    kv = m.kv_bytes_per_token
    stored = f", {kv_dtype} + scales" if kv_dtype else ""
    shared = f" of {m.head_dim}, V read from K" if m.kv_planes == 1 else ""  # a latent cache
    heads = (f"{m.num_kv_heads} KV heads" if not m.kv_widths else
             f"KV heads x head dim {min(m.kv_widths)} to {max(m.kv_widths)} by layer")
    lines.append(f"  KV cache per token ({heads}{shared}{stored}"
                 + (f", {m.num_layers} attention layer{'s' * (m.num_layers != 1)}"
                    if m.state_bytes_per_seq else "")
                 + f"): {_fmt_bytes(kv)}"
                 + (f"; {sum(map(bool, m.kv_windows))} of {len(m.kv_windows)} layers read at "
                    f"most their last {max(m.kv_windows)} tokens" if m.kv_windows else "")
                 if kv else "  KV cache per token: unknown (give --layers, --kv-heads, --head-dim)")
    if m.state_bytes_per_seq:
        lines.append(f"  recurrent state per sequence (linear-attention layers, read and "
                     f"written every step): {_fmt_bytes(m.state_bytes_per_seq)}")
    ridge = hw.flops / hw.bandwidth
    lines.append(f"  ridge point: {ridge:.0f} FLOP/byte; decode does about "
                 f"{2 * 8 / m.weight_bits:.0f} FLOP per weight byte per sequence")
    int8 = int8_hardware(hw, m)
    if hw.int8_ops:
        lines.append(f"  int8 matmul: {hw.int8_ops / 1e12:.2f} TOP/s ({hw.int8_ops / hw.flops:.1f}x): "
                     f"the machine's int8 roof (whole rows), ridge "
                     f"{hw.int8_ops / hw.bandwidth:.0f} OP/byte")
    if hw.q8act_ops:
        lines.append(f"  q8act: {hw.q8act_ops / 1e12:.2f} TOP/s ({hw.q8act_ops / hw.flops:.1f}x): "
                     f"the roof of layers with int8 activations (blocks of 32, scaled in fp32)"
                     + ("" if int8 is None or hw.w8a8_ops else ", the int8 column's"))
    if hw.w8a8_ops:
        share = w8a8_share(m)
        lines.append(f"  w8a8: {hw.w8a8_ops / 1e12:.2f} TOP/s ({hw.w8a8_ops / hw.flops:.1f}x): "
                     f"the roof of qkv, o, gate_up (and down on unquantised weights; a quantised "
                     f"one's counted at the rest's rate) on int8 "
                     f"activations (blocks of up to 128, smoothed)"
                     + (f"; {share:.0%} of a layer's FLOPs, the int8 column at "
                        f"{int8.flops / 1e12:.2f} TOP/s" if share and int8 else ""))
    lines.append("")
    lines.append("prefill (time to first token, one prompt)")
    lines.append(f"  {'prompt':>8}{'predicted':>12}{'bound':>10}"
                 + (f"{'int8 roof':>12}" if int8 else ""))
    for n in prompt_lens:
        p = predict_prefill(m, hw, n)
        extra = f"{predict_prefill(m, int8, n).seconds * 1e3:>10.1f}ms" if int8 else ""
        lines.append(f"  {n:>8}{p.seconds * 1e3:>10.1f}ms{p.bound:>10}{extra}")
    lines.append("")
    lines.append(f"decode (context {context} tokens per sequence)")
    lines.append(f"  {'batch':>8}{'step':>12}{'tok/s':>12}{'bound':>10}")
    limit = max_batch(m, kv_pool_bytes, context) if kv_pool_bytes else None
    for b in batches:
        p = predict_decode(m, hw, b, context)
        note = "  (beyond the KV pool)" if limit is not None and b > limit else ""
        lines.append(f"  {b:>8}{p.seconds * 1e3:>10.2f}ms{b / p.seconds:>12.1f}{p.bound:>10}{note}")
    if limit is not None:
        lines.append(f"  the KV pool ({_fmt_bytes(kv_pool_bytes)}{stored}) holds "
                     f"{int(kv_pool_bytes // kv):,} tokens: {limit} sequences of {context} tokens")
    return "\n".join(lines)


def quantized_bits_per_weight(method: str | None, group_size: int | None = None,
                              dtype_bits: int = 32) -> float:
    """Bits read per weight of the quantised layers (scales included), for the roofline;
    group_size None: int4's default. (The formats' module is imported only here: this one
    imports no torch.)"""
    if method is None:
        return float(dtype_bits)
    from servelm.quantization.numerics import DEFAULT_GROUP_SIZE, check_method

    check_method(method)
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    return 8.0 if method == "int8" else 4.0 + 32.0 / group_size


def quantized_expert_bits(method: str | None) -> float | None:
    """Bits per routed-expert weight under a weight format (None: the other layers'): int8
    per row, or int4 in groups of 32 (SparseMoE.quantize_experts)."""
    return None if method is None else quantized_bits_per_weight(method, 32)
