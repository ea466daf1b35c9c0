"""The whole engine (scheduler, model runner, CUDA graphs, Triton attention, sampler) on each
device against transformers: a tiny random Llama saved as a Hugging Face directory with a
word-level tokenizer built here, so nothing is read from the embedded model (the GPU machine
carries no model file). On the CPU every CI run checks the same path in fp32; with CUDA,
fp32 and bf16, with captured decode graphs and eagerly, and int4 and int8."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from servelm import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
STEPS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    vocab = {f"w{i}": i for i in range(500)}
    vocab.update({"<unk>": 500, "<s>": 501, "</s>": 502})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=503, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=1024, bos_token_id=501,
                                   eos_token_id=502)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "lm_head" in name or "embed" in name:
                p.mul_(20)  # peaked logits: greedy steps far from ties
    model.save_pretrained(d)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 37, 130, 300)]
    return str(d), model, prompts


def _reference(model, prompts, device, dtype):
    # A copy: casting the fixture's model to bf16 and back would round its weights for the
    # fp32 cases that follow, which read the saved (unrounded) checkpoint.
    ref = copy.deepcopy(model).to(device, dtype)
    out = []
    for ids in prompts:
        with torch.no_grad():
            tokens = ref.generate(torch.tensor([ids], device=device), max_new_tokens=STEPS,
                                  min_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        out.append(tokens[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("eager", [False, True])
def test_the_engine_matches_transformers_greedy(checkpoint, device, dtype, eager):
    """Prompts of 5 to 300 tokens served together: fp32 gives transformers' greedy tokens
    exactly; bf16 (another summation order in every matmul) at least the first 8 of each.
    A seeded sampled request gives the same tokens alone and among the others."""
    if device == "cpu" and (dtype != "float32" or not eager):
        pytest.skip("the CPU's paths are checked against transformers in test_families.py")
    path, model, prompts = checkpoint
    want = _reference(model, prompts, device, getattr(torch, dtype))
    llm = LLM(model=path, dtype=dtype, device=device, kv_cache_memory=64 << 20,
              max_model_len=512, enforce_eager=eager, kernel_tuning="off")
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    for i, (g, w) in enumerate(zip(got, want)):
        same = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), STEPS)
        assert same >= (STEPS if dtype == "float32" else 8), (i, g, w)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7)
    alone = llm.generate([{"prompt_token_ids": prompts[1]}], seeded, use_tqdm=False)
    among = llm.generate([{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == among[1].outputs[0].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_weights_serve_on_cuda(checkpoint, quantization):
    """int4 weights (tinygemm for decode rows, the Triton dequantisation for the 300-token
    prompt, and no rows at all for the last layer of a chunk that samples nothing) and int8
    (the Triton matmul for decode rows, the converted weight for the prompt) through the
    whole engine: every request gets all its tokens, each in the vocabulary."""
    path, _, prompts = checkpoint
    kw = dict(model=path, dtype="bfloat16", device="cuda", kv_cache_memory=64 << 20,
              max_model_len=512)
    q = LLM(quantization=quantization, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in q] == [STEPS] * len(prompts)
    assert all(0 <= t < 503 for o in q for t in o.outputs[0].token_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_int8_activations_on_cuda_are_measured_and_serve(checkpoint, quantization):
    """bf16 and int4 weights on CUDA: the calibrated layers' shapes timed on w8a8's Triton
    form at the batch and prompt buckets (none failing its known-answer check), the layers
    that took it holding it for those rows alone, and every request served, the first
    greedy tokens those of the engine without int8 activations (peaked logits)."""
    path, _, prompts = checkpoint
    kw = dict(model=path, dtype="bfloat16", device="cuda", kv_cache_memory=64 << 20,
              max_model_len=512, quantization=quantization)
    llm = LLM(**kw)
    smooth = [s for s in llm.engine.executor.tuning.shapes if ":smooth" in s.key]
    assert smooth and not any(s.failed for s in smooth)
    assert all(t < float("inf") for s in smooth for t in s.times_us["w8a8"][2:])
    from servelm.layers import w8a8
    from servelm.layers.linear_methods import BucketedLinear
    for m in llm.engine.executor.model.modules():
        if isinstance(m, BucketedLinear):
            assert not isinstance(m.module_for(1), w8a8.W8A8TritonLinear)
            assert isinstance(m.module_for(512), w8a8.W8A8TritonLinear) == (m.methods[3] == "w8a8")
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    off = [o.outputs[0].token_ids for o in LLM(int8_activations="off", **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    assert [len(g) for g in got] == [STEPS] * len(prompts)
    assert all(g[:4] == o[:4] for g, o in zip(got, off)), (got, off)
