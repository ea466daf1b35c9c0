"""Embeddings: pooling requests through the same scheduler and prefill path as generation.

Against transformers' final hidden states (last token, mean) on a tiny random Qwen3
checkpoint and on the embedded model, fp32; normalisation and Matryoshka truncation;
batches of mixed lengths equal to one at a time; chunked prefill; generation and
embeddings in one engine, in the same steps; POST /v1/embeddings through the openai SDK
(float and base64) against a real server, and its 400s."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.engine.engine import PoolingConfig
from servelm.models.config import ModelConfig
from servelm.pooling_params import PoolingParams

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
PROMPTS = ["The capital of France is Paris, the capital of Spain is Madrid, and the capital "
           "of Italy is Rome; the capital of Germany is Berlin.",
           "def fibonacci(n):",
           "1, 2, 3, 5, 8, 13, 21, 34, 55,",
           "Hi"]
ATOL = 2e-5  # fp32, unit vectors


def _st_modules(d, pooling: str, normalize: bool, dense: bool = False) -> None:
    """sentence-transformers' modules.json and 1_Pooling/config.json in checkpoint dir d."""
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"}]
    if dense:
        mods.append({"idx": 2, "name": "2", "path": "2_Dense",
                     "type": "sentence_transformers.models.Dense"})
    if normalize:
        mods.append({"idx": 3, "name": "3", "path": "3_Normalize",
                     "type": "sentence_transformers.models.Normalize"})
    (d / "modules.json").write_text(json.dumps(mods))
    (d / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": m == pooling
             for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                             **flags}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_tokenizer):
    """name -> HF directory of one tiny random Qwen3 (norms perturbed), as: a plain causal
    LM, sentence-transformers models pooling by mean (normalised) and by CLS (not), a
    Matryoshka last-token model, one with a Dense module; and transformers' base model
    (final hidden states) as the reference."""
    torch.manual_seed(7)
    cfg = transformers.Qwen3Config(vocab_size=hf_tokenizer.vocab_size, **TINY)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    plain = tmp_path_factory.mktemp("tiny-plain")
    model.save_pretrained(plain)
    hf_tokenizer.save_pretrained(plain)
    dirs = {"plain": plain}
    for name in ("mean", "cls", "matryoshka", "dense"):
        d = tmp_path_factory.mktemp(f"tiny-{name}") / "ckpt"
        shutil.copytree(plain, d)
        dirs[name] = d
    _st_modules(dirs["mean"], "mean_tokens", normalize=True)
    _st_modules(dirs["cls"], "cls_token", normalize=False)
    _st_modules(dirs["dense"], "lasttoken", normalize=True, dense=True)
    c = json.loads((dirs["matryoshka"] / "config.json").read_text())
    (dirs["matryoshka"] / "config.json").write_text(json.dumps(
        {**c, "matryoshka_dimensions": [16, 32, 64]}))
    return {k: str(v) for k, v in dirs.items()}, model.model


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20,
               max_model_len=256, **kw)


def _hidden(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).last_hidden_state[0].float()


def _unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=-1)


def _vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def test_last_token_pooling_matches_transformers(tiny):
    dirs, ref = tiny
    llm = _llm(dirs["plain"])
    cfg = llm.engine.pooling_config
    assert (cfg.pooling_type, cfg.normalize, cfg.matryoshka_dimensions) == ("last", True, None)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    got = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    want = torch.stack([_unit(_hidden(ref, x)[-1]) for x in ids])
    assert got.shape == (len(PROMPTS), 64)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # Not normalised: the raw final hidden state, as the reference's.
    raw = _vectors(llm.embed([{"prompt_token_ids": ids[0]}], PoolingParams(normalize=False),
                             use_tqdm=False))[0]
    torch.testing.assert_close(raw, _hidden(ref, ids[0])[-1], atol=1e-4, rtol=1e-4)
    assert abs(raw.norm().item() - 1) > 0.1  # so the check above is not of a unit vector
    # A model that claims no Matryoshka training: truncation refused, its own width allowed.
    with pytest.raises(ValueError, match="dimensions 16: this model does not support"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=16), use_tqdm=False)
    full = _vectors(llm.embed(PROMPTS[:1], PoolingParams(dimensions=64), use_tqdm=False))
    torch.testing.assert_close(full[0], got[0], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="more than the model's 64"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)


