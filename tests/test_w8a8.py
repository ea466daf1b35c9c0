"""The w8a8 linear method (kernels/csrc/w8a8.cpp, servelm/layers/w8a8.py): activations
smoothed (SmoothQuant) and quantised to int8 per block of up to 128 inputs, times per-channel
int8 weights on AVX-512 VNNI; the calibration pass that gives layers their smoothing
(servelm/engine/calibration.py); and how the tuner takes the method. The model-level
accuracy bar is tests/test_quantization.py's."""

import math

import pytest
import torch
from torch import nn

from servelm import quantization as Q
from servelm import tuning
from servelm.config import KernelConfig
from servelm.engine import calibration
from servelm.kernels import triton_quant
from servelm.layers import linear_methods as lm
from servelm.layers import w8a8

runs = pytest.mark.skipif(not (w8a8.available() and w8a8.int8_dot()),
                          reason="the w8a8 kernel needs AVX-512 VNNI")


def _calibrated(n, k, bias=False, fmt="int4", seed=0, outliers=True):
    """A layer with a calibration: channel maxima with a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
        if bias:
            lin.bias.normal_(generator=g)
    src = (Q.Int4Linear.from_linear(lin, 32) if fmt == "int4" else
           Q.Int8Linear.from_linear(lin) if fmt == "int8" else lin.to(torch.bfloat16))
    amax = torch.rand(k, generator=g) + 0.5
    if outliers:
        amax[torch.randperm(k, generator=g)[:3]] *= 40
    setattr(src, w8a8.AMAX, amax)
    return src, amax


def _inputs(rows, amax, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, amax.shape[0], generator=g) * amax / 3).to(dtype)


def test_pack_puts_each_byte_where_the_kernel_reads_it():
    q = torch.randint(-127, 128, (20, 32), dtype=torch.int8)
    p = w8a8.pack(q)
    assert p.shape == (2, 8, 16, 4) and p.dtype == torch.uint8
    # panel 1, inputs 4 * 5 + 2, output 3 of the panel: row 19
    assert int(p[1, 5, 3, 2]) == int(q[19, 22]) + 128
    assert int(p[0, 7, 15, 3]) == int(q[15, 31]) + 128
    assert (p[1, :, 4:] == 128).all()  # the rows past N: zeros


def test_block_size_is_the_largest_dividing_in_features():
    assert [w8a8.block_size(k) for k in (576, 896, 1536, 640, 48, 40)] == [96, 128, 128, 128, 16, 0]
    # a calibration's longest block (down_proj: 64) caps it
    assert [w8a8.block_size(k, 64) for k in (576, 1536, 4864, 48)] == [64, 64, 64, 16]
    src = nn.Linear(1536, 32)
    w8a8.set_calibration(src, torch.ones(1536), 64)
    assert w8a8.layer_block(src) == 64 and w8a8.longest_block(src) == 64
    w8a8.set_calibration(src, torch.ones(1536))
    assert w8a8.layer_block(src) == 128


def test_weights_are_scaled_per_output_channel_and_block():
    """Each block of an output channel's inputs has its own int8 scale (the activations'
    blocks): a block of large weights coarsens its own step, not its neighbours'."""
    w = torch.randn(20, 64, generator=torch.Generator().manual_seed(0)) * 0.01
    w[3, 40] = 5.0  # one large weight in block 2 of row 3
    q, scale = w8a8.quantize_blocks(w, 16)
    assert q.shape == (20, 64) and scale.shape == (20, 4)
    assert scale[3, 2] == pytest.approx(5.0 / 127) and scale[3, :2].max() < 0.001
    deq = (q.float().reshape(20, 4, 16) * scale[..., None]).reshape(20, 64)
    err = (deq - w).abs().reshape(20, 4, 16)
    # each block within half its own step: row 3's first blocks keep their fine one
    assert (err <= scale[..., None] / 2 + 1e-9).all()
    packed = w8a8.pack_scales(scale)
    assert packed.shape == (2, 4, 16)
    assert packed[0, 2, 3] == scale[3, 2] and packed[1, 1, 3] == scale[19, 1]
    assert (packed[1, :, 4:] == 0).all()  # the columns past N
    assert torch.equal(w8a8.unpack_scales(packed, 20), scale)


@runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantisation_is_the_reference_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(9, 192) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
    x[2, 64:128] = 0  # a block of zeros: d = 0, q = 0
    x[3, 5] = 1e3     # one large value dominates its block
    inv = torch.rand(192) + 0.5
    q, d = torch.ops.servelm_w8a8.quantize(x, inv, 64)
    want_q, want_d = w8a8.reference(x, inv, 64)
    assert torch.equal(q, want_q) and torch.equal(d, want_d)
    assert not q[2, 64:128].any() and d[2, 1] == 0
    assert q.abs().max() == 127


