"""Load-test pieces that need no server: profiles, prompt sets, the comparison spec, gates, metrics
parsing, the report (real matplotlib) and the CLI's refusals before any load is sent."""

from __future__ import annotations

import dataclasses
import inspect
import json
import socket
import textwrap

import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli
from specbuild.core.errors import UsageError
from specbuild.pipeline.loadtest import LoadtestConfig, input_budget, parse_compare, resolve_tokenizer
from specbuild.loadtests import promptsets, report as rep, target
from specbuild.loadtests.rundata import run_key
from specbuild.loadtests.profiles import load_profile, profile_from_dict
from specbuild.loadtests.runner import CellResult, locust_argv
from specbuild.loadtests.runspec import Gates, RunSpec
from specbuild.loadtests.tokens import TokenCounter

BASE = {"users": 2, "duration": 5, "stream": True, "max_tokens": 8, "prompt_set": "chat"}


def test_builtin_profiles_match_the_traffic_they_model():
    chat, batch = load_profile("chat"), load_profile("batch")
    assert chat.stream and 1 <= chat.users <= 4 and chat.max_tokens == 128 and chat.wait_time[1] > 0
    assert not batch.stream and 16 <= batch.users <= 64 and batch.max_tokens == 256
    assert batch.prompt_set == {"summarize": 1} and batch.max_input_tokens > chat.max_input_tokens
    short = chat.with_overrides(users=1, duration=3, max_tokens=8)
    assert (short.users, short.duration, short.max_tokens, short.spawn_rate) == (1, 3.0, 8, 1.0)


@pytest.mark.parametrize("change, message", [
    ({"users_typo": 3}, "unknown field(s) ['users_typo']"),
    ({"users": 0}, "invalid users = 0"),
    ({"users": "4"}, "field 'users' = '4' has type str"),
    ({"users": True}, "field 'users' = True has type bool"),
    ({"stream": 1}, "field 'stream' = 1 has type int"),
    ({"wait_time": [2.0, 1.0]}, "invalid wait_time"),
    ({"wait_time": [1.0]}, "wait_time = [1.0] must be [min, max]"),
    ({"prompt_set": "poems"}, "invalid prompt_set = 'poems'"),
    ({"prompt_set": {"chat": 0}}, "invalid prompt_set.chat = 0"),
    ({"top_p": 1.5}, "invalid top_p = 1.5"),
])
def test_profile_errors_name_the_field_and_the_fix(change, message):
    with pytest.raises(UsageError) as e:
        profile_from_dict({**BASE, **change}, name="p", source="p.toml")
    assert message in str(e.value) and "p.toml" in str(e.value)


def test_profile_missing_field_and_unknown_name(tmp_path):
    with pytest.raises(UsageError, match=r"missing required field\(s\) \['max_tokens'\]"):
        profile_from_dict({k: v for k, v in BASE.items() if k != "max_tokens"}, name="p")
    with pytest.raises(UsageError, match=r"built-in profiles: \['batch', 'chat'\]"):
        load_profile("nosuch")
    bad = tmp_path / "bad.toml"
    bad.write_text("users = [\n")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_profile(bad)


def test_prompt_sets_are_real_text(tiny_tokenizer):
    code = promptsets.code_prompts(seed=1)
    assert len(code) >= 20
    # every code prompt is a prefix of a real stdlib function's source
    sources = []
    for name in promptsets.CODE_MODULES:
        mod = __import__(name, fromlist=["_"])
        for _, f in inspect.getmembers(mod, inspect.isfunction):
            try:
                sources.append(inspect.getsource(f))
            except OSError:   # generated functions (namedtuple methods) have no source
                pass
    for p in code[:10]:
        body = p.split("\n\n", 1)[1]
        assert body.startswith("def ") and any(s.startswith(body.rstrip("\n")) for s in sources)
    assert len(promptsets.chat_prompts()) >= 30 and all(p.endswith(("?", ".")) for p in promptsets.chat_prompts())
    assert all(p.startswith("Summarize") and len(p) > 800 for p in promptsets.summarize_prompts())
    counter = TokenCounter(tiny_tokenizer)
    mix = promptsets.build_prompts({"chat": 1, "summarize": 1}, count=50, seed=3, counter=counter,
                                   max_input_tokens=40)
    assert len(mix) == 50 and max(counter.count(p) for p in mix) <= 40
    assert mix == promptsets.build_prompts({"chat": 1, "summarize": 1}, count=50, seed=3, counter=counter,
                                           max_input_tokens=40)


