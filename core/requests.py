"""Request shaping: the client contract's request (`request_body`) as each deployment takes it
(`adapt_request`: the embedded engine as is, a TensorRT-LLM release's own names, Triton's llmapi model), and
the model a client talks to (`client_model`). No transport: `specbuild.pipeline.client` sends these, and the
load tests send the same bodies."""

from __future__ import annotations

from typing import Any

from specbuild.core import contract
from specbuild.core.errors import ServerError


class RequestError(ServerError):
    """The server refused or failed one request; `str(e)` holds Triton's message."""


EMBEDDED = "embedded"


def adapt_request(target: str, model: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The contract request `body` as the deployment `target` takes it; returns (body, prompt_echoed).

    Embedded: unchanged. A TensorRT-LLM deployment serves upstream's own ensemble / tensorrt_llm_bls of its
    release (`contract.request_problems` has the table): `seed`/`min_tokens` are sent as `random_seed`/
    `min_length`; `return_perf_metrics` is left out where the release has no perf-metric outputs (v0.18);
    `proposer` (embedded-only) is left out; on the BLS speculative path (num_draft_tokens > 0) the request
    goes with stream=false and exclude_input_in_output=false (upstream's loop needs both), so text_output
    echoes the prompt and `prompt_echoed` is True. Streaming with speculation is refused with the reason.
    """
    if target == contract.LLMAPI_TARGET:
        return _llmapi_body(body), False
    family = contract.trtllm_family(target)
    if family is None:
        return body, False
    names = contract.trtllm_input_names(family, model)
    out: dict[str, Any] = {}
    for key, value in body.items():
        name = contract.contract_name_for(family, model, key)
        if name is not None:
            out[name] = value
        elif key in ("return_perf_metrics", "proposer"):
            continue                      # no such output in this release / embedded-only choice
        else:
            raise RequestError(f"{model} of tensorrtllm_backend {family} has no input {key!r}; leave it out "
                               f"(inputs of this release: {', '.join(sorted(names))}).")
    echoed = False
    if model == contract.SPECULATIVE_MODEL and int(out.get("num_draft_tokens") or 0) > 0:
        if out.get("stream"):
            raise RequestError(f"{model} of tensorrtllm_backend {family} cannot stream with speculation "
                               "(num_draft_tokens > 0): upstream's BLS drives the draft and target models "
                               "non-decoupled. Use stream=false, or num_draft_tokens=0 for streaming.")
        out["stream"] = False
        out["exclude_input_in_output"] = False
        echoed = True
    problems = contract.request_problems(target, model, out)
    if problems:
        raise RequestError("; ".join(problems))
    return out, echoed


def _llmapi_body(body: dict[str, Any]) -> dict[str, Any]:
    """The contract request in the llmapi model's names (`contract.llmapi_request`). Its speculation is fixed by
    model.yaml's speculative_config, so a request's num_draft_tokens is refused with the reason (0 included: it
    would not switch speculation off)."""
    try:
        return contract.llmapi_request(body)
    except ValueError as e:
        raise RequestError(f"{e}. To compare speculation on and off, serve the target a second time without "
                           "speculative_config and give that server to `verify --reference-url` (or as a "
                           "load-test setting's url=).") from None


def client_model(target: str, model: str) -> str:
    """The Triton model a client talks to: the llmapi path has one (`tensorrt_llm`) for every contract model."""
    return contract.LLMAPI_MODEL if target == contract.LLMAPI_TARGET else model


def request_body(prompt: str, *, max_tokens: int = 64, stream: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 end_id: int | None = None, stop_words: list[str] | None = None, min_tokens: int | None = None,
                 num_draft_tokens: int | None = None, return_perf_metrics: bool = False,
                 exclude_input_in_output: bool = True, proposer: str | None = None) -> dict[str, Any]:
    """The contract tensors as a name -> value dict (None values are left out).

    `proposer` ("draft" | "ngram") is an embedded-deployment extension, not part of the contract.
    """
    body = {"text_input": prompt, "max_tokens": max_tokens, "stream": stream, "temperature": temperature,
            "top_k": top_k, "top_p": top_p, "seed": seed, "end_id": end_id, "stop_words": stop_words,
            "min_tokens": min_tokens, "num_draft_tokens": num_draft_tokens,
            "return_perf_metrics": return_perf_metrics or None,
            "exclude_input_in_output": exclude_input_in_output, "proposer": proposer}
    return {k: v for k, v in body.items() if v is not None}
