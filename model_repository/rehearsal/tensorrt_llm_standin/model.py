"""Rehearsal stand-in for the C++ `tensorrt_llm` / `tensorrt_llm_draft` models (Triton Python backend).

`specbuild serve --rehearse` copies this file into `<model>/1/model.py` of the rehearsal repository and
changes only the `backend:` line of the deployed config.pbtxt to "python"; inputs, outputs, parameters and
the transaction policy stay exactly as deploy wrote them for the pinned backend release. The weights
come from `1/rehearsal.json` (the Hugging Face directory of the role, recorded by convert). The request
semantics live in specbuild.engines.trtllm.standin.
"""

import json
import os
import site
from pathlib import Path

for _d in os.environ.get("SPECBUILD_SITE_DIRS", "").split(os.pathsep):
    if _d:
        site.addsitedir(_d)  # honour .pth files (editable installs) of the serving environment

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy().reshape(-1)
    return default if a.size == 0 else a[0].item()


def _array(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        from specbuild.engines.trtllm.standin import StandinEngine

        self.config = json.loads(args["model_config"])
        here = Path(args["model_repository"]) / args["model_version"]
        spec = json.loads((here / "rehearsal.json").read_text())
        self.name = self.config["name"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.config)
        params = {k: v.get("string_value", "") for k, v in self.config.get("parameters", {}).items()}
        exclude = params.get("exclude_input_in_output", "false")
        self.exclude_default = exclude.lower() in ("true", "1", "yes") if not exclude.startswith("${") else False
        self.outputs = {o["name"]: pb_utils.triton_string_to_numpy(o["data_type"]) for o in self.config["output"]}
        self.engine = StandinEngine(spec["hf_dir"], max_seq_len=int(spec.get("max_seq_len", 2048)),
                                    slots=int(spec.get("slots", 4)), dtype=spec.get("dtype", "float32"))
        self.stats_file = here / "stats.json"

    def _parse(self, request):
        from specbuild.engines.trtllm.standin import Request, RequestError, word_list

        ids = _array(request, "input_ids")
        if ids is None:
            raise RequestError("input_ids is not present in the request (the stand-in has no encoder path)")
        if _scalar(request, "request_output_len") is None:
            raise RequestError("request_output_len is not present in the request")
        ids = ids.reshape(-1).astype(np.int64).tolist()
        n = _scalar(request, "input_lengths")
        if n is not None:
            ids = ids[:int(n)]
        draft = _array(request, "draft_input_ids")
        draft_ids = None if draft is None else [int(t) for t in draft.reshape(-1).tolist()]
        dl = _array(request, "draft_logits")
        seed = _scalar(request, "random_seed", _scalar(request, "seed"))
        end_id = _scalar(request, "end_id")
        min_len = _scalar(request, "min_length", _scalar(request, "min_tokens", 0))
        exclude = _scalar(request, "exclude_input_in_output")
        return Request(
            input_ids=ids, max_new_tokens=int(_scalar(request, "request_output_len")),
            end_id=None if end_id is None or int(end_id) < 0 else int(end_id), min_length=int(min_len or 0),
            temperature=float(_scalar(request, "temperature", 0.0) or 0.0),
            top_k=int(_scalar(request, "runtime_top_k", 0) or 0),
            top_p=float(_scalar(request, "runtime_top_p", 1.0) or 1.0),
            seed=None if seed is None else int(seed),
            exclude_input_in_output=self.exclude_default if exclude is None else bool(exclude),
            streaming=bool(_scalar(request, "streaming", False)),
            draft_input_ids=draft_ids or None,
            draft_logits=None if (dl is None or not draft_ids) else dl.reshape(len(draft_ids), -1),
            return_generation_logits=bool(_scalar(request, "return_generation_logits", False)),
            stop_words=word_list(_array(request, "stop_words_list")))

    def _response(self, req, tokens, result, final_stream_piece=False):
        """The C++ backend's output shapes: output_ids [1, beams=1, L], sequence_length [1, 1]."""
        if req.streaming or req.exclude_input_in_output:
            ids = list(tokens)
        else:
            ids = req.input_ids + list(tokens)
        values = {
            "output_ids": np.array([[ids]], np.int32).reshape(1, 1, len(ids)),
            "sequence_length": np.array([[len(ids)]], np.int32),
            "cum_log_probs": np.zeros((1, 1), np.float32),
            "output_log_probs": np.zeros((1, 1, max(1, len(tokens))), np.float32),
            "context_logits": np.zeros((1, 1, 1), np.float32),
            "generation_logits": np.zeros((1, 1, 1, 1), np.float32),
            "batch_index": np.zeros((1, 1), np.int32),
            "sequence_index": np.zeros((1, 1), np.int32),
            "kv_cache_alloc_new_blocks": np.zeros((1, 1), np.int32),
            "kv_cache_reused_blocks": np.zeros((1, 1), np.int32),
            "kv_cache_alloc_total_blocks": np.zeros((1, 1), np.int32),
            "arrival_time_ns": np.zeros((1, 1), np.int64),
            "first_scheduled_time_ns": np.zeros((1, 1), np.int64),
            "first_token_time_ns": np.zeros((1, 1), np.int64),
            "last_token_time_ns": np.zeros((1, 1), np.int64),
        }
        if result is not None:
            if result.generation_logits is not None and result.generation_logits.size:
                g = result.generation_logits.astype(np.float32)
                values["generation_logits"] = g.reshape(1, 1, g.shape[0], g.shape[1])
            values["acceptance_rate"] = np.array([[result.num_accepted / result.num_draft if result.num_draft
                                                   else 0.0]], np.float32)
            values["total_accepted_draft_tokens"] = np.array([[result.num_accepted]], np.int32)
            values["total_draft_tokens"] = np.array([[result.num_draft]], np.int32)
        tensors = [pb_utils.Tensor(k, v.astype(self.outputs[k])) for k, v in values.items() if k in self.outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _write_stats(self):
        try:
            tmp = self.stats_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.engine.stats.to_dict()))
            tmp.replace(self.stats_file)
        except OSError:
            pass

    def execute(self, requests):
        from specbuild.engines.trtllm.standin import RequestError

        responses = []
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else None
            try:
                if _scalar(request, "stop", False):
                    resp = self._response(self._parse_stop(request), [], None)
                    sender.send(resp, flags=FINAL) if sender else responses.append(resp)
                    continue
                req = self._parse(request)
                if req.streaming and not self.decoupled:
                    raise RequestError("Streaming is only supported if model is deployed using decoupled mode.")
                if sender is not None and req.streaming:
                    result = self.engine.generate(
                        req, on_token=lambda tok: sender.send(self._response(req, [tok], None)))
                    sender.send(self._response(req, [], result), flags=FINAL)
                else:
                    result = self.engine.generate(req)
                    resp = self._response(req, result.new_tokens, result)
                    sender.send(resp, flags=FINAL) if sender else responses.append(resp)
            except Exception as e:  # noqa: BLE001 - every failure becomes this request's error response
                err = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{self.name}: {e}"))
                sender.send(err, flags=FINAL) if sender else responses.append(err)
            self._write_stats()
        return None if self.decoupled else responses

    def _parse_stop(self, request):
        from specbuild.engines.trtllm.standin import Request
        return Request(input_ids=[0], max_new_tokens=0, exclude_input_in_output=True)

    def finalize(self):
        self._write_stats()