def test_parse_compare_and_input_budget():
    assert parse_compare("num_draft_tokens=0,4") == ("num_draft_tokens", [0, 4])
    assert parse_compare(None) == (None, [None])
    for bad in ("num_draft_tokens", "num_draft_tokens=4", "num_draft_tokens=1,1", "k=a,b"):
        with pytest.raises(UsageError):
            parse_compare(bad)
    chat = load_profile("chat").with_overrides(max_tokens=32)
    assert input_budget(chat, None) == chat.max_input_tokens
    assert input_budget(chat, 256) == 256 - 32 - 8 - 64          # 64 tokens kept for the chat template
    raw = dataclasses.replace(chat, chat_template=False)
    assert input_budget(raw, 256) == 256 - 32 - 8
    with pytest.raises(UsageError, match="smaller --max-tokens"):
        input_budget(chat.with_overrides(max_tokens=256), 256)


def test_config_refuses_bad_values():
    with pytest.raises(UsageError, match="--protocol"):
        LoadtestConfig(protocol="websocket")
    with pytest.raises(UsageError, match="--max-error-rate"):
        LoadtestConfig(max_error_rate=5)
    with pytest.raises(UsageError, match="--duration"):
        LoadtestConfig(duration=0)


def test_tokenizer_is_found_through_the_deploy_manifest(tmp_path, tiny_tokenizer):
    engines = tmp_path / "elsewhere" / "engines"
    (engines / "tokenizer").mkdir(parents=True)
    (engines / "tokenizer" / "tokenizer.json").write_text((tiny_tokenizer / "tokenizer.json").read_text())
    (tmp_path / "work" / "model_repository").mkdir(parents=True)
    (tmp_path / "work" / "model_repository" / "manifest.json").write_text(
        json.dumps({"inputs": {"engine_dir": str(engines)}}))
    assert resolve_tokenizer(None, tmp_path / "work") == engines / "tokenizer"
    with pytest.raises(UsageError, match="pass --tokenizer"):
        resolve_tokenizer(None, tmp_path / "empty")


def test_gates_and_spec_metrics():
    g = Gates(max_p95_ttft_ms=100, max_error_rate=0.01)
    assert g.violations(p95_ttft_ms=50, p95_tpot_ms=None, p95_e2e_ms=None, error_rate=0.0) == []
    v = g.violations(p95_ttft_ms=150, p95_tpot_ms=None, p95_e2e_ms=None, error_rate=0.02)
    assert v == ["p95 TTFT 150.0 ms > 100 ms", "error rate 2.00% > 1.00%"]
    assert Gates(max_p95_ttft_ms=1).violations(p95_ttft_ms=None, p95_tpot_ms=None, p95_e2e_ms=None,
                                               error_rate=0) == ["p95 TTFT was not measured (gate 1 ms)"]
    before = {"specbuild_draft_tokens_total": 100.0, "specbuild_accepted_tokens_total": 40.0,
              "specbuild_drafts_total": 25.0, "specbuild_acceptance_rate": 0.4, 'nv_inference_count{model="x"}': 5}
    after = {"specbuild_draft_tokens_total": 180.0, "specbuild_accepted_tokens_total": 100.0,
             "specbuild_drafts_total": 45.0, "specbuild_acceptance_rate": 0.55, 'nv_inference_count{model="x"}': 9}
    s = target.spec_summary(target.metric_deltas(before, after))
    assert (s["drafted"], s["accepted"], s["drafts"]) == (80.0, 60.0, 20.0)
    assert s["acceptance_rate"] == pytest.approx(0.75) and s["mean_accepted_length"] == pytest.approx(4.0)


def _samples(e2e_base: float, n: int, accepted: int | None) -> list[dict]:
    return [{"kind": "request", "start": 1000.0 + i, "ok": True, "error": None, "ttft_ms": 10.0 + i,
             "e2e_ms": e2e_base + i, "itl_ms": [5.0, 7.0], "tokens": 11, "chunks": 3,
             "tpot_ms": (e2e_base + i - 10.0 - i) / 10, "accepted": accepted, "drafted": 8 if accepted else None,
             "acceptance_rate": None, "overhead_ms": 0.5} for i in range(n)]


