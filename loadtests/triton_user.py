"""Locust users for LLM endpoints (Triton's KServe generate, gRPC streaming, OpenAI completions / chat):
an abstract `TritonUser` owns a client (`loadtests/clients.py`) and fires request events.

Metrics (client side, the GenAI-Perf / `vllm bench serve` definitions, the same for every API):

- TTFT: send -> first response carrying a non-empty piece of text (`text_output`, or an OpenAI chunk's
  `choices[0].text` / `delta.content`; streaming only).
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

Transports: `loadtests/clients.py`; the wire format (bodies, datatypes, SSE, perf metrics, errors):
`specbuild.core.wire`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gevent
from locust import User

from specbuild.loadtests.clients import GrpcClient, HttpClient, RequestFailed, Timer  # noqa: F401 (API)
from specbuild.loadtests.runspec import RunSpec
from specbuild.loadtests.stopping import is_connection_error, report_server_gone
from specbuild.loadtests.tokens import TokenCounter



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
    server_tokens: int | None = None               # the server's own count (OpenAI usage.completion_tokens)
    overhead_ms: float = 0.0                       # time spent in harness code (parsing, counting, events)
    user: str | None = None                        # the Locust user that sent it ("<worker>-<n>", as seeded)
    prompt: int | None = None                      # its prompt's index in the run's prompts


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
        self._own_errors = 0        # this user's consecutive connection errors (its back-off)
        self.client = self.new_client()

    def new_client(self):
        spec = self.spec
        if spec.protocol == "grpc":
            return GrpcClient(spec.grpc_url, spec.model, spec.request_timeout_s, spec.grpc_batch_dim,
                              spec.datatypes)
        return HttpClient(spec.url, spec.model, spec.request_timeout_s, api=spec.api)

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

    def fields(self, output_tokens: int | None) -> dict:
        """The run's request fields; with a per-prompt output length (from the data), its max_tokens (and
        min_tokens / min_length when the run fixes the output length)."""
        payload = self.spec.payload
        if output_tokens is None:
            return payload
        fields = {**payload, "max_tokens": output_tokens}
        for fixed in ("min_tokens", "min_length"):
            if fixed in payload:
                fields[fixed] = output_tokens
        return fields

    def generate(self, prompt: str, input_tokens: int | None = None, output_tokens: int | None = None,
                 client=None, prompt_index: int | None = None) -> Sample:
        counter, out = self._shared()
        client = client or self.client
        timer = Timer()
        sample = Sample(start=timer.start, input_tokens=input_tokens, user=getattr(self, "user_key", None),
                        prompt=prompt_index)
        client.overhead = 0.0
        try:
            client.generate(prompt, self.fields(output_tokens), self.spec.stream, timer)
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
        sample.overhead_ms = (client.overhead + time.perf_counter() - t_post) * 1000
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
        if "completion_tokens" in timer.got.usage:
            sample.server_tokens = timer.got.usage["completion_tokens"]

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
