"""Linear methods chosen by measurement (servelm.tuning, servelm.layers.linear_methods):
the choice from timing tables, the known-answer check that keeps a wrong method out, the
cache, the per-bucket dispatch, and every method against the fp32 reference."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from servelm import quantization as Q
from servelm import tuning, tuning_cache
from servelm.config import KernelConfig
from servelm.layers import linear_methods as lm
from servelm.prepack import PackedLinear


def _never(monkeypatch, *names: str) -> None:
    """The linear methods' registry with the methods `names` applying to no layer."""
    methods = tuple(dataclasses.replace(m, runs=lambda src, act: False) if m.name in names
                    else m for m in lm.LINEAR_METHODS)
    monkeypatch.setattr(lm, "LINEAR_METHODS", methods)
    monkeypatch.setattr(lm, "METHODS_BY_NAME", {m.name: m for m in methods})


INF = math.inf


class _Block(nn.Module):
    """Two layers of each of two shapes, named as a model's are."""

    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for layer in self.layers:
            layer.qkv_proj = nn.Linear(64, 96, bias=True)
            layer.down_proj = nn.Linear(128, 64, bias=False)
        self.to(dtype)

    def forward(self, x):
        return [(layer.qkv_proj(x), layer.down_proj(torch.cat([x, x], -1))) for layer in self.layers]


# ---------------------------------------------------------------- choose

def test_choose_picks_the_fastest_method_per_bucket():
    times = {"tiles": [10, 20, 300, 2400], "onednn": [15, 25, 100, 800]}
    assert tuning.choose(times, "tiles") == ["tiles", "tiles", "onednn", "onednn"]


def test_choose_keeps_the_default_unless_beaten_by_the_margin():
    times = {"tiles": [10.4, 10.6, 10, 10], "onednn": [10, 10, 10, 10]}
    # 4% slower stays, 6% slower is replaced.
    assert tuning.choose(times, "tiles", margin=0.05) == ["tiles", "onednn", "tiles", "tiles"]


def test_choose_never_picks_a_failed_or_untimed_method():
    times = {"tiles": [10, 10, 10, 10], "onednn": [INF] * 4, "torch": [50, INF, 50, 50]}
    assert tuning.choose(times, "onednn") == ["tiles"] * 4
    assert tuning.choose({"onednn": [INF] * 4}, "torch") == ["torch"] * 4  # nothing ran


def test_choose_batch_invariant_takes_one_method_for_every_bucket():
    times = {"tiles": [10, 20, 300, 2400], "onednn": [15, 25, 100, 800]}
    assert tuning.choose(times, "tiles", batch_invariant=True) == ["onednn"] * 4
    # The least worst slowdown, not the least total: the 512-row bucket's milliseconds do
    # not outvote the one-row bucket's microseconds.
    times2 = {"panels": [10, 10, 105, 1050], "onednn": [20, 15, 100, 1000]}
    assert tuning.choose(times2, "onednn", batch_invariant=True) == ["panels"] * 4
    # A method that failed any bucket cannot serve them all.
    times["onednn"][0] = INF
    assert tuning.choose(times, "onednn", batch_invariant=True) == ["tiles"] * 4


def _shape(times, invariant, n=30, default="tiles"):
    return tuning.ShapeChoice("k", ["l"] * n, [default] * 4, times, [], invariant=invariant,
                              candidates=list(times))


def test_invariance_is_chosen_where_it_costs_at_most_ten_percent():
    cheap = [_shape({"tiles": [10, 20, 300, 2400], "onednn": [10.5, 21, 100, 800]}, ["onednn"])]
    costly = [_shape({"tiles": [10, 20, 300, 2400], "onednn": [15, 25, 100, 800]}, ["onednn"])]
    for shapes, auto in ((cheap, True), (costly, False)):
        report = tuning.TuningReport(shapes)
        tuning._decide(shapes, None, report)
        assert report.batch_invariant is auto
        assert shapes[0].methods == (["onednn"] * 4 if auto else ["tiles", "tiles", "onednn", "onednn"])
    report = tuning.TuningReport(costly)
    tuning._decide(costly, True, report)  # asked for: paid for
    assert report.batch_invariant and costly[0].methods == ["onednn"] * 4
    assert report.invariance_cost[0] == pytest.approx(1.5)
    # No invariant method for one shape: the fastest everywhere, and said so.
    none = [_shape({"tiles": [10] * 4, "onednn": [20] * 4}, [])]
    report = tuning.TuningReport(none)
    tuning._decide(none, True, report)
    assert report.batch_invariant is False and none[0].methods == ["tiles"] * 4


def test_the_decode_stacks_methods_win_where_the_calls_it_saves_pay_for_them():
    """At 1, 8 and 64 rows the stack's shapes take a stack method (tiles, q8act) when its time
    summed over the layers is at most the fastest choice's plus the per-op calls the
    DecodeStack saves; shapes outside the stack (an LM head) keep the fastest."""
    def shapes():
        layer = _shape({"q8act": [10, 20, 300, 2400], "qdot": [9, 25, 400, 3000],
                        "onednn": [30, 30, 100, 800]}, [])
        head = _shape({"q8act": [100, 200, 3000, 24000], "qdot": [80, 250, 4000, 30000]}, [], n=1)
        head.key = "head"
        return [layer, head]

    # 30 layers: q8act costs 30 us more at one row, 5 us a layer saved pays for it.
    got = shapes()
    tuning._decide(got, False, tuning.TuningReport(got), tuning.StackCost({"k"}, 30, 5.0))
    assert got[0].methods == ["q8act", "q8act", "onednn", "onednn"]
    assert got[1].methods == ["qdot", "q8act", "q8act", "q8act"]  # the head: the fastest
    # 0.5 us a layer does not: the fastest per bucket, and the stack runs no row.
    got = shapes()
    tuning._decide(got, False, tuning.TuningReport(got), tuning.StackCost({"k"}, 30, 0.5))
    assert got[0].methods == ["qdot", "q8act", "onednn", "onednn"]
    # At 8 rows only the one-row method can keep the stack (one module for its rows).
    one = [_shape({"tiles": [10, 30, 300, 2400], "q8act": [11, 20, 300, 2400]}, [])]
    tuning._decide(one, False, tuning.TuningReport(one), tuning.StackCost({"k"}, 30, 0.1))
    assert one[0].methods[:2] == ["tiles", "q8act"]  # 30 layers x 10 us: more than saved
    one = [_shape({"tiles": [10, 30, 300, 2400], "q8act": [11, 20, 300, 2400]}, [])]
    tuning._decide(one, False, tuning.TuningReport(one), tuning.StackCost({"k"}, 30, 20.0))
    assert one[0].methods[:2] == ["tiles", "tiles"]


def test_the_stack_adds_no_second_dequantised_copy_where_it_stops_early():
    """An int4 shape whose fastest method is oneDNN at 1 and 64 rows, q8act at 8 and 512:
    amx, the stack's fastest at one row, would be a second dequantised copy beside the 64-row
    bucket's oneDNN should the stack stop before that bucket (here at 8 rows), so it is not
    offered; q8act does not pay at one row, and every bucket keeps its fastest."""
    sc = _shape({"onednn": [8, 30, 90, 800], "amx": [9, 25, 5000, 3000],
                 "q8act": [12, 20, 300, 700]}, [])
    sc.key = "int4g32/bfloat16:256x256"
    tuning._decide([sc], False, tuning.TuningReport([sc]), tuning.StackCost({sc.key}, 30, 3.0))
    assert sc.methods == ["onednn", "q8act", "onednn", "q8act"]


