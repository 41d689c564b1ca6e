"""`specbuild serve`, `stop` and `status`: thin wrappers over `specbuild.pipeline.serve`."""

from __future__ import annotations

import json

import click

from specbuild.pipeline import serve as lib
from specbuild.cli.options import workdir_option


def _say(msg: str) -> None:
    click.echo(msg, err=True)


@click.command("serve")
@workdir_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind HTTP, gRPC and metrics to. Anything but loopback is refused unless "
                   "--allow-remote is given (inference is not authenticated; see docs/serving.md).")
@click.option("--allow-remote", is_flag=True, default=False,
              help="Allow a non-loopback --host. Put a proxy with a body-size limit and a Host check in front "
                   "(docs/serving.md): the bundled tritonserver 2.51 has published HTTP vulnerabilities.")
@click.option("--http-port", type=int, default=8000, show_default=True, help="HTTP (KServe v2) port.")
@click.option("--grpc-port", type=int, default=8001, show_default=True, help="gRPC port.")
@click.option("--metrics-port", type=int, default=8002, show_default=True, help="Prometheus /metrics port.")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for /v2/health/ready before giving up (the log tail is shown).")
@click.option("--background", is_flag=True, default=False,
              help="Return once the server is ready and leave it running; stop it with `specbuild stop`.")
@click.option("--tritonserver", "binary", default=None, metavar="PATH",
              help="tritonserver binary. Default: `tritonserver` on PATH, else the nvidia-pytriton wheel's.")
@click.option("--log-verbose", type=click.IntRange(min=0), default=0, show_default=True,
              help="tritonserver --log-verbose level (log in WORKDIR/server/tritonserver.log).")
@click.option("--rehearse", is_flag=True, default=False,
              help="Rehearse a `deploy --backend trtllm` repository on the CPU tritonserver: upstream's own "
                   "preprocessing/postprocessing/tensorrt_llm_bls from --backend-models-dir, and a stand-in for "
                   "the C++ tensorrt_llm models (see docs/deploying-on-gpus.md).")
@click.option("--backend-models-dir", default=None, metavar="DIR",
              help="With --rehearse: a tensorrtllm_backend checkout of the deployed release tag, its "
                   "all_models/inflight_batcher_llm, or a container's /app/all_models.")
def serve_command(workdir, host, allow_remote, http_port, grpc_port, metrics_port, timeout, background, binary,
                  log_verbose, rehearse, backend_models_dir):
    """Serve WORKDIR/model_repository/ with a real Triton Inference Server.

    Runs in the foreground until Ctrl-C (then stops cleanly), or with --background returns
    once ready. pid and log: WORKDIR/server/. The admin APIs (model config, repository, statistics, trace,
    logging, shared memory) answer only requests with the per-server token header that
    WORKDIR/server/server.json records (mode 0600); health, metadata and inference stay open.

    \b
    Example:
      specbuild serve
      specbuild serve --background --http-port 18000 --grpc-port 18001 --metrics-port 18002
      specbuild serve --host 0.0.0.0 --allow-remote   # reachable from other machines: proxy in front
      specbuild serve --rehearse --backend-models-dir ./tensorrtllm_backend --background
    """
    opts = lib.ServeOptions(host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                            timeout=timeout, tritonserver=binary, log_verbose=log_verbose, allow_remote=allow_remote)
    if backend_models_dir and not rehearse:
        raise click.UsageError("--backend-models-dir applies to --rehearse only.")
    if rehearse:
        from specbuild.pipeline import rehearse as reh
        start = lambda: reh.start(workdir, opts, backend_models_dir=backend_models_dir, progress=_say)  # noqa: E731
        foreground = lambda: reh.serve_foreground(workdir, opts, backend_models_dir=backend_models_dir,  # noqa: E731
                                                  progress=_say)
    else:
        start = lambda: lib.start(workdir, opts, progress=_say)  # noqa: E731
        foreground = lambda: lib.serve_foreground(workdir, opts, progress=_say)  # noqa: E731
    if background:
        info = start()
        click.echo(f"serving (pid {info.pid}): HTTP {info.http_url}  gRPC {info.grpc_url}  "
                   f"metrics {info.metrics_url}\n  log: {info.log_file}\n  stop: specbuild stop --workdir {workdir}")
        return
    _say("Ctrl-C stops the server.")
    foreground()
    click.echo("server stopped.")


@click.command("stop")
@workdir_option
@click.option("--timeout", type=float, default=30.0, show_default=True,
              help="Seconds to wait after SIGTERM before SIGKILL.")
def stop_command(workdir, timeout):
    """Stop the server started from WORKDIR (SIGTERM, then SIGKILL after --timeout).

    Signals only a process proven to be that server (the recorded pid with its recorded start time and
    instance mark); a recorded pid that now belongs to another process is left alone (exit code 1).

    \b
    Example:
      specbuild stop
      specbuild stop --workdir /data/work --timeout 10
    """
    info = lib.stop(workdir, timeout=timeout)
    click.echo("no server running." if info is None else f"stopped (pid {info.pid}); ports freed.")


@click.command("status")
@workdir_option
@click.option("--json", "as_json", is_flag=True, default=False, help="Print the status as JSON.")
def status_command(workdir, as_json):
    """Show whether the server of WORKDIR runs, is ready, and its URLs and models.

    Exit code 0 when running and ready, 1 otherwise.

    \b
    Example:
      specbuild status
      specbuild status --json
    """
    st = lib.status(workdir)
    if as_json:
        click.echo(json.dumps(st, indent=2))
    elif not st["running"]:
        click.echo("not running" + (f" (a stale server record is left in {workdir}/server/; `specbuild stop` removes it)"
                                    if st.get("stale_state") else ""))
    else:
        click.echo(f"running (pid {st['pid']}), {'ready' if st['ready'] else 'NOT ready'}\n"
                   f"  HTTP {st['http']}  gRPC {st['grpc']}  metrics {st['metrics']}\n  log: {st['log']}")
        for name, state in sorted(st.get("models", {}).items()):
            click.echo(f"  model {name}: {state}")
    if not (st["running"] and st.get("ready")):
        raise click.exceptions.Exit(1)
