"""Triton Python-backend model `tensorrt_llm` of the embedded deployment: holds the ONE engine.

One instance (one stub process) loads `specbuild.engines.embedded.Engine` from the build directory
named in config.pbtxt and starts its continuous-batching scheduler thread. `execute` only validates
and submits: every request joins the running batch at once, and the scheduler thread streams each
request's tokens back through that request's response sender (decoupled mode).

`stream=false` requests get exactly ONE response (the whole text, flagged final), which is what lets
HTTP `/generate` serve them even though the model is decoupled. Cancelled requests (client gone) are
aborted in the engine so their batch slot is freed. Speculation counters are exported as Triton
custom metrics (`specbuild_*`) on the metrics port.
"""

import os
import queue
import site
import threading
from types import SimpleNamespace

for _d in os.environ.get("SPECBUILD_SITE_DIRS", "").split(os.pathsep):
    if _d:
        site.addsitedir(_d)  # honour .pth files (editable installs) of the serving environment

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
COUNTERS = (  # (engine metrics key, metric name, help)
    ("requests_total", "specbuild_requests_total", "Requests finished by the embedded engine"),
    ("generated_tokens_total", "specbuild_generated_tokens_total", "Tokens generated (emitted)"),
    ("draft_tokens_total", "specbuild_draft_tokens_total", "Draft tokens proposed (drafted)"),
    ("accepted_tokens_total", "specbuild_accepted_tokens_total", "Draft tokens accepted by the target"),
    ("drafts_total", "specbuild_drafts_total", "Speculation rounds (drafts scored by the target)"),
)


def _coalesce(batch):
    """Merge the deltas of each request in `batch` into one (per-request order kept; None = stop marker)."""
    out, index, stop = [], {}, False
    for item in batch:
        if item is None:
            stop = True
            continue
        live, d = item
        i = index.get(id(live))
        if i is None or out[i][1].finished:
            index[id(live)] = len(out)
            out.append(item)
            continue
        prev = out[i][1]
        out[i] = (live, SimpleNamespace(
            request_id=d.request_id, token_ids=list(prev.token_ids) + list(d.token_ids), text=prev.text + d.text,
            finished=d.finished, finish_reason=d.finish_reason, stats=d.stats, error=d.error))
    return out + [None] if stop else out


class _Live:
    __slots__ = ("sender", "parsed", "chunks", "rid", "done", "key", "abort_requested", "aborted", "started")

    def __init__(self, sender, parsed, key):
        self.sender, self.parsed, self.chunks, self.rid, self.done = sender, parsed, [], None, False
        self.key, self.abort_requested, self.aborted, self.started = key, False, False, False


