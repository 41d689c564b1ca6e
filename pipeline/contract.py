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


# ---- TensorRT-LLM deployments: what each pinned tensorrtllm_backend release accepts -----------------------
# The embedded deployment implements the contract above. A TensorRT-LLM deployment serves upstream's own
# ensemble / tensorrt_llm_bls of its release, whose inputs are read from the release tags into
# engines/trtllm/upstream_facts.json. Differences a client must know (tags v0.18.0-v0.18.2, v0.19.0):
#
# | contract name          | v0.18.x                        | v0.19.0                         |
# |------------------------|--------------------------------|---------------------------------|
# | seed                   | random_seed                    | random_seed                     |
# | min_tokens             | min_length                     | min_length                      |
# | return_perf_metrics    | absent (return_kv_cache_reuse_stats) | present, with acceptance_rate, total_accepted_draft_tokens, total_draft_tokens |
# | stream on the BLS with num_draft_tokens > 0 | required, false (validate calls stream.any()) | required, false (same) |
#
# On the BLS speculative path (num_draft_tokens > 0) both releases need exclude_input_in_output false (their
# loop feeds output_ids back as the prompt) and return text_output = prompt + completion; the client strips the
# prompt itself. Without perf-metric outputs, acceptance is measured client-side (tokens per round).

TRTLLM_RENAMES = {"seed": "random_seed", "min_tokens": "min_length"}


def trtllm_family(target: str) -> str | None:
    """'trtllm-0.18' -> '0.18'; anything else (e.g. 'embedded') -> None."""
    return target.removeprefix("trtllm-") if target.startswith("trtllm-") else None


def trtllm_input_names(family: str, model: str) -> set[str]:
    from specbuild.engines.trtllm.upstream_facts import input_names
    return input_names(family, model)


def trtllm_output_names(family: str, model: str) -> set[str]:
    from specbuild.engines.trtllm.upstream_facts import output_names
    return output_names(family, model)


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
    for key in request:
        if key in names:
            continue
        renamed = TRTLLM_RENAMES.get(key)
        if renamed in names:
            problems.append(f"{model} (tensorrtllm_backend {family}): {key!r} is called {renamed!r} in this release")
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
