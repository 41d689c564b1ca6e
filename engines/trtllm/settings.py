"""Stage options for the TensorRT-LLM backend, read defensively from `ctx.options` into one frozen value.

The CLI (owned elsewhere) passes options through; any key may be missing or None, which means
"use the default". Validation happens here, once, with messages that name the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from specbuild.core.errors import UsageError

from specbuild.engines.trtllm.versions import Recipe, resolve

DTYPES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float32": "float32", "fp32": "float32", "auto": "auto"}
QUANTIZATIONS = (None, "int8_wo", "int4_wo", "fp8")


def _get(options: Mapping[str, Any], key: str, default: Any) -> Any:
    value = options.get(key)
    return default if value is None else value


def _int(options: Mapping[str, Any], key: str, default: int, minimum: int = 1) -> int:
    value = _get(options, key, default)
    try:
        value = int(value)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--{key.replace('_', '-')} must be an integer, got {value!r}.") from e
    if value < minimum:
        raise UsageError(f"--{key.replace('_', '-')} must be >= {minimum}, got {value}.")
    return value


def _fraction(options: Mapping[str, Any], key: str, default: float) -> float:
    raw = _get(options, key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--{key.replace('_', '-')} must be a number between 0 and 1, got {raw!r}.") from e
    if not 0.0 < value < 1.0:
        raise UsageError(f"--{key.replace('_', '-')} must be between 0 and 1 (exclusive), got {value}.")
    return value


def _ids(options: Mapping[str, Any], key: str, default: str) -> str:
    value = _get(options, key, default)
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    parts = [p.strip() for p in str(value).split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise UsageError(f"--{key.replace('_', '-')} must be a comma list of GPU indices like 0,1; got {value!r}.")
    return ",".join(parts)


@dataclass(frozen=True)
class Settings:
    recipe: Recipe
    dtype: str
    tp: int
    pp: int
    draft_tp: int
    draft_pp: int
    quantization: str | None
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    max_draft_len: int
    use_draft_logits: bool
    fast_logits: bool
    target_gpu_ids: str
    draft_gpu_ids: str
    kv_cache_free_gpu_mem_fraction: float
    draft_kv_cache_free_gpu_mem_fraction: float
    bls_instance_count: int
    http_port: int
    grpc_port: int
    metrics_port: int
    host: str
    tritonserver: str
    backend_models_dir: str

    @property
    def target_world(self) -> int:
        return self.tp * self.pp

    @property
    def draft_world(self) -> int:
        return self.draft_tp * self.draft_pp

    @property
    def shared_gpu(self) -> bool:
        return bool(set(self.target_gpu_ids.split(",")) & set(self.draft_gpu_ids.split(",")))

    @property
    def num_gpus(self) -> int:
        ids = set(self.target_gpu_ids.split(",")) | set(self.draft_gpu_ids.split(","))
        return max(int(i) for i in ids) + 1

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict
        return asdict(self)


def settings_from(options: Mapping[str, Any], installed: str | None = None) -> Settings:
    """Build and validate Settings from stage options (`installed` = detected tensorrt_llm version)."""
    recipe = resolve(options.get("trtllm_version"), options.get("trtllm_generation"),
                     options.get("container_tag"), installed,
                     force=bool(options.get("force_version") or options.get("force")))
    raw_dtype = str(_get(options, "dtype", "float16")).lower()
    if raw_dtype not in DTYPES:
        raise UsageError(f"--dtype {raw_dtype!r} is not supported by TensorRT-LLM; choose float16, bfloat16 or "
                         "float32.")
    quant = options.get("quantization") or None
    if quant in ("none", "None"):
        quant = None
    if quant not in QUANTIZATIONS:
        raise UsageError(f"--quantization {quant!r} is not supported on the trtllm backend; choose one of "
                         "int8_wo, int4_wo, fp8 (or leave it unset).")
    tp, pp = _int(options, "tp", 1), _int(options, "pp", 1)
    draft_tp, draft_pp = _int(options, "draft_tp", tp), _int(options, "draft_pp", 1)
    max_draft_len = _int(options, "max_draft_len", 4)
    max_seq_len = _int(options, "max_seq_len", 4096)
    max_input_len = _int(options, "max_input_len", min(2048, max_seq_len // 2))
    max_batch_size = _int(options, "max_batch_size", 8)
    max_num_tokens = _int(options, "max_num_tokens", 8192)
    if max_seq_len <= max_input_len:
        raise UsageError(f"--max-seq-len ({max_seq_len}) must be larger than --max-input-len ({max_input_len}): "
                         "it counts prompt plus generated tokens.")
    if max_num_tokens < max_draft_len + 1:
        raise UsageError(f"--max-num-tokens ({max_num_tokens}) must be at least --max-draft-len + 1 "
                         f"({max_draft_len + 1}), the target verifies K drafts plus one token per step.")
    fast_logits = bool(_get(options, "fast_logits", False))
    use_draft_logits = bool(_get(options, "use_draft_logits", False)) or fast_logits
    default_target_ids = ",".join(str(i) for i in range(tp * pp))
    target_gpu_ids = _ids(options, "target_gpu_ids", default_target_ids)
    draft_gpu_ids = _ids(options, "draft_gpu_ids", ",".join(str(i) for i in range(draft_tp * draft_pp)))
    shared = bool(set(target_gpu_ids.split(",")) & set(draft_gpu_ids.split(",")))
    # The fraction is of the memory free when each model allocates its KV cache. On one shared GPU the
    # two models must leave room for each other whichever loads first: 0.5 (target) then 0.2 (draft).
    target_frac = _fraction(options, "kv_cache_free_gpu_mem_fraction", 0.5 if shared else 0.9)
    draft_frac = _fraction(options, "draft_kv_cache_free_gpu_mem_fraction", 0.2 if shared else 0.9)
    if fast_logits and recipe.generation != "engine":
        raise UsageError("--fast-logits exists only on the engine path (Triton BLS); drop it for the llmapi path.")
    if fast_logits:
        from specbuild.engines.trtllm.versions import supports_fast_logits
        if not supports_fast_logits(recipe):
            raise UsageError(f"--fast-logits needs TensorRT-LLM >= 0.15, not {recipe.trtllm_version}; drop it or "
                             "use --trtllm-version 0.18.0.")
    return Settings(
        recipe=recipe, dtype=DTYPES[raw_dtype], tp=tp, pp=pp, draft_tp=draft_tp, draft_pp=draft_pp,
        quantization=quant, max_batch_size=max_batch_size, max_input_len=max_input_len, max_seq_len=max_seq_len,
        max_num_tokens=max_num_tokens, max_draft_len=max_draft_len, use_draft_logits=use_draft_logits,
        fast_logits=fast_logits, target_gpu_ids=target_gpu_ids, draft_gpu_ids=draft_gpu_ids,
        kv_cache_free_gpu_mem_fraction=target_frac, draft_kv_cache_free_gpu_mem_fraction=draft_frac,
        bls_instance_count=_int(options, "bls_instance_count", max_batch_size),
        http_port=_int(options, "http_port", 8000), grpc_port=_int(options, "grpc_port", 8001),
        metrics_port=_int(options, "metrics_port", 8002), host=str(_get(options, "host", "127.0.0.1")),
        tritonserver=str(_get(options, "tritonserver", "/opt/tritonserver/bin/tritonserver")),
        backend_models_dir=str(_get(options, "backend_models_dir", "/app/all_models")),
    )
