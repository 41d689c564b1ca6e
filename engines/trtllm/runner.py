"""Run external tools (trtllm-build, the per-rank converter) with their output streamed and kept.

Every command is an argv list (never a shell string), logged before it starts, its stdout and stderr
streamed line by line to the progress callback and into a log file, and, on failure, the tail of
its stderr is put into the raised error so the user sees why without opening the log.
"""

from __future__ import annotations

import collections
import logging
import os
import shlex
import subprocess
import threading
from pathlib import Path
from typing import Callable, Mapping, Sequence

from specbuild.core.errors import SpecbuildError, ToolNotAvailable

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 40
CONTAINER_HINT = ("Use --dry-run to print the exact commands and files, --rehearse to record them and rehearse the "
                  "deployment on this CPU (`specbuild serve --rehearse`), or run specbuild inside the TensorRT-LLM "
                  "container ({container}).")


class CommandFailed(SpecbuildError):
    """An external command exited non-zero; `.stderr_tail` holds its last stderr lines."""

    def __init__(self, message: str, returncode: int, stderr_tail: str):
        super().__init__(message)
        self.returncode = returncode
        self.stderr_tail = stderr_tail


def require_tensorrt_llm(container: str) -> str:
    """Return the installed tensorrt_llm version or raise ToolNotAvailable naming the way out."""
    from specbuild.engines.trtllm.versions import detect_installed
    version = detect_installed()
    if version is None:
        raise ToolNotAvailable("tensorrt_llm is not importable here (it needs an NVIDIA GPU and NVIDIA's package "
                               "index). " + CONTAINER_HINT.format(container=container))
    return version


def run_command(argv: Sequence[str], *, log_file: Path | None = None, cwd: Path | None = None,
                env: Mapping[str, str] | None = None, progress: Callable[[str], None] | None = None,
                what: str | None = None) -> None:
    """Run `argv`, streaming its output; raise CommandFailed with the stderr tail on a non-zero exit."""
    argv = [str(a) for a in argv]
    what = what or Path(argv[0]).name
    progress = progress or (lambda line: log.info(line))
    log.info("running: %s", shlex.join(argv))
    full_env = {**os.environ, **(env or {})}
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, errors="replace", bufsize=1)
    except FileNotFoundError as e:
        raise ToolNotAvailable(f"{argv[0]} is not installed or not on PATH. "
                               "Use --dry-run, or run inside the TensorRT-LLM container.") from e
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
    lock = threading.Lock()
    sink = open(log_file, "a", encoding="utf-8") if log_file else None
    if sink:
        sink.write(f"$ {shlex.join(argv)}\n")

    def pump(stream, is_err: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            with lock:
                if is_err:
                    tail.append(line)
                if sink:
                    sink.write(line + "\n")
                    sink.flush()
                progress(f"[{what}] {line}")

    threads = [threading.Thread(target=pump, args=(proc.stdout, False), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, True), daemon=True)]
    for t in threads:
        t.start()
    try:
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        for t in threads:
            t.join(timeout=5)
        if sink:
            sink.close()
    if rc != 0:
        stderr_tail = "\n".join(tail)
        where = f" (full log: {log_file})" if log_file else ""
        raise CommandFailed(f"{what} failed with exit code {rc}{where}:\n  $ {shlex.join(argv)}\n"
                            f"--- stderr (last {len(tail)} lines) ---\n{stderr_tail}", rc, stderr_tail)
