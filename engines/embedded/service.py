"""The engine process: ONE Engine + Frontend behind a Unix socket, fronted by every Triton model.

    python -m specbuild.engines.embedded.service --engine-dir DIR --socket PATH [--params JSON] [--parent-pid N]

Why a process of its own: behind tritonserver 2.51's Python backend, a response sent from one model's stub
to another's (the decoupled BLS hop every request used to take: client model -> `tensorrt_llm`) waits on
the receiving stub; when that stub died or stalled, the engine's one sender thread waited forever, and every
model stopped answering (bench/README.md "Soak": a dead `tensorrt_llm_bls` stub hung `ensemble` too). Here
each Triton model (`ensemble`, `tensorrt_llm_bls`, `tensorrt_llm`) holds its own connection and sends its own
responses; the engine never waits on any of them:

- every connection has its own queue of outgoing frames and its own writer thread: `push` never blocks;
- a connection that takes no bytes for `stall_timeout_s` while frames wait for it (its peer is stuck), that
  lets more than `max_pending` frames pile up, or whose peer is gone, is closed, and its live requests are
  cancelled, so their slots free; the other connections never notice;
- the metrics connection (the `tensorrt_llm` model, which owns Triton's custom metrics) acknowledges each
  push; the frontend pushes before every final reply, so a client that has its answer reads counters that
  include it. An ack that does not come within `metrics_ack_s` is not waited for again until one arrives.
  A metrics connection that says hello is sent the totals so far at once (it may come after the requests).

The process exits when its parent (the `tensorrt_llm` stub) is gone, and on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from specbuild.engines.embedded.wire_ipc import (MAX_SUBMIT_FRAME, FrameTooLarge, PeerRefused, ProtocolError,
                                                 TooLarge, check_peer, check_sizes, encode, recv, reply_to_wire,
                                                 tensor_from_wire, wire_sizes)

log = logging.getLogger("specbuild.engine")


@dataclass(frozen=True)
class ServiceOptions:
    stall_timeout_s: float = 30.0   # a peer that takes nothing this long while frames wait for it is closed
    max_pending: int = 65536        # frames queued for one connection before it is closed as stuck
    metrics_ack_s: float = 2.0      # how long a final reply waits for the metrics model's ack
    send_buffer_bytes: int = 0      # SO_SNDBUF of each connection (0: the system's); small in tests


class _Connection:
    def __init__(self, service: "EngineService", sock: socket.socket, cid: int):
        self.service, self.sock, self.cid = service, sock, cid
        self.role = "requests"
        self._out: deque[bytes] = deque()
        self._cv = threading.Condition()
        self.keys: set[str] = set()          # engine keys of this connection's live requests
        self.closed = False
        self.sending_since: float | None = None

    def start(self) -> None:
        for target, name in ((self._read_loop, "reader"), (self._write_loop, "writer")):
            threading.Thread(target=target, name=f"conn{self.cid}-{name}", daemon=True).start()

    def push(self, msg: dict) -> None:
        """Queue a frame for the peer; never blocks (a peer that falls too far behind is closed)."""
        frame = encode(msg)
        with self._cv:
            if self.closed:
                return
            overflow = len(self._out) >= self.service.options.max_pending
            if not overflow:
                self._out.append(frame)
                self._cv.notify()
        if overflow:
            self.close(f"{self.service.options.max_pending} frames waiting for it")

    def add_key(self, key: str) -> bool:
        with self._cv:
            if not self.closed:
                self.keys.add(key)
            return not self.closed

    def drop_key(self, key: str) -> None:
        with self._cv:
            self.keys.discard(key)

    def close(self, reason: str) -> None:
        with self._cv:
            if self.closed:
                return
            self.closed = True
            self._out.clear()
            try:
                # wakes a writer blocked in sendall and the reader, and tells the peer; before the writer is
                # woken: it closes the socket, and a shutdown after that is EBADF (the peer never heard of it)
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._cv.notify_all()
            keys = list(self.keys)
            self.keys.clear()
        if reason:
            log.warning("connection %d (%s) closed: %s; cancelling its %d live request(s)",
                        self.cid, self.role, reason, len(keys))
        for key in keys:
            self.service.frontend.cancel(key)
        self.service.forget(self)

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._out and not self.closed:
                    self._cv.wait()
                if self.closed:
                    break
                frames = list(self._out)
                self._out.clear()
            self.sending_since = time.monotonic()
            try:
                self.sock.sendall(b"".join(frames))
            except OSError as e:
                self.close(f"send failed ({e})")
                break
            finally:
                self.sending_since = None
        self.sock.close()

    def _read_loop(self) -> None:
        try:
            while not self.closed:
                try:
                    msg = recv(self.sock, limit=MAX_SUBMIT_FRAME)
                except FrameTooLarge as e:      # skipped undecoded; refused alone when it names its request
                    if e.key is None:
                        raise ProtocolError(str(e)) from None
                    self.service.refuse(self, e.key, str(e))
                    continue
                self._dispatch(msg)
        except ProtocolError as e:              # before OSError: it is a ConnectionError
            self.close(f"protocol error: {e}")
        except (EOFError, OSError) as e:
            self.close("" if isinstance(e, EOFError) or self.closed else f"read failed ({e})")
        except Exception as e:  # noqa: BLE001 - never leave the connection's requests held by a dead reader
            log.exception("connection %d: the reader failed", self.cid)
            self.close(f"reader failed: {type(e).__name__}: {e}")

    def _dispatch(self, msg: dict) -> None:
        """One frame; whatever it raises fails that frame's request alone (a reader that died would leave this
        connection's requests and their slots held)."""
        try:
            self.service.dispatch(self, msg)
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001
            key = msg.get("key") if msg.get("op") == "submit" else None
            log.exception("connection %d: %s frame failed", self.cid, msg.get("op"))
            if key is not None:
                self.service.refuse(self, str(key), f"the engine could not take this request: "
                                                    f"{type(e).__name__}: {e}", kind="internal")


