"""LoRA adapters served by the engine: greedy tokens equal transformers + PEFT (fp32) for
Llama, Qwen2 (q/k/v bias), Qwen3, Phi-3 (fused projections), GLM-4, Starcoder2 and Phi-2
(non-gated MLPs), Qwen3.5 and
Qwen3-Next (gated queries, gated DeltaNet layers) and Gemma 4 (layers of differing shapes);
a mixed batch gives each
sequence its tokens alone; residency past max_loras; prefix-cache separation; bad input."""

from __future__ import annotations

import pytest
import torch

from helpers import random_lora_stacks, tiny_hf_checkpoint
from servelm import LLM, LoRARequest, SamplingParams
from servelm.kernels import load_ops

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16),
              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6),
              ["q_proj", "v_proj", "down_proj"]),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32),
              ["q_proj", "k_proj", "o_proj", "up_proj"]),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5),
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    # Pairwise rotary: the base's q/k rows are reordered at load, and B's with them.
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16, pad_token_id=0),
             ["q_proj", "k_proj", "v_proj", "gate_up_proj"]),
    # Non-gated MLPs (c_fc / c_proj; Phi's fc1 / fc2 and its o_proj spelled dense), biases.
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM",
                   dict(sliding_window=8, norm_epsilon=1e-5),
                   ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"]),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=4),
            ["q_proj", "v_proj", "dense", "fc1", "fc2"]),
}
_HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=4, initializer_range=0.1)
if hasattr(transformers, "Qwen3_5TextConfig"):
    # Gated attention (q_proj holds each head's query and output gate) between gated
    # DeltaNet layers (their projections apart: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
    FAMILIES["qwen3_5"] = (
        "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _HYBRID,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"])
if hasattr(transformers, "Qwen3NextConfig"):
    # The DeltaNet's projections fused per key head (in_proj_qkvz, in_proj_ba); MoE MLPs.
    FAMILIES["qwen3_next"] = (
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(_HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32),
        ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"])
if hasattr(transformers, "Gemma4TextConfig"):
    # Layers of three shapes: sliding ones, global ones with their own head size and one K=V
    # head (no v_proj), KV-shared ones (q_proj alone) with double-wide MLPs; routed experts
    # beside each dense MLP, which is adapted.
    _S, _F = "sliding_attention", "full_attention"
    FAMILIES["gemma4"] = (
        "Gemma4TextConfig", "Gemma4ForCausalLM",
        dict(num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=8,
             layer_types=[_S, _S, _F, _S, _S, _F], num_global_key_value_heads=1,
             attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
             hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
             top_k_experts=2, moe_intermediate_size=32, initializer_range=0.05,
             rope_parameters={_S: {"rope_type": "default", "rope_theta": 10000.0},
                              _F: {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                   "rope_theta": 1e4}}),
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
PROMPTS = ["The capital of France is Paris, the capital of Spain is Madrid, and the capital of",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 5, 8, 13, 21, 34, 55,"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
KW = dict(dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20, max_model_len=256)


def make_adapter(base, directory, targets: list[str], seed: int, rank: int = 8,
                 alpha: int = 16, **conf):
    """A PEFT LoRA adapter on a copy of the base with random non-zero A and B, saved to
    directory; returns the PEFT model (the reference)."""
    import copy

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **conf))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.eval()
    model.save_pretrained(directory)
    return model


def reference_tokens(model, ids: list[int], n: int = 16) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def family_setups(tmp_path_factory, hf_tokenizer):
    """family -> (base directory, base model, [(adapter dir, PEFT model)] x 2)."""
    out = {}
    for i, (name, (config_cls, model_cls, extra, targets)) in enumerate(FAMILIES.items()):
        d = tmp_path_factory.mktemp(f"lora-base-{name}")
        base = tiny_hf_checkpoint(d, config_cls, model_cls, extra, hf_tokenizer, seed=i)
        adapters = []
        for j in range(2):
            ad = tmp_path_factory.mktemp(f"lora-{name}-{j}")
            conf = {"use_rslora": True} if j else {}
            adapters.append((str(ad), make_adapter(base, ad, targets, seed=100 * i + j,
                                                   rank=8 if j == 0 else 4, **conf)))
        out[name] = (str(d), base, adapters)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers_with_peft(family_setups, family):
    """Each adapter alone, the base, and all three mixed in one batch (an adapter twice):
    every sequence's tokens are PEFT's, on the kernels' path and the eager reference."""
    path, base, adapters = family_setups[family]
    tok_ids = None
    # The eager reference for one family; every family on the kernels' path where they run.
    paths = (True,) if load_ops("ops") else (False,)
    if family == "llama" and load_ops("ops"):
        paths = (True, False)
    for kernels in paths:
        llm = LLM(model=path, enable_lora=True, max_loras=2, max_lora_rank=8,
                  cpu_kernels=kernels, **KW)
        tok = llm.get_tokenizer()
        tok_ids = [tok.encode(p) for p in PROMPTS]
        loras = [LoRARequest(f"a{j}", j + 1, ad) for j, (ad, _) in enumerate(adapters)]
        want = {None: [reference_tokens(base, ids) for ids in tok_ids]}
        for lr, (_, ref) in zip(loras, adapters):
            want[lr.lora_name] = [reference_tokens(ref, ids) for ids in tok_ids]
            assert want[lr.lora_name] != want[None]  # the adapter changes the answer
        prompts = [{"prompt_token_ids": ids} for ids in tok_ids]
        for lr in [None] + loras:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lr)
            name = lr and lr.lora_name
            assert [o.outputs[0].token_ids for o in outs] == want[name], (family, name, kernels)
        mixed = [loras[0], None, loras[1], loras[0]]
        outs = llm.generate([prompts[0], prompts[1], prompts[2], prompts[1]], GREEDY,
                            use_tqdm=False, lora_request=mixed)
        assert [o.outputs[0].token_ids for o in outs] == [
            want["a0"][0], want[None][1], want["a1"][2], want["a0"][1]], (family, kernels)


