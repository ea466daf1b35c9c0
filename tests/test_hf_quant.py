"""Quantised checkpoints load as what they are: a GGUF's or an HF quantization_config's
weight format (native_quantization), and AWQ / GPTQ / compressed-tensors layers unpacked to
exactly their dequantised dense weights.

The packers here follow the reference packing code (AutoAWQ's WQLinear_GEMM.from_linear,
auto-gptq's QuantLinear.pack, compressed-tensors' pack_to_int32) loop for loop, on integer
codes drawn at random, so loading what they wrote checks servelm's unpacking against the
layout itself; the expected weights are (q - z) * s from those codes, in float64."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import real_model
from servelm.models.loader import ModelLoadError, load_model, open_checkpoint

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 96
HEAD_DIM = HIDDEN // HEADS
PROJ = {  # HF linear name -> (out, in)
    "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "mlp.gate_proj": (INTER, HIDDEN),
    "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}
GROUP = 32


# ---- reference packers -------------------------------------------------------------------

def awq_pack(intweight: np.ndarray) -> torch.Tensor:
    """AutoAWQ GEMM: [rows, cols] 4-bit codes -> [rows, cols / 8] int32, column
    order_map[i] of each block of 8 in nibble i."""
    intweight = intweight.astype(np.uint32)
    packed = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
    return torch.from_numpy(packed.view(np.int32))


def gptq_pack_rows(intweight: np.ndarray, bits: int) -> np.ndarray:
    """auto-gptq's qweight loop: [in, out] codes -> [in * bits / 32, out], input rows in
    order from the low bits."""
    intweight = intweight.astype(np.uint32)
    per = 32 // bits
    packed = np.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < packed.shape[0]:
        for j in range(i, i + per):
            packed[row] |= intweight[j] << (bits * (j - i))
        i += per
        row += 1
    return packed


def gptq_pack_zeros(zeros: np.ndarray, bits: int, v1: bool) -> np.ndarray:
    """auto-gptq's qzeros loop (v1 stores zero - 1): [groups, out] -> [groups, out * bits
    / 32], outputs in order from the low bits."""
    zeros = (zeros - (1 if v1 else 0)).astype(np.uint32)
    per = 32 // bits
    packed = np.zeros((zeros.shape[0], zeros.shape[1] // per), dtype=np.uint32)
    i = col = 0
    while col < packed.shape[1]:
        for j in range(i, i + per):
            packed[:, col] |= zeros[:, j] << (bits * (j - i))
        i += per
        col += 1
    return packed


def ct_pack(value: np.ndarray, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' pack_to_int32: signed codes offset by 2^(bits-1), padded, packed
    in order along packed_dim from the low bits."""
    value = (value.astype(np.int32) + (1 << (bits - 1))).astype(np.uint32)
    if packed_dim == 0:
        value = value.T
    per = 32 // bits
    pad = -value.shape[1] % per
    value = np.pad(value, [(0, 0), (0, pad)])
    packed = np.zeros((value.shape[0], value.shape[1] // per), dtype=np.uint32)
    for i in range(per):
        packed |= value[:, i::per] << (bits * i)
    packed = packed.T if packed_dim == 0 else packed
    return torch.from_numpy(np.ascontiguousarray(packed).view(np.int32))


# ---- a tiny quantised Qwen2 directory ------------------------------------------------------

def _fp16_scales(rng, shape) -> np.ndarray:
    return rng.uniform(0.002, 0.03, size=shape).astype(np.float16)


def awq_layer(rng, out_f: int, in_f: int):
    """(checkpoint tensors, the dense weight [out, in] in float64)."""
    groups = in_f // GROUP
    q = rng.integers(0, 16, size=(in_f, out_f))           # [in, out], as AWQ holds it
    z = rng.integers(0, 16, size=(groups, out_f))
    s = _fp16_scales(rng, (groups, out_f))
    g = np.arange(in_f) // GROUP
    dense = ((q - z[g]) * s[g].astype(np.float64)).T
    return {"qweight": awq_pack(q), "qzeros": awq_pack(z),
            "scales": torch.from_numpy(s)}, dense


def gptq_layer(rng, out_f: int, in_f: int, bits: int = 4, act_order: bool = False,
               v1: bool = True):
    groups = in_f // GROUP
    q = rng.integers(0, 1 << bits, size=(in_f, out_f))
    # v1 cannot store zero 0 (zero - 1 wraps); symmetric checkpoints hold 2^(bits-1).
    z = rng.integers(1, 1 << bits, size=(groups, out_f))
    s = _fp16_scales(rng, (groups, out_f))
    g = np.arange(in_f) // GROUP
    if act_order:  # desc_act: each input row's group follows a permutation
        g = g[rng.permutation(in_f)]
    dense = ((q - z[g]) * s[g].astype(np.float64)).T
    return {"qweight": torch.from_numpy(gptq_pack_rows(q, bits).view(np.int32)),
            "qzeros": torch.from_numpy(gptq_pack_zeros(z, bits, v1).view(np.int32)),
            "scales": torch.from_numpy(s),
            "g_idx": torch.from_numpy(g.astype(np.int32))}, dense


def ct_int8_layer(rng, out_f: int, in_f: int):
    """int-quantized, per output channel, symmetric, with a static activation scale
    (W8A8), which a weight-only engine leaves unread."""
    q = rng.integers(-128, 128, size=(out_f, in_f)).astype(np.int8)
    s = torch.from_numpy(rng.uniform(0.001, 0.02, size=(out_f, 1)).astype(np.float32))
    s = s.to(torch.bfloat16)
    dense = q.astype(np.float64) * s.double().numpy()
    return {"weight": torch.from_numpy(q), "weight_scale": s,
            "input_scale": torch.tensor([0.01], dtype=torch.bfloat16)}, dense


def ct_int4_layer(rng, out_f: int, in_f: int):
    """pack-quantized, groups of inputs, asymmetric (zero points packed by outputs)."""
    groups = in_f // GROUP
    q = rng.integers(-8, 8, size=(out_f, in_f)).astype(np.int8)
    zp = rng.integers(-8, 8, size=(out_f, groups)).astype(np.int8)
    s = rng.uniform(0.002, 0.03, size=(out_f, groups)).astype(np.float16)
    g = np.arange(in_f) // GROUP
    dense = (q.astype(np.float64) - zp[:, g]) * s[:, g].astype(np.float64)
    return {"weight_packed": ct_pack(q, 4), "weight_shape": torch.tensor([out_f, in_f]),
            "weight_scale": torch.from_numpy(s), "weight_zero_point": ct_pack(zp, 4, 0)}, dense


def _config(quantization_config: dict | None) -> dict:
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
           "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
           "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "max_position_embeddings": 128,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "torch_dtype": "float16"}
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    return cfg


def write_model(path: Path, quantization_config: dict, make_layer, head: bool = False
                ) -> dict[str, np.ndarray]:
    """A tiny Qwen2 directory whose linear layers (and, head: the LM head) are quantised by
    make_layer; its tensors alternate between two safetensors files, so a layer's parts
    lie in both. Returns the expected dense tensors by HF name (float64)."""
    rng = np.random.default_rng(0)
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, np.ndarray] = {}

    def plain(name: str, shape) -> None:
        value = rng.standard_normal(shape).astype(np.float16)
        tensors[name] = torch.from_numpy(value)
        expected[name] = value.astype(np.float64)

    plain("model.embed_tokens.weight", (VOCAB, HIDDEN))
    plain("model.norm.weight", (HIDDEN,))
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        plain(f"{p}.input_layernorm.weight", (HIDDEN,))
        plain(f"{p}.post_attention_layernorm.weight", (HIDDEN,))
        for proj, (out_f, in_f) in PROJ.items():
            parts, dense = make_layer(rng, out_f, in_f)
            tensors.update({f"{p}.{proj}.{k}": v for k, v in parts.items()})
            expected[f"{p}.{proj}.weight"] = dense
        for proj in ("q_proj", "k_proj", "v_proj"):
            plain(f"{p}.self_attn.{proj}.bias", (PROJ[f"self_attn.{proj}"][0],))
    if head:
        parts, dense = make_layer(rng, VOCAB, HIDDEN)
        tensors.update({f"lm_head.{k}": v for k, v in parts.items()})
        expected["lm_head.weight"] = dense
    else:
        plain("lm_head.weight", (VOCAB, HIDDEN))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config(quantization_config)))
    names = sorted(tensors)
    for n in range(2):
        save_file({k: tensors[k].contiguous() for k in names[n::2]},
                  str(path / f"model-0000{n + 1}-of-00002.safetensors"))
    return expected


