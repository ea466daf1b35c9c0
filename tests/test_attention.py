"""The attention backends (servelm.attention): which one start-up picks from KernelConfig,
and every backend against the reference on the same mixed batch (decodes of ragged lengths,
whole and chunked prompts, grouped-query heads, a sliding window, quantised caches)."""

from __future__ import annotations

import pytest
import torch

from servelm import attention
from servelm.attention import AttentionSpec, get_backend, select
from servelm.config import KernelConfig
from servelm.engine.model_runner import KVCache, ModelRunner, SeqInput, build_forward_batch
from servelm.kernels import load_ops
from servelm.kernels import triton_attention as ta
from servelm.models import kv_quant
from servelm.models.layers import Attention
from tests.test_cuda_graphs import _model

CPU = torch.device("cpu")


def _spec(device="cpu", kv_dtype=torch.float32, dtype=torch.float32):
    return AttentionSpec(torch.device(device), dtype, kv_dtype, num_heads=4, num_kv_heads=2,
                         head_dim=16, block_size=4)


# ---------------------------------------------------------------- choosing one at start-up

def test_auto_picks_the_cpu_kernels_where_they_run_else_the_reference():
    if load_ops("ops"):
        # fp32 and bf16: the faster prompt path measured here (below); tuning off: cpu.
        assert select(KernelConfig(), _spec()).name in ("cpu", "cpu_sdpa", "cpu_amx")
        assert select(KernelConfig(tuning="off"), _spec()).name == "cpu"
        assert select(KernelConfig(), _spec(kv_dtype=torch.int8)).name == "cpu"
    else:
        assert select(KernelConfig(), _spec()).name == "reference"
    assert select(KernelConfig(cpu_kernels=False), _spec()).name == "reference"
    # fp8 is no cache the C++ kernels read: auto takes the reference (the runner refuses
    # fp8 with cpu_kernels on before that, naming kv_cache_dtype).
    assert select(KernelConfig(), _spec(kv_dtype=torch.float8_e4m3fn)).name == "reference"
    assert select(KernelConfig(attention_backend="reference"), _spec()).name == "reference"


