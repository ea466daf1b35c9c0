"""KV-cache quantisation (CacheConfig.kv_cache_dtype int8 / fp8, servelm.models.kv_quant):
every attention backend reading the quantised cache against the reference over the
dequantised cache (the gather + SDPA path, the C++ CPU kernels, Triton in its interpreter),
the pool's capacity, start-up errors, and the engine end to end with its quality (KL and
perplexity against the unquantised cache on tests/data/prose.txt)."""

from __future__ import annotations

import math

import pytest
import torch

from servelm.attention import AttnGroup
from servelm.attention.reference import paged_attention
from servelm.config import CacheConfig, KernelConfig
from servelm.engine.model_runner import KVCache, ModelRunner, SeqInput, build_forward_batch
from servelm.kernels import load_ops
from servelm.models import kv_quant
from servelm.models.layers import paged_decode_attention_ref, rotary_kv_write_ref
from tests.test_cuda_graphs import DEVICES, _model, _Seqs
from tests.test_quantization import TEXT

QDTYPES = [torch.int8, torch.float8_e4m3fn]
# (H, KVH, D, block size): SmolLM2 (G = 3), no grouping, one-token blocks with G = 4.
SHAPES = [(9, 3, 64, 16), (8, 8, 32, 4), (4, 1, 16, 1)]


