"""The Triton side of the engine process (no Triton imports): where its socket lives, a connection to it,
and the supervisor that starts it and starts it again when it dies.

    path = socket_path(model_repository, os.getppid())      # the same for every model of one tritonserver
    proc = EngineProcess(argv_for(engine_dir, path, params), path, start_timeout=600); proc.start(); proc.watch()
    conn = EngineConnection(path, on_frame=..., on_lost=...)
    conn.send({"op": "submit", "key": "7", "tensors": {...}})

See `service.py` for the protocol and why the engine runs in a process of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from specbuild.engines.embedded.wire_ipc import PeerRefused, check_peer, encode, recv

log = logging.getLogger(__name__)


class EngineUnavailable(ConnectionError):
    """The engine process cannot be reached (not started, restarting, or gone); the request gets a 503."""


SUN_PATH_MAX = 107     # bytes of an AF_UNIX socket path (sun_path is 108 bytes with its NUL, Linux unix(7))


def socket_dir() -> Path:
    """This user's private directory for engine sockets: `<tmp>/specbuild-<uid>`, made with mode 0700 and checked
    WITHOUT following a link (another local user could plant a symlink or a directory of their own there to
    point the models at a fake engine): a real directory, owned by this user, mode 0700; PermissionError if not."""
    uid = os.getuid()
    base = Path(tempfile.gettempdir()) / f"specbuild-{uid}"
    try:
        os.mkdir(base, 0o700)          # never follows a link: an existing name (a link too) is FileExistsError
    except FileExistsError:
        pass
    fix = (f"remove {base} (rm -r, it only holds engine sockets) or point TMPDIR elsewhere; it must be this "
           f"user's (uid {uid}) own directory with mode 0700.")
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:               # ELOOP: a symlink; ENOTDIR: not a directory
        kind = "a symlink" if os.path.islink(base) else "not a directory"
        raise PermissionError(f"{base} is {kind} ({e.strerror}); {fix}") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise PermissionError(f"{base} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}; {fix}")
    return base


def socket_path(model_repository: str | Path, server_pid: int) -> str:
    """A private path for one tritonserver (its pid) serving one model repository, in `socket_dir()`; ValueError
    if it is longer than an AF_UNIX path may be."""
    digest = hashlib.sha256(os.path.realpath(model_repository).encode()).hexdigest()[:12]
    path = str(socket_dir() / f"engine-{digest}-{server_pid}.sock")
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise ValueError(f"the engine socket path {path} is {len(os.fsencode(path))} bytes, above the "
                         f"{SUN_PATH_MAX} an AF_UNIX socket path may have; set TMPDIR to a shorter directory "
                         "(e.g. TMPDIR=/tmp).")
    return path


def python_executable() -> str:
    """The interpreter that runs the engine process: $SPECBUILD_PYTHON (`specbuild serve` sets it), else python3."""
    exe = os.environ.get("SPECBUILD_PYTHON") or shutil.which("python3") or shutil.which("python")
    if not exe:
        raise EngineUnavailable("no Python interpreter for the engine process: set SPECBUILD_PYTHON to the python "
                                "of the environment specbuild is installed in.")
    return exe


def argv_for(engine_dir: str, path: str, params: dict) -> list[str]:
    return [python_executable(), "-m", "specbuild.engines.embedded.service", "--engine-dir", engine_dir,
            "--socket", path, "--params", json.dumps(params), "--parent-pid", str(os.getpid())]


class EngineConnection:
    """One connection to the engine process, shared by the threads of one Triton model.

    `send` connects on first use (waiting up to `connect_timeout` s for the socket) and raises EngineUnavailable
    when it cannot; a reader thread hands every frame to `on_frame`; when the connection breaks,
    `on_lost(reason, generation)` is called once (from a thread of its own) and the next `send` connects again.
    Each connection made has a generation (1, 2, ...): `send(msg, sent_on=f)` calls `f(generation)` under the
    connection's lock before the bytes go, so an owner can tell the requests of a lost connection from those
    already sent on the next one."""

    def __init__(self, path: str, on_frame: Callable[[dict], None], on_lost: Callable[[str], None], *,
                 role: str = "requests", connect_timeout: float = 5.0, send_timeout: float = 30.0):
        self.path, self.role = path, role
        self.on_frame, self.on_lost = on_frame, on_lost
        self.connect_timeout, self.send_timeout = connect_timeout, send_timeout
        self.engine_id: str | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()          # connect / send
        self._closed = False
        self.generation = 0                    # of the current connection (incremented at each connect)

    def open(self) -> None:
        """Connect now (instead of at the first send); EngineUnavailable if the engine does not answer."""
        with self._lock:
            if self._sock is None:
                self._connect()

    def send(self, msg: dict, sent_on: Callable[[int], None] | None = None) -> None:
        frame = encode(msg)
        with self._lock:
            sock = self._sock or self._connect()
            if sent_on is not None:
                sent_on(self.generation)
            try:
                sock.sendall(frame)
            except OSError as e:
                self._drop(sock, f"send failed ({e})")
                raise EngineUnavailable(f"the engine process connection broke: {e}") from None

    def close(self) -> None:
        self._closed = True
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _connect(self) -> socket.socket:
        if self._closed:
            raise EngineUnavailable("the model is shutting down")
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                sock, ready = _hello(self.path, self.role, timeout=max(1.0, self.connect_timeout))
                break
            except PeerRefused as e:
                raise EngineUnavailable(f"the engine socket {self.path} is served by another user: {e}") from None
            except (OSError, EOFError) as e:
                if time.monotonic() >= deadline:
                    raise EngineUnavailable(f"the engine process is not running ({self.path}: {e}); it may be "
                                            "starting or restarting; retry shortly.") from None
                time.sleep(0.1)
        sock.settimeout(self.send_timeout)     # sends: a stuck engine fails the sender instead of hanging it
        self.engine_id = ready.get("engine")
        self._sock = sock
        self.generation += 1
        threading.Thread(target=self._read_loop, args=(sock, self.generation), name=f"engine-{self.role}-reader",
                         daemon=True).start()
        return sock

    def _read_loop(self, sock: socket.socket, generation: int) -> None:
        reason = "the engine closed the connection"
        try:
            while True:
                try:
                    msg = recv(sock)
                except socket.timeout:
                    continue                   # the timeout bounds sends; an idle read just goes on
                self.on_frame(msg)
        except EOFError:
            pass
        except Exception as e:  # noqa: BLE001 - the connection is over whatever broke it
            reason = f"{type(e).__name__}: {e}"
        with self._lock:
            self._drop(sock, reason)

    def _drop(self, sock: socket.socket, reason: str) -> None:
        """(lock held) Forget `sock` if it is still the current one, and tell the owner once."""
        if self._sock is not sock:
            return
        generation = self.generation
        self._sock = None
        try:
            sock.close()
        except OSError:
            pass
        if not self._closed:
            threading.Thread(target=self.on_lost, args=(reason, generation), daemon=True).start()


class EngineProcess:
    """Start the engine process, wait until it serves, and start it again whenever it exits without the server
    having asked (`stop`): a crash, a kill, and also a SIGTERM from anyone else (the engine then exits 0, which
    is no reason to leave the server without an engine: every request would fail while /v2/health/ready says 200).

    The engine leads a session of its own, so signals to the server's process group (`specbuild stop`'s
    SIGTERM, a terminal's Ctrl-C) do not reach it: it stops when the `tensorrt_llm` model unloads (`stop`) or
    when that model's process is gone (the engine's PR_SET_PDEATHSIG and parent poll, `service.py`)."""

    def __init__(self, argv: list[str], path: str, *, start_timeout: float,
                 on_restart: Callable[[], None] | None = None):
        self.argv, self.path, self.start_timeout, self.on_restart = argv, path, start_timeout, on_restart
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()          # proc: started / stopped one at a time

    @property
    def serving(self) -> bool:
        """The engine process is running and its socket answers now."""
        proc = self.proc
        return proc is not None and proc.poll() is None and not self._stopping.is_set() and _answers(self.path)

    def start(self) -> None:
        """Start the process and return once its socket answers (within `start_timeout` s); raise RuntimeError
        if it exits first, does not answer in time, or the model is stopping."""
        log.info("starting the engine process: %s", " ".join(self.argv[:6]))
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the model is stopping; the engine is not started again.")
            self.proc = proc = subprocess.Popen(self.argv, stdout=sys.stderr, stderr=sys.stderr,
                                                start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while True:
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"the engine process exited with code {code} while loading; its log is in "
                                   "the server log (lines 'specbuild-engine ...').")
            if self._stopping.is_set():
                raise RuntimeError("the model is stopping; the engine is not started again.")
            if _answers(self.path):
                return
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"the engine process did not serve within {self.start_timeout:.0f} s.")
            time.sleep(0.1)

    def watch(self) -> None:
        threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True).start()

    def _supervise(self) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            proc = self.proc
            code = proc.wait()
            if self._stopping.is_set():
                return
            self.restarts += 1
            how = f"signal {-code}" if code < 0 else f"code {code}"
            log.error("the engine process (pid %d) exited (%s) though the server did not stop it; starting it "
                      "again in %.0f s (restart %d)", proc.pid, how, backoff, self.restarts)
            if self._stopping.wait(backoff):
                return
            started = time.monotonic()
            try:
                self.start()
            except (RuntimeError, PeerRefused) as e:
                log.error("restarting the engine failed: %s", e)
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = 1.0 if time.monotonic() - started > 60 else min(backoff * 2, 30.0)
            if self.on_restart is not None:
                self.on_restart()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _hello(path: str, role: str, timeout: float) -> tuple[socket.socket, dict]:
    """Connect and introduce ourselves; the socket and the engine's "ready" (OSError / EOFError if it does not
    answer that way)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        check_peer(sock)                   # the engine is ours (same uid), before a prompt goes to it
        sock.sendall(encode({"op": "hello", "role": role}))
        ready = recv(sock)
        if ready.get("op") != "ready":
            raise ConnectionError(f"unexpected answer {ready.get('op')!r}")
        return sock, ready
    except BaseException:
        sock.close()
        raise


def _answers(path: str) -> bool:
    try:
        sock, _ = _hello(path, "probe", timeout=2.0)
    except PeerRefused:
        raise
    except (OSError, EOFError):
        return False
    sock.close()
    return True
