"""A new user's first hour against a real `servelm serve` process: a base model (Gemma 3 270M,
no chat template) served by positional name over HTTPS under a root path, the banner, chat
templates by request and by flag, and the fields clients send (accepted, honoured, refused)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import ssl
import subprocess
import tempfile
import time

import httpx
import pytest

import server_zygote
from helpers import real_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
            "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ greeting | default('') }}"
            "{{ m.content }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gemma() -> str:
    return real_model("gemma3-270m")


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    key, cert = d / "key.pem", d / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return str(key), str(cert)


@pytest.fixture(scope="module")
def server(gemma, tls):
    """`servelm serve GEMMA` (positional), HTTPS, under /api; yields (base URL, banner, client)."""
    key, cert = tls
    log = tempfile.NamedTemporaryFile("w+", prefix="servelm-first-hour-", suffix=".log")
    proc = server_zygote.launch(  # `python -m servelm.cli serve ...`, forked ready-imported
        ["serve", gemma, "--port", "0",
         "--kernel-tuning", "off", "--kv-cache-memory", "64MiB", "--max-model-len", "512",
         "--ssl-keyfile", key, "--ssl-certfile", cert, "--root-path", "/api"],
        log.name, ROOT)
    deadline = time.monotonic() + 180
    url = None
    while url is None:
        text = open(log.name).read()
        m = re.search(r"on (https://[\d.]+:\d+)/api ", text)
        if m:
            url = m.group(1)
        elif proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"server did not start:\n{text}")
        else:
            time.sleep(0.05)
    client = httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=cert),
                          timeout=120)
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield url, open(log.name).read(), client
    client.close()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def chat(client, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": "gemma-3-270m-q4_k_m.gguf", "messages": MESSAGES, "max_tokens": 4,
        "temperature": 0, **body})


def test_banner_names_what_is_served(server):
    url, banner, _ = server
    assert f"serving gemma-3-270m-q4_k_m.gguf on {url}/api (Gemma3ForCausalLM" in banner
    assert re.search(r"weights +GGUF Q4_K_M \(.*\): int4 weights; activations \w+ on cpu",
                     banner), banner
    assert re.search(r"KV cache +[\d,]+ tokens \(max 512 per request\)", banner), banner
    assert f"console   {url}/api/" in banner and f"API       {url}/api/v1" in banner


def test_https_and_root_path(server):
    url, _, client = server
    assert client.get("/openapi.json").json()["servers"] == [{"url": "/api"}]
    with pytest.raises(httpx.HTTPError):  # a client that does not trust the certificate
        httpx.get(f"{url}/health", timeout=10)


def test_base_model_without_template_is_a_400_that_says_how(server):
    r = chat(server[2])
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "no chat template" in msg and "--chat-template" in msg


def test_request_chat_template_and_kwargs(server):
    client = server[2]
    r = chat(client, chat_template=TEMPLATE)
    assert r.status_code == 200, r.text
    plain = r.json()["usage"]["prompt_tokens"]
    ids = client.post("/tokenize", json={
        "prompt": "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                  "<start_of_turn>model\n", "add_special_tokens": False}).json()
    assert ids["count"] == plain
    kwargs = {"greeting": "Good morning, dear model. "}
    r = chat(client, chat_template=TEMPLATE, chat_template_kwargs=kwargs)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > plain + 4
    # /tokenize renders a conversation with the same template and variables.
    ids = client.post("/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE,
                                         "chat_template_kwargs": kwargs}).json()
    assert ids["count"] == r.json()["usage"]["prompt_tokens"]
    r = chat(client, chat_template="{% for m in messages %}{{ m.content")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_metadata_fields_are_accepted(server):
    r = chat(server[2], chat_template=TEMPLATE, store=False, metadata={"team": "a"},
             service_tier="auto", safety_identifier="u-1", prompt_cache_key="k", user="u",
             verbosity="low", reasoning_effort="low", modalities=["text"], cache_prompt=True)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field,value", [("audio", {"voice": "alloy", "format": "wav"}),
                                         ("prediction", {"type": "content", "content": "x"}),
                                         ("modalities", ["text", "audio"]),
                                         ("web_search_options", {}),
                                         ("store", "yes")])
def test_output_changing_fields_are_refused_by_name(server, field, value):
    r = chat(server[2], chat_template=TEMPLATE, **{field: value})
    assert r.status_code == 400
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field


def test_completions_suffix_is_refused(server):
    r = server[2].post("/v1/completions", json={"model": "gemma-3-270m-q4_k_m.gguf",
                                                 "prompt": "def f(", "suffix": "return 1"})
    assert r.status_code == 400 and "suffix" in r.json()["error"]["message"]


def test_cache_prompt_false_keeps_the_prompt_out_of_the_prefix_cache(server):
    client = server[2]
    prompt = "A long shared prefix for the prefix cache. " * 8

    def cached(**body):
        r = client.post("/v1/completions", json={"model": "gemma-3-270m-q4_k_m.gguf",
                                                  "prompt": prompt, "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_prompt=False) == 0
    assert cached(cache_prompt=False) == 0  # the first one left nothing to find
    cached()
    assert cached() >= 64  # the default shares it
    assert cached(cache_prompt=False) == 0


def test_chat_template_flag_in_generate(gemma, tmp_path, capsys):
    from servelm.cli import main

    path = tmp_path / "gemma.jinja"
    path.write_text(TEMPLATE)
    rc = main(["generate", "What is the capital of France?", "--chat", "--model", gemma,
               "--chat-template", str(path), "--kernel-tuning", "off", "--max-tokens", "3",
               "--temperature", "0", "--kv-cache-memory", "32MiB", "--max-model-len", "256"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert re.search(r"\[1\d prompt tokens, [1-3] output tokens", err), err
