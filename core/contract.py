"""The client contract: the tensors clients send to and read from a specbuild deployment.

Both backends expose the same client-facing Triton models with the same tensor names, so a client
(`specbuild infer`, the Locust load tests, `verify`, genai-perf, upstream TRT-LLM client scripts)
written against the embedded deployment runs unchanged against a TensorRT-LLM deployment.

The names, dtypes and dims are those of the upstream TensorRT-LLM Triton backend
(`triton_backend/all_models/inflight_batcher_llm/{ensemble,tensorrt_llm_bls}/config.pbtxt`,
TensorRT-LLM 0.18): dims exclude the batch dimension (the models have `max_batch_size > 0`).

- `ENSEMBLE_MODEL` ("ensemble") is plain generation; it streams when `stream=true` (decoupled).
- `SPECULATIVE_MODEL` ("tensorrt_llm_bls") additionally takes `num_draft_tokens` (0 = speculation off;
  on the embedded backend -1 = adaptive K, chosen per sequence from its acceptance)
  and `use_draft_logits`. On TensorRT-LLM this path is non-streaming, one request per call, and the
  whole TensorRT-LLM draft-target deployment is non-decoupled (nothing streams, the ensemble included);
  the embedded deployment streams. See docs/deploying-on-gpus.md.

Note on naming: later upstream backends call them `min_tokens` / `seed`; the contract uses those. The
TensorRT-LLM releases specbuild deploys (tensorrtllm_backend 0.18.x, 0.19.0) call them `min_length` /
`random_seed` and 0.18 has no perf-metric outputs: see the per-release section at the end of this module.
HTTP clients send the same names as JSON keys to `POST /v2/models/<model>/generate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

ENSEMBLE_MODEL = "ensemble"
SPECULATIVE_MODEL = "tensorrt_llm_bls"
CLIENT_MODELS = (ENSEMBLE_MODEL, SPECULATIVE_MODEL)


@dataclass(frozen=True)
class TensorSpec:
    """One client-visible tensor. `data_type` uses Triton's config spelling (TYPE_INT32, ...)."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = True
    speculative_only: bool = False   # declared only by SPECULATIVE_MODEL

    @property
    def datatype(self) -> str:
        """The KServe v2 / tritonclient spelling (INT32, FP32, BYTES, BOOL, UINT64)."""
        t = self.data_type.removeprefix("TYPE_")
        return "BYTES" if t == "STRING" else t


def _t(name: str, data_type: str, dims: tuple[int, ...] = (1,), **kw: Any) -> TensorSpec:
    return TensorSpec(name, data_type, dims, **kw)


CLIENT_INPUTS: tuple[TensorSpec, ...] = (
    _t("text_input", "TYPE_STRING", optional=False),
    _t("max_tokens", "TYPE_INT32", optional=False),
    _t("stream", "TYPE_BOOL"),
    _t("temperature", "TYPE_FP32"),
    _t("top_k", "TYPE_INT32"),
    _t("top_p", "TYPE_FP32"),
    _t("seed", "TYPE_UINT64"),
    _t("end_id", "TYPE_INT32"),
    _t("stop_words", "TYPE_STRING", (-1,)),
    _t("min_tokens", "TYPE_INT32"),
    _t("exclude_input_in_output", "TYPE_BOOL"),
    _t("return_perf_metrics", "TYPE_BOOL"),
    _t("num_draft_tokens", "TYPE_INT32", speculative_only=True),
    _t("use_draft_logits", "TYPE_BOOL", speculative_only=True),
)

CLIENT_OUTPUTS: tuple[TensorSpec, ...] = (
    _t("text_output", "TYPE_STRING", (-1,), optional=False),
    # Filled only when the request set return_perf_metrics=true.
    _t("acceptance_rate", "TYPE_FP32"),
    _t("total_accepted_draft_tokens", "TYPE_INT32"),
    _t("total_draft_tokens", "TYPE_INT32"),
)

PERF_METRIC_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


def inputs_for(model: str) -> tuple[TensorSpec, ...]:
    """The contract inputs a client-facing model must declare."""
    if model not in CLIENT_MODELS:
        raise ValueError(f"{model!r} is not a client-facing model; choose one of {CLIENT_MODELS}.")
    return tuple(t for t in CLIENT_INPUTS if model == SPECULATIVE_MODEL or not t.speculative_only)


