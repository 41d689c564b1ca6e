"""`specbuild tune`: scoring and winner selection, the deployment default, tune.json/tune.md, what `--apply`
writes (the engine's engine_config.json, which a re-deploy keeps), refusals before any load, and one
end-to-end sweep against the real tiny-model tritonserver (tests/servers.py)."""

from __future__ import annotations

import json
import shutil
import socket

import httpx
import pytest
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from specbuild.cli.main import cli
from specbuild.engines.embedded.deploy import render
from specbuild.core.errors import ManifestError, UsageError
from specbuild.loadtests.report import summarize_cell
from specbuild.loadtests.runner import CellResult
from specbuild.core.manifest import Manifest, write_manifest
from specbuild.engines.embedded.config import ConfigError, EngineConfig, Policy
from specbuild.pipeline.tune import TuneConfig, apply_policy, parse_k_list, plan_settings, sweep_ks, tuned_policy
from specbuild.pipeline.tune_score import (OBJECTIVES, Setting, cell_row, choose_default, choose_winner, gain_vs_baseline,
                                  render_markdown)

LAT, THR = OBJECTIVES["latency"], OBJECTIVES["throughput"]


def row(label, k, proposer=None, *, tpot=None, e2e=100.0, tps=None, requests=10, failures=0):
    return {"label": label, "k": k, "proposer": proposer, "requests": requests, "failures": failures,
            "tpot_ms_p50": tpot, "e2e_ms_p50": e2e, "tokens_per_s": tps}


# --- pure parts ---------------------------------------------------------------------------------------

def test_k_list_and_config_refusals():
    assert parse_k_list("0, 2,4") == (0, 2, 4)
    with pytest.raises(UsageError, match="not an integer"):
        parse_k_list("0,two")
    for ks, msg in (((0, -1, 2), "negative"), ((0, 2, 2), "repeats"), ((0,), "no K > 0")):
        with pytest.raises(UsageError, match=msg):
            TuneConfig(ks=ks)
    with pytest.raises(UsageError, match="draft, ngram|'draft', 'ngram'"):
        TuneConfig(ks=(0, 2), proposers=("medusa",))
    with pytest.raises(UsageError, match="--duration"):
        TuneConfig(duration=0)
    assert sweep_ks(None, 4) == (0, 1, 2, 4) and sweep_ks(None, None) == (0, 1, 2, 4, 6)
    with pytest.raises(UsageError, match="no K > 0 to tune"):
        sweep_ks(None, 0)
    with pytest.raises(UsageError, match="K=6 is above the deployment's max_draft_len 4"):
        sweep_ks((0, 2, 6), 4)


def test_plan_settings_measures_k0_once():
    labels = [s.label for s in plan_settings((0, 2, 4), ("draft", "ngram"))]
    assert labels == ["k=0", "k=2/draft", "k=2/ngram", "k=4/draft", "k=4/ngram"]
    assert [s.label for s in plan_settings((2, 0), None)] == ["k=0", "k=2"]
    assert Setting(3, "ngram").request_fields() == {"num_draft_tokens": 3, "proposer": "ngram"}
    assert Setting(0, None).request_fields() == {"num_draft_tokens": 0} and Setting(2, "draft").slug == "k2-draft"


def test_chat_lowest_tpot_wins_and_failures_disqualify():
    rows = [row("k=0", 0, tpot=20.0), row("k=2/draft", 2, "draft", tpot=12.0, failures=1),
            row("k=2/ngram", 2, "ngram", tpot=15.0), row("k=4/ngram", 4, "ngram", tpot=18.0)]
    win = choose_winner(rows, LAT)
    assert win["label"] == "k=2/ngram"
    assert rows[1]["valid"] is False and "1 failed" in rows[1]["why_invalid"] and rows[1]["score"] is None
    assert gain_vs_baseline(rows, win, LAT) == pytest.approx(20.0 / 15.0)


def test_tie_within_one_percent_goes_to_lower_e2e_then_smaller_k():
    rows = [row("k=0", 0, tpot=10.05, e2e=90.0), row("k=2", 2, tpot=10.0, e2e=95.0), row("k=4", 4, tpot=12.0)]
    assert choose_winner(rows, LAT)["label"] == "k=0"
    rows = [row("k=4", 4, tpot=10.0, e2e=90.0), row("k=2", 2, tpot=10.0, e2e=90.0)]
    assert choose_winner(rows, LAT)["label"] == "k=2"
    rows = [row("k=0", 0, tpot=10.0, e2e=90.0), row("k=2", 2, tpot=9.0, e2e=95.0)]   # 10% apart: no tie
    assert choose_winner(rows, LAT)["label"] == "k=2"


