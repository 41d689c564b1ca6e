"""Preallocated KV cache for many sequences, written by position, plus a slot allocator.

Layout per layer: k, v = [slots + 1, kv_heads, max_seq, head_dim]; the extra last slot is scratch for the
padding of ragged batches. A sequence's cache is valid for positions 0..len-1 of its slot; anything
written beyond (a rejected draft) is overwritten before it can be attended, because a query at position p
only attends to 0..p and every position <= p is written in the same or an earlier forward. Rolling back
after a rejection is therefore only a change of the sequence's length counter (`Sequence.target_len` /
`draft_len`, engines/embedded/sequence.py).
"""

from __future__ import annotations

import threading

import torch

from specbuild.engines.embedded.errors import EngineLimitError


class KVCache:
    def __init__(self, *, num_layers: int, num_slots: int, kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device, decode_step: str = "auto"):
        shape = (num_slots + 1, kv_heads, max_seq, head_dim)
        self.decode_step = decode_step          # fused.py: "auto" | "fused" | "eager" for forwards over this cache
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_seq = num_slots, max_seq
        self.scratch_slot = num_slots

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class SlotAllocator:
    """Hands out cache slots 0..n-1; lowest free first so a batch of one keeps using slot 0 (a view, no gather).

    A freed slot is *released*, not yet reusable: the step that was running when its request ended may still
    write it (the request was in that step's draft or verify batch; aborts come from other threads). `reclaim()`
    makes released slots allocatable and is called by the stepping thread at the start of a step, before any
    admission, so a slot is never handed to a new request while a write of its old one can still land (the
    soak's wrong answer, tests/test_slot_reuse.py)."""

    def __init__(self, n: int):
        self._free = list(range(n))
        self._released: list[int] = []
        self._lock = threading.Lock()

    def alloc(self) -> int:
        with self._lock:
            if not self._free:
                raise EngineLimitError("no free KV-cache slot; wait for a running request to finish or raise "
                                       "max_batch_size.")
            self._free.sort()
            return self._free.pop(0)

    def free(self, slot: int) -> None:
        with self._lock:
            if slot in self._free or slot in self._released:
                raise RuntimeError(f"slot {slot} freed twice")
            self._released.append(slot)

    def reclaim(self) -> None:
        """Step boundary (stepping thread only): released slots become allocatable."""
        with self._lock:
            self._free.extend(self._released)
            self._released.clear()

    @property
    def num_free(self) -> int:
        """Slots no request holds (released ones included): what an operator sees as free."""
        return len(self._free) + len(self._released)

    @property
    def num_available(self) -> int:
        """Slots `alloc` can hand out in this step."""
        return len(self._free)
