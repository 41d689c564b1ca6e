"""One exception hierarchy. The CLI maps every `SpecbuildError` to a message and a non-zero exit."""

from __future__ import annotations


class SpecbuildError(Exception):
    """Base class. `str(e)` says what went wrong *and* what to do about it."""

    exit_code = 1


class UsageError(SpecbuildError):
    """Bad option values or combinations (exit 2, like Click's own usage errors)."""

    exit_code = 2


class SourceError(SpecbuildError):
    """A model source cannot be resolved or read (missing path, corrupt file, pickle without the flag...)."""


class CheckFailed(SpecbuildError):
    """A pre-flight check refused the target/draft pair. `.results` holds every check's outcome."""

    def __init__(self, message: str, results=None):
        super().__init__(message)
        self.results = results or []


class ManifestError(SpecbuildError):
    """A stage's input manifest is missing, stale or from an incompatible version."""


class ServerError(SpecbuildError):
    """tritonserver could not be started, reached or stopped."""


class ToolNotAvailable(SpecbuildError):
    """A tool the chosen backend needs (tensorrt_llm, trtllm-build, tritonserver) is not installed here."""
