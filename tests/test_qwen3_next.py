"""Qwen3-Next and Qwen3.5 (dense, MoE) against transformers: tiny random checkpoints made by
transformers (four layers: three gated-DeltaNet linear-attention layers over a recurrent
state, then one full-attention layer with its output gate and a partial rotary; Qwen3-Next
with MoE layers beside a dense one), served token-exact through prefill, chunked prefill
mixed with decodes, preemption and recurrent-state slots that run out; the chunked delta
rule against the token-by-token recurrence; the prefix cache restoring the recurrent state
from snapshots; what hybrid models refuse (speculative decoding, tensor parallelism); int8
weights; Qwen3.5's multimodal checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import (add_gguf_metadata, assert_chunks_cache_and_preemption_keep_tokens,
                     assert_matches_reference, assert_stack_decodes_as_per_op,
                     assert_multimodal_checkpoint_serves_its_text_model,
                     assert_tensor_parallel_matches,
                     gguf_tokenizer_metadata, prompt_logits, tiny_hf_checkpoint)
from helpers import TINY_KW as KW, TINY_PROMPTS as PROMPTS
from servelm import LLM, SamplingParams
from servelm.models.config import ModelConfig
from servelm.models.linear_attention import delta_rule_chunked, delta_rule_step, l2_normalize

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, initializer_range=0.1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory, hf_tokenizer):
    """(HF directory, transformers model): MoE on layers 0, 2 and 3, a dense MLP on 1."""
    d = tmp_path_factory.mktemp("hf-qwen3-next")
    model = tiny_hf_checkpoint(d, "Qwen3NextConfig", "Qwen3NextForCausalLM",
                               {**HYBRID, **MOE, "mlp_only_layers": [1]}, hf_tokenizer, seed=3)
    return str(d), model


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory, hf_tokenizer):
    d = tmp_path_factory.mktemp("hf-qwen3-5")
    model = tiny_hf_checkpoint(d, "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", HYBRID,
                               hf_tokenizer, seed=4)
    return str(d), model


def _ids(llm, prompt):
    return llm.get_tokenizer().encode(prompt)


def test_config_reads_the_hybrid_layout(qwen3_next):
    path, ref = qwen3_next
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.family == "qwen3_next" and cfg.has_recurrent_state
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.kv_layers == (3,) and cfg.rotary_dim == 4 and cfg.qk_norm
    assert cfg.extra == {"attn_output_gate": True, "linear_attn": {
        "num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 8, "head_v_dim": 8, "conv_kernel": 4}}
    assert cfg.dense_layers == (1,) and cfg.num_experts == 4
    # Linear attention's own shapes, the output gate, the gated shared expert: counted.
    assert cfg.num_params == sum(p.numel() for p in ref.parameters())


def test_layers_caches_and_the_decode_path(qwen3_next, caplog):
    """The linear layers hold no KV blocks but a state slot each sequence, and as many
    snapshots of such states for the prefix cache (rows after the slots); where the budget
    leaves no room for a snapshot, prefix caching is turned off (logged); the whole-step
    DecodeStack declines Qwen3-Next for its routed experts."""
    from servelm.engine.executor import state_snapshots
    from servelm.models import decode_stack

    path, _ = qwen3_next
    llm = LLM(model=path, max_num_seqs=8, **KW)
    engine = llm.engine
    assert engine.block_manager.enable_caching
    assert engine.executor.num_state_slots == engine.block_manager.num_state_slots == 8
    assert engine.executor.num_state_snapshots == engine.block_manager.num_state_snapshots == 8
    runner = engine.executor.runner
    # K and V of the one full-attention layer only.
    assert runner.kv_cache.data.shape[0] == 1 and runner.kv_cache.layers[:3] == [None] * 3
    assert [type(c) for c in runner.layer_caches] == [tuple] * 4
    conv, ssm = runner.layer_caches[0]
    assert conv.shape == (16, 2 * 16 + 32, 3) and ssm.shape == (16, 4, 8, 8)
    assert ssm.dtype == torch.float32
    got = decode_stack.describe(engine.executor.model)
    assert isinstance(got, str) and "routed experts" in got  # (its DeltaNet layers it takes)
    # Snapshots take at most a quarter of the budget.
    state = engine.executor.worker.state_bytes()
    assert state_snapshots(8, state, 4 * 3 * state) == 3
    assert state_snapshots(8, state, 4 * state - 1) == 0
    budget = 2 * state + engine.executor.block_bytes  # a slot, a block or two, no snapshot
    assert state_snapshots(1, state, budget) == 0
    with caplog.at_level(logging.INFO, logger="servelm.engine.engine"):
        tight = LLM(model=path, **{**KW, "kv_cache_memory": budget})
    assert "prefix caching off" in caplog.text
    assert not tight.engine.block_manager.enable_caching
    assert tight.engine.executor.num_state_snapshots == 0


def test_prefix_cache_restores_the_state_from_snapshots(qwen3_5):
    """Prefix caching beside a recurrent state: a prompt's state is kept at its last block
    boundary (a snapshot), and its answer's at the answer's latest one; a later prompt that
    extends both (a chat's next turn) is admitted on the cached blocks with the state
    restored into its slot, and computes only the rest; its tokens are those of an engine
    without the cache. A prompt that parts from the first inside a block reuses the blocks
    before it only where a snapshot is (none there: all computed)."""
    path, _ = qwen3_5
    plain = LLM(model=path, enable_prefix_caching=False, **KW)
    cached = LLM(model=path, max_num_seqs=4, **KW)
    bm = cached.engine.block_manager
    assert bm.enable_caching and bm.num_state_snapshots == 4
    bs = bm.block_size
    text = " ".join(PROMPTS)
    turn1 = _ids(cached, text)[:3 * bs + 5]
    out1 = cached.generate([turn1], GREEDY, use_tqdm=False)[0]
    # Kept: the prompt's state at 48 tokens, and its answer's at 64 (73 computed).
    assert bm.num_snapshots == 2 and out1.metrics.num_cached_tokens == 0
    # The next turn: the first prompt, its answer and more.
    turn2 = turn1 + list(out1.outputs[0].token_ids) + _ids(cached, PROMPTS[2])
    apart = turn1[:2 * bs + 3] + _ids(cached, PROMPTS[1])  # parts inside block 3
    outs = cached.generate([turn2, apart], GREEDY, use_tqdm=False)
    want = plain.generate([turn1, turn2, apart], GREEDY, use_tqdm=False)
    assert out1.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want[1:]]
    assert outs[0].metrics.num_cached_tokens == 4 * bs  # into the answer: its snapshot
    assert outs[1].metrics.num_cached_tokens == 0       # blocks 1-2 cached, no state there
    assert bm.num_snapshots >= 3


@pytest.mark.parametrize("budget", [4096, 20])
def test_prompts_sharing_a_system_prompt_restart_where_they_part(qwen3_5, budget):
    """Three prompts share a system prompt and part after it (inside block 3). The second
    finds the first's blocks cached but no state there, so it computes them, in a step that
    ends where the two part (with a 20-token budget: the third prompt chunk, cut short),
    and keeps its state there; the third restarts from it. Tokens: an engine without the
    cache's."""
    path, _ = qwen3_5
    plain = LLM(model=path, enable_prefix_caching=False, **KW)
    llm = LLM(model=path, max_num_seqs=4, max_num_batched_tokens=budget, **KW)
    bm = llm.engine.block_manager
    bs = bm.block_size
    system = _ids(llm, " ".join(PROMPTS))[:3 * bs + 5]
    prompts = [system + _ids(llm, p) for p in PROMPTS]
    steps = []
    step = llm.engine.step

    def watched():
        sched = llm.engine.scheduler
        out = step()
        steps.append([(r.request_id, r.num_computed_tokens) for r in sched.running])
        return out
    llm.engine.step = watched
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    want = plain.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, 3 * bs]
    # The second prompt's steps stopped at 48 tokens on the way.
    assert any((rid, 3 * bs) in s for s in steps for rid in {r for r, _ in s})


