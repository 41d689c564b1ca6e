"""Turn the client-contract tensors of one Triton request into engine arguments (no Triton imports).

Used by the `tensorrt_llm` Python-backend model of the embedded deployment; kept free of
`triton_python_backend_utils` so it is unit-tested without a server. Every refusal raises
`BadRequest` with a message that names the tensor and the accepted range: the model turns it into a
Triton error for that request only, and the server keeps serving the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


class BadRequest(ValueError):
    """A request the engine cannot run; `str(e)` is sent back to the client."""


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    max_draft_len: int
    has_draft: bool = True


@dataclass(frozen=True)
class ParsedRequest:
    prompt: str
    stream: bool
    sampling: dict[str, Any]          # keyword arguments of SamplingParams
    num_draft_tokens: int | None      # None => engine default; 0 => speculation off
    exclude_input_in_output: bool
    return_perf_metrics: bool
    proposer: str | None = None       # None => engine default; "draft" | "ngram" (embedded-only input)


def _scalar(get: Callable[[str], np.ndarray | None], name: str, kind: str, default: Any = None) -> Any:
    arr = get(name)
    if arr is None:
        return default
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise BadRequest(f"{name} must hold exactly one value per request (got {flat.size}); "
                         "send one prompt per request.")
    v = flat[0]
    if kind == "bool":
        return bool(v)
    if kind == "int":
        return int(v)
    if kind == "float":
        return float(v)
    return v


def _text(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start}); "
                             "send UTF-8 encoded text.") from None
    return str(value)


def parse_request(get: Callable[[str], np.ndarray | None], limits: Limits) -> ParsedRequest:
    """`get(name)` returns the input tensor as a numpy array, or None when the client left it out."""
    raw = _scalar(get, "text_input", "raw")
    if raw is None:
        raise BadRequest("text_input is missing; send the prompt as a BYTES tensor named text_input.")
    prompt = _text(raw, "text_input")
    if not prompt:
        raise BadRequest("text_input is empty; send a non-empty prompt.")
    max_tokens = _scalar(get, "max_tokens", "int")
    if max_tokens is None:
        raise BadRequest("max_tokens is missing; send the number of tokens to generate (INT32 > 0).")
    if max_tokens <= 0:
        raise BadRequest(f"max_tokens must be > 0 (got {max_tokens}).")
    if max_tokens >= limits.max_seq_len:
        raise BadRequest(f"max_tokens={max_tokens} is beyond the engine's max sequence length "
                         f"{limits.max_seq_len} (prompt + output must fit); lower max_tokens or rebuild "
                         "with a larger --max-seq-len.")
    temperature = _scalar(get, "temperature", "float", 0.0)
    if not temperature >= 0.0:
        raise BadRequest(f"temperature must be >= 0 (got {temperature}); 0 means greedy.")
    top_k = _scalar(get, "top_k", "int", 0)
    if top_k < 0:
        raise BadRequest(f"top_k must be >= 0 (got {top_k}); 0 disables top-k.")
    top_p = _scalar(get, "top_p", "float", 1.0)
    if top_p == 0.0:
        top_p = 1.0  # upstream TRT-LLM clients send top_p=0 to mean "off"
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in [0, 1] (got {top_p}); 0 or 1 disables top-p.")
    min_tokens = _scalar(get, "min_tokens", "int", None)
    if min_tokens is None:
        min_tokens = _scalar(get, "min_length", "int", 0)
    if min_tokens < 0:
        raise BadRequest(f"min_tokens must be >= 0 (got {min_tokens}).")
    seed = _scalar(get, "seed", "int", None)
    end_id = _scalar(get, "end_id", "int", None)
    stops = get("stop_words")
    stop = tuple(_text(s, "stop_words") for s in np.asarray(stops).reshape(-1)) if stops is not None else ()
    stop = tuple(s for s in stop if s)
    k = _scalar(get, "num_draft_tokens", "int", None)
    if k is not None:
        if k < -1:
            raise BadRequest(f"num_draft_tokens must be >= 0, or -1 for adaptive K (got {k}); "
                             "0 turns speculation off.")
        if k > limits.max_draft_len:
            raise BadRequest(f"num_draft_tokens={k} is above the built maximum {limits.max_draft_len}; "
                             f"send at most {limits.max_draft_len} or rebuild with a larger --max-draft-len.")
    proposer = _scalar(get, "proposer", "raw", None)
    if proposer is not None:
        proposer = _text(proposer, "proposer").strip().lower()
        if proposer not in ("draft", "ngram"):
            raise BadRequest(f"proposer must be 'draft' or 'ngram' (got {proposer!r}).")
        if proposer == "draft" and not limits.has_draft:
            raise BadRequest("proposer 'draft' needs a draft model, and this engine was built without one; "
                             "send proposer='ngram' or rebuild with a draft.")
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "seed": seed, "min_tokens": min(min_tokens, max_tokens), "stop": stop}
    if end_id is not None:
        sampling["stop_token_ids"] = (end_id,)
    return ParsedRequest(
        prompt=prompt,
        stream=_scalar(get, "stream", "bool", False),
        sampling=sampling,
        num_draft_tokens=k,
        proposer=proposer,
        exclude_input_in_output=_scalar(get, "exclude_input_in_output", "bool", False),
        return_perf_metrics=_scalar(get, "return_perf_metrics", "bool", False),
    )


def perf_metrics(stats: Any) -> dict[str, np.ndarray]:
    """The contract's perf-metric outputs from a SpecStats (zeros when speculation was off)."""
    drafted = int(getattr(stats, "num_draft_tokens", 0) or 0) if stats is not None else 0
    accepted = int(getattr(stats, "num_accepted_tokens", 0) or 0) if stats is not None else 0
    rate = accepted / drafted if drafted else 0.0
    return {"acceptance_rate": np.array([[rate]], dtype=np.float32),
            "total_accepted_draft_tokens": np.array([[accepted]], dtype=np.int32),
            "total_draft_tokens": np.array([[drafted]], dtype=np.int32)}