def expected_params(expected: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The decoder's parameters (fused q/k/v and gate/up) from HF-named dense tensors."""
    out = {}
    for name, value in expected.items():
        out[name.removeprefix("model.")] = torch.from_numpy(value)
    for i in range(LAYERS):
        for fused, parts, kind in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"),
                                    ("weight", "bias")),
                                   ("mlp.gate_up_proj", ("gate_proj", "up_proj"), ("weight",))):
            base = f"layers.{i}.{fused.split('.')[0]}"
            for k in kind:
                out[f"layers.{i}.{fused}.{k}"] = torch.cat(
                    [out.pop(f"{base}.{part}.{k}") for part in parts])
    return out


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
              "version": "gemm"}


def gptq_config(bits: int, act_order: bool = False, fmt: str = "gptq") -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": act_order,
            "sym": False, "checkpoint_format": fmt, "lm_head": True}


CT_INT8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                    "group_size": None, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                              "strategy": "tensor", "dynamic": False}}}}
CT_INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                    "group_size": GROUP, "dynamic": False},
        "input_activations": None}}}

CASES = {  # name -> (quantization_config, layer maker, LM head quantised, native format)
    "awq": (AWQ_CONFIG, awq_layer, False, "int4"),
    "gptq4": (gptq_config(4), gptq_layer, True, "int4"),
    "gptq4-act-order": (gptq_config(4, act_order=True),
                        lambda rng, o, i: gptq_layer(rng, o, i, act_order=True), False, "int4"),
    "gptq4-v2": (gptq_config(4, fmt="gptq_v2"),
                 lambda rng, o, i: gptq_layer(rng, o, i, v1=False), False, "int4"),
    "gptq8": (gptq_config(8, act_order=True),
              lambda rng, o, i: gptq_layer(rng, o, i, bits=8, act_order=True), False, "int8"),
    "ct-int8": (CT_INT8_CONFIG, ct_int8_layer, False, "int8"),
    "ct-int4": (CT_INT4_CONFIG, ct_int4_layer, False, "int4"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    root = tmp_path_factory.mktemp("hf-quant")
    return {name: (root / name, write_model(root / name, cfg, make, head))
            for name, (cfg, make, head, _) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_quantised_checkpoint_loads_its_dequantised_weights(checkpoints, case):
    path, expected = checkpoints[case]
    ckpt = open_checkpoint(str(path))
    model = load_model(ckpt, ckpt.config(), torch.float32, torch.device("cpu"), 64)
    params = dict(model.named_parameters())
    want = expected_params(expected)
    assert set(params) == set(want)
    for name, value in want.items():
        got = params[name].detach()
        assert torch.equal(got, value.float()), (
            f"{case} {name}: {int((got != value.float()).sum())} of {got.numel()} differ")


def test_quantised_checkpoint_loads_in_bf16(checkpoints):
    """The dense weights land in the load dtype: the exact values, rounded once."""
    path, expected = checkpoints["awq"]
    ckpt = open_checkpoint(str(path))
    model = load_model(ckpt, ckpt.config(), torch.bfloat16, torch.device("cpu"), 64)
    w = model.get_parameter("layers.1.mlp.down_proj.weight").detach()
    assert w.dtype == torch.bfloat16
    ref = torch.from_numpy(expected["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(w, ref.float().to(torch.bfloat16))


def test_tensor_parallel_slice_of_a_packed_layer(checkpoints):
    """A rank's rows of a packed layer: unpacked, then cut."""
    path, expected = checkpoints["gptq4-act-order"]
    ckpt = open_checkpoint(str(path))
    name = "model.layers.0.self_attn.q_proj.weight"
    pieces = {name: [(0, 16, 48)], "model.layers.0.mlp.down_proj.weight": [(1, 0, 32),
                                                                            (1, 64, 96)]}
    got = dict(ckpt.weights(ckpt.config(), slice_of=pieces.get))
    assert torch.equal(got[name], torch.from_numpy(expected[name][16:48]).float())
    down = expected["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"],
                       torch.from_numpy(np.concatenate([down[:, :32], down[:, 64:96]], 1)
                                        ).float())


@pytest.mark.parametrize("case", list(CASES))
def test_hf_native_quantization(checkpoints, case):
    path, _ = checkpoints[case]
    native, described = open_checkpoint(str(path)).native_quantization()
    assert native == CASES[case][3]
    assert described.endswith(f": {native} weights")


def test_hf_native_quantization_descriptions(checkpoints):
    _, awq = open_checkpoint(str(checkpoints["awq"][0])).native_quantization()
    assert awq == f"AWQ 4-bit, groups of {GROUP}: int4 weights"
    _, gptq = open_checkpoint(str(checkpoints["gptq8"][0])).native_quantization()
    assert gptq == f"GPTQ 8-bit, groups of {GROUP}, act-order: int8 weights"


def test_unquantised_hf_directory_has_no_native_format(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config(None)))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    native, described = open_checkpoint(str(tmp_path)).native_quantization()
    assert native is None and "unquantised" in described


@pytest.mark.parametrize("qcfg, named", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "gptq", "bits": 3}, "3-bit"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}},
     "'float-quantized'"),
])
def test_unsupported_quantisation_is_named(tmp_path, qcfg, named):
    (tmp_path / "config.json").write_text(json.dumps(_config(qcfg)))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    ckpt = open_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match=named) as err:
        ckpt.native_quantization()
    assert isinstance(err.value, ModelLoadError)
    assert "AWQ" in str(err.value) and "GPTQ" in str(err.value)  # what servelm loads
    with pytest.raises(ModelLoadError, match=named):
        load_model(ckpt, ckpt.config(), torch.float32, torch.device("cpu"), 64)


