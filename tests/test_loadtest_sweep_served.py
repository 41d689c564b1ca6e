"""Sweeps, open loop, settings at different endpoints and users' prompt files, end to end: `specbuild
loadtest` against real tritonservers serving the fixed-timing model of test_loadtest.py (20 ms per step;
num_draft_tokens > 0 emits up to 3 tokens a step), each Locust run a real subprocess under a hard deadline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli
from test_loadtest import TritonFixture

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    a = TritonFixture(tmp_path_factory.mktemp("triton-a"), token_ms=20.0, accept=2)
    try:
        b = TritonFixture(tmp_path_factory.mktemp("triton-b"), token_ms=20.0, accept=2)
    except Exception:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


def _invoke(args: list[str]):
    result = CliRunner().invoke(cli, ["loadtest", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_a_sweep_measures_every_setting_at_every_point_and_finds_the_crossover(servers, tiny_tokenizer, tmp_path):
    a, b = servers
    out = tmp_path / "report"
    # speculation off at one server, on at the other: a setting names its own endpoint
    r = _invoke(["--tokenizer", str(tiny_tokenizer), "--url", a.url, "--metrics-url", "", "--profile", "chat",
                 "--sweep", "users=1,2", "--setting", "off:num_draft_tokens=0",
                 "--setting", f"on:num_draft_tokens=2,url={b.url},metrics_url={b.metrics_url}", "--duration", "2",
                 "--min-requests", "3", "--max-tokens", "12", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "[run 1/4] chat/users=1/off" in r.output and "[run 4/4" in r.output   # progress over the sweep
    data = json.loads((out / "report.json").read_text())
    cells = {(c["sweep"]["value"], c["setting"]): c for c in data["cells"]}
    assert set(cells) == {(u, s) for u in (1, 2) for s in ("off", "on")}
    assert data["sweep"] == {"chat": {"param": "users", "values": [1, 2]}}
    for (users, setting), c in cells.items():
        assert c["status"] == "ok" and c["users"] == users and c["requests"] >= 3
        assert c["endpoint"]["url"] == (b.url if setting == "on" else a.url)
        assert c["client_cpu"]["cpu_s"] > 0 and c["client_cpu"]["cores"] > 0
        run = out / c["run_dir"]
        assert run == out / "runs" / "chat" / f"users-{users}" / setting
        assert (run / "profile_export_aiperf.json").is_file() and (run / "profile_export_aiperf.csv").is_file()
    assert cells[(1, "on")]["acceptance"]["responses"]["drafted"] > 0
    [curve] = data["curves"]
    assert curve["setting"] == "on" and [p["value"] for p in curve["points"]] == [1, 2]
    for p in curve["points"]:   # 3 tokens a step against 1: faster at every point, confidently
        assert p["gain"] > 1 and p["e2e_speedup"] > 1 and p["confidence"]["p_gain_gt_1"] > 0.5
        # each user drew the same prompts in both runs: their TTFTs pair up (a user's n-th request, its prompt)
        assert p["ttft_same_prompts"]["pairs"] >= 2 and p["ttft_same_prompts"]["ttft_speedup"] > 0
    assert curve["crossover"]["value"] == 2 and curve["crossover"]["beyond_sweep"]
    md = (out / "report.md").read_text()
    assert "## Where speculation pays" in md and "| chat | on | users=2 |" in md
    for name in ("gain_vs_load.png", "pareto.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    aiperf = json.loads((out / "profile_export_aiperf.json").read_text())["runs"]
    assert set(aiperf) == {f"chat/users={u}/{s}" for u in (1, 2) for s in ("off", "on")}
    assert aiperf["chat/users=2/on"]["request_count"]["avg"] == cells[(2, "on")]["requests"]


def test_open_loop_and_a_prompt_file_with_its_own_output_lengths(servers, tiny_tokenizer, tmp_path):
    a, _ = servers
    prompts = tmp_path / "inputs.jsonl"
    prompts.write_text('{"text": "the quick brown fox", "output_length": 3}\n'
                       '{"text": "Paris is the capital of France", "output_length": 5}\n')
    out = tmp_path / "report"
    r = _invoke(["--tokenizer", str(tiny_tokenizer), "--url", a.url, "--metrics-url", "", "--model", "ensemble",
                 "--profile", "chat", "--request-rate", "4", "--prompts", str(prompts), "--lengths", "data",
                 "--duration", "3", "--min-requests", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "report.json").read_text())
    [cell] = data["cells"]
    assert cell["status"] == "ok" and cell["request_rate"] == 4 and cell["requests"] >= 4
    assert data["prompts"]["records"] == 2 and data["prompts"]["lengths"] == "data"
    samples = [json.loads(line) for p in (out / cell["run_dir"] / "samples").glob("*.jsonl")
               for line in p.read_text().splitlines()]
    chunks = {s["chunks"] for s in samples if s.get("kind") == "request" and s["ok"]}
    assert chunks <= {3, 5} and chunks      # one streamed piece per token asked for by each record
    spec = json.loads(Path(out / cell["run_dir"] / "runspec.json").read_text())
    assert spec["prompt_output_tokens"] == [3, 5] and spec["request_rate"] == 4


def test_sweep_and_api_refusals_before_any_load(servers, tiny_tokenizer, tmp_path):
    a, _ = servers
    base = ["--tokenizer", str(tiny_tokenizer), "--url", a.url, "--metrics-url", "", "--out", str(tmp_path / "r")]
    r = _invoke(base + ["--sweep", "k=1,2"])
    assert r.exit_code == 2 and "cannot be swept" in r.output
    r = _invoke(base + ["--lengths", "data"])
    assert r.exit_code == 2 and "--prompts FILE" in r.output
    r = _invoke(base + ["--api", "openai-chat"])   # a Triton server is not an OpenAI-compatible one
    assert r.exit_code == 2 and "/v1/models" in r.output
    r = _invoke(base + ["--api", "openai-chat", "--protocol", "grpc"])
    assert r.exit_code == 2 and "HTTP only" in r.output
    assert not (tmp_path / "r").exists()
