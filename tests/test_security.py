"""The server-side security round (issue 28): the admin APIs of a `specbuild serve` server answer only with its
token, a non-loopback --host needs --allow-remote, `stop` signals only a process it can prove is its server,
outputs are readable by a server of another uid, and the dependency floors leave the published advisories out.

The probes marked `server` start the real tritonserver (2.51, the nvidia-pytriton wheel's) on a one-model
repository (test_serve's echo model)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from packaging.requirements import Requirement

from servers import free_ports, reaped, serve_options
from specbuild.core.errors import ServerError, UsageError
from specbuild.core.manifest import atomic_write_text
from specbuild.pipeline import serve

ROOT = Path(__file__).resolve().parents[1]


# --- files: 0644 for outputs, 0600 for the secret ------------------------------------------------------------

def test_atomic_writes_follow_the_umask_and_an_explicit_mode(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "out.txt", "x")
        atomic_write_text(tmp_path / "secret.json", "{}", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.txt").stat().st_mode) == 0o640     # 0666 & ~027; mkstemp gave 0600
    assert stat.S_IMODE((tmp_path / "secret.json").stat().st_mode) == 0o600
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "out.txt", "y")                        # rewriting keeps the rule
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.txt").stat().st_mode) == 0o644


# --- dependency floors ---------------------------------------------------------------------------------------

# (package, the newest release a published advisory covers): the floor must exclude it.
VULNERABLE = [("jinja2", "3.1.5"),          # CVE-2025-27516 (sandbox escape through |attr), fixed 3.1.6
              ("transformers", "4.52.4"),   # CVE-2025-6051 / 6638 / 6921 (ReDoS), fixed 4.53.0
              ("gevent", "23.7.0"),         # CVE-2023-41419 (pywsgi), fixed 23.9.0
              ("protobuf", "6.33.4")]       # CVE-2026-0994 (json_format recursion), fixed 6.33.5


@pytest.mark.parametrize("name,bad", VULNERABLE)
def test_dependency_floors_exclude_versions_with_advisories(name, bad):
    deps = {Requirement(d).name.lower(): Requirement(d) for d in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert not deps[name].specifier.contains(bad), f"{deps[name]} admits {name} {bad}"
    from importlib.metadata import version
    assert deps[name].specifier.contains(version(name), prereleases=True)   # and the installed one passes


# --- a non-loopback --host -----------------------------------------------------------------------------------

def test_a_non_loopback_host_needs_allow_remote_and_says_why(tmp_path):
    with pytest.raises(UsageError, match=r"--allow-remote") as err:
        serve.ServeOptions(host="0.0.0.0")
    assert "CVE-2025-23310" in str(err.value) and "proxy" in str(err.value)
    assert serve.ServeOptions(host="0.0.0.0", allow_remote=True).host == "0.0.0.0"
    for ok in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        serve.ServeOptions(host=ok)
    from specbuild.cli.main import cli

    res = CliRunner().invoke(cli, ["serve", "--workdir", str(tmp_path), "--host", "0.0.0.0", "--background"])
    assert res.exit_code != 0 and "--allow-remote" in res.output
    assert not (tmp_path / "server").exists()                        # refused before anything was started


# --- stop signals only its own server ------------------------------------------------------------------------

def _record(wd: Path, pid: int, **kw) -> None:
    ports = free_ports(3)
    state = {"pid": pid, "host": "127.0.0.1", "http_port": ports[0], "grpc_port": ports[1],
             "metrics_port": ports[2], "repository": str(wd), "log_file": str(wd / "log"),
             "argv": ["tritonserver"], "started": time.time(), "workdir": str(wd.resolve()), **kw}
    (wd / "server").mkdir(exist_ok=True)
    (wd / "server" / "server.json").write_text(json.dumps(state))


@pytest.fixture()
def bystander():
    """A process that is not our server (a `tritonserver`-named one, so the old name check took it for ours)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "tritonserver"],
                            start_new_session=True)
    with reaped(proc):
        deadline = time.monotonic() + 10
        while serve.start_ticks(proc.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        yield proc


@pytest.mark.parametrize("case", ["other start time", "no instance mark", "old record", "another workdir"])
def test_stop_never_signals_a_process_it_cannot_prove_is_its_server(tmp_path, bystander, case):
    ticks = serve.start_ticks(bystander.pid)
    fields = {"other start time": dict(start_ticks=ticks - 1, instance="abc", boot_id=serve.boot_id()),
              "no instance mark": dict(start_ticks=ticks, instance="abc", boot_id=serve.boot_id()),
              "old record": {},
              "another workdir": dict(start_ticks=ticks, instance="abc", workdir="/elsewhere")}[case]
    _record(tmp_path, bystander.pid, **fields)
    with pytest.raises(ServerError, match="(nothing|Nothing) was signalled"):
        serve.stop(tmp_path, timeout=5)
    time.sleep(0.3)
    assert bystander.poll() is None                                  # not signalled: still running
    assert serve.status(tmp_path)["running"] is False
    from specbuild.cli.main import cli

    res = CliRunner().invoke(cli, ["stop", "--workdir", str(tmp_path), "--timeout", "5"])
    assert res.exit_code != 0 and "signalled" in res.output
    assert bystander.poll() is None


def test_stop_removes_the_record_of_a_server_that_is_gone(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    _record(tmp_path, proc.pid, start_ticks=1, instance="abc", boot_id=serve.boot_id())
    assert serve.stop(tmp_path) is None and serve.read_state(tmp_path) is None


def test_stop_does_signal_the_process_it_started(tmp_path):
    """The same record, made true: the pid with its own start time and the instance mark in its environment."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                            env={**os.environ, serve.INSTANCE_ENV: "abc"})
    with reaped(proc):
        deadline = time.monotonic() + 10
        while serve._instance_of(proc.pid) != "abc" and time.monotonic() < deadline:
            time.sleep(0.05)
        _record(tmp_path, proc.pid, start_ticks=serve.start_ticks(proc.pid), instance="abc",
                boot_id=serve.boot_id())
        assert serve.why_not_ours(serve.read_state(tmp_path)) is None
        assert serve.stop(tmp_path, timeout=10).pid == proc.pid
        proc.wait(timeout=10)                                        # SIGTERM'd (stop reaped it)
        assert not serve._alive(proc.pid)


# --- the real server: restricted admin APIs ------------------------------------------------------------------

# (method, path) of every admin API a client of the model does not need: tritonserver 2.51's categories
# shared-memory, model-config, model-repository, statistics, trace, logging.
RESTRICTED = [("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/cudasharedmemory/status"),
              ("GET", "/v2/models/echo/config"), ("POST", "/v2/repository/index"),
              ("GET", "/v2/models/echo/stats"), ("GET", "/v2/trace/setting"),
              ("GET", "/v2/models/echo/trace/setting"), ("GET", "/v2/logging")]
OPEN = [("GET", "/v2/health/ready"), ("GET", "/v2/health/live"), ("GET", "/v2"), ("GET", "/v2/models/echo"),
        ("GET", "/v2/models/echo/ready")]


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    from test_serve import make_repo

    wd = tmp_path_factory.mktemp("secure")
    make_repo(wd)
    info = serve.start(wd, serve_options())
    try:
        yield wd, info
    finally:
        serve.stop(wd, timeout=20)


@pytest.mark.server
def test_admin_apis_answer_only_with_the_token(echo_server):
    wd, info = echo_server
    base = info.http_url
    assert info.admin_token and len(info.admin_token) >= 32
    with httpx.Client(timeout=30) as c:
        for method, path in RESTRICTED:
            for host in (None, "evil.example"):
                headers = {"Host": host} if host else {}
                r = c.request(method, base + path, headers=headers)
                assert r.status_code == 403, (method, path, host, r.status_code, r.text)
            r = c.request(method, base + path, headers={serve.ADMIN_HEADER: "wrong"})
            assert r.status_code == 403, (method, path, "wrong token", r.status_code)
            r = c.request(method, base + path, headers=info.admin_headers)
            assert r.status_code == 200, (method, path, r.status_code, r.text)
        for method, path in OPEN:                          # what the load tests, GenAI-Perf and AIPerf need
            assert c.request(method, base + path).status_code == 200, path
        meta = c.get(f"{base}/v2/models/echo").json()
        assert [i["name"] for i in meta["inputs"]] == ["text_input"]     # load tests read input names here
        r = c.post(f"{base}/v2/models/echo/generate", json={"text_input": "hi"})
        assert r.status_code == 200 and r.json()["text_output"] == "hi"
        # a web page's "simple" cross-origin POST (text/plain, no custom header) cannot unload the model
        r = c.post(f"{base}/v2/repository/models/echo/unload", content="{}",
                   headers={"Content-Type": "text/plain", "Origin": "http://evil.example", "Host": "evil.example"})
        assert r.status_code == 403
        assert c.get(f"{base}/v2/models/echo/ready").status_code == 200
        # logging cannot be changed without the token either
        r = c.post(f"{base}/v2/logging", json={"log_verbose_level": 1})
        assert r.status_code == 403


@pytest.mark.server
def test_grpc_admin_apis_answer_only_with_the_token(echo_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    _, info = echo_server
    c = grpcclient.InferenceServerClient(info.grpc_url)
    try:
        assert c.is_server_ready() and c.get_model_metadata("echo").name == "echo"   # open
        for call in (lambda **h: c.get_model_config("echo", **h),
                     lambda **h: c.get_model_repository_index(**h),
                     lambda **h: c.get_inference_statistics("echo", **h),
                     lambda **h: c.get_log_settings(**h),
                     lambda **h: c.get_trace_settings(**h),
                     lambda **h: c.get_system_shared_memory_status(**h)):
            with pytest.raises(InferenceServerException):
                call()
            call(headers={serve.ADMIN_GRPC_HEADER: info.admin_token})
    finally:
        c.close()


@pytest.mark.server
def test_the_token_is_kept_private_and_our_clients_send_it(echo_server):
    wd, info = echo_server
    state = wd / "server" / "server.json"
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert info.admin_token in state.read_text()
    assert not any(info.admin_token in a for a in json.loads(state.read_text())["argv"])
    assert info.admin_token not in (wd / "server" / "tritonserver.log").read_text()
    st = serve.status(wd)                      # `specbuild status` lists the models through the token
    assert st["ready"] and st["models"] == {"echo": "READY"}
    from specbuild.loadtests import target

    assert target.preflight(info.http_url, "echo", headers=info.admin_headers).batch_dim is False  # read config
    assert serve.endpoints(wd).admin_headers == info.admin_headers


@pytest.mark.server
def test_every_start_gets_a_new_token(echo_server, tmp_path):
    from test_serve import make_repo

    make_repo(tmp_path)
    other = serve.start(tmp_path, serve_options())
    try:
        assert other.admin_token != echo_server[1].admin_token
        r = httpx.get(f"{other.http_url}/v2/logging", headers=echo_server[1].admin_headers, timeout=30)
        assert r.status_code == 403                                  # one server's token opens only that server
    finally:
        serve.stop(tmp_path, timeout=20)


def test_engine_config_is_readable_by_a_server_of_another_uid(tmp_path):
    """engine_config.json is written like every other output (0666 & ~umask), not mkstemp's 0600: a server that runs
    as another uid must read it."""
    from specbuild.engines.embedded.config import EngineConfig

    old = os.umask(0o022)
    try:
        path = EngineConfig(draft="draft").save(tmp_path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644 and EngineConfig.load(tmp_path).draft == "draft"


def test_embedded_deploy_escapes_the_engine_path_in_config_pbtxt(tmp_path):
    """A backslash or a quote in the engine directory's path survives into the parsed config, unchanged."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from specbuild.engines.embedded.deploy import DEFAULTS, render

    odd = tmp_path / 'we\\nird"dir'          # a backslash before an n: unescaped, a newline
    odd.mkdir()
    files = render(odd, {**DEFAULTS, "max_batch_size": 2})
    cfg = text_format.Parse(files["tensorrt_llm/config.pbtxt"], model_config_pb2.ModelConfig())
    assert cfg.parameters["engine_dir"].string_value == str(odd.resolve())
