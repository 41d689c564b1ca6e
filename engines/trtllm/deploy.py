"""deploy (trtllm): engines (or LLM-API options) -> a Triton model repository + the launch command.

Output (engine path)::

    model_repository/triton/{ensemble,preprocessing,postprocessing,tensorrt_llm,tensorrt_llm_draft,
                             tensorrt_llm_bls}/config.pbtxt (+ 1/)
    model_repository/tokenizer/            the target tokenizer (pre/post-processing)
    model_repository/launch.json, launch.sh

Output (llmapi path): triton/tensorrt_llm/{config.pbtxt, 1/model.yaml, 1/model.py...},
trtllm_serve.yaml, launch.json, launch.sh.

Triton is pointed at `triton/` (not the stage root) so that tokenizer/ and the launch files are not
mistaken for models. The Python model sources come from the pinned container
(`--backend-models-dir`, default /app/all_models); see repository.py for why.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from specbuild.core.errors import CheckFailed, ToolNotAvailable, UsageError
from specbuild.core.stage import STAGE_DIRS, PlanStep, StageContext, StageResult

from specbuild.engines.trtllm import rehearsal
from specbuild.engines.trtllm.build import llm_api_yaml
from specbuild.engines.trtllm.common import (BUILD_KEYS, planned_source_dir, upstream_path, upstream_root,
                                             upstream_settings)
from specbuild.engines.trtllm.launch import engine_launch, launch_json, launch_script, llmapi_launch
from specbuild.engines.trtllm.repository import (ENGINE_MODELS, LLMAPI_PYTHON_MODELS, PYTHON_MODELS, UPSTREAM_CONFIGS,
                                                 engine_repository, llmapi_repository, upstream_mismatches)
from specbuild.engines.trtllm.settings import Settings
from specbuild.engines.trtllm.versions import ENGINE

TRITON_DIR = "triton"
SERVE_YAML = "trtllm_serve.yaml"


def final_dir(ctx: StageContext) -> Path:
    """Where the repository will live once the stage finishes (configs hold absolute paths)."""
    return (Path(ctx.workdir) / STAGE_DIRS["deploy"]).resolve()


def render_files(ctx: StageContext, s: Settings, options: dict[str, Any],
                 assumed: list[str] | None = None) -> dict[str, str]:
    """{path relative to the stage dir: content} of every file deploy writes itself (`assumed` collects what a
    chain of dry runs had to assume: the source directories convert has not recorded yet)."""
    root = final_dir(ctx)
    files: dict[str, str] = {}
    if s.recipe.generation == ENGINE:
        engines = upstream_root(ctx).resolve()
        repo = engine_repository(s, engines_dir=engines, tokenizer_dir=root / "tokenizer")
        launch = engine_launch(s, root / TRITON_DIR)
    else:
        (target, t_note), (draft, d_note) = (planned_source_dir(ctx, options, role) for role in ("target", "draft"))
        if assumed is not None:
            assumed += [n for n in (t_note, d_note) if n]
        body = llm_api_yaml(s, draft)      # checked against the release's own rules (llmapi.check_yaml)
        repo = llmapi_repository(s, target_dir=target, llm_api_yaml=body)
        files[SERVE_YAML] = body
        launch = llmapi_launch(s, root / TRITON_DIR, target, root / SERVE_YAML)
    files.update({f"{TRITON_DIR}/{rel}": text for rel, text in repo.items()})
    files["launch.json"] = launch_json(launch)
    files["launch.sh"] = launch_script(launch)
    return files


def _deploy_settings(ctx: StageContext) -> tuple[Settings, dict[str, Any], list[str]]:
    s, options, notes = upstream_settings(ctx, BUILD_KEYS)
    if ctx.upstream is not None and options.get("fast_logits") and not options.get("use_draft_logits"):
        raise UsageError("--fast-logits passes the draft's generation logits to the target, but the draft engine was "
                         "built without them; rebuild with `specbuild build --backend trtllm --use-draft-logits`.")
    return s, options, notes


def _python_sources(s: Settings) -> dict[str, str]:
    return PYTHON_MODELS if s.recipe.generation == ENGINE else LLMAPI_PYTHON_MODELS


def plan(ctx: StageContext) -> list[PlanStep]:
    s, options, notes = _deploy_settings(ctx)
    out = Path(ctx.out_dir)
    steps = [PlanStep("note", note=f"TensorRT-LLM {s.recipe.trtllm_version} ({s.recipe.generation} path), "
                                   f"container {s.recipe.container}")]
    steps += [PlanStep("note", note=n) for n in notes]
    inferred = inferred_note(s)
    if inferred:
        steps.append(PlanStep("note", note=inferred))
    assumed: list[str] = []
    rendered = render_files(ctx, s, options, assumed)
    steps += [PlanStep("note", note=n) for n in assumed]
    for rel, text in rendered.items():
        steps.append(PlanStep("write", path=str(out / rel), content=text))
    for model, src in _python_sources(s).items():
        ours = sorted(rendered_in(rendered, model))
        keep = f" (keeping our {', '.join(ours)}: the container's is not copied over it)" if ours else ""
        steps.append(PlanStep("note", note=f"copy {_models_root(s) / src} -> "
                                           f"{out / TRITON_DIR / model / '1'}{keep}"))
    if s.recipe.generation == ENGINE:
        steps.append(PlanStep("note", note=f"compare our configs with {_models_root(s)}/inflight_batcher_llm/*/"
                                           "config.pbtxt (tensors, dims, optional flags, parameter keys) and refuse "
                                           "a mismatch"))
    if s.recipe.generation == ENGINE:
        steps.append(PlanStep("note", note=f"copy {upstream_path(ctx, 'tokenizer')} -> {out / 'tokenizer'}"))
    return steps


def _models_root(s: Settings) -> Path:
    """--backend-models-dir as given (the container's all_models) or a tensorrtllm_backend checkout / its
    all_models/inflight_batcher_llm dir: the directory that holds inflight_batcher_llm/."""
    root = Path(s.backend_models_dir)
    if s.recipe.generation == ENGINE and not (root / "inflight_batcher_llm").is_dir():
        from specbuild.core.upstream_facts import models_dir
        try:
            return models_dir(root).parent
        except FileNotFoundError:
            return root
    return root


def _copy_python_models(s: Settings, triton: Path, files: dict[str, str]) -> list[dict[str, Any]]:
    src_root = _models_root(s)
    checks = []
    for model, rel in _python_sources(s).items():
        src = src_root / rel
        if not (src / "model.py").is_file():
            raise ToolNotAvailable(
                f"{src / 'model.py'} not found: the Triton Python models come from the TensorRT-LLM container. "
                f"Run deploy inside {s.recipe.container}, or pass --backend-models-dir pointing at the container's "
                f"/app/all_models or a checkout of tensorrtllm_backend v{s.recipe.trtllm_version}; or use --dry-run.")
    if s.recipe.generation == ENGINE:
        for model, rel in UPSTREAM_CONFIGS.items():
            upstream_cfg = src_root / rel
            if not upstream_cfg.is_file():
                checks.append({"name": f"{model}_matches_container", "ok": True,
                               "detail": f"not compared: {upstream_cfg} does not exist"})
                continue
            problems = upstream_mismatches(files[f"{TRITON_DIR}/{model}/config.pbtxt"], upstream_cfg.read_text())
            if problems:
                raise CheckFailed(f"the container's {model} model does not match ours: {problems}. The container "
                                  f"does not hold tensorrtllm_backend {s.recipe.trtllm_version} (version family "
                                  f"{s.recipe.backend_family}); use {s.recipe.container} or the matching "
                                  f"--trtllm-version.")
            checks.append({"name": f"{model}_matches_container", "ok": True})
    for model, rel in _python_sources(s).items():
        copy_container_model(src_root / rel, triton / model / "1", ours=rendered_in(files, model))
    return checks


def rendered_in(files: dict[str, str], model: str) -> set[str]:
    """The paths under `<model>/1/` that deploy renders itself (the llmapi model's `model.yaml`)."""
    prefix = f"{TRITON_DIR}/{model}/1/"
    return {rel[len(prefix):] for rel in files if rel.startswith(prefix)}


def copy_container_model(src: Path, dst: Path, *, ours: set[str]) -> list[str]:
    """Copy the container's model version directory `src` (`.../<model>/1`) into `dst`, except the files deploy
    rendered there (`ours`, relative to `dst`) and bytecode; returns what was copied (relative paths).

    Upstream's `llmapi/tensorrt_llm/1/` ships its own `model.yaml` (TensorRT-LLM triton_backend/all_models, e.g.
    tensorrtllm_backend c2e65b8: `model: TinyLlama/TinyLlama-1.1B-Chat-v1.0`, no speculative_config); copied over
    ours it would serve that model without speculation. `serve --rehearse` assembles its copy with this function
    too, so the rehearsal sees exactly what a real deploy serves.
    """
    copied = []
    Path(dst).mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(src).rglob("*")):
        rel = path.relative_to(src)
        if path.is_dir() or "__pycache__" in rel.parts or path.suffix == ".pyc" or rel.as_posix() in ours:
            continue
        (Path(dst) / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, Path(dst) / rel)
        copied.append(rel.as_posix())
    return copied


def run(ctx: StageContext) -> StageResult:
    s, options, notes = _deploy_settings(ctx)
    rehearsal.refuse_rehearsal_upstream(ctx, "deploy")
    rehearse = rehearsal.requested(ctx.options)
    for n in notes:
        ctx.progress(n)
    out = Path(ctx.out_dir)
    files = render_files(ctx, s, options)
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (out / "launch.sh").chmod(0o755)
    triton = out / TRITON_DIR
    if s.recipe.generation == ENGINE:
        for model in ENGINE_MODELS:
            (triton / model / "1").mkdir(parents=True, exist_ok=True)
        shutil.copytree(upstream_path(ctx, "tokenizer"), out / "tokenizer")
    checks = [{"name": "note", "ok": True, "detail": n} for n in notes]
    if rehearse and not _has_python_models(s):
        # `serve --rehearse --backend-models-dir DIR` brings upstream's Python models into its own copy.
        checks.append({"name": "python_models", "ok": True,
                       "detail": f"not copied: {_models_root(s)} holds no upstream models (a rehearsal); "
                                 "`specbuild serve --rehearse --backend-models-dir DIR` adds them"})
    else:
        checks += _copy_python_models(s, triton, files)
    if rehearse:
        final = ctx.out_dir
        ctx.out_dir = Path(ctx.workdir) / STAGE_DIRS["deploy"]
        try:
            steps = plan(ctx)
        finally:
            ctx.out_dir = final
        (out / rehearsal.PLAN_FILE).write_text(rehearsal.plan_record(steps, stage="deploy", recipe=s.recipe.to_dict()))
    inferred = inferred_note(s)
    if inferred:
        ctx.progress(inferred)
        checks.append({"name": "inferred_facts", "ok": True, "detail": inferred})
    extra = {"recipe": s.recipe.to_dict(), "trtllm_options": options, "rendered": sorted(files),
             "client_models": ["ensemble", "tensorrt_llm_bls"] if s.recipe.generation == ENGINE
             else ["tensorrt_llm"]}
    if rehearse or rehearsal.upstream_is_rehearsal(ctx.upstream):
        extra["rehearsal"] = True
    return StageResult(
        outputs={"triton_model_repository": TRITON_DIR, "launch": "launch.json",
                 "models": sorted(p.name for p in triton.iterdir() if p.is_dir())},
        checks=checks, extra=extra,
    )


def _has_python_models(s: Settings) -> bool:
    root = _models_root(s)
    return all((root / rel / "model.py").is_file() for rel in _python_sources(s).values())


def inferred_note(s: Settings) -> str | None:
    """One line naming the facts of this deployment that were not read at the release's own commit."""
    if s.recipe.generation == ENGINE:
        from specbuild.core.upstream_facts import inferred_facts
        facts = inferred_facts(s.recipe.backend_family) if s.recipe.backend_family else []
        what = f"the version-table family {s.recipe.backend_family}"
    else:
        from specbuild.engines.trtllm.llmapi import inferred_facts as llmapi_inferred
        facts = llmapi_inferred(s.recipe.trtllm_version)
        what = "the LLM-API path"
    if not facts:
        return None
    listed = ", ".join(f"{f.get('id', f['fact'][:40])} ({f['exactness']})" for f in facts)
    return (f"TensorRT-LLM {s.recipe.trtllm_version}: {len(facts)} fact(s) of {what} are not read at the release's "
            f"own commit: {listed}. Sources: core/upstream_facts.json, core/trtllm_schema.json and "
            "docs/deploying-on-gpus.md; "
            "check them in the container before production.")