def test_report_figures_gain_table_and_files(tmp_path):
    off = CellResult("chat", "num_draft_tokens=0", tmp_path, 0, 5.0, samples=_samples(110.0, 5, None),
                     probes_ms=[0.2, 0.4])
    on = CellResult("chat", "num_draft_tokens=4", tmp_path, 0, 5.0,
                    samples=_samples(60.0, 5, 4) + [{"kind": "request", "start": 1000.0, "ok": False,
                                                     "error": "RequestFailed: boom", "e2e_ms": 3.0}])
    gates = Gates(max_p95_ttft_ms=12.0)
    measured = [rep.measure_cell(c, stream=True, users=2, gates=gates) for c in (off, on)]
    cells = [cell for cell, _ in measured]
    runs = {run_key(cell): data for cell, data in measured}
    c0, c1 = cells
    assert c0["ttft_ms"]["p50"] == 12.0 and c0["e2e_ms"]["p50"] == 112.0 and c0["itl_ms"]["count"] == 10
    assert c0["tpot_ms"]["p50"] == pytest.approx(10.0) and c0["output_tokens"] == 55
    assert c0["tokens_per_s"] == pytest.approx(55 / (4 + 0.114))
    assert c1["failures"] == 1 and c1["error_rate"] == pytest.approx(1 / 6) and c1["errors"] == ["RequestFailed: boom"]
    assert c1["acceptance"]["responses"] == {"accepted": 20, "drafted": 40, "acceptance_rate": 0.5}
    assert c0["gates"] == {"passed": False, "violations": ["p95 TTFT 13.8 ms > 12 ms"]}
    gains = rep.gain_table(cells, "num_draft_tokens=0")
    assert len(gains) == 1 and gains[0]["e2e_speedup"] == pytest.approx(112 / 62)
    assert gains[0]["ttft_speedup"] == pytest.approx(1.0) and gains[0]["acceptance_rate"] == 0.5
    report = {"url": "http://x", "model": "m", "protocol": "http", "started": "now", "status": "ok",
              "cells": cells, "gains": gains}
    paths = rep.write_report(tmp_path / "out", report, runs)
    data = json.loads(paths["json"].read_text())
    assert {"ttft", "itl", "e2e", "throughput"} <= set(data["plots"])
    assert not [k for c in data["cells"] for k in c if k.startswith("_")]      # the cells alone, no private keys
    assert runs["chat/num_draft_tokens=0"].values["e2e_ms"] == [110.0 + i for i in range(5)]
    for name in data["plots"].values():
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["md"].read_text()
    assert "| chat | num_draft_tokens=4 vs num_draft_tokens=0 | 1.00x | " in md and "1.81x" in md
    assert "FAIL: p95 TTFT 13.8 ms > 12 ms" in md


def test_locust_argv_local_master_worker(tmp_path):
    spec = RunSpec(label="chat", protocol="http", url="http://127.0.0.1:1", grpc_url="127.0.0.1:2", model="m",
                   stream=True, payload={}, prompts=["hi"], tokenizer="t", samples_dir=str(tmp_path))
    local = locust_argv(spec, users=2, spawn_rate=2, duration=5, csv_prefix=tmp_path / "x", stop_timeout=3)
    assert local[1:3] == ["-m", "locust"] and local[local.index("-u") + 1] == "2"
    assert local[local.index("-t") + 1] == "5s" and "--headless" in local and "--master" not in local
    master = locust_argv(spec, users=2, spawn_rate=2, duration=5, csv_prefix=tmp_path / "x", stop_timeout=3,
                         role="master", workers=3, master_port=5600)
    assert master[master.index("--expect-workers") + 1] == "3" and "127.0.0.1" in master
    worker = locust_argv(spec, users=2, spawn_rate=2, duration=5, csv_prefix=tmp_path / "x", stop_timeout=3,
                         role="worker", master_port=5600)
    assert worker[-4:] == ["--master-host", "127.0.0.1", "--master-port", "5600"] and "--headless" not in worker


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_refuses_before_any_load(tmp_path, tiny_tokenizer):
    runner = CliRunner()
    out = tmp_path / "report"
    base = ["loadtest", "--tokenizer", str(tiny_tokenizer), "--out", str(out), "--duration", "1"]
    bad = tmp_path / "bad.toml"
    bad.write_text(textwrap.dedent("""\
        users = 2
        duration = 5
        stream = true
        max_tokens = 8
        prompt_set = "chat"
        think_time = 3
    """))
    r = runner.invoke(cli, base + ["--profile", str(bad)])
    assert r.exit_code == 2 and "unknown field(s) ['think_time']" in r.output
    r = runner.invoke(cli, base + ["--url", f"http://127.0.0.1:{_closed_port()}"])
    assert r.exit_code == 1 and "no Triton server answers" in r.output and "--url" in r.output
    r = runner.invoke(cli, base + ["--compare", "num_draft_tokens=4"])
    assert r.exit_code == 2 and "at least two distinct values" in r.output
    assert not out.exists()
    assert "Example:" in runner.invoke(cli, ["loadtest", "--help"]).output