def test_at_64_rows_the_stack_keeps_layers_that_tie_with_onednn():
    """Two shapes at 64 rows: amx ahead on one, 2 us behind on the other (30 layers: 60 us,
    3 us a layer saved: 90 us). Summed with the
    calls the stack saves, amx is no slower, so both take it (one stack for 1 to 181 rows)
    rather than the per-op path for the whole step; far behind (the last case), they keep
    the fastest."""
    def shapes(gu_amx):
        qkv = _shape({"amx": [45, 48, 56, 310], "onednn": [85, 77, 63, 265]}, [])
        gu = _shape({"amx": [153, 158, gu_amx, 880], "onednn": [200, 194, 201, 746]}, [])
        gu.key = "gu"
        return [qkv, gu]

    got = shapes(203)
    tuning._decide(got, False, tuning.TuningReport(got), tuning.StackCost({"k", "gu"}, 30, 3.0))
    assert [sc.methods for sc in got] == [["amx", "amx", "amx", "onednn"]] * 2
    got = shapes(203)  # without the stack: the fastest per bucket
    tuning._decide(got, False, tuning.TuningReport(got))
    assert got[1].methods[2] == "onednn"
    got = shapes(400)  # 30 layers x 199 us behind: more than the 90 us saved
    tuning._decide(got, False, tuning.TuningReport(got), tuning.StackCost({"k", "gu"}, 30, 3.0))
    assert [sc.methods[2] for sc in got] == ["amx", "onednn"]


def test_an_invariant_choice_leaving_the_stack_pays_for_its_calls():
    def shapes(inv="onednn"):  # onednn: not a method the stack runs; amx: one
        return [_shape({"tiles": [10, 20, 300, 2400], inv: [9.5, 21, 100, 800]}, [inv])]

    got = shapes()  # no stack: onednn for every row costs at most 5% (bucket 8)
    report = tuning.TuningReport(got)
    tuning._decide(got, None, report)
    assert report.batch_invariant and got[0].methods == ["onednn"] * 4
    got = shapes()  # on the stack, tiles save 3 us a layer: onednn at one row costs 1.25x
    report = tuning.TuningReport(got)
    tuning._decide(got, None, report, tuning.StackCost({"k"}, 30, 3.0))
    assert report.batch_invariant is False
    assert got[0].methods == ["tiles", "tiles", "onednn", "onednn"]
    assert report.invariance_cost[0] == pytest.approx((30 * 9.5 + 90) / 300)
    got = shapes("amx")  # an invariant method the stack runs pays nothing for leaving it
    report = tuning.TuningReport(got)
    tuning._decide(got, None, report, tuning.StackCost({"k"}, 30, 3.0))
    assert report.batch_invariant and got[0].methods == ["amx"] * 4

    # The other way: amx keeps 64 rows on the stack where the fastest (onednn) leaves it,
    # so the fastest pays the calls there: 12% slower alone, 8.7% counting them.
    def three():
        return [_shape({"tiles": [10, 20, 300, 2400], "onednn": [12, 25, 100, 800],
                        "amx": [10.2, 20.5, 112, 850]}, ["amx"])]

    got = three()
    report = tuning.TuningReport(got)
    tuning._decide(got, None, report)
    assert report.batch_invariant is False and report.invariance_cost[2] == pytest.approx(1.12)
    got = three()
    report = tuning.TuningReport(got)
    tuning._decide(got, None, report, tuning.StackCost({"k"}, 30, 3.0))
    assert report.batch_invariant and got[0].methods == ["amx"] * 4
    assert report.invariance_cost[2] == pytest.approx(30 * 112 / (30 * 100 + 90))

    # tiles for a few rows and amx for a batch: a stack for each (the model binds one per
    # run of buckets on the same modules), so at 64 rows neither choice leaves the stack.
    got = [_shape({"tiles": [10, 20, 300, 2400], "amx": [10.4, 20.8, 100, 800]}, ["amx"])]
    report = tuning.TuningReport(got)
    tuning._decide(got, False, report, tuning.StackCost({"k"}, 30, 3.0))
    assert got[0].methods == ["tiles", "tiles", "amx", "amx"]
    assert report.invariance_cost[2] == pytest.approx(1.0)
    assert report.invariance_cost[0] == pytest.approx(1.04)


def test_a_quantised_layer_keeps_one_dequantised_copy_of_its_weights():
    """amx fastest at 64 rows and oneDNN at 512 (the 1.5B's down_proj in int4 on the AMX
    Xeon) would hold two bf16 copies of an int4 layer: the one least behind at its worst
    bucket takes both, oneDNN (1.38x at 64) over amx (1.97x at 512); with the numbers the
    other way round, amx. A bf16 layer keeps the fastest in each bucket."""
    times = {"q8act": [2751, 1116, 7412, 60864], "qdot": [565, 2451, 20127, 161016],
             "onednn": [2472, 2367, 4444, 13564], "amx": [1756, 1871, 3222, 26724]}
    flipped = dict(times, onednn=[2472, 2367, 4444, 20000], amx=[1756, 1871, 3222, 26724])
    for key, t, want in (("int4g32/bfloat16:8960x1536", times, "onednn"),
                         ("int8/bfloat16:8960x1536", times, "onednn"),
                         ("int4g32/bfloat16:8960x1536", flipped, "amx")):
        sc = _shape(dict(t), [], default="q8act")
        sc.key = key
        tuning._decide([sc], False, tuning.TuningReport([sc]))
        assert sc.methods == ["qdot", "q8act", want, want], key
    sc = _shape(dict(times), [], default="q8act")
    sc.key = "bfloat16/bfloat16:8960x1536"
    tuning._decide([sc], False, tuning.TuningReport([sc]))
    assert sc.methods == ["qdot", "q8act", "amx", "onednn"]
    # The DecodeStack's one-row choice does not add amx to an int4 layer holding oneDNN: the
    # stack takes q8act instead (amx alone would pay for itself).
    t = {"qdot": [9, 30, 300, 3000], "q8act": [12, 30, 300, 3000], "amx": [10, 30, 300, 3000],
         "onednn": [50, 20, 100, 800]}
    for key, want in (("int4g32/bfloat16:576x576", "q8act"), ("bfloat16/bfloat16:576x576", "amx")):
        sc = _shape(dict(t), [], default="qdot")
        sc.key = key
        tuning._decide([sc], False, tuning.TuningReport([sc]), tuning.StackCost({key}, 30, 5.0))
        assert sc.methods[0] == want and sc.methods[2:] == ["onednn", "onednn"], key


