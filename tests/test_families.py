"""Every model family against transformers: a tiny random checkpoint of each, made by
transformers here (seeded, saved as safetensors with a real tokenizer), served by servelm.

fp32 eager logits within 1e-3 (relative) of transformers' and greedy tokens equal; the C++
kernel path within tolerance of eager, through chunked prefill and the prefix cache, and
past the sliding window; int4 close to eager."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import (add_gguf_metadata, assert_reference_greedy, assert_tensor_parallel_matches,
                     gguf_tokenizer_metadata, prompt_logits, tiny_hf_checkpoint)
from servelm import LLM, SamplingParams
from servelm.kernels import load_ops
from servelm.models.config import ModelConfig
from servelm.models.registry import family_for_architecture, supported_architectures

transformers = pytest.importorskip("transformers")

WINDOW = 8  # shorter than every prompt below: the sliding layers drop keys

FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        head_dim=16, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Weights and caps that make both caps bend (Gemma 2's own caps: 50 and 30); its
    # default layer types alternate sliding and global.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, initializer_range=0.1,
        attn_logit_softcapping=1.5, final_logit_softcapping=0.3)),
    # Four layers: the fourth attends without rotary (no_rope_layer_interval 4).
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=12.0, attention_multiplier=0.4, residual_multiplier=0.22,
        logits_scaling=8.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    # Layers sliding, sliding, sliding, full; the full layers' rotary YaRN-scaled.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=WINDOW, head_dim=16, rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                               "original_max_position_embeddings": 128},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, mlp_only_layers=[1])),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16, pad_token_id=0)),
    # A dense first layer, then MoE: DeepSeek-V3's grouped sigmoid router (a correction bias,
    # 2 groups of 4, the best one's experts), a shared expert, q/k norms, q/k/v biases and a
    # partial rotary.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        sliding_window=WINDOW, norm_epsilon=1e-5)),
    # Layers sliding, sliding, sliding, global (the global one without rotary).
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=WINDOW, sliding_window_pattern=4, head_dim=16)),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=16)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
        attention_multiplier=0.4, residual_multiplier=0.22, logits_scaling=8.0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(use_qkv_bias=True)),
    "stablelm_parallel": ("StableLmConfig", "StableLmForCausalLM", dict(
        use_parallel_residual=True)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=4)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.25)),
    # YaRN over an original context of 8: the queries' scale steps every 8 positions.
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5})),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=4)),
    "gpt_neox_sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        num_key_value_heads=4, use_parallel_residual=False, hidden_act="gelu_new")),
}

# Families with biases on linear layers, which the checkpoints fixture makes non-zero.
BIASED = ("starcoder2", "glm4", "glm4_moe", "qwen2_moe", "stablelm", "phi", "gpt_neox")

PROMPTS = ["The capital of France is Paris, the capital of Spain is Madrid, and the capital of Italy is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 5, 8, 13, 21, 34, 55,"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_tokenizer):
    """family -> (HF directory, transformers model), random weights, norms perturbed off
    their init so a wrong norm convention shows (and the linear layers' biases, which
    transformers initialises to zero, where BIASED)."""
    out = {}
    for i, (name, (config_cls, model_cls, extra)) in enumerate(FAMILIES.items()):
        d = tmp_path_factory.mktemp(f"hf-{name}")
        model = tiny_hf_checkpoint(d, config_cls, model_cls, extra, hf_tokenizer, seed=i)
        if name in BIASED:
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if pname.endswith(".bias") and "norm" not in pname:
                        p.normal_(0.0, 0.05)
                for pname, b in model.named_buffers():  # a router's correction bias (GLM-4-MoE)
                    if pname.endswith("e_score_correction_bias"):
                        b.normal_(0.0, 0.1)
            model.save_pretrained(d)
        out[name] = (str(d), model)
    return out


def _ids(llm, prompt):
    return llm.get_tokenizer().encode(prompt)


def _reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eager_fp32_matches_transformers(checkpoints, family):
    path, ref = checkpoints[family]
    llm = LLM(model=path, dtype="float32", cpu_kernels=False, kernel_tuning="off",
              kv_cache_memory=16 << 20, max_model_len=256)
    assert llm.engine.model_config.family == {"llama3": "llama", "qwen3_yarn": "qwen3",
                                              "stablelm_parallel": "stablelm",
                                              "gpt_neox_sequential": "gpt_neox"}.get(family, family)
    prompts = [_ids(llm, p) for p in PROMPTS]
    ours = prompt_logits(llm.engine, prompts)
    for i, ids in enumerate(prompts):
        want = _reference_logits(ref, ids)
        diff = (ours[i] - want).abs().max().item()
        assert diff <= 1e-3 * want.abs().max().item(), f"{family} prompt {i}: max |diff| {diff}"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        # transformers' greedy continuation, EOS barred as ignore_eos bars ours (what its
        # generate(min_new_tokens=20) gives, checked in one forward instead of 20)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens, family
        assert_reference_greedy(ref, ids, out.outputs[0].token_ids,
                                banned=(ref.config.eos_token_id,))


@pytest.mark.skipif(not load_ops("ops"), reason="needs the C++ kernels")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernel_path_matches_eager_through_chunks_and_the_prefix_cache(checkpoints, family):
    path, _ = checkpoints[family]
    kw = dict(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20,
              max_model_len=256)
    eager = LLM(cpu_kernels=False, **kw)
    # 16-token budget: every prompt is prefilled in chunks, later ones past the window.
    fast = LLM(max_num_batched_tokens=16, max_num_seqs=4, **kw)
    prompts = [_ids(eager, p) for p in PROMPTS]
    want = prompt_logits(eager.engine, prompts)
    got = prompt_logits(fast.engine, prompts)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    a = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for round_ in range(2):  # the second round starts from the prefix cache
        outs = fast.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == a, (family, round_)
    assert all(o.metrics.num_cached_tokens >= 16 for o in outs), [(len(o.prompt_token_ids), o.metrics.num_cached_tokens) for o in outs]


@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_a_windowed_model_runs_prompts_longer_than_its_pool(checkpoints, cpu_kernels):
    """Every layer of Mistral slides: the blocks behind a sequence's window go back to the
    pool as it grows (and other sequences overwrite them), so prompts longer than the whole
    pool run, several at once, each with transformers' greedy tokens."""
    path, ref = checkpoints["mistral"]
    probe = LLM(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20)
    block_bytes = probe.engine.executor.block_bytes
    llm = LLM(model=path, dtype="float32", kernel_tuning="off", cpu_kernels=cpu_kernels,
              block_size=4, kv_cache_memory=16 * block_bytes // 4, max_num_batched_tokens=8, max_num_seqs=3,
              max_model_len=256)
    engine = llm.engine
    assert engine.block_manager.reach == WINDOW and engine.kv_capacity_tokens == 64
    assert engine.max_model_len == 256
    prompts = [_ids(llm, p * 4) for p in PROMPTS]
    assert min(map(len, prompts)) > engine.kv_capacity_tokens
    together = 0
    step = engine.step

    def watched():
        nonlocal together
        out = step()
        together = max(together, engine.scheduler.num_running)
        return out
    engine.step = watched
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert together == len(prompts)
    for ids, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert_reference_greedy(ref, ids, out.outputs[0].token_ids,
                                banned=(ref.config.eos_token_id,))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_attention_reach_is_the_widest_window_when_every_layer_slides(checkpoints):
    def reach(family):
        return ModelConfig.from_hf_dir(checkpoints[family][0]).attention_reach
    assert reach("mistral") == reach("starcoder2") == WINDOW
    assert reach("gemma3") is None and reach("exaone4") is None  # a global layer reads all
    assert reach("qwen3") is None


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_moe", "phi3", "qwen2_moe", "starcoder2",
                                    "olmo2"])
