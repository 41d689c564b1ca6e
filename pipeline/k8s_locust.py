"""The load test inside the cluster (`specbuild loadtest --kubernetes`): Locust's own distributed mode, one master
Job and a Job of N workers, running the locustfile and run spec a local `specbuild loadtest` runs, against the
server's Service instead of a local URL.

Per planned run (profile x setting x sweep point), `<out>/<run>/` (and `<out>/README.txt`):
- `configmap.yaml`: the run spec with the cluster's addresses (`<service>.<namespace>.svc`, ports 8000/8001), the
  tokenizer under the artefact copy (`/specbuild/work/...`), samples and stop.json under /tmp;
- `master.yaml`: a Job, `locust --master --expect-workers N --headless -u U -r R -t T --csv ...`, its pod
  labelled `specbuild/client=true` like the workers (the server's NetworkPolicy lets only those in); the stop rule
  (min duration and requests, the ceiling, the server gone) runs there, as in a local run; at the end it prints
  Locust's CSVs and stop.json to its log (`kubectl logs job/<name>`);
- `master-service.yaml`: the master's port 5557 for the workers; `networkpolicy.yaml`: 5557 from the workers only;
- `workers.yaml`: a Job of N pods (completions = parallelism = N), `locust --worker --master-host <master>`; each
  exits when the master ends the run. Spread across nodes and kept off the server's nodes where the scheduler can:
  a load generator beside the server takes the cores it measures.

Same pod rules as the server (`k8s_objects`): non-root, read-only root filesystem, requests = limits (one core per
Locust process: it is single-threaded), no service-account token, an init container copying the tokenizer's folder
from the same artefacts (`--artifacts` of `deploy --kubernetes`).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specbuild.core.errors import UsageError
from specbuild.pipeline import k8s_objects as k
from specbuild.pipeline.k8s_objects import MOUNT, PORTS, WORK

LOCUST_PORT = 5557
SPEC_DIR = "/specbuild-loadtest"      # the ConfigMap: runspec.json
RUN_DIR = "/tmp/locust"               # samples, stop.json, Locust's CSVs (an emptyDir)
CLIENT_LABEL = ("specbuild/client", "true")
_CONFIGMAP_MAX = 900 * 1024
_LOCUSTFILE = '"$(python -c \'import specbuild.loadtests.locustfile as m; print(m.__file__)\')"'


def run_name(key: str) -> str:
    """A DNS-1123 label from a run's key ('chat/default/users=4' -> 'chat-default-users-4')."""
    name = re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-")
    return name[:40].rstrip("-") or "run"


def cluster_spec(spec, *, workdir: Path, service: str, namespace: str) -> dict[str, Any]:
    """The run spec (`loadtests.runspec.RunSpec`) as the pods read it: the server through its Service, the
    tokenizer under WORK, the writable paths under RUN_DIR."""
    data = asdict(spec)
    host = f"{service}.{namespace}.svc"
    path = urlsplit(spec.url).path.rstrip("/")
    data["url"] = f"http://{host}:{PORTS['http']}{path}"
    data["grpc_url"] = f"{host}:{PORTS['grpc']}"
    tokenizer = Path(spec.tokenizer).resolve()
    root = Path(workdir).resolve()
    if not tokenizer.is_relative_to(root):
        raise UsageError(f"the tokenizer {tokenizer} is outside {root}; the pods get only the workdir's artefacts. "
                         "Put it under the workdir (or pass --tokenizer with one there) and run again.")
    data["tokenizer"] = f"{WORK}/{tokenizer.relative_to(root)}"
    data["samples_dir"] = f"{RUN_DIR}/samples"
    data["run_dir"] = RUN_DIR
    return data


def _pod(*, lab: dict[str, str], server_selector: dict[str, str], container: dict[str, Any], init: dict[str, Any],
         init_volumes: list[dict], spec_map: str) -> dict[str, Any]:
    own = {key: lab[key] for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance")}
    return {"metadata": {"labels": lab},
            "spec": {"automountServiceAccountToken": False, "securityContext": k.pod_security(),
                     "restartPolicy": "Never", "terminationGracePeriodSeconds": 30,
                     "initContainers": [init], "containers": [container],
                     "volumes": [{"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
                                 {"name": "cache", "emptyDir": {}},
                                 {"name": "spec", "configMap": {"name": spec_map, "defaultMode": 0o444}},
                                 *init_volumes],
                     "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                         {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": server_selector},
                                                             "topologyKey": "kubernetes.io/hostname"}},
                         {"weight": 50, "podAffinityTerm": {"labelSelector": {"matchLabels": own},
                                                            "topologyKey": "kubernetes.io/hostname"}}]}}}}


