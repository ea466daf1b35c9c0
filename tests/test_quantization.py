"""Weight-only int8 / int4: formats, C++ kernels against PyTorch, the module swap, the
engine end to end, and quality against fp32 (KL divergence and perplexity on a shipped text)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from servelm import quantization as Q
from servelm.quantization import formats as QF
from servelm.quantization import numerics as QN
from servelm.layers.stack import kernel_weights
from servelm.roofline import quantized_bits_per_weight
from servelm.config import EngineConfig
from servelm.sampling_params import SamplingParams
from servelm.engine.model_runner import SeqInput, build_forward_batch

TEXT = (Path(__file__).parent / "data" / "prose.txt").read_text()

needs_kernels = pytest.mark.skipif(not Q.kernels_available(),
                                   reason="servelm C++ quant kernels not built here")


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


# ---------------------------------------------------------------- formats

def test_int8_roundtrip():
    w = torch.randn(40, 96)
    q, s = Q.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (40,)
    err = (Q.dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_roundtrip_and_packing(group):
    torch.manual_seed(0)
    w = torch.randn(24, 256)  # 24 rows: two tiles of 16, the second padded
    q, s, m = Q.quantize_int4(w, group)
    assert q.shape == (2, 8 * 256) and q.dtype == torch.uint8
    assert s.shape == m.shape == (2, 256 // group, 16) and s.dtype == torch.float16
    codes = Q.unpack_int4(q, 24)
    assert codes.shape == (24, 256) and int(codes.max()) <= 15
    # Tiled layout: block b of tile t is 32 uint16 lanes L = 2r + e; nibble j = q[16t+r, 8b+2j+e].
    lanes = q.reshape(2, 32, 32, 2).to(torch.int32)
    lane = lanes[..., 0] | (lanes[..., 1] << 8)  # t, b, L
    for t, b, r, e, j in [(0, 0, 0, 0, 0), (0, 3, 5, 1, 2), (1, 31, 7, 1, 3), (1, 2, 3, 0, 1)]:
        assert (lane[t, b, 2 * r + e] >> (4 * j)) & 15 == codes[16 * t + r, 8 * b + 2 * j + e]
    assert torch.equal(QN._pack_tiles(Q.unpack_int4(q).to(torch.int32)), q)
    err = (Q.dequantize_int4(q, s, m, group, 24) - w).abs().reshape(24, -1, group)
    sc = s.float().transpose(1, 2).reshape(32, -1)[:24]
    assert (err <= sc[..., None] * 0.51 + 1e-3).all()


def test_int8_packing_roundtrip():
    q, s = Q.quantize_int8(torch.randn(21, 36))
    p, ps = Q.pack_int8(q, s)
    assert p.shape == (2, 16 * 36) and ps.shape == (32,)
    assert torch.equal(Q.unpack_int8(p, 21), q)


def test_int4_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible by group_size"):
        Q.quantize_int4(torch.randn(8, 100), 32)
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize_int4(torch.randn(8, 128), 48)


# ---------------------------------------------------------------- kernels vs reference

SHAPES = [(960, 576), (576, 1536), (33, 64), (7, 96)]


@needs_kernels
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 7, 40, 47, 48, 77])
def test_int4_kernel_matches_reference(n, k, dtype, rows):
    torch.manual_seed(n + k + rows)
    w, bias = torch.randn(n, k) * 0.05, torch.randn(n)
    for group in (32, 64):
        if k % group:
            continue
        q, s, m = Q.quantize_int4(w, group)
        x = torch.randn(rows, k).to(dtype)
        ref = x.float() @ Q.dequantize_int4(q, s, m, group, n).T + bias
        y = torch.ops.servelm_quant.int4_linear(x, q, s, m, group, n, bias)
        assert y.dtype == dtype and y.shape == (rows, n)
        # fp32: bf16 hi+lo split of the activations; bf16: the output's own rounding.
        assert _rel_err(y, ref) < (2e-4 if dtype == torch.float32 else 1e-2)


@needs_kernels
@pytest.mark.parametrize("n,k", SHAPES + [(10, 68), (7, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 23, 24, 40, 77])
def test_int8_kernel_matches_reference(n, k, dtype, rows):
    torch.manual_seed(n + k + rows)
    w, bias = torch.randn(n, k) * 0.05, torch.randn(n)
    q, s = Q.quantize_int8(w)
    x = torch.randn(rows, k).to(dtype)
    ref = x.float() @ Q.dequantize_int8(q, s).T + bias
    p, ps = Q.pack_int8(q, s)
    y = torch.ops.servelm_quant.int8_linear(x, p, ps, n, bias)
    assert y.dtype == dtype and y.shape == (rows, n)
    # fp32: the nibble decode's +128 offsets cost a little cancellation (~1e-4).
    assert _rel_err(y, ref) < (5e-4 if dtype == torch.float32 else 1e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES + [(10, 68), (7, 20), (49, 2)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 40, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_kernels_match_reference(dtype, n, k, rows, bias):
    """bf16/fp32 weights in the kernels' tiles: streamed below 8 rows (1 to 4 rows a pass),
    the GEMM micro-kernel over pairs of tiles from 8 (an odd tile count leaves one alone)."""
    torch.manual_seed(n + k + rows)
    w = (torch.randn(n, k) * 0.05).to(dtype)
    b = torch.randn(n) if bias else None
    op = Q.TILE_OPS[dtype]
    tiles = Q.pack_tiles(w)
    assert tiles.dtype == dtype and tiles.shape == (-(-n // 16), 16 * k)
    assert torch.equal(Q.unpack_tiles(tiles, n), w)
    x = torch.randn(rows, k).to(dtype)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    y = getattr(torch.ops.servelm_quant, op)(x, tiles, n, b)
    assert y.dtype == dtype and y.shape == (rows, n)
    # bf16: the output's own rounding; fp32: summation order.
    assert _rel_err(y, ref.float()) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    # A row's result does not depend on the rows around it, within a kernel (<8 / >=8 rows).
    if rows in (5, 40):
        torch.testing.assert_close(getattr(torch.ops.servelm_quant, op)(x[:rows - 1], tiles, n, b),
                                   y[:rows - 1], rtol=0, atol=0)


@needs_kernels
def test_tiled_kernels_and_layer_reject_or_route_what_they_cannot_take():
    tiles = Q.pack_tiles(torch.randn(16, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16 activations"):
        torch.ops.servelm_quant.bf16_linear(torch.randn(1, 64), tiles, 16, None)
    with pytest.raises(RuntimeError, match="tiled layout"):
        torch.ops.servelm_quant.bf16_linear(torch.randn(1, 32).bfloat16(), tiles, 16, None)
    with pytest.raises(RuntimeError, match="needs K \\(in_features\\) even"):
        torch.ops.servelm_quant.bf16_linear(torch.randn(1, 63).bfloat16(),
                                            torch.zeros(16 * 63, dtype=torch.bfloat16), 16, None)
    f32 = Q.pack_tiles(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="float32 activations"):
        torch.ops.servelm_quant.f32_linear(torch.randn(1, 64).bfloat16(), f32, 16, None)
    with pytest.raises(RuntimeError, match="tiled layout"):
        torch.ops.servelm_quant.f32_linear(torch.randn(1, 32), f32, 16, None)
    with pytest.raises(TypeError, match="bfloat16 or float32 weights"):
        Q.TiledLinear(torch.randn(16, 64).half())
    # The layer: activations of its dtype on the kernel, others on F.linear of its weight.
    lin = _linear(40, 64, True).bfloat16()
    layer = Q.TiledLinear.from_linear(lin)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, lin.weight.float(), lin.bias.float()))
    assert kernel_weights(layer) == ([layer.qweight], -1)
    assert kernel_weights(Q.TiledLinear.from_linear(_linear(40, 64, True))) is None  # fp32
    layer.use_kernel = False  # as KernelConfig(cpu_kernels=False) has it: PyTorch, off the stack
    assert kernel_weights(layer) is None
    xb = x.bfloat16()
    torch.testing.assert_close(layer(xb), F.linear(xb, lin.weight, lin.bias))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiles_method_swaps_every_layer_it_applies_to(dtype):
    from servelm.config import KernelConfig
    from servelm.tuning import finalize_linears

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.o_proj = nn.Linear(16, 16)
            self.down_proj = nn.Linear(15, 16)  # odd in_features: bf16 cannot tile it
            self.lm_head = nn.Linear(16, 50, bias=False)
            self.lm_head.weight = self.embed.weight

    m = Block().to(dtype)
    x = torch.randn(2, 15).to(dtype)
    want = m.down_proj(x)
    finalize_linears(m, None, KernelConfig(linear_method="tiles"))
    assert isinstance(m.o_proj, Q.TiledLinear) and isinstance(m.lm_head, Q.TiledLinear)
    assert isinstance(m.down_proj, Q.TiledLinear) == (dtype == torch.float32)
    assert isinstance(m.embed.weight, nn.Parameter)  # the tied embedding keeps its weight
    assert _rel_err(m.down_proj(x), want.float()) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    half = Block().half()  # no tiled kernel for fp16: the default method instead
    finalize_linears(half, None, KernelConfig(linear_method="tiles"))
    assert not isinstance(half.o_proj, Q.TiledLinear)


@needs_kernels
def test_kernel_rejects_unsupported_shapes():
    q = torch.zeros(1, 16 * 70, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="divisible by 4"):
        torch.ops.servelm_quant.int8_linear(torch.randn(1, 70), q, torch.ones(16), 16, None)
    s = torch.ones(1, 3, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.servelm_quant.int4_linear(
            torch.randn(1, 96), torch.zeros(1, 768, dtype=torch.uint8), s, s, 48, 16, None)


# ---------------------------------------------------------------- modules, fallback

def _linear(n, k, bias):
    torch.manual_seed(n * k)
    lin = nn.Linear(k, n, bias=bias)
    lin.weight.data.mul_(0.1)
    return lin.requires_grad_(False)


@pytest.mark.parametrize("method", ["int8", "int8-rowmajor", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 40])
def test_module_kernel_and_fallback_agree(method, dtype, rows, monkeypatch):
    lin = _linear(200, 256, bias=True)
    if method == "int8-rowmajor":  # the layout for PyTorch's _weight_int8pack_mm
        qlin = Q.Int8Linear(*Q.quantize_int8(lin.weight), lin.bias, tiled=False)
    else:
        qlin = Q.quantize_linear(lin, method)
    x = torch.randn(2, rows, 256).to(dtype)  # leading dims are kept
    ref = F.linear(x.float(), qlin.dequantize(torch.float32), qlin.bias.float())
    y_fast = qlin(x)
    qlin.use_kernel = False
    y_slow = qlin(x)
    for y in (y_fast, y_slow):
        assert y.shape == (2, rows, 200) and y.dtype == dtype
        assert _rel_err(y, ref) < (1e-4 if dtype == torch.float32 else 2e-2)


def test_kernels_off_by_config_run_pytorch():
    """use_kernel False (KernelConfig(cpu_kernels=False) asks quantize_model for it): the
    PyTorch path, and int8 in row-major layout rather than the kernels' tiles."""
    qlin = Q.quantize_linear(_linear(64, 128, bias=False), "int4", use_kernel=False)
    assert not qlin.use_kernel
    assert not Q.quantize_linear(_linear(64, 128, bias=False), "int8", use_kernel=False).tiled
    x = torch.randn(1, 128)
    torch.testing.assert_close(qlin(x), x @ qlin.dequantize().T, rtol=1e-4, atol=1e-4)


