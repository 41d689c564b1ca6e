"""Stage artifacts: content hashes, `manifest.json`, fingerprints and atomic writes.

Every stage writes its output through `stage_output(...)`: files go into a temporary sibling
directory, `manifest.json` is written last, every file is fsynced, and the directory is renamed into
place. A stage whose output already carries a manifest with the same fingerprint (inputs' sha256 +
options + versions) is a no-op; anything else is rebuilt. An interrupted stage leaves only a `.tmp-*`
directory, which no later stage accepts and the next run removes. If the final rename fails, the previous
output is put back; a crash between the two renames is repaired by the next run (`recover_output`).
Stages of one workspace serialize on `workspace_lock` (a second one refuses instead of deleting the
first one's temp dirs). A full disk while a stage writes is `NoSpaceError` ("no space left on device at
PATH: free N MB or pass --workdir elsewhere"): the temp directory is removed, the previous output kept.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import platform
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from specbuild import __version__
from specbuild.core.errors import ManifestError, SpecbuildError, UsageError

MANIFEST = "manifest.json"
SCHEMA = 1
_HASH_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


class HashCache:
    """sha256 of large files, memoized on (path, size, mtime) in the workspace, so a no-op re-run
    does not re-read gigabytes of weights."""

    def __init__(self, cache_file: Path | None):
        self.cache_file = cache_file
        self._data: dict[str, str] = {}
        if cache_file and cache_file.exists():
            try:
                self._data = json.loads(cache_file.read_text())
            except (OSError, ValueError):
                self._data = {}

    def sha256(self, path: Path) -> str:
        key = _stat_key(path)
        if key not in self._data:
            self._data[key] = sha256_file(path)
            self._save()
        return self._data[key]

    def _save(self) -> None:
        if not self.cache_file:
            return
        with contextlib.suppress(OSError):
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.cache_file, json.dumps(self._data))


def hash_tree(root: Path, cache: HashCache | None = None) -> dict[str, str]:
    """sha256 of every regular file under `root` (or of `root` itself if it is a file), keyed by relative path."""
    cache = cache or HashCache(None)
    root = Path(root)
    if root.is_file():
        return {root.name: cache.sha256(root)}
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST:
            out[str(p.relative_to(root))] = cache.sha256(p)
    return out


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "specbuild": __version__}
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("torch", "transformers", "tokenizers", "safetensors"):
        try:  # package metadata, not `import torch`: a no-op stage must not pay ~1 s of imports
            versions[mod] = version(mod)
        except PackageNotFoundError:  # pragma: no cover - optional at this stage
            versions[mod] = "not installed"
    return versions


def fingerprint(payload: Any) -> str:
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


@dataclass
class Manifest:
    stage: str
    inputs: dict[str, Any]
    options: dict[str, Any]
    versions: dict[str, str] = field(default_factory=tool_versions)
    checks: list[dict[str, Any]] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)

    @property
    def fingerprint(self) -> str:
        # Versions of python/torch/transformers/specbuild are part of the key: an upgrade rebuilds.
        return fingerprint({"stage": self.stage, "inputs": self.inputs, "options": self.options,
                            "versions": self.versions, "schema": SCHEMA})

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "stage": self.stage, "fingerprint": self.fingerprint,
                "created": self.created, "inputs": self.inputs, "options": self.options,
                "versions": self.versions, "checks": self.checks, "outputs": self.outputs,
                **({"extra": self.extra} if self.extra else {})}


def read_manifest(directory: Path, stage: str | None = None) -> dict[str, Any]:
    """Read and validate `directory/manifest.json`. Raises ManifestError with the fix in the message."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        hint = f"run `specbuild {stage}` first" if stage else "re-run the stage that produces it"
        raise ManifestError(f"{directory} has no {MANIFEST}: it is not a finished specbuild artifact; {hint}.")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); delete {directory} and re-run the stage.") from e
    if data.get("schema") != SCHEMA:
        raise ManifestError(f"{path} has schema {data.get('schema')!r}, this specbuild reads {SCHEMA}; re-run the stage.")
    if stage and data.get("stage") != stage:
        raise ManifestError(f"{directory} holds a {data.get('stage')!r} artifact, expected {stage!r}.")
    return data