def test_quantised_weights_stay_close(checkpoints, family):
    """int8 within 1e-3 (cosine) of fp32; int4 the same on the kernel and eager paths (on
    random weights its rounding alone moves the logits a few percent)."""
    path, _ = checkpoints[family]
    kw = dict(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20,
              max_model_len=256)
    ref = LLM(cpu_kernels=False, **kw)
    prompts = [_ids(ref, p) for p in PROMPTS]
    want = prompt_logits(ref.engine, prompts)

    def cos(quantization, cpu_kernels, against=want):
        from servelm.models.moe import SparseMoE

        llm = LLM(quantization=quantization, cpu_kernels=cpu_kernels, **kw)
        experts = [m for m in llm.engine.executor.model.modules() if isinstance(m, SparseMoE)]
        assert all(m.expert_format == (quantization if m.options["intermediate"] % 32 == 0
                                       and m.options["hidden"] % 32 == 0 else "int8")
                   for m in experts)  # routed experts: int4 where the sizes take groups of 32
        assert bool(experts) == ("moe" in family)
        got = prompt_logits(llm.engine, prompts)
        return torch.nn.functional.cosine_similarity(got, against, dim=-1).min().item(), got

    assert cos("int8", True)[0] > 0.999
    c_eager, int4_eager = cos("int4", False)
    assert c_eager > 0.9
    assert cos("int4", True, int4_eager)[0] > 0.999  # int4pack rounds activations to bf16


def test_moe_reads_each_expert_once_a_step(checkpoints, monkeypatch):
    """The batched expert path: one matmul pair per expert with tokens, whatever the count."""
    from servelm.models import moe

    path, _ = checkpoints["qwen3_moe"]
    llm = LLM(model=path, dtype="float32", cpu_kernels=False, kernel_tuning="off",
              kv_cache_memory=16 << 20, max_model_len=256)
    calls, rows = [], []
    real = moe.expert_mlp

    def counting(x, gate_up, down, act):
        calls.append(gate_up.data_ptr())
        rows.append(x.shape[0])
        return real(x, gate_up, down, act)

    monkeypatch.setattr(moe, "expert_mlp", counting)
    prompts = [_ids(llm, p) for p in PROMPTS]
    prompt_logits(llm.engine, prompts)  # one step, all three prompts
    moe_layers = [m for m in llm.engine.executor.model.layers if isinstance(m.mlp, moe.SparseMoE)]
    assert len(moe_layers) == 2  # layer 1 is dense (mlp_only_layers)
    # Each (layer, expert) ran once, over all its tokens: every token reached k = 2 experts
    # (layer 0: every prompt token; the last layer's MLP runs only for the sampled rows).
    assert len(calls) == len(set(calls)) <= 4 * len(moe_layers)
    assert sum(rows) == 2 * (sum(len(p) for p in prompts) + len(prompts))


