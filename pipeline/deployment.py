"""What is deployed in a workspace: the facts the client and the load side need, read from the stages'
manifests once, here, so the load tests only measure.

    from specbuild.pipeline.deployment import deployment
    d = deployment("specbuild-work")          # d.target, d.tokenizer_dir(), d.max_seq_len
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbuild.core import contract
from specbuild.core.errors import UsageError
from specbuild.core.requests import EMBEDDED


@dataclass(frozen=True)
class Deployment:
    workdir: Path
    target: str                     # "embedded" | "trtllm-<family>" | "trtllm-llmapi" (`deployment_target`)
    max_seq_len: int | None         # the engine's (prompt + output tokens), when the workspace holds a built engine

    def tokenizer_dir(self, explicit: str | None = None) -> Path:
        return resolve_tokenizer(explicit, self.workdir)


def deployment(workdir) -> Deployment:
    workdir = Path(workdir)
    return Deployment(workdir=workdir, target=deployment_target(workdir), max_seq_len=deployment_max_seq_len(workdir))


def deployment_target(workdir) -> str:
    """What the deployment in `workdir` serves, read from the deploy manifest: "trtllm-<family>" (the release
    family of its engine-path templates, e.g. "trtllm-0.18"), "trtllm-llmapi" (Triton's LLM-API model of
    TensorRT-LLM 1.0-1.2.x), else "embedded" (the contract as is)."""
    path = Path(workdir) / "model_repository" / "manifest.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return EMBEDDED
    if data.get("options", {}).get("backend") != "trtllm":
        return EMBEDDED
    recipe = (data.get("extra") or {}).get("recipe") or {}
    if recipe.get("generation") == "llmapi":
        return contract.LLMAPI_TARGET           # Triton's llmapi model: its own sampling_param_* names
    family = recipe.get("backend_family")
    # A deployment from before the version table recorded no family: the contract is sent as is, rather than
    # guessing a release.
    return f"trtllm-{family}" if family else EMBEDDED


def resolve_tokenizer(explicit: str | None, workdir: Path) -> Path:
    """--tokenizer, else the deployment's tokenizer found through the workspace manifests."""
    if explicit:
        return Path(explicit)
    tried = []
    candidates = []
    manifest = workdir / "model_repository" / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        engine_dir = data.get("inputs", {}).get("engine_dir")
        if engine_dir:
            candidates.append(Path(engine_dir) / "tokenizer")
    candidates += [workdir / "engines" / "tokenizer", workdir / "checkpoints" / "target"]
    candidates += _converted_targets(workdir / "checkpoints" / "manifest.json")
    for c in candidates:
        tried.append(str(c))
        if (c / "tokenizer.json").is_file():
            return c
    raise UsageError(f"cannot find the target's tokenizer (tried {tried}); pass --tokenizer DIR (the target "
                     "model directory holding tokenizer.json) or the --workdir of the deployment.")


def _converted_targets(manifest: Path) -> list[Path]:
    """Where convert kept or found the target: the Hugging Face copy a TensorRT-LLM rehearsal keeps
    (checkpoints/hf/target), then the target's own directory (the llmapi path serves it as given)."""
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return []
    out = []
    kept = ((data.get("outputs") or {}).get("hf_checkpoints") or {}).get("target")
    if isinstance(kept, str):
        out.append(manifest.parent / kept)
    source = ((data.get("inputs") or {}).get("target") or {}).get("path")
    if isinstance(source, str):
        out.append(Path(source))
    return out


def deployment_max_seq_len(workdir: Path) -> int | None:
    """The engine's max_seq_len (prompt + output tokens) when the workspace holds a built engine."""
    for path, keys in ((workdir / "engines" / "engine_config.json", ("max_seq_len",)),
                       (workdir / "engines" / "manifest.json", ("options", "max_seq_len"))):
        try:
            value: Any = json.loads(path.read_text())
            for k in keys:
                value = value[k]
            return int(value)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None
