"""The weights a decode step streams, moved onto transparent huge pages (2 MB) where Linux offers them.

A decode step reads every weight once, front to back: the target's fp32 panels (455 MB for SmolLM2-135M), the
draft's int8-activation blocks (66 MB) and both heads' screens. On 4 KB pages that is a TLB miss every 4 KB, about
110 000 page walks a target step; on 2 MB pages, about 230. Measured on the 2-core AMD EPYC Zen 4 (one process, the
same runner on the same weights before and after the move, 10 alternating rounds of 9, read bandwidth 53-60 GB/s at
the time): the target's layers at 1 row 9.82 -> 8.64 ms (1.14x), at 9 rows 16.67 -> 15.62 ms (1.07x), the int4
draft's layers 2.84 -> 2.67 ms (1.06x); bitwise the same outputs (bench/README.md, "2026-12-07 evening").

glibc's malloc gives huge pages only under `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, set before the process starts,
and Linux's default THP mode ("madvise") only to memory that asked for them. So `place_weights_` copies the tensors
into one anonymous mapping per model, aligned to 2 MB and marked `MADV_HUGEPAGE` before it is touched, and rebinds
the modules to views of it (the old tensors are freed). Where THP is off ("never"), the platform has no
`MADV_HUGEPAGE`, the weights are not on the CPU, or `SPECBUILD_HUGE_PAGES=0`, nothing moves and the engine runs as
before. It runs when an engine is made (engine.py), before its fused runners take the tensors.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE = 2 << 20                  # bytes of a huge page (x86-64, arm64 with 4 KB base pages)
ALIGN = 4096                    # each tensor starts on its own 4 KB boundary inside the mapping
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> str | None:
    """None where weights can go on huge pages here, else why not."""
    if os.environ.get("SPECBUILD_HUGE_PAGES", "").strip() == "0":
        return "SPECBUILD_HUGE_PAGES=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this platform has no MADV_HUGEPAGE"
    try:
        mode = THP_ENABLED.read_text()
    except OSError:
        return f"no {THP_ENABLED}"
    if "[never]" in mode:
        return "transparent huge pages are off ([never])"
    return None


def streamed_tensors(model: nn.Module) -> list[tuple[object, str, int | None]]:
    """(owner, attribute, index) of every tensor a decode step streams: the tiled kernel's panels, the block
    kernels' blocks as they are read, and the lm_head's screen (made here, as the scorer or proposer would make it:
    no other layer's, which nothing reads)."""
    from specbuild.engines.embedded.kernels import TiledLinear
    from specbuild.engines.embedded.quant import BlockLinear

    out: list[tuple[object, str, int | None]] = []
    for mod in model.modules():
        if isinstance(mod, TiledLinear):
            out.append((mod, "panels", None))
        elif isinstance(mod, BlockLinear):
            if mod.activations == "int8":
                mod.kernel_blocks()                         # the interleaved copy, made once
                out += [(mod, "_interleaved", i) for i, t in enumerate(mod._interleaved) if t is not None]
            else:
                out += [(mod, name, None) for name in ("qs", "d", "m") if getattr(mod, name) is not None]
        else:
            continue
        if mod is model.lm_head:
            mod.prepare_screen()
        if isinstance(mod._screen, tuple):
            out += [(mod, "_screen", i) for i, t in enumerate(mod._screen) if t is not None]
    return out


def _get(owner, attr: str, index: int | None) -> torch.Tensor:
    value = getattr(owner, attr)
    return value if index is None else value[index]


def _set(owner, attr: str, index: int | None, tensor: torch.Tensor) -> None:
    if index is None:
        setattr(owner, attr, tensor)                      # a registered buffer stays one (nn.Module.__setattr__)
    else:
        items = list(getattr(owner, attr))
        items[index] = tensor
        setattr(owner, attr, tuple(items))


def place_weights_(model: nn.Module) -> int:
    """Move the tensors `streamed_tensors` names onto one huge-page mapping (values unchanged) -> bytes moved (0:
    nothing moved, see `available`). The mapping lives as long as the model (`model._huge_pages`)."""
    why = available()
    slots = streamed_tensors(model) if why is None else []
    tensors = [_get(*s) for s in slots]
    if why is None and any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        why = "the weights are not contiguous CPU tensors"
    if why is not None or not tensors:
        if why is not None:
            log.debug("weights stay on base pages: %s", why)
        return 0
    sizes = [(t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for t in tensors]
    total = sum(sizes)
    span = (total + HUGE - 1) // HUGE * HUGE                # whole huge pages from the aligned start ...
    try:
        arena = mmap.mmap(-1, span + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # ... wherever it lands
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as e:
        log.info("weights stay on base pages: %s", e)
        return 0
    base = torch.frombuffer(arena, dtype=torch.uint8)
    offset = (-base.data_ptr()) % HUGE                   # the first tensor on a huge-page boundary
    for slot, t, size in zip(slots, tensors, sizes):
        n = t.numel() * t.element_size()
        view = base[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        _set(*slot, view)
        offset += size
    model._huge_pages = arena                            # (torch.frombuffer keeps it too)
    return total
