"""DeepSeek-V2 and V3 against transformers: tiny random checkpoints made by transformers
(three layers: a dense first layer, then MoE layers with shared experts). V2: the full-rank
query projection, value heads narrower than the q/k heads, group-limited softmax routing
with a routed scaling; V3: the low-rank query (q_a_proj / q_a_layernorm / q_b_proj), value
heads wider than the q/k heads, YaRN (mscale_all_dim in the softmax scale), sigmoid routing
with a correction bias over groups. Served from the latent cache (one row of kv_lora_rank +
qk_rope_head_dim a token and layer, 48 here: the C++ decode and prompt kernels take it)
with kv_b_proj absorbed, token-exact through prefill, chunked prefill, decode, the prefix
cache and preemption; int8 weights close; the pool's rows, bytes and the roofline's KV
bytes for the latent (DeepSeek-V2-Lite's shape too), and which attention backends take
it; both routers against transformers' on random hidden states; tensor parallelism (TP=2)
against one device, from HF and from llama.cpp's split kv_b."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from helpers import (assert_chunks_cache_and_preemption_keep_tokens, assert_matches_reference,
                     assert_tensor_parallel_matches,
                     gguf_tokenizer_metadata, prompt_logits, tiny_hf_checkpoint)
from helpers import TINY_KW as KW, TINY_PROMPTS as PROMPTS
from servelm import LLM, SamplingParams
from servelm.kernels import load_ops
from servelm.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

COMMON = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              first_k_dense_replace=1, initializer_range=0.1)
V2 = dict(COMMON, q_lora_rank=None, v_head_dim=16, n_shared_experts=2,
          topk_method="group_limited_greedy", n_group=4, topk_group=1,
          routed_scaling_factor=2.0)
V3 = dict(COMMON, q_lora_rank=32, v_head_dim=32, n_shared_experts=1, n_group=4,
          topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 128, "mscale": 1.0,
                           "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0})
CHECKPOINTS = {"v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", V2),
               "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", V3)}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def deepseek(request, tmp_path_factory, hf_tokenizer):
    """(version, HF directory, transformers model)."""
    config_cls, model_cls, extra = CHECKPOINTS[request.param]
    d = tmp_path_factory.mktemp(f"hf-deepseek-{request.param}")
    model = tiny_hf_checkpoint(d, config_cls, model_cls, extra, hf_tokenizer, seed=11)
    if request.param == "v3":  # a correction bias that moves the routers' choices
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
        model.save_pretrained(d)
    return request.param, str(d), model


@pytest.fixture(scope="module")
def eager(deepseek):
    """The checkpoint's engine on the eager fp32 path (C++ ops off): the reference of the
    tests below, built once."""
    return LLM(model=deepseek[1], cpu_kernels=False, **KW)


def test_config_reads_deepseek_keys(deepseek):
    version, path, _ = deepseek
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.family == f"deepseek_{version}"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rotary_dim) == (4, 4, 8)
    assert cfg.head_dim == 24  # the q/k heads: nope + rope
    assert cfg.cache_layout == (1, 1, 40 + 8)  # the latent and the rope key, V read from K
    assert cfg.dense_layers == (0,) and cfg.num_experts == 8
    assert cfg.shared_expert_intermediate_size == (64 if version == "v2" else 32)
    mla = cfg.extra["mla"]
    assert mla["q_lora_rank"] == (None if version == "v2" else 32) and mla["rope_pairwise"]
    if version == "v2":
        assert cfg.extra["router_scoring"] == "softmax_grouped" and not cfg.norm_topk_prob
        assert cfg.attn_scale == pytest.approx(24 ** -0.5)
    else:
        assert cfg.extra["router_scoring"] == "sigmoid_grouped" and cfg.norm_topk_prob
        m = 0.1 * torch.log(torch.tensor(4.0)).item() + 1.0  # YaRN's mscale_all_dim, squared
        assert cfg.attn_scale == pytest.approx(24 ** -0.5 * m * m)


def test_eager_fp32_matches_transformers(deepseek, eager):
    _, _, ref = deepseek
    llm = eager
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert_matches_reference(llm, ref, prompts, GREEDY)
    # The roofline's weight bytes count latent attention's own shapes.
    built = sum(p.numel() for n, p in llm.engine.executor.model.named_parameters()
                if not n.endswith("e_score_correction_bias"))
    assert llm.engine.model_config.num_params == built


@pytest.fixture(scope="module")
def kernels(deepseek):
    """The checkpoint's engine with the C++ ops (the cpu attention backend where they
    build: the latent rows of 48 are within its kernels' head dims)."""
    return LLM(model=deepseek[1], **KW)


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_both_forms_keep_the_tokens(deepseek, eager, kernels, form, monkeypatch):
    """Every prompt chunk absorbed (over the latent rows, as decodes attend: on the C++
    prompt kernel where the cpu backend runs), or every group expanded through kv_b_proj
    (on the reference backend its decode groups too): the eager engine's own ("auto",
    against transformers above) last logits and greedy tokens, on both engines."""
    from servelm.models.mla import LatentAttention

    expanded = LatentAttention._expanded
    calls = []
    monkeypatch.setattr(LatentAttention, "_expanded",
                        lambda self, *a: calls.append(1) or expanded(self, *a))
    prompts = [eager.get_tokenizer().encode(p) for p in PROMPTS]
    want_logits = prompt_logits(eager.engine, prompts)
    want = [o.outputs[0].token_ids for o in eager.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    assert calls  # "auto" expanded the fresh prompts
    for llm in (eager, kernels):
        layers = [layer.self_attn for layer in llm.engine.executor.model.layers]
        try:
            for attn in layers:
                attn.prompt_form = form
            calls.clear()
            got = prompt_logits(llm.engine, prompts)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                use_tqdm=False)
        finally:
            for attn in layers:
                attn.prompt_form = "auto"
        assert bool(calls) == (form == "expanded")
        torch.testing.assert_close(got, want_logits, rtol=1e-3,
                                   atol=1e-3 * want_logits.abs().max().item())
        assert [o.outputs[0].token_ids for o in outs] == want


