"""Where things live on disk, shared by every floor: the conversion cache and a model directory's weight files."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specbuild.core.errors import SourceError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def cache_dir() -> Path:
    """The conversion cache: `$SPECBUILD_CACHE`, else `~/.cache/specbuild` (read when called, not at import)."""
    return Path(os.environ.get("SPECBUILD_CACHE") or Path.home() / ".cache" / "specbuild").expanduser()


def model_files(path: Path) -> list[Path]:
    """The weight files of an HF directory: those its safetensors index names, else every *.safetensors,
    else the pickle files."""
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise SourceError(f"{index} is unreadable ({e}); re-download or re-export the model.") from e
        missing = [n for n in names if not (Path(path) / n).is_file()]
        if missing:
            raise SourceError(f"{index} names missing shards {missing[:3]}; re-download the model.")
        return [Path(path) / n for n in names]
    safetensors = sorted(Path(path).glob("*.safetensors"))
    if safetensors:
        return safetensors
    return sorted(p for p in Path(path).iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
