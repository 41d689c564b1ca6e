"""The embedded engine's configuration: `Policy` (what speculation a request gets) and `EngineConfig` (everything
in `engine_config.json`). This module is the only reader and writer of that file; it imports no torch, so the
stages and `tune` use it without loading a model.

    cfg = EngineConfig.load(engine_dir)              # engine_config.json -> EngineConfig (validated)
    cfg.policy.describe()                            # "adaptive K (<= 8) with the draft; off above 3 sequences"
    cfg.replace(policy=Policy(k=4)).save(engine_dir) # atomic write

**Policy semantics** (one place; the scheduler and the docs follow it):

| the request sends | K per step | drafts above `max_concurrency`? |
|---|---|---|
| no `num_draft_tokens` | the policy's: adaptive (0..max_draft_len, from the request's own acceptance and the step costs) or its fixed K | no (the cut-off) |
| `num_draft_tokens = -1` | adaptive | no |
| `num_draft_tokens = 0` | 0 (speculation off) | – |
| `num_draft_tokens = K > 0` | K, *forced* (never more than max_tokens leaves room for) | yes |

The proposer is the request's `proposer`, else the policy's. `max_concurrency` is TensorRT-LLM's
`max_concurrency` for speculation: at high batch a target step is compute-bound and drafting stops paying, so
requests that leave K to the deployment are not drafted in steps with more running sequences. `build` measures
it (the crossover); `tune --apply` and `Engine.set_policy` replace the policy.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbuild.engines.embedded.errors import EngineLimitError
from specbuild.core.constants import DRAFT_ACTIVATIONS, DTYPES, ENGINE_CONFIG_FILE, PREFILL_PRECISIONS, PROPOSERS
from specbuild.core.errors import SourceError
from specbuild.core.manifest import atomic_write_text

ADAPTIVE = "adaptive"                    # Policy.k value: K chosen per step (adaptive.py)
ADAPTIVE_K = -1                          # the request-side spelling of adaptive (num_draft_tokens = -1)
EXACT, UNSAFE_ALWAYS_ACCEPT = "exact", "unsafe-always-accept"   # acceptance rules; only "exact" is lossless
ACCEPTANCE_RULES = (EXACT, UNSAFE_ALWAYS_ACCEPT)
LINEAR_KERNELS = ("auto", "tiled", "onednn", "aten")
DRAFT_KV = ("own", "shared")
DECODE_STEPS = ("auto", "fused", "eager")  # = fused.DECODE_STEPS (this module imports no torch)
ENGINE_FORMAT = "specbuild-embedded-engine"
ENGINE_SCHEMA = 2                        # 2: `policy` object (1: loose adaptive_k / spec_max_concurrency keys)
QUEUE_PER_SLOT = 4                       # default max_queue_size = QUEUE_PER_SLOT x max_batch_size
DEFAULT_QUEUE_TIMEOUT_S = 300.0          # longest wait for a slot: batch clients queue behind full slots
DEFAULT_REQUEST_TIMEOUT_S = 600.0        # longest life of a request (queue + generation): frees abandoned slots


class ConfigError(SourceError, EngineLimitError):
    """engine_config.json (or a policy) is not something the engine can run; the message says what to change.
    A SourceError (the engine directory is unusable) and an EngineLimitError (a limit or option it cannot serve)."""


def _int_or_none(name: str, value: Any, lo: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
        raise ConfigError(f"{name}={value!r} must be an integer >= {lo} or null.")


def _seconds_or_none(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ConfigError(f"{name}={value!r} must be a number of seconds > 0 or null (no limit).")


@dataclass(frozen=True)
class Policy:
    """The deployment's default speculation (see the module docstring for what a request's own K means)."""

    k: int | str = ADAPTIVE              # ADAPTIVE, or a fixed K for requests that send none (0 = off)
    proposer: str = "draft"              # "draft" | "ngram"
    max_concurrency: int | None = None   # no drafting by default in steps with more sequences; None = no cut-off
    source: str = "defaults"             # who set it: "build", "build: calibrated", "tune", ...

    def __post_init__(self):
        if self.k != ADAPTIVE and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0):
            raise ConfigError(f"policy k={self.k!r} must be {ADAPTIVE!r} or an integer >= 0 (0 = speculation off).")
        if self.proposer not in PROPOSERS:
            raise ConfigError(f"policy proposer {self.proposer!r} is unknown; use one of {PROPOSERS}.")
        _int_or_none("policy max_concurrency", self.max_concurrency, 0)

    @property
    def adaptive(self) -> bool:
        return self.k == ADAPTIVE

    def check(self, *, max_draft_len: int, has_draft: bool) -> None:
        """Refuse a policy this engine cannot serve (a K above max_draft_len, the draft proposer without a draft)."""
        if not self.adaptive and self.k > max_draft_len:
            raise ConfigError(f"policy k={self.k} is above the engine's max_draft_len={max_draft_len}; pick K <= "
                              f"{max_draft_len} or rebuild with a larger --max-draft-len.")
        if self.proposer == "draft" and not has_draft and self.k != 0:
            raise ConfigError("the policy drafts with the draft model, but this engine has none; use proposer "
                              "'ngram' or k=0.")

    def resolve(self, request_k: int | None, max_draft_len: int) -> tuple[int, bool, bool]:
        """A request's K (None = it sent none) -> (most K per step, adaptive, forced). Forced requests draft
        above `max_concurrency`; the others follow the cut-off."""
        if request_k is None:
            if self.adaptive:
                return max_draft_len, True, False
            return int(self.k), False, False
        if request_k == ADAPTIVE_K:
            return max_draft_len, True, False
        return int(request_k), False, request_k > 0

    def describe(self, cutoff: str | None = None) -> str:
        """One line for logs and dry runs; `cutoff` replaces the cut-off's description (a plan, before it is
        measured)."""
        what = (f"adaptive K with the {self.proposer}" if self.adaptive else
                "speculation off" if self.k == 0 else f"K={self.k} with the {self.proposer}")
        if self.k == 0:
            return what
        cut = cutoff or ("at any concurrency" if self.max_concurrency is None else
               "never by default (max_concurrency 0)" if self.max_concurrency == 0 else
               f"off above {self.max_concurrency} concurrent sequence{'s' if self.max_concurrency > 1 else ''}")
        return f"{what}, {cut}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Policy":
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"policy has unknown keys {unknown}; the keys are k, proposer, max_concurrency, "
                              "source.")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """Everything `engine_config.json` holds: paths (relative to the engine directory), limits, numerics,
    admission, the calibration and the policy. Validated on construction."""

    target: str = "target"
    draft: str | None = None
    draft_format: str | None = None          # "hf-safetensors" | "int8-weight-only" | "int4-blocks" (quant.py)
    draft_quantize: str | None = None        # the quantization build applied (None: the draft as converted)
    tokenizer: str | None = None             # None: the target dir holds the tokenizer
    max_batch_size: int = 8
    max_seq_len: int = 1024
    max_draft_len: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    draft_kv: str = "own"                    # "shared": a self-draft attends over the target's KV cache
    draft_activations: str = "fp32"          # "int8": a block-quantized draft rounds x to 8 bits (cheaper, approximate)
    linear_kernel: str = "auto"              # "auto" | "tiled" | "onednn" | "aten" (kernels.py)
    decode_step: str = "auto"                # "auto" | "fused" | "eager" (fused.py)
    prefill_precision: str = "fp32"          # "bf16": the target's prompt rows on AVX-512 BF16 (step.py; not the
                                             # fp32 model's exact prompt cache, the same in every mode)
    online_costs: bool = True                # adaptive K prices K with step costs measured while serving
    acceptance_rule: str = EXACT             # "exact" | "unsafe-always-accept" (deliberate fault, tests only)
    max_queue_size: int | None = None        # waiting requests before refusing; None = 4 x max_batch_size;
                                             # 0 = no limit (as Triton's own max_queue_size)
    queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S    # longest wait for a slot; None = no limit
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S  # longest life of a request; None = no limit
    calibration: dict | None = None          # calibrate.Calibration.to_dict() (+ crossover): the measured costs
    policy: Policy = field(default_factory=Policy)

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_seq_len < 2 or self.max_draft_len < 0:
            raise ConfigError(f"engine limits must be max_batch_size >= 1, max_seq_len >= 2, max_draft_len >= 0; "
                              f"got {self.max_batch_size}, {self.max_seq_len}, {self.max_draft_len}.")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use one of {DTYPES}.")
        for name, allowed in (("acceptance_rule", ACCEPTANCE_RULES), ("linear_kernel", LINEAR_KERNELS),
                              ("draft_kv", DRAFT_KV), ("decode_step", DECODE_STEPS),
                              ("draft_activations", DRAFT_ACTIVATIONS),
                              ("prefill_precision", PREFILL_PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} {getattr(self, name)!r} is unknown; use one of {allowed}"
                                  + (" (\"exact\" is the only lossless one)." if name == "acceptance_rule" else "."))
        _int_or_none("max_queue_size", self.max_queue_size, 0)
        _int_or_none("threads", self.threads, 0)
        _seconds_or_none("queue_timeout_s", self.queue_timeout_s)
        _seconds_or_none("request_timeout_s", self.request_timeout_s)
        if not isinstance(self.policy, Policy):
            raise ConfigError(f"policy must be a Policy, got {type(self.policy).__name__}")
        self.policy.check(max_draft_len=self.max_draft_len, has_draft=self.has_draft)

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    @property
    def queue_limit(self) -> int | None:
        """Requests that may wait for a slot; None = no limit (max_queue_size 0, as Triton's own max_queue_size:
        a queue of 0 would refuse every request, since each one waits for its first step)."""
        if self.max_queue_size == 0:
            return None
        return self.max_queue_size if self.max_queue_size is not None else QUEUE_PER_SLOT * self.max_batch_size

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    # ---- engine_config.json -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["policy"] = self.policy.to_dict()
        return {"format": ENGINE_FORMAT, "schema": ENGINE_SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = ENGINE_CONFIG_FILE) -> "EngineConfig":
        d = dict(d)
        legacy = any(k in d for k in _SCHEMA_1_KEYS)
        fmt, schema = d.pop("format", ENGINE_FORMAT), d.pop("schema", 1 if legacy else ENGINE_SCHEMA)
        if fmt != ENGINE_FORMAT:
            raise ConfigError(f"{where}: format {fmt!r} is not {ENGINE_FORMAT!r}; pass the engine directory "
                              "written by `specbuild build --backend embedded`.")
        if not isinstance(schema, int) or schema > ENGINE_SCHEMA:
            raise ConfigError(f"{where}: schema {schema!r} is newer than this specbuild reads ({ENGINE_SCHEMA}); "
                              "upgrade specbuild or rebuild with `specbuild build --force`.")
        if schema < 2:
            d = _from_schema_1(d)
        d.pop("target_format", None)        # informational keys of schema 1
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; rebuild with `specbuild build --force`.")
        try:
            if d.get("policy") is None:
                d["policy"] = default_policy(d.get("max_draft_len", cls.max_draft_len), d.get("draft") is not None)
            else:
                d["policy"] = Policy.from_dict(d["policy"])
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"{where}: {e}; rebuild with `specbuild build --force`.") from None

    @classmethod
    def load(cls, engine_dir: str | os.PathLike) -> "EngineConfig":
        path = Path(engine_dir) / ENGINE_CONFIG_FILE
        if not path.is_file():
            raise ConfigError(f"{engine_dir} has no {ENGINE_CONFIG_FILE}; run `specbuild build --backend embedded` "
                              "and pass its engine directory.")
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(f"{path} is not valid JSON ({e}); rebuild with `specbuild build --force`.") from None
        return cls.from_dict(data, where=str(path))

    def save(self, engine_dir: str | os.PathLike) -> Path:
        """Write `engine_config.json` atomically (a temp file renamed over the old one)."""
        path = Path(engine_dir) / ENGINE_CONFIG_FILE
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")   # mode 0666 & ~umask, like every output
        return path


def default_policy(max_draft_len: int, has_draft: bool) -> Policy:
    """The policy of an engine nobody measured: a fixed K = min(4, max_draft_len) at any concurrency, with the
    draft when there is one, else n-gram."""
    return Policy(k=min(4, max_draft_len), proposer="draft" if has_draft else "ngram", source="defaults")


_SCHEMA_1_KEYS = ("adaptive_k", "default_num_draft_tokens", "default_proposer", "spec_max_concurrency")


def _from_schema_1(d: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 (before the Policy object): loose default_num_draft_tokens / default_proposer / adaptive_k /
    spec_max_concurrency keys."""
    adaptive = bool(d.pop("adaptive_k", False))
    k = d.pop("default_num_draft_tokens", 4)
    proposer = d.pop("default_proposer", "draft")
    if proposer == "draft" and not d.get("draft"):
        proposer = "ngram"
    d["policy"] = {"k": ADAPTIVE if adaptive else k, "proposer": proposer,
                   "max_concurrency": d.pop("spec_max_concurrency", None), "source": "engine_config.json schema 1"}
    return d
