"""`serve` / `stop` / `status`: run the real `tritonserver` on a deployed model repository.

State lives in `<workdir>/server/`: `server.json` (pid, its start time, ports, argv, the admin token;
mode 0600), `tritonserver.log`, and the Python-backend directory assembled for the pytriton wheel
(`backends/`). The server runs in its own session (process group), so `stop` can SIGTERM the whole group —
tritonserver and its Python stub processes — then SIGKILL whatever is left after the timeout, and finally
checks that the ports are free. `stop` signals only a process it can prove is the server this workdir
started: the recorded pid with the recorded start time (/proc/<pid>/stat field 22, this boot) and the
instance mark every process of the server carries in its environment (SPECBUILD_SERVER_INSTANCE).

Every API a client of the model does not need (RESTRICTED_APIS: shared-memory, model-repository,
model-config, statistics, trace, logging) is restricted, on HTTP and gRPC, to requests carrying the
per-server token (`ADMIN_HEADER`, generated at each start): see docs/serving.md for what that covers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from specbuild.core.constants import ADMIN_KEY, RESTRICTED_APIS, restriction_args  # noqa: F401 (API)
from specbuild.core import http
from specbuild.core.errors import ServerError, ToolNotAvailable, UsageError
from specbuild.core.manifest import atomic_write_text, ensure_writable_dir, read_manifest, workspace_lock
from specbuild.pipeline.stage import stage_dir
from specbuild.pipeline.tritonbin import find_tritonserver, prepare_backend_dir, server_env

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ORPHAN_GRACE_S = 3.0     # Python stubs left after tritonserver exited get this long before SIGKILL

# tritonserver 2.51 `--http-restricted-api=<apis>:<key>=<value>` / `--grpc-restricted-protocol=...` (its --help;
# server docs/customization_guide/inference_protocols.md "Limit Endpoint Access"): the categories it knows are
# health, metadata, inference, shared-memory, model-config, model-repository, statistics, trace, logging.
# health, metadata and inference stay open: they are what a client of the model (the load tests, GenAI-Perf,
# AIPerf, tritonclient) needs.
ADMIN_HEADER = ADMIN_KEY                                # HTTP: the header is the key itself
ADMIN_GRPC_HEADER = f"triton-grpc-protocol-{ADMIN_KEY}"  # gRPC: Triton prefixes the key
INSTANCE_ENV = "SPECBUILD_SERVER_INSTANCE"              # in the environment of every process of the server


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
    allow_remote: bool = False       # bind a non-loopback --host (no authentication on inference: see docs)

    def __post_init__(self):
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        for p in ports:
            if not 0 < int(p) < 65536:
                raise UsageError(f"port {p} is out of range; pass ports between 1 and 65535.")
        if len(set(ports)) != 3:
            raise UsageError(f"--http-port, --grpc-port and --metrics-port must differ (got {ports}).")
        if self.timeout <= 0:
            raise UsageError(f"--timeout must be > 0 seconds (got {self.timeout}).")
        if not is_loopback(self.host) and not self.allow_remote:
            raise UsageError(
                f"--host {self.host} would make the server reachable from other machines, and Triton does not "
                "authenticate inference: anyone who reaches the port can generate, and the bundled tritonserver "
                "2.51 carries published vulnerabilities reachable over HTTP (CVE-2025-23310/23311, "
                "CVE-2025-23319/23320/23334, CVE-2025-33201; see docs/serving.md). Put a proxy with a body-size "
                "limit and a Host check in front and bind it to 127.0.0.1, or pass --allow-remote if that is "
                "what you mean.")


def is_loopback(host: str) -> bool:
    import ipaddress

    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
    start_ticks: int = 0          # /proc/<pid>/stat field 22 (clock ticks after boot) of the server process
    boot_id: str = ""             # /proc/sys/kernel/random/boot_id when it started
    instance: str = ""            # SPECBUILD_SERVER_INSTANCE in the server's environment (and its children's)
    workdir: str = ""             # the (resolved) workdir that started it
    admin_token: str = ""         # the ADMIN_HEADER value the restricted APIs require

    @property
    def admin_headers(self) -> dict[str, str]:
        """The header that opens the restricted APIs (empty for a server started without a token)."""
        return {ADMIN_HEADER: self.admin_token} if self.admin_token else {}

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


def start_ticks(pid: int) -> int | None:
    """The process's start time, /proc/<pid>/stat field 22 (clock ticks since boot): with the pid and the boot
    it names one process, whatever pid reuse happens later. None if there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _instance_of(pid: int) -> str | None:
    """The SPECBUILD_SERVER_INSTANCE a process was started with (None: unreadable or absent)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = INSTANCE_ENV.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def why_not_ours(info: ServerInfo) -> str | None:
    """None when the recorded pid is, now, the server that `specbuild serve` started and recorded in `info`;
    else why it is not (no such process, another start time, another boot, no instance mark)."""
    if not _alive(info.pid):
        return f"pid {info.pid} is not running"
    if not info.start_ticks or not info.instance:
        return (f"the record of pid {info.pid} has no start time (written by an older specbuild): it cannot be "
                "told from another process that reused the pid")
    if info.boot_id and info.boot_id != boot_id():
        return f"pid {info.pid} was recorded before the machine rebooted"
    ticks = start_ticks(info.pid)
    if ticks != info.start_ticks:
        return f"pid {info.pid} now belongs to another process (started at tick {ticks}, not {info.start_ticks})"
    if _instance_of(info.pid) != info.instance:
        return f"pid {info.pid} does not carry this server's {INSTANCE_ENV}"
    return None


def _our_members(info: ServerInfo) -> list[int]:
    """Processes of the server's group that carry its instance mark (its Python stubs, the engine process)."""
    if not info.instance:
        return []
    return [p for p in _group_members(info.pid) if _instance_of(p) == info.instance]


