"""servelm.lora.loader: PEFT adapter directories and llama.cpp GGUF LoRA files, read into the
decoder's adapted layers (module path -> per-part (A, B) with the scale in B).

The PEFT directories are written here as PEFT saves them (its adapter_config.json fields and
state-dict names: base_model.model.<module>.lora_A.weight, or with the adapter's name
infix), without peft installed; the GGUF files with gguf-py's writer, as llama.cpp's
convert_lora_to_gguf.py lays them out (lora_a [r, K], lora_b [N, r] in numpy order, q/k
rows of B permuted for a llama base)."""

from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from servelm.layers.lora import LoRALinear, LoRAStep
from servelm.lora.loader import LoRAAdapter, LoRAError, load_adapter
from servelm.models.config import ModelConfig

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
H, I, Q, KV = 32, 48, 32, 16  # hidden, intermediate, q rows, k/v rows (head_dim 8)
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A split target -> (decoder module under layers.{i}, part index, its A's K, its B's N).
WHERE = {"q_proj": ("self_attn.qkv_proj", 0, H, Q), "k_proj": ("self_attn.qkv_proj", 1, H, KV),
         "v_proj": ("self_attn.qkv_proj", 2, H, KV), "o_proj": ("self_attn.o_proj", 0, Q, H),
         "gate_proj": ("mlp.gate_up_proj", 0, H, I), "up_proj": ("mlp.gate_up_proj", 1, H, I),
         "down_proj": ("mlp.down_proj", 0, I, H)}
SECTION = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "qkv_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
           "down_proj": "mlp", "gate_up_proj": "mlp"}


def config(arch: str, **extra) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": [arch], **TINY, **extra})


LLAMA = config("LlamaForCausalLM")
QWEN2 = config("Qwen2ForCausalLM")
PHI3 = config("Phi3ForCausalLM")


def peft_config(**over) -> dict:
    """adapter_config.json as PEFT 0.17 writes it for a causal LM."""
    conf = {"alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": "some/base",
            "bias": "none", "corda_config": None, "eva_config": None, "exclude_modules": None,
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "layer_replication": None, "layers_pattern": None, "layers_to_transform": None,
            "loftq_config": {}, "lora_alpha": 16, "lora_bias": False, "lora_dropout": 0.05,
            "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
            "peft_type": "LORA", "qalora_group_size": 16, "r": 4, "rank_pattern": {},
            "revision": None, "target_modules": list(SPLIT), "target_parameters": None,
            "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_dora": False,
            "use_qalora": False, "use_rslora": False}
    conf.update(over)
    return conf


