"""`specbuild check` and `specbuild convert`: thin wrappers over `specbuild.pipeline.checks` and `specbuild.pipeline.convert`."""

from __future__ import annotations

import click

from specbuild.pipeline.checks import failures, format_table, run_checks
from specbuild.cli.options import (backend_option, dry_run_option, force_option, rehearse_option,
                                   trtllm_generation_option, workdir_option)
from specbuild.pipeline.convert import DTYPES, QUANTIZATIONS, convert
from specbuild.pipeline.sources import resolve

source_options = [
    click.option("--target", required=True, metavar="SRC",
                 help="Target model: HF directory, .gguf file, hub id org/name, or demo:smollm2-135m-instruct."),
    click.option("--draft", required=True, metavar="SRC",
                 help="Draft model (same tokenizer as the target), in the same forms as --target."),
    click.option("--allow-pickle", is_flag=True, default=False,
                 help="Accept pickle weights (*.bin, *.pt); loading pickle can run code. Off by default."),
    click.option("--trust-remote-code", is_flag=True, default=False,
                 help="Accept configs that declare custom code (auto_map). Off by default."),
]


def _sources(fn):
    for opt in reversed(source_options):
        fn = opt(fn)
    return fn


def _stderr(msg: str) -> None:
    click.echo(msg, err=True)


@click.command("check")
@_sources
@backend_option
@force_option
def check_command(target, draft, allow_pickle, trust_remote_code, backend, force):
    """Run the pre-flight checks on a target/draft pair and print them as a table.

    Exits 0 when every check passes or warns, 1 when any fails. Nothing is written
    (GGUF and demo sources are converted once into the cache, $SPECBUILD_CACHE).

    \b
    Example:
      specbuild check --target demo:smollm2-135m-instruct --draft ./my-draft
      specbuild check --target ./llama-8b --draft ./llama-1b --backend trtllm
    """
    src_t = resolve(target, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, progress=_stderr)
    src_d = resolve(draft, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, progress=_stderr)
    results = run_checks(src_t.path, src_d.path, backend=backend, force=force)
    click.echo(format_table(results))
    if failures(results):
        raise click.exceptions.Exit(1)


@click.command("convert")
@_sources
@workdir_option
@backend_option
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
              help="Weight dtype of the converted checkpoints (float32 is the right choice on CPU; with "
                   "--backend trtllm the default is float16).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel size (trtllm only; embedded needs 1).")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Pipeline-parallel size (trtllm only; embedded needs 1).")
@click.option("--quantization", type=click.Choice(QUANTIZATIONS), default=None,
              help="Weight quantization (trtllm only). Default: none.")
@click.option("--trtllm-version", default=None, metavar="VERSION",
              help="TensorRT-LLM version to target (trtllm only). Default: the installed one, else 1.2.1.")
@trtllm_generation_option
@rehearse_option
@dry_run_option
@force_option
def convert_command(target, draft, allow_pickle, trust_remote_code, workdir, backend, dtype, tp, pp, quantization,
                    trtllm_version, trtllm_generation, rehearse, dry_run, force):
    """Check a target/draft pair and write normalized checkpoints to WORKDIR/checkpoints/.

    Refuses (exit 1) when a pre-flight check fails. Re-running with the same inputs
    and options is a no-op; a changed input or option redoes the stage.

    \b
    Example:
      specbuild convert --target demo:smollm2-135m-instruct --draft ./my-draft
      specbuild convert --target ./qwen2-7b --draft ./qwen2-0.5b --dtype bfloat16 --workdir /data/work
      specbuild convert --target ./llama-8b --draft ./llama-1b --backend trtllm --tp 2 --dry-run
      specbuild convert --target ./llama-8b --draft ./llama-1b --backend trtllm --trtllm-generation engine --rehearse
    """
    if backend == "trtllm" and click.get_current_context().get_parameter_source("dtype") is \
            click.core.ParameterSource.DEFAULT:
        dtype = "float16"  # the trtllm default (upstream's DTM recipe); float32 is the embedded CPU default
    result = convert(target, draft, workdir=workdir, backend=backend, dtype=dtype, tp=tp, pp=pp, force=force,
                     allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, dry_run=dry_run,
                     trtllm_version=trtllm_version, quantization=quantization, trtllm_generation=trtllm_generation,
                     rehearse=rehearse, progress=_stderr)
    for c in result.checks:
        if c.status == "warn":
            _stderr(f"warning: {c.name}: {c.message}")
    if result.plan is not None:
        click.echo("\n".join(step.render() for step in result.plan))
        return
    state = "up to date (nothing to do)" if result.skipped else "converted"
    click.echo(f"{state} in {result.seconds:.1f}s: {result.out_dir}")
    if backend == "trtllm":
        extra = result.manifest.get("extra", {})
        recipe = extra.get("recipe", {})
        click.echo(f"  TensorRT-LLM {recipe.get('trtllm_version')} ({recipe.get('generation')} path)"
                   + (": a rehearsal (plan recorded in rehearsal_plan.json, Hugging Face checkpoints kept in hf/); "
                      "next: specbuild build --backend trtllm --rehearse" if extra.get("rehearsal") else ""))
        return
    for role in ("target", "draft"):
        out = result.manifest.get("outputs", {}).get(role, {})
        resized = out.get("vocab_resized")
        note = f", vocab resized {resized['from']}->{resized['to']}" if resized else ""
        click.echo(f"  {role}: {result.out_dir / role} ({out.get('architecture')}, {out.get('params', 0) / 1e6:.1f}M "
                   f"params, {out.get('dtype')}{note})")
