"""Locate `tritonserver` and prepare what it needs to run Python-backend models.

Two installations are supported:

* a Triton container (or any machine) with `tritonserver` on PATH and its backends under
  `/opt/tritonserver/backends` — used as is;
* the `nvidia-pytriton` wheel, which ships a real tritonserver (2.51 for pytriton 0.7) plus one Python
  backend stub per Python minor version. Its backend directory must be assembled: `libtriton_python.so`,
  `triton_python_backend_utils.py` and the stub matching *this* interpreter (`prepare_backend_dir`).

`server_env` builds the environment the server (and the Python stubs it spawns) runs with: the wheel's
bundled libraries and this interpreter's `libpython` on LD_LIBRARY_PATH, and this environment's
site-packages on PYTHONPATH so `model.py` files can `import specbuild`.
"""

from __future__ import annotations

import os
import shutil
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from specbuild.core.errors import ToolNotAvailable

CONTAINER_BACKENDS = Path("/opt/tritonserver/backends")


@dataclass(frozen=True)
class TritonBinary:
    path: Path                      # the tritonserver executable
    source: str                     # "path" (container/system install) | "pytriton" (the wheel)
    lib_dirs: tuple[Path, ...]      # extra LD_LIBRARY_PATH entries the binary needs
    backends_dir: Path | None       # ready-made backend directory (container); None => prepare one

    @property
    def python_tag(self) -> str:
        return f"{sys.version_info.major}.{sys.version_info.minor}"


def _pytriton_root() -> Path | None:
    try:
        import pytriton  # noqa: PLC0415 - optional at import time
    except ImportError:
        return None
    return Path(pytriton.__file__).resolve().parent / "tritonserver"


def find_tritonserver(explicit: str | os.PathLike | None = None) -> TritonBinary:
    """`explicit` (e.g. --tritonserver) > `tritonserver` on PATH > the nvidia-pytriton wheel."""
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ToolNotAvailable(f"{path} is not an executable tritonserver; pass the path of the "
                                   "binary (e.g. /opt/tritonserver/bin/tritonserver).")
        return TritonBinary(path, "path", (), CONTAINER_BACKENDS if CONTAINER_BACKENDS.is_dir() else None)
    on_path = shutil.which("tritonserver")
    if on_path:
        backends = Path(on_path).resolve().parent.parent / "backends"
        if not backends.is_dir():
            backends = CONTAINER_BACKENDS if CONTAINER_BACKENDS.is_dir() else None
        return TritonBinary(Path(on_path), "path", (), backends)
    root = _pytriton_root()
    if root and (root / "bin" / "tritonserver").is_file():
        libs = root.parent.parent / "nvidia_pytriton.libs"
        return TritonBinary(root / "bin" / "tritonserver", "pytriton", (libs,) if libs.is_dir() else (), None)
    raise ToolNotAvailable("tritonserver not found: it is neither on PATH nor shipped by an installed "
                           "nvidia-pytriton wheel. Run inside a Triton container, or `pip install "
                           "nvidia-pytriton` into this environment.")


def prepare_backend_dir(binary: TritonBinary, dest: Path) -> Path:
    """Return a backend directory for `binary`; for the pytriton wheel, assemble `dest/python/`.

    Idempotent: files already identical in size are not copied again.
    """
    if binary.backends_dir is not None:
        return binary.backends_dir
    root = binary.path.resolve().parent.parent
    src_backend = root / "backends" / "python"
    stub = root / "python_backend_stubs" / binary.python_tag / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir() if p.is_dir() and p.name[0].isdigit())
        raise ToolNotAvailable(f"nvidia-pytriton has no Python backend stub for Python {binary.python_tag} "
                               f"(it has {', '.join(have)}); run specbuild with one of those Python versions.")
    out = Path(dest) / "python"
    out.mkdir(parents=True, exist_ok=True)
    for src in [*(p for p in src_backend.iterdir() if p.is_file()), stub]:
        dst = out / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            tmp = dst.with_name(f".{dst.name}.tmp")
            shutil.copy2(src, tmp)
            os.replace(tmp, dst)
    return Path(dest)


def python_lib_dir() -> Path | None:
    """The directory of this interpreter's shared libpython, so the stub embeds the same Python."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR")
    return Path(libdir) if libdir and Path(libdir).is_dir() else None


def site_dirs() -> list[str]:
    """site-packages of the running environment (a venv's own first)."""
    dirs = list(site.getsitepackages())
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user and Path(user).is_dir():
        dirs.append(user)
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def server_env(binary: TritonBinary, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    lib_dirs = [str(p) for p in binary.lib_dirs]
    pylib = python_lib_dir()
    if pylib and binary.source == "pytriton":
        lib_dirs.insert(0, str(pylib))
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    if lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
    paths = site_dirs()
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # model.py calls site.addsitedir() on these so .pth files (editable installs) are honoured.
    env["SPECBUILD_SITE_DIRS"] = os.pathsep.join(site_dirs())
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # the interpreter of the embedded engine's own process (model tensorrt_llm starts it)
    env.setdefault("SPECBUILD_PYTHON", sys.executable)
    return env
