"""The LoRA delta in C++: servelm_ops.lora_add against servelm.layers.lora.lora_add_ref (bf16
and fp32; 1, 2 or 3 parts; several slots and rows without one; ranks padded with zeros; a
strided y; 1 to 300 rows), and inside the DecodeStack, whose decode steps with adapters are
the per-op path's bit for bit."""

from __future__ import annotations

import pytest
import torch

from servelm import quantization as Q
from servelm.kernels import load_ops
from servelm.layers.lora import LoRALinear, lora_add_ref
from servelm.models import decode_stack
from servelm.models.config import ModelConfig
from tests.helpers import (GEMMA4_LAYERS, decode_rows, method_targets, per_op_and_stack, random_bf16_model,
                           random_lora_stacks)

pytestmark = pytest.mark.skipif(not load_ops("ops"), reason="needs servelm's C++ kernels")


def _op():
    return torch.ops.servelm_ops.lora_add


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # each side rounds its own fp32 dots (a t value a bf16 ulp apart now and then) and its
        # own sum: about a bf16 ulp of a value of magnitude 1 apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("parts", [(40,), (48, 16, 16), (35, 35), (64, 32, 80)])
@pytest.mark.parametrize("M", [1, 7, 64, 300])
@pytest.mark.parametrize("R", [8, 5])  # an odd R: the bf16 expand's last rank pair half zero
def test_lora_add_is_the_reference(dtype, parts, M, R):
    g = torch.Generator().manual_seed(M * 7 + len(parts))
    K, S = 72, 3  # K and most parts not multiples of 16: the masked tails (64, 32, 80: whole vectors)
    a, b, bounds = random_lora_stacks(S, parts, K, R, dtype, ranks=(R, 3, 5), g=g)
    x = torch.randn(M, K, generator=g).to(dtype)
    slots = torch.randint(-1, S, (M,), generator=g, dtype=torch.int32)
    if M >= 7:
        slots[:4] = torch.tensor([0, -1, 2, 0], dtype=torch.int32)
    N = sum(parts)
    wide = torch.randn(M, N + 9, generator=g).to(dtype)  # y: a view with a row stride > N
    y = wide[:, 5:5 + N]
    want = y.clone()
    lora_add_ref(want, x, a, b, slots, bounds)
    before = wide.clone()
    _op()(y, x, a, b, slots, bounds)
    _close(y, want, dtype)
    none = slots < 0
    assert torch.equal(y[none], before[:, 5:5 + N][none])  # rows without an adapter untouched
    assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(wide[:, 5 + N:], before[:, 5 + N:])
    if (~none).any():
        assert not torch.equal(y[~none], before[:, 5:5 + N][~none])


def test_a_rows_delta_does_not_depend_on_its_batch():
    """Each value's arithmetic is fixed: a row's delta alone equals its delta among 300 rows
    of several slots, bit for bit."""
    g = torch.Generator().manual_seed(3)
    a, b, bounds = random_lora_stacks(2, (64, 32), 96, 16, torch.bfloat16, ranks=(16, 4), g=g)
    x = torch.randn(300, 96, generator=g).bfloat16()
    slots = torch.randint(-1, 2, (300,), generator=g, dtype=torch.int32)
    y0 = torch.randn(300, 96, generator=g).bfloat16()
    y = y0.clone()
    _op()(y, x, a, b, slots, bounds)
    for m in (0, 1, 77, 150, 299):
        one = y0[m:m + 1].clone()
        _op()(one, x[m:m + 1], a, b, slots[m:m + 1], bounds)
        assert torch.equal(one, y[m:m + 1])


def test_lora_add_refuses_what_it_cannot_run():
    a = torch.zeros(2, 8, 16)
    b = torch.zeros(2, 4, 8, 2)
    x, y = torch.zeros(3, 16), torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match="row slot 2 of row 1"):
        _op()(y, x, a, b, torch.tensor([0, 2, -1], dtype=torch.int32), [0, 8])
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
        _op()(y.bfloat16(), x.bfloat16(), a, b, torch.zeros(3, dtype=torch.int32), [0, 8])
    with pytest.raises(RuntimeError, match="bounds"):
        _op()(y, x, a, b, torch.zeros(3, dtype=torch.int32), [0, 4])
    with pytest.raises(RuntimeError, match="int32"):
        _op()(y, x, a, b, torch.zeros(3, dtype=torch.long), [0, 8])


# ---- inside the DecodeStack -----------------------------------------------------------------

STACK = pytest.mark.skipif(
    not (Q.kernels_available() and decode_stack.available()),
    reason="needs the C++ kernels (AVX-512 BF16)")

CFG = dict(architecture="Qwen2ForCausalLM", family="qwen2", attention_bias=True,
           vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
           num_kv_heads=2, head_dim=16, max_position_embeddings=512)
SLOTS = [0, -1, 1, 0]  # the batch's rows: two adapters, one row without, one adapter twice
LENS = [5, 17, 40, 9]


# Routed experts with a gated shared expert (Qwen2-MoE): the adapters on its attention (the
# adapter loader wraps no expert).
MOE_CFG = dict(CFG, architecture="Qwen2MoeForCausalLM", family="qwen2_moe", num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96)