def test_parse_settings_names_and_fields():
    from specbuild.pipeline.loadtest import parse_settings

    assert parse_settings(["off:num_draft_tokens=0", "ngram:num_draft_tokens=4,proposer=ngram"]) == [
        ("off", {"num_draft_tokens": 0}), ("ngram", {"num_draft_tokens": 4, "proposer": "ngram"})]
    for bad in (["off"], ["a:k"], ["a:k=1", "a:k=2"], ["a:=1", "b:k=2"]):
        with pytest.raises(UsageError):
            parse_settings(bad)
    assert parse_settings(["draft:num_draft_tokens=4"]) == [("draft", {"num_draft_tokens": 4})]   # one config
    # `default`: send no field, measure the deployment's own policy (default K, adaptive K, cut-off)
    assert parse_settings(["off:num_draft_tokens=0", "policy:default"]) == [("off", {"num_draft_tokens": 0}),
                                                                              ("policy", {})]


def test_chat_template_wraps_prompts_and_fixed_output_sets_min_tokens(tiny_tokenizer):
    from specbuild.pipeline.loadtest import _payload

    counter = TokenCounter(tiny_tokenizer)
    wrapped = promptsets.build_prompts({"chat": 1}, count=3, seed=1, counter=counter, max_input_tokens=40, chat=True)
    plain = promptsets.build_prompts({"chat": 1}, count=3, seed=1, counter=counter, max_input_tokens=40)
    for w, p in zip(wrapped, plain):
        assert w == f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n"
    chat = load_profile("chat").with_overrides(max_tokens=32)
    assert chat.fixed_output and _payload(chat, {}, [])["min_tokens"] == 32
    assert "min_tokens" not in _payload(dataclasses.replace(chat, fixed_output=False), {}, [])


# --- adaptive runs, failures kept, server death ------------------------------------------------------

def test_profiles_carry_min_requests_and_a_ceiling():
    chat, batch = load_profile("chat"), load_profile("batch")
    assert chat.min_requests >= 1 and batch.min_requests >= 1
    assert chat.ceiling == max(4 * chat.duration, chat.duration + 60)
    short = chat.with_overrides(duration=3, min_requests=2)
    assert (short.duration, short.min_requests, short.ceiling) == (3.0, 2, 63.0)
    assert chat.with_overrides(duration=10, max_duration=15).ceiling == 15.0
    with pytest.raises(UsageError, match="invalid max_duration"):
        chat.with_overrides(duration=10, max_duration=5)
    with pytest.raises(UsageError, match="invalid min_requests"):
        profile_from_dict({**BASE, "min_requests": 0}, name="p")


class _Entry:
    def __init__(self, n, failed=0):
        self.num_requests, self.num_failures = n, failed


class _Env:
    """The two things RunMonitor reads of a Locust Environment: stats entries and the runner."""

    def __init__(self):
        self.stats = type("S", (), {"entries": {}})()
        self.quits = 0
        self.runner = type("R", (), {"quit": lambda _self: setattr(self, "quits", self.quits + 1)})()


