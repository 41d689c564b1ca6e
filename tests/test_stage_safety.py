"""Stage safety: one stage per workspace at a time, the previous output survives a failed rename, a crash
between the two renames is repaired, and a stage killed at a random point is either reused (complete) or
redone by the next run — never accepted half-written."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli
from specbuild.core import manifest as manifest_mod
from specbuild.core.manifest import WorkspaceBusy, hash_tree, read_manifest, workspace_lock

SMALL_BUILD = ["--max-batch-size", "2", "--max-seq-len", "128", "--max-draft-len", "2"]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def convert_args(target, draft, wd):
    return ["convert", "--target", target, "--draft", draft, "--workdir", wd]


def checkpoints(wd: Path) -> dict[str, str]:
    return hash_tree(wd / "checkpoints")


def test_second_stage_in_the_same_workspace_refuses(tmp_path, tiny_llama, tiny_llama_draft):
    wd = tmp_path / "wd"
    with workspace_lock(wd, "specbuild build"):
        res = run(*convert_args(tiny_llama, tiny_llama_draft, wd))
        assert res.exit_code != 0
        assert "is busy" in res.output and f"pid {os.getpid()} (specbuild build)" in res.output
        assert not (wd / "checkpoints").exists()
    # released: the same command now works
    res = run(*convert_args(tiny_llama, tiny_llama_draft, wd))
    assert res.exit_code == 0, res.output
    with pytest.raises(WorkspaceBusy), workspace_lock(wd, "a"), workspace_lock(wd, "b"):
        pass


def test_failed_final_rename_puts_the_previous_output_back(tmp_path, tiny_llama, tiny_llama_draft, monkeypatch):
    wd = tmp_path / "wd"
    assert run(*convert_args(tiny_llama, tiny_llama_draft, wd)).exit_code == 0
    before = checkpoints(wd)
    fp = read_manifest(wd / "checkpoints", "convert")["fingerprint"]
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(src).name.startswith(".tmp-checkpoints-") and "-old-" not in Path(src).name:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(manifest_mod.os, "replace", failing_replace)
    res = run(*convert_args(tiny_llama, tiny_llama_draft, wd), "--force")
    assert res.exit_code != 0
    monkeypatch.undo()
    assert checkpoints(wd) == before
    assert read_manifest(wd / "checkpoints", "convert")["fingerprint"] == fp
    assert not list(wd.glob(".tmp-checkpoints-*"))


def test_crash_between_the_two_renames_is_repaired(tmp_path, tiny_llama, tiny_llama_draft):
    wd = tmp_path / "wd"
    assert run(*convert_args(tiny_llama, tiny_llama_draft, wd)).exit_code == 0
    before = checkpoints(wd)
    # what a crash right after `final -> old` leaves: no final dir, the complete previous output parked
    os.replace(wd / "checkpoints", wd / ".tmp-checkpoints-old-12345")
    (wd / ".tmp-checkpoints-abcdef").mkdir()             # and the new, unfinished temp dir
    res = run(*convert_args(tiny_llama, tiny_llama_draft, wd))
    assert res.exit_code == 0, res.output
    assert "up to date" in res.output.lower() or "no-op" in res.output.lower()
    assert checkpoints(wd) == before
    assert not list(wd.glob(".tmp-checkpoints-*"))


def _cli_argv(*args) -> list[str]:
    return [sys.executable, "-c", "from specbuild.cli.main import main; main()", *[str(a) for a in args]]


def _kill_at(argv: list[str], delay: float) -> None:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def _timed(argv: list[str]) -> float:
    t0 = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return time.monotonic() - t0


def test_convert_and_build_killed_at_random_points(tmp_path, tiny_llama, tiny_llama_draft):
    """SIGKILL (no cleanup runs) at seeded random points of a real run; the next run must succeed and leave
    exactly what a clean run leaves (convert: the same bytes; build: an engine that generates the same text)."""
    from specbuild.engines.embedded import Engine, SamplingParams

    ref = tmp_path / "ref"
    convert_t = _timed(_cli_argv(*convert_args(tiny_llama, tiny_llama_draft, ref)))
    build_t = _timed(_cli_argv("build", "--workdir", ref, *SMALL_BUILD))
    ref_ckpt = checkpoints(ref)
    params = SamplingParams(max_tokens=8)
    ref_text = Engine.from_build_dir(ref / "engines").generate("hello world", params, num_draft_tokens=2).text

    rng = random.Random(1234)
    for i in range(3):
        wd = tmp_path / f"killed-{i}"
        _kill_at(_cli_argv(*convert_args(tiny_llama, tiny_llama_draft, wd)), rng.uniform(0.2, 1.0) * convert_t)
        res = run(*convert_args(tiny_llama, tiny_llama_draft, wd))
        assert res.exit_code == 0, res.output
        assert checkpoints(wd) == ref_ckpt
        _kill_at(_cli_argv("build", "--workdir", wd, *SMALL_BUILD), rng.uniform(0.2, 1.0) * build_t)
        res = run("build", "--workdir", wd, *SMALL_BUILD)
        assert res.exit_code == 0, res.output
        read_manifest(wd / "engines", "build")
        assert not list(wd.glob(".tmp-*"))
        out = Engine.from_build_dir(wd / "engines").generate("hello world", params, num_draft_tokens=2)
        assert out.text == ref_text
