"""servelm_stack.DecodeStack: all decoder layers of a decode-only step in one C++ call.

It must give exactly (bit for bit) what the per-op kernel path gives, since it runs the
same kernels with the same split of the work; these tests compare the two on random
models and through the engine, and check when the engine takes it and when it does not.
"""

from __future__ import annotations

import pytest
import torch

from servelm import LLM, SamplingParams
from servelm import quantization as Q
from servelm.kernels import load_ops
from servelm.layers import amx, q8act, w8a8
from servelm.layers.stack import StackFormat
from servelm.models import decode_stack
from servelm.models.config import ModelConfig
from servelm.models.llama import LlamaForCausalLM
from tests.helpers import (decode_rows, assert_stack_decodes_as_per_op,
                           method_targets, per_op_and_stack, random_bf16_model)

pytestmark = pytest.mark.skipif(not (Q.kernels_available() and load_ops("ops")),
                                reason="needs the C++ kernels (AVX-512 BF16)")

BS = 16  # KV block size
# From these many rows on the matmuls decode each weight tile once (a different kernel).
# q8act runs one kernel at every row count: its rows are those of the int4 tiles.
# amx: its tiles fit the call's rows up to 32, then blocks of 32.
DECODE_ONCE = {"int4": 48, "int8": 24, "mixed": 24, "bf16": 8, "mixed16": 8, "q8act": 48,
               "mixedq8": 24, "amx": 33, "mixedamx": 33, "amxsilu": 8, "amxsilu2": 33}


def _config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                max_position_embeddings=4096)
    return ModelConfig(**{**base, **kw})


def _model(cfg: ModelConfig, formats: dict[str, str], seed: int = 0) -> LlamaForCausalLM:
    """A random bf16 model with each linear of every layer quantised as formats says."""
    model = random_bf16_model(cfg, seed)
    for name, method in formats.items():
        if method == "bf16":  # bf16 weights in the kernels' tiles
            method_targets(model.layers, (name,), "tiles")
        elif method in ("amx", "amxsilu"):  # bf16 weights in AMX tile order
            method_targets(model.layers, (name,), "amx")
            if method == "amxsilu":  # gate_up with its gate and up blocks alternating
                assert all(layer.mlp.fuse_activation() == 1 for layer in model.layers)
        elif method == "q8act":  # int4 in q8act's panels (activations quantised to int8)
            Q.quantize_model(model.layers, "int4", targets=(name,))
            method_targets(model.layers, (name,), "q8act")
        else:
            Q.quantize_model(model.layers, method, targets=(name,))
    return model.eval()


def _setup(cfg, lens, seed=1):
    return decode_rows(cfg, lens, BS, seed)


_both = per_op_and_stack


FORMATS = {
    "int4": dict.fromkeys(Q.TARGETS, "int4"),
    "int8": dict.fromkeys(Q.TARGETS, "int8"),
    "mixed": {"qkv_proj": "int4", "o_proj": "int8", "gate_up_proj": "int8", "down_proj": "int4"},
    "bf16": dict.fromkeys(Q.TARGETS, "bf16"),
    "mixed16": {"qkv_proj": "bf16", "o_proj": "int4", "gate_up_proj": "bf16", "down_proj": "int8"},
    "q8act": dict.fromkeys(Q.TARGETS, "q8act"),
    "mixedq8": {"qkv_proj": "q8act", "o_proj": "int8", "gate_up_proj": "int4", "down_proj": "q8act"},
    "amx": dict.fromkeys(Q.TARGETS, "amx"),
    "mixedamx": {"qkv_proj": "amx", "o_proj": "int4", "gate_up_proj": "amx", "down_proj": "q8act"},
    # gate_up writes silu(gate) * up itself (QLinear::kAmxGated); down on the tiles (bf16)
    # and on amx (whose A tiles the stack packs from 33 rows: its own row step)
    "amxsilu": {"qkv_proj": "amx", "o_proj": "amx", "gate_up_proj": "amxsilu", "down_proj": "bf16"},
    "amxsilu2": {**dict.fromkeys(Q.TARGETS, "amx"), "gate_up_proj": "amxsilu"},
}


