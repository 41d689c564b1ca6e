"""Triton Python-backend model of the embedded deployment's client-facing models (`ensemble`,
`tensorrt_llm_bls`): forwards each request to the `tensorrt_llm` model, which holds the one engine.

Why not a Triton ensemble: in Triton 2.51 a client's cancellation (gRPC cancel, HTTP disconnect) does
not reach the composing models of an ensemble, so a gone client would keep its engine slot until
max_tokens. Here each request is forwarded with a BLS call (`exec(decoupled=True)`) on its own
thread, its pieces are re-sent as they arrive, and a watchdog polls `is_cancelled()`: a cancelled
request is aborted in the engine (a second, tiny request to `tensorrt_llm` with `abort=true`).

stream=false: exactly one response (flagged final), so HTTP /generate works although the model is
decoupled. stream=true: one response per piece, then a flag-only final response.

The request lifecycle itself (validation, admission, registry, outputs) is `engines/embedded/frontend.py`
inside `tensorrt_llm`; this model only forwards and turns a client's cancellation into an abort. Errors
keep their Triton code (INVALID_ARG 400, UNAVAILABLE 503 for overload).
"""

import json
import os
import site
import threading
import uuid

for _d in os.environ.get("SPECBUILD_SITE_DIRS", "").split(os.pathsep):
    if _d:
        site.addsitedir(_d)

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _key_tensor(key):
    return pb_utils.Tensor("request_key", np.array([[key.encode()]], dtype=np.object_))


class TritonPythonModel:
    def initialize(self, args):
        import sys

        sys.setswitchinterval(0.0005)  # many I/O-bound threads: hand the GIL over quickly (default 5 ms)
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.name = cfg["name"]
        self.engine_model = params.get("engine_model", "tensorrt_llm")
        self.inputs = [i["name"] for i in cfg["input"]]
        self.outputs = [o["name"] for o in cfg["output"]]
        self.lock = threading.Lock()
        self.live = {}  # key -> response sender
        self.stop_event = threading.Event()
        self.watchdog = threading.Thread(target=self._watch, name=f"{self.name}-watchdog", daemon=True)
        self.watchdog.start()

    def execute(self, requests):
        for request in requests:
            # copies: the forwarding thread outlives execute(), the request's input buffers need not
            tensors = [pb_utils.Tensor(t.name(), np.array(t.as_numpy(), copy=True))
                       for t in (pb_utils.get_input_tensor_by_name(request, n) for n in self.inputs)
                       if t is not None]
            sender = request.get_response_sender()
            threading.Thread(target=self._forward, args=(tensors, sender), daemon=True).start()
        return None

    def _forward(self, tensors, sender):
        key = uuid.uuid4().hex
        stream = any(t.name() == "stream" and bool(t.as_numpy().reshape(-1)[0]) for t in tensors
                     if t.as_numpy().size == 1)
        with self.lock:
            self.live[key] = sender
        final_sent = False

        def finish(response=None):
            # Leave self.live (under the lock) BEFORE the final response: the watchdog then no longer
            # calls is_cancelled() on this request (on a finished request that crashes tritonserver 2.51).
            nonlocal final_sent
            with self.lock:
                cancelled = self.live.pop(key, None) is None
            final_sent = True
            if cancelled or response is None:
                sender.send(flags=FINAL)  # a cancelled request still needs its final flag
            else:
                sender.send(response, flags=FINAL)

        try:
            request = pb_utils.InferenceRequest(model_name=self.engine_model, inputs=tensors + [_key_tensor(key)],
                                                requested_output_names=self.outputs)
            for resp in request.exec(decoupled=True):
                if final_sent:
                    continue  # drain the iterator
                if resp.has_error():
                    finish(pb_utils.InferenceResponse(output_tensors=[], error=_same_error(resp.error())))
                    continue
                outputs = resp.output_tensors()
                if not outputs:
                    continue
                if not stream:
                    finish(pb_utils.InferenceResponse(output_tensors=outputs))
                    continue
                with self.lock:
                    gone = key not in self.live
                if not gone:
                    sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
        except Exception as e:
            pb_utils.Logger.log_error(f"{self.name}: forwarding to {self.engine_model} failed: {e}")
            if not final_sent:
                try:
                    finish(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                        f"{self.name}: forwarding to {self.engine_model} failed: {e}")))
                except Exception:
                    pass
        finally:
            if not final_sent:
                try:
                    finish()
                except Exception as e:
                    pb_utils.Logger.log_warn(f"{self.name}: could not close request {key}: {e}")

    def _watch(self):
        while not self.stop_event.wait(0.1):
            cancelled = []
            with self.lock:
                for key, sender in list(self.live.items()):
                    try:
                        if sender.is_cancelled():
                            del self.live[key]
                            cancelled.append(key)
                    except Exception as e:
                        pb_utils.Logger.log_warn(f"{self.name}: cancellation check of {key} failed: {e}")
            for key in cancelled:
                try:
                    self._abort(key)
                except Exception as e:
                    pb_utils.Logger.log_warn(f"{self.name}: abort of {key} failed: {e}")

    def _abort(self, key):
        abort = pb_utils.Tensor("abort", np.array([[True]], dtype=np.bool_))
        request = pb_utils.InferenceRequest(model_name=self.engine_model, inputs=[_key_tensor(key), abort],
                                            requested_output_names=["text_output"])
        for _ in request.exec(decoupled=True):
            pass

    def finalize(self):
        self.stop_event.set()
        self.watchdog.join(timeout=2)


def _same_error(err):
    """The engine model's error with its code kept (INVALID_ARG, UNAVAILABLE, ...)."""
    try:
        return pb_utils.TritonError(err.message(), err.code())
    except Exception:
        return pb_utils.TritonError(err.message())
