"""A model's weights in 2 MB pages (Linux transparent huge pages), for decoding on a CPU.

Decoding reads every weight once per token. Read through 4 KB pages, a 1 GB head costs a
quarter of a million TLB entries per token; through 2 MB pages, 512. Measured here (Intel
Xeon, one thread, a 2048 x 128256 fp32 head): 69-70 ms per product at batch 1 and 206 ms at
batch 16 from memory in huge pages, against 70-73 and 216-238 ms from a mapped file (the
page cache: partly huge pages, at the kernel's choice) and 76-84 and 247 ms from an
ordinary copy (docs/performance.md, "Against transformers' generate").

Design choices:

* Opt-in where a model is loaded once and decodes little (``anyorder.load(...,
  huge_pages=True)``, ``anyorder sample --huge-pages``), on by default where it decodes for
  long (``anyorder serve``; ``--no-huge-pages``): the copy costs seconds per GB here (the
  kernel zeroes each 2 MB page as it faults in, and reclaims page cache to find them).
* Each CPU parameter of at least 2 MB gets its own anonymous mapping, aligned to 2 MB and
  advised ``MADV_HUGEPAGE`` before its first write, so the kernel backs it with huge pages
  as the copy faults it in (``transparent_hugepage`` set to ``madvise`` or ``always``). A
  ``Parameter`` keeps its identity (its ``data`` changes), so tied weights stay tied.
* Where the kernel offers none (``never``, or no ``MADV_HUGEPAGE``: macOS, Windows),
  nothing moves, and :func:`place_in_huge_pages` says so by returning 0.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
"""Bytes of an x86-64 / arm64 (4 KB base) transparent huge page."""
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel backs a region advised ``MADV_HUGEPAGE`` with huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in its own mapping advised for huge pages (the
    mapping lives as long as the tensor's storage)."""
    nbytes = t.numel() * t.element_size()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first write faults a page in
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -address % HUGE_PAGE
    out = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    out = out.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def place_in_huge_pages(model: nn.Module) -> int:
    """Move ``model``'s CPU parameters of at least :data:`HUGE_PAGE` bytes into memory
    advised for huge pages, values unchanged.

    Returns:
        The bytes moved (0 where the kernel offers no huge pages; the ones before the
        first that could not be mapped, if the system refuses a mapping).
    """
    if not available():
        return 0
    moved = 0
    with torch.no_grad():
        for param in model.parameters():  # a tied weight once
            nbytes = param.numel() * param.element_size()
            if param.device.type == "cpu" and nbytes >= HUGE_PAGE:
                try:
                    param.data = huge_copy(param.data)
                except OSError:  # no address space or memory for another copy: stay put
                    break
                moved += nbytes
    return moved