def test_run_monitor_ends_on_duration_and_requests_or_the_ceiling(tmp_path):
    from specbuild.loadtests.stopping import COMPLETE, SERVER_GONE, TOO_SLOW, RunMonitor

    spec = RunSpec(label="chat", protocol="http", url="http://x", grpc_url="x:1", model="m", stream=True,
                   payload={}, prompts=["hi"], tokenizer="t", samples_dir=str(tmp_path / "samples"),
                   run_dir=str(tmp_path), min_duration_s=10, min_requests=5, max_duration_s=40)
    now = [0.0]
    env = _Env()
    mon = RunMonitor(env, spec, clock=lambda: now[0])
    mon.started = 0.0
    env.stats.entries[("chat", "E2E")] = _Entry(9, failed=5)       # 4 completed
    now[0] = 12.0
    assert mon.verdict() is None                                    # duration passed, too few requests
    env.stats.entries[("chat", "E2E")] = _Entry(10, failed=5)
    assert mon.verdict() == COMPLETE
    now[0] = 5.0
    assert mon.verdict() is None                                    # enough requests, duration not yet
    env.stats.entries[("chat", "E2E")] = _Entry(2)
    now[0] = 40.0
    assert mon.verdict() == TOO_SLOW
    mon.end(TOO_SLOW)
    mon.end(COMPLETE)                                               # the first reason stays
    stop = json.loads((tmp_path / "stop.json").read_text())
    assert stop["reason"] == TOO_SLOW and stop["completed"] == 2 and stop["min_requests"] == 5 and env.quits == 1
    gone = RunMonitor(_Env(), spec, clock=lambda: 1.0)
    gone.started, gone.gone = 0.0, "5 consecutive connection errors"
    assert gone.verdict() == SERVER_GONE


def test_connection_errors_are_told_apart_from_server_errors():
    from geventhttpclient.response import HTTPConnectionClosed

    from specbuild.loadtests.stopping import is_connection_error

    class RequestFailed(Exception):   # (triton_user's; importing Locust here would monkey-patch pytest)
        pass

    assert is_connection_error(ConnectionRefusedError(111, "Connection refused"))
    assert is_connection_error(ConnectionResetError()) and is_connection_error(HTTPConnectionClosed("closed"))
    assert is_connection_error(Exception("[StatusCode.UNAVAILABLE] failed to connect to all addresses"))
    assert not is_connection_error(RequestFailed("HTTP 400: bad num_draft_tokens"))
    assert not is_connection_error(TimeoutError("timed out"))


def test_failed_and_too_slow_runs_are_in_every_report_file(tmp_path):
    import csv

    ok = CellResult("chat", "off", tmp_path, 0, 5.0, samples=_samples(110.0, 5, None),
                    stop={"reason": "complete", "min_requests": 5, "min_duration_s": 3, "max_duration_s": 63})
    slow = CellResult("batch", "off", tmp_path, 0, 63.0, samples=_samples(900.0, 2, None),
                      stop={"reason": "too slow to measure here", "completed": 2, "min_requests": 16,
                            "min_duration_s": 3, "max_duration_s": 63})
    failed = CellResult("batch", "draft", tmp_path, 0, 70.0, error="Locust produced no results for batch/draft")
    gone = CellResult("batch", "ngram", tmp_path, 4, 8.0, samples=_samples(50.0, 1, None),
                      stop={"reason": "server gone", "server_gone": "5 consecutive connection errors"})
    measured = [rep.measure_cell(c, stream=c.profile == "chat", users=2) for c in (ok, slow, failed, gone)]
    cells = [cell for cell, _ in measured]
    runs = {run_key(cell): data for cell, data in measured}
    assert [c["status"] for c in cells] == ["ok", "too slow to measure here", "failed", "server gone"]
    from specbuild.loadtests.report import overall_status

    assert overall_status(cells, interrupted=False) == "server gone"
    assert overall_status(cells[:3], interrupted=False) == "runs failed"
    assert overall_status(cells[:2], interrupted=False) == "too slow to measure here"
    assert overall_status(cells, interrupted=True) == "interrupted" and overall_status(cells[:1], interrupted=False) == "ok"
    report = {"url": "http://x", "model": "m", "protocol": "http", "started": "now", "status": "server gone",
              "cells": cells, "gains": []}
    paths = rep.write_report(tmp_path / "out", report, runs)
    md = paths["md"].read_text()
    assert "## Runs that did not complete a measurement" in md
    assert "batch / off: **too slow to measure here**: 2 request(s) completed" in md and "wanted 16" in md
    assert "batch / draft: **failed**" in md and "Locust produced no results" in md
    assert "5 consecutive connection errors" in md
    rows = list(csv.DictReader(open(paths["csv"])))
    assert [(r["profile"], r["setting"], r["status"]) for r in rows] == [
        ("chat", "off", "ok"), ("batch", "off", "too slow to measure here"), ("batch", "draft", "failed"),
        ("batch", "ngram", "server gone")]
    assert float(rows[0]["e2e_ms_p50"]) == 112.0 and rows[2]["requests"] == "0" and rows[2]["e2e_ms_p50"] == ""
    genai = json.loads(paths["genai_perf"].read_text())
    assert set(genai["runs"]) == {"chat/off", "batch/off", "batch/draft", "batch/ngram"}
    assert genai["runs"]["batch/draft"]["request_count"]["avg"] == 0 and "request_latency" not in genai["runs"]["batch/draft"]
    assert not [k for c in json.loads(paths["json"].read_text())["cells"] for k in c if k.startswith("_")]
    assert set(json.loads(paths["aiperf_json"].read_text())["runs"]) == set(genai["runs"])