def test_a_model_the_stack_runs_keeps_its_layers_on_the_stack(tmp_path, monkeypatch):
    """Through finalize_linears, on a small Llama model in bf16 + int4: a method faster by a
    little at one row (qdot, by fake timings) does not take the layers off the DecodeStack;
    the per-op call time is measured once and cached with the table."""
    from servelm.layers import qdot
    from servelm.models.config import ModelConfig
    from servelm.models.llama import LlamaForCausalLM
    from servelm.models import decode_stack

    if not (Q.kernels_available() and decode_stack.available()):
        pytest.skip("needs the C++ kernels (AVX-512 BF16)")
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                      intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=256)

    def fake(mod, x):  # qdot 10% faster than everything else at one row
        fast = isinstance(mod, qdot.QDotLinear) and x.shape[0] == 1
        return mod(x), x.shape[0] * (0.9e-6 if fast else 1e-6)

    monkeypatch.setattr(tuning, "_timed_call", fake)
    # (no SiLU pass to add to non-amx gate_ups: the fake matmuls take ~1 µs, a real pass more)
    monkeypatch.setattr(tuning, "_silu_pass_us", lambda width, act: [0.0] * len(lm.BUCKET_ROWS))
    for stack, want in ((True, ("tiles", "q8act")), (False, ("qdot",))):
        model = LlamaForCausalLM(cfg, max_positions=256).to(torch.bfloat16)
        report = tuning.finalize_linears(model, "int4", _cfg(tmp_path, tuning="fresh",
                                                            fused_decode=stack))
        layers = [s for s in report.shapes if "lm_head" not in s.names[0]]
        if not any("qdot" in s.times_us for s in layers):
            pytest.skip("qdot does not run here")
        assert all(s.methods[0] in want for s in layers), report.table()
    cache = tuning_cache.TuningCache(tmp_path, tuning_cache.machine_key(torch.get_num_threads()))
    assert cache.get(tuning.OP_CALL_KEY)["times_us"]["rms_norm"][0] > 0


def test_a_swiglu_gate_up_counts_the_silu_pass_that_amx_fuses(tmp_path, monkeypatch):
    """A SwiGLU MLP's gate_up on amx writes silu(gate) * up itself: the tuner adds the
    separate SiLU pass (measured once per width, cached) to every other method's time for
    that shape only. With oneDNN a little faster than amx for the matmul alone, gate_up
    takes amx (gated) and the other layers keep oneDNN."""
    from servelm.layers import amx
    from servelm.models.config import ModelConfig
    from servelm.models.llama import LlamaForCausalLM

    if not amx.available():
        pytest.skip("no AMX-BF16 here")
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                      intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=256)

    def fake(mod, x):  # oneDNN 5% faster than amx, everything else far behind
        t = 1.0 if isinstance(mod, amx.AmxLinear) else 0.95 if isinstance(mod, PackedLinear) else 9
        return mod(x), x.shape[0] * t * 1e-6

    monkeypatch.setattr(tuning, "_timed_call", fake)
    passes = [0.5 * r for r in lm.BUCKET_ROWS]
    monkeypatch.setattr(tuning, "_silu_pass_us", lambda width, act: passes)
    model = LlamaForCausalLM(cfg, max_positions=256).to(torch.bfloat16)
    report = tuning.finalize_linears(model, None,
                                     _cfg(tmp_path, tuning="fresh", fused_decode=False))
    by_kind = {s.names[0].rsplit(".", 1)[-1]: s for s in report.shapes}
    assert by_kind["gate_up_proj"].methods == ["amx"] * 4, report.table()
    assert all(by_kind[k].methods == ["onednn"] * 4 for k in ("qkv_proj", "o_proj", "down_proj"))
    gu = by_kind["gate_up_proj"].times_us
    assert gu["onednn"][3] == pytest.approx(512 * 0.95 + 256) and gu["amx"][3] == pytest.approx(512)
    assert all(layer.mlp.gate_up_proj.gated for layer in model.layers)
    cache = tuning_cache.TuningCache(tmp_path, tuning_cache.machine_key(torch.get_num_threads()))
    assert cache.get(f"{tuning.ACT_KEY}:192")["times_us"]["silu_and_mul"] == passes


def test_row_invariance_check_catches_a_row_count_dependent_kernel():
    lin = nn.Linear(64, 32)
    x = torch.randn(128, 64)

    def switches(t):  # another summation order below 8 rows, as a GEMV path has
        y = lin(t)
        return y * (1 + 2 ** -20) if t.shape[0] < 8 else y

    assert tuning.row_invariant(lambda t: t[:, :32] * 2, x)
    assert not tuning.row_invariant(switches, x)


# ---------------------------------------------------------------- dispatch

def test_buckets_split_rows_at_the_geometric_means():
    assert [lm.bucket_of(r) for r in (1, 2, 22, 23, 181, 182, 4096)] == [0, 1, 1, 2, 2, 3, 3]


class _Spy(nn.Module):
    def __init__(self, lin, name, log):
        super().__init__()
        self.lin, self.name, self.log = lin, name, log
        self.in_features, self.out_features, self.bias = lin.in_features, lin.out_features, None

    def forward(self, x):
        self.log.append(self.name)
        return self.lin(x)


def test_bucketed_linear_runs_each_buckets_module():
    log: list[str] = []
    lin = nn.Linear(8, 4)
    a, b = _Spy(lin, "a", log), _Spy(lin, "b", log)
    layer = lm.BucketedLinear([a, a, b, b], ["torch", "torch", "onednn", "onednn"])
    assert len(layer.impls) == 2
    for rows in (1, 22, 23, 512):
        torch.testing.assert_close(layer(torch.ones(rows, 8)), lin(torch.ones(rows, 8)))
    layer(torch.ones(2, 3, 8))  # leading dimensions count as rows: 6
    assert log == ["a", "a", "b", "b", "a"]
    assert layer.module_for(100) is b


def test_bucket_row_ranges_cover_every_row_count_once():
    ranges = [lm.bucket_row_range(b) for b in range(len(lm.BUCKET_ROWS))]
    assert ranges[0] == (1, 1) and ranges[1] == (2, 22) and ranges[2][0] == 23
    for b, (lo, hi) in enumerate(ranges):
        assert lm.bucket_of(lo) == b and lm.bucket_of(min(hi, 1 << 20)) == b
        if b + 1 < len(ranges):
            assert ranges[b + 1][0] == hi + 1


# ---------------------------------------------------------------- every method

def _source(fmt: str, n=96, k=128, bias=True, act=torch.float32):
    torch.manual_seed(1)
    lin = nn.Linear(k, n, bias=bias)
    if fmt in ("int4", "int8"):
        return Q.quantize_linear(lin, fmt)
    return lin.to(act)


@pytest.mark.parametrize("fmt,act", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                     ("int8", torch.float32), ("int8", torch.bfloat16),
                                     ("int4", torch.float32), ("int4", torch.bfloat16)])
@pytest.mark.parametrize("method", lm.METHODS)
def test_every_method_matches_the_fp32_reference(fmt, act, method):
    src = _source(fmt, act=act)
    if not lm.applies(method, src, act, True):
        pytest.skip(f"{method} does not run {fmt} with {act} activations here")
    mod = lm.build(method, src, act)
    ref_w, bias = lm.reference_weight(src), src.bias
    for rows in lm.BUCKET_ROWS:
        x = torch.randn(rows, 128).to(act)
        want = x.float() @ ref_w.T + bias.float()
        got = mod(x)
        assert got.dtype == act and got.shape == want.shape
        err = (got.float() - want).abs().max().item() / want.abs().max().item()
        exact = getattr(mod, "compute_dtype", act) == torch.float32  # int4pack: bf16 inside
        # qdot: activations quantised to int16 (~16 bits), not fp32-exact.
        tol = 2e-2 if not exact else 5e-4 if method == "qdot" else 1e-4
        assert err < tol, (method, rows, err)
        assert tuning.known_answer(mod, ref_w, bias, x)
    # The copy a timing sweep runs (tuning._clone): the same results from its own memory.
    copy = tuning._clone(mod)
    x = torch.randn(8, 128).to(act)
    assert torch.equal(copy(x), mod(x))

    def storages(m):
        ts = [t for t in list(m.parameters()) + list(m.buffers())
              + [v for v in vars(m).values() if isinstance(v, torch.Tensor)]]
        return {t.untyped_storage().data_ptr() for t in ts if t.layout == torch.strided}
    assert storages(mod) and not storages(mod) & storages(copy)


