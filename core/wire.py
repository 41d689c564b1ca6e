"""The wire format every client of a deployment speaks, in one place (no transport here).

Used by `pipeline/client.py` (infer, verify), the Locust users (`loadtests/triton_user.py`: the KServe and
the OpenAI APIs), the independent client (`loadtests/independent_client.py`) and the
load test's smoke request (`loadtests/target.py`). Three APIs:

- `kserve`: Triton's KServe v2 generate extension: `POST /v2/models/<m>/generate` (one JSON answer) and
  `/generate_stream` (SSE), and gRPC inputs with the datatypes the deployment declares.
- `openai-completions` / `openai-chat`: `POST /v1/completions` and `/v1/chat/completions`, streaming
  (SSE, ended by `data: [DONE]`) or not, as vLLM, SGLang, trtllm-serve and llama.cpp's server take them.

    path, body = encode("kserve", "Hello", {"max_tokens": 8, "stream": True}, model="ensemble")
    for raw in lines:                         # however the transport reads lines
        event = parse_line("kserve", raw)     # None for blank lines, comments, [DONE]
        if event: ... event.text, event.perf, event.error

Request fields are the client contract's names (`specbuild.core.contract`); `openai_fields` maps them
to OpenAI's (`min_tokens` -> `min_tokens` + `ignore_eos`, `stop_words` -> `stop`; KServe-only fields are
left out) and passes any other field through (a server's own extensions, e.g. llama.cpp's
`speculative.n_max`). gRPC datatypes come from the contract, or for a TensorRT-LLM deployment from its
release's own model config (`random_seed` is UINT64 there, never INT32).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from specbuild.core import contract

KSERVE = "kserve"
OPENAI_COMPLETIONS = "openai-completions"
OPENAI_CHAT = "openai-chat"
APIS = (KSERVE, OPENAI_COMPLETIONS, OPENAI_CHAT)
OPENAI_PATHS = {OPENAI_COMPLETIONS: "/v1/completions", OPENAI_CHAT: "/v1/chat/completions"}
PERF_KEYS = contract.PERF_METRIC_OUTPUTS   # acceptance_rate, total_accepted_draft_tokens, total_draft_tokens
DONE = "[DONE]"

# Contract fields with no OpenAI meaning (KServe tensors), left out of an OpenAI request.
KSERVE_ONLY = ("text_input", "return_perf_metrics", "exclude_input_in_output", "num_draft_tokens",
               "use_draft_logits", "proposer", "end_id", "stream")
# Connection-level failures, by the text transports put in their exceptions (refused, reset, UNAVAILABLE).
CONNECTION_ERROR_TEXTS = ("StatusCode.UNAVAILABLE", "Connection refused", "Connection reset", "Socket closed",
                          "failed to connect")


def check_api(api: str) -> str:
    if api not in APIS:
        raise ValueError(f"unknown API {api!r}; choose one of {APIS}.")
    return api


def is_openai(api: str) -> bool:
    return check_api(api) != KSERVE


# --- request encoding ----------------------------------------------------------------------------------------

def kserve_path(model: str, stream: bool) -> str:
    return f"/v2/models/{model}/generate" + ("_stream" if stream else "")


def openai_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Contract request fields -> OpenAI request fields. `min_tokens` is sent with `ignore_eos` too (vLLM
    and llama.cpp both take it: without it a server that lacks min_tokens stops at EOS); `stop_words` is
    `stop`; seed, top_k, top_p, temperature, max_tokens keep their names; KServe-only fields are dropped;
    anything else passes through unchanged."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key in KSERVE_ONLY:
            continue
        if key == "stop_words":
            out["stop"] = value
        elif key == "min_tokens":
            out["min_tokens"] = value
            if value:
                out["ignore_eos"] = True
        else:
            out[key] = value
    return out


def openai_body(api: str, prompt: str, fields: dict[str, Any], *, model: str | None, stream: bool) -> dict[str, Any]:
    """The JSON body of an OpenAI completions / chat request. Streaming asks for the usage chunk."""
    body: dict[str, Any] = {}
    if model:
        body["model"] = model
    if check_api(api) == OPENAI_CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(openai_fields(fields))
    body["stream"] = bool(stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def encode(api: str, prompt: str, fields: dict[str, Any], *, model: str | None, stream: bool) -> tuple[str, dict]:
    """(path, JSON body) of one request. `fields` are the contract's names (KServe takes them as they are)."""
    if is_openai(api):
        return OPENAI_PATHS[api], openai_body(api, prompt, fields, model=model, stream=stream)
    return kserve_path(model or contract.ENSEMBLE_MODEL, stream), {"text_input": prompt, **fields}