def test_each_layer_chooses_its_path_once():
    """A weight-format layer binds the path its state calls for when it is built, and again
    only when that state changes (use_kernel set, the module moved); forward runs the bound
    path and nothing else."""
    lin = _linear(64, 128, bias=True)
    kernel = "kernel" if Q.kernels_available() else "dequantise"
    int4, int8 = Q.quantize_linear(lin, "int4"), Q.quantize_linear(lin, "int8")
    assert int4.path == kernel and int8.path == kernel
    assert Q.Int8Linear(*Q.quantize_int8(lin.weight), lin.bias, tiled=False).path == "int8pack"
    # PyTorch's int8pack matmul is wrong unless in_features is a multiple of 16: not taken.
    odd = _linear(64, 24, bias=False)
    row_major = Q.Int8Linear(*Q.quantize_int8(odd.weight), tiled=False)
    assert row_major.path == "dequantise"
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    torch.testing.assert_close(row_major(x).float(), x.float() @ row_major.dequantize().T,
                               rtol=0.02, atol=0.02)
    assert Q.TiledLinear.from_linear(lin).path == kernel
    int4.use_kernel = False
    assert int4.path == "dequantise"
    int4.use_kernel = Q.kernels_available()
    assert int4.path == kernel
    assert int8.to("meta").path == "dequantise"  # no kernel runs on that device
    seen = []
    int4._path = lambda layer, x: seen.append(tuple(x.shape)) or x[..., :64]
    assert int4(torch.randn(2, 128)).shape == (2, 64) and seen == [(2, 128)]


