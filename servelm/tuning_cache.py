"""The measured linear-method table of one machine, cached in the user's cache directory.

The key is what a timing depends on besides the layer (machine_key): the CPU model and its
vector flags, the thread count, torch's version and the kernel sources; one JSON file per
key, entries by layer shape (servelm.tuning's shape keys), written atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CACHE_VERSION = 3


def machine_key(threads: int) -> dict:
    """What a timing depends on besides the layer: CPU, threads, torch, kernel sources."""
    from servelm.kernels import CSRC

    # "model name" alone can be as vague as "AMD EPYC" under a hypervisor (a Zen 1 and a Zen 3
    # read the same): the family / model / stepping numbers tell them apart.
    model, ids, flags = "?", {}, []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key == "model name" and model == "?":
                    model = line.split(":", 1)[1].strip()
                elif key in ("cpu family", "model", "stepping") and key not in ids:
                    ids[key] = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = [fl for fl in line.split(":", 1)[1].split()
                             if fl.startswith(("amx", "avx512", "avx2", "fma"))]
    except OSError:
        pass
    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*")):
        h.update(p.name.encode() + p.read_bytes())
    if ids:
        model += " (" + "/".join(ids.get(k, "?") for k in ("cpu family", "model", "stepping")) + ")"
    return {"cpu": model, "flags": sorted(flags), "threads": threads,
            "torch": torch.__version__, "kernels": h.hexdigest()[:16], "version": CACHE_VERSION}


def cache_dir(configured: str | None) -> Path:
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "servelm"


class TuningCache:
    """The measured shapes of one machine key, in one JSON file."""

    def __init__(self, directory: Path, key: dict):
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = directory / f"linear-methods-{digest}.json"
        self.key = key
        self.entries: dict[str, dict] = {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("key") == key:
                self.entries = data.get("shapes", {})
        except (OSError, ValueError):
            pass

    def get(self, shape: str) -> dict | None:
        return self.entries.get(shape)

    def put(self, shape: str, times_us: dict[str, list[float]], failed: list[str],
            invariant: list[str], candidates: list[str]) -> None:
        self.entries[shape] = {"times_us": {m: [t if math.isfinite(t) else None for t in ts]
                                            for m, ts in times_us.items()},
                               "failed": failed, "invariant": invariant,
                               "candidates": candidates}

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": self.key, "shapes": self.entries}, indent=1))
            tmp.replace(self.path)
        except OSError as e:  # a read-only home: tune again next time
            logger.warning("kernel tuning cache not written (%s): %s", self.path, e)


def times_from(entry: dict) -> dict[str, list[float]]:
    return {m: [math.inf if t is None else float(t) for t in ts]
            for m, ts in entry["times_us"].items()}
