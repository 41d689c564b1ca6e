"""Errors of the embedded engine (part of the SpecbuildError hierarchy, so the CLI maps them).

`kind` is what a server reports: "invalid" (the client's request; HTTP 400), "unavailable" (overload:
the waiting queue is full or the request waited too long; HTTP 503 / Triton UNAVAILABLE, retry later),
"internal" (the engine failed on this request; the server keeps serving the others).
"""

from __future__ import annotations

from specbuild.core.errors import SpecbuildError


class EngineLimitError(SpecbuildError):
    """A request is beyond the engine's limits (empty prompt, prompt + max_tokens > max_seq_len,
    num_draft_tokens > max_draft_len, ...) or uses an option the engine was not built for."""

    exit_code = 2
    kind = "invalid"


class EngineUnavailableError(SpecbuildError):
    """The engine refuses a request for now: its waiting queue is full or the request waited past the
    queue-time limit. Retry later (HTTP 503)."""

    kind = "unavailable"


class EngineError(SpecbuildError):
    """A request failed inside the engine (the model forward raised); the message carries the cause."""

    kind = "internal"


class SamplingError(EngineError):
    """Sampling one sequence failed (a non-finite distribution); only that sequence is stopped."""