@pytest.mark.skipif(not load_ops("gemv"), reason="needs the gemv kernel (AVX2, FMA)")
def test_bf16_moe_decode_steps_run_the_fused_experts(checkpoints):
    """A one-sequence decode step of bf16 experts runs servelm_gemv.moe_experts, a call a
    layer; its next-token distribution is the per-expert path's within bf16 rounding."""
    from servelm.models.moe import SparseMoE

    path, _ = checkpoints["qwen3_moe"]
    llm = LLM(model=path, dtype="bfloat16", kernel_tuning="off", kv_cache_memory=16 << 20,
              max_model_len=256)
    mods = [m.mlp for m in llm.engine.executor.model.layers if isinstance(m.mlp, SparseMoE)]
    llm.engine.executor.model.fused_decode = False  # the per-op path (the stack runs the same)
    rows: list[int] = []

    def counted():
        for m in mods:
            m.select(True)
            assert m._fused is not None and m._fused_rows >= 1
            m._fused = (lambda real: lambda x, *a: (rows.append(x.shape[0]), real(x, *a))[1])(
                m._fused)

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)

    def second_step(prompt):  # the first token is the prompt's (the per-expert path)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        return out.token_ids[:2], dict(out.logprobs[1].top)

    for prompt in PROMPTS[:2]:
        rows.clear()
        counted()
        fused = second_step(prompt)
        # Three decode steps, a call a MoE layer each (and the prompt's last layer, which
        # runs only the sampled row).
        assert set(rows) == {1} and len(rows) >= 3 * len(mods)
        for m in mods:
            m.select(False)
        plain = second_step(prompt)
        assert fused[0] == plain[0]
        shared = set(fused[1]) & set(plain[1])
        assert len(shared) >= 4
        for t in shared:
            assert abs(fused[1][t] - plain[1][t]) < 0.05, t


@pytest.mark.skipif(not load_ops("ops"), reason="needs the C++ kernels")
def test_soft_capped_attention_runs_on_the_cpu_kernels(checkpoints):
    """The C++ attention ops soft-cap scores: Gemma 2 attends on the cpu backend (its tokens
    against the eager path's in test_kernel_path_matches_eager_...), and the whole-step
    DecodeStack takes its layers with the model's cap."""
    from servelm.models import decode_stack

    path, _ = checkpoints["gemma2"]
    kw = dict(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20,
              max_model_len=256)
    runner = LLM(**kw).engine.executor.runner
    assert runner.use_kernels and runner.attention.name == "cpu"
    assert decode_stack.describe(runner.model).attn_softcap == 1.5


# What the whole-step DecodeStack says of each family's layers (None: it takes them all);
# the families it declines decode op by op on the C++ kernels.
STACK_DECLINES = {"gemma2": None, "smollm3": None, "granite": None,
                  "olmo2": None, "olmo3": None,
                  "qwen2_moe": "(routed experts run op by op)",
                  "starcoder2": None,
                  "exaone4": None,
                  "granitemoe": "(routed experts run op by op)",
                  "stablelm": None,
                  "stablelm_parallel": None,
                  "phi": None,
                  "cohere": None,
                  "ministral3": None,
                  "gpt_neox": None,
                  "glm4": None, "ernie4_5": None,
                  "glm4_moe": "(routed experts run op by op)"}


@pytest.mark.parametrize("family", list(STACK_DECLINES))
def test_decode_stack_takes_or_declines_each_family(checkpoints, family):
    from servelm.models import decode_stack
    from servelm.models.decoder import CausalLM

    with open(f"{checkpoints[family][0]}/config.json") as f:
        model = CausalLM(ModelConfig.from_hf_dict(json.load(f)), max_positions=64)
    got = decode_stack.describe(model)
    if STACK_DECLINES[family] is None:
        assert isinstance(got, decode_stack.StackDescription), got
    else:  # the first layer it cannot take (SmolLM3's fourth; Qwen2-MoE's first is MoE)
        assert isinstance(got, str) and got.endswith(STACK_DECLINES[family]), got


