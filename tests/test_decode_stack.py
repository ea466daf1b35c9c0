"""The DecodeStack on every family whose layers it can describe (servelm.models.decode_stack):
Qwen3 (q/k norms), Mistral (a window on every layer), Phi-3 (partial rotary), Gemma 3 (q/k
norms, sandwich norms, tanh-GELU, windows with their own rotary table, a softmax scale, an
embedding scale), Gemma 2 (soft-capped scores), Qwen2 (qkv bias), SmolLM3 (a layer without
rotary), Granite (scaled residual branches), Ministral 3 (position-scaled queries), OLMo 3
and EXAONE 4 (norms after attention and the MLP alone; OLMo's q / k norms over the whole
projection), StableLM and Cohere (LayerNorms; Cohere's attention and MLP in parallel) and
Llama, and routed experts (Qwen3-MoE; Qwen2-MoE with its gated shared expert; GLM-4-MoE
with its grouped sigmoid router; gpt-oss with its attention sinks), each against the per-op kernel path on tiny random models, int4 and
bf16 weights (int4 and MXFP4 experts), contexts short of and past the window. A family it
cannot describe (bf16 or int8 experts) runs op by op and says why.

Bit for bit: the per-op path's q/k norms run the same row kernel as the stack's (a head a
row).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

from servelm import quantization as Q
from servelm.kernels import load_ops
from servelm.models import decode_stack
from servelm.models.config import FULL, SLIDING, ModelConfig
from servelm.models.decoder import CausalLM
from tests.helpers import (GEMMA4_LAYERS, decode_rows, assert_stack_decodes_as_per_op,
                           gemma4_scales_off_one,
                           method_targets, per_op_and_stack, random_bf16_model,
                           tiny_hf_checkpoint)

pytestmark = pytest.mark.skipif(
    not (Q.kernels_available() and load_ops("ops") and decode_stack.available()),
    reason="needs the C++ kernels (AVX-512 BF16)")

BS = 16  # KV block size
WINDOW = 24  # the sliding layers' window: some contexts below run past it

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=512)
FAMILIES = {
    "llama": dict(architecture="LlamaForCausalLM"),
    "qwen2": dict(architecture="Qwen2ForCausalLM", family="qwen2", attention_bias=True),
    "qwen3": dict(architecture="Qwen3ForCausalLM", family="qwen3", qk_norm=True, head_dim=32),
    "mistral": dict(architecture="MistralForCausalLM", sliding_window=WINDOW,
                    layer_types=(SLIDING,) * 3),
    "phi3": dict(architecture="Phi3ForCausalLM", family="phi3", rotary_dim=8),
    "gemma3": dict(architecture="Gemma3ForCausalLM", family="gemma3", qk_norm=True,
                   sandwich_norms=True, hidden_act="gelu_tanh", head_dim=32,
                   embed_scale=math.sqrt(64), attn_scale=24 ** -0.5, sliding_window=WINDOW,
                   layer_types=(SLIDING, FULL, SLIDING), rope_local_theta=10000.0,
                   rope_theta=1e6, final_logit_softcap=30.0),
    # Soft-capped scores (a cap low enough that random weights' scores bend).
    "gemma2": dict(architecture="Gemma2ForCausalLM", family="gemma2", sandwich_norms=True,
                   hidden_act="gelu_tanh", head_dim=32, embed_scale=math.sqrt(64),
                   attn_scale=24 ** -0.5, sliding_window=WINDOW,
                   layer_types=(SLIDING, FULL, SLIDING), attn_logit_softcap=0.5,
                   final_logit_softcap=30.0),
    # A layer without rotary (SmolLM3's every fourth: NoPE).
    "smollm3": dict(architecture="SmolLM3ForCausalLM", no_rope_layers=(1,)),
    # Each branch's output scaled before the residual add, with an embedding and an
    # attention multiplier (Granite).
    "granite": dict(architecture="GraniteForCausalLM", family="granite", residual_scale=0.22,
                    embed_scale=12.0, attn_scale=0.4),
    # Queries scaled by their position after the rotary, stepping every 16 positions
    # (Ministral 3).
    "ministral3": dict(architecture="Ministral3ForCausalLM", family="ministral3",
                       query_scale_beta=0.5, query_scale_period=16),
    # Norms after attention and the MLP alone, q / k norms over the whole projection, a
    # window on the sliding layers (OLMo 3; OLMo 2 without the window).
    "olmo3": dict(architecture="Olmo3ForCausalLM", family="olmo2", qk_norm=True,
                  qk_norm_whole=True, sandwich_norms=True, pre_norms=False,
                  sliding_window=WINDOW, layer_types=(SLIDING, SLIDING, FULL)),
    # LayerNorms with biases, a qkv bias, a partial rotary (StableLM 2).
    "stablelm": dict(architecture="StableLmForCausalLM", family="stablelm", norm_type="layer",
                     attention_bias=True, rotary_dim=4),
    # LayerNorms without biases, attention and the MLP in parallel on one norm (Cohere).
    "cohere": dict(architecture="CohereForCausalLM", family="cohere", norm_type="layer_no_bias",
                   parallel_block=True),
    # In parallel, the MLP on a norm of its own.
    "parallel_two_norms": dict(architecture="StableLmForCausalLM", family="stablelm",
                               norm_type="layer", parallel_block=True, parallel_mlp_norm=True),
    # Non-gated MLPs with biases on every linear: after attention (Starcoder2, a window on
    # every layer), in parallel on one norm (Phi-2, a partial rotary) or on two (GPT-NeoX,
    # erf's GELU).
    "starcoder2": dict(architecture="Starcoder2ForCausalLM", family="starcoder2",
                       norm_type="layer", mlp_gated=False, hidden_act="gelu_tanh",
                       attention_bias=True, attention_out_bias=True, mlp_bias=True,
                       sliding_window=WINDOW, layer_types=(SLIDING,) * 3),
    "phi": dict(architecture="PhiForCausalLM", family="phi", norm_type="layer",
                parallel_block=True, mlp_gated=False, mlp_bias=True, hidden_act="gelu_tanh",
                attention_bias=True, attention_out_bias=True, rotary_dim=8),
    "gpt_neox": dict(architecture="GPTNeoXForCausalLM", family="gpt_neox", norm_type="layer",
                     parallel_block=True, parallel_mlp_norm=True, mlp_gated=False,
                     mlp_bias=True, hidden_act="gelu", attention_bias=True,
                     attention_out_bias=True, rotary_dim=4),
    # Gemma 4 (its window WINDOW too): see GEMMA4_LAYERS.
    "gemma4": GEMMA4_LAYERS,
    # The same norms' places with per-head q / k norms, its global layer without rotary.
    "exaone4": dict(architecture="Exaone4ForCausalLM", family="exaone4", qk_norm=True,
                    sandwich_norms=True, pre_norms=False, sliding_window=WINDOW,
                    layer_types=(SLIDING, SLIDING, FULL), no_rope_layers=(2,)),
}


# With routed experts beside every dense MLP (Gemma 4's MoE block: the router on the stream,
# its input normalised and scaled, the chosen weights scaled per expert).
FAMILIES["gemma4_moe"] = dict(FAMILIES["gemma4"], num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32,
                              extra=dict(FAMILIES["gemma4"]["extra"], moe_beside_mlp=True))


def _model(family: str, fmt: str, seed: int = 0) -> CausalLM:
    cfg = ModelConfig(**{**BASE, **FAMILIES[family]})
    model = random_bf16_model(cfg, seed)
    with torch.no_grad():
        for layer in model.layers:
            if layer.layer_scalar is not None:  # scalars near 1, each its own
                layer.layer_scalar.uniform_(0.6, 1.4)
            if layer.moe is not None:  # router scales near 1
                layer.moe.experts.router_scale.uniform_(0.6, 1.4)
                layer.moe.experts.per_expert_scale.uniform_(0.6, 1.4)
    if fmt == "bf16":  # bf16 weights in the kernels' tiles
        method_targets(model.layers, Q.TARGETS, "tiles")
    else:
        Q.quantize_model(model.layers, fmt)
    method_targets(model.layers, ("input_gate", "input_proj"), "tiles")  # Gemma 4's PLE
    model.select_ops(True)  # the per-op path on servelm's C++ ops, as the runner selects it
    return model.eval()


def _setup(cfg, lens, seed=1):
    return decode_rows(cfg, lens, BS, seed)


_both = per_op_and_stack


# Contexts: one row; either side of the window and past it; 50 rows (from 48 the int4
# matmuls decode each weight tile once).
LENS = [[1], [WINDOW - 1, WINDOW, WINDOW + 1, 100, 17, 300], list(range(1, 200, 4))]


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_on_the_stack_is_the_per_op_path(family, fmt):
    model = _model(family, fmt)
    assert model.decode_stack_supported()
    # LayerNorm families: more data at 50 rows (their norms' bits once parted one row in ~50).
    layer_norm = FAMILIES[family].get("norm_type", "rms") != "rms"
    for lens in LENS:
        for seed in (1, 2, 3, 4) if layer_norm and len(lens) > 40 else (1,):
            batch, data, caches = _setup(model.config, lens, seed)
            before = data.clone()
            (h0, kv0), (h1, kv1) = _both(model, batch, data, caches)
            assert torch.equal(h0, h1)
            assert torch.equal(kv0, kv1)  # each layer's new K/V written alike
            assert not torch.equal(kv0, before)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_layers_of_different_mlp_widths_on_the_stack(fmt):
    """Each layer's MLP at its own width (Gemma 4's double-wide layers; a MoE model's dense
    layers beside its shared experts): the per-op path's bits."""
    cfg = ModelConfig(**{**BASE, **FAMILIES["llama"], "extra": {"intermediate_sizes": (96, 192, 64)}})
    model = random_bf16_model(cfg)
    assert [layer.mlp.intermediate for layer in model.layers] == [96, 192, 64]
    if fmt == "bf16":
        method_targets(model.layers, Q.TARGETS, "tiles")
    else:
        Q.quantize_model(model.layers, fmt)
    model.select_ops(True)
    for lens in LENS:
        batch, data, caches = _setup(model.config, lens)
        (h0, kv0), (h1, kv1) = _both(model, batch, data, caches)
        assert torch.equal(h0, h1) and torch.equal(kv0, kv1)


