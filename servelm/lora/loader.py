"""LoRA adapters read from disk into the decoder's layout: a PEFT directory
(adapter_config.json + adapter_model.safetensors, or adapter_model.bin) or a llama.cpp GGUF
LoRA file (general.type "adapter", adapter.type "lora").

Either becomes a LoRAAdapter whose `modules` are keyed by the decoder's adaptable layers
(servelm.lora.wrap.adaptable_layers' paths: layers.{i}.self_attn.qkv_proj, .o_proj,
layers.{i}.mlp.gate_up_proj, .down_proj), one entry per part of the fused layer (q, k, v;
gate, up) in its column order: (A [r, K], B [N_part, r]) in fp32 with the adapter's scale
folded into B, or None for a part the adapter leaves alone; what LoRALinear.set_slot takes.

Checkpoint names map to the decoder's through the model's Family (internal_name for HF
names, gguf_name for llama.cpp's); an adapter on a whole fused checkpoint layer (Phi-3's
qkv_proj, gate_up_proj) gives each part the same A and that part's rows of B. Anything the
decoder cannot run as y += B (A x) on those layers (DoRA, embeddings, the LM head, biases,
routed experts, full module copies) is a LoRAError naming it, as is every shape that does
not fit the base.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from servelm.layers.lora import TARGET_PARTS

Part = tuple[torch.Tensor, torch.Tensor] | None

# The decoder block each adaptable layer lives in.
_SECTION = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
            "down_proj": "mlp", "c_fc": "mlp", "c_proj": "mlp",
            "in_proj_qkvz": "linear_attn", "in_proj_ba": "linear_attn",
            "out_proj": "linear_attn"}
# A checkpoint layer (its name under layers.{i}, decoder spelling) -> (the decoder's module
# under layers.{i}, the part it fills; None: the whole fused layer, every part).
_TARGETS: dict[str, tuple[str, int | None]] = {}
for _module, _parts in TARGET_PARTS.items():
    for _j, _part in enumerate(_parts):
        _TARGETS[f"{_SECTION[_module]}.{_part}"] = (f"{_SECTION[_module]}.{_module}", _j)
    if len(_parts) > 1:
        _TARGETS[f"{_SECTION[_module]}.{_module}"] = (f"{_SECTION[_module]}.{_module}", None)

# Modules no adapter of servelm's may target (PEFT's spelling, and llama.cpp's).
_EMBEDDINGS = ("embed_tokens", "lm_head")
_PEFT_KINDS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
               "lora_magnitude_vector")
# adapter_config.json fields that change what the weights mean beyond y += B (A x) on
# linear layers (a true value refuses the adapter).
_PEFT_REFUSED = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "lora_bias": "adapters with a LoRA bias (lora_bias) are not supported",
    "target_parameters": "adapters on parameters (target_parameters, e.g. MoE experts) "
                         "are not supported",
    "trainable_token_indices": "trainable tokens (trainable_token_indices) are not supported",
    "layer_replication": "layer_replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
}

# init_lora_weights values whose adapters apply to a base PEFT modified (the principal
# components moved into the adapter), not to the model as published.
_RESIDUAL_INITS = ("pissa", "olora", "corda", "lora_ga")


class LoRAError(ValueError):
    """An adapter that cannot be loaded onto this base model; the message names why."""


@dataclass
class LoRAAdapter:
    """One adapter in the decoder's layout (see the module docstring)."""

    name: str
    path: str
    rank: int        # the largest rank over its modules
    alpha: float     # lora_alpha (PEFT) or adapter.lora.alpha (GGUF), as the file gives it
    modules: dict[str, list[Part]] = field(default_factory=dict)
    format: str = "peft"  # "peft" or "gguf"

    def nbytes_in(self, dtype: torch.dtype) -> int:
        """The adapter's own weights' bytes held in `dtype`: every A and B once (a fused
        checkpoint layer's A, shared by its parts, counted once)."""
        size = torch.empty((), dtype=dtype).element_size()
        seen: set[int] = set()
        count = 0
        for parts in self.modules.values():
            for ab in parts:
                for t in ab or ():
                    if id(t) not in seen:
                        seen.add(id(t))
                        count += t.numel()
        return count * size

    @property
    def nbytes(self) -> int:
        """nbytes_in(float32): the bytes as loaded."""
        return self.nbytes_in(torch.float32)


