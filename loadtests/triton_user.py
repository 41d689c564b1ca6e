"""Locust users for Triton's LLM endpoints: an abstract `TritonUser` owns a client and fires request events.

Metrics (client side, the GenAI-Perf / `vllm bench serve` definitions):

- TTFT: send -> first response carrying a non-empty `text_output` (streaming only).
- ITL: every gap between consecutive non-empty streamed responses.
- E2E: send -> final response (end of the SSE stream / the gRPC final flag / the /generate body).
- output tokens: the joined text re-tokenized with the target's tokenizer (pieces carry their own spacing).
- TPOT: (E2E - TTFT) / (tokens - 1) when streaming and tokens > 1; without streaming TTFT is not
  observable and TPOT is E2E / tokens (recorded as such in the report).

Each metric is fired as its own Locust request type ("TTFT", "ITL", "TPOT", "E2E") under the run label,
with `response_length` = output tokens on the E2E row, so Locust's CSV carries every percentile. Each
request is also appended to `samples-<pid>.jsonl` (raw values for exact percentiles and the plots).

Connection errors (refused, reset, UNAVAILABLE) are failures like any other, and also: the user backs
off before its next request (0.25 s doubling up to 5 s, so a batch user does not hammer a dead port in
a tight loop), and after `spec.max_connection_errors` of them in a row in one process, with no success
between, the run is ended as "server gone" (`stopping.report_server_gone`).

Transports: HTTP `POST /v2/models/<m>/generate_stream` (SSE, read line by line as it arrives) or
`/generate`; gRPC streaming through tritonclient (needs `grpc.experimental.gevent.init_gevent()`, done
by the locustfile before any channel exists). With gRPC, non-streaming requests use the same stream
with `stream=false` (decoupled models refuse the unary call).
"""

from __future__ import annotations

import json
import os
import queue
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import gevent
from locust import User

from specbuild.loadtests.runspec import RunSpec
from specbuild.loadtests.stopping import is_connection_error, report_server_gone
from specbuild.loadtests.tokens import TokenCounter

PERF_KEYS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


class RequestFailed(Exception):
    """The server answered with an error (HTTP status, an SSE error event, a gRPC error)."""


@dataclass
class Sample:
    """One request as the client saw it. Times in ms; perf metrics as the server reported them."""

    start: float                                   # wall-clock time the request was sent
    ok: bool = True
    error: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    input_tokens: int | None = None                # prompt tokens (counted once, when the prompts were built)
    chunks: int = 0
    tpot_ms: float | None = None
    accepted: int | None = None
    drafted: int | None = None
    acceptance_rate: float | None = None
    overhead_ms: float = 0.0                       # time spent in harness code (parsing, counting, events)