def test_chunks_prefix_cache_and_preemption_with_snapshots_keep_the_tokens(qwen3_next):
    """With the prefix cache on: prompts in 16-token chunks (each keeping its state at its
    last block boundary), a second round admitted on the cached blocks and restored states,
    and a pool that preempts (a readmitted sequence restored from its snapshot, or
    recomputed): the eager path's tokens each time, and no snapshot or slot lost."""
    path, _ = qwen3_next
    # The tight pool: a few slots, a snapshot or two, four or five blocks.
    _, tight = assert_chunks_cache_and_preemption_keep_tokens(
        path, PROMPTS, GREEDY, tight_memory=lambda ex: 6 * ex.worker.state_bytes()
        + 4 * ex.block_bytes, tight_rounds=2, **KW)
    bm = tight.engine.block_manager
    assert tight.engine.executor.num_blocks <= 5 and bm.num_state_snapshots >= 1
    assert bm.num_snapshots and bm.num_free_slots == bm.num_state_slots and bm.owners() == {}


def test_qwen3_next_matches_transformers(qwen3_next):
    path, ref = qwen3_next
    llm = LLM(model=path, **KW)
    assert_matches_reference(llm, ref, [_ids(llm, p) for p in PROMPTS], GREEDY)


def test_qwen3_5_matches_transformers(qwen3_5):
    path, ref = qwen3_5
    llm = LLM(model=path, cpu_kernels=False, **KW)
    assert llm.engine.model_config.family == "qwen3_5"
    assert_matches_reference(llm, ref, [_ids(llm, p) for p in PROMPTS], GREEDY)