def test_float16_activations():
    qlin = Q.quantize_linear(_linear(64, 128, bias=False), "int4")
    x = torch.randn(3, 128)
    y = qlin(x.half())
    assert y.dtype == torch.float16
    assert _rel_err(y, x @ qlin.dequantize().T) < 1e-2


# ---------------------------------------------------------------- CUDA layouts

@pytest.mark.parametrize("group", [32, 128])
def test_tinygemm_operands_hold_the_same_weights(group):
    """Our int4 groups in the layout of PyTorch's CUDA tinygemm (w = s (q - 8) + z, bf16
    scales and zeros): the same weights to bf16 rounding of the scales, nibble order as
    its convention (element 2i in the high nibble of byte i)."""
    torch.manual_seed(1)
    w = torch.randn(40, 256)
    q, s, m = Q.quantize_int4(w, group)
    codes = Q.unpack_int4(q, 40)
    nibbles, sz = Q.tinygemm_operands(Q.unpack_int4(q), s, m, group, 40)
    assert nibbles.shape == (40, 128) and nibbles.dtype == torch.uint8
    assert sz.shape == (256 // group, 40, 2) and sz.dtype == torch.bfloat16
    assert int(nibbles[3, 5]) == int(codes[3, 10]) << 4 | int(codes[3, 11])
    ref = Q.dequantize_int4(q, s, m, group, 40)
    got = Q.dequantize_tinygemm(nibbles, sz, group)
    assert _rel_err(got, ref) < 1e-2


def test_cuda_kernel_probes_accept_a_right_kernel_and_refuse_a_failing_one(monkeypatch):
    """The probes that decide whether a CUDA kernel is used run it on a known case: the
    Triton int4 dequantisation's passes (here in Triton's interpreter when no GPU is), and
    a probe that fails leaves the kernel unused."""
    monkeypatch.setattr(QF, "_cuda_ops", {})
    from servelm.kernels import triton_quant
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert QF._cuda_triton_dequant_works(dev) is triton_quant.available()

    def wrong():
        raise RuntimeError("disagrees")
    assert QF._cuda_op_works("wrong", wrong) is False
    assert QF._cuda_ops == {"int4-triton-dequant": triton_quant.available(), "wrong": False}


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 16, 32, 33, 200])
def test_cuda_quantized_layers_match_their_weights(method, rows):
    """On CUDA: int4 through tinygemm (up to CUDA_INT4_MAX_ROWS rows, then dequantised by
    the Triton kernel), int8 through the converted weight; against the dequantised weights
    in fp32."""
    lin = _linear(1536, 576, bias=False).cuda()
    qlin = Q.quantize_linear(lin, method)
    if method == "int4":
        assert qlin.tg_weight is not None  # H100/H200 class GPUs run tinygemm
    x = torch.randn(rows, 576, device="cuda").bfloat16()
    ref = F.linear(x.float(), qlin.dequantize(torch.float32))
    y = qlin(x)
    assert y.shape == (rows, 1536) and y.dtype == torch.bfloat16
    assert _rel_err(y, ref) < 2e-2
    if method == "int4" and rows > Q.CUDA_INT4_MAX_ROWS:  # dequantised by the Triton kernel
        assert QF._cuda_ops["int4-triton-dequant"]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_probes_run_before_any_graph_capture(monkeypatch):
    """An int4 or int8 layer built on CUDA asks its kernels' probes then, before any step
    runs; one first asked inside a graph capture, where its copies cannot run, answers no
    without probing or remembering."""
    monkeypatch.setattr(QF, "_cuda_ops", {})
    Q.quantize_linear(_linear(256, 64, False).cuda(), "int4")
    assert QF._cuda_ops == {"int4pack": True, "int4-triton-dequant": True}
    Q.quantize_linear(_linear(256, 64, False).cuda(), "int8")
    assert QF._cuda_ops["int8-triton"] is True
    asked = []
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    with torch.cuda.graph(graph):
        works = QF._cuda_op_works("unasked", lambda: asked.append(1))
        x.add_(1)
    assert works is False and not asked and "unasked" not in QF._cuda_ops


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_quantized_layers_take_inputs_without_rows(method, device):
    """A prompt chunk that samples no token hands the last layer's o_proj and MLP no rows:
    CUDA's int4 and int8 matmuls refuse such an input, the layer returns its empty output."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True).requires_grad_(False).to(device)
    qlin = Q.quantize_linear(lin, method)
    for shape in [(0, 256), (2, 0, 256)]:
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        y = qlin(x)
        assert y.shape == (*shape[:-1], 96) and y.device.type == device
    y = qlin(torch.randn(3, 256, device=device, dtype=torch.bfloat16))  # and rows again
    assert y.shape == (3, 96) and torch.isfinite(y).all()


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 128)
        self.qkv_proj = nn.Linear(128, 192, bias=True)
        self.down_proj = nn.Linear(100, 128, bias=False)  # K=100: int4 (groups of 32) cannot
        self.other = nn.Linear(128, 128)
        self.lm_head = nn.Linear(128, 50, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied


def test_quantize_model_swaps_targets_and_keeps_tied_embedding():
    model = _Tiny().requires_grad_(False)
    emb = model.embed_tokens.weight.detach().clone()
    Q.quantize_model(model, "int4")
    assert isinstance(model.qkv_proj, Q.Int4Linear) and isinstance(model.lm_head, Q.Int4Linear)
    assert isinstance(model.down_proj, Q.Int8Linear)  # kept at 8 bits, not dropped
    assert type(model.other) is nn.Linear
    assert torch.equal(model.embed_tokens.weight, emb)
    assert isinstance(model.embed_tokens.weight, nn.Parameter)
    with pytest.raises(ValueError, match="quantization"):
        Q.quantize_model(_Tiny(), "int3")


def test_config_rejects_unknown_quantization():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="fp8")
    assert EngineConfig(quantization="int4").quantization == "int4"
    # With tensor parallelism each rank quantises its own shard (tests/test_tensor_parallel.py).
    assert EngineConfig(quantization="int8", tensor_parallel_size=2).tensor_parallel_size == 2


# ---------------------------------------------------------------- the engine, quality

def _engine(dtype, quantization, linear_method="auto"):
    from servelm import LLM

    # Tuning off: these engines are about the quantisation's quality and paths, each layer on
    # the untuned default (the kernels' tiles, else qdot); what the tuner picks, and that its
    # picks give the reference tokens, is tests/test_tuning.py's.
    return LLM(dtype=dtype, quantization=quantization, kv_cache_memory=128 << 20,
               linear_method=linear_method, kernel_tuning="off")


@pytest.fixture(scope="module")
def quant_llms():
    return {q: _engine("float32", q) for q in ("int8", "int4")}


@pytest.fixture(scope="module")
def bf16_int4():
    """bf16 activations on int4 weights: the decode-once quality test's and the generation
    test's engine, built once."""
    return _engine("bfloat16", "int4")


