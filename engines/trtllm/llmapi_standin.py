"""The CPU stand-in for `tensorrt_llm`'s LLM API, so that upstream's Triton `llmapi` model.py runs unchanged.

`specbuild serve --rehearse` on an llmapi deployment serves upstream's own
`triton_backend/all_models/llmapi/tensorrt_llm/1/{model.py,helpers.py}` and puts a package `tensorrt_llm` next to
them (model_repository/rehearsal/tensorrt_llm_llmapi/tensorrt_llm/, thin modules re-exporting this one). It has
exactly the surface those model.py versions import (read from the stored versions; the import lines):

- tensorrtllm_backend c2e65b8 (the 0.20 tree): `tensorrt_llm.SamplingParams`, `tensorrt_llm._torch.llm.LLM`,
  `tensorrt_llm._utils.global_mpi_rank`, `tensorrt_llm.llmapi.LLM`,
  `tensorrt_llm.llmapi.llm_utils.update_llm_args_with_extra_dict`;
- TensorRT-LLM triton_backend model.py @b35ac1b6 (1.2.0rc2 era): `tensorrt_llm.LLM`, `SamplingParams`,
  `tensorrt_llm._utils.global_mpi_rank / global_mpi_size`, `tensorrt_llm.llmapi.llm.RequestOutput`,
  `tensorrt_llm.llmapi.llm_utils.update_llm_args_with_extra_dict`, `tensorrt_llm.llmapi.MpiCommSession`.

Behaviour kept from the real API, by the release's own rules (read from its source: core/trtllm_schema.json):
`LLM(**args)` refuses unknown arguments and wrong types (1.x LlmArgs are StrictBaseModels, so a 0.20-style
`pytorch_backend_config` is an error there); `update_llm_args_with_extra_dict` turns `speculative_config` into a
decoding config through `DecodingBaseConfig.from_dict`, which knows only the release's keys (draft-target is
`DraftTarget` on 1.0 .. 1.2.1; `Draft_Target` raises ValueError("Invalid decoding type: Draft_Target")) and the
release's draft field (speculative_model_dir on 1.0 / 1.1; speculative_model, alias speculative_model_dir, on
1.2); `generate_async(prompt, sampling_params,
streaming)` returns an async iterator of `RequestOutput` (`.finished`, `.outputs[0].text` cumulative,
`finish_reason`, `stop_reason`, `cumulative_logprob`, `request_perf_metrics` when
`SamplingParams(return_perf_metrics=True)`) with `.abort()`; `exclude_input_from_output=False` puts the prompt in
front of the text (upstream's helpers default it to False: the docs' sample response echoes the prompt).

The generation itself is the embedded engine's (`Engine.from_checkpoints(target, draft)`, `submit`, `abort`): the
draft proposes `max_draft_len` tokens a step and the target verifies them, as DraftTarget does.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import Version

CONFIG_FILE = "_rehearsal.json"     # written by serve --rehearse next to the package: version, limits


def rehearsal_config() -> dict[str, Any]:
    import tensorrt_llm  # the stand-in package itself
    path = Path(tensorrt_llm.__file__).with_name(CONFIG_FILE)
    return json.loads(path.read_text()) if path.is_file() else {}


def version() -> str:
    return str(rehearsal_config().get("version", "1.2.1"))


def global_mpi_rank() -> int:
    return 0


def global_mpi_size() -> int:
    return 1


class MpiCommSession:
    """Multi-rank sessions need MPI ranks and GPUs; the rehearsal runs one rank."""

    def __init__(self, comm=None, n_workers: int = 1):
        if n_workers != 1:
            raise RuntimeError("the CPU rehearsal runs one rank: tensor_parallel_size * pipeline_parallel_size "
                               "must be 1")


# ---- configs --------------------------------------------------------------------------------------------------
# The rules are the release's own, read from its source (core/trtllm_schema.json via core/trtllm_schema.py): which
# fields each config class has (all forbid extra fields), the DecodingBaseConfig.from_dict keys, and which YAML
# keys update_llm_args_with_extra_dict turns into config objects. Below 1.0 (the 0.20 tree) no release source was
# read: the old hand-kept rules apply there (draft-target as DraftTarget + speculative_model_dir).
_LEGACY_FIELDS = {"KvCacheConfig": {"enable_block_reuse", "free_gpu_memory_fraction", "max_tokens", "host_cache_size"},
                  "DraftTargetDecodingConfig": {"max_draft_len", "speculative_model_dir", "max_concurrency"},
                  "TorchLlmArgs": {"model", "tokenizer", "backend", "tensor_parallel_size", "pipeline_parallel_size",
                                   "max_batch_size", "max_num_tokens", "max_seq_len", "max_input_len",
                                   "max_beam_width", "disable_overlap_scheduler", "kv_cache_config",
                                   "speculative_config", "trust_remote_code", "dtype", "_mpi_session",
                                   "pytorch_backend_config"}}


def _release() -> str | None:
    """The release whose facts the rehearsal obeys (None below 1.0: the legacy rules)."""
    v = Version(version())
    if v < Version("1.0"):
        return None
    from specbuild.engines.trtllm.llmapi import _schema_version
    return _schema_version(str(v))


def _check(cls: str, kw: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Refuse what `cls(**kw)` of the release refuses; return {field name: value} (aliases resolved)."""
    from specbuild.core import trtllm_schema
    rel = _release()
    if rel is None:
        fields, aliases = {k: "object" for k in _LEGACY_FIELDS[cls]}, {}
    else:
        fields, aliases = trtllm_schema.class_fields(rel, cls), trtllm_schema.class_aliases(rel, cls)
    where = f"TensorRT-LLM {version()}" + (f", facts of {trtllm_schema.describe(rel)}" if rel else "")
    for key in kw:
        if key not in fields and key not in aliases:
            raise ValueError(f"1 validation error for {cls}: {key}: Extra inputs are not permitted ({where})")
    if rel is not None:
        problems = trtllm_schema.class_problems(rel, cls, {k: v for k, v in kw.items() if k not in skip})
        if problems:
            raise ValueError(f"1 validation error for {cls}: {problems[0]}")
    return {aliases.get(k, k): v for k, v in kw.items()}


