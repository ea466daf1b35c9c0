"""Gemma 4 (text) against transformers: tiny random checkpoints made by transformers.

`gemma4` has every feature at once: six layers (sliding, sliding, global, sliding,
sliding, global; a window of 8, shorter than every prompt), global layers with their own
head size (32 against 16) and KV-head count (1 against 2) whose values are their keys'
projection (attention_k_eq_v) and whose rotary is "proportional" (half the frequencies
turn), per-layer inputs (PLE), the last two layers reading the KV cache of the last
earlier layer of their kind (num_kv_shared_layers) with double-wide MLPs, routed experts
beside every dense MLP (enable_moe_block), soft-capped logits, and layer scalars and
router scales off their init. `gemma4_dense` is the plain form: global layers with their
own head size and v_proj, no PLE, no sharing, no experts. Both are served token-exact
through prefill, chunked prefill, decode, the prefix cache and preemption; the KV pool
holds each layer's own shape (a view each, shared layers their source's); the whole-step
DecodeStack takes their layers, and the kernel backends decline what they cannot run, with
the reason."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import (assert_chunks_cache_and_preemption_keep_tokens, assert_matches_reference,
                     assert_multimodal_checkpoint_serves_its_text_model,
                     assert_prefix_travels_between_engines, assert_reference_greedy,
                     assert_stack_decodes_as_per_op, assert_tensor_parallel_matches,
                     gemma4_scales_off_one, prompt_logits, tiny_hf_checkpoint)
from helpers import TINY_KW as KW, TINY_PROMPTS as PROMPTS
from servelm import LLM, SamplingParams
from servelm.attention import AttentionSpec, select
from servelm.config import KernelConfig
from servelm.engine.model_runner import KVCache
from servelm.kernels import load_ops
from servelm.models.config import FULL, SLIDING, ModelConfig

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4TextConfig"):
    pytest.skip("this transformers has no Gemma 4", allow_module_level=True)

WINDOW = 8
TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]
ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4}}
COMMON = dict(num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
              layer_types=TYPES, rope_parameters=ROPE, initializer_range=0.05)
CONFIGS = {
    "gemma4": dict(COMMON, num_global_key_value_heads=1, attention_k_eq_v=True,
                   num_kv_shared_layers=2, use_double_wide_mlp=True,
                   hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=4,
                   top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0),
    "gemma4_dense": dict(COMMON, hidden_size_per_layer_input=0),
}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_tokenizer):
    """name -> (HF directory, transformers model): norms perturbed (tiny_hf_checkpoint), and
    the layer scalars (buffers) and the routers' scales moved off 1, so that each shows."""
    out = {}
    for seed, (name, extra) in enumerate(CONFIGS.items()):
        d = tmp_path_factory.mktemp(f"hf-{name}")
        extra = dict(extra)
        if extra.get("hidden_size_per_layer_input"):
            extra["vocab_size_per_layer_input"] = hf_tokenizer.vocab_size
        model = tiny_hf_checkpoint(d, "Gemma4TextConfig", "Gemma4ForCausalLM", extra,
                                   hf_tokenizer, seed=11 + seed)
        gemma4_scales_off_one(model)
        model.save_pretrained(d)
        out[name] = (str(d), model)
    return out


@pytest.fixture(scope="module")
def gemma4(checkpoints):
    return checkpoints["gemma4"]


def _ids(llm, prompt):
    return llm.get_tokenizer().encode(prompt)


