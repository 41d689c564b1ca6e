"""`deploy` stage: package the built engines into a Triton model repository (`<workdir>/model_repository/`).

The backend does the work (`specbuild.engines.<backend>.deploy`): `embedded` renders Python-backend
models that run the embedded engine; `trtllm` renders the upstream TensorRT-LLM repository. Both
expose the same client-facing models and tensors (`specbuild.core.contract`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from specbuild.core.manifest import fingerprint, hash_tree, sha256_file
from specbuild.pipeline.stage import StageOutcome, run_stage, stage_dir


def _templates_fingerprint(backend: str) -> str:
    """Hash of `model_repository/<backend>/` and of the backend's deploy code: an edited template or
    renderer re-renders the repository (the specbuild version alone would not notice)."""
    import importlib.util
    from importlib import resources

    hashes: dict[str, str] = {}
    root = Path(str(resources.files("specbuild.model_repository"))) / backend
    if root.is_dir():
        hashes = {k: v for k, v in hash_tree(root).items() if "__pycache__" not in k}
    spec = importlib.util.find_spec(f"specbuild.engines.{backend}.deploy")
    if spec and spec.origin and Path(spec.origin).is_file():
        hashes["<deploy.py>"] = sha256_file(Path(spec.origin))
    return fingerprint(hashes)


def deploy(*, workdir: str | Path, backend: str = "embedded", max_batch_size: int | None = None,
           device: str | None = None, threads: int | None = None, force: bool = False,
           dry_run: bool = False, extra_options: dict[str, Any] | None = None,
           progress: Callable[[str], None] | None = None) -> StageOutcome:
    """Render `<workdir>/model_repository/` from `<workdir>/engines/` (the output of `specbuild build`).

    `max_batch_size` is the client-facing models' Triton max_batch_size (default 64), `device` and
    `threads` where the embedded engine runs (default: the device it was built for, torch's thread count).
    `extra_options` carries backend-specific options (e.g. for trtllm) into the stage.
    Unchanged inputs and options make the stage a no-op unless `force`.
    """
    workdir = Path(workdir)
    options: dict[str, Any] = {k: v for k, v in {"max_batch_size": max_batch_size, "device": device,
                                                 "threads": threads}.items() if v is not None}
    options.update(extra_options or {})
    # The rendered configs name the engine directory by absolute path: a moved workdir re-renders.
    inputs = {"engine_dir": str(stage_dir(workdir, "build").resolve()),
              "templates": _templates_fingerprint(backend)}
    return run_stage("deploy", backend=backend, workdir=workdir, options=options, inputs=inputs,
                     upstream_stage="build", force=force, dry_run=dry_run, progress=progress)
