"""The CLI chain as a newcomer types it: a RELATIVE --workdir (the demo's `specbuild-work`), from the
directory that holds it. Every path is resolved once at the CLI boundary, so tritonserver (which runs with
its own cwd) finds its backend directory and the repository finds the engine."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from servers import free_ports
from specbuild.cli.main import cli
from specbuild.pipeline import serve

pytestmark = pytest.mark.server


def test_cli_chain_with_a_relative_workdir(tmp_path, monkeypatch, tiny_llama, tiny_llama_draft):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    wd = ["--workdir", "rel-work"]

    def ok(*args):
        res = runner.invoke(cli, [str(a) for a in args])
        assert res.exit_code == 0, res.output
        return res.output

    ok("convert", "--target", tiny_llama, "--draft", tiny_llama_draft, *wd)
    ok("build", *wd, "--max-batch-size", "2", "--max-seq-len", "256", "--max-draft-len", "3", "--no-calibrate")
    ok("deploy", *wd)
    config = (tmp_path / "rel-work" / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'"{tmp_path / "rel-work"}' in config          # the engine dir is recorded absolute
    http, grpc, metrics = free_ports(3)
    try:
        out = ok("serve", *wd, "--background", "--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics,
                 "--timeout", "240")
        assert f"http://127.0.0.1:{http}" in out
        info = serve.read_state(tmp_path / "rel-work")
        assert info.argv[info.argv.index("--backend-directory") + 1].startswith(str(tmp_path))
        out = ok("infer", *wd, "--prompt", "hello", "--max-tokens", "4", "--num-draft-tokens", "2")
        assert out.strip()
    finally:
        res = runner.invoke(cli, ["stop", *wd])
    assert res.exit_code == 0, res.output
