"""convert (trtllm): Hugging Face target + draft -> TensorRT-LLM checkpoints (engine path).

Engine path: per model and per rank, `convert_rank` runs `<ModelClass>.from_hugging_face(...)
.save_checkpoint(...)` with the TP/PP Mapping (FP8: one calibrated `quantize` call). Output::

    checkpoints/target/{config.json, rank0.safetensors, ...}
    checkpoints/draft/{config.json, rank0.safetensors, ...}
    checkpoints/tokenizer/   (the target's tokenizer, for Triton pre/post-processing)

LLM-API path (TensorRT-LLM >= 1.0): the PyTorch backend loads Hugging Face checkpoints directly, so
convert only checks the pair and records the sources (checkpoints/sources.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specbuild.core.errors import CheckFailed, UsageError
from specbuild.core.stage import PlanStep, StageContext, StageResult

from specbuild.engines.trtllm import rehearsal
from specbuild.engines.trtllm.checks import check_vocab
from specbuild.engines.trtllm.common import (ROLES, copy_tokenizer, hf_config, model_class, resolve_dtype,
                                             source_dir, stage_settings)
from specbuild.engines.trtllm.runner import require_tensorrt_llm, run_command
from specbuild.engines.trtllm.settings import Settings
from specbuild.engines.trtllm.versions import ENGINE

WORKER = "specbuild.engines.trtllm.convert_rank"
# The interpreter of the TensorRT-LLM containers (nvcr.io/nvidia/tritonserver:<tag>-trtllm-python-py3 and
# nvcr.io/nvidia/tensorrt-llm/release:<version>): `python3` on PATH, where tensorrt_llm is installed.
CONTAINER_PYTHON = "python3"


def worker_python(s: Settings) -> str:
    """The interpreter a plan names for the per-rank converter: this one when tensorrt_llm imports here (we are
    in the container), else the container's `python3`: a dry run or a rehearsal on another machine must not
    record this machine's interpreter path for a step that runs inside the container."""
    return sys.executable if s.recipe.detected else CONTAINER_PYTHON


def _sources(ctx: StageContext, s: Settings) -> dict[str, dict]:
    out = {}
    for role in ROLES:
        path = source_dir(ctx.options, role)
        cfg = hf_config(path)
        out[role] = {"dir": path, "config": cfg, "class": model_class(cfg, role)}
    vocab = check_vocab(out["target"]["config"], out["draft"]["config"])
    for role in ROLES:
        out[role]["vocab_size"] = vocab
    if s.recipe.generation != ENGINE and s.quantization:
        raise UsageError(f"--quantization {s.quantization} is applied at conversion on the engine path only; on the "
                         "llmapi path pass a pre-quantized (ModelOpt) checkpoint instead and drop --quantization.")
    return out


def commands(ctx: StageContext, s: Settings, sources: dict[str, dict], *, python: str | None = None) -> list[list[str]]:
    """The exact argv lists convert runs, target first, one per rank (or one calibrated run for FP8); `python`:
    the interpreter (default: `worker_python`)."""
    python = python or worker_python(s)
    argvs = []
    for role in ROLES:
        src = sources[role]
        tp, pp = (s.tp, s.pp) if role == "target" else (s.draft_tp, s.draft_pp)
        dtype = resolve_dtype(s.dtype, src["config"])
        base = [python, "-m", WORKER, "--model-class", src["class"], "--model-dir", str(src["dir"]),
                "--output-dir", str(Path(ctx.out_dir) / role), "--dtype", dtype,
                "--tp-size", str(tp), "--pp-size", str(pp)]
        quant = ["--quantization", s.quantization] if s.quantization else []
        if s.quantization == "fp8":
            calib = str(ctx.options.get("calib_dataset") or "cnn_dailymail")
            argvs.append(base + quant + ["--calibrate", "--calib-dataset", calib])
        else:
            argvs.extend(base + ["--rank", str(rank)] + quant for rank in range(tp * pp))
    return argvs


def _sources_json(sources: dict[str, dict], s: Settings) -> str:
    return json.dumps({role: {"dir": str(src["dir"]), "model_class": src["class"],
                              "vocab_size": src["vocab_size"]} for role, src in sources.items()}
                      | {"recipe": s.recipe.to_dict()}, indent=2) + "\n"


