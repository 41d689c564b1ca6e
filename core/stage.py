"""The stage types a backend sees: what `run_stage` hands a backend (`StageContext`), what the backend returns
(`StageResult`, or `PlanStep`s for --dry-run), what the caller gets back (`StageOutcome`), and where each stage's
output lives in a workspace (`stage_dir`). A backend (`specbuild.engines.<backend>.<stage>`) exposes::

    def run(ctx: StageContext) -> StageResult          # do the work into ctx.out_dir
    def plan(ctx: StageContext) -> list[PlanStep]      # optional: what run() would do (--dry-run)

The runner itself (fingerprints, atomic writes) is `specbuild.pipeline.stage`.
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specbuild.core.manifest import MANIFEST, HashCache, atomic_write_text

log = logging.getLogger(__name__)

BACKENDS = ("embedded", "trtllm")
STAGE_DIRS = {"convert": "checkpoints", "build": "engines", "deploy": "model_repository"}


@dataclass
class PlanStep:
    """One thing a stage would do: a command to run (argv) or a file to write (path + content)."""

    kind: str  # "run" | "write" | "note"
    argv: list[str] | None = None
    path: str | None = None
    content: str | None = None
    note: str | None = None

    def render(self) -> str:
        if self.kind == "run":
            return "$ " + shlex.join(self.argv or [])
        if self.kind == "write":
            head = f"--- write {self.path}"
            return head if self.content is None else f"{head}\n{self.content.rstrip()}"
        return f"# {self.note}"


@dataclass
class StageContext:
    stage: str
    backend: str
    workdir: Path
    out_dir: Path                      # where run() writes (a temp dir that is renamed into place)
    options: dict[str, Any]
    upstream: dict[str, Any] | None    # the previous stage's manifest (None for convert)
    upstream_dir: Path | None
    hashes: HashCache
    progress: Callable[[str], None] = lambda msg: log.info(msg)
    preflight: list[dict[str, Any]] = field(default_factory=list)   # convert: the pre-flight checks it passed


@dataclass
class StageResult:
    inputs: dict[str, Any] = field(default_factory=dict)    # extra inputs to record (e.g. resolved sources)
    outputs: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageOutcome:
    out_dir: Path
    manifest: dict[str, Any]
    skipped: bool                      # True when the inputs and options were unchanged (no-op)
    seconds: float
    plan: list[PlanStep] | None = None


def stage_dir(workdir: Path, stage: str) -> Path:
    return Path(workdir) / STAGE_DIRS[stage]


def write_manifest_raw(directory: Path, data: dict[str, Any]) -> None:
    atomic_write_text(Path(directory) / MANIFEST, json.dumps(data, indent=2, default=str) + "\n")
