"""The one client of a specbuild deployment (used by `infer`, `verify` and the load-test checks).

Speaks the client contract (`specbuild.core.contract`) over Triton's KServe v2 API, to either backend:

* `generate(...)`          HTTP `POST /v2/models/<m>/generate` (one response; stream=false)
* `generate_stream(...)`   HTTP `POST /v2/models/<m>/generate_stream` (SSE; stream=true)
* `grpc_stream(...)`       gRPC bidirectional streaming (tritonclient.grpc)

and, as `OpenAIClient`, to any OpenAI-compatible server (`trtllm-serve`, vLLM, SGLang, llama.cpp's
`llama-server`): `POST /v1/completions` or `/v1/chat/completions`, streaming (SSE) or not.

Each returns a `Generation`: the text, the streamed pieces with their arrival times (seconds since
the request was sent), and the perf metrics when `return_perf_metrics` was asked for. Server-side
refusals raise `RequestError` carrying Triton's message. What goes over the wire (bodies, gRPC datatypes,
SSE events, perf metrics, error messages) is `specbuild.core.wire`'s, shared with every other client.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from specbuild.core import contract, http, wire
from specbuild.core.errors import ServerError  # noqa: F401
from specbuild.core.requests import (EMBEDDED, RequestError, adapt_request, client_model,  # noqa: F401
                                     request_body)
from specbuild.pipeline.deployment import deployment_target  # noqa: F401

DEFAULT_HTTP = "http://127.0.0.1:8000"
DEFAULT_GRPC = "127.0.0.1:8001"


def prompt_echo(tokenizer_dir) -> Callable[[str], str]:
    """What upstream's postprocessing makes of a prompt it echoes: decode(encode(prompt), skip special tokens),
    with the tokenizer loaded as upstream's pre/postprocessing load it (AutoTokenizer, add_special_tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), legacy=False, padding_side="left")
    return lambda prompt: tok.decode(tok.encode(prompt, add_special_tokens=True), skip_special_tokens=True)


def client_for(workdir, url: str, grpc_url: str = DEFAULT_GRPC, *, model: str, timeout: float = 300.0,
               tokenizer_dir=None) -> "Client":
    """A Client adapted to the deployment in `workdir` (embedded, or a TensorRT-LLM release family)."""
    target = deployment_target(workdir)
    echo = prompt_echo(tokenizer_dir) if target != EMBEDDED and tokenizer_dir else None
    return Client(url=url, grpc_url=grpc_url, model=model, timeout=timeout, target=target, echo=echo)


@dataclass
class Generation:
    text: str = ""
    chunks: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)   # seconds since send, one per chunk
    seconds: float = 0.0                                   # end to end
    acceptance_rate: float | None = None
    total_accepted_draft_tokens: int | None = None
    total_draft_tokens: int | None = None
    sent_at: float = 0.0                                   # time.perf_counter() at send
    usage: dict[str, int] = field(default_factory=dict)    # OpenAI servers: prompt_tokens, completion_tokens
    finish_reason: str | None = None                       # OpenAI servers: "length", "stop", ...

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] if self.arrivals else None

    def _absorb(self, event: "wire.Event", t: float) -> None:
        if event.text:
            self.chunks.append(event.text)
            self.arrivals.append(t)
            self.text += event.text
        for k, v in event.perf.items():   # cumulative per request: the last value wins
            setattr(self, k, v if k == "acceptance_rate" else int(v))
        self.usage.update(event.usage)
        self.finish_reason = event.finish_reason or self.finish_reason


