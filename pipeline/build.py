"""`build` stage: turn `<workdir>/checkpoints/` (from `specbuild convert`) into `<workdir>/engines/`.

The backend does the work (`specbuild.engines.<backend>.build`):
- `embedded`: an engine directory the pure-PyTorch engine loads (`engine_config.json`, target/ and draft/ weights in the
  runtime layout, an optional int8 weight-only draft, tokenizer), a smoke generation and a calibration that
  picks the default K (see `specbuild.engines.embedded.calibrate`);
- `trtllm`: `trtllm-build` for target and draft (the trtllm-only options below are passed through).

Validation happens here, once, before anything is read or written; re-running with unchanged checkpoints and
options is a no-op (the stage runner's fingerprint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specbuild.core.errors import UsageError
from specbuild.pipeline.stage import BACKENDS, PlanStep, run_stage
from specbuild.core.constants import DRAFT_ACTIVATIONS, DRAFT_QUANTIZATIONS, DTYPES, PREFILL_PRECISIONS, PROPOSERS  # noqa: F401 (the CLI imports them here)

MAX_DRAFT_LEN_LIMIT = 32


@dataclass(frozen=True)
class BuildResult:
    out_dir: Path
    manifest: dict[str, Any]
    skipped: bool                        # True: checkpoints and options unchanged, nothing was redone
    seconds: float
    plan: list[PlanStep] | None = None   # set for dry runs

    @property
    def calibration(self) -> dict[str, Any] | None:
        return self.manifest.get("extra", {}).get("calibration")


def _check_device(device: str) -> None:
    if device == "cpu":
        return
    if device == "cuda" or device.startswith("cuda:"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device is visible to torch here; build with --device cpu.")
        return
    raise UsageError(f"unknown --device {device!r}; use cpu, cuda or cuda:N.")


def _validate(*, backend: str, max_batch_size: int, max_seq_len: int, max_draft_len: int, dtype: str,
              device: str, threads: int | None, draft_quantize: str | None, proposer: str,
              num_draft_tokens: int | None, tp: int, pp: int) -> None:
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if max_batch_size < 1:
        raise UsageError(f"--max-batch-size must be >= 1 (got {max_batch_size}).")
    if max_seq_len < 16:
        raise UsageError(f"--max-seq-len must be >= 16 (got {max_seq_len}); prompts and outputs share it.")
    if not 1 <= max_draft_len <= MAX_DRAFT_LEN_LIMIT:
        raise UsageError(f"--max-draft-len must be in 1..{MAX_DRAFT_LEN_LIMIT} (got {max_draft_len}); "
                         "4-8 is the useful range.")
    if num_draft_tokens is not None and not 0 <= num_draft_tokens <= max_draft_len:
        raise UsageError(f"--num-draft-tokens {num_draft_tokens} must be in 0..--max-draft-len ({max_draft_len}); "
                         "omit it to use the calibrated K.")
    if dtype not in DTYPES:
        raise UsageError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    if proposer not in PROPOSERS:
        raise UsageError(f"unknown --proposer {proposer!r}; choose one of {', '.join(PROPOSERS)}.")
    if backend != "embedded":
        return
    if draft_quantize is not None and draft_quantize not in DRAFT_QUANTIZATIONS:
        raise UsageError(f"unknown --draft-quantize {draft_quantize!r}; choose one of "
                         f"{', '.join(DRAFT_QUANTIZATIONS)} (or omit it).")
    if threads is not None and not 1 <= threads <= (os.cpu_count() or 1):
        raise UsageError(f"--threads {threads} is out of range; use 1..{os.cpu_count()} (this machine's cores) "
                         "or omit it for torch's default.")
    if tp != 1 or pp != 1:
        raise UsageError(f"the embedded backend runs on one device: --tp/--pp must be 1 (got tp={tp}, pp={pp}). "
                         "Use --backend trtllm for tensor/pipeline parallelism.")
    _check_device(device)


def build(*, workdir: str | os.PathLike = "specbuild-work", backend: str = "embedded", max_batch_size: int = 8,
          max_seq_len: int = 1024, max_draft_len: int = 8, dtype: str = "float32", device: str = "cpu",
          threads: int | None = None, draft_quantize: str | None = None, calibrate: bool = True,
          proposer: str = "draft", num_draft_tokens: int | None = None, force: bool = False, dry_run: bool = False,
          trtllm_version: str | None = None, max_input_len: int | None = None, max_num_tokens: int | None = None,
          use_draft_logits: bool = False, tp: int = 1, pp: int = 1, container_tag: str | None = None,
          adaptive_k: bool | None = None, spec_max_concurrency: int | None = None, crossover: bool = True,
          trtllm_generation: str | None = None, rehearse: bool = False, draft_activations: str | None = None,
          prefill_precision: str | None = None, progress: Callable[[str], None] | None = None) -> BuildResult:
    """Build `<workdir>/engines/` from `<workdir>/checkpoints/` with the chosen backend.

    `num_draft_tokens=None` makes the calibrated K the default K (embedded); `draft_quantize="int8"` stores the
    draft as int8 weight-only (with a draft == target checkpoint this is the demo "int8 self-draft").
    `draft_activations` ("fp32" | "int8", default int8 for an int4 draft): a block draft's activations.
    `prefill_precision` ("fp32" | "bf16", default fp32): the target's prompt rows (embedded; EngineConfig).
    `adaptive_k` lets each sequence choose its K from its own acceptance (requests may also send
    num_draft_tokens=-1); `spec_max_concurrency` switches drafting off while more sequences run.
    Defaults (embedded, calibrated): adaptive K unless `num_draft_tokens` fixes one, and `spec_max_concurrency`
    = the measured crossover cut-off (`crossover=True`: build times speculation against plain decoding at
    rising concurrency, see `calibrate.measure_crossover`; an explicit `spec_max_concurrency` skips that).
    """
    if spec_max_concurrency is not None and spec_max_concurrency < 1:
        raise UsageError(f"--spec-max-concurrency {spec_max_concurrency} must be >= 1 (leave it unset for "
                         "speculation at every batch size).")
    _validate(backend=backend, max_batch_size=max_batch_size, max_seq_len=max_seq_len, max_draft_len=max_draft_len,
              dtype=dtype, device=device, threads=threads, draft_quantize=draft_quantize, proposer=proposer,
              num_draft_tokens=num_draft_tokens, tp=tp, pp=pp)
    options: dict[str, Any] = {
        "max_batch_size": max_batch_size, "max_seq_len": max_seq_len, "max_draft_len": max_draft_len,
        "dtype": dtype, "device": device, "threads": threads, "draft_quantize": draft_quantize,
        "calibrate": calibrate, "proposer": proposer, "num_draft_tokens": num_draft_tokens,
    }
    if adaptive_k is not None:          # only when set, so the default policy keeps one fingerprint
        options["adaptive_k"] = bool(adaptive_k)
    if not crossover:
        options["crossover"] = False
    if draft_activations is not None:   # only when set: the default (int8 for an int4 draft) keeps its fingerprint
        if draft_activations not in DRAFT_ACTIVATIONS:
            raise UsageError(f"unknown --draft-activations {draft_activations!r}; choose one of "
                             f"{', '.join(DRAFT_ACTIVATIONS)}.")
        options["draft_activations"] = draft_activations
    if prefill_precision is not None:   # only when set: the default keeps its fingerprint
        if prefill_precision not in PREFILL_PRECISIONS:
            raise UsageError(f"unknown --prefill-precision {prefill_precision!r}; choose one of "
                             f"{', '.join(PREFILL_PRECISIONS)}.")
        if backend != "embedded" and prefill_precision != "fp32":
            raise UsageError("--prefill-precision applies to --backend embedded only (TensorRT-LLM builds its "
                             "engine in --dtype).")
        options["prefill_precision"] = prefill_precision
    if spec_max_concurrency is not None:
        options["spec_max_concurrency"] = spec_max_concurrency
    if (trtllm_generation or rehearse) and backend != "trtllm":
        raise UsageError("--trtllm-generation and --rehearse apply to --backend trtllm only.")
    if backend == "trtllm":
        options.update({"trtllm_version": trtllm_version, "max_input_len": max_input_len,
                        "max_num_tokens": max_num_tokens, "use_draft_logits": use_draft_logits,
                        "tp": tp, "pp": pp, "container_tag": container_tag,
                        "trtllm_generation": trtllm_generation, "rehearse": rehearse or None})
        options = {k: v for k, v in options.items() if v is not None}
    outcome = run_stage("build", backend=backend, workdir=Path(workdir), options=options, inputs={},
                        upstream_stage="convert", force=force, dry_run=dry_run, progress=progress)
    return BuildResult(out_dir=outcome.out_dir, manifest=outcome.manifest, skipped=outcome.skipped,
                       seconds=outcome.seconds, plan=outcome.plan)
