"""servelm's GGUF reader against the gguf package's own reader on the embedded model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from servelm.models.gguf_file import GGUFReader


@pytest.fixture(scope="module")
def readers(gguf_path):
    gguf = pytest.importorskip("gguf")
    return GGUFReader(gguf_path), gguf.GGUFReader(gguf_path)


def test_metadata_equals_the_reference_reader(readers):
    ours, ref = readers
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert sorted(ours.metadata) == sorted(keys)
    for k in keys:
        want = ref.fields[k].contents()
        got = ours.metadata[k]
        if isinstance(want, float):
            assert got == pytest.approx(want), k
        else:
            assert got == want, k


def test_tensors_equal_the_reference_reader(readers):
    import gguf

    ours, ref = readers
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.qtype == b.tensor_type and a.shape == tuple(int(x) for x in reversed(b.shape))
    for i in (0, 1, 2, len(ref.tensors) - 1):  # Q8_0, F32, Q4_1, ...
        a, b = ours.tensors[i], ref.tensors[i]
        np.testing.assert_array_equal(
            gguf.quants.dequantize(a.data, b.tensor_type).reshape(a.shape),
            gguf.quants.dequantize(b.data, b.tensor_type).reshape(a.shape))


def test_truncated_file_is_a_clear_error(tmp_path, gguf_path):
    from servelm.models.loader import GGUFFile, ModelLoadError

    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        cut.write_bytes(f.read(5000))
    with pytest.raises(ModelLoadError, match=f"{cut}: cannot read GGUF file"):
        GGUFFile(str(cut))


def test_a_file_is_parsed_once_while_unchanged_and_again_when_rewritten(tmp_path, gguf_path):
    """read_gguf keeps the last few files' parsed headers, by identity (inode, size,
    modification time): the same file gives the same reader; a file written again, even at
    the same path, is parsed again. The tokenizer built from a kept header is shared, each
    caller holding its own copy (its chat template its own)."""
    import os
    import shutil

    from servelm.models.paths import read_gguf
    from servelm.tokenizer import gguf_tokenizer

    path = tmp_path / "m.gguf"
    shutil.copyfile(gguf_path, path)
    first = read_gguf(str(path))
    assert read_gguf(str(path)) is first
    a, b = (gguf_tokenizer(str(path), first.metadata) for _ in range(2))
    assert a is not b and a._backend is b._backend
    a.chat_template = "{{ messages[0]['content'] }}"
    assert b.chat_template != a.chat_template
    assert gguf_tokenizer(str(path), first.metadata).chat_template == b.chat_template
    shutil.copyfile(gguf_path, path)  # written again: same bytes, a new modification time
    os.utime(path, ns=(1, 1))
    again = read_gguf(str(path))
    assert again is not first and again.metadata == first.metadata
    assert gguf_tokenizer(str(path), again.metadata)._backend is not a._backend


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
                                       "Q6_K", "F16", "BF16"])
def test_torch_dequantisation_is_gguf_pys_bit_for_bit(type_name, kernels):
    """Random blocks (every bit pattern of scales and quants, NaN/inf scales included)
    dequantised by servelm.models.dequant (its torch functions, and its C++ op where built)
    and by gguf-py's numpy reference."""
    import gguf

    from servelm.models import dequant

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, size=(3, 40 * size), dtype=np.uint8)
    ref = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(-1)
    got = dequant.dequantize(raw, type_name, kernels=kernels).numpy()
    assert got.shape == ref.shape == (3 * 40 * block,)
    assert np.array_equal(got, ref, equal_nan=True)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_q5_dequantisation_in_chunks_is_gguf_pys(type_name, monkeypatch):
    """Q5_0/Q5_1 run a chunk of blocks at a time: chunks of 7 over 120 blocks (the last one
    partial) give gguf-py's values too."""
    import gguf

    from servelm.models import dequant

    monkeypatch.setattr(dequant, "_Q5_CHUNK", 7)
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(1).integers(0, 256, size=(4, 30 * size), dtype=np.uint8)
    ref = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(-1)
    assert np.array_equal(dequant.dequantize(raw, type_name).numpy(), ref, equal_nan=True)


def test_torch_dequantisation_of_the_embedded_model_is_gguf_pys(gguf_path):
    import gguf

    from servelm.models import dequant

    seen = set()
    for t in GGUFReader(gguf_path).tensors[:40]:
        qtype = gguf.GGMLQuantizationType(t.qtype)
        ref = np.asarray(gguf.quants.dequantize(t.data, qtype), dtype=np.float32).reshape(-1)
        assert np.array_equal(dequant.dequantize(t.data, qtype.name).numpy(), ref), t.name
        seen.add(qtype.name)
    assert {"Q4_1", "Q8_0", "F32"} <= seen
    assert dequant.dequantize(np.zeros(10, np.uint8), "IQ2_XXS") is None  # gguf-py's then


def test_the_dequantisation_op_refuses_bad_blocks_by_name():
    from servelm.kernels import load_ops

    if not load_ops("gguf_dequant"):
        pytest.skip("C++ kernels not built here")
    op = torch.ops.servelm_gguf_dequant.dequantize
    with pytest.raises(RuntimeError, match="unknown block type IQ2_XXS"):
        op(torch.zeros(2, 66, dtype=torch.uint8), "IQ2_XXS")
    with pytest.raises(RuntimeError, match=r"blocks must be contiguous uint8 \[n, 144\] for Q4_K"):
        op(torch.zeros(2, 143, dtype=torch.uint8), "Q4_K")
