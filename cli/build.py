"""`specbuild build`: a thin wrapper over `specbuild.pipeline.build.build`."""

from __future__ import annotations

import click

from specbuild.pipeline.build import DRAFT_ACTIVATIONS, DRAFT_QUANTIZATIONS, DTYPES, PREFILL_PRECISIONS, PROPOSERS, build
from specbuild.cli.options import (backend_option, dry_run_option, force_option, rehearse_option,
                                   trtllm_generation_option, workdir_option)


def _stderr(msg: str) -> None:
    click.echo(msg, err=True)


@click.command("build")
@workdir_option
@backend_option
@click.option("--max-batch-size", type=int, default=8, show_default=True,
              help="Most sequences decoded at once (KV-cache slots).")
@click.option("--max-seq-len", type=int, default=1024, show_default=True,
              help="Most tokens per sequence, prompt + output.")
@click.option("--max-draft-len", type=int, default=8, show_default=True,
              help="Largest K (draft tokens per step) a request may ask for.")
@click.option("--num-draft-tokens", type=int, default=None,
              help="Default K for requests that do not set one (0 = speculation off). Default: the calibrated K.")
@click.option("--proposer", type=click.Choice(PROPOSERS), default="draft", show_default=True,
              help="Default proposer: the draft model, or n-gram prompt lookup (no model).")
@click.option("--draft-quantize", type=click.Choice(DRAFT_QUANTIZATIONS), default=None,
              help="Store the draft weight-only quantized: int8 (per channel, torch's int8 kernel) or int4 (Q4_1 "
                   "blocks, lm_head Q8_0: the GGUF layouts, on the fused step's kernels; a dequantized GGUF's own "
                   "blocks are recovered exactly). Default: none (draft dtype = --dtype).")
@click.option("--draft-activations", type=click.Choice(DRAFT_ACTIVATIONS), default=None,
              help="Activations of an int4 draft: int8 (rounded per block of 32, integer kernels: about a third "
                   "cheaper a step, acceptance a little lower) or fp32 (the target's exact arithmetic on the "
                   "draft's weights). Output is the target's either way. Default: int8 for an int4 draft.")
@click.option("--prefill-precision", type=click.Choice(PREFILL_PRECISIONS), default=None,
              help="The target's prompt rows (embedded): fp32, or bf16 (products of bf16-rounded inputs and "
                   "weights, fp32 sums, on AVX-512 BF16: a prompt prefills 1.5-1.7x faster on an AMD EPYC Zen 4). "
                   "Speculation stays lossless against the same engine without it; the output is no longer the "
                   "fp32 model's exactly. Refused on a CPU without AVX-512 BF16. Default: fp32.")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
              help="Runtime dtype of the weights (float32 is right on CPU).")
@click.option("--device", default="cpu", show_default=True, help="Device the engine runs on: cpu, cuda or cuda:N.")
@click.option("--threads", type=int, default=None, help="CPU threads for torch. Default: torch's default.")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="Measure step times and acceptance and pick the default K (embedded).")
@click.option("--trtllm-version", default=None, metavar="VERSION",
              help="TensorRT-LLM version to target (trtllm only). Default: the installed one.")
@click.option("--max-input-len", type=int, default=None, help="Longest prompt (trtllm only). Default: 2048.")
@click.option("--max-num-tokens", type=int, default=None,
              help="Tokens per engine step across the batch (trtllm only). Default: 8192.")
@click.option("--use-draft-logits", is_flag=True, default=False,
              help="Build the draft with --gather_generation_logits for sampling-based acceptance (trtllm only).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel size (trtllm only).")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Pipeline-parallel size (trtllm only).")
@click.option("--container-tag", default=None, help="TensorRT-LLM Triton container tag (trtllm only).")
@click.option("--adaptive-k/--fixed-k", default=None,
              help="Requests without num_draft_tokens get adaptive K: each sequence picks K each step from its "
                   "own acceptance and the calibrated costs (requests may also send -1); --fixed-k: the default "
                   "K. Default: adaptive when calibrated without --num-draft-tokens (embedded only).")
@click.option("--spec-max-concurrency", type=click.IntRange(min=1), default=None,
              help="Draft only while at most this many sequences run (like TensorRT-LLM's max_concurrency). "
                   "Default: the crossover build measures (embedded; always draft without calibration).")
@click.option("--crossover/--no-crossover", default=True, show_default=True,
              help="Measure where speculation stops paying (speedup vs plain decoding at rising concurrency, "
                   "a few seconds) and make it the default --spec-max-concurrency (embedded, with calibration).")