def read_state(workdir) -> ServerInfo | None:
    path = _state_file(workdir)
    if not path.exists():
        return None
    try:
        return ServerInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_state(workdir, info: ServerInfo) -> None:
    # 0600: it holds the admin token
    atomic_write_text(_state_file(workdir), json.dumps(asdict(info), indent=2) + "\n", mode=0o600)


@dataclass(frozen=True)
class Endpoints:
    http: str
    grpc: str
    metrics: str
    recorded: bool          # True when they come from the server `specbuild serve` recorded in the workdir
    admin_headers: dict[str, str] = field(default_factory=dict)   # opens its restricted APIs (recorded only)


def endpoints(workdir, url: str | None = None, grpc_url: str | None = None,
              metrics_url: str | None = None) -> Endpoints:
    """Where clients reach the deployment: an explicit --url (gRPC and metrics on its host, ports 8001/8002,
    unless given too); else the server `specbuild serve` recorded in `workdir`; else 127.0.0.1:8000/8001/8002."""
    from urllib.parse import urlsplit

    info = None if url else read_state(workdir)
    if info is not None:
        return Endpoints(info.http_url, grpc_url or info.grpc_url,
                         info.metrics_url if metrics_url is None else metrics_url, recorded=True,
                         admin_headers=info.admin_headers)
    url = (url or "http://127.0.0.1:8000").rstrip("/")
    host = urlsplit(url).hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return Endpoints(url, grpc_url or f"{host}:8001",
                     f"http://{host}:8002/metrics" if metrics_url is None else metrics_url, recorded=False)




def redacted(argv: list[str]) -> list[str]:
    """argv with the admin token masked (for logs and server.json's argv)."""
    return [a.rsplit("=", 1)[0] + "=***" if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))
            else a for a in argv]


