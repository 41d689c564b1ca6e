"""Make the nvidia-pytriton wheel's tritonserver a plain `tritonserver` (run by docker/embedded.Dockerfile).

    python install_tritonserver.py [--backends /opt/tritonserver/backends] [--bin /usr/local/bin]

- assembles the Python backend for this interpreter in BACKENDS/python (`specbuild.pipeline.tritonbin`), the
  directory tritonserver reads by default, so no `--backend-directory` is needed;
- writes BIN/tritonserver: the wheel's binary with its bundled libraries, this interpreter's libpython and
  site-packages in the environment (what `specbuild serve` sets up), so a Kubernetes pod runs
  `tritonserver --model-repository=...` exactly as in a Triton container.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from specbuild.pipeline.tritonbin import find_tritonserver, prepare_backend_dir, server_env

KEYS = ("LD_LIBRARY_PATH", "PYTHONPATH", "SPECBUILD_SITE_DIRS", "SPECBUILD_PYTHON")


def wrapper(binary: Path, env: dict[str, str]) -> str:
    lines = ["#!/bin/sh", "# Written by docker/install_tritonserver.py: the nvidia-pytriton tritonserver, ready to run."]
    lines += [f"export {k}={shlex.quote(env[k])}" for k in KEYS if env.get(k)]
    lines.append(f'exec {shlex.quote(str(binary))} "$@"')
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="/opt/tritonserver/backends", type=Path)
    ap.add_argument("--bin", default="/usr/local/bin", type=Path)
    args = ap.parse_args(argv)
    binary = find_tritonserver(os.environ.get("SPECBUILD_TRITONSERVER") or None)
    if binary.source != "pytriton":
        print(f"tritonserver is already installed at {binary.path}; nothing to do", file=sys.stderr)
        return 0
    prepare_backend_dir(binary, args.backends)
    env = server_env(binary, base={})
    args.bin.mkdir(parents=True, exist_ok=True)
    out = args.bin / "tritonserver"
    tmp = out.with_name(".tritonserver.tmp")
    tmp.write_text(wrapper(binary.path, env))
    tmp.chmod(0o755)
    os.replace(tmp, out)
    print(f"{out} -> {binary.path} (backends: {args.backends})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
