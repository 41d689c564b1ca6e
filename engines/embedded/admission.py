"""Admission: who waits for a KV-cache slot, for how long, how long a request may live, and which prompt tokens
the next prefill feeds (chunked prefill).

- `add` refuses (EngineUnavailableError, HTTP 503) when `max_waiting` requests already wait (serving submissions);
- a request still waiting for a slot after `queue_timeout_s` is finished with an "unavailable" error;
- a request alive (waiting or running) longer than `request_timeout_s` is finished with a "timeout" error: the
  bound on slots held by clients that vanished without the server hearing of it (Triton's HTTP frontend does not
  report a dropped non-streaming `/generate`, server#7077);
- `plan_prefill` hands out free slots in FIFO order and picks the prompt chunk each admitted sequence feeds in
  this step: with sequences running, at most `prefill_token_budget` prompt tokens in all, so a long prompt never
  stalls them for more than one chunk; with none running, whole prompts. A sequence holding a slot stays at the
  head of `waiting` until its whole prompt is cached (`target_len` counts its cached positions).

Bookkeeping only: the scheduler runs the forwards and holds the engine lock around every call here.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from specbuild.engines.embedded.errors import EngineUnavailableError
from specbuild.engines.embedded.kvcache import SlotAllocator
from specbuild.engines.embedded.sequence import Sequence

UNAVAILABLE, TIMEOUT = "unavailable", "timeout"


class Admission:
    prefill_token_budget: int = 256     # prompt tokens fed per step while other sequences run (chunk size)

    def __init__(self, slots: SlotAllocator, *, clock: Callable[[], float], max_waiting: int | None,
                 queue_timeout_s: float | None, request_timeout_s: float | None):
        self.slots, self.clock = slots, clock
        self.waiting: deque[Sequence] = deque()
        self.set_limits(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s,
                        request_timeout_s=request_timeout_s)
        self.rejected_total = 0          # refused at submit: the waiting queue was full
        self.expired_total = 0           # finished after queue_timeout_s without a slot
        self.timed_out_total = 0         # finished at request_timeout_s

    def set_limits(self, *, max_waiting: int | None, queue_timeout_s: float | None,
                   request_timeout_s: float | None) -> None:
        self.max_waiting = max_waiting                 # None = unbounded waiting queue
        self.queue_timeout_s = queue_timeout_s         # None = a request may wait for a slot forever
        self.request_timeout_s = request_timeout_s     # None = a request may live forever

    def add(self, seq: Sequence, *, bounded: bool) -> None:
        if bounded and self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            self.rejected_total += 1
            raise EngineUnavailableError(
                f"the server is busy: {len(self.waiting)} requests already wait for a batch slot "
                f"(max_queue_size={self.max_waiting}); retry later.")
        seq.enqueued_at = self.clock()
        self.waiting.append(seq)

    def discard(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)

    def overdue(self, running: list[Sequence]) -> list[tuple[Sequence, str, str]]:
        """Sequences to finish now -> [(sequence, message, kind)], removed from `waiting`."""
        now, out = self.clock(), []
        if self.request_timeout_s is not None:
            for s in list(self.waiting) + running:
                if not s.finished and now - s.enqueued_at > self.request_timeout_s:
                    out.append((s, f"the request ran for {now - s.enqueued_at:.1f} s, past request_timeout_s="
                                   f"{self.request_timeout_s:g} (the bound on requests whose client is gone); "
                                   "lower max_tokens, or raise request_timeout_s in the deployment.", TIMEOUT))
                    self.timed_out_total += 1
        if self.queue_timeout_s is not None:
            # a sequence with a slot is admitted and part-prefilled (chunked prefill), not waiting for one
            late = {id(s) for s, _, _ in out}
            for s in self.waiting:
                if s.slot < 0 and id(s) not in late and now - s.enqueued_at > self.queue_timeout_s:
                    out.append((s, f"the server is busy: the request waited {now - s.enqueued_at:.1f} s for a "
                                   f"batch slot (queue_timeout_s={self.queue_timeout_s:g}); retry later.",
                                UNAVAILABLE))
                    self.expired_total += 1
        for s, _, _ in out:
            self.discard(s)
        return out

    def plan_prefill(self, live_running: int) -> tuple[list[Sequence], list[int]]:
        """Allocate slots to waiting requests and pick this step's prompt chunks -> (sequences, end positions)."""
        cands: list[Sequence] = []
        for seq in self.waiting:
            if seq.slot < 0:
                if not self.slots.num_available:
                    break
                seq.slot = self.slots.alloc()
            cands.append(seq)
        budget = self.prefill_token_budget if live_running else None
        chunk: list[Sequence] = []
        ends: list[int] = []
        for s in cands:
            take = len(s.tokens) - s.target_len
            if budget is not None:
                take = min(take, budget)
                budget -= take
            if take <= 0:
                break
            chunk.append(s)
            ends.append(s.target_len + take)
        return chunk, ends

    def pending(self) -> bool:
        """A request the next prefill would take (a free slot, or one already mid-prefill) is waiting: drafting
        stops early so its first token is not held back by a whole speculation round (lock-free read)."""
        waiting = self.waiting
        return bool(waiting) and (self.slots.num_available > 0 or any(s.slot >= 0 for s in list(waiting)))