def _cache(KVH, D, page, lens, dtype, seed=0):
    """A quantised pool with scattered blocks for sequences of `lens`, its dequantised
    fp32 copy (what the reference reads), and int32 tables."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // page) for n in lens) + 2
    k, v = (torch.randn(nb, page, KVH, D, generator=g) for _ in range(2))
    (kq, ks), (vq, vs) = kv_quant.quantize(k, dtype), kv_quant.quantize(v, dtype)
    free = torch.randperm(nb, generator=g).tolist()
    W = max(-(-n // page) for n in lens)
    tables = torch.zeros(len(lens), W, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(-(-n // page)):
            tables[b, j] = free.pop()
    deq = (kv_quant.dequantize(kq, ks, torch.float32), kv_quant.dequantize(vq, vs, torch.float32))
    return (kq, vq, ks, vs), deq, tables


def test_quantize_roundtrip_bounds_and_zero_rows():
    x = torch.randn(50, 3, 64)
    x[0, 1] = 0
    for dtype, rel in ((torch.int8, 0.5 / 127), (torch.float8_e4m3fn, 0.07)):
        q, s = kv_quant.quantize(x, dtype)
        assert q.dtype == dtype and s.shape == x.shape[:-1] and s[0, 1] == 0
        err = (kv_quant.dequantize(q, s, torch.float32) - x).abs()
        amax = x.abs().amax(-1, keepdim=True)
        # int8: half a step of max|x| / 127; fp8: 3 mantissa bits relative to each element.
        bound = amax * rel + 1e-7 if dtype == torch.int8 else x.abs() * rel + amax * 2 ** -9 / 448
        assert (err <= bound).all()


def test_pool_holds_about_twice_the_tokens_of_bf16_in_the_same_bytes():
    cfg = _model("cpu").config
    bf16 = KVCache.bytes_per_block(cfg, 16, torch.bfloat16)
    int8 = KVCache.bytes_per_block(cfg, 16, torch.int8)
    fp32 = KVCache.bytes_per_block(cfg, 16, torch.float32)
    assert int8 == KVCache.bytes_per_block(cfg, 16, torch.float8_e4m3fn)
    # head_dim 16 here: 16 + 4 scale bytes a row against 32 (bf16) and 64 (fp32).
    assert bf16 / int8 == 32 / 20 and fp32 / int8 == 64 / 20
    assert kv_quant.bits_per_element(torch.int8, 64) == 8.5  # SmolLM2: 1.88x bf16, 3.76x fp32
    kv = KVCache(cfg, 10, 16, torch.int8, torch.device("cpu"))
    assert kv.data.dtype == torch.int8 and kv.scales.shape == (2, 2, 10, 16, 2)
    assert len(kv.layers[0]) == 4 and kv.layers[1][2].data_ptr() == kv.scales[1, 0].data_ptr()


def test_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    # (The recurrent states' dtype, beside it: a keyword the CLI's choices do not check.)
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of auto, float32, "
                                         "bfloat16, got 'float16'"):
        CacheConfig(mamba_ssm_cache_dtype="float16")


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("H,KVH,D,page", SHAPES)
def test_reference_gather_dequantises_what_it_reads(dtype, H, KVH, D, page):
    """The eager path's gather + SDPA over a quantised cache equals it over the
    dequantised cache: decode rows of ragged lengths and a prompt chunk at position 5."""
    lens = [1, page + 1, 37]
    (kq, vq, ks, vs), (kd, vd), tables = _cache(KVH, D, page, lens, dtype)
    q = torch.randn(len(lens), H, D)
    want = paged_decode_attention_ref(q, kd, vd, tables, torch.tensor(lens), D ** -0.5)
    got = paged_decode_attention_ref(q, kq, vq, tables, torch.tensor(lens), D ** -0.5,
                                     k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # A group of two prompt chunks: 3 tokens of row 1 from its start, row 2's last 4.
    seqs = [SeqInput([0] * 3, 0, tables[1].tolist()), SeqInput([0] * 4, 33, tables[2].tolist())]
    # (Grouped as for Triton: all prompt chunks in one padded group.)
    batch, _ = build_forward_batch(seqs, page, H // KVH, torch.device("cpu"), "triton")
    grp: AttnGroup = batch.attn.groups[0]
    qp = torch.randn(7, H, D)
    want = paged_attention(qp, kd, vd, grp, D ** -0.5)
    got = paged_attention(qp, kq, vq, grp, D ** -0.5, scales=(ks, vs))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the C++ CPU kernels

needs_ops = pytest.mark.skipif(not load_ops("ops"), reason="C++ kernels unavailable")


@needs_ops
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KVH,D,page", [(9, 3, 64, 16), (8, 8, 32, 4), (4, 1, 128, 1)])
def test_cpu_kernels_read_the_int8_cache(qdtype, H, KVH, D, page):
    """Decode (ragged lengths, a sliding window) and prompt chunks (ragged, any start) from
    the int8 cache and its scales, against the reference over the dequantised cache."""
    ops = torch.ops.servelm_ops
    lens = [1, 17, 70, 3 * page + 2]
    (kq, vq, ks, vs), (kd, vd), tables = _cache(KVH, D, page, lens, torch.int8)
    tol = 1e-5 if qdtype == torch.float32 else 2e-2
    q = torch.randn(len(lens), H, D).to(qdtype)
    cl = torch.tensor(lens, dtype=torch.int32)
    for window in (0, 9):
        want = paged_decode_attention_ref(q.float(), kd, vd, tables, cl, D ** -0.5, window)
        got = ops.paged_decode_attention(q, kq, vq, tables, cl, D ** -0.5, window, ks, vs)
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # Prompt chunks: sequence b's last n_b tokens.
    nq = [1, 5, 20, 2]
    cu = torch.tensor([0] + list(torch.tensor(nq).cumsum(0)), dtype=torch.int32)
    sp = torch.tensor([n - c for n, c in zip(lens, nq)], dtype=torch.int32)
    qp = torch.randn(sum(nq), H, D).to(qdtype)
    got = ops.paged_prefill_attention(qp, kq, vq, tables, cu, sp, D ** -0.5, ks, vs)
    rows = [(b, int(sp[b]) + i) for b in range(len(lens)) for i in range(nq[b])]
    want = torch.stack([paged_decode_attention_ref(
        qp[r:r + 1].float(), kd, vd, tables[b:b + 1], torch.tensor([p + 1]), D ** -0.5).view(-1)
        for r, (b, p) in enumerate(rows)])
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@needs_ops
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_cpu_rotary_kv_write_quantises_as_the_reference(qdtype):
    ops = torch.ops.servelm_ops
    H, KVH, D, T = 9, 3, 64, 6
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(qdtype)
    cos, sin = (torch.randn(T, D, generator=g).to(qdtype) for _ in range(2))
    slots = torch.tensor([0, 5, 17, 18, 40, 63])
    outs = []
    for fn in (rotary_kv_write_ref, ops.rotary_kv_write):
        a = qkv.clone()
        kc, vc = (torch.zeros(4, 16, KVH, D, dtype=torch.int8) for _ in range(2))
        ks, vs = (torch.zeros(4, 16, KVH) for _ in range(2))
        fn(a, cos, sin, kc, vc, slots, H, KVH, ks, vs)
        outs.append((a, kc, vc, ks, vs))
    (a1, *c1), (a2, *c2) = outs
    torch.testing.assert_close(a1, a2, rtol=0, atol=1e-6)
    for x, y in zip(c1, c2):  # rows within one step of rounding, scales equal
        assert (x.float() - y.float()).abs().max() <= (1 if x.dtype == torch.int8 else 1e-6)
    assert (c1[0] != 0).any() and c1[2].count_nonzero() == T * KVH


@needs_ops
def test_cpu_kernels_refuse_a_cache_they_cannot_read():
    ops = torch.ops.servelm_ops
    (kq, vq, ks, vs), _, tables = _cache(3, 64, 16, [5], torch.float8_e4m3fn)
    q, cl = torch.randn(1, 9, 64), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="kv_cache_dtype"):
        ops.paged_decode_attention(q, kq, vq, tables, cl, 0.125, 0, ks, vs)
    (kq, vq, ks, vs), _, tables = _cache(3, 64, 16, [5], torch.int8)
    with pytest.raises(RuntimeError, match="k_scale"):
        ops.paged_decode_attention(q, kq, vq, tables, cl, 0.125)


@needs_ops
def test_fp8_with_the_cpu_kernels_is_refused_at_start_up_naming_the_field():
    model = _model("cpu")
    kv = KVCache(model.config, 8, 4, torch.float8_e4m3fn, torch.device("cpu"))
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'"):
        ModelRunner(model, kv, torch.device("cpu"))
    runner = ModelRunner(model, kv, torch.device("cpu"), kernels=KernelConfig(cpu_kernels=False))
    assert not runner.use_kernels and runner.attention.name == "reference"


# ---------------------------------------------------------------- Triton (interpreter on CPU)

@pytest.mark.parametrize("dtype", QDTYPES)
def test_triton_reads_the_quantised_cache(dtype):
    from servelm.kernels import triton_attention as ta

    if not ta.available():
        pytest.skip("Triton not installed")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else the interpreter
    H, KVH, D, page = 9, 3, 64, 16
    lens = [1, 17, 150]
    (kq, vq, ks, vs), (kd, vd), tables = _cache(KVH, D, page, lens, dtype)
    q = torch.randn(len(lens), H, D)
    cl = torch.tensor(lens, dtype=torch.int32)
    want = paged_decode_attention_ref(q, kd, vd, tables, cl, D ** -0.5).view(len(lens), -1)
    kq, vq, ks, vs, tables_d = (t.to(dev) for t in (kq, vq, ks, vs, tables))
    for splits in (1, 3):
        got = ta.paged_decode_attention(q.to(dev), kq, vq, tables_d, cl.to(dev), D ** -0.5,
                                        splits=splits, scales=(ks, vs))
        torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    nq = [1, 5, 3]
    cu = torch.tensor([0, 1, 6, 9], dtype=torch.int32)
    sp = torch.tensor([n - c for n, c in zip(lens, nq)], dtype=torch.int32)
    qp = torch.randn(9, H, D)
    got = ta.paged_prefill_attention(qp.to(dev), kq, vq, tables_d, cu.to(dev), sp.to(dev), 5,
                                     D ** -0.5, scales=(ks, vs)).cpu()
    rows = [(b, int(sp[b]) + i) for b in range(3) for i in range(nq[b])]
    want = torch.stack([paged_decode_attention_ref(
        qp[r:r + 1], kd, vd, tables[b:b + 1], torch.tensor([p + 1]), D ** -0.5).view(-1)
        for r, (b, p) in enumerate(rows)])
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- runners on a tiny model

def _runner(kv_dtype, cpu_kernels, spare_block=False, device="cpu"):
    model = _model(device)
    kv = KVCache(model.config, 64, 4, kv_dtype, torch.device(device), spare_block=spare_block)
    return ModelRunner(model, kv, torch.device(device),
                       kernels=KernelConfig(cpu_kernels=cpu_kernels, tuning="off"))


def _steps(runner, steps=6):
    """Prompts of ragged lengths, then decode steps: every step's logits."""
    seqs = _Seqs([3, 9, 1, 14], runner.kv_cache.num_blocks)
    out = []
    with torch.inference_mode():
        logits, rows = runner.execute([seqs.prompt(i) for i in range(4)])
        out.append(logits[sorted(range(len(rows)), key=rows.__getitem__)])
        for step in range(steps):
            logits, rows = runner.execute([seqs.decode(i, (5 * step + i) % 96) for i in range(4)])
            out.append(logits[sorted(range(len(rows)), key=rows.__getitem__)])
    return torch.stack(out)


