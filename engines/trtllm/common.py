"""Helpers shared by the trtllm stages: Hugging Face sources, tokenizer files, stage settings."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Mapping

from specbuild.core.constants import TOKENIZER_FILES as _TOKENIZER_FILES
from specbuild.core.errors import CheckFailed, SourceError, UsageError

from specbuild.engines.trtllm import SUPPORTED_ARCHITECTURES
from specbuild.engines.trtllm.checks import read_json
from specbuild.engines.trtllm.settings import Settings, settings_from
from specbuild.engines.trtllm.versions import detect_installed

ROLES = ("target", "draft")
# upstream's pre/postprocessing load the tokenizer with AutoTokenizer, which also reads config.json; the chat
# template goes along so that load tests render chat prompts with it
TOKENIZER_FILES = _TOKENIZER_FILES + ("config.json",)


def stage_settings(options: Mapping[str, Any]) -> Settings:
    return settings_from(options, installed=detect_installed())


def source_dir(options: Mapping[str, Any], role: str) -> Path:
    """The resolved Hugging Face directory of `role` (options target_dir / draft_dir)."""
    value = options.get(f"{role}_dir")
    if not value:
        raise UsageError(f"no {role} checkpoint: pass --{role} (the convert stage needs options['{role}_dir']).")
    path = Path(value).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SourceError(f"{path} has no config.json; --{role} must be a Hugging Face checkpoint directory.")
    return path


def hf_config(path: Path) -> dict[str, Any]:
    return read_json(Path(path) / "config.json")


def model_class(config: Mapping[str, Any], role: str) -> str:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    raise CheckFailed(f"the {role} architecture {archs} is not supported by the trtllm backend here; supported: "
                      f"{sorted(SUPPORTED_ARCHITECTURES)}. Use --backend embedded or a Llama/Mistral/Qwen2 model.")


def resolve_dtype(dtype: str, config: Mapping[str, Any]) -> str:
    """'auto' -> the checkpoint's float16/bfloat16 dtype (float32 checkpoints become float16, as upstream)."""
    if dtype != "auto":
        return dtype
    src = str(config.get("torch_dtype") or config.get("dtype") or "float16")
    return src if src in ("float16", "bfloat16") else "float16"


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    if not any(n.startswith("tokenizer") or n in ("vocab.json",) for n in copied):
        raise SourceError(f"{src} has no tokenizer files; the Triton pre/post-processing models need the target's "
                          "tokenizer next to its config.json.")
    return copied


PREVIOUS = {"build": "convert", "deploy": "build"}
DEFAULT_OUTPUTS = {"target_checkpoint": "target", "draft_checkpoint": "draft", "tokenizer": "tokenizer",
                   "target_engine": "target", "draft_engine": "draft"}


def upstream_root(ctx) -> Path:
    """The upstream stage directory (its conventional place when a dry run has no upstream yet)."""
    from specbuild.core.stage import stage_dir
    return Path(ctx.upstream_dir) if ctx.upstream_dir else stage_dir(ctx.workdir, PREVIOUS[ctx.stage])


def upstream_path(ctx, key: str) -> Path:
    """A path recorded in the upstream manifest's outputs, relocated to the upstream dir.

    Without an upstream manifest (a dry run of a chain not yet run) the conventional layout is used.
    """
    if ctx.upstream is None:
        return upstream_root(ctx) / DEFAULT_OUTPUTS[key]
    outputs = ctx.upstream.get("outputs", {})
    if key not in outputs:
        raise UsageError(f"the upstream stage in {ctx.upstream_dir} was not made by the trtllm backend "
                         f"(no {key!r}); re-run it with --backend trtllm.")
    return Path(ctx.upstream_dir) / outputs[key]


# Options fixed by an earlier stage: a later stage inherits them and refuses a different value.
CONVERT_KEYS = ("trtllm_version", "trtllm_generation", "container_tag", "dtype", "tp", "pp", "draft_tp", "draft_pp",
                "quantization")
BUILD_KEYS = CONVERT_KEYS + ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_draft_len",
                             "use_draft_logits")


def _earlier_manifest(ctx) -> tuple[str, dict | None]:
    """(stage name, manifest) of the nearest earlier trtllm stage that has run: the upstream, or for a deploy
    whose build has not run, the convert stage."""
    if ctx.upstream is not None:
        return PREVIOUS[ctx.stage], ctx.upstream
    from specbuild.core.manifest import read_manifest
    from specbuild.core.stage import stage_dir
    stage = PREVIOUS[ctx.stage]
    while stage:
        try:
            m = read_manifest(stage_dir(ctx.workdir, stage), stage)
        except Exception:
            m = None
        if m is not None and (m.get("options") or {}).get("backend", "trtllm") == "trtllm":
            return stage, m
        stage = PREVIOUS.get(stage)
    return PREVIOUS[ctx.stage], None