def test_the_description_carries_each_layer_option():
    d = decode_stack.describe(_model("gemma3", "int4"))
    assert [(x.window, x.local_rotary) for x in d.layers] == [(WINDOW, True), (0, False),
                                                                (WINDOW, True)]
    assert all(x.qk_norm and x.sandwich_norms and not x.qkv_bias for x in d.layers)
    assert d.activation == decode_stack.Activation.GELU_TANH and d.scale == 24 ** -0.5
    assert d.embed_scale == 8.0 and d.rotary_dim == 32
    assert decode_stack.describe(_model("phi3", "int4")).rotary_dim == 8
    assert decode_stack.describe(_model("qwen2", "int4")).layers[0].qkv_bias
    assert decode_stack.describe(_model("mistral", "int4")).layers[2].window == WINDOW
    assert decode_stack.describe(_model("gemma2", "int4")).attn_softcap == 0.5
    assert decode_stack.describe(_model("gemma3", "int4")).attn_softcap == 0.0


MOE_FAMILIES = {
    # Softmax routing renormalised over the chosen experts, q / k norms.
    "qwen3_moe": dict(architecture="Qwen3MoeForCausalLM", family="qwen3_moe", qk_norm=True,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    # A shared expert gated by sigmoid(shared_expert_gate(x)) beside the routed experts, a
    # qkv bias (Qwen2-MoE).
    "qwen2_moe": dict(architecture="Qwen2MoeForCausalLM", family="qwen2_moe", attention_bias=True,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=False, shared_expert_intermediate_size=96),
    # DeepSeek-V3's grouped sigmoid router (a correction bias; 2 groups of 4, the best one's
    # experts chosen), ungated shared experts, a dense first layer of another width, q/k
    # norms, q/k/v biases, a partial rotary (GLM-4-MoE).
    "glm4_moe": dict(architecture="Glm4MoeForCausalLM", family="glm4_moe", qk_norm=True,
                     attention_bias=True, rotary_dim=8, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=32,
                     dense_layers=(0,), extra={"router_scoring": "sigmoid_grouped", "n_group": 2,
                                               "topk_group": 1, "score_bias": True,
                                               "shared_expert_gate": False,
                                               "routed_scaling": 2.5}),
    # A router with a bias, experts with biases and the clamped SwiGLU, attention sinks, q/k/v/o
    # biases, sliding and full layers.
    "gpt_oss": dict(architecture="GptOssForCausalLM", family="gpt_oss", num_experts=8,
                    num_experts_per_tok=3, moe_intermediate_size=64, attention_bias=True,
                    attention_out_bias=True, sliding_window=WINDOW,
                    layer_types=(SLIDING, FULL, SLIDING),
                    extra={"attention_sinks": True, "router_bias": True, "expert_bias": True,
                           "swiglu_limit": 0.3, "swiglu_alpha": 1.702}),
}


def _moe_model(family: str, fmt: str) -> CausalLM:
    """A tiny random MoE model: int4 weights with int4 or MXFP4 experts (random codes and
    exponents, as a checkpoint's), int8 weights and experts, or bf16 ones (tiles); the fused
    experts' op (hence the stack) for steps of up to 64 rows."""
    from servelm.quantization.mxfp4 import MXFP4Weight

    model = random_bf16_model(ModelConfig(**{**BASE, **MOE_FAMILIES[family]}))
    g = torch.Generator().manual_seed(3)
    for layer in model.layers if fmt == "mxfp4" else ():
        mlp = layer.mlp
        if not hasattr(mlp, "to_mxfp4"):  # a dense layer
            continue
        mlp.to_mxfp4()
        for which in ("gate_up", "down"):
            w = getattr(mlp, f"experts_{which}")
            shape = (w.shape[0], mlp._out_features(f"experts_{which}"), w.shape[2])
            mlp.load_mxfp4(which, "all", MXFP4Weight(
                torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g),
                torch.randint(118, 126, shape, dtype=torch.uint8, generator=g), "gguf"))
    if fmt == "bf16":
        method_targets(model.layers, Q.TARGETS, "tiles")
    else:
        Q.quantize_model(model.layers, "int8" if fmt == "int8" else "int4")
    model.moe_fused_rows = 64
    model.select_ops(True)
    return model.eval()


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "int8", "bf16"])
@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_routed_experts_on_the_stack_are_the_per_op_path(family, fmt):
    """A MoE layer's router (servelm_q8act.moe_route's: softmax, or GLM-4-MoE's grouped
    sigmoid) and routed experts (the fused ops' phases: int4 / MXFP4 panels, int8 / bf16
    rows) on the stack, with gpt-oss's sinks, biases and clamped SwiGLU, Qwen2-MoE's gated
    shared expert, GLM-4-MoE's ungated one beside a dense layer of another width: the per-op
    path's bits, for steps up to the fused op's rows (larger ones run op by op)."""
    model = _moe_model(family, fmt)
    assert model.layers[-1].mlp.expert_format == (None if fmt == "bf16" else fmt)
    d = decode_stack.describe(model)
    dense = model.config.dense_layers
    assert all(x.routed_experts == (i not in dense) and x.sinks == (family == "gpt_oss")
               for i, x in enumerate(d.layers))
    for lens in LENS:
        batch, data, caches = _setup(model.config, lens)
        (h0, kv0), (h1, kv1) = _both(model, batch, data, caches)
        assert torch.equal(h0, h1) and torch.equal(kv0, kv1)
    assert max(hi for _, hi in model.decode_stack_ranges()) == 64
    # The tuner asks before the ops are selected: the layers are the stack's all the same;
    # bound on the references (no fused op), it declines them.
    model.select_ops(False)
    assert isinstance(decode_stack.describe(model), decode_stack.StackDescription)
    assert isinstance(decode_stack.layer_args(model.layers[-1]), str)
    model.moe_fused_rows = 4
    model.select_ops(True)
    assert model.bind_decode_layers(caches)
    assert max(hi for _, hi in model.decode_stack_ranges()) == 4


