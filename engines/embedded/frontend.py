"""Serving frontend of the embedded engine: the whole request lifecycle, with no Triton imports.

    fe = Frontend(engine, metrics_sink=publish)      # publish(dict) sets the server's gauges/counters
    fe.start()
    fe.handle(get, send, key="req-1")                # parse + admit + submit; errors go to send() at once
    fe.cancel("req-1")                               # the one cancellation path (client gone)
    fe.close(timeout=5)                              # stop engine and sender threads (server shutdown)

- **Validation** happens here, once per request, before anything is queued: `parse_request` turns the
  client-contract tensors into `SamplingParams` + `RequestOptions`. It checks types, shapes, UTF-8 and the
  frontend's caps (prompt bytes, stop_words count and length); the sampling value rules live in
  `SamplingParams` and the engine's limits (prompt + max_tokens vs max_seq_len, K range, proposer) in
  `Engine.submit`; each is stated once and its error names the limit.
- **Admission**: the engine's waiting queue is bounded (`max_queue_size`, default 4 x max_batch_size) and a
  request that waits longer than `queue_timeout_s` is dropped; both answer an "unavailable" error at once
  (Triton UNAVAILABLE, HTTP 503) instead of hanging.
- **One registry** keyed by request id (the forwarding model's request key), **one output queue** filled by
  the engine thread (never blocked on IPC) and drained by **one sender thread**, which merges the deltas of a
  request that piled up (fewer responses, same text) and calls that request's `send(Reply)`.
- **Metrics** are pushed, never polled: before the sender delivers a request's final reply it pushes
  `metrics_sink` when anything changed, so a client that has its response reads counters that include it;
  in between, at most every `metrics_interval_s` after an engine step (so a streamed piece is counted within
  that bound).

Error kinds of a `Reply`: "invalid" (the request; HTTP 400), "unavailable" (overload; 503), "timeout" (the
request ran past `request_timeout_s`; 503), "internal" (the engine failed on this request only).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from specbuild.engines.embedded.errors import EngineLimitError, EngineUnavailableError
from specbuild.engines.embedded.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_PROMPT_BYTES = 64 * 1024
MAX_STOP_WORDS = 16
MAX_STOP_WORD_BYTES = 256


class BadRequest(ValueError):
    """A request the engine cannot run; `str(e)` goes back to the client (HTTP 400)."""

    kind = "invalid"


# ---- validation -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestLimits:
    max_prompt_bytes: int = MAX_PROMPT_BYTES        # UTF-8 bytes of text_input
    max_stop_words: int = MAX_STOP_WORDS            # entries of stop_words
    max_stop_word_bytes: int = MAX_STOP_WORD_BYTES  # UTF-8 bytes of one stop word


@dataclass(frozen=True)
class RequestOptions:
    stream: bool = False
    num_draft_tokens: int | None = None   # None => engine default; 0 => off; -1 => adaptive
    proposer: str | None = None           # None => engine default; "draft" | "ngram"
    exclude_input_in_output: bool = False
    return_perf_metrics: bool = False


@dataclass(frozen=True)
class ParsedRequest:
    prompt: str
    params: SamplingParams
    options: RequestOptions = RequestOptions()


def _scalar(get: Callable[[str], Any], name: str, kind: str, default: Any = None) -> Any:
    arr = get(name)
    if arr is None:
        return default
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise BadRequest(f"{name} must hold exactly one value per request (got {flat.size}); "
                         "send one prompt per request.")
    v = flat[0]
    try:
        if kind == "bool":
            return bool(v)
        if kind == "int":
            return int(v)
        if kind == "float":
            return float(v)
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"{name} must be {'an integer' if kind == 'int' else 'a number'} (got {v!r}).") from None
    return v


def _text(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start}); "
                             "send UTF-8 encoded text.") from None
    if isinstance(value, str):
        return value
    raise BadRequest(f"{name} must be text (BYTES), got {type(value).__name__}.")


def parse_request(get: Callable[[str], Any], limits: RequestLimits = RequestLimits()) -> ParsedRequest:
    """`get(name)` -> the input tensor as a numpy array, or None when the client left it out."""
    raw = _scalar(get, "text_input", "raw")
    if raw is None:
        raise BadRequest("text_input is missing; send the prompt as a BYTES tensor named text_input.")
    if isinstance(raw, (bytes, np.bytes_)) and len(raw) > limits.max_prompt_bytes:
        raise BadRequest(f"text_input is {len(raw)} bytes, above the limit max_prompt_bytes="
                         f"{limits.max_prompt_bytes}; send a shorter prompt.")
    prompt = _text(raw, "text_input")
    if len(prompt.encode("utf-8")) > limits.max_prompt_bytes:
        raise BadRequest(f"text_input is above the limit max_prompt_bytes={limits.max_prompt_bytes}; "
                         "send a shorter prompt.")
    if not prompt:
        raise BadRequest("text_input is empty; send a non-empty prompt.")
    max_tokens = _scalar(get, "max_tokens", "int")
    if max_tokens is None:
        raise BadRequest("max_tokens is missing; send the number of tokens to generate (INT32 > 0).")
    top_p = _scalar(get, "top_p", "float", 1.0)
    if top_p == 0.0:
        top_p = 1.0  # upstream TRT-LLM clients send top_p=0 to mean "off"
    min_tokens = _scalar(get, "min_tokens", "int", None)
    if min_tokens is None:
        min_tokens = _scalar(get, "min_length", "int", 0)
    stop = _stop_words(get("stop_words"), limits)
    end_id = _scalar(get, "end_id", "int", None)
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=_scalar(get, "temperature", "float", 0.0),
            top_k=_scalar(get, "top_k", "int", 0), top_p=top_p, seed=_scalar(get, "seed", "int", None),
            min_tokens=min(min_tokens, max_tokens) if max_tokens > 0 else min_tokens, stop=stop,
            stop_token_ids=(end_id,) if end_id is not None else None)
    except EngineLimitError as e:
        raise BadRequest(str(e)) from None
    proposer = _scalar(get, "proposer", "raw", None)
    options = RequestOptions(
        stream=_scalar(get, "stream", "bool", False),
        num_draft_tokens=_scalar(get, "num_draft_tokens", "int", None),
        proposer=None if proposer is None else _text(proposer, "proposer").strip().lower(),
        exclude_input_in_output=_scalar(get, "exclude_input_in_output", "bool", False),
        return_perf_metrics=_scalar(get, "return_perf_metrics", "bool", False))
    return ParsedRequest(prompt, params, options)


def _stop_words(arr, limits: RequestLimits) -> tuple[str, ...]:
    if arr is None:
        return ()
    words = np.asarray(arr).reshape(-1)
    if words.size > limits.max_stop_words:
        raise BadRequest(f"stop_words has {words.size} entries, above the limit max_stop_words="
                         f"{limits.max_stop_words}.")
    out = []
    for w in words:
        s = _text(w, "stop_words")
        if len(s.encode("utf-8")) > limits.max_stop_word_bytes:
            raise BadRequest(f"a stop word is {len(s.encode('utf-8'))} bytes, above the limit "
                             f"max_stop_word_bytes={limits.max_stop_word_bytes}.")
        if s:
            out.append(s)
    return tuple(out)


# ---- lifecycle -----------------------------------------------------------------------------------
@dataclass
class Reply:
    """One response to a client: a text piece, or the final one; with `error`, a refusal/failure."""

    text: str = ""
    final: bool = False
    stats: Any = None                  # SpecStats, only when the request asked for perf metrics
    error: str | None = None
    kind: str | None = None            # with error: "invalid" | "unavailable" | "internal"
    carries_text: bool = False         # a non-streaming answer: always send text_output, even if empty


@dataclass(eq=False)
class _Entry:
    key: str
    request: ParsedRequest
    send: Callable[[Reply], None]
    chunks: list[str] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False
    started: bool = False


_TICK, _STOP = object(), object()
_COUNTER_OF_KIND = {"invalid": "requests_refused_invalid_total", "unavailable": "requests_refused_unavailable_total",
                    "timeout": "requests_timed_out_total", "internal": "requests_failed_total"}


class Frontend:
    def __init__(self, engine, limits: RequestLimits = RequestLimits(), *,
                 metrics_sink: Callable[[dict], None] | None = None, metrics_interval_s: float = 0.2):
        self.engine, self.limits = engine, limits
        self.metrics_sink, self.metrics_interval_s = metrics_sink, metrics_interval_s
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._early_cancels: OrderedDict[str, None] = OrderedDict()   # cancels that overtook their submit
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._dirty = False
        self._sink_lock = threading.Lock()    # the sink turns totals into counter increments: one at a time
        self._closed = False
        self.counters = {"requests_cancelled_total": 0, "requests_refused_invalid_total": 0,
                         "requests_refused_unavailable_total": 0, "requests_timed_out_total": 0,
                         "requests_failed_total": 0, "max_active": 0}
        self._active = 0
        self._sender = threading.Thread(target=self._send_loop, name="specbuild-sender", daemon=True)
        engine.scheduler.on_step = self._on_step

    def start(self, run_engine: bool = True) -> None:
        """Start the sender thread and (unless `run_engine` is False: the caller steps the engine) the engine's."""
        self._sender.start()
        if run_engine:
            self.engine.start()

    # ---- requests (any thread) ---------------------------------------------------------------------
    def parse(self, get: Callable[[str], Any]) -> ParsedRequest:
        return parse_request(get, self.limits)

    def handle(self, get: Callable[[str], Any], send: Callable[[Reply], None], key: str | None = None) -> None:
        """Parse and submit one request; a refusal is sent (final, with its kind) before this returns."""
        try:
            self.submit(self.parse(get), send, key)
        except Exception as e:  # noqa: BLE001 - this request only
            kind = getattr(e, "kind", "internal")
            if kind not in ("invalid", "unavailable"):
                kind = "internal"
                log.exception("request %s could not be submitted", key)
            with self._lock:
                self.counters[_COUNTER_OF_KIND.get(kind, "requests_failed_total")] += 1
            # counted at the sender's next push (within metrics_interval_s): a refusal never waits on the
            # metrics round trip, which holds the lock every final reply needs (a flood of cheap invalid
            # requests would slow every stream)
            self._dirty_tick()
            send(Reply(final=True, error=str(e) if kind != "internal" else f"{type(e).__name__}: {e}", kind=kind))

    def publish_soon(self) -> None:
        """Push the current metrics at the sender's next push (within metrics_interval_s) even if nothing changed:
        a metrics publisher that (re)connected has seen none of this engine's totals yet."""
        self._dirty_tick()

    def count_refusal(self, kind: str) -> None:
        """Count a request refused before `handle` (the service's size caps); pushed at the next metrics push."""
        with self._lock:
            self.counters[_COUNTER_OF_KIND.get(kind, "requests_failed_total")] += 1
        self._dirty_tick()

    def submit(self, request: ParsedRequest, send: Callable[[Reply], None], key: str | None = None) -> str:
        key = key or f"fe-{next(self._ids)}"
        entry = _Entry(key, request, send)
        with self._lock:
            if self._closed:
                raise EngineUnavailableError("the server is shutting down; retry on another replica or later.")
            if key in self._entries:
                raise BadRequest(f"request id {key!r} is already in use")
            if self._early_cancels.pop(key, False) is None:
                raise EngineUnavailableError(f"request {key} was cancelled before it started.")
            self._entries[key] = entry
        o = request.options
        try:
            self.engine.submit(request.prompt, request.params, num_draft_tokens=o.num_draft_tokens,
                               proposer=o.proposer, request_id=key,
                               on_output=lambda d, e=entry: self._outbox.put((e, d)))
        except BaseException:
            with self._lock:
                self._entries.pop(key, None)
            raise
        return key

    def cancel(self, key: str) -> bool:
        """Abort a request (client gone): its slot is free when this returns. False if it is not live."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._early_cancels[key] = None
                while len(self._early_cancels) > 1024:
                    self._early_cancels.popitem(last=False)
                return False
            if entry.done or entry.cancelled:
                return False
            entry.cancelled = True
            self.counters["requests_cancelled_total"] += 1
        self.engine.abort(key)
        return True

    def live(self) -> int:
        with self._lock:
            return len(self._entries)

    def metrics(self) -> dict:
        m = dict(self.engine.metrics())
        with self._lock:
            m.update(self.counters, live=len(self._entries), active=self._active)
        m["queue_limit"] = self.engine.config.queue_limit or 0        # 0: no limit
        m["slots_total"] = self.engine.config.max_batch_size
        return m

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Refuse new requests, stop the engine thread (live requests end with an empty final reply) and the
        sender thread; returns within about 2 x `timeout` even if a step hangs."""
        with self._lock:
            self._closed = True
        self.engine.shutdown(timeout)
        self._outbox.put(_STOP)
        if self._sender.is_alive():
            self._sender.join(timeout)
        with self._lock:
            left = [e for e in self._entries.values() if not e.done]
            self._entries.clear()
        for e in left:                     # the engine thread is stuck: close the streams anyway
            e.done = True
            self._safe_send(e, Reply(final=True, error="the server is shutting down", kind="unavailable"))

    # ---- the sender thread -------------------------------------------------------------------------
    def _on_step(self) -> None:            # engine thread, after every step: cheap
        self._dirty_tick()

    def _dirty_tick(self) -> None:
        if not self._dirty:
            self._dirty = True
            self._outbox.put(_TICK)

    def _send_loop(self) -> None:
        last_push = 0.0
        while True:
            wait = None
            if self._dirty:
                wait = max(0.0, last_push + self.metrics_interval_s - time.monotonic())
            try:
                batch = [self._outbox.get(timeout=wait)]
            except queue.Empty:
                batch = []
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            for entry, delta in _coalesce([b for b in batch if b is not _STOP and b is not _TICK]):
                self._deliver(entry, delta)
            if self._dirty and (stop or time.monotonic() >= last_push + self.metrics_interval_s):
                self._dirty = False
                last_push = time.monotonic()
                self._push_metrics()
            if stop:
                return

    def _push_metrics(self) -> None:
        """Publish the metrics (sender thread, or a refusing request's thread; one at a time)."""
        self._dirty = False
        if self.metrics_sink is None:
            return
        try:
            with self._sink_lock:
                self.metrics_sink(self.metrics())
        except Exception:  # noqa: BLE001
            log.exception("metrics sink raised")

    def _deliver(self, entry: _Entry, d) -> None:
        if entry.done:
            return
        with self._lock:
            if not entry.started:
                entry.started = True
                self._active += 1
                self.counters["max_active"] = max(self.counters["max_active"], self._active)
            if d.finished:
                entry.done = True
                self._active -= 1
                self._entries.pop(entry.key, None)   # leave the registry before the final reply
                if d.error:
                    self.counters[_COUNTER_OF_KIND.get(d.error_kind, "requests_failed_total")] += 1
        if d.finished:
            self._dirty = True
            self._push_metrics()                     # the counters include this request before its reply
        o = entry.request.options
        if d.error or d.finish_reason == "error":
            kind = d.error_kind or "internal"
            reply = Reply(final=True, kind=kind,
                          error=d.error if kind != "internal" else f"engine error: {d.error or 'unknown'}")
        elif d.finish_reason == "abort":
            reply = Reply(final=True)
        elif not o.stream:
            entry.chunks.append(d.text)
            if not d.finished:
                return
            text = "".join(entry.chunks)
            reply = Reply(text if o.exclude_input_in_output else entry.request.prompt + text, True,
                          d.stats if o.return_perf_metrics else None, carries_text=True)
        elif d.finished:
            reply = Reply(d.text, True, d.stats if o.return_perf_metrics else None)
        elif d.text:
            reply = Reply(d.text)
        else:
            return
        if not self._safe_send(entry, reply) and not d.finished:
            self.cancel(entry.key)

    def _safe_send(self, entry: _Entry, reply: Reply) -> bool:
        try:
            entry.send(reply)
            return True
        except Exception as e:  # noqa: BLE001 - a broken client must not stop the sender
            log.warning("could not send to %s: %s", entry.key, e)
            return False


def _coalesce(items: list) -> list:
    """Merge consecutive deltas of each request (per-request order kept); a final delta closes a run."""
    out: list = []
    index: dict[int, int] = {}
    for entry, d in items:
        i = index.get(id(entry))
        if i is None or out[i][1].finished:
            index[id(entry)] = len(out)
            out.append((entry, d))
            continue
        prev = out[i][1]
        out[i] = (entry, type(d)(request_id=d.request_id, token_ids=list(prev.token_ids) + list(d.token_ids),
                                 text=prev.text + d.text, finished=d.finished, finish_reason=d.finish_reason,
                                 stats=d.stats, error=d.error, error_kind=d.error_kind))
    return out