@pytest.mark.parametrize("fmt,act", [("float32", torch.float32), ("int4", torch.float32)])
def test_measure_passes_every_correct_method_at_every_bucket(fmt, act):
    # Each bucket's check has its own reference (measure computes each once per shape and
    # shares it among the methods): a reference from another input would fail them all.
    srcs = [_source(fmt, act=act) for _ in range(2)]
    methods = [m for m in lm.METHODS if lm.applies(m, srcs[0], act, True)
               and (m != "torch" or fmt == "float32")]
    times, failed, _ = tuning.measure(srcs, methods, act)
    assert failed == []
    assert set(times) == set(methods)
    assert all(len(t) == len(lm.BUCKET_ROWS) and all(map(math.isfinite, t))
               for t in times.values())


def test_known_answer_refuses_a_wrong_or_failing_module():
    src = _source("float32")
    x = torch.randn(8, 128)
    ref_w = lm.reference_weight(src)
    assert tuning.known_answer(src, ref_w, src.bias, x)
    assert not tuning.known_answer(lambda t: src(t) * 1.05, ref_w, src.bias, x)
    assert not tuning.known_answer(lambda t: src(t)[:, :-1], ref_w, src.bias, x)

    def fails(t):
        raise RuntimeError("no kernel for this shape")

    assert not tuning.known_answer(fails, ref_w, src.bias, x)


def test_the_reference_is_the_only_method_without_optimised_paths():
    src = _source("int4")
    assert [m for m in lm.METHODS if lm.applies(m, src, torch.float32, False)] == ["torch"]
    assert lm.default_method(src, torch.float32, False) == "torch"


# ---------------------------------------------------------------- finalize_linears

def _cfg(tmp_path, **kw):
    return KernelConfig(tuning_cache_dir=str(tmp_path), **kw)


class _Wrong(nn.Module):
    """Fast and wrong: what a kernel computing with the wrong layout looks like."""

    def __init__(self, src):
        super().__init__()
        self.in_features, self.out_features, self.bias = src.in_features, src.out_features, None

    def forward(self, x):
        return torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype)


def test_a_method_failing_its_check_is_never_picked(tmp_path, monkeypatch):
    real_build = lm.build
    monkeypatch.setattr(lm, "build", lambda m, src, act: _Wrong(src) if m == "torch"
                        else real_build(m, src, act))
    # The wrong method measures fastest by far.
    real_time = tuning._timed_call
    monkeypatch.setattr(tuning, "_timed_call", lambda mod, x: (mod(x), 1e-9)
                        if isinstance(mod, _Wrong) else real_time(mod, x))
    model = _Block()
    report = tuning.finalize_linears(model, None, _cfg(tmp_path, tuning="fresh"))
    assert report.source == "measured"
    for shape in report.shapes:
        assert "torch" in shape.failed and "torch" not in shape.methods
    assert not any(isinstance(m, _Wrong) for m in model.modules())


def _fake_times(monkeypatch, fast: dict[type, set[int]]):
    """Each timed call takes 1 µs a row where fast[type(module)] holds the row count, else 3
    (times grow with the rows, as real ones do: the tuner scales a method's larger buckets
    from one where it took tuning.HOPELESS times the best)."""
    def fake(mod, x):
        return mod(x), x.shape[0] * (1e-6 if x.shape[0] in fast.get(type(mod), set()) else 3e-6)

    monkeypatch.setattr(tuning, "_timed_call", fake)