def test_a_moe_model_runs_op_by_op_and_says_why(caplog, monkeypatch):
    """Routed experts the stack does not run (fp32 ones; a router other than the softmax one)
    keep the model op by op, and it says why."""
    monkeypatch.setattr(decode_stack, "_logged", set())  # said once a process: not yet here
    cfg = ModelConfig(**{**BASE, "architecture": "Qwen3MoeForCausalLM", "family": "qwen3_moe",
                         "qk_norm": True, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32})
    torch.manual_seed(0)
    sigmoid = random_bf16_model(cfg)
    for layer in sigmoid.layers:  # Llama 4's router: a sigmoid weighting the experts' inputs
        layer.mlp.options.update(router_scoring="sigmoid", expert_input_weighted=True)
    fp32 = decode_stack.describe(CausalLM(cfg, max_positions=cfg.max_position_embeddings))
    assert isinstance(fp32, str) and "layer 0" in fp32 and "float32" in fp32
    model = sigmoid
    reason = decode_stack.describe(model)
    assert reason.endswith("its router is neither the softmax one nor the grouped sigmoid "
                           "one (routed experts run op by op)")
    assert not model.decode_stack_supported()
    _, _, caches = _setup(cfg, [4])
    with caplog.at_level(logging.INFO, logger="servelm.models.decode_stack"):
        assert not model.bind_decode_layers(caches) and not model.fused_decode
    assert reason in caplog.text
    assert model.decode_stack_ranges() == []