@pytest.fixture(scope="module")
def llama_engine(family_setups):
    path, _, adapters = family_setups["llama"]
    llm = LLM(model=path, enable_lora=True, max_loras=1, max_lora_rank=8,
              max_num_batched_tokens=32, max_num_seqs=4, **KW)
    return llm, adapters


def test_more_adapters_than_slots_take_turns(llama_engine):
    """max_loras 1: two adapters in one call run in turns (one resident a step, the other
    waiting, not refused), each with its own tokens; the slot is rewritten on each switch."""
    llm, adapters = llama_engine
    a, b = (LoRARequest(f"s{j}", 10 + j, ad) for j, (ad, _) in enumerate(adapters))
    prompts = PROMPTS[:2]
    alone = {lr.lora_name: [o.outputs[0].token_ids for o in
                            llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lr)]
             for lr in (a, b)}
    loads = llm.engine.lora.loads
    outs = llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=[a, b, b, a])
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [alone["s0"][0], alone["s1"][1], alone["s1"][0], alone["s0"][1]]
    assert llm.engine.lora.loads > loads
    assert len(llm.engine.lora.resident) == 1


def test_two_adapters_never_share_prefix_cache_blocks(llama_engine):
    """The same long prompt under the base and an adapter: no cached tokens across them,
    cached tokens within one."""
    llm, adapters = llama_engine
    lr = LoRARequest("p0", 20, adapters[0][0])
    prompt = PROMPTS[0] * 3
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt], one, use_tqdm=False)
    first = llm.generate([prompt], one, use_tqdm=False, lora_request=lr)[0]
    again = llm.generate([prompt], one, use_tqdm=False, lora_request=lr)[0]
    assert first.metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens > 0


