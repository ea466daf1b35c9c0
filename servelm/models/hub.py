"""Model names -> local paths the loader opens.

A user names a model by a path (GGUF file or Hugging Face directory), a Hugging Face repo id
`ORG/NAME` (its snapshot directory), or `ORG/NAME:QUANT` (llama-server's -hf spelling: the GGUF
file in that repo whose name carries the quant tag). Repos come from the Hugging Face cache
first (the layout huggingface_hub writes: models--ORG--NAME/{refs,snapshots,blobs}), read
here without the network; only what is absent is downloaded, with huggingface_hub, and only
the files servelm loads. Every failure is a ValueError of one line: the CLI prints it as is.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re

DEFAULT_QUANT = "Q4_K_M"  # what a bare ORG/NAME picks in a repo of GGUF files (as llama.cpp)

# Files of an HF model directory that servelm reads (loader.HFCheckpoint, Tokenizer.from_dir).
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
            "merges.txt")
HF_PATTERNS = ("chat_template.*", "*.safetensors.index.json")
INDEX = "model.safetensors.index.json"

# Ollama's documented spelling of a Hugging Face GGUF repo (hf.co/ORG/NAME:QUANT) and URLs.
_HF_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_QUANT = re.compile(r"[A-Za-z0-9_]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_TRUE = {"1", "ON", "YES", "TRUE"}

HOW_TO_NAME = ("name a model by a path (GGUF file or Hugging Face directory), a Hugging Face "
               "repo ORG/NAME, or a GGUF in one, ORG/NAME:QUANT (e.g. "
               "bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M)")


def hub_cache_dir(download_dir: str | None = None) -> str:
    """The Hugging Face hub cache: download_dir, else what huggingface_hub would use, read from
    the environment now (its own constants are fixed when it is first imported)."""
    if download_dir:
        return os.path.abspath(os.path.expanduser(download_dir))
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "huggingface")
        cache = os.path.join(home, "hub")
    return os.path.abspath(os.path.expanduser(os.path.expandvars(cache)))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set: the cache only, no request to the hub."""
    return any((os.environ.get(k) or "").strip().upper() in _TRUE
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def repo_folder(cache: str, repo_id: str) -> str:
    return os.path.join(cache, "models--" + repo_id.replace("/", "--"))


def parse_name(spec: str) -> tuple[str, str | None]:
    """'ORG/NAME' -> (repo id, None); 'ORG/NAME:QUANT' -> (repo id, quant); else ValueError."""
    name = spec.strip()
    for prefix in _HF_PREFIXES:
        if name.lower().startswith(prefix):
            name = name[len(prefix):]
            break
    repo, _, quant = name.partition(":")
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.lower().endswith(".gguf")
    if looks_like_path or not _REPO_ID.fullmatch(repo) or (quant and not _QUANT.fullmatch(quant)):
        raise ValueError(f"{spec}: no such file or directory, nor a model name: {HOW_TO_NAME}")
    if ":" in name and not quant:
        raise ValueError(f"{spec}: empty quant tag after ':' ({HOW_TO_NAME})")
    return repo, quant or None


def cached_snapshot(cache: str, repo_id: str, revision: str | None) -> str | None:
    """The snapshot directory of repo_id at revision (a branch or tag through refs/, or a
    commit hash) in the cache, or None."""
    folder = repo_folder(cache, repo_id)
    rev = revision or "main"
    if _COMMIT.fullmatch(rev) and os.path.isdir(os.path.join(folder, "snapshots", rev)):
        return os.path.join(folder, "snapshots", rev)
    ref = os.path.join(folder, "refs", rev)
    if not os.path.isfile(ref):
        return None
    with open(ref) as f:
        commit = f.read().strip()
    snap = os.path.join(folder, "snapshots", commit)
    return snap if commit and os.path.isdir(snap) else None


def snapshot_files(snap: str) -> list[str]:
    """The files present in a snapshot (relative, '/'-separated; broken links left out)."""
    out = []
    for root, _, names in os.walk(snap, followlinks=True):
        for n in names:
            path = os.path.join(root, n)
            if os.path.isfile(path):
                out.append(os.path.relpath(path, snap).replace(os.sep, "/"))
    return sorted(out)


def hf_missing(snap: str, files: list[str]) -> list[str]:
    """What an HF model directory lacks for the loader: config.json, the safetensors weights
    (every shard its index names). [] = complete."""
    missing = [] if "config.json" in files else ["config.json"]
    if INDEX in files:
        try:
            with open(os.path.join(snap, INDEX)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            return missing + [f"{INDEX} (unreadable)"]
        return missing + [s for s in shards if s not in files]
    if not any("/" not in f and f.endswith(".safetensors") for f in files):
        missing.append("*.safetensors")
    return missing


def gguf_files(files: list[str]) -> list[str]:
    return [f for f in files if f.lower().endswith(".gguf")]


def _model_ggufs(files: list[str]) -> list[str]:
    """GGUF model files: multimodal projectors and later split parts left out."""
    out = []
    for f in gguf_files(files):
        split = _SPLIT.search(f)
        if os.path.basename(f).lower().startswith("mmproj") or (split and int(split[1]) != 1):
            continue
        out.append(f)
    return out


def pick_gguf(files: list[str], quant: str) -> str | None:
    """The GGUF file whose name carries the quant tag (case-insensitive): a tag between
    separators first (Q4_0 is not IQ4_0's), else anywhere; of several, the shortest name
    (a split model: its first part). None when no name has it."""
    tag = quant.lower()
    bounded = re.compile(rf"(?<![a-z0-9]){re.escape(tag)}(?![a-z0-9])")
    names = _model_ggufs(files)
    hits = ([f for f in names if bounded.search(f.lower())]
            or [f for f in names if tag in f.lower()])
    return min(hits, key=lambda f: (len(f), f)) if hits else None


def _listing(files: list[str]) -> str:
    ggufs = gguf_files(files)
    return f"GGUF files there: {', '.join(ggufs)}" if ggufs else "no GGUF files there"


def choose_gguf(repo_id: str, files: list[str], quant: str | None) -> str:
    """The GGUF a name means in a repo's file list: the quant's, or for a bare ORG/NAME the
    Q4_K_M one (a repo of one GGUF model: that one); else ValueError listing them."""
    if quant:
        hit = pick_gguf(files, quant)
        if hit is None:
            raise ValueError(f"{repo_id}: no GGUF file with {quant!r} in its name "
                             f"({_listing(files)})")
        return hit
    hit = pick_gguf(files, DEFAULT_QUANT)
    models = _model_ggufs(files)
    if hit is None and len(models) == 1:
        hit = models[0]
    if hit is None:
        raise ValueError(f"{repo_id}: several GGUF files and none {DEFAULT_QUANT}: name one as "
                         f"{repo_id}:QUANT ({_listing(files)})")
    return hit


def _split_parts(name: str, files: list[str]) -> list[str]:
    """A split GGUF's parts in order (named like its first), or [name]."""
    split = _SPLIT.search(name)
    if not split:
        return [name]
    stem, total = name[:split.start()], int(split[2])
    return [f"{stem}-{i:05d}-of-{total:05d}{name[split.end() - 5:]}" for i in range(1, total + 1)]


def _from_snapshot(repo_id: str, snap: str, quant: str | None) -> tuple[str | None, str]:
    """What the name means in a cached snapshot: (path, '') or (None, why it is not there)."""
    files = snapshot_files(snap)
    if quant:
        hit = pick_gguf(files, quant)
        if hit and all(p in files for p in _split_parts(hit, files)):
            return os.path.join(snap, hit), ""
        return None, f"no complete GGUF with {quant!r} in its name there ({_listing(files)})"
    missing = hf_missing(snap, files)
    if not missing:
        return snap, ""
    if _model_ggufs(files) and "config.json" not in files:
        try:
            return os.path.join(snap, choose_gguf(repo_id, files, None)), ""
        except ValueError as e:
            return None, str(e).split(": ", 1)[1]
    return None, f"the cached snapshot lacks {', '.join(missing)}"


def _hf_download_list(repo_id: str, files: list[str], revision: str | None,
                      cache: str) -> list[str]:
    """The files of an HF model repo servelm loads: top-level config, tokenizer and chat
    template files, and the weights: the shards the index names (not a consolidated copy
    beside them), else model.safetensors, else every top-level *.safetensors."""
    top = [f for f in files if "/" not in f]
    want = [f for f in top
            if f in HF_FILES or any(fnmatch.fnmatch(f, p) for p in HF_PATTERNS)]
    if INDEX in top:
        from huggingface_hub import hf_hub_download

        index = hf_hub_download(repo_id, INDEX, revision=revision, cache_dir=cache)
        with open(index) as f:
            want += sorted(set(json.load(f)["weight_map"].values()))
    elif "model.safetensors" in top:
        want.append("model.safetensors")
    else:
        want += [f for f in top if f.endswith(".safetensors")]
    return want


def _download(repo_id: str, quant: str | None, revision: str | None, cache: str) -> str:
    """Fetch what the name means from the hub into the cache; its local path."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    files = HfApi().list_repo_files(repo_id, revision=revision)
    top = [f for f in files if "/" not in f]
    if not quant and "config.json" in top and any(f.endswith(".safetensors") for f in top):
        return snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                 allow_patterns=_hf_download_list(repo_id, files, revision,
                                                                  cache))
    if not quant and not gguf_files(files):
        raise ValueError(f"{repo_id}: neither config.json with *.safetensors nor GGUF files in "
                         f"the repo, nothing servelm loads")
    name = choose_gguf(repo_id, files, quant)
    paths = [hf_hub_download(repo_id, part, revision=revision, cache_dir=cache)
             for part in _split_parts(name, files)]
    return paths[0]


def _hub_error(repo_id: str, revision: str | None, cache: str, e: Exception) -> ValueError:
    from huggingface_hub.utils import (GatedRepoError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    if isinstance(e, GatedRepoError):
        return ValueError(f"{repo_id}: a gated repo; accept its terms on huggingface.co and "
                          f"log in (`hf auth login` or HF_TOKEN)")
    if isinstance(e, RepositoryNotFoundError):
        return ValueError(f"{repo_id}: no such model repo on the Hugging Face hub (a private "
                          f"one needs `hf auth login` or HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return ValueError(f"{repo_id}: no revision {revision!r} on the Hugging Face hub")
    first = (str(e).strip().splitlines() or [""])[0]
    return ValueError(f"{repo_id}: not in the Hugging Face cache ({repo_folder(cache, repo_id)}) "
                      f"and the download failed ({type(e).__name__}: {first}); with no network, "
                      f"get it elsewhere with `hf download {repo_id}` into that cache")


def resolve_model(spec: str | None, revision: str | None = None,
                  download_dir: str | None = None) -> str | None:
    """A user's model argument -> a local path (GGUF file or HF directory) the loader opens.

    None -> None (the embedded model). An existing path -> itself. 'ORG/NAME' -> the snapshot
    directory of that Hugging Face repo at `revision` (branch, tag or commit; default main),
    or, in a repo of GGUF files, its Q4_K_M file (a repo of one GGUF model: that file).
    'ORG/NAME:QUANT' -> the GGUF file in that repo whose name carries the quant tag. The cache
    (download_dir, else HF_HUB_CACHE / HF_HOME / ~/.cache/huggingface/hub) is read first;
    what is absent is downloaded with huggingface_hub (only the files servelm loads) unless
    HF_HUB_OFFLINE is set. Any failure: ValueError, one line that says what to do."""
    if spec is None:
        return None
    if os.path.exists(spec):
        return spec
    if os.path.exists(os.path.expanduser(spec)):
        return os.path.expanduser(spec)
    if spec.startswith(("/", ".", "~")) or spec.lower().endswith(".gguf"):
        return spec  # a path, not a name: the loader says it does not exist
    repo_id, quant = parse_name(spec)
    cache = hub_cache_dir(download_dir)
    at = f" at revision {revision!r}" if revision else ""
    snap = cached_snapshot(cache, repo_id, revision)
    why = f"not in the Hugging Face cache{at} ({repo_folder(cache, repo_id)})"
    if snap is not None:
        path, reason = _from_snapshot(repo_id, snap, quant)
        if path is not None:
            return path
        why = f"{reason} (cache: {snap})"
    if hub_offline():
        get = f"hf download {repo_id}" + (f" --include '*{quant}*'" if quant else "")
        raise ValueError(f"{repo_id}: {why}, and HF_HUB_OFFLINE is set: get it with `{get}` "
                         f"or unset HF_HUB_OFFLINE")
    try:
        return _download(repo_id, quant, revision, cache)
    except ValueError as e:
        if type(e) is ValueError:  # ours, already one line (the hub's errors subclass it)
            raise
        raise _hub_error(repo_id, revision, cache, e) from None
    except Exception as e:  # network, HTTP, authentication: the hub's many error types
        raise _hub_error(repo_id, revision, cache, e) from None