def _tokens(llm, prompts, sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


# ---- config ----------------------------------------------------------------------------------

def test_config_reads_gemma4_keys(gemma4):
    cfg = ModelConfig.from_hf_dir(gemma4[0])
    assert cfg.family == "gemma4" and cfg.layer_types == tuple(TYPES)
    assert cfg.layer_head_dims == (16, 16, 32, 16, 16, 32)
    assert cfg.layer_kv_heads == (2, 2, 1, 2, 2, 1)
    assert cfg.kv_source_layers == (0, 1, 2, 3, 3, 2)  # the last sliding and global ones
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2] and not cfg.uniform_kv
    assert cfg.attn_scale == 1.0 and cfg.qk_norm and cfg.sandwich_norms
    assert cfg.rope_scaling["rope_type"] == "proportional" and cfg.rope_local_theta == 1e4
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.final_logit_softcap == 30.0 and cfg.tie_word_embeddings
    assert cfg.extra == {"v_norm": True, "layer_scalar": True, "k_eq_v_layers": (2, 5),
                         "intermediate_sizes": (96, 96, 96, 96, 192, 192),
                         "per_layer_input_size": 8,
                         "per_layer_vocab_size": cfg.vocab_size, "moe_beside_mlp": True}
    dense = ModelConfig.from_hf_dir(gemma4[0].replace("gemma4", "gemma4_dense"))
    assert dense.layer_head_dims == (16, 16, 32, 16, 16, 32) and dense.layer_kv_heads == ()
    assert dense.kv_source_layers == () and dense.num_experts == 0
    assert dense.extra == {"v_norm": True, "layer_scalar": True, "k_eq_v_layers": ()}


def test_parameter_count_is_transformers(checkpoints):
    for path, ref in checkpoints.values():
        assert ModelConfig.from_hf_dir(path).num_params == ref.num_parameters()


def test_hub_keys_read_as_per_layer_config(gemma4):
    """The hub's configs name the global layers' shape by global_head_dim and
    num_global_key_value_heads (transformers 5.25 writes per_layer_config instead)."""
    raw = json.load(open(f"{gemma4[0]}/config.json"))
    hub = {k: v for k, v in raw.items() if k != "per_layer_config"}
    hub.update(global_head_dim=32, num_global_key_value_heads=1)
    a, b = ModelConfig.from_hf_dict(hub), ModelConfig.from_hf_dict(raw)
    assert a == b and a.extra == b.extra
    # num_global_key_value_heads applies only with attention_k_eq_v, as in transformers
    cfg = ModelConfig.from_hf_dict({**hub, "attention_k_eq_v": False})
    assert cfg.layer_kv_heads == () and cfg.extra["k_eq_v_layers"] == ()


@pytest.mark.parametrize("change, match", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"num_kv_shared_layers": 6}, "num_kv_shared_layers=6"),
    ({"per_layer_config": {"2": {"head_dim": 32, "intermediate_size": 8}}}, "per_layer_config"),
    ({"enable_moe_block": True, "num_experts": None}, "enable_moe_block needs num_experts"),
    ({"vocab_size_per_layer_input": 100}, "vocab_size_per_layer_input=100"),
    ({"rope_parameters": {**ROPE, SLIDING: {"rope_type": "linear", "rope_theta": 1e4,
                                            "factor": 2.0}}}, "sliding_attention rope_type"),
])
def test_unsupported_configs_are_refused_naming_the_key(gemma4, change, match):
    raw = json.load(open(f"{gemma4[0]}/config.json"))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**raw, **change})


# ---- serving -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_fp32_matches_transformers(checkpoints, name):
    path, ref = checkpoints[name]
    llm = LLM(model=path, cpu_kernels=False, **KW)
    prompts = [_ids(llm, p) for p in PROMPTS]
    assert min(map(len, prompts)) > WINDOW
    assert_matches_reference(llm, ref, prompts, GREEDY)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_prefix_cache_and_preemption_keep_the_tokens(checkpoints, name):
    """The C++ ops and attention where they build (the cpu backend runs both head sizes), a
    16-token budget (prompts prefilled in chunks past the window), a second round from the
    prefix cache, then a pool of 5 blocks (each the sum of the layers' own) that preempts:
    the eager path's tokens each time. Decode steps run op by op (fp32: the DecodeStack runs bf16 models)."""
    path, _ = checkpoints[name]
    fast, _ = assert_chunks_cache_and_preemption_keep_tokens(path, PROMPTS, GREEDY, **KW)
    ex = fast.engine.executor
    assert not ex.model.fused_decode
    if load_ops("ops"):
        assert ex.runner.attention.name.startswith("cpu")
    cfg = ex.model.config
    assert ex.kv_groups == cfg.kv_groups is not None  # (test_block_groups_*)
    assert ex.block_bytes == KVCache.bytes_per_block(cfg, ex.kv_cache.block_size, torch.float32,
                                                     ex.kv_groups)


