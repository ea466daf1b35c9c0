"""Llama 4 (text) against transformers: a tiny random checkpoint made by transformers (four
layers: three rotary layers with chunked local attention and q/k L2 norms, a fourth without
rotary attending to everything with its queries temperature-scaled; dense MLPs and MoE
layers alternating, top-1 sigmoid routing on the experts' inputs beside an ungated shared
expert; llama3 rotary scaling), served token-exact through prefill, chunked prefill whose
chunks do not align with the attention chunks, decode across chunk boundaries, the prefix
cache and preemption; the chunked mask on the reference attention against a hand-written
one, the kernel backends declining it; int8 weights; the multimodal checkpoint's text
model; llama.cpp's `llama4` GGUF written by gguf-py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import (add_gguf_metadata, assert_chunks_cache_and_preemption_keep_tokens,
                     assert_matches_reference, assert_reference_greedy,
                     assert_multimodal_checkpoint_serves_its_text_model,
                     assert_tensor_parallel_matches, gguf_tokenizer_metadata, prompt_logits,
                     tiny_hf_checkpoint)
from helpers import TINY_KW as KW, TINY_PROMPTS as PROMPTS
from servelm import LLM, SamplingParams
from servelm.kernels import load_ops
from servelm.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CHUNK = 6  # the attention chunk: it divides neither the KV block (16) nor the prefill budget
# Weights (initializer_range) and a temperature (floor_scale, attn_scale) large enough that
# the no-rope layer's query scale, its +1 offset included, moves the logits past 1e-3.
CONFIG = dict(num_hidden_layers=4, head_dim=16, intermediate_size=48, intermediate_size_mlp=96,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
              attention_chunk_size=CHUNK, floor_scale=2, attn_scale=1.0,
              initializer_range=0.1,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64})
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, hf_tokenizer):
    """(HF directory, transformers model)."""
    d = tmp_path_factory.mktemp("hf-llama4")
    model = tiny_hf_checkpoint(d, "Llama4TextConfig", "Llama4ForCausalLM", CONFIG,
                               hf_tokenizer, seed=7)
    return str(d), model


def _ids(llm, prompt):
    return llm.get_tokenizer().encode(prompt)


def test_config_reads_llama4_keys(llama4):
    cfg = ModelConfig.from_hf_dir(llama4[0])
    assert cfg.family == "llama4" and cfg.no_rope_layers == (3,) and cfg.rope_interleaved
    assert cfg.intermediate_size == 96 and cfg.dense_layers == (0, 2)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size) == (4, 1, 48, 48)
    assert not cfg.norm_topk_prob and cfg.rope_scaling["rope_type"] == "llama3"
    assert (cfg.query_scale_beta, cfg.query_scale_period) == (1.0, 2)
    assert cfg.extra == {"router_scoring": "sigmoid", "expert_input_weighted": True,
                         "shared_expert_gate": False, "qk_l2_norm_layers": (0, 1, 2),
                         "attention_chunk_size": CHUNK, "chunked_layers": (0, 1, 2),
                         "query_scale_layers": (3,), "query_scale_offset": 1.0}


def test_layers_take_their_options_and_decode_op_by_op(llama4):
    """Chunks and L2 norms on the rotary layers, the temperature on the no-rope one; the
    whole-step DecodeStack declines the first layer's chunked attention."""
    from servelm.models import decode_stack
    from servelm.models.decoder import CausalLM

    model = CausalLM(ModelConfig.from_hf_dir(llama4[0]), max_positions=64)
    attn = [layer.self_attn for layer in model.layers]
    assert [a.chunk for a in attn] == [CHUNK, CHUNK, CHUNK, None]
    assert [a.qk_l2_norm for a in attn] == [True, True, True, False]
    assert [a.rope for a in attn] == [True, True, True, False]
    assert [a.q_scale_beta for a in attn] == [0.0, 0.0, 0.0, 1.0]
    moe = model.layers[1].mlp
    assert moe.shared_expert_gate is None and moe.expert_input_weighted
    got = decode_stack.describe(model)
    assert isinstance(got, str) and "its attention is chunked" in got


def test_eager_fp32_matches_transformers(llama4):
    path, ref = llama4
    llm = LLM(model=path, cpu_kernels=False, **KW)
    prompts = [_ids(llm, p) for p in PROMPTS]
    assert min(map(len, prompts)) > 2 * CHUNK
    assert_matches_reference(llm, ref, prompts, GREEDY)