class Timer:
    """Arrival times of the non-empty pieces of one request, relative to `perf_counter` at send."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.start = time.time()
        self.arrivals: list[float] = []
        self.pieces: list[str] = []
        self.perf: dict[str, float] = {}
        self.end: float | None = None

    def piece(self, text: str, now: float) -> None:
        if text:
            self.arrivals.append(now)
            self.pieces.append(text)

    def metrics(self, values: dict[str, Any]) -> None:
        for k in PERF_KEYS:
            v = values.get(k)
            if isinstance(v, list):
                v = v[0] if v else None
            if v is not None:
                self.perf[k] = float(v)   # cumulative per request: the last value wins


def _scalar(v: Any) -> Any:
    return v[0] if isinstance(v, list) and len(v) == 1 else v


class TritonHttpClient:
    """KServe v2 generate extension over geventhttpclient (one connection per simulated user)."""

    def __init__(self, url: str, model: str, timeout: float):
        from geventhttpclient import HTTPClient

        u = urlsplit(url)
        self._http = HTTPClient(u.hostname, u.port or (443 if u.scheme == "https" else 80),
                                ssl=u.scheme == "https", concurrency=1, connection_timeout=10.0,
                                network_timeout=timeout)
        self._base = u.path.rstrip("/") + f"/v2/models/{model}"
        self.overhead = 0.0

    def probe(self) -> float:
        """Round trip of the zero-work `GET /v2/health/live`, in ms (the transport floor)."""
        t0 = time.perf_counter()
        resp = self._http.get("/v2/health/live")
        resp.read()
        resp.release()
        return (time.perf_counter() - t0) * 1000

    def generate(self, payload: dict[str, Any], stream: bool, timer: Timer) -> None:
        body = json.dumps(payload).encode()
        path = self._base + ("/generate_stream" if stream else "/generate")
        resp = self._http.post(path, body=body, headers={"Content-Type": "application/json"})
        try:
            if resp.status_code != 200:
                raise RequestFailed(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}")
            if not stream:
                data = json.loads(resp.read())
                now = time.perf_counter()
                timer.piece(str(_scalar(data.get("text_output", ""))), now)
                timer.metrics(data)
                timer.end = now
                return
            while True:
                line = resp.readline(b"\n")
                now = time.perf_counter()
                if not line:
                    break
                t = time.perf_counter()
                if line.startswith(b"data:"):
                    data = json.loads(line[5:])
                    if "error" in data:
                        raise RequestFailed(f"stream error: {data['error']}")
                    timer.piece(str(_scalar(data.get("text_output", ""))), now)
                    timer.metrics(data)
                self.overhead += time.perf_counter() - t
            timer.end = time.perf_counter()
        finally:
            resp.release()

    def close(self) -> None:
        self._http.close()


class TritonGrpcClient:
    """gRPC streaming through tritonclient; one bidirectional stream per simulated user."""

    def __init__(self, grpc_url: str, model: str, timeout: float, batch_dim: bool = True):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self._client = grpcclient.InferenceServerClient(grpc_url)
        self._model = model
        self._timeout = timeout
        self._batch_dim = batch_dim
        self._responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        self._n = 0
        self.overhead = 0.0

    def probe(self) -> float:
        t0 = time.perf_counter()
        self._client.is_server_live()
        return (time.perf_counter() - t0) * 1000

    def _inputs(self, payload: dict[str, Any]) -> list:
        import numpy as np

        from specbuild.pipeline.contract import input_spec

        inputs = []
        for name, value in payload.items():
            try:
                dtype = input_spec(name).datatype
            except KeyError:
                dtype = "BOOL" if isinstance(value, bool) else "INT32" if isinstance(value, int) else \
                    "FP32" if isinstance(value, float) else "BYTES"
            np_dtype = {"BYTES": object, "BOOL": bool, "INT32": np.int32, "FP32": np.float32,
                        "UINT64": np.uint64}.get(dtype, object)
            v = value.encode() if isinstance(value, str) else value
            arr = np.array([[v]] if self._batch_dim else [v], dtype=np_dtype)
            inp = self._grpc.InferInput(name, list(arr.shape), dtype)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        return inputs

    def generate(self, payload: dict[str, Any], stream: bool, timer: Timer) -> None:
        self._n += 1
        rid = f"{os.getpid()}-{id(self)}-{self._n}"
        self._client.async_stream_infer(self._model, self._inputs(payload), request_id=rid,
                                        enable_empty_final_response=True)
        while True:
            try:
                result, error = self._responses.get(timeout=self._timeout)
            except queue.Empty:
                raise RequestFailed(f"no gRPC response within {self._timeout:g} s") from None
            now = time.perf_counter()
            if error is not None:
                raise RequestFailed(f"gRPC error: {error}")
            t = time.perf_counter()
            response = result.get_response()
            if response.id and response.id != rid:
                continue   # a late response of an earlier, failed request
            out = result.as_numpy("text_output")
            if out is not None:
                timer.piece("".join(x.decode() if isinstance(x, bytes) else str(x) for x in out.flatten()), now)
            for k in PERF_KEYS:
                arr = result.as_numpy(k)
                if arr is not None:
                    timer.metrics({k: arr.flatten()[0].item()})
            self.overhead += time.perf_counter() - t
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param or not stream:
                timer.end = now
                return

    def close(self) -> None:
        try:
            self._client.stop_stream()
        finally:
            self._client.close()


class TritonUser(User):
    """Abstract user: owns a Triton client, measures each request and fires Locust request events.

    Subclasses set `spec` (a RunSpec) and call `self.generate(prompt)` from their tasks.
    """

    abstract = True
    spec: RunSpec
    _counter: TokenCounter | None = None
    _samples = None
    _connection_errors = 0      # consecutive, in this process (any success resets it)
    _gone_reported = False

    def __init__(self, environment):
        super().__init__(environment)
        spec = self.spec
        self._own_errors = 0        # this user's consecutive connection errors (its back-off)
        if spec.protocol == "grpc":
            self.client = TritonGrpcClient(spec.grpc_url, spec.model, spec.request_timeout_s,
                                           spec.grpc_batch_dim)
        else:
            self.client = TritonHttpClient(spec.url, spec.model, spec.request_timeout_s)

    @classmethod
    def _shared(cls):
        """Per-process tokenizer and samples file (opened on first use)."""
        if TritonUser._counter is None:
            TritonUser._counter = TokenCounter(cls.spec.tokenizer)
            path = Path(cls.spec.samples_dir) / f"samples-{os.getpid()}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            TritonUser._samples = open(path, "a", buffering=1)
        return TritonUser._counter, TritonUser._samples

    def on_start(self):
        _, out = self._shared()
        for _ in range(3):
            try:
                out.write(json.dumps({"kind": "probe", "ms": self.client.probe()}) + "\n")
            except Exception:   # a probe is informative only; the requests will report failures
                break

    def on_stop(self):
        self.client.close()

    def generate(self, prompt: str, input_tokens: int | None = None) -> Sample:
        counter, out = self._shared()
        payload = {"text_input": prompt, **self.spec.payload}
        timer = Timer()
        sample = Sample(start=timer.start, input_tokens=input_tokens)
        self.client.overhead = 0.0
        try:
            self.client.generate(payload, self.spec.stream, timer)
        except Exception as e:  # recorded, not raised: Locust keeps the user running
            sample.ok, sample.error = False, f"{type(e).__name__}: {e}"
            sample.e2e_ms = (time.perf_counter() - timer.t0) * 1000
            self.environment.events.request.fire(request_type="E2E", name=self.spec.label,
                                                 response_time=sample.e2e_ms, response_length=0,
                                                 exception=e, context={})
            out.write(json.dumps({"kind": "request", **asdict(sample)}) + "\n")
            if is_connection_error(e):
                self._connection_error(sample.error)
            else:   # the server answered (with an error): it is there
                TritonUser._connection_errors = self._own_errors = 0
            return sample
        TritonUser._connection_errors = self._own_errors = 0
        t_post = time.perf_counter()
        self._finish(sample, timer, counter)
        self._fire(sample)
        sample.overhead_ms = (self.client.overhead + time.perf_counter() - t_post) * 1000
        out.write(json.dumps({"kind": "request", **asdict(sample)}) + "\n")
        return sample

    def _connection_error(self, error: str) -> None:
        TritonUser._connection_errors += 1
        self._own_errors += 1
        limit = self.spec.max_connection_errors
        if TritonUser._connection_errors >= limit and not TritonUser._gone_reported:
            TritonUser._gone_reported = True
            report_server_gone(self.environment, f"{TritonUser._connection_errors} consecutive connection "
                                                 f"errors; the last: {error}")
        gevent.sleep(min(0.25 * 2 ** (self._own_errors - 1), 5.0))   # back off; never a tight loop

    def _finish(self, sample: Sample, timer: Timer, counter: TokenCounter) -> None:
        t0, arrivals = timer.t0, timer.arrivals
        sample.e2e_ms = ((timer.end or time.perf_counter()) - t0) * 1000
        sample.chunks = len(arrivals)
        text = "".join(timer.pieces)
        # Tokenizing is CPU work: do it in gevent's thread pool so other users' timers keep running.
        sample.tokens = gevent.get_hub().threadpool.apply(counter.count, (text,))
        if self.spec.stream and arrivals:
            sample.ttft_ms = (arrivals[0] - t0) * 1000
            sample.itl_ms = [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:])]
            if sample.tokens > 1:
                sample.tpot_ms = (sample.e2e_ms - sample.ttft_ms) / (sample.tokens - 1)
        elif not self.spec.stream and sample.tokens > 0:
            sample.tpot_ms = sample.e2e_ms / sample.tokens
        if "total_draft_tokens" in timer.perf:
            sample.drafted = int(timer.perf["total_draft_tokens"])
            sample.accepted = int(timer.perf.get("total_accepted_draft_tokens", 0))
        if "acceptance_rate" in timer.perf:
            sample.acceptance_rate = timer.perf["acceptance_rate"]

    def _fire(self, sample: Sample) -> None:
        fire = self.environment.events.request.fire
        name = self.spec.label
        if sample.ttft_ms is not None:
            fire(request_type="TTFT", name=name, response_time=sample.ttft_ms, response_length=0,
                 exception=None, context={})
        for gap in sample.itl_ms:
            fire(request_type="ITL", name=name, response_time=gap, response_length=0, exception=None, context={})
        if sample.tpot_ms is not None:
            fire(request_type="TPOT", name=name, response_time=sample.tpot_ms, response_length=0,
                 exception=None, context={})
        fire(request_type="E2E", name=name, response_time=sample.e2e_ms, response_length=sample.tokens,
             exception=None, context={"chunks": sample.chunks})