def test_every_cpu_path_on_an_int8_cache_matches_the_reference_and_the_float_cache():
    ref = _steps(_runner(torch.int8, cpu_kernels=False))
    full = _steps(_runner(torch.float32, cpu_kernels=False))
    if load_ops("ops"):
        runner = _runner(torch.int8, cpu_kernels=True)
        assert runner.use_kernels and not runner.model.fused_decode  # per-op path, no stack
        assert runner.attention.name == "cpu"
        torch.testing.assert_close(_steps(runner), ref, rtol=1e-4, atol=1e-4)
    # Quantisation moves logits by a little, not nothing.
    assert 0 < (ref - full).abs().max() < 0.15 * full.abs().max()


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("device,capture", DEVICES)
def test_graph_steps_write_and_read_the_quantised_pool(device, capture, dtype):
    """DecodeGraphs over a quantised pool with its spare block (captured on CUDA, with the
    Triton attention where it runs; on the CPU the static-buffer forward, capture off):
    the same logits and pool contents (rows and scales) as the eager runner."""
    from servelm.engine.cuda_graphs import DecodeGraphs

    eager = _runner(dtype, cpu_kernels=False, spare_block=True, device=device)
    kv = eager.kv_cache
    graphs = DecodeGraphs(eager.model, kv, torch.device(device), max_batch=4, capture=capture,
                          attention=eager.attention)
    seqs = _Seqs([3, 9, 6], kv.num_blocks)
    with torch.inference_mode():
        eager.execute([seqs.prompt(i) for i in range(3)])
    for step in range(4):
        batch = [seqs.decode(i, (3 * step + i) % 96) for i in range(3)]
        saved = kv.data.clone(), kv.scales.clone()
        got, _ = graphs.execute(batch)
        after = kv.data[:, :, :kv.num_blocks].clone(), kv.scales[:, :, :kv.num_blocks].clone()
        kv.data.copy_(saved[0])
        kv.scales.copy_(saved[1])
        want, rows = eager.execute(batch)
        torch.testing.assert_close(got, want[sorted(range(3), key=rows.__getitem__)],
                                   rtol=1e-4, atol=1e-4)
        rows, scales = kv.data[:, :, :kv.num_blocks], kv.scales[:, :, :kv.num_blocks]
        if device == "cpu":  # the same bits
            assert torch.equal(after[0].view(torch.uint8), rows.view(torch.uint8))
            torch.testing.assert_close(after[1], scales)
        else:  # padded-batch matmuls may round K/V differently: within a step or two
            torch.testing.assert_close(kv_quant.dequantize(*after, torch.float32),
                                       kv_quant.dequantize(rows, scales, torch.float32),
                                       rtol=0.15, atol=2 * scales.max().item())