def test_fake_timings_pick_the_expected_methods(tmp_path, monkeypatch):
    if not lm.applies("onednn", nn.Linear(64, 96), torch.float32, True):
        pytest.skip("oneDNN cannot pack fp32 here")
    _fake_times(monkeypatch, {nn.Linear: {1, 8}, PackedLinear: {64, 512}})
    _never(monkeypatch, "tiles")  # the same choice on every CPU
    model = _Block()
    x = torch.randn(3, 64)
    want = model(x)
    report = tuning.finalize_linears(model, None, _cfg(tmp_path, tuning="fresh"))
    assert [s.methods for s in report.shapes] == [["torch", "torch", "onednn", "onednn"]] * 2
    layer = model.layers[1].qkv_proj
    assert isinstance(layer, lm.BucketedLinear)
    assert type(layer.module_for(1)) is nn.Linear and isinstance(layer.module_for(64), PackedLinear)
    for (a, b), (c, d) in zip(model(x), want):  # the same function either way
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, d, rtol=1e-5, atol=1e-5)
    assert "qkv_proj" in report.table() and "1: torch" in report.table()
    # batch_invariant: one method for all rows (here the fast one at two buckets of four).
    model = _Block()
    report = tuning.finalize_linears(model, None, _cfg(tmp_path, tuning="fresh",
                                                       batch_invariant=True))
    assert all(len(set(s.methods)) == 1 for s in report.shapes)
    assert not any(isinstance(m, lm.BucketedLinear) for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_runs_never_tune_to_a_method_computing_in_bf16(tmp_path, monkeypatch, dtype):
    """int4pack rounds fp32 activations to bf16 (on a Xeon with AMX it flipped a greedy token
    of the embedded model): measured fastest everywhere, an fp32 run still leaves it out,
    a bf16 run takes it; forced, it runs in either."""
    if not lm.applies("int4pack", _int4_src(), torch.bfloat16, True):
        pytest.skip("PyTorch's int4pack kernel does not run here")
    _fake_times(monkeypatch, {lm.Int4PackLinear: {1, 8, 64, 512}})
    assert lm.tunable("int4pack", dtype) == (dtype == torch.bfloat16)
    report = tuning.finalize_linears(_Block(dtype), "int4", _cfg(tmp_path, tuning="fresh"))
    chose = {m for s in report.shapes for m in s.methods}
    assert ("int4pack" in chose) == (dtype == torch.bfloat16), report.table()
    if dtype == torch.float32:
        assert all("int4pack" not in s.times_us for s in report.shapes)
    forced = tuning.finalize_linears(_Block(dtype), "int4",
                                     _cfg(tmp_path, linear_method="int4pack"))
    assert all(s.methods == ["int4pack"] * 4 for s in forced.shapes)


def _int4_src():
    from servelm.quantization import Int4Linear

    return Int4Linear.from_linear(nn.Linear(64, 96))


def test_a_hopeless_method_is_scaled_not_timed_and_not_checked_for_invariance(tmp_path,
                                                                             monkeypatch):
    # oneDNN made 10x slower than F.linear at every row count: after the one-row bucket its
    # larger buckets are scaled from it (never called), and its rows are never compared.
    if not lm.applies("onednn", nn.Linear(64, 96), torch.float32, True):
        pytest.skip("oneDNN cannot pack fp32 here")
    timed, checked = [], []

    def fake(mod, x):
        timed.append((type(mod), x.shape[0]))
        return mod(x), x.shape[0] * (1e-5 if isinstance(mod, PackedLinear) else 1e-6)

    real_inv = tuning.row_invariant
    monkeypatch.setattr(tuning, "_timed_call", fake)
    monkeypatch.setattr(tuning, "row_invariant",
                        lambda m, x: checked.append(type(m)) or real_inv(m, x))
    _never(monkeypatch, "tiles", "gemv", "gemv_rows", "panels")  # the same choice on every CPU
    report = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh"))
    # oneDNN: the one-row bucket only (its check the first call there), for both shapes.
    onednn_rows = [r for t, r in timed if t is PackedLinear]
    assert set(onednn_rows) == {1} and len(onednn_rows) >= 2 * (1 + tuning.MIN_REPS)
    assert {r for t, r in timed if t is nn.Linear} == set(lm.BUCKET_ROWS)
    assert PackedLinear not in checked and nn.Linear in checked
    for shape in report.shapes:
        assert shape.methods == ["torch"] * len(lm.BUCKET_ROWS)
        t1 = shape.times_us["onednn"][0]
        assert shape.times_us["onednn"] == [t1 * r for r in lm.BUCKET_ROWS]
        assert "onednn" not in shape.invariant


def test_past_a_compute_bound_bucket_a_lesser_gap_is_hopeless(tmp_path, monkeypatch):
    # oneDNN made 5x slower than F.linear: under HOPELESS, so timed at 1, 8 and 64 rows; past
    # 64 rows (compute-bound) over HOPELESS_COMPUTE, so 512 rows is scaled from 64.
    if not lm.applies("onednn", nn.Linear(64, 96), torch.float32, True):
        pytest.skip("oneDNN cannot pack fp32 here")
    assert tuning.HOPELESS_COMPUTE < 5 < tuning.HOPELESS
    timed = []

    def fake(mod, x):
        timed.append((type(mod), x.shape[0]))
        return mod(x), x.shape[0] * (5e-6 if isinstance(mod, PackedLinear) else 1e-6)

    monkeypatch.setattr(tuning, "_timed_call", fake)
    _never(monkeypatch, "tiles", "gemv", "gemv_rows", "panels")
    report = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh"))
    assert {r for t, r in timed if t is PackedLinear} == {1, 8, 64}
    assert {r for t, r in timed if t is nn.Linear} == set(lm.BUCKET_ROWS)
    for shape in report.shapes:
        t = shape.times_us["onednn"]
        assert t[3] == t[2] * lm.BUCKET_ROWS[3] / lm.BUCKET_ROWS[2]
        assert shape.methods == ["torch"] * len(lm.BUCKET_ROWS)


def test_the_table_is_cached_per_machine_key(tmp_path, monkeypatch):
    calls = []
    real = tuning.measure
    monkeypatch.setattr(tuning, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    cands = [m for m in lm.METHODS if lm.applies(m, nn.Linear(64, 96), torch.float32, True)]
    if len(cands) < 2:
        pytest.skip("one linear method here: nothing to measure")
    first = tuning.finalize_linears(_Block(), None, _cfg(tmp_path))
    assert first.source == "measured" and len(calls) == 2  # one per distinct shape
    second = tuning.finalize_linears(_Block(seed=1), None, _cfg(tmp_path))
    assert second.source == "cached" and len(calls) == 2
    assert [s.methods for s in second.shapes] == [s.methods for s in first.shapes]
    fresh = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh"))
    assert fresh.source == "measured" and len(calls) == 4
    # Another thread count is another machine key: measured again, in another file.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        other = tuning.finalize_linears(_Block(), None, _cfg(tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert other.source == "measured" and other.cache_path != first.cache_path
    assert len(list(tmp_path.glob("linear-methods-*.json"))) == 2


def test_a_cached_shape_missing_a_method_that_runs_now_is_measured_again(tmp_path,
                                                                           monkeypatch):
    """A table cached before a method applied to a shape (a newer servelm: amx for int4
    layers) would hide that method for good: the shape is measured again."""
    calls = []
    real = tuning.measure
    monkeypatch.setattr(tuning, "measure", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    cands = [m for m in lm.METHODS if lm.applies(m, nn.Linear(64, 96), torch.float32, True)]
    if len(cands) < 2:
        pytest.skip("one linear method here: nothing to measure")
    first = tuning.finalize_linears(_Block(), None, _cfg(tmp_path))
    assert first.source == "measured" and len(calls) == 2
    cache = tuning_cache.TuningCache(tmp_path, tuning_cache.machine_key(torch.get_num_threads()))
    key = first.shapes[0].key
    entry = cache.get(key)
    dropped = entry["candidates"][-1]
    entry["candidates"] = entry["candidates"][:-1]  # as if it did not apply then
    entry["times_us"].pop(dropped, None)
    cache.save()
    again = tuning.finalize_linears(_Block(), None, _cfg(tmp_path))
    assert again.source == "measured" and len(calls) == 3  # that shape only
    assert dropped in calls[-1]
    assert [s.cached for s in again.shapes] == [s.key != key for s in again.shapes]


def test_an_unreadable_cache_is_measured_again(tmp_path):
    key = tuning_cache.machine_key(torch.get_num_threads())
    cache = tuning_cache.TuningCache(tmp_path, key)
    cache.path.write_text("{not json")
    assert tuning_cache.TuningCache(tmp_path, key).entries == {}


def test_tuning_off_and_forced_methods_measure_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "measure", lambda *a, **k: pytest.fail("measured"))
    off = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="off"))
    assert off.source == "off" and not list(tmp_path.iterdir())
    model = _Block()
    forced = tuning.finalize_linears(model, None, _cfg(tmp_path, linear_method="torch"))
    assert forced.source == "forced"
    assert all(type(m.qkv_proj) is nn.Linear for m in model.layers)
    model = _Block()
    tuning.finalize_linears(model, None, _cfg(tmp_path, cpu_kernels=False))
    assert all(type(m.down_proj) is nn.Linear for m in model.layers)  # the eager reference


def test_kernel_config_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="linear_method must be auto, or one or more"):
        KernelConfig(linear_method="cublas")
    with pytest.raises(ValueError, match="'w8a8,cublas'"):
        KernelConfig(linear_method="w8a8,cublas")
    with pytest.raises(ValueError, match="int8_activations must be one of auto, off"):
        KernelConfig(int8_activations="yes")
    assert KernelConfig(linear_method="w8a8,q8act").linear_method == "w8a8,q8act"
    with pytest.raises(ValueError, match="kernel tuning must be one of off, cached, fresh"):
        KernelConfig(tuning="always")
    with pytest.raises(ValueError, match="fused_decode must be True or False"):
        KernelConfig(fused_decode=1)
    with pytest.raises(ValueError, match="shm_collectives must be True or False"):
        KernelConfig(shm_collectives="no")
    assert KernelConfig(linear_method="gemv_rows").linear_method == "gemv_rows"


def test_engine_flags_reach_the_kernel_config():
    from servelm.cli import make_parser

    args = make_parser().parse_args(["serve", "--no-shm-collectives", "--linear-method",
                                     "gemv_rows"])
    assert args.shm_collectives is False and args.linear_method == "gemv_rows"
    assert make_parser().parse_args(["serve"]).shm_collectives is True


