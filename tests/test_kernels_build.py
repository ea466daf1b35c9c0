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