def input_spec(name: str) -> TensorSpec:
    for t in CLIENT_INPUTS:
        if t.name == name:
            return t
    raise KeyError(f"{name!r} is not a contract input; known: {[t.name for t in CLIENT_INPUTS]}")


def contract_mismatches(model: str, inputs: Iterable[Any], outputs: Iterable[Any]) -> list[str]:
    """Compare a model's declared tensors with the contract; return human-readable problems (empty = ok).

    `inputs`/`outputs` are objects with `.name`, `.data_type` and `.dims` - e.g. the `input`/`output`
    fields of a parsed `tritonclient.grpc.model_config_pb2.ModelConfig` (data_type may be the enum int),
    or TensorSpec instances.
    """
    problems: list[str] = []
    for kind, expected, declared in (("input", inputs_for(model), inputs),
                                     ("output", CLIENT_OUTPUTS, outputs)):
        have = {d.name: d for d in declared}
        for spec in expected:
            d = have.get(spec.name)
            if d is None:
                problems.append(f"{model}: missing {kind} {spec.name!r}")
                continue
            dtype = _dtype_name(d.data_type)
            if dtype != spec.data_type:
                problems.append(f"{model}: {kind} {spec.name!r} is {dtype}, contract says {spec.data_type}")
            if tuple(d.dims) != spec.dims:
                problems.append(f"{model}: {kind} {spec.name!r} has dims {list(d.dims)}, "
                                f"contract says {list(spec.dims)}")
            if kind == "input" and not spec.optional and getattr(d, "optional", False):
                problems.append(f"{model}: input {spec.name!r} must not be optional")
    return problems


def _dtype_name(data_type: Any) -> str:
    if isinstance(data_type, int):
        from tritonclient.grpc import model_config_pb2
        return model_config_pb2.DataType.Name(data_type)
    return str(data_type)


# ---- TensorRT-LLM deployments: what each release's Triton models accept --------------------------------------
# The embedded deployment implements the contract above. A TensorRT-LLM deployment serves upstream's own
# ensemble / tensorrt_llm_bls of its release, whose inputs are in the version table
# (core/upstream_facts.json: 0.18 and 0.19 read at the tensorrtllm_backend tags; 0.20 read at
# tensorrtllm_backend c2e65b8, the tree TensorRT-LLM's triton_backend/ started from; 0.21, 1.0, 1.1, 1.2 derived
# by dated changes, each with its source and exactness). Differences a client must know:
#
# | contract name        | 0.18.x        | 0.19.0        | 0.20.0, 0.21.0 | 1.0.0, 1.1.0, 1.2.0, 1.2.1                     |
# |----------------------|---------------|---------------|----------------|------------------------------------------------|
# | seed                 | random_seed   | random_seed   | seed           | seed                                           |
# | min_tokens           | min_length    | min_length    | min_tokens     | min_tokens                                     |
# | return_perf_metrics  | absent        | present       | present        | present                                        |
# | return_num_input_tokens / return_num_output_tokens -> num_input_tokens / num_output_tokens | absent | absent | absent | present (inferred, PR #5445); the BLS fills them from 1.2 (#8150) |
# | stream on the BLS with num_draft_tokens > 0 | required, false (validate calls stream.any()) | same | same | same |
# | length_penalty / early_stopping | honoured | honoured | honoured | silently ignored by the C++ model on 1.2.x (#13633) |
#
# On the BLS speculative path (num_draft_tokens > 0) every release needs exclude_input_in_output false (its loop
# feeds output_ids back as the prompt) and returns text_output = prompt + completion; the client strips the prompt
# itself. Its perf-metric outputs describe the last round only: acceptance is measured client-side.
# The LLM-API path (Triton's llmapi model `tensorrt_llm`, 1.0 .. 1.2.x) takes text_input, streaming and
# sampling_param_* tensors instead (LLMAPI_NAMES); trtllm-serve speaks the OpenAI API.

TRTLLM_RENAMES = {"seed": "random_seed", "min_tokens": "min_length"}


def trtllm_family(target: str) -> str | None:
    """'trtllm-0.18' -> '0.18'; anything else ('embedded', the llmapi path's 'trtllm-llmapi') -> None."""
    if target == LLMAPI_TARGET:
        return None
    return target.removeprefix("trtllm-") if target.startswith("trtllm-") else None