# ---------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def int4_engines(tmp_path_factory):
    from servelm import LLM

    d = str(tmp_path_factory.mktemp("tuning"))
    kw = dict(dtype="float32", quantization="int4", kv_cache_memory=32 << 20,
              enable_prefix_caching=False, tuning_cache_dir=d)
    return {m: LLM(linear_method=m, **kw) for m in ("auto", "torch")}


def test_int4_engine_tuned_gives_the_reference_tokens(int4_engines):
    """Whatever methods the tuner picked for the int4 layers, greedy decoding gives the
    tokens of dequantise + F.linear (the reference) for a short prompt and a long one."""
    from servelm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # The long one is real prose (over 182 tokens: the prompt-sized bucket): a repeated
    # " x" made near-ties that rounding differences between methods flipped.
    prose = (Path(__file__).parent / "data" / "prose.txt").read_text()[:1000]
    assert len(int4_engines["torch"].get_tokenizer().encode(prose)) > 182
    prompts = ["The capital of France is", prose]
    got = [o.outputs[0].token_ids for o in int4_engines["auto"].generate(prompts, sp)]
    want = [o.outputs[0].token_ids for o in int4_engines["torch"].generate(prompts, sp)]
    assert got == want
    assert int4_engines["torch"].engine.executor.tuning.source == "forced"


def test_batch_invariant_engine_gives_bit_identical_results_alone_and_together():
    """The statement batch_invariant makes: a seeded request's tokens and logprobs are the
    same bits whether it runs alone or among 15 others (default dtype, prefix caching off
    so every prompt is computed both times). The run's tuning cache (tests/conftest.py):
    whichever test measured these shapes first, the choice is made from its table."""
    from servelm import LLM, SamplingParams

    llm = LLM(kv_cache_memory=64 << 20, batch_invariant=True, enable_prefix_caching=False)
    if not llm.engine.executor.tuning.batch_invariant:
        pytest.skip("no row-invariant linear method for some layer on this CPU")
    prompts = [f"Story {i}: once upon a time" + " and then" * (i % 5) for i in range(16)]
    sps = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=5,
                          ignore_eos=True, logprobs=0) for i in range(16)]

    def key(o):
        c = o.outputs[0]
        return c.token_ids, [lp.logprob for lp in c.logprobs]

    alone = [key(llm.generate([p], s, use_tqdm=False)[0]) for p, s in zip(prompts, sps)]
    together = [key(o) for o in llm.generate(prompts, sps, use_tqdm=False)]
    assert alone == together


def test_servelm_tune_prints_the_table(capsys):
    from servelm.cli import main

    # The run's own tuning cache (tests/conftest.py): the fp32 shapes are measured once per
    # run (test_int4_engine_tuned_gives_the_reference_tokens measures a fresh table).
    assert main(["tune", "--dtype", "float32", "--kv-cache-memory", "16MiB",
                 "--kernel-tuning", "cached"]) == 0
    out = capsys.readouterr().out
    assert "linear methods (" in out and "lm_head" in out and "121 linear layers" in out
    assert "  1 rows:" in out


# ---------------------------------------------------------------- measuring in about a second

