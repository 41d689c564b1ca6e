"""Kubernetes manifests for a deployed repository (`specbuild deploy --kubernetes`), written atomically to
`<workdir>/kubernetes/` next to (never inside) the model repository.

- **Artefacts travel**: an init container copies the workdir's `engines/` and `model_repository/` from a volume
  (`--artifacts pvc:CLAIM[/SUBDIR]`) or an object store (`--artifacts s3://BUCKET/PREFIX`) into one emptyDir mounted
  at `/specbuild`, then lays the relocated configs over them: every text file of the deployment that names this
  workdir's absolute path is rendered again with `/specbuild/work` in its place (a ConfigMap), so no config in the
  pod names a path of the build machine.
- **Secure pods**: non-root, read-only root filesystem (emptyDirs for /tmp, the cache and /dev/shm), no privilege
  escalation, all capabilities dropped, RuntimeDefault seccomp; a NetworkPolicy (8000/8001 from pods labelled
  `specbuild/client=true`, 8002 from the monitoring namespace); Triton's admin APIs behind a header whose value is in
  the Secret `<name>-admin` (`kubectl create secret generic <name>-admin --from-literal=key=...`).
- **Production shape**: requests = limits, startup/readiness/liveness probes on `/v2/health/{ready,live}`,
  Prometheus scrape annotations (:8002/metrics), a PodDisruptionBudget, anti-affinity across nodes.
- **Autoscaling**: a KEDA ScaledObject on the requests in flight per replica (embedded: `specbuild_live_requests`;
  trtllm: `nv_trt_llm_request_metrics{request_type="active"}` + Triton's `nv_inference_pending_request_count`), the
  threshold at the measured crossover (`--report`'s sweep, else the build's `spec_max_concurrency`): beyond it
  speculation stops paying, so that is where a replica is added. `alternatives/hpa.yaml`: the same on an HPA.
- **GPUs**: a TensorRT-LLM pod asks for the GPUs of its layout (tp x pp of target and draft); one larger than a node
  (`--gpus-per-node`, default 8) is a LeaderWorkerSet whose leader starts every rank with mpirun over `kubectl exec`
  (see `k8s_multinode.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specbuild.core.errors import UsageError
from specbuild.core.manifest import Manifest, read_manifest, stage_output, write_manifest
from specbuild.pipeline import k8s_objects as k
from specbuild.pipeline.k8s_objects import MOUNT, PORTS, WORK, pod_argv

CLIENT_LABEL = ("specbuild/client", "true")
MONITORING = ("kubernetes.io/metadata.name", "monitoring")
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
_TEXT_MAX = 512 * 1024          # larger files are weights/engines: never relocated, never read
_CONFIGMAP_MAX = 900 * 1024     # a ConfigMap holds at most 1 MiB


def relocate(workdir: Path) -> dict[str, str]:
    """{path relative to the workdir: content with the workdir replaced by WORK} of every small text file of
    engines/ and model_repository/ that names the workdir's absolute path."""
    old = str(workdir.resolve())
    out: dict[str, str] = {}
    for top in ("engines", "model_repository"):
        root = workdir / top
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if not path.is_file() or path.is_symlink() or path.stat().st_size > _TEXT_MAX or \
                    "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            if old in text:
                out[str(path.relative_to(workdir))] = text.replace(old, WORK)
    return out


def _overlay_key(rel: str) -> str:
    return rel.replace("/", "__")


def _outside(options: dict[str, Any], workdir: Path) -> list[str]:
    """Checkpoints the rendered configs read from outside the workdir (the LLM-API path reads the HF directory)."""
    bad = []
    for key in ("target_dir", "draft_dir"):
        value = options.get(key)
        if value and not Path(value).resolve().is_relative_to(workdir.resolve()):
            bad.append(str(Path(value).resolve()))
    return bad


def _copied_dirs(workdir: Path, layout: dict[str, Any] | None) -> tuple[str, ...]:
    """The workdir's top-level directories the pod needs: the repository, the engines, an LLM-API checkpoint."""
    dirs = [d for d in ("engines", "model_repository") if (workdir / d).is_dir()] or ["model_repository"]
    for key in ("target_dir", "draft_dir"):
        value = ((layout or {}).get("options") or {}).get(key)
        if value and Path(value).resolve().is_relative_to(workdir):
            top = Path(value).resolve().relative_to(workdir).parts[0]
            if top not in dirs:
                dirs.append(top)
    return tuple(dirs)


