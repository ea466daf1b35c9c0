"""servelm_quant.decode_layer: a whole decoder layer for decode rows in one C++ call.

It must give exactly (bit for bit) what the per-op kernel path gives, since it runs the
same kernels with the same split of the work; these tests compare the two on random
layers and through the engine, and check when the engine takes it and when it does not.
"""

from __future__ import annotations

import pytest
import torch

from servelm import LLM, SamplingParams
from servelm import quantization as Q
from servelm.engine.model_runner import SeqInput, build_forward_batch
from servelm.kernels import load_ops
from servelm.models.config import ModelConfig
from servelm.models.layers import RotaryEmbedding
from servelm.models.llama import DECODE_LAYER_MAX_ROWS, DecoderLayer

pytestmark = pytest.mark.skipif(not (Q.kernels_available() and load_ops("ops")),
                                reason="needs the C++ kernels (AVX-512 BF16)")

BS = 16  # KV block size


def _config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                max_position_embeddings=4096)
    return ModelConfig(**{**base, **kw})


def _layer(cfg: ModelConfig, formats: dict[str, str], seed: int = 0) -> DecoderLayer:
    """A random bf16 decoder layer with each linear quantised as formats says."""
    torch.manual_seed(seed)
    layer = DecoderLayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0))
    layer = layer.to(torch.bfloat16)
    for name, method in formats.items():
        Q.quantize_model(layer, method, targets=(name,))
    return layer.eval()