# ---- the pool in block groups: pages of one size, the sliding layers' window -----------------

GROUPS = {"gemma4": ((2,), (0,), (1,), (3,)), "gemma4_dense": ((2, 5), (0, 1, 3, 4))}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_groups_hold_the_sliding_layers_window(checkpoints, name):
    """Pages of one size: gemma4's global layer (twice the head size, half the KV heads)
    fills one alone, as each sliding layer does, and its KV-shared layers read their
    sources' pages; gemma4_dense's two global layers fill one, its four sliding layers
    another. In memory for 24 blocks of every layer, one table caps a sequence at 96
    tokens; in groups a block of tokens takes one page of the global group and the sliding
    groups hold the window and a step's tokens, so a 124-token sequence runs, with
    transformers' greedy tokens, and the one-table engine's in a larger pool."""
    path, ref = checkpoints[name]
    cfg = ModelConfig.from_hf_dir(path)
    groups = cfg.kv_groups
    assert groups.layers == GROUPS[name] and groups.reaches[0] == 0
    assert set(groups.reaches[1:]) == {WINDOW}
    if name == "gemma4":  # 4 reads 3's pages, 5 reads 2's
        assert groups.place(4) == groups.place(3) and groups.place(5) == groups.place(2)
    kw = dict(KW, block_size=4, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=512)
    block = KVCache.bytes_per_block(cfg, 4, torch.float32)
    page = KVCache.bytes_per_block(cfg, 4, torch.float32, groups)
    assert block == page * (4 if name == "gemma4" else 2)  # no page holds padding here
    one = LLM(model=path, **{**kw, "kv_cache_memory": 24 * block}, hybrid_kv_cache=False)
    assert one.engine.max_model_len == 96
    llm = LLM(model=path, **{**kw, "kv_cache_memory": 24 * block})
    engine = llm.engine
    bm = engine.block_manager
    assert bm.num_blocks == 24 * block // page and engine.max_model_len > 124
    prompt = _ids(llm, PROMPTS[0] * 4)[:100]
    held = []
    step = engine.step

    def watched():
        out = step()
        held.extend(bm.num_held(r.request_id) for r in engine.scheduler.running)
        return out
    engine.step = watched
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    big = LLM(model=path, **{**kw, "kv_cache_memory": 64 * block}, hybrid_kv_cache=False)
    assert big.generate([{"prompt_token_ids": prompt}], sp,
                        use_tqdm=False)[0].outputs[0].token_ids == got
    assert_reference_greedy(ref, prompt, got)
    # At its longest: 31 pages of the global group, at most 5 in each sliding group.
    sliding = len(groups.layers) - 1
    assert max(held) <= 31 + sliding * 5 and bm.num_free_blocks == bm.num_blocks


def test_a_prefix_in_block_groups_travels_between_engines(gemma4):
    """Disaggregated prefill with pages of one size holding layers of two head sizes and
    KV-shared layers: the receiver runs the prompt from the sender's pages."""
    assert_prefix_travels_between_engines(dict(model=gemma4[0], **KW, block_size=4),
                                          PROMPTS[0] * 4, GREEDY)