def test_bad_adapters_are_refused_by_name(llama_engine, family_setups, tmp_path):
    llm, adapters = llama_engine
    engine = llm.engine
    with pytest.raises(ValueError, match="no-such"):
        engine.add_lora(LoRARequest("missing", 30, str(tmp_path / "no-such")))
    qwen_adapter = family_setups["qwen3"][2][0][0]  # another base's shapes
    with pytest.raises(ValueError, match="layers.0.self_attn"):
        engine.add_lora(LoRARequest("wrong-base", 31, qwen_adapter))
    big = tmp_path / "big"
    make_adapter(family_setups["llama"][1], big, ["q_proj"], seed=5, rank=16)
    with pytest.raises(ValueError, match="rank"):
        engine.add_lora(LoRARequest("too-big", 32, str(big)))
    with pytest.raises(ValueError, match="not loaded"):
        llm.generate(["x"], GREEDY, use_tqdm=False, lora_request="never-loaded")
    assert not engine.has_unfinished_requests()
    # Still serving, and an adapter can come and go.
    assert engine.add_lora(LoRARequest("tmp", 33, adapters[1][0]))
    assert not engine.add_lora(LoRARequest("tmp", 33, adapters[1][0]))
    engine.remove_lora("tmp")
    with pytest.raises(KeyError):
        engine.remove_lora("tmp")
    assert llm.generate(["x"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.skipif("gemma4" not in FAMILIES, reason="this transformers has no Gemma 4")
@pytest.mark.parametrize("module, match", [
    ("layers.2.self_attn.v_proj", "layer 2 has no v_proj .*its keys are its values"),
    ("layers.4.self_attn.k_proj", "layer 4 has no k_proj .*reads layer 3's keys and values")])
def test_an_adapter_for_a_projection_the_layer_lacks_is_refused(family_setups, tmp_path,
                                                                 module, match):
    """Gemma 4's K=V global layers have no v_proj and its KV-shared layers no k_proj or
    v_proj: an adapter holding one (another base's) is refused naming the layer."""
    import shutil

    from safetensors.torch import load_file, save_file

    from servelm.lora.loader import LoRAError, load_adapter
    from servelm.models.config import ModelConfig

    path, _, adapters = family_setups["gemma4"]
    bad = tmp_path / "bad"
    shutil.copytree(adapters[0][0], bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    prefix = f"base_model.model.model.{module}"
    tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, 64)
    tensors[f"{prefix}.lora_B.weight"] = torch.randn(16, 8)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    cfg = ModelConfig.from_hf_dir(path)
    assert load_adapter(adapters[0][0], cfg).rank == 8
    with pytest.raises(LoRAError, match=match):
        load_adapter(str(bad), cfg)


def test_lora_needs_enabling():
    llm = LLM(**KW)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(["x"], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, "/x"))


def test_speculation_and_structured_outputs_with_an_adapter(family_setups):
    """ngram speculation with an adapter gives the adapter's greedy tokens (its drafts are
    verified by the adapted model), and a JSON schema holds for an adapted request."""
    import json

    from servelm import StructuredOutputsParams

    path, _, adapters = family_setups["llama"]
    lr = LoRARequest("spec", 1, adapters[0][0])
    prompt = {"prompt_token_ids": list(range(300, 340)) * 2}  # the prompt's end recurs
    plain = LLM(model=path, enable_lora=True, **KW)
    spec = LLM(model=path, enable_lora=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}, **KW)
    spec.engine.speculator.ridge_tokens = 1e9  # draft whatever this machine measured
    want = plain.generate([prompt], GREEDY, use_tqdm=False, lora_request=lr)[0]
    got = spec.generate([prompt], GREEDY, use_tqdm=False, lora_request=lr)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert spec.engine.stats.num_spec_draft_tokens > 0  # drafts were verified
    base = plain.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert base.outputs[0].token_ids != want.outputs[0].token_ids
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = plain.generate(["Answer as JSON:"], SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)),
        use_tqdm=False, lora_request=lr)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text)["n"], int)


def adapted_logits(engine, ids: list[int], name: str | None) -> torch.Tensor:
    """The next-token logits after a whole prompt, with an adapter (or the base: None)."""
    from helpers import release
    from servelm.engine.model_runner import SeqInput

    slot = engine.lora.slots_for([name])[name] if name else -1
    engine.block_manager.allocate("probe", len(ids))
    try:
        logits, _ = engine.executor.execute([SeqInput(
            ids, 0, engine.block_manager.block_table("probe"), True, lora_slot=slot)])
    finally:
        release(engine, "probe")
    return logits[0].float()


def test_a_quantised_base_keeps_its_adapters_in_the_activation_dtype(family_setups):
    """int4 weights, bf16 activations: the adapters' slots are bf16, and an adapter moves
    the int4 model's logits as PEFT's moves the fp32 model's."""
    path, base, adapters = family_setups["llama"]
    llm = LLM(model=path, enable_lora=True, quantization="int4",
              **{**KW, "dtype": "bfloat16"})
    engine = llm.engine
    assert {m.lora_a.dtype for m in engine.lora.layers.values()} == {torch.bfloat16}
    engine.add_lora(LoRARequest("q", 1, adapters[0][0]))
    for prompt in PROMPTS:
        ids = llm.get_tokenizer().encode(prompt)
        ours = adapted_logits(engine, ids, "q") - adapted_logits(engine, ids, None)
        with torch.no_grad():
            ref = (adapters[0][1](input_ids=torch.tensor([ids])).logits[0, -1]
                   - base(torch.tensor([ids])).logits[0, -1])
        cos = torch.nn.functional.cosine_similarity(ours, ref, dim=0).item()
        ratio = (ours.norm() / ref.norm()).item()
        assert cos > 0.9 and 0.7 < ratio < 1.4, (prompt, cos, ratio)