def test_prompts_expand_where_it_costs_fewer_flops():
    """DeepSeek-V2-Lite's heads: a fresh prompt of a few blocks and a long chunk over a
    long context expand; decodes, a few draft tokens or a short chunk over a long context
    stay absorbed."""
    from types import SimpleNamespace

    from servelm.models.mla import LatentAttention

    with torch.device("meta"):
        attn = LatentAttention(2048, 16, None, 512, 128, 64, 128, scale=0.1)

    def group(queries, keys):
        return SimpleNamespace(pad_index=torch.empty(2, queries),
                               block_tables=torch.empty(2, keys // 16), block_size=16)

    assert not attn._expands(group(1, 4096))
    assert not attn._expands(group(4, 2048))
    assert not attn._expands(group(64, 4096))
    assert attn._expands(group(256, 4096))
    assert attn._expands(group(64, 64)) and attn._expands(group(512, 512))
    attn.prompt_form = "absorbed"
    assert not attn._expands(group(512, 512))


def test_chunked_prefill_prefix_cache_and_preemption_keep_the_tokens(deepseek):
    """The C++ ops where they build, a 16-token budget (prompts prefilled in pieces), a
    second round from the prefix cache, then a pool so small that sequences are preempted:
    the eager path's tokens every time."""
    _, path, _ = deepseek
    fast, _ = assert_chunks_cache_and_preemption_keep_tokens(path, PROMPTS, GREEDY, **KW)
    from servelm.kernels import load_ops

    if load_ops("ops"):  # the C++ attention read the latent rows (K and V one tensor)
        assert fast.engine.executor.runner.attention.name == "cpu"


def test_int8_weights_stay_close(deepseek, eager):
    """int8 quantises the latent attention's projections (not W_UK and W_UV, the absorbed
    halves of kv_b_proj: dense in the model dtype), the dense MLP, the shared experts and
    the LM head, on the C++ kernels: within 2e-3 (cosine) of the fp32 reference."""
    _, path, _ = deepseek
    ref = eager
    prompts = [ref.get_tokenizer().encode(p) for p in PROMPTS]
    want = prompt_logits(ref.engine, prompts)
    llm = LLM(model=path, quantization="int8", **KW)
    got = prompt_logits(llm.engine, prompts)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item() > 0.998
    attn = llm.engine.executor.model.layers[0].self_attn
    assert type(attn.o_proj) is not torch.nn.Linear  # quantised
    assert attn.w_uk.dtype == attn.w_uv.dtype == torch.float32


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantised_latent_rows_stay_close(deepseek, eager, kv):
    """kv_cache_dtype int8 (the C++ kernels) and fp8 (the reference): one plane of rows with
    one fp32 scale a row, stored once; the prompts' last logits (expanded and absorbed)
    within quantisation's reach of the fp32 pool's."""
    _, path, _ = deepseek
    fp8 = {"cpu_kernels": False} if kv == "fp8" else {}  # (the C++ kernels read int8 only)
    llm = LLM(model=path, kv_cache_dtype=kv, **KW, **fp8)
    cache = llm.engine.executor.kv_cache
    assert cache.data.shape[1] == 1 and cache.scales.shape[1:2] == (1,)
    k, v, ks, vs = cache.layers[0]
    assert k.data_ptr() == v.data_ptr() and ks.data_ptr() == vs.data_ptr()
    prompts = [eager.get_tokenizer().encode(p) for p in PROMPTS]
    want = prompt_logits(eager.engine, prompts)
    for form in ("expanded", "absorbed"):
        for layer in llm.engine.executor.model.layers:
            layer.self_attn.prompt_form = form
        got = prompt_logits(llm.engine, prompts)
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
        assert cos > (0.999 if kv == "int8" else 0.97), form  # fp8: 3 mantissa bits


def _expanded_bytes_per_token(cfg: ModelConfig, elem: int) -> int:
    """What the expanded form cached: K and V of every head, the narrower head padded."""
    mla = cfg.extra["mla"]
    d = max(mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], mla["v_head_dim"])
    return 2 * cfg.num_layers * cfg.num_heads * d * elem


def test_kv_pool_holds_the_latent_rows(deepseek, eager):
    """One plane a layer ([blocks, block_size, 1 KV head, 40 + 8]), V the same tensor as K,
    the pool's bytes what it stores: 4x (V2) and 5.3x (V3) fewer than the expanded cache's."""
    from servelm.engine.model_runner import KVCache

    ex = eager.engine.executor
    cfg, cache = ex.model.config, ex.kv_cache
    assert cache.data.shape[:2] == (3, 1) and cache.data.shape[-2:] == (1, 48)
    k, v = cache.layers[0]
    assert k.data_ptr() == v.data_ptr() and k.shape == v.shape
    assert k.shape[1:] == (cache.block_size, 1, 48)
    per_token = 3 * 48 * 4  # layers x (latent + rope key) x fp32
    assert ex.block_bytes == KVCache.bytes_per_block(cfg, cache.block_size, torch.float32)
    assert ex.block_bytes == cache.block_size * per_token
    assert cache.data.numel() * 4 == ex.block_bytes * cache.data.shape[2]
    assert _expanded_bytes_per_token(cfg, 4) >= 4 * per_token
    assert eager.engine.shape.kv_bytes_per_token == per_token
    # int8 rows: one fp32 scale a row, stored once.
    assert KVCache.bytes_per_block(cfg, 16, torch.int8) == 16 * 3 * (48 + 4)


# DeepSeek-V2-Lite's config.json (the keys servelm reads).
V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400,
           "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27,
           "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
           "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
           "moe_intermediate_size": 1408, "n_shared_experts": 2, "first_k_dense_replace": 1,
           "topk_method": "greedy", "routed_scaling_factor": 1.0,
           "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
           "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707,
                            "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1}}


def test_v2_lite_cache_bytes_and_roofline():
    """DeepSeek-V2-Lite: 27 layers x (512 + 64) bf16 = 31.1 KB a token, not the expanded
    27 x 2 x 16 heads x 192 = 331.8 KB (10.7x); the roofline counts the same."""
    from servelm.engine.model_runner import KVCache
    from servelm.roofline import ModelShape, report, Hardware

    cfg = ModelConfig.from_hf_dict(V2_LITE)
    assert cfg.cache_layout == (1, 1, 576)
    latent = KVCache.bytes_per_block(cfg, 16, torch.bfloat16) // 16
    assert latent == 27 * 576 * 2 == 31104
    assert _expanded_bytes_per_token(cfg, 2) == 331776
    shape = ModelShape.from_config(cfg, weight_bits=16, kv_bits=16)
    assert shape.kv_bytes_per_token == latent
    text = report(shape, Hardware(100e9, 1e12), prompt_lens=(128,), batches=(1,))
    assert "KV cache per token (1 KV heads of 576, V read from K): 31.10 KB" in text


def test_roofline_cli_counts_the_latent(deepseek, capsys):
    """`servelm roofline --model` on an MLA checkpoint: its latent rows (48 bf16 values a
    layer, no V)."""
    from servelm.cli import main

    _, path, _ = deepseek
    rc = main(["roofline", "--model", path, "--bandwidth", "30", "--flops", "2.3",
               "--dtype", "bfloat16"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert f"KV cache per token (1 KV heads of 48, V read from K): {3 * 48 * 2} B" in out.out


def test_backends_that_take_the_latent_shape():
    """The reference runs any latent shape; the C++ backends (cpu, cpu_sdpa, cpu_amx) take
    the tiny checkpoints' rows (48 dims, 4 query heads a KV head), V2-Lite's (576 dims, 16
    query heads) and V3's (128 query heads a KV head), and decline a row past 576 dims or
    more than 128 query heads a KV head with the reason, so "auto" chooses the reference
    there."""
    from servelm.attention import BACKENDS, AttentionSpec, select
    from servelm.config import KernelConfig
    from servelm.kernels import load_ops

    def spec(heads, d):
        return AttentionSpec(torch.device("cpu"), torch.bfloat16, torch.bfloat16, heads, 1, d, 16)

    for heads, d in ((16, 640), (256, 576)):
        assert BACKENDS["reference"].unsupported(spec(heads, d)) is None
        for name in ("cpu", "cpu_sdpa", "cpu_amx"):
            reason = BACKENDS[name].unsupported(spec(heads, d))
            assert reason is not None and ("head dims up to 576" in reason
                                           or "C++ kernels are not built" in reason
                                           or "flash attention" in reason), (name, reason)
        assert select(KernelConfig(tuning="off"), spec(heads, d)).name == "reference"
    if load_ops("ops"):
        for heads, d in ((4, 48), (16, 576), (128, 576)):
            assert BACKENDS["cpu"].unsupported(spec(heads, d)) is None
            assert select(KernelConfig(tuning="off"), spec(heads, d)).name == "cpu"


def test_layers_are_latent_attention_and_decode_op_by_op(deepseek):
    from servelm.models import decode_stack
    from servelm.models.decoder import CausalLM
    from servelm.models.mla import LatentAttention
    from servelm.models.moe import SparseMoE

    version, path, _ = deepseek
    model = CausalLM(ModelConfig.from_hf_dir(path), max_positions=64)
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in model.layers)
    assert not isinstance(model.layers[0].mlp, SparseMoE)
    moe = model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and moe.shared_expert_gate is None
    assert (moe.e_score_correction_bias is not None) == (version == "v3")
    got = decode_stack.describe(model)
    assert isinstance(got, str) and "LatentAttention" in got


def test_a_wide_latent_runs_on_the_cpu_kernels(tmp_path, hf_tokenizer):
    """A latent of 256 (rows of 264 dims, no multiple of 16) with the C++ ops on: its decodes
    on the C++ decode op's any-width path, its prompts handed to the reference per group
    (the prompt op takes multiples of 16), token-exact against transformers."""
    config_cls, model_cls, extra = CHECKPOINTS["v2"]
    ref = tiny_hf_checkpoint(tmp_path, config_cls, model_cls, dict(extra, kv_lora_rank=256),
                             hf_tokenizer, seed=5)
    llm = LLM(model=str(tmp_path), **KW)
    assert llm.engine.executor.runner.attention.name == ("cpu" if load_ops("ops")
                                                         else "reference")
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert_matches_reference(llm, ref, prompts, GREEDY)


TP = dict(dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20, max_model_len=256,
          num_threads=1)


def test_tensor_parallel_2_matches_tp1(deepseek):
    """Two ranks of two heads each: V2's full-rank query rows, V3's q_b_proj rows, kv_b_proj's
    key and value rows and o_proj's columns by head (value heads narrower than the q/k
    heads in V2, wider in V3); the latent replicated; the dense first layer, the routed and
    the shared experts by their slices, the router whole: TP=1's logits and tokens."""
    assert_tensor_parallel_matches(dict(model=deepseek[1], **TP), PROMPTS, GREEDY)


def test_tensor_parallel_2_from_llama_cpp_split_kv_b(deepseek, gguf_path, tmp_path):
    """The newer converter's attn_k_b [heads, kv_lora, nope] and attn_v_b [heads, v,
    kv_lora] split by their heads dim, the experts from their stacked tensors."""
    _write_deepseek_gguf(tmp_path / "model.gguf", deepseek[2],
                         gguf_tokenizer_metadata(gguf_path), split_kv_b=True)
    assert_tensor_parallel_matches(dict(model=str(tmp_path / "model.gguf"), **TP), PROMPTS)


def test_tensor_parallel_plan_slices_by_latent_heads(deepseek):
    from servelm.distributed.sharding import ShardPlan

    cfg = ModelConfig.from_hf_dir(deepseek[1])
    mla = cfg.extra["mla"]
    qk, v = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], mla["v_head_dim"]
    plan = ShardPlan.of(cfg, 1, 2)
    assert plan.q_heads == (2, 4) and plan.local_config(cfg).cache_shape_of(0) == (1, 48)
    layer = "model.layers.1.self_attn."
    assert plan.slice_of(layer + "q_proj.weight") == [(0, 2 * qk, 4 * qk)]
    assert plan.slice_of(layer + "q_b_proj.weight") == [(0, 2 * qk, 4 * qk)]
    assert plan.slice_of(layer + "kv_b_proj.weight") == [
        (0, 2 * (mla["qk_nope_head_dim"] + v), 4 * (mla["qk_nope_head_dim"] + v))]
    assert plan.slice_of(layer + "k_b_proj.weight") == [(0, 2, 4)]
    assert plan.slice_of(layer + "o_proj.weight") == [(1, 2 * v, 4 * v)]
    for replicated in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "q_a_proj.weight",
                       "q_a_layernorm.weight"):
        assert plan.slice_of(layer + replicated) is None
    shared = cfg.shared_expert_intermediate_size
    assert plan.slice_of("model.layers.1.mlp.shared_experts.down_proj.weight") == [
        (1, shared // 2, shared)]
    with pytest.raises(ValueError, match="latent attention with biases"):
        ShardPlan.of(dataclasses.replace(cfg, attention_bias=True), 0, 2)


# ---- the routers against transformers' --------------------------------------------------------

def _moe(cfg: ModelConfig):
    from servelm.models.moe import SparseMoE

    keys = ("router_scoring", "n_group", "topk_group", "score_bias", "routed_scaling",
            "shared_expert_gate")
    return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                     cfg.num_experts_per_tok, cfg.norm_topk_prob,
                     shared_intermediate=cfg.shared_expert_intermediate_size,
                     **{k: cfg.extra[k] for k in keys if k in cfg.extra})


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_router_chooses_as_transformers(version):
    """Random hidden states and router weights (V3: a correction bias large enough to
    change the groups and experts chosen): the same experts and weights."""
    config_cls, _, extra = CHECKPOINTS[version]
    hf_cfg = getattr(transformers, config_cls)(vocab_size=32, hidden_size=64,
                                               intermediate_size=96, **extra)
    modeling = importlib.import_module(
        f"transformers.models.deepseek_{version}.modeling_deepseek_{version}")
    router_cls = getattr(modeling, f"DeepseekV{version[1]}TopkRouter")
    torch.manual_seed(3)
    ref = router_cls(hf_cfg)
    with torch.no_grad():
        ref.weight.normal_(0, 0.2)
        if version == "v3":
            ref.e_score_correction_bias.normal_(0, 0.3)
    cfg = ModelConfig.from_hf_dict({**hf_cfg.to_dict(), "architectures": [
        f"DeepseekV{version[1]}ForCausalLM"]})
    moe = _moe(cfg)
    with torch.no_grad():
        moe.gate.weight.copy_(ref.weight)
        if version == "v3":
            moe.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(64, 64)
    _, want_w, want_ids = ref(x)
    got_w, got_ids = moe.route(x)
    want_ids, order = want_ids.sort(-1)
    got_ids, got_order = got_ids.sort(-1)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w.gather(1, got_order), want_w.gather(1, order))
    if version == "v3":  # the bias changed some choices (else the test would not see it)
        unbiased = torch.sigmoid(x @ ref.weight.T).topk(2, -1)[1].sort(-1)[0]
        assert not torch.equal(unbiased, want_ids)


