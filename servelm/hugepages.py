"""CPU memory in 2 MB transparent huge pages, for tensors streamed every step.

A decode step reads every weight once: ~76 MB for the embedded model in int4, spread over
~19,000 4 KB pages, so nearly every page costs a TLB miss and a page walk, and the hardware
prefetchers stop at each page boundary. Linux backs a region with 2 MB pages when asked
(madvise(MADV_HUGEPAGE); /sys/kernel/mm/transparent_hugepage/enabled set to "madvise" or
"always"), which PyTorch's allocator does not do for these tensors. `pack(tensors)` copies
tensors into one such region, in the order given (the order a step reads them), and
returns views of it. Where the kernel or platform does not allow it, the region is plain
memory and everything works as before; `huge=False` asks for plain pages (KernelConfig's
hugepages field, for side-by-side runs).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each packed tensor starts on a cache line


def empty(nbytes: int, huge: bool = True) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes`, 2 MB aligned, in huge pages when the
    kernel allows (untouched anonymous memory asked for huge pages before its first fault)."""
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    # Private anonymous memory (shared anonymous memory is shmem, whose huge pages are a
    # separate setting), page aligned and untouched.
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, size + HUGE_PAGE)
    buf = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -buf.data_ptr() % HUGE_PAGE
    # Plain pages are asked for too: with THP "always" the kernel would otherwise back the
    # region with huge pages anyway.
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None and sys.platform.startswith("linux"):
        try:
            region.madvise(advice, start, size)
        except OSError:  # THP compiled out or disabled: plain pages
            pass
    return buf[start:start + nbytes]


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def populate(ptr: int, nbytes: int) -> bool:
    """Fault in the pages of [ptr, ptr + nbytes) of private anonymous memory, writable,
    without changing what they hold (madvise MADV_POPULATE_WRITE): the cost of the first
    touch paid now instead of inside a later step. False where the kernel (Linux < 5.14) or
    platform cannot, and nothing was done."""
    if _LIBC is None or nbytes <= 0:
        return False
    start = ptr - ptr % _PAGE
    end = -(-(ptr + nbytes) // _PAGE) * _PAGE
    return _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                         _MADV_POPULATE_WRITE) == 0


def pack(tensors: list[torch.Tensor], huge: bool = True) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, any dtype) laid out one after another in one huge-page
    region; each copy has its tensor's dtype, shape and values, contiguous."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    arena = empty(total, huge)
    out = []
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        view = arena[off:off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


def pack_weights(model: torch.nn.Module, huge: bool = True) -> int:
    """Move every CPU layer's repacked tensors (a module's `packed_tensors`: the quantised
    layers, qdot's and panels' layouts) into one region of 2 MB huge pages (plain pages if
    not `huge`), in module order (the order a step reads them): the weight stream then
    crosses ~40 pages a step instead of ~19,000 (servelm.hugepages). Returns the bytes
    packed."""
    fields = [(m, name) for m in model.modules() if getattr(m, "packed_tensors", None)
              and getattr(m, m.packed_tensors[0]).device.type == "cpu"
              for name in m.packed_tensors if getattr(m, name, None) is not None]
    views = pack([getattr(m, name) for m, name in fields], huge=huge)
    for (m, name), v in zip(fields, views):
        setattr(m, name, v)
    return sum(v.numel() * v.element_size() for v in views)
