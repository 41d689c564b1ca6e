"""Configuration precedence: defaults -> specbuild.toml -> SPECBUILD_* environment -> flags.

Observed through `specbuild convert --dry-run`, which prints the paths it would write (under --workdir).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli

CLEAN_ENV = {"SPECBUILD_WORKDIR": None, "SPECBUILD_CONVERT_WORKDIR": None, "SPECBUILD_CONFIG": None,
             "SPECBUILD_CONVERT_DTYPE": None}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def planned_workdir(tiny_llama, tiny_llama_draft, *flags, env=None) -> str:
    res = CliRunner().invoke(cli, ["convert", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft),
                                   "--dry-run", *flags], env={**CLEAN_ENV, **(env or {})})
    assert res.exit_code == 0, res.output
    writes = [line.split(" ", 2)[2] for line in res.stdout.splitlines() if line.startswith("--- write ")]
    assert writes[-1].endswith("/checkpoints/manifest.json")
    planned = writes[-1][: -len("/checkpoints/manifest.json")]
    # paths are resolved once, at the CLI boundary: what a stage plans to write is absolute
    assert Path(planned).is_absolute(), planned
    return os.path.relpath(planned, Path.cwd())


def test_default(in_tmp, tiny_llama, tiny_llama_draft):
    assert planned_workdir(tiny_llama, tiny_llama_draft) == "specbuild-work"


def test_toml_command_table_and_top_level(in_tmp, tiny_llama, tiny_llama_draft):
    (in_tmp / "specbuild.toml").write_text('workdir = "shared-toml"\n')
    assert planned_workdir(tiny_llama, tiny_llama_draft) == "shared-toml"
    (in_tmp / "specbuild.toml").write_text('workdir = "shared-toml"\n[convert]\nworkdir = "convert-toml"\n')
    assert planned_workdir(tiny_llama, tiny_llama_draft) == "convert-toml"


def test_env_beats_toml_and_command_env_beats_shared_env(in_tmp, tiny_llama, tiny_llama_draft):
    (in_tmp / "specbuild.toml").write_text('[convert]\nworkdir = "convert-toml"\n')
    assert planned_workdir(tiny_llama, tiny_llama_draft, env={"SPECBUILD_WORKDIR": "shared-env"}) == "shared-env"
    env = {"SPECBUILD_WORKDIR": "shared-env", "SPECBUILD_CONVERT_WORKDIR": "convert-env"}
    assert planned_workdir(tiny_llama, tiny_llama_draft, env=env) == "convert-env"


def test_flag_beats_everything(in_tmp, tiny_llama, tiny_llama_draft):
    (in_tmp / "specbuild.toml").write_text('[convert]\nworkdir = "convert-toml"\n')
    env = {"SPECBUILD_WORKDIR": "shared-env", "SPECBUILD_CONVERT_WORKDIR": "convert-env"}
    assert planned_workdir(tiny_llama, tiny_llama_draft, "--workdir", "flag-wd", env=env) == "flag-wd"


def test_explicit_config_file_and_other_options(in_tmp, tiny_llama, tiny_llama_draft):
    cfg = in_tmp / "elsewhere.toml"
    cfg.write_text('[convert]\nworkdir = "from-explicit"\ndtype = "bfloat16"\n')
    res = CliRunner().invoke(cli, ["--config", str(cfg), "convert", "--target", str(tiny_llama), "--draft",
                                   str(tiny_llama_draft), "--dry-run"], env=CLEAN_ENV)
    assert res.exit_code == 0, res.output
    assert "from-explicit/checkpoints/manifest.json" in res.stdout and "to bfloat16" in res.stdout


def test_bad_config_is_a_usage_error(in_tmp, tiny_llama, tiny_llama_draft):
    (in_tmp / "specbuild.toml").write_text('[no-such-command]\nx = 1\n')
    res = CliRunner().invoke(cli, ["convert", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft),
                                   "--dry-run"], env=CLEAN_ENV)
    assert res.exit_code == 2 and "unknown commands" in res.output
    (in_tmp / "specbuild.toml").write_text("workdir = [unclosed\n")
    res = CliRunner().invoke(cli, ["check", "--target", "x", "--draft", "y"], env=CLEAN_ENV)
    assert res.exit_code == 2 and "not valid TOML" in res.output
