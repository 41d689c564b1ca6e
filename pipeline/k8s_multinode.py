"""A TensorRT-LLM deployment larger than one node: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1).

One group = `ceil(GPUs / --gpus-per-node)` pods (leader = worker index 0), each asking for `--gpus-per-node`
GPUs. The wiring is the one upstream documents for Triton + TensorRT-LLM on LWS (https://github.com/kubernetes-sigs/lws/tree/main/docs/examples/tensorrt-llm, adapted from triton-inference-server/tutorials
Deployment/Kubernetes/EKS_Multinode_Triton_TRTLLM): the leader runs `mpirun --host <pod>:<slots>,...` with
`-mca plm_rsh_agent kubessh`, a script that starts OpenMPI's daemon in the worker pods through `kubectl exec`
(so the leader's service account may exec into its own pods: rbac.yaml), workers only wait. Rank 0 serves
HTTP/gRPC/metrics; the other ranks load the engine models only (the launch's own argv, `launch.json`).

- LLM-API path: `mpirun -n <tp x pp> --host <leader>:<gpus-per-node>,<worker-1>:<gpus-per-node>,...
  trtllm-llmapi-launch tritonserver ...`: one MPI world, rank r on pod r // gpus-per-node, one rank per GPU
  (`trtllm-llmapi-launch` makes rank 0 run the server and the other ranks the LLM API's MPI workers).
- engine path: refused. Target and draft run in one Triton (orchestrator mode spawns the ranks on its own node; the
  fast-logits leader layout mixes rank 0, draft and target ranks in one world with node-local GPU ids), and
  upstream's multi-node recipe is one engine model per world.

The image needs kubectl: build docker/trtllm-multinode.Dockerfile (the release container + kubectl + kubessh).
"""

from __future__ import annotations

import copy
import math
import shlex
from typing import Any

from specbuild.core.errors import UsageError
from specbuild.pipeline import k8s_objects as k

KUBESSH = "/specbuild-bin/kubessh"
KUBESSH_SCRIPT = """#!/bin/sh
# mpirun's rsh agent (-mca plm_rsh_agent): run OpenMPI's daemon in a pod of this group through the API server.
pod="$1"
shift
exec kubectl exec "$pod" -c tritonserver -- /bin/sh -c "$*"
"""


def _hosts(pods: int, slots: int) -> str:
    # LWS names the leader <lws>-<group> and the workers <lws>-<group>-<index>; $(POD_NAME) is the leader's own.
    return ",".join(["$(POD_NAME):%d" % slots] + [f"$(POD_NAME)-{i}:{slots}" for i in range(1, pods)])


def leader_command(argv: list[str], *, pods: int, slots: int, world: int) -> list[str]:
    """The launch argv with the multi-node mpirun options, behind a wait for every worker pod to run."""
    if not argv or argv[0] != "mpirun":
        raise UsageError("the launch does not start under mpirun; a multi-node deployment needs the engine path "
                         "in leader mode (`deploy --backend trtllm --fast-logits`) or the LLM-API path with tp x pp > 1.")
    rest = [a for a in argv[1:] if a != "--allow-run-as-root"]
    if rest[:2] == ["-n", "1"]:    # one MPI world of tp x pp ranks, not `-n 1` (the LLM API would spawn the rest)
        rest = ["-n", str(world), *rest[2:]]
    mpirun = ["mpirun", "--allow-run-as-root", "-mca", "plm_rsh_agent", KUBESSH, "--host", _hosts(pods, slots),
              *rest]
    waits = [f"until kubectl exec \"$POD_NAME-{i}\" -c tritonserver -- true >/dev/null 2>&1; do "
             f"echo waiting for worker $POD_NAME-{i}; sleep 2; done" for i in range(1, pods)]
    script = "\n".join(["set -eu", *waits, "exec " + shlex.join(mpirun)])
    return ["bash", "-c", script]


def leader_worker_set(*, name: str, namespace: str, lab: dict, selector: dict, template: dict, layout: dict,
                      gpus: int, gpus_per_node: int, replicas: int) -> dict[str, Any]:
    s, launch = layout["settings"], layout["launch"]
    if launch.get("triton_argv") is None:
        raise UsageError(f"{gpus} GPUs do not fit one node of {gpus_per_node} (--gpus-per-node). The engine path runs "
                         "target and draft in one Triton (orchestrator mode spawns every rank on its own node; the "
                         "fast-logits leader layout puts rank 0, the draft ranks and the target ranks in one world "
                         "with node-local GPU ids), and upstream documents multi-node only for one engine model per "
                         "world. Across nodes use the LLM-API path (`--trtllm-generation llmapi`: one MPI world of "
                         "tp x pp ranks), or nodes with more GPUs (--gpus-per-node).")
    world = s.target_world
    pods = math.ceil(gpus / gpus_per_node)
    slots = gpus_per_node            # rank r on pod r // gpus_per_node: one rank per GPU
    leader = copy.deepcopy(template)
    worker = copy.deepcopy(template)
    lc = leader["spec"]["containers"][0]
    argv = launch.get("triton_argv") or launch["argv"]
    lc["command"] = leader_command(k.pod_argv(argv, layout["workdir"]), pods=pods, slots=slots, world=world)
    pod_name = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    for pod in (leader, worker):
        c = pod["spec"]["containers"][0]
        c["resources"]["requests"]["nvidia.com/gpu"] = gpus_per_node
        c["resources"]["limits"]["nvidia.com/gpu"] = gpus_per_node
        c["env"].insert(0, pod_name)
        c["volumeMounts"].append({"name": "kubessh", "mountPath": "/specbuild-bin", "readOnly": True})
        pod["spec"]["volumes"].append({"name": "kubessh", "configMap": {"name": f"{name}-kubessh",
                                                                         "defaultMode": 0o555}})
        pod["spec"]["subdomain"] = name
    leader["spec"]["serviceAccountName"] = name
    leader["spec"]["automountServiceAccountToken"] = True     # kubectl exec into the workers (rbac.yaml)
    wc = worker["spec"]["containers"][0]
    wc["command"] = ["sleep", "infinity"]                     # OpenMPI's daemon arrives through kubectl exec
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        wc.pop(probe)
    wc["ports"] = []
    worker["metadata"]["annotations"] = {}
    # groups on different nodes from each other; the pods of a group on different nodes too (one per node)
    for pod in (leader, worker):
        pod["spec"]["affinity"] = k.anti_affinity(selector, required=True)
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": k.meta(name, lab, namespace),
           "spec": {"replicas": replicas, "startupPolicy": "LeaderCreated",
                    "rolloutStrategy": {"type": "RollingUpdate",
                                        "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
                    "leaderWorkerTemplate": {"size": pods, "restartPolicy": "RecreateGroupOnPodRestart",
                                             "leaderTemplate": leader, "workerTemplate": worker}}}
    rbac = [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": k.meta(name, lab, namespace),
             "automountServiceAccountToken": False},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": k.meta(name, lab, namespace),
             "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                       {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": k.meta(name, lab, namespace),
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
             "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}]
    kubessh = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": k.meta(f"{name}-kubessh", lab, namespace),
               "data": {"kubessh": KUBESSH_SCRIPT}}
    return {"leaderworkerset.yaml": lws, "rbac.yaml": rbac, "kubessh.yaml": kubessh}
