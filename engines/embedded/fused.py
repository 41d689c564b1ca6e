"""The fused CPU decode step (csrc/fused.cpp): building it, probing it, and running a model's layers through it.

    python -m specbuild.engines.embedded.fused build     # what `make setup` runs; prints what it built
    python -m specbuild.engines.embedded.fused status    # is it built here, and why not

A decode step of a small model in eager PyTorch is hundreds of ATen calls from Python; the fused runner runs all
of a model's layers in one C++ call (the linears still on oneDNN, or on the block-quantized kernels of quant.py),
with ragged rows instead of padded ones and the GIL released (kernels and numerics: csrc/fused.cpp).

The extension is compiled on this machine (`-march=native`; its name carries a hash of the source, the flags,
the torch version and this CPU's model and flags, so a different machine or source builds its own) into
`$SPECBUILD_CACHE/torch_extensions/`. Building needs a C++ compiler and ninja (~1 minute); it happens in
`make setup` and, when missing, in `specbuild build`. Serving only loads a built extension: where there is none
the engine runs eager PyTorch and says why once (`status()`), so every test and every stage still works.

`decode_step` (EngineConfig): "auto" (fused where built and the model is supported, else eager), "fused"
(required: refuse to load without it), "eager".

`SPECBUILD_FUSED_ISA=avx2` builds (and loads) the AVX2 kernels on a CPU with AVX-512 (`-mno-avx512f
-mno-avxvnni` after `-march=native`): to measure or debug on an AVX-512 machine what an AVX2-only one (an AMD EPYC
Zen 3, say) runs. It is its own extension beside the native one; unset, or "native", is the default.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import time
from importlib import resources
from pathlib import Path

import torch


log = logging.getLogger(__name__)

from specbuild.engines.embedded.config import DECODE_STEPS  # noqa: F401
PACKED_FP32, Q4_1, Q8_0, DENSE, INT8_ROWWISE, TILED_FP32, Q4_1_Q8, Q8_0_Q8 = 0, 1, 2, 3, 4, 5, 6, 7
INT8_ACTIVATIONS = {Q4_1: Q4_1_Q8, Q8_0: Q8_0_Q8}    # a block kind -> the same weights on int8 activations
BASE_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17"]
ISA_CFLAGS = {"native": [], "avx2": ["-mno-avx512f", "-mno-avxvnni"]}   # SPECBUILD_FUSED_ISA


def isa() -> str:
    """The kernels' instruction set: "native" (this CPU's best) unless SPECBUILD_FUSED_ISA says "avx2"."""
    value = os.environ.get("SPECBUILD_FUSED_ISA", "").strip().lower() or "native"
    if value not in ISA_CFLAGS:
        from specbuild.core.errors import UsageError

        raise UsageError(f"SPECBUILD_FUSED_ISA={value!r}: expected one of {', '.join(ISA_CFLAGS)} "
                         "(or unset it for this CPU's own kernels)")
    return value


def cpu_has_avx512() -> bool:
    """Does this CPU have what the extension's AVX-512 kernels need (AVX-512 F and BW)? Where it does not, the
    native build is the AVX2 one and `extension_for("avx2")` builds the same kernels again."""
    from specbuild.core.machine import cpu_info

    return {"avx512f", "avx512bw"} <= set(cpu_info()["isa"])


def cflags(kernels_isa: str | None = None) -> list[str]:
    return BASE_CFLAGS + ISA_CFLAGS[kernels_isa or isa()]


_EXT = None                    # the loaded module
_WHY: str | None = None        # why it is not loaded (None: not tried yet, or loaded)
_TRIED = False


def _source() -> Path:
    return Path(str(resources.files("specbuild.engines.embedded") / "csrc" / "fused.cpp"))


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
        return model + flags
    except OSError:
        return platform.processor()


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


def kernels_id() -> str:
    """What the extension computes with on this machine, whatever checkout it was built from: its source, flags,
    torch and CPU (`extension_name` also hashes the source's path). A calibration records it: step costs measured
    on other kernels are another engine's (bench_engine.py rebuilds on a mismatch)."""
    return _digest(_source().read_bytes(), " ".join(cflags()).encode(), torch.__version__.encode(), _cpu_id().encode())


def extension_name(kernels_isa: str | None = None) -> str:
    # the source's path too: ninja's build file names it, so two checkouts sharing one cache would otherwise
    # rebuild the one extension in turn (each load waiting on the other's build lock)
    return "specbuild_fused_" + _digest(_source().read_bytes(), str(_source().resolve()).encode(),
                                        " ".join(cflags(kernels_isa)).encode(), torch.__version__.encode(),
                                        _cpu_id().encode(), sys.version.encode())


def build_dir(kernels_isa: str | None = None) -> Path:
    from specbuild.core.paths import cache_dir

    return cache_dir() / "torch_extensions" / extension_name(kernels_isa)


def extension_for(kernels_isa: str | None = None):
    """Compile (or find) and import the extension for `kernels_isa` (default: `isa()`): compiled once into the
    cache (~1 minute); raises what the build raises. With another instruction set ("avx2" on an AVX-512 CPU) it is
    a second extension beside the one the engine loads, for tests and measurements."""
    from torch.utils import cpp_extension

    out = build_dir(kernels_isa)
    out.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        return cpp_extension.load(name=extension_name(kernels_isa), sources=[str(_source())],
                                  extra_cflags=cflags(kernels_isa), extra_ldflags=["-fopenmp"],
                                  build_directory=str(out), verbose=False)


def _load(build: bool) -> object | None:
    """Import the extension from its build directory (compiling it first when `build`). None + the reason in
    `_WHY` when it cannot be had."""
    global _EXT, _WHY, _TRIED
    if _EXT is not None:
        return _EXT
    if _TRIED and not build:
        return None
    _TRIED = True
    if os.environ.get("SPECBUILD_DECODE_STEP", "").strip().lower() == "eager":
        _WHY = "SPECBUILD_DECODE_STEP=eager"
        return None
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        _WHY = f"the fused decode step is built for x86-64 Linux, this is {sys.platform}/{platform.machine()}"
        return None
    out = build_dir()
    name = extension_name()
    if not build and not (out / f"{name}.so").is_file():
        _WHY = (f"not built on this machine ({out}); run `make setup` or "
                "`python -m specbuild.engines.embedded.fused build`")
        return None
    try:
        _EXT = extension_for()
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a compile error: the engine runs eager
        _WHY = f"building the fused decode step failed ({type(e).__name__}: {str(e).strip().splitlines()[-1:]})"
        log.warning("%s; the engine runs eager PyTorch", _WHY)
        return None
    _WHY = None
    return _EXT


@contextlib.contextmanager
def _build_lock(out: Path):
    """One builder at a time, by a kernel lock that dies with its holder. torch's own baton is a plain `lock` file
    that a build killed mid-compile leaves behind, and every later load then waits for it forever; under our lock
    such a file can only be stale, so it is removed."""
    import fcntl

    with open(out / ".specbuild-build.flock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = out / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def extension(build: bool = False):
    """The loaded extension module, or None (see `status()`)."""
    return _load(build)


def status() -> str:
    ext = extension()
    return f"fused ({extension_name()}, {isa()} kernels)" if ext is not None else f"eager: {_WHY}"


def block_linear(kind: int, x: torch.Tensor, qs, d, m, bias, out_features: int) -> torch.Tensor | None:
    """y = x @ W^T for a block-quantized W on the extension's kernel; None when it is not built."""
    ext = extension()
    if ext is None:
        return None
    empty = torch.empty(0)
    return ext.block_linear(kind, x, qs, d, m if m is not None else empty, bias if bias is not None else empty,
                            out_features)


def argmax_rows(x: torch.Tensor) -> list[int] | None:
    """Each row's argmax of x [M, N] (fp32, CPU), as `x.argmax(-1).tolist()` gives it, on the extension's
    vectorized loop; None when it is not built."""
    ext = extension()
    return None if ext is None else ext.argmax_rows(x)


def build(progress=print) -> bool:
    """Compile (or find) the extension for this machine and check it against eager PyTorch. -> built or not."""
    global _EXT, _WHY
    t0 = time.perf_counter()
    ext = extension(build=True)
    if ext is None:
        progress(f"fused decode step: not built ({_WHY}); the embedded engine runs eager PyTorch")
        return False
    from specbuild.engines.embedded.blocks import dequantize_blocks, interleave_blocks, quantize_blocks

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    for scheme, kind in (("q4_1", Q4_1), ("q8_0", Q8_0)):
        qs, d, m, _ = quantize_blocks(w, scheme)
        ref = x @ dequantize_blocks(qs, d, m, scheme).T
        got = ext.block_linear(kind, x, qs, d, m if m is not None else torch.empty(0), torch.empty(0), 40)
        if not torch.allclose(got, ref, rtol=1e-4, atol=1e-4):
            progress(f"fused decode step: the {scheme} kernel disagrees with PyTorch here; not used")
            _EXT, _WHY = None, f"the {scheme} kernel disagreed with PyTorch when probed"
            return False
        qi, di, mi = interleave_blocks(qs, d, m)
        q8 = ext.block_linear(INT8_ACTIVATIONS[kind], x, qi, di, mi if mi is not None else torch.empty(0),
                              torch.empty(0), 40)
        if not (q8 - ref).norm() <= 0.05 * ref.norm():           # int8 activations: an approximation (~1 %)
            progress(f"fused decode step: the {scheme} int8-activation kernel disagrees with PyTorch here; not used")
            _EXT, _WHY = None, f"the {scheme} int8-activation kernel disagreed with PyTorch when probed"
            return False
    lin = torch.randn(40, 64, generator=gen)
    xs = torch.randn(9, 64, generator=gen)
    panels = ext.pack_panels(lin)
    got = ext.tiled_linear(xs, panels, torch.empty(0), 40)
    if not torch.allclose(got, xs @ lin.T, rtol=1e-4, atol=1e-4) or \
            not torch.equal(ext.tiled_linear(xs[4:5], panels, torch.empty(0), 40), got[4:5]):
        progress("fused decode step: the tiled fp32 kernel disagrees with PyTorch here; not used")
        _EXT, _WHY = None, "the tiled fp32 kernel disagreed with PyTorch when probed"
        return False
    progress(f"fused decode step: built and checked in {time.perf_counter() - t0:.0f} s ({build_dir()})")
    return True


def main(argv=None) -> int:
    from specbuild.core.errors import SpecbuildError

    args = sys.argv[1:] if argv is None else argv
    try:
        isa()                   # a bad SPECBUILD_FUSED_ISA is refused whether or not anything is built yet
        if args[:1] == ["build"]:
            build()
            return 0            # never fails setup: without it the engine runs eager
        if args[:1] == ["status"]:
            print(status())
            return 0
    except SpecbuildError as e:  # a bad SPECBUILD_FUSED_ISA: its message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print("usage: python -m specbuild.engines.embedded.fused build|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