def scale_threshold(workdir: Path, report: Path | None, scale_at: int | None, fallback: int) -> tuple[int, str]:
    """Requests in flight per replica at which to add one, and where that number comes from."""
    if scale_at is not None:
        return scale_at, "--scale-at"
    if report is not None:
        try:
            data = json.loads(Path(report).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--report {report}: not a readable load-test report.json ({e}).") from None
        values = [c["crossover"]["value"] for c in data.get("curves") or []
                  if c.get("param") in ("users", "concurrency") and (c.get("crossover") or {}).get("value")]
        if not values:
            raise UsageError(f"--report {report} has no measured crossover over users (a sweep whose first setting "
                             "is the baseline: `specbuild loadtest --sweep users=1,2,4,8 --setting off:num_draft_tokens=0 "
                             "--setting policy:default`); pass --scale-at N.")
        return max(1, int(min(values))), f"{report}: the load test's crossover"
    cfg = workdir / "engines" / "engine_config.json"
    data = {}
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
        except ValueError:
            data = {}
        smc = (data.get("policy") or {}).get("max_concurrency")
        if smc:
            return int(smc), f"{cfg}: the build's measured spec_max_concurrency"
    batch = int(data.get("max_batch_size") or fallback)
    return batch, f"no measured crossover: the max batch size {batch} (pass --report or --scale-at)"


def _trtllm_layout(deployed: dict[str, Any], workdir: Path) -> dict[str, Any]:
    from specbuild.engines.trtllm.settings import settings_from

    options = dict(deployed.get("extra", {}).get("trtllm_options") or deployed.get("options") or {})
    s = settings_from({**options, "force_version": True})
    launch_path = workdir / "model_repository" / "launch.json"
    launch = json.loads(launch_path.read_text()) if launch_path.is_file() else None
    return {"settings": s, "gpus": max(s.num_gpus, s.target_world), "launch": launch, "options": options, "workdir": workdir}


def _server_container(*, image: str, command: list[str], env: list[dict], gpus: int, cpu: str, memory: str,
                      startup_failures: int) -> dict[str, Any]:
    res: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        res["nvidia.com/gpu"] = gpus
    admin = {"name": k.ADMIN_ENV, "valueFrom": {"secretKeyRef": {"name": "", "key": "key"}}}   # name: render()
    return {"name": "tritonserver", "image": image, "command": command,
            "env": [admin, *k.CACHE_ENV, *env],
            "ports": [{"name": n, "containerPort": p} for n, p in PORTS.items()],
            **k.probes(startup_failures), "resources": {"requests": dict(res), "limits": dict(res)},
            "volumeMounts": k.scratch_mounts(), "securityContext": k.container_security()}


def embedded_command() -> list[str]:
    return ["tritonserver", f"--model-repository={WORK}/model_repository", "--http-address=0.0.0.0",
            "--grpc-address=0.0.0.0", "--metrics-address=0.0.0.0", f"--http-port={PORTS['http']}",
            f"--grpc-port={PORTS['grpc']}", f"--metrics-port={PORTS['metrics']}", "--allow-metrics=true",
            "--exit-timeout-secs=30", *k.restricted_flags()]


def render(*, name: str, backend: str, image: str, workdir: Path, artifacts: str = "pvc:specbuild-work",
           artifacts_secret: str | None = None, namespace: str = "default", replicas: int = 1,
           max_replicas: int = 4, gpus: int | None = None, gpus_per_node: int = 8, cpu: str | None = None,
           memory: str | None = None, deployed: dict[str, Any] | None = None, report: Path | None = None,
           scale_at: int | None = None, prometheus: str = PROMETHEUS) -> dict[str, Any]:
    """{filename: manifest dict} of the whole deployment (`alternatives/...` files are not applied by
    `kubectl apply -f <dir>`)."""
    workdir = Path(workdir).resolve()
    deployed = deployed or {}
    if not (artifacts.startswith("pvc:") and len(artifacts) > 4) and not artifacts.startswith("s3://"):
        raise UsageError(f"--artifacts {artifacts!r}: give pvc:CLAIM[/SUBDIR] (a volume holding the workdir's "
                         "engines/ and model_repository/) or s3://BUCKET/PREFIX (the same, synced to S3).")
    lab = k.labels(name, backend)
    selector = k.selector(name)
    overlay = relocate(workdir)
    if sum(len(t.encode()) for t in overlay.values()) > _CONFIGMAP_MAX:
        raise UsageError("the relocated configs exceed a ConfigMap's 1 MiB; render with fewer models per workdir.")
    docs: dict[str, Any] = {}
    env: list[dict] = []
    layout = None
    if backend == "trtllm":
        layout = _trtllm_layout(deployed, workdir)
        outside = _outside(layout["options"], workdir)
        if outside and (layout["launch"] or {}).get("triton_argv") is not None:
            raise UsageError(f"the deployment reads {', '.join(outside)} from outside {workdir}; the pod gets only "
                             "the workdir's copy. Put the checkpoint under the workdir and deploy again.")
        gpus = gpus or layout["gpus"]
        launch = layout["launch"]
        if launch is None:
            raise UsageError(f"{workdir / 'model_repository' / 'launch.json'} is missing; run `specbuild deploy "
                             "--backend trtllm` (not a rehearsal) first.")
        argv = launch.get("triton_argv") or launch["argv"]
        command = pod_argv(argv, workdir)
        env = [{"name": key, "value": str(v)} for key, v in (launch.get("env") or {}).items()]
        cpu, memory = cpu or "8", memory or "64Gi"
        fallback = layout["settings"].max_batch_size
    else:
        gpus = 0
        command = embedded_command()
        cpu, memory = cpu or "4", memory or "16Gi"
        fallback = int((deployed.get("options") or {}).get("max_batch_size") or 64)
    per_replica, source = scale_threshold(workdir, report, scale_at, fallback)
    container = _server_container(image=image, command=command, env=env, gpus=gpus, cpu=cpu, memory=memory,
                                  startup_failures=180 if backend == "trtllm" else 90)
    container["env"][0]["valueFrom"]["secretKeyRef"]["name"] = f"{name}-admin"
    init, init_volumes = k.fetch_init_container(artifacts, {_overlay_key(r): r for r in overlay}, artifacts_secret,
                                                dirs=_copied_dirs(workdir, layout))
    for v in init_volumes:
        if v["name"] == "overlay":
            v["configMap"]["name"] = f"{name}-relocated"
    pod_spec = {"automountServiceAccountToken": False, "securityContext": k.pod_security(),
                "terminationGracePeriodSeconds": 60, "initContainers": [init], "containers": [container],
                "volumes": [*k.scratch_volumes("8Gi" if backend == "trtllm" else "2Gi"), *init_volumes],
                "affinity": k.anti_affinity(selector, required=bool(gpus))}
    template = {"metadata": {"labels": lab, "annotations": k.scrape_annotations()}, "spec": pod_spec}
    multinode = backend == "trtllm" and gpus > gpus_per_node
    if overlay:
        docs["configmap.yaml"] = {"apiVersion": "v1", "kind": "ConfigMap",
                                  "metadata": k.meta(f"{name}-relocated", lab, namespace),
                                  "data": {_overlay_key(r): t for r, t in overlay.items()}}
    if multinode:
        from specbuild.pipeline.k8s_multinode import leader_worker_set
        docs.update(leader_worker_set(name=name, namespace=namespace, lab=lab, selector=selector,
                                      template=template, layout=layout, gpus=gpus, gpus_per_node=gpus_per_node,
                                      replicas=replicas))
        target = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": name}
    else:
        docs["deployment.yaml"] = {"apiVersion": "apps/v1", "kind": "Deployment",
                                   "metadata": k.meta(name, lab, namespace),
                                   "spec": {"replicas": replicas, "selector": {"matchLabels": selector},
                                            "strategy": {"type": "RollingUpdate",
                                                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                                            "template": template}}
        target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    docs["service.yaml"] = k.service(name, lab, {**selector, **({"leaderworkerset.sigs.k8s.io/worker-index": "0"}
                                                                if multinode else {})}, namespace)
    docs["pdb.yaml"] = k.pdb(name, lab, selector, namespace, replicas)
    docs["networkpolicy.yaml"] = k.network_policy(name, lab, selector, namespace, client_label=CLIENT_LABEL,
                                                  monitoring=MONITORING, group_ports=[] if multinode else None)
    where = f'namespace="{namespace}",pod=~"{name}-.*"'
    if backend == "trtllm":
        # each side `or vector(0)`: a family with no series yet must not blank the sum
        demand = (f'(sum(nv_trt_llm_request_metrics{{{where},model="tensorrt_llm",request_type="active"}}) '
                  f'or vector(0)) + (sum(nv_inference_pending_request_count{{{where},'
                  f'model=~"ensemble|tensorrt_llm_bls"}}) or vector(0))')
        metric = "nv_trt_llm_request_metrics"
    else:
        demand = f"sum(specbuild_live_requests{{{where}}}) or vector(0)"
        metric = "specbuild_live_requests"
    docs["scaledobject.yaml"] = k.scaled_object(name, lab, namespace, target=target, prometheus=prometheus,
                                                queries=[("requests-in-flight", demand, str(per_replica))],
                                                min_replicas=replicas, max_replicas=max(max_replicas, replicas))
    docs["scaledobject.yaml"]["metadata"]["annotations"] = {"specbuild/threshold-source": source}
    docs["alternatives/hpa.yaml"] = k.hpa(name, lab, namespace, target=target, metric=metric, per_pod=per_replica,
                                          min_replicas=replicas, max_replicas=max(max_replicas, replicas))
    return docs


def _deployed(workdir: Path) -> dict[str, Any]:
    return read_manifest(workdir / "model_repository", "deploy")


def write(workdir: str | Path, *, image: str | None = None, name: str = "specbuild",
          artifacts: str = "pvc:specbuild-work", artifacts_secret: str | None = None, namespace: str = "default",
          replicas: int = 1, max_replicas: int = 4, gpus_per_node: int = 8, report: str | Path | None = None,
          scale_at: int | None = None, prometheus: str = PROMETHEUS) -> Path:
    """Render for the deployment in `<workdir>/model_repository/` into `<workdir>/kubernetes/` (atomically, after
    the lint rules of `k8s_lint` passed)."""
    import yaml

    from specbuild.pipeline.k8s_lint import lint

    workdir = Path(workdir)
    deployed = _deployed(workdir)
    backend = deployed.get("options", {}).get("backend", "embedded")
    defaulted = image is None
    if image is None and backend == "trtllm":
        launch = workdir / "model_repository" / "launch.json"
        triton = json.loads(launch.read_text()).get("triton_container") if launch.is_file() else None
        image = triton or (deployed.get("extra", {}).get("recipe") or {}).get("container")
    if not image:
        raise UsageError("--image is required for the embedded backend: build docker/embedded.Dockerfile "
                         "(`docker build -f docker/embedded.Dockerfile -t REGISTRY/specbuild:TAG .`) and push it.")
    if replicas < 1 or gpus_per_node < 1 or (scale_at is not None and scale_at < 1):
        raise UsageError("--replicas, --gpus-per-node and --scale-at must be >= 1.")
    docs = render(name=name, backend=backend, image=image, workdir=workdir, artifacts=artifacts,
                  artifacts_secret=artifacts_secret, namespace=namespace, replicas=replicas,
                  max_replicas=max_replicas, gpus_per_node=gpus_per_node, deployed=deployed,
                  report=Path(report) if report else None, scale_at=scale_at, prometheus=prometheus)
    if "leaderworkerset.yaml" in docs and defaulted:
        raise UsageError("a deployment across nodes starts its ranks with `kubectl exec`, which the release container "
                         "lacks: build docker/trtllm-multinode.Dockerfile (the release container + kubectl) and pass "
                         "it as --image.")
    problems = lint(docs)
    if problems:
        raise UsageError("internal error: the rendered manifests break the lint rules: " + "; ".join(problems))
    out = workdir / "kubernetes"
    with stage_output(out) as tmp:
        for filename, doc in docs.items():
            (tmp / filename).parent.mkdir(parents=True, exist_ok=True)
            body = doc if isinstance(doc, list) else [doc]
            (tmp / filename).write_text(yaml.safe_dump_all(body, sort_keys=False))
        scaled = docs["scaledobject.yaml"]
        write_manifest(tmp, Manifest(
            stage="kubernetes", inputs={"deploy": deployed.get("fingerprint")},
            options={"image": image, "name": name, "backend": backend, "artifacts": artifacts,
                     "artifacts_secret": artifacts_secret, "namespace": namespace,
                     "replicas": replicas, "max_replicas": max_replicas, "gpus_per_node": gpus_per_node},
            outputs={"files": sorted(docs)},
            extra={"apply": f"kubectl apply -f {out}",
                   "admin_secret": f"kubectl -n {namespace} create secret generic {name}-admin "
                                   "--from-literal=key=\"$(openssl rand -hex 24)\"",
                   "autoscaling": {"threshold": scaled["spec"]["triggers"][0]["metadata"]["threshold"],
                                   "source": scaled["metadata"]["annotations"]["specbuild/threshold-source"]}}))
    return out


__all__ = ["render", "write", "relocate", "pod_argv", "scale_threshold", "MOUNT"]
