"""Pre-flight refusals for the TensorRT-LLM draft-target path, callable by the server and client side.

Each check raises CheckFailed whose message names the fix.
Sources: upstream's draft-target docs and issues #473, #676, #2789, #3615 (docs/deploying-on-gpus.md, "Limits of
the BLS draft-target path"); the release facts are in the version table, core/upstream_facts.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from specbuild.core.errors import CheckFailed

# SpeculativeDecodingMode bit flags as stored (an integer) in the engine's build_config.
SPEC_MODE_BITS = {1: "none", 2: "draft_tokens_external", 4: "medusa", 8: "lookahead_decoding",
                  16: "explicit_draft_tokens", 32: "eagle"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise CheckFailed(f"{path} does not exist; re-run the stage that writes it.") from e
    except ValueError as e:
        raise CheckFailed(f"{path} is not valid JSON ({e}); re-run the stage that writes it.") from e


def speculative_mode(engine_config: Mapping[str, Any]) -> str:
    """The engine's speculative decoding mode as a name ('none' when absent)."""
    build = engine_config.get("build_config") or {}
    pre = engine_config.get("pretrained_config") or {}
    raw = build.get("speculative_decoding_mode", pre.get("speculative_decoding_mode"))
    if raw is None:
        return "none"
    if isinstance(raw, int):
        return "|".join(name for bit, name in SPEC_MODE_BITS.items() if raw & bit) or "none"
    return str(raw).lower().removeprefix("speculativedecodingmode.")


def engine_max_draft_len(engine_config: Mapping[str, Any]) -> int:
    build = engine_config.get("build_config") or {}
    pre = engine_config.get("pretrained_config") or {}
    return int(build.get("max_draft_len") or pre.get("max_draft_len") or 0)


def validate_engine_config(engine_config: Mapping[str, Any], role: str, *, max_draft_len: int | None = None,
                           use_draft_logits: bool = False) -> dict[str, Any]:
    """Check a built engine's config.json; return the facts checked. `role` is 'target' or 'draft'."""
    mode = speculative_mode(engine_config)
    built_k = engine_max_draft_len(engine_config)
    build = engine_config.get("build_config") or {}
    if role == "target":
        if "draft_tokens_external" not in mode:
            raise CheckFailed(f"the target engine was built without speculative decoding (mode {mode!r}); it would "
                              "refuse every draft token ('larger than maximum number of draft tokens (0)'). Rebuild "
                              "it with `trtllm-build ... --speculative_decoding_mode draft_tokens_external "
                              "--max_draft_len K` (specbuild build --backend trtllm does this).")
        if built_k < 1:
            raise CheckFailed("the target engine has max_draft_len 0; rebuild with --max_draft_len K (K >= 1).")
        if max_draft_len is not None and built_k < max_draft_len:
            raise CheckFailed(f"the target engine was built with max_draft_len {built_k} but {max_draft_len} was "
                              f"requested; rebuild with --max-draft-len {max_draft_len} or lower the request.")
    elif role == "draft":
        if use_draft_logits and not build.get("gather_generation_logits", False):
            raise CheckFailed("the draft engine was built without --gather_generation_logits but draft logits are "
                              "used; rebuild the draft with --gather_generation_logits or drop --use-draft-logits.")
    else:
        raise ValueError(f"role must be 'target' or 'draft', not {role!r}")
    plugin = build.get("plugin_config") or {}
    if plugin and plugin.get("use_paged_context_fmha") is False:
        raise CheckFailed(f"the {role} engine was built without paged context FMHA, which draft-target needs for "
                          "KV-cache reuse; rebuild with --use_paged_context_fmha enable.")
    return {"role": role, "speculative_decoding_mode": mode, "max_draft_len": built_k}


def check_vocab(target_config: Mapping[str, Any], draft_config: Mapping[str, Any]) -> int:
    """Draft and target must share a vocabulary (sizes from the model configs, not the tokenizer)."""
    tv, dv = target_config.get("vocab_size"), draft_config.get("vocab_size")
    if tv is None or dv is None:
        raise CheckFailed("a model config has no vocab_size; pass Hugging Face checkpoints with a config.json.")
    if int(tv) != int(dv):
        raise CheckFailed(f"vocab mismatch: target vocab_size {tv}, draft vocab_size {dv}. TensorRT-LLM draft-target "
                          "needs identical vocabularies (buffer-size errors otherwise); pick a draft from the same "
                          "family, or pad the draft's embedding and lm_head to the target's vocab_size.")
    return int(tv)
