"""Every model family against transformers: a tiny random checkpoint of each, made by
transformers here (seeded, saved as safetensors with a real tokenizer), served by servelm.

fp32 eager logits within 1e-3 (relative) of transformers' and greedy tokens equal; the C++
kernel path within tolerance of eager, through chunked prefill and the prefix cache, and
past the sliding window; int4 close to eager."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import prompt_logits
from servelm import LLM, SamplingParams
from servelm.kernels import load_ops
from servelm.models.config import ModelConfig
from servelm.models.registry import supported_architectures

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 8  # shorter than every prompt below: the sliding layers drop keys

FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        head_dim=16, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}

PROMPTS = ["The capital of France is Paris, the capital of Spain is Madrid, and the capital of Italy is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 5, 8, 13, 21, 34, 55,"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_tokenizer):
    """family -> (HF directory, transformers model), random weights, norms perturbed off
    their init so a wrong norm convention shows."""
    out = {}
    for i, (name, (config_cls, model_cls, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        cfg = getattr(transformers, config_cls)(vocab_size=hf_tokenizer.vocab_size,
                                                **{**COMMON, **extra})
        model = getattr(transformers, model_cls)(cfg).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.add_(torch.randn_like(p) * 0.2)
                elif "embed" in pname:
                    p.mul_(0.5 / max(cfg.initializer_range, 1e-3) * 0.02)
        d = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(d)
        hf_tokenizer.save_pretrained(d)
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
    assert llm.engine.model_config.family == ("llama" if family == "llama3" else family)
    prompts = [_ids(llm, p) for p in PROMPTS]
    ours = prompt_logits(llm.engine, prompts)
    for i, ids in enumerate(prompts):
        want = _reference_logits(ref, ids)
        diff = (ours[i] - want).abs().max().item()
        assert diff <= 1e-3 * want.abs().max().item(), f"{family} prompt {i}: max |diff| {diff}"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20,
                                do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == want, family


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


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_moe", "phi3"])
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
        llm = LLM(quantization=quantization, cpu_kernels=cpu_kernels, **kw)
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
    moe_layers = [m for m in llm.engine.runner.model.layers if isinstance(m.mlp, moe.SparseMoE)]
    assert len(moe_layers) == 2  # layer 1 is dense (mlp_only_layers)
    # Each (layer, expert) ran once, over all its tokens: every token reached k = 2 experts
    # (layer 0: every prompt token; the last layer's MLP runs only for the sampled rows).
    assert len(calls) == len(set(calls)) <= 4 * len(moe_layers)
    assert sum(rows) == 2 * (sum(len(p) for p in prompts) + len(prompts))


def test_config_keys_each_family_reads(checkpoints):
    def cfg(name):
        with open(f"{checkpoints[name][0]}/config.json") as f:
            return ModelConfig.from_hf_dict(json.load(f))

    gemma = cfg("gemma3")
    assert gemma.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma.rope_local_theta == 10000.0 and gemma.rope_theta == 1e6
    assert gemma.sandwich_norms and gemma.qk_norm and gemma.hidden_act == "gelu_tanh"
    assert gemma.attn_scale == pytest.approx(24 ** -0.5)
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


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_tensor_parallel_2_matches_tp1(checkpoints, family):
    """The shared blocks shard with their options (q/k norms, sandwich norms, windows, bias)."""
    path, _ = checkpoints[family]
    kw = dict(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20,
              max_model_len=256, num_threads=2)
    one = LLM(**kw)
    prompts = [_ids(one, p) for p in PROMPTS]
    want = prompt_logits(one.engine, prompts)
    a = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    threads = torch.get_num_threads()
    two = LLM(tensor_parallel_size=2, **kw)
    try:
        got = prompt_logits(two.engine, prompts)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)] == a
    finally:
        two.engine.shutdown()
        torch.set_num_threads(threads)  # rank 0 took its share of the threads


@pytest.mark.parametrize("family", ["phi3", "mixtral"])
def test_tensor_parallel_refuses_a_family_it_cannot_split(checkpoints, family):
    path, _ = checkpoints[family]
    with pytest.raises(ValueError, match=f"tensor parallelism does not support the {family}"):
        LLM(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20,
            tensor_parallel_size=2)