# ---------------------------------------------------------------- GGUF (llama.cpp's deepseek2)

_GGUF_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
               "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
               "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
               "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
               "mlp.shared_experts.up_proj": "ffn_up_shexp",
               "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def _write_deepseek_gguf(path, model, tokenizer_meta: dict, split_kv_b: bool) -> None:
    """The checkpoint as llama.cpp's converter writes deepseek2: split_kv_b, the newer
    layout (the latent as one KV head of kv_lora_rank + rope, kv_b_proj as attn_k_b
    [heads, kv_lora, nope] and attn_v_b [heads, v, kv_lora]); else the older one
    (attn_kv_b whole, per-head key and value lengths)."""
    import gguf

    from helpers import add_gguf_metadata

    cfg, arch = model.config, "deepseek2"
    w = gguf.GGUFWriter(str(path), arch)
    heads, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    kv_lora, v = cfg.kv_lora_rank, cfg.v_head_dim
    meta = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
            "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": heads, "attention.kv_lora_rank": kv_lora,
            "rope.dimension_count": rope,
            "leading_dense_block_count": cfg.first_k_dense_replace,
            "expert_count": cfg.n_routed_experts, "expert_used_count": cfg.num_experts_per_tok,
            "expert_feed_forward_length": cfg.moe_intermediate_size,
            "expert_shared_count": cfg.n_shared_experts,
            "expert_gating_func": 2 if cfg.model_type == "deepseek_v3" else 1,
            "expert_group_count": cfg.n_group, "expert_group_used_count": cfg.topk_group}
    if split_kv_b:
        meta.update({"attention.head_count_kv": 1, "attention.key_length": kv_lora + rope,
                     "attention.value_length": kv_lora, "attention.key_length_mla": nope + rope,
                     "attention.value_length_mla": v})
    else:
        meta.update({"attention.head_count_kv": heads, "attention.key_length": nope + rope,
                     "attention.value_length": v})
    if cfg.q_lora_rank:
        meta["attention.q_lora_rank"] = cfg.q_lora_rank
    for key, value in meta.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.expert_weights_scale", cfg.routed_scaling_factor)
    if getattr(cfg, "norm_topk_prob", False) and cfg.model_type == "deepseek_v3":
        w.add_bool(f"{arch}.expert_weights_norm", True)
    rp = cfg.rope_parameters
    if rp.get("rope_type") == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", rp["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                     rp["original_max_position_embeddings"])
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * rp["mscale_all_dim"])
    add_gguf_metadata(w, tokenizer_meta)
    for name, t in model.state_dict().items():
        t = t.float()
        if name == "lm_head.weight":
            w.add_tensor("output.weight", t.numpy())
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight",
                          "model.norm.weight": "output_norm.weight"}[name], t.numpy())
            continue
        i, part = name.split(".")[2], ".".join(name.split(".")[3:])
        if part == "mlp.experts.gate_up_proj":  # [E, 2I, H]: the gates, then the ups
            gate, up = t.chunk(2, dim=1)
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", gate.contiguous().numpy())
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", up.contiguous().numpy())
        elif part == "mlp.experts.down_proj":
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", t.contiguous().numpy())
        elif part == "mlp.gate.e_score_correction_bias":
            w.add_tensor(f"blk.{i}.exp_probs_b.bias", t.numpy())
        elif part == "self_attn.kv_b_proj.weight" and split_kv_b:
            kv_b = t.view(heads, nope + v, kv_lora)
            w.add_tensor(f"blk.{i}.attn_k_b.weight",
                         kv_b[:, :nope].transpose(1, 2).contiguous().numpy())
            w.add_tensor(f"blk.{i}.attn_v_b.weight", kv_b[:, nope:].contiguous().numpy())
        elif part == "self_attn.kv_b_proj.weight":
            w.add_tensor(f"blk.{i}.attn_kv_b.weight", t.numpy())
        else:
            base, kind = part.rsplit(".", 1)
            w.add_tensor(f"blk.{i}.{_GGUF_PARTS[base]}.{kind}", t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
def test_gguf_loads_as_its_hf_checkpoint(deepseek, eager, gguf_path, tmp_path, split_kv_b):
    """llama.cpp's deepseek2 GGUF in both converters' layouts (kv_b_proj split into the
    absorbed form's matrices, or whole): the family (V3 by its sigmoid gating), the router,
    the latent cache and the logits equal the HF checkpoint's."""
    version, path, ref = deepseek
    meta = gguf_tokenizer_metadata(gguf_path)
    _write_deepseek_gguf(tmp_path / "model.gguf", ref, meta, split_kv_b)
    gg = LLM(model=str(tmp_path / "model.gguf"), cpu_kernels=False, **KW)
    want, got = eager.engine.model_config, gg.engine.model_config
    assert got.family == want.family == f"deepseek_{version}"
    for field in ("head_dim", "num_kv_heads", "rotary_dim", "cache_layout", "attn_scale",
                  "dense_layers", "num_experts", "shared_expert_intermediate_size",
                  "norm_topk_prob"):
        assert getattr(got, field) == pytest.approx(getattr(want, field)), field
    assert got.extra["mla"] == want.extra["mla"]
    for key in ("router_scoring", "n_group", "topk_group", "score_bias", "routed_scaling"):
        assert got.extra.get(key) == want.extra.get(key), key
    prompts = [eager.get_tokenizer().encode(p) for p in PROMPTS]
    torch.testing.assert_close(prompt_logits(gg.engine, prompts),
                               prompt_logits(eager.engine, prompts), rtol=1e-5, atol=1e-5)