@pytest.fixture(scope="module")
def q8act_int4():
    """int4 weights on q8act (activations quantised to int8 per block of 32), bf16 runs."""
    from servelm.layers import q8act

    if not q8act.available():
        pytest.skip("the q8act kernel is not built here (AVX2, FMA, F16C)")
    llm = _engine("bfloat16", "int4", "q8act")
    assert any(isinstance(m, q8act.Int4Q8Linear) for m in llm.engine.executor.model.modules())
    return llm


def all_logits(engine, ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position of one prompt: the runner's batch for it, through the
    model with every position's hidden state kept, then the LM head."""
    bm, runner = engine.block_manager, engine.executor.runner
    bm.allocate("all-logits", len(ids))
    try:
        seq = SeqInput(ids, 0, bm.block_table("all-logits"), True)
        batch, _ = build_forward_batch([seq], runner.kv_cache.block_size,
                                       runner.num_queries_per_kv, runner.device,
                                       runner.attention)
        with torch.inference_mode():
            hidden = engine.executor.model(batch, runner.kv_cache.layers)
            assert hidden.shape[0] == len(ids)
            return engine.executor.model.compute_logits(hidden).float()
    finally:
        bm.free("all-logits")


@pytest.fixture(scope="module")
def reference(llm):
    """The first 256 tokens of TEXT and the fp32 engine's logits at every position, once for
    the module's quality tests: the ratios are close to the whole text's (int4 KL 0.053 vs
    0.055, ppl ratio 1.05 at 512 tokens) at a fraction of the cost of the prompt passes."""
    ids = llm.get_tokenizer().encode(TEXT)[:256]
    return ids, all_logits(llm.engine, ids)


def quality(reference, quant_llms):
    ids, ref = reference
    ref_logp = torch.log_softmax(ref, -1)
    out = {}
    for name, lq in [("fp32", None)] + sorted(quant_llms.items()):
        logits = ref if name == "fp32" else all_logits(lq.engine, ids)
        logp = torch.log_softmax(logits, -1)
        nll = -logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
        out[name] = (kl, math.exp(nll))
    return out


def test_quality_kl_and_perplexity(reference, quant_llms, request):
    from servelm.layers import q8act

    engines = dict(quant_llms)
    if q8act.available():
        # q8act (bf16 runs): int4 weights x activations quantised to int8 per block of 32.
        # Measured on SmolLM2-135M, every layer and the LM head on it: KL to fp32 0.0566
        # against 0.0531 for int4 on the fp32 panels (bf16 activations), 0.053 here (fp32).
        engines["int4 q8act"] = request.getfixturevalue("q8act_int4")
    q = quality(reference, engines)
    print({k: f"KL {kl:.4f} ppl {ppl:.2f}" for k, (kl, ppl) in q.items()})
    kl8, ppl8 = q["int8"]
    kl4, ppl4 = q["int4"]
    ppl32 = q["fp32"][1]
    assert 2 < ppl32 < 40
    assert kl8 < 0.01 and abs(ppl8 / ppl32 - 1) < 0.02
    assert kl4 < 0.1 and 0.98 < ppl4 / ppl32 < 1.12
    if "int4 q8act" in q:  # the int8 activations add little to int4's own error
        klq, pplq = q["int4 q8act"]
        assert klq < kl4 + 0.01 and abs(pplq / ppl4 - 1) < 0.01, q


# A greedy token of the int8-activation path may differ from the bf16 path's only where the
# bf16 path's own logits nearly tie: ours at most this far below its best (a few of the bf16
# logits' rounding steps, 0.125 at the logits' magnitude). Measured on SmolLM2 (int4, w8a8 +
# q8act), teacher-forced over 1,027 tokens of prose: the top-1 differs at 33 positions, where
# the bf16 logits' gap is at most 0.5; a drift is whole units off.
NEAR_TIE = 0.625


@pytest.fixture(scope="module")
def w8a8_int4():
    """int4 weights, bf16 runs: every calibrated layer (qkv, o, gate_up, and down_proj in
    blocks of 32) on w8a8 (int8 activations per block, SmoothQuant-smoothed, int8 weights per
    channel and block), the LM head on its own method: the most of a prompt a tuner can put
    on w8a8 (where q8act measures faster, down_proj stays on it)."""
    from servelm.layers import q8act, w8a8

    if not (q8act.available() and w8a8.available() and w8a8.int8_dot()):
        pytest.skip("the w8a8 method does not run here (no int8 dot product, or no kernel)")
    llm = _engine("bfloat16", "int4", "w8a8")
    downs = [m for n, m in llm.engine.executor.model.named_modules() if n.endswith("down_proj")]
    assert downs and all(isinstance(m, w8a8.W8A8Linear) and m.block == 32 for m in downs)
    return llm


@pytest.fixture(scope="module")
def bf16_plain():
    """bf16 weights and activations on the kernels' tiles: the bf16 model's reference."""
    return _engine("bfloat16", "none")


@pytest.fixture(scope="module")
def w8a8_bf16():
    """bf16 weights, bf16 runs: the calibrated layers (qkv, o, gate_up and down) on w8a8,
    the LM head on the tiles (bf16 activations)."""
    from servelm.layers import w8a8

    if not (w8a8.available() and w8a8.int8_dot()):
        pytest.skip("the w8a8 method does not run here (no AVX-512 VNNI, or no kernel)")
    llm = _engine("bfloat16", "none", "w8a8,tiles")
    downs = [m for n, m in llm.engine.executor.model.named_modules() if n.endswith("down_proj")]
    assert downs and all(isinstance(m, w8a8.W8A8Linear) and m.block == 64 for m in downs)
    return llm


@pytest.mark.parametrize("path,base", [("q8act_int4", "bf16_int4"), ("w8a8_int4", "bf16_int4"),
                                       ("w8a8_bf16", "bf16_plain")])
def test_int8_activations_meet_the_accuracy_bar(reference, path, base, request):
    """The bar an int8-activation path meets to run by default: against the same int4 weights
    with bf16 activations, mean KL of the next-token distribution <= 0.005, perplexity within
    1%, and greedy continuations token for token up to near ties. Measured (512 tokens of
    prose; docs/kernels.md has the table): q8act on every layer and the LM head,
    SmolLM2-135M KL 0.0041, perplexity +0.6%; Qwen2.5-Coder-0.5B (Q4_K_M) 0.0014, +0.2%;
    Gemma-3-270M (Q4_K_M) 0.0037, +0.8%. w8a8 on qkv, o, gate_up and down (in blocks of 32
    on int4 weights, of 64 on bf16 ones), the LM head on its own method: the same bar
    (docs/kernels.md, "w8a8")."""
    from servelm.layers import q8act, w8a8

    llm = request.getfixturevalue(path)
    bf16_int4 = request.getfixturevalue(base)  # the same weights, bf16 activations
    assert not any(isinstance(m, (q8act.Int4Q8Linear, w8a8.W8A8Linear))
                   for m in bf16_int4.engine.executor.model.modules())
    ids = reference[0]
    base = torch.log_softmax(all_logits(bf16_int4.engine, ids), -1)
    ours = torch.log_softmax(all_logits(llm.engine, ids), -1)
    kl = (base.exp() * (base - ours)).sum(-1).mean().item()
    target = torch.tensor(ids[1:])[:, None]
    ppl = [math.exp(-lp[:-1].gather(1, target).mean().item()) for lp in (base, ours)]
    print(f"{path} against bf16 activations: KL {kl:.4f}, perplexity {ppl[1]:.2f} / {ppl[0]:.2f}")
    assert kl <= 0.005 and abs(ppl[1] / ppl[0] - 1) <= 0.01, (kl, ppl)

    tok = llm.get_tokenizer()
    prompts = [ids[:n] for n in (12, 60, 150)] + [
        tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):\n   ")]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    differ = 0
    for p, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        logits = all_logits(bf16_int4.engine, p + got[:-1])[len(p) - 1:]
        gap = logits.max(-1).values - logits.gather(1, torch.tensor(got)[:, None]).squeeze(1)
        assert (gap <= NEAR_TIE).all(), (p[:6], gap.max().item())
        differ += int((gap > 0).sum())
    # A near tie now and then (measured: one token in 24 a prompt, a gap of 0.06-0.25,
    # the bf16 logits' own rounding), not a drift.
    assert differ <= 0.1 * len(prompts) * greedy.max_tokens, differ


def test_bf16_quality_on_block_floating_point(reference):
    # bfp (bf16 runs on AVX2): weights and activations as int16 mantissas sharing an exponent
    # per block of 64, against the same bf16 weights on the fp32-FMA panels. Measured on
    # SmolLM2-135M, every layer and the LM head on each: KL to fp32 0.0010 on both, perplexity
    # 17.50 against 17.52 on the Zen 3 (fp32 17.52). The AVX-512 Xeon, whose attention and
    # norm kernels differ, read KL 0.0010 / 0.0009 and perplexity 17.60 / 17.49: a bf16 run's
    # perplexity moves by about half a percent either way with the kernels around the linear
    # layers, so each is held to fp32's within 1%, and the KL carries the comparison.
    from servelm.layers import bfp, panels

    if not (bfp.available() and panels.available()):
        pytest.skip("the bfp and panels kernels are not built here (AVX2, FMA, F16C)")
    engines = {m: _engine("bfloat16", None, m) for m in ("bfp", "panels")}
    assert isinstance(engines["bfp"].engine.executor.model.lm_head, bfp.BfpLinear)
    # int8 weights in fp32 runs: their codes against 15-bit activation blocks, against the
    # same weights on panels (fp32 FMAs over the dequantised codes): KL 0.0034 on both,
    # perplexity 17.49 on both.
    for m in ("bfp", "panels"):
        engines[f"int8 {m}"] = _engine("float32", "int8", m)
    assert isinstance(engines["int8 bfp"].engine.executor.model.lm_head, bfp.BfpLinear)
    q = quality(reference, engines)
    print({k: f"KL {kl:.4f} ppl {ppl:.2f}" for k, (kl, ppl) in q.items()})
    assert q["panels"][0] < 0.005, q
    assert q["bfp"][0] < 1.5 * q["panels"][0] + 0.0005, q
    for m in ("bfp", "panels"):
        assert abs(q[m][1] / q["fp32"][1] - 1) < 0.01, q
    assert abs(q["int8 bfp"][0] - q["int8 panels"][0]) < 0.0005, q
    assert abs(q["int8 bfp"][1] / q["int8 panels"][1] - 1) < 0.002, q


@needs_kernels
def test_bf16_quality_through_the_decode_once_prompt_path(llm, reference, bf16_int4):
    # bf16 activations over a prompt of hundreds of tokens: the kernels decode each weight
    # tile to bf16 once and multiply every row (>= 48 rows int4, >= 24 int8, >= 8 bf16
    # weights). Measured: KL to fp32 bf16 0.0009, int8 0.0044, int4 0.055 (fp32
    # activations: 0.0035 / 0.055).
    engines = {"int8": _engine("bfloat16", "int8"), "int4": bf16_int4}
    engines["bf16"] = _engine("bfloat16", None, "tiles")  # bf16 weights in the kernels' tiles
    engines["bf16 oneDNN"] = _engine("bfloat16", None, "onednn")
    assert isinstance(engines["bf16"].engine.executor.model.lm_head, Q.TiledLinear)
    assert not isinstance(engines["bf16 oneDNN"].engine.executor.model.lm_head, Q.TiledLinear)
    assert len(llm.get_tokenizer().encode(TEXT)) > 100
    q = quality(reference, engines)
    ppl32 = q["fp32"][1]
    for name in ("bf16", "bf16 oneDNN"):
        assert q[name][0] < 0.005 and abs(q[name][1] / ppl32 - 1) < 0.01, q
    assert q["bf16"][0] < 2 * q["bf16 oneDNN"][0] + 0.001, q
    assert q["int8"][0] < 0.01 and abs(q["int8"][1] / ppl32 - 1) < 0.02
    assert q["int4"][0] < 0.1 and 0.98 < q["int4"][1] / ppl32 < 1.12


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_engine_generates_coherent_text(quant, quant_llms):
    sp = SamplingParams(temperature=0, max_tokens=8)
    out = quant_llms[quant].generate(["The capital of France is"], sp, use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_engine_bf16_int4_generates_and_reports_bits(bf16_int4):
    llm = bf16_int4
    assert llm.engine.shape.weight_bits == quantized_bits_per_weight("int4")
    sp = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["The capital of France is", "The capital of Italy is", "1, 2, 3, 4,",
               "Water boils at", "The capital of Spain is"]
    # Five sequences: the first steps run more rows than the GEMV threshold.
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    assert "Rome" in outs[1].outputs[0].text