@pytest.mark.skipif(not load_ops("ops"), reason="C++ kernels unavailable")
def test_auto_times_the_two_cpu_prompt_paths_once_and_takes_the_faster(tmp_path, monkeypatch):
    if get_backend("cpu_sdpa").unsupported(_spec()) is not None:
        pytest.skip(get_backend("cpu_sdpa").unsupported(_spec()))
    calls = []
    fake = {"cpu": [10.0, 100.0], "cpu_sdpa": [20.0, 50.0]}  # µs at 512 / 2048 tokens
    # cpu_amx runs bf16 only: the fp32 spec below never times it.
    amx = False

    def timed(backends, spec):
        calls.append([b.name for b in backends])
        return fake

    monkeypatch.setattr(attention, "time_prompt", timed)
    cfg = KernelConfig(tuning_cache_dir=str(tmp_path))
    assert select(cfg, _spec()).name == "cpu_sdpa"  # 70 µs in all against 110
    assert calls == [["cpu", "cpu_sdpa"] + (["cpu_amx"] if amx else [])]
    fake.update(cpu_sdpa=[20.0, 95.0])
    assert select(cfg, _spec()).name == "cpu_sdpa" and len(calls) == 1  # cached
    fresh = KernelConfig(tuning_cache_dir=str(tmp_path), tuning="fresh")
    assert select(fresh, _spec()).name == "cpu" and len(calls) == 2  # 110 against 115
    bf16 = _spec(dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    amx = get_backend("cpu_amx").unsupported(bf16) is None
    fake["cpu_amx"] = [5.0, 200.0]
    assert select(cfg, bf16).name == "cpu"  # another dtype, another entry
    assert len(calls) == 3 and calls[-1] == ["cpu", "cpu_sdpa"] + (["cpu_amx"] if amx else [])
    assert select(KernelConfig(attention_backend="cpu_sdpa"), _spec()).name == "cpu_sdpa"
    assert len(calls) == 3  # named: nothing timed


@pytest.mark.skipif(not load_ops("ops"), reason="C++ kernels unavailable")
def test_a_cached_choice_missing_a_path_that_runs_now_is_measured_again(tmp_path, monkeypatch):
    """An entry timed before cpu_amx existed (or on a build without it) lacks its time: the
    next start measures every path again rather than never trying it."""
    spec = _spec(dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    for n in ("cpu_sdpa", "cpu_amx"):
        monkeypatch.setattr(get_backend(n), "unsupported", lambda spec: None)
    calls = []

    def timed(backends, spec):
        calls.append([b.name for b in backends])
        return {b.name: [30.0 if b.name == "cpu_amx" else 50.0] * 2 for b in backends}

    monkeypatch.setattr(attention, "time_prompt", timed)
    cfg = KernelConfig(tuning_cache_dir=str(tmp_path))
    monkeypatch.setattr(attention, "CPU_PROMPT_PATHS", ("cpu", "cpu_sdpa"))
    assert select(cfg, spec).name in ("cpu", "cpu_sdpa") and len(calls) == 1
    monkeypatch.setattr(attention, "CPU_PROMPT_PATHS", ("cpu", "cpu_sdpa", "cpu_amx"))
    assert select(cfg, spec).name == "cpu_amx"
    assert calls[-1] == ["cpu", "cpu_sdpa", "cpu_amx"]
    assert select(cfg, spec).name == "cpu_amx" and len(calls) == 2  # now cached


def test_the_real_prompt_timings_cover_every_path():
    spec = _spec(dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    names = [n for n in attention.CPU_PROMPT_PATHS if get_backend(n).unsupported(spec) is None]
    if not names:
        pytest.skip("neither cpu backend runs here")
    times = attention.time_prompt([get_backend(n) for n in names], spec)
    assert sorted(times) == sorted(names)
    assert all(len(t) == len(attention.PROMPT_TOKENS) and all(0 < x < 1e7 for x in t)
               for t in times.values())


def test_auto_on_cuda_picks_triton_where_its_probe_passes(monkeypatch):
    monkeypatch.setattr(ta, "available", lambda: True)
    monkeypatch.setattr(ta, "works", lambda *a: True)
    assert select(KernelConfig(), _spec("cuda")).name == "triton"
    assert select(KernelConfig(triton_attention=False), _spec("cuda")).name == "reference"
    monkeypatch.setattr(ta, "works", lambda *a: False)
    assert select(KernelConfig(), _spec("cuda")).name == "reference"
    with pytest.raises(ValueError, match="attention_backend 'triton' cannot run.*probe"):
        select(KernelConfig(attention_backend="triton"), _spec("cuda"))


def test_an_explicit_backend_that_cannot_run_is_refused_naming_the_field(monkeypatch):
    with pytest.raises(ValueError, match="attention_backend 'triton' cannot run.*CUDA"):
        select(KernelConfig(attention_backend="triton"), _spec())
    with pytest.raises(ValueError, match="attention_backend 'cpu' cannot run.*CPU"):
        select(KernelConfig(attention_backend="cpu"), _spec("cuda"))
    with pytest.raises(ValueError, match="attention_backend 'cpu' cannot run.*fp8"):
        select(KernelConfig(attention_backend="cpu"), _spec(kv_dtype=torch.float8_e4m3fn))
    monkeypatch.setattr(attention.cpu, "load_ops", lambda name: False)
    with pytest.raises(ValueError, match="attention_backend 'cpu' cannot run.*not built"):
        select(KernelConfig(attention_backend="cpu"), _spec())
    assert select(KernelConfig(), _spec()).name == "reference"  # auto: no kernels, no cpu
    # Through the runner, at start-up.
    model = _model("cpu")
    kv = KVCache(model.config, 8, 4, torch.float32, CPU)
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        ModelRunner(model, kv, CPU, kernels=KernelConfig(attention_backend="triton"))


def test_kernel_config_validates_the_field():
    with pytest.raises(ValueError, match="attention_backend must be one of auto, reference, "
                                         "cpu, cpu_sdpa, cpu_amx, triton, got 'sdpa'"):
        KernelConfig(attention_backend="sdpa")
    with pytest.raises(ValueError, match="attention_backend 'cpu'.*cpu_kernels=False"):
        KernelConfig(attention_backend="cpu", cpu_kernels=False)
    with pytest.raises(ValueError, match="attention_backend 'cpu_sdpa'.*cpu_kernels=False"):
        KernelConfig(attention_backend="cpu_sdpa", cpu_kernels=False)
    with pytest.raises(ValueError, match="attention_backend 'cpu_amx'.*cpu_kernels=False"):
        KernelConfig(attention_backend="cpu_amx", cpu_kernels=False)
    with pytest.raises(ValueError, match="attention_backend 'triton'.*triton_attention=False"):
        KernelConfig(attention_backend="triton", triton_attention=False)


def test_the_runner_decides_once_and_the_decode_stack_needs_the_cpu_backend():
    model = _model("cpu")
    kv = KVCache(model.config, 16, 4, torch.float32, CPU)
    binds = []
    model.bind_decode_layers = binds.append  # what the runner offers the DecodeStack
    auto = ModelRunner(model, kv, CPU)
    assert auto.attention.name in (("cpu", "cpu_sdpa", "cpu_amx") if load_ops("ops")
                                   else ("reference",))
    assert len(binds) == auto.use_kernels
    ref = ModelRunner(model, kv, CPU, kernels=KernelConfig(attention_backend="reference"))
    # The C++ fused ops still run (cpu_kernels on); attention is the reference's, and the
    # DecodeStack, which reads the cpu backend's ragged decode rows, is not bound.
    assert ref.attention.name == "reference" and ref.use_kernels == auto.use_kernels
    off = ModelRunner(model, kv, CPU, kernels=KernelConfig(cpu_kernels=False))
    assert off.attention.name == "reference" and not off.use_kernels
    assert len(binds) == auto.use_kernels
    # Every combination computes the same step: a prompt, then it and a second prompt's
    # chunk with a decode.
    steps = [[SeqInput(list(range(1, 10)), 0, [0, 1, 2])],
             [SeqInput([11], 9, [0, 1, 2]), SeqInput(list(range(20, 27)), 0, [5, 6])]]
    with torch.inference_mode():
        outs = []
        for runner in (auto, ref, off):
            kv.data.zero_()
            outs.append([runner.execute(step) for step in steps])
    for got in outs[1:]:
        for (a, rows_a), (b, rows_b) in zip(got, outs[0]):
            assert sorted(rows_a) == sorted(rows_b)
            order = lambda rows: sorted(range(len(rows)), key=rows.__getitem__)  # noqa: E731
            torch.testing.assert_close(a[order(rows_a)], b[order(rows_b)], rtol=1e-4, atol=1e-4)


def test_the_flag_and_the_keyword_reach_kernel_config(monkeypatch):
    from servelm.cli import make_parser
    from servelm.entrypoints import llm as llm_module

    for cmd in (["generate", "hi"], ["chat"], ["serve"]):
        assert make_parser().parse_args(cmd).attention_backend == "auto"
        args = make_parser().parse_args([*cmd, "--attention-backend", "reference"])
        assert args.attention_backend == "reference"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["generate", "hi", "--attention-backend", "flash"])
    seen = []
    monkeypatch.setattr(llm_module, "LLMEngine", seen.append)
    llm_module.LLM(attention_backend="reference")
    assert seen[0].kernels.attention_backend == "reference"


# ---------------------------------------------------------------- every backend vs the reference

BS = 4
# (start, tokens): decodes (contexts 1, 6, 30, 70); a whole prompt; chunks continuing a
# context (one inside a window of 8, alone in its group; a long one late in its context);
# and a chunk that does not sample (the last).
_SEQS = [(0, 1), (5, 1), (29, 1), (69, 1), (0, 13), (2, 5), (20, 9), (40, 25), (16, 20)]


def _batch_inputs(seqs_spec, H, KVH, D, kv_dtype, seed=0):
    """SeqInputs over scattered blocks of one pool, the pool filled at random (quantised
    with its scales for int8 / fp8), and q per KV slot (so every backend's flat order
    reads the same q for a token)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(s + n) // BS) for s, n in seqs_spec]
    nb = sum(need) + 2
    free = torch.randperm(nb, generator=g).tolist()
    seqs = [SeqInput(list(range(n)), s, [free.pop() for _ in range(k)],
                     sample=(i != len(seqs_spec) - 1))
            for i, ((s, n), k) in enumerate(zip(seqs_spec, need))]
    k = torch.randn(nb, BS, KVH, D, generator=g)
    v = torch.randn(nb, BS, KVH, D, generator=g)
    scales = None
    if kv_quant.is_quantized(kv_dtype):
        (k, ks), (v, vs) = kv_quant.quantize(k, kv_dtype), kv_quant.quantize(v, kv_dtype)
        scales = (ks, vs)
    q_by_slot = torch.randn(nb * BS, H, D, generator=g)
    return seqs, k, v, scales, q_by_slot


def _attend(backend, layer, seqs, k, v, scales, q_by_slot, g, device=CPU):
    """The backend's output per token, rows in slot order (comparable across backends)."""
    batch, _ = build_forward_batch(seqs, BS, g, device, backend)
    slots = batch.slot_mapping
    q = q_by_slot[slots.cpu()].to(device)
    dev = lambda t: t.to(device)  # noqa: E731
    out = backend.forward(layer, q, dev(k), dev(v),
                          None if scales is None else tuple(map(dev, scales)), batch.attn)
    assert out.shape == (q.shape[0], layer.q_size)
    return out.cpu()[slots.cpu().argsort()]


def _backends():
    out = [pytest.param(n, marks=pytest.mark.skipif(not load_ops("ops"),
                                                     reason="C++ kernels unavailable"))
           for n in ("cpu", "cpu_sdpa")]
    return out + [pytest.param("triton", marks=pytest.mark.skipif(
        not ta.available(), reason="Triton not installed"))]


@pytest.mark.parametrize("name", _backends())
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_every_backend_matches_the_reference_on_one_mixed_batch(name, window, kv_dtype,
                                                                  monkeypatch):
    """Decodes of ragged lengths and prompt chunks (from the start, continuing a context,
    one that does not sample) in one step, G = 3 query heads per KV head; with a window of
    8 the decodes and the chunks whose keys overrun it take each backend's windowed path or
    its fallback to the reference. Each backend orders the flat tokens its own way: rows
    are compared token by token."""
    backend = get_backend(name)
    spec = AttentionSpec(CPU, torch.float32, kv_dtype, 6, 2, 32, BS)
    device = CPU
    if name == "triton":  # compiled on a GPU, else in Triton's interpreter (conftest.py)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif backend.unsupported(spec) is not None:
        pytest.skip(backend.unsupported(spec))
    # Short groups would stay on the C++ op: every group takes the flash path here.
    monkeypatch.setattr(attention.cpu, "SDPA_MIN_KEYS", 0)
    layer = Attention(64, 6, 2, 32, window=window)
    seqs, k, v, scales, q_by_slot = _batch_inputs(_SEQS, 6, 2, 32, kv_dtype)
    want = _attend(get_backend("reference"), layer, seqs, k, v, scales, q_by_slot, 3)
    got = _attend(backend, layer, seqs, k, v, scales, q_by_slot, 3, device)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["cpu", "cpu_sdpa", "cpu_amx"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_the_cpu_prompt_paths_match_the_fp32_reference_in_bf16(name, head_dim, monkeypatch):
    """bf16, the default dtype: every prompt path (servelm's op, PyTorch's flash attention
    with a cached context merged by log-sum-exp, servelm's AMX kernel at head dims 64 and
    128, the op's at 32) against the fp32 reference on the same bf16 inputs, within bf16's
    rounding."""
    backend = get_backend(name)
    spec = AttentionSpec(CPU, torch.bfloat16, torch.bfloat16, 6, 2, head_dim, BS)
    if backend.unsupported(spec) is not None:
        pytest.skip(backend.unsupported(spec))
    monkeypatch.setattr(attention.cpu, "SDPA_MIN_KEYS", 0)
    amx_calls = []
    if name == "cpu_amx":
        op = torch.ops.servelm_amx_attention.paged_prefill_attention
        monkeypatch.setattr(torch.ops.servelm_amx_attention, "paged_prefill_attention",
                            lambda *a: amx_calls.append(1) or op(*a))
    layer = Attention(64, 6, 2, head_dim)
    seqs, k, v, _, q_by_slot = _batch_inputs(_SEQS, 6, 2, head_dim, torch.float32, seed=1)
    k, v, q_by_slot = (t.bfloat16() for t in (k, v, q_by_slot))
    want = _attend(get_backend("reference"), layer, seqs, k.float(), v.float(), None,
                   q_by_slot.float(), 3)
    got = _attend(backend, layer, seqs, k, v, None, q_by_slot, 3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    # The AMX kernel takes head dims 64 and 128, each prompt group in one call.
    assert len(amx_calls) == (len(build_forward_batch(seqs, BS, 3, CPU, backend)[0].attn.groups)
                              if head_dim in (64, 128) and name == "cpu_amx" else 0)


def test_cpu_sdpa_leaves_groups_of_short_sequences_to_the_cpp_op(monkeypatch):
    """Below SDPA_MIN_KEYS a group runs servelm's op, bit for bit the cpu backend's; at or
    above it, PyTorch's flash attention (called once per sequence)."""
    spec = AttentionSpec(CPU, torch.float32, torch.float32, 6, 2, 32, BS)
    if get_backend("cpu_sdpa").unsupported(spec) is not None:
        pytest.skip(get_backend("cpu_sdpa").unsupported(spec))
    layer = Attention(64, 6, 2, 32)
    prompts = [(0, 13), (2, 5), (20, 9)]  # at most 29 keys
    seqs, k, v, _, q_by_slot = _batch_inputs(prompts, 6, 2, 32, torch.float32)
    calls = []
    flash = attention.cpu._flash_for_cpu()
    monkeypatch.setattr(attention.cpu, "_flash_for_cpu",
                        lambda: lambda *a, **kw: calls.append(1) or flash(*a, **kw))
    cpp = _attend(get_backend("cpu"), layer, seqs, k, v, None, q_by_slot, 3)
    monkeypatch.setattr(attention.cpu, "SDPA_MIN_KEYS", 30)
    assert torch.equal(_attend(get_backend("cpu_sdpa"), layer, seqs, k, v, None, q_by_slot, 3),
                       cpp) and not calls
    for least, flash_calls in ((29, 2), (0, 5)):
        # 29: only the group of the 29-key sequence (its context, then its chunk); 0: every
        # sequence, the two continuing a context twice.
        calls.clear()
        monkeypatch.setattr(attention.cpu, "SDPA_MIN_KEYS", least)
        got = _attend(get_backend("cpu_sdpa"), layer, seqs, k, v, None, q_by_slot, 3)
        assert len(calls) == flash_calls
        torch.testing.assert_close(got, cpp, rtol=2e-5, atol=2e-5)


def _amx_prompt_case(seqs, H, KVH, D, bs, key_growth=0.0, seed=0):
    """Prompt chunks (start, tokens) over scattered blocks of one pool, bf16; key_growth
    makes later keys score ever higher (each row's maximum keeps rising)."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-(s + n) // bs) for s, n in seqs]
    nb = sum(per) + 2
    k = torch.randn(nb * bs, KVH, D, generator=g)
    if key_growth:
        k = k.abs() * (1 + key_growth * torch.arange(nb * bs)[:, None, None])
    k = k.view(nb, bs, KVH, D).bfloat16()
    v = torch.randn(nb, bs, KVH, D, generator=g).bfloat16()
    free = torch.randperm(nb, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(per), dtype=torch.int32)
    for i, p in enumerate(per):
        tables[i, :p] = torch.tensor([free.pop() for _ in range(p)], dtype=torch.int32)
    q = (torch.randn(sum(n for _, n in seqs), H, D, generator=g) * (0.3 if key_growth else 1))
    if key_growth:
        q = q.abs()
    cu = torch.tensor([0] + [n for _, n in seqs], dtype=torch.int32).cumsum(0).int()
    start = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    return q.bfloat16(), k, v, tables, cu, start


def _causal_reference(q, k, v, tables, cu, start, scale):
    """fp32 attention of each chunk's queries over keys 0..its own position."""
    H, KVH, D = q.shape[1], k.shape[2], k.shape[3]
    bs, out = k.shape[1], []
    for i in range(len(start)):
        s, n = int(start[i]), int(cu[i + 1] - cu[i])
        pos = torch.arange(s + n)
        slots = tables[i][pos // bs].long() * bs + pos % bs
        kk = k.reshape(-1, KVH, D)[slots].float().repeat_interleave(H // KVH, 1)
        vv = v.reshape(-1, KVH, D)[slots].float().repeat_interleave(H // KVH, 1)
        qq = q[cu[i]:cu[i + 1]].float()
        att = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        att = att.masked_fill(pos[None, None, :] > (s + torch.arange(n))[None, :, None],
                              float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", att.softmax(-1), vv).reshape(n, H * D))
    return torch.cat(out)


@pytest.mark.parametrize("seqs,growth", [
    ([(0, 700)], 0.0),                               # one long prompt, a short last tile
    ([(0, 300), (250, 45), (1000, 17), (0, 3)], 0.0),  # mixed lengths, continued contexts
    ([(0, 600), (500, 40)], 0.01),                   # each row's max keeps rising
])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_amx_prompt_kernel_matches_the_reference_on_long_rows(seqs, growth, head_dim):
    """Rows of hundreds of keys (at head dim 64 the key-major kernel, from 256 keys in the
    longest row; at 128 the row-major one): against fp32 attention on the same bf16 inputs,
    within bf16's rounding, including rows whose maximum rises key after key (the online
    softmax's rescaling) and chunks that continue a context."""
    if not (load_ops("amx_attention") and torch.ops.servelm_amx_attention.available()):
        pytest.skip("no AMX-BF16 here")
    H, KVH = 6, 2
    q, k, v, tables, cu, start = _amx_prompt_case(seqs, H, KVH, head_dim, 16, growth)
    scale = head_dim ** -0.5
    got = torch.ops.servelm_amx_attention.paged_prefill_attention(q, k, v, tables, cu, start,
                                                                  scale)
    want = _causal_reference(q, k, v, tables, cu, start, scale)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("option, reason", [
    ({"logit_softcap": 30.0}, "soft-cap attention scores"),       # Gemma 2
    ({"sinks": True}, "attention sinks"),                         # gpt-oss
    ({"attention_chunk": 8}, "chunked local attention"),          # Llama 4
])
def test_the_kernels_run_every_model_option(option, reason):
    """A soft-cap, sinks and attention chunks (AttentionSpec.kernels_lack): the cpu
    backends' kernels and Triton's run them, so auto takes the cpu backend where the
    kernels build; a backend whose kernels lack an option (options) declines it with the
    reason."""
    from servelm.attention import BACKENDS

    spec = AttentionSpec(torch.device("cpu"), torch.float32, torch.float32, 4, 2, 16, 16,
                         **option)
    assert BACKENDS["reference"].unsupported(spec) is None
    assert spec.kernels_lack(BACKENDS["cpu"].options) is None
    assert reason in spec.kernels_lack()
    if load_ops("ops"):
        assert BACKENDS["cpu"].unsupported(spec) is None
        assert select(KernelConfig(attention_backend="cpu"), spec).name == "cpu"
        assert select(KernelConfig(tuning="off"), spec).name == "cpu"
    assert spec.kernels_lack(BACKENDS["triton"].options) is None
    cuda = AttentionSpec(torch.device("cuda"), torch.float32, torch.float32, 4, 2, 16, 16,
                         **option)
    assert reason not in (BACKENDS["triton"].unsupported(cuda) or "")


# Long prompts (300 keys: several of the op's 128-key chunks, some wholly before a window or
# a chunk's start), chunks continuing a context, and decodes past a window.
_LONG_SEQS = [(0, 1), (299, 1), (150, 1), (0, 300), (100, 200), (40, 37), (0, 17)]


def _option_backends():
    cpu = [pytest.param(n, marks=pytest.mark.skipif(not load_ops("ops"),
                                                    reason="C++ kernels unavailable"))
           for n in ("cpu", "cpu_sdpa", "cpu_amx")]
    return cpu + [pytest.param("triton", marks=pytest.mark.skipif(
        not ta.available(), reason="Triton not installed"))]


def _device_for(name: str, backend) -> torch.device:
    """Where a backend's test runs: Triton compiled on a GPU, else in its interpreter on
    CPU tensors (conftest.py); the cpu backends on the CPU, skipped where they cannot run."""
    if name == "triton":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = backend.unsupported(AttentionSpec(CPU, torch.bfloat16, torch.bfloat16, 6, 2, 32, BS))
    if reason is not None:
        pytest.skip(reason)
    return CPU


@pytest.mark.parametrize("name", _option_backends())
@pytest.mark.parametrize("seqs_spec", [_SEQS, _LONG_SEQS], ids=["mixed", "long"])
@pytest.mark.parametrize("options", [
    dict(window=40), dict(chunk=64), dict(softcap=5.0), dict(sinks=True),
    dict(window=8, chunk=8, softcap=5.0, sinks=True)], ids=str)
def test_the_kernel_paths_attend_with_windows_chunks_softcaps_and_sinks_as_the_reference(
        name, seqs_spec, options, monkeypatch):
    """Each model option on the kernel backends (the cpu ones: decodes on the C++ decode op,
    prompts on each path, which hands what it does not run to the C++ prompt op; Triton's
    decode and prompt kernels) against the reference, in fp32, with sinks large enough to
    take a real share of each softmax."""
    backend = get_backend(name)
    device = _device_for(name, backend)
    monkeypatch.setattr(attention.cpu, "SDPA_MIN_KEYS", 0)
    sinks = options.pop("sinks", False)
    layer = Attention(64, 6, 2, 32, **options)
    if sinks:
        layer.sinks = torch.nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(3)) * 2)
    seqs, k, v, scales, q_by_slot = _batch_inputs(seqs_spec, 6, 2, 32, torch.float32)
    want = _attend(get_backend("reference"), layer, seqs, k, v, scales, q_by_slot, 3)
    got = _attend(backend, layer.to(device), seqs, k, v, scales, q_by_slot, 3, device)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not load_ops("ops"), reason="C++ kernels unavailable")
@pytest.mark.parametrize("h, kvh, d", [(4, 2, 512), (16, 1, 576), (128, 1, 64)],
                         ids=["gemma4-global", "deepseek-v2-lite-latent", "128-per-kv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_ops_take_the_widest_heads_and_head_groups(h, kvh, d, dtype):
    """The C++ ops' limits (MAX_HEAD_DIM, MAX_QUERIES_PER_KV): Gemma 4's 512-dim global
    heads, DeepSeek's 576-dim latent rows for 16 query heads, 128 query heads a KV head
    (DeepSeek-V3's); decodes and prompt chunks against the fp32 reference."""
    layer = Attention(64, h, kvh, d)
    seqs, k, v, _, q_by_slot = _batch_inputs(_SEQS, h, kvh, d, torch.float32, seed=2)
    k, v, q_by_slot = (t.to(dtype) for t in (k, v, q_by_slot))
    want = _attend(get_backend("reference"), layer, seqs, k.float(), v.float(), None,
                   q_by_slot.float(), h // kvh)
    got = _attend(get_backend("cpu"), layer, seqs, k, v, None, q_by_slot, h // kvh)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", [p for p in _option_backends()
                                  if p.values[0] not in ("cpu_sdpa", "cpu_amx")])
def test_the_kernels_attend_with_every_option_over_an_int8_cache(name):
    """Windows, chunks, a soft-cap and sinks together over an int8 cache (its scales applied
    per token): the cpu backend and Triton's against the reference on the same quantised
    cache."""
    backend = get_backend(name)
    device = _device_for(name, backend)
    layer = Attention(64, 6, 2, 32, window=40, chunk=64, softcap=5.0)
    layer.sinks = torch.nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(4)))
    seqs, k, v, scales, q_by_slot = _batch_inputs(_LONG_SEQS, 6, 2, 32, torch.int8)
    want = _attend(get_backend("reference"), layer, seqs, k, v, scales, q_by_slot, 3)
    got = _attend(backend, layer.to(device), seqs, k, v, scales, q_by_slot, 3, device)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
