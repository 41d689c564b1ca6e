"""serve / stop / status against the real tritonserver on a trivial repository (no engine needed)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from servers import free_ports, interruptible, reaped, serve_options
from specbuild.pipeline import serve
from specbuild.core.errors import ServerError, UsageError
from specbuild.core.manifest import Manifest, write_manifest
from specbuild.pipeline.tritonbin import find_tritonserver, prepare_backend_dir, server_env

pytestmark = pytest.mark.server

ECHO_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
ECHO_MODEL = """
import os, site
for d in os.environ.get("SPECBUILD_SITE_DIRS", "").split(os.pathsep):
    if d: site.addsitedir(d)
import numpy as np
import triton_python_backend_utils as pb_utils
import specbuild  # proves the stub sees this environment's packages (editable install included)

class TritonPythonModel:
    def initialize(self, args):
        if os.environ.get("ECHO_FAIL"):
            raise RuntimeError("echo model refuses to load (ECHO_FAIL)")
    def execute(self, requests):
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().reshape(-1)[0]
            s = r.get_response_sender()
            s.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([text], dtype=object))]),
                   flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def make_repo(workdir: Path) -> Path:
    repo = workdir / "model_repository"
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    write_manifest(repo, Manifest(stage="deploy", inputs={}, options={"backend": "embedded"}))
    return repo


def alive(pid: int) -> bool:
    return serve._alive(pid)


@pytest.fixture()
def workdir(tmp_path) -> Path:
    make_repo(tmp_path)
    yield tmp_path
    serve.stop(tmp_path, timeout=10)  # never leave a server behind, whatever the test did


def test_tritonbin_prepares_stub_and_env(tmp_path):
    binary = find_tritonserver()
    backends = prepare_backend_dir(binary, tmp_path / "be")
    if binary.source == "pytriton":
        names = {p.name for p in (backends / "python").iterdir()}
        assert {"libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"} <= names
    env = server_env(binary, base={"PATH": "/usr/bin"})
    import site
    assert site.getsitepackages()[0] in env["PYTHONPATH"].split(os.pathsep)
    assert all(Path(p).is_dir() for p in env["SPECBUILD_SITE_DIRS"].split(os.pathsep))
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


def test_start_status_stop(workdir):
    opts = serve_options()
    info = serve.start(workdir, opts)
    assert info.host == "127.0.0.1" and "--http-address" in info.argv
    r = httpx.post(f"{info.http_url}/v2/models/echo/generate", json={"text_input": "héllo"}, timeout=30)
    assert r.status_code == 200 and r.json()["text_output"] == "héllo"
    st = serve.status(workdir)
    assert st["running"] and st["ready"] and st["models"] == {"echo": "READY"}
    assert (workdir / "server" / "server.json").exists() and (workdir / "server" / "tritonserver.log").exists()
    # metrics port serves Triton's own families
    assert "nv_inference_request_success" in httpx.get(info.metrics_url, timeout=10).text
    # a second server on the same workdir is refused
    with pytest.raises(ServerError, match="already running"):
        serve.start(workdir, serve_options())
    stopped = serve.stop(workdir, timeout=20)
    assert stopped.pid == info.pid
    assert not alive(info.pid) and not serve._group_members(info.pid)
    for port in (opts.http_port, opts.grpc_port, opts.metrics_port):
        assert serve.port_free("127.0.0.1", port)
    assert serve.status(workdir) == {"running": False, "stale_state": False}
    assert serve.stop(workdir) is None


def test_port_in_use_is_refused(workdir):
    import socket

    opts = serve_options()
    with socket.socket() as s:
        s.bind(("127.0.0.1", opts.grpc_port))
        s.listen()
        with pytest.raises(ServerError, match=rf"port {opts.grpc_port} .*--grpc-port"):
            serve.start(workdir, opts)
    assert not (workdir / "server" / "server.json").exists()


def test_bad_options_refused():
    with pytest.raises(UsageError, match="must differ"):
        serve.ServeOptions(http_port=9000, grpc_port=9000, metrics_port=9002)
    with pytest.raises(UsageError, match="out of range"):
        serve.ServeOptions(http_port=70000)


def test_missing_repository_refused(tmp_path):
    from specbuild.core.errors import ManifestError

    with pytest.raises(ManifestError, match="specbuild deploy"):
        serve.start(tmp_path, serve_options())


