"""`specbuild deploy`: thin wrapper over `specbuild.deploy.deploy`."""

from __future__ import annotations

import click

from specbuild.cli.options import backend_option, dry_run_option, force_option, workdir_option
from specbuild.deploy import deploy


@click.command("deploy")
@workdir_option
@backend_option
@click.option("--max-batch-size", type=click.IntRange(min=1), default=64, show_default=True,
              help="Triton max_batch_size of the client-facing models.")
@click.option("--device", default=None,
              help="Where the embedded engine runs: cpu, cuda or cuda:N (embedded only). Default: as built.")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="torch CPU threads of the engine (0 = torch's default; embedded only).")
@dry_run_option
@force_option
def deploy_command(workdir, backend, max_batch_size, device, threads, dry_run, force):
    """Package WORKDIR/engines/ into a Triton model repository in WORKDIR/model_repository/.

    The client-facing models are `ensemble` and `tensorrt_llm_bls` (upstream names and
    tensors, see docs/serving.md); with the embedded backend one `tensorrt_llm` model holds the
    engine and batches all requests continuously. Re-running unchanged is a no-op.

    \b
    Example:
      specbuild deploy
      specbuild deploy --workdir /data/work --threads 8
      specbuild deploy --dry-run
    """
    result = deploy(workdir=workdir, backend=backend, max_batch_size=max_batch_size, device=device,
                    threads=threads, force=force, dry_run=dry_run,
                    progress=lambda m: click.echo(m, err=True))
    if result.plan is not None:
        click.echo("\n".join(step.render() for step in result.plan))
        return
    state = "up to date (nothing to do)" if result.skipped else "deployed"
    click.echo(f"{state} in {result.seconds:.1f}s: {result.out_dir}")
    click.echo(f"  models: {', '.join(result.manifest.get('outputs', {}).get('models', []))}")
    click.echo(f"  next: specbuild serve --workdir {workdir}")
