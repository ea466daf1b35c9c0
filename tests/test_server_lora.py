"""LoRA adapters through the server: a request's `model` naming an adapter on every generating
API, /v1/models and Ollama's /api/tags listing them under their base, and vLLM's runtime
/v1/load_lora_adapter and /v1/unload_lora_adapter with every refusal in its status and shape.

One `servelm serve` process on a tiny random Llama (the embedded model's tokenizer) with two
PEFT adapters from start-up, and the offline LLM over the same files as the reference: greedy
tokens through the server equal LLM.generate / LLM.chat with the same LoRARequest."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from helpers import tiny_hf_checkpoint
from servelm import LLM, SamplingParams
from servelm.lora import LoRARequest
from test_server import KEY, Server

pytest.importorskip("peft")

AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny-llama"
PROMPT = "Hello there, my name is"
CHAT = [{"role": "user", "content": "Tell me a story."}]
MAX_TOKENS = 10
MAX_RANK = 8
# The same untimed choice of matmul methods in the server and the offline reference: the
# same tokens, and no start-up spent measuring a model this small.
ENGINE = {"kernel_tuning": "off"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(directory: str, tokenizer, seed: int, rank: int = 4, extra: dict | None = None,
             targets: list[str] = TARGETS) -> str:
    """A PEFT adapter with random non-zero B (PEFT initialises B to zero: no effect) over
    the tiny base (or, with extra, a base of another shape), saved in directory."""
    import peft

    model = tiny_hf_checkpoint(os.path.join(directory, "base"), "LlamaConfig",
                               "LlamaForCausalLM", extra or {}, tokenizer, seed=0)
    torch.manual_seed(seed)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                      target_modules=targets))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    path = os.path.join(directory, "adapter")
    lora.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, hf_tokenizer):
    """The base checkpoint and the adapters: a1, a2 served from start-up, a3 loaded at run
    time, and three that must be refused (rank over MAX_RANK, another base's shapes)."""
    root = tmp_path_factory.mktemp("lora-server")
    base = str(root / "base")
    tiny_hf_checkpoint(base, "LlamaConfig", "LlamaForCausalLM", {}, hf_tokenizer, seed=0)
    out = {"base": base}
    for name, seed in (("a1", 1), ("a2", 2), ("a3", 3)):
        out[name] = _adapter(str(root / name), hf_tokenizer, seed,
                             targets=TARGETS if name != "a3" else ["q_proj", "v_proj"])
    out["rank16"] = _adapter(str(root / "rank16"), hf_tokenizer, 4, rank=16)
    out["other_base"] = _adapter(str(root / "other"), hf_tokenizer, 5,
                                 extra={"hidden_size": 32, "intermediate_size": 48})
    return SimpleNamespace(**out)


@pytest.fixture(scope="module")
def server(files):
    s = Server("--model", files.base, "--served-model-name", BASE, "--api-key", KEY,
               "--lora-modules", f"a1={files.a1}", f"a2={files.a2}",
               "--max-loras", "2", "--max-lora-rank", str(MAX_RANK),
               *(a for k, v in ENGINE.items() for a in (f"--{k.replace('_', '-')}", v)))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(files):
    """The reference: the offline LLM over the same files, greedy."""
    llm = LLM(model=files.base, dtype="float32", enable_lora=True, max_lora_rank=MAX_RANK,
              kv_cache_memory=64 << 20, max_model_len=1024, **ENGINE)
    ids = {name: i for i, name in enumerate(("a1", "a2", "a3"), 1)}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)

    def lora(name):
        return None if name is None else LoRARequest(name, ids[name], getattr(files, name))

    def complete(name):
        return llm.generate([PROMPT], params, use_tqdm=False,
                            lora_request=lora(name))[0].outputs[0].text

    def chat(name):
        return llm.chat(CHAT, params, use_tqdm=False, lora_request=lora(name))[0].outputs[0].text

    return SimpleNamespace(complete=complete, chat=chat)


def _complete(client, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.model == model
    return r.choices[0].text


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=kw.pop("headers", AUTH),
                      timeout=60, **kw)


