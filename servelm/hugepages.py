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

import mmap
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
    if huge and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, size)
        except OSError:  # THP compiled out or disabled: plain pages
            pass
    return buf[start:start + nbytes]


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