def test_qwen3_5_moe_matches_transformers(tmp_path, hf_tokenizer):
    ref = tiny_hf_checkpoint(tmp_path, "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                             {**HYBRID, **MOE}, hf_tokenizer, seed=5)
    llm = LLM(model=str(tmp_path), **KW)
    cfg = llm.engine.model_config
    assert cfg.family == "qwen3_5_moe" and cfg.dense_layers == () and cfg.norm_topk_prob
    assert_matches_reference(llm, ref, [_ids(llm, p) for p in PROMPTS[:2]], GREEDY)


def test_chunks_mixed_steps_slots_and_preemption_keep_the_tokens(qwen3_next):
    """The eager path's tokens (C++ ops off), whole prompts in one step each, against:
    a 16-token budget (prompts in chunks whose recurrent state carries over, decodes of one
    sequence in the same steps as another's chunks); two state slots for three prompts
    (the third waits for a slot); a pool that preempts (a recomputed sequence restarts its
    state from zeros)."""
    path, _ = qwen3_next
    eager = LLM(model=path, cpu_kernels=False, **KW)
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    chunked = LLM(model=path, max_num_batched_tokens=16, max_num_seqs=4, **KW)
    outs = chunked.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    two = LLM(model=path, max_num_seqs=2, **KW)
    assert two.engine.block_manager.num_state_slots == 2
    assert [o.outputs[0].token_ids
            for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    ex = chunked.engine.executor  # three slots and five blocks (prefix caching off)
    budget = 3 * ex.worker.state_bytes() + 5 * ex.block_bytes
    tight = LLM(model=path, **{**KW, "kv_cache_memory": budget}, max_num_seqs=3,
                admission_lookahead=0, enable_prefix_caching=False)
    assert tight.engine.executor.num_blocks == 5
    outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    assert tight.engine.block_manager.num_free_slots == tight.engine.block_manager.num_state_slots


def test_what_a_hybrid_model_refuses(qwen3_next):
    path, _ = qwen3_next
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        LLM(model=path, speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            **KW)



@pytest.mark.parametrize("which", ["qwen3_next", "qwen3_5"])
def test_tensor_parallel_2_matches_tp1(qwen3_next, qwen3_5, which):
    """Two ranks, each with half of every DeltaNet's key heads and their value heads (their
    rows of Qwen3-Next's grouped in_proj_qkvz / in_proj_ba or Qwen3.5's parts, convolution
    channels, gates, states; out_proj's columns), half the attention heads (q_proj's query
    and gate rows together), half of each expert and MLP: one device's logits and tokens.
    Then a chat's next turn on the prefix cache: the state restored from its snapshot on
    every rank."""
    path = (qwen3_next if which == "qwen3_next" else qwen3_5)[0]
    kw = dict(model=path, num_threads=1, **KW)
    assert_tensor_parallel_matches(kw, PROMPTS, GREEDY)
    one, two = LLM(**kw), LLM(tensor_parallel_size=2, **kw)
    try:
        assert two.engine.executor.num_state_slots == one.engine.executor.num_state_slots
        deltanet = two.engine.executor.model.layers[0].linear_attn  # rank 0's
        assert (deltanet.num_k_heads, deltanet.num_v_heads) == (1, 2)  # of 2 and 4
        turn1 = _ids(one, " ".join(PROMPTS))[:40]
        out = [llm.generate([turn1], GREEDY, use_tqdm=False)[0] for llm in (one, two)]
        assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids
        turn2 = turn1 + list(out[0].outputs[0].token_ids) + _ids(one, PROMPTS[1])
        again = [llm.generate([turn2], GREEDY, use_tqdm=False)[0] for llm in (one, two)]
        assert again[1].metrics.num_cached_tokens > 0
        assert again[0].outputs[0].token_ids == again[1].outputs[0].token_ids
    finally:
        two.engine.shutdown()


def test_int8_weights_stay_close(qwen3_next):
    """int8 quantises the DeltaNet's in/out projections, the attention (its gate too), the
    dense MLP, the shared experts and the LM head: the logits stay close (cosine 0.95; this
    tiny random model is chaotic on the second prompt: bf16 activations alone move it to
    0.89, int8 weights to 0.96, a projection's rows out of order to ~0)."""
    path, _ = qwen3_next
    ref = LLM(model=path, cpu_kernels=False, **KW)
    prompts = [_ids(ref, p) for p in PROMPTS]
    want = prompt_logits(ref.engine, prompts)
    llm = LLM(model=path, quantization="int8", **KW)
    model = llm.engine.executor.model
    assert type(model.layers[0].linear_attn.in_proj_qkvz) is not torch.nn.Linear
    assert type(model.layers[3].self_attn.attn_gate) is not torch.nn.Linear
    got = prompt_logits(llm.engine, prompts)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item() > 0.95


def test_multimodal_qwen3_5_checkpoint_serves_its_text_model(qwen3_5, tmp_path):
    """Qwen3_5ForConditionalGeneration's layout: the tensors under model.language_model., a
    vision tower and MTP layers beside them (not read)."""
    assert_multimodal_checkpoint_serves_its_text_model(
        qwen3_5[0], tmp_path, "Qwen3_5ForConditionalGeneration", "qwen3_5",
        lambda k: k.replace("model.", "model.language_model.", 1),
        ["model.visual.patch_embed.proj.weight", "mtp.fc.weight"], KW, PROMPTS)


# ---- the recurrence itself ------------------------------------------------------------------

@pytest.mark.parametrize("cuts", [(), (1,), (37,), (64, 65), (5, 70, 130)])
def test_the_chunked_delta_rule_is_the_token_recurrence(cuts):
    """Over 150 tokens cut into pieces anywhere (a prompt's chunks, a single token), from a
    non-zero state: the blocked form's outputs and final state are the per-token
    recurrence's."""
    g = torch.Generator().manual_seed(0)
    L, H, Dk, Dv = 150, 3, 8, 5
    q = l2_normalize(torch.randn(L, H, Dk, generator=g)) * Dk ** -0.5
    k = l2_normalize(torch.randn(L, H, Dk, generator=g))
    v = torch.randn(L, H, Dv, generator=g)
    decay = -torch.rand(L, H, generator=g)
    beta = torch.rand(L, H, generator=g)
    S0 = torch.randn(H, Dk, Dv, generator=g) * 0.3
    want, S_want = [], S0.clone()[None]
    for t in range(L):
        want.append(delta_rule_step(S_want, q[t:t + 1], k[t:t + 1], v[t:t + 1],
                                    decay[t:t + 1], beta[t:t + 1])[0])
    S = S0.clone()
    bounds = [0, *cuts, L]
    got = torch.cat([delta_rule_chunked(S, q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b])
                     for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S, S_want[0], rtol=1e-4, atol=1e-5)


def test_roofline_counts_kv_on_attention_layers_and_the_state_per_sequence(qwen3_next):
    """KV bytes per token from the one full-attention layer only; every decode row reads
    and writes its sequence's state (fp32 S, the conv inputs); `servelm roofline` says so."""
    from servelm import roofline as rl
    from servelm.engine.state_cache import StateCache

    cfg = ModelConfig.from_hf_dir(qwen3_next[0])
    state = StateCache.bytes_per_slot(cfg, torch.float32)
    assert state == 3 * (64 * 3 * 4 + 4 * 8 * 8 * 4)  # three linear layers: conv + S
    m = rl.ModelShape.from_config(cfg, weight_bits=16, kv_bits=16, state_bytes=state)
    assert m.kv_bytes_per_token == 2 * 1 * 2 * 16 * 2
    plain = rl.ModelShape.from_config(cfg, weight_bits=16, kv_bits=16)
    hw = rl.Hardware(1e11, 1e12)
    grow = (rl.predict_decode(m, hw, 8, 100).memory_seconds
            - rl.predict_decode(plain, hw, 8, 100).memory_seconds)
    assert grow == pytest.approx(2 * 8 * state / 1e11)
    assert m.state_flops_per_token == 4.0 * 2 * 4 * 8 * 8 * 3
    text = rl.report(m, hw)
    assert "1 attention layer)" in text and "recurrent state per sequence" in text


# ---- GGUF (llama.cpp's qwen35 / qwen3next) ---------------------------------------------------

def _tiled(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """Value heads from key-head groups to llama.cpp's tiled order along dim."""
    t = t.movedim(dim, 0)
    t = t.reshape(hk, r, d, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    return t.movedim(0, dim)


def _qwen35_gguf(ref, path, gguf_path):
    """The tiny Qwen3.5 in llama.cpp's `qwen35` spelling, as its convert_hf_to_gguf.py
    writes it (checked against that converter's output, bit for bit, on this model):
    every norm but the DeltaNet's stored as 1 + w, ssm_a = -exp(A_log), the conv kernel
    squeezed, value heads tiled across key heads in every tensor that runs over them."""
    cfg, arch = ref.config, "qwen35"
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "block_count": cfg.num_hidden_layers,
                       "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads,
                       "attention.key_length": cfg.head_dim,
                       "attention.value_length": cfg.head_dim,
                       "rope.dimension_count": cfg.head_dim // 4,
                       "ssm.conv_kernel": cfg.linear_conv_kernel_dim, "ssm.state_size": dk,
                       "ssm.group_count": hk, "ssm.time_step_rank": hv,
                       "ssm.inner_size": hv * dv, "full_attention_interval": 4}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_array(f"{arch}.attention.recurrent_layers",
                [t == "linear_attention" for t in cfg.layer_types])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    add_gguf_metadata(w, gguf_tokenizer_metadata(gguf_path))
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
             "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
             "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
             "linear_attn.out_proj": "ssm_out"}
    kd = 2 * hk * dk
    for name, t in ref.state_dict().items():
        t = t.float()
        if name.endswith("norm.weight") and "linear_attn" not in name:
            t = t + 1
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight",
                          "model.norm.weight": "output_norm.weight"}[name], t.numpy())
            continue
        if name == "lm_head.weight":
            w.add_tensor("output.weight", t.numpy())
            continue
        i, rest = int(name.split(".")[2]), name.split(".", 3)[3]
        part, _, kind = rest.rpartition(".")
        if rest.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            t = t.reshape(t.shape[0], -1) if t.dim() == 3 else t
            t = torch.cat([t[:kd], _tiled(t[kd:], 0, hk, r, dv)])
        elif rest.endswith("in_proj_z.weight"):
            t = _tiled(t, 0, hk, r, dv)
        elif rest.endswith(("in_proj_b.weight", "in_proj_a.weight")):
            t = _tiled(t, 0, hk, r, 1)
        elif rest.endswith("out_proj.weight"):
            t = _tiled(t, 1, hk, r, dv)
        elif rest.endswith(("A_log", "dt_bias")):
            t = _tiled(t, 0, hk, r, 1)
            w.add_tensor(f"blk.{i}.ssm_a" if rest.endswith("A_log") else f"blk.{i}.ssm_dt.bias",
                         (-t.exp() if rest.endswith("A_log") else t).contiguous().numpy())
            continue
        w.add_tensor(f"blk.{i}.{parts[part]}.{kind}", t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen35_gguf_loads_as_its_hf_checkpoint(qwen3_5, gguf_path, tmp_path):
    """llama.cpp's `qwen35` file of the tiny Qwen3.5 (two value heads a key head, so the
    tiled value-head order is undone at load): the same logits and greedy tokens; in bf16 on
    the C++ kernels (int4 weights), its decode steps on the DecodeStack, as op by op."""
    src, ref = qwen3_5
    _qwen35_gguf(ref, tmp_path / "model.gguf", gguf_path)
    kw = {**KW, "cpu_kernels": False}
    hf, gg = LLM(model=src, **kw), LLM(model=str(tmp_path / "model.gguf"), **kw)
    cfg = gg.engine.model_config
    assert cfg.family == "qwen3_5" and cfg.layer_types == ModelConfig.from_hf_dir(src).layer_types
    assert cfg.rotary_dim == 4 and cfg.extra["linear_attn"]["num_v_heads"] == 4
    ids = [_ids(hf, p) for p in PROMPTS]
    want = prompt_logits(hf.engine, ids)
    torch.testing.assert_close(prompt_logits(gg.engine, ids), want, rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())
    assert ([o.outputs[0].token_ids for o in gg.generate(PROMPTS, GREEDY, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in hf.generate(PROMPTS, GREEDY, use_tqdm=False)])
    from servelm.models import decode_stack

    if decode_stack.available():
        fast = LLM(model=str(tmp_path / "model.gguf"), dtype="bfloat16", quantization="int4",
                   linear_method="tiles", kv_cache_memory=16 << 20, max_model_len=256,
                   enable_prefix_caching=False)
        assert_stack_decodes_as_per_op(fast, ids[:2], SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))


def test_qwen35_gguf_tensor_parallel_2_matches_tp1(qwen3_5, gguf_path, tmp_path):
    """The same split read from llama.cpp's qwen35 file, whose value heads are tiled across
    the key heads: a rank reads its value heads as a run a value head of each key head
    (Family.gguf_pieces) and regroups its slice; one device's logits and tokens."""
    from servelm.models.registry import family_for_architecture

    fam = family_for_architecture("Qwen3_5ForCausalLM")
    lin = {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 16}
    cfg = ModelConfig(architecture="Qwen3_5ForCausalLM", vocab_size=8, hidden_size=8,
                      intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=4, max_position_embeddings=8, extra={"linear_attn": lin})
    # Rank 1 of 2: key head 1, value heads 2 and 3, tiled as rows 1 and 3 of each part.
    assert fam.gguf_pieces("model.layers.0.linear_attn.in_proj_z.weight", [(0, 32, 64)],
                           cfg) == [(0, 16, 32), (0, 48, 64)]
    assert fam.gguf_pieces("model.layers.0.linear_attn.in_proj_qkv.weight",
                           [(0, 16, 32), (0, 48, 64), (0, 96, 128)], cfg) == [
        (0, 16, 32), (0, 48, 64), (0, 80, 96), (0, 112, 128)]
    assert fam.gguf_pieces("model.layers.0.linear_attn.out_proj.weight", [(1, 32, 64)],
                           cfg) == [(1, 16, 32), (1, 48, 64)]
    assert fam.gguf_pieces("model.layers.0.self_attn.q_proj.weight", [(0, 0, 8)],
                           cfg) == [(0, 0, 8)]
    path = tmp_path / "model.gguf"
    _qwen35_gguf(qwen3_5[1], path, gguf_path)
    assert_tensor_parallel_matches(dict(model=str(path), num_threads=1, **KW), PROMPTS, GREEDY)


def test_qwen3next_gguf_names_and_values():
    """llama.cpp's qwen3next / qwen35 spellings: ssm_a (no .weight) holds -exp(A_log),
    ssm_dt.bias the dt_bias, attn_qkv on a linear layer its q | k | v, the DeltaNet's norm
    w itself (every other norm 1 + w); the config from ssm.* and recurrent_layers."""
    import numpy as np

    from servelm.models.registry import family_for_gguf

    fam = family_for_gguf("qwen3next")
    assert fam.gguf_name("blk.2.ssm_a") == "model.layers.2.linear_attn.A_log"
    assert fam.gguf_name("blk.2.ssm_dt.bias") == "model.layers.2.linear_attn.dt_bias"
    assert fam.gguf_name("blk.0.attn_qkv.weight") == "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert fam.gguf_name("blk.1.ssm_ba.weight") == "model.layers.1.linear_attn.in_proj_ba.weight"
    assert fam.gguf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    meta = {"attention.recurrent_layers": [True, True, True, False], "ssm.time_step_rank": 4,
            "ssm.group_count": 2, "ssm.state_size": 8, "ssm.inner_size": 32,
            "ssm.conv_kernel": 4}
    got = fam.gguf_config(lambda key, default=None: meta.get(key, default),
                          {"num_layers": 4}, set())
    assert got["layer_types"] == ("linear_attention",) * 3 + ("full_attention",)
    assert got["extra"]["linear_attn"] == {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 8,
                                           "head_v_dim": 8, "conv_kernel": 4}
    cfg = ModelConfig(architecture="Qwen3NextForCausalLM", vocab_size=8, hidden_size=8,
                      intermediate_size=8, num_layers=4, num_heads=2, num_kv_heads=1,
                      head_dim=4, max_position_embeddings=8, family="qwen3_next", **got)
    a_log = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)
    np.testing.assert_allclose(fam.from_gguf("model.layers.0.linear_attn.A_log",
                                             -np.exp(a_log), cfg, 4), a_log, rtol=1e-6)
    norm = np.array([1.5, 2.0], dtype=np.float32)
    assert (fam.from_gguf("model.layers.0.linear_attn.norm.weight", norm, cfg, 2) == norm).all()
    assert (fam.from_gguf("model.layers.0.input_layernorm.weight", norm, cfg, 2)
            == norm - 1).all()