@dataclass
class _Weight:
    """One checkpoint layer's A and B, before placement."""

    source: str           # the checkpoint's name of the layer (for messages)
    internal: str         # its decoder name: layers.{i}.<section>.<name>
    a: torch.Tensor
    b: torch.Tensor
    rank: int | None = None  # the rank its config declares (PEFT), checked against A
    alpha: float = 0.0
    scale: float = 1.0


def load_adapter(path: str, model_config, name: str | None = None,
                 max_rank: int | None = None) -> LoRAAdapter:
    """The adapter at `path` (a PEFT directory or a GGUF LoRA file) for a base of
    `model_config` (servelm.models.config.ModelConfig). name: defaults to the path's last
    component. max_rank: a module of higher rank is a LoRAError."""
    from servelm.models.registry import family_for_architecture

    if not path or not os.path.exists(path):
        raise LoRAError(f"LoRA adapter path {path!r} does not exist")
    try:
        family = family_for_architecture(model_config.architecture)
    except ValueError as e:
        raise LoRAError(f"{path}: {e}") from e
    if name is None:
        name = os.path.basename(os.path.normpath(path))
        name = name[:-5] if name.endswith(".gguf") else name
    if os.path.isdir(path):
        weights, alpha = _read_peft(path, family)
        fmt = "peft"
    elif _is_gguf(path):
        weights, alpha = _read_gguf(path, model_config, family)
        fmt = "gguf"
    else:
        raise LoRAError(f"{path}: not a LoRA adapter (a PEFT directory with "
                        f"adapter_config.json, or a GGUF LoRA file)")
    if getattr(model_config, "qkv_per_head", False):
        raise LoRAError(f"{path}: servelm does not adapt a base whose q/k/v rows are "
                        f"interleaved head by head (GPT-NeoX)")
    modules, rank = _place(path, weights, model_config, max_rank, family, gguf=fmt == "gguf")
    return LoRAAdapter(name=name, path=path, rank=rank, alpha=alpha, modules=modules,
                       format=fmt)


# ---- placement (both formats) ----------------------------------------------------------------

