"""Kubernetes manifests for a deployed repository (`specbuild deploy --kubernetes`).

One Deployment + one Service, written atomically to `<workdir>/kubernetes/` next to (never inside) the model
repository, which Triton would otherwise try to load as a model. The pod mounts the workspace volume at the
*same absolute path* as here, so every path the rendered configs hold (engine dirs, tokenizer) stays valid.

- probes: readiness on `/v2/health/ready`, liveness on `/v2/health/live` (HTTP port);
- metrics: Prometheus scrape annotations on the metrics port (Triton's own families and `specbuild_*`);
- trtllm: the container of the recorded recipe, `nvidia.com/gpu` limits, the launch script `deploy` wrote;
- embedded: an image you build with specbuild installed (`--image`, required), CPU requests/limits.

Scale out with `replicas` (each pod holds a full copy: draft-target speculation is per replica) and
Locust's distributed mode for load (`specbuild loadtest --workers N`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specbuild.core.errors import UsageError
from specbuild.core.manifest import Manifest, read_manifest, stage_output, write_manifest

PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


def _server_command(backend: str, repo: Path) -> list[str]:
    if backend == "trtllm":
        return ["bash", str(repo / "launch.sh")]
    return ["tritonserver", f"--model-repository={repo}", "--http-address=0.0.0.0", "--grpc-address=0.0.0.0",
            "--metrics-address=0.0.0.0", f"--http-port={PORTS['http']}", f"--grpc-port={PORTS['grpc']}",
            f"--metrics-port={PORTS['metrics']}", "--allow-metrics=true", "--exit-timeout-secs=30"]


def render(*, name: str, backend: str, image: str, workdir: Path, claim: str, replicas: int = 1, gpus: int = 1,
           cpu: str = "2", memory: str = "8Gi") -> dict[str, dict[str, Any]]:
    """The Deployment and Service as plain dicts (serialized to YAML by `write`)."""
    workdir = workdir.resolve()
    labels = {"app.kubernetes.io/name": "specbuild", "app.kubernetes.io/instance": name,
              "specbuild/backend": backend}
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if backend == "trtllm":
        limits["nvidia.com/gpu"] = gpus
    probe = {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3}
    container = {
        "name": "tritonserver", "image": image,
        "command": _server_command(backend, workdir / "model_repository"),
        "ports": [{"name": k, "containerPort": v} for k, v in PORTS.items()],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "httpGet": {"path": "/v2/health/live", "port": "http"}},
        # Loading engines (or the embedded engine + draft) takes a while; do not kill a pod that is still loading.
        "startupProbe": {**probe, "failureThreshold": 60},
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "volumeMounts": [{"name": "workspace", "mountPath": str(workdir), "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],   # the Python backend's shared memory
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas, "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(PORTS["metrics"]),
                    "prometheus.io/path": "/metrics"}},
                "spec": {"containers": [container], "volumes": [
                    {"name": "workspace", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}]},
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
        "spec": {"selector": labels, "ports": [{"name": k, "port": v, "targetPort": k} for k, v in PORTS.items()]},
    }
    return {"deployment.yaml": deployment, "service.yaml": service}


def write(workdir: str | Path, *, image: str | None = None, name: str = "specbuild", claim: str = "specbuild-work",
          replicas: int = 1, gpus: int = 1) -> Path:
    """Render for the deployment in `<workdir>/model_repository/` into `<workdir>/kubernetes/` (atomically)."""
    import yaml

    workdir = Path(workdir)
    deployed = read_manifest(workdir / "model_repository", "deploy")
    backend = deployed.get("options", {}).get("backend", "embedded")
    if image is None:
        image = (deployed.get("extra", {}).get("recipe") or {}).get("container") if backend == "trtllm" else None
    if not image:
        raise UsageError("--image is required for the embedded backend: an image with tritonserver and specbuild "
                         "installed (e.g. built FROM nvcr.io/nvidia/tritonserver:<yy.mm>-py3 with "
                         "`pip install specbuild`).")
    if replicas < 1 or gpus < 1:
        raise UsageError("--replicas and --gpus must be >= 1.")
    docs = render(name=name, backend=backend, image=image, workdir=workdir, claim=claim, replicas=replicas,
                  gpus=gpus)
    out = workdir / "kubernetes"
    with stage_output(out) as tmp:
        for filename, doc in docs.items():
            (tmp / filename).write_text(yaml.safe_dump(doc, sort_keys=False))
        write_manifest(tmp, Manifest(stage="kubernetes", inputs={"deploy": deployed.get("fingerprint")},
                                     options={"image": image, "name": name, "claim": claim, "replicas": replicas,
                                              "gpus": gpus},
                                     outputs={"files": sorted(docs)}, extra={"apply": f"kubectl apply -f {out}"}))
    return out
