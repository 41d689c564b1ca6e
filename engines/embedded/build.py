"""`build` for the embedded backend: the engine directory `<workdir>/engines/` the runtime loads.

Layout written (atomically, through the stage runner)::

    engine_config.json     runtime config: limits, dtype, device, threads, default K and proposer, draft
                           quantization, and the calibration (also in manifest.json)
    target/                config.json + model.safetensors in the runtime dtype (HF names)
    draft/                 fp draft: the same layout; int8 draft: config.json + model.int8.safetensors
                           (engine-module names, int8 weights + per-channel scales; see quant.py)
    tokenizer/             the target's tokenizer files
    manifest.json

Then the engine is loaded from that directory exactly as a server would (`Engine.from_build_dir`), a smoke
generation checks that speculative output equals target-only output (greedy), and a calibration
(`calibrate.py`) measures step times and acceptance and picks the default K.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specbuild.engines.embedded.config import ADAPTIVE, EngineConfig, Policy
from specbuild.core.constants import ENGINE_CONFIG_FILE, TOKENIZER_FILES
from specbuild.core.errors import ManifestError, SpecbuildError, UsageError
from specbuild.core.stage import PlanStep, StageContext, StageResult

DRAFT_FORMATS = {"int8": "int8-weight-only", "int4": "int4-blocks"}   # engine_config.json draft_format
SMOKE_PROMPT = "The capital of France is"
SMOKE_TOKENS = 8


def _checkpoint_dirs(ctx: StageContext) -> tuple[Path, Path | None]:
    if ctx.upstream_dir is None:
        raise ManifestError("build needs the convert stage's output; run `specbuild convert` first.")
    up = Path(ctx.upstream_dir)
    target = up / "target"
    if not (target / "config.json").is_file():
        raise ManifestError(f"{target} has no config.json; the checkpoints are incomplete: re-run "
                            "`specbuild convert --force`.")
    draft = up / "draft"
    return target, (draft if (draft / "config.json").is_file() else None)


def _draft_kv(ctx: StageContext, target_src: Path, draft_src: Path | None) -> str:
    """"shared" when the draft checkpoint is the target's (same config.json and weight files by sha256): its
    quantized copy then attends over the target's KV cache (engine.py `draft_kv`); else "own". The digests are
    the ones convert recorded in its manifest (`outputs.<role>.files`), else the workspace's hash cache."""
    if draft_src is None:
        return "own"
    names = ["config.json"] + [f.name for f in _weights(target_src)]
    if [f.name for f in _weights(draft_src)] != names[1:] or len(names) < 2:
        return "own"
    outputs = (ctx.upstream or {}).get("outputs") or {}

    def digest(role: str, src: Path, name: str) -> str:
        recorded = ((outputs.get(role) or {}).get("files") or {}).get(name)
        return recorded or ctx.hashes.sha256(src / name)

    same = all(digest("target", target_src, n) == digest("draft", draft_src, n) for n in names)
    return "shared" if same else "own"


def _weights(src: Path) -> list[Path]:
    files = sorted(src.glob("*.safetensors"))
    index = src / "model.safetensors.index.json"
    return files + ([index] if index.is_file() else [])


def _engine_config(opts: dict[str, Any], *, has_draft: bool, policy: Policy, calibration: dict | None) -> EngineConfig:
    """The runtime config `Engine.from_build_dir` reads (paths relative to the engine directory)."""
    draft_format = None
    if has_draft:
        draft_format = DRAFT_FORMATS.get(opts["draft_quantize"], "hf-safetensors")
    return EngineConfig(
        target="target", draft="draft" if has_draft else None, draft_format=draft_format,
        draft_quantize=opts["draft_quantize"] if has_draft else None, tokenizer="tokenizer",
        max_batch_size=opts["max_batch_size"], max_seq_len=opts["max_seq_len"], max_draft_len=opts["max_draft_len"],
        dtype=opts["dtype"], device=opts["device"], threads=opts["threads"],
        draft_kv=opts.get("draft_kv", "own") if has_draft else "own", calibration=calibration, policy=policy,
        draft_activations=draft_activations(opts) if has_draft else "fp32",
        prefill_precision=opts.get("prefill_precision") or "fp32")


def draft_activations(opts: dict[str, Any]) -> str:
    """--draft-activations, else "int8" for an int4 (block) draft — its integer kernels cost about a third less
    per step on AVX2 and acceptance falls a little (bench/README.md) — and "fp32" for any other."""
    return opts.get("draft_activations") or ("int8" if opts.get("draft_quantize") == "int4" else "fp32")


