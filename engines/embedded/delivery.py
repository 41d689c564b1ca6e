"""Delivery: the engine's deltas reach each request's callback in order, once, and never after its final one.

`Outbox.put` runs under the engine lock; `Outbox.deliver` calls the callbacks
outside it, one at a time, in order, so a callback may call `submit`/`abort`. A callback that raises aborts its
own request (through `on_broken`), nothing else.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

from specbuild.engines.embedded.sequence import Sequence, StreamDelta

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, lock: threading.RLock, on_broken: Callable[[str], object]):
        self._lock = lock                       # the engine lock (held by emit's callers)
        self._queue: deque[tuple[Sequence, StreamDelta]] = deque()
        self._deliver_lock = threading.RLock()
        self._on_broken = on_broken

    def put(self, s: Sequence, delta: StreamDelta) -> None:
        """Queue a delta (engine lock held)."""
        self._queue.append((s, delta))

    def deliver(self) -> None:
        with self._deliver_lock:
            while True:
                with self._lock:
                    if not self._queue:
                        return
                    s, delta = self._queue.popleft()
                if s.final_sent:
                    continue
                s.final_sent = delta.finished
                try:
                    s.on_output(delta)
                except Exception:  # noqa: BLE001 - a broken consumer must not take the engine down
                    log.exception("on_output callback of %s raised; aborting the request", s.request_id)
                    self._on_broken(s.request_id)