def test_batch_highest_throughput_wins_and_nothing_valid_gives_none():
    rows = [row("k=0", 0, tps=100.0), row("k=2", 2, tps=140.0), row("k=4", 4, tps=150.0, requests=0)]
    assert choose_winner(rows, THR)["label"] == "k=2"
    assert rows[2]["why_invalid"] == "no request completed"
    assert gain_vs_baseline(rows, rows[1], THR) == pytest.approx(1.4)
    assert choose_winner([row("k=0", 0, tps=None), row("k=2", 2, tps=5.0, failures=2)], THR) is None


def test_default_setting_minimises_summed_regret_across_profiles():
    chat = [row("k=0", 0, tpot=20.0), row("k=2", 2, tpot=10.0), row("k=4", 4, tpot=11.0)]
    batch = [row("k=0", 0, tps=100.0), row("k=2", 2, tps=60.0), row("k=4", 4, tps=95.0)]
    profiles = {}
    for name, rows, obj in (("chat", chat, LAT), ("batch", batch, THR)):
        win = choose_winner(rows, obj)
        profiles[name] = {"objective": obj.__dict__, "settings": rows, "winner": win}
    assert profiles["chat"]["winner"]["label"] == "k=2" and profiles["batch"]["winner"]["label"] == "k=0"
    # regrets: k=0: 1.0 + 0; k=2: 0 + 0.667; k=4: 0.1 + 0.053 -> k=4 loses least overall
    d = choose_default(profiles)
    assert (d["label"], d["k"]) == ("k=4", 4) and d["summed_regret"] == pytest.approx(0.1 + 100 / 95 - 1)
    assert choose_default({"chat": profiles["chat"]})["label"] == "k=2"
    profiles["batch"]["winner"] = None
    assert choose_default(profiles) is None


def test_one_profiles_default_is_its_winner_even_when_a_tied_setting_scores_a_little_better():
    """A row inside the winner's 1 % tie band can have the better primary score and still lose the tie-break;
    its regret is 0, not negative, so it cannot take the default from the winner (seen once in CI: winner
    k=2/ngram, default k=2/draft)."""
    rows = [row("k=0", 0, tpot=20.0, e2e=400.0), row("k=2/draft", 2, "draft", tpot=10.0, e2e=300.0),
            row("k=2/ngram", 2, "ngram", tpot=10.05, e2e=200.0)]
    win = choose_winner(rows, LAT)
    assert win["label"] == "k=2/ngram"                      # tied on TPOT, lower e2e
    d = choose_default({"chat": {"objective": LAT.__dict__, "settings": rows, "winner": win}})
    assert d["label"] == "k=2/ngram" and d["summed_regret"] == 0.0


def _cell(setting: str, *, e2e: float, tokens: int, accepted: int, drafted: int, failed: int = 0) -> dict:
    samples = [{"kind": "request", "ok": True, "start": 1000.0 + i, "e2e_ms": e2e, "ttft_ms": 5.0,
                "tpot_ms": (e2e - 5.0) / (tokens - 1), "itl_ms": [2.0, 3.0], "tokens": tokens,
                "accepted": accepted, "drafted": drafted, "overhead_ms": 0.1} for i in range(4)]
    samples += [{"kind": "request", "ok": False, "start": 1000.0, "e2e_ms": 1.0, "tokens": 0,
                 "error": "HTTP 400"}] * failed
    cell = CellResult(profile="chat", setting=setting, run_dir=None, exit_code=0, duration_s=5.0, samples=samples)
    return summarize_cell(cell, stream=True, users=2, metrics={"acceptance_rate": 0.5, "mean_accepted_length": 2.0})


def test_cell_row_reads_a_real_loadtest_summary_and_markdown_lists_every_setting():
    rows = [cell_row(Setting(0, None), _cell("k0", e2e=300.0, tokens=31, accepted=0, drafted=0)),
            cell_row(Setting(2, "draft"), _cell("k2", e2e=150.0, tokens=31, accepted=30, drafted=40)),
            cell_row(Setting(2, "ngram"), _cell("k2n", e2e=100.0, tokens=31, accepted=3, drafted=40, failed=1))]
    assert rows[1]["tpot_ms_p50"] == pytest.approx(145.0 / 30) and rows[1]["acceptance_rate"] == 0.75
    assert rows[1]["mean_accepted_length"] == 2.0 and rows[1]["requests"] == 4 and rows[2]["failures"] == 1
    win = choose_winner(rows, LAT)
    assert win["label"] == "k=2/draft"   # the faster ngram run had a failed request
    result = {"url": "http://x", "model": "tensorrt_llm_bls", "started": "s", "finished": "f", "status": "ok",
              "machine": {"platform": "linux", "cpu_count": 2},
              "sweep": {"k": [0, 2], "proposers": ["draft", "ngram"], "note": None},
              "profiles": {"chat": {"objective": LAT.__dict__, "settings": rows, "baseline": "k=0",
                                    "winner": {k: win[k] for k in ("label", "k", "proposer", "score")},
                                    "gain_vs_baseline": gain_vs_baseline(rows, win, LAT)}},
              "default": {"label": "k=2/draft", "rule": "r"}, "applied": None}
    md = render_markdown(result)
    assert "## chat" in md and "Winner: **k=2/draft** (2.03x vs k=0)" in md
    assert md.count("| k=") == 3 and "1 failed request(s)" in md and "**winner**" in md