# Gemma 4's layers (K=V and KV-shared ones: their qkv of two parts and of one; per-layer
# inputs beside the adapted linears).
GEMMA4_CFG = dict(CFG, **GEMMA4_LAYERS, attention_bias=False)


def _lora_model(fmt: str, cfg: dict = CFG):
    """A tiny random bf16 model (its linears on the C++ kernels), every adaptable linear
    wrapped, adapters of ranks 8 and 3 in slots 0 and 1 (q, v, o, gate, up, down adapted; k
    not, in slot 1)."""
    from servelm.lora.wrap import apply_lora

    cfg = ModelConfig(**cfg)
    model = random_bf16_model(cfg, seed=0)
    if fmt == "bf16":
        method_targets(model.layers, Q.TARGETS, "tiles")
    else:
        Q.quantize_model(model.layers, fmt)
    method_targets(model.layers, ("input_gate", "input_proj"), "tiles")  # Gemma 4's PLE
    wrapped = apply_lora(model, max_loras=2, max_rank=8)
    g = torch.Generator().manual_seed(5)
    for layer in wrapped.values():
        widths = [layer.bounds[j + 1] - layer.bounds[j] for j in range(len(layer.bounds) - 1)]
        for slot, rank in ((0, 8), (1, 3)):
            parts = [(torch.randn(rank, layer.in_features, generator=g) * 0.3,
                      torch.randn(w, rank, generator=g) * 0.3) for w in widths]
            if slot == 1 and len(parts) == 3:
                parts[1] = None
            layer.set_slot(slot, parts)
    model.moe_fused_rows = 64  # (a MoE model's: every step here on the stack)
    model.select_ops(True)
    return model.eval(), wrapped


def _forward(model, batch, data, caches, fused: bool):
    saved = data.clone()
    model.fused_decode = fused
    with torch.inference_mode():
        hidden = model(batch, caches)
    data.copy_(saved)
    return hidden


# 50 rows: from 48 the int4 matmuls decode each weight tile once; slots 0, 1 and none mixed.
WIDE = list(range(1, 200, 4))
WIDE_SLOTS = [(-1, 0, 1, 0, 1, 1, -1)[i % 7] for i in range(len(WIDE))]


