"""`specbuild deploy --kubernetes`: manifests a cluster accepts (validated offline against the Kubernetes schemas of
1.30 .. the newest `kubernetes-validate` ships, strict), the lint rules production needs, artefacts that reach the
pod without a same-path mount, autoscaling at the crossover, GPUs from tp x pp, a LeaderWorkerSet across nodes,
and the embedded image's Dockerfile."""

import copy
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from specbuild.cli.main import cli
from specbuild.core.errors import UsageError
from specbuild.core.manifest import Manifest, write_manifest
from specbuild.pipeline.k8s_lint import lint, schema_problems
from specbuild.pipeline.kubernetes import write

kv = pytest.importorskip("kubernetes_validate", reason="the dev extra's kubernetes-validate validates the schemas")
from kubernetes_validate import utils as kv_utils  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = sorted({v.rsplit(".", 1)[0] for v in kv_utils.all_versions()
                   if tuple(map(int, v.split(".")[:2])) >= (1, 30)}, key=lambda v: tuple(map(int, v.split("."))))


def read_dir(out: Path) -> dict:
    docs = {}
    for p in sorted(out.rglob("*.yaml")):
        body = [d for d in yaml.safe_load_all(p.read_text()) if d]
        docs[str(p.relative_to(out))] = body if len(body) > 1 else body[0]
    return docs


def valid_everywhere(docs: dict) -> None:
    assert lint(docs) == []
    for version in VERSIONS:
        assert schema_problems(docs, version) == [], version


def test_the_validator_ships_its_schemas_and_covers_the_releases_users_run(monkeypatch):
    def no_network(*a, **kw):
        raise OSError("offline")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    assert VERSIONS[0] == "1.30" and len(VERSIONS) >= 8      # 1.30 .. 1.37 at kubernetes-validate 1.37
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {"containers": [{"name": "c", "image": "i", "bogus": 1}]}}
    with pytest.raises(kv.ValidationError):
        kv.validate(pod, VERSIONS[-1], strict=True)


@pytest.fixture(scope="module")
def embedded_out(server_workdir):
    r = CliRunner().invoke(cli, ["deploy", "--workdir", str(server_workdir), "--kubernetes",
                                 "--image", "registry.example.com/specbuild:0.1", "--replicas", "2",
                                 "--artifacts", "s3://bucket/work", "--artifacts-secret", "aws"])
    assert r.exit_code == 0, r.output
    assert "kubectl -n default create secret generic specbuild-admin" in r.output
    return server_workdir, server_workdir / "kubernetes"


def test_embedded_manifests_validate_lint_and_travel(embedded_out):
    workdir, out = embedded_out
    docs = read_dir(out)
    valid_everywhere(docs)
    assert (out / "manifest.json").is_file()
    dep = docs["deployment.yaml"]
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "registry.example.com/specbuild:0.1"
    assert "--model-repository=/specbuild/work/model_repository" in c["command"]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    # no path of this machine anywhere: the configs that named the workdir travel relocated in the ConfigMap
    text = "".join(p.read_text() for p in out.rglob("*.yaml"))
    assert str(workdir.resolve()) not in text
    cm = docs["configmap.yaml"]["data"]
    assert "/specbuild/work/engines" in cm["model_repository__tensorrt_llm__config.pbtxt"]
    init = pod["initContainers"][0]
    script = init["command"][-1]
    assert init["image"].startswith("amazon/aws-cli:") and init["envFrom"] == [{"secretRef": {"name": "aws"}}]
    assert "aws s3 sync --only-show-errors --delete s3://bucket/work/engines /specbuild/work/engines" in script
    assert ("cp /specbuild-overlay/model_repository__tensorrt_llm__config.pbtxt "
            "/specbuild/work/model_repository/tensorrt_llm/config.pbtxt") in script
    # the relocated config is the deployed one with the mount point substituted, nothing else changed
    local = (workdir / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert cm["model_repository__tensorrt_llm__config.pbtxt"] == local.replace(str(workdir.resolve()),
                                                                                "/specbuild/work")
    # the autoscaler: requests in flight per replica; this build was not calibrated, so its max batch size
    so = docs["scaledobject.yaml"]
    trig = so["spec"]["triggers"][0]["metadata"]
    assert "specbuild_live_requests" in trig["query"] and trig["threshold"] == "16"
    assert so["spec"]["minReplicaCount"] == 2
    assert docs["pdb.yaml"]["spec"]["maxUnavailable"] == 1
    assert {p["port"] for p in docs["service.yaml"]["spec"]["ports"]} == {8000, 8001, 8002}
    assert docs["service.yaml"]["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_the_threshold_is_the_measured_crossover(server_workdir, tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"curves": [
        {"param": "users", "crossover": {"value": 6}}, {"param": "users", "crossover": {"value": 9}},
        {"param": "request_rate", "crossover": {"value": 2}}]}))
    out = write(server_workdir, image="reg/specbuild:0.1", report=report)
    trig = read_dir(out)["scaledobject.yaml"]["spec"]["triggers"][0]["metadata"]
    assert trig["threshold"] == "6"                       # the lowest concurrency crossover
    assert json.loads((out / "manifest.json").read_text())["extra"]["autoscaling"]["source"].endswith(
        "the load test's crossover")
    report.write_text(json.dumps({"curves": [{"param": "users", "crossover": {"value": None}}]}))
    with pytest.raises(UsageError, match="--scale-at"):
        write(server_workdir, image="reg/specbuild:0.1", report=report)