def build_argv(binary: Path, repository: Path, backend_dir: Path, opts: ServeOptions, token: str) -> list[str]:
    h = opts.host
    return [str(binary), "--model-repository", str(repository), "--backend-directory", str(backend_dir),
            "--http-address", h, "--http-port", str(opts.http_port),
            "--grpc-address", h, "--grpc-port", str(opts.grpc_port),
            "--metrics-address", h, "--metrics-port", str(opts.metrics_port),
            "--allow-metrics", "true", "--allow-gpu-metrics", "false", "--allow-cpu-metrics", "true",
            "--exit-on-error", "true", "--strict-readiness", "true",
            "--exit-timeout-secs", str(opts.exit_timeout), "--log-verbose", str(opts.log_verbose),
            *restriction_args(token)]


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
    if current and (why_not_ours(current) is None or _our_members(current)):
        raise ServerError(f"a server from {workdir} is already running (pid {current.pid}, "
                          f"{current.http_url}); run `specbuild stop --workdir {workdir}` first.")
    if not is_loopback(opts.host):
        msg = (f"warning: binding {opts.host} (--allow-remote): the server is reachable from other machines and "
               "inference is not authenticated; see docs/serving.md for the proxy to put in front.")
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
    token = secrets.token_urlsafe(32)
    instance = secrets.token_hex(16)
    argv = build_argv(binary.path, repository, backend_dir, opts, token)
    log_file = sdir / "tritonserver.log"
    say("Running: " + " ".join(redacted(argv)))
    env = {**server_env(binary), INSTANCE_ENV: instance}
    with open(log_file, "wb") as logf:
        proc = subprocess.Popen(argv, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=sdir)
    info = ServerInfo(pid=proc.pid, host=opts.host, http_port=opts.http_port, grpc_port=opts.grpc_port,
                      metrics_port=opts.metrics_port, repository=str(repository), log_file=str(log_file),
                      argv=redacted(argv), started=time.time(), start_ticks=start_ticks(proc.pid) or 0,
                      boot_id=boot_id(), instance=instance, workdir=str(workdir), admin_token=token)
    _write_state(workdir, info)
    try:
        wait_ready(info, opts.timeout, proc=proc, progress=say)
    except BaseException:
        stop(workdir, timeout=10)
        raise
    return info


def is_ready(info: ServerInfo, timeout: float = 2.0) -> bool:
    import httpx

    try:
        return http.get(f"{info.http_url}/v2/health/ready", timeout=timeout).status_code == 200
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
    here = str(Path(workdir).resolve())
    if info.workdir and info.workdir != here:
        raise ServerError(f"{_state_file(workdir)} records a server started from {info.workdir}, not {here}; "
                          f"nothing was signalled. Run `specbuild stop --workdir {info.workdir}`.")
    why = why_not_ours(info)
    members = _our_members(info)
    if why is not None and not members:
        if _alive(info.pid):
            # the pid runs, but it cannot be shown to be our server: never signal it
            raise ServerError(f"not stopping pid {info.pid}: {why}. Nothing was signalled. If our server is "
                              f"gone, remove {_state_file(workdir)}; if it still runs, stop it yourself "
                              f"(`ps -o pid,lstart,args -p {info.pid}`, then kill it).")
        log.warning("%s; removing the stale %s", why, _state_file(workdir))
        _state_file(workdir).unlink(missing_ok=True)
        return None
    pgid = info.pid  # start_new_session=True: the server leads its own process group

    def leader() -> bool:
        return why_not_ours(info) is None

    def group() -> list[int]:
        return _our_members(info)

    if leader() or group():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        orphaned_at = None
        while (leader() or group()) and time.monotonic() < deadline:
            if not leader():
                # tritonserver is gone; what is left are its Python stubs, possibly deep in an engine step for
                # requests nobody waits for any more: a short grace to exit on their own, then SIGKILL.
                orphaned_at = orphaned_at or time.monotonic()
                if time.monotonic() - orphaned_at > ORPHAN_GRACE_S:
                    break
            time.sleep(0.1)
        if leader():
            log.warning("tritonserver (pid %d) did not exit within %.0fs; sending SIGKILL", info.pid, timeout)
        if leader() or group():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            end = time.monotonic() + 10
            while (leader() or group()) and time.monotonic() < end:
                time.sleep(0.1)
    left = [p for p in ([info.pid] if leader() else []) + group() if _alive(p)]
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
    if info is None or why_not_ours(info) is not None:
        return {"running": False, "stale_state": info is not None}
    out = {"running": True, "pid": info.pid, "http": info.http_url, "grpc": info.grpc_url,
           "metrics": info.metrics_url, "log": info.log_file, "repository": info.repository,
           "ready": is_ready(info)}
    with contextlib.suppress(Exception):
        index = http.post(f"{info.http_url}/v2/repository/index", json={}, headers=info.admin_headers,
                          timeout=5).json()
        out["models"] = {m["name"]: m.get("state", "?") for m in index}
    return out


def serve_foreground(workdir: str | Path, opts: ServeOptions = ServeOptions(), *,
                     repository: str | Path | None = None,
                     progress: Callable[[str], None] | None = None) -> ServerInfo | None:
    """Start, then block until Ctrl-C (or the server dies); always stop cleanly, even mid-startup."""
    info = None
    try:
        info = start(workdir, opts, repository=repository, progress=progress)  # cleans up on its own failure
        while why_not_ours(info) is None:
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