class StrictConfig:
    NAME = "config"

    def __init__(self, **kw: Any):
        self._values = _check(self.NAME, kw)
        for k, v in self._values.items():
            setattr(self, k, v)

    def __getattr__(self, name: str) -> Any:        # a field left unset (the rehearsal does not model defaults)
        if name.startswith("_"):
            raise AttributeError(name)
        return None

    def __repr__(self) -> str:
        return f"{self.NAME}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


class KvCacheConfig(StrictConfig):
    NAME = "KvCacheConfig"


class DecodingBaseConfig(StrictConfig):
    NAME = "DecodingBaseConfig"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DecodingBaseConfig":
        """Dispatch on decoding_type with the release's own keys: anything else is
        ValueError("Invalid decoding type: ..."), as upstream raises."""
        data = dict(data)
        decoding_type = data.pop("decoding_type", None)
        rel = _release()
        if rel is None:
            if decoding_type != "DraftTarget":
                raise ValueError(f"Invalid decoding type: {decoding_type}")
            return DraftTargetDecodingConfig(**data)
        from specbuild.core import trtllm_schema
        target = trtllm_schema.decoding_class(rel, decoding_type)
        if target != "DraftTargetDecodingConfig":
            raise ValueError(f"the CPU rehearsal runs draft-target only ({decoding_type} selects {target} in "
                             f"TensorRT-LLM {rel})")
        return DraftTargetDecodingConfig(**data)


class DraftTargetDecodingConfig(DecodingBaseConfig):
    NAME = "DraftTargetDecodingConfig"

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        rel = _release()
        from specbuild.core import trtllm_schema
        key = trtllm_schema.draft_path_field(rel) if rel else "speculative_model_dir"
        self.draft_dir = getattr(self, key)
        # TorchLlmArgs.validate_speculative_config of each release asserts both (core/trtllm_schema.json validators)
        if not self.max_draft_len or int(self.max_draft_len) <= 0:
            raise ValueError("max_draft_len must be > 0 for DraftTarget")
        if not self.draft_dir:
            raise ValueError(f"{key} must be specified for DraftTarget (upstream: 'Draft model must be specified.')")


def update_llm_args_with_extra_dict(llm_args: dict[str, Any], llm_args_dict: dict[str, Any],
                                    extra_llm_api_options: str | None = None) -> dict[str, Any]:
    """The YAML loader shared by trtllm-serve and Triton's llmapi model: the keys of the release's field mapping
    become config objects (speculative_config through DecodingBaseConfig.from_dict; kv_cache_config only where the
    release maps it, 1.2: on 1.0 / 1.1 it stays a mapping and LLM() validates it); the rest passes as is."""
    rel = _release()
    from specbuild.core import trtllm_schema
    mapping = trtllm_schema.facts(rel)["extra_dict_mapping"] if rel else {"speculative_config": "DecodingBaseConfig"}
    out = dict(llm_args)
    for key, value in llm_args_dict.items():
        if key == "speculative_config" and isinstance(value, dict):
            out[key] = DecodingBaseConfig.from_dict(value)
        elif mapping.get(key) == "KvCacheConfig" and isinstance(value, dict):
            out[key] = KvCacheConfig(**value)
        else:
            out[key] = value
    return out