class Client:
    def __init__(self, url: str = DEFAULT_HTTP, grpc_url: str = DEFAULT_GRPC, model: str = contract.ENSEMBLE_MODEL,
                 timeout: float = 300.0, *, target: str = EMBEDDED, echo: Callable[[str], str] | None = None):
        """`target`: "embedded", "trtllm-<family>" or "trtllm-llmapi" (`deployment_target`); requests are
        adapted to it (and, on the llmapi path, sent to its one model, `tensorrt_llm`).
        `echo(prompt)`: the text a TensorRT-LLM BLS echoes in front of the completion (its postprocessing
        decodes prompt + output ids); default: the prompt itself."""
        self.url, self.grpc_url, self.timeout = url.rstrip("/"), grpc_url, timeout
        self.model = client_model(target, model)
        self.target, self.echo = target, echo or (lambda prompt: prompt)

    def _body(self, prompt: str, **params: Any) -> tuple[dict[str, Any], bool]:
        return adapt_request(self.target, self.model, request_body(prompt, **params))

    def _strip_echo(self, gen: "Generation", prompt: str) -> None:
        head = self.echo(prompt)
        if not gen.text.startswith(head):
            raise RequestError(f"{self.model}: the response does not start with the echoed prompt "
                               f"({head[:40]!r}...), so the completion cannot be separated; pass a tokenizer "
                               "whose decode matches the deployment's postprocessing.")
        gen.text = gen.text[len(head):]
        gen.chunks = [gen.text] if gen.text else []

    def _post(self, path: str, body: dict, stream: bool):
        url = f"{self.url}/v2/models/{self.model}/{path}"
        return http.stream("POST", url, json=body, timeout=self.timeout) if stream else \
            http.post(url, json=body, timeout=self.timeout)

    def generate(self, prompt: str, **params: Any) -> Generation:
        """One non-streaming request (HTTP /generate)."""
        import httpx

        body, echoed = self._body(prompt, stream=False, **params)
        gen = Generation(sent_at=time.perf_counter())
        try:
            resp = self._post("generate", body, stream=False)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.url}: {e}; is the server running (`specbuild status`)?") from e
        if resp.status_code != 200:
            raise RequestError(f"{self.model}: {wire.http_error(resp.status_code, resp.text)}")
        event = wire.parse_body(wire.KSERVE, resp.content)
        if event.error:
            raise RequestError(f"{self.model}: {event.error}")
        gen._absorb(event, time.perf_counter() - gen.sent_at)
        gen.seconds = time.perf_counter() - gen.sent_at
        if echoed:
            self._strip_echo(gen, prompt)
        return gen

    def generate_stream(self, prompt: str, on_chunk: Callable[[str], None] | None = None,
                        **params: Any) -> Generation:
        """One streaming request over HTTP SSE; `on_chunk` sees every piece as it arrives."""
        import httpx

        body, _ = self._body(prompt, stream=True, **params)
        gen = Generation(sent_at=time.perf_counter())
        try:
            with self._post("generate_stream", body, stream=True) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise RequestError(f"{self.model}: {wire.http_error(resp.status_code, resp.text)}")
                _read_events(resp, wire.KSERVE, gen, on_chunk, where=self.model)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.url}: {e}; is the server running (`specbuild status`)?") from e
        gen.seconds = time.perf_counter() - gen.sent_at
        return gen

    def grpc_stream(self, prompt: str, on_chunk: Callable[[str], None] | None = None,
                    stream: bool = True, cancel_after: int | None = None, **params: Any) -> Generation:
        """One request over gRPC streaming. `cancel_after=n` cancels it after n pieces (tests, Ctrl-C)."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        body, echoed = self._body(prompt, stream=stream, **params)
        try:
            return self._grpc_stream(grpcclient, body, echoed, prompt, on_chunk, cancel_after)
        except InferenceServerException as e:     # refused before any response (e.g. a tensor it does not take)
            raise RequestError(f"{self.model}: {e.message() if hasattr(e, 'message') else e}") from None

    def _grpc_stream(self, grpcclient, body: dict[str, Any], echoed: bool, prompt: str,
                     on_chunk: Callable[[str], None] | None, cancel_after: int | None) -> Generation:
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.grpc_url)
        gen = Generation()
        try:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            gen.sent_at = time.perf_counter()
            client.async_stream_infer(self.model, grpc_inputs(body, target=self.target, model=self.model),
                                      enable_empty_final_response=True)
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    result, error = results.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    raise ServerError(f"no response from {self.grpc_url} within {self.timeout:.0f}s") from None
                if error is not None:
                    raise RequestError(f"{self.model}: {error.message() if hasattr(error, 'message') else error}")
                t = time.perf_counter() - gen.sent_at
                n = len(gen.chunks)
                gen._absorb(wire.grpc_event(result), t)
                if on_chunk and len(gen.chunks) > n:
                    on_chunk(gen.chunks[-1])
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
                if cancel_after is not None and len(gen.chunks) >= cancel_after:
                    client.stop_stream(cancel_requests=True)
                    break
        finally:
            client.stop_stream()
            client.close()
        gen.seconds = time.perf_counter() - gen.sent_at
        if echoed:
            self._strip_echo(gen, prompt)
        return gen

    def metrics(self, metrics_url: str) -> dict[str, float]:
        return parse_metrics(http.get(metrics_url, timeout=10).text)


class OpenAIClient:
    """An OpenAI-compatible server: `api` is "openai-completions" (`/v1/completions`) or "openai-chat"
    (`/v1/chat/completions`: the prompt is one user message, the server applies its chat template). Request
    fields are the contract's names (`wire.openai_fields` maps them; `None` values are left out, so the server's
    default applies); `model` is the request's `model` field (`connect` finds it in `/v1/models`)."""

    def __init__(self, url: str, api: str, model: str | None, timeout: float = 300.0):
        if not wire.is_openai(api):
            raise ValueError(f"OpenAIClient speaks openai-completions or openai-chat, not {api!r}")
        self.url, self.api, self.model, self.timeout = url.rstrip("/"), api, model, timeout

    @classmethod
    def connect(cls, url: str, api: str, model: str | None = None, timeout: float = 300.0) -> "OpenAIClient":
        """The server at `url` up and ready, serving `model` (default: the first of its `/v1/models`)."""
        from specbuild.loadtests.target import preflight_openai

        info = preflight_openai(url.rstrip("/"), model)
        return cls(url, api, info.name, timeout)

    def request(self, prompt: str, stream: bool, **params: Any) -> tuple[str, dict[str, Any]]:
        """(URL, JSON body) of one request: `wire.encode` of the fields that are not None."""
        fields = {k: v for k, v in params.items() if v is not None}
        path, body = wire.encode(self.api, prompt, fields, model=self.model, stream=stream)
        return self.url + path, body

    def _refused(self, status: int, text: str) -> RequestError:
        return RequestError(f"{self.url} ({self.model}): {wire.http_error(status, text)}")

    def generate(self, prompt: str, **params: Any) -> Generation:
        """One non-streaming request."""
        import httpx

        url, body = self.request(prompt, False, **params)
        gen = Generation(sent_at=time.perf_counter())
        try:
            resp = http.post(url, json=body, timeout=self.timeout)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.url}: {e}; is the server running?") from e
        if resp.status_code != 200:
            raise self._refused(resp.status_code, resp.text)
        event = wire.parse_body(self.api, resp.content)
        if event.error:
            raise RequestError(f"{self.url} ({self.model}): {event.error}")
        gen._absorb(event, time.perf_counter() - gen.sent_at)
        gen.seconds = time.perf_counter() - gen.sent_at
        return gen

    def generate_stream(self, prompt: str, on_chunk: Callable[[str], None] | None = None,
                        **params: Any) -> Generation:
        """One streaming request (SSE until `data: [DONE]`); `on_chunk` sees every piece as it arrives."""
        import httpx

        url, body = self.request(prompt, True, **params)
        gen = Generation(sent_at=time.perf_counter())
        try:
            with http.stream("POST", url, json=body, timeout=self.timeout) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise self._refused(resp.status_code, resp.text)
                _read_events(resp, self.api, gen, on_chunk, where=f"{self.url} ({self.model})")
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.url}: {e}; is the server running?") from e
        gen.seconds = time.perf_counter() - gen.sent_at
        return gen