def test_models_list_the_adapters_under_their_base(server, client, files):
    ids = [m.id for m in client.models.list().data]
    assert ids == [BASE, "a1", "a2"]
    card = client.models.retrieve("a1").model_dump()
    assert card["parent"] == BASE and card["root"] == files.a1
    assert card["family"] == "llama"  # the base's
    assert client.models.retrieve(BASE).model_dump()["parent"] is None
    tags = httpx.get(f"{server.url}/api/tags", headers=AUTH).json()["models"]
    assert [t["name"] for t in tags] == [f"{BASE}:latest", "a1:latest", "a2:latest"]
    assert tags[1]["details"]["parent_model"] == f"{BASE}:latest"
    ps = httpx.get(f"{server.url}/api/ps", headers=AUTH).json()["models"]
    assert [m["name"] for m in ps] == [f"{BASE}:latest", "a1:latest", "a2:latest"]
    assert ps[2]["details"]["parent_model"] == f"{BASE}:latest" and ps[2]["size"] > 0
    assert ps[2]["expires_at"] == ps[0]["expires_at"] and ps[2]["size_vram"] == 0
    # The start-up banner names them.
    assert f"a1 = {files.a1}" in server.output() and "up to 2 resident" in server.output()


def test_completions_and_chat_run_the_adapter_named(client, offline):
    texts = {}
    for model in (BASE, "a1", "a2"):
        texts[model] = _complete(client, model)
        assert texts[model] == offline.complete(None if model == BASE else model), model
    assert len(set(texts.values())) == 3  # each adapter changes the answer
    chat = client.chat.completions.create(model="a2", messages=CHAT, max_tokens=MAX_TOKENS,
                                          temperature=0)
    assert chat.model == "a2"
    assert chat.choices[0].message.content == offline.chat("a2") != offline.chat(None)
    # Streamed: the same tokens, every chunk naming the adapter.
    chunks = list(client.chat.completions.create(model="a1", messages=CHAT,
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))
    assert {c.model for c in chunks} == {"a1"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        offline.chat("a1")


def test_one_batch_of_base_and_adapters_gives_each_its_own_tokens(server, offline):
    """Concurrent requests of the base and both adapters (a1 twice) share steps; each gets
    what it gets alone."""
    models = [BASE, "a1", "a2", "a1"]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY,
                                      max_retries=0) as c:
            rs = await asyncio.gather(*(c.completions.create(
                model=m, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0) for m in models))
        return [r.choices[0].text for r in rs]

    got = asyncio.run(run())
    assert got == [offline.complete(None if m == BASE else m) for m in models]


def test_every_generating_api_takes_the_adapter(server, client, offline):
    want = offline.chat("a1")
    r = _post(server, "/v1/responses", {"model": "a1", "input": CHAT[0]["content"],
                                        "max_output_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "a1"
    assert r.json()["output"][-1]["content"][0]["text"] == want
    r = _post(server, "/v1/messages", {"model": "a1", "messages": CHAT,
                                       "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "a1"
    assert r.json()["content"][0]["text"] == want
    # Ollama's: the name matched as Ollama matches (tag optional, any case).
    r = _post(server, "/api/chat", {"model": "A1:latest", "messages": CHAT, "stream": False,
                                    "options": {"num_predict": MAX_TOKENS, "temperature": 0}})
    assert r.status_code == 200 and r.json()["message"]["content"] == want
    r = _post(server, "/api/generate", {"model": "a2", "prompt": PROMPT, "raw": True,
                                        "stream": False,
                                        "options": {"num_predict": MAX_TOKENS, "temperature": 0}})
    assert r.status_code == 200 and r.json()["response"] == offline.complete("a2")


def test_unknown_model_is_a_404_in_each_apis_shape(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found" and "'a1', 'a2'" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    r = _post(server, "/v1/responses", {"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(server, "/v1/messages", {"model": "nope", "messages": CHAT, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    for path, body in (("/api/chat", {"messages": CHAT}), ("/api/generate", {"prompt": "x"})):
        r = _post(server, path, {"model": "nope", **body})
        assert (r.status_code, r.json()) == (404, {"error": "model 'nope' not found"})
    # Embeddings come from the base only: an adapter there is a 400 that says so.
    r = _post(server, "/v1/embeddings", {"model": "a1", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "base model only" in r.json()["error"]["message"]
    r = _post(server, "/api/embed", {"model": "a1", "input": "x"})
    assert r.status_code == 400 and "base model only" in r.json()["error"]


def test_load_use_unload(server, client, offline, files):
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": files.a3},
              headers={})
    assert r.status_code == 401  # behind the key
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": files.a3})
    assert r.status_code == 200 and "a3" in r.text
    assert "a3" in [m.id for m in client.models.list().data]
    assert _complete(client, "a3") == offline.complete("a3")
    # Three adapters in turn through two slots: each still gives its own tokens.
    for model in ("a1", "a2", "a3", "a1"):
        assert _complete(client, model) == offline.complete(model)
    stats = httpx.get(f"{server.url}/v1/stats", headers=AUTH).json()["lora"]
    assert stats["loaded"] == ["a1", "a2", "a3"] and stats["max_loras"] == 2
    assert stats["resident"][-1] == "a1" and len(stats["resident"]) == 2
    metrics = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    assert "servelm_lora_adapters_loaded 3.0" in metrics
    assert "servelm_lora_adapters_resident 2.0" in metrics
    assert f"servelm_lora_adapter_loads_total {float(stats['loads'])}" in metrics
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "a3"})
    assert r.status_code == 200 and "a3" in r.text
    assert "a3" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "a3")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("a3")


@pytest.mark.parametrize("body, status, words", [
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 400, "/no/such/adapter"),
    ({"lora_name": "x", "lora_path": "{rank16}"}, 400, "over the maximum LoRA rank"),
    ({"lora_name": "x", "lora_path": "{other_base}"}, 400, "layers.0."),
    ({"lora_name": "a1", "lora_path": "{a2}"}, 400, "already loaded"),
    ({"lora_name": BASE, "lora_path": "{a2}"}, 400, "served model's name"),
    ({"lora_name": "x"}, 400, "lora_path"),
], ids=["missing-path", "rank-over-max", "wrong-base", "name-taken", "base-name", "no-path"])
def test_load_refusals(server, client, files, body, status, words):
    body = {k: v.format(**vars(files)) for k, v in body.items()}
    r = _post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    assert [m.id for m in client.models.list().data] == [BASE, "a1", "a2"]


def test_unload_refusals_and_the_server_keeps_serving(server, client, offline):
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # In use: a streaming request on a1 holds it.
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "a1", "prompt": PROMPT, "max_tokens": 400,
                            "ignore_eos": True, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "a1"})
        assert r.status_code == 400 and "in use" in r.json()["error"]["message"]
    assert _complete(client, "a1") == offline.complete("a1")
    assert _complete(client, BASE) == offline.complete(None)


def _stub_app():
    """The app over an engine that never runs, LoRA off."""
    from servelm.engine.async_engine import EngineSnapshot
    from servelm.server.api import build_app
    from servelm.server.options import ServerOptions

    engine = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None), loras={},
                             snapshot=EngineSnapshot(), engine=None, lora_enabled=False)
    return build_app(engine, BASE, ServerOptions(api_keys=(KEY,)))