@pytest.mark.skipif(not load_ops("ops"), reason="needs the C++ kernels")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_block_groups_read_as_one_table_on_the_kernel_paths(gemma4, kv_dtype):
    """bf16 on the C++ kernels, where each layer's K and V are views into pages of another
    size (a block stride of its own; an int8 pool's scales too): the pool in groups gives
    the one-table prompt logits exactly, and its decode steps (the DecodeStack writing each
    layer's rows at its group's slots) the one table's tokens and logprobs, with the per-op
    path's."""
    path, _ = gemma4
    kw = dict(model=path, dtype="bfloat16", kernel_tuning="off", block_size=4,
              kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              kv_cache_dtype=kv_dtype)
    one = LLM(**kw, hybrid_kv_cache=False)
    llm = LLM(**kw)
    k = llm.engine.executor.kv_cache.layers[2][0]
    assert not k.is_contiguous() and k.stride(0) > k[0].numel()
    prompts = [_ids(llm, p * 2) for p in PROMPTS]
    assert torch.equal(prompt_logits(llm.engine, prompts), prompt_logits(one.engine, prompts))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    assert _tokens(llm, prompts, sp) == _tokens(one, prompts, sp)
    if kv_dtype == "auto":
        assert llm.engine.executor.model.decode_stack_ranges()
        assert_stack_decodes_as_per_op(llm, prompts, sp)


def test_multimodal_checkpoint_serves_its_text_model(gemma4, tmp_path):
    """Gemma4ForConditionalGeneration's layout: the tensors under model.language_model.,
    vision and audio towers beside them (not read)."""
    assert_multimodal_checkpoint_serves_its_text_model(
        gemma4[0], tmp_path, "Gemma4ForConditionalGeneration", "gemma4",
        lambda k: k.replace("model.", "model.language_model.", 1),
        ["model.vision_tower.patch_embedder.input_proj.weight",
         "model.embed_audio.embedding_projection.weight"], KW, PROMPTS)


def test_decode_stack_takes_every_form(checkpoints):
    """The whole-step DecodeStack takes Gemma 4's layers, the experts beside the MLP too
    (tests/test_decode_stack.py runs them against the per-op path)."""
    from servelm.models import decode_stack
    from servelm.models.decoder import CausalLM

    got = {name: decode_stack.describe(CausalLM(ModelConfig.from_hf_dir(path), max_positions=64)
                                       .to(torch.bfloat16))  # (fp32 experts run op by op)
           for name, (path, _) in checkpoints.items()}
    for d in got.values():
        assert isinstance(d, decode_stack.StackDescription), d
        assert d.v_norm and d.local_rotary_dim == 16 and d.rotary_dim == 32
    full = got["gemma4"]
    assert all(layer.experts_beside for layer in full.layers) and full.per_layer_input == 8
    assert [(layer.kv_shared, layer.k_eq_v) for layer in full.layers] == [
        (False, False), (False, False), (False, True), (False, False), (True, False), (True, False)]
    assert not any(layer.experts_beside for layer in got["gemma4_dense"].layers)


def test_weight_quantisation_takes_the_per_layer_inputs_projections(gemma4):
    """-q int8 quantises the per-layer inputs' projections with the other linear layers
    (quantization.TARGETS): the model-wide one and each layer's gate and projection."""
    from servelm.quantization import QuantLinear, quantize_model
    from servelm.models.decoder import CausalLM

    model = CausalLM(ModelConfig.from_hf_dir(gemma4[0]), max_positions=64)
    quantize_model(model, "int8", use_kernels=False)
    ple = [model.per_layer_embed.per_layer_model_projection]
    ple += [m for layer in model.layers
            for m in (layer.per_layer_input.input_gate, layer.per_layer_input.input_proj)]
    assert len(ple) == 13 and all(isinstance(m, QuantLinear) for m in ple)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tensor_parallel_2_matches_tp1(checkpoints, name):
    """Two ranks, each layer split by its own shape: the sliding layers' 2 KV heads one a
    rank, the global layers' single K=V head (32 dims) on both ranks with half its query
    heads each, the KV-shared layers' double-wide MLPs by their own width, each expert
    beside the MLP by half its intermediate size; the per-layer inputs replicated."""
    assert_tensor_parallel_matches(dict(model=checkpoints[name][0], num_threads=1, **KW),
                                   PROMPTS, GREEDY)