@pytest.mark.parametrize("fmt", ["float32", "int4", "int8", "int8-rowmajor"])
def test_head_is_the_first_outputs_of_the_layer(fmt):
    src = _source("int8" if fmt.startswith("int8") else fmt, n=80)
    if fmt == "int8-rowmajor":
        src = lm.build("int8pack", src, torch.float32)
    part = lm.head(src, 48)
    assert type(part) is type(src) and part.out_features == 48
    assert lm.weight_format(part) == lm.weight_format(src)
    torch.testing.assert_close(lm.reference_weight(part), lm.reference_weight(src)[:48])
    x = torch.randn(5, src.in_features)
    torch.testing.assert_close(part(x), src(x)[:, :48], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        lm.head(src, 40)


def _sliced(monkeypatch):
    """Every layer of _Block counts as too large to time whole: a 32-output slice."""
    monkeypatch.setattr(tuning, "SLICE_BYTES", 1)
    monkeypatch.setattr(tuning, "INVARIANCE_BYTES", 1)
    monkeypatch.setattr(tuning, "SLICE_MIN_OUT", 32)
    _never(monkeypatch, "tiles")


def test_a_large_layer_is_timed_on_a_slice_only_at_prompt_sized_buckets(monkeypatch):
    _sliced(monkeypatch)
    calls = []

    def fake(mod, x):
        calls.append((mod.out_features, x.shape[0]))
        return mod(x), 1e-6 * x.shape[0] * mod.out_features / 96

    monkeypatch.setattr(tuning, "_timed_call", fake)
    inv_outputs = []
    monkeypatch.setattr(tuning, "row_invariant",
                        lambda m, x: inv_outputs.append(m.out_features) or True)
    src = nn.Linear(64, 96)
    times, failed, invariant = tuning.measure([src], ["torch", "onednn"], torch.float32,
                                              default="torch")
    assert failed == [] and invariant == ["torch"] and inv_outputs == [32]
    # One and 8 rows stream the whole layer; 64 and 512 rows are timed on 32 of its 96
    # outputs, and so is row invariance checked.
    assert {o for o, r in calls if r == 1} == {96}
    assert {o for o, r in calls if r in (64, 512)} == {32}
    # ... and scaled back to the whole layer: the fake takes 1 µs a row of the whole layer.
    for t in times.values():
        assert t == pytest.approx([1, 8, 64, 512])


def test_a_layer_larger_than_a_sweep_is_swept_on_a_slice(monkeypatch):
    # A 1.5B model's LM head (140 MB in int4) at one and 8 rows: a slice of SWEEP_BYTES,
    # checked against the same outputs of the reference, its times scaled to the layer.
    _sliced(monkeypatch)
    monkeypatch.setattr(tuning, "SWEEP_BYTES", 1)
    calls = []

    def fake(mod, x):
        calls.append((mod.out_features, x.shape[0]))
        return mod(x), 1e-6 * x.shape[0] * mod.out_features / 96

    monkeypatch.setattr(tuning, "_timed_call", fake)
    srcs = [nn.Linear(64, 96) for _ in range(3)]
    times, failed, _ = tuning.measure(srcs, ["torch", "onednn"], torch.float32, default="torch")
    assert failed == [] and {o for o, r in calls} == {32}
    for t in times.values():
        assert t == pytest.approx([1, 8, 64, 512])


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_a_large_int4_layer_is_measured_on_its_slice(monkeypatch, act):
    """As finalize_linears measures it (one unpacking shared by every method): the slice is
    cut inside inference mode, and unpacking it once must not need a version counter (an
    int4 Qwen2.5-1.5B's LM head, 151,936 x 1,536, crashed the engine's start here)."""
    from servelm.quantization import unpacked_once

    _sliced(monkeypatch)
    src = _source("int4", n=96, k=128, bias=False)
    cands = [m for m in lm.METHODS if lm.applies(m, src, act, True) and lm.tunable(m, act)]
    with unpacked_once():
        times, failed, _ = tuning.measure([src], cands, act, default=cands[0])
    assert failed == [] and set(times) == set(cands)
    assert all(math.isfinite(t) for ts in times.values() for t in ts)


class _WrongPastEight(nn.Module):
    """Right up to 8 rows, zeros beyond: a kernel whose many-row path has a bug."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.in_features, self.out_features = inner, inner.in_features, inner.out_features
        self.bias = None

    def forward(self, x):
        y = self.inner(x)
        return y if x.shape[0] <= 8 else torch.zeros_like(y)


def test_a_method_wrong_on_the_whole_layer_but_right_on_its_slice_is_not_kept(tmp_path,
                                                                             monkeypatch):
    if not lm.applies("onednn", nn.Linear(64, 96), torch.float32, True):
        pytest.skip("oneDNN cannot pack fp32 here")
    _sliced(monkeypatch)
    _never(monkeypatch, "gemv", "gemv_rows", "panels")
    real_build = lm.build
    monkeypatch.setattr(lm, "build", lambda m, src, act: _WrongPastEight(real_build(m, src, act))
                        if m == "onednn" and src.out_features > 32 else real_build(m, src, act))
    # oneDNN is fastest by far at every bucket; the whole layer's many-row path is wrong,
    # which the tuner, timing the slice there, sees only in its check of the whole layer.
    real_time = tuning._timed_call
    monkeypatch.setattr(tuning, "_timed_call", lambda mod, x: (mod(x), 1e-9)
                        if isinstance(mod, (PackedLinear, _WrongPastEight))
                        else real_time(mod, x))
    model = _Block()
    x = torch.randn(3, 64)
    want = model(x)
    report = tuning.finalize_linears(model, None, _cfg(tmp_path, tuning="fresh",
                                                       batch_invariant=False))
    for shape in report.shapes:
        assert shape.methods == ["torch"] * len(lm.BUCKET_ROWS) and "onednn" in shape.failed
    assert not any(isinstance(m, (_WrongPastEight, PackedLinear)) for m in model.modules())
    for (a, b), (c, d) in zip(model(x), want):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, d)
    # The next start, from the cache, checks the whole layer again (nothing passed), and
    # again runs the reference.
    checks = []
    real_check = tuning._whole_layer_ok
    monkeypatch.setattr(tuning, "_whole_layer_ok",
                        lambda *a: checks.append(1) or real_check(*a))
    model = _Block()
    report = tuning.finalize_linears(model, None, _cfg(tmp_path, batch_invariant=False))
    assert report.source == "cached" and len(checks) == 2
    assert all(s.methods == ["torch"] * len(lm.BUCKET_ROWS) for s in report.shapes)


def test_methods_that_passed_on_the_whole_layer_are_not_checked_again(tmp_path, monkeypatch):
    _sliced(monkeypatch)
    checks = []
    real_check = tuning._whole_layer_ok
    monkeypatch.setattr(tuning, "_whole_layer_ok", lambda *a: checks.append(1) or real_check(*a))
    first = tuning.finalize_linears(_Block(), None, _cfg(tmp_path))
    assert first.source == "measured" and len(checks) == 2  # one per distinct shape
    second = tuning.finalize_linears(_Block(), None, _cfg(tmp_path))
    assert second.source == "cached" and len(checks) == 2
    assert [s.methods for s in second.shapes] == [s.methods for s in first.shapes]


def test_row_invariance_is_checked_in_order_of_preference_until_one_holds(monkeypatch):
    cands = [m for m in ("torch", "onednn", "panels")
             if lm.applies(m, nn.Linear(64, 96), torch.float32, True)]
    if len(cands) < 3:
        pytest.skip("fewer than three fp32 methods here")
    speed = {nn.Linear: 3, PackedLinear: 1, lm.panels.PanelLinear: 2}  # onednn, panels, torch
    monkeypatch.setattr(tuning, "_timed_call", lambda mod, x: (mod(x), speed[type(mod)] * 1e-6))
    checked = []
    monkeypatch.setattr(tuning, "row_invariant", lambda m, x: checked.append(type(m))
                        or not isinstance(m, PackedLinear))
    _, _, invariant = tuning.measure([nn.Linear(64, 96)], cands, torch.float32, default="torch")
    assert checked == [PackedLinear, lm.panels.PanelLinear] and invariant == ["panels"]
    # The default within the margin of the fastest is preferred, so checked first.
    speed[nn.Linear] = 1.02
    checked.clear()
    _, _, invariant = tuning.measure([nn.Linear(64, 96)], cands, torch.float32, default="torch")
    assert checked == [nn.Linear] and invariant == ["torch"]


def test_a_slow_method_drops_out_of_the_later_rounds(monkeypatch):
    calls = {"fast": 0, "close": 0, "slow": 0, "hopeless": 0}
    mods = {k: [lambda x, k=k: k] for k in calls}
    cost = {"fast": 1.0, "close": 1.3, "slow": 2.0, "hopeless": 3.5}

    def fake(mod, x):
        k = mod(x)
        calls[k] += 1
        return k, cost[k]

    monkeypatch.setattr(tuning, "_timed_call", fake)
    best = tuning._time_interleaved(mods, torch.zeros(1))
    assert best == cost
    # Past KEEP_FIRST after the first round: out; past KEEP: out after the second.
    assert calls["hopeless"] == 1 and calls["slow"] == 2
    assert calls["fast"] == calls["close"] >= tuning.MIN_REPS
    # The known-answer calls' times are a sample, not a round: they drop no method.
    calls.update(fast=0, close=0, slow=0, hopeless=0)
    best = tuning._time_interleaved(mods, torch.zeros(1),
                                    first={"fast": 0.5, "close": 1.3, "slow": 9, "hopeless": 9})
    assert calls["hopeless"] == 1 and calls["fast"] >= tuning.MIN_REPS and best["fast"] == 0.5


def test_one_busy_spell_does_not_drop_the_fastest_method(monkeypatch):
    """The method fastest the rest of the time, caught 2.8x slow by a busy spell in its
    first sweep (as oneDNN's 512-row call once was on a shared VM), is still chosen."""
    seen = {"onednn": 0, "torch": 0}
    mods = {k: [lambda x, k=k: k] for k in seen}

    def fake(mod, x):
        k = mod(x)
        seen[k] += 1
        if k == "torch":
            return k, 2.0
        return k, 5.6 if seen[k] == 1 else 1.0

    monkeypatch.setattr(tuning, "_timed_call", fake)
    best = tuning._time_interleaved(mods, torch.zeros(1))
    assert min(best, key=best.get) == "onednn" and seen["onednn"] >= 2
    # ... and so when its known-answer check, the first call of a prompt-sized bucket, was
    # 10x slow (oneDNN compiles a kernel for each new shape in its first call).
    seen.update(onednn=1, torch=1)
    best = tuning._time_interleaved(mods, torch.zeros(1), first={"onednn": 20.0, "torch": 2.0})
    assert min(best, key=best.get) == "onednn" and seen["onednn"] >= 2


def test_check_rows_cover_every_position_of_the_kernels_row_blocks():
    assert tuning._check_rows(8) is None
    for n in (64, 512):
        rows = tuning._check_rows(n).tolist()
        assert len(rows) < n / 4 + 24 and set(range(n - 7, n)) <= set(rows)
        for block in (2, 4, 6, 8, 16):
            assert {r % block for r in rows} == set(range(block)), (n, block)
            if n >= 512:  # and later blocks at every position, too
                assert {r % block for r in rows if r >= 16} == set(range(block)), (n, block)


def test_a_long_one_row_call_does_not_scale_the_few_row_bucket(tmp_path, monkeypatch):
    # A large LM head's one-row call takes over EXTRAPOLATE_S for every method, memory-bound:
    # the 8-row bucket is still measured (there F.linear wins here, at one row oneDNN), and
    # only a long bucket of over 8 rows scales the next one.
    if not lm.applies("onednn", nn.Linear(64, 96), torch.float32, True):
        pytest.skip("oneDNN cannot pack fp32 here")
    timed = []

    def fake(mod, x):
        rows = x.shape[0]
        timed.append((type(mod), rows))
        packed = isinstance(mod, PackedLinear)
        if rows == 1:
            return mod(x), 0.02 if packed else 0.03
        if rows == 8:
            return mod(x), 0.03 if packed else 0.02
        return mod(x), rows * (2e-3 if packed else 1e-3)  # 64 rows: past EXTRAPOLATE_S

    monkeypatch.setattr(tuning, "_timed_call", fake)
    _never(monkeypatch, "tiles", "gemv", "gemv_rows", "panels")  # the same choice on every CPU
    report = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh",
                                                           batch_invariant=False))
    for shape in report.shapes:
        assert shape.methods[:3] == ["onednn", "torch", "torch"]
        assert shape.times_us["onednn"][3] == shape.times_us["onednn"][2] * 512 / 64
    assert {r for _, r in timed} == {1, 8, 64}  # 512 rows: scaled from 64, never called