# --- --apply: the config edit on a real rendered repository -------------------------------------------

@pytest.fixture
def repo_workdir(tmp_path):
    """A workdir as `specbuild deploy` leaves it: the rendered embedded repository + its manifest."""
    repo = tmp_path / "model_repository"
    for rel, text in render(tmp_path / "engines", {"max_batch_size": 8, "device": "cpu", "threads": 1}).items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    write_manifest(repo, Manifest(stage="deploy", inputs={}, options={"backend": "embedded"}))
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "engine_config.json").write_text(json.dumps({"max_draft_len": 4, "draft": "draft"}))
    return tmp_path


def parse(path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_apply_writes_the_policy_into_the_engine_config_and_leaves_the_repository_alone(repo_workdir):
    repo = repo_workdir / "model_repository"
    path = repo / "tensorrt_llm" / "config.pbtxt"
    before = path.read_text()
    assert "policy" not in parse(path).parameters          # the policy is no parameter of the deployment
    out = apply_policy(repo, Policy(k=4, proposer="draft", source="tune"))
    engines = repo_workdir / "engines"
    assert EngineConfig.load(engines).policy == Policy(k=4, proposer="draft", source="tune")
    assert EngineConfig.load(engines).max_draft_len == 4   # the rest of the engine config as it was
    assert out["config"] == str(engines / "engine_config.json")
    assert out["described"] == "K=4 with the draft, at any concurrency"
    assert "specbuild stop" in out["restart"] and "serve" in out["restart"]
    assert path.read_text() == before
    apply_policy(repo, Policy(k=0, proposer="draft"))      # applying again replaces
    assert EngineConfig.load(engines).policy.k == 0


def test_apply_refusals_leave_the_engine_config_untouched(repo_workdir, tmp_path_factory):
    repo = repo_workdir / "model_repository"
    path = repo_workdir / "engines" / "engine_config.json"
    original = path.read_text()
    with pytest.raises(UsageError, match="max_draft_len=4"):
        apply_policy(repo, Policy(k=6))
    with pytest.raises(ConfigError, match="unknown"):
        Policy(k=2, proposer="medusa")
    assert path.read_text() == original
    with pytest.raises(ManifestError, match="run `specbuild deploy`"):
        apply_policy(tmp_path_factory.mktemp("empty") / "model_repository", Policy(k=2))
    write_manifest(repo, Manifest(stage="deploy", inputs={}, options={"backend": "trtllm"}))
    with pytest.raises(UsageError, match="embedded engine only"):
        apply_policy(repo, Policy(k=2))
    assert path.read_text() == original


def _engine_policy(workdir):
    """The policy the engine process loads from the rendered repository: its `tensorrt_llm` parameters, exactly
    as `model_repository/embedded/triton_models.py` hands them to `engines/embedded/service.py`."""
    from specbuild.engines.embedded.service import load_frontend

    params = {k: v.string_value for k, v in
              parse(workdir / "model_repository" / "tensorrt_llm" / "config.pbtxt").parameters.items()}
    frontend = load_frontend(params["engine_dir"], params, lambda m: None)
    try:
        return frontend.engine.config.policy
    finally:
        frontend.close(timeout=5.0)


def test_a_re_deploy_keeps_a_tuned_policy(tiny_llama, tmp_path):
    """build -> deploy -> tune --apply's write -> deploy again: the engine runs the tuned policy."""
    from specbuild.pipeline.build import build
    from specbuild.pipeline.convert import convert
    from specbuild.pipeline.deploy import deploy

    wd = tmp_path / "work"
    convert(str(tiny_llama), str(tiny_llama), workdir=wd)
    build(workdir=wd, max_batch_size=2, max_seq_len=64, max_draft_len=4, calibrate=False)
    deploy(workdir=wd)
    built = _engine_policy(wd)
    tuned = Policy(k=2, proposer="ngram", source="tune: k=2/ngram")
    assert built != tuned
    apply_policy(wd / "model_repository", tuned)
    assert _engine_policy(wd) == tuned
    deploy(workdir=wd, force=True)                     # a re-deploy renders the whole repository again
    assert _engine_policy(wd) == tuned
    deploy(workdir=wd, threads=1)                      # so does one with other options
    assert _engine_policy(wd) == tuned


def test_the_engine_refuses_a_stale_policy_parameter(repo_workdir):
    from specbuild.engines.embedded.service import load_frontend

    with pytest.raises(ConfigError, match="engine_config.json"):
        load_frontend(str(repo_workdir / "engines"), {"policy": '{"k": 2}'}, lambda m: None)


# --- CLI refusals before any load ---------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, code, message", [
    (["--profile", "nope", "--k", "0,2"], 2, "unknown profile 'nope'"),
    (["--k", "0,-2"], 2, "negative"),
    (["--k", "0,2,2"], 2, "repeats"),
    (["--k", "0,8"], 2, "K=8 is above the deployment's max_draft_len 4"),
    (["--k", "0,2", "--proposer", "draft,lookahead"], 2, "--proposer"),
    (["--k", "0,2"], 1, "no Triton server answers"),
])
def test_cli_refuses_before_any_load(repo_workdir, tiny_tokenizer, args, code, message):
    out = repo_workdir / "tune-out"
    res = CliRunner().invoke(cli, ["tune", "--workdir", str(repo_workdir), "--tokenizer", str(tiny_tokenizer),
                                   "--url", f"http://127.0.0.1:{_free_port()}", "--out", str(out)] + args)
    assert res.exit_code == code, res.output
    assert message in res.output
    assert not out.exists()


