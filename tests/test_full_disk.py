"""A stage that fills the disk: a clear error ("no space left on device at PATH: free N MB or pass --workdir
elsewhere"), nothing half-written, the earlier output intact, and the next run after space is freed works.

The real case runs convert and build on a small tmpfs this test mounts and unmounts itself (root only; skipped
where mounting is not allowed). The test doubles (any machine) make the write calls of the embedded convert and
build fail the two ways a full disk shows up: an OSError with ENOSPC (shutil's copies) and a library error that
carries it only in its text (safetensors' Rust writer).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli
from specbuild.core.manifest import hash_tree, read_manifest, tree_bytes

SMALL_BUILD = ["--max-batch-size", "2", "--max-seq-len", "128", "--max-draft-len", "2"]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def convert(target, draft, wd, *extra):
    return run("convert", "--target", target, "--draft", draft, "--workdir", wd, *extra)


def build(wd, *extra):
    return run("build", "--workdir", wd, *SMALL_BUILD, *extra)


def assert_clear_no_space_error(res, wd: Path) -> None:
    assert res.exit_code == 1, res.output
    assert f"no space left on device at {wd}" in res.output, res.output
    assert "MB or pass --workdir elsewhere" in res.output, res.output
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output


def leftovers(wd: Path) -> list[str]:
    return sorted(p.name for p in wd.glob(".tmp-*"))


@pytest.fixture
def small_fs(tmp_path):
    """Mount a tmpfs of the given size at tmp_path/"fs" (unmounted afterwards), or skip where not allowed."""
    mounts = []

    def mount(size_bytes: int) -> Path:
        point = tmp_path / f"fs{len(mounts)}"
        point.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root here; the test doubles below cover the error path")
        kib = -(-size_bytes // 1024)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs", str(point)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounts.append(point)
        return point

    try:
        yield mount
    finally:
        for point in mounts:
            if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(point)], capture_output=True)


def fill(fs: Path, leave_bytes: int) -> Path:
    """A file that takes all but `leave_bytes` of the filesystem's free space."""
    filler = fs / "filler"
    free = shutil.disk_usage(fs).free
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(1, free - leave_bytes))
    return filler


def test_convert_and_build_on_a_full_disk(small_fs, tiny_llama, tiny_llama_draft):
    inputs = tree_bytes(tiny_llama) + tree_bytes(tiny_llama_draft)
    fs = small_fs(4 * inputs + (4 << 20))          # room for checkpoints + engines, then filled up
    wd = fs / "wd"
    assert convert(tiny_llama, tiny_llama_draft, wd).exit_code == 0
    assert build(wd).exit_code == 0
    before = {"checkpoints": hash_tree(wd / "checkpoints"), "engines": hash_tree(wd / "engines")}
    fps = {d: read_manifest(wd / d)["fingerprint"] for d in before}

    filler = fill(fs, leave_bytes=64 << 10)
    assert_clear_no_space_error(build(wd, "--force"), wd)
    assert_clear_no_space_error(convert(tiny_llama, tiny_llama_draft, wd, "--force"), wd)
    for d, hashes in before.items():                 # the earlier outputs: same bytes, same manifests
        assert hash_tree(wd / d) == hashes
        assert read_manifest(wd / d)["fingerprint"] == fps[d]
    assert leftovers(wd) == []

    fresh = fs / "fresh"                              # a first run on the full disk leaves no output at all
    assert_clear_no_space_error(convert(tiny_llama, tiny_llama_draft, fresh), fresh)
    assert not (fresh / "checkpoints").exists() and leftovers(fresh) == []

    filler.unlink()                                   # space freed: the same commands work again
    assert convert(tiny_llama, tiny_llama_draft, wd, "--force").exit_code == 0
    res = build(wd, "--force")
    assert res.exit_code == 0, res.output
    assert hash_tree(wd / "checkpoints") == before["checkpoints"]
    read_manifest(wd / "engines", "build")
    assert leftovers(wd) == []


def _partial_then(exc_factory, real):
    """A write call that writes half of what it was asked to, then fails as a full disk does."""
    def write(*args, **kwargs):
        real(*args, **kwargs)
        dst = Path(args[1])
        with open(dst, "r+b") as f:
            f.truncate(max(1, dst.stat().st_size // 2))
        raise exc_factory(dst)
    return write


def test_no_space_inside_safetensors_is_a_clear_error(tmp_path, tiny_llama, tiny_llama_draft, monkeypatch):
    """safetensors reports ENOSPC only in its text ("I/O error: No space left on device (os error 28)")."""
    import safetensors.torch

    wd = tmp_path / "wd"
    assert convert(tiny_llama, tiny_llama_draft, wd).exit_code == 0
    before = hash_tree(wd / "checkpoints")
    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    assert_clear_no_space_error(convert(tiny_llama, tiny_llama_draft, wd, "--force"), wd)
    monkeypatch.undo()
    assert hash_tree(wd / "checkpoints") == before
    assert leftovers(wd) == []


def test_enospc_while_build_copies_is_a_clear_error(tmp_path, tiny_llama, tiny_llama_draft, monkeypatch):
    wd = tmp_path / "wd"
    assert convert(tiny_llama, tiny_llama_draft, wd).exit_code == 0
    assert build(wd).exit_code == 0
    before = hash_tree(wd / "engines")
    monkeypatch.setattr(shutil, "copyfile", _partial_then(
        lambda dst: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst)), shutil.copyfile))
    assert_clear_no_space_error(build(wd, "--force"), wd)
    monkeypatch.undo()
    assert hash_tree(wd / "engines") == before
    read_manifest(wd / "engines", "build")
    assert leftovers(wd) == []


def test_a_stage_output_gets_the_usual_directory_mode(tmp_path, tiny_llama, tiny_llama_draft):
    """Not mkdtemp's 0700: a server running as another user (a Triton container) must read the output."""
    wd = tmp_path / "wd"
    assert convert(tiny_llama, tiny_llama_draft, wd).exit_code == 0
    umask = os.umask(0)
    os.umask(umask)
    assert (wd / "checkpoints").stat().st_mode & 0o777 == 0o777 & ~umask
