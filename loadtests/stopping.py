"""When a Locust run ends: measured enough, too slow to measure, or the server is gone.

A run measures until BOTH `min_duration_s` have passed and `min_requests` requests have completed
(so a slow machine still yields a measurement, only a longer one), or until the hard ceiling
`max_duration_s` (then the setting is "too slow to measure here" and the report says what it saw), or
until `max_connection_errors` consecutive connection errors (the server is gone: the run stops at once,
Locust exits with SERVER_GONE_EXIT_CODE). The monitor runs on the master (or the only) Locust process,
reads the aggregated stats, and writes why it ended to `<run dir>/stop.json` before quitting the runner.
Workers tell the master about a dead server with a custom message.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import gevent

from specbuild.loadtests.runspec import STOP_FILE, RunSpec

SERVER_GONE_MESSAGE = "specbuild_server_gone"
COMPLETE, TOO_SLOW, SERVER_GONE = "complete", "too slow to measure here", "server gone"


def is_connection_error(exc: BaseException) -> bool:
    """Refused / reset / closed connections (HTTP) and UNAVAILABLE (gRPC): the server is not there."""
    from geventhttpclient.response import HTTPConnectionClosed

    if isinstance(exc, (ConnectionError, HTTPConnectionClosed)):
        return True
    from specbuild.core.wire import is_connection_error_text

    return is_connection_error_text(str(exc))


class RunMonitor:
    """Ends the run (master or local runner); `server_gone()` may be called by users or a worker message."""

    def __init__(self, environment, spec: RunSpec, clock=time.monotonic, interval: float = 0.5):
        self.environment = environment
        self.spec = spec
        self.clock = clock
        self.interval = interval
        self.started: float | None = None
        self.reason: str | None = None
        self.gone: str | None = None

    def elapsed(self) -> float:
        return 0.0 if self.started is None else self.clock() - self.started

    def completed(self) -> int:
        entry = self.environment.stats.entries.get((self.spec.label, "E2E"))
        return entry.num_requests - entry.num_failures if entry else 0   # num_requests counts failures too

    def start(self) -> None:
        self.started = self.clock()
        gevent.spawn(self._loop)

    def server_gone(self, message: str) -> None:
        if self.gone is None:
            self.gone = message
            gevent.spawn(self.end, SERVER_GONE)

    def verdict(self) -> str | None:
        """The reason to end now, or None to keep measuring."""
        elapsed = self.elapsed()
        if self.gone is not None:
            return SERVER_GONE
        if elapsed >= self.spec.min_duration_s and self.completed() >= self.spec.min_requests:
            return COMPLETE
        if elapsed >= self.spec.max_duration_s:
            return TOO_SLOW
        return None

    def _loop(self) -> None:
        while self.reason is None:
            gevent.sleep(self.interval)
            reason = self.verdict()
            if reason is not None:
                self.end(reason)

    def end(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        record: dict[str, Any] = {"reason": reason, "elapsed_s": round(self.elapsed(), 3),
                                  "completed": self.completed(), "min_duration_s": self.spec.min_duration_s,
                                  "min_requests": self.spec.min_requests, "max_duration_s": self.spec.max_duration_s,
                                  "server_gone": self.gone}
        run_dir = Path(self.spec.run_dir or Path(self.spec.samples_dir).parent)
        (run_dir / STOP_FILE).write_text(json.dumps(record) + "\n")
        self.environment.runner.quit()


def report_server_gone(environment, message: str) -> None:
    """From a user: on a worker, tell the master; on the master / local runner, end the run."""
    from locust.runners import WorkerRunner

    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        runner.send_message(SERVER_GONE_MESSAGE, {"message": message})
        return
    monitor = getattr(environment, "specbuild_monitor", None)
    if monitor is not None:
        monitor.server_gone(message)
