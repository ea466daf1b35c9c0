"""gpt-oss against transformers: a tiny random checkpoint made by transformers (attention
sinks, q/k/v/o biases, sliding and full layers alternating, YaRN, routed experts with biases
and the clamped SwiGLU), served token-exact through prefill, chunked prefill, decode, the
prefix cache and preemption on the C++ attention kernels (which run the sinks); the sink on
the reference attention against a hand-written softmax; MXFP4 dequantised bit for bit as transformers
and gguf-py do, from an HF checkpoint's blocks and from llama.cpp's GGUF."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import (add_gguf_metadata, assert_chunks_cache_and_preemption_keep_tokens,
                     assert_stack_decodes_as_per_op,
                     assert_matches_reference, assert_reference_greedy,
                     assert_tensor_parallel_matches,
                     gguf_tokenizer_metadata, prompt_logits, tiny_hf_checkpoint)
from servelm import LLM, SamplingParams
from servelm.kernels import load_ops
from servelm.models.config import FULL, SLIDING, ModelConfig

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

WINDOW = 8  # shorter than every prompt: the sliding layers drop keys
LIMIT = 0.2  # the SwiGLU clamp, low enough that random weights' activations reach it
# intermediate_size 128: two tensor-parallel ranks take 64 each, whole MXFP4 blocks.
CONFIG = dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              intermediate_size=128,
              swiglu_limit=LIMIT, rope_parameters={
                  "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                  "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                  "truncate": False})
PROMPTS = ["The capital of France is Paris, the capital of Spain is Madrid, and the capital of Italy is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 5, 8, 13, 21, 34, 55,"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
KW = dict(dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20, max_model_len=256)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, hf_tokenizer):
    """(HF directory, transformers model): sinks of a few units (so they take a real share
    of each softmax), every bias non-zero (transformers initialises the experts' to zero)."""
    d = tmp_path_factory.mktemp("hf-gpt-oss")
    model = tiny_hf_checkpoint(d, "GptOssConfig", "GptOssForCausalLM", CONFIG, hf_tokenizer,
                               seed=11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.5)
            elif "bias" in name and "norm" not in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(d)
    return str(d), model


def _ids(llm, prompt):
    return llm.get_tokenizer().encode(prompt)


def test_config_reads_gpt_oss_keys(gpt_oss):
    cfg = ModelConfig.from_hf_dir(gpt_oss[0])
    assert cfg.family == "gpt_oss" and cfg.layer_types == (SLIDING, FULL, SLIDING)
    assert cfg.window(0) == WINDOW and cfg.window(1) is None
    assert cfg.attention_bias and cfg.attention_out_bias and not cfg.tie_word_embeddings
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 128)
    assert cfg.norm_topk_prob and not cfg.dense_layers
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert cfg.extra == {"attention_sinks": True, "router_bias": True, "expert_bias": True,
                         "swiglu_limit": LIMIT, "swiglu_alpha": 1.702}


def test_decode_steps_run_on_the_stack(gpt_oss):
    """With int4 weights on the kernels the whole-step DecodeStack takes gpt-oss's layers (the
    sinks, the biased router, the clamped, biased int4 experts): one stream's decode tokens and
    logprobs are the per-op path's; unquantised experts it declines, saying so."""
    from servelm.models import decode_stack
    from servelm.models.decoder import CausalLM

    model = CausalLM(ModelConfig.from_hf_dir(gpt_oss[0]), max_positions=64)
    got = decode_stack.describe(model)
    assert isinstance(got, str) and got.endswith("(routed experts run op by op)")
    if not (load_ops("q8act") and decode_stack.available()):
        return
    llm = LLM(model=gpt_oss[0], **{**KW, "dtype": "bfloat16"}, quantization="int4",
              enable_prefix_caching=False)
    assert llm.engine.executor.model.fused_decode
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    assert_stack_decodes_as_per_op(llm, [_ids(llm, PROMPTS[0])], sp)


def test_eager_fp32_matches_transformers(gpt_oss):
    path, ref = gpt_oss
    llm = LLM(model=path, cpu_kernels=False, **KW)
    prompts = [_ids(llm, p) for p in PROMPTS]
    assert min(map(len, prompts)) > WINDOW
    assert_matches_reference(llm, ref, prompts, GREEDY)