class EngineService:
    """Serve a started `Frontend` on a Unix socket (see the module docstring)."""

    def __init__(self, frontend, path: str | Path, options: ServiceOptions = ServiceOptions()):
        self.frontend, self.path, self.options = frontend, str(path), options
        self.engine_id = uuid.uuid4().hex[:12]
        self._conns: dict[int, _Connection] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._metrics_conn: _Connection | None = None
        self._acks: dict[int, threading.Event] = {}
        self._seq = itertools.count(1)
        self._ack_lagging = False
        self._server: socket.socket | None = None

    # ---- the socket ------------------------------------------------------------------------------
    def bind(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)               # a dead engine's socket (the supervisor restarts on the same path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)                  # the socket file: its owner only
        try:
            srv.bind(self.path)
        finally:
            os.umask(old)
        srv.listen(64)
        srv.settimeout(0.5)
        self._server = srv

    def serve(self, stop: threading.Event) -> None:
        """Accept connections until `stop` is set; a watchdog closes stalled peers."""
        assert self._server is not None, "bind() first"
        threading.Thread(target=self._watch_stalls, args=(stop,), name="stall-watchdog", daemon=True).start()
        while not stop.is_set():
            try:
                sock, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                if stop.is_set():
                    break
                raise
            try:
                check_peer(sock)               # only this user's processes (the models) may submit prompts
            except (PeerRefused, OSError) as e:
                log.warning("refused a connection: %s", e)
                sock.close()
                continue
            sock.setblocking(True)
            if self.options.send_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.options.send_buffer_bytes)
            conn = _Connection(self, sock, next(self._ids))
            with self._lock:
                self._conns[conn.cid] = conn
            conn.start()
        self._server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        for conn in list(self._conns.values()):
            conn.close("")

    def forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.pop(conn.cid, None)
            if self._metrics_conn is conn:
                self._metrics_conn = None

    def _watch_stalls(self, stop: threading.Event) -> None:
        while not stop.wait(min(1.0, self.options.stall_timeout_s / 2)):
            now = time.monotonic()
            with self._lock:
                conns = list(self._conns.values())
            for conn in conns:
                since = conn.sending_since
                if since is not None and now - since > self.options.stall_timeout_s:
                    conn.close(f"its peer took nothing for {now - since:.0f} s (stall_timeout_s="
                               f"{self.options.stall_timeout_s:g})")

    # ---- messages --------------------------------------------------------------------------------
    def dispatch(self, conn: _Connection, msg: dict) -> None:
        op = msg["op"]
        if op == "submit":
            self._submit(conn, str(msg["key"]), msg.get("tensors") or {})
        elif op == "cancel":
            self.frontend.cancel(f"{conn.cid}/{msg['key']}")
        elif op == "hello":
            conn.role = str(msg.get("role", "requests"))
            if conn.role == "metrics":
                with self._lock:
                    self._metrics_conn = conn
            conn.push({"op": "ready", "engine": self.engine_id, "pid": os.getpid()})
            if conn.role == "metrics":
                # its totals so far, at once: the requests answered before it (re)connected pushed to nobody,
                # and nothing else may happen for a long time (a restart otherwise went uncounted until the
                # next request)
                self.frontend.publish_soon()
        elif op == "metrics_ack":
            event = self._acks.pop(int(msg.get("seq", 0)), None)
            self._ack_lagging = False
            if event is not None:
                event.set()
        else:
            raise ProtocolError(f"unknown op {op!r}")

    def refuse(self, conn: _Connection, key: str, error: str, kind: str = "invalid") -> None:
        """The final reply of one request, refused before the frontend saw it (counted like its refusals)."""
        from specbuild.engines.embedded.frontend import Reply

        self.frontend.count_refusal(kind)
        conn.push(reply_to_wire(key, Reply(final=True, error=error, kind=kind)))

    def _submit(self, conn: _Connection, key: str, wire_tensors: dict) -> None:
        try:
            if not isinstance(wire_tensors, dict):
                raise ProtocolError("a malformed tensor: the tensors are not a mapping")
            check_sizes({name: wire_sizes(t) for name, t in wire_tensors.items()})   # before decoding any
            tensors = {name: tensor_from_wire(t) for name, t in wire_tensors.items()}
        except (ProtocolError, TooLarge) as e:  # this request's, not the connection's: refuse it alone
            self.refuse(conn, key, str(e))
            return
        engine_key = f"{conn.cid}/{key}"

        def send(reply, key=key, engine_key=engine_key):
            if reply.final:
                conn.drop_key(engine_key)
            conn.push(reply_to_wire(key, reply))

        if conn.add_key(engine_key):
            self.frontend.handle(tensors.get, send, key=engine_key)

    def publish(self, metrics: dict) -> None:
        """The frontend's metrics sink: push to the metrics connection; wait for its ack unless it lags."""
        conn = self._metrics_conn
        if conn is None or conn.closed:
            return
        seq = next(self._seq)
        wait = not self._ack_lagging
        event = threading.Event()
        if wait:
            self._acks[seq] = event
        conn.push({"op": "metrics", "seq": seq, "m": metrics})
        if wait and not event.wait(self.options.metrics_ack_s):
            self._acks.pop(seq, None)
            self._ack_lagging = True
            log.warning("the metrics model did not acknowledge within %.1f s; not waiting for it until it does",
                        self.options.metrics_ack_s)


