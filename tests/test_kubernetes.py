"""`specbuild deploy --kubernetes`: manifests that parse, probe Triton's health endpoints, expose the three ports,
carry Prometheus annotations and mount the workspace where the rendered configs expect it."""

import yaml
from click.testing import CliRunner

from specbuild.cli.main import cli
from specbuild.pipeline.kubernetes import render


def test_embedded_manifests_from_a_real_deployment(server_workdir, tmp_path):
    r = CliRunner().invoke(cli, ["deploy", "--workdir", str(server_workdir), "--kubernetes",
                                 "--image", "registry.example.com/specbuild:0.1", "--replicas", "2"])
    assert r.exit_code == 0, r.output
    out = server_workdir / "kubernetes"
    dep = yaml.safe_load((out / "deployment.yaml").read_text())
    svc = yaml.safe_load((out / "service.yaml").read_text())
    assert (out / "manifest.json").is_file()
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    c = pod["spec"]["containers"][0]
    assert c["image"] == "registry.example.com/specbuild:0.1"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert f"--model-repository={server_workdir.resolve() / 'model_repository'}" in c["command"]
    assert "--http-address=0.0.0.0" in c["command"]          # inside a pod; the CLI's own serve stays on loopback
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {str(server_workdir.resolve())}
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {8000, 8001, 8002}
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_embedded_needs_an_image_and_nothing_is_written(tmp_path):
    r = CliRunner().invoke(cli, ["deploy", "--workdir", str(tmp_path), "--kubernetes"])
    assert r.exit_code == 2 and "--image" in r.output
    assert not (tmp_path / "kubernetes").exists()


def test_trtllm_pods_ask_for_gpus_and_run_the_launch_script(tmp_path):
    docs = render(name="spec", backend="trtllm", image="nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3",
                  workdir=tmp_path, claim="work", gpus=2)
    c = docs["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["command"] == ["bash", str(tmp_path.resolve() / "model_repository" / "launch.sh")]