def _layer_shapes(cfg, layer: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """Decoder module under layers.{layer} -> (its parts' output widths, its input width):
    the layer's own head size, KV heads and MLP width (Gemma 4's differ by layer), and its
    qkv_proj's parts (q and k where the values are the keys, q alone where the layer reads
    another's keys and values)."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_of(layer), cfg.head_dim_of(layer)
    mlp = ({"mlp.gate_up_proj": ((inter, inter), h), "mlp.down_proj": ((h,), inter)}
           if cfg.mlp_gated else {"mlp.c_fc": ((inter,), h), "mlp.c_proj": ((h,), inter)})
    if cfg.is_linear_layer(layer):  # a gated DeltaNet: q | k | v and z, b and a, out_proj
        lin = cfg.extra["linear_attn"]
        key, value = lin["num_k_heads"] * lin["head_k_dim"], lin["num_v_heads"] * lin["head_v_dim"]
        return {"linear_attn.in_proj_qkvz": ((2 * key + value, value), h),
                "linear_attn.in_proj_ba": ((lin["num_v_heads"],) * 2, h),
                "linear_attn.out_proj": ((h,), value), **mlp}
    q, kv = cfg.num_heads * d, cfg.kv_heads_of(layer) * d
    parts = len(qkv_parts(cfg, layer))
    return {"self_attn.qkv_proj": ((q, kv, kv)[:parts], h), "self_attn.o_proj": ((h,), q),
            **mlp}


def qkv_parts(cfg, layer: int) -> tuple[str, ...]:
    """The projections a layer's qkv_proj holds (models.layers.Attention.qkv_parts)."""
    if cfg.kv_source(layer) != layer:
        return ("q_proj",)
    if layer in cfg.extra.get("k_eq_v_layers", ()):
        return ("q_proj", "k_proj")
    return ("q_proj", "k_proj", "v_proj")


def _place(path: str, weights: list[_Weight], cfg, max_rank: int | None, family=None,
           gguf: bool = False) -> tuple[dict[str, list[Part]], int]:
    """Check each weight against the base's shapes and put it (scale folded into B) in its
    decoder module's parts."""
    if not weights:
        raise LoRAError(f"{path}: the adapter holds no LoRA weights")
    modules: dict[str, list[Part]] = {}
    rank = 0
    for w in weights:
        m = re.fullmatch(r"layers\.(\d+)\.(\w+\.\w+)", w.internal)
        target = m and _TARGETS.get(m.group(2))
        if not target:
            raise LoRAError(f"{path}: {w.source}: servelm does not adapt this layer "
                            f"(adapted: q/k/v/o projections, the dense MLP's gate/up/down "
                            f"or up/down (c_fc/c_proj, fc1/fc2) and a gated DeltaNet's "
                            f"in_proj_qkv/z/b/a and out_proj)")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoRAError(f"{path}: {w.source}: layer {layer} is beyond the base model's "
                            f"{cfg.num_layers} layers")
        module, part = target
        if module.startswith("self_attn.") and cfg.extra.get("mla"):
            raise LoRAError(f"{path}: {w.source}: layer {layer}'s attention is latent "
                            f"attention (DeepSeek), whose projections servelm does not "
                            f"adapt (its dense MLPs it does)")
        if (not module.startswith("mlp.")
                and module.startswith("linear_attn.") != cfg.is_linear_layer(layer)):
            raise LoRAError(f"{path}: {w.source}: layer {layer} is "
                            + ("linear attention (a gated DeltaNet)" if cfg.is_linear_layer(layer)
                               else "not linear attention")
                            + " (an adapter for another base model?)")
        if module.startswith("linear_attn.") and gguf:
            raise LoRAError(f"{path}: {w.source}: GGUF LoRA adapters on linear-attention "
                            f"layers are not supported (llama.cpp orders their value heads "
                            f"its own way): use the PEFT adapter")
        if (module.startswith("mlp.") and cfg.is_moe_layer(layer)
                and not cfg.extra.get("moe_beside_mlp")):  # (Gemma 4's MLP is beside them)
            raise LoRAError(f"{path}: {w.source}: layer {layer}'s MLP is routed experts, "
                            f"which servelm does not adapt")
        shapes = _layer_shapes(cfg, layer)
        if module not in shapes:  # a gated MLP's target on a non-gated one, or the reverse
            raise LoRAError(f"{path}: {w.source}: layer {layer}'s MLP has no "
                            f"{module.split('.')[1]} (it has "
                            f"{' and '.join(n.split('.')[1] for n in shapes if n.startswith('mlp.'))}"
                            f"; an adapter for another base model?)")
        widths, k = shapes[module]
        if part is not None and part >= len(widths):
            held = qkv_parts(cfg, layer)
            raise LoRAError(f"{path}: {w.source}: layer {layer} has no "
                            f"{TARGET_PARTS['qkv_proj'][part]} (its attention projects "
                            f"{', '.join(held)} only: "
                            + ("its keys are its values)" if len(held) == 2 else
                               f"it reads layer {cfg.kv_source(layer)}'s keys and values)"))
        if part is None and module == "self_attn.qkv_proj" and len(widths) < 3:
            raise LoRAError(f"{path}: {w.source}: layer {layer}'s attention has no fused "
                            f"q/k/v projection to adapt whole (it projects "
                            f"{', '.join(qkv_parts(cfg, layer))} only)")
        n = sum(widths) if part is None else widths[part]
        # A gated attention's q_proj (Qwen3-Next, Qwen3.5) holds each head's query and its
        # output gate ([heads, 2, head_dim] rows), which the base splits into qkv_proj's q
        # and attn_gate at load: B's rows are split the same way, A serves both.
        gated = (module == "self_attn.qkv_proj" and cfg.extra.get("attn_output_gate")
                 and not cfg.is_linear_layer(layer))
        if gated and part is None:
            raise LoRAError(f"{path}: {w.source}: layer {layer}'s queries carry an output "
                            f"gate: adapt q_proj, k_proj and v_proj apart")
        if gated and part == 0:
            n *= 2
        a, b = w.a, w.b
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, k) or tuple(b.shape) != (n, r):
            raise LoRAError(f"{path}: {w.source}: lora_A is {list(a.shape)} and lora_B "
                            f"{list(b.shape)}; the base's layer needs lora_A [r, {k}] and "
                            f"lora_B [{n}, r] (an adapter for another base model?)")
        if w.rank is not None and r != w.rank:
            raise LoRAError(f"{path}: {w.source}: lora_A has rank {r}, the adapter's "
                            f"config gives it r={w.rank}")
        if max_rank is not None and r > max_rank:
            raise LoRAError(f"{path}: {w.source}: rank {r} is over the maximum LoRA rank "
                            f"{max_rank} (max_lora_rank)")
        rank = max(rank, r)
        key = f"layers.{layer}.{module}"
        parts = modules.setdefault(key, [None] * len(widths))
        a = a.float().contiguous()
        b = b.float() * w.scale
        if part is None and module.startswith("linear_attn.in_proj") and family is not None:
            # Qwen3-Next's fused pair, per key head: B's rows reordered as the base's are.
            name = f"layers.{layer}.{module}.weight"
            b = family.split(name, b, cfg)[0][1]
        if gated and part == 0:
            d = cfg.head_dim_of(layer)
            heads = b.reshape(-1, 2, d, r)
            b = heads[:, 0].reshape(-1, r)
            modules[f"layers.{layer}.self_attn.attn_gate"] = [
                (a, heads[:, 1].reshape(-1, r).contiguous())]
        bounds = [0]
        for width in widths:
            bounds.append(bounds[-1] + width)
        for j in (range(len(widths)) if part is None else (part,)):
            if parts[j] is not None:
                raise LoRAError(f"{path}: {w.source}: {key} part "
                                f"{TARGET_PARTS[module.split('.')[1]][j]} is adapted twice "
                                f"(a fused layer and its parts both targeted?)")
            rows = b if part is not None else b[bounds[j]:bounds[j + 1]]
            if module == "self_attn.qkv_proj" and j < 2 and cfg.rope_interleaved:
                # The base's q/k rows were reordered at load for its pairwise rotary
                # (layers.rotate_half_rows): B's rows move with them.
                from servelm.models.layers import rotate_half_rows

                d = cfg.head_dim_of(layer)
                rows = rotate_half_rows(rows, d, cfg.rotary_dim or d)
            parts[j] = (a, rows.contiguous())
    return modules, rank