@pytest.mark.parametrize("kind", ["mean", "cls"])
def test_mean_and_cls_pooling_through_chunked_prefill_match_transformers(tiny, kind):
    """sentence-transformers models that pool by mean (every position's final hidden state,
    summed once each) or CLS (the first position's), across prefill chunks of 8 tokens."""
    dirs, ref = tiny
    llm = _llm(dirs[kind], max_num_batched_tokens=8, max_num_seqs=4)
    cfg = llm.engine.pooling_config
    assert (cfg.pooling_type, cfg.normalize) == (kind, kind == "mean")
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert max(len(x) for x in ids) > 3 * 8  # several chunks
    got = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    pool = (lambda h: _unit(h.mean(0))) if kind == "mean" else (lambda h: h[0])
    want = torch.stack([pool(_hidden(ref, x)) for x in ids])
    torch.testing.assert_close(got, want, atol=ATOL if kind == "mean" else 1e-4, rtol=1e-5)


def test_batches_of_mixed_lengths_equal_one_at_a_time(tiny):
    dirs, _ = tiny
    llm = _llm(dirs["mean"])
    together = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    alone = torch.cat([_vectors(llm.embed([p], use_tqdm=False)) for p in PROMPTS])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def test_matryoshka_truncates_then_normalises_and_refuses_untrained_widths(tiny):
    dirs, ref = tiny
    llm = _llm(dirs["matryoshka"])
    assert llm.engine.pooling_config.matryoshka_dimensions == (16, 32, 64)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    got = _vectors(llm.embed(PROMPTS[:1], PoolingParams(dimensions=16), use_tqdm=False))[0]
    torch.testing.assert_close(got, _unit(_hidden(ref, ids)[-1][:16]), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"not one this model was trained for: \[16, 32, 64\]"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=20), use_tqdm=False)


def test_pooling_the_checkpoint_states_but_servelm_cannot_run_is_refused(tiny):
    dirs, _ = tiny
    cfg = ModelConfig.from_hf_dir(dirs["dense"])
    assert cfg.pooling_type == "last" and "Dense module" in cfg.pooling_unsupported
    with pytest.raises(ValueError, match="cannot embed here: .*Dense module"):
        PoolingConfig.of(cfg).check(PoolingParams())


def test_gguf_pooling_type_metadata():
    """<arch>.pooling_type, llama.cpp's enum: 1 mean, 2 cls, 3 last (Qwen3-Embedding's)."""
    meta = {"general.architecture": "qwen3", "qwen3.attention.head_count": 4,
            "qwen3.attention.head_count_kv": 2, "qwen3.embedding_length": 64,
            "qwen3.feed_forward_length": 96, "qwen3.block_count": 2, "qwen3.vocab_size": 100,
            "qwen3.attention.key_length": 16}
    names = {"blk.0.attn_q_norm.weight", "output.weight"}
    kinds = {None: None, 0: None, 1: "mean", 2: "cls", 3: "last", 4: "rank"}
    for value, kind in kinds.items():
        m = meta if value is None else {**meta, "qwen3.pooling_type": value}
        cfg = ModelConfig.from_gguf(m, names)
        assert cfg.pooling_type == kind
        assert (cfg.pooling_unsupported is not None) == (kind == "rank")


# ---- the embedded model ------------------------------------------------------------------