def test_chunked_prefill_prefix_cache_and_preemption_keep_the_tokens(llama4):
    """The C++ ops where they build (the attention too, which runs the chunks), a 16-token
    budget (prompts prefilled in pieces that straddle attention chunks), a second round from
    the prefix cache (16 cached tokens: mid-chunk), then a pool that preempts: the eager
    path's tokens (the reference attention) each time."""
    path, _ = llama4
    fast, _ = assert_chunks_cache_and_preemption_keep_tokens(path, PROMPTS, GREEDY, **KW)
    assert fast.engine.executor.runner.attention.name == ("cpu" if load_ops("ops")
                                                          else "reference")


def test_int8_weights_stay_close(llama4):
    """int8 quantises the attention projections, the dense MLPs, the shared expert and the
    LM head (the routed experts stay in the activation dtype): within 1e-3 (cosine)."""
    path, _ = llama4
    ref = LLM(model=path, cpu_kernels=False, **KW)
    prompts = [_ids(ref, p) for p in PROMPTS]
    want = prompt_logits(ref.engine, prompts)
    llm = LLM(model=path, quantization="int8", **KW)
    got = prompt_logits(llm.engine, prompts)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item() > 0.999


def test_tensor_parallel_2_matches_tp1(llama4):
    """Two ranks, each with half the heads (their chunks, L2 norms and temperature as one
    device runs them), half of each dense MLP, expert and the shared expert (the router
    whole, the weights on each rank's expert inputs), as one device's logits and tokens."""
    assert_tensor_parallel_matches({**KW, "model": llama4[0], "num_threads": 1}, PROMPTS, GREEDY)


def test_multimodal_checkpoint_serves_its_text_model(llama4, tmp_path):
    """Llama4ForConditionalGeneration's layout: the tensors under language_model., a
    vision tower beside them (not read)."""
    assert_multimodal_checkpoint_serves_its_text_model(
        llama4[0], tmp_path, "Llama4ForConditionalGeneration", "llama4",
        lambda k: f"language_model.{k}",
        ["vision_model.patch_embedding.linear.weight", "multi_modal_projector.linear_1.weight"],
        KW, PROMPTS)


# ---- the chunked mask on the reference attention -------------------------------------------

def _group(seqs, block_size, g):
    from servelm.attention import BACKENDS

    return BACKENDS["reference"].build(seqs, block_size, g, torch.device("cpu"))[1].groups