def test_chunked_prefill_prefix_cache_and_preemption_keep_the_tokens(gpt_oss):
    """The C++ ops where they build (norms, rotary + KV write, and the attention with its
    sinks and window), a 16-token budget (every prompt prefilled in chunks, later ones past
    the window), a second round from the prefix cache, then a pool that preempts: the
    eager path's tokens (the reference attention) each time."""
    path, _ = gpt_oss
    fast, _ = assert_chunks_cache_and_preemption_keep_tokens(path, PROMPTS, GREEDY, **KW)
    if load_ops("ops"):
        assert fast.engine.executor.runner.attention.name == "cpu"


def test_auto_attention_backend_runs_the_sinks(gpt_oss):
    """The engine's spec says the model has sinks: "auto" takes the cpu backend, whose
    kernels run them (the reference without the kernels)."""
    path, _ = gpt_oss
    runner = LLM(model=path, **KW).engine.executor.runner
    assert runner.attention.name == ("cpu" if load_ops("ops") else "reference")


def test_quantised_weights_stay_close(gpt_oss):
    """int8 / int4 quantise the attention projections, the LM head and the experts (their
    biases as they were): int8 within 1e-3 (cosine) of fp32, int4 close."""
    path, _ = gpt_oss
    kw = {**KW, "attention_backend": "reference"}
    ref = LLM(model=path, cpu_kernels=False, **kw)
    prompts = [_ids(ref, p) for p in PROMPTS]
    want = prompt_logits(ref.engine, prompts)

    def cos(quantization):
        llm = LLM(model=path, quantization=quantization, **kw)
        moe = llm.engine.executor.model.layers[0].mlp
        assert moe.expert_format == quantization  # hidden and intermediate: multiples of 32
        assert moe.experts_gate_up_bias.dtype == torch.float32
        got = prompt_logits(llm.engine, prompts)
        return torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()

    assert cos("int8") > 0.999
    assert cos("int4") > 0.9


def test_tensor_parallel_2_matches_tp1(gpt_oss):
    """Two ranks, each with half the heads (their sinks too) and half of each expert's
    intermediate size: HF's interleaved gate / up columns split as pairs, its [E, I, H]
    down by rows, the gate / up biases by the same pairs; o_proj's and the experts' down
    biases added by rank 0 alone."""
    assert_tensor_parallel_matches(dict(model=gpt_oss[0], num_threads=1, **KW), PROMPTS,
                                   GREEDY)


# ---- the sink on the reference attention ---------------------------------------------------

def _group(seqs, block_size, g):
    from servelm.attention import BACKENDS

    return BACKENDS["reference"].build(seqs, block_size, g, torch.device("cpu"))[1].groups


