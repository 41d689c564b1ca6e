"""`specbuild deploy`: thin wrapper over `specbuild.pipeline.deploy.deploy`."""

from __future__ import annotations

import click

from specbuild.cli.options import (backend_option, dry_run_option, force_option, rehearse_option,
                                   trtllm_generation_option, workdir_option)
from specbuild.pipeline.deploy import deploy
from specbuild.core.errors import UsageError

# --flag -> (option key of engines/trtllm/settings.py, click type, help)
TRTLLM_OPTIONS = {
    "trtllm_version": (str, "TensorRT-LLM version (default: as built / installed)."),
    "container_tag": (str, "TensorRT-LLM Triton container tag (default: the pinned one for the version)."),
    "target_gpu_ids": (str, "GPU ids of the target, e.g. 0 or 1,2 (default: 0..tp*pp-1)."),
    "draft_gpu_ids": (str, "GPU ids of the draft (default: 0..draft_tp-1; sharing the target's GPU is fine)."),
    "kv_cache_free_gpu_mem_fraction": (float, "Target KV-cache fraction of free GPU memory "
                                              "(default 0.5 when both models share a GPU, else 0.9)."),
    "draft_kv_cache_free_gpu_mem_fraction": (float, "Draft KV-cache fraction (default 0.2 shared, else 0.9)."),
    "bls_instance_count": (int, "tensorrt_llm_bls instances (default: max batch size)."),
    "backend_models_dir": (str, "Where the container keeps upstream's Python models (default /app/all_models)."),
    "host": (str, "Address the launched server binds (default 127.0.0.1; 0.0.0.0 inside a container whose ports "
                  "you publish)."),
}


def _trtllm_options(f):
    for key, (typ, help_text) in reversed(list(TRTLLM_OPTIONS.items())):
        f = click.option(f"--{key.replace('_', '-')}", key, type=typ, default=None,
                         help=f"{help_text} (trtllm only)")(f)
    return click.option("--fast-logits", is_flag=True, default=False,
                        help="Speculative-decoding fast logits: draft logits passed by MPI, participant_ids "
                             "and world size set (trtllm engine path only).")(f)


@click.command("deploy")
@workdir_option
@backend_option
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None,
              help="Triton max_batch_size of the client-facing models. Default: 64 (embedded); the engines' "
                   "(trtllm: fixed at build).")
@click.option("--device", default=None,
              help="Where the embedded engine runs: cpu, cuda or cuda:N (embedded only). Default: as built.")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="torch CPU threads of the engine (0 = torch's default; embedded only).")
@click.option("--max-queue-size", type=click.IntRange(min=0), default=None,
              help="Requests that may wait for a batch slot before new ones get 503; 0 = no limit, as in "
                   "Triton (embedded only). Default: the build's, 4 x its max batch size.")
@click.option("--queue-timeout", type=click.FloatRange(min=0), default=None,
              help="Seconds a request may wait for a slot before it gets 503; 0 = no limit (embedded only). "
                   "Default: the build's, 300.")
@click.option("--request-timeout", type=click.FloatRange(min=0), default=None,
              help="Seconds a request may live (queue + generation) before it ends with 503: frees the slots of "
                   "clients that vanished unheard; 0 = no limit (embedded only). Default: the build's, 600.")
@_trtllm_options
@click.option("--kubernetes", is_flag=True, default=False,
              help="Also write WORKDIR/kubernetes/: Deployment (or LeaderWorkerSet across nodes), Service, "
                   "PodDisruptionBudget, NetworkPolicy, KEDA ScaledObject, relocated configs; see "
                   "docs/deploying-on-gpus.md#scale-out.")
