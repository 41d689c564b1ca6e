"""Real tritonserver fixtures for the test suite (registered in conftest.py via `pytest_plugins`).

* `free_ports(n)`: n distinct free TCP ports on 127.0.0.1.
* `server_workdir`: a session-scoped workspace with the tiny Llama target + draft taken through the real
  pipeline (convert -> build -> deploy, library functions).
* `running_server`: a session-scoped real tritonserver serving that workspace on free ports. It yields a
  `ServerHandle` (http_url, grpc_url, metrics_url, workdir, info, restart()) shared by every module that
  asks for it (end-to-end, verify and load-test tests), and stops it (no process, ports freed) at the end.

    def test_something(running_server):
        from specbuild.pipeline.client import Client
        gen = Client(running_server.http_url, running_server.grpc_url).generate("Hello", max_tokens=8)
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from specbuild.pipeline import serve

START_TIMEOUT = 240.0  # generous: loading the engine on a busy 2-core CI box


def free_ports(n: int = 3) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def reaped(proc):
    """Run the block with `proc` (a process the test started); on the way out, however it ends, kill that
    process by its own PID if it still runs and reap it."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def serve_options(**kw) -> serve.ServeOptions:
    http, grpc, metrics = free_ports(3)
    return serve.ServeOptions(http_port=http, grpc_port=grpc, metrics_port=metrics, timeout=START_TIMEOUT,
                              exit_timeout=5, **kw)


@dataclass
class ServerHandle:
    workdir: Path
    options: serve.ServeOptions
    info: serve.ServerInfo

    @property
    def http_url(self) -> str:
        return self.info.http_url

    @property
    def grpc_url(self) -> str:
        return self.info.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.info.metrics_url

    def stop(self) -> serve.ServerInfo | None:
        return serve.stop(self.workdir, timeout=20)

    def restart(self) -> None:
        self.stop()
        self.info = serve.start(self.workdir, self.options)


def deploy_tiny(workdir: Path, target: Path, draft: Path, *, max_batch_size: int = 16,
                max_seq_len: int = 1024, max_draft_len: int = 4, num_draft_tokens: int = 3) -> Path:
    """convert -> build -> deploy of the tiny models (library functions; no-ops when up to date)."""
    from specbuild.pipeline.build import build
    from specbuild.pipeline.convert import convert
    from specbuild.pipeline.deploy import deploy

    convert(str(target), str(draft), workdir=workdir)
    build(workdir=workdir, max_batch_size=max_batch_size, max_seq_len=max_seq_len, max_draft_len=max_draft_len,
          num_draft_tokens=num_draft_tokens, calibrate=False)
    deploy(workdir=workdir)
    return workdir


@pytest.fixture(scope="session")
def server_workdir(tmp_path_factory, tiny_llama, tiny_llama_draft) -> Path:
    return deploy_tiny(tmp_path_factory.mktemp("served"), tiny_llama, tiny_llama_draft)


@pytest.fixture(scope="session")
def running_server(server_workdir):
    opts = serve_options()
    info = serve.start(server_workdir, opts)
    handle = ServerHandle(server_workdir, opts, info)
    try:
        yield handle
    finally:
        handle.stop()


def interruptible() -> None:
    """`preexec_fn` of a process a test Ctrl-Cs: SIGINT back to its default, as in a terminal. A test run started
    in the background by a shell without job control (`cmd &` in a script) inherits SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler: the SIGINT the test sends would do nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
