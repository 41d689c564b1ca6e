"""The transports of the Locust users, one connection per simulated user; what goes over the wire (request
bodies, gRPC datatypes, SSE events, perf metrics, error messages) is `specbuild.core.wire`'s.

- `HttpClient`: geventhttpclient, for Triton's KServe generate extension (`/v2/models/<m>/generate`,
  `/generate_stream`) and OpenAI-compatible servers (`/v1/completions`, `/v1/chat/completions`), streaming
  (SSE read line by line as it arrives: reading fixed-size chunks would delay TTFT) or not.
- `GrpcClient`: tritonclient gRPC streaming (needs `grpc.experimental.gevent.init_gevent()`, done by the
  locustfile before any channel exists); non-streaming requests use the same stream with `stream=false`
  (decoupled models refuse the unary call).

Every client fills a `Timer`: the arrival time of each non-empty piece (`perf_counter`, taken before
parsing), the perf metrics, the usage, the end. A refusal or an error event raises `RequestFailed`.
"""

from __future__ import annotations

import json
import os
import queue
import time
from typing import Any
from urllib.parse import urlsplit

from specbuild.core import wire


class RequestFailed(Exception):
    """The server answered with an error (HTTP status, an SSE error event, a gRPC error)."""


class Timer:
    """One request as it arrives: pieces with their arrival times (relative to `perf_counter` at send)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.start = time.time()
        self.got = wire.Absorber()
        self.end: float | None = None

    @property
    def arrivals(self) -> list[float]:
        return self.got.arrivals

    @property
    def pieces(self) -> list[str]:
        return self.got.pieces

    @property
    def perf(self) -> dict[str, float]:
        return self.got.perf

    def event(self, event: wire.Event, now: float) -> None:
        if event.error:
            raise RequestFailed(f"stream error: {event.error}")
        self.got.add(event, now)


class HttpClient:
    """KServe generate or OpenAI completions/chat over geventhttpclient (one connection)."""

    def __init__(self, url: str, model: str, timeout: float, api: str = wire.KSERVE, concurrency: int = 1):
        from geventhttpclient import HTTPClient

        u = urlsplit(url)
        self._http = HTTPClient(u.hostname, u.port or (443 if u.scheme == "https" else 80),
                                ssl=u.scheme == "https", concurrency=concurrency, connection_timeout=10.0,
                                network_timeout=timeout)
        self._prefix = u.path.rstrip("/")
        self.api = wire.check_api(api)
        self.model = model
        self.overhead = 0.0

    def probe(self) -> float:
        """Round trip of a zero-work GET (`/v2/health/live`, or `/health` on an OpenAI server), in ms."""
        t0 = time.perf_counter()
        resp = self._http.get(self._prefix + ("/health" if wire.is_openai(self.api) else "/v2/health/live"))
        resp.read()
        resp.release()
        return (time.perf_counter() - t0) * 1000

    def generate(self, prompt: str, fields: dict[str, Any], stream: bool, timer: Timer) -> None:
        path, body = wire.encode(self.api, prompt, fields, model=self.model, stream=stream)
        resp = self._http.post(self._prefix + path, body=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
        try:
            if resp.status_code != 200:
                raise RequestFailed(wire.http_error(resp.status_code, resp.read()))
            if not stream:
                data = resp.read()
                now = time.perf_counter()
                timer.event(wire.parse_body(self.api, data), now)
                timer.end = now
                return
            while True:
                line = resp.readline(b"\n")
                now = time.perf_counter()
                if not line:
                    break
                t = time.perf_counter()
                event = wire.parse_line(self.api, line)
                if event is not None:
                    timer.event(event, now)
                self.overhead += time.perf_counter() - t
            timer.end = time.perf_counter()
        finally:
            resp.release()

    def close(self) -> None:
        self._http.close()


class GrpcClient:
    """gRPC streaming through tritonclient; one bidirectional stream per simulated user."""

    def __init__(self, grpc_url: str, model: str, timeout: float, batch_dim: bool = True,
                 datatypes: dict[str, str] | None = None):
        import tritonclient.grpc as grpcclient

        self._client = grpcclient.InferenceServerClient(grpc_url)
        self._model = model
        self._timeout = timeout
        self._batch_dim = batch_dim
        self._types = datatypes or {}
        self._responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        self._n = 0
        self.overhead = 0.0

    def probe(self) -> float:
        t0 = time.perf_counter()
        self._client.is_server_live()
        return (time.perf_counter() - t0) * 1000

    def generate(self, prompt: str, fields: dict[str, Any], stream: bool, timer: Timer) -> None:
        self._n += 1
        rid = f"{os.getpid()}-{id(self)}-{self._n}"
        body = {"text_input": prompt, **fields}
        self._client.async_stream_infer(self._model, wire.grpc_inputs(body, self._types, self._batch_dim),
                                        request_id=rid, enable_empty_final_response=True)
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
            timer.event(wire.grpc_event(result), now)
            self.overhead += time.perf_counter() - t
            final = response.parameters.get("triton_final_response")
            if (final is not None and final.bool_param) or not stream:
                timer.end = now
                return

    def close(self) -> None:
        try:
            self._client.stop_stream()
        finally:
            self._client.close()