@pytest.mark.parametrize("window", [None, 5])
def test_reference_attention_sinks_match_a_hand_written_softmax(window):
    """paged_attention with sinks: each query's weights exp(s_i) / (sum_j exp(s_j) +
    exp(sink of its head)), over causal (or windowed) keys, grouped-query heads; a prompt
    chunk after a cached prefix and a decode row. A sink far below every score is none."""
    from servelm.attention.reference import paged_attention

    g = torch.Generator().manual_seed(0)
    H, KVH, D, bs = 4, 2, 16, 4
    kc, vc = (torch.randn(8, bs, KVH, D, generator=g) for _ in range(2))
    sinks = torch.randn(H, generator=g) * 2
    # (start, new tokens, blocks): a chunk of 5 after 6 cached tokens; one decode at 9.
    scale = D ** -0.5
    for start, n, blocks in [(6, 5, [3, 1, 6]), (9, 1, [0, 2, 5])]:
        seq = SimpleNamespace(token_ids=list(range(n)), start_pos=start, block_table=blocks,
                              sample=True, all_logits=False, num_logits=1)
        (group,) = _group([seq], bs, H // KVH)
        q = torch.randn(n, H, D, generator=g)
        got = paged_attention(q, kc, vc, group, scale, window, sinks=sinks)
        plain = paged_attention(q, kc, vc, group, scale, window)
        far = paged_attention(q, kc, vc, group, scale, window, sinks=torch.full((H,), -1e4))
        torch.testing.assert_close(far, plain, rtol=1e-5, atol=1e-6)
        k, v = (c[blocks].reshape(-1, KVH, D) for c in (kc, vc))
        rows = []
        for t in range(n):
            pos = start + t
            lo = 0 if window is None else max(0, pos - window + 1)
            out = []
            for h in range(H):
                kv = h // (H // KVH)
                sc = (k[lo:pos + 1, kv] @ q[t, h]) * scale
                w = sc.exp() / (sc.exp().sum() + sinks[h].exp())
                out.append(w @ v[lo:pos + 1, kv])
            rows.append(torch.cat(out))
        assert not torch.allclose(got, plain, atol=1e-3)  # the sinks take a share
        torch.testing.assert_close(got, torch.stack(rows), rtol=1e-5, atol=1e-6)


# ---- MXFP4 ---------------------------------------------------------------------------------

def test_mxfp4_dequantisation_is_transformers_and_gguf_py_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from servelm.models import dequant

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 8, 16), dtype=torch.uint8, generator=g)
    scales = torch.arange(240, dtype=torch.uint8).view(3, 10, 8)  # 0-239 (255 is E8M0's NaN)
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)   # [E, in, out]
        got = dequant.mxfp4_hf(blocks, scales, dtype).transpose(1, 2).contiguous()
        assert got.dtype == dtype and torch.equal(got.view(bits), want.view(bits))
    # ggml's blocks: every byte pattern (block 0's scale byte 0, 1, 2, ...)
    raw = np.random.default_rng(0).integers(0, 256, size=(4, 64 * 17), dtype=np.uint8)
    raw.reshape(-1, 17)[:, 0] = np.arange(256, dtype=np.uint8)
    with np.errstate(over="ignore"):  # the largest scales overflow, in both
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).astype(np.float32)
    got = dequant.dequantize(raw, "MXFP4").numpy().reshape(want.shape)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_gguf_names_and_fused_gate_up_experts():
    """llama.cpp's names (sinks, the post-attention norm, the router and its bias, the
    experts' biases) and its fused gate / up experts (--fuse-gate-up-exps: gate rows, then
    up), which reach SparseMoE's gate_up rows unchanged."""
    from servelm.models.registry import family_for_gguf

    fam = family_for_gguf("gpt-oss")
    names = {"blk.3.attn_sinks.weight": "layers.3.self_attn.sinks",
             "blk.3.post_attention_norm.weight": "layers.3.post_attention_layernorm.weight",
             "blk.3.ffn_gate_inp.bias": "layers.3.mlp.gate.bias",
             "blk.3.ffn_up_exps.bias": "layers.3.mlp.experts.up_proj.bias",
             "blk.3.ffn_gate_up_exps.weight": "layers.3.mlp.experts.gate_up_proj",
             "blk.3.ffn_gate_up_exps.bias": "layers.3.mlp.experts_gate_up_bias"}
    for gguf_name, internal in names.items():
        assert fam.internal_name(fam.gguf_name(gguf_name)) == internal, gguf_name
    g = torch.Generator().manual_seed(0)
    for gguf_name, shape in (("blk.0.ffn_gate_up_exps.weight", (3, 8, 5)),
                             ("blk.0.ffn_gate_up_exps.bias", (3, 8))):
        fused = torch.randn(shape, generator=g)
        hf = fam.gguf_name(gguf_name)
        arr = torch.from_numpy(np.ascontiguousarray(fam.from_gguf(hf, fused.numpy(), None, 3)))
        assert torch.equal(fam.transform(fam.internal_name(hf), arr), fused), gguf_name


def _mxfp4(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., out, in] quantised by gguf-py: (ggml's bytes, HF's blocks [..., out, in / 32,
    16] and scales [..., out, in / 32], the values both hold)."""
    raw = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    values = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4))
    b = torch.from_numpy(raw.copy()).view(*w.shape[:-1], -1, 17)
    qs = b[..., 1:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)          # ggml: values 0-15, then 16-31
    hf_blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)    # HF: pairs, the low nibble first
    return raw, hf_blocks.contiguous(), b[..., 0].contiguous(), values.reshape(w.shape)


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, I, ...] gate and up -> [E, 2I, ...] rows gate 0, up 0, gate 1, ..."""
    return torch.stack((gate, up), dim=2).reshape(gate.shape[0], -1, *gate.shape[2:])