def test_failed_model_shows_log_tail(workdir, monkeypatch):
    monkeypatch.setenv("ECHO_FAIL", "1")
    with pytest.raises(ServerError, match="echo model refuses to load") as err:
        serve.start(workdir, serve_options())
    assert "tritonserver.log" in str(err.value)
    assert serve.read_state(workdir) is None  # cleaned up


def test_cli_background_status_stop(workdir):
    from specbuild.cli.main import cli

    http, grpc, metrics = free_ports(3)
    runner = CliRunner()
    args = ["--workdir", str(workdir)]
    res = runner.invoke(cli, ["serve", *args, "--background", "--http-port", str(http), "--grpc-port", str(grpc),
                              "--metrics-port", str(metrics), "--timeout", "120"])
    assert res.exit_code == 0, res.output
    assert f"http://127.0.0.1:{http}" in res.output
    pid = serve.read_state(workdir).pid
    res = runner.invoke(cli, ["status", *args])
    assert res.exit_code == 0 and "ready" in res.output and "model echo: READY" in res.output
    res = runner.invoke(cli, ["stop", *args])
    assert res.exit_code == 0 and "ports freed" in res.output
    assert not alive(pid)
    res = runner.invoke(cli, ["status", *args])
    assert res.exit_code == 1 and "not running" in res.output
    # taken port: clean error, exit code != 0
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", http))
        s.listen()
        res = runner.invoke(cli, ["serve", *args, "--background", "--http-port", str(http),
                                  "--grpc-port", str(grpc), "--metrics-port", str(metrics)])
    assert res.exit_code != 0 and f"port {http}" in res.output


def test_foreground_serve_stops_cleanly_on_ctrl_c(workdir):
    http, grpc, metrics = free_ports(3)
    exe = Path(sys.executable).parent / "specbuild"
    proc = subprocess.Popen([str(exe), "serve", "--workdir", str(workdir), "--http-port", str(http),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
    with reaped(proc):
        deadline = time.monotonic() + 150
        while serve.read_state(workdir) is None or not serve.is_ready(serve.read_state(workdir)):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.3)
        pid = serve.read_state(workdir).pid
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "server stopped" in out
    assert not alive(pid) and not serve._group_members(pid)
    assert all(serve.port_free("127.0.0.1", p) for p in (http, grpc, metrics))


def test_trtllm_repository_needs_a_trtllm_tritonserver(workdir):
    from specbuild.core.errors import ToolNotAvailable

    if find_tritonserver().source != "pytriton":
        pytest.skip("a real tritonserver is on PATH here")
    write_manifest(workdir / "model_repository", Manifest(stage="deploy", inputs={}, options={"backend": "trtllm"}))
    with pytest.raises(ToolNotAvailable, match="TensorRT-LLM Triton container"):
        serve.start(workdir, serve_options())
    assert serve.read_state(workdir) is None


def test_stop_does_not_wait_out_the_timeout_for_orphaned_stubs(tmp_path):
    """tritonserver exits on SIGTERM but a Python stub deep in an engine step ignores it (seen in the demo:
    SIGKILL only after 30 s): once tritonserver is gone, its stubs get a short grace, then SIGKILL."""
    import json as _json

    fake = tmp_path / "fake-tritonserver"
    fake.write_text("#!/usr/bin/env bash\n(trap '' TERM; while true; do sleep 0.2; done) &\n"
                    "trap 'exit 0' TERM\nwhile true; do sleep 0.2; done\n")
    fake.chmod(0o755)
    proc = subprocess.Popen([str(fake)], start_new_session=True, env={**os.environ, serve.INSTANCE_ENV: "t1"})
    time.sleep(0.5)
    ports = free_ports(3)
    state = {"pid": proc.pid, "host": "127.0.0.1", "http_port": ports[0], "grpc_port": ports[1],
             "metrics_port": ports[2], "repository": str(tmp_path), "log_file": str(tmp_path / "log"),
             "argv": [str(fake)], "started": time.time(), "start_ticks": serve.start_ticks(proc.pid),
             "boot_id": serve.boot_id(), "instance": "t1", "workdir": str(tmp_path.resolve())}
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "server.json").write_text(_json.dumps(state))
    assert serve._group_members(proc.pid)
    t0 = time.monotonic()
    try:
        serve.stop(tmp_path, timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert time.monotonic() - t0 < 30           # not the 60 s timeout: grace of ORPHAN_GRACE_S, then SIGKILL
    assert not serve._group_members(proc.pid)
