"""`specbuild verify` against the real tiny-model deployment (and, with a broken acceptor, that it catches drift)."""

import json

import pytest

from click.testing import CliRunner

from specbuild.cli.main import cli

pytestmark = pytest.mark.server          # starts a real tritonserver


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


def test_verify_catches_a_deliberately_broken_acceptor(tmp_path_factory, tiny_llama, tiny_llama_draft, tmp_path,
                                                        running_server):
    """The same deployment with the test-only rule "unsafe-always-accept" (every drafted token kept, the
    target's verdict ignored): an unrelated draft then changes the output, and verify must exit non-zero."""
    from servers import ServerHandle, deploy_tiny, serve_options

    from specbuild.pipeline import serve

    workdir = deploy_tiny(tmp_path_factory.mktemp("broken"), tiny_llama, tiny_llama_draft)
    cfg_path = workdir / "engines" / "engine_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["acceptance_rule"] = "unsafe-always-accept"
    cfg_path.write_text(json.dumps(cfg))
    opts = serve_options()
    handle = ServerHandle(workdir, opts, serve.start(workdir, opts))
    try:
        result, out = _verify(handle, tmp_path, "--seeds", "0")
        # --reference-url: the K = 0 side on another server, no num_draft_tokens sent (the llmapi path's way).
        # The lossless server against itself passes; against the broken one as the reference it must fail, which
        # only happens if the K = 0 requests really go there (the broken server's default policy drafts).
        fine, _ = _verify(running_server, tmp_path / "same", "--seeds", "0",
                          "--reference-url", running_server.http_url)
        routed, _ = _verify(running_server, tmp_path / "routed", "--seeds", "0", "--reference-url", handle.http_url)
    finally:
        handle.stop()
    assert fine.exit_code == 0, fine.output
    assert routed.exit_code == 1 and "DIVERGES at token" in routed.output, routed.output
    assert result.exit_code == 1, result.output
    assert "DIVERGES at token" in result.output
    report = json.loads(out.read_text())
    assert report["ok"] is False
    bad = [c for c in report["greedy"] if not c["identical"]]
    assert bad and all(c["first_divergence"] is not None and c["context"] for c in bad)