def merged_options(ctx, fixed: tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """Upstream's effective options overlaid with this stage's (unset = inherit).

    Keys in `fixed` were baked into the upstream artifact (e.g. tp/dtype into the checkpoint shards):
    the upstream value wins, and a different value given to this stage is reported in the returned
    notes (callers show them) instead of silently producing an inconsistent artifact.
    """
    _, up = _earlier_manifest(ctx)
    up = up or {}
    base = dict(up.get("extra", {}).get("trtllm_options") or up.get("options") or {})
    mine = {k: v for k, v in ctx.options.items() if v is not None}
    notes = []
    for key in fixed:
        if key in mine and base.get(key) is not None and mine[key] != base[key]:
            notes.append(f"ignored --{key.replace('_', '-')} {mine[key]!r}: {upstream_root(ctx)} was made with "
                         f"{base[key]!r}; re-run the earlier stage to change it")
            del mine[key]
    return {**{k: v for k, v in base.items() if v is not None}, **mine}, notes


def upstream_settings(ctx, fixed: tuple[str, ...]) -> tuple[Settings, dict[str, Any], list[str]]:
    """Settings for a stage with an upstream (build, deploy), the merged options to record, and notes."""
    options, notes = merged_options(ctx, fixed)
    s = stage_settings(options)
    notes.append(recorded_note(ctx, s))
    if s.recipe.untested:
        notes.append(f"TensorRT-LLM {s.recipe.trtllm_version} is not in the version table (accepted with --force): "
                     f"the repository uses the backend-{s.recipe.backend_family} templates, unverified against its "
                     "Triton models")
    if s.dtype == "float32":
        notes.append("dtype float32 makes TensorRT-LLM engines twice the size and speed cost of float16; "
                     "convert with --dtype float16 or bfloat16 for GPUs")
    return s, options, notes


def assumed_source(role: str) -> Path:
    """What a plan names for a source directory convert has not recorded yet (a chain of dry runs)."""
    return Path(f"<the --{role} given to convert>")


def planned_source_dir(ctx, options: Mapping[str, Any], role: str) -> tuple[Path, str | None]:
    """source_dir(options, role) -> (it, None); in a chain of dry runs, where no earlier stage has run and so no
    manifest records the directory convert was given, (a placeholder naming it, the note saying so)."""
    if options.get(f"{role}_dir") or _earlier_manifest(ctx)[1] is not None:
        return source_dir(options, role), None
    where = assumed_source(role)
    return where, (f"the {role} checkpoint directory is not known until convert runs (it records the --{role} it "
                   f"was given); this plan writes {where} in its place")


def recorded_note(ctx, s: Settings) -> str:
    """What this stage took from the earlier stages' manifests, or that it could not know them (dry runs)."""
    stage, manifest = _earlier_manifest(ctx)
    shown = (f"dtype {s.dtype}, tp {s.tp}, pp {s.pp}, draft tp {s.draft_tp}, draft pp {s.draft_pp}"
             + ("" if ctx.stage == "build" else f", max_seq_len {s.max_seq_len}, max_input_len {s.max_input_len}, "
                f"max_batch_size {s.max_batch_size}, max_draft_len {s.max_draft_len}"))
    if manifest is not None:
        return f"options recorded by {stage} ({stage_path(ctx, stage)}/manifest.json): {shown}"
    return (f"{stage} has not run in {ctx.workdir} (no manifest), so this plan cannot know what it will record; "
            f"it assumes {shown} (this command's options and the trtllm defaults). The real run takes them from "
            f"the {stage} manifest. Engine configs, tensorrt_llm's version and checkpoint files are not known either.")


def stage_path(ctx, stage: str) -> Path:
    from specbuild.core.stage import stage_dir
    return stage_dir(ctx.workdir, stage)


# Defaults of the trtllm path where the shared CLI flags default to the embedded engine's values.
TRTLLM_CLI_DEFAULTS = {"dtype": "float16", "tp": 1, "pp": 1, "max_seq_len": 4096, "max_batch_size": 8,
                       "max_draft_len": 4}


def cli_defaults(workdir, stage: str) -> dict[str, Any]:
    """Values for the trtllm options a user did not pass on the `stage` command line: those the earlier stage
    recorded in its manifest (dtype, tp, pp from convert), else the trtllm defaults."""
    from specbuild.core.manifest import read_manifest
    from specbuild.core.stage import stage_dir
    out = dict(TRTLLM_CLI_DEFAULTS)
    prev = PREVIOUS.get(stage)
    while prev:
        try:
            m = read_manifest(stage_dir(workdir, prev), prev)
        except Exception:
            m = None
        if m is not None:
            rec = (m.get("extra") or {}).get("trtllm_options") or {}
            out.update({k: rec[k] for k in ("dtype", "tp", "pp", "max_seq_len", "max_batch_size", "max_draft_len")
                        if rec.get(k) is not None and k in out})
            break
        prev = PREVIOUS.get(prev)
    if out["dtype"] not in ("float16", "bfloat16", "float32"):
        out["dtype"] = "float16"
    return out