# ---- PEFT ------------------------------------------------------------------------------------

def _peft_config(path: str) -> dict:
    """adapter_config.json, checked: a LoRA servelm can run, with PEFT's defaults filled."""
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise LoRAError(f"{path}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        with open(cfg_file) as f:
            conf = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_file}: cannot read it ({e})") from e
    if not isinstance(conf, dict):
        raise LoRAError(f"{cfg_file}: not a JSON object")
    peft_type = conf.get("peft_type") or "LORA"
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{cfg_file}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, why in _PEFT_REFUSED.items():
        if conf.get(key):
            raise LoRAError(f"{cfg_file}: {why}")
    init = conf.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_RESIDUAL_INITS):
        raise LoRAError(f"{cfg_file}: init_lora_weights {init!r}: the adapter needs the "
                        f"residual base model it was trained on (save it with PEFT's "
                        f"path_initial_model_for_weight_conversion to apply to the base)")
    if conf.get("modules_to_save"):
        raise LoRAError(f"{cfg_file}: modules_to_save {conf['modules_to_save']!r}: full "
                        f"copies of base modules are not supported")
    if conf.get("bias", "none") not in (None, "none"):
        raise LoRAError(f"{cfg_file}: bias {conf['bias']!r}: adapters that train biases "
                        f"are not supported (bias must be 'none')")
    r, alpha = conf.get("r", 8), conf.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{cfg_file}: r {r!r} is not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{cfg_file}: lora_alpha {alpha!r} is not a number")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = conf.get(key) or {}
        if not isinstance(pattern, dict):
            raise LoRAError(f"{cfg_file}: {key} must be an object (pattern -> value)")
        for pat, value in pattern.items():
            try:
                re.compile(pat)
            except re.error as e:
                raise LoRAError(f"{cfg_file}: {key} pattern {pat!r} is not a valid regular "
                                f"expression ({e})") from e
            if not isinstance(value, (int, float)) or isinstance(value, bool) or (
                    key == "rank_pattern" and (not isinstance(value, int) or value < 1)):
                raise LoRAError(f"{cfg_file}: {key}[{pat!r}] = {value!r} is not a valid "
                                f"{'rank' if key == 'rank_pattern' else 'alpha'}")
    _check_targets(conf.get("target_modules"), cfg_file)
    return {**conf, "r": r, "lora_alpha": alpha, "rank_pattern": conf.get("rank_pattern") or {},
            "alpha_pattern": conf.get("alpha_pattern") or {},
            "use_rslora": bool(conf.get("use_rslora"))}