# ---- the process -------------------------------------------------------------------------------------
def load_frontend(engine_dir: str, params: dict, metrics_sink):
    """Engine + Frontend from the `tensorrt_llm` model's parameters (device, admission, request limits). The
    policy is engine_config.json's (the build's, or what `specbuild tune --apply` wrote there), never a parameter."""
    from specbuild.engines.embedded import Engine
    from specbuild.engines.embedded.config import ConfigError
    from specbuild.engines.embedded.frontend import Frontend, RequestLimits

    if str(params.get("policy", "")).strip():               # written by an earlier `tune --apply`
        raise ConfigError("the tensorrt_llm model's config.pbtxt carries a `policy` parameter, which the engine no "
                          f"longer reads: the policy lives in {engine_dir}/engine_config.json. Run `specbuild "
                          "deploy --force` and `specbuild tune --apply` again (or edit engine_config.json's policy).")
    engine = Engine.from_build_dir(engine_dir, device=params.get("device") or None,
                                   threads=int(params.get("threads") or 0) or None)
    admission = admission_limits(params)                    # deploy's limits ("" = the build's)
    if admission:
        engine.set_admission(**admission)
    limits = {k: int(params[k]) for k in ("max_prompt_bytes", "max_stop_words", "max_stop_word_bytes")
              if str(params.get(k, "")).strip()}
    cfg = engine.config
    log.info("speculation policy %s (%s); admission changes %s", cfg.policy.describe(), cfg.policy.source,
             admission or "none")
    log.info("engine loaded from %s (max_batch_size=%d, max_seq_len=%d, max_draft_len=%d, max_queue_size=%s, "
             "queue_timeout_s=%s, request_timeout_s=%s)", engine_dir, cfg.max_batch_size, cfg.max_seq_len,
             cfg.max_draft_len, cfg.queue_limit, cfg.queue_timeout_s, cfg.request_timeout_s)
    return Frontend(engine, RequestLimits(**limits), metrics_sink=metrics_sink)


