"""The LLM-API (PyTorch backend) path per TensorRT-LLM release: field names, the trtllm-serve flag, and the check
that every YAML and command line we write is one the release accepts.

One dict of `LLM()` arguments serves both servers of this path (each fact's source is in the table below):
- Triton's `llmapi` model (`triton_backend/all_models/llmapi/tensorrt_llm/1/model.py`): every key of its
  `model.yaml` except `triton_config` goes through `update_llm_args_with_extra_dict({}, cfg)` into `LLM(**args)`;
- `trtllm-serve serve <model> --extra_llm_api_options <yaml>` (`--config` on 1.2), through the same function.

Upstream's rules decide: the decoding_type key, the draft field and the serve flag are read from the release's own
source (core/trtllm_schema.json, one entry per release with the commit its pages were generated from), and
`check_yaml` / `check_argv` refuse, with the field, the release and the commit, what that release would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from packaging.version import Version

from specbuild.core import trtllm_schema
from specbuild.core.errors import CheckFailed


@dataclass(frozen=True)
class LlmApiRelease:
    version: str                # the release whose facts were read (1.0.0, 1.1.0, 1.2.0, 1.2.1)
    commit: str                 # the commit its documentation pages were generated from
    decoding_type: str          # the DecodingBaseConfig.from_dict key of draft-target
    draft_key: str              # the field naming the draft model
    serve_flag: str             # trtllm-serve's YAML option
    facts: tuple[dict[str, str], ...]


_TRITON = {"id": "triton-llmapi-config", "fact": "Triton llmapi config.pbtxt: text_input, streaming, sampling_param_* "
           "(best_of, temperature, top_k, top_p, frequency/presence_penalty, max_tokens, stop, seed, "
           "exclude_input_from_output, return_perf_metrics), return_finish_reason/stop_reason/cumulative_logprob, stop "
           "-> text_output, finish_reason, stop_reason, cumulative_logprob, kv-cache, timing and speculative outputs; "
           "max_batch_size / decoupled come from model.yaml triton_config",
           "exactness": "inferred",
           "source": "NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @c8c6df08 (stored, "
                     "content exact; release unknown: the documentation pages do not render triton_backend)"}
# PR #5448 "Disable block reuse when draft model speculation is being used" (2025-06-24, merged; before the release/1.0
# cut 2025-08-07..16): the PyTorch executor turns KV-cache block reuse off, with a warning, when a drafter is used.
# Its code lives in _torch/pyexecutor, which the documentation pages do not render: dated, not read at a release.
BLOCK_REUSE = {"id": "block-reuse-off", "fact": "kv_cache_config.enable_block_reuse is not a setting on the draft-target "
               "path: the PyTorch executor turned block reuse off with a warning when a draft model is used; whether "
               "each 1.x release still does was not read (the 1.0 notes list 'two-model engine KV cache reuse'), so "
               "specbuild leaves it to the release", "exactness": "inferred",
               "source": "PR NVIDIA/TensorRT-LLM#5448 (2025-06-24, before the release/1.0 cut)"}


def _schema_version(trtllm_version: str) -> str:
    """The release whose facts apply: the version itself when read, else the newest older read release of the
    same major.minor (e.g. 1.2.2 -> 1.2.1; its facts are then inferred)."""
    key = trtllm_schema.release_key(trtllm_version)
    if key is not None:
        return key
    v = Version(str(trtllm_version))
    older = [r for r in trtllm_schema.releases() if Version(r) <= v and Version(r).release[:2] == v.release[:2]]
    if not older:
        raise KeyError(f"no release-source LLM-API facts for TensorRT-LLM {trtllm_version} (read: "
                       f"{', '.join(trtllm_schema.releases())}); use one of those or add {v.base_version} to "
                       "core/trtllm_schema.json (scripts/extract_trtllm_schema.py)")
    return older[-1]


def release(trtllm_version: str) -> LlmApiRelease:
    key = _schema_version(trtllm_version)
    f = trtllm_schema.facts(key)
    own = key == Version(str(trtllm_version)).base_version
    exact = {"exactness": "exact" if own else "inferred",
             "source": trtllm_schema.describe(key) + ("" if own else f"; {trtllm_version} itself was not read")}
    dt, field, flag = (trtllm_schema.decoding_key(key), trtllm_schema.draft_path_field(key),
                       trtllm_schema.serve_yaml_flag(key))
    read = (
        {"id": "decoding-type", "fact": f"speculative_config decoding_type {dt} (DecodingBaseConfig.from_dict keys: "
                                        f"{', '.join(f['from_dict']['DecodingBaseConfig'])})", **exact},
        {"id": "draft-key", "fact": f"the draft model is speculative_config.{field}", **exact},
        {"id": "serve-flag", "fact": f"trtllm-serve serve MODEL {flag} <yaml>",
         **{**exact, "source": f"{f['pages']['trtllm-serve']['repo']} gh-pages {f['pages']['trtllm-serve']['path']} "
                               f"(commit {f['commit'][:7]})" + ("" if own else f"; {trtllm_version} not read")}},
    )
    inferred = tuple({"id": i["what"], "fact": i["why"], "exactness": "inferred",
                      "source": trtllm_schema.describe(key)} for i in trtllm_schema.inferred(key))
    return LlmApiRelease(key, f["commit"], dt, field, flag, read + inferred + (_TRITON, BLOCK_REUSE))


def inferred_facts(trtllm_version: str) -> list[dict[str, str]]:
    return [f for f in release(trtllm_version).facts if f["exactness"] != "exact"]


def speculative_config(trtllm_version: str, *, max_draft_len: int, draft_dir: str) -> dict[str, Any]:
    r = release(trtllm_version)
    return {"decoding_type": r.decoding_type, "max_draft_len": max_draft_len, r.draft_key: draft_dir}


def _refuse(trtllm_version: str, what: str, problems: list[str]) -> None:
    if problems:
        raise CheckFailed(f"{what} would be refused by {trtllm_schema.describe(trtllm_version)}:\n  - "
                          + "\n  - ".join(problems) + "\nThis is a specbuild bug (or a release whose facts in "
                          "core/trtllm_schema.json are wrong); please report it with this message.")


def check_yaml(trtllm_version: str, data: Mapping[str, Any], *, where: str) -> None:
    """Refuse (CheckFailed) LLM() arguments the release would refuse; `data` without triton_config."""
    key = _schema_version(trtllm_version)
    _refuse(key, where, trtllm_schema.yaml_problems(key, data, where=where))


def check_model_yaml(trtllm_version: str, text: str, *, where: str = "model.yaml") -> None:
    """Triton's llmapi model.py drops triton_config and hands the rest to update_llm_args_with_extra_dict."""
    import yaml
    data = dict(yaml.safe_load(text) or {})
    data.pop("triton_config", None)
    check_yaml(trtllm_version, data, where=where)


def check_argv(trtllm_version: str, tool: str, argv: Iterable[str]) -> None:
    key = _schema_version(trtllm_version)
    _refuse(key, f"the {tool} command line", trtllm_schema.argv_problems(key, tool, list(argv)))