def _policy(opts: dict[str, Any], calibration: dict | None, default_k: int) -> Policy:
    """The policy the deployment serves with by default. Explicit options win. Else, with a calibration:
    adaptive K unless a fixed --num-draft-tokens was given, and the measured cut-off of the default proposer (no
    drafting above the concurrency where it stopped paying); without one: the fixed default K at any concurrency."""
    adaptive = opts.get("adaptive_k")
    if adaptive is None:
        adaptive = calibration is not None and opts["num_draft_tokens"] is None
    smc = opts.get("spec_max_concurrency")
    measured = smc is None and calibration is not None and bool(calibration.get("crossover"))
    if measured:
        smc = ((calibration.get("crossover") or {}).get(opts["proposer"]) or {}).get("spec_max_concurrency")
    source = "build: " + ("calibrated" if calibration is not None else "not calibrated")
    if measured:
        source += ", measured cut-off"
    return Policy(k=ADAPTIVE if adaptive else default_k, proposer=opts["proposer"], max_concurrency=smc,
                  source=source)


def _write_target(src: Path, dst: Path, dtype: str) -> dict:
    """Copy the converted target (recasting when the build dtype differs from the checkpoint's)."""
    from specbuild.engines.embedded.weights import read_config

    dst.mkdir(parents=True)
    cfg = read_config(src)
    files = _weights(src)
    if cfg.get("dtype", cfg.get("torch_dtype", "float32")) == dtype:
        for f in files:
            shutil.copyfile(f, dst / f.name)
    else:
        from safetensors.torch import load_file, save_file

        from specbuild.engines.embedded.weights import torch_dtype
        dt = torch_dtype(dtype)
        for f in files:
            if f.suffix != ".safetensors":
                shutil.copyfile(f, dst / f.name)
                continue
            state = {k: (v.to(dt) if v.is_floating_point() else v) for k, v in load_file(str(f)).items()}
            save_file(state, str(dst / f.name), metadata={"format": "pt"})
            del state
    cfg["dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return {"format": "hf-safetensors", "dtype": dtype, "files": [f.name for f in files]}


def _write_draft(src: Path, dst: Path, *, dtype: str, quantize: str | None) -> dict:
    if quantize is None:
        return _write_target(src, dst, dtype)
    from specbuild.engines.embedded.quant import quantize_model_, save_quantized_model
    from specbuild.engines.embedded.weights import load_model, read_config

    model = quantize_model_(load_model(src, dtype=dtype), quantize)
    info = save_quantized_model(model, dst, hf_config={**read_config(src), "dtype": dtype}, scheme=quantize)
    return {"format": DRAFT_FORMATS[quantize], "dtype": dtype, **info}


def _smoke(engine, *, has_draft: bool, proposer: str) -> dict:
    """Greedy generation with speculation off and on; the outputs must be equal (lossless)."""
    from specbuild.engines.embedded import SamplingParams

    params = SamplingParams(max_tokens=SMOKE_TOKENS, temperature=0.0, ignore_eos=True)
    plain = engine.generate(SMOKE_PROMPT, params, num_draft_tokens=0)
    spec_proposer = proposer if has_draft or proposer == "ngram" else "ngram"
    spec = engine.generate(SMOKE_PROMPT, params, num_draft_tokens=min(2, engine.config.max_draft_len),
                           proposer=spec_proposer)
    if len(plain.token_ids) != SMOKE_TOKENS:
        raise SpecbuildError(f"smoke generation produced {len(plain.token_ids)} tokens instead of {SMOKE_TOKENS}; "
                             "the engine directory is unusable: report this with the build log.")
    if spec.token_ids != plain.token_ids:
        raise SpecbuildError(f"smoke generation with speculation ({spec_proposer}) differs from target-only output "
                             f"({spec.token_ids} vs {plain.token_ids}): the engine is not lossless; report this.")
    return {"name": "smoke-generation", "ok": True, "prompt": SMOKE_PROMPT, "tokens": len(plain.token_ids),
            "text": plain.text, "speculative_equal": True, "proposer": spec_proposer}


def _crossover(engine, opts: dict[str, Any], *, has_draft: bool, default_k: int, calibration: dict,
               progress) -> dict:
    """Per proposer (the draft when there is one, n-gram always): the measured speedup at each concurrency and
    the cut-off (`calibrate.measure_crossover`), with the policy requests get by default (adaptive K, or the
    default K when a fixed one was asked for) and the measured costs."""
    from specbuild.engines.embedded.calibrate import measure_crossover

    engine.update_calibration(calibration)
    adaptive = opts.get("adaptive_k")
    adaptive = opts["num_draft_tokens"] is None if adaptive is None else adaptive
    out = {}
    for proposer in (("draft",) if has_draft else ()) + ("ngram",):
        k = -1 if adaptive else (default_k if proposer == opts["proposer"] else min(4, opts["max_draft_len"]))
        if k == 0:
            continue
        out[proposer] = x = measure_crossover(engine, proposer=proposer, k=k,
                                              max_batch_size=opts["max_batch_size"], budget_s=30.0,
                                              progress=progress)
        load, cpus = x["load_avg"][0], x["cpu_count"] or 1
        if load is not None and load > cpus:
            calibration.setdefault("notes", []).append(
                f"the machine was busy while the {proposer} crossover was measured (load average {load:.1f} on "
                f"{cpus} cores): the cut-off reflects that load; re-run `specbuild build --force` on a quiet "
                f"machine, or set --spec-max-concurrency.")
    return out


def run(ctx: StageContext) -> StageResult:
    target_src, draft_src = _checkpoint_dirs(ctx)
    opts = {**ctx.options, "draft_kv": _draft_kv(ctx, target_src, draft_src)}
    if opts["proposer"] == "draft" and draft_src is None:
        raise UsageError(f"--proposer draft needs a draft checkpoint, but {ctx.upstream_dir} has none; "
                         "re-run `specbuild convert` with --draft, or build with --proposer ngram.")
    out = Path(ctx.out_dir)
    crossover = opts["calibrate"] and opts.get("crossover", True) and opts.get("spec_max_concurrency") is None
    steps = (["fused", "weights", "load", "smoke"] + (["calibrate"] if opts["calibrate"] else [])
             + (["crossover"] if crossover else []))
    bar = tqdm(total=len(steps), desc="build", unit="step", file=sys.stderr, leave=False)

    def step(msg: str) -> None:
        bar.update()
        bar.set_postfix_str(msg)
        ctx.progress(msg)

    try:
        if opts.get("decode_step", "auto") != "eager":
            from specbuild.engines.embedded import fused

            step("the fused decode step (compiled once per machine)")
            fused.build(progress=ctx.progress)
        step("writing the weights" + (f" (the draft {opts['draft_quantize']} weight-only)"
                                      if opts["draft_quantize"] else ""))
        outputs = _write_weights(opts, target_src, draft_src, out)
        has_draft = "draft" in outputs
        default_k = opts["num_draft_tokens"] if opts["num_draft_tokens"] is not None else min(4, opts["max_draft_len"])
        _engine_config(opts, has_draft=has_draft, policy=Policy(k=default_k, proposer=opts["proposer"],
                                                                source="build: smoke"), calibration=None).save(out)
        step("loading the engine from the build directory")
        from specbuild.engines.embedded import Engine
        engine = Engine.from_build_dir(out, device=opts["device"], threads=opts["threads"])
        step("smoke generation")
        checks = [_smoke(engine, has_draft=has_draft, proposer=opts["proposer"])]
        calibration = None
        if opts["calibrate"]:
            step("calibrating (step times, acceptance)")
            calibration, default_k, check = _calibrate(ctx, engine, opts, has_draft=has_draft, default_k=default_k,
                                                       step=step)
            checks.append(check)
        engine_cfg = _engine_config(opts, has_draft=has_draft, policy=_policy(opts, calibration, default_k),
                                    calibration=calibration)
        engine_cfg.save(out)
    finally:
        bar.close()
    d = engine_cfg.to_dict()
    outputs["engine"] = {**{k: d[k] for k in ("max_batch_size", "max_seq_len", "max_draft_len", "dtype", "device",
                                             "threads", "draft_quantize", "linear_kernel", "draft_kv",
                                             "draft_activations", "prefill_precision")},
                         "policy": d["policy"], "policy_described": engine_cfg.policy.describe(),
                         "decode_step": engine.decode_step}
    return StageResult(outputs=outputs, checks=checks, extra={"calibration": calibration} if calibration else {})


def _write_weights(opts: dict[str, Any], target_src: Path, draft_src: Path | None, out: Path) -> dict[str, Any]:
    """target/, draft/ (when the build drafts with it, quantized as asked) and tokenizer/ -> their outputs."""
    outputs = {"target": _write_target(target_src, out / "target", opts["dtype"])}
    if draft_src is not None and (opts["proposer"] == "draft" or opts["draft_quantize"] is not None):
        outputs["draft"] = _write_draft(draft_src, out / "draft", dtype=opts["dtype"], quantize=opts["draft_quantize"])
    (out / "tokenizer").mkdir()
    for name in TOKENIZER_FILES:
        if (target_src / name).is_file():
            shutil.copyfile(target_src / name, out / "tokenizer" / name)
    return outputs


def _calibrate(ctx: StageContext, engine, opts: dict[str, Any], *, has_draft: bool, default_k: int, step):
    """Step costs and acceptance (-> the default K) and, unless a cut-off was given, the crossover concurrency.
    -> (calibration, default K, the check recorded in the manifest)."""
    from specbuild.engines.embedded.calibrate import calibrate
    from specbuild.engines.embedded.step import decode_step_of
    from specbuild.engines.embedded.step import linear_kernel_of

    cal = calibrate(engine, engine.target, engine.draft, proposer=opts["proposer"],
                    max_draft_len=opts["max_draft_len"], progress=ctx.progress)
    calibration = cal.to_dict()
    calibration["linear_kernel"] = linear_kernel_of(engine.target)     # what the costs were measured on
    calibration["decode_step"] = decode_step_of(engine.target, engine.scorer.cache)
    if calibration["decode_step"] == "fused":
        from specbuild.engines.embedded.fused import kernels_id

        calibration["fused_kernels"] = kernels_id()
    calibration["draft_activations"] = engine.config.draft_activations
    if opts["num_draft_tokens"] is None:
        default_k = cal.recommended_k
    if opts.get("crossover", True) and opts.get("spec_max_concurrency") is None:
        step("calibrating the crossover concurrency (speculation vs plain decoding)")
        calibration["crossover"] = _crossover(engine, opts, has_draft=has_draft, default_k=default_k,
                                              calibration=calibration, progress=ctx.progress)
    check = {"name": "calibration", "ok": True, "alpha": cal.alpha, "cost_ratio": cal.cost_ratio,
             "recommended_k": cal.recommended_k, "predicted_speedup": cal.predicted_speedup[cal.recommended_k]}
    return calibration, default_k, check


def plan(ctx: StageContext) -> list[PlanStep]:
    target_src, draft_src = _checkpoint_dirs(ctx)
    opts = {**ctx.options, "draft_kv": _draft_kv(ctx, target_src, draft_src)}
    out = Path(ctx.out_dir)
    steps = [PlanStep("note", note=f"embedded build: weights in {opts['dtype']} on {opts['device']}")]
    for f in _weights(target_src):
        steps.append(PlanStep("write", path=str(out / "target" / f.name)))
    if draft_src is not None and (opts["proposer"] == "draft" or opts["draft_quantize"] is not None):
        if opts["draft_quantize"] == "int8":
            steps.append(PlanStep("note", note="quantize the draft's linear layers to int8 (per-output-channel)"))
            steps.append(PlanStep("write", path=str(out / "draft" / "model.int8.safetensors")))
        elif opts["draft_quantize"] == "int4":
            steps.append(PlanStep("note", note="quantize the draft's layers to Q4_1 blocks and its lm_head to Q8_0 "
                                               "(the GGUF layouts; a dequantized GGUF's own blocks are recovered "
                                               "exactly)"))
            steps.append(PlanStep("write", path=str(out / "draft" / "model.int4.safetensors")))
        else:
            steps += [PlanStep("write", path=str(out / "draft" / f.name)) for f in _weights(draft_src)]
    steps.append(PlanStep("write", path=str(out / "tokenizer")))
    has_draft = draft_src is not None and (opts["proposer"] == "draft" or opts["draft_quantize"] is not None)
    default_k = opts["num_draft_tokens"] if opts["num_draft_tokens"] is not None else min(4, opts["max_draft_len"])
    steps.append(PlanStep("note", note=f"smoke generation ({SMOKE_TOKENS} tokens, speculation on == off)"))
    if opts["calibrate"]:
        steps.append(PlanStep("note", note=f"calibrate: target/draft step times, verify times for K=1.."
                                           f"{opts['max_draft_len']}, acceptance on chat/code/summarization "
                                           "prompts -> default K"))
        if opts.get("crossover", True) and opts.get("spec_max_concurrency") is None:
            steps.append(PlanStep("note", note="calibrate the crossover: speculation vs plain decoding at rising "
                                               "concurrency -> the policy's max_concurrency (measured)"))
    # The policy this run writes: with a calibration, max_concurrency is what the crossover measures.
    policy = _policy(opts, {} if opts["calibrate"] else None, default_k)
    cut = ("off above the concurrency where the measured crossover says drafting stops paying"
           if opts["calibrate"] and opts.get("crossover", True) and opts.get("spec_max_concurrency") is None else None)
    steps.append(PlanStep("note", note="default policy: " + policy.describe(cut)))
    cfg = _engine_config(opts, has_draft=has_draft, policy=policy, calibration=None)
    steps.append(PlanStep("write", path=str(out / ENGINE_CONFIG_FILE), content=json.dumps(cfg.to_dict(), indent=2)))
    steps.append(PlanStep("write", path=str(out / "manifest.json")))
    return steps