def test_genai_perf_export_names_statistics_and_units():
    """The names, statistics and units of GenAI-Perf's profile_export_genai_perf.json (export.py says which
    version); statistics as numpy computes them (linear percentiles, population std)."""
    import numpy as np

    from specbuild.loadtests.export import PERCENTILES, genai_perf_export

    samples = _samples(110.0, 5, None)
    for i, s in enumerate(samples):
        s["input_tokens"] = 20 + i
    samples.append({"kind": "request", "start": 1000.0, "ok": False, "error": "x", "e2e_ms": 1.0})
    out = genai_perf_export(samples, stream=True, window_s=4.0, input_config={"profile": "chat"})
    assert list(out) == ["time_to_first_token", "inter_token_latency", "request_latency",
                         "output_token_throughput_per_request", "output_sequence_length", "input_sequence_length",
                         "output_token_throughput", "request_throughput", "request_count", "input_config"]
    stats = ["unit", "avg"] + [f"p{p}" for p in PERCENTILES] + ["min", "max", "std"]
    assert [f"p{p}" for p in PERCENTILES] == ["p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99"]
    e2e = [s["e2e_ms"] for s in samples if s["ok"]]
    rl = out["request_latency"]
    assert list(rl) == stats and rl["unit"] == "ms"
    assert rl["avg"] == pytest.approx(np.mean(e2e)) and rl["std"] == pytest.approx(np.std(e2e))
    assert all(rl[f"p{p}"] == pytest.approx(np.percentile(e2e, p)) for p in PERCENTILES)
    # GenAI-Perf's inter_token_latency is per request (e2e - ttft) / (osl - 1): our TPOT
    assert out["inter_token_latency"]["p50"] == pytest.approx(np.median([s["tpot_ms"] for s in samples[:5]]))
    assert out["input_sequence_length"]["unit"] == "tokens" and out["input_sequence_length"]["max"] == 24
    assert out["output_token_throughput"] == {"unit": "tokens/sec", "avg": 55 / 4.0}
    assert out["request_throughput"] == {"unit": "requests/sec", "avg": 5 / 4.0}
    assert out["request_count"] == {"unit": "count", "avg": 5}
    assert out["output_token_throughput_per_request"]["unit"] == "tokens/sec"
    batch = genai_perf_export(samples, stream=False, window_s=4.0, input_config={})
    assert "time_to_first_token" not in batch and "inter_token_latency" not in batch   # as GenAI-Perf does


def test_prometheus_text_is_parsed_in_one_place():
    from specbuild.core.metrics import metric_sum, parse_prometheus

    text = textwrap.dedent("""\
        # HELP nv_inference_count Number of inferences
        # TYPE nv_inference_count counter
        nv_inference_count{model="ensemble",version="1"} 12
        nv_inference_count{model="ensemble2",version="1"} 3
        specbuild_draft_tokens_total 4.5e2
        nv_gpu_utilization{gpu_uuid="x"} NaN
        with_timestamp 7 1700000000000
        not a sample line
    """)
    s = parse_prometheus(text)
    assert s['nv_inference_count{model="ensemble",version="1"}'] == 12.0 and s["specbuild_draft_tokens_total"] == 450.0
    assert s["with_timestamp"] == 7.0 and len(s) == 5
    assert metric_sum(s, "nv_inference_count") == 15.0 and metric_sum(s, "nv_inference_count", model="ensemble") == 12.0
    assert metric_sum(s, "absent") == 0.0