@trtllm_generation_option
@rehearse_option
@dry_run_option
@force_option
def build_command(workdir, backend, max_batch_size, max_seq_len, max_draft_len, num_draft_tokens, proposer,
                  draft_quantize, dtype, device, threads, calibrate, trtllm_version, max_input_len, max_num_tokens,
                  use_draft_logits, tp, pp, container_tag, adaptive_k, spec_max_concurrency, crossover,
                  trtllm_generation, rehearse, dry_run, force, draft_activations, prefill_precision):
    """Build WORKDIR/engines/ from the converted checkpoints in WORKDIR/checkpoints/.

    The embedded backend writes the engine directory, runs a smoke generation
    (speculative output must equal target-only output) and calibrates: step times,
    acceptance on built-in prompts, and the K with the best predicted speedup, which
    becomes the default K. Re-running with unchanged inputs is a no-op.

    \b
    Example:
      specbuild convert --target demo:smollm2-135m-instruct --draft demo:smollm2-135m-instruct
      specbuild build --draft-quantize int4          # the demo self-draft: the target's own 4-bit blocks
      specbuild build --proposer ngram --max-batch-size 4 --force
      specbuild build --draft-quantize int4 --adaptive-k --spec-max-concurrency 3
      specbuild build --backend trtllm --max-draft-len 4 --dry-run
      specbuild build --backend trtllm --rehearse
    """
    if backend == "trtllm":  # flags left at their (embedded) defaults: what convert recorded, else trtllm's defaults
        from specbuild.engines.trtllm.common import cli_defaults
        ctx, fallback = click.get_current_context(), cli_defaults(workdir, "build")
        unset = {k for k in fallback if ctx.get_parameter_source(k) is click.core.ParameterSource.DEFAULT}
        dtype, tp, pp = (fallback[k] if k in unset else v for k, v in (("dtype", dtype), ("tp", tp), ("pp", pp)))
        max_seq_len, max_batch_size, max_draft_len = (fallback[k] if k in unset else v for k, v in (
            ("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size), ("max_draft_len", max_draft_len)))
    result = build(workdir=workdir, backend=backend, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                   max_draft_len=max_draft_len, dtype=dtype, device=device, threads=threads,
                   draft_quantize=draft_quantize, calibrate=calibrate, proposer=proposer,
                   num_draft_tokens=num_draft_tokens, force=force, dry_run=dry_run, trtllm_version=trtllm_version,
                   max_input_len=max_input_len, max_num_tokens=max_num_tokens, use_draft_logits=use_draft_logits,
                   tp=tp, pp=pp, container_tag=container_tag, adaptive_k=adaptive_k,
                   spec_max_concurrency=spec_max_concurrency, crossover=crossover,
                   trtllm_generation=trtllm_generation, rehearse=rehearse, draft_activations=draft_activations,
                   prefill_precision=prefill_precision, progress=_stderr)
    if result.plan is not None:
        click.echo("\n".join(step.render() for step in result.plan))
        return
    state = "up to date (nothing to do)" if result.skipped else "built"
    click.echo(f"{state} in {result.seconds:.1f}s: {result.out_dir}")
    cal = result.calibration
    if cal:
        k = cal["recommended_k"]
        click.echo(f"  calibration ({cal['proposer']}): alpha={cal['alpha']:.2f} c={cal['cost_ratio']:.2f} "
                   f"t_target={cal['t_target_s'] * 1e3:.1f}ms t_draft={cal['t_draft_s'] * 1e3:.1f}ms "
                   f"-> K={k} (predicted {cal['predicted_speedup'][str(k)]:.2f}x)")
        for prop, x in (cal.get("crossover") or {}).items():
            curve = ", ".join(f"{s:.2f}x@{b}" for b, s in x["speedup_by_batch"].items())
            smc = x["spec_max_concurrency"]
            cut = ("draft at any concurrency" if smc is None else "never draft" if smc == 0
                   else f"draft while <= {smc} sequences run")
            click.echo(f"  crossover ({prop}, K={x['k']}): {curve} -> {cut} ({x['seconds']:.1f}s)")
        for note in cal.get("notes", []):
            _stderr(f"note: {note}")
    eng = result.manifest.get("outputs", {}).get("engine") or {}
    if "policy_described" in eng:
        click.echo(f"  default policy: {eng['policy_described']} ({eng['policy']['source']})")