def admission_limits(params: dict) -> dict:
    """max_queue_size (requests), queue_timeout_s and request_timeout_s (seconds); 0 = no limit; "" = keep."""
    out = {}
    if str(params.get("max_queue_size", "")).strip():
        out["max_queue_size"] = int(params["max_queue_size"])
    for key in ("queue_timeout_s", "request_timeout_s"):
        if str(params.get(key, "")).strip():
            value = float(params[key])
            out[key] = value if value > 0 else None
    return out


def _die_with_parent(parent_pid: int | None, stop: threading.Event) -> None:
    if not parent_pid:
        return
    try:  # Linux: SIGTERM when the parent goes (the poll below covers the rest)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def poll():
        while not stop.wait(1.0):
            if os.getppid() != parent_pid:
                log.warning("the tensorrt_llm model's process %d is gone; the engine stops", parent_pid)
                stop.set()

    if os.getppid() != parent_pid:
        stop.set()
    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbuild.engines.embedded.service", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--socket", required=True, help="the Unix socket path to listen on")
    ap.add_argument("--params", default="{}", help="the tensorrt_llm model's parameters as JSON")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is no longer the parent")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="specbuild-engine %(asctime)s %(levelname)s %(message)s")
    # the scheduler thread holds the GIL most of the time (a small model is Python-bound); the sender, the
    # connections' writers and readers need it in between: by default each hand-over waits up to 5 ms
    sys.setswitchinterval(0.0005)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _die_with_parent(args.parent_pid, stop)
    params = json.loads(args.params)
    options = ServiceOptions(**{k: float(params[k]) if k.endswith("_s") else int(params[k])
                                for k in ("stall_timeout_s", "max_pending", "metrics_ack_s")
                                if str(params.get(k, "")).strip()})
    holder: dict = {}
    frontend = load_frontend(args.engine_dir, params, lambda m: holder["service"].publish(m))
    service = holder["service"] = EngineService(frontend, args.socket, options)
    frontend.start()
    service.bind()                         # bound only once the engine is loaded: connecting == ready
    log.info("serving on %s (pid %d, engine %s)", args.socket, os.getpid(), service.engine_id)
    try:
        service.serve(stop)
    finally:
        frontend.close(timeout=5.0)
        log.info("engine stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
