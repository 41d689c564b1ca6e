"""The `convert` stage: (target, draft) sources -> `<workdir>/checkpoints/` with a manifest.

    from specbuild.pipeline.convert import convert
    result = convert("demo:smollm2-135m-instruct", "path/to/draft", workdir="specbuild-work")
    result.out_dir, result.skipped, result.manifest["outputs"]["draft"]["files"]

Order of work: validate options -> resolve both sources (converting GGUF/demo sources into the cache)
-> pre-flight checks (refuse with `CheckFailed` listing every failing check and its fix) -> make sure
the workdir is writable -> hash every input file (memoized by path+size+mtime) -> `run_stage`, which is
a no-op when inputs, options and tool versions are unchanged. Nothing is written into the workdir
before the checks pass. Backends: `specbuild.engines.<backend>.convert` gets the resolved directories
as `ctx.options["target_dir"]` / `["draft_dir"]`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specbuild.pipeline.checks import CheckResult, failure_message, failures, run_checks
from specbuild.core.errors import CheckFailed, UsageError
from specbuild.core.manifest import (MANIFEST, HashCache, Manifest, ensure_writable_dir, hash_tree, is_up_to_date,
                                read_manifest)
from specbuild.pipeline.sources import ResolvedSource, resolve
from specbuild.pipeline.stage import BACKENDS, PlanStep, StageOutcome, run_stage, stage_dir
from specbuild.core.constants import DTYPES  # noqa: F401 (the CLI imports it here)

QUANTIZATIONS = ("int8_wo", "int4_wo", "fp8")


@dataclass(frozen=True)
class ConvertResult:
    out_dir: Path
    manifest: dict
    skipped: bool                    # True: inputs and options unchanged, nothing was redone
    seconds: float
    checks: list[CheckResult]
    target: ResolvedSource
    draft: ResolvedSource
    plan: list[PlanStep] | None = None


def _validate(backend: str, dtype: str, tp: int, pp: int, quantization: str | None) -> None:
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    if tp < 1 or pp < 1:
        raise UsageError(f"--tp and --pp must be >= 1 (got tp={tp}, pp={pp}).")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UsageError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}.")
    if backend == "embedded":
        if (tp, pp) != (1, 1):
            raise UsageError(f"the embedded backend runs on one device: --tp/--pp must be 1 (got tp={tp}, pp={pp}). "
                             "Use --backend trtllm for tensor/pipeline parallelism.")
        if quantization is not None:
            raise UsageError(f"--quantization {quantization} needs --backend trtllm; the embedded backend casts "
                             "with --dtype only.")


def convert(target: str | os.PathLike, draft: str | os.PathLike, *, workdir: str | os.PathLike = "specbuild-work",
            backend: str = "embedded", dtype: str = "float32", tp: int = 1, pp: int = 1, force: bool = False,
            allow_pickle: bool = False, trust_remote_code: bool = False, dry_run: bool = False,
            trtllm_version: str | None = None, quantization: str | None = None,
            trtllm_generation: str | None = None, rehearse: bool = False,
            progress: Callable[[str], None] | None = None) -> ConvertResult:
    """Resolve, check and convert a (target, draft) pair into `<workdir>/checkpoints/{target,draft}/`."""
    t0 = time.perf_counter()
    _validate(backend, dtype, tp, pp, quantization)
    if (trtllm_generation or rehearse) and backend != "trtllm":
        raise UsageError("--trtllm-generation and --rehearse apply to --backend trtllm only.")
    say = progress or (lambda msg: None)
    workdir = Path(workdir)
    if backend == "trtllm":   # refuse an unsupported TensorRT-LLM recipe before anything is resolved or written
        from specbuild.engines.trtllm.settings import settings_from
        settings_from({"trtllm_version": trtllm_version, "trtllm_generation": trtllm_generation, "dtype": dtype,
                       "tp": tp, "pp": pp, "quantization": quantization, "force": force})
    src_t = resolve(target, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, progress=say)
    src_d = resolve(draft, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, progress=say)
    options = {"dtype": dtype, "tp": tp, "pp": pp, "force": force, "allow_pickle": allow_pickle,
               "trust_remote_code": trust_remote_code, "target_dir": str(src_t.path), "draft_dir": str(src_d.path),
               "trtllm_version": trtllm_version, "quantization": quantization}
    # trtllm-only keys only when set, so existing fingerprints stay valid
    options.update({k: v for k, v in (("trtllm_generation", trtllm_generation), ("rehearse", rehearse)) if v})
    stage_kw = dict(backend=backend, workdir=workdir, options=options, force=force, dry_run=dry_run, progress=say)
    out_dir = stage_dir(workdir, "convert")
    if not dry_run and not force and (out_dir / MANIFEST).is_file():
        # Fast path: an existing output with the same fingerprint is a no-op; its manifest holds the checks.
        inputs = _hash_inputs(workdir, src_t, src_d, say)
        if is_up_to_date(out_dir, Manifest(stage="convert", inputs=inputs, options={**options, "backend": backend})):
            manifest = read_manifest(out_dir, "convert")  # (not run_stage: importing the backend costs ~1 s)
            checks = [CheckResult(**c) for c in manifest.get("checks", [])]
            return _result(StageOutcome(out_dir, manifest, skipped=True, seconds=0.0), checks, src_t, src_d, t0)
    say("running pre-flight checks")
    checks = run_checks(src_t.path, src_d.path, backend=backend, force=force)
    if failures(checks):
        raise CheckFailed(failure_message(checks), checks)
    inputs = {} if dry_run else _hash_inputs(workdir, src_t, src_d, say)
    outcome = run_stage("convert", inputs=inputs, preflight=[c.to_dict() for c in checks], **stage_kw)
    return _result(outcome, checks, src_t, src_d, t0)


def _hash_inputs(workdir: Path, src_t: ResolvedSource, src_d: ResolvedSource, say) -> dict:
    ensure_writable_dir(workdir)
    hashes = HashCache(workdir / ".hash-cache.json")
    say("hashing inputs")
    return {role: {**src.describe(), "files": hash_tree(src.path, hashes)}
            for role, src in (("target", src_t), ("draft", src_d))}


def _result(outcome, checks, src_t, src_d, t0) -> ConvertResult:
    return ConvertResult(out_dir=outcome.out_dir, manifest=outcome.manifest, skipped=outcome.skipped,
                         seconds=time.perf_counter() - t0, checks=checks, target=src_t, draft=src_d,
                         plan=outcome.plan)