class TritonPythonModel:
    def initialize(self, args):
        import sys

        # The scheduler thread holds the GIL most of the time (a small model is Python-bound); every
        # response send and every new request needs the GIL in another thread, which by default waits up to
        # 5 ms per hand-over. 0.5 ms keeps streaming and admission latency low.
        sys.setswitchinterval(0.0005)
        from specbuild.engines.embedded import Engine
        from specbuild.model_repository.embedded.request_params import Limits

        params = {k: v["string_value"] for k, v in
                  __import__("json").loads(args["model_config"]).get("parameters", {}).items()}
        threads = int(params.get("threads") or 0) or None
        self.engine = Engine.from_build_dir(params["engine_dir"], device=params.get("device") or None,
                                            threads=threads)
        self._apply_tuned_defaults(params)
        cfg = self.engine.config
        self.limits = Limits(max_seq_len=cfg.max_seq_len, max_draft_len=cfg.max_draft_len,
                             has_draft=getattr(cfg, "has_draft", True))
        self.lock = threading.Lock()
        self.live = {}             # id(live) -> _Live
        self.by_key = {}           # request_key (set by the forwarding models) -> _Live
        self.aborted = 0
        self._init_metrics()
        self.outbox = queue.Queue()  # (live, delta) from the scheduler thread to the sender thread
        self.sender_thread = threading.Thread(target=self._send_loop, name="specbuild-sender", daemon=True)
        self.sender_thread.start()
        self.engine.start()
        self.stop_event = threading.Event()
        self.watchdog = threading.Thread(target=self._watch, name="specbuild-watchdog", daemon=True)
        self.watchdog.start()
        pb_utils.Logger.log_info(f"specbuild engine loaded from {params['engine_dir']} "
                                 f"(max_batch_size={cfg.max_batch_size}, max_seq_len={cfg.max_seq_len}, "
                                 f"max_draft_len={cfg.max_draft_len})")

    def _apply_tuned_defaults(self, params):
        """`specbuild tune --apply` writes default_num_draft_tokens / default_proposer into this config."""
        import dataclasses

        changes = {}
        if params.get("default_num_draft_tokens", "").strip():
            changes["default_num_draft_tokens"] = int(params["default_num_draft_tokens"])
        if params.get("default_proposer", "").strip():
            changes["default_proposer"] = params["default_proposer"].strip()
        if changes:
            self.engine.config = dataclasses.replace(self.engine.config, **changes)
            pb_utils.Logger.log_info(f"specbuild: tuned defaults applied: {changes}")

    # ---- metrics -------------------------------------------------------------------------------
    def _init_metrics(self):
        self.counters, self.seen = {}, {}
        for key, name, doc in COUNTERS:
            fam = pb_utils.MetricFamily(name=name, description=doc, kind=pb_utils.MetricFamily.COUNTER)
            self.counters[key] = (fam, fam.Metric(labels={}))
            self.seen[key] = 0
        gauge = pb_utils.MetricFamily.GAUGE
        self.rate_family = pb_utils.MetricFamily(
            name="specbuild_acceptance_rate", kind=gauge,
            description="Accepted / drafted tokens since the model was loaded")
        self.rate = self.rate_family.Metric(labels={})
        self.running_family = pb_utils.MetricFamily(
            name="specbuild_running_requests", kind=gauge, description="Requests in the running batch")
        self.running = self.running_family.Metric(labels={})
        self.waiting_family = pb_utils.MetricFamily(
            name="specbuild_waiting_requests", kind=gauge, description="Requests waiting for a batch slot")
        self.waiting = self.waiting_family.Metric(labels={})
        self.max_running_family = pb_utils.MetricFamily(
            name="specbuild_max_running_requests", kind=gauge,
            description="Most requests seen producing tokens at the same time (first token out, not "
                        "finished): > 1 shows continuous batching")
        self.max_running = self.max_running_family.Metric(labels={})
        self.aborted_family = pb_utils.MetricFamily(
            name="specbuild_requests_aborted_total", kind=pb_utils.MetricFamily.COUNTER,
            description="Requests aborted because the client cancelled or disconnected")
        self.aborted_metric = self.aborted_family.Metric(labels={})
        self.max_seen = 0
        self.active = 0            # requests between their first output and their end

    def _sync_metrics(self):
        m = self.engine.metrics()
        with self.lock:
            for key, (_, metric) in self.counters.items():
                value = int(m.get(key, 0))
                if value > self.seen[key]:
                    metric.increment(value - self.seen[key])
                    self.seen[key] = value
            drafted = self.seen["draft_tokens_total"]
            self.rate.set(self.seen["accepted_tokens_total"] / drafted if drafted else 0.0)
            self.running.set(int(m.get("running", 0)))
            self.waiting.set(int(m.get("waiting", 0)))

    def _watch(self):
        # Cancellation is polled (a queued request produces no callback to notice it in). is_cancelled()
        # runs under self.lock and only for requests still in self.live: a request leaves self.live (under
        # the lock) before its final response is sent, and asking a finished request's response factory
        # whether it is cancelled crashes tritonserver 2.51.
        while not self.stop_event.wait(0.1):
            cancelled = []
            with self.lock:
                for live in self.live.values():
                    try:
                        if live.rid is not None and not live.aborted and live.sender.is_cancelled():
                            cancelled.append(live)
                    except Exception as e:  # keep watching the others
                        pb_utils.Logger.log_warn(f"cancellation check failed: {e}")
            for live in cancelled:
                self._abort(live)
            try:
                self._sync_metrics()
            except Exception as e:
                pb_utils.Logger.log_warn(f"metrics update failed: {e}")

    def _forget(self, live):
        with self.lock:
            self.live.pop(id(live), None)
            if live.key:
                self.by_key.pop(live.key, None)

    def _abort_key(self, key):
        with self.lock:
            live = self.by_key.get(key)
            if live is None or live.done:
                return
            live.abort_requested = True
        if live.rid is not None:
            self._abort(live)

    def _abort(self, live):
        with self.lock:
            if live.aborted or live.done:
                return
            live.aborted = True
            self.aborted += 1
            self.aborted_metric.increment(1)
        self.engine.abort(live.rid)

    # ---- requests ------------------------------------------------------------------------------
    def execute(self, requests):
        from specbuild.engines.embedded import SamplingParams
        from specbuild.model_repository.embedded.request_params import BadRequest, parse_request

        for request in requests:
            sender = request.get_response_sender()

            def get(name, request=request):
                t = pb_utils.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            key = get("request_key")
            key = None if key is None else bytes(key.reshape(-1)[0]).decode("utf-8", "replace")
            abort = get("abort")
            if abort is not None and bool(abort.reshape(-1)[0]):
                self._abort_key(key)
                sender.send(flags=FINAL)
                continue
            try:
                parsed = parse_request(get, self.limits)
                live = _Live(sender, parsed, key)
                with self.lock:
                    self.live[id(live)] = live
                    if key:
                        self.by_key[key] = live
                try:
                    live.rid = self.engine.submit(parsed.prompt, SamplingParams(**parsed.sampling),
                                                  num_draft_tokens=parsed.num_draft_tokens,
                                                  proposer=parsed.proposer,
                                                  on_output=lambda d, live=live: self._on_output(live, d))
                except BaseException:
                    self._forget(live)
                    raise
                if live.abort_requested:  # the abort overtook the submit
                    self._abort(live)
            except BadRequest as e:
                self._send_error(sender, str(e))
            except Exception as e:  # EngineLimitError and anything else: this request only
                self._send_error(sender, f"{type(e).__name__}: {e}")
        return None

    def _send_error(self, sender, message):
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message)),
                    flags=FINAL)

    def _on_output(self, live, delta):
        # Called by the engine's scheduler thread: never block it on IPC, hand the delta to the sender.
        self.outbox.put((live, delta))

    def _send_loop(self):
        """Deliver deltas in order. When sending falls behind (many streams), consecutive deltas of one
        request are merged into one response: fewer IPC round trips, same text."""
        while True:
            batch = [self.outbox.get()]
            while True:
                try:
                    batch.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            for item in _coalesce(batch):
                if item is None:
                    return
                live, delta = item
                try:
                    self._deliver(live, delta)
                except Exception as e:
                    pb_utils.Logger.log_error(f"could not deliver output of {delta.request_id}: {e}")
                    if not delta.finished and live.rid is not None:
                        self._abort(live)

    def _track_active(self, live, finished):
        with self.lock:
            if not live.started:
                live.started = True
                self.active += 1
                if self.active > self.max_seen:
                    self.max_seen = self.active
                    self.max_running.set(self.active)
            if finished:
                self.active -= 1

    def _deliver(self, live, delta):
        p = live.parsed
        if live.done:
            return
        self._track_active(live, delta.finished)
        if delta.finished:
            live.done = True
            self._forget(live)
        if delta.error or delta.finish_reason == "error":
            self._send_error(live.sender, f"engine error: {delta.error or 'unknown'}")
            return
        if delta.finish_reason == "abort":
            live.sender.send(flags=FINAL)
            return
        if not p.stream:
            live.chunks.append(delta.text)
            if not delta.finished:
                return
            text = "".join(live.chunks)
            if not p.exclude_input_in_output:
                text = p.prompt + text
            live.sender.send(self._response(text, delta.stats if p.return_perf_metrics else None,
                                            p.return_perf_metrics), flags=FINAL)
            return
        if delta.finished:
            if delta.text or p.return_perf_metrics:
                live.sender.send(self._response(delta.text, delta.stats, p.return_perf_metrics), flags=FINAL)
            else:
                live.sender.send(flags=FINAL)
        elif delta.text:
            live.sender.send(self._response(delta.text, None, False))

    def _response(self, text, stats, with_perf):
        from specbuild.model_repository.embedded.request_params import perf_metrics

        tensors = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))]
        if with_perf:
            tensors += [pb_utils.Tensor(k, v) for k, v in perf_metrics(stats).items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.stop_event.set()
        try:
            self.engine.shutdown()     # aborts what is still live; its final deltas go through the outbox
            self.outbox.put(None)
            self.sender_thread.join(timeout=10)
        finally:
            pb_utils.Logger.log_info("specbuild engine stopped")
