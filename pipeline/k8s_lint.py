"""What production needs of the rendered manifests, checked before `deploy --kubernetes` writes them, and the
offline schema check of the tests (`schema_problems`, with the `kubernetes-validate` package of the dev extra).

`lint(docs)` -> problems (empty: fine):
- every container: requests == limits for cpu and memory, the restricted securityContext (non-root, read-only
  root filesystem, no privilege escalation, ALL capabilities dropped, RuntimeDefault seccomp);
- every pod: runAsNonRoot + RuntimeDefault seccomp, an emptyDir on /tmp and on the cache (read-only root), anti-affinity
  across nodes (`kubernetes.io/hostname`), a service-account token only where the pod uses it;
- a server container (one exposing 8000): startup/readiness/liveness probes on /v2/health/{live,ready}, the pod's
  Prometheus scrape annotations on :8002/metrics, Triton's admin APIs restricted;
- the set: a PodDisruptionBudget and a NetworkPolicy selecting the server pods; the NetworkPolicy lets 8000/8001 in
  from labelled clients only and 8002 from a monitoring namespace only;
- the custom resources the validator has no schema for (LeaderWorkerSet, KEDA ScaledObject): their structure.
"""

from __future__ import annotations

from typing import Any, Iterator

LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy", "volumeClaimTemplates",
                "persistentVolumeClaimRetentionPolicy"}
KEDA_SPEC = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod", "idleReplicaCount",
             "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}


def objects(docs: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    for filename, doc in docs.items():
        for d in doc if isinstance(doc, list) else [doc]:
            yield filename, d


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(role, pod template) of a workload."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "Job"):
        return [(kind, spec.get("template") or {})]
    if kind == "LeaderWorkerSet":
        t = spec.get("leaderWorkerTemplate") or {}
        return [(f"{kind} {r}", t[r]) for r in ("leaderTemplate", "workerTemplate") if r in t]
    return []


def _container_problems(where: str, c: dict, server: bool, annotations: dict) -> list[str]:
    p = []
    res = c.get("resources") or {}
    req, lim = res.get("requests") or {}, res.get("limits") or {}
    for key in ("cpu", "memory"):
        if key not in req or key not in lim:
            p.append(f"{where}: resources.requests and .limits need {key}")
        elif str(req[key]) != str(lim[key]):
            p.append(f"{where}: {key} request {req[key]} != limit {lim[key]} (Guaranteed QoS)")
    sc = c.get("securityContext") or {}
    want = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True}
    for key, value in want.items():
        if sc.get(key) is not value:
            p.append(f"{where}: securityContext.{key} must be {value}")
    if (sc.get("capabilities") or {}).get("drop") != ["ALL"]:
        p.append(f"{where}: securityContext.capabilities.drop must be [ALL]")
    if (sc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        p.append(f"{where}: securityContext.seccompProfile must be RuntimeDefault")
    if server:
        paths = {name: ((c.get(name) or {}).get("httpGet") or {}).get("path")
                 for name in ("startupProbe", "readinessProbe", "livenessProbe")}
        if paths["readinessProbe"] != "/v2/health/ready":
            p.append(f"{where}: readinessProbe must GET /v2/health/ready")
        if paths["livenessProbe"] != "/v2/health/live" or paths["startupProbe"] not in ("/v2/health/live",
                                                                                     "/v2/health/ready"):
            p.append(f"{where}: liveness and startup probes must GET /v2/health/live")
        if annotations.get("prometheus.io/scrape") != "true" or annotations.get("prometheus.io/port") != "8002" \
                or annotations.get("prometheus.io/path") != "/metrics":
            p.append(f"{where}: the pod needs the Prometheus scrape annotations for :8002/metrics")
        text = " ".join(c.get("command") or []) + " ".join(c.get("args") or [])
        if "--http-restricted-api=" not in text or "--grpc-restricted-protocol=" not in text:
            p.append(f"{where}: tritonserver must restrict its admin APIs (--http-restricted-api, "
                     "--grpc-restricted-protocol)")
    return p


def pod_problems(where: str, template: dict) -> list[str]:
    p = []
    spec = template.get("spec") or {}
    psc = spec.get("securityContext") or {}
    if psc.get("runAsNonRoot") is not True or (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        p.append(f"{where}: pod securityContext needs runAsNonRoot and seccompProfile RuntimeDefault")
    if not spec.get("serviceAccountName") and spec.get("automountServiceAccountToken") is not False:
        p.append(f"{where}: automountServiceAccountToken must be false (the pod does not call the API)")
    anti = ((spec.get("affinity") or {}).get("podAntiAffinity") or {})
    terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution") or \
        [t.get("podAffinityTerm", {}) for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution") or []]
    if not any(t.get("topologyKey") == "kubernetes.io/hostname" for t in terms):
        p.append(f"{where}: needs pod anti-affinity across nodes (topologyKey kubernetes.io/hostname)")
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        cwhere = f"{where} container {c.get('name')}"
        server = any(port.get("containerPort") == 8000 for port in c.get("ports") or [])
        p += _container_problems(cwhere, c, server, annotations)
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
        for path in ("/tmp",) + (("/cache",) if c in (spec.get("containers") or []) else ()):
            if "emptyDir" not in volumes.get(mounts.get(path, ""), {}):
                p.append(f"{cwhere}: needs an emptyDir on {path} (the root filesystem is read-only)")
    return p