# ---------------------------------------------------------------- the embedded model

@pytest.fixture(scope="module")
def int8_llm():
    from servelm import LLM

    return LLM(dtype="float32", kv_cache_memory=64 << 20, kv_cache_dtype="int8",
               kernel_tuning="off", max_num_batched_tokens=128, max_num_seqs=8)


def _teacher_forced(model, kv_cache, use_kernels, ids, chunk=128):
    """fp32 logits at every position of `ids`, prefilled chunk by chunk over the paged
    cache (each chunk reads the earlier ones' K/V from the pool, as the engine does)."""
    table = list(range(-(-len(ids) // kv_cache.block_size)))
    g = model.config.num_heads // model.config.num_kv_heads
    out = []
    had = model.norm.uses_kernels
    model.select_ops(use_kernels)
    try:
        with torch.inference_mode():
            for s in range(0, len(ids), chunk):
                seq = SeqInput(ids[s:s + chunk], s, table, True)
                batch, _ = build_forward_batch([seq], kv_cache.block_size, g,
                                               torch.device("cpu"),
                                               "cpu" if use_kernels else "reference")
                out.append(model.compute_logits(model(batch, kv_cache.layers)).float())
    finally:
        model.select_ops(had)
    return torch.cat(out)


def test_quality_kl_and_perplexity_against_the_unquantised_cache(int8_llm):
    """Teacher-forced through the paged path (chunks of 128 reading the earlier ones from
    the pool) on the first 256 tokens of prose.txt, on one model: the int8 cache through
    the C++ kernels, fp8 through the reference, each against the fp32 cache. Measured on
    512 tokens: KL int8 0.0006, fp8 0.0030; perplexity 15.81 (fp32), 15.81 (int8), 15.76
    (fp8); top-1 agreement 0.994 (int8), 0.969 (fp8)."""
    engine = int8_llm.engine
    ids = int8_llm.get_tokenizer().encode(TEXT)[:256]
    cfg, bs = engine.model_config, engine.executor.kv_cache.block_size
    nb = -(-len(ids) // bs)

    def run(kv_dtype, use_kernels):
        kv = KVCache(cfg, nb, bs, kv_dtype, torch.device("cpu"))
        return _teacher_forced(engine.executor.model, kv, use_kernels, ids)

    kernels = engine.executor.runner.use_kernels
    ref = torch.log_softmax(run(torch.float32, kernels), -1)
    res = {}
    for name, kv_dtype, use_kernels in (("fp32", torch.float32, kernels),
                                        ("int8", torch.int8, kernels),
                                        ("fp8", torch.float8_e4m3fn, False)):
        logp = ref if name == "fp32" else torch.log_softmax(run(kv_dtype, use_kernels), -1)
        nll = -logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
        kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
        top1 = (logp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        res[name] = (kl, math.exp(nll), top1)
    print({k: f"KL {kl:.4f} ppl {ppl:.2f} top-1 agreement {a:.3f}" for k, (kl, ppl, a) in res.items()})
    ppl32 = res["fp32"][1]
    for name in ("int8", "fp8"):
        kl, ppl, top1 = res[name]
        assert 0 < kl <= 0.01 and abs(ppl / ppl32 - 1) < 0.02 and top1 > 0.94


def test_engine_on_an_int8_cache_with_chunked_prefill_and_prefix_caching(int8_llm):
    """A prompt longer than the step's token budget (chunked prefill), generated twice:
    the second run takes its prefix from the cache (quantised blocks shared) and gives the
    same greedy tokens; the pool holds ~3.8x the blocks of an fp32 pool of these bytes."""
    from servelm import SamplingParams

    engine = int8_llm.engine
    assert engine.executor.kv_cache.quantized and engine.kv_dtype == torch.int8
    fp32_blocks = (64 << 20) // KVCache.bytes_per_block(engine.model_config, 16, torch.float32)
    assert engine.executor.kv_cache.num_blocks / fp32_blocks == pytest.approx(256 / 68, rel=0.01)
    prompt = "The capital of France is Paris. " + TEXT[:600]
    assert len(int8_llm.get_tokenizer().encode(prompt)) > 128  # > max_num_batched_tokens
    sp = SamplingParams(temperature=0, max_tokens=6)
    first = int8_llm.generate([prompt], sp, use_tqdm=False)[0]
    second = int8_llm.generate([prompt], sp, use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0 and second.metrics.num_cached_tokens >= 128
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert len(first.outputs[0].token_ids) == 6 and first.outputs[0].text.strip()


def test_roofline_reports_the_quantised_pool():
    from servelm import roofline as rl
    from servelm.models.config import ModelConfig

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                      intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, max_position_embeddings=2048)  # SmolLM2-135M
    hw = rl.Hardware(20e9, 1e12)
    pool = 20 * 32 * 16 * 30 * 2 * 3 * 64 * 2  # 20 bf16 sequences of 512 tokens
    lines = {}
    for name, bits in (("bf16", 16), ("int8", kv_quant.bits_per_element(torch.int8, 64))):
        m = rl.ModelShape.from_config(cfg, weight_bits=16, kv_bits=bits)
        lines[name] = rl.report(m, hw, context=512, kv_pool_bytes=pool,
                                kv_dtype=None if name == "bf16" else name)
    assert "KV cache per token (3 KV heads): 23.04 KB" in lines["bf16"]
    assert "KV cache per token (3 KV heads, int8 + scales): 12.24 KB" in lines["int8"]
    assert "holds 10,240 tokens: 20 sequences" in lines["bf16"]
    assert "holds 19,275 tokens: 37 sequences" in lines["int8"]  # 1.88x


def test_cli_flag_reaches_the_engine_config():
    from servelm.cli import make_parser

    for cmd in (["generate", "hi"], ["chat"], ["serve"]):
        args = make_parser().parse_args([*cmd, "--kv-cache-dtype", "int8"])
        assert args.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "int4"])
