"""The Triton Python-backend models of the embedded deployment; imported by the rendered model.py files, inside
tritonserver's stubs only (it imports `triton_python_backend_utils`).

- `ForwardingModel` (`ensemble`, `tensorrt_llm_bls`): each request goes to the engine process over the
  model's own connection (`engines/embedded/service.py`), and the model sends the engine's replies to its own
  clients. A cancelled request (gRPC cancel, a dropped stream) is found by a watchdog polling
  `is_cancelled()` and cancelled in the engine.
- `EngineModel` (`tensorrt_llm`): starts the engine process (and starts it again if it dies), owns the
  `specbuild_*` / `vllm:spec_decode_*` custom metrics the engine pushes, and serves requests like the others.

No model waits on another model's stub: a stub that dies or stalls fails its own requests only (the engine
closes its connection and frees its slots); the old BLS hop between stubs could hang them all.

stream=false requests get exactly ONE response (flagged final), so HTTP /generate works although the models
are decoupled. `is_cancelled()` is only asked of a request that has not had its final response (asking a
finished request's sender crashes tritonserver 2.51): a request leaves `live` under the lock before that.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from specbuild.engines.embedded.service_client import (EngineConnection, EngineProcess, EngineUnavailable,
                                                       argv_for, socket_path)
from specbuild.engines.embedded.wire_ipc import ProtocolError, TooLarge, array_sizes, check_sizes, tensor_to_wire
from specbuild.model_repository.embedded.request_params import perf_arrays

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ERROR_CODES = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "timeout": "UNAVAILABLE",
               "internal": "INTERNAL"}


def error_response(message: str, kind: str = "internal"):
    code = getattr(pb_utils.TritonError, ERROR_CODES.get(kind, "INTERNAL"), None)
    err = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


def send_reply(sender, msg: dict) -> None:
    """One engine reply frame as one Triton response."""
    final = bool(msg.get("final"))
    if msg.get("error") is not None:
        sender.send(error_response(msg["error"], msg.get("kind") or "internal"), flags=FINAL)
        return
    text, perf = msg.get("text") or "", msg.get("perf")
    if final and not text and perf is None and not msg.get("carries_text"):
        sender.send(flags=FINAL)
        return
    tensors = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))]
    if perf is not None:
        tensors += [pb_utils.Tensor(k, v) for k, v in perf_arrays(*perf).items()]
    sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)


def model_params(args: dict) -> tuple[dict, dict]:
    cfg = json.loads(args["model_config"])
    return cfg, {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}


class _Request:
    """A request's response sender, used by one thread at a time: the connection's reader sends its pieces while
    the watchdog may close it (client gone) and the execute thread may fail it. Two threads sending on one
    sender at once let a piece overtake the final flag inside tritonserver 2.51, which then uses the freed
    response factory: every send goes through `send` (its own lock; nothing after the final flag)."""

    __slots__ = ("sender", "lock", "closed", "generation")

    def __init__(self, sender):
        self.sender, self.lock, self.closed = sender, threading.Lock(), False
        self.generation: int | None = None     # the engine connection it was sent on (None: not sent yet)

    def send(self, fn, final: bool) -> bool:
        """Run `fn(sender)` unless the final response was sent already; False if it was."""
        with self.lock:
            if self.closed:
                return False
            self.closed = final
            fn(self.sender)
            return True


class ForwardingModel:
    def initialize(self, args):
        # many I/O-bound threads (execute, the connection's reader, the watchdog): hand the GIL over quickly
        sys.setswitchinterval(0.0005)
        cfg, self.params = model_params(args)
        self.name = cfg["name"]
        self.inputs = [i["name"] for i in cfg["input"]]
        self.path = socket_path(Path(args["model_repository"]).parent, os.getppid())
        self.lock = threading.Lock()
        self.live: dict[str, _Request] = {}      # key -> request, until its final response is on its way
        self.keys = itertools.count(1)
        self.conn = EngineConnection(self.path, self._on_frame, self._on_lost,
                                     connect_timeout=float(self.params.get("connect_timeout_s") or 10.0))
        self.stop_event = threading.Event()
        self.watchdog = threading.Thread(target=self._watch, name=f"{self.name}-watchdog", daemon=True)
        self.watchdog.start()

    def execute(self, requests):
        for request in requests:
            req = _Request(request.get_response_sender())
            key = str(next(self.keys))
            try:
                arrays = {}
                for name in self.inputs:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        arrays[name] = t.as_numpy()
                # element counts and bytes before any encoding: a 2,000,000-entry stop_words costs nothing more
                check_sizes({name: array_sizes(a) for name, a in arrays.items()})
                tensors = {name: tensor_to_wire(a) for name, a in arrays.items()}
                with self.lock:
                    self.live[key] = req
                self.conn.send({"op": "submit", "key": key, "tensors": tensors},
                               sent_on=lambda g, req=req: setattr(req, "generation", g))
            except TooLarge as e:
                self._close(key, req, error_response(str(e), "invalid"))
            except ProtocolError as e:
                self._close(key, req, error_response(f"the request is too large to forward: {e}", "invalid"))
            except EngineUnavailable as e:
                self._close(key, req, error_response(str(e), "unavailable"))
            except Exception as e:  # noqa: BLE001 - this request only
                self._close(key, req, error_response(f"{self.name}: {type(e).__name__}: {e}", "internal"))
        return None

    def _close(self, key, req: _Request, response=None) -> None:
        """The final response of `req` (an error, or the bare final flag), unless it has had one."""
        with self.lock:
            self.live.pop(key, None)
        try:
            req.send(lambda s: s.send(response, flags=FINAL) if response is not None else s.send(flags=FINAL),
                     final=True)
        except Exception as e:  # noqa: BLE001
            pb_utils.Logger.log_warn(f"{self.name}: could not close request {key}: {e}")

    def _on_frame(self, msg: dict) -> None:     # the connection's reader thread
        if msg.get("op") != "reply":
            return
        key, final = msg.get("key"), bool(msg.get("final"))
        with self.lock:
            req = self.live.pop(key, None) if final else self.live.get(key)
        if req is None:
            return                                   # cancelled by its client: its final flag is already sent
        try:
            req.send(lambda s: send_reply(s, msg), final=final)
        except Exception as e:  # noqa: BLE001 - a broken client is its own request's problem
            pb_utils.Logger.log_warn(f"{self.name}: sending to request {key} failed ({e}); cancelling it")
            if not final:
                self._abandon([key])

    def _on_lost(self, reason: str, generation: int | None = None) -> None:
        """The engine connection `generation` broke (None: every request, the model is unloading): fail the
        requests sent on it. Those already sent on the next connection (execute runs on while this thread
        starts) are not its: failing them was a spurious 503, and their replies were then dropped."""
        with self.lock:
            lost = {k: r for k, r in self.live.items() if generation is None or r.generation == generation}
            for k in lost:
                del self.live[k]
        if lost:
            pb_utils.Logger.log_error(f"{self.name}: lost the engine process ({reason}); failing {len(lost)} "
                                      "request(s) in flight")
        for key, req in lost.items():
            self._close(key, req, error_response(f"the engine process went away mid-request ({reason}); retry.",
                                                 "unavailable"))

    def _watch(self) -> None:
        while not self.stop_event.wait(0.1):
            cancelled = []
            with self.lock:                          # a request leaves `live` under this lock before its final
                for key, req in list(self.live.items()):
                    try:
                        if req.sender.is_cancelled():
                            cancelled.append(key)
                    except Exception as e:  # noqa: BLE001
                        pb_utils.Logger.log_warn(f"{self.name}: cancellation check of {key} failed: {e}")
            if cancelled:
                self._abandon(cancelled)

    def _abandon(self, keys) -> None:
        """The clients of `keys` are gone: close their responses and cancel them in the engine."""
        with self.lock:
            reqs = [(k, self.live.pop(k)) for k in keys if k in self.live]
        for key, req in reqs:
            self._close(key, req)                    # a cancelled request still needs its final flag
            try:
                self.conn.send({"op": "cancel", "key": key})
            except EngineUnavailable:
                pass                                 # no engine: nothing runs for it either

    def finalize(self):
        self.stop_event.set()
        self.watchdog.join(timeout=2)
        self.conn.close()
        self._on_lost("the model is being unloaded")


# ---- tensorrt_llm: the engine's owner ------------------------------------------------------------------
COUNTER, GAUGE = "counter", "gauge"
METRICS = (  # (engine metrics key, metric name, kind, help)
    ("requests_total", "specbuild_requests_total", COUNTER, "Requests queued in the engine (passed validation)"),
    ("generated_tokens_total", "specbuild_generated_tokens_total", COUNTER, "Tokens generated (emitted)"),
    ("draft_tokens_total", "specbuild_draft_tokens_total", COUNTER, "Draft tokens proposed (drafted)"),
    ("accepted_tokens_total", "specbuild_accepted_tokens_total", COUNTER, "Draft tokens accepted by the target"),
    ("drafts_total", "specbuild_drafts_total", COUNTER, "Speculation rounds (drafts scored by the target)"),
    # the same three in vLLM's schema (what vLLM, llama.cpp's server and AIPerf users read)
    ("drafts_total", "vllm:spec_decode_num_drafts", COUNTER, "Speculation rounds that drafted at least one token"),
    ("draft_tokens_total", "vllm:spec_decode_num_draft_tokens", COUNTER, "Draft tokens proposed"),
    ("accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens", COUNTER, "Draft tokens accepted"),
    ("requests_cancelled_total", "specbuild_requests_aborted_total", COUNTER,
     "Requests aborted because the client cancelled or disconnected"),
    ("requests_refused_invalid_total", "specbuild_requests_refused_invalid_total", COUNTER,
     "Requests refused as invalid (HTTP 400)"),
    ("requests_refused_unavailable_total", "specbuild_requests_refused_unavailable_total", COUNTER,
     "Requests refused for overload: queue full or waited past queue_timeout_s (HTTP 503)"),
    ("queue_full_total", "specbuild_queue_full_total", COUNTER,
     "Of the overload refusals: the waiting queue was full (max_queue_size)"),
    ("queue_expired_total", "specbuild_queue_expired_total", COUNTER,
     "Of the overload refusals: waited past queue_timeout_s for a slot"),
    ("requests_timed_out_total", "specbuild_requests_timed_out_total", COUNTER,
     "Requests ended at request_timeout_s (the bound on requests whose client vanished unheard)"),
    ("requests_failed_total", "specbuild_requests_failed_total", COUNTER,
     "Requests the engine failed on (each alone; the others kept running)"),
    ("acceptance_rate", "specbuild_acceptance_rate", GAUGE, "Accepted / drafted tokens since the engine started"),
    ("running", "specbuild_running_requests", GAUGE, "Requests in the running batch"),
    ("waiting", "specbuild_waiting_requests", GAUGE, "Requests waiting for a batch slot"),
    ("max_active", "specbuild_max_running_requests", GAUGE,
     "Most requests seen producing tokens at the same time (first token out, not finished): > 1 shows "
     "continuous batching"),
    ("slots_free", "specbuild_slots_free", GAUGE, "Free batch slots (all of them when idle: none leaked)"),
    ("live", "specbuild_live_requests", GAUGE, "Requests registered and not yet answered in full"),
    ("spec_cutoff_steps_total", "specbuild_spec_cutoff_steps_total", COUNTER,
     "Steps with more sequences than the policy's max_concurrency (no drafting by default)"),
    ("steps_total", "specbuild_steps_total", COUNTER, "Engine steps (rounds) that decoded at least one sequence"),
    ("sequence_steps_total", "specbuild_sequence_steps_total", COUNTER,
     "Decode steps summed over their sequences (a round of 4 sequences counts 4): draft tokens / this = the "
     "mean K the engine drafted per sequence and step"),
    ("policy_max_concurrency", "specbuild_policy_max_concurrency", GAUGE,
     "The policy's cut-off: no drafting by default in steps with more sequences (-1 = no cut-off)"),
    ("draft_cost_ratio", "specbuild_draft_cost_ratio", GAUGE,
     "c = draft step / plain target step that adaptive K prices K with, at the latest step's concurrency "
     "(measured while serving, else the build's calibration)"),
    ("target_step_ms", "specbuild_target_step_ms", GAUGE,
     "Plain target step measured while serving at the latest step's concurrency (median, ms; 0 = none yet)"),
    ("engine_restarts", "specbuild_engine_restarts_total", COUNTER,
     "Times the engine process died and was started again"),
    ("engine_up", "specbuild_engine_up", GAUGE,
     "1 while the engine process answers, 0 while it is gone or restarting (tritonserver 2.51 cannot mark a "
     "Python-backend model unready: alert or route on this)"),
)
PER_POSITION = ("vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each draft position (label position, 0-based)")


class EngineModel(ForwardingModel):
    def initialize(self, args):
        _, params = model_params(args)
        path = socket_path(Path(args["model_repository"]).parent, os.getppid())
        self.process = EngineProcess(argv_for(params["engine_dir"], path, params), path,
                                     start_timeout=float(params.get("engine_start_timeout_s") or 1800.0),
                                     on_restart=self._on_engine_restart)
        self.process.start()
        self._init_metrics()
        self.metrics_conn = EngineConnection(path, self._on_metrics_frame, self._on_metrics_lost, role="metrics")
        self.metrics_conn.open()                                     # connect now: pushes start at once
        super().initialize(args)
        self.process.watch()
        pb_utils.Logger.log_info(f"specbuild: engine process pid {self.process.proc.pid} serving on {path}")

    def _init_metrics(self):
        self.families, self.metrics, self.seen, self.per_pos = {}, {}, {}, []
        self.metrics_engine = None                 # the engine whose totals `seen` holds
        for _, name, kind, doc in METRICS:
            fam = pb_utils.MetricFamily(name=name, description=doc,
                                        kind=getattr(pb_utils.MetricFamily, kind.upper()))
            self.families[name] = fam              # a family must outlive its metrics
            self.metrics[name] = fam.Metric(labels={})
        self.per_pos_family = pb_utils.MetricFamily(name=PER_POSITION[0], description=PER_POSITION[1],
                                                    kind=pb_utils.MetricFamily.COUNTER)
        self.metrics_lock = threading.Lock()

    def _on_metrics_frame(self, msg: dict) -> None:
        if msg.get("op") != "metrics":
            return
        try:
            self._publish(msg.get("m") or {})
        finally:
            try:
                self.metrics_conn.send({"op": "metrics_ack", "seq": msg.get("seq", 0)})
            except EngineUnavailable:
                pass

    def _publish(self, m: dict) -> None:
        """Counters are totals of the engine's life in `m`; each metric is incremented by what it has not seen."""
        with self.metrics_lock:
            if not self.metrics:
                return                                   # finalized
            engine = self.metrics_conn.engine_id
            if engine != self.metrics_engine:
                # a new engine (restarted) counts from 0 again: forget its predecessor's totals, not our restarts
                self.seen = {k: v for k, v in self.seen.items() if k == "specbuild_engine_restarts_total"}
                self.metrics_engine = engine
            drafted = m.get("draft_tokens_total", 0)
            m["acceptance_rate"] = m.get("accepted_tokens_total", 0) / drafted if drafted else 0.0
            m["engine_restarts"] = self.process.restarts
            m["engine_up"] = 1
            for key, name, kind, _ in METRICS:
                value = m.get(key, 0)
                if kind == COUNTER:
                    self._advance(name, self.metrics[name], value)
                else:
                    self.metrics[name].set(float(value))
            for i, value in enumerate(m.get("accepted_per_pos", [])):
                while len(self.per_pos) <= i:
                    self.per_pos.append(self.per_pos_family.Metric(labels={"position": str(len(self.per_pos))}))
                self._advance(f"pos{i}", self.per_pos[i], value)

    def _advance(self, key, metric, value):
        if value > self.seen.get(key, 0):
            metric.increment(value - self.seen.get(key, 0))
            self.seen[key] = value

    def _on_metrics_lost(self, reason: str, generation: int = 0) -> None:
        with self.metrics_lock:
            if self.metrics:
                self.metrics["specbuild_engine_up"].set(0.0)
        threading.Thread(target=self._reconnect_metrics, name="metrics-reconnect", daemon=True).start()

    def _reconnect_metrics(self) -> None:
        while not self.stop_event.wait(0.5):
            try:
                self.metrics_conn.open()
                return
            except EngineUnavailable:
                continue

    def is_ready(self) -> bool:
        """Model readiness: the engine process answers. Asked by tritonserver releases whose Python backend
        calls a model's own readiness check (python_backend#430, server#8661, 2026); 2.51 never calls it and
        reports the model ready while its stub lives: `specbuild_engine_up` says the truth there."""
        return self.process.serving

    def _on_engine_restart(self) -> None:
        pb_utils.Logger.log_warn(f"specbuild: the engine process was started again (pid {self.process.proc.pid}, "
                                 f"restart {self.process.restarts})")

    def finalize(self):
        self.stop_event.set()
        self.metrics_conn.close()
        try:
            super().finalize()
        finally:
            self.process.stop(timeout=10.0)
            # Drop the metric objects now, while the stub can still take their delete messages: left to the
            # interpreter's exit they are destroyed after the stub, and 2.51's Metric::Clear then dereferences
            # the freed stub (a segfault at exit, `Metric::SaveToSharedMemory` in the kernel log; fixed upstream
            # by python_backend 47f9e03, Mar 2026).
            with self.metrics_lock:
                self.metrics.clear()
                self.per_pos.clear()
                self.families.clear()
                self.per_pos_family = None
            gc.collect()
            pb_utils.Logger.log_info("specbuild engine stopped")