def test_config_keys_each_family_reads(checkpoints):
    def cfg(name):
        with open(f"{checkpoints[name][0]}/config.json") as f:
            return ModelConfig.from_hf_dict(json.load(f))

    gemma = cfg("gemma3")
    assert gemma.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma.rope_local_theta == 10000.0 and gemma.rope_theta == 1e6
    assert gemma.sandwich_norms and gemma.qk_norm and gemma.hidden_act == "gelu_tanh"
    assert gemma.attn_scale == pytest.approx(24 ** -0.5)
    gemma2 = cfg("gemma2")
    assert gemma2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (1.5, 0.3)
    assert gemma2.sandwich_norms and not gemma2.qk_norm and gemma2.embed_scale == 8.0
    assert gemma2.attn_scale == pytest.approx(24 ** -0.5)
    assert cfg("smollm3").no_rope_layers == (3,)
    qwen2_moe = cfg("qwen2_moe")
    assert qwen2_moe.shared_expert_intermediate_size == 80 and qwen2_moe.attention_bias
    assert qwen2_moe.dense_layers == (1,) and not qwen2_moe.norm_topk_prob
    coder = cfg("starcoder2")
    assert coder.norm_type == "layer" and not coder.mlp_gated and coder.mlp_bias
    assert coder.attention_bias and coder.attention_out_bias and coder.window(0) == WINDOW
    glm4 = cfg("glm4")
    assert glm4.rope_interleaved and glm4.rotary_dim == 8 and glm4.sandwich_norms
    assert glm4.attention_bias
    olmo2 = cfg("olmo2")
    assert olmo2.qk_norm_whole and olmo2.sandwich_norms and not olmo2.pre_norms
    olmo3 = cfg("olmo3")
    assert olmo3.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
    assert (olmo3.rope_theta, olmo3.rope_local_theta) == (5e5, 1e4)
    assert olmo3.rope_scaling["rope_type"] == "yarn" and olmo3.qk_norm_whole
    exaone = cfg("exaone4")
    assert exaone.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
    assert exaone.no_rope_layers == (3,) and exaone.qk_norm and not exaone.qk_norm_whole
    assert not exaone.pre_norms and cfg("ernie4_5").rope_interleaved
    gmoe = cfg("granitemoe")
    assert (gmoe.num_experts, gmoe.moe_intermediate_size, gmoe.residual_scale) == (4, 96, 0.22)
    stablelm, parallel, phi = cfg("stablelm"), cfg("stablelm_parallel"), cfg("phi")
    assert stablelm.rotary_dim == 4 and stablelm.attention_bias and stablelm.norm_type == "layer"
    assert parallel.parallel_block and not stablelm.parallel_block
    assert phi.parallel_block and phi.lm_head_bias and phi.attention_out_bias and phi.rotary_dim == 8
    cohere = cfg("cohere")
    assert cohere.logits_scaling == 4.0 and cohere.norm_type == "layer_no_bias"
    assert cohere.parallel_block and cohere.rope_interleaved and cohere.tie_word_embeddings
    ministral = cfg("ministral3")
    assert (ministral.query_scale_beta, ministral.query_scale_period) == (0.5, 8)
    assert ministral.rope_scaling["rope_type"] == "yarn"
    neox, neox_seq = cfg("gpt_neox"), cfg("gpt_neox_sequential")
    assert neox.parallel_block and neox.parallel_mlp_norm and not neox_seq.parallel_block
    assert neox.qkv_per_head and neox.hidden_act == "gelu" and neox.rotary_dim == 4
    assert neox_seq.hidden_act == "gelu_tanh"
    granite = cfg("granite")
    assert (granite.embed_scale, granite.attn_scale, granite.residual_scale,
            granite.logits_scaling) == (12.0, 0.4, 0.22, 8.0)
    assert cfg("qwen2").attention_bias  # transformers always gives Qwen2 a q/k/v bias
    assert cfg("phi3").rotary_dim == 8
    assert cfg("mistral").window(0) == WINDOW
    moe_cfg = cfg("qwen3_moe")
    assert moe_cfg.dense_layers == (1,) and moe_cfg.is_moe_layer(0)
    assert moe_cfg.num_active_params < moe_cfg.num_params


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["FalconForCausalLM"], "vocab_size": 8, "hidden_size": 8,
         "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="FalconForCausalLM") as e:
        LLM(model=str(tmp_path))
    for arch in supported_architectures():
        assert arch in str(e.value)


# One family for each way of sharding (the others' options are rank-local: a rank runs them
# on its heads as one device does; the suite's time is kept for the distinct splits). Qwen2
# is not one: its tensors are a subset of Qwen2-MoE's (whose dense layer and non-zero q/k/v
# biases split by the same rules), and its own biases are transformers' zeros.
@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen2_moe", "glm4", "granitemoe",
                                    "stablelm_parallel", "starcoder2", "phi", "gpt_neox",
                                    "olmo2", "olmo3"])
