"""The stage runner shared by convert, build and deploy.

A stage is: upstream manifest(s) + options -> an output directory with a manifest. The runner owns
the fingerprint no-op, the atomic write (temp dir + rename; a full disk is `NoSpaceError`, the previous
output kept) and the manifest; the backend owns the work. Backends live in
`specbuild.engines.<backend>.<stage>` and expose::

    def run(ctx: StageContext) -> StageResult          # do the work into ctx.out_dir
    def plan(ctx: StageContext) -> list[PlanStep]      # optional: what run() would do (--dry-run)
"""

from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path
from typing import Any, Callable

from specbuild.core.errors import SpecbuildError, UsageError
from specbuild.core.manifest import (HashCache, Manifest, is_up_to_date, read_manifest, recover_output,
                                     stage_output, tree_bytes, workspace_lock, write_manifest)
from specbuild.core.stage import (BACKENDS, STAGE_DIRS, PlanStep, StageContext, StageOutcome,  # noqa: F401
                                  StageResult, stage_dir, write_manifest_raw)

log = logging.getLogger(__name__)


def backend_module(backend: str, stage: str):
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    return importlib.import_module(f"specbuild.engines.{backend}.{stage}")


def run_stage(stage: str, *, backend: str, workdir: Path, options: dict[str, Any],
              inputs: dict[str, Any], upstream_stage: str | None = None, force: bool = False,
              dry_run: bool = False, progress: Callable[[str], None] | None = None,
              preflight: list[dict[str, Any]] | None = None) -> StageOutcome:
    """Run one stage with fingerprinting and an atomic write.

    `inputs` must already identify the inputs by content (sha256); the fingerprint is
    stage + inputs + options + tool versions, so unchanged inputs make the stage a no-op.
    """
    if dry_run:
        return _run_stage(stage, backend=backend, workdir=workdir, options=options, inputs=inputs,
                          upstream_stage=upstream_stage, force=force, dry_run=True, progress=progress,
                          preflight=preflight)
    with workspace_lock(workdir, f"specbuild {stage}"):
        return _run_stage(stage, backend=backend, workdir=workdir, options=options, inputs=inputs,
                          upstream_stage=upstream_stage, force=force, dry_run=False, progress=progress,
                          preflight=preflight)


def _run_stage(stage: str, *, backend: str, workdir: Path, options: dict[str, Any],
               inputs: dict[str, Any], upstream_stage: str | None, force: bool,
               dry_run: bool, progress: Callable[[str], None] | None,
               preflight: list[dict[str, Any]] | None) -> StageOutcome:
    t0 = time.perf_counter()
    workdir = Path(workdir)
    out_dir = stage_dir(workdir, stage)
    if not dry_run:
        recover_output(out_dir)
        if upstream_stage:
            recover_output(stage_dir(workdir, upstream_stage))
    upstream = upstream_dir = None
    if upstream_stage:
        upstream_dir = stage_dir(workdir, upstream_stage)
        if dry_run and not (upstream_dir / "manifest.json").exists():
            # A plan may be printed before the upstream stage ever ran (e.g. trtllm plans on a CPU box).
            upstream = None
        else:
            upstream = read_manifest(upstream_dir, upstream_stage)
    if upstream is not None:
        up_backend = upstream.get("options", {}).get("backend")
        if up_backend and up_backend != backend:
            raise UsageError(f"{upstream_dir} was made for backend {up_backend!r}, not {backend!r}; "
                             f"re-run `specbuild {upstream_stage} --backend {backend}` or pass "
                             f"--backend {up_backend}.")
        inputs = {**inputs, upstream_stage: upstream["fingerprint"]}
    mod = backend_module(backend, stage)
    hashes = HashCache(workdir / ".hash-cache.json") if not dry_run else HashCache(None)
    options = {**options, "backend": backend}
    ctx = StageContext(stage=stage, backend=backend, workdir=workdir, out_dir=out_dir, options=options,
                       upstream=upstream, upstream_dir=upstream_dir, hashes=hashes,
                       progress=progress or (lambda msg: log.info(msg)), preflight=list(preflight or []))
    if dry_run:
        if not hasattr(mod, "plan"):
            raise UsageError(f"--dry-run is not available for `{stage}` with backend {backend!r}.")
        steps = mod.plan(ctx)
        return StageOutcome(out_dir, {}, skipped=False, seconds=time.perf_counter() - t0, plan=steps)
    manifest = Manifest(stage=stage, inputs=inputs, options=options)
    if not force and is_up_to_date(out_dir, manifest):
        return StageOutcome(out_dir, read_manifest(out_dir, stage), skipped=True,
                            seconds=time.perf_counter() - t0)
    with stage_output(out_dir, need_bytes=lambda: _output_estimate(stage, ctx)) as tmp:
        ctx.out_dir = tmp
        try:
            result: StageResult = mod.run(ctx)
        except SpecbuildError:
            raise
        except KeyboardInterrupt:
            raise
        manifest.inputs = {**inputs, **result.inputs}
        # The fingerprint must not depend on what run() discovered, only on what the caller fixed.
        fp = Manifest(stage=stage, inputs=inputs, options=options, versions=manifest.versions).fingerprint
        manifest.outputs, manifest.checks, manifest.extra = result.outputs, result.checks, result.extra
        data = write_manifest(tmp, manifest)
        data["fingerprint"] = fp
        write_manifest_raw(tmp, data)
    return StageOutcome(out_dir, data, skipped=False, seconds=time.perf_counter() - t0)


def _output_estimate(stage: str, ctx: StageContext) -> int:
    """About how many bytes a stage's output takes, for the "free N MB" of a full disk: convert writes a
    copy of both checkpoints, build one of the converted checkpoints; deploy writes a few small files."""
    if stage == "convert":
        dirs = [ctx.options.get("target_dir"), ctx.options.get("draft_dir")]
        if dirs[0] and dirs[0] == dirs[1]:
            dirs = dirs[:1]
    elif stage == "build":
        dirs = [ctx.upstream_dir]
    else:
        dirs = []
    return sum(tree_bytes(Path(d)) for d in dirs if d)