# ---- sampling and outputs ------------------------------------------------------------------------------------
class SamplingParams:
    FIELDS = {"max_tokens": 32, "temperature": None, "top_k": None, "top_p": None, "seed": None, "best_of": None,
              "n": 1, "frequency_penalty": None, "presence_penalty": None, "stop": None, "end_id": None,
              "min_tokens": None, "exclude_input_from_output": True, "return_perf_metrics": False,
              "ignore_eos": False}

    def __init__(self, **kw: Any):
        for k in kw:
            if k not in self.FIELDS:
                raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument {k!r}")
        for k, default in self.FIELDS.items():
            setattr(self, k, kw.get(k, default))

    def stop_strings(self) -> tuple[str, ...]:
        s = self.stop
        if s is None:
            return ()
        if isinstance(s, (str, bytes)):
            s = [s]
        flat = []
        for item in (s.reshape(-1).tolist() if hasattr(s, "reshape") else list(s)):
            flat.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        return tuple(x for x in flat if x)


@dataclass
class KvCacheMetrics:
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class TimingMetrics:
    arrival_time: float = 0.0           # seconds (upstream converts with pd.Timedelta(...).value)
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0


@dataclass
class SpeculativeDecodingMetrics:
    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0


@dataclass
class RequestPerfMetrics:
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)
    timing_metrics: TimingMetrics = field(default_factory=TimingMetrics)
    speculative_decoding: SpeculativeDecodingMetrics = field(default_factory=SpeculativeDecodingMetrics)


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: Any = None
    request_perf_metrics: RequestPerfMetrics | None = None