def _needs(fmt: str) -> None:
    if "q8" in fmt and not q8act.available():
        pytest.skip("the q8act kernel is not built here (AVX2, FMA, F16C)")
    if "amx" in fmt and not amx.available():
        pytest.skip("the amx kernel does not run here (AMX-BF16)")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("lens", [[1], [37], [150], [300], [5, 300, 17], [3] * 7 + [90] * 6,
                                  "below", "above", "many"])
@pytest.mark.parametrize("layers", [1, 3])
def test_decode_stack_is_bit_identical_to_the_per_op_path(fmt, lens, layers):
    _needs(fmt)
    cfg = _config(num_layers=layers)
    model = _model(cfg, FORMATS[fmt])
    if lens in ("below", "above", "many"):  # rows either side of the decode-once threshold;
        # many: past 192 rows, where amx packs blocks of 32 rows
        rows = {"below": DECODE_ONCE[fmt] - 1, "above": 64, "many": 200}[lens]
        lens = list(range(1, 4 * rows, 4))  # contexts 1 .. 4 rows - 3
    batch, data, caches = _setup(cfg, lens)
    before = data.clone()
    (h0, kv0), (h1, kv1) = _both(model, batch, data, caches)
    assert torch.equal(h0, h1)
    assert torch.equal(kv0, kv1)  # each layer's new K/V written alike
    assert not torch.equal(kv0, before)


@pytest.mark.parametrize("fmt", ["int4", "bf16", "q8act", "amx"])
def test_decode_stack_with_qkv_bias_and_other_head_dims(fmt):
    _needs(fmt)
    # Qwen2-style qkv bias; head_dim 64 (the AVX-512 attention path) and 5 query heads per KV.
    cfg = _config(hidden_size=320, num_heads=5, num_kv_heads=1, head_dim=64,
                  intermediate_size=128, attention_bias=True, num_layers=2)
    model = _model(cfg, FORMATS[fmt])
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    batch, data, caches = _setup(cfg, [9, 64, 130])
    (h0, kv0), (h1, kv1) = _both(model, batch, data, caches)
    assert torch.equal(h0, h1) and torch.equal(kv0, kv1)


def test_decode_stack_binds_only_quantised_kernel_layers():
    cfg = _config(num_layers=2)
    _, _, caches = _setup(cfg, [4])
    assert not _model(cfg, {}).bind_decode_layers(caches)  # bf16 nn.Linear: the oneDNN path
    assert not _model(cfg, {"qkv_proj": "bf16"}).bind_decode_layers(caches)  # others untiled
    assert not _model(cfg, {"qkv_proj": "int4", "o_proj": "int4"}).bind_decode_layers(caches)
    model = _model(cfg, FORMATS["mixed"])
    assert model.bind_decode_layers(caches) and model.fused_decode
    assert model._decode_stacks[0][2].max_rows() == 4096
    assert model.decode_stack_ranges() == [(1, 4096)]  # one module set for every row count
    model = _model(cfg, FORMATS["int4"])
    assert model.bind_decode_layers(caches)
    # A tensor-parallel layer all-reduces its attention and MLP outputs: never stacked.
    attn = model.layers[1].self_attn
    attn.__class__ = type("ParallelLike", (type(attn),), {})
    assert not model.bind_decode_layers(caches) and not model.fused_decode
    assert not model.float().bind_decode_layers(caches)  # fp32 activations: per-op path


def _bucketed(model, methods: list[str], down: list[str] | None = None) -> None:
    """Every layer's linear layers from int4 sources, run by row bucket on `methods` (one a
    bucket; down_proj on `down` where given), as servelm.tuning leaves them. A w8a8 layer's
    source gets a calibration (channel maxima with outliers) first."""
    from servelm.layers import linear_methods as lm

    Q.quantize_model(model.layers, "int4")
    g = torch.Generator().manual_seed(3)
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            src = getattr(owner, name)
            ms = down if down is not None and name == "down_proj" else methods
            if any(m.startswith("w8a8") for m in ms):
                amax = torch.rand(src.in_features, generator=g) + 0.5
                amax[:2] *= 30
                setattr(src, w8a8.AMAX, amax)
            built = {m: lm.build(m, src, torch.bfloat16) for m in dict.fromkeys(ms)}
            setattr(owner, name, lm.BucketedLinear([built[m] for m in ms], ms))


