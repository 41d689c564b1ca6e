"""build (trtllm): TensorRT-LLM checkpoints -> engines (engine path) or the LLM-API options (llmapi path).

Engine path: `trtllm-build` once for the draft and once for the target; the target gets
`--speculative_decoding_mode draft_tokens_external --max_draft_len K`, both get paged KV and
`--use_paged_context_fmha enable` (draft-target relies on KV-cache reuse), the draft gets
`--gather_generation_logits` when draft logits are used. Afterwards each engine's config.json is read
back and checked (speculative mode, max_draft_len, gathered logits). Output::

    engines/target/{config.json, rank0.engine, ...}   engines/draft/...   engines/tokenizer/

LLM-API path: no engines; `engines/llm_api_options.yaml` holds `speculative_config` (DraftTarget),
the KV-cache settings and the limits, for `trtllm-serve` and for Triton's llmapi model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


from specbuild.core.errors import CheckFailed, UsageError
from specbuild.core.stage import PlanStep, StageContext, StageResult

from specbuild.engines.trtllm import rehearsal
from specbuild.engines.trtllm.checks import read_json, validate_engine_config
from specbuild.engines.trtllm.common import (BUILD_KEYS, CONVERT_KEYS, ROLES, hf_config, planned_source_dir,
                                             resolve_dtype, source_dir, upstream_path, upstream_settings)
from specbuild.engines.trtllm.runner import require_tensorrt_llm, run_command
from specbuild.engines.trtllm.settings import Settings
from specbuild.engines.trtllm.versions import ENGINE

OPTIONS_YAML = "llm_api_options.yaml"


def trtllm_build_argv(s: Settings, role: str, checkpoint_dir: Path, output_dir: Path, dtype: str) -> list[str]:
    """The exact trtllm-build command line for one model of the draft-target pair."""
    plugin = "auto" if s.quantization == "fp8" else dtype
    argv = ["trtllm-build",
            "--checkpoint_dir", str(checkpoint_dir),
            "--output_dir", str(output_dir),
            "--gemm_plugin", plugin,
            "--gpt_attention_plugin", plugin,
            "--remove_input_padding", "enable",
            "--kv_cache_type", "paged",
            "--context_fmha", "enable",
            "--use_paged_context_fmha", "enable",
            "--max_beam_width", "1",
            "--max_batch_size", str(s.max_batch_size),
            "--max_input_len", str(s.max_input_len),
            "--max_seq_len", str(s.max_seq_len),
            "--max_num_tokens", str(s.max_num_tokens)]
    if role == "target":
        argv += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(s.max_draft_len)]
    elif s.use_draft_logits:
        argv += ["--gather_generation_logits"]
    from specbuild.core import trtllm_schema
    if trtllm_schema.release_key(s.recipe.trtllm_version) is not None:     # a release whose CLI facts were read
        from specbuild.engines.trtllm.llmapi import check_argv
        check_argv(s.recipe.trtllm_version, "trtllm-build", argv)
    return argv


def _dtype(options: dict[str, Any], s: Settings, role: str) -> str:
    if s.dtype != "auto":
        return s.dtype
    try:
        config = hf_config(source_dir(options, role))
    except UsageError:   # a dry run before convert ran: the checkpoint's dtype is not known yet
        config = {}
    return resolve_dtype(s.dtype, config)


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def llm_api_options(s: Settings, draft_dir: Path) -> dict[str, Any]:
    """LLM() keyword arguments for draft-target on the PyTorch backend (trtllm-serve YAML / model.yaml)."""
    # Field names per release, read from the release's source (llmapi.py, core/trtllm_schema.json): decoding_type
    # DraftTarget on 1.0 .. 1.2.1; the draft in speculative_model_dir (1.0, 1.1) or speculative_model (1.2).
    from specbuild.engines.trtllm.llmapi import speculative_config
    return {
        "tensor_parallel_size": s.tp,
        "pipeline_parallel_size": s.pp,
        "max_batch_size": s.max_batch_size,
        "max_num_tokens": s.max_num_tokens,
        "max_seq_len": s.max_seq_len,
        "disable_overlap_scheduler": True,
        # enable_block_reuse is left to the release: with a draft model TensorRT-LLM turned block reuse off with a
        # warning (PR #5448), and which 1.x releases still do is not read at a release commit, so specbuild does
        # not present it as a setting.
        "kv_cache_config": {"free_gpu_memory_fraction": s.kv_cache_free_gpu_mem_fraction},
        "speculative_config": speculative_config(s.recipe.trtllm_version, max_draft_len=s.max_draft_len,
                                                 draft_dir=str(draft_dir)),
    }


LLM_API_YAML_HEADER = (
    "# LLM() arguments for draft-target speculative decoding (TensorRT-LLM {version}, PyTorch backend), checked\n"
    "# against the release's own source ({source}).\n"
    "# kv_cache_config.enable_block_reuse is not set: with a draft model TensorRT-LLM turns KV-cache block reuse\n"
    "# off with a warning (NVIDIA/TensorRT-LLM PR #5448), so it is not a setting to rely on here.\n")


def llm_api_yaml(s: Settings, draft_dir: Path) -> str:
    """The trtllm-serve YAML (also the body of Triton's model.yaml), refused (CheckFailed) unless the release's
    own rules accept it."""
    from specbuild.core import trtllm_schema
    from specbuild.engines.trtllm.llmapi import check_yaml, release
    data = llm_api_options(s, draft_dir)
    check_yaml(s.recipe.trtllm_version, data, where="the trtllm-serve YAML")
    r = release(s.recipe.trtllm_version)
    return LLM_API_YAML_HEADER.format(version=s.recipe.trtllm_version,
                                      source=trtllm_schema.describe(r.version)) + to_yaml(data)


def to_yaml(data: dict[str, Any], indent: int = 0) -> str:
    """Minimal YAML for nested dicts of scalars (no PyYAML dependency)."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(to_yaml(value, indent + 2).rstrip("\n"))
        else:
            lines.append(" " * indent + f"{key}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


def _engine_steps(ctx: StageContext, s: Settings, options: dict[str, Any]) -> list[list[str]]:
    ckpt = {role: upstream_path(ctx, f"{role}_checkpoint") for role in ROLES}
    return [trtllm_build_argv(s, role, ckpt[role], Path(ctx.out_dir) / role, _dtype(options, s, role))
            for role in ("draft", "target")]


def plan(ctx: StageContext) -> list[PlanStep]:
    s, options, notes = upstream_settings(ctx, CONVERT_KEYS)
    steps = [PlanStep("note", note=f"TensorRT-LLM {s.recipe.trtllm_version} ({s.recipe.generation} path), "
                                   f"container {s.recipe.container}")]
    steps += [PlanStep("note", note=n) for n in notes]
    if s.recipe.generation == ENGINE:
        steps += [PlanStep("run", argv=argv) for argv in _engine_steps(ctx, s, options)]
        steps.append(PlanStep("note", note="then read draft/config.json and target/config.json back: target must "
                                           f"have speculative_decoding_mode draft_tokens_external and max_draft_len "
                                           f">= {s.max_draft_len}"))
    else:
        draft, assumed = planned_source_dir(ctx, options, "draft")
        if assumed:
            steps.append(PlanStep("note", note=assumed))
        body = llm_api_yaml(s, draft)
        steps.append(PlanStep("write", path=str(Path(ctx.out_dir) / OPTIONS_YAML), content=body))
    return steps


def _rehearse(ctx: StageContext, s: Settings, options: dict[str, Any], notes: list[str]) -> StageResult:
    """--rehearse: record the trtllm-build argv (rehearsal.py), keep the tokenizer, mark the engine dirs."""
    out = Path(ctx.out_dir)
    final = ctx.out_dir
    ctx.out_dir = Path(ctx.workdir) / "engines"
    try:
        steps = plan(ctx)
        argvs = {Path(a[a.index("--output_dir") + 1]).name: a for a in _engine_steps(ctx, s, options)} \
            if s.recipe.generation == ENGINE else {}
    finally:
        ctx.out_dir = final
    (out / rehearsal.PLAN_FILE).write_text(rehearsal.plan_record(steps, stage="build", recipe=s.recipe.to_dict()))
    outputs: dict[str, Any] = {"rehearsal_plan": rehearsal.PLAN_FILE}
    if s.recipe.generation == ENGINE:
        for role in ("draft", "target"):
            rehearsal.mark(out / role, role, argvs.get(role))
            outputs[f"{role}_engine"] = role
        shutil.copytree(upstream_path(ctx, "tokenizer"), out / "tokenizer")
        outputs["tokenizer"] = "tokenizer"
    else:
        (out / OPTIONS_YAML).write_text(llm_api_yaml(s, source_dir(options, "draft")))
        outputs["llm_api_options"] = OPTIONS_YAML
    ctx.progress(f"rehearsal: recorded {sum(st.kind == 'run' for st in steps)} trtllm-build commands in "
                 f"engines/{rehearsal.PLAN_FILE} (not run: no TensorRT-LLM)" if s.recipe.generation == ENGINE else
                 f"rehearsal: wrote engines/{OPTIONS_YAML} (the LLM-API path builds no engine); plan in "
                 f"engines/{rehearsal.PLAN_FILE}")
    effective = {**options, **{k: getattr(s, k) for k in BUILD_KEYS if hasattr(s, k)}}
    effective.update(trtllm_version=s.recipe.trtllm_version, trtllm_generation=s.recipe.generation,
                     container_tag=s.recipe.container)
    checks = [{"name": "note", "ok": True, "detail": n} for n in notes]
    checks.append({"name": "rehearsal", "ok": True, "detail": "no engine was built"})
    return StageResult(outputs=outputs, checks=checks,
                       extra={"rehearsal": True, "recipe": s.recipe.to_dict(), "tensorrt_llm": None,
                              "trtllm_options": effective})


def run(ctx: StageContext) -> StageResult:
    s, options, notes = upstream_settings(ctx, CONVERT_KEYS)
    rehearsal.refuse_rehearsal_upstream(ctx, "build")
    if rehearsal.requested(ctx.options):
        for n in notes:
            ctx.progress(n)
        return _rehearse(ctx, s, options, notes)
    installed = require_tensorrt_llm(s.recipe.container)
    out = Path(ctx.out_dir)
    outputs: dict[str, Any] = {}
    checks: list[dict[str, Any]] = [{"name": "note", "ok": True, "detail": n} for n in notes]
    for n in notes:
        ctx.progress(n)
    if s.recipe.generation == ENGINE:
        for argv in _engine_steps(ctx, s, options):
            role = Path(argv[argv.index("--output_dir") + 1]).name
            ctx.progress(f"build: trtllm-build {role}")
            run_command(argv, log_file=out / "build.log", progress=ctx.progress, what=f"trtllm-build {role}")
        for role in ("draft", "target"):
            cfg = read_json(out / role / "config.json")
            world = s.tp * s.pp if role == "target" else s.draft_tp * s.draft_pp
            missing = [f"rank{r}.engine" for r in range(world) if not (out / role / f"rank{r}.engine").is_file()]
            if missing:
                raise CheckFailed(f"trtllm-build finished but {missing} are missing in {out / role}; see "
                                  f"{out / 'build.log'}.")
            checks.append({"name": f"{role}_engine", "ok": True,
                           **validate_engine_config(cfg, role, max_draft_len=s.max_draft_len,
                                                    use_draft_logits=s.use_draft_logits)})
            outputs[f"{role}_engine"] = role
        shutil.copytree(upstream_path(ctx, "tokenizer"), out / "tokenizer")
        outputs["tokenizer"] = "tokenizer"
    else:
        (out / OPTIONS_YAML).write_text(llm_api_yaml(s, source_dir(options, "draft")))
        outputs["llm_api_options"] = OPTIONS_YAML
    effective = {**options, **{k: getattr(s, k) for k in BUILD_KEYS if hasattr(s, k)}}
    effective["trtllm_version"] = s.recipe.trtllm_version
    effective["trtllm_generation"] = s.recipe.generation
    effective["container_tag"] = s.recipe.container
    return StageResult(outputs=outputs, checks=checks,
                       extra={"recipe": s.recipe.to_dict(), "tensorrt_llm": installed, "trtllm_options": effective})
