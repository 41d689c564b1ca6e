"""The Kubernetes objects of `deploy --kubernetes`, as plain dicts (`pipeline/kubernetes.py` decides which).

Every pod here runs with the restricted Pod Security Standard's settings (non-root, no privilege escalation, all
capabilities dropped, RuntimeDefault seccomp) and a read-only root filesystem: the writable places are emptyDirs
(`/tmp`, the cache, `/dev/shm` for the Python backend, and the artefact copy under `MOUNT`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specbuild.core.constants import ADMIN_KEY, ADMIN_TOKEN_ENV, restriction_args

PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
MOUNT = "/specbuild"                  # the one mount point: the workdir's copy is MOUNT/work
WORK = f"{MOUNT}/work"
OVERLAY = "/specbuild-overlay"        # the ConfigMap of relocated configs (init container only)
UID = 1000                            # the embedded image's user; NGC's tritonserver images have uid 1000 too
BUSYBOX = "busybox:1.37.0"
AWS_CLI = "amazon/aws-cli:2.22.35"
# Triton's admin APIs behind the same header as `specbuild serve` (core.constants.RESTRICTED_APIS / ADMIN_KEY),
# its value from a Secret; health, metadata and inference stay open to the clients the NetworkPolicy lets in.
ADMIN_HEADER = ADMIN_KEY
ADMIN_ENV = ADMIN_TOKEN_ENV


def selector(name: str, component: str = "server") -> dict[str, str]:
    """The labels that pick one deployment's pods of one component (a subset of `labels`)."""
    return {"app.kubernetes.io/name": "specbuild", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def labels(name: str, backend: str, component: str = "server") -> dict[str, str]:
    return {**selector(name, component), "specbuild/backend": backend}


def meta(name: str, lab: dict[str, str], namespace: str | None = None, **extra: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"name": name, "labels": dict(lab)}
    if namespace:
        m["namespace"] = namespace
    m.update(extra)
    return m


def pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def restricted_flags() -> list[str]:
    """The admin APIs behind a header whose value only the Secret's holder knows ($(VAR): expanded by the kubelet)."""
    return restriction_args(f"$({ADMIN_ENV})")


def pod_argv(argv: list[str], workdir: Path) -> list[str]:
    """A launch.json argv for the pod: the workdir -> WORK, every address -> 0.0.0.0 (the NetworkPolicy is the
    boundary), Triton's admin APIs restricted on every tritonserver of the launch."""
    old = str(workdir.resolve())
    out: list[str] = []
    for arg in argv:
        arg = arg.replace(old, WORK)
        for flag in ("--http-address=", "--grpc-address=", "--metrics-address="):
            if arg.startswith(flag):
                arg = flag + "0.0.0.0"
        out.append(arg)
        if arg.startswith("--model-repository="):
            out += restricted_flags()
    return out


def probes(startup_failures: int = 90) -> dict[str, Any]:
    ready = {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5,
             "failureThreshold": 3}
    live = {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5,
            "failureThreshold": 3}
    # Loading engines (or converting + building the fused CPU step) takes minutes: the startup probe holds the
    # liveness probe off for up to startup_failures x 10 s.
    return {"startupProbe": {**live, "failureThreshold": startup_failures}, "readinessProbe": ready,
            "livenessProbe": live}


def scratch_volumes(shm: str) -> list[dict[str, Any]]:
    return [{"name": "work", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "cache", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]


def scratch_mounts(*, work_read_only: bool = True) -> list[dict[str, Any]]:
    return [{"name": "work", "mountPath": MOUNT, "readOnly": work_read_only},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": "/cache"},
            {"name": "dshm", "mountPath": "/dev/shm"}]


CACHE_ENV = [{"name": "HOME", "value": "/cache"}, {"name": "XDG_CACHE_HOME", "value": "/cache"},
             {"name": "SPECBUILD_CACHE", "value": "/cache/specbuild"},
             {"name": "TORCH_EXTENSIONS_DIR", "value": "/cache/torch_extensions"},
             {"name": "HF_HOME", "value": "/cache/huggingface"}]


def fetch_init_container(artifacts: str, overlay: dict[str, str], secret: str | None,
                         dirs: tuple[str, ...] = ("engines", "model_repository"),
                         require: str = "model_repository/manifest.json") -> tuple[dict, list[dict]]:
    """(init container, its extra volumes): the workdir's `dirs` (engines/, model_repository/, or deeper ones such
    as engines/tokenizer) from a PVC (busybox cp) or an S3 prefix (aws s3 sync) into MOUNT/work, then the relocated
    configs (`overlay`: key -> relative path) over them, so no config names a path of the build machine. It fails
    (naming `artifacts`) when `require` is not there after the copy."""
    script = ["set -eu", f"mkdir -p {WORK}"]
    volumes: list[dict] = []
    mounts = [{"name": "work", "mountPath": MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    env: list[dict] = [{"name": "HOME", "value": "/tmp"}]
    env_from: list[dict] = []
    if artifacts.startswith("pvc:"):
        claim, _, sub = artifacts[4:].partition("/")
        image = BUSYBOX
        volumes.append({"name": "artifacts", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "artifacts", "mountPath": "/artifacts", "readOnly": True,
                       **({"subPath": sub} if sub else {})})
        # rm first: a pod sandbox recreated on the same node re-runs this over the kept emptyDir
        script += [f"rm -rf {WORK}/{d} && mkdir -p {Path(WORK, d).parent} && cp -R /artifacts/{d} {WORK}/{d}"
                   for d in dirs]
    else:
        image = AWS_CLI
        url = artifacts.rstrip("/")
        script += [f"aws s3 sync --only-show-errors --delete {url}/{d} {WORK}/{d}" for d in dirs]
        if secret:   # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_REGION (or IRSA: no secret at all)
            env_from.append({"secretRef": {"name": secret}})
    script.append(f"test -f {WORK}/{require} || {{ echo 'no {require} under {artifacts}: copy the workdir "
                  f"({', '.join(d + '/' for d in dirs)}) there' >&2; exit 1; }}")
    if overlay:
        volumes.append({"name": "overlay", "configMap": {"name": "", "defaultMode": 0o444}})   # name set by caller
        mounts.append({"name": "overlay", "mountPath": OVERLAY, "readOnly": True})
        script += [f"cp {OVERLAY}/{key} {WORK}/{rel}" for key, rel in sorted(overlay.items())]
    script.append(f"echo artefacts ready in {WORK}")
    c = {"name": "fetch-artifacts", "image": image, "command": ["sh", "-c", "\n".join(script)],
         "env": env, "volumeMounts": mounts, "securityContext": container_security(),
         "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}}}
    if image == AWS_CLI:
        c["command"] = ["/bin/sh", "-c", "\n".join(script)]   # the image's entrypoint is `aws`
    if env_from:
        c["envFrom"] = env_from
    return c, volumes


def anti_affinity(lab: dict[str, str], required: bool) -> dict[str, Any]:
    """Replicas on different nodes: required for GPU pods (one node's failure or drain takes one replica), preferred
    for CPU pods (a small cluster may still place two on one node)."""
    term = {"labelSelector": {"matchLabels": dict(lab)}, "topologyKey": "kubernetes.io/hostname"}
    if required:
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}


def scrape_annotations() -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORTS["metrics"]),
            "prometheus.io/path": "/metrics"}


def service(name: str, lab: dict[str, str], selector: dict[str, str], namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, lab, namespace),
            "spec": {"selector": dict(selector),
                     "ports": [{"name": k, "port": v, "targetPort": k} for k, v in PORTS.items()]}}


def pdb(name: str, lab: dict[str, str], selector: dict[str, str], namespace: str, replicas: int) -> dict[str, Any]:
    """At most one replica down for a voluntary disruption (drain, upgrade); one replica: none, so a drain waits
    for a second replica (or the operator's decision) instead of silently taking the only server away."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta(name, lab, namespace),
            "spec": {"maxUnavailable": 1 if replicas > 1 else 0, "selector": {"matchLabels": dict(selector)}}}


def network_policy(name: str, lab: dict[str, str], selector: dict[str, str], namespace: str, *,
                   client_label: tuple[str, str], monitoring: tuple[str, str], group_ports: list[int] | None = None
                   ) -> dict[str, Any]:
    """Ingress: HTTP/gRPC only from pods labelled `client_label` (same namespace), metrics only from the monitoring
    namespace; `group_ports` (multi-node) open between the pods of one group for MPI. Everything else: denied."""
    ck, cv = client_label
    mk, mv = monitoring
    rules: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": {ck: cv}}}],
         "ports": [{"protocol": "TCP", "port": PORTS["http"]}, {"protocol": "TCP", "port": PORTS["grpc"]}]},
        {"from": [{"namespaceSelector": {"matchLabels": {mk: mv}}}],
         "ports": [{"protocol": "TCP", "port": PORTS["metrics"]}]},
    ]
    if group_ports is not None:
        rules.append({"from": [{"podSelector": {"matchLabels": dict(selector)}}]})   # MPI/NCCL: any port, own pods
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta(name, lab, namespace),
            "spec": {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"], "ingress": rules}}


def scaled_object(name: str, lab: dict[str, str], namespace: str, *, target: dict[str, str], prometheus: str,
                  queries: list[tuple[str, str, str]], min_replicas: int, max_replicas: int) -> dict[str, Any]:
    """KEDA ScaledObject (keda.sh/v1alpha1): one prometheus trigger per (metric name, query, threshold). KEDA's
    prometheus trigger is an AverageValue metric: desired replicas = ceil(query / threshold), the largest over
    the triggers."""
    triggers = [{"type": "prometheus", "name": metric,
                 "metadata": {"serverAddress": prometheus, "query": query, "threshold": threshold}}
                for metric, query, threshold in queries]
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta(name, lab, namespace),
            "spec": {"scaleTargetRef": target, "minReplicaCount": min_replicas, "maxReplicaCount": max_replicas,
                     "pollingInterval": 15, "cooldownPeriod": 300,
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                         "scaleDown": {"stabilizationWindowSeconds": 300,
                                       "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]}}}},
                     "triggers": triggers}}


def hpa(name: str, lab: dict[str, str], namespace: str, *, target: dict[str, str], metric: str, per_pod: int,
        min_replicas: int, max_replicas: int) -> dict[str, Any]:
    """The same rule as an HPA on the custom metrics API (needs prometheus-adapter exposing `metric` per pod)."""
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta(name, lab, namespace),
            "spec": {"scaleTargetRef": target, "minReplicas": min_replicas, "maxReplicas": max_replicas,
                     "metrics": [{"type": "Pods", "pods": {"metric": {"name": metric},
                                                           "target": {"type": "AverageValue",
                                                                      "averageValue": str(per_pod)}}}],
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300,
                                                "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]}}}}
