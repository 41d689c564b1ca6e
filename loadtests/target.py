"""The deployment under test, seen from outside: pre-flight checks and Prometheus metrics.

Everything here runs *before* (and after) load is sent, so a server that is down, a model name that
does not exist or a parameter the model does not take fails fast with a message that says what to do.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

from specbuild.core import http, wire
from specbuild.core.errors import ServerError, UsageError
from specbuild.core.metrics import metric_sum, parse_prometheus


@dataclass(frozen=True)
class ModelInfo:
    name: str
    inputs: tuple[str, ...]
    batch_dim: bool            # the model declares max_batch_size > 0 (inputs carry a batch dimension)


def _get(client: httpx.Client, url: str) -> httpx.Response:
    try:
        return client.get(url)
    except httpx.HTTPError as e:
        raise ServerError(f"no Triton server answers at {url} ({type(e).__name__}: {e}). Start the deployment "
                          "(`specbuild serve --workdir ...`) or pass the right --url.") from e


def preflight(url: str, model: str, *, timeout: float = 10.0, headers: dict[str, str] | None = None) -> ModelInfo:
    """Server ready, model known and ready; returns the model's declared inputs.

    `headers` open the server's restricted APIs (model config, repository index) where it has them, e.g. the
    admin token of a `specbuild serve` server; without them a refused config reads as max_batch_size > 0."""
    with http.Client(timeout=timeout, headers=headers or {}) as client:
        ready = _get(client, f"{url}/v2/health/ready")
        if ready.status_code != 200:
            raise ServerError(f"Triton at {url} is up but not ready (HTTP {ready.status_code}); wait for "
                              "the models to load or check the server log (`specbuild status`).")
        meta = _get(client, f"{url}/v2/models/{model}")
        if meta.status_code != 200:
            known = _model_names(client, url)
            raise UsageError(f"model {model!r} does not exist on {url} ({wire.error_message(meta.text)}); models there: "
                             f"{known or 'none'}. Pass one of them with --model.")
        if _get(client, f"{url}/v2/models/{model}/ready").status_code != 200:
            raise ServerError(f"model {model!r} on {url} is not ready; load it (explicit model control) "
                              "or check the server log.")
        inputs = tuple(i["name"] for i in meta.json().get("inputs", []))
        config = _get(client, f"{url}/v2/models/{model}/config")
        batch_dim = config.status_code != 200 or config.json().get("max_batch_size", 1) > 0
        return ModelInfo(model, inputs, batch_dim)


def check_grpc(grpc_url: str, model: str) -> None:
    """Triton's gRPC endpoint answers and serves `model` (for --protocol grpc)."""
    import tritonclient.grpc as grpcclient

    try:
        client = grpcclient.InferenceServerClient(grpc_url)
        try:
            ok = client.is_server_ready(client_timeout=10) and client.is_model_ready(model, client_timeout=10)
        finally:
            client.close()
    except Exception as e:  # InferenceServerException or a grpc error
        raise ServerError(f"Triton's gRPC endpoint at {grpc_url} does not answer ({e}); pass --grpc-url "
                          "host:port (default: the --url host, port 8001).") from e
    if not ok:
        raise ServerError(f"model {model!r} is not ready on the gRPC endpoint {grpc_url}.")


def check_inputs(info: ModelInfo, names: list[str]) -> None:
    missing = [n for n in names if n not in info.inputs]
    if missing:
        hint = (" num_draft_tokens is taken by the speculative model: pass --model tensorrt_llm_bls."
                if "num_draft_tokens" in missing else "")
        raise UsageError(f"model {info.name!r} has no input(s) {missing} (it takes {list(info.inputs)}).{hint}")


