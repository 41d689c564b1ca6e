"""The CLI reference, docs/cli.md, must match `--help` of every registered command (regenerate with
`python scripts/gen_cli_reference.py`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("gen_cli_reference", ROOT / "scripts" / "gen_cli_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cli_reference_is_current():
    gen = _script()
    assert gen.main(["--check"]) == 0, "docs/cli.md is stale: run `python scripts/gen_cli_reference.py`"


def test_reference_covers_every_command_and_check_detects_staleness(tmp_path):
    from specbuild.cli.main import COMMANDS

    gen = _script()
    section = gen.render()
    for name in COMMANDS:
        assert f"### `specbuild {name}`" in section and f"Usage: specbuild {name} [OPTIONS]" in section
        assert "Example" in section.split(f"### `specbuild {name}`")[1].split("### ")[0], f"{name}: no Example"
    doc = tmp_path / "cli.md"
    doc.write_text(f"# x\n\n{gen.START}\nold text\n{gen.END}\ntrailer\n")
    assert gen.main(["--check", "--file", str(doc)]) == 1
    assert gen.main(["--file", str(doc)]) == 0
    assert gen.main(["--check", "--file", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# x\n\n") and text.endswith("\ntrailer\n") and "old text" not in text
