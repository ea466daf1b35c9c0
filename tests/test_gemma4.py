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
DecodeStack and the kernel backends decline what they cannot run, with the reason."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import (assert_chunks_cache_and_preemption_keep_tokens, assert_matches_reference,
                     assert_multimodal_checkpoint_serves_its_text_model, prompt_logits,
                     tiny_hf_checkpoint)
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
        with torch.no_grad():
            for pname, b in model.named_buffers():
                if pname.endswith("layer_scalar"):
                    b.uniform_(0.6, 1.4)
            for pname, p in model.named_parameters():
                if pname.endswith(("router.scale", "router.per_expert_scale")):
                    p.add_(torch.randn_like(p) * 0.3)
        model.save_pretrained(d)
        out[name] = (str(d), model)
    return out


@pytest.fixture(scope="module")
def gemma4(checkpoints):
    return checkpoints["gemma4"]


def _ids(llm, prompt):
    return llm.get_tokenizer().encode(prompt)


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
    the eager path's tokens each time. Decode steps run op by op (the DecodeStack declines)."""
    path, _ = checkpoints[name]
    fast = assert_chunks_cache_and_preemption_keep_tokens(path, PROMPTS, GREEDY, **KW)
    ex = fast.engine.executor
    assert not ex.model.fused_decode
    if load_ops("ops"):
        assert ex.runner.attention.name.startswith("cpu")
    cfg = ex.model.config
    assert ex.block_bytes == KVCache.bytes_per_block(cfg, ex.kv_cache.block_size, torch.float32)


def test_multimodal_checkpoint_serves_its_text_model(gemma4, tmp_path):
    """Gemma4ForConditionalGeneration's layout: the tensors under model.language_model.,
    vision and audio towers beside them (not read)."""
    assert_multimodal_checkpoint_serves_its_text_model(
        gemma4[0], tmp_path, "Gemma4ForConditionalGeneration", "gemma4",
        lambda k: k.replace("model.", "model.language_model.", 1),
        ["model.vision_tower.patch_embedder.input_proj.weight",
         "model.embed_audio.embedding_projection.weight"], KW, PROMPTS)


def test_decode_stack_declines_with_the_reason(checkpoints):
    from servelm.models import decode_stack
    from servelm.models.decoder import CausalLM

    reasons = {}
    for name, (path, _) in checkpoints.items():
        got = decode_stack.describe(CausalLM(ModelConfig.from_hf_dir(path), max_positions=64))
        assert isinstance(got, str)
        reasons[name] = got
    assert reasons == {"gemma4": "layer 0: it has routed experts beside its MLP (routed "
                                 "experts run op by op)",
                       "gemma4_dense": "layer 0: its values are RMS-normalised (v_norm)"}


def test_tensor_parallel_and_lora_are_refused(gemma4):
    with pytest.raises(ValueError, match="tensor parallelism does not support the gemma4"):
        LLM(model=gemma4[0], tensor_parallel_size=2, **KW)
    with pytest.raises(ValueError, match="LoRA adapters cannot adapt a model whose layers"):
        LLM(model=gemma4[0], enable_lora=True, cpu_kernels=False, **KW)


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
