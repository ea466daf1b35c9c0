"""Every C++ kernel source builds on the machine at hand wherever a compiler is present.

A kernel that fails to compile is not an error at run time (callers fall back to PyTorch),
so without this test a source that builds on one ISA and not on another (an AVX2-only
helper named from code every ISA compiles) passes the whole suite on PyTorch paths."""

from __future__ import annotations

import os
import shutil

import pytest

from servelm.kernels import available_sources, load_ops


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler: the PyTorch fallbacks are the only path here")
@pytest.mark.skipif(os.environ.get("SERVELM_NO_KERNELS", "") not in ("", "0"),
                    reason="SERVELM_NO_KERNELS set: the kernels are not built on purpose")
@pytest.mark.parametrize("name", available_sources())
def test_kernel_builds(name):
    assert load_ops(name), f"servelm kernel {name!r} did not build (the log above says why)"


def test_a_dead_builds_lock_is_removed_and_builds_take_turns(tmp_path, monkeypatch):
    """cpp_extension's `lock` file, left by a build killed midway, would make every later
    build wait forever: under servelm's flock (freed when its holder dies) it is removed
    first; and while one process holds the flock, another waits for it."""
    import fcntl
    import threading

    import servelm.kernels as K
    from torch.utils import cpp_extension

    calls = []

    def fake_load(name, sources, build_directory, **kw):
        calls.append((name, os.path.exists(os.path.join(build_directory, "lock"))))

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("SERVELM_KERNEL_DIR", str(tmp_path))
    name = available_sources()[0]
    (tmp_path / name).mkdir()
    (tmp_path / name / "lock").write_text("")  # a dead build's
    assert K._build(name, verbose=False)
    assert calls == [(f"servelm_{name}", False)]

    with open(tmp_path / name / "servelm.flock", "w") as held:  # another process building
        fcntl.flock(held, fcntl.LOCK_EX)
        t = threading.Thread(target=K._build, args=(name, False))
        t.start()
        t.join(0.5)
        assert t.is_alive() and len(calls) == 1  # waiting its turn
        fcntl.flock(held, fcntl.LOCK_UN)
    t.join(10)
    assert len(calls) == 2