@functools.lru_cache(maxsize=None)
def _declared_datatypes(target: str, model: str | None) -> dict[str, str]:
    """name -> KServe datatype the deployment's model declares (a TensorRT-LLM release's config), or {}; read
    once per (target, model), not per request (callers only read the dict)."""
    family = contract.trtllm_family(target)
    try:
        from specbuild.core import upstream_facts

        if target == contract.LLMAPI_TARGET:        # the llmapi model's config.pbtxt as specbuild deploys it
            declared = upstream_facts.extract_model(upstream_facts.template("llmapi/tensorrt_llm/config.pbtxt"))["inputs"]
        elif family is None or model is None:
            return {}
        else:
            declared = upstream_facts.model_facts(family, model)["inputs"]
    except (KeyError, ImportError, OSError, ValueError):
        return {}
    return {t["name"]: _kserve_type(t["data_type"]) for t in declared if str(t["data_type"]).startswith("TYPE_")}


def _kserve_type(data_type: str) -> str:
    t = data_type.removeprefix("TYPE_")
    return "BYTES" if t == "STRING" else t


def datatype(name: str, value: Any, declared: dict[str, str] | None = None) -> str:
    """The KServe datatype of input `name`: what the model declares, else the contract's (a renamed
    TensorRT-LLM input such as random_seed has its contract twin's: UINT64), else from the Python value."""
    if declared and name in declared:
        return declared[name]
    aliases = {v: k for k, v in contract.TRTLLM_RENAMES.items()}   # random_seed -> seed, min_length -> min_tokens
    try:
        return contract.input_spec(aliases.get(name, name)).datatype
    except KeyError:
        pass
    if isinstance(value, list):
        value = value[0] if value else ""
    return ("BOOL" if isinstance(value, bool) else "INT32" if isinstance(value, int) else
            "FP32" if isinstance(value, float) else "BYTES")


def datatypes(body: dict[str, Any], *, target: str = "embedded", model: str | None = None) -> dict[str, str]:
    """name -> datatype for every field of `body` (computed once per run, outside the load generator)."""
    declared = _declared_datatypes(target, model)
    return {name: datatype(name, value, declared) for name, value in body.items()}


_NUMPY = {"BYTES": "object", "BOOL": "bool", "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
          "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64", "FP16": "float16",
          "FP32": "float32", "FP64": "float64"}


def grpc_arrays(body: dict[str, Any], types: dict[str, str] | None = None,
                batch_dim: bool = True) -> list[tuple[str, Any, str]]:
    """(name, numpy array, datatype) per field: strings UTF-8 encoded, a batch dimension of 1 when the model
    has max_batch_size > 0, lists (stop_words) as one row."""
    import numpy as np

    out = []
    types = types or {}
    for name, value in body.items():
        dtype = types.get(name) or datatype(name, value)
        values = value if isinstance(value, list) else [value]
        if dtype == "BYTES":
            values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        arr = np.array([values] if batch_dim else values, dtype=_NUMPY.get(dtype, "object"))
        out.append((name, arr, dtype))
    return out