def _check_targets(targets, cfg_file: str) -> None:
    """target_modules naming an embedding or the LM head (PEFT's matching: a list entry is
    a module name or its dotted suffix; a string is a regex over the whole module name)."""
    if targets is None or targets == "all-linear":  # all-linear leaves the LM head out
        return
    if isinstance(targets, str):
        try:
            bad = [t for t in ("model.embed_tokens", "lm_head") if re.fullmatch(targets, t)]
        except re.error as e:
            raise LoRAError(f"{cfg_file}: target_modules {targets!r} is not a valid regular "
                            f"expression ({e})") from e
    elif isinstance(targets, (list, tuple)):
        bad = [t for t in targets if isinstance(t, str) and t.rpartition(".")[2] in _EMBEDDINGS]
    else:
        raise LoRAError(f"{cfg_file}: target_modules {targets!r} is neither a list nor a "
                        f"string")
    if bad:
        raise LoRAError(f"{cfg_file}: target_modules {targets!r} targets {bad[0]!r}: "
                        f"adapters on the embeddings or the LM head are not supported")


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's get_pattern_key: the first pattern (in the config's order) that matches the
    module name whole or one of its dotted suffixes gives the value."""
    for pat, value in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return value
    return default


def _peft_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    binf = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(binf):
            sd = torch.load(binf, map_location="cpu", weights_only=True)
            if not isinstance(sd, dict):
                raise LoRAError(f"{binf}: not a state dict")
            return sd
    except LoRAError:
        raise
    except Exception as e:  # a corrupt or unreadable file: any of the readers' errors
        raise LoRAError(f"{path}: cannot read the adapter's weights ({e})") from e
    raise LoRAError(f"{path}: no adapter_model.safetensors or adapter_model.bin")


def _read_peft(path: str, family) -> tuple[list[_Weight], float]:
    conf = _peft_config(path)
    found: dict[str, dict[str, torch.Tensor]] = {}
    infixes: set[str] = set()
    for key, tensor in _peft_tensors(path).items():
        name = key.removeprefix("base_model.model.")
        comps = name.split(".")
        at = max((i for i, c in enumerate(comps) if c in _PEFT_KINDS), default=None)
        if at is None:
            raise LoRAError(f"{path}: tensor {key!r} is not a LoRA weight (modules_to_save, "
                            f"trainable tokens or another PEFT method are not supported)")
        module, kind, rest = ".".join(comps[:at]), comps[at], comps[at + 1:]
        if kind == "lora_magnitude_vector":
            raise LoRAError(f"{path}: {module}: DoRA adapters (lora_magnitude_vector) are "
                            f"not supported")
        if kind.startswith("lora_embedding") or module.rpartition(".")[2] in _EMBEDDINGS:
            raise LoRAError(f"{path}: {module}: adapters on the embeddings or the LM head "
                            f"are not supported")
        param = rest[-1] if rest and rest[-1] in ("weight", "bias") else None
        if param != "weight":
            raise LoRAError(f"{path}: tensor {key!r}: "
                            + ("LoRA biases are not supported" if param == "bias"
                               else "not a LoRA weight"))
        infixes.add(".".join(rest[:-1]))
        found.setdefault(module, {})[kind] = tensor
    if len(infixes) > 1:
        raise LoRAError(f"{path}: the weights hold several adapters "
                        f"({', '.join(sorted(i or '(unnamed)' for i in infixes))}); "
                        f"save one per directory")
    weights = []
    for module, ab in found.items():
        if set(ab) != {"lora_A", "lora_B"}:
            missing = "lora_B" if "lora_A" in ab else "lora_A"
            raise LoRAError(f"{path}: {module}: {missing} is missing")
        r = _pattern_value(conf["rank_pattern"], module, conf["r"])
        alpha = _pattern_value(conf["alpha_pattern"], module, conf["lora_alpha"])
        scale = alpha / math.sqrt(r) if conf["use_rslora"] else alpha / r
        internal = family.internal_name(module + ".weight").removesuffix(".weight")
        weights.append(_Weight(module, internal, ab["lora_A"], ab["lora_B"], r, alpha, scale))
    return weights, conf["lora_alpha"]


# ---- GGUF ------------------------------------------------------------------------------------

def _is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise LoRAError(f"{path}: cannot read it ({e})") from e


def _gguf_arch_fits(arch: str, family) -> bool:
    """llama.cpp converts Llama-shaped models (Mistral, Mixtral too) as `llama`."""
    return arch in family.gguf_architectures or (arch == "llama" and family.gguf_permute_qk)


def _read_gguf(path: str, cfg, family) -> tuple[list[_Weight], float]:
    import gguf

    from servelm.models import dequant
    from servelm.models.paths import ModelLoadError, read_gguf

    try:
        reader = read_gguf(path)
    except ModelLoadError as e:
        raise LoRAError(str(e)) from e
    meta = reader.metadata
    if meta.get("general.type") != "adapter":
        raise LoRAError(f"{path}: not a GGUF adapter (general.type is "
                        f"{meta.get('general.type')!r}, an adapter's is 'adapter')")
    if meta.get("adapter.type") != "lora":
        raise LoRAError(f"{path}: GGUF adapter.type {meta.get('adapter.type')!r} is not "
                        f"supported (only 'lora')")
    if meta.get("adapter.alora.invocation_tokens"):
        raise LoRAError(f"{path}: activated LoRA (adapter.alora.invocation_tokens) is not "
                        f"supported")
    arch = meta.get("general.architecture")
    if not _gguf_arch_fits(arch, family):
        raise LoRAError(f"{path}: an adapter for GGUF architecture {arch!r}; the base model "
                        f"is of the {family.name} family")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    found: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        if kind not in ("lora_a", "lora_b"):
            raise LoRAError(f"{path}: tensor {t.name!r} is not a LoRA weight (servelm loads "
                            f"only .lora_a / .lora_b pairs)")
        qtype = gguf.GGMLQuantizationType(t.qtype).name
        try:
            # A copy: the memory map is read-only, and these tensors are small.
            values = dequant.dequantize(np.array(t.data), qtype, kernels=False)
        except ValueError as e:
            raise LoRAError(f"{path}: tensor {t.name}: {e}") from e
        if values is None:
            raise LoRAError(f"{path}: tensor {t.name} has unsupported type {qtype}")
        found.setdefault(base, {})[kind] = values.numpy().reshape(t.shape)
    weights = []
    for base, ab in found.items():
        if set(ab) != {"lora_a", "lora_b"}:
            missing = "lora_b" if "lora_a" in ab else "lora_a"
            raise LoRAError(f"{path}: {base}: {missing} is missing")
        hf = family.gguf_name(base)
        if hf is None:
            raise LoRAError(f"{path}: {base}: not a layer of the {family.name} family")
        if hf.rpartition(".")[0].rpartition(".")[2] in _EMBEDDINGS:
            raise LoRAError(f"{path}: {base}: adapters on the embeddings or the LM head "
                            f"are not supported")
        a, b = ab["lora_a"], ab["lora_b"]
        heads = {".q_proj.": cfg.num_heads, ".k_proj.": cfg.num_kv_heads}
        rows = next((n * cfg.head_dim for part, n in heads.items() if part in hf), None)
        if b.ndim == 2 and b.shape[0] == rows:
            # llama.cpp permuted B's rows as it did the base weight's (A is per input); a
            # B of other rows is refused by its shape below.
            b = family.from_gguf(hf, b, cfg, b.shape[0])
        r = a.shape[0] if a.ndim == 2 else 1
        scale = alpha / r if alpha else 1.0  # llama.cpp: alpha 0 (or none) scales by 1
        internal = family.internal_name(hf).removesuffix(".weight")
        weights.append(_Weight(base, internal, torch.from_numpy(np.array(a, np.float32)),
                               torch.from_numpy(np.array(b, np.float32)), None, alpha, scale))
    return weights, alpha