def _read_events(resp, api: str, gen: Generation, on_chunk: Callable[[str], None] | None, *, where: str) -> None:
    """A stream's SSE events into `gen` (each piece with its arrival time), `on_chunk` per new piece; an error
    event raises RequestError naming `where`."""
    for line in resp.iter_lines():
        event = wire.parse_line(api, line)
        if event is None:
            continue
        if event.error:
            raise RequestError(f"{where}: {event.error}")
        n = len(gen.chunks)
        gen._absorb(event, time.perf_counter() - gen.sent_at)
        if on_chunk and len(gen.chunks) > n:
            on_chunk(gen.chunks[-1])


def grpc_inputs(body: dict[str, Any], *, target: str = EMBEDDED, model: str | None = None) -> list:
    """tritonclient.grpc InferInputs with the datatypes the deployment declares and a batch dimension of 1
    (`specbuild.core.wire`)."""
    # The llmapi model declares max_batch_size 0 (model.yaml's triton_config): its tensors have no batch dimension.
    return wire.grpc_inputs(body, wire.datatypes(body, target=target, model=model),
                            batch_dim=target != contract.LLMAPI_TARGET)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}: `specbuild.core.metrics.parse_prometheus`."""
    from specbuild.core.metrics import parse_prometheus

    return parse_prometheus(text)


def metric(metrics: dict[str, float], name: str) -> float:
    """Sum of every series of `name` (any labels); 0.0 if absent: `specbuild.core.metrics.metric_sum`."""
    from specbuild.core.metrics import metric_sum

    return metric_sum(metrics, name)