def grpc_inputs(body: dict[str, Any], types: dict[str, str] | None = None, batch_dim: bool = True) -> list:
    """tritonclient.grpc InferInputs of `body` (see `grpc_arrays`)."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, arr, dtype in grpc_arrays(body, types, batch_dim):
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


# --- responses -------------------------------------------------------------------------------------------------

@dataclass
class Event:
    """One response (a /generate body, or one SSE event) as every client reads it."""

    text: str = ""                                     # the piece of output text it carries (may be empty)
    perf: dict[str, float] = field(default_factory=dict)   # acceptance_rate / total_*_draft_tokens
    usage: dict[str, int] = field(default_factory=dict)    # OpenAI usage: prompt_tokens, completion_tokens
    error: str | None = None                           # the server reported an error in the stream/body
    finish_reason: str | None = None


def _scalar(v: Any) -> Any:
    if isinstance(v, list):
        return v[0] if v else None
    return v


def perf_metrics(values: dict[str, Any]) -> dict[str, float]:
    """The perf-metric outputs present in a KServe response (scalar or one-element list) as floats."""
    out = {}
    for k in PERF_KEYS:
        v = _scalar(values.get(k))
        if v is not None:
            out[k] = float(v)
    return out


def kserve_event(data: dict[str, Any]) -> Event:
    if "error" in data:
        return Event(error=str(data["error"]))
    piece = data.get("text_output", "")
    if isinstance(piece, list):
        piece = "".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in piece)
    return Event(text=str(piece or ""), perf=perf_metrics(data))


def openai_event(api: str, data: dict[str, Any]) -> Event:
    """A completion / chat completion (chunk): its text, usage, and the speculation counts a server reports
    per response (llama.cpp's `timings.draft_n` / `draft_n_accepted`) as perf metrics."""
    if "error" in data:
        return Event(error=_openai_error(data["error"]))
    text, finish = "", None
    for choice in data.get("choices") or []:
        if api == OPENAI_CHAT:
            part = (choice.get("delta") or choice.get("message") or {}).get("content")
        else:
            part = choice.get("text")
        text += part or ""
        finish = choice.get("finish_reason") or finish
    usage = {k: int(v) for k, v in (data.get("usage") or {}).items() if isinstance(v, (int, float))}
    perf: dict[str, float] = {}
    timings = data.get("timings") or {}
    if "draft_n" in timings:
        perf["total_draft_tokens"] = float(timings["draft_n"])
        perf["total_accepted_draft_tokens"] = float(timings.get("draft_n_accepted", 0))
        if timings["draft_n"]:
            perf["acceptance_rate"] = perf["total_accepted_draft_tokens"] / perf["total_draft_tokens"]
    return Event(text=text, perf=perf, usage=usage, finish_reason=finish)


def grpc_event(result) -> Event:
    """One tritonclient gRPC result (anything with `as_numpy(name)`) -> its Event."""
    out: dict[str, Any] = {}
    for name in ("text_output", *PERF_KEYS):
        arr = result.as_numpy(name)
        if arr is not None:
            out[name] = [v if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v
                         for v in arr.reshape(-1)]
    return kserve_event(out)


def response_event(api: str, data: dict[str, Any]) -> Event:
    return openai_event(api, data) if is_openai(api) else kserve_event(data)


def sse_data(line: bytes | str) -> str | None:
    """The payload of an SSE `data:` line (one leading space removed, line ending stripped); None for blank
    lines, comments (`:`), and the other fields (`event:`, `id:`, `retry:`)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.rstrip("\r\n")
    if not line.startswith("data:"):
        return None
    data = line[5:]
    return data[1:] if data.startswith(" ") else data


def parse_line(api: str, line: bytes | str) -> Event | None:
    """One SSE line -> its Event, or None (not a data line, or OpenAI's closing `[DONE]`). A data line that is
    not JSON is reported as an error event, never raised."""
    data = sse_data(line)
    if data is None or data.strip() == DONE or not data.strip():
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return Event(error=f"malformed stream event: {data[:200]!r}")
    if not isinstance(obj, dict):
        return Event(error=f"unexpected stream event: {data[:200]!r}")
    return response_event(api, obj)


def parse_body(api: str, body: bytes | str) -> Event:
    """A non-streaming answer's body -> its Event."""
    try:
        obj = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        return Event(error=f"the answer is not JSON: {text[:200]!r}")
    return response_event(api, obj) if isinstance(obj, dict) else Event(error=f"unexpected answer: {obj!r:.200}")


class LineBuffer:
    """Raw chunks of a byte stream -> complete lines (for transports that hand out chunks, not lines)."""

    def __init__(self):
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        return lines

    def rest(self) -> list[bytes]:
        rest, self._buf = self._buf, b""
        return [rest] if rest.strip() else []


class Absorber:
    """Accumulates the events of one request: the pieces (text with their arrival times), the last perf
    metrics (cumulative per request on both servers: the last value wins) and the usage."""

    def __init__(self):
        self.pieces: list[str] = []
        self.arrivals: list[float] = []
        self.perf: dict[str, float] = {}
        self.usage: dict[str, int] = {}

    def add(self, event: Event, now: float) -> None:
        if event.text:
            self.pieces.append(event.text)
            self.arrivals.append(now)
        self.perf.update(event.perf)
        self.usage.update(event.usage)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


# --- errors ----------------------------------------------------------------------------------------------------

def _openai_error(err: Any) -> str:
    if isinstance(err, dict):
        msg = err.get("message") or json.dumps(err)
        kind = err.get("type") or err.get("code")
        return f"{msg} ({kind})" if kind else str(msg)
    return str(err)


def error_message(body: bytes | str) -> str:
    """The server's own message in an error answer: KServe `{"error": "..."}`, OpenAI
    `{"error": {"message": ..., "type": ...}}`, a stream refused with one SSE event, or the text itself."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = text.strip()
    data = sse_data(text.splitlines()[0]) if text.startswith("data:") else text
    try:
        obj = json.loads(data)
    except (ValueError, TypeError):
        return text[:500]
    if isinstance(obj, dict) and "error" in obj:
        return _openai_error(obj["error"])
    return text[:500]


def http_error(status: int, body: bytes | str) -> str:
    """One line for a refused HTTP request: `HTTP 400: <the server's message>`."""
    return f"HTTP {status}: {error_message(body)}"


def is_connection_error_text(text: str) -> bool:
    """Whether an exception's text says the server is not there (refused, reset, UNAVAILABLE)."""
    return any(s in text for s in CONNECTION_ERROR_TEXTS)


def first_error(events: Iterable[Event]) -> str | None:
    for e in events:
        if e.error:
            return e.error
    return None
