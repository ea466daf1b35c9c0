"""A quantised checkpoint runs in the weight format its file stores, unless asked otherwise:
a GGUF's Q4/Q5/K-quant tensors as int4, Q8_0 as int8 (servelm.engine.resolve_quantization over
the checkpoint's native_quantization); an explicit quantization or dtype wins."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.quantization import Int4Linear, Int8Linear, QuantLinear

KW = dict(kernel_tuning="off", kv_cache_memory=32 << 20, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, buffers and the packed weights
    its layers keep as attributes), each storage counted once."""
    seen, total = set(), 0
    for m in model.modules():
        tensors = [*m._parameters.values(), *m._buffers.values(),
                   *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            try:
                key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            except NotImplementedError:  # an opaque tensor (oneDNN's packed weight)
                key, nbytes = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def linear_kinds(model: torch.nn.Module) -> set[type]:
    """The quantised linear layers' classes (bf16 tiles are not a quantisation)."""
    return {type(m) for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))}


@pytest.fixture(scope="module")
def q8_gguf(gguf_path, tmp_path_factory) -> str:
    """The embedded model (Q4_1) written again with its linear weights in Q8_0 blocks (the
    embedding table F16, norms F32): a real Q8_0 file of a model that generates. Read with
    servelm's reader and dequantised by servelm.models.dequant (gguf-py's values bit for bit,
    tests/test_gguf_file.py; gguf-py's reader and numpy decoding took seconds here); the Q8_0
    blocks are gguf-py's own quantisation."""
    import gguf

    from helpers import add_gguf_metadata
    from servelm.models import dequant
    from servelm.models.gguf_file import GGUFReader

    src = GGUFReader(gguf_path)
    meta = {k: v for k, v in src.metadata.items()
            if not k.startswith("GGUF.") and k not in ("general.architecture",
                                                       "general.file_type")}
    path = tmp_path_factory.mktemp("q8") / "smollm2-135m-q8_0.gguf"
    w = gguf.GGUFWriter(str(path), src.metadata["general.architecture"])
    add_gguf_metadata(w, meta)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in src.tensors:
        qtype = gguf.GGMLQuantizationType(t.qtype)
        values = dequant.dequantize(t.data, qtype.name).numpy().reshape(t.shape)
        if values.ndim == 1:
            w.add_tensor(t.name, values)
        elif t.name == "token_embd.weight":
            w.add_tensor(t.name, values.astype(np.float16))
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(t.name, gguf.quants.quantize(values, q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def q8_llms(q8_gguf):
    """The Q8_0 file as it comes (int8) and dequantised to bf16 by an explicit dtype."""
    return LLM(model=q8_gguf, **KW), LLM(model=q8_gguf, dtype="bfloat16", **KW)


def test_q8_0_file_runs_int8(q8_llms):
    native, bf16 = q8_llms
    eng = native.engine
    assert eng.config.quantization == "int8"
    assert "Q8_0" in eng.weight_format and "int8" in eng.weight_format
    kinds = linear_kinds(eng.executor.model)
    assert kinds and all(issubclass(k, Int8Linear) for k in kinds)
    assert bf16.engine.config.quantization is None and not linear_kinds(bf16.engine.executor.model)
    assert "dequantised to bfloat16" in bf16.engine.weight_format
    # int8 linears: about half the bytes of the bf16 copy (the embedding table is shared).
    assert weight_bytes(eng.executor.model) < 0.75 * weight_bytes(bf16.engine.executor.model)
    # ... and it still answers as the dequantised model does.
    prompt = "The capital of France is"
    a = native.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    b = bf16.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert a[:3] == b[:3]


def test_explicit_quantization_wins(q8_gguf):
    llm = LLM(model=q8_gguf, quantization="int4", **KW)
    assert llm.engine.config.quantization == "int4"
    kinds = linear_kinds(llm.engine.executor.model)
    assert kinds and all(issubclass(k, Int4Linear) for k in kinds)
    none = LLM(model=q8_gguf, quantization="none", **KW)
    assert none.engine.config.quantization is None and not linear_kinds(none.engine.executor.model)
    assert none.engine.weight_format.startswith("dequantised")


def test_embedded_q4_1_model_runs_int4():
    llm = LLM(**KW)
    assert llm.engine.config.quantization == "int4"
    assert llm.engine.weight_format == "GGUF Q4_1 (Q4_1 100%): int4 weights"
    assert llm.engine.shape.weight_bits == 5.0  # the roofline reads int4 groups of 32


def test_qwen_q4_k_m_runs_int4():
    from helpers import real_model

    path = real_model("qwen25-coder-0.5b")
    llm = LLM(model=path, **KW)
    eng = llm.engine
    assert eng.config.quantization == "int4" and "Q4_K_M" in eng.weight_format
    linear = [m for m in eng.executor.model.modules() if isinstance(m, QuantLinear)]
    assert linear and all(isinstance(m, Int4Linear) for m in linear), linear_kinds(eng.executor.model)
    params = sum(m.in_features * m.out_features for m in linear)
    # int4 in groups of 32 with fp16 scales and mins: 5 bits a weight, against bf16's 16.
    packed = weight_bytes(torch.nn.ModuleList(linear))
    assert packed < 0.35 * 2 * params
    out = llm.generate("def fibonacci(n):", GREEDY, use_tqdm=False)[0].outputs[0].text
    assert out.strip()


def test_tokenizer_from_another_checkpoint(gguf_path):
    """--tokenizer: the tokenizer (and template) of another file; one with more tokens than
    the model has rows is refused by name."""
    from helpers import real_model

    same = LLM(tokenizer=gguf_path, **KW)
    assert same.engine.tokenizer.vocab_size == same.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="tokenizer .*qwen.* tokens are more than the model's"):
        LLM(tokenizer=real_model("qwen25-coder-0.5b"), **KW)
