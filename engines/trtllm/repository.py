"""Render the Triton model repository for the TensorRT-LLM backend from model_repository/trtllm templates.

Engine path (`inflight_batcher_llm`): ensemble, preprocessing, postprocessing, tensorrt_llm (target
engine), tensorrt_llm_draft (draft engine, same template), tensorrt_llm_bls (draft-target orchestration).
LLM-API path (`llmapi`): one `tensorrt_llm` Python model whose 1/model.yaml carries the LLM() arguments.

Choice (see docs/deploying-on-gpus.md): the `config.pbtxt` files are ours (rendered here, tested as
data); the Python model sources (`1/model.py` of preprocessing, postprocessing, tensorrt_llm_bls and
the llmapi model) are the container's own, copied at deploy time from the pinned image, because the
BLS loop must match the C++ backend of the same release. `upstream_mismatches` refuses a container
whose own configs declare tensors ours lack.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from specbuild.pipeline.errors import SpecbuildError

from specbuild.engines.trtllm.settings import Settings

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
TARGET_MODEL = "tensorrt_llm"
DRAFT_MODEL = "tensorrt_llm_draft"
ENGINE_MODELS = ("ensemble", "preprocessing", "postprocessing", TARGET_MODEL, DRAFT_MODEL, "tensorrt_llm_bls")
# Models whose 1/ directory comes from the container (the C++ tensorrtllm backend needs only an empty 1/).
PYTHON_MODELS = {"preprocessing": "inflight_batcher_llm/preprocessing/1",
                 "postprocessing": "inflight_batcher_llm/postprocessing/1",
                 "tensorrt_llm_bls": "inflight_batcher_llm/tensorrt_llm_bls/1"}
LLMAPI_PYTHON_MODELS = {"tensorrt_llm": "llmapi/tensorrt_llm/1"}


def template(relpath: str) -> str:
    root = resources.files("specbuild.model_repository") / "trtllm"
    return (root / relpath).read_text()


def render(text: str, values: Mapping[str, Any], name: str = "template") -> str:
    """Substitute every ${key}; refuse unknown keys so no placeholder can survive into a config."""
    missing = sorted({m.group(1) for m in PLACEHOLDER.finditer(text)} - set(values))
    if missing:
        raise SpecbuildError(f"internal error: {name} needs values for {missing}")
    out = PLACEHOLDER.sub(lambda m: _fmt(values[m.group(1)]), text)
    if "${" in out:
        raise SpecbuildError(f"internal error: {name} still holds a placeholder after rendering")
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _param_block(params: Mapping[str, Any]) -> str:
    lines = []
    for key, value in params.items():
        text = _fmt(value).replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'parameters: {{ key: "{key}" value: {{ string_value: "{text}" }} }}')
    return "\n".join(lines)


def participant_ids(s: Settings) -> dict[str, str]:
    """Fast-logits MPI layout: rank 0 orchestrator, then the draft's ranks, then the target's."""
    draft = list(range(1, 1 + s.draft_world))
    target = list(range(1 + s.draft_world, 1 + s.draft_world + s.target_world))
    return {DRAFT_MODEL: ",".join(map(str, draft)), TARGET_MODEL: ",".join(map(str, target))}


def engine_parameters(s: Settings, role: str, engine_dir: Path) -> dict[str, Any]:
    """Every parameter of a tensorrt_llm / tensorrt_llm_draft config (no placeholder left unset)."""
    params: dict[str, Any] = {
        "max_beam_width": 1,
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": str(engine_dir),
        "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": (s.kv_cache_free_gpu_mem_fraction if role == "target"
                                           else s.draft_kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": True,
        "enable_chunked_context": False,
        "exclude_input_in_output": s.exclude_input_in_output,
        "normalize_log_probs": True,
        "cancellation_check_period_ms": 100,
        "stats_check_period_ms": 100,
        "gpu_device_ids": s.target_gpu_ids if role == "target" else s.draft_gpu_ids,
        "encoder_input_features_data_type": "TYPE_FP16",
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
    }
    if s.fast_logits:
        params["speculative_decoding_fast_logits"] = 1
        params["participant_ids"] = participant_ids(s)[TARGET_MODEL if role == "target" else DRAFT_MODEL]
    return params


def engine_repository(s: Settings, *, engines_dir: Path, tokenizer_dir: Path) -> dict[str, str]:
    """{relative path: content} of the inflight_batcher_llm repository (config.pbtxt files)."""
    common = {"trtllm_version": s.recipe.trtllm_version, "triton_max_batch_size": s.max_batch_size,
              "max_queue_delay_microseconds": 0, "max_queue_size": 0, "logits_datatype": "TYPE_FP32"}
    files: dict[str, str] = {}
    base = "inflight_batcher_llm"
    files["ensemble/config.pbtxt"] = render(template(f"{base}/ensemble/config.pbtxt"),
                                            {**common, "tensorrt_llm_model_name": TARGET_MODEL}, "ensemble")
    files["preprocessing/config.pbtxt"] = render(
        template(f"{base}/preprocessing/config.pbtxt"),
        {**common, "tokenizer_dir": tokenizer_dir, "add_special_tokens": True,
         "engine_dir": engines_dir / "target", "preprocessing_instance_count": s.max_batch_size}, "preprocessing")
    files["postprocessing/config.pbtxt"] = render(
        template(f"{base}/postprocessing/config.pbtxt"),
        {**common, "tokenizer_dir": tokenizer_dir, "skip_special_tokens": True,
         "postprocessing_instance_count": s.max_batch_size}, "postprocessing")
    for name, role in ((TARGET_MODEL, "target"), (DRAFT_MODEL, "draft")):
        # Draft-target (BLS) calls both engines non-streaming: decoupled false on both.
        files[f"{name}/config.pbtxt"] = render(
            template(f"{base}/tensorrt_llm/config.pbtxt"),
            {**common, "model_name": name, "decoupled_mode": False,
             "parameters": _param_block(engine_parameters(s, role, engines_dir / role))}, name)
    files["tensorrt_llm_bls/config.pbtxt"] = render(
        template(f"{base}/tensorrt_llm_bls/config.pbtxt"),
        {**common, "decoupled_mode": False, "accumulate_tokens": False, "bls_instance_count": s.bls_instance_count,
         "tensorrt_llm_model_name": TARGET_MODEL, "tensorrt_llm_draft_model_name": DRAFT_MODEL},
        "tensorrt_llm_bls")
    return files


def llmapi_repository(s: Settings, *, target_dir: Path, llm_api_yaml: str) -> dict[str, str]:
    """{relative path: content} of the llmapi repository (config.pbtxt + 1/model.yaml)."""
    values = {"trtllm_version": s.recipe.trtllm_version, "target_dir": target_dir,
              "llm_api_options": llm_api_yaml.rstrip("\n"), "decoupled": False}
    return {"tensorrt_llm/config.pbtxt": render(template("llmapi/tensorrt_llm/config.pbtxt"), values, "llmapi"),
            "tensorrt_llm/1/model.yaml": render(template("llmapi/tensorrt_llm/1/model.yaml"), values, "model.yaml")}


def parse_config(text: str):
    """Parse config.pbtxt text into tritonclient's ModelConfig protobuf (raises on a syntax error)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def upstream_mismatches(ours: str, upstream: str) -> list[str]:
    """Tensors the container's own config declares that ours lacks or types differently.

    The container's Python models look their output configs up by name at start-up, so ours must
    declare every output and every required input theirs does (placeholders in their template are
    neutralised before parsing).
    """
    upstream = PLACEHOLDER.sub(lambda m: "1" if "batch" in m.group(1) or "count" in m.group(1) else
                               ("TYPE_FP32" if "datatype" in m.group(1) else "false"), upstream)
    mine, theirs = parse_config(ours), parse_config(upstream)
    problems = []
    for kind in ("input", "output"):
        have = {t.name: t for t in getattr(mine, kind)}
        for t in getattr(theirs, kind):
            if kind == "input" and t.optional:
                continue  # absent optional inputs read as None in the Python models
            if t.name not in have:
                problems.append(f"{theirs.name}: {kind} {t.name!r} missing")
            elif have[t.name].data_type != t.data_type:
                problems.append(f"{theirs.name}: {kind} {t.name!r} type differs")
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