def _container(name: str, image: str, script: str, *, ports: list[dict] | None = None) -> dict[str, Any]:
    res = {"cpu": "1", "memory": "1Gi"}
    c = {"name": name, "image": image, "command": ["sh", "-c", script],
         "env": [{"name": "SPECBUILD_LOADTEST_SPEC", "value": f"{SPEC_DIR}/runspec.json"}, *k.CACHE_ENV],
         "resources": {"requests": dict(res), "limits": dict(res)},
         "volumeMounts": [{"name": "work", "mountPath": MOUNT, "readOnly": True},
                          {"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": "/cache"},
                          {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True}],
         "securityContext": k.container_security()}
    if ports:
        c["ports"] = ports
    return c


def master_argv(*, users: int, spawn_rate: float, duration_s: float, workers: int, url: str, label: str,
                stop_timeout: float) -> list[str]:
    """The master's Locust arguments (after `python -m locust -f LOCUSTFILE`)."""
    return ["--loglevel", "WARNING", "--headless", "-u", str(users), "-r", f"{spawn_rate:g}",
            "-t", f"{duration_s:g}s", "--host", url, "--csv", f"{RUN_DIR}/{label}", "--only-summary",
            "--stop-timeout", f"{stop_timeout:g}", "--master", "--expect-workers", str(workers),
            "--expect-workers-max-wait", "600", "--master-bind-port", str(LOCUST_PORT)]


def worker_argv(master: str) -> list[str]:
    return ["--loglevel", "WARNING", "--worker", "--master-host", master, "--master-port", str(LOCUST_PORT)]


def render(spec, *, users: int, spawn_rate: float, workers: int, stop_timeout: float, key: str, workdir: Path,
           name: str, namespace: str, image: str, artifacts: str, artifacts_secret: str | None,
           server_selector: dict[str, str], backend: str) -> dict[str, Any]:
    """{filename: manifest} of one run of the load test inside the cluster."""
    if workers < 1:
        raise UsageError(f"--workers {workers}: the load test inside the cluster needs at least one worker.")
    data = cluster_spec(spec, workdir=workdir, service=name, namespace=namespace)
    body = json.dumps(data, indent=1)
    if len(body.encode()) > _CONFIGMAP_MAX:
        raise UsageError(f"the run spec of {key} is {len(body.encode()) // 1024} KiB, more than a ConfigMap holds; "
                         "use fewer or shorter prompts.")
    run = f"{name}-locust-{run_name(key)}"[:52].rstrip("-")
    master, workers_name, spec_map = f"{run}-master", f"{run}-workers", f"{run}-spec"
    lab = {**k.labels(name, backend, "loadtest"), CLIENT_LABEL[0]: CLIENT_LABEL[1], "specbuild/run": run}
    mlab, wlab = {**lab, "specbuild/locust": "master"}, {**lab, "specbuild/locust": "worker"}
    tokenizer_dir = str(Path(data["tokenizer"]).parent.relative_to(WORK))
    init, init_volumes = k.fetch_init_container(artifacts, {}, artifacts_secret, dirs=(tokenizer_dir,),
                                                require=str(Path(data["tokenizer"]).relative_to(WORK)))
    # the master ends the run itself (the stop rule); -t is the backstop, as in a local run
    backstop = spec.max_duration_s + stop_timeout + 60
    margv = master_argv(users=users, spawn_rate=spawn_rate, duration_s=backstop, workers=workers,
                        url=data["url"], label=spec.label, stop_timeout=stop_timeout)
    mscript = "\n".join([
        f"mkdir -p {RUN_DIR}/samples",
        f"python -m locust -f {_LOCUSTFILE} {shlex.join(margv)}",
        "rc=$?",
        f"for f in {RUN_DIR}/{spec.label}_stats.csv {RUN_DIR}/{spec.label}_failures.csv {RUN_DIR}/stop.json; do",
        '  [ -f "$f" ] && { echo "== $f"; cat "$f"; echo; }',
        "done",
        "exit $rc"])
    wscript = f"mkdir -p {RUN_DIR}/samples\nexec python -m locust -f {_LOCUSTFILE} {shlex.join(worker_argv(master))}"
    deadline = int(backstop + 900)   # + the workers' scheduling and the artefact copy
    master_job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": k.meta(master, mlab, namespace),
                  "spec": {"backoffLimit": 0, "activeDeadlineSeconds": deadline, "ttlSecondsAfterFinished": 86400,
                           "template": _pod(lab=mlab, server_selector=server_selector, init=init,
                                            init_volumes=init_volumes, spec_map=spec_map,
                                            container=_container("locust-master", image, mscript,
                                                                 ports=[{"name": "locust",
                                                                         "containerPort": LOCUST_PORT}]))}}
    workers_job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": k.meta(workers_name, wlab, namespace),
                   "spec": {"completions": workers, "parallelism": workers, "backoffLimit": workers,
                            "activeDeadlineSeconds": deadline, "ttlSecondsAfterFinished": 86400,
                            "template": _pod(lab=wlab, server_selector=server_selector, init=init,
                                             init_volumes=init_volumes, spec_map=spec_map,
                                             container=_container("locust-worker", image, wscript))}}
    msel = {"specbuild/run": run, "specbuild/locust": "master"}
    wsel = {"specbuild/run": run, "specbuild/locust": "worker"}
    return {
        "configmap.yaml": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": k.meta(spec_map, lab, namespace),
                           "data": {"runspec.json": body}},
        "master-service.yaml": {"apiVersion": "v1", "kind": "Service", "metadata": k.meta(master, mlab, namespace),
                                "spec": {"selector": msel, "ports": [{"name": "locust", "port": LOCUST_PORT,
                                                                      "targetPort": "locust"}]}},
        "networkpolicy.yaml": {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                               "metadata": k.meta(master, mlab, namespace),
                               "spec": {"podSelector": {"matchLabels": msel}, "policyTypes": ["Ingress"],
                                        "ingress": [{"from": [{"podSelector": {"matchLabels": wsel}}],
                                                     "ports": [{"protocol": "TCP", "port": LOCUST_PORT}]}]}},
        "master.yaml": master_job,
        "workers.yaml": workers_job,
    }