def test_tensor_parallel_plans_each_layer_by_its_shape(gemma4):
    """The rank's plan a layer, and its local config: the KV pool's shapes and the MLP
    widths of this rank's part."""
    from servelm.distributed.sharding import ShardPlan

    cfg = ModelConfig.from_hf_dir(gemma4[0])
    for rank in (0, 1):
        plan = ShardPlan.of(cfg, rank, 2)
        local = plan.local_config(cfg)
        assert local.num_heads == 2 and local.kv_heads_of(0) == 1
        assert [local.kv_heads_of(i) for i in range(6)] == [1, 1, 1, 1, 1, 1]
        assert [local.head_dim_of(i) for i in range(6)] == [16, 16, 32, 16, 16, 32]
        assert [local.intermediate_of(i) for i in range(6)] == [48, 48, 48, 48, 96, 96]
        assert plan.for_layer(0).kv_heads == (rank, rank + 1)  # sliding: 2 KV heads
        assert plan.for_layer(2).kv_heads == (0, 1)            # global: 1, shared
        assert plan.for_layer(2).q_heads == (2 * rank, 2 * rank + 2)
        assert plan.slice_of("model.layers.2.self_attn.k_proj.weight") == [(0, 0, 32)]
        assert plan.slice_of("model.layers.0.self_attn.k_proj.weight") == [
            (0, 16 * rank, 16 * rank + 16)]
        assert plan.slice_of("model.layers.5.mlp.down_proj.weight") == [
            (1, 96 * rank, 96 * rank + 96)]
        assert plan.slice_of("model.layers.1.experts.gate_up_proj") == [
            (1, 16 * rank, 16 * rank + 16), (1, 32 + 16 * rank, 32 + 16 * rank + 16)]
        assert plan.slice_of("model.embed_tokens_per_layer.weight") is None


# ---- the KV pool's per-layer shapes and the backends that cannot run them --------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])  # int8: with scales
def test_kv_cache_gives_each_layer_its_own_shape(gemma4, dtype):
    cfg = ModelConfig.from_hf_dir(gemma4[0])
    blocks, bs = 6, 4
    kv = KVCache(cfg, blocks, bs, dtype, torch.device("cpu"))
    elem = torch.empty(0, dtype=dtype).element_size()
    scale = 4 if dtype == torch.int8 else 0
    own = [0, 1, 2, 3]  # 4 and 5 read 3's and 2's
    per_layer = [2 * bs * cfg.kv_heads_of(i) * (cfg.head_dim_of(i) * elem + scale) for i in own]
    assert KVCache.bytes_per_block(cfg, bs, dtype) == sum(per_layer) == 2 * bs * (
        3 * 2 * (16 * elem + scale) + 1 * (32 * elem + scale))
    for i, entry in enumerate(kv.layers):
        k, v = entry[:2]
        assert k.shape == v.shape == (blocks, bs, cfg.kv_heads_of(i), cfg.head_dim_of(i))
        assert k.dtype == dtype and k.is_contiguous() and v.is_contiguous()
        if dtype == torch.int8:
            assert entry[2].shape == entry[3].shape == (blocks, bs, cfg.kv_heads_of(i))
    assert kv.layers[4] is kv.layers[3] and kv.layers[5] is kv.layers[2]
    # One allocation: the own layers' regions tile the rows without overlap, in layer order.
    regions = [t for i in own for t in kv.layers[i][:2]]
    base = kv.data.data_ptr()
    at = 0
    for t in regions:
        assert t.data_ptr() == base + at
        at += t.numel() * t.element_size()
    assert at == kv.data.numel() * kv.data.element_size()
    assert kv.uncommitted_bytes == blocks * sum(per_layer)
    kv.layers[2][1][5, 3] = 1  # the global layer's V, last block: nothing else moves
    assert int(kv.data.ne(0).sum()) == 1 * 32


