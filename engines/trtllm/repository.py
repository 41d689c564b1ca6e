"""Render the Triton model repository for the TensorRT-LLM backend from model_repository/trtllm templates.

Engine path (`inflight_batcher_llm`): ensemble, preprocessing, postprocessing, tensorrt_llm (target
engine), tensorrt_llm_draft (draft engine, same template), tensorrt_llm_bls (draft-target orchestration).
The templates come in one family per tensorrtllm_backend release (`backend-<family>/`, written from the
version table in upstream_facts.json, which was read from the release tags): input/output names, data
types, dims, optional flags and parameter keys are exactly the tag's. Rendering follows upstream's
`tools/fill_template.py`: every structural placeholder must be given, and a parameter we do not set keeps
its literal `${key}` value, which upstream's models read as "unset" (as after fill_template).
LLM-API path (`llmapi`): one `tensorrt_llm` Python model whose 1/model.yaml carries the LLM() arguments.

The Python model sources (`1/` of preprocessing, postprocessing, tensorrt_llm_bls and the llmapi model)
are the container's own, copied at deploy time, because the BLS loop must match the C++ backend of the
same release. `upstream_mismatches` refuses a container whose own configs differ from ours.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from specbuild.core.errors import SpecbuildError

from specbuild.core import pbtxt, upstream_facts
from specbuild.engines.trtllm.settings import Settings

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
PARAM_PLACEHOLDER = re.compile(r'string_value:\s*"\$\{([A-Za-z_][A-Za-z0-9_]*)\}"')
TARGET_MODEL = "tensorrt_llm"
DRAFT_MODEL = "tensorrt_llm_draft"
ENGINE_MODELS = ("ensemble", "preprocessing", "postprocessing", TARGET_MODEL, DRAFT_MODEL, "tensorrt_llm_bls")
# Models whose 1/ directory comes from the container (the C++ tensorrtllm backend needs only an empty 1/).
PYTHON_MODELS = {"preprocessing": "inflight_batcher_llm/preprocessing/1",
                 "postprocessing": "inflight_batcher_llm/postprocessing/1",
                 "tensorrt_llm_bls": "inflight_batcher_llm/tensorrt_llm_bls/1"}
# Configs of the container compared with ours at deploy (the C++ model's too: it has no Python source).
UPSTREAM_CONFIGS = {**{m: f"inflight_batcher_llm/{m}/config.pbtxt" for m in PYTHON_MODELS},
                    TARGET_MODEL: "inflight_batcher_llm/tensorrt_llm/config.pbtxt",
                    DRAFT_MODEL: "inflight_batcher_llm/tensorrt_llm/config.pbtxt"}
LLMAPI_PYTHON_MODELS = {"tensorrt_llm": "llmapi/tensorrt_llm/1"}


template = upstream_facts.template   # a packaged template's text, model_repository/trtllm/<relpath>


def render(text: str, values: Mapping[str, Any], name: str = "template", *, keep_unset_parameters: bool = False,
           syntax: str = "pbtxt") -> str:
    """Substitute every ${key}; refuse unknown keys so no structural placeholder survives into a config.

    A value inside double quotes is escaped for the file's `syntax` ("pbtxt": core.pbtxt, the one escaping
    of every config.pbtxt renderer; "yaml": YAML's double-quoted escapes); outside quotes a config.pbtxt
    takes only a bool, number or identifier (a YAML template may splice a block there).

    With `keep_unset_parameters` (the upstream templates), a placeholder that is a whole parameter value and
    has no value stays literal, exactly as upstream's fill_template leaves it.
    """
    needed = {m.group(1) for m in PLACEHOLDER.finditer(text)}
    optional = {m.group(1) for m in PARAM_PLACEHOLDER.finditer(text)} if keep_unset_parameters else set()
    missing = sorted(needed - optional - set(values))
    if missing:
        raise SpecbuildError(f"internal error: {name} needs values for {missing}")
    out = PLACEHOLDER.sub(lambda m: _fmt(values[m.group(1)], _in_string(m.string, m.start()), syntax)
                          if m.group(1) in values else m.group(0), text)
    left = {m.group(1) for m in PLACEHOLDER.finditer(out)}
    if left - optional:
        raise SpecbuildError(f"internal error: {name} still holds a placeholder after rendering")
    return out


def _in_string(text: str, pos: int) -> bool:
    """Whether `pos` lies inside a double-quoted string of its line (the templates put one value per quote)."""
    line = text[text.rfind("\n", 0, pos) + 1:pos]
    return len(re.findall(r'(?<!\\)"', line)) % 2 == 1


def _fmt(value: Any, in_string: bool, syntax: str = "pbtxt") -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if syntax == "yaml":
        return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") if in_string else str(value)
    return pbtxt.escape(str(value)) if in_string else pbtxt.bare(value)


def participant_ids(s: Settings) -> dict[str, str]:
    """Fast-logits MPI layout: rank 0 orchestrator, then the draft's ranks, then the target's."""
    draft = list(range(1, 1 + s.draft_world))
    target = list(range(1 + s.draft_world, 1 + s.draft_world + s.target_world))
    return {DRAFT_MODEL: ",".join(map(str, draft)), TARGET_MODEL: ",".join(map(str, target))}


def engine_values(s: Settings, role: str, engine_dir: Path) -> dict[str, Any]:
    """Placeholder values (upstream fill_template keys) of a tensorrt_llm / tensorrt_llm_draft config.

    Keys left out (e.g. max_tokens_in_paged_kv_cache, medusa_choices) stay unset, as in upstream's recipe.
    """
    values: dict[str, Any] = {
        "triton_backend": "tensorrtllm",
        "decoupled_mode": False,      # draft-target (BLS) calls both engines non-streaming
        "max_beam_width": 1,
        "batching_strategy": "inflight_fused_batching",
        "engine_dir": str(engine_dir),
        "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": (s.kv_cache_free_gpu_mem_fraction if role == "target"
                                           else s.draft_kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": True,
        "enable_chunked_context": False,
        # false is required on the BLS speculative path: upstream's loop feeds output_ids (prompt + new tokens)
        # back as the next input_ids. Clients must not override it per request there (contract.py).
        "exclude_input_in_output": False,
        "normalize_log_probs": True,
        "cancellation_check_period_ms": 100,
        "stats_check_period_ms": 100,
        "gpu_device_ids": s.target_gpu_ids if role == "target" else s.draft_gpu_ids,
        "encoder_input_features_data_type": "TYPE_FP16",
    }
    if s.fast_logits:
        values["speculative_decoding_fast_logits"] = 1
        values["participant_ids"] = participant_ids(s)[TARGET_MODEL if role == "target" else DRAFT_MODEL]
    return values


def family_of_settings(s: Settings) -> str:
    if not s.recipe.backend_family:
        raise SpecbuildError(f"internal error: no backend family for TensorRT-LLM {s.recipe.trtllm_version}")
    return s.recipe.backend_family


def engine_repository(s: Settings, *, engines_dir: Path, tokenizer_dir: Path) -> dict[str, str]:
    """{relative path: content} of the inflight_batcher_llm repository (config.pbtxt files)."""
    family = family_of_settings(s)

    def tmpl(model: str) -> str:
        return upstream_facts.packaged_template(family, model)

    # prompt_embedding_table_data_type: a data-type placeholder of the 1.2 family's tensorrt_llm / BLS (upstream's
    # own recipes fill TYPE_FP16, the type earlier releases declare literally).
    common = {"triton_max_batch_size": s.max_batch_size, "max_queue_delay_microseconds": 0, "max_queue_size": 0,
              "logits_datatype": "TYPE_FP32", "prompt_embedding_table_data_type": "TYPE_FP16"}
    files: dict[str, str] = {}
    files["ensemble/config.pbtxt"] = render(tmpl("ensemble"), common, "ensemble", keep_unset_parameters=True)
    files["preprocessing/config.pbtxt"] = render(
        tmpl("preprocessing"),
        {**common, "tokenizer_dir": tokenizer_dir, "add_special_tokens": True, "engine_dir": engines_dir / "target",
         "preprocessing_instance_count": s.max_batch_size}, "preprocessing", keep_unset_parameters=True)
    files["postprocessing/config.pbtxt"] = render(
        tmpl("postprocessing"),
        {**common, "tokenizer_dir": tokenizer_dir, "skip_special_tokens": True,
         "postprocessing_instance_count": s.max_batch_size}, "postprocessing", keep_unset_parameters=True)
    for name, role in ((TARGET_MODEL, "target"), (DRAFT_MODEL, "draft")):
        files[f"{name}/config.pbtxt"] = render(
            tmpl("tensorrt_llm"), {**common, "model_name": name, **engine_values(s, role, engines_dir / role)},
            name, keep_unset_parameters=True)
    files["tensorrt_llm_bls/config.pbtxt"] = render(
        tmpl("tensorrt_llm_bls"),
        {**common, "decoupled_mode": False, "accumulate_tokens": False, "bls_instance_count": s.bls_instance_count,
         "tensorrt_llm_model_name": TARGET_MODEL, "tensorrt_llm_draft_model_name": DRAFT_MODEL,
         "multimodal_encoders_name": ""}, "tensorrt_llm_bls", keep_unset_parameters=True)
    return files


def llmapi_repository(s: Settings, *, target_dir: Path, llm_api_yaml: str) -> dict[str, str]:
    """{relative path: content} of the llmapi repository (config.pbtxt + 1/model.yaml)."""
    values = {"trtllm_version": s.recipe.trtllm_version, "target_dir": target_dir,
              "llm_api_options": llm_api_yaml.rstrip("\n"), "decoupled": False}
    files = {"tensorrt_llm/config.pbtxt": render(template("llmapi/tensorrt_llm/config.pbtxt"), values, "llmapi"),
             "tensorrt_llm/1/model.yaml": render(template("llmapi/tensorrt_llm/1/model.yaml"), values, "model.yaml",
                                                 syntax="yaml")}
    from specbuild.engines.trtllm.llmapi import check_model_yaml
    check_model_yaml(s.recipe.trtllm_version, files["tensorrt_llm/1/model.yaml"], where="Triton's llmapi model.yaml")
    return files


def parse_config(text: str):
    """Parse config.pbtxt text into tritonclient's ModelConfig protobuf (raises on a syntax error)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def upstream_mismatches(ours: str, upstream: str) -> list[str]:
    """Where our rendered config differs from the container's (or a release tag's) own template.

    Compares, without substituting anything into upstream's placeholders (upstream_facts reads them by
    name): every input (data type, dims, optional, reshape), every output (data type, dims), and the
    parameter keys, in both directions. A data type that is a placeholder upstream (logits_datatype,
    encoder_input_features_data_type) accepts any value; the model name is not compared (the draft is
    rendered from the tensorrt_llm template).
    """
    mine, theirs = upstream_facts.extract_model(ours), upstream_facts.extract_model(upstream)
    name = mine["name"]
    problems = []
    for kind, fields in (("inputs", ("data_type", "dims", "optional", "reshape")), ("outputs", ("data_type", "dims"))):
        have = {t["name"]: t for t in mine[kind]}
        want = {t["name"]: t for t in theirs[kind]}
        word = kind[:-1]
        for tname, t in want.items():
            if tname not in have:
                problems.append(f"{name}: {word} {tname!r} missing")
                continue
            for field in fields:
                a, b = have[tname].get(field), t.get(field)
                if field == "data_type" and str(b).startswith("${"):
                    continue
                if a != b:
                    problems.append(f"{name}: {word} {tname!r} {field} is {a!r}, upstream has {b!r}")
        problems += [f"{name}: {word} {tname!r} is not declared upstream" for tname in have if tname not in want]
    for key in theirs["parameters"]:
        if key not in mine["parameters"]:
            problems.append(f"{name}: parameter {key!r} missing")
    problems += [f"{name}: parameter {key!r} is not declared upstream" for key in mine["parameters"]
                 if key not in theirs["parameters"]]
    if (mine["backend"], mine["platform"]) != (theirs["backend"], theirs["platform"]) and \
            not str(theirs["backend"]).startswith("${"):
        problems.append(f"{name}: backend {mine['backend']!r} / platform {mine['platform']!r}, upstream has "
                        f"{theirs['backend']!r} / {theirs['platform']!r}")
    return problems