@STACK
@pytest.mark.parametrize("rows", ["one", "four", "fifty"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_the_stack_adds_each_rows_adapter_as_the_per_op_path(fmt, rows):
    model, _ = _lora_model(fmt)
    lens, slots = {"one": (LENS[:1], SLOTS[:1]), "four": (LENS, SLOTS),
                   "fifty": (WIDE, WIDE_SLOTS)}[rows]
    batch, data, caches = decode_rows(model.config, lens, 16, seed=1)
    model.lora_step.set(torch.tensor(slots, dtype=torch.int32), None)
    (h0, kv0), (h1, kv1) = per_op_and_stack(model, batch, data, caches)
    assert torch.equal(h0, h1)
    assert torch.equal(kv0, kv1)
    # No adapter: the rows with one change, the rows without are the same.
    model.lora_step.clear()
    base = _forward(model, batch, data, caches, fused=True)
    assert torch.equal(base, _forward(model, batch, data, caches, fused=False))
    for m, s in enumerate(slots):
        assert torch.equal(base[m], h1[m]) == (s < 0)


def _assert_the_stack_runs_the_adapters_as_per_op(model) -> None:
    """LENS' rows in SLOTS' adapters: the stack runs the adapters, its hidden states and KV
    the per-op path's bits."""
    batch, data, caches = decode_rows(model.config, LENS, 16, seed=1)
    model.lora_step.set(torch.tensor(SLOTS, dtype=torch.int32), None)
    (h0, kv0), (h1, kv1) = per_op_and_stack(model, batch, data, caches)
    assert model.stack_runs_lora
    assert torch.equal(h0, h1) and torch.equal(kv0, kv1)


@STACK
def test_the_stack_adapts_a_moe_models_attention():
    """MoE layers on the stack (the router, routed experts, and the shared expert on the MLP
    linears) with adapters on their attention: the per-op path's bits."""
    model, wrapped = _lora_model("int4", MOE_CFG)
    assert wrapped and all(".self_attn." in name for name in wrapped)
    _assert_the_stack_runs_the_adapters_as_per_op(model)


@STACK
def test_the_stack_adapts_gemma4s_layers():
    """Gemma 4's layers on the stack with adapters on every linear: a K=V layer's qkv of q and
    k (its values take the adapted keys), a KV-shared layer's of q alone; the per-op path's
    bits."""
    model, wrapped = _lora_model("int4", GEMMA4_CFG)
    widths = {len(wrapped[f"layers.{i}.self_attn.qkv_proj"].bounds) - 1 for i in (2, 4)}
    assert widths == {1, 2}  # (KV-shared: q; K=V: q and k)
    _assert_the_stack_runs_the_adapters_as_per_op(model)


@STACK
def test_decode_step_takes_the_steps_lora_rows():
    """CausalLM.decode_step (plain lists) hands the stack model.lora_step's rows too."""
    model, _ = _lora_model("bf16")
    batch, data, caches = decode_rows(model.config, LENS, 16, seed=1)
    model.lora_step.set(torch.tensor(SLOTS, dtype=torch.int32), None)
    model.select_ops(True)
    assert model.bind_decode_layers(caches)
    want = _forward(model, batch, data, caches, fused=True)
    dec = batch.attn.decodes
    lists = (batch.input_ids.tolist(), batch.positions.tolist(), batch.slot_mapping.tolist(),
             dec.block_tables.flatten().tolist(), dec.context_lens.tolist())
    saved = data.clone()
    with torch.inference_mode():
        got = model.decode_step(*lists)
    data.copy_(saved)
    assert torch.equal(got, want)
    model.lora_step.clear()
    with torch.inference_mode():
        plain = model.decode_step(*lists)
    data.copy_(saved)
    assert not torch.equal(plain, want)


@STACK
def test_the_op_on_the_per_op_path_is_the_reference():
    """The per-op path with servelm_ops.lora_add is the one with lora_add_ref, up to each
    rounding its fp32 sum once: far closer than the adapters' effect."""
    model, wrapped = _lora_model("bf16")
    batch, data, caches = decode_rows(model.config, LENS, 16, seed=1)
    model.lora_step.set(torch.tensor(SLOTS, dtype=torch.int32), None)
    op = _forward(model, batch, data, caches, fused=False)
    for m in wrapped.values():
        m.select(False)
    ref = _forward(model, batch, data, caches, fused=False)
    model.lora_step.clear()
    base = _forward(model, batch, data, caches, fused=False)
    effect = (ref.float() - base.float()).abs().max()
    assert effect > 0.5
    assert (op.float() - ref.float()).abs().max() < 0.05 * effect


# ---- the engine: adapted decode steps on the stack ------------------------------------------

@STACK
@pytest.mark.parametrize("family,method", [("llama", "default"), ("llama", "amx"),
                                           ("qwen3_5", "default")])
def test_the_engine_decodes_adapted_batches_on_the_stack(tmp_path, hf_tokenizer, family, method):
    """A bf16 engine with two PEFT adapters: a mixed batch (base, each adapter, one twice)
    decodes on the DecodeStack, and its tokens and logprobs are the per-op path's. On amx
    the gate_up is gated (SiLU in its epilogue): the stack adds its deltas there, before the
    SiLU, and the per-op path adds them to gate and up, then runs silu_and_mul. Qwen3.5's
    adapters also reach its gated attention's output gate and its DeltaNet layers'
    projections (in_proj_qkvz, in_proj_ba, out_proj on the stack)."""
    pytest.importorskip("peft")
    from servelm.layers import amx

    if method == "amx" and not amx.available():
        pytest.skip("no AMX tiles here")
    from servelm import LLM, LoRARequest, SamplingParams
    from tests.helpers import tiny_hf_checkpoint
    from tests.test_lora import FAMILIES, make_adapter

    if family not in FAMILIES:
        pytest.skip(f"this transformers has no {family}")
    config_cls, model_cls, extra, targets = FAMILIES[family]
    if family == "llama":
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = tiny_hf_checkpoint(tmp_path / "base", config_cls, model_cls, extra, hf_tokenizer,
                              seed=0)
    loras = []
    for j in range(2):
        make_adapter(base, tmp_path / f"a{j}", targets, seed=10 + j, rank=8 - 4 * j)
        loras.append(LoRARequest(f"a{j}", j + 1, str(tmp_path / f"a{j}")))
    llm = LLM(model=str(tmp_path / "base"), enable_lora=True, max_loras=2, max_lora_rank=8,
              dtype="bfloat16", kernel_tuning="off", kv_cache_memory=16 << 20,
              max_model_len=256, **({"linear_method": "amx"} if method == "amx" else {}))
    model = llm.engine.executor.model
    assert model.fused_decode and model.stack_runs_lora
    if method == "amx":
        from servelm.layers.stack import base_linear

        gate_up = base_linear(model.layers[0].mlp.gate_up_proj)
        assert isinstance(gate_up, amx.AmxLinear) and gate_up.gated
    steps = []
    decode_step = model.decode_step

    def counting(*a):
        steps.append(model.lora_step.tokens is not None)
        return decode_step(*a)

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 17 + 3 * i, 4]} for i in range(4)]
    mixed = [loras[0], None, loras[1], loras[0]]
    model.decode_step = counting
    try:
        fused = llm.generate(prompts, sp, use_tqdm=False, lora_request=mixed)
    finally:
        del model.decode_step
    assert any(steps)  # adapted decode steps ran on the stack
    model.fused_decode = False
    try:
        per_op = llm.generate(prompts, sp, use_tqdm=False, lora_request=mixed)
        plain = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        model.fused_decode = True
    for a, b in zip(fused, per_op):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert fused[1].outputs[0].logprobs == plain[1].outputs[0].logprobs
    assert fused[0].outputs[0].logprobs != plain[0].outputs[0].logprobs