def test_tensor_parallel_2_matches_tp1(checkpoints, family):
    """The shared blocks shard with their options (q/k norms, sandwich norms, windows, two
    rotary tables; Qwen2-MoE's q/k/v biases by head; Phi-3's fused qkv and gate_up tensors read
    as each rank's rows of every part, and its partial rotary; each expert of Qwen3-MoE by
    its intermediate slice, the router whole; Qwen2-MoE's shared expert by its own slice,
    its gate whole; GLM-4's pairwise-rotary q/k rows reordered within each rank's heads;
    EXAONE 4's post-only norms, per-head q/k norms and rotary-less global layers; Granite
    MoE's experts from their one input_linear / output_linear tensor each; StableLM's
    parallel block, LayerNorms and partial rotary; Cohere's pairwise rotary in a parallel
    block; Granite's scaled residual, SmolLM3's rotary-less layers, Ministral 3's
    position-scaled queries; Starcoder2's, Phi's and GPT-NeoX's non-gated MLPs (c_fc / fc1 /
    dense_h_to_4h by rows, the down projection by columns) and row-parallel biases (o_proj's
    and the down projection's, added by rank 0 alone), GPT-NeoX's per-head query_key_value
    and vocabulary-split embed_in / embed_out, Phi's LM-head bias; OLMo 2's and 3's q / k
    norms over the whole projection (each rank's heads over the all-reduced mean square);
    Mixtral's below, from GGUF)."""
    path, _ = checkpoints[family]
    assert_tensor_parallel_matches(dict(model=path, dtype="float32", kernel_tuning="off",
                                        kv_cache_memory=16 << 20, max_model_len=256,
                                        num_threads=1), PROMPTS, GREEDY)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tensor_parallel_2_runs_bf16_quantised_experts(checkpoints, quantization):
    """bf16 with quantised experts under TP=2: each rank measures its own experts for the
    fused op at start-up (no all-reduce there) and quantises its slice (down's rows are half
    as long: 24 inputs, which PyTorch's int8pack matmul cannot take); the logits stay close
    to one device's."""
    from servelm.models.moe import SparseMoE

    path, _ = checkpoints["qwen3_moe"]
    kw = dict(model=path, dtype="bfloat16", kernel_tuning="off", kv_cache_memory=16 << 20,
              max_model_len=256, num_threads=1, quantization=quantization)
    one = LLM(**kw)
    assert any(isinstance(m, SparseMoE) and m._fused is not None
               for m in one.engine.executor.model.modules())  # the rank tunes the fused op
    ids = [_ids(one, p) for p in PROMPTS]
    want = prompt_logits(one.engine, ids).float()
    threads = torch.get_num_threads()
    two = LLM(tensor_parallel_size=2, **kw)
    try:
        got = prompt_logits(two.engine, ids).float()
    finally:
        two.engine.shutdown()
        torch.set_num_threads(threads)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99


def test_tensor_parallel_refuses_a_family_it_cannot_split(checkpoints, monkeypatch):
    # A family that cannot split says so before any rank starts (Gemma 4, in
    # test_gemma4.py; Mixtral made one here).
    monkeypatch.setattr(family_for_architecture("MixtralForCausalLM"), "tensor_parallel",
                        False)
    family = "mixtral"
    path, _ = checkpoints[family]
    with pytest.raises(ValueError, match=f"tensor parallelism does not support the {family}"):
        LLM(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20,
            tensor_parallel_size=2)


# ---- GGUF: each family's llama.cpp spelling, written here from the same checkpoints ---------

def _llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to llama's q/k rows (interleaves rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF name part -> llama.cpp's, as convert_hf_to_gguf.py names them.
_GGUF_PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
               "block_sparse_moe.router": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
               "mlp.shared_experts.up_proj": "ffn_up_shexp",
               "mlp.shared_experts.down_proj": "ffn_down_shexp",
               "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
               "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down", "self_attn.dense": "attn_output"}
_GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "phi3": "phi3",
              "mixtral": "llama", "mistral": "llama", "llama3": "llama", "smollm3": "smollm3",
             "granite": "granite", "granitemoe": "granitemoe", "olmo2": "olmo2", "qwen2_moe": "qwen2moe",
             "glm4": "glm4", "glm4_moe": "glm4moe", "starcoder2": "starcoder2", "ernie4_5": "ernie4_5",
             "stablelm": "stablelm", "stablelm_parallel": "stablelm", "phi": "phi2",
             "cohere": "command-r", "gemma2": "gemma2", "exaone4": "exaone4", "olmo3": "olmo2",
             "ministral3": "mistral3", "gpt_neox": "gptneox"}
# Where a family's llama.cpp names differ from _GGUF_PARTS'.
_GGUF_FAMILY_PARTS = {"olmo2": {"post_attention_layernorm": "post_attention_norm",
                                "post_feedforward_layernorm": "post_ffw_norm"},
                      "olmo3": {"post_attention_layernorm": "post_attention_norm",
                                "post_feedforward_layernorm": "post_ffw_norm"},
                      "glm4_moe": {"post_attention_layernorm": "post_attention_norm"},
                      "glm4": {"post_self_attn_layernorm": "post_attention_norm",
                               "post_mlp_layernorm": "post_ffw_norm"},
                      "exaone4": {"post_attention_layernorm": "post_attention_norm",
                                  "post_feedforward_layernorm": "post_ffw_norm"},
                      "gemma2": {"post_attention_layernorm": "post_attention_norm",
                                 "pre_feedforward_layernorm": "ffn_norm",
                                 "post_feedforward_layernorm": "post_ffw_norm"}}
# q/k rows permuted by llama.cpp's converter
_GGUF_PERMUTED = ("llama", "smollm3", "granite", "granitemoe", "mistral3")