def test_an_adapter_loaded_again_never_reads_its_old_weights_kv(llama_engine):
    """Unload, then load other weights under the same name and id: the prompt's blocks the
    old weights cached are not reused (each registration salts its own)."""
    llm, adapters = llama_engine
    prompt = PROMPTS[0] * 3
    one = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], one, use_tqdm=False,
                         lora_request=LoRARequest("re", 40, adapters[0][0]))[0]
    llm.engine.remove_lora("re")
    second = llm.generate([prompt], one, use_tqdm=False,
                          lora_request=LoRARequest("re", 40, adapters[1][0]))[0]
    fresh = llm.generate([prompt], one, use_tqdm=False,
                         lora_request=LoRARequest("other", 41, adapters[1][0]))[0]
    assert second.metrics.num_cached_tokens == 0
    assert second.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert first.outputs[0].token_ids != fresh.outputs[0].token_ids


def test_an_adapter_loads_while_the_engine_steps(llama_engine, monkeypatch):
    """load_lora_adapter's reading and checking runs beside the engine (a worker thread):
    a stream in flight gets tokens while a slow load is under way, and the adapter is
    registered once it is read. (On the engine thread, the load had held every stream.)"""
    import asyncio
    import threading
    import time

    from servelm.engine.async_engine import AsyncLLMEngine

    llm, adapters = llama_engine
    manager = llm.engine.lora
    real, loading = manager.load, threading.Event()
    window = []

    def slow_load(request):
        window.append(time.monotonic())
        loading.set()
        time.sleep(0.5)
        out = real(request)
        window.append(time.monotonic())
        return out

    monkeypatch.setattr(manager, "load", slow_load)
    engine = AsyncLLMEngine(llm.engine)
    engine.start()
    try:
        async def main():
            sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            times = []

            async def stream():
                async for _ in engine.generate(PROMPTS[0], sp):
                    times.append(time.monotonic())

            task = asyncio.create_task(stream())
            while not times:
                await asyncio.sleep(0.005)
            await engine.add_lora(LoRARequest("bg", 40, adapters[0][0]))
            await task
            return times

        times = asyncio.run(main())
    finally:
        engine.stop()
    assert loading.is_set() and "bg" in engine.loras
    start, end = window
    assert sum(start < t < end for t in times) >= 5, (start, end, times[:3], times[-3:])
    llm.engine.remove_lora("bg")


# ---- the CUDA form of the delta (run here on the CPU against the reference) ----------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts, R", [((48, 16, 16), 8), ((35, 35), 5), ((40,), 16)])
def test_the_dense_form_is_the_reference_without_a_host_sync(dtype, parts, R):
    """lora_add_dense (CUDA's) gives lora_add_ref's values (rows of slot -1 untouched, slots
    of lower rank, an odd rank) and reads nothing back to the host: no .item()/.tolist(),
    no nonzero or unique, which the reference's loop over slots needs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from servelm.layers.lora import lora_add_dense, lora_add_ref

    g = torch.Generator().manual_seed(R + len(parts))
    S, K, M, N = 3, 72, 23, sum(parts)
    a, b, bounds = random_lora_stacks(S, parts, K, R, dtype, ranks=(R, 3, 2), g=g)
    x = torch.randn(M, K, generator=g).to(dtype)
    slots = torch.randint(-1, S, (M,), generator=g, dtype=torch.int32)
    slots[:2] = -1
    y0 = torch.randn(M, N, generator=g).to(dtype)
    want, got = y0.clone(), y0.clone()
    lora_add_ref(want, x, a, b, slots, bounds)

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if any(k in name for k in ("_local_scalar_dense", "nonzero", "unique")):
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    with Syncs() as mode:
        lora_add_dense(got, x, a, b, slots, bounds)
    assert mode.seen == []
    with Syncs() as ref_mode:  # (the check sees the reference's syncs)
        lora_add_ref(y0.clone(), x, a, b, slots, bounds)
    assert ref_mode.seen
    assert torch.equal(got[slots < 0], y0[slots < 0])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # t rounded to bf16 on each side from sums in another order: a bf16 ulp apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    assert (got != y0).any()