class RequestOutput:
    """What generate_async yields: one per streamed step (streaming) or one at the end."""

    def __init__(self, request_id: str, prompt: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [CompletionOutput()]
        self.context_logits = None
        self.finished = False
        self._queue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._llm: "LLM | None" = None
        self._engine_id: str | None = None

    def abort(self) -> None:
        if self._llm is not None and self._engine_id is not None and not self.finished:
            self._llm._engine.abort(self._engine_id)

    def __aiter__(self):
        return self

    async def __anext__(self) -> "RequestOutput":
        if self._queue is None:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item


# ---- the LLM ---------------------------------------------------------------------------------------------------
class LLM:
    """`LLM(model=<target HF dir>, speculative_config=DraftTarget(...), ...)` on the embedded engine."""

    def __init__(self, model: str | None = None, **kw: Any):
        if isinstance(kw.get("kv_cache_config"), dict):     # 1.0 / 1.1: validated by the LLM args, not the loader
            kw["kv_cache_config"] = KvCacheConfig(**kw["kv_cache_config"])
        kw = {k: v for k, v in _check("TorchLlmArgs", {**({"model": model} if model is not None else {}), **kw},
                                      skip=("speculative_config", "kv_cache_config")).items() if k != "model"}
        if kw.get("backend") not in (None, "pytorch"):
            raise ValueError(f"the rehearsal covers the PyTorch backend only, not backend={kw.get('backend')!r}")
        tp, pp = int(kw.get("tensor_parallel_size") or 1), int(kw.get("pipeline_parallel_size") or 1)
        if tp * pp != 1:
            raise ValueError(f"the CPU rehearsal runs one rank: tensor_parallel_size {tp} x pipeline_parallel_size "
                             f"{pp} must be 1")
        if not model or not (Path(model) / "config.json").is_file():
            raise ValueError(f"model {model!r} is not a Hugging Face checkpoint directory here (the rehearsal "
                             "loads the target from the path model.yaml names)")
        spec = kw.get("speculative_config")
        if spec is not None and not isinstance(spec, DraftTargetDecodingConfig):
            raise ValueError("speculative_config must come through update_llm_args_with_extra_dict (a decoding "
                             "config), as in trtllm-serve and Triton's llmapi model")
        from specbuild.engines.embedded import Engine

        cfg = rehearsal_config()
        self.max_draft_len = int(spec.max_draft_len) if spec is not None else 0
        self.args = {"model": model, **kw}
        self._engine = Engine.from_checkpoints(
            model, spec.draft_dir if spec is not None else None,
            max_batch_size=int(cfg.get("max_batch_size", min(int(kw.get("max_batch_size") or 4), 4))),
            max_seq_len=int(cfg.get("max_seq_len", kw.get("max_seq_len") or 1024)),
            max_draft_len=max(1, self.max_draft_len), dtype="float32", device="cpu",
            tokenizer_dir=kw.get("tokenizer") or model)
        self._engine.start()
        self.tokenizer = self._engine.tokenizer
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self._stats_file = cfg.get("stats_file")

    def generate_async(self, inputs: str, sampling_params: SamplingParams | None = None,
                       streaming: bool = False) -> RequestOutput:
        from specbuild.engines.embedded import SamplingParams as EngineParams

        sp = sampling_params or SamplingParams()
        prompt = inputs if isinstance(inputs, str) else str(inputs)
        ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        out = RequestOutput(request_id="", prompt=prompt, prompt_token_ids=ids)
        loop = asyncio.get_running_loop()
        out._queue, out._loop, out._llm = asyncio.Queue(), loop, self
        params = EngineParams(max_tokens=int(sp.max_tokens or 32), temperature=float(sp.temperature or 0.0),
                              top_k=int(sp.top_k or 0), top_p=float(sp.top_p if sp.top_p is not None else 1.0),
                              seed=None if sp.seed is None else int(sp.seed), min_tokens=int(sp.min_tokens or 0),
                              stop=sp.stop_strings())
        head = "" if sp.exclude_input_from_output else prompt
        text: list[str] = []
        t0 = time.time()
        first: list[float] = []

        def snapshot(finished: bool, reason: str | None, stats) -> RequestOutput:
            snap = RequestOutput(out.request_id, prompt, ids)
            comp = snap.outputs[0]
            comp.text = head + "".join(text)
            comp.token_ids = list(out.outputs[0].token_ids)
            comp.finish_reason = reason
            snap.finished = finished
            if finished and sp.return_perf_metrics:
                drafted = int(getattr(stats, "num_draft_tokens", 0) or 0)
                accepted = int(getattr(stats, "num_accepted_tokens", 0) or 0)
                comp.request_perf_metrics = RequestPerfMetrics(
                    timing_metrics=TimingMetrics(t0, t0, first[0] if first else t0, time.time()),
                    speculative_decoding=SpeculativeDecodingMetrics(accepted / drafted if drafted else 0.0,
                                                                    accepted, drafted))
            return snap

        def on_output(d) -> None:
            if d.token_ids and not first:
                first.append(time.time())
            out.outputs[0].token_ids.extend(d.token_ids)
            text.append(d.text or "")
            if d.error:
                loop.call_soon_threadsafe(out._queue.put_nowait, RuntimeError(d.error))
                loop.call_soon_threadsafe(out._queue.put_nowait, None)
                return
            if d.finished:
                out.finished = True
                self._count(d.stats)
                loop.call_soon_threadsafe(out._queue.put_nowait, snapshot(True, _reason(d.finish_reason), d.stats))
                loop.call_soon_threadsafe(out._queue.put_nowait, None)
            elif streaming and d.token_ids:
                loop.call_soon_threadsafe(out._queue.put_nowait, snapshot(False, None, None))

        out._engine_id = self._engine.submit(prompt, params, num_draft_tokens=self.max_draft_len,
                                             on_output=on_output)
        out.request_id = out._engine_id
        return out

    def generate(self, inputs: str, sampling_params: SamplingParams | None = None) -> RequestOutput:
        async def run():
            last = None
            async for o in self.generate_async(inputs, sampling_params):
                last = o
            return last
        return asyncio.run(run())

    def _count(self, stats) -> None:
        with self._lock:
            self.stats["requests"] += 1
            self.stats["draft_tokens"] += int(getattr(stats, "num_draft_tokens", 0) or 0)
            self.stats["accepted_tokens"] += int(getattr(stats, "num_accepted_tokens", 0) or 0)
            if self._stats_file:
                tmp = Path(self._stats_file).with_suffix(".tmp")
                tmp.write_text(json.dumps(self.stats))
                tmp.replace(self._stats_file)

    def shutdown(self) -> None:
        self._engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _reason(reason: str | None) -> str | None:
    return {"abort": "cancelled"}.get(reason or "", reason)
