"""The LLM-API (PyTorch backend) path per TensorRT-LLM release: field names, the trtllm-serve flag, and where each
fact comes from (exact = read in code of that era, release attribution dated by PRs = inferred).

One dict of `LLM()` arguments serves both servers of this path (each fact's source is in the table below):
- Triton's `llmapi` model (`triton_backend/all_models/llmapi/tensorrt_llm/1/model.py`): every key of its
  `model.yaml` except `triton_config` goes through `update_llm_args_with_extra_dict({}, cfg)` into `LLM(**args)`;
- `trtllm-serve <model> --extra_llm_api_options <yaml>` (`--config` from 1.2), through the same function.

`speculative_config` is dispatched by `DecodingBaseConfig.from_dict` on `decoding_type`; 1.x configs are
`StrictBaseModel`s, so an unknown key (e.g. 0.20's `pytorch_backend_config`) is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packaging.version import Version


@dataclass(frozen=True)
class LlmApiRelease:
    family: str                 # major.minor
    decoding_type: str          # the speculative_config decoding_type of draft-target
    draft_key: str              # the field naming the draft model
    serve_flag: str             # trtllm-serve's YAML option
    facts: tuple[dict[str, str], ...]


_DT_1X = {"id": "decoding-type", "fact": "speculative_config decoding_type DraftTarget, draft in speculative_model_dir "
          "(DecodingBaseConfig(StrictBaseModel) fields max_draft_len, speculative_model_dir; from_dict dispatch dict "
          "has 'DraftTarget': DraftTargetDecodingConfig; 'Draft_Target' is not in it: ValueError 'Invalid decoding type')",
          "exactness": "inferred",
          "source": "NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py stored versions (index ids 1520735490: 1.0 era "
                    "with UserProvided/AUTO; 1090804222: 1.1 era with SaveState), content exact; release by feature dates"}
_SERVE_1X = {"id": "serve-flag", "fact": "trtllm-serve takes the YAML as --extra_llm_api_options (no --config alias "
             "before PR #9104, 2025-11-12)", "exactness": "inferred",
             "source": "tensorrt_llm/commands/serve.py stored versions; PR NVIDIA/TensorRT-LLM#9104"}
_TRITON = {"id": "triton-llmapi-config", "fact": "Triton llmapi config.pbtxt: text_input, streaming, sampling_param_* "
           "(best_of, temperature, top_k, top_p, frequency/presence_penalty, max_tokens, stop, seed, "
           "exclude_input_from_output, return_perf_metrics), return_finish_reason/stop_reason/cumulative_logprob, stop "
           "-> text_output, finish_reason, stop_reason, cumulative_logprob, kv-cache, timing and speculative outputs; "
           "max_batch_size / decoupled come from model.yaml triton_config",
           "exactness": "inferred",
           "source": "NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @c8c6df08 (stored, "
                     "content exact; release unknown); release notes 1.0 'Add request_perf_metrics to triton LLMAPI "
                     "backend', 'Add support for Triton request cancellation'"}

RELEASES = {
    "1.0": LlmApiRelease("1.0", "DraftTarget", "speculative_model_dir", "--extra_llm_api_options",
                         (_DT_1X, _SERVE_1X, _TRITON)),
    "1.1": LlmApiRelease("1.1", "DraftTarget", "speculative_model_dir", "--extra_llm_api_options",
                         (_DT_1X, _SERVE_1X, _TRITON)),
    "1.2": LlmApiRelease("1.2", "Draft_Target", "speculative_model", "--config", (
        {"id": "draft-key", "fact": "the draft is speculative_model (speculative_model_dir kept as an alias)",
         "exactness": "inferred", "source": "PR NVIDIA/TensorRT-LLM#10099 (2025-12-18, before the release/1.2 cut "
                                            "2026-01-12..26): renamed with AliasChoices; llm_args.py index id 7019226376"},
        {"id": "decoding-type", "fact": "decoding_type Draft_Target (the DraftTargetDecodingConfig Literal; "
                                        "'DraftTarget' is recorded as an alias for warnings)",
         "exactness": "inferred", "source": "llm_args.py index ids 7019226376, 55143598664 (release unknown); "
                                            "triton-inference-server/tutorials Feature_Guide/Speculative_Decoding/"
                                            "TRT-LLM/README.md @4fe2b90 (2026-04-21) model.yaml uses Draft_Target"},
        {"id": "serve-flag", "fact": "trtllm-serve --config <yaml> (alias of --extra_llm_api_options)",
         "exactness": "inferred", "source": "PR NVIDIA/TensorRT-LLM#9104 (2025-11-12)"},
        _TRITON)),
}


def release(trtllm_version: str) -> LlmApiRelease:
    v = Version(str(trtllm_version))
    key = f"{v.major}.{v.minor}"
    if key not in RELEASES:
        raise KeyError(f"no LLM-API facts for TensorRT-LLM {trtllm_version}; known: {sorted(RELEASES)}")
    return RELEASES[key]


def inferred_facts(trtllm_version: str) -> list[dict[str, str]]:
    return [f for f in release(trtllm_version).facts if f["exactness"] != "exact"]


def speculative_config(trtllm_version: str, *, max_draft_len: int, draft_dir: str) -> dict[str, Any]:
    r = release(trtllm_version)
    return {"decoding_type": r.decoding_type, "max_draft_len": max_draft_len, r.draft_key: draft_dir}
