"""Errors of the embedded engine (part of the SpecbuildError hierarchy, so the CLI maps them)."""

from __future__ import annotations

from specbuild.pipeline.errors import SpecbuildError


class EngineLimitError(SpecbuildError):
    """A request is beyond the engine's limits (empty prompt, prompt + max_tokens > max_seq_len,
    num_draft_tokens > max_draft_len, ...) or uses an option the engine was not built for."""

    exit_code = 2


class EngineError(SpecbuildError):
    """A request failed inside the engine (the model forward raised); the message carries the cause."""