def _setup(cfg, lens, seed=1):
    """Decode rows whose contexts (after this token) have the given lengths, a KV pool filled
    with random keys/values, and the batch the model runner would build for them."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in lens) + 4
    shape = (num_blocks, BS, cfg.num_kv_heads, cfg.head_dim)
    k = torch.randn(shape, generator=g).bfloat16()
    v = torch.randn(shape, generator=g).bfloat16()
    perm = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()  # scattered blocks
    seqs, at = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // BS)
        seqs.append(SeqInput([7 + i], n - 1, perm[at:at + nb]))
        at += nb
    batch, _ = build_forward_batch(seqs, BS, cfg.num_heads // cfg.num_kv_heads,
                                   torch.device("cpu"), kernels=True)
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, 10000.0)
    cos, sin = rope.cos_sin(batch.positions, torch.bfloat16)
    residual = torch.randn(len(lens), cfg.hidden_size, generator=g).bfloat16()
    delta = torch.randn(len(lens), cfg.hidden_size, generator=g).bfloat16() * 0.5
    return batch, cos, sin, (k, v), residual, delta


def _both(layer, batch, cos, sin, kv, residual, delta):
    """(out, residual, k, v) from the per-op path and from decode_layer, on copies."""
    results = []
    for fused in (False, True):
        r = residual.clone()
        cache = (kv[0].clone(), kv[1].clone())
        d = None if delta is None else delta.clone()
        with torch.inference_mode():
            if fused:
                assert layer.bind_decode_layer()
                out = layer.forward_decode(d, r, cos, sin, batch, cache)
            else:
                out = layer.forward_fused(d, r, cos, sin, batch, cache)
        results.append((out, r, *cache))
    return results


FORMATS = {
    "int4": dict.fromkeys(Q.TARGETS, "int4"),
    "int8": dict.fromkeys(Q.TARGETS, "int8"),
    "mixed": {"qkv_proj": "int4", "o_proj": "int8", "gate_up_proj": "int8", "down_proj": "int4"},
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("lens", [[1], [37], [300], [5, 300, 17], [3] * 7 + [90] * 6,
                                  list(range(1, 4 * DECODE_LAYER_MAX_ROWS, 4))[:23]])
@pytest.mark.parametrize("first", [False, True])
def test_decode_layer_is_bit_identical_to_the_per_op_path(fmt, lens, first):
    cfg = _config()
    layer = _layer(cfg, FORMATS[fmt])
    batch, cos, sin, kv, residual, delta = _setup(cfg, lens)
    (o0, r0, k0, v0), (o1, r1, k1, v1) = _both(layer, batch, cos, sin, kv, residual,
                                               None if first else delta)
    assert torch.equal(o0, o1)
    assert torch.equal(r0, r1)  # residual += delta and the attention output, in place
    assert torch.equal(k0, k1) and torch.equal(v0, v1)  # the new token's K/V written alike
    assert not torch.equal(r0, residual)


def test_decode_layer_with_qkv_bias_and_other_head_dims():
    # Qwen2-style qkv bias; head_dim 64 (the AVX-512 attention path) and 5 query heads per KV.
    cfg = _config(hidden_size=320, num_heads=5, num_kv_heads=1, head_dim=64,
                  intermediate_size=128, attention_bias=True)
    layer = _layer(cfg, FORMATS["int4"])
    assert layer.self_attn.qkv_proj.bias is not None
    batch, cos, sin, kv, residual, delta = _setup(cfg, [9, 64, 130])
    (o0, r0, k0, v0), (o1, r1, k1, v1) = _both(layer, batch, cos, sin, kv, residual, delta)
    assert torch.equal(o0, o1) and torch.equal(r0, r1) and torch.equal(k0, k1)


def test_decode_layer_binds_only_quantised_kernel_layers():
    cfg = _config()
    assert not _layer(cfg, {}).bind_decode_layer()  # bf16 nn.Linear: the oneDNN path
    assert not _layer(cfg, {"qkv_proj": "int4", "o_proj": "int4"}).bind_decode_layer()
    assert _layer(cfg, FORMATS["mixed"]).bind_decode_layer()


def test_decode_layer_rejects_bad_arguments():
    cfg = _config()
    layer = _layer(cfg, FORMATS["int4"])
    assert layer.bind_decode_layer()
    op = torch.ops.servelm_quant.decode_layer.default
    weights, groups, bias, heads, kv_heads, scale = layer._decode_args

    def call(n=1, w=weights, gs=groups, residual_dtype=torch.bfloat16):
        batch, cos, sin, kv, residual, delta = _setup(cfg, [20] * n)
        with torch.inference_mode():
            return op(delta, residual.to(residual_dtype), layer.input_layernorm.weight,
                      layer.post_attention_layernorm.weight, 1e-5, w, gs, bias, cos, sin,
                      kv[0], kv[1], batch.slot_mapping, batch.decode_block_tables,
                      batch.decode_context_lens, heads, kv_heads, scale)

    with pytest.raises(RuntimeError, match="decode_layer takes 1 to 23 rows, got 24"):
        call(n=DECODE_LAYER_MAX_ROWS)
    with pytest.raises(RuntimeError, match="group_sizes needs 4 entries"):
        call(gs=groups[:3])
    with pytest.raises(RuntimeError, match="too few weight tensors"):
        call(w=weights[:-1])
    with pytest.raises(RuntimeError, match="left over"):
        call(w=weights + [weights[0]])
    with pytest.raises(RuntimeError, match="residual must be contiguous bfloat16"):
        call(residual_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="decode_layer o_proj: int8 qweight"):  # int4 as int8
        call(gs=[32, 0, 32, 32])


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def bf16_quant_llms():
    # No prefix caching: both runs must batch the same rows (the kernels' arithmetic
    # differs from 48 rows on, so a cached prefix would change the prompt step).
    return {q: LLM(dtype="bfloat16", quantization=q, kv_cache_memory=128 << 20,
                   enable_prefix_caching=False) for q in ("int4", "int8")}


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_engine_decode_layer_matches_per_op_path(quant, bf16_quant_llms):
    llm = bf16_quant_llms[quant]
    model = llm.engine.model
    assert model.fused_decode
    calls = []
    real = DecoderLayer.forward_decode

    def counting(self, *a):
        calls.append(1)
        return real(self, *a)

    ids = llm.get_tokenizer().encode("The first rule of serving language models is")
    prompts = [ids, ids[:3], list(range(1000, 1300))]  # one context past 256 tokens
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    try:
        DecoderLayer.forward_decode = counting
        fused = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        model.fused_decode = False
        per_op = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        DecoderLayer.forward_decode = real
        model.fused_decode = True
    assert calls  # decode steps went through decode_layer
    for a, b in zip(fused, per_op):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_engine_keeps_per_op_path_where_decode_layer_does_not_apply(monkeypatch):
    # fp32 activations (the kernels split them into bf16 hi + lo): bound, never called.
    llm = LLM(dtype="float32", quantization="int4", kv_cache_memory=32 << 20)
    assert llm.engine.model.fused_decode
    monkeypatch.setattr(DecoderLayer, "forward_decode", lambda *a: pytest.fail("called"))
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # The switch for side-by-side runs.
    monkeypatch.setenv("SERVELM_NO_FUSED_DECODE", "1")
    assert not LLM(dtype="bfloat16", quantization="int4",
                   kv_cache_memory=32 << 20).engine.model.fused_decode
