"""`specbuild loadtest --api openai-*` against a real third-party server: llama.cpp's `llama-server` (build
11434, `make llamacpp`), serving the demo model SmolLM2-135M-Instruct with and without its own draft-model
speculation, each on its own port (a setting names its endpoint). Skipped, with the reason, when llama.cpp
is not built here. The servers are pinned to one thread each and stopped by their own PIDs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli
from specbuild.loadtests import llamacpp

pytestmark = [pytest.mark.server, pytest.mark.timeout(900),
              pytest.mark.skipif(llamacpp.missing() is not None, reason=str(llamacpp.missing()))]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Two llama-servers on the demo model's Q4_1 GGUF: plain, and speculative with itself as the draft."""
    logs = tmp_path_factory.mktemp("llama")
    q4 = llamacpp.model(llamacpp.DRAFT_GGUF)
    plain = llamacpp.LlamaServer(target=q4, parallel=2, ctx=2048, log=logs / "plain.log").start()
    try:
        spec = llamacpp.LlamaServer(target=q4, draft=q4, draft_max=4, parallel=2, ctx=2048,
                                    log=logs / "spec.log").start()
    except Exception:
        plain.stop()
        raise
    yield plain, spec
    plain.stop()
    spec.stop()


def _invoke(args):
    result = CliRunner().invoke(cli, ["loadtest", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_llama_server_with_and_without_its_draft_streaming_completions(llama, tmp_path):
    plain, spec = llama
    out = tmp_path / "report"
    r = _invoke(["--api", "openai-completions", "--tokenizer", str(llamacpp.tokenizer_dir()), "--profile", "chat",
                 "--setting", f"off:url={plain.url}", "--setting", f"draft:url={spec.url}", "--users", "1",
                 "--duration", "2", "--min-requests", "2", "--max-tokens", "16", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "report.json").read_text())
    cells = {c["setting"]: c for c in data["cells"]}
    assert data["api"] == "openai-completions" and data["model"] == "smollm2"
    for name, c in cells.items():
        assert c["status"] == "ok" and c["failures"] == 0, c["errors"]
        assert c["endpoint"]["url"] == (spec.url if name == "draft" else plain.url)
        assert c["ttft_ms"]["count"] == c["requests"] and c["itl_ms"]["count"] > 0
        assert c["output_tokens_per_request"]["p50"] >= 14   # ignore_eos + min_tokens: the asked 16 (re-tokenized)
        assert c["harness"]["zero_work_probe_ms"]["count"] > 0   # GET /health
    # llama.cpp reports its drafts per response (timings); the plain server drafts nothing
    drafted = cells["draft"]["acceptance"]["responses"]
    assert drafted["drafted"] > 0 and 0 < drafted["acceptance_rate"] <= 1   # its own weights as draft: high
    assert not cells["off"]["acceptance"]["responses"]["drafted"]
    assert data["gains"][0]["setting"] == "draft" and data["gains"][0]["e2e_speedup"] > 0


def test_llama_server_chat_completions_non_streaming_and_per_request_fields(llama, tmp_path):
    plain, _ = llama
    out = tmp_path / "report"
    r = _invoke(["--api", "openai-chat", "--url", plain.url, "--tokenizer", str(llamacpp.tokenizer_dir()),
                 "--profile", "batch", "--users", "2", "--duration", "2", "--min-requests", "2",
                 "--max-tokens", "8", "--setting", "greedy:top_k=1,seed=7", "--out", str(out)])
    assert r.exit_code == 0, r.output
    [cell] = json.loads((out / "report.json").read_text())["cells"]
    assert cell["status"] == "ok" and cell["requests"] >= 2 and cell["ttft_ms"] is None   # no stream, no TTFT
    assert cell["tpot_definition"] == "e2e / tokens (non-streaming)" and cell["output_tokens"] > 0
    spec = json.loads((out / cell["run_dir"] / "runspec.json").read_text())
    assert spec["api"] == "openai-chat" and spec["payload"]["top_k"] == 1 and spec["payload"]["seed"] == 7