# --- end to end: the real tiny-model server ------------------------------------------------------------

@pytest.mark.server
def test_tune_end_to_end_against_the_real_server(running_server, tmp_path):
    """K in {0, 2} for chat, 2 users, ~4 s per setting; --apply on a copy of the served engine, deployed."""
    from specbuild.pipeline.deploy import deploy

    work = tmp_path / "work"
    shutil.copytree(running_server.workdir / "engines", work / "engines")     # --apply writes its engine_config.json
    deploy(workdir=work)
    res = CliRunner().invoke(cli, ["tune", "--workdir", str(work), "--url", running_server.http_url,
                                   "--metrics-url", running_server.metrics_url, "--profile", "chat",
                                   "--k", "0,2", "--duration", "4", "--users", "2", "--max-tokens", "8",
                                   "--apply"])
    assert res.exit_code == 0, res.output
    result = json.loads((work / "tune" / "tune.json").read_text())
    sweep = result["sweep"]
    expected = ["k=0", "k=2/draft", "k=2/ngram"] if sweep["proposer_swept"] else ["k=0", "k=2"]
    assert sweep["settings"] == expected and (sweep["note"] is None) == sweep["proposer_swept"]
    chat = result["profiles"]["chat"]
    assert [r["label"] for r in chat["settings"]] == expected
    assert chat["winner"]["label"] in expected and result["default"]["label"] == chat["winner"]["label"]
    for r in chat["settings"]:
        assert r["requests"] > 0 and r["failures"] == 0 and r["tpot_ms_p50"] > 0 and r["tokens_per_s"] > 0
        assert (work / "tune" / r["report"]).is_file() and r["status"] == "ok"
        run = (work / "tune" / r["report"]).parent   # one shared skeleton: no per-candidate report/manifest
        assert (run / "locust_stats.csv").is_file() and not (run / "report.json").exists()
        assert not (run / "manifest.json").exists()
    assert [r for r in chat["settings"] if r["k"] == 2][0]["drafted"] > 0
    assert chat["profile"]["users"] == 2 and chat["profile"]["max_tokens"] == 8
    assert result["machine"]["cpu_count"] >= 1 and result["status"] == "ok"
    md = (work / "tune" / "tune.md").read_text()
    assert "## chat" in md and f"Winner: **{chat['winner']['label']}**" in md
    assert EngineConfig.load(work / "engines").policy.k == chat["winner"]["k"]
    assert result["applied"]["config"] == str((work / "engines" / "engine_config.json").resolve())
    assert "restart to apply" in res.output
    assert "fewer than 10 requests" in md.lower() or all(r["requests"] >= 10 for r in chat["settings"])
    # the tuned engine loads in the real tritonserver ("restart") and answers
    from servers import serve_options
    from specbuild.pipeline import serve

    info = serve.start(work, serve_options())
    try:
        gen = httpx.post(f"{info.http_url}/v2/models/tensorrt_llm_bls/generate",
                         json={"text_input": "Hello", "max_tokens": 4}, timeout=120)
        assert gen.status_code == 200 and "text_output" in gen.json()
    finally:
        serve.stop(work, timeout=20)