def plan(ctx: StageContext) -> list[PlanStep]:
    s = stage_settings(ctx.options)
    sources = _sources(ctx, s)
    steps = [PlanStep("note", note=f"TensorRT-LLM {s.recipe.trtllm_version} ({s.recipe.generation} path), "
                                   f"container {s.recipe.container}")]
    if s.dtype == "float32":
        steps.append(PlanStep("note", note="dtype float32 doubles engine size and cost versus float16; pass --dtype "
                                           "float16 or bfloat16 for GPUs"))
    if s.recipe.generation == ENGINE:
        if worker_python(s) == CONTAINER_PYTHON:
            steps.append(PlanStep("note", note=f"tensorrt_llm does not import here: the commands below run inside "
                                               f"{s.recipe.container}, with its `{CONTAINER_PYTHON}` (where "
                                               "specbuild is installed beside tensorrt_llm)"))
        steps += [PlanStep("run", argv=argv) for argv in commands(ctx, s, sources)]
        steps.append(PlanStep("note", note=f"copy the target tokenizer from {sources['target']['dir']} to "
                                           f"{Path(ctx.out_dir) / 'tokenizer'}"))
    else:
        steps.append(PlanStep("note", note="the LLM API (PyTorch backend) loads Hugging Face checkpoints directly; "
                                           "nothing to convert"))
    steps.append(PlanStep("write", path=str(Path(ctx.out_dir) / "sources.json"), content=_sources_json(sources, s)))
    return steps


def _rehearse(ctx: StageContext, s: Settings, sources: dict[str, dict]) -> StageResult:
    """--rehearse: record the plan, keep the Hugging Face checkpoints and the tokenizer (rehearsal.py)."""
    out = Path(ctx.out_dir)
    final = ctx.out_dir
    ctx.out_dir = Path(ctx.workdir) / "checkpoints"     # the plan names the final paths, as the dry run does
    try:
        steps = plan(ctx)
    finally:
        ctx.out_dir = final
    (out / rehearsal.PLAN_FILE).write_text(rehearsal.plan_record(steps, stage="convert", recipe=s.recipe.to_dict()))
    outputs: dict[str, object] = {"sources": "sources.json", "rehearsal_plan": rehearsal.PLAN_FILE}
    for role in ROLES:
        rehearsal.keep_tree(sources[role]["dir"], out / rehearsal.HF_DIR / role)
    outputs["hf_checkpoints"] = {role: f"{rehearsal.HF_DIR}/{role}" for role in ROLES}
    if s.recipe.generation == ENGINE:
        outputs.update(target_checkpoint="target", draft_checkpoint="draft")   # named by the plan, not written
        copy_tokenizer(sources["target"]["dir"], out / "tokenizer")
        outputs["tokenizer"] = "tokenizer"
    (out / "sources.json").write_text(_sources_json(sources, s))
    ctx.progress(f"rehearsal: recorded {sum(st.kind == 'run' for st in steps)} commands in "
                 f"checkpoints/{rehearsal.PLAN_FILE} (not run: no TensorRT-LLM); kept the Hugging Face checkpoints "
                 f"in checkpoints/{rehearsal.HF_DIR}/")
    return StageResult(
        outputs=outputs,
        checks=[{"name": "vocab_match", "ok": True, "vocab_size": sources["target"]["vocab_size"]},
                {"name": "rehearsal", "ok": True, "detail": "no TensorRT-LLM checkpoint was written"}],
        extra={"rehearsal": True, "recipe": s.recipe.to_dict(), "tensorrt_llm": None,
               "trtllm_options": {**{k: v for k, v in ctx.options.items() if v is not None},
                                  "trtllm_version": s.recipe.trtllm_version,
                                  "trtllm_generation": s.recipe.generation, "container_tag": s.recipe.container}},
    )


def run(ctx: StageContext) -> StageResult:
    s = stage_settings(ctx.options)
    if rehearsal.requested(ctx.options):
        return _rehearse(ctx, s, _sources(ctx, s))
    installed = require_tensorrt_llm(s.recipe.container)
    sources = _sources(ctx, s)
    out = Path(ctx.out_dir)
    outputs: dict[str, object] = {"sources": "sources.json"}
    if s.recipe.generation == ENGINE:
        for argv in commands(ctx, s, sources, python=sys.executable):
            ctx.progress(f"convert: {argv[argv.index('--output-dir') + 1]}")
            run_command(argv, log_file=out / "convert.log", progress=ctx.progress, what="convert_rank")
        for role in ROLES:
            world = s.tp * s.pp if role == "target" else s.draft_tp * s.draft_pp
            missing = [n for n in ["config.json"] + [f"rank{r}.safetensors" for r in range(world)]
                       if not (out / role / n).is_file()]
            if missing:
                raise CheckFailed(f"the {role} conversion finished but {missing} are missing in {out / role}; see "
                                  f"{out / 'convert.log'}.")
            outputs[f"{role}_checkpoint"] = role
        copy_tokenizer(sources["target"]["dir"], out / "tokenizer")
        outputs["tokenizer"] = "tokenizer"
    (out / "sources.json").write_text(_sources_json(sources, s))
    return StageResult(
        outputs=outputs,
        checks=[{"name": "vocab_match", "ok": True, "vocab_size": sources["target"]["vocab_size"]}],
        extra={"recipe": s.recipe.to_dict(), "tensorrt_llm": installed,
               "trtllm_options": {**{k: v for k, v in ctx.options.items() if v is not None},
                                  "trtllm_version": s.recipe.trtllm_version,
                                  "trtllm_generation": s.recipe.generation, "container_tag": s.recipe.container}},
    )
