"""What Ollama's /api/tags, /api/show and /api/ps say about the one model servelm serves:
its name (Ollama's name:tag form), file size and digest, details (format, family, parameter
size, quantization level) and model_info (the GGUF header's keys, as Ollama shows them); and
each LoRA adapter served on it, listed as a model whose parent_model is the base."""

from __future__ import annotations

import functools
import hashlib
import os
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Iterable

import torch

from servelm.server.errors import APIError

if TYPE_CHECKING:
    from servelm.engine.engine import LLMEngine

# Ollama's /api/ps says when a model will be unloaded; servelm's stays for the server's life.
NEVER = "9999-12-31T23:59:59Z"


def timestamp(t: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes created_at."""
    when = datetime.now(timezone.utc) if t is None else datetime.fromtimestamp(t, timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def tagged(served: str) -> str:
    """The served name in Ollama's name:tag form (':latest' when it has no tag)."""
    return served if ":" in served.rsplit("/", 1)[-1] else f"{served}:latest"


def check_model(served: str, name: str, adapters: Iterable[str] = ()) -> str | None:
    """None when `name` is the served model, the adapter's own name when it names one of
    `adapters` (LoRA adapters' names), each matched with its tag optional and in any case,
    as Ollama matches names; a 404 in Ollama's words when it names none of them."""
    def names(n: str) -> tuple[str, str]:
        return n.casefold(), tagged(n).casefold()

    key = name.casefold()
    if key in names(served):
        return None
    found = next((a for a in adapters if key in names(a)), None)
    if found is None:
        raise APIError(404, f"model '{name}' not found")
    return found


def _human(n: int) -> str:
    """A parameter count as Ollama writes it: '135M', '0.5B', '8.0B'."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:.0f}M"
    return f"{n / 1e3:.0f}K"


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def _disk(path: str) -> tuple[int, float]:
    """(bytes, modification time) of the file or of a directory's files."""
    if os.path.isdir(path):
        files = [e for e in os.scandir(path) if e.is_file()]
        return (sum(e.stat().st_size for e in files),
                max((e.stat().st_mtime for e in files), default=0.0))
    st = os.stat(path)
    return st.st_size, st.st_mtime


def quantization_level(llm: LLMEngine) -> str:
    """How the weights run: a GGUF's own type (Q4_K_M ...) when the engine runs the file's
    format, else the format it runs (INT4, INT8) or the dtype (F32, BF16, F16)."""
    from servelm.models.catalog import gguf_quant

    run = llm.config.quantization
    if run is None:
        return {torch.float32: "F32", torch.bfloat16: "BF16",
                torch.float16: "F16"}.get(llm.dtype, str(llm.dtype).removeprefix("torch."))
    if _is_gguf(llm.model_path) and llm.weight_format.startswith("GGUF"):
        return gguf_quant(llm.model_path) or run.upper()
    return run.upper()


@functools.lru_cache(maxsize=4)
def _gguf_info(path: str) -> dict[str, Any]:
    """The header's keys as Ollama's /api/show gives them: long arrays (the vocabulary,
    merges) empty, the name and chat template left out."""
    from servelm.models.gguf_file import GGUFReader

    meta = GGUFReader(path).metadata
    return {k: ([] if isinstance(v, (list, tuple)) and len(v) > 5 else v)
            for k, v in meta.items() if k not in ("general.name", "tokenizer.chat_template")}


class ServedModel:
    """The served model as Ollama's listing and show routes describe it (made, and its
    details read from the file's header, once: off the event loop)."""

    def __init__(self, llm: LLMEngine, served: str):
        self.llm = llm
        self.name = tagged(served)
        self.size, mtime = _disk(llm.model_path)
        self.modified_at = timestamp(mtime)
        # Ollama's digest names a manifest; this one names the file's path, size and time.
        key = f"{os.path.abspath(llm.model_path)}:{self.size}:{mtime}"
        self.digest = hashlib.sha256(key.encode()).hexdigest()

    @functools.cached_property
    def details(self) -> dict[str, Any]:
        cfg = self.llm.model_config
        return {"parent_model": "", "format": "gguf" if _is_gguf(self.llm.model_path)
                else "safetensors", "family": cfg.family, "families": [cfg.family],
                "parameter_size": _human(cfg.num_params),
                "quantization_level": quantization_level(self.llm)}

    def entry(self) -> dict[str, Any]:
        """One element of /api/tags' models."""
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at,
                "size": self.size, "digest": self.digest, "details": self.details}

    def adapter_entry(self, name: str, path: str) -> dict[str, Any]:
        """/api/tags' element of a LoRA adapter on this model (its files read: off the event
        loop), its parent_model the base's name."""
        size, mtime = _disk(path) if os.path.exists(path) else (0, 0.0)
        key = f"{os.path.abspath(path)}:{size}:{mtime}"
        tag = tagged(name)
        return {"name": tag, "model": tag, "modified_at": timestamp(mtime), "size": size,
                "digest": hashlib.sha256(key.encode()).hexdigest(),
                "details": {**self.details, "parent_model": self.name}}

    def running(self, entry: dict[str, Any] | None = None) -> dict[str, Any]:
        """One element of /api/ps' models: the served model's, or an adapter's (its
        /api/tags entry given): every registered adapter is in memory beside the base."""
        entry = entry or self.entry()
        gpu = self.llm.device.type == "cuda"
        return {**entry, "expires_at": NEVER, "size_vram": entry["size"] if gpu else 0,
                "context_length": self.llm.max_model_len}

    def model_info(self) -> dict[str, Any]:
        cfg = self.llm.model_config
        arch = cfg.family
        info = {"general.architecture": arch, "general.parameter_count": cfg.num_params,
                f"{arch}.context_length": cfg.max_position_embeddings,
                f"{arch}.embedding_length": cfg.hidden_size,
                f"{arch}.feed_forward_length": cfg.intermediate_size,
                f"{arch}.block_count": cfg.num_layers,
                f"{arch}.attention.head_count": cfg.num_heads,
                f"{arch}.attention.head_count_kv": cfg.num_kv_heads,
                f"{arch}.vocab_size": cfg.vocab_size}
        if _is_gguf(self.llm.model_path):
            info = {**info, **_gguf_info(self.llm.model_path)}
        return info

    def show(self) -> dict[str, Any]:
        """The body of /api/show."""
        tok = self.llm.tokenizer
        return {"modelfile": f"# servelm serves this model from its own files\n"
                             f"FROM {self.llm.model_path}\n",
                "parameters": f"num_ctx {self.llm.max_model_len}",
                "template": tok.chat_template or "", "license": "",
                "details": self.details, "model_info": self.model_info(),
                "capabilities": ["completion", "tools"],
                "modified_at": self.modified_at,
                "servelm": {"weight_format": self.llm.weight_format,
                            "max_model_len": self.llm.max_model_len}}