def lora_pair(r: int, k: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(r, k, generator=gen), torch.randn(n, r, generator=gen)


def split_weights(targets=SPLIT, layers=(0, 1), rank=4, seed=0, ranks=None):
    """{(layer, target): (A, B)} for split (per-projection) targets."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in layers:
        for t in targets:
            _, _, k, n = WHERE[t]
            out[i, t] = lora_pair((ranks or {}).get((i, t), rank), k, n, gen)
    return out


def peft_key(layer: int, target: str, kind: str, infix: str = "") -> str:
    return (f"base_model.model.model.layers.{layer}.{SECTION[target]}.{target}.{kind}"
            f"{'.' + infix if infix else ''}.weight")


def write_peft(directory, weights: dict, conf: dict | None = None, infix: str = "",
               extra: dict | None = None, bin_file: bool = False):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(conf or peft_config()))
    sd = {}
    for (i, t), (a, b) in weights.items():
        sd[peft_key(i, t, "lora_A", infix)] = a.contiguous()
        sd[peft_key(i, t, "lora_B", infix)] = b.contiguous()
    sd.update(extra or {})
    if bin_file:
        torch.save(sd, directory / "adapter_model.bin")
    else:
        save_file(sd, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def assert_split(adapter: LoRAAdapter, weights: dict, scale_of) -> None:
    """Every (layer, target) of `weights` sits in its decoder module's part, B scaled;
    every other part is None."""
    expect: dict[str, dict[int, tuple]] = {}
    for (i, t), ab in weights.items():
        module, j, _, _ = WHERE[t]
        expect.setdefault(f"layers.{i}.{module}", {})[j] = (ab, scale_of(i, t))
    assert set(adapter.modules) == set(expect)
    for path, parts in adapter.modules.items():
        assert len(parts) == (3 if "qkv" in path else 2 if "gate_up" in path else 1), path
        for j, got in enumerate(parts):
            if j not in expect[path]:
                assert got is None, (path, j)
                continue
            (a, b), scale = expect[path][j]
            assert got[0].dtype == got[1].dtype == torch.float32
            torch.testing.assert_close(got[0], a)
            torch.testing.assert_close(got[1], b * scale)


# ---- PEFT ------------------------------------------------------------------------------------

@pytest.mark.parametrize("infix,bin_file", [("", False), ("default", False), ("", True)])
def test_peft_llama_every_target(tmp_path, infix, bin_file):
    weights = split_weights()
    path = write_peft(tmp_path / "ad", weights, infix=infix, bin_file=bin_file)
    adapter = load_adapter(path, LLAMA)
    assert (adapter.name, adapter.path, adapter.rank, adapter.alpha, adapter.format) == (
        "ad", path, 4, 16, "peft")
    assert_split(adapter, weights, lambda i, t: 16 / 4)
    own = sum(a.numel() + b.numel() for a, b in weights.values())
    assert adapter.nbytes == own * 4 and adapter.nbytes_in(torch.bfloat16) == own * 2


def test_peft_keys_without_the_peft_model_prefix(tmp_path):
    """transformers' own adapter saving (PeftAdapterMixin) names tensors from the model
    down: model.layers.0.self_attn.q_proj.lora_A.weight."""
    weights = split_weights(("q_proj", "up_proj"), layers=(0,))
    path = write_peft(tmp_path / "ad", {})
    sd = {}
    for (i, t), (a, b) in weights.items():
        for kind, w in (("lora_A", a), ("lora_B", b)):
            sd[peft_key(i, t, kind).removeprefix("base_model.model.")] = w
    save_file(sd, path + "/adapter_model.safetensors")
    assert_split(load_adapter(path, LLAMA), weights, lambda i, t: 16 / 4)


def test_peft_qwen2_some_targets_rslora(tmp_path):
    weights = split_weights(("q_proj", "v_proj", "down_proj"), layers=(1,), rank=8)
    conf = peft_config(r=8, lora_alpha=32, use_rslora=True,
                       target_modules=["q_proj", "v_proj", "down_proj"])
    adapter = load_adapter(write_peft(tmp_path / "ad", weights, conf), QWEN2, name="mine")
    assert adapter.name == "mine" and adapter.rank == 8
    assert_split(adapter, weights, lambda i, t: 32 / math.sqrt(8))
    assert adapter.modules["layers.1.self_attn.qkv_proj"][1] is None  # k not adapted


def test_peft_rank_and_alpha_patterns(tmp_path):
    ranks = {(0, "v_proj"): 2, (1, "v_proj"): 2, (1, "q_proj"): 6}
    weights = split_weights(("q_proj", "v_proj", "down_proj"), ranks=ranks)
    conf = peft_config(r=4, lora_alpha=8, target_modules=r".*\.(q_proj|v_proj|down_proj)",
                       rank_pattern={"v_proj": 2, "model.layers.1.self_attn.q_proj": 6},
                       alpha_pattern={"layers.0.mlp.down_proj": 3, "q_proj": 12})
    adapter = load_adapter(write_peft(tmp_path / "ad", weights, conf), LLAMA)
    assert adapter.rank == 6 and adapter.alpha == 8

    def scale(i, t):
        r = ranks.get((i, t), 4)
        alpha = 3 if (i, t) == (0, "down_proj") else 12 if t == "q_proj" else 8
        return alpha / r
    assert_split(adapter, weights, scale)


def test_peft_rank_pattern_with_rslora(tmp_path):
    weights = split_weights(("q_proj", "o_proj"), layers=(0,), ranks={(0, "o_proj"): 16})
    conf = peft_config(r=4, lora_alpha=8, use_rslora=True, rank_pattern={"o_proj": 16})
    adapter = load_adapter(write_peft(tmp_path / "ad", weights, conf), LLAMA)
    assert_split(adapter, weights, lambda i, t: 8 / math.sqrt(16 if t == "o_proj" else 4))


def phi3_fused_weights(seed=0, r=4):
    gen = torch.Generator().manual_seed(seed)
    return {"self_attn.qkv_proj": lora_pair(r, H, Q + 2 * KV, gen),
            "self_attn.o_proj": lora_pair(r, Q, H, gen),
            "mlp.gate_up_proj": lora_pair(r, H, 2 * I, gen),
            "mlp.down_proj": lora_pair(r, I, H, gen)}


def write_phi3_peft(directory, fused: dict, layer: int = 1, **conf):
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(peft_config(
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], **conf)))
    sd = {}
    for module, (a, b) in fused.items():
        sd[f"base_model.model.model.layers.{layer}.{module}.lora_A.weight"] = a
        sd[f"base_model.model.model.layers.{layer}.{module}.lora_B.weight"] = b
    save_file(sd, str(directory / "adapter_model.safetensors"))
    return str(directory)


def test_peft_phi3_fused_layers(tmp_path):
    """An adapter on Phi-3's whole qkv_proj / gate_up_proj: every part the same A, its own
    rows of B; applied through LoRALinear it is the fused layer's x (s B A)^T."""
    fused = phi3_fused_weights()
    adapter = load_adapter(write_phi3_peft(tmp_path / "ad", fused), PHI3)
    assert set(adapter.modules) == {f"layers.1.{m}" for m in fused}
    bounds = {"self_attn.qkv_proj": (0, Q, Q + KV, Q + 2 * KV), "mlp.gate_up_proj": (0, I, 2 * I),
              "self_attn.o_proj": (0, H), "mlp.down_proj": (0, H)}
    for module, (a, b) in fused.items():
        parts = adapter.modules[f"layers.1.{module}"]
        cols = bounds[module]
        assert len(parts) == len(cols) - 1
        for j, (pa, pb) in enumerate(parts):
            torch.testing.assert_close(pa, a)
            torch.testing.assert_close(pb, b[cols[j]:cols[j + 1]] * 4.0)
        k = a.shape[1]
        layer = LoRALinear(torch.nn.Linear(k, b.shape[0], bias=False), np.diff(cols).tolist(),
                           k, max_loras=2, max_rank=8, dtype=torch.float32,
                           device=torch.device("cpu"), step=LoRAStep())
        torch.nn.init.zeros_(layer.base.weight)
        layer.set_slot(1, parts)
        xin = torch.randn(3, k)
        layer.step.set(torch.tensor([1, -1, 1], dtype=torch.int32), None)
        y = layer(xin)
        want = xin @ (4.0 * b @ a).t()
        torch.testing.assert_close(y[[0, 2]], want[[0, 2]], rtol=1e-4, atol=1e-4)
        assert torch.all(y[1] == 0)
    # A's bytes once per fused layer, though every part holds it.
    own = sum(a.numel() + b.numel() for a, b in fused.values())
    assert adapter.nbytes == 4 * own


def test_peft_split_adapter_through_lora_linear(tmp_path):
    """The split q/k/v and gate/up targets, set into LoRALinears, add each projection's own
    s B A x to its own columns."""
    weights = split_weights()
    adapter = load_adapter(write_peft(tmp_path / "ad", weights), LLAMA)
    widths = {"self_attn.qkv_proj": [Q, KV, KV], "mlp.gate_up_proj": [I, I],
              "self_attn.o_proj": [H], "mlp.down_proj": [H]}
    for module, parts in widths.items():
        k = H if module != "mlp.down_proj" else I
        k = Q if module == "self_attn.o_proj" else k
        layer = LoRALinear(torch.nn.Linear(k, sum(parts), bias=False), parts, k, max_loras=1,
                           max_rank=8, dtype=torch.float32, device=torch.device("cpu"),
                           step=LoRAStep())
        torch.nn.init.zeros_(layer.base.weight)
        layer.set_slot(0, adapter.modules[f"layers.0.{module}"])
        x = torch.randn(2, k)
        layer.step.set(torch.zeros(2, dtype=torch.int32), None)
        targets = [t for t in SPLIT if WHERE[t][0] == module]
        want = torch.cat([x @ (4.0 * weights[0, t][1] @ weights[0, t][0]).t() for t in targets],
                         dim=1)
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)