def test_each_run_waits_for_the_previous_runs_requests_to_leave_the_server(monkeypatch):
    """Closed-loop batch users leave up to users requests in the engine when a run ends (a non-streaming
    /generate is not cancelled by a disconnect); the next run must not start on that backlog."""
    from specbuild.loadtests import target

    series = iter([{"specbuild_live_requests": 24.0}, {"specbuild_live_requests": 9.0},
                   {"specbuild_live_requests": 0.0}])
    monkeypatch.setattr(target, "scrape", lambda url: next(series))
    now = [0.0]
    idle, left = target.wait_idle("http://x/metrics", timeout=60, clock=lambda: now[0],
                                  sleep=lambda dt: now.__setitem__(0, now[0] + dt))
    assert idle and left == 0 and now[0] == 1.0                    # two polls of 0.5 s
    monkeypatch.setattr(target, "scrape", lambda url: {"specbuild_live_requests": 5.0})
    now[0] = 0.0
    idle, left = target.wait_idle("http://x/metrics", timeout=3, clock=lambda: now[0],
                                  sleep=lambda dt: now.__setitem__(0, now[0] + dt))
    assert not idle and left == 5 and now[0] == 3.0                 # bounded
    monkeypatch.setattr(target, "scrape", lambda url: {"nv_inference_count": 3.0})   # no such gauge: no wait
    assert target.wait_idle("http://x/metrics", timeout=60) == (True, None)
    monkeypatch.setattr(target, "scrape", lambda url: None)                          # no metrics port
    assert target.wait_idle(None, timeout=60) == (True, None)


def test_a_run_that_completed_nothing_by_its_ceiling_is_too_slow_not_failed(tmp_path):
    """A forced-draft batch run on a slow machine can end its 75 s ceiling with 0 requests done: that is a
    measurement ("too slow to measure here", with what was seen), not a harness failure (exit 1)."""
    from specbuild.loadtests import report as rep
    from specbuild.loadtests.runner import CellResult

    cell = CellResult(profile="batch", setting="draft", run_dir=tmp_path, exit_code=0, duration_s=81.0,
                      stop={"reason": "too slow to measure here", "completed": 0, "elapsed_s": 75.1,
                            "min_requests": 16, "min_duration_s": 15.0, "max_duration_s": 75.0})
    summary = rep.summarize_cell(cell, stream=False, users=32)
    assert summary["status"] == "too slow to measure here"
    assert rep.overall_status([summary], interrupted=False) == "too slow to measure here"


def test_silences_find_the_gap_with_requests_waiting_and_ignore_idle_time():
    from specbuild.loadtests.stalls import silences

    def req(start, ttft, itl, e2e):
        return {"start": start, "ttft_ms": ttft, "itl_ms": itl, "e2e_ms": e2e}

    steady = [req(t * 0.1, 20.0, [10.0] * 5, 80.0) for t in range(40)]          # 4 s of 10-20 ms gaps
    assert silences(steady)["stalls"] == [] and silences(steady)["longest_s"] < 0.1
    # one request waits through a 6 s silence starting at t = 4.0 (its first piece comes at 10.0)
    paused = steady + [req(4.0, 6000.0, [10.0], 6020.0)] + [req(10.0 + t * 0.1, 20.0, [10.0], 40.0) for t in range(5)]
    out = silences(paused)
    assert len(out["stalls"]) == 1 and 5.8 < out["stalls"][0]["s"] < 6.1 and out["stalls"][0]["waiting"] == 1
    assert out["longest_s"] == out["stalls"][0]["s"] and 3.9 < out["longest_at_s"] < 4.1
    # the same 6 s with nobody waiting (closed-loop think time) is no stall
    idle = steady + [req(10.0 + t * 0.1, 20.0, [10.0], 40.0) for t in range(5)]
    assert silences(idle)["stalls"] == []
    assert silences([])["longest_s"] is None and silences(steady[:1])["stalls"] == []
    # a short run (under 100 silences, so its p99 is its longest): the pause still stands out against the sixth
    # longest silence, and up to five such pauses all do; six equal ones are the run's own pace, not stalls
    short = [req(t * 0.5, 20.0, [], 40.0) for t in range(12)]                    # 12 silences of 20 ms
    assert len(short) * 2 < 100
    out = silences(short + [req(6.0, 6000.0, [], 6000.0)] + [req(12.5 + t * 0.5, 20.0, [], 40.0) for t in range(5)])
    assert [round(s["s"]) for s in out["stalls"]] == [6] and out["longest_s"] == out["stalls"][0]["s"]
    pauses = [req(20.0 + 10 * k, 3000.0, [], 3000.0) for k in range(5)]
    assert len(silences(short + pauses)["stalls"]) == 5
    assert silences(short + pauses + [req(80.0, 3000.0, [], 3000.0)])["stalls"] == []