@pytest.mark.parametrize("form", ["w8a8", "w8a8_pairs"])
def test_w8a8_batches_get_a_stack_of_their_own(form):
    """The tuner's int4 choice on a Zen 4: q8act for one and a few rows, w8a8 (int8 weights
    and activations) from 23 on the calibrated layers, down_proj on q8act throughout (on a
    Zen 5: w8a8's pair form): a stack for each run, each bit for bit the per-op path on its
    rows."""
    if not (q8act.available() and w8a8.available() and w8a8.int8_dot()):
        pytest.skip("the w8a8 kernel needs AVX-512 VNNI")
    if form == "w8a8_pairs" and not w8a8.pairs_available():
        pytest.skip("w8a8's pair form needs AVX-512 VNNI")
    for cfg in (_config(num_layers=2),
                _config(hidden_size=320, num_heads=5, num_kv_heads=1, head_dim=64,
                        intermediate_size=128, attention_bias=True, num_layers=2)):
        model = _model(cfg, {})
        _bucketed(model, ["q8act", "q8act", form, form], down=["q8act"] * 4)
        for lens in ([5, 30, 9], [3] * 30, list(range(1, 800, 4))):
            batch, data, caches = _setup(cfg, lens)
            (h0, kv0), (h1, kv1) = _both(model, batch, data, caches)
            assert torch.equal(h0, h1) and torch.equal(kv0, kv1)
        assert model.decode_stack_ranges() == [(1, 22), (23, 4096)]


def test_a_stack_for_each_run_of_buckets_on_kernel_modules():
    """The tuner's int4 choice on an AMX Xeon (q8act for one and a few rows, amx, the weights
    dequantised to bf16, from 23): one stack for each, each bit for bit the per-op path on
    its rows; a bucket on a method the stack does not run (oneDNN) leaves its rows per-op."""
    _needs("q8act amx")
    cfg = _config(num_layers=2)
    model = _model(cfg, {})
    _bucketed(model, ["q8act", "q8act", "amx", "amx"])
    for lens in ([5, 30, 9], [3] * 30):
        batch, data, caches = _setup(cfg, lens)
        (h0, kv0), (h1, kv1) = _both(model, batch, data, caches)
        assert torch.equal(h0, h1) and torch.equal(kv0, kv1)
    assert model.decode_stack_ranges() == [(1, 22), (23, 4096)]
    model = _model(cfg, {})
    _bucketed(model, ["q8act", "onednn", "amx", "amx"])
    _, _, caches = _setup(cfg, [4])
    assert model.bind_decode_layers(caches)
    assert model.decode_stack_ranges() == [(1, 1), (23, 4096)]
    assert model.decode_stack_takes(caches, 1) and model.decode_stack_takes(caches, 23)
    assert not model.decode_stack_takes(caches, 8)  # oneDNN's rows: the per-op path
    model = _model(cfg, {})
    _bucketed(model, ["onednn"] * 4)
    assert not model.bind_decode_layers(caches) and model.decode_stack_ranges() == []


