"""Configuration precedence: defaults -> specbuild.toml -> SPECBUILD_* environment -> flags.

`specbuild.toml` (in the current directory, or the file named by `--config` / `SPECBUILD_CONFIG`) has
one table per command, keyed like the flags with dashes turned into underscores::

    [convert]
    workdir = "/data/specbuild-work"
    dtype = "bfloat16"

    [serve]
    http_port = 8000

Keys at the top level apply to every command that has such an option. The CLI feeds this into
Click's `default_map`, and Click's `auto_envvar_prefix="SPECBUILD"` maps `SPECBUILD_<COMMAND>_<OPTION>`
(for example `SPECBUILD_CONVERT_WORKDIR`) and the shared `SPECBUILD_WORKDIR`; explicit flags win.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from specbuild.core.errors import UsageError

CONFIG_FILE = "specbuild.toml"
DEFAULT_WORKDIR = "specbuild-work"


def find_config(explicit: str | os.PathLike | None = None) -> Path | None:
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise UsageError(f"config file {path} does not exist; pass an existing file to --config.")
        return path
    env = os.environ.get("SPECBUILD_CONFIG")
    if env:
        return find_config(env)
    path = Path.cwd() / CONFIG_FILE
    return path if path.is_file() else None


def load_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path} is not valid TOML: {e}") from e


def default_map(config: dict[str, Any], commands: list[str]) -> dict[str, dict[str, Any]]:
    """Turn the TOML document into Click's `default_map` (top-level keys shared by every command)."""
    shared = {k.replace("-", "_"): v for k, v in config.items() if not isinstance(v, dict)}
    unknown = [k for k, v in config.items() if isinstance(v, dict) and k not in commands]
    if unknown:
        raise UsageError(f"specbuild.toml has tables for unknown commands {unknown}; known: {sorted(commands)}.")
    out: dict[str, dict[str, Any]] = {}
    for cmd in commands:
        table = {k.replace("-", "_"): v for k, v in config.get(cmd, {}).items()}
        out[cmd] = {**shared, **table}
    return out
