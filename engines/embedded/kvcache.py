"""Preallocated KV cache for many sequences, written by position, plus a slot allocator.

Layout per layer: k, v = [slots + 1, kv_heads, max_seq, head_dim]; the extra last slot is scratch for the
padding of ragged batches. A sequence's cache is valid for positions 0..len-1 of its slot; anything
written beyond (a rejected draft) is overwritten before it can be attended, because a query at position p
only attends to 0..p and every position <= p is written in the same or an earlier forward. Rolling back
after a rejection is therefore only a change of the sequence's length counter (see `SeqState`).
"""

from __future__ import annotations

import threading

import torch

from specbuild.engines.embedded.errors import EngineLimitError


class KVCache:
    def __init__(self, *, num_layers: int, num_slots: int, kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_slots + 1, kv_heads, max_seq, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_seq = num_slots, max_seq
        self.scratch_slot = num_slots

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class SlotAllocator:
    """Hands out cache slots 0..n-1; lowest free first so a batch of one keeps using slot 0 (a view, no gather)."""

    def __init__(self, n: int):
        self._free = list(range(n))
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
            if slot in self._free:
                raise RuntimeError(f"slot {slot} freed twice")
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)