def test_reference_attention_chunks_match_a_hand_written_mask():
    """paged_attention with chunk c: query at position p attends the keys k <= p with
    k // c == p // c, grouped-query heads; a prompt chunk after a cached prefix that
    straddles two attention chunks, and a decode row at a chunk's first position."""
    from servelm.attention.reference import paged_attention

    g = torch.Generator().manual_seed(0)
    H, KVH, D, bs, c = 4, 2, 16, 4, 5
    kc, vc = (torch.randn(8, bs, KVH, D, generator=g) for _ in range(2))
    scale = D ** -0.5
    for start, n, blocks in [(3, 8, [3, 1, 6]), (10, 1, [0, 2, 5])]:
        seq = SimpleNamespace(token_ids=list(range(n)), start_pos=start, block_table=blocks,
                              sample=True, all_logits=False, num_logits=1)
        (group,) = _group([seq], bs, H // KVH)
        q = torch.randn(n, H, D, generator=g)
        got = paged_attention(q, kc, vc, group, scale, chunk=c)
        k, v = (x[blocks].reshape(-1, KVH, D) for x in (kc, vc))
        rows = []
        for t in range(n):
            pos = start + t
            lo = pos // c * c
            out = []
            for h in range(H):
                kv = h // (H // KVH)
                w = torch.softmax((k[lo:pos + 1, kv] @ q[t, h]) * scale, dim=0)
                out.append(w @ v[lo:pos + 1, kv])
            rows.append(torch.cat(out))
        torch.testing.assert_close(got, torch.stack(rows), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(got, paged_attention(q, kc, vc, group, scale), atol=1e-3)


# ---- GGUF ----------------------------------------------------------------------------------

def _llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for llama3 scaling: one divisor per frequency."""
    import math

    p = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_gguf_loads_as_transformers(llama4, gguf_path, tmp_path):
    """llama.cpp's `llama4` spelling of the tiny model (convert_hf_to_gguf.py's
    Llama4Model: q/k not permuted, experts split into gate / up / down [E, I, H] /
    [E, H, I], the shared expert as *_shexp, rope_freqs for llama3 scaling): its greedy
    tokens are transformers' with llama.cpp's built-in chunk (8192) and temperature
    (floor 8192, scale 0.1), which it stores no metadata for."""
    src, _ = llama4
    ref = transformers.Llama4ForCausalLM.from_pretrained(
        src, dtype=torch.float32, attention_chunk_size=8192, floor_scale=8192,
        attn_scale=0.1).eval()
    cfg = ref.config
    arch, path = "llama4", tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "block_count": cfg.num_hidden_layers,
                       "feed_forward_length": cfg.intermediate_size_mlp,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads,
                       "attention.key_length": cfg.head_dim,
                       "attention.value_length": cfg.head_dim,
                       "rope.dimension_count": cfg.head_dim,
                       "expert_count": cfg.num_local_experts,
                       "expert_used_count": cfg.num_experts_per_tok,
                       "expert_feed_forward_length": cfg.intermediate_size,
                       "interleave_moe_layer_step": cfg.interleave_moe_layer_step}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    meta = gguf_tokenizer_metadata(gguf_path)
    add_gguf_metadata(w, meta)
    w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up",
             "feed_forward.down_proj": "ffn_down", "feed_forward.router": "ffn_gate_inp",
             "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
             "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
             "feed_forward.shared_expert.down_proj": "ffn_down_shexp"}
    for name, t in ref.state_dict().items():
        t = t.float()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight",
                          "model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[name], t.numpy())
            continue
        i, rest = int(name.split(".")[2]), name.split(".", 3)[3]
        if rest == "feed_forward.experts.gate_up_proj":           # [E, H, 2I]
            gate, up = t.transpose(1, 2).chunk(2, dim=1)            # [E, I, H] each
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", gate.contiguous().numpy())
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", up.contiguous().numpy())
        elif rest == "feed_forward.experts.down_proj":            # [E, I, H] -> [E, H, I]
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", t.transpose(1, 2).contiguous().numpy())
        else:
            part, _, kind = rest.rpartition(".")
            w.add_tensor(f"blk.{i}.{parts[part]}.{kind}", t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    llm = LLM(model=str(path), cpu_kernels=False, **KW)
    gcfg = llm.engine.model_config
    assert gcfg.family == "llama4" and gcfg.no_rope_layers == (3,) and gcfg.dense_layers == (0, 2)
    assert gcfg.extra["attention_chunk_size"] == 8192 and gcfg.query_scale_period == 8192
    assert gcfg.extra["qk_l2_norm_layers"] == (0, 1, 2)
    prompts = [_ids(llm, p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert_reference_greedy(ref, ids, out.outputs[0].token_ids,
                                banned=(cfg.eos_token_id,))


def test_gguf_config_follows_llama_cpps_built_in_values():
    """llama.cpp stores no chunk, temperature or no-rope pattern for `llama4`: chunks of 8192
    and every 4th layer without rotary unless attention.sliding_window is 0 (then neither),
    the q/k norms unless the model has 128 experts (Maverick)."""
    from servelm.models.registry import family_for_gguf

    fam = family_for_gguf("llama4")
    base = {"num_layers": 8, "num_experts": 16, "moe_intermediate_size": 32}
    got = fam.gguf_config(lambda key, default=None: None, base, set())
    assert got["no_rope_layers"] == (3, 7) and got["shared_expert_intermediate_size"] == 32
    assert got["extra"]["chunked_layers"] == got["extra"]["qk_l2_norm_layers"] == (
        0, 1, 2, 4, 5, 6)
    assert (got["query_scale_beta"], got["query_scale_period"]) == (0.1, 8192)
    maverick = fam.gguf_config(lambda key, default=None: None, {**base, "num_experts": 128},
                               set())
    assert maverick["extra"]["qk_l2_norm_layers"] == ()
    off = fam.gguf_config(lambda key, default=None: 0 if key == "attention.sliding_window"
                          else default, base, set())
    assert off["no_rope_layers"] == () and "chunked_layers" not in off["extra"]
    assert "query_scale_beta" not in off and len(off["extra"]["qk_l2_norm_layers"]) == 8