def _want(x, mod):
    """The kernel's arithmetic in fp64: the blocks' exact integer sums, scaled."""
    q, d = w8a8.reference(x, mod.inv_scale, mod.block)
    n, k = mod.out_features, mod.in_features
    wq = (mod.weight.permute(0, 2, 1, 3).reshape(-1, k)[:n].to(torch.int64) - 128)
    qb = q.to(torch.int64).reshape(q.shape[0], -1, mod.block)
    wb = wq.reshape(n, -1, mod.block)
    sums = torch.einsum("mbk,nbk->mnb", qb.double(), wb.double())
    ws = w8a8.unpack_scales(mod.weight_scale, n).double()  # [n, blocks]
    y = (sums * d.double()[:, None, :] * ws).sum(-1)
    return y if mod.bias is None else y + mod.bias.double()


@runs
@pytest.mark.parametrize("n,k,bias,fmt", [(40, 48, True, "int8"), (64, 576, False, "int4"),
                                          (20, 256, True, "bfloat16")])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
def test_kernel_is_its_integer_arithmetic(n, k, bias, fmt, rows):
    src, amax = _calibrated(n, k, bias, fmt)
    mod = w8a8.W8A8Linear(src)
    x = _inputs(rows, amax, torch.float32)
    y = mod(x)
    want = _want(x, mod)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    yb = mod(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    wantb = _want(x.bfloat16(), mod)
    assert ((yb.double() - wantb).abs() <= 2 ** -7 * wantb.abs() + 1e-6).all()


@runs
@pytest.mark.skipif(not hasattr(getattr(torch.ops, "servelm_w8a8", None), "linear256"),
                    reason="the 256-bit form builds beside the wide one with AVX-512 VL")
@pytest.mark.parametrize("n,k,bias,fmt,longest", [(40, 48, True, "int8", 128),
                                                  (33, 1536, True, "bfloat16", 64),
                                                  (64, 576, False, "int4", 128)])
def test_the_256_bit_form_gives_the_wide_forms_bits(n, k, bias, fmt, longest):
    """AVX-VNNI's form (two vectors of 8 a panel, 4 rows a call; built here as AVX-512 VL's
    EVEX encoding of the same instruction) computes every value by the same operations:
    the same bits as the wide form at any row count, both dtypes, the last panel partial."""
    src, amax = _calibrated(n, k, bias, fmt)
    w8a8.set_calibration(src, amax, longest)
    mod = w8a8.W8A8Linear(src)
    for rows in (1, 3, 4, 7, 13, 64):
        for dtype in (torch.float32, torch.bfloat16):
            x = _inputs(rows, amax, dtype, seed=rows)
            got = torch.ops.servelm_w8a8.linear256(x, mod.inv_scale, mod.weight, mod.weight_scale,
                                                   mod.block, mod.out_features, mod.bias)
            assert torch.equal(got, mod(x)), (rows, dtype)


def test_avx_vnni_counts_as_an_int8_dot_product(monkeypatch, tmp_path):
    """A CPU with AVX-VNNI and no AVX-512 (its kernel is the 256-bit form) has the int8 dot
    product; one with neither does not."""
    for flags, want in (("fpu avx2 avx_vnni", True), ("fpu avx2 avx512_vnni", True),
                        ("fpu avx2 fma", False)):
        assert _read_with_flags(monkeypatch, tmp_path, flags, w8a8.int8_dot) is want, flags


def _read_with_flags(monkeypatch, tmp_path, flags, probe):
    """probe() (a cached test of the CPU's flags) with /proc/cpuinfo faked to list `flags`."""
    import builtins

    real_open = builtins.open
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(builtins, "open", lambda f, *a, **kw: real_open(
        info if f == "/proc/cpuinfo" else f, *a, **kw))
    probe.cache_clear()
    try:
        return probe()
    finally:
        monkeypatch.setattr(builtins, "open", real_open)
        probe.cache_clear()


def _tile_op(name):
    return getattr(torch.ops.servelm_w8a8, name)


# (n, k, bias, format, longest block): blocks of 128, 96, 64, 32 and 16 (kt 64, 32, 64, 32,
# 16), one panel, an odd panel count, a partial last panel.
TILE_CASES = [(40, 48, True, "int8", 128), (33, 1536, True, "bfloat16", 64),
              (64, 576, False, "int4", 128), (48, 96, True, "int8", 128),
              (16, 32, False, "int8", 32), (80, 160, True, "int8", 32)]
TILE_ROWS = (1, 3, 16, 17, 31, 32, 33, 64, 70)


@runs
@pytest.mark.parametrize("n,k,bias,fmt,longest", TILE_CASES)
def test_the_tile_form_gives_the_wide_forms_bits(n, k, bias, fmt, longest):
    """AMX-INT8's form (w8a8_tiles.h: the panels as B tiles, the quantised rows as A tiles,
    each block's int32 tiles scaled and chained as the wide form's registers), its loop on
    tiles emulated in C++: the same bits as the wide form at any row count (one and two row
    tiles, a partial one), both dtypes, every block length."""
    src, amax = _calibrated(n, k, bias, fmt)
    w8a8.set_calibration(src, amax, longest)
    mod = w8a8.W8A8Linear(src)
    for rows in TILE_ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = _inputs(rows, amax, dtype, seed=rows)
            got = _tile_op("linear_tiles_emulated")(x, mod.inv_scale, mod.weight, mod.weight_scale,
                                                    mod.block, mod.out_features, mod.bias)
            assert torch.equal(got, mod(x)), (rows, dtype)


@runs
@pytest.mark.skipif(not w8a8.tiles_available(), reason="AMX-INT8 tiles do not run here")
@pytest.mark.parametrize("n,k,bias,fmt,longest", TILE_CASES)
def test_amx_int8_tiles_give_the_wide_forms_bits(n, k, bias, fmt, longest):
    src, amax = _calibrated(n, k, bias, fmt)
    w8a8.set_calibration(src, amax, longest)
    mod, tiles = w8a8.W8A8Linear(src), w8a8.W8A8Linear(src, tiles=True)
    for rows in TILE_ROWS + (512,):
        for dtype in (torch.float32, torch.bfloat16):
            x = _inputs(rows, amax, dtype, seed=rows)
            assert torch.equal(tiles(x), mod(x)), (rows, dtype)
            assert torch.equal(tiles(x), _tile_op("linear_tiles_emulated")(
                x, mod.inv_scale, mod.weight, mod.weight_scale, mod.block, mod.out_features,
                mod.bias)), (rows, dtype)


pairs_run = pytest.mark.skipif(not w8a8.pairs_available(),
                               reason="w8a8's pair form needs AVX-512 VNNI")


@runs
@pairs_run
@pytest.mark.parametrize("n,k,bias,fmt,longest", TILE_CASES)
def test_the_pair_form_gives_the_wide_forms_bits(n, k, bias, fmt, longest):
    """Two panels a call, 7 rows at a time (w8a8_kernel.h's pairs): the wide form's bits at
    any row count (whole calls and each shorter tail), both dtypes, every block length, with
    one panel, an odd panel count (its last panel by the wide form's micro-kernel) and a
    partial last panel."""
    src, amax = _calibrated(n, k, bias, fmt)
    w8a8.set_calibration(src, amax, longest)
    mod = w8a8.W8A8Linear(src)
    pairs = lm.build("w8a8_pairs", src, torch.bfloat16)
    assert pairs.pairs and "two panels a call" in repr(pairs)
    for rows in TILE_ROWS + (2, 4, 5, 6, 7, 8, 14, 512):
        for dtype in (torch.float32, torch.bfloat16):
            x = _inputs(rows, amax, dtype, seed=rows)
            assert torch.equal(pairs(x), mod(x)), (rows, dtype)


@runs
@pairs_run
@pytest.mark.parametrize("n,k,fmt,longest", [(64, 576, "int4", 128), (96, 160, "int8", 32),
                                             (3072, 576, "int4", 128)])
def test_the_pair_form_writes_silu_mul_as_the_two_ops_would(n, k, fmt, longest):
    """A SwiGLU gate_up on the pair form writes silu(gate) * up itself (gate panel f and up
    panel f + n / 32 in one call): the bits of its output then servelm_ops.silu_and_mul, at
    any row count; a SiLU MLP whose gate_up runs it takes it. With a bias, or halves that are
    not whole panels, the layer does not offer it."""
    from servelm.kernels import load_ops
    from servelm.layers.linear_methods import BucketedLinear
    from servelm.models.layers import GatedMLP

    src, amax = _calibrated(n, k, False, fmt)
    w8a8.set_calibration(src, amax, longest)
    mod = lm.build("w8a8_pairs", src, torch.bfloat16)
    if not hasattr(torch.ops.servelm_w8a8, w8a8.PAIR_SILU_OP):
        pytest.skip("the gated epilogue needs AVX512-BF16")
    assert mod.writes_silu_mul and load_ops("ops")
    for rows in (1, 3, 7, 8, 13, 64, 100):
        x = _inputs(rows, amax, seed=rows)
        assert torch.equal(mod.silu_mul(x), torch.ops.servelm_ops.silu_and_mul(mod(x))), rows
    mlp = GatedMLP(k, n // 2)
    mlp.gate_up_proj = BucketedLinear([src, src, mod, mod], ["torch", "torch", "w8a8_pairs",
                                                              "w8a8_pairs"])
    mlp.down_proj = nn.Linear(n // 2, k, bias=False).to(torch.bfloat16)
    mlp.select(True)
    assert mlp._gated_ids == {id(mod)}
    x = _inputs(64, amax)
    assert torch.equal(mlp(x), mlp.down_proj(torch.ops.servelm_ops.silu_and_mul(mod(x))))
    biased, amax = _calibrated(n, k, True, fmt)
    assert not lm.build("w8a8_pairs", biased, torch.bfloat16).writes_silu_mul
    odd, _ = _calibrated(48, k, False, fmt)  # halves of 24 outputs
    assert not lm.build("w8a8_pairs", odd, torch.bfloat16).writes_silu_mul


def test_the_pair_form_applies_where_it_is_built(monkeypatch):
    src, _ = _calibrated(32, 64)
    monkeypatch.setattr(w8a8, "pairs_available", lambda: False)
    assert not w8a8.pairs_apply(src, torch.bfloat16)
    assert "w8a8_pairs" not in lm.WeightFormat.of(src).methods(src, torch.bfloat16, True)
    if w8a8.available() and w8a8.int8_dot():
        monkeypatch.setattr(w8a8, "pairs_available", lambda: True)
        assert w8a8.pairs_apply(src, torch.bfloat16)
        assert not w8a8.pairs_apply(src, torch.float32)
    with pytest.raises(ValueError, match="not both"):
        w8a8.W8A8Linear(src, tiles=True, pairs=True)


@runs
@pairs_run
def test_the_pair_method_is_a_w8a8_form_on_the_stack():
    """The tuner reads its name back, the DecodeStack runs it (its own format code), and a
    layer never holds two forms' int8 copies."""
    from servelm.layers import stack

    src, _ = _calibrated(48, 192, True)
    pairs, wide = lm.build("w8a8_pairs", src, torch.bfloat16), lm.build("w8a8", src, torch.bfloat16)
    summary = tuning.linear_summary(nn.ModuleList([pairs, wide]))
    assert "512 rows: w8a8 1, w8a8_pairs 1" in summary, summary
    assert stack.kernel_weights(pairs)[1] == stack.StackFormat.W8A8_PAIRS + pairs.block
    assert stack.kernel_weights(wide)[1] == stack.StackFormat.W8A8 + wide.block
    times = {"w8a8": [math.inf, math.inf, 5.0, 9.0], "w8a8_pairs": [math.inf, math.inf, 6.0, 4.0],
             "tiles": [1.0, 2.0, 20.0, 30.0]}
    sc = tuning.ShapeChoice("int4g32:48x192:smooth", ["a"], ["tiles"] * 4, times, [])
    assert (tuning._one_dequantised_copy(sc, ["tiles", "tiles", "w8a8", "w8a8_pairs"])
            == ["tiles", "tiles", "w8a8_pairs", "w8a8_pairs"])


def test_the_tile_form_applies_only_with_amx_int8(monkeypatch, tmp_path):
    """AMX-INT8 in /proc/cpuinfo (faked here) and the form running here (built for AMX-INT8,
    the OS granting the tile state) are both needed; without either the tuner never sees it."""
    for flags, want in (("fpu avx512_vnni amx_tile amx_bf16 amx_int8", True),
                        ("fpu avx512_vnni amx_tile amx_bf16", False)):
        assert _read_with_flags(monkeypatch, tmp_path, flags, w8a8.int8_tiles) is want, flags
    src, _ = _calibrated(32, 64)
    monkeypatch.setattr(w8a8, "int8_tiles", lambda: False)
    monkeypatch.setattr(w8a8, "tiles_available", lambda: True)
    assert not w8a8.tiles_apply(src, torch.bfloat16)
    assert "w8a8_amx" not in lm.WeightFormat.of(src).methods(src, torch.bfloat16, True)
    monkeypatch.setattr(w8a8, "int8_tiles", lambda: True)
    monkeypatch.setattr(w8a8, "tiles_available", lambda: False)
    assert not w8a8.tiles_apply(src, torch.bfloat16)
    if w8a8.available() and w8a8.int8_dot():
        monkeypatch.setattr(w8a8, "tiles_available", lambda: True)
        assert w8a8.tiles_apply(src, torch.bfloat16)
        assert not w8a8.tiles_apply(src, torch.float32)


@runs
def test_the_tile_method_is_a_layer_of_its_own_off_the_stack(monkeypatch):
    """Built as the tuner builds it (its op the emulated loop here): w8a8's results, the
    tuner reads its name back, the DecodeStack leaves it to the per-op path, and a layer
    never holds both forms' int8 copies."""
    from servelm.layers import stack

    monkeypatch.setattr(w8a8, "tiles_available", lambda: True)
    monkeypatch.setattr(w8a8, "TILE_OP", "linear_tiles_emulated")
    src, amax = _calibrated(48, 192, True)
    mod = lm.build("w8a8_amx", src, torch.bfloat16)
    wide = lm.build("w8a8", src, torch.bfloat16)
    assert mod.tiles and "AMX-INT8" in repr(mod)
    x = _inputs(40, amax)
    assert torch.equal(mod(x), wide(x))
    summary = tuning.linear_summary(nn.ModuleList([mod, wide]))
    assert "512 rows: w8a8 1, w8a8_amx 1" in summary, summary
    assert stack.kernel_weights(mod) is None and stack.kernel_weights(wide) is not None
    times = {"w8a8": [math.inf, math.inf, 5.0, 9.0], "w8a8_amx": [math.inf, math.inf, 6.0, 4.0],
             "tiles": [1.0, 2.0, 20.0, 30.0]}
    for key in ("int4g32:48x192:smooth", "bfloat16:48x192:smooth"):  # quantised or not
        sc = tuning.ShapeChoice(key, ["a"], ["tiles"] * 4, times, [])
        got = tuning._one_dequantised_copy(sc, ["tiles", "tiles", "w8a8", "w8a8_amx"])
        assert got == ["tiles", "tiles", "w8a8_amx", "w8a8_amx"], key


@runs
def test_rows_are_the_same_bits_whatever_the_row_count():
    src, amax = _calibrated(72, 384, True)
    mod = w8a8.W8A8Linear(src)
    x = _inputs(37, amax)
    full = mod(x)
    for lo, hi in [(0, 1), (3, 11), (8, 16), (20, 37)]:
        assert torch.equal(mod(x[lo:hi].clone()), full[lo:hi])
    assert tuning.row_invariant(mod, x)


@runs
@pytest.mark.parametrize("fmt", ["int4", "int8", "bfloat16"])
def test_smoothing_holds_outlier_channels(fmt):
    """Against the fp32 product: within a few percent on inputs with outlier channels, and
    closer than the same int8 blocks without the smoothing."""
    src, amax = _calibrated(128, 384, fmt=fmt)
    x = _inputs(32, amax)
    want = x.float() @ lm.reference_weight(src).T
    err = lambda y: ((y.float() - want).norm() / want.norm()).item()  # noqa: E731
    smoothed = err(w8a8.W8A8Linear(src)(x))
    plain = w8a8.W8A8Linear(src, alpha=0.0)  # s = 1 / wmax: no activation migration
    assert smoothed < 0.02, smoothed
    assert smoothed < err(plain(x)) / 2, (smoothed, err(plain(x)))


def test_applies_only_where_it_can_run(monkeypatch):
    src, _ = _calibrated(32, 64)
    bare = Q.Int4Linear.from_linear(nn.Linear(64, 32), 32)
    assert not w8a8.applies(bare, torch.bfloat16)  # no calibration
    assert not w8a8.applies(src, torch.float32)    # fp32 runs keep fp32-accurate methods
    monkeypatch.setattr(w8a8, "int8_dot", lambda: False)  # a CPU without VNNI
    assert not w8a8.applies(src, torch.bfloat16)
    assert "w8a8" not in lm.WeightFormat.of(src).methods(src, torch.bfloat16, True)
    assert lm.default_method(src, torch.bfloat16, True) != "w8a8"


@runs
def test_a_head_keeps_the_calibration():
    src, amax = _calibrated(64, 96)
    head = lm.head(src, 32)
    assert torch.equal(w8a8.calibrated(head), amax) and w8a8.applies(head, torch.bfloat16)
    assert tuning._shape_key(src, torch.bfloat16).endswith(":smooth")
    w8a8.set_calibration(src, amax, 32)
    assert w8a8.longest_block(lm.head(src, 32)) == 32


def test_down_proj_is_calibrated_in_shorter_blocks():
    """The calibrated layers: qkv, o, gate_up and down_proj in any format; down_proj in blocks
    of at most 64, and of at most 32 where its weights are quantised (their int8 copy rounds
    the codes again)."""
    def layer(fmt):
        mlp, attn, block = nn.Module(), nn.Module(), nn.Module()
        for parent, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"),
                             (mlp, "down_proj")):
            lin = nn.Linear(256, 256)
            setattr(parent, name, Q.Int4Linear.from_linear(lin, 32) if fmt == "int4"
                    else lin.to(torch.bfloat16))
        block.self_attn, block.mlp = attn, mlp
        return block
    for fmt, down in (("bfloat16", 64), ("int4", 32)):
        targets = calibration._targets(layer(fmt))
        assert sorted(n.rsplit(".", 1)[-1] for n in targets) == [
            "down_proj", "gate_up_proj", "o_proj", "qkv_proj"], fmt
        longest = {n.rsplit(".", 1)[-1]: calibration._longest(n, m) for n, m in targets.items()}
        assert longest == {"qkv_proj": 128, "o_proj": 128, "gate_up_proj": 128,
                           "down_proj": down}, fmt


def test_the_tuner_takes_it_for_batches_and_prompts_only():
    inf = math.inf
    times = lm.eligible({"w8a8": [5.0, 5.0, 5.0, 5.0], "q8act": [10.0, 10.0, 10.0, 10.0],
                         "tiles": [1.0, inf, 20.0, 30.0]})
    assert times["w8a8"] == [inf, inf, 5.0, 5.0] and times["tiles"] == [1.0, inf, 20.0, 30.0]
    assert tuning.choose(times, "q8act") == ["tiles", "q8act", "w8a8", "w8a8"]
    sc = tuning.ShapeChoice("k:smooth", ["a", "b"], ["q8act"] * 4, times, [])
    sc.invariant = ["q8act"]
    report = tuning.TuningReport([sc])
    tuning._decide([sc], False, report)
    assert sc.methods == ["tiles", "q8act", "w8a8", "w8a8"]
    # batch-invariant: one method for every bucket, never one the tuner may not choose at one row
    sc.invariant = ["w8a8", "q8act"]
    tuning._decide([sc], True, report)
    assert sc.methods == ["q8act"] * 4


def test_the_decode_stack_keeps_w8a8_where_the_shape_holds_it_for_prompts():
    """At 64 rows the DecodeStack may run w8a8 (a stack of its own) where the shape holds it
    for prompts anyway; at one and 8 rows it keeps the one-row method."""
    inf = math.inf
    times = lm.eligible({"w8a8": [50.0, 50.0, 100.0, 500.0],
                         "q8act": [10.0, 20.0, 160.0, 900.0]})
    sc = tuning.ShapeChoice("k:smooth", ["a"], ["q8act"] * 4, times, [])
    stack = tuning.StackCost({"k:smooth"}, 1, 1.0)
    free = [["q8act", "q8act", "w8a8", "w8a8"]]
    tuning._stack_choice([sc], free, stack)
    assert free == [["q8act", "q8act", "w8a8", "w8a8"]] and times["w8a8"][0] == inf
    assert tuning._on_stack([sc], free, stack) == [True, True, True, True]


def test_known_answer_inputs_follow_the_calibration():
    src, amax = _calibrated(32, 64)
    x = tuning.check_input(src, 4000, torch.Generator().manual_seed(0), torch.float32)
    ratio = x.abs().amax(0) / amax
    assert ratio.min() > 2 and ratio.max() < 6  # each channel at its own scale
    bare = Q.Int4Linear.from_linear(nn.Linear(64, 32), 32)
    assert tuning.check_input(bare, 4, torch.Generator(), torch.bfloat16).dtype == torch.bfloat16


# ---------------------------------------------------------------- the Triton form (CUDA)

triton = pytest.mark.skipif(not triton_quant.available(),
                            reason="needs Triton (its interpreter runs it on CPU tensors)")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled there


@triton
@pytest.mark.parametrize("fmt,n,k,bias", [("int4", 48, 576, False), ("int8", 40, 192, True),
                                          ("bfloat16", 33, 256, True)])
def test_the_triton_form_holds_the_cpu_kernels_weights_and_arithmetic(fmt, n, k, bias):
    """W8A8TritonLinear's int8 weights and block scales are the CPU kernel's (unpacked), and
    it computes the same blocks' integer sums, scaled: the fp64 arithmetic within fp32's
    rounding, bf16 within one step."""
    src, amax = _calibrated(n, k, bias, fmt)
    mod = w8a8.W8A8TritonLinear(src)  # built from the CPU source, run where Triton compiles
    block, q, scale, inv, b = w8a8.smoothed(src)
    assert mod.block == block and torch.equal(mod.weight, q) and torch.equal(mod.inv_scale, inv)
    if w8a8.available() and w8a8.int8_dot():
        cpu = w8a8.W8A8Linear(src)
        packed = cpu.weight.permute(0, 2, 1, 3).reshape(-1, k)[:n].to(torch.int16) - 128
        assert torch.equal(packed.to(torch.int8), mod.weight)
        assert torch.equal(w8a8.unpack_scales(cpu.weight_scale, n), mod.weight_scale)
    for dtype, step in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
        x = _inputs(21, amax, dtype)
        xq, d = w8a8.reference(x, inv, block)
        sums = torch.einsum("mbk,nbk->mnb", xq.double().reshape(21, -1, block),
                            q.double().reshape(n, -1, block))
        want = (sums * d.double()[:, None, :] * scale.double()[None]).sum(-1)
        if b is not None:
            want = want + b.double()
        y = mod.to(DEV)(x.to(DEV)).cpu()
        mod.cpu()
        assert y.dtype == dtype
        assert ((y.double() - want).abs() <= step * want.abs() + 1e-5 * want.abs().max()).all()


def _cuda_model():
    """Two calibrated layer shapes (two layers of one) and an uncalibrated head, bf16."""
    model = nn.Module()
    model.a0, _ = _calibrated(64, 256, fmt="bfloat16", seed=1)
    model.a1, _ = _calibrated(64, 256, fmt="bfloat16", seed=2)
    model.b, _ = _calibrated(32, 128, bias=True, fmt="bfloat16", seed=3)
    model.head = nn.Linear(256, 48).to(torch.bfloat16)
    return model.to(DEV)


@triton
def test_cuda_tuning_takes_w8a8_where_it_is_faster(monkeypatch):
    """The shapes timed faster on w8a8 by more than the tuner's margin run it at those
    buckets (never one or a few rows), the others keep their own kernels; the swapped layers
    compute what their sources do, within w8a8's rounding. Timed by a fake clock, on CPU
    tensors (Triton's interpreter)."""
    from servelm import tuning_cuda

    monkeypatch.setattr(w8a8, "triton_runs", lambda act, device: True)
    model = _cuda_model()
    srcs = {n: getattr(model, n) for n in ("a0", "a1", "b", "head")}
    timed = []

    def clock(mod, x):
        timed.append((type(mod).__name__, x.shape[0], mod.out_features))
        fast = isinstance(mod, w8a8.W8A8TritonLinear)
        if mod.out_features == 64:  # shape a: w8a8 wins at 512 rows, ties at 64
            return 50.0 if fast and x.shape[0] == 512 else 100.0
        return 120.0 if fast else 100.0  # shape b: never
    shapes = tuning_cuda.apply(model, torch.bfloat16, DEV, 1 << 30, clock)
    assert {r for _, r, _ in timed} == {64, 512}  # the buckets w8a8 may take, nothing less
    assert len(shapes) == 2 and all(not s.failed for s in shapes)
    by_out = {int(s.key.split("x")[1].split(":")[0]): s for s in shapes}
    assert by_out[64].methods == ["torch", "torch", "torch", "w8a8"]
    assert by_out[64].names == ["a0", "a1"] and by_out[32].methods == ["torch"] * 4
    for name in ("a0", "a1"):
        layer = getattr(model, name)
        assert isinstance(layer, lm.BucketedLinear)
        assert layer.module_for(8) is srcs[name] and layer.module_for(64) is srcs[name]
        assert isinstance(layer.module_for(512), w8a8.W8A8TritonLinear)
        x = _inputs(200, w8a8.calibrated(srcs[name])).to(DEV)
        want = srcs[name](x).float()
        err = (layer(x).float() - want).norm() / want.norm()
        assert 0 < err < 0.02, err
    assert model.b is srcs["b"] and model.head is srcs["head"]


@triton
def test_cuda_tuning_keeps_own_kernels_over_budget_or_on_a_wrong_result(monkeypatch):
    from servelm import tuning_cuda

    monkeypatch.setattr(w8a8, "triton_runs", lambda act, device: True)
    fast = lambda mod, x: 10.0 if isinstance(mod, w8a8.W8A8TritonLinear) else 100.0  # noqa: E731
    # The copies' budget holds shape b's int8 copy, not shape a's two.
    model = _cuda_model()
    need_a = 2 * tuning_cuda.copy_bytes(model.a0)
    need_b = tuning_cuda.copy_bytes(model.b)
    assert need_b < need_a
    shapes = tuning_cuda.apply(model, torch.bfloat16, DEV, need_b, fast)
    assert isinstance(model.b, lm.BucketedLinear)
    assert not isinstance(model.a0, lm.BucketedLinear)
    assert [s.methods for s in shapes if "256x64" in s.key] == [["torch"] * 4]
    # A kernel whose result is wrong here is never taken, whatever its time.
    monkeypatch.setattr(w8a8.W8A8TritonLinear, "forward", lambda self, x: x.new_zeros(
        *x.shape[:-1], self.out_features))
    model = _cuda_model()
    shapes = tuning_cuda.apply(model, torch.bfloat16, DEV, 1 << 30, fast)
    assert all(s.failed == ["w8a8"] and s.methods == ["torch"] * 4 for s in shapes)
    assert not any(isinstance(m, lm.BucketedLinear) for m in model.children())


def test_a_failed_calibration_on_cuda_leaves_every_layer_its_own(caplog):
    """int8 activations are an optimisation: a calibration pass that fails on the GPU (here
    faked: the pass raises after reaching one layer) leaves every layer as it was and the
    engine's start-up going, with a warning that says why."""
    from servelm import tuning_cuda

    model = _cuda_model()
    before = {n: m for n, m in model.named_children()}

    def fails(m):
        setattr(m.head, w8a8.AMAX, torch.ones(256))
        raise RuntimeError("no kernel image is available")
    with caplog.at_level("WARNING", logger="servelm.tuning_cuda"):
        report = tuning_cuda.finalize(model, KernelConfig(), fails, torch.device("cuda"))
    assert report.shapes == [] and "no kernel image" in caplog.text
    assert dict(model.named_children()) == before
    assert w8a8.calibrated(model.head) is None  # the half-done pass's maxima dropped
    # elsewhere than CUDA nothing runs
    assert tuning_cuda.finalize(model, KernelConfig(), fails).shapes == []


# ---------------------------------------------------------------- calibration

@pytest.fixture(scope="module")
def model():
    """The embedded model's layers (int4 weights, bf16), loaded alone, not calibrated."""
    from servelm.models.loader import load_model, open_checkpoint

    ck = open_checkpoint(None)
    m = load_model(ck, ck.config(), torch.bfloat16, torch.device("cpu"), 2048)
    Q.quantize_model(m, "int4")
    return m, ck


def test_wanted_by_the_setting(model):
    m, _ = model
    cpu = torch.device("cpu")
    expect = w8a8.int8_dot() and w8a8.available()
    assert calibration.wanted(m, "auto", cpu, KernelConfig()) is expect
    assert not calibration.wanted(m, "off", cpu, KernelConfig())
    assert not calibration.wanted(m, "auto", cpu, KernelConfig(tuning="off"))  # never chosen
    assert not calibration.wanted(m, "auto", cpu, KernelConfig(linear_method="q8act,tiles"))
    assert calibration.wanted(m, "auto", cpu, KernelConfig(linear_method="w8a8,q8act")) is expect
    assert calibration.wanted(m, "auto", cpu, KernelConfig(linear_method="w8a8_amx,q8act")) is expect
    assert not calibration.wanted(m, "auto", cpu, KernelConfig(cpu_kernels=False))


def test_wanted_on_cuda_where_triton_drives_int8_tensor_cores(model, monkeypatch):
    m, _ = model
    cuda = torch.device("cuda")
    monkeypatch.setattr(w8a8, "triton_runs", lambda act, device: False)  # no GPU, or pre-Ampere
    assert not calibration.wanted(m, "auto", cuda, KernelConfig())
    monkeypatch.setattr(w8a8, "triton_runs", lambda act, device: device.type == "cuda")
    assert calibration.wanted(m, "auto", cuda, KernelConfig())
    assert calibration.wanted(m, "auto", cuda, KernelConfig(cpu_kernels=False))  # CPU-only
    assert not calibration.wanted(m, "off", cuda, KernelConfig())
    assert not calibration.wanted(m, "auto", cuda, KernelConfig(tuning="off"))


@runs
def test_calibration_covers_every_target_row_and_is_cached(model, tmp_path, monkeypatch):
    m, ck = model
    ids = calibration.calibration_ids(ck.tokenizer(), 96)
    assert len(ids) == 96
    cache = calibration.cache_file(tmp_path, ck.path, torch.bfloat16, "int4", ids)
    seen = {}

    def record(mod, args):
        seen[id(mod)] = args[0].shape[0]
    targets = list(calibration._targets(m).values())
    assert len(targets) == 4 * len(m.layers)  # qkv, o, gate_up, down
    hooks = [t.register_forward_pre_hook(record) for t in targets]
    try:
        assert calibration.calibrate(m, ids, KernelConfig(), cache) == len(targets)
    finally:
        for h in hooks:
            h.remove()
    # every target saw every position: the last layer's o_proj and MLP too
    assert set(seen.values()) == {96}
    amax = {id(t): w8a8.calibrated(t).clone() for t in targets}
    assert all(a.shape == (t.in_features,) and (a >= 0).all() and a.max() > 0
               for t, a in zip(targets, amax.values()))
    assert {n.rsplit(".", 1)[-1]: w8a8.longest_block(t)
            for n, t in calibration._targets(m).items()} == {
        "qkv_proj": 128, "o_proj": 128, "gate_up_proj": 128, "down_proj": 32}  # int4 weights
    assert cache.exists()
    for t in targets:
        delattr(t, w8a8.AMAX)
    monkeypatch.setattr(calibration, "_measure", lambda *a: pytest.fail("not read back"))
    assert calibration.calibrate(m, ids, KernelConfig(), cache) == len(targets)
    assert all(torch.equal(w8a8.calibrated(t), amax[id(t)]) for t in targets)
    # a pass that reached only some layers (their calibration alone cached) is read back
    part = tmp_path / "part.pt"
    names = list(calibration._targets(m))
    torch.save({n: amax[id(calibration._targets(m)[n])] for n in names[:5]}, part)
    for t in targets:
        delattr(t, w8a8.AMAX)
    assert calibration.calibrate(m, ids, KernelConfig(), part) == 5
    assert sum(w8a8.calibrated(t) is not None for t in targets) == 5
    # another text is another calibration
    other = calibration.cache_file(tmp_path, ck.path, torch.bfloat16, "int4", ids[:50])
    assert other != cache


@triton
def test_the_triton_form_on_the_embedded_models_layers(model):
    """Real weights and activations: the embedded model's (int4) qkv layers of its first and
    last decoder layers and the last one's gate_up, calibrated on the built-in text, run on
    the Triton form on the inputs that text gives them: within a few percent of the fp32
    product (outlier channels and all), and the CPU kernel's results where it runs."""
    m, ck = model
    ids = calibration.calibration_ids(ck.tokenizer(), 64)
    last = len(m.layers) - 1
    names = ["layers.0.self_attn.qkv_proj", f"layers.{last}.self_attn.qkv_proj",
             f"layers.{last}.mlp.gate_up_proj"]
    layers = {n: m.get_submodule(n) for n in names}
    targets = calibration._targets(m)  # the fixture's calibration state, restored after
    before = {n: (w8a8.calibrated(t), w8a8.longest_block(t)) for n, t in targets.items()}
    seen = {}
    hooks = [t.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, args[0].detach()))
             for n, t in layers.items()]
    try:
        assert calibration.calibrate(m, ids, KernelConfig(), None) > 0
        for n, src in layers.items():
            x = seen[n].reshape(-1, src.in_features)[:48].contiguous()
            got = w8a8.W8A8TritonLinear(src).to(DEV)(x.to(DEV)).float().cpu()
            want = x.float() @ lm.reference_weight(src).T
            err = ((got - want).norm() / want.norm()).item()
            assert err < 0.03, (n, err)
            if w8a8.available() and w8a8.int8_dot():
                cpu = w8a8.W8A8Linear(src)(x).float()
                assert ((got - cpu).abs() <= 2 ** -7 * cpu.abs() + 1e-3 * cpu.abs().max()).all(), n
    finally:
        for h in hooks:
            h.remove()
        for n, (amax, longest) in before.items():
            if amax is None:
                if w8a8.calibrated(targets[n]) is not None:
                    delattr(targets[n], w8a8.AMAX)
            else:
                w8a8.set_calibration(targets[n], amax, longest)


@runs
def test_a_short_context_calibrates_on_what_fits():
    """An engine with max_model_len under the calibration text's 512 tokens (its rotary
    tables that long) calibrates on as many tokens as fit, and serves."""
    from servelm import LLM, SamplingParams

    llm = LLM(max_model_len=96, kv_cache_memory=16 << 20, enable_prefix_caching=False)
    # The calibrated layers reached the tuner, which timed the w8a8 method on them (which
    # method it then picks is a measurement, not this test's business).
    smooth = [s for s in llm.engine.executor.tuning.shapes if ":smooth" in s.key]
    assert smooth
    assert all(min(s.times_us["w8a8"]) < float("inf") for s in smooth)
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