def test_run_rotary_takes_both_tables_and_the_stack_checks_its_description():
    """run_rotary (from embedded rows and each table's cos/sin rows) is run_tokens' middle;
    a description the stack cannot run is refused by name."""
    model = _model("gemma3", "int4")
    cfg = model.config
    lens = [3, 40, 9]
    batch, data, caches = _setup(cfg, lens)
    assert model.bind_decode_layers(caches)
    stack = model._decode_stacks[0][2]
    dec = batch.attn.decodes
    args = (batch.slot_mapping, dec.block_tables, dec.context_lens)
    with torch.inference_mode():
        saved = data.clone()
        want = stack.run_tokens(batch.input_ids, batch.positions, *args)
        data.copy_(saved)
        x = model.embed(batch.input_ids)
        tables = [t for r in (model.rotary, model.rotary_local)
                  for t in r.cos_sin(batch.positions, torch.bfloat16)]
        delta = stack.run_rotary(x, tables, *args)
        got = torch.ops.servelm_ops.fused_add_rms_norm(delta, x, model.norm.weight,
                                                       model.norm.eps)
        assert torch.equal(got, want)
        with pytest.raises(RuntimeError, match="4 rotary tensors"):
            stack.run(x, *tables[:2], *args)
    desc = decode_stack.describe(model)
    parts = [decode_stack.layer_args(layer) for layer in model.layers]
    with pytest.raises(RuntimeError, match="rotary_dim must be even"):
        decode_stack.build(dataclasses.replace(desc, rotary_dim=7), parts, caches)
    with pytest.raises(RuntimeError, match="none of SiLU"):
        decode_stack.build(dataclasses.replace(desc, activation=5), parts, caches)
    no_k = [(w, f, [n if i != decode_stack.NormSlot.K else torch.empty(0)
                    for i, n in enumerate(norms)], b) for w, f, norms, b in parts]
    with pytest.raises(RuntimeError, match="q and k norms come together"):
        decode_stack.build(desc, no_k, caches)


