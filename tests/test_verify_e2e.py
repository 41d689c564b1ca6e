"""`specbuild verify` against the real tiny-model deployment (and, with a broken acceptor, that it catches drift)."""

import json

from click.testing import CliRunner

from specbuild.cli.main import cli


def _verify(server, tmp_path, *extra):
    out = tmp_path / "verify.json"
    args = ["verify", "--workdir", str(server.workdir), "--url", server.http_url, "-k", "3", "--max-tokens", "12",
            "--prompt", "The quick brown fox", "--prompt", "def fibonacci(n):", "--out", str(out), *extra]
    return CliRunner().invoke(cli, args), out


def test_verify_passes_on_a_lossless_deployment(running_server, tmp_path):
    result, out = _verify(running_server, tmp_path, "--seeds", "60", "--positions", "2", "--temperature", "1.0")
    assert result.exit_code == 0, result.output
    assert "identical" in result.output and "no drift" in result.output
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert all(c["identical"] for c in report["greedy"])
    assert len(report["sampling"]["positions"]) == 2 and report["sampling"]["seeds"] == 60


def test_verify_refuses_bad_options_before_sending(running_server, tmp_path):
    result, _ = _verify(running_server, tmp_path, "--seeds", "10")
    assert result.exit_code != 0
    assert "too few" in result.output


def test_verify_without_a_server_says_how_to_start_one(tmp_path):
    result = CliRunner().invoke(cli, ["verify", "--workdir", str(tmp_path), "--seeds", "0"])
    assert result.exit_code != 0
    assert "specbuild serve --background" in result.output
