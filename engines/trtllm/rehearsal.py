"""`--rehearse` for the trtllm stages: the TensorRT-LLM chain on a machine without TensorRT-LLM.

convert, build and deploy with `--rehearse` do what their `--dry-run` prints and, instead of running what
needs TensorRT-LLM or a GPU (the per-rank converter, `trtllm-build`), record it: the exact plan (every argv and
every file, as the dry run renders it) goes into `<stage>/rehearsal_plan.json`. What the CPU stand-in of
`specbuild serve --rehearse` needs is kept for real: convert keeps the Hugging Face checkpoints
(`checkpoints/hf/{target,draft}`, hard links where the filesystem allows, else copies) and the target
tokenizer; build keeps the tokenizer and marks `engines/{target,draft}/` as a rehearsal's (no engine files);
deploy writes the real model repository (the same configs as on the GPU box). Every manifest carries
`extra.rehearsal: true`, and a stage run for real refuses an upstream that was a rehearsal, with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from specbuild.core.errors import UsageError
from specbuild.core.stage import PlanStep

PLAN_FILE = "rehearsal_plan.json"
MARKER = "REHEARSAL.json"
HF_DIR = "hf"


def requested(options: dict[str, Any]) -> bool:
    return bool(options.get("rehearse"))


def upstream_is_rehearsal(manifest: dict[str, Any] | None) -> bool:
    return bool(((manifest or {}).get("extra") or {}).get("rehearsal"))


def refuse_rehearsal_upstream(ctx, stage: str) -> None:
    """A real (GPU) stage must not consume a rehearsal's artifacts: they hold no TensorRT-LLM checkpoints or
    engines, only the plan of what would have been run."""
    if requested(ctx.options) or not upstream_is_rehearsal(ctx.upstream):
        return
    prev = {"build": "convert", "deploy": "build"}[stage]
    what = "engines" if prev == "build" else "checkpoints"
    raise UsageError(f"{ctx.upstream_dir} holds a rehearsal's {what} (`specbuild {prev} --backend trtllm --rehearse` "
                     f"on a machine without TensorRT-LLM): no TensorRT-LLM {what} were made there, only the plan in "
                     f"{Path(ctx.upstream_dir) / PLAN_FILE}. Re-run `specbuild {prev} --backend trtllm` (without "
                     f"--rehearse) inside the TensorRT-LLM container, or pass --rehearse to this {stage} as well.")


def plan_record(steps: Iterable[PlanStep], *, stage: str, recipe: dict[str, Any]) -> str:
    """The plan a rehearsal recorded instead of running it: argv lists, files (path + content), notes."""
    items = []
    for s in steps:
        if s.kind == "run":
            items.append({"run": list(s.argv or [])})
        elif s.kind == "write":
            items.append({"write": s.path, "content": s.content})
        else:
            items.append({"note": s.note})
    return json.dumps({"rehearsal": True, "stage": stage, "recipe": recipe,
                       "not_run": "TensorRT-LLM is not used by a rehearsal: every `run` step below is what the "
                                  "real stage runs inside the TensorRT-LLM container",
                       "steps": items}, indent=2) + "\n"


def keep_tree(src: Path, dst: Path) -> None:
    """Copy a checkpoint directory, hard-linking files where possible (same filesystem: no extra space)."""
    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link_or_copy,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))


def mark(directory: Path, role: str, argv: list[str] | None) -> None:
    """Mark a rehearsal's engine directory: it holds no engine, and says what would have built one."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text(json.dumps(
        {"rehearsal": True, "role": role, "engine": None,
         "why": "made by `specbuild build --backend trtllm --rehearse` without TensorRT-LLM: no engine was built",
         "would_run": argv}, indent=2) + "\n")