# ---------------------------------------------------------------- through the engine

GEMMA4 = dict(num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=8,
              layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                      "rope_theta": 1e4}})
ENGINE_FAMILIES = {  # tiny HF checkpoints (as tests/test_families.py makes them)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=8)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=12.0, attention_multiplier=0.4, residual_multiplier=0.22,
        logits_scaling=8.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(use_qkv_bias=True)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.25)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    # YaRN over an original context of 8: the queries' scale steps every 8 positions.
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5})),
    # Non-gated MLPs (erf's GELU on GPT-NeoX), Phi and GPT-NeoX in parallel blocks.
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        sliding_window=8, norm_epsilon=1e-5)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=4)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=4)),
    # Gated-DeltaNet layers over recurrent states, then a full-attention layer with its
    # output gate, q / k norms and a partial rotary.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        initializer_range=0.1)),
    # Gemma 4: global layers with their own head size and KV heads, their values their keys'
    # projection; weightless v norms; per-layer inputs; layer scalars; the last two layers
    # reading an earlier layer's KV cache, with double-wide MLPs. And its plain form.
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(GEMMA4, num_global_key_value_heads=1,
               attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
               hidden_size_per_layer_input=16)),
    "gemma4_dense": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(GEMMA4, hidden_size_per_layer_input=0)),
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        GEMMA4, hidden_size_per_layer_input=16, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32)),
    # The same layers with routed int4 experts and a gated shared expert in every MLP.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        initializer_range=0.1, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
}


@pytest.fixture(scope="module")
def family_llms(tmp_path_factory, hf_tokenizer):
    pytest.importorskip("transformers")
    from servelm import LLM

    out = {}
    for i, (name, (config_cls, model_cls, extra)) in enumerate(ENGINE_FAMILIES.items()):
        d = tmp_path_factory.mktemp(f"hf-{name}")
        model = tiny_hf_checkpoint(d, config_cls, model_cls, extra, hf_tokenizer, seed=i)
        if name.startswith("gemma4"):
            gemma4_scales_off_one(model)
            model.save_pretrained(d)
        # No prefix caching: both runs must batch the same rows.
        out[name] = LLM(model=str(d), dtype="bfloat16", quantization="int4",
                        linear_method="tiles", kv_cache_memory=16 << 20, max_model_len=256,
                        enable_prefix_caching=False)
    return out


