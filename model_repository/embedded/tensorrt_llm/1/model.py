"""Triton Python-backend model `tensorrt_llm` of the embedded deployment: holds the ONE engine.

A thin shim over `specbuild.engines.embedded.frontend.Frontend`, which owns the request lifecycle
(validation, admission, the request registry, cancellation, the output queue and its sender thread,
metrics). This file only maps Triton objects onto it: input tensors -> `get(name)`, a response sender ->
`send(Reply)`, `abort=true` + `request_key` (sent by the forwarding models when their client is gone) ->
`Frontend.cancel`, and the frontend's pushed metrics -> Triton custom metrics (`specbuild_*`).

`stream=false` requests get exactly ONE response (flagged final), so HTTP `/generate` works although the
model is decoupled. Nothing here polls `is_cancelled()`: cancellation arrives as an abort request (asking
a finished request's sender whether it is cancelled crashes tritonserver 2.51).
"""

import json
import os
import site
import sys

for _d in os.environ.get("SPECBUILD_SITE_DIRS", "").split(os.pathsep):
    if _d:
        site.addsitedir(_d)  # honour .pth files (editable installs) of the serving environment

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
COUNTER, GAUGE = "counter", "gauge"  # pb_utils.MetricFamily kinds are resolved in initialize()
METRICS = (  # (frontend metrics key, metric name, kind, help)
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
    ("acceptance_rate", "specbuild_acceptance_rate", GAUGE, "Accepted / drafted tokens since the model was loaded"),
    ("running", "specbuild_running_requests", GAUGE, "Requests in the running batch"),
    ("waiting", "specbuild_waiting_requests", GAUGE, "Requests waiting for a batch slot"),
    ("max_active", "specbuild_max_running_requests", GAUGE,
     "Most requests seen producing tokens at the same time (first token out, not finished): > 1 shows "
     "continuous batching"),
    ("slots_free", "specbuild_slots_free", GAUGE, "Free batch slots (all of them when idle: none leaked)"),
    ("live", "specbuild_live_requests", GAUGE, "Requests registered and not yet answered in full"),
    ("spec_cutoff_steps_total", "specbuild_spec_cutoff_steps_total", COUNTER,
     "Steps with more sequences than the policy's max_concurrency (no drafting by default)"),
    ("draft_cost_ratio", "specbuild_draft_cost_ratio", GAUGE,
     "c = draft step / plain target step that adaptive K prices K with, at the latest step's concurrency "
     "(measured while serving, else the build's calibration)"),
    ("target_step_ms", "specbuild_target_step_ms", GAUGE,
     "Plain target step measured while serving at the latest step's concurrency (median, ms; 0 = none yet)"),
)
PER_POSITION = ("vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each draft position (label position, 0-based)")
ERROR_CODES = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "timeout": "UNAVAILABLE",
               "internal": "INTERNAL"}


def error_response(message, kind="internal"):
    code = getattr(pb_utils.TritonError, ERROR_CODES.get(kind, "INTERNAL"), None)
    err = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


class TritonPythonModel:
    def initialize(self, args):
        # The engine thread holds the GIL most of the time (a small model is Python-bound); a response send
        # or a new request needs it in another thread, which by default waits up to 5 ms per hand-over.
        sys.setswitchinterval(0.0005)
        from specbuild.engines.embedded import Engine
        from specbuild.engines.embedded.frontend import Frontend, RequestLimits

        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        self.engine = Engine.from_build_dir(params["engine_dir"], device=params.get("device") or None,
                                            threads=int(params.get("threads") or 0) or None)
        from specbuild.engines.embedded.config import Policy

        policy = params.get("policy", "").strip()     # `specbuild tune --apply` (else the build's policy)
        if policy:
            self.engine.set_policy(Policy.from_dict(json.loads(policy)))
        admission = _admission(params)                # deploy's admission limits ("" = the build's)
        if admission:
            self.engine.set_admission(**admission)
        pb_utils.Logger.log_info(f"specbuild: speculation policy {self.engine.config.policy.describe()} "
                                 f"({self.engine.config.policy.source}); admission changes {admission or 'none'}")
        limits = {k: int(params[k]) for k in ("max_prompt_bytes", "max_stop_words", "max_stop_word_bytes")
                  if params.get(k, "").strip()}
        self.families = {}
        self.metrics = {name: self._metric(name, kind, doc) for _, name, kind, doc in METRICS}
        self.per_pos_family = pb_utils.MetricFamily(name=PER_POSITION[0], description=PER_POSITION[1],
                                                    kind=pb_utils.MetricFamily.COUNTER)
        self.per_pos = []   # Metric per draft position, created as positions appear
        self.seen = {}
        self.frontend = Frontend(self.engine, RequestLimits(**limits), metrics_sink=self._publish)
        self.frontend.start()
        cfg = self.engine.config
        pb_utils.Logger.log_info(f"specbuild engine loaded from {params['engine_dir']} (max_batch_size="
                                 f"{cfg.max_batch_size}, max_seq_len={cfg.max_seq_len}, max_draft_len="
                                 f"{cfg.max_draft_len}, max_queue_size={cfg.queue_limit}, queue_timeout_s="
                                 f"{cfg.queue_timeout_s}, request_timeout_s={cfg.request_timeout_s})")

    def _metric(self, name, kind, doc):
        fam = pb_utils.MetricFamily(name=name, description=doc, kind=getattr(pb_utils.MetricFamily, kind.upper()))
        self.families[name] = fam  # a family must outlive its metrics
        return fam.Metric(labels={})

    def _publish(self, m):
        """Called by the frontend, one call at a time: before every final reply, and after engine steps
        (rate-limited). Counters are totals in `m`; each metric is incremented by what it has not seen yet."""
        drafted = m.get("draft_tokens_total", 0)
        m["acceptance_rate"] = m.get("accepted_tokens_total", 0) / drafted if drafted else 0.0
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

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()

            def get(name, request=request):
                t = pb_utils.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            key = get("request_key")
            key = None if key is None else bytes(key.reshape(-1)[0]).decode("utf-8", "replace")
            abort = get("abort")
            if abort is not None and bool(abort.reshape(-1)[0]):
                if key:
                    self.frontend.cancel(key)
                sender.send(flags=FINAL)
                continue
            self.frontend.handle(get, lambda reply, sender=sender: _send(sender, reply), key=key)
        return None

    def finalize(self):
        try:
            self.frontend.close(timeout=5.0)  # stops the engine and the sender thread; live requests end
        finally:
            pb_utils.Logger.log_info("specbuild engine stopped")


def _admission(params):
    """Admission limits from config.pbtxt ("" = keep the build's): max_queue_size (requests), queue_timeout_s
    and request_timeout_s (seconds; 0 = no limit)."""
    out = {}
    if params.get("max_queue_size", "").strip():
        out["max_queue_size"] = int(params["max_queue_size"])
    for key in ("queue_timeout_s", "request_timeout_s"):
        if params.get(key, "").strip():
            value = float(params[key])
            out[key] = value if value > 0 else None
    return out


def _send(sender, reply):
    if reply.error is not None:
        sender.send(error_response(reply.error, reply.kind), flags=FINAL)
        return
    if reply.final and not reply.text and reply.stats is None and not reply.carries_text:
        sender.send(flags=FINAL)
        return
    tensors = [pb_utils.Tensor("text_output", np.array([[reply.text.encode("utf-8")]], dtype=np.object_))]
    if reply.stats is not None:
        from specbuild.model_repository.embedded.request_params import perf_metrics

        tensors += [pb_utils.Tensor(k, v) for k, v in perf_metrics(reply.stats).items()]
    sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if reply.final else 0)