# ---- GGUF ------------------------------------------------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (applied to a LoRA's B rows)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
              "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
              "down_proj": "ffn_down"}


def write_gguf(path, arch: str, tensors: dict, alpha: float | None = 16.0,
               general_type: str = "adapter", adapter_type: str = "lora") -> str:
    """tensors: name -> fp32 array, or (raw array, GGMLQuantizationType)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(general_type)
    if adapter_type is not None:
        w.add_string("adapter.type", adapter_type)
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def gguf_tensors(weights: dict, permute: bool, qtype=None) -> dict:
    out = {}
    for (i, t), (a, b) in weights.items():
        a, b = a.numpy(), b.numpy()
        if permute and t in ("q_proj", "k_proj"):
            b = llama_cpp_permute(b, 4 if t == "q_proj" else 2)
        base = f"blk.{i}.{GGUF_NAMES[t]}.weight"
        if qtype is not None:
            a, b = (gguf.quants.quantize(a, qtype), qtype), (gguf.quants.quantize(b, qtype), qtype)
        out[base + ".lora_a"], out[base + ".lora_b"] = a, b
    return out


@pytest.mark.parametrize("qtype", [None, gguf.GGMLQuantizationType.F16,
                                   gguf.GGMLQuantizationType.BF16])
def test_gguf_llama_equals_peft(tmp_path, qtype):
    """A llama GGUF LoRA (q/k B rows permuted by the converter) loads to the arrays of the
    PEFT adapter it came from, scale alpha / r."""
    weights = split_weights()
    if qtype is not None:  # the values the file can hold exactly
        weights = {k: (a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float())
                   for k, (a, b) in weights.items()}
    path = write_gguf(tmp_path / "ad.gguf", "llama", gguf_tensors(weights, True, qtype))
    adapter = load_adapter(path, LLAMA)
    assert (adapter.name, adapter.rank, adapter.alpha, adapter.format) == ("ad", 4, 16.0, "gguf")
    assert_split(adapter, weights, lambda i, t: 16 / 4)
    peft = load_adapter(write_peft(tmp_path / "peft", weights), LLAMA)
    for path_, parts in peft.modules.items():
        for got, want in zip(adapter.modules[path_], parts):
            torch.testing.assert_close(got, want)


def test_gguf_q8_0_and_no_alpha(tmp_path):
    """Q8_0 (rank a multiple of 32 so B's rows are whole blocks); no adapter.lora.alpha
    scales by 1, as llama.cpp does."""
    weights = split_weights(("q_proj", "gate_proj"), layers=(0,), rank=32)
    path = write_gguf(tmp_path / "ad.gguf", "llama",
                      gguf_tensors(weights, True, gguf.GGMLQuantizationType.Q8_0), alpha=None)
    adapter = load_adapter(path, LLAMA)
    assert adapter.alpha == 0.0 and adapter.rank == 32
    for (i, t), (a, b) in weights.items():
        module, j, _, _ = WHERE[t]
        ga, gb = adapter.modules[f"layers.{i}.{module}"][j]
        torch.testing.assert_close(ga, a, rtol=0, atol=a.abs().max().item() / 100)
        torch.testing.assert_close(gb, b, rtol=0, atol=b.abs().max().item() / 100)


def test_gguf_qwen2_not_permuted(tmp_path):
    weights = split_weights(("q_proj", "k_proj", "up_proj"), layers=(1,))
    path = write_gguf(tmp_path / "q.gguf", "qwen2", gguf_tensors(weights, False), alpha=8.0)
    assert_split(load_adapter(path, QWEN2), weights, lambda i, t: 8 / 4)


def test_gguf_phi3_fused(tmp_path):
    fused = phi3_fused_weights(seed=3)
    names = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {}
    for module, (a, b) in fused.items():
        tensors[f"blk.0.{names[module]}.weight.lora_a"] = a.numpy()
        tensors[f"blk.0.{names[module]}.weight.lora_b"] = b.numpy()
    adapter = load_adapter(write_gguf(tmp_path / "p.gguf", "phi3", tensors), PHI3)
    peft = load_adapter(write_phi3_peft(tmp_path / "peft", fused, layer=0), PHI3)
    assert set(adapter.modules) == set(peft.modules)
    for path_, parts in peft.modules.items():
        for got, want in zip(adapter.modules[path_], parts):
            torch.testing.assert_close(got, want)


# ---- refusals --------------------------------------------------------------------------------

def bad_peft(tmp_path, conf=None, weights=None, extra=None, cfg=LLAMA, **kw):
    path = write_peft(tmp_path / "bad", split_weights(("q_proj",), layers=(0,))
                      if weights is None else weights, conf, extra=extra)
    with pytest.raises(LoRAError) as e:
        load_adapter(path, cfg, **kw)
    return str(e.value)


def test_missing_paths_and_files(tmp_path):
    with pytest.raises(LoRAError, match="does not exist"):
        load_adapter(str(tmp_path / "nowhere"), LLAMA)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_adapter(str(tmp_path / "empty"), LLAMA)
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "adapter_config.json").write_text(json.dumps(peft_config()))
    with pytest.raises(LoRAError, match="no adapter_model.safetensors or adapter_model.bin"):
        load_adapter(str(tmp_path / "noweights"), LLAMA)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="adapter_config.json: cannot read"):
        load_adapter(str(tmp_path / "broken"), LLAMA)
    (tmp_path / "file.txt").write_text("hello")
    with pytest.raises(LoRAError, match="not a LoRA adapter"):
        load_adapter(str(tmp_path / "file.txt"), LLAMA)


@pytest.mark.parametrize("over,needle", [
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="lora_only"), "bias 'lora_only'"),
    (dict(bias="all"), "bias 'all'"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
    (dict(target_modules=["q_proj", "lm_head"]), "'lm_head'"),
    (dict(target_modules=r".*(embed_tokens|q_proj)"), "'model.embed_tokens'"),
    (dict(target_parameters=["mlp.experts.gate_up_proj"]), "target_parameters"),
    (dict(init_lora_weights="pissa_niter_4"), "init_lora_weights 'pissa_niter_4'"),
    (dict(r=0), "r 0"),
    (dict(rank_pattern={"q_proj(": 2}), "rank_pattern pattern 'q_proj('"),
])
def test_refused_configs(tmp_path, over, needle):
    msg = bad_peft(tmp_path, peft_config(**over))
    assert needle in msg and "adapter_config.json" in msg


def test_refused_weights(tmp_path):
    emb = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 64),
           "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(32, 4)}
    assert "model.embed_tokens: adapters on the embeddings" in bad_peft(tmp_path / "1", extra=emb)
    head = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(64, 4)}
    assert "lm_head: adapters on the embeddings or the LM head" in bad_peft(tmp_path / "2",
                                                                           extra=head)
    dora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
            torch.ones(32)}
    assert "model.layers.0.self_attn.q_proj: DoRA" in bad_peft(tmp_path / "3", extra=dora)
    bias = {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.ones(32)}
    assert "LoRA biases are not supported" in bad_peft(tmp_path / "4", extra=bias)
    saved = {"base_model.model.model.norm.modules_to_save.default.weight": torch.ones(32)}
    assert "is not a LoRA weight" in bad_peft(tmp_path / "5", extra=saved)
    half = {"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": torch.zeros(4, 32)}
    assert "model.layers.1.mlp.up_proj: lora_B is missing" in bad_peft(tmp_path / "6", extra=half)
    two = {peft_key(1, "v_proj", "lora_A", "other"): torch.zeros(4, 32),
           peft_key(1, "v_proj", "lora_B", "other"): torch.zeros(16, 4)}
    assert "several adapters" in bad_peft(tmp_path / "7", extra=two)


def test_refused_targets_and_shapes(tmp_path):
    msg = bad_peft(tmp_path / "1", weights=split_weights(("q_proj",), layers=(2,)))
    assert "model.layers.2.self_attn.q_proj: layer 2 is beyond the base model's 2 layers" in msg
    # An adapter for a wider base: names the layer, its found and expected shapes.
    gen = torch.Generator().manual_seed(0)
    wide = {(0, "k_proj"): lora_pair(4, 64, 32, gen)}
    msg = bad_peft(tmp_path / "2", weights=wide)
    assert ("model.layers.0.self_attn.k_proj: lora_A is [4, 64] and lora_B [32, 4]; the "
            "base's layer needs lora_A [r, 32] and lora_B [16, r]") in msg
    msg = bad_peft(tmp_path / "3", weights=split_weights(("o_proj",), layers=(0,), rank=8))
    assert ("model.layers.0.self_attn.o_proj: lora_A has rank 8, the adapter's config gives "
            "it r=4") in msg
    msg = bad_peft(tmp_path / "4", peft_config(r=8), split_weights(rank=8), max_rank=4)
    assert "rank 8 is over the maximum LoRA rank 4" in msg
    # Both the fused layer and one of its parts.
    gen = torch.Generator().manual_seed(1)
    both = {"base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight": torch.zeros(4, 32),
            "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight": torch.zeros(64, 4)}
    msg = bad_peft(tmp_path / "5", weights={(0, "q_proj"): lora_pair(4, H, Q, gen)}, extra=both)
    assert "adapted twice" in msg


def test_refused_moe_targets(tmp_path):
    moe = config("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=24, head_dim=8)
    gen = torch.Generator().manual_seed(0)
    a, b = lora_pair(4, H, 24, gen)
    experts = {"base_model.model.model.layers.0.mlp.experts.1.gate_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.mlp.experts.1.gate_proj.lora_B.weight": b}
    msg = bad_peft(tmp_path / "1", extra=experts, cfg=moe)
    assert "model.layers.0.mlp.experts.1.gate_proj: servelm does not adapt this layer" in msg
    router = {"base_model.model.model.layers.0.mlp.gate.lora_A.weight": torch.zeros(4, H),
              "base_model.model.model.layers.0.mlp.gate.lora_B.weight": torch.zeros(4, 4)}
    assert "mlp.gate: servelm does not adapt" in bad_peft(tmp_path / "2", extra=router, cfg=moe)
    dense = split_weights(("down_proj",), layers=(1,))
    msg = bad_peft(tmp_path / "3", weights=dense, cfg=moe)
    assert "model.layers.1.mlp.down_proj: layer 1's MLP is routed experts" in msg
    # Attention is adapted on a MoE base.
    ok = load_adapter(write_peft(tmp_path / "4", split_weights(("q_proj", "o_proj"))), moe)
    assert set(ok.modules) == {f"layers.{i}.self_attn.{m}" for i in (0, 1)
                               for m in ("qkv_proj", "o_proj")}


def test_refused_for_the_layer_kind(tmp_path):
    """A target the layer's kind lacks is named with what the layer has: a non-gated MLP's
    up projection on a gated MLP, a DeltaNet's projection on an attention layer, latent
    attention's projections."""
    import dataclasses

    gen = torch.Generator().manual_seed(0)
    up = {"base_model.model.model.layers.0.mlp.c_fc.lora_A.weight": torch.zeros(4, H),
          "base_model.model.model.layers.0.mlp.c_fc.lora_B.weight": torch.zeros(I, 4)}
    msg = bad_peft(tmp_path / "1", extra=up)
    assert "layer 0's MLP has no c_fc (it has gate_up_proj and down_proj" in msg
    lin = {"base_model.model.model.layers.1.linear_attn.out_proj.lora_A.weight": torch.zeros(4, H),
           "base_model.model.model.layers.1.linear_attn.out_proj.lora_B.weight": torch.zeros(H, 4)}
    assert "layer 1 is not linear attention" in bad_peft(tmp_path / "2", extra=lin)
    mla = dataclasses.replace(LLAMA, extra={**LLAMA.extra, "mla": {"kv_lora_rank": 8}})
    msg = bad_peft(tmp_path / "3", weights={(0, "q_proj"): lora_pair(4, H, Q, gen)}, cfg=mla)
    assert "layer 0's attention is latent attention (DeepSeek)" in msg


def test_refused_gguf(tmp_path):
    good = gguf_tensors(split_weights(("q_proj",), layers=(0,)), True)

    def refused(name, arch="llama", tensors=good, **kw):
        with pytest.raises(LoRAError) as e:
            load_adapter(write_gguf(tmp_path / name, arch, tensors, **kw), LLAMA)
        return str(e.value)

    assert "general.type is 'model'" in refused("m.gguf", general_type="model",
                                                 adapter_type=None)
    assert "adapter.type 'control_vector'" in refused("c.gguf", adapter_type="control_vector")
    assert "GGUF architecture 'qwen2'" in refused("q.gguf", arch="qwen2")
    emb = {"token_embd.weight.lora_a": np.zeros((4, 64), np.float32),
           "token_embd.weight.lora_b": np.zeros((32, 4), np.float32)}
    assert "token_embd.weight: adapters on the embeddings" in refused("e.gguf", tensors=emb)
    norm = {**good, "blk.0.attn_norm.weight": np.ones(32, np.float32)}
    assert "'blk.0.attn_norm.weight' is not a LoRA weight" in refused("n.gguf", tensors=norm)
    half = {"blk.1.ffn_down.weight.lora_a": np.zeros((4, 48), np.float32)}
    assert "blk.1.ffn_down.weight: lora_b is missing" in refused("h.gguf", tensors=half)
    wrong = {"blk.0.attn_q.weight.lora_a": np.zeros((4, 32), np.float32),
             "blk.0.attn_q.weight.lora_b": np.zeros((48, 4), np.float32)}
    assert "blk.0.attn_q.weight: lora_A is [4, 32] and lora_B [48, 4]" in refused(
        "w.gguf", tensors=wrong)
    with pytest.raises(LoRAError, match="rank 4 is over the maximum LoRA rank 2"):
        load_adapter(write_gguf(tmp_path / "r.gguf", "llama", good), LLAMA, max_rank=2)


# ---- against PEFT itself ---------------------------------------------------------------------

HF_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.mark.parametrize("arch,targets,options", [
    ("Llama", list(SPLIT),
     dict(rank_pattern={"v_proj": 2, "model.layers.1.mlp.down_proj": 8},
          alpha_pattern={"k_proj": 3, "layers.0.self_attn.o_proj": 24})),
    ("Qwen2", ["q_proj", "k_proj", "v_proj", "down_proj"], dict(use_rslora=True)),
    ("Phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
     dict(rank_pattern={"gate_up_proj": 6})),
])
def test_peft_saved_adapter_deltas(tmp_path, arch, targets, options):
    """An adapter PEFT itself made and saved (random A and B) loads to PEFT's own delta
    weights, scale (alpha / r, rsLoRA, rank_pattern, alpha_pattern) included, and a fused
    checkpoint layer's delta is its parts' side by side."""
    pytest.importorskip("peft")
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    hf_cfg = getattr(transformers, f"{arch}Config")(**HF_TINY)
    model = getattr(transformers, f"{arch}ForCausalLM")(hf_cfg)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=targets,
                                                  init_lora_weights=False, **options))
    peft_model.save_pretrained(tmp_path / "ad")
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    adapter = load_adapter(str(tmp_path / "ad"), cfg)

    expected = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            hf = name.removeprefix("base_model.model.model.")
            expected[hf] = module.get_delta_weight("default").detach()
    assert len(expected) == 2 * len(targets)
    parts_of = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                "gate_up_proj": ("gate_proj", "up_proj")}
    got = {}
    for path, parts in adapter.modules.items():
        prefix, module = path.rsplit(".", 1)
        deltas = [None if ab is None else ab[1] @ ab[0] for ab in parts]
        fused = f"{prefix}.{module}" in expected
        if fused or len(parts) == 1:
            got[f"{prefix}.{module}"] = torch.cat(deltas)
        else:
            for part, delta in zip(parts_of[module], deltas):
                if delta is not None:
                    got[f"{prefix}.{part}"] = delta
    assert set(got) == set(expected)
    for name, delta in expected.items():
        torch.testing.assert_close(got[name], delta, rtol=1e-5, atol=1e-6, msg=name)
    assert adapter.rank == max([4, *options.get("rank_pattern", {}).values()])