def test_kv_cache_of_a_uniform_model_is_unchanged():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=32,
                      intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=64)
    assert cfg.uniform_kv
    assert KVCache.bytes_per_block(cfg, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 8 * 2
    kv = KVCache(cfg, 10, 16, torch.int8, torch.device("cpu"))
    assert kv.data.shape == (3, 2, 10, 16, 2, 8) and kv.scales.shape == (3, 2, 10, 16, 2)
    for i, (k, v, ks, vs) in enumerate(kv.layers):
        assert k.data_ptr() == kv.data[i, 0].data_ptr() and v.data_ptr() == kv.data[i, 1].data_ptr()
        assert ks.data_ptr() == kv.scales[i, 0].data_ptr()


def test_kernel_backends_decline_a_layer_shape_they_cannot_run():
    """The real Gemma 4's global layers of 512-dim heads run on the C++ attention; a layer
    past its 576 dims makes the cpu backends decline the model, and auto takes the
    reference."""
    from servelm.attention import BACKENDS

    real = AttentionSpec(torch.device("cpu"), torch.float32, torch.float32, num_heads=8,
                         num_kv_heads=4, head_dim=256, block_size=16,
                         layer_shapes=((2, 512),))
    assert real.shapes() == ((4, 256), (2, 512))
    if load_ops("ops"):
        assert BACKENDS["cpu"].unsupported(real) is None
    spec = AttentionSpec(torch.device("cpu"), torch.float32, torch.float32, num_heads=8,
                         num_kv_heads=4, head_dim=256, block_size=16,
                         layer_shapes=((2, 640),))
    for name in ("cpu", "cpu_sdpa", "cpu_amx"):
        assert "not a layer's 640" in BACKENDS[name].unsupported(spec)
    assert select(KernelConfig(), spec).name == "reference"
    with pytest.raises(ValueError, match="head dims up to 576"):
        select(KernelConfig(attention_backend="cpu"), spec)
    fits = AttentionSpec(torch.device("cpu"), torch.float32, torch.float32, 8, 4, 16, 16,
                         layer_shapes=((1, 32),))
    if load_ops("ops"):
        assert BACKENDS["cpu"].unsupported(fits) is None


# ---- GGUF: llama.cpp's gemma4, written here from the same checkpoints -----------------------

# HF names (after model.layers.N.) -> llama.cpp's blk.N.<name> (gguf-py's tensor map and the
# converter's renames: the router's scale and the per-expert scales as `.scale` tensors).
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight", "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight"}
_GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight",
                 "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                 "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
                 "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}


def _write_gemma4_gguf(path, model, tokenizer_meta: dict, extra_ple_rows: int = 0,
                       mxfp4: bool = False) -> None:
    """The file llama.cpp's converter writes for a Gemma 4 text model (its keys and
    names; norms as they are; rope_freqs for the global layers' proportional rotary;
    per-layer arrays for the KV heads and the MLP widths where layers differ), with
    `extra_ple_rows` more rows in the per-layer embedding table than the vocabulary (the
    converter cuts only token_embd's)."""
    import gguf

    from helpers import add_gguf_metadata

    # The config's values as a dict (transformers 5.25 holds the global layers' head size and
    # KV heads in per_layer_config, and refuses the per-layer attributes globally).
    cfg, arch = model.config.to_dict(), "gemma4"
    n = cfg["num_hidden_layers"]
    over = next((v for k, v in (cfg.get("per_layer_config") or {}).items()
                 if cfg["layer_types"][int(k)] == FULL), {})
    global_head_dim = over.get("head_dim", cfg.get("global_head_dim") or cfg["head_dim"])
    global_kv = over.get("num_key_value_heads", cfg.get("num_global_key_value_heads"))
    w = gguf.GGUFWriter(str(path), arch)
    shared = cfg.get("num_kv_shared_layers") or 0
    for key, value in {"context_length": cfg["max_position_embeddings"],
                       "embedding_length": cfg["hidden_size"], "block_count": n,
                       "attention.head_count": cfg["num_attention_heads"],
                       "attention.key_length": global_head_dim,
                       "attention.value_length": global_head_dim,
                       "attention.key_length_swa": cfg["head_dim"],
                       "attention.value_length_swa": cfg["head_dim"],
                       "attention.sliding_window": cfg["sliding_window"],
                       "attention.shared_kv_layers": shared,
                       "embedding_length_per_layer_input": cfg.get("hidden_size_per_layer_input") or 0,
                       "rope.dimension_count": global_head_dim,
                       "rope.dimension_count_swa": cfg["head_dim"]}.items():
        w.add_uint32(f"{arch}.{key}", value)
    if cfg["use_double_wide_mlp"]:
        w.add_array(f"{arch}.feed_forward_length",
                    [cfg["intermediate_size"] * (2 if i >= n - shared else 1) for i in range(n)])
    else:
        w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    if global_kv is not None and global_kv != cfg["num_key_value_heads"]:
        w.add_array(f"{arch}.attention.head_count_kv",
                    [cfg["num_key_value_heads"] if t == SLIDING else global_kv
                     for t in cfg["layer_types"]])
    else:
        w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_array(f"{arch}.attention.sliding_window_pattern",
                [t == SLIDING for t in cfg["layer_types"]])
    rope = cfg["rope_parameters"]
    w.add_float32(f"{arch}.rope.freq_base", rope[FULL]["rope_theta"])
    w.add_float32(f"{arch}.rope.freq_base_swa", rope[SLIDING]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if cfg["final_logit_softcapping"]:
        w.add_float32(f"{arch}.final_logit_softcapping", cfg["final_logit_softcapping"])
    if cfg["enable_moe_block"]:
        w.add_uint32(f"{arch}.expert_count", cfg["num_experts"])
        w.add_uint32(f"{arch}.expert_used_count", cfg["top_k_experts"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    add_gguf_metadata(w, tokenizer_meta)
    turn = int(global_head_dim * rope[FULL]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", torch.tensor(
        [1.0] * turn + [1e30] * (global_head_dim // 2 - turn)).numpy())
    for name, t in model.state_dict().items():
        t = t.float()
        if name == "lm_head.weight":  # tied: not written
            continue
        if name in _GGUF_GLOBALS:
            if name == "model.embed_tokens_per_layer.weight" and extra_ple_rows:
                t = torch.cat((t, torch.randn(extra_ple_rows, t.shape[1])))
            w.add_tensor(_GGUF_GLOBALS[name], t.contiguous().numpy())
            continue
        i, part = name.split(".")[2], ".".join(name.split(".")[3:])
        if mxfp4 and _GGUF_NAMES[part].endswith("_exps.weight"):  # llama-quantize MXFP4_MOE's
            mx = gguf.GGMLQuantizationType.MXFP4
            w.add_tensor(f"blk.{i}.{_GGUF_NAMES[part]}",
                         gguf.quants.quantize(t.contiguous().numpy(), mx), raw_dtype=mx)
            continue
        w.add_tensor(f"blk.{i}.{_GGUF_NAMES[part]}", t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gguf_loads_as_its_hf_checkpoint(checkpoints, name, gguf_path, tmp_path):
    """llama.cpp's gemma4 file: the layer kinds from the bool pattern, the two head sizes,
    the global layers' KV heads from the per-layer array and K=V from their missing attn_v,
    the KV-shared layers and their double-wide MLPs from the width array, the proportional
    rotary from rope_freqs, the per-layer inputs (their table's rows past the vocabulary
    dropped), the experts' fused gate_up and the router's and experts' scales: the config
    and the logits equal the HF checkpoint's, and greedy tokens too."""
    from helpers import gguf_tokenizer_metadata

    path, model = checkpoints[name]
    _write_gemma4_gguf(tmp_path / "model.gguf", model, gguf_tokenizer_metadata(gguf_path),
                       extra_ple_rows=5)
    hf = LLM(model=path, cpu_kernels=False, **KW)
    gg = LLM(model=str(tmp_path / "model.gguf"), cpu_kernels=False, **KW)
    want, got = hf.engine.model_config, gg.engine.model_config
    assert got.family == "gemma4"
    for field in ("layer_types", "sliding_window", "head_dim", "layer_head_dims",
                  "num_kv_heads", "layer_kv_heads", "kv_source_layers", "rope_theta",
                  "rope_local_theta", "rope_scaling", "final_logit_softcap", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "rotary_dim",
                  "tie_word_embeddings", "embed_scale", "attn_scale"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.extra == want.extra
    prompts = [_ids(hf, p) for p in PROMPTS]
    torch.testing.assert_close(prompt_logits(gg.engine, prompts),
                               prompt_logits(hf.engine, prompts), rtol=1e-5, atol=1e-5)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in gg.generate(PROMPTS, greedy, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in hf.generate(PROMPTS, greedy, use_tqdm=False)])


def test_gguf_tensor_parallel_2_matches_tp1(gemma4, gguf_path, tmp_path):
    """The same split read from llama.cpp's file: the per-layer KV heads and widths from its
    arrays, the fused experts' gate_up by halves, the per-layer table replicated."""
    from helpers import gguf_tokenizer_metadata

    path = tmp_path / "model.gguf"
    _write_gemma4_gguf(path, gemma4[1], gguf_tokenizer_metadata(gguf_path), extra_ple_rows=5)
    assert_tensor_parallel_matches(dict(model=str(path), num_threads=1, **KW), PROMPTS, GREEDY)


def test_mxfp4_experts_gguf_runs_them_as_mxfp4(checkpoints, gguf_path, tmp_path):
    """The experts beside the dense MLP in MXFP4 (llama-quantize's MXFP4_MOE): kept as MXFP4
    under their own names, the logits those of the same file dequantised on load."""
    from helpers import gguf_tokenizer_metadata

    path = tmp_path / "mxfp4.gguf"
    _write_gemma4_gguf(path, checkpoints["gemma4"][1], gguf_tokenizer_metadata(gguf_path),
                       mxfp4=True)
    kept = LLM(model=str(path), cpu_kernels=False, **KW)
    dense = LLM(model=str(path), cpu_kernels=False, quantization="none", **KW)
    formats = {m.experts.expert_format for m in kept.engine.executor.model.modules()
               if hasattr(m, "experts") and hasattr(m.experts, "expert_format")}
    assert formats == {"mxfp4"}
    prompts = [_ids(kept, p) for p in PROMPTS]
    torch.testing.assert_close(prompt_logits(kept.engine, prompts),
                               prompt_logits(dense.engine, prompts), rtol=1e-5, atol=1e-5)


def test_gguf_rope_freqs_must_be_the_proportional_rotary():
    from servelm.models.registry import family_for_architecture

    family = family_for_architecture("Gemma4ForCausalLM")
    cfg = ModelConfig(architecture="Gemma4ForCausalLM", family="gemma4", vocab_size=10,
                      hidden_size=8, intermediate_size=8, num_layers=2, num_heads=1,
                      num_kv_heads=1, head_dim=8, layer_types=(SLIDING, FULL),
                      max_position_embeddings=64, sliding_window=4, layer_head_dims=(8, 16))
    got = family.gguf_rope_freqs(cfg, (1.0, 1.0, 1e30, 1e30, 1e30, 1e30, 1e30, 1e30))
    assert got.rope_scaling["rope_type"] == "proportional"
    assert got.rope_scaling["partial_rotary_factor"] == 0.25
    for bad in ((1.0,) * 4, (1.0, 2.0) + (1e30,) * 6, (1e30, 1.0) + (1e30,) * 6):
        with pytest.raises(ValueError, match="proportional rotary"):
            family.gguf_rope_freqs(cfg, bad)