def test_mxfp4_checkpoint_and_its_gguf_load_as_transformers(gpt_oss, gguf_path, tmp_path,
                                                            capsys):
    """The tiny model's experts quantised to MXFP4 once (gpt-oss's HF blocks and scales,
    config quantization_config mxfp4; and llama.cpp's `gpt-oss` GGUF: MXFP4 gate / up /
    down experts with their biases, the sinks, post_attention_norm, YaRN in the metadata):
    transformers' own MXFP4 load dequantises to our values, the HF directory's greedy tokens
    are transformers', and the GGUF's logits are the HF directory's. The clamp at gpt-oss's
    own 7.0 here: llama.cpp stores none (its gpt-oss graph has 7.0 built in)."""
    from safetensors.torch import load_file, save_file

    src, _ = gpt_oss
    ref = transformers.GptOssForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                         swiglu_limit=7.0).eval()
    cfg = ref.config
    E, I, H = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
    hf_dir = tmp_path / "hf-mxfp4"
    hf_dir.mkdir()
    tensors = load_file(f"{src}/model.safetensors")
    gguf_experts = {}
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            ex, p = layer.mlp.experts, f"model.layers.{i}.mlp.experts."
            gate_up = ex.gate_up_proj.transpose(1, 2)                     # [E, 2I, H]
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
            down = ex.down_proj.transpose(1, 2)                           # [E, H, I]
            (graw, gb, gs, gv), (uraw, ub, us, uv) = _mxfp4(gate), _mxfp4(up)
            draw, db, ds, dv = _mxfp4(down)
            gguf_experts[i] = (graw, uraw, draw)
            ex.gate_up_proj.copy_(_interleave(gv, uv).transpose(1, 2))
            ex.down_proj.copy_(dv.transpose(1, 2))
            del tensors[p + "gate_up_proj"], tensors[p + "down_proj"]
            tensors.update({p + "gate_up_proj_blocks": _interleave(gb, ub),
                            p + "gate_up_proj_scales": _interleave(gs, us),
                            p + "down_proj_blocks": db, p + "down_proj_scales": ds})
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(open(f"{src}/config.json").read())
    config["swiglu_limit"] = 7.0
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (hf_dir / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / f).write_text(open(f"{src}/{f}").read())

    theirs = transformers.GptOssForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True))
    for a, b in zip(theirs.model.layers, ref.model.layers):
        assert torch.equal(a.mlp.experts.gate_up_proj, b.mlp.experts.gate_up_proj)
        assert torch.equal(a.mlp.experts.down_proj, b.mlp.experts.down_proj)

    hf = LLM(model=str(hf_dir), cpu_kernels=False, **KW)
    assert _experts(hf) == "mxfp4"  # kept as MXFP4, dequantised an expert at a time here
    assert hf.engine.shape.expert_bits == 4.25
    prompts = [_ids(hf, p) for p in PROMPTS]
    outs = hf.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert_reference_greedy(ref, ids, out.outputs[0].token_ids, banned=(cfg.eos_token_id,))

    # llama.cpp's spelling of the same model (convert_hf_to_gguf.py's GptOssModel).
    arch, path = "gpt-oss", tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"context_length": cfg.max_position_embeddings, "embedding_length": H,
                       "block_count": cfg.num_hidden_layers, "feed_forward_length": I,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads,
                       "attention.key_length": cfg.head_dim,
                       "attention.value_length": cfg.head_dim,
                       "attention.sliding_window": cfg.sliding_window, "expert_count": E,
                       "expert_used_count": cfg.num_experts_per_tok,
                       "expert_feed_forward_length": I,
                       "rope.scaling.original_context_length":
                           cfg.rope_parameters["original_max_position_embeddings"]}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", cfg.rope_parameters["factor"])
    meta = gguf_tokenizer_metadata(gguf_path)
    add_gguf_metadata(w, meta)
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.router": "ffn_gate_inp"}
    mx = gguf.GGMLQuantizationType.MXFP4
    for name, t in ref.state_dict().items():
        t = t.float()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight",
                          "model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[name], t.numpy())
            continue
        i, rest = int(name.split(".")[2]), name.split(".", 3)[3]
        part, _, kind = rest.rpartition(".")
        if rest == "self_attn.sinks":
            w.add_tensor(f"blk.{i}.attn_sinks.weight", t.numpy())
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(f"blk.{i}.ffn_gate_exps.bias", t[:, 0::2].contiguous().numpy())
            w.add_tensor(f"blk.{i}.ffn_up_exps.bias", t[:, 1::2].contiguous().numpy())
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(f"blk.{i}.ffn_down_exps.bias", t.numpy())
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            continue
        else:
            w.add_tensor(f"blk.{i}.{parts[part]}.{kind}", t.numpy())
    for i, (graw, uraw, draw) in gguf_experts.items():
        for which, raw in (("gate", graw), ("up", uraw), ("down", draw)):
            w.add_tensor(f"blk.{i}.ffn_{which}_exps.weight", raw, raw_dtype=mx)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    gg = LLM(model=str(path), cpu_kernels=False, **KW)
    gcfg = gg.engine.model_config
    assert gcfg.family == "gpt_oss" and gcfg.layer_types == (SLIDING, FULL, SLIDING)
    assert gcfg.extra == hf.engine.model_config.extra
    assert [_ids(gg, p) for p in PROMPTS] == prompts
    want = prompt_logits(hf.engine, prompts)
    assert _experts(gg) == "mxfp4"
    torch.testing.assert_close(prompt_logits(gg.engine, prompts), want, rtol=1e-5, atol=1e-5)
    from servelm.cli import main  # the roofline counts the file's experts at MXFP4's bits

    capsys.readouterr()
    assert main(["roofline", "--model", str(path), "--bandwidth", "30", "--flops", "1"]) == 0
    assert f"({E} experts at 4.25 bits, 2 a token" in capsys.readouterr().out
    # Two ranks, each keeping its slice of the experts as MXFP4 (the HF blocks' interleaved
    # rows as pairs, the down projection's inputs in whole blocks; llama.cpp's gate / up /
    # down tensors likewise), with their biases: one device's logits.
    for src in (hf_dir, path):
        kw = dict(model=str(src), num_threads=1, **KW)
        assert_tensor_parallel_matches(kw, PROMPTS)
        two = LLM(tensor_parallel_size=2, **kw)
        try:
            assert two.engine.mxfp4_experts and _experts(two) == "mxfp4"
        finally:
            two.engine.shutdown()
    # Dequantised on load when asked: the same values.
    for src in (hf_dir, path):
        dense = LLM(model=str(src), cpu_kernels=False, quantization="none", **KW)
        assert _experts(dense) is None
        torch.testing.assert_close(prompt_logits(dense.engine, prompts), want, rtol=1e-5,
                                   atol=1e-5)
    if not load_ops("q8act"):
        return
    # bf16 on the kernels: the experts' MXFP4 times int8 activations (the fused op for a
    # decode step, mxfp4_linear an expert at a time for the prompts), near the fp32 logits.
    fast = LLM(model=str(path), **{**KW, "dtype": "bfloat16"})
    moe = fast.engine.executor.model.layers[0].mlp
    assert moe.expert_format == "mxfp4" and moe._fused is not None
    got = prompt_logits(fast.engine, prompts)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999
    outs = fast.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    from servelm.models import decode_stack

    if decode_stack.available():  # one stream's decode steps on the stack, its MXFP4 experts
        assert fast.engine.executor.model.fused_decode
        assert_stack_decodes_as_per_op(fast, prompts[:1], SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, logprobs=2))


def _experts(llm) -> str | None:
    """The routed experts' format in every layer (one answer)."""
    formats = {layer.mlp.expert_format for layer in llm.engine.executor.model.layers}
    assert len(formats) == 1
    return formats.pop()