def test_decode_stack_rejects_bad_arguments():
    if not decode_stack.available():  # (which loads the class: no model is bound here)
        pytest.skip("the DecodeStack is not built here (AVX-512 BF16)")
    cfg = _config(num_layers=2)
    model = _model(cfg, FORMATS["int4"])
    rows = 3
    batch, data, caches = _setup(cfg, [20] * rows)
    parts = [layer.decode_stack_args() for layer in model.layers]
    desc = decode_stack.describe(model)

    def stack(weights=None, groups=None, norms=None, caches=caches):
        return torch.classes.servelm_stack.DecodeStack(
            [t for p in parts for t in p[0]] if weights is None else weights,
            [g for p in parts for g in p[1]] if groups is None else groups,
            [t for p in parts for t in p[2]] if norms is None else norms,
            [b for p in parts for b in p[3]], [k for k, _ in caches], [v for _, v in caches],
            desc.layer_options(), desc.model_options(), desc.model_scalars())

    weights = [t for p in parts for t in p[0]]
    none = StackFormat.NONE  # (no output gate, no per-layer input: each layer's last three linears)
    with pytest.raises(RuntimeError, match="per layer 13 norms, 7 formats"):
        stack(groups=[32] * 9)
    with pytest.raises(RuntimeError, match="too few weight tensors"):
        stack(weights=weights[:-1])
    with pytest.raises(RuntimeError, match="left over"):
        stack(weights=weights + [weights[0]])
    with pytest.raises(RuntimeError, match="DecodeStack o_proj: int8 qweight"):  # int4 as int8
        stack(groups=[32, 0, 32, 32, none, none, none] * 2)
    with pytest.raises(RuntimeError, match="DecodeStack o_proj: bf16 weight must be"):  # as bf16
        stack(groups=[32, -1, 32, 32, none, none, none] * 2)
    with pytest.raises(RuntimeError, match="group size -5 is none of int4's"):
        stack(groups=[32, -5, 32, 32, none, none, none] * 2)
    with pytest.raises(RuntimeError, match="only an attention layer's extra linear"):
        stack(groups=[32, none, 32, 32, none, none, none] * 2)
    with pytest.raises(RuntimeError, match="only gate_up_proj may be gated amx"):
        stack(groups=[32, StackFormat.AMX_GATED, 32, 32, none, none, none] * 2)
    q8 = StackFormat.Q8ACT
    with pytest.raises(RuntimeError, match="none of int4's .* q8act's .* or w8a8's"):  # q8act, no group
        stack(groups=[32, q8, 32, 32, none, none, none] * 2)
    with pytest.raises(RuntimeError, match="DecodeStack o_proj: q8act qweight must be"):  # tiles
        stack(groups=[32, q8 + 32, 32, 32, none, none, none] * 2)
    with pytest.raises(RuntimeError, match="q8act group size must be a multiple of 32"):
        stack(groups=[32, q8 + 16, 32, 32, none, none, none] * 2)
    with pytest.raises(RuntimeError, match="DecodeStack o_proj: amx"):  # int4 tiles as amx
        stack(groups=[32, StackFormat.AMX, 32, 32, none, none, none] * 2)
    with pytest.raises(RuntimeError, match="norm weights must be contiguous bfloat16"):
        stack(norms=[t.float() for p in parts for t in p[2]])
    with pytest.raises(RuntimeError, match="a per-layer input has its gate and projection"):
        stack(groups=[32, 32, 32, 32, none, 32, 32] * 2, weights=weights + weights[:6])
    s = stack()
    with pytest.raises(RuntimeError, match="the layers take no per-layer inputs"):
        s.set_per_layer_inputs(torch.zeros(rows, 2, 16).bfloat16())
    assert s.num_layers() == 2
    x = torch.randn(rows, cfg.hidden_size).bfloat16()
    cos = sin = torch.ones(rows, cfg.head_dim).bfloat16()
    args = (batch.slot_mapping, batch.attn.decodes.block_tables, batch.attn.decodes.context_lens)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="DecodeStack takes 1 to 4096 rows, got 4097"):
            s.run(torch.randn(4097, cfg.hidden_size).bfloat16(), cos, sin, *args)
        with pytest.raises(RuntimeError, match="residual must be contiguous bfloat16"):
            s.run(x[:2].float(), cos[:2], sin[:2], *(a[:2] for a in args))
        with pytest.raises(RuntimeError, match="one row per token"):
            s.run(x[:2], cos[:2], sin[:2], *args)
        # The stack runs rotary, the KV write and attention itself: their inputs are checked.
        two = [a[:2] for a in args]
        with pytest.raises(RuntimeError, match="cos/sin must be contiguous bfloat16"):
            s.run(x[:2], cos[:2, :-1], sin[:2, :-1], *two)
        with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = -1 is outside the KV cache"):
            s.run(x[:2], cos[:2], sin[:2], torch.tensor([0, -1]), *two[1:])
        with pytest.raises(RuntimeError, match="slot_mapping must be contiguous int64"):
            s.run(x[:2], cos[:2], sin[:2], two[0].int(), *two[1:])
        with pytest.raises(RuntimeError, match="block_tables and context_lens must be contiguous int32"):
            s.run(x[:2], cos[:2], sin[:2], two[0], two[1].long(), two[2])
        with pytest.raises(RuntimeError, match=r"context_lens\[0\] = 100000 exceeds its block table"):
            s.run(x[:2], cos[:2], sin[:2], two[0], two[1], torch.tensor([100000, 20], dtype=torch.int32))
        # run_tokens: the whole step from token ids, once bind_io has given it the tables.
        ids, pos = torch.tensor([1, 2, 3]), torch.tensor([19, 19, 19])
        with pytest.raises(RuntimeError, match="call bind_io first"):
            s.run_tokens(ids, pos, *args)
        emb, norm = model.embed_tokens.weight, model.norm.weight
        table = torch.ones(64, cfg.head_dim).bfloat16()
        with pytest.raises(RuntimeError, match="cos/sin must be contiguous bfloat16"):
            s.bind_io(emb, table.float(), table.float(), norm)
        with pytest.raises(RuntimeError, match="embed must be contiguous bfloat16"):
            s.bind_io(emb[:, :-1], table, table, norm)
        s.bind_io(emb, table, table, norm)
        with pytest.raises(RuntimeError, match=r"input_ids\[1\] = 256 is outside the vocabulary"):
            s.run_tokens(torch.tensor([1, 256, 3]), pos, *args)
        with pytest.raises(RuntimeError, match=r"positions\[2\] = 64 is outside the rotary table"):
            s.run_tokens(ids, torch.tensor([19, 19, 64]), *args)
        with pytest.raises(RuntimeError, match="input_ids and positions must be contiguous int64"):
            s.run_tokens(ids.int(), pos, *args)
        assert s.run_tokens(ids, pos, *args).shape == (rows, cfg.hidden_size)
        # run_lists: the same step from plain lists (the model runner's decode-only path).
        lists = [ids.tolist(), pos.tolist(), args[0].tolist(), args[1].flatten().tolist(),
                 args[2].tolist()]
        assert torch.equal(s.run_lists(*lists), s.run_tokens(ids, pos, *args))
        with pytest.raises(RuntimeError, match="one entry per row"):
            s.run_lists(lists[0][:2], *lists[1:])
        with pytest.raises(RuntimeError, match="block id -1 out of range"):
            s.run_lists(*lists[:3], [-1] + lists[3][1:], lists[4])
        with pytest.raises(RuntimeError, match=r"context_lens\[0\] = 0 out of range"):
            s.run_lists(*lists[:4], [0] + lists[4][1:])


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def bf16_quant_llms():
    # No prefix caching: both runs must batch the same rows (the kernels' arithmetic
    # differs from 48 rows on, so a cached prefix would change the prompt step).
    # "q8act": int4 weights in q8act's panels (the tuner's one-row choice on some CPUs).
    kw = dict(dtype="bfloat16", kv_cache_memory=128 << 20, enable_prefix_caching=False)
    llms = {q: LLM(quantization=q, linear_method="tiles", **kw) for q in ("int4", "int8", None)}
    if q8act.available():
        llms["q8act"] = LLM(quantization="int4", linear_method="q8act", **kw)
    if amx.available():  # bf16 weights in AMX tile order
        llms["amx"] = LLM(linear_method="amx", **kw)
    return llms