# ---------------------------------------------------------------- weights beyond the LLC

def test_llc_bytes_reads_the_largest_cache_of_level_three_or_more(tmp_path):
    for i, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "491520K"), (3, "32M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    assert tuning.llc_bytes(str(tmp_path)) == 491520 << 10
    (tmp_path / "index2" / "size").write_text("garbage\n")  # unreadable: skipped
    assert tuning.llc_bytes(str(tmp_path)) == 32 << 20
    assert tuning.llc_bytes(str(tmp_path / "none")) == 0  # nothing reported


def test_memory_bound_timings_evict_the_cache_before_each_round(monkeypatch):
    """Every method's sweep in a round is timed after one eviction (each sweep's weights are
    read once a round), and nothing is evicted where no evict is given."""
    events = []
    monkeypatch.setattr(tuning, "_time_sweep", lambda mods, x: events.append(mods[0]) or 1e-3)
    sweeps = {"a": ["A"], "b": ["B"]}
    tuning._time_interleaved(sweeps, torch.zeros(1, 4), evict=lambda: events.append("evict"))
    assert events[:3] == ["evict", "A", "B"] and events[3:6] == ["evict", "A", "B"]
    assert len(events) % 3 == 0 and events[::3] == ["evict"] * (len(events) // 3)
    events.clear()
    tuning._time_interleaved(sweeps, torch.zeros(1, 4))
    assert "evict" not in events and events


def test_weights_beyond_the_llc_are_timed_from_memory_at_one_and_8_rows(tmp_path, monkeypatch):
    cands = [m for m in lm.METHODS if lm.applies(m, nn.Linear(64, 96), torch.float32, True)]
    if len(cands) < 2:
        pytest.skip("one linear method here: nothing to measure")
    evicts, rounds = [], []
    real = tuning._time_interleaved

    def spy(sweeps, x, first=None, evict=None):
        rounds.append((x.shape[0], evict is not None))
        return real(sweeps, x, first, None if evict is None else lambda: evicts.append(1))

    monkeypatch.setattr(tuning, "_time_interleaved", spy)
    monkeypatch.setattr(tuning, "llc_bytes", lambda: 1 << 20)  # _Block's 115 KB fit
    warm = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh"))
    assert not warm.from_memory and not any(e for _, e in rounds) and not evicts
    rounds.clear()
    monkeypatch.setattr(tuning, "llc_bytes", lambda: 4096)  # outgrown
    cold = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh"))
    assert cold.from_memory and "timed from memory" in cold.table() and evicts
    assert {(rows, e) for rows, e in rounds} <= {(1, True), (8, True), (64, False), (512, False)}
    assert {rows for rows, e in rounds if e} == {1, 8}
    # The cache keeps the two tables apart: each is read back for its own kind of model.
    keys = set(tuning_cache.TuningCache(tmp_path, tuning_cache.machine_key(
        torch.get_num_threads())).entries)
    assert {k + tuning.COLD_KEY for k in (s.key for s in warm.shapes)} <= keys
    assert {s.key for s in warm.shapes} <= keys
    again = tuning.finalize_linears(_Block(), None, _cfg(tmp_path))
    assert again.source == "cached" and again.from_memory


def test_dequantised_copies_stay_within_their_memory_budget():
    """The shapes of a quantised model that could hold a bf16 copy (amx, onednn) hold them
    only while all of them fit the budget: past it the largest shape does without (its
    quantised methods take every bucket), then the next; plain bf16 shapes are not counted."""
    times = {"q8act": [10, 30, 900, 9000], "amx": [12, 25, 300, 3000],
             "onednn": [40, 60, 400, 3500]}

    def shapes():
        out = []
        for key, n in (("int4g32/bfloat16:4864x896", 24), ("int4g32/bfloat16:896x896", 24),
                       ("bfloat16/bfloat16:896x896", 1)):
            sc = _shape(dict(times), ["q8act", "amx"], n=n, default="q8act")
            sc.key = key
            out.append(sc)
        return out

    def groups(shapes):
        sizes = {s.key: tuple(int(x) for x in s.key.rsplit(":", 1)[1].split("x"))
                 for s in shapes}
        return {s.key: [("l", None, "l", torch.nn.Linear(*sizes[s.key], device="meta"))]
                * len(s.names) for s in shapes}

    big = 24 * 4864 * 896 * 2  # bf16 bytes of the large shape's copies
    small = 24 * 896 * 896 * 2
    for budget, dropped in ((big + small, []), (big + small - 1, ["int4g32/bfloat16:4864x896"]),
                            (small - 1, ["int4g32/bfloat16:4864x896",
                                         "int4g32/bfloat16:896x896"])):
        ss = shapes()
        got = tuning._limit_dequantised_copies(ss, groups(ss), torch.bfloat16, budget)
        assert got == dropped, budget
        tuning._decide(ss, False, tuning.TuningReport(ss))
        for sc in ss:
            held = {m for m in sc.methods if m in ("amx", "onednn")}
            assert (not held) == (sc.key in dropped), (budget, sc.key, sc.methods)
            assert "amx" not in sc.invariant or sc.key not in dropped
    with pytest.raises(ValueError, match="dequantized_copy_bytes"):
        KernelConfig(dequantized_copy_bytes=-1)


def test_w8a8_int8_copies_of_bf16_layers_count_against_the_copy_budget():
    """A bf16 shape holds no dequantised copy, but w8a8 adds an int8 one (a byte a weight):
    it counts, and past the budget the shape loses w8a8 (its own tiles stay)."""
    inf = math.inf
    sc = _shape({"tiles": [10, 30, 300, 3000], "w8a8": [inf, inf, 200, 2000]}, ["tiles"],
                n=24, default="tiles")
    sc.key = "bfloat16/bfloat16:4864x896:smooth"
    groups = {sc.key: [("l", None, "l", torch.nn.Linear(4864, 896, device="meta"))] * 24}
    int8_bytes = 24 * 4864 * 896
    assert tuning._limit_dequantised_copies([sc], groups, torch.bfloat16, int8_bytes) == []
    assert "w8a8" in sc.times_us
    assert tuning._limit_dequantised_copies([sc], groups, torch.bfloat16,
                                            int8_bytes - 1) == [sc.key]
    assert set(sc.times_us) == {"tiles"} and "w8a8" not in sc.candidates