def preflight_openai(url: str, model: str | None, *, timeout: float = 10.0) -> ModelInfo:
    """An OpenAI-compatible server: up and ready (`/health`, where it has one), `model` among `/v1/models`
    (default: the first one it serves). Any request field may be sent (servers ignore or refuse unknown
    ones: the smoke request tells)."""
    with http.Client(timeout=timeout) as client:
        try:
            health = client.get(f"{url}/health")
            listed = client.get(f"{url}/v1/models")
        except httpx.HTTPError as e:
            raise ServerError(f"no OpenAI-compatible server answers at {url} ({type(e).__name__}: {e}). Start it "
                              "or pass the right --url (the base URL, without /v1).") from e
    if health.status_code not in (200, 404):   # 404: no /health route; 503: still loading the model
        raise ServerError(f"the server at {url} is up but not ready (GET /health: HTTP {health.status_code}: "
                          f"{wire.error_message(health.text)}); wait for the model to load.")
    if listed.status_code != 200:
        raise UsageError(f"{url}/v1/models answers HTTP {listed.status_code}; is {url} an OpenAI-compatible "
                         "server (pass the base URL, without /v1)?")
    try:
        ids = [m["id"] for m in listed.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        ids = []
    if model is None:
        if not ids:
            raise UsageError(f"{url}/v1/models lists no model; pass --model NAME.")
        model = ids[0]
    elif ids and model not in ids:
        raise UsageError(f"model {model!r} is not served at {url}; models there: {ids}. Pass one with --model.")
    return ModelInfo(model, (), False)


def smoke_request(url: str, model: str, payload: dict[str, Any], stream: bool, timeout: float = 120.0,
                  api: str = wire.KSERVE) -> None:
    """One short real request with the run's exact payload, so a refused parameter fails before the load."""
    fields = {**payload, "max_tokens": 2}
    for fixed in ("min_tokens", "min_length"):   # a fixed output length, cut to the smoke's 2 tokens
        if fixed in fields:
            fields[fixed] = min(2, fields[fixed])
    path, body = wire.encode(api, "Hello", fields, model=model, stream=stream)
    try:
        with http.Client(timeout=timeout) as client:
            resp = client.post(url + path, json=body)
    except httpx.HTTPError as e:
        raise ServerError(f"the smoke request to {url + path} failed ({type(e).__name__}: {e}).") from e
    if resp.status_code != 200:
        err = wire.error_message(resp.text)
    elif stream:
        err = wire.first_error(filter(None, (wire.parse_line(api, line) for line in resp.text.splitlines())))
    else:
        err = wire.parse_body(api, resp.content).error
    if err:
        raise UsageError(f"the deployment refused a request with this run's parameters "
                         f"{sorted(body)}: {err}. Fix the profile / --compare / --setting values.")


def _model_names(client: httpx.Client, url: str) -> list[str] | str:
    try:
        resp = client.post(f"{url}/v2/repository/index")
        if resp.status_code == 403:    # a restricted repository API (`specbuild serve` restricts it)
            return ("not listed (the repository index needs the server's admin token: run from the workdir "
                    "that served it, or set SPECBUILD_ADMIN_TOKEN)")
        return sorted({m["name"] for m in resp.json()})
    except Exception:
        return []


# --- Prometheus metrics --------------------------------------------------------------------------------

def scrape(metrics_url: str | None, timeout: float = 5.0) -> dict[str, float] | None:
    """`name{labels}` -> value of every sample on Triton's metrics port; None if it cannot be reached."""
    if not metrics_url:
        return None
    try:
        text = http.get(metrics_url, timeout=timeout).text
    except httpx.HTTPError:
        return None
    out = parse_prometheus(text)
    out["_scraped_at"] = time.time()
    return out


# Requests not yet answered in full: the embedded engine's, llama.cpp's server's, vLLM's.
IN_FLIGHT_GAUGES = ("specbuild_live_requests", "llamacpp:requests_processing", "vllm:num_requests_running")


def in_flight(samples: dict[str, float] | None) -> float | None:
    """Requests the server still works on (None: the deployment exports no such gauge, e.g. TensorRT-LLM)."""
    if not samples:
        return None
    found = [metric_sum(samples, g) for g in IN_FLIGHT_GAUGES if any(k.split("{")[0] == g for k in samples)]
    return sum(found) if found else None


def wait_idle(metrics_url: str | None, timeout: float, *, poll: float = 0.5,
              clock=time.monotonic, sleep=time.sleep) -> tuple[bool, float | None]:
    """Wait until the previous run's requests have left the server (a closed-loop client gone from a
    non-streaming /generate does not cancel its request: Triton's HTTP frontend never sees the disconnect),
    so each run starts on an idle server. Returns (idle, requests still in flight); bounded by `timeout`."""
    deadline = clock() + timeout
    while True:
        left = in_flight(scrape(metrics_url))
        if left is None or left <= 0:
            return True, left
        if clock() >= deadline:
            return False, left
        sleep(poll)


def alive(url: str, timeout: float = 3.0) -> bool:
    """The server answers `GET /v2/health/live` (after a run, to tell a dead server from a slow one)."""
    try:
        return http.get(f"{url}/v2/health/live", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def metric_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    if not before or not after:
        return {}
    return {k: after[k] - before.get(k, 0.0) for k in after if k != "_scraped_at" and after[k] != before.get(k)}


def model_deltas(deltas: dict[str, float], model: str) -> dict[str, float]:
    """Triton's request counters for `model` and every custom `specbuild_*` / spec counter, as deltas."""
    keep = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
            "nv_inference_request_duration_us", "nv_inference_queue_duration_us")
    return {k: v for k, v in deltas.items()
            if (k.startswith(keep) and f'model="{model}"' in k) or k.startswith("specbuild_")
            or any(s in k.split("{")[0].lower() for s in ("draft", "accept"))}


def _sum(deltas: dict[str, float], pred) -> float | None:
    vals = [v for k, v in deltas.items() if pred(k.split("{")[0].lower())]
    return sum(vals) if vals else None


# The vLLM counter schema (vllm/v1/spec_decode/metrics.py `SpecDecodingProm`), which our embedded server and
# AIPerf use too, and llama.cpp's server exports under its own prefix (`llamacpp:spec_decode_num_drafts_total`,
# ... build 11434). Prometheus clients print counters with a `_total` suffix.
SPEC_COUNTERS = {"drafts": "spec_decode_num_drafts", "draft_tokens": "spec_decode_num_draft_tokens",
                 "accepted": "spec_decode_num_accepted_tokens", "per_pos": "spec_decode_num_accepted_tokens_per_pos"}
VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED, VLLM_PER_POS = (f"vllm:{n}" for n in SPEC_COUNTERS.values())
_POSITION = re.compile(r'position="(\d+)"')
_SPEC_FAMILY = re.compile(r"^([a-zA-Z_][a-zA-Z0-9_]*):(spec_decode_num_[a-z_]+?)(?:_total)?$")


def _spec_families(deltas: dict[str, float]) -> dict[str, dict[str, dict[str, float]]]:
    """prefix ("vllm", "llamacpp", ...) -> counter ("drafts", ...) -> {series key: delta}."""
    names = {v: k for k, v in SPEC_COUNTERS.items()}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key, value in deltas.items():
        m = _SPEC_FAMILY.match(key.split("{")[0])
        if m and m.group(2) in names:
            out.setdefault(m.group(1), {}).setdefault(names[m.group(2)], {})[key] = value
    return out


def vllm_spec_summary(deltas: dict[str, float]) -> dict[str, Any] | None:
    """Acceptance from the vLLM-schema counters (`vllm:` preferred, else another server's prefix such as
    `llamacpp:`), or None when the server exports none of them.

    acceptance rate = d(accepted) / d(draft tokens); mean accepted length = 1 + d(accepted) / d(drafts)
    (the bonus token counts, as vLLM's SpecDecodingLogging); acceptance at draft position i =
    d(accepted_per_pos{position=i}) / d(drafts) (the fraction of drafts whose i-th token was accepted)."""
    found = _spec_families(deltas)
    if not found:
        return None
    prefix = "vllm" if "vllm" in found else sorted(found)[0]
    fams = found[prefix]
    total = lambda n: sum(fams[n].values()) if fams.get(n) else None  # noqa: E731
    drafts, drafted, accepted = total("drafts"), total("draft_tokens"), total("accepted")
    per_pos: dict[int, float] = {}
    for key, value in fams.get("per_pos", {}).items():
        m = _POSITION.search(key)
        if m:
            per_pos[int(m.group(1))] = per_pos.get(int(m.group(1)), 0.0) + value
    return {
        "schema": "vllm" if prefix == "vllm" else f"vllm ({prefix}: prefix)", "drafts": drafts, "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if accepted is not None and drafted else None,
        "mean_accepted_length": 1 + accepted / drafts if accepted is not None and drafts else None,
        "per_position": [per_pos.get(i, 0.0) / drafts for i in range(max(per_pos) + 1)]
        if per_pos and drafts else None,
        "counters_read": sorted({k.split("{")[0] for fam in fams.values() for k in fam}),
    }


def spec_summary(deltas: dict[str, float]) -> dict[str, Any]:
    """Acceptance figures from the deployment's spec-decoding counters, if it exports any.

    The vLLM-schema counters are read when present (`vllm_spec_summary`, preferred). Otherwise counter names
    are matched loosely (`*accepted*`, `*draft*token*`, `*draft*step*|*num_drafts*`), as in `vllm bench
    serve`: acceptance rate = d(accepted) / d(drafted tokens), mean accepted length = 1 + d(accepted) /
    d(drafts); no per-position figures then.
    """
    counters = sorted({k.split("{")[0] for k in deltas if any(s in k.lower() for s in ("draft", "accept", "spec"))})
    found = vllm_spec_summary(deltas)
    if found is not None:
        return {**found, "counters": counters}
    accepted = _sum(deltas, lambda n: "accepted" in n and "rate" not in n and "per_pos" not in n)
    drafted = _sum(deltas, lambda n: "draft" in n and "token" in n and "accepted" not in n)
    drafts = _sum(deltas, lambda n: "draft" in n and ("step" in n or "num_drafts" in n or n.endswith("drafts_total")))
    out: dict[str, Any] = {"schema": "matched by name" if accepted is not None or drafted is not None else None,
                           "accepted": accepted, "drafted": drafted, "drafts": drafts}
    out["acceptance_rate"] = accepted / drafted if accepted is not None and drafted else None
    out["mean_accepted_length"] = 1 + accepted / drafts if accepted is not None and drafts else None
    out["per_position"] = None
    out["counters"] = counters
    return out