@pytest.mark.parametrize("family", sorted(ENGINE_FAMILIES))
def test_engine_runs_each_familys_decode_steps_on_the_stack(family, family_llms):
    from servelm import SamplingParams

    llm = family_llms[family]
    model = llm.engine.executor.model
    assert model.fused_decode
    prompts = [list(range(10, 40)), [5, 6, 7], list(range(100, 140))]  # past the window
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    assert_stack_decodes_as_per_op(llm, prompts, sp)


def test_qwen3_5_answers_keep_their_state_snapshots_on_the_stack(tmp_path, hf_tokenizer):
    """A Qwen3.5 answer's decode steps keep its recurrent state at each block boundary they
    reach (a prefix-cache snapshot) on the stack as op by op: a next turn that extends the
    answer is admitted past that boundary, its state restored from the snapshot, and both
    turns' tokens and logprobs are the per-op path's. A stack with linear-attention layers
    refuses a run whose rows' state slots were not given."""
    pytest.importorskip("transformers")
    from servelm import LLM, SamplingParams

    config_cls, model_cls, extra = ENGINE_FAMILIES["qwen3_5"]
    tiny_hf_checkpoint(tmp_path, config_cls, model_cls, extra, hf_tokenizer, seed=11)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    results = []
    for fused in (True, False):
        llm = LLM(model=str(tmp_path), dtype="bfloat16", quantization="int4",
                  linear_method="tiles", kv_cache_memory=16 << 20, max_model_len=256,
                  max_num_seqs=4)
        model = llm.engine.executor.model
        assert model.fused_decode and llm.engine.block_manager.enable_caching
        model.fused_decode = fused
        bs = llm.engine.block_manager.block_size
        turn1 = list(range(10, 10 + 3 * bs + 5))
        out1 = llm.generate([turn1], sp, use_tqdm=False)[0].outputs[0]
        turn2 = turn1 + list(out1.token_ids) + [5, 6, 7]
        out2 = llm.generate([turn2], sp, use_tqdm=False)[0]
        # Admitted past the prompt's snapshot (3 blocks), on the answer's (4 blocks).
        assert out2.metrics.num_cached_tokens == 4 * bs
        results.append((out1.token_ids, out1.logprobs, out2.outputs[0].token_ids,
                        out2.outputs[0].logprobs))
    assert results[0] == results[1]
    stack = model._decode_stacks[0][2]
    with pytest.raises(RuntimeError, match="set_state_rows"):
        stack.run_lists([5], [3], [7], [1], [4])


def test_qwen3_5_recurrent_states_in_bfloat16(tmp_path, hf_tokenizer):
    """mamba_ssm_cache_dtype="bfloat16" (vLLM's flag): the linear-attention layers' states in
    bf16, half a sequence's state bytes; decode steps on the stack are the per-op path's
    exactly; a prompt run in 16-token chunks (its state kept between them) gives prompt
    logprobs near float32 states' (bf16 rounding between chunks), not equal to them."""
    pytest.importorskip("transformers")
    from servelm import LLM, SamplingParams

    config_cls, model_cls, extra = ENGINE_FAMILIES["qwen3_5"]
    tiny_hf_checkpoint(tmp_path, config_cls, model_cls, extra, hf_tokenizer, seed=12)
    kw = dict(model=str(tmp_path), dtype="bfloat16", quantization="int4", linear_method="tiles",
              kv_cache_memory=16 << 20, max_model_len=256, enable_prefix_caching=False,
              max_num_batched_tokens=16, max_num_seqs=4)
    half, full = LLM(**kw, mamba_ssm_cache_dtype="bfloat16"), LLM(**kw)
    states = [llm.engine.executor.runner.layer_caches[0][1] for llm in (half, full)]
    assert [s.dtype for s in states] == [torch.bfloat16, torch.float32]
    worker = [llm.engine.executor.worker for llm in (half, full)]
    conv = math.prod(half.engine.model_config.linear_state_shapes[0]) * 2 * 3  # 3 DeltaNet layers
    assert 2 * (worker[0].state_bytes() - conv) == worker[1].state_bytes() - conv
    assert_stack_decodes_as_per_op(half, [list(range(10, 40)), [5, 6, 7]], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = list(range(200, 264))
    got = [[next(iter(p.values())).logprob for p in llm.generate(
        [{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].prompt_logprobs[1:]]
        for llm in (half, full)]
    diffs = [abs(a - b) for a, b in zip(*got)]
    assert max(diffs) < 0.05 and max(diffs[16:]) > 0  # the first chunk's are the same
