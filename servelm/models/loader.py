"""Weights from a GGUF file or a Hugging Face safetensors directory, as HF-named tensors."""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from servelm.models import dequant, hf_quant
from servelm.models.config import ModelConfig
from servelm.models.paths import (DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE,  # noqa: F401
                                  ModelLoadError, default_model_path, read_gguf,
                                  resolve_model_path)
from servelm.models.registry import family_for_architecture
from servelm.quantization.mxfp4 import MXFP4Weight

ROPE_FREQS = "rope_freqs.weight"

# GGUF tensor types by the servelm weight format that keeps their precision: 2- to 5-bit
# blocks run as int4 (as llama.cpp's Q4_K_M mixes Q4_K with Q6_K), 6- and 8-bit as int8.
GGUF_INT4 = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "MXFP4"}
GGUF_INT8 = {"Q8_0", "Q8_1", "Q8_K", "Q6_K"}


class GGUFFile:
    """A GGUF file's metadata as plain Python values, and its tensors dequantised on demand
    (MXFP4 routed experts, where keep_mxfp4 is set, as they are: MXFP4Weight)."""

    def __init__(self, path: str):
        self.reader = read_gguf(path)
        self.path = path
        self.metadata = self.reader.metadata
        self.tensor_names = {t.name for t in self.reader.tensors}
        # Whether weights() yields MXFP4 experts as MXFP4Weight (the engine's choice, where
        # mxfp4_experts(); load_model readies the model's experts for them).
        self.keep_mxfp4 = False

    def mxfp4_experts(self) -> bool:
        """Whether the routed experts are all MXFP4 (llama.cpp's gpt-oss files)."""
        kinds = {_gguf_type_name(t.qtype) for t in self.reader.tensors if _stacked_experts(t.name)}
        return kinds == {"MXFP4"}

    def config(self) -> ModelConfig:
        try:
            cfg = ModelConfig.from_gguf(self.metadata, self.tensor_names)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: {e}") from e
        if ROPE_FREQS in self.tensor_names:
            # Llama 3.1+ files carry their rope scaling as one divisor per frequency
            # (Gemma 4's, its global layers' partial rotary).
            t = next(t for t in self.reader.tensors if t.name == ROPE_FREQS)
            factors = tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).ravel())
            try:
                cfg = family_for_architecture(cfg.architecture).gguf_rope_freqs(cfg, factors)
            except ValueError as e:
                raise ModelLoadError(f"{self.path}: {e}") from e
        return cfg

    def native_quantization(self) -> tuple[str | None, str]:
        """The weight format to run this file in by default (None: the activation dtype) and
        a line for the log. Decided by the linear layers' tensor types (the decoder's 2-D
        weights and the LM head, by element count; not the embedding table, not norms, not
        routed experts' stacked 3-D tensors, which servelm keeps in the activation dtype:
        gpt-oss's MXFP4 experts must not make its bf16 attention int4): more than half 2- to
        5-bit blocks -> int4; else more than half quantised -> int8."""
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            linear = (t.name.startswith("blk.") and t.name.endswith(".weight")
                      and len(t.shape) == 2) or t.name == "output.weight"
            if linear:
                qtype = _gguf_type_name(t.qtype)
                counts[qtype] = counts.get(qtype, 0) + int(np.prod(t.shape))
        total = sum(counts.values()) or 1
        int4 = sum(n for q, n in counts.items() if _gguf_int4(q)) / total
        int8 = sum(n for q, n in counts.items() if q in GGUF_INT8) / total
        native = "int4" if int4 > 0.5 else "int8" if int4 + int8 > 0.5 else None
        mix = ", ".join(f"{q} {_percent(n / total)}"
                        for q, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        kind = _gguf_file_type(self.metadata.get("general.file_type"))
        return native, (f"GGUF{' ' + kind if kind else ''} ({mix or 'no linear weights'}): "
                        f"{native + ' weights' if native else 'unquantised weights'}")

    def tokenizer(self):
        from servelm.tokenizer import gguf_tokenizer

        return gguf_tokenizer(self.path, self.metadata)

    def weights(self, cfg: ModelConfig, slice_of: SliceOf | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named fp32 tensors, in the HF checkpoint's convention (the family undoes what
        llama.cpp's converter did: q/k rows permuted for llama, Gemma's norms stored as 1 + w).

        slice_of (tensor parallelism): HF name -> the (dim, start, end) pieces to keep,
        joined in order; only those parts are dequantised."""
        import gguf

        family = family_for_architecture(cfg.architecture)
        for t in tqdm(self.reader.tensors, desc="loading weights", unit="tensor",
                      file=sys.stderr, disable=None, leave=False):
            if t.name == ROPE_FREQS:
                continue  # read into the config's rope scaling
            name = family.gguf_name(t.name)
            if name is None:
                raise ModelLoadError(f"{self.path}: unsupported tensor {t.name!r} for "
                                     f"the {family.name} family")
            qtype = gguf.GGMLQuantizationType(t.qtype)
            if self.keep_mxfp4 and qtype.name == "MXFP4" and _stacked_experts(t.name):
                w = MXFP4Weight.from_ggml(t.data)  # (a rank's slice: views of its blocks)
                pieces = slice_of and slice_of(name)
                yield name, w.pieces(pieces) if pieces else w
                continue
            pieces = slice_of and slice_of(name)
            pieces = family.gguf_pieces(name, pieces, cfg) if pieces else [None]
            arrs = [self._dequantized(t, qtype, piece) for piece in pieces]
            arr = arrs[0] if len(arrs) == 1 else np.concatenate(arrs, axis=pieces[0][0])
            # Whole heads of rows (also when sliced): un-permuted head by head.
            arr = family.from_gguf(name, arr, cfg, t.shape[0])
            yield name, torch.from_numpy(np.ascontiguousarray(arr))

    def _dequantized(self, t, qtype, piece: tuple[int, int, int] | None) -> np.ndarray:
        """Tensor t (or the piece (dim, start, end) of it) as fp32; only that part is
        dequantised."""
        import gguf

        data, shape, part = t.data, t.shape, None
        if piece is not None:
            data, shape, part = _slice_raw(t, qtype, *piece)
        fast = dequant.dequantize(data, qtype.name)  # torch, for the common types
        if fast is not None:
            arr = fast.numpy().reshape(shape)
        else:
            try:
                arr = gguf.quants.dequantize(data, qtype)
            except NotImplementedError as e:
                raise ModelLoadError(f"{self.path}: tensor {t.name} has unsupported type "
                                     f"{qtype.name}") from e
            arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        if part is not None:  # a range of the last dim not on quantisation block boundaries
            arr = np.ascontiguousarray(arr[..., part[1]:part[2]])
        if not arr.flags.writeable:  # a view of the memory-mapped file
            arr = arr.copy()
        return arr


def _stacked_experts(name: str) -> bool:
    """A GGUF tensor of a layer's stacked routed experts (llama.cpp's ffn_*_exps weights)."""
    return name.startswith("blk.") and name.endswith("_exps.weight")


def _gguf_type_name(qtype: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def _gguf_int4(name: str) -> bool:
    """A block type of 5 bits or fewer a weight (the IQ and ternary ones included)."""
    return name in GGUF_INT4 or name.startswith(("IQ", "TQ"))


def _gguf_file_type(value) -> str | None:
    """general.file_type as llama.cpp names it ("Q4_K_M", "F16"), None when absent."""
    import gguf

    if value is None:
        return None
    try:
        name = gguf.LlamaFileType(int(value)).name
    except ValueError:
        return f"file type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _percent(share: float) -> str:
    return "<1%" if 0 < share < 0.005 else f"{share:.0%}"


def _slice_raw(t, qtype, dim: int, start: int, end: int):
    """A GGUF tensor's raw data cut to [start, end) along dim before dequantising: (data,
    shape, None), or, for a range of the last dim (within quantised rows) off the block grid,
    (whole data, whole shape, the cut still to make after dequantising). The raw data has
    the tensor's dims but the last, which holds the row's blocks for a quantised type."""
    import gguf

    shape = list(t.shape)
    shape[dim] = end - start
    last = len(shape) - 1
    if dim < last or t.data.dtype != np.uint8:  # whole rows, or F32 / F16 values
        index = (slice(None),) * dim + (slice(start, end),)
        return t.data[index], tuple(shape), None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if start % block or end % block:
        return t.data, t.shape, (dim, start, end)
    return (t.data[..., start // block * type_size:end // block * type_size], tuple(shape),
            None)


class HFCheckpoint:
    """A Hugging Face model directory: config.json, *.safetensors, tokenizer files. A
    quantised one (AWQ, GPTQ, compressed-tensors) yields its linear layers unpacked to
    dense weights (servelm.models.hf_quant)."""

    def __init__(self, path: str):
        self.path = path
        self._quant: tuple[hf_quant.HFQuant | None] | None = None
        # MXFP4 experts (gpt-oss: quant_method mxfp4): yielded as MXFP4Weight where
        # keep_mxfp4 is set (the engine's choice), else dequantised as they are read.
        self._mxfp4 = False
        self.keep_mxfp4 = False

    def mxfp4_experts(self) -> bool:
        """Whether the checkpoint's experts are MXFP4 (quantization_config mxfp4)."""
        self.quantization()
        return self._mxfp4

    def quantization(self) -> hf_quant.HFQuant | None:
        """config.json's quantization_config, read once; ModelLoadError for a method servelm
        does not load."""
        if self._quant is None:
            cfg_path = os.path.join(self.path, "config.json")
            try:
                with open(cfg_path) as f:
                    raw = json.load(f)
                self._mxfp4 = _quant_method(raw) == "mxfp4"
                self._quant = (None if self._mxfp4 else hf_quant.read_quant_config(raw),)
            except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
                raise ModelLoadError(f"{cfg_path}: {e}") from e
        return self._quant[0]

    def native_quantization(self) -> tuple[str | None, str]:
        """The weight format to run this checkpoint in by default (None: the activation
        dtype) and a line for the log: AWQ / GPTQ / compressed-tensors up to 4 bits -> int4,
        8 bits -> int8; unquantised -> None."""
        quant = self.quantization()
        if self._mxfp4:  # the experts' own format, whatever the other layers'
            return None, "Hugging Face safetensors (MXFP4 experts): unquantised weights"
        if quant is None:
            return None, "Hugging Face safetensors: unquantised weights"
        return quant.native()

    def config(self) -> ModelConfig:
        try:
            text = self._text_config()
            return (ModelConfig.from_hf_dict(text) if text is not None
                    else ModelConfig.from_hf_dir(self.path))
        except (KeyError, ValueError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{os.path.join(self.path, 'config.json')}: {e}") from e

    def _text_config(self) -> dict[str, Any] | None:
        """A multimodal checkpoint's text model config (its family's hf_text_config, e.g.
        Llama4ForConditionalGeneration's text_config), or None for a text model's own."""
        with open(os.path.join(self.path, "config.json")) as f:
            raw = json.load(f)
        if not raw.get("text_config"):
            return None
        return family_for_architecture((raw.get("architectures") or [""])[0]).hf_text_config(raw)

    def tokenizer(self):
        from servelm.tokenizer import Tokenizer

        return Tokenizer.from_dir(self.path)

    def weights(self, cfg: ModelConfig, slice_of: SliceOf | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """One tensor at a time, so peak memory stays near the model's own size.

        slice_of (tensor parallelism): HF name -> the (dim, start, end) pieces to read,
        joined in order."""
        from safetensors import safe_open

        quant = self.quantization()
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        names = []
        for f in files:
            with safe_open(f, framework="pt") as st:
                names += [(f, k) for k in st.keys()]
        file_of = {k: f for f, k in names}
        layers, skip = hf_quant.quantised_layers(quant, list(file_of)) if quant else ({}, set())
        layer_of = {name: prefix for prefix, parts in layers.items() for name in parts.values()}
        handles: dict[str, Any] = {}
        # A multimodal checkpoint's other towers (its family's hf_ignored): not read.
        ignored = getattr(family_for_architecture(cfg.architecture), "hf_ignored", None)

        def handle(f: str):
            if f not in handles:
                handles[f] = safe_open(f, framework="pt")
            return handles[f]

        for f, key in tqdm(names, desc="loading weights", unit="tensor", file=sys.stderr,
                           disable=None, leave=False):
            if key in skip or (ignored and ignored(key)):
                continue
            mx = self._mxfp4 and key.endswith(("_blocks", "_scales"))
            base = key[:-len("_blocks")] if mx else key
            if mx and base + "_blocks" in file_of and base + "_scales" in file_of:
                if key.endswith("_blocks"):  # the pair at its blocks; its scales skipped
                    blocks = handle(f).get_tensor(key)
                    scales = handle(file_of[base + "_scales"]).get_tensor(base + "_scales")
                    yield base, (self._mxfp4_kept(blocks, scales, base, slice_of)
                                 if self.keep_mxfp4
                                 else self._mxfp4_dense(blocks, scales, base, slice_of))
                continue
            prefix = layer_of.get(key)
            if prefix is not None:  # a packed layer: all its parts at its first one
                members = layers.pop(prefix, None)
                if members is not None:
                    tensors = {part: handle(file_of[name]).get_tensor(name)
                               for part, name in members.items()}
                    yield self._dense(quant, prefix, tensors, slice_of)
                continue
            pieces = slice_of and slice_of(key)
            if pieces is None:
                yield key, handle(f).get_tensor(key)
            else:
                sl = handle(f).get_slice(key)
                parts = [sl[(slice(None),) * dim + (slice(start, end),)]
                         for dim, start, end in pieces]
                yield key, parts[0] if len(parts) == 1 else torch.cat(parts, pieces[0][0])

    @staticmethod
    def _mxfp4_kept(blocks: torch.Tensor, scales: torch.Tensor, name: str,
                    slice_of: SliceOf | None) -> MXFP4Weight:
        """An MXFP4 tensor as it is, or a tensor-parallel rank's slice of it: the slicing
        rules speak of the dense form [..., in, out]; the blocks are [..., out, in]."""
        w = MXFP4Weight.from_hf(blocks, scales)
        pieces = slice_of and slice_of(name)
        if not pieces:
            return w
        nd = len(w.shape)
        swap = {nd - 2: nd - 1, nd - 1: nd - 2}
        return w.pieces([(swap.get(dim % nd, dim), a, b) for dim, a, b in pieces])

    @staticmethod
    def _mxfp4_dense(blocks: torch.Tensor, scales: torch.Tensor, name: str,
                     slice_of: SliceOf | None) -> torch.Tensor:
        """An MXFP4 tensor's values (dequant.mxfp4_hf: [..., out, in], exact, bf16) in the
        layout of the checkpoint's dense form, [..., in, out], as transformers loads it."""
        weight = dequant.mxfp4_hf(blocks, scales).transpose(-1, -2)
        pieces = slice_of and slice_of(name)
        if pieces:
            weight = torch.cat([weight.narrow(dim, start, end - start)
                                for dim, start, end in pieces], pieces[0][0])
        return weight

    @staticmethod
    def _dense(quant: hf_quant.HFQuant, prefix: str, parts: dict[str, torch.Tensor],
               slice_of: SliceOf | None) -> tuple[str, torch.Tensor]:
        """A packed layer's tensors (by part name) -> its dense weight (fp32, exact), named
        "<prefix>.weight"; sliced after unpacking under tensor parallelism."""
        try:
            weight = hf_quant.dense_weight(quant, parts)
        except KeyError as e:
            raise ValueError(f"quantised layer {prefix} has no {e.args[0]!r} tensor") from e
        except ValueError as e:
            raise ValueError(f"quantised layer {prefix}: {e}") from e
        name = f"{prefix}.weight"
        pieces = slice_of and slice_of(name)
        if pieces:
            weight = torch.cat([weight.narrow(dim, start, end - start)
                                for dim, start, end in pieces], pieces[0][0])
        return name, weight


def _quant_method(cfg: dict[str, Any]) -> str:
    q = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    return str(q.get("quant_method", "")).lower()


Checkpoint = GGUFFile | HFCheckpoint
SliceOf = Callable[[str], "list[tuple[int, int, int]] | None"]


def open_checkpoint(model: str | None) -> Checkpoint:
    """Resolve the path (None: the embedded model) and open it; one read of GGUF metadata."""
    path = resolve_model_path(model)
    return HFCheckpoint(path) if os.path.isdir(path) else GGUFFile(path)


def _materialise(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Every meta parameter and buffer of `model` allocated on `device`, floating ones in
    `dtype` (what to_empty(device).to(dtype) gives, without the fp32 copy first, and without
    empty_like's meta decomposition, whose first call imports sympy: a second of start-up).
    A tensor shared by two modules stays shared."""
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (meta tensor, new)

    def new(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            out = torch.empty(t.shape, device=device,
                              dtype=dtype if t.is_floating_point() else t.dtype)
            if isinstance(t, torch.nn.Parameter):
                out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
            memo[id(t)] = (t, out)
        return memo[id(t)][1]

    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = new(t)


def get_model_class(architecture: str) -> type[torch.nn.Module]:
    """The module class for an architecture (one generic decoder); ValueError if unknown."""
    from servelm.models.decoder import CausalLM

    family_for_architecture(architecture)
    return CausalLM


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                shard=None) -> torch.nn.Module:
    """The registered class for cfg on `device`, its weights allocated but not filled.

    Built on the meta device (no time spent on a random initialisation the weights
    overwrite); shard (tensor parallelism) swaps in this rank's 1/N modules first. Raises
    ValueError for an unknown architecture."""
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg, max_positions)
        if shard is not None:
            model = shard.apply(model)
    _materialise(model, device, dtype)
    model.init_rotary(device)  # buffers in no checkpoint, computed (meta held none)
    return model


def load_model(ckpt: Checkpoint, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, shard=None) -> torch.nn.Module:
    """Build the registered class for the checkpoint and fill its weights.

    shard (tensor parallelism, servelm.distributed.sharding.Shard): swaps the freshly built
    modules for this rank's 1/N versions and reads only this rank's part of each tensor."""
    try:
        get_model_class(cfg.architecture)
    except ValueError as e:
        raise ModelLoadError(f"{ckpt.path}: {e}") from e
    model = build_model(cfg, dtype, device, max_positions, shard)
    if ckpt.keep_mxfp4:  # the weights yield MXFP4 experts as they are
        from servelm.models.moe import SparseMoE

        for m in model.modules():
            if isinstance(m, SparseMoE):
                m.to_mxfp4()
    try:
        family = model.family
        model.load_weights(ckpt.weights(cfg) if shard is None else ckpt.weights(
            cfg, shard.slicer(family.shard_rules + (() if isinstance(ckpt, GGUFFile)
                                                    else family.hf_shard_rules))))
    except ModelLoadError:
        raise  # already names the file
    except ValueError as e:
        raise ModelLoadError(f"{ckpt.path}: {e}") from e
    if shard is not None:  # (row-parallel biases: rank 0's alone)
        shard.finish(model)
    return model.eval()