def test_the_soak_counts_good_requests_slowed_beyond_their_p99_by_a_hostile_one():
    """`slowed_by_hostile`: the bound is the p99 of the good requests that overlapped no hostile request and
    no fault; a good request that overlapped a hostile one and took longer than --slowed-factor x the bound is
    slowed, counted with its case (one above the bound alone is only `beyond_p99`), and the gate fails when
    more than --slowed-max-fraction of the overlapping ones were."""
    from specbuild.loadtests import soak

    good = [(float(i), i + 0.5 + (i % 10) * 0.01, True) for i in range(300)]       # alone: 0.50-0.59 s
    good += [(1000.0, 1003.0, True), (2000.0, 2000.52, True), (3000.0, 3009.0, True), (4000.0, 4000.8, True)]
    hostile = [(1000.5, 1000.6, "stop_words_2m"), (2000.1, 2000.2, "max_tokens_zero"),
               (3000.1, 3000.2, "max_tokens_zero"), (4000.1, 4000.2, "max_tokens_zero (flood)")]
    pause = {"start": 2999.0, "end": 3010.0}                  # the third one overlapped a fault: not judged
    got = soak.slowed_by_hostile(good, hostile, [None, pause], grace=1.0, factor=1.5)
    assert got["overlapping"] == 3 and got["beyond_p99"] == 2                # 3.0 s and 0.8 s > 0.59 s
    assert got["slowed"] == 1 and got["by_case"] == {"stop_words_2m": 1}     # 0.8 s < 1.5 x 0.59 s
    assert got["by_profile"]["chat"]["p99_alone_s"] == 0.59 and got["examples"][0]["latency_s"] == 3.0
    assert got["ratio"]["max"] == round(3.0 / 0.59, 2) and got["ratio"]["p50"] == round(0.8 / 0.59, 2)
    tight = soak.slowed_by_hostile(good, hostile, [None, pause], grace=1.0, factor=1.0)
    assert tight["slowed"] == 2 and tight["by_case"] == {"stop_words_2m": 1, "max_tokens_zero (flood)": 1}
    args = soak.parse_args([])
    report = {"server_gone": [], "good_wrong_text": 0, "good_failed": 0, "hostile_by_case": {},
              "hostile_one_by_one": {}, "memory": [], "end": {"live": 0, "slots_free": 8}, "slots_total": 8,
              "faults": [], "after_pause": {}, "abandoned": {}, "by_kind": {"good_served": 1},
              "slowed_by_hostile": {**got, "slowed": 4, "overlapping": 40}}
    assert any("overlapped a hostile one" in r for r in soak.gate(report, args)["reasons"])
    report["slowed_by_hostile"] = got
    assert soak.gate(report, args)["passed"]


def test_load_generators_build_one_tls_context_per_process(monkeypatch):
    """httpx builds a TLS context (certifi's CA bundle, ~18 ms of CPU) for each top-level call unless handed one:
    the soak's flood paid it per request and measured its own CPU. Every client goes through specbuild.core.http, which
    builds one per process, with verification on."""
    import http.server
    import ssl
    import threading

    from specbuild.core import http as shttp
    from specbuild.loadtests.soak import send_hostile

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length") or 0))
            body = b'{"error": "max_tokens=0 must be >= 1"}'
            self.send_response(400)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    loads = []
    real = ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                        lambda self, *a, **kw: (loads.append(1), real(self, *a, **kw))[1])
    shttp.tls_context.cache_clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        for ep in ("generate", "generate_stream", "generate"):
            label, message = send_hostile(base, "max_tokens_zero", "ensemble", ep, "Hi", 8, 10)
            assert (label, message) == ("400", "max_tokens=0 must be >= 1")
        with shttp.Client(timeout=10) as c:
            assert c.post(f"{base}/x", json={}).status_code == 400
        assert shttp.post(f"{base}/x", json={}, timeout=10).status_code == 400
    finally:
        server.shutdown()
    assert len(loads) == 1, f"{len(loads)} CA bundles loaded for 5 requests"
    assert shttp.tls_context().verify_mode == ssl.CERT_REQUIRED and shttp.tls_context().check_hostname