def test_a_steps_decodes_update_consecutive_slots_in_place():
    """Decodes whose slots run consecutively in row order are updated through a view of
    the state (dec_range); any other order gathers and writes back; both give the same
    outputs and states."""
    from servelm.models.linear_attention import GatedDeltaNet, RecurrentBatch

    torch.manual_seed(0)
    layer = GatedDeltaNet(16, num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4,
                          conv_kernel=3, eps=1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    cpu = torch.device("cpu")
    assert RecurrentBatch.build([0, 1, 2], [1, 1, 1], [4, 5, 6], [False] * 3,
                                cpu).dec_range == (4, 7)
    assert RecurrentBatch.build([0, 1, 2], [1, 1, 1], [5, 4, 6], [False] * 3,
                                cpu).dec_range is None
    x = torch.randn(3, 16)
    outs, states = [], []
    for slots in ([4, 5, 6], [6, 5, 4]):  # the same sequences, in slot order or reversed
        conv = torch.zeros(8, layer.conv_dim, 2)
        ssm = torch.zeros(8, 2, 4, 4)
        for s_, v in zip((4, 5, 6), range(3)):
            conv[s_].fill_(0.1 * (v + 1))
            ssm[s_].fill_(0.2 * (v + 1))
        order = [4, 5, 6] if slots == [4, 5, 6] else [6, 5, 4]
        xs = x if slots == [4, 5, 6] else x.flip(0)
        batch = type("B", (), {"recurrent": RecurrentBatch.build(
            [0, 1, 2], [1, 1, 1], order, [False] * 3, cpu)})()
        with torch.no_grad():
            out = layer(xs, None, None, batch, (conv, ssm))
        outs.append(out if slots == [4, 5, 6] else out.flip(0))
        states.append((conv.clone(), ssm.clone()))
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(states[0][0], states[1][0])
    torch.testing.assert_close(states[0][1], states[1][1])


def test_the_cpp_decode_step_is_the_pytorch_one():
    """servelm's C++ delta-rule step on slots in place (fresh ones zeroed first) against
    delta_rule_step on the gathered states: the same outputs and states."""
    from servelm.kernels import load_ops

    if not load_ops("delta_rule"):
        pytest.skip("servelm's C++ kernels are not built here")
    g_ = torch.Generator().manual_seed(1)
    N, B, H, Dk, Dv = 6, 3, 4, 16, 8
    S = torch.randn(N, H, Dk, Dv, generator=g_)
    slots = torch.tensor([4, 1, 2])
    fresh = torch.tensor([False, True, False])
    q = l2_normalize(torch.randn(B, H, Dk, generator=g_)) * Dk ** -0.5
    k = l2_normalize(torch.randn(B, H, Dk, generator=g_))
    v = torch.randn(B, H, Dv, generator=g_)
    decay, beta = -torch.rand(B, H, generator=g_), torch.rand(B, H, generator=g_)
    want_S = S.clone()
    gathered = want_S[slots]
    gathered[fresh] = 0
    want = delta_rule_step(gathered, q, k, v, decay, beta)
    want_S[slots] = gathered
    got = torch.ops.servelm_delta_rule.step(S, slots, q, k, v, decay, beta, fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S, want_S, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dk,dv,state_dtype", [(8, 8, torch.float32), (8, 6, torch.float32),
                                               (16, 72, torch.float32), (8, 6, torch.bfloat16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_cpp_decode_is_the_op_by_op_layer(dtype, dk, dv, state_dtype):
    """A decode-only step through GatedDeltaNet on servelm's fused C++ decode (the
    convolution step, the gates, the delta rule and the gated norm in one call) against
    the same layer op by op (the C++ delta-rule step between PyTorch ops): the outputs, the
    convolution states and the recurrent states, with scattered slots, a fresh one and two
    value heads a key head; channels and value dims short of and past the vector kernels'
    16 and 64 lanes. bf16 recurrent states (mamba_ssm_cache_dtype): the fused decode, the C++
    step and the PyTorch step (kernels off) alike, within bf16's rounding."""
    from types import SimpleNamespace

    from servelm.kernels import load_ops
    from servelm.models.linear_attention import GatedDeltaNet, RecurrentBatch

    if not load_ops("delta_rule"):
        pytest.skip("servelm's C++ kernels are not built here")
    g_ = torch.Generator().manual_seed(2)
    layer = GatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=dk, head_v_dim=dv,
                          conv_kernel=4, eps=1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g_) * 0.3)
    layer = layer.to(dtype)
    N, C = 6, layer.conv_dim
    conv0 = torch.randn(N, C, 3, generator=g_).to(dtype)
    ssm0 = (torch.randn(N, 4, dk, dv, generator=g_) * 0.1).to(state_dtype)
    x = torch.randn(3, 32, generator=g_).to(dtype)
    rec = RecurrentBatch.build([0, 1, 2], [1, 1, 1], [4, 1, 2], [False, True, False], x.device)
    assert rec.decodes_only
    batch = SimpleNamespace(recurrent=rec)
    outs = {}
    for path in ("fused", "step", "pytorch"):
        layer.select(path != "pytorch")
        if path == "step":
            layer._decode = None  # the op-by-op path, C++ step included
        state = (conv0.clone(), ssm0.clone())
        with torch.no_grad():
            outs[path] = (layer(x, None, None, batch, state), *state)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    state_tol = (dict(rtol=1e-4, atol=1e-5) if state_dtype == torch.float32
                 else dict(rtol=2e-2, atol=2e-3))
    for other in ("step", "pytorch"):
        torch.testing.assert_close(outs["fused"][0], outs[other][0], **tol)
        assert torch.equal(outs["fused"][1], outs[other][1])  # the convolution inputs alike
        assert outs[other][2].dtype == state_dtype
        torch.testing.assert_close(outs["fused"][2].float(), outs[other][2].float(), **state_tol)
    assert not torch.equal(outs["fused"][2], ssm0)