def is_up_to_date(directory: Path, manifest: Manifest) -> bool:
    path = Path(directory) / MANIFEST
    if not path.exists():
        return False
    try:
        return json.loads(path.read_text()).get("fingerprint") == manifest.fingerprint
    except (OSError, ValueError):
        return False


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> None:
    """Write `text` to `path` through a temp file renamed over it (readers see the old or the new file).

    The file gets `mode` if given (e.g. 0o600 for a file holding a secret), else what `open()` would give a
    new file: 0o666 less the umask (0o644 under the usual 022). mkstemp alone leaves 0o600, and a server
    running as another uid then cannot read a manifest.json or a config.pbtxt.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, (0o666 & ~umask()) if mode is None else mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def ensure_writable_dir(directory: Path) -> Path:
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-", delete=True)
        probe.close()
    except OSError as e:
        if is_no_space(e):
            raise NoSpaceError(no_space_message(directory)) from e
        raise SpecbuildError(f"cannot write to {directory}: {e.strerror or e}. "
                             "Pass a writable --workdir (or fix its permissions).") from e
    return directory


# ---- a full disk ---------------------------------------------------------------------------------------
class NoSpaceError(SpecbuildError):
    """The filesystem of the workspace filled up while a stage wrote its output (ENOSPC / EDQUOT)."""


_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")
_MB = 1 << 20


def is_no_space(exc: BaseException | None) -> bool:
    """True if `exc` (or what caused it) is a full disk: an OSError with ENOSPC / EDQUOT, or a library error
    that carries one only in its text (safetensors' Rust writer: "I/O error: No space left on device (os
    error 28)")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE_ERRNOS:
            return True
        if any(t in str(exc) for t in _NO_SPACE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def tree_bytes(path: Path | None) -> int:
    """Bytes of the regular files under `path` (0 if it is missing); symlinks are not followed."""
    if path is None:
        return 0
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if not stat.S_ISLNK(st.st_mode):
                    total += st.st_size
    return total


def _free_bytes(path: Path) -> int | None:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def no_space_message(where: Path, need_bytes: int = 0, kept: Path | None = None) -> str:
    """"no space left on device at PATH: free N MB or pass --workdir elsewhere", with what is known."""
    free = _free_bytes(where)
    if need_bytes and free is not None:
        short_mb = max(1, -(-(need_bytes - free) // _MB))
        head = f"no space left on device at {where}: free {short_mb} MB or pass --workdir elsewhere"
        notes = [f"{free / _MB:.1f} MB free there, the output needs about {need_bytes / _MB:.1f} MB"]
    else:
        head = f"no space left on device at {where}: free some space or pass --workdir elsewhere"
        notes = [f"{free / _MB:.1f} MB free there"] if free is not None else []
    if kept is not None and kept.exists():
        notes.append(f"the previous {kept.name}/ is unchanged")
    notes.append("nothing half-written was kept")
    return f"{head} ({'; '.join(notes)})."


LOCK_FILE = ".specbuild.lock"


class WorkspaceBusy(UsageError):
    """Another specbuild stage or server start holds the workspace lock."""


@contextlib.contextmanager
def workspace_lock(workdir: Path, what: str) -> Iterator[None]:
    """Hold `<workdir>/.specbuild.lock` (flock, released by the kernel if the process dies) while `what` runs.

    A second stage (or `serve`) in the same workspace refuses at once with the holder's pid and task,
    instead of both writing the same outputs and deleting each other's temp directories.
    """
    workdir = ensure_writable_dir(Path(workdir))
    path = workdir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise WorkspaceBusy(f"{workdir} is busy: {holder} is using it; wait for it to finish, or use "
                                f"another --workdir.") from None
        with contextlib.suppress(OSError):   # who holds it: only a hint (and a full disk must not stop here)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} ({what})".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor releases the flock


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to disk, so a power cut after the rename cannot leave a
    manifest that points at empty files."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _old_dirs(final_dir: Path) -> list[Path]:
    return sorted(final_dir.parent.glob(f".tmp-{final_dir.name}-old-*"))


def recover_output(final_dir: Path) -> None:
    """Repair what a crash between `stage_output`'s two renames left: `final_dir` missing and the previous,
    complete output parked as `.tmp-<name>-old-<pid>` -> put it back. Then remove every other leftover.
    Call with the workspace lock held."""
    final_dir = Path(final_dir)
    if not final_dir.parent.is_dir():
        return
    if not final_dir.exists():
        for old in reversed(_old_dirs(final_dir)):
            if (old / MANIFEST).is_file():
                os.replace(old, final_dir)
                break
    for stale in final_dir.parent.glob(f".tmp-{final_dir.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)  # leftovers of an interrupted run


@contextlib.contextmanager
def stage_output(final_dir: Path, need_bytes: int | Callable[[], int] | None = None) -> Iterator[Path]:
    """Yield a temporary directory next to `final_dir`; on success rename it into place atomically.

    On any exception the temporary directory is removed and `final_dir` is left as it was before (if the
    final rename itself fails, the previous output is put back). The caller must write `manifest.json`
    into the temp dir (see `write_manifest`) before leaving, and should hold the workspace lock.
    A full disk (ENOSPC / EDQUOT, also inside a library's own error) becomes `NoSpaceError`: "no space left
    on device at PATH: free N MB or pass --workdir elsewhere", N from `need_bytes` (an estimate of the
    output's size, or a callable computing one), the previous output's size and what had been written.
    """
    final_dir = Path(final_dir)
    ensure_writable_dir(final_dir.parent)
    recover_output(final_dir)
    try:
        tmp = Path(tempfile.mkdtemp(dir=final_dir.parent, prefix=f".tmp-{final_dir.name}-"))
    except OSError as e:
        if is_no_space(e):
            raise NoSpaceError(no_space_message(final_dir.parent, kept=final_dir)) from e
        raise
    # mkdtemp makes the directory 0700; the output (a model repository a server may read as another user)
    # gets the mode any directory made here gets.
    with contextlib.suppress(OSError):
        os.chmod(tmp, 0o777 & ~umask())
    try:
        yield tmp
        if not (tmp / MANIFEST).exists():
            raise ManifestError(f"internal error: stage wrote no {MANIFEST} into {tmp}")
        _fsync_tree(tmp)
        old = None
        if final_dir.exists():
            old = final_dir.parent / f".tmp-{final_dir.name}-old-{os.getpid()}"
            os.replace(final_dir, old)
        try:
            os.replace(tmp, final_dir)
        except BaseException:
            if old is not None:
                os.replace(old, final_dir)  # put the previous output back
            raise
        _fsync_dir(final_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        full = is_no_space(e) and not isinstance(e, NoSpaceError)
        written = tree_bytes(tmp) if full else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            need = need_bytes() if callable(need_bytes) else (need_bytes or 0)
            need = max(need, tree_bytes(final_dir), written)
            raise NoSpaceError(no_space_message(final_dir.parent, need, kept=final_dir)) from e
        raise


def umask() -> int:
    """The process umask, read without changing it (Linux /proc; else the usual 022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def write_manifest(directory: Path, manifest: Manifest) -> dict[str, Any]:
    data = manifest.to_dict()
    atomic_write_text(Path(directory) / MANIFEST, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return data


def python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"