def test_lint_rules_catch_what_production_needs(embedded_out):
    docs = read_dir(embedded_out[1])

    def broken(mutate):
        d = copy.deepcopy(docs)
        mutate(d)
        return lint(d)

    def main(d):
        return d["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]

    assert any("readOnlyRootFilesystem" in p for p in broken(lambda d: main(d)["securityContext"].update(
        readOnlyRootFilesystem=False)))
    assert any("capabilities" in p for p in broken(lambda d: main(d)["securityContext"].pop("capabilities")))
    assert any("readinessProbe" in p for p in broken(lambda d: main(d).pop("readinessProbe")))
    assert any("memory" in p for p in broken(lambda d: main(d)["resources"]["limits"].update(memory="32Gi")))
    assert any("/tmp" in p for p in broken(lambda d: main(d).update(
        volumeMounts=[m for m in main(d)["volumeMounts"] if m["mountPath"] != "/tmp"])))
    assert any("restrict" in p for p in broken(lambda d: main(d).update(
        command=[a for a in main(d)["command"] if "restricted" not in a])))
    assert any("anti-affinity" in p for p in broken(
        lambda d: d["deployment.yaml"]["spec"]["template"]["spec"].pop("affinity")))
    assert any("Prometheus" in p for p in broken(
        lambda d: d["deployment.yaml"]["spec"]["template"]["metadata"].pop("annotations")))
    assert any("PodDisruptionBudget" in p for p in broken(lambda d: d.pop("pdb.yaml")))
    assert any("8002" in p for p in broken(lambda d: d["networkpolicy.yaml"]["spec"]["ingress"][1].update(
        {"from": [{"podSelector": {}}]})))
    # and the schemas catch what the lint does not look at
    d = copy.deepcopy(docs)
    d["deployment.yaml"]["spec"]["replicas"] = "two"
    assert schema_problems(d, VERSIONS[0])


def test_embedded_needs_an_image_and_nothing_is_written(tmp_path):
    r = CliRunner().invoke(cli, ["deploy", "--workdir", str(tmp_path), "--kubernetes"])
    assert r.exit_code == 2 and "docker/embedded.Dockerfile" in r.output
    assert not (tmp_path / "kubernetes").exists()


# ---- TensorRT-LLM: the deployment deploy writes (launch.json from engines/trtllm/launch.py, configs) --------------

def trtllm_workdir(root: Path, generation: str, **opts) -> Path:
    from specbuild.engines.trtllm.launch import engine_launch, launch_json, llmapi_launch
    from specbuild.engines.trtllm.settings import settings_from

    w = root.resolve()
    repo = w / "model_repository"
    (repo / "triton" / "tensorrt_llm").mkdir(parents=True)
    options = {"trtllm_version": "0.18.0" if generation == "engine" else "1.0.0", "trtllm_generation": generation,
               **opts}
    if generation == "llmapi":
        (w / "checkpoints" / "target").mkdir(parents=True)
        options["target_dir"] = str(w / "checkpoints" / "target")
    s = settings_from(options)
    if generation == "engine":
        (w / "engines").mkdir()
        launch = engine_launch(s, repo / "triton")
        (repo / "triton" / "tensorrt_llm" / "config.pbtxt").write_text(
            f'parameters {{ key: "gpt_model_path" value: {{ string_value: "{w}/engines/target" }} }}\n')
    else:
        launch = llmapi_launch(s, repo / "triton", w / "checkpoints" / "target", repo / "trtllm_serve.yaml")
    (repo / "launch.json").write_text(launch_json(launch))
    write_manifest(repo, Manifest(stage="deploy", inputs={}, options={"backend": "trtllm"},
                                  extra={"recipe": s.recipe.to_dict(), "trtllm_options": options}))
    return w


def server_container(docs):
    if "deployment.yaml" in docs:
        return docs["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    return docs["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]


@pytest.mark.parametrize("generation,opts,gpus", [("engine", {}, 1), ("engine", {"tp": 2}, 2),
                                                  ("llmapi", {"tp": 2}, 2), ("engine", {"tp": 4, "pp": 2}, 8)])
def test_trtllm_pods_ask_for_the_gpus_of_their_layout(tmp_path, generation, opts, gpus):
    w = trtllm_workdir(tmp_path / "w", generation, **opts)
    out = write(w)
    docs = read_dir(out)
    valid_everywhere(docs)
    c = server_container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus == c["resources"]["requests"]["nvidia.com/gpu"]
    launch = json.loads((w / "model_repository" / "launch.json").read_text())
    # the release container (engine path) / the Triton llmapi container, the launch's own argv, served on 0.0.0.0
    assert c["image"] == (launch.get("triton_container") or launch["container"])
    argv = launch.get("triton_argv") or launch["argv"]
    assert c["command"][:2] == argv[:2] == ["mpirun", "--allow-run-as-root"]
    assert "--http-address=0.0.0.0" in c["command"] and "--http-address=127.0.0.1" not in c["command"]
    assert "--model-repository=/specbuild/work/model_repository/triton" in c["command"]
    assert str(w) not in "".join(p.read_text() for p in out.rglob("*.yaml"))
    assert {e["name"]: e.get("value") for e in c["env"]}.items() >= launch["env"].items()
    affinity = docs["deployment.yaml"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"]         # GPU replicas on different nodes
    trig = docs["scaledobject.yaml"]["spec"]["triggers"][0]["metadata"]
    assert 'request_type="active"' in trig["query"] and "nv_inference_pending_request_count" in trig["query"]


def test_tp4_pp2_across_two_nodes_is_a_leader_worker_set(tmp_path):
    w = trtllm_workdir(tmp_path / "w", "llmapi", tp=4, pp=2)
    with pytest.raises(UsageError, match="trtllm-multinode.Dockerfile"):     # the release container has no kubectl
        write(w, gpus_per_node=4)
    out = write(w, image="registry.example.com/trtllm-mn:25.09", gpus_per_node=4)
    docs = read_dir(out)
    valid_everywhere(docs)                       # LWS structure + its pod templates as PodTemplates, every version
    assert "deployment.yaml" not in docs
    lws = docs["leaderworkerset.yaml"]
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    for role in ("leaderTemplate", "workerTemplate"):
        res = t[role]["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == 4 == res["requests"]["nvidia.com/gpu"]
    script = t["leaderTemplate"]["spec"]["containers"][0]["command"][-1]
    assert "-mca plm_rsh_agent /specbuild-bin/kubessh" in script
    assert "'$(POD_NAME):4,$(POD_NAME)-1:4' -n 8 trtllm-llmapi-launch" in script     # one world of tp x pp ranks
    assert 'until kubectl exec "$POD_NAME-1"' in script
    assert t["workerTemplate"]["spec"]["containers"][0]["command"] == ["sleep", "infinity"]
    assert t["leaderTemplate"]["spec"]["serviceAccountName"] == "specbuild"
    assert t["workerTemplate"]["spec"]["automountServiceAccountToken"] is False
    role = next(d for d in docs["rbac.yaml"] if d["kind"] == "Role")
    assert {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]} in role["rules"]
    assert docs["service.yaml"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert docs["scaledobject.yaml"]["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    # the lint rules check the custom resource's structure too
    bad = copy.deepcopy(docs)
    bad["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    assert any("groupSize" in p for p in lint(bad))


def test_the_engine_path_across_nodes_is_refused_with_the_way_out(tmp_path):
    w = trtllm_workdir(tmp_path / "w", "engine", tp=4, pp=2, fast_logits=True)
    with pytest.raises(UsageError, match="--trtllm-generation llmapi"):
        write(w, image="registry.example.com/trtllm-mn:25.03", gpus_per_node=4)
    assert not (w / "kubernetes").exists()


def test_a_checkpoint_outside_the_workdir_is_refused(tmp_path):
    w = trtllm_workdir(tmp_path / "w", "llmapi")
    outside = tmp_path / "hf"
    outside.mkdir()
    m = json.loads((w / "model_repository" / "manifest.json").read_text())
    m["extra"]["trtllm_options"]["target_dir"] = str(outside)
    (w / "model_repository" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UsageError, match="outside"):
        write(w)


def test_bad_artifacts_are_refused(tmp_path):
    w = trtllm_workdir(tmp_path / "w", "engine")
    with pytest.raises(UsageError, match="pvc:CLAIM"):
        write(w, artifacts="/data/work")


# ---- the embedded image --------------------------------------------------------------------------------------------

def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith("#")]


@pytest.mark.parametrize("name", ["embedded.Dockerfile", "trtllm-multinode.Dockerfile"])
def test_the_dockerfiles_lint(name):
    ins = dockerfile(ROOT / "docker" / name)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in ins if i == "ARG" and "=" in a}
    for i, a in ins:
        if i == "FROM":
            image = a.split()[0]
            image = args.get(image.strip("${}"), image) if image.startswith("$") else image
            tag = image.rsplit(":", 1)[-1]
            assert ":" in image and tag != "latest" and re.search(r"\d+\.\d+", tag), image   # pinned
        assert i != "ADD", "COPY, not ADD (no remote URLs, no archive magic)"
    users = [a for i, a in ins if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    kinds = [i for i, _ in ins]
    last_user = len(kinds) - 1 - kinds[::-1].index("USER")
    assert all(n < last_user for n, i in enumerate(kinds) if i == "RUN")     # nothing runs as root after it
    text = (ROOT / "docker" / name).read_text()
    assert "HEALTHCHECK" in text and "/v2/health/" in text        # the probes, documented


def test_the_embedded_image_pins_torch_from_the_cpu_index_and_runs_as_the_manifests_user():
    from specbuild.pipeline.k8s_objects import UID

    ins = dockerfile(ROOT / "docker" / "embedded.Dockerfile")
    runs = " ".join(a for i, a in ins if i == "RUN")
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([\d.]+)"', pyproject).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in [f"{i} {a}" for i, a in ins]
    assert '"torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu' in runs
    assert runs.index("torch==") < runs.index("pip install /tmp/specbuild-src")
    assert f"--uid {UID}" in runs and [a for i, a in ins if i == "USER"][-1] == f"{UID}:{UID}"
    assert ("ENTRYPOINT", '["tritonserver"]') in ins


def test_the_image_installer_makes_a_runnable_tritonserver(tmp_path):
    pytest.importorskip("pytriton")
    r = subprocess.run([sys.executable, str(ROOT / "docker" / "install_tritonserver.py"),
                        "--backends", str(tmp_path / "backends"), "--bin", str(tmp_path / "bin")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": "/usr/bin:/bin"})     # no tritonserver on PATH: the wheel's
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "backends" / "python" / "triton_python_backend_stub").is_file()
    run = subprocess.run([str(tmp_path / "bin" / "tritonserver"), "--help"], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin"})      # nothing inherited: the wrapper's env
    text = run.stdout + run.stderr                    # --help exits 1; a missing library would fail before usage
    assert "Usage: tritonserver" in text and "--model-repository" in text
    assert "error while loading shared libraries" not in text


def _locust_script_argv(script: str) -> list[str]:
    """The Locust arguments of a pod's `sh -c` script (after `-f LOCUSTFILE`)."""
    import shlex
    line = next(x for x in script.splitlines() if "python -m locust" in x)
    return shlex.split(line.split("print(m.__file__)')\"", 1)[1])


def locust_options(argv: list[str]) -> dict:
    """Locust's own parser on `argv`, in a subprocess (importing locust here would monkey-patch this process)."""
    code = ("import json, sys\nfrom locust.argument_parser import parse_options\n"
            "o = parse_options(args=sys.argv[1:])\nprint(json.dumps({k: v for k, v in vars(o).items() "
            "if isinstance(v, (str, int, float, bool, type(None)))}))")
    r = subprocess.run([sys.executable, "-c", code, "-f", "locustfile.py", *argv], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_load_test_runs_inside_the_cluster_as_a_locust_master_and_workers(embedded_out, running_server, tmp_path):
    """`loadtest --kubernetes`: per planned run, a master Job and a Job of workers that the schemas, the lint rules,
    Locust's own argument parser and the server's NetworkPolicy accept; then the very scripts of those pods, run
    here against the real server (only the cluster's names and the pod's fixed paths swapped), end the run by
    the stop rule and print Locust's results to the log."""
    from specbuild.pipeline.k8s_locust import LOCUST_PORT, RUN_DIR, lint_loadtest
    from servers import free_ports

    workdir, kube = embedded_out
    r = CliRunner().invoke(cli, ["deploy", "--workdir", str(workdir), "--kubernetes",   # as embedded_out (others
                                 "--image", "registry.example.com/specbuild:0.1",        # render over it)
                                 "--artifacts", "s3://bucket/work", "--artifacts-secret", "aws"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "lt"
    r = CliRunner().invoke(cli, ["loadtest", "--workdir", str(workdir), "--url", running_server.http_url,
                                 "--grpc-url", running_server.grpc_url, "--metrics-url", running_server.metrics_url,
                                 "--profile", "chat", "--sweep", "users=1,3", "--setting", "off:num_draft_tokens=0",
                                 "--setting", "on:num_draft_tokens=4", "--duration", "3", "--min-requests", "4",
                                 "--max-tokens", "8", "--workers", "3", "--kubernetes", "--out", str(out)])
    assert r.exit_code == 0, r.output
    runs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert runs == ["chat-users-1-off", "chat-users-1-on", "chat-users-3-off", "chat-users-3-on"]
    assert "kubectl apply -f" in (out / "README.txt").read_text()
    server_np = read_dir(kube)["networkpolicy.yaml"]
    clients = server_np["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    server_sel = read_dir(kube)["deployment.yaml"]["spec"]["selector"]["matchLabels"]
    for run in runs:
        docs = read_dir(out / run)
        assert lint_loadtest(docs) == []
        for version in VERSIONS:
            assert schema_problems(docs, version) == [], version
        text = "".join((out / run / f).read_text() for f in docs)
        assert str(workdir) not in text and str(tmp_path) not in text   # no path of this machine
        spec = json.loads(docs["configmap.yaml"]["data"]["runspec.json"])
        assert spec["url"] == "http://specbuild.default.svc:8000" and spec["grpc_url"] == "specbuild.default.svc:8001"
        assert spec["tokenizer"] == "/specbuild/work/engines/tokenizer/tokenizer.json"
        assert (workdir / "engines/tokenizer/tokenizer.json").is_file()
        assert spec["payload"]["num_draft_tokens"] == (0 if run.endswith("off") else 4)
        master, workers = docs["master.yaml"], docs["workers.yaml"]
        for job in (master, workers):
            pod = job["spec"]["template"]
            assert clients.items() <= pod["metadata"]["labels"].items()   # the server lets them in
            terms = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            assert terms[0]["podAffinityTerm"]["labelSelector"]["matchLabels"] == server_sel   # off its nodes
            init = pod["spec"]["initContainers"][0]["command"][-1]
            assert "aws s3 sync --only-show-errors --delete s3://bucket/work/engines/tokenizer " \
                   "/specbuild/work/engines/tokenizer" in init
            assert "test -f /specbuild/work/engines/tokenizer/tokenizer.json" in init
            assert pod["spec"]["initContainers"][0]["envFrom"] == [{"secretRef": {"name": "aws"}}]
        assert workers["spec"]["completions"] == workers["spec"]["parallelism"] == 3
        if run != "chat-users-3-on":
            continue
        # Locust's own parser takes both command lines
        margv = _locust_script_argv(master["spec"]["template"]["spec"]["containers"][0]["command"][-1])
        mopts = locust_options(margv)
        assert mopts["master"] and mopts["headless"] and mopts["expect_workers"] == 3
        assert mopts["num_users"] == (1 if "users-1" in run else 3) and mopts["host"] == spec["url"]
        wscript = workers["spec"]["template"]["spec"]["containers"][0]["command"][-1]
        wopts = locust_options(_locust_script_argv(wscript))
        svc = docs["master-service.yaml"]
        assert wopts["worker"] and wopts["master_host"] == svc["metadata"]["name"]
        assert wopts["master_port"] == LOCUST_PORT
        assert svc["spec"]["selector"].items() <= master["spec"]["template"]["metadata"]["labels"].items()

    # the pods' own scripts, here: cluster names -> this machine's server, the fixed paths -> tmp_path
    docs = read_dir(out / "chat-users-3-on")
    spec = json.loads(docs["configmap.yaml"]["data"]["runspec.json"])
    spec.update(url=running_server.http_url, grpc_url=running_server.grpc_url,
                tokenizer=str(workdir / "engines/tokenizer/tokenizer.json"))
    run_dir = tmp_path / "pod"
    local = dict(spec, samples_dir=str(run_dir / "samples"), run_dir=str(run_dir))
    (tmp_path / "runspec.json").write_text(json.dumps(local))
    port = str(free_ports(1)[0])

    def here(script):
        return (script.replace(RUN_DIR, str(run_dir)).replace(f"--master-bind-port {LOCUST_PORT}",
                                                             f"--master-bind-port {port} --master-bind-host 127.0.0.1")
                .replace(f"--master-port {LOCUST_PORT}", f"--master-port {port}")
                .replace(docs["master-service.yaml"]["metadata"]["name"], "127.0.0.1")
                .replace("http://specbuild.default.svc:8000", running_server.http_url))

    env = {**os.environ, "SPECBUILD_LOADTEST_SPEC": str(tmp_path / "runspec.json"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    mscript = here(docs["master.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"][-1])
    wscript = here(docs["workers.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"][-1])
    master = subprocess.Popen(["sh", "-c", mscript], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    workers = [subprocess.Popen(["sh", "-c", wscript], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True) for _ in range(3)]
    try:
        log, _ = master.communicate(timeout=240)
        for w in workers:
            assert w.wait(timeout=60) == 0     # each worker exits when the master ends the run
    finally:
        for p in (master, *workers):
            if p.poll() is None:
                os.killpg(p.pid, 9)
    assert master.returncode == 0, log[-3000:]
    assert f"== {run_dir}/chat_stats.csv" in log and f"== {run_dir}/stop.json" in log
    stop = json.loads((run_dir / "stop.json").read_text())
    assert stop["completed"] >= 4, stop
    rows = [line.split(",") for line in (run_dir / "chat_stats.csv").read_text().splitlines()]
    aggregated = next(row for row in rows if "Aggregated" in row)
    assert int(aggregated[rows[0].index("Request Count")]) >= 4
    assert len(list((run_dir / "samples").glob("samples-*.jsonl"))) == 3   # one per worker


def test_the_load_test_for_the_cluster_needs_the_rendered_deployment_and_writes_nothing(tmp_path):
    r = CliRunner().invoke(cli, ["loadtest", "--workdir", str(tmp_path), "--kubernetes", "--out", str(tmp_path / "lt")])
    assert r.exit_code != 0
    assert "deploy --kubernetes" in r.output and "render that first" in r.output
    assert not (tmp_path / "lt").exists()