@click.option("--image", default=None,
              help="Container image for --kubernetes (default for trtllm: the release container; required for "
                   "embedded: built from docker/embedded.Dockerfile; across nodes: docker/trtllm-multinode.Dockerfile).")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Replicas for --kubernetes (also the autoscaler's minimum).")
@click.option("--max-replicas", type=click.IntRange(min=1), default=4, show_default=True,
              help="The autoscaler's maximum replicas, for --kubernetes.")
@click.option("--artifacts", default="pvc:specbuild-work", show_default=True,
              help="Where the pods copy WORKDIR's engines/ and model_repository/ from, for --kubernetes: "
                   "pvc:CLAIM[/SUBDIR] or s3://BUCKET/PREFIX.")
@click.option("--artifacts-secret", default=None,
              help="Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_REGION) for --artifacts s3://... "
                   "(leave out with IAM roles for service accounts).")
@click.option("--namespace", default="default", show_default=True, help="Namespace of the --kubernetes manifests.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True,
              help="GPUs of one node, for --kubernetes: a trtllm deployment needing more becomes a LeaderWorkerSet.")
@click.option("--scale-at", type=click.IntRange(min=1), default=None,
              help="Requests in flight per replica at which the autoscaler adds one, for --kubernetes. Default: "
                   "--report's measured crossover, else the build's spec_max_concurrency.")
@click.option("--report", "loadtest_report", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A load-test report.json with a users sweep against a baseline: its crossover sets --scale-at.")
@click.option("--prometheus", default="http://prometheus-operated.monitoring.svc:9090", show_default=True,
              help="Prometheus the KEDA ScaledObject queries, for --kubernetes.")
@trtllm_generation_option
@rehearse_option
@dry_run_option
@force_option
def deploy_command(workdir, backend, max_batch_size, device, threads, max_queue_size, queue_timeout, request_timeout,
                   fast_logits, kubernetes, image, replicas, max_replicas, artifacts, artifacts_secret, namespace,
                   gpus_per_node, scale_at, loadtest_report, prometheus, trtllm_generation, rehearse, dry_run, force,
                   **trtllm):
    """Package WORKDIR/engines/ into a Triton model repository in WORKDIR/model_repository/.

    The client-facing models are `ensemble` and `tensorrt_llm_bls` (upstream names and
    tensors, see docs/serving.md); with the embedded backend the `tensorrt_llm` model starts the
    engine process, which batches the requests of all three models continuously. Re-running
    unchanged is a no-op.

    \b
    Example:
      specbuild deploy
      specbuild deploy --workdir /data/work --threads 8
      specbuild deploy --max-queue-size 64 --queue-timeout 30 --request-timeout 120
      specbuild deploy --dry-run
      specbuild deploy --backend trtllm --target-gpu-ids 0 --draft-gpu-ids 0 --fast-logits --dry-run
      specbuild deploy --backend trtllm --host 0.0.0.0        # inside a container: publish the ports
      specbuild deploy --backend trtllm --rehearse     # then: specbuild serve --rehearse --backend-models-dir DIR
      specbuild deploy --kubernetes --image registry.example.com/specbuild:0.1 --replicas 2
      specbuild deploy --kubernetes --image registry.example.com/specbuild:0.1 --artifacts s3://bucket/work
    """
    if kubernetes and backend == "embedded" and not image:
        raise UsageError("--kubernetes with the embedded backend needs --image: build docker/embedded.Dockerfile "
                         "(`docker build -f docker/embedded.Dockerfile -t REGISTRY/specbuild:TAG .`) and push it.")
    extra = {k: v for k, v in trtllm.items() if v is not None}
    if fast_logits:
        extra["fast_logits"] = True
    if trtllm_generation:
        extra["trtllm_generation"] = trtllm_generation
    if rehearse:
        extra["rehearse"] = True
    if force and backend == "trtllm":
        extra["force_version"] = True  # also accept a TensorRT-LLM version outside the version table
    if extra and backend != "trtllm":
        flags = ", ".join("--" + k.replace("_", "-") for k in extra)
        raise UsageError(f"{flags} apply to --backend trtllm only.")
    admission = {k: v for k, v in (("max_queue_size", max_queue_size), ("queue_timeout_s", queue_timeout),
                                   ("request_timeout_s", request_timeout)) if v is not None}
    if admission and backend != "embedded":
        raise UsageError("--max-queue-size, --queue-timeout and --request-timeout apply to --backend embedded only "
                         "(TensorRT-LLM's queue is configured by its own model config).")
    extra.update(admission)
    result = deploy(workdir=workdir, backend=backend, max_batch_size=max_batch_size, device=device,
                    threads=threads, force=force, dry_run=dry_run, extra_options=extra or None,
                    progress=lambda m: click.echo(m, err=True))
    if result.plan is not None:
        click.echo("\n".join(step.render() for step in result.plan))
        return
    state = "up to date (nothing to do)" if result.skipped else "deployed"
    click.echo(f"{state} in {result.seconds:.1f}s: {result.out_dir}")
    click.echo(f"  models: {', '.join(result.manifest.get('outputs', {}).get('models', []))}")
    if kubernetes:
        from specbuild.pipeline.kubernetes import write

        out = write(workdir, image=image, name="specbuild", artifacts=artifacts, artifacts_secret=artifacts_secret,
                    namespace=namespace, replicas=replicas, max_replicas=max_replicas, gpus_per_node=gpus_per_node,
                    report=loadtest_report, scale_at=scale_at, prometheus=prometheus)
        import json

        extra = json.loads((out / "manifest.json").read_text()).get("extra", {})
        click.echo(f"  kubernetes: {out}")
        click.echo(f"    autoscaling: a replica per {extra['autoscaling']['threshold']} requests in flight "
                   f"({extra['autoscaling']['source']})")
        click.echo(f"    first: {extra['admin_secret']}")
        click.echo(f"    then:  {extra['apply']}")
    if result.manifest.get("extra", {}).get("rehearsal"):
        click.echo(f"  next: specbuild serve --rehearse --backend-models-dir DIR --workdir {workdir}")
    else:
        click.echo(f"  next: specbuild serve --workdir {workdir}")