def test_embedded_model_default_is_its_last_token_normalised(llm, hf_model):
    """The embedded chat model answers too: its last token's final hidden state, L2-normalised."""
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    got = _vectors(llm.embed([{"prompt_token_ids": x} for x in ids], use_tqdm=False))
    want = torch.stack([_unit(_hidden(hf_model.model, x)[-1]) for x in ids])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_generation_and_embeddings_share_the_engine_and_its_steps(llm, monkeypatch):
    """Generation and pooling requests in one engine, some steps running both: each answer
    is what it is alone; pooling requests leave nothing in the prefix cache."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    texts = ["The KV cache stores", "Once upon a time, in a small village,"]
    alone_text = [o.outputs[0].token_ids for o in llm.generate(texts, greedy, use_tqdm=False)]
    unique = "Embeddings are never cached: zebra quartz 4417 " * 6
    alone_vec = _vectors(llm.embed(PROMPTS + [unique], use_tqdm=False))

    kinds = []  # per step with pooling: (pooling chunks, other sequences)
    real = engine.executor.execute_pooling

    def spy(seqs):
        kinds.append((sum(s.pooling for s in seqs), sum(not s.pooling for s in seqs)))
        return real(seqs)

    monkeypatch.setattr(engine.executor, "execute_pooling", spy)
    engine.add_request("g0", texts[0], greedy)
    engine.step()  # g0 prefilled: it decodes while the embeddings prefill
    engine.add_request("g1", texts[1], greedy)
    for i, p in enumerate(PROMPTS + [unique]):
        engine.add_pooling_request(f"e{i}", p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert any(p and o for p, o in kinds), kinds  # a step with both
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(2)] == alone_text
    mixed = torch.stack([done[f"e{i}"].outputs.data for i in range(len(PROMPTS) + 1)])
    torch.testing.assert_close(mixed, alone_vec, atol=1e-5, rtol=0)
    assert engine.stats.num_pooling_requests >= 2 * (len(PROMPTS) + 1)
    # The embedded prompt was never cached: generating it computes every position.
    out = llm.generate([unique], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.outputs[0].metrics.num_cached_tokens == 0
    # An aborted pooling request frees its blocks at once.
    free = engine.block_manager.num_free_blocks
    engine.add_pooling_request("gone", unique)
    assert engine.abort_request("gone") and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free


# ---- POST /v1/embeddings -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    from test_server import Server

    s = Server("--kernel-tuning", "off").wait_ready(timeout=300)  # CPUs shared with others
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


MODEL = "SmolLM2-135M-Instruct"


def test_openai_sdk_float_and_base64_agree_with_offline(client, server, llm):
    texts = ["The capital of France is", "def fibonacci(n):", "Hi"]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.model == MODEL and floats.object == "list"
    n = sum(len(llm.get_tokenizer().encode(t)) for t in texts)
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (n, n)
    got = torch.tensor([d.embedding for d in floats.data])
    want = _vectors(llm.embed(texts, use_tqdm=False))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # The SDK's default asks for base64 and decodes it: the same float32 values, exactly.
    b64 = client.embeddings.create(model=MODEL, input=texts)
    assert [d.embedding for d in b64.data] == [d.embedding for d in floats.data]
    # Raw: little-endian float32, as OpenAI sends it.
    r = httpx.post(f"{server.url}/v1/embeddings", json={
        "model": MODEL, "input": texts, "encoding_format": "base64", "user": "u1"})
    raw = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
           for d in r.json()["data"]]
    assert raw == [d.embedding for d in floats.data]
    # Token ids, one list or several, are the texts' embeddings.
    ids = [llm.get_tokenizer().encode(t) for t in texts]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in floats.data]
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    # Alone, not in a batch of three: equal within fp32 rounding (the batch's shape picks
    # the kernels).
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), got[1], atol=1e-5, rtol=0)
    metrics = httpx.get(f"{server.url}/metrics").text
    inputs = float(next(line.split()[1] for line in metrics.splitlines()
                        if line.startswith("servelm_embedding_inputs_total")))
    assert inputs >= 3 + 3 + 1 + 3 + 1


def test_dimensions_are_refused_where_the_model_has_no_matryoshka(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="hello", dimensions=64)
    assert e.value.status_code == 400 and e.value.body["param"] == "dimensions"
    assert "Matryoshka" in e.value.body["message"]


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input[0]"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": [1, 999999]}, "input"),
    ({"input": [[1, 2], [-1]]}, "input[1]"),
    ({"input": [True, 2]}, "input"),
    ({"input": ["a", [1, 2]]}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": [7] * 1025}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "temperature": 1}, "temperature"),
    ({}, "input"),
])
def test_bad_input_is_a_400_in_openai_shape(server, body, param):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"]


def test_wrong_model_is_a_404_and_the_server_keeps_serving(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="nope", input="hello")
    assert e.value.body["code"] == "model_not_found"
    ok = client.embeddings.create(model=MODEL, input="still here", encoding_format="float")
    assert len(ok.data[0].embedding) == 576


def test_a_preempted_pooling_request_is_recomputed_and_pools_each_position_once(tiny):
    """Five blocks of 16 tokens: a generation (31 + 40 tokens) and a 60-token mean-pooling
    prompt cannot both hold theirs, so the pooling request, admitted last, is preempted
    mid-prompt and recomputed after; its mean still counts each position once."""
    dirs, _ = tiny
    gen_ids, pool_ids = list(range(100, 131)), list(range(200, 260))
    alone = _vectors(_llm(dirs["mean"]).embed([pool_ids], use_tqdm=False))[0]
    llm = LLM(model=dirs["mean"], dtype="float32", kernel_tuning="off",
              kv_cache_memory=5 * 12288, max_num_batched_tokens=8, max_num_seqs=4,
              admission_lookahead=0)
    engine = llm.engine
    assert engine.block_manager.num_blocks == 5
    engine.add_request("g", gen_ids, SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True))
    engine.add_pooling_request("e", pool_ids)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.scheduler.num_preemptions > 0
    assert len(done["g"].outputs[0].token_ids) == 40
    torch.testing.assert_close(done["e"].outputs.data, alone, atol=1e-5, rtol=0)