_NEOX_NAMES = ((r"^gpt_neox\.embed_in\.", "model.embed_tokens."), (r"^embed_out\.", "lm_head."),
               (r"^gpt_neox\.final_layer_norm\.", "model.norm."),
               (r"^gpt_neox\.layers\.", "model.layers."),
               (r"\.attention\.query_key_value\.", ".self_attn.qkv_proj."),
               (r"\.attention\.dense\.", ".self_attn.o_proj."),
               (r"\.mlp\.dense_h_to_4h\.", ".mlp.c_fc."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.c_proj."))


def _neox_state(state: dict, heads: int) -> dict:
    """A GPT-NeoX state dict in the writer's names, its fused query_key_value rows (each
    head's q, k and v together) reordered to q | k | v, as llama.cpp's converter does."""
    import re

    out = {}
    for name, t in state.items():
        if ".query_key_value." in name:
            t = t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        for pattern, repl in _NEOX_NAMES:
            name = re.sub(pattern, repl, name)
        out[name] = t
    return out


def _write_gguf(path, family: str, model, tokenizer_meta: dict, q8_experts: bool = False) -> None:
    """q8_experts: the experts' gate and up tensors in Q8_0 blocks (the rest fp32)."""
    import re

    import gguf
    import numpy as np

    cfg, arch = model.config, _GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)

    def add_experts(name: str, arr: np.ndarray) -> None:
        if q8_experts and "ffn_down" not in name:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(arr, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, arr)

    n = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for key, value in {"context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "block_count": n,
                       "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads,
                       "attention.key_length": head_dim}.items():
        w.add_uint32(f"{arch}.{key}", value)
    layer_norm_eps = getattr(cfg, "layer_norm_eps", None) or getattr(cfg, "norm_epsilon", None)
    if layer_norm_eps:  # LayerNorms (Starcoder2, StableLM, Phi)
        w.add_float32(f"{arch}.attention.layer_norm_epsilon", layer_norm_eps)
    else:
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", (cfg.rope_parameters.get("full_attention")
                                             or cfg.rope_parameters)["rope_theta"])
    if getattr(cfg, "sliding_window", None):
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    if family in ("exaone4", "olmo3"):  # llama.cpp's converter: a bool a layer, true: sliding
        w.add_array(f"{arch}.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in cfg.layer_types])
    full_rope = (cfg.rope_parameters or {}).get("full_attention") or {}
    local_rope = (cfg.rope_parameters or {}).get("sliding_attention") or {}
    if family == "olmo3" and local_rope.get("rope_theta"):  # as llama.cpp's converter
        w.add_float32(f"{arch}.rope.freq_base_swa", local_rope["rope_theta"])
    if family == "olmo3" and full_rope.get("rope_type") == "yarn":  # as llama.cpp's olmo2
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", full_rope["factor"])
        w.add_float32(f"{arch}.rope.scaling.attn_factor", full_rope["attention_factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                     full_rope["original_max_position_embeddings"])
    if family == "ministral3":  # llama.cpp's mistral3: YaRN and the query scale's beta
        rope = cfg.rope_parameters
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                     rope["original_max_position_embeddings"])
        w.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", rope["beta_fast"])
        w.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", rope["beta_slow"])
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", rope["mscale_all_dim"])
        w.add_float32(f"{arch}.attention.temperature_scale", rope["llama_4_scaling_beta"])
    if family in ("granite", "granitemoe"):
        for key, value in {"embedding_scale": cfg.embedding_multiplier,
                           "residual_scale": cfg.residual_multiplier,
                           "logit_scale": cfg.logits_scaling,
                           "attention.scale": cfg.attention_multiplier}.items():
            w.add_float32(f"{arch}.{key}", value)
    if family == "cohere":
        w.add_float32(f"{arch}.logit_scale", cfg.logit_scale)
    if family == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    if family == "glm4_moe":  # as llama.cpp's converter (no multi-token-prediction layer)
        for key, value in {"leading_dense_block_count": cfg.first_k_dense_replace,
                           "expert_shared_count": cfg.n_shared_experts,
                           "expert_group_count": cfg.n_group,
                           "expert_group_used_count": cfg.topk_group,
                           "nextn_predict_layers": 0}.items():
            w.add_uint32(f"{arch}.{key}", value)
        w.add_float32(f"{arch}.expert_weights_scale", cfg.routed_scaling_factor)
        w.add_bool(f"{arch}.expert_weights_norm", cfg.norm_topk_prob)
        w.add_uint32(f"{arch}.expert_gating_func", 2)  # sigmoid
    if family == "gpt_neox":
        w.add_bool(f"{arch}.use_parallel_residual", cfg.use_parallel_residual)
    if family in ("phi3", "glm4", "glm4_moe", "stablelm", "stablelm_parallel", "phi", "gpt_neox"):
        factor = cfg.rope_parameters.get("partial_rotary_factor") or cfg.partial_rotary_factor
        w.add_uint32(f"{arch}.rope.dimension_count", int(head_dim * factor))
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        w.add_uint32(f"{arch}.expert_feed_forward_length", inter)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length",
                         cfg.shared_expert_intermediate_size)
    add_gguf_metadata(w, tokenizer_meta)
    state = {k: v.float() for k, v in model.state_dict().items()}
    if family == "gpt_neox":
        state = _neox_state(state, cfg.num_attention_heads)
    stacked: dict[tuple[int, str], list] = {}
    for name, t in state.items():
        if family == "gemma2" and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp's converter stores Gemma's (1 + w)
        if name in ("lm_head.weight", "lm_head.bias"):
            if not cfg.tie_word_embeddings:
                w.add_tensor(f"output.{name.rpartition('.')[2]}", t.numpy())
            continue
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t.numpy())
            continue
        if name in ("model.norm.weight", "model.norm.bias", "model.final_layernorm.weight",
                    "model.final_layernorm.bias"):
            w.add_tensor(f"output_norm.{name.rpartition('.')[2]}", t.numpy())
            continue
        fused = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                             r"(gate_up_proj|down_proj)", name)
        if fused:  # transformers' in-memory experts: [E, 2I, H] (gate, then up) / [E, H, I]
            i = int(fused.group(1))
            if fused.group(2) == "down_proj":
                add_experts(f"blk.{i}.ffn_down_exps.weight", t.contiguous().numpy())
            else:
                gate, up = t.chunk(2, dim=1)
                add_experts(f"blk.{i}.ffn_gate_exps.weight", gate.contiguous().numpy())
                add_experts(f"blk.{i}.ffn_up_exps.weight", up.contiguous().numpy())
            continue
        bias = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", name)
        if bias:  # the router's correction bias (GLM-4-MoE)
            w.add_tensor(f"blk.{bias.group(1)}.exp_probs_b.bias", t.numpy())
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        i, part, kind = int(m.group(1)), m.group(2), m.group(3)
        e = re.fullmatch(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)", part)
        if e:  # one [E, ...] tensor per projection in llama.cpp
            which = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                     "down_proj": "down", "w2": "down"}[e.group(2)]
            stacked.setdefault((i, which), []).append((int(e.group(1)), t))
            continue
        if arch in _GGUF_PERMUTED and part == "self_attn.q_proj":
            t = _llamacpp_permute(t, cfg.num_attention_heads)
        elif arch in _GGUF_PERMUTED and part == "self_attn.k_proj":
            t = _llamacpp_permute(t, cfg.num_key_value_heads)
        gguf_part = _GGUF_FAMILY_PARTS.get(family, {}).get(part) or _GGUF_PARTS[part]
        w.add_tensor(f"blk.{i}.{gguf_part}.{kind}", t.numpy())
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":  # as llama.cpp's converter: a divisor per frequency
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        w.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())
    for (i, which), ts in stacked.items():
        arr = torch.stack([t for _, t in sorted(ts, key=lambda x: x[0])]).numpy()
        add_experts(f"blk.{i}.ffn_{which}_exps.weight", np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_and_gguf(hf_path: str, family: str, ref, gguf_path: str, tmp_path):
    """The fp32 eager engines of an HF checkpoint and of the GGUF _write_gguf makes of its
    transformers model `ref` (the tokenizer's keys from gguf_path)."""
    _write_gguf(tmp_path / "model.gguf", family, ref, gguf_tokenizer_metadata(gguf_path))
    kw = dict(dtype="float32", cpu_kernels=False, kernel_tuning="off",
              kv_cache_memory=16 << 20, max_model_len=256)
    return LLM(model=hf_path, **kw), LLM(model=str(tmp_path / "model.gguf"), **kw)


def _assert_same_prompt_logits(hf, gg) -> None:
    prompts = [_ids(hf, p) for p in PROMPTS]
    assert [_ids(gg, p) for p in PROMPTS] == prompts
    torch.testing.assert_close(prompt_logits(gg.engine, prompts), prompt_logits(hf.engine, prompts),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                    "mixtral", "phi3", "smollm3", "granite", "olmo2",
                                    "qwen2_moe", "glm4", "glm4_moe", "starcoder2", "ernie4_5",
                                    "granitemoe", "stablelm", "stablelm_parallel", "phi",
                                    "cohere", "exaone4", "ministral3"])