def _network_policy_problems(np: dict) -> list[str]:
    p = []
    rules = (np.get("spec") or {}).get("ingress") or []
    if "Ingress" not in ((np.get("spec") or {}).get("policyTypes") or []):
        p.append("NetworkPolicy: policyTypes must include Ingress")
    for port, want in ((8000, "podSelector"), (8001, "podSelector"), (8002, "namespaceSelector")):
        allowed = [r for r in rules if any(x.get("port") == port for x in r.get("ports") or [])]
        if not allowed or any(not r.get("from") or any(set(f) != {want} for f in r["from"]) for r in allowed):
            p.append(f"NetworkPolicy: port {port} must be open only from a {want}")
    for r in rules:
        if not r.get("from"):
            p.append("NetworkPolicy: an ingress rule without `from` opens its ports to every pod")
    return p


def _lws_problems(obj: dict) -> list[str]:
    p = []
    spec = obj.get("spec") or {}
    if obj.get("apiVersion") != "leaderworkerset.x-k8s.io/v1":
        p.append(f"LeaderWorkerSet: apiVersion {obj.get('apiVersion')} is not leaderworkerset.x-k8s.io/v1")
    p += [f"LeaderWorkerSet: unknown spec field {f}" for f in sorted(set(spec) - LWS_SPEC)]
    t = spec.get("leaderWorkerTemplate") or {}
    p += [f"LeaderWorkerSet: unknown leaderWorkerTemplate field {f}" for f in sorted(set(t) - LWS_TEMPLATE)]
    if "workerTemplate" not in t:
        p.append("LeaderWorkerSet: leaderWorkerTemplate.workerTemplate is required")
    if not isinstance(t.get("size"), int) or t["size"] < 1:
        p.append("LeaderWorkerSet: leaderWorkerTemplate.size must be an integer >= 1")
    if t.get("restartPolicy") not in (None, "RecreateGroupOnPodRestart", "None"):
        p.append(f"LeaderWorkerSet: restartPolicy {t.get('restartPolicy')} is not RecreateGroupOnPodRestart|None")
    if spec.get("startupPolicy") not in (None, "LeaderCreated", "LeaderReady"):
        p.append(f"LeaderWorkerSet: startupPolicy {spec.get('startupPolicy')} is not LeaderCreated|LeaderReady")
    if (spec.get("rolloutStrategy") or {}).get("type", "RollingUpdate") != "RollingUpdate":
        p.append("LeaderWorkerSet: rolloutStrategy.type must be RollingUpdate")
    return p


def _keda_problems(obj: dict) -> list[str]:
    p = []
    spec = obj.get("spec") or {}
    if obj.get("apiVersion") != "keda.sh/v1alpha1":
        p.append(f"ScaledObject: apiVersion {obj.get('apiVersion')} is not keda.sh/v1alpha1")
    p += [f"ScaledObject: unknown spec field {f}" for f in sorted(set(spec) - KEDA_SPEC)]
    if not (spec.get("scaleTargetRef") or {}).get("name"):
        p.append("ScaledObject: scaleTargetRef.name is required")
    if not spec.get("triggers"):
        p.append("ScaledObject: at least one trigger")
    for t in spec.get("triggers") or []:
        md = t.get("metadata") or {}
        if t.get("type") != "prometheus" or not all(isinstance(md.get(x), str) and md[x]
                                                    for x in ("serverAddress", "query", "threshold")):
            p.append("ScaledObject: a prometheus trigger needs string serverAddress, query and threshold")
        elif not md["threshold"].isdigit() or int(md["threshold"]) < 1:
            p.append(f"ScaledObject: threshold {md['threshold']!r} must be a positive integer")
    if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
        p.append("ScaledObject: minReplicaCount > maxReplicaCount")
    return p


def lint(docs: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    kinds: dict[str, list[dict]] = {}
    for filename, obj in objects(docs):
        kinds.setdefault(obj.get("kind", "?"), []).append(obj)
        for role, template in pod_templates(obj):
            problems += pod_problems(f"{filename} {role}", template)
        if obj.get("kind") == "LeaderWorkerSet":
            problems += _lws_problems(obj)
        if obj.get("kind") == "ScaledObject":
            problems += _keda_problems(obj)
        if obj.get("kind") == "NetworkPolicy":
            problems += _network_policy_problems(obj)
    if not any(k in kinds for k in ("Deployment", "LeaderWorkerSet")):
        problems.append("no server workload (Deployment or LeaderWorkerSet)")
    for kind in ("PodDisruptionBudget", "NetworkPolicy", "Service"):
        if kind not in kinds:
            problems.append(f"a {kind} is missing")
    return problems


def schema_problems(docs: dict[str, Any], version: str) -> list[str]:
    """Every object with a built-in schema validated (strict: unknown fields fail) against Kubernetes `version`
    offline with `kubernetes-validate` (it ships the schemas); a LeaderWorkerSet's pod templates as PodTemplates."""
    import kubernetes_validate

    problems = []
    for filename, obj in objects(docs):
        targets = [obj]
        if obj.get("kind") in ("LeaderWorkerSet",):
            targets = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{role}"},
                        "template": t} for role, t in pod_templates(obj)]
        elif obj.get("kind") == "ScaledObject":
            continue   # a CRD: _keda_problems
        for target in targets:
            try:
                kubernetes_validate.validate(target, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(x) for x in e.path)
                problems.append(f"{filename} {target['kind']} ({version}): {path}: {e.message}")
    return problems