def ensemble_problems(configs: Mapping[str, Any]) -> list[str]:
    """Check an ensemble against its step models like Triton does at load time.

    `configs` maps model name -> parsed ModelConfig and must hold "ensemble". Reports: unknown step
    models, unknown step inputs/outputs, dtype mismatches along the chain, required step inputs left
    unmapped, ensemble inputs never consumed, ensemble outputs never produced.
    """
    ens = configs["ensemble"]
    dtypes = {t.name: t.data_type for t in ens.input}
    consumed: set[str] = set()
    problems = []
    for step in ens.ensemble_scheduling.step:
        model = configs.get(step.model_name)
        if model is None:
            problems.append(f"step model {step.model_name!r} is not in the repository")
            continue
        ins = {t.name: t for t in model.input}
        outs = {t.name: t for t in model.output}
        for key, tensor in step.input_map.items():
            consumed.add(tensor)
            if key not in ins:
                problems.append(f"{step.model_name} has no input {key!r}")
            elif tensor not in dtypes:
                problems.append(f"{step.model_name}.{key} reads {tensor!r}, which nothing produces before it")
            elif dtypes[tensor] != ins[key].data_type:
                problems.append(f"{step.model_name}.{key} dtype differs from {tensor!r}")
        for name, t in ins.items():
            if not t.optional and name not in step.input_map:
                problems.append(f"{step.model_name} required input {name!r} is not mapped")
        for key, tensor in step.output_map.items():
            if key not in outs:
                problems.append(f"{step.model_name} has no output {key!r}")
            else:
                dtypes[tensor] = outs[key].data_type
    for t in ens.input:
        if t.name not in consumed:
            problems.append(f"ensemble input {t.name!r} is never used")
    for t in ens.output:
        if t.name not in dtypes or t.name in {i.name for i in ens.input}:
            problems.append(f"ensemble output {t.name!r} is never produced")
        elif dtypes[t.name] != t.data_type:
            problems.append(f"ensemble output {t.name!r} dtype differs from its producer")
    return problems
