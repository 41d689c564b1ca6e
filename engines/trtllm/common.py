"""Helpers shared by the trtllm stages: Hugging Face sources, tokenizer files, stage settings."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Mapping

from specbuild.pipeline.errors import CheckFailed, SourceError, UsageError

from specbuild.engines.trtllm import SUPPORTED_ARCHITECTURES
from specbuild.engines.trtllm.checks import read_json
from specbuild.engines.trtllm.settings import Settings, settings_from
from specbuild.engines.trtllm.versions import detect_installed

ROLES = ("target", "draft")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "config.json")


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
    from specbuild.pipeline.stage import stage_dir
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


def merged_options(ctx, fixed: tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """Upstream's effective options overlaid with this stage's (unset = inherit).

    Keys in `fixed` were baked into the upstream artifact (e.g. tp/dtype into the checkpoint shards):
    the upstream value wins, and a different value given to this stage is reported in the returned
    notes (callers show them) instead of silently producing an inconsistent artifact.
    """
    up = ctx.upstream or {}
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
    if s.dtype == "float32":
        notes.append("dtype float32 makes TensorRT-LLM engines twice the size and speed cost of float16; "
                     "convert with --dtype float16 or bfloat16 for GPUs")
    return s, options, notes