def test_gguf_of_each_family_loads_as_its_hf_checkpoint(checkpoints, family, gguf_path,
                                                        tmp_path):
    path, ref = checkpoints[family]
    hf, gg = _hf_and_gguf(path, family, ref, gguf_path, tmp_path)
    # llama.cpp writes Mistral as `llama` (the same layer, its window in the metadata).
    assert gg.engine.model_config.family == {"mistral": "llama"}.get(family, hf.engine.model_config.family)
    _assert_same_prompt_logits(hf, gg)


@pytest.mark.parametrize("parallel", [True, False])
def test_gguf_gpt_neox_loads_as_its_hf_checkpoint(hf_tokenizer, gguf_path, tmp_path, parallel):
    """GPT-NeoX as llama.cpp writes it (`gptneox`): the fused qkv rows as q | k | v, not
    head by head; use_parallel_residual from the metadata, the exact GELU (the file names
    no activation: Pythia's)."""
    config_cls, model_cls, extra = FAMILIES["gpt_neox"]
    ref = tiny_hf_checkpoint(tmp_path / "hf", config_cls, model_cls,
                             {**extra, "use_parallel_residual": parallel}, hf_tokenizer, seed=5)
    with torch.no_grad():  # the biases non-zero, as the checkpoints fixture makes them
        for name, p in ref.named_parameters():
            if name.endswith(".bias") and "norm" not in name:
                p.normal_(0.0, 0.05)
    ref.save_pretrained(tmp_path / "hf")
    hf, gg = _hf_and_gguf(str(tmp_path / "hf"), "gpt_neox", ref, gguf_path, tmp_path)
    got = gg.engine.model_config
    assert got.family == "gpt_neox" and not got.qkv_per_head and got.attention_bias
    assert got.parallel_block == parallel and got.rotary_dim == 4
    _assert_same_prompt_logits(hf, gg)