# ---- GGUF ------------------------------------------------------------------------------

def write_gguf(path: Path, tensors: list[tuple[str, str, tuple[int, ...]]],
               file_type: str | None) -> str:
    """A GGUF holding only tensors (name, type name, shape): Q8_0 quantised with gguf's
    numpy quantiser, F32/F16 as values, other block types as random bytes of their size
    (native_quantization reads types and shapes only)."""
    import gguf

    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), "qwen2")
    if file_type is not None:
        w.add_file_type(gguf.LlamaFileType[file_type].value)
    for name, kind, shape in tensors:
        qtype = gguf.GGMLQuantizationType[kind]
        values = rng.standard_normal(shape).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, values)
        elif kind == "F16":
            w.add_tensor(name, values.astype(np.float16))
        elif kind == "Q8_0":
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block * size),
                               dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _gguf_model(linear: str, embed: str, norm: str = "F32") -> list:
    return [("token_embd.weight", embed, (VOCAB, 256)),
            ("blk.0.attn_norm.weight", norm, (256,)),
            ("blk.0.attn_q.weight", linear, (256, 256)),
            ("blk.0.ffn_down.weight", linear, (256, 512)),
            ("output.weight", linear, (VOCAB, 256))]


def test_gguf_q8_0_is_int8(tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", _gguf_model("Q8_0", "Q8_0"), "MOSTLY_Q8_0")
    assert open_checkpoint(path).native_quantization() == (
        "int8", "GGUF Q8_0 (Q8_0 100%): int8 weights")


def test_gguf_routed_experts_do_not_decide_the_format(tmp_path):
    """Routed experts (stacked 3-D tensors) stay in the activation dtype whatever the file
    says (gpt-oss's MXFP4 ones): F16 attention beside 4-bit experts three times its size
    runs unquantised, not int4."""
    tensors = _gguf_model("F16", "F16") + [("blk.0.ffn_gate_exps.weight", "Q4_0", (8, 256, 256))]
    native, described = open_checkpoint(write_gguf(tmp_path / "moe.gguf", tensors,
                                                   "MOSTLY_F16")).native_quantization()
    assert native is None and "Q4_0" not in described, described


def test_gguf_f16_is_unquantised(tmp_path):
    path = write_gguf(tmp_path / "f16.gguf", _gguf_model("F16", "Q8_0"), "MOSTLY_F16")
    native, described = open_checkpoint(path).native_quantization()
    assert native is None
    assert described == "GGUF F16 (F16 100%): unquantised weights"


def test_gguf_mix_is_weighted_by_linear_elements(tmp_path):
    """Q4_K on most linear elements -> int4 even beside Q6_K; Q6_K on most -> int8; the
    embedding table's type does not count."""
    mostly_q4 = [("token_embd.weight", "Q6_K", (4096, 256)),
                 ("blk.0.attn_q.weight", "Q6_K", (256, 256)),
                 ("blk.0.ffn_down.weight", "Q4_K", (256, 512)),
                 ("blk.0.ffn_up.weight", "Q4_K", (512, 256)),
                 ("output.weight", "Q8_0", (64, 256))]
    native, described = open_checkpoint(
        write_gguf(tmp_path / "a.gguf", mostly_q4, "MOSTLY_Q4_K_M")).native_quantization()
    assert native == "int4"
    assert described == "GGUF Q4_K_M (Q4_K 76%, Q6_K 19%, Q8_0 5%): int4 weights"
    mostly_q6 = [("token_embd.weight", "Q4_K", (4096, 256)),
                 ("blk.0.attn_q.weight", "Q4_K", (256, 256)),
                 ("blk.0.ffn_down.weight", "Q6_K", (256, 512)),
                 ("output.weight", "F16", (64, 256))]
    native, described = open_checkpoint(
        write_gguf(tmp_path / "b.gguf", mostly_q6, None)).native_quantization()
    assert (native, described) == ("int8", "GGUF (Q6_K 62%, Q4_K 31%, F16 8%): int8 weights")


def test_qwen25_q4_k_m_gguf_is_int4():
    native, described = open_checkpoint(real_model("qwen25-coder-0.5b")).native_quantization()
    assert native == "int4"
    assert described.startswith("GGUF Q4_K_M (") and "Q4_K" in described
    assert described.endswith("): int4 weights")
