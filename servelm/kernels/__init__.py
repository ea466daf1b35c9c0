"""Optional C++ CPU kernels, one extension per source file in csrc/, built with
torch.utils.cpp_extension for the machine they run on (-march=native).

`make install` builds them ahead of time (`python -m servelm.kernels`); at run time
`load_ops(name)` loads the built library (rebuilding it if its source changed) and
registers its `torch.ops.servelm_<name>.*` operators. Every caller keeps a pure-PyTorch
path and uses it when `load_ops` returns False (no compiler, a failed build, or
SERVELM_NO_KERNELS=1: a build concern, nothing is compiled, as on a GPU machine) or when
KernelConfig.cpu_kernels is off (the run-time choice: the eager reference).

What the kernels take from the process is settled once (`prepare`: SERVELM_NO_KERNELS read,
ninja's directory on PATH), by the process's start-up (servelm.runtime.init_process), else
by the first `load_ops`; a loaded name's answer is cached, so a call on a step's path is
one dictionary lookup and never reads the environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
_loaded: dict[str, bool] = {}
_lock = threading.Lock()
_disabled: bool | None = None  # SERVELM_NO_KERNELS, once prepare() has read it


def prepare() -> bool:
    """Once per process (later calls return the first answer): read SERVELM_NO_KERNELS and
    put the interpreter's directory on PATH, where torch.utils.cpp_extension looks for
    ninja (the pip package installs it beside the interpreter). Returns whether the kernels
    are turned off."""
    global _disabled
    if _disabled is None:
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        _disabled = os.environ.get("SERVELM_NO_KERNELS", "") not in ("", "0")
    return _disabled


def build_dir() -> Path:
    """Where built libraries live: SERVELM_KERNEL_DIR, else inside the active environment
    (.venv), so they go with the torch they were built against."""
    base = os.environ.get("SERVELM_KERNEL_DIR")
    return Path(base) if base else Path(sys.prefix) / "servelm-kernels"


def available_sources() -> list[str]:
    return sorted(p.stem for p in CSRC.glob("*.cpp"))


def load_ops(name: str, verbose: bool = False) -> bool:
    """Build (if needed) and load csrc/<name>.cpp; True when its ops are registered."""
    ok = _loaded.get(name)
    if ok is None:
        with _lock:
            if name not in _loaded:
                _loaded[name] = not prepare() and _build(name, verbose)
            ok = _loaded[name]
    return ok


def _build(name: str, verbose: bool) -> bool:
    src = CSRC / f"{name}.cpp"
    if not src.exists():
        logger.warning("no kernel source %s", src)
        return False
    try:
        from torch.utils import cpp_extension

        # ninja: found on PATH (prepare() put the interpreter's directory there).
        out = build_dir() / name
        out.mkdir(parents=True, exist_ok=True)
        with _build_lock(out):
            cpp_extension.load(
                name=f"servelm_{name}", sources=[str(src)], build_directory=str(out),
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math",
                              _headers_flag()],
                extra_ldflags=["-fopenmp"], is_python_module=False, verbose=verbose)
        return True
    except Exception as e:  # no compiler, a build error: fall back to PyTorch, say why once
        logger.warning("servelm C++ kernels %r unavailable, using PyTorch ops: %s", name, e)
        return False


@contextlib.contextmanager
def _build_lock(out: Path):
    """One process at a time builds or loads an extension's directory, holding an flock the
    kernel releases when its holder dies. cpp_extension's own `lock` file is not released by a
    process killed mid-build, and every later start would wait on it forever: holding the
    flock, a `lock` file left there is such a dead build's, and is removed."""
    import fcntl

    with open(out / "servelm.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = out / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a kernel build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def _headers_flag() -> str:
    """A define carrying the shared headers' hash: cpp_extension rebuilds an extension when
    its source or flags change, and this way a header change counts too."""
    import hashlib

    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*.h")):
        h.update(p.name.encode() + p.read_bytes())
    return f"-DSERVELM_HEADERS_HASH={h.hexdigest()[:16]}"


def main() -> int:
    """Build every kernel now (make install runs this), so no request waits for a compiler."""
    logging.basicConfig(level=logging.INFO)
    ok = True
    for name in available_sources():
        built = load_ops(name, verbose=False)
        print(f"servelm kernel {name}: {'built' if built else 'UNAVAILABLE (PyTorch fallback)'}")
        ok &= built
    return 0 if ok else 1