def test_gguf_gemma2_loads_as_its_hf_checkpoint(hf_tokenizer, gguf_path, tmp_path):
    """Gemma 2 in llama.cpp's spelling: its norms stored as 1 + w, the sandwich norms' names,
    both soft-caps in the metadata, alternating sliding layers from the window. llama.cpp
    stores no query_pre_attn_scalar (it takes head_dim), so this checkpoint's is head_dim."""
    config_cls, model_cls, extra = FAMILIES["gemma2"]
    ref = tiny_hf_checkpoint(tmp_path / "hf", config_cls, model_cls,
                             {**extra, "query_pre_attn_scalar": 32}, hf_tokenizer, seed=3)
    hf, gg = _hf_and_gguf(str(tmp_path / "hf"), "gemma2", ref, gguf_path, tmp_path)
    assert gg.engine.model_config.family == "gemma2"
    assert gg.engine.model_config.layer_types == hf.engine.model_config.layer_types
    _assert_same_prompt_logits(hf, gg)


@pytest.mark.parametrize("local_theta", [5e5, 1e4])
def test_gguf_olmo3_loads_as_its_hf_checkpoint(hf_tokenizer, gguf_path, tmp_path, local_theta):
    """OLMo 3 as llama.cpp writes it (`olmo2` with a window): its layer kinds from
    sliding_window_pattern, the sliding layers' rotary base from rope.freq_base_swa (the
    full layers' where they share it), YaRN with its attention factor on the full layers
    only (the sliding ones unscaled, as real OLMo 3 checkpoints have it)."""
    config_cls, model_cls, extra = FAMILIES["olmo3"]
    rope = {"full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                               "original_max_position_embeddings": 128,
                               "attention_factor": 1.2},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    ref = tiny_hf_checkpoint(tmp_path / "hf", config_cls, model_cls,
                             {**extra, "rope_parameters": rope}, hf_tokenizer, seed=4)
    hf, gg = _hf_and_gguf(str(tmp_path / "hf"), "olmo3", ref, gguf_path, tmp_path)
    got, want = gg.engine.model_config, hf.engine.model_config
    assert got.family == want.family == "olmo3"
    assert (got.layer_types, got.sliding_window) == (want.layer_types, want.sliding_window)
    assert got.rope_scaling["attention_factor"] == pytest.approx(1.2)
    assert got.rope_local_theta == want.rope_local_theta == local_theta
    _assert_same_prompt_logits(hf, gg)


def test_gguf_moe_tensor_parallel_2_matches_tp1(checkpoints, gguf_path, tmp_path):
    """Mixtral from GGUF (llama.cpp's `llama` with experts: q/k un-permuted per rank's
    heads), its stacked experts sliced on load: gate/up [E, I, H] by rows of every expert
    (Q8_0 blocks cut before dequantising), down [E, H, I] by columns (fp32 values)."""
    _, ref = checkpoints["mixtral"]
    _write_gguf(tmp_path / "model.gguf", "mixtral", ref, gguf_tokenizer_metadata(gguf_path),
                q8_experts=True)
    assert_tensor_parallel_matches(dict(model=str(tmp_path / "model.gguf"), dtype="float32",
                                        kernel_tuning="off", kv_cache_memory=16 << 20,
                                        max_model_len=256, num_threads=1), PROMPTS)


def test_stacked_weights_are_copied_part_by_part_and_a_wrong_part_is_named():
    """q/k/v and gate/up arrive as separate checkpoint tensors and go into the fused
    parameter's rows in order; a part of the wrong shape is refused with the weight's name."""
    from servelm.models.config import ModelConfig
    from servelm.models.llama import LlamaForCausalLM

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                      intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg, max_positions=64)
    g = torch.Generator().manual_seed(0)
    hf = {}
    for name, p in model.named_parameters():
        w = torch.randn(p.shape, generator=g)
        for fused, parts in model._STACKED.items():
            if f".{fused}." in name:
                sizes = ([32, 16, 16] if fused == "qkv_proj" else [48, 48])
                for part, t in zip(parts, w.split(sizes)):
                    hf[name.replace(fused, part)] = t
                break
        else:
            hf[name] = w
    model.load_weights(hf.items())
    qkv = model.layers[0].self_attn.qkv_proj.weight
    want = torch.cat([hf[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, want)
    hf["layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    with pytest.raises(ValueError, match=r"'layers.0.self_attn.qkv_proj.weight' has shape "
                                         r"\(32, 32\) \+ \(8, 32\) \+ \(16, 32\)"):
        model.load_weights(hf.items())