def lint_loadtest(docs: dict[str, Any]) -> list[str]:
    """The pod rules of every manifest (`k8s_lint`), and the load test's own: a master Job and a workers Job whose
    pods carry the client label, the master's port open only to its workers, no server port."""
    from specbuild.pipeline.k8s_lint import pod_problems, objects, pod_templates

    problems: list[str] = []
    jobs = {}
    for filename, obj in objects(docs):
        for role, template in pod_templates(obj):
            problems += pod_problems(f"{filename} {role}", template)
            labels = (template.get("metadata") or {}).get("labels") or {}
            if labels.get(CLIENT_LABEL[0]) != CLIENT_LABEL[1]:
                problems.append(f"{filename}: pods need the label {CLIENT_LABEL[0]}={CLIENT_LABEL[1]} (the server's "
                                "NetworkPolicy lets only those in)")
            if (template.get("spec") or {}).get("restartPolicy") != "Never":
                problems.append(f"{filename}: a load-test pod must not restart (restartPolicy Never)")
            jobs[labels.get("specbuild/locust")] = obj
        if obj.get("kind") == "NetworkPolicy":
            rules = (obj.get("spec") or {}).get("ingress") or []
            if any(not r.get("from") for r in rules) or \
                    {p.get("port") for r in rules for p in r.get("ports") or []} != {LOCUST_PORT}:
                problems.append(f"{filename}: only {LOCUST_PORT}, and only from the workers")
    for role in ("master", "worker"):
        if (jobs.get(role) or {}).get("kind") != "Job":
            problems.append(f"the Locust {role} must be a Job")
    if jobs.get("worker") and jobs["worker"]["spec"].get("completions") != jobs["worker"]["spec"].get("parallelism"):
        problems.append("the workers Job: completions must equal parallelism (every worker at once)")
    return problems


def write(out: Path, rendered: dict[str, dict[str, Any]]) -> Path:
    """`out/<run>/*.yaml` for every run ({run: docs}), with README.txt saying how to run and read each."""
    import yaml

    from specbuild.core.manifest import Manifest, stage_output, write_manifest

    with stage_output(out) as tmp:
        lines = ["The load test inside the cluster: one folder per run, applied one at a time.", ""]
        for run, docs in rendered.items():
            problems = lint_loadtest(docs)
            if problems:
                raise UsageError("internal error: the load-test manifests break the lint rules: " + "; ".join(problems))
            (tmp / run).mkdir(parents=True)
            for filename, doc in docs.items():
                (tmp / run / filename).write_text(yaml.safe_dump(doc, sort_keys=False))
            master = docs["master.yaml"]["metadata"]
            lines += [f"# {run}", f"kubectl apply -f {out / run}",
                      f"kubectl -n {master['namespace']} wait --for=condition=complete --timeout=30m job/{master['name']}",
                      f"kubectl -n {master['namespace']} logs job/{master['name']}   # Locust's CSVs and stop.json",
                      f"kubectl delete -f {out / run}", ""]
        (tmp / "README.txt").write_text("\n".join(lines))
        write_manifest(tmp, Manifest(stage="loadtest-kubernetes", inputs={}, options={},
                                     outputs={"runs": sorted(rendered)}))
    return out


__all__ = ["render", "write", "lint_loadtest", "cluster_spec", "master_argv", "worker_argv", "run_name"]
