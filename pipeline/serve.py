"""`serve` / `stop` / `status`: run the real `tritonserver` on a deployed model repository.

State lives in `<workdir>/server/`: `server.json` (pid, ports, argv), `tritonserver.log`, and the
Python-backend directory assembled for the pytriton wheel (`backends/`). The server runs in its own
session (process group), so `stop` can SIGTERM the whole group — tritonserver and its Python stub
processes — then SIGKILL whatever is left after the timeout, and finally checks that the ports are free.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from specbuild.core.errors import ServerError, ToolNotAvailable, UsageError
from specbuild.core.manifest import atomic_write_text, ensure_writable_dir, read_manifest, workspace_lock
from specbuild.pipeline.stage import stage_dir
from specbuild.pipeline.tritonbin import find_tritonserver, prepare_backend_dir, server_env

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ORPHAN_GRACE_S = 3.0     # Python stubs left after tritonserver exited get this long before SIGKILL


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    timeout: float = 300.0           # seconds to wait for /v2/health/ready
    exit_timeout: int = 5            # tritonserver --exit-timeout-secs (it waits this long for open connections)
    log_verbose: int = 0
    tritonserver: str | None = None  # explicit binary; default: PATH, then the nvidia-pytriton wheel

    def __post_init__(self):
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        for p in ports:
            if not 0 < int(p) < 65536:
                raise UsageError(f"port {p} is out of range; pass ports between 1 and 65535.")
        if len(set(ports)) != 3:
            raise UsageError(f"--http-port, --grpc-port and --metrics-port must differ (got {ports}).")
        if self.timeout <= 0:
            raise UsageError(f"--timeout must be > 0 seconds (got {self.timeout}).")


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    repository: str
    log_file: str
    argv: list[str] = field(default_factory=list)
    started: float = 0.0

    @property
    def _h(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"[{host}]" if ":" in host else host

    @property
    def http_url(self) -> str:
        return f"http://{self._h}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._h}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._h}:{self.metrics_port}/metrics"


def server_dir(workdir: str | Path) -> Path:
    return Path(workdir) / "server"


def _state_file(workdir) -> Path:
    return server_dir(workdir) / "server.json"


def log_tail(path: str | Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child that exited: reap it
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _group_members(pgid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(p.name))
    return out


def _is_tritonserver(pid: int) -> bool:
    try:
        return b"tritonserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def read_state(workdir) -> ServerInfo | None:
    path = _state_file(workdir)
    if not path.exists():
        return None
    try:
        return ServerInfo(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Endpoints:
    http: str
    grpc: str
    metrics: str
    recorded: bool          # True when they come from the server `specbuild serve` recorded in the workdir


def endpoints(workdir, url: str | None = None, grpc_url: str | None = None,
              metrics_url: str | None = None) -> Endpoints:
    """Where clients reach the deployment: an explicit --url (gRPC and metrics on its host, ports 8001/8002,
    unless given too); else the server `specbuild serve` recorded in `workdir`; else 127.0.0.1:8000/8001/8002."""
    from urllib.parse import urlsplit

    info = None if url else read_state(workdir)
    if info is not None:
        return Endpoints(info.http_url, grpc_url or info.grpc_url,
                         info.metrics_url if metrics_url is None else metrics_url, recorded=True)
    url = (url or "http://127.0.0.1:8000").rstrip("/")
    host = urlsplit(url).hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return Endpoints(url, grpc_url or f"{host}:8001",
                     f"http://{host}:8002/metrics" if metrics_url is None else metrics_url, recorded=False)


def build_argv(binary: Path, repository: Path, backend_dir: Path, opts: ServeOptions) -> list[str]:
    h = opts.host
    return [str(binary), "--model-repository", str(repository), "--backend-directory", str(backend_dir),
            "--http-address", h, "--http-port", str(opts.http_port),
            "--grpc-address", h, "--grpc-port", str(opts.grpc_port),
            "--metrics-address", h, "--metrics-port", str(opts.metrics_port),
            "--allow-metrics", "true", "--allow-gpu-metrics", "false", "--allow-cpu-metrics", "true",
            "--exit-on-error", "true", "--strict-readiness", "true",
            "--exit-timeout-secs", str(opts.exit_timeout), "--log-verbose", str(opts.log_verbose)]


def start(workdir: str | Path, opts: ServeOptions = ServeOptions(), *, repository: str | Path | None = None,
          progress: Callable[[str], None] | None = None) -> ServerInfo:
    """Start tritonserver in the background and wait until `/v2/health/ready`; return its ServerInfo.

    `repository` defaults to `<workdir>/model_repository` (the output of `specbuild deploy`). Holds the
    workspace lock until the server is ready: a second `serve` (or a stage) in the same workspace refuses.
    """
    with workspace_lock(Path(workdir).resolve(), "specbuild serve (starting)"):
        return _start(workdir, opts, repository=repository, progress=progress)


def _start(workdir: str | Path, opts: ServeOptions, *, repository: str | Path | None,
           progress: Callable[[str], None] | None) -> ServerInfo:
    say = progress or log.info
    workdir = Path(workdir).resolve()  # tritonserver runs with cwd=<workdir>/server: every path absolute
    backend = None
    if repository is None:
        repository = stage_dir(workdir, "deploy")
        # refuses a missing or half-written repository
        backend = read_manifest(repository, "deploy").get("options", {}).get("backend")
        if (repository / "triton").is_dir():  # trtllm: models live in triton/, launch files beside it
            repository = repository / "triton"
    repository = Path(repository).resolve()
    current = read_state(workdir)
    if current and _alive(current.pid) and _is_tritonserver(current.pid):
        raise ServerError(f"a server from {workdir} is already running (pid {current.pid}, "
                          f"{current.http_url}); run `specbuild stop --workdir {workdir}` first.")
    if opts.host not in LOOPBACK:
        msg = f"warning: binding {opts.host}: the server is reachable from other machines (no authentication)."
        say(msg) if progress else log.warning(msg)
    for name, port in (("--http-port", opts.http_port), ("--grpc-port", opts.grpc_port),
                       ("--metrics-port", opts.metrics_port)):
        if not port_free(opts.host, port):
            raise ServerError(f"port {port} on {opts.host} is already in use; pass a free {name} "
                              "(or stop whatever listens there).")
    binary = find_tritonserver(opts.tritonserver)
    if backend == "trtllm" and binary.source == "pytriton":
        raise ToolNotAvailable("this repository was deployed with --backend trtllm: it needs the tritonserver "
                               "of a TensorRT-LLM Triton container (tensorrtllm backend, GPU), not the "
                               "nvidia-pytriton one; run `specbuild serve` inside that container or pass "
                               "--tritonserver.")
    sdir = ensure_writable_dir(server_dir(workdir))
    backend_dir = prepare_backend_dir(binary, sdir / "backends").resolve()
    argv = build_argv(binary.path, repository, backend_dir, opts)
    log_file = sdir / "tritonserver.log"
    say("Running: " + " ".join(argv))
    with open(log_file, "wb") as logf:
        proc = subprocess.Popen(argv, env=server_env(binary), stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=sdir)
    info = ServerInfo(pid=proc.pid, host=opts.host, http_port=opts.http_port, grpc_port=opts.grpc_port,
                      metrics_port=opts.metrics_port, repository=str(repository), log_file=str(log_file),
                      argv=argv, started=time.time())
    atomic_write_text(_state_file(workdir), json.dumps(asdict(info), indent=2) + "\n")
    try:
        wait_ready(info, opts.timeout, proc=proc, progress=say)
    except BaseException:
        stop(workdir, timeout=10)
        raise
    return info


def is_ready(info: ServerInfo, timeout: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(f"{info.http_url}/v2/health/ready", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(info: ServerInfo, timeout: float, *, proc: subprocess.Popen | None = None,
               progress: Callable[[str], None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if (proc.poll() is not None) if proc else not _alive(info.pid):
            code = proc.returncode if proc else "?"
            raise ServerError(f"tritonserver exited (code {code}) before becoming ready; "
                              f"last lines of {info.log_file}:\n{log_tail(info.log_file)}")
        if is_ready(info):
            if progress:
                progress(f"ready: {info.http_url} (gRPC {info.grpc_url}, metrics {info.metrics_url})")
            return
        if time.monotonic() > deadline:
            raise ServerError(f"tritonserver was not ready after {timeout:.0f}s; try a larger --timeout. "
                              f"Last lines of {info.log_file}:\n{log_tail(info.log_file)}")
        time.sleep(0.25)


def stop(workdir: str | Path, timeout: float = 30.0) -> ServerInfo | None:
    """SIGTERM the server's process group, SIGKILL after `timeout`; None if nothing was running.

    Raises ServerError if a process survives or a port stays bound.
    """
    info = read_state(workdir)
    if info is None:
        return None
    if _alive(info.pid) and not _is_tritonserver(info.pid):
        log.warning("pid %d is no longer tritonserver; removing the stale %s", info.pid, _state_file(workdir))
        _state_file(workdir).unlink(missing_ok=True)
        return None
    pgid = info.pid  # start_new_session=True: the server leads its own process group
    if _alive(info.pid) or _group_members(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        orphaned_at = None
        while (_alive(info.pid) or _group_members(pgid)) and time.monotonic() < deadline:
            if not _alive(info.pid):
                # tritonserver is gone; what is left are its Python stubs, possibly deep in an engine step for
                # requests nobody waits for any more: a short grace to exit on their own, then SIGKILL.
                orphaned_at = orphaned_at or time.monotonic()
                if time.monotonic() - orphaned_at > ORPHAN_GRACE_S:
                    break
            time.sleep(0.1)
        if _alive(info.pid):
            log.warning("tritonserver (pid %d) did not exit within %.0fs; sending SIGKILL", info.pid, timeout)
        if _alive(info.pid) or _group_members(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            end = time.monotonic() + 10
            while (_alive(info.pid) or _group_members(pgid)) and time.monotonic() < end:
                time.sleep(0.1)
    left = [p for p in [info.pid, *_group_members(pgid)] if _alive(p)]
    if left:
        raise ServerError(f"processes {sorted(set(left))} of the server survived SIGKILL; check them with ps.")
    _wait_ports_free(info, 10.0)
    with contextlib.suppress(OSError):
        _state_file(workdir).unlink()
    return info


def _wait_ports_free(info: ServerInfo, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    ports = (info.http_port, info.grpc_port, info.metrics_port)
    while True:
        busy = [p for p in ports if not port_free(info.host, p)]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise ServerError(f"server stopped but ports {busy} on {info.host} are still bound; "
                              "another process may be using them.")
        time.sleep(0.1)


def status(workdir: str | Path) -> dict:
    """What `specbuild status` prints: running?, ready?, URLs, models and their states."""
    info = read_state(workdir)
    if info is None or not _alive(info.pid) or not _is_tritonserver(info.pid):
        return {"running": False, "stale_state": info is not None}
    out = {"running": True, "pid": info.pid, "http": info.http_url, "grpc": info.grpc_url,
           "metrics": info.metrics_url, "log": info.log_file, "repository": info.repository,
           "ready": is_ready(info)}
    with contextlib.suppress(Exception):
        import httpx

        index = httpx.post(f"{info.http_url}/v2/repository/index", json={}, timeout=5).json()
        out["models"] = {m["name"]: m.get("state", "?") for m in index}
    return out


def serve_foreground(workdir: str | Path, opts: ServeOptions = ServeOptions(), *,
                     repository: str | Path | None = None,
                     progress: Callable[[str], None] | None = None) -> ServerInfo | None:
    """Start, then block until Ctrl-C (or the server dies); always stop cleanly, even mid-startup."""
    info = None
    try:
        info = start(workdir, opts, repository=repository, progress=progress)  # cleans up on its own failure
        while _alive(info.pid):
            time.sleep(0.5)
        raise ServerError(f"tritonserver exited unexpectedly; last lines of {info.log_file}:\n"
                          f"{log_tail(info.log_file)}")
    except KeyboardInterrupt:
        if progress:
            progress("stopping tritonserver ...")
    finally:
        if info is not None:
            stop(workdir)
    return info