def trtllm_input_names(family: str, model: str) -> set[str]:
    from specbuild.core.upstream_facts import input_names
    return input_names(family, model)


def contract_name_for(family: str, model: str, name: str) -> str | None:
    """The tensor a release declares for a contract input (renamed where needed), None if it has none."""
    names = trtllm_input_names(family, model)
    if name in names:
        return name
    renamed = TRTLLM_RENAMES.get(name)
    return renamed if renamed in names else None


def request_problems(target: str, model: str, request: dict[str, Any]) -> list[str]:
    """Why `request` (tensor name -> value) would fail or be silently ignored on `target` ('embedded' or
    'trtllm-<family>'); empty = fine. Clients call this before sending to a TensorRT-LLM deployment."""
    family = trtllm_family(target)
    if family is None:
        known = {t.name for t in inputs_for(model)}
        return [f"{model}: {n!r} is not a contract input" for n in request if n not in known and n != "proposer"]
    names = trtllm_input_names(family, model)
    problems = []
    older = {v: k for k, v in TRTLLM_RENAMES.items()}      # random_seed -> seed (0.19 and earlier -> 0.20 on)
    for key in request:
        if key in names:
            continue
        renamed = TRTLLM_RENAMES.get(key)
        if renamed in names:
            problems.append(f"{model} (tensorrtllm_backend {family}): {key!r} is called {renamed!r} in this release")
        elif older.get(key) in names:
            problems.append(f"{model} (TensorRT-LLM {family}): no input {key!r} in this release; it is called "
                            f"{older[key]!r} from 0.20 on")
        else:
            problems.append(f"{model} (tensorrtllm_backend {family}): no input {key!r} in this release; Triton "
                            "rejects the request")
    speculative = model == SPECULATIVE_MODEL and int(request.get("num_draft_tokens") or 0) > 0
    if speculative:
        if request.get("exclude_input_in_output"):
            problems.append(f"{model} (tensorrtllm_backend {family}): exclude_input_in_output=true breaks upstream's "
                            "speculative loop (it assumes output_ids hold the prompt); send false and strip the "
                            "prompt from text_output")
        if "stream" not in request:
            problems.append(f"{model} (tensorrtllm_backend {family}): send stream=false with num_draft_tokens > 0 "
                            "(upstream's validate calls stream.any(); without it the request fails)")
        elif request.get("stream"):
            problems.append(f"{model} (tensorrtllm_backend {family}): streaming is not supported with speculative "
                            "decoding (upstream BLS)")
    return problems


# The contract's names as the LLM-API path's Triton model (`tensorrt_llm`, llmapi) takes them
# (triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @c8c6df08; engines/trtllm/llmapi.py).
LLMAPI_MODEL = "tensorrt_llm"
LLMAPI_TARGET = "trtllm-llmapi"        # client.deployment_target of an llmapi deployment (no version-table family)
LLMAPI_NAMES = {"text_input": "text_input", "stream": "streaming", "max_tokens": "sampling_param_max_tokens",
                "temperature": "sampling_param_temperature", "top_k": "sampling_param_top_k",
                "top_p": "sampling_param_top_p", "seed": "sampling_param_seed", "stop_words": "sampling_param_stop",
                "return_perf_metrics": "sampling_param_return_perf_metrics",
                "exclude_input_in_output": "sampling_param_exclude_input_from_output"}


def llmapi_request(request: dict[str, Any]) -> dict[str, Any]:
    """A contract request in the llmapi model's names; refuses what that model has no input for (num_draft_tokens:
    its speculation is fixed by model.yaml's speculative_config; min_tokens, end_id: not declared)."""
    out, missing = {}, []
    for key, value in request.items():
        if key in LLMAPI_NAMES:
            out[LLMAPI_NAMES[key]] = value
        elif key == "num_draft_tokens" and value is not None:
            missing.append(f"{key} (speculation is set by model.yaml's speculative_config, not per request)")
        elif key != "proposer":
            missing.append(key)
    if missing:
        raise ValueError(f"the llmapi model ({LLMAPI_MODEL}) has no input for {', '.join(missing)}; leave them out")
    return out