def test_lora_disabled_and_documented():
    app = _stub_app()

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     headers=AUTH) as c:
            load = await c.post("/v1/load_lora_adapter",
                                json={"lora_name": "x", "lora_path": "/tmp/x"})
            unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
            spec = (await c.get("/openapi.json")).json()
        return load, unload, spec

    load, unload, spec = asyncio.run(run())
    for r in (load, unload):
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    for path, codes in (("/v1/load_lora_adapter", {"200", "400", "401", "503"}),
                        ("/v1/unload_lora_adapter", {"200", "400", "401", "404", "503"})):
        op = spec["paths"][path]["post"]
        assert codes <= set(op["responses"]) and "422" not in op["responses"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["required"][0] == \
            "lora_name"
    assert json.dumps(spec)  # serialisable as served



def test_load_inplace_and_reload_under_one_name(server, client, files, offline):
    """load_inplace puts the new adapter in the old one's place; one that fails to load keeps
    the old one; unload then load under the same name runs the new weights."""
    def load(path, inplace=False):
        return _post(server, "/v1/load_lora_adapter",
                     {"lora_name": "a4", "lora_path": path, "load_inplace": inplace})

    assert load(files.a1).status_code == 200
    assert _complete(client, "a4") == offline.complete("a1")
    assert load(files.a2, inplace=True).status_code == 200
    assert _complete(client, "a4") == offline.complete("a2")
    r = load("/no/such/adapter", inplace=True)
    assert r.status_code == 400 and "/no/such/adapter" in r.json()["error"]["message"]
    assert _complete(client, "a4") == offline.complete("a2")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "a4"}).status_code == 200
    assert load(files.a1).status_code == 200
    assert _complete(client, "a4") == offline.complete("a1")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "a4"}).status_code == 200


# Longer than a KV block: its first block goes into the prefix cache.
LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def test_a_name_loaded_again_never_reads_its_old_weights_kv(server, client, files):
    def complete(model):
        r = client.completions.create(model=model, prompt=LONG, max_tokens=MAX_TOKENS,
                                      temperature=0)
        return r.choices[0].text

    want = {name: complete(name) for name in ("a1", "a2")}
    for path, inplace, name in ((files.a1, False, "a1"), (files.a2, True, "a2")):
        r = _post(server, "/v1/load_lora_adapter",
                  {"lora_name": "a5", "lora_path": path, "load_inplace": inplace})
        assert r.status_code == 200
        assert complete("a5") == want[name]