@pytest.mark.parametrize("quant", ["int4", "int8", None, "q8act", "amx"])  # None: bf16 tiles
def test_engine_decode_stack_matches_per_op_path(quant, bf16_quant_llms):
    _needs(str(quant))
    llm = bf16_quant_llms[quant]
    model = llm.engine.executor.model
    assert model.fused_decode
    ids = llm.get_tokenizer().encode("The first rule of serving language models is")
    prompts = [ids, ids[:3], list(range(1000, 1300))]  # one context past 256 tokens
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    assert_stack_decodes_as_per_op(llm, prompts, sp)


def test_engine_binds_the_stack_only_where_it_applies():
    kw = dict(kv_cache_memory=32 << 20, linear_method="tiles")
    # fp32 activations (the kernels split them into bf16 hi + lo): the per-op path.
    assert not LLM(dtype="float32", quantization="int4", **kw).engine.executor.model.fused_decode
    # bf16 weights in the kernels' tiles: on the stack too; on oneDNN's matmuls, not.
    assert LLM(dtype="bfloat16", **kw).engine.executor.model.fused_decode
    assert not LLM(dtype="bfloat16", kv_cache_memory=32 << 20,
                   linear_method="onednn").engine.executor.model.fused_decode
    # The switch for side-by-side runs.
    assert not LLM(dtype="bfloat16", quantization="int4", fused_decode=False,
                   **kw).engine.executor.model.fused_decode
