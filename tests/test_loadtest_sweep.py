"""Sweeps, users' own prompt files, the standard speculation counters and the AIPerf export: the parts that
need no server (the served sweep is in test_loadtest_sweep_served.py)."""

from __future__ import annotations

import csv
import io
import json
import random

import pytest

from specbuild.loadtests import export, sweep
from specbuild.loadtests.datasets import load_prompt_file
from specbuild.loadtests.target import metric_deltas, spec_summary
from specbuild.core.errors import UsageError
from specbuild.core.metrics import parse_prometheus


def test_parse_sweeps_shared_per_profile_and_refusals():
    s = sweep.parse_sweeps(["users=4,1,2"], ["chat", "batch"])
    assert s["chat"] == s["batch"] and s["chat"].values == (1, 2, 4) and s["chat"].param == "users"
    s = sweep.parse_sweeps(["batch:users=8,16", "users=1,2"], ["chat", "batch"])
    assert s["chat"].values == (1, 2) and s["batch"].values == (8, 16)   # a profile's own sweep wins
    assert sweep.parse_sweeps(["request_rate=0.5,2"], ["chat"])["chat"].values == (0.5, 2.0)
    for bad, msg in ((["users"], "must look like"), (["k=1,2"], "cannot be swept"), (["users=1,x"], "not an integer"),
                     (["users=0,1"], "must be > 0"), (["users=1,1"], "repeats"), (["nope:users=1"], "not run"),
                     (["users=1", "users=2"], "two sweeps")):
        with pytest.raises(UsageError, match=msg):
            sweep.parse_sweeps(bad, ["chat"])


RUNS: dict = {}      # run_key -> RunData of the cells `_cell` made (carried beside them, as loadtest does)


def _cell(profile, setting, value, e2e, tokens=64, stream=True, n=40, seed=0):
    from specbuild.loadtests.rundata import RunData, run_key

    rng = random.Random(f"{setting}-{value}-{seed}")
    e2es = [e2e * rng.uniform(0.9, 1.1) for _ in range(n)]
    cell = {"profile": profile, "setting": setting, "status": "ok", "stream": stream, "users": value,
            "sweep": {"param": "users", "value": value}, "requests": n,
            "e2e_ms": {"p50": sorted(e2es)[n // 2]}, "ttft_ms": {"p50": 10.0} if stream else None,
            "tpot_ms": {"p50": e2e / tokens}, "tokens_per_s": value * tokens / (e2e / 1000)}
    RUNS[run_key(cell)] = RunData(values={"e2e_ms": e2es, "tokens": [tokens] * n,
                                          "tpot_ms": [x / tokens for x in e2es]})
    return cell


def test_gain_curve_crossover_and_confidence():
    # speculation 1.5x faster at 1 user, 1.2x at 2, 1.02x at 4 (within noise), 0.7x at 8: crossover 4, low confidence
    cells = []
    for value, speedup in ((1, 1.5), (2, 1.2), (4, 1.02), (8, 0.7)):
        cells += [_cell("chat", "off", value, 1000.0), _cell("chat", "draft", value, 1000.0 / speedup)]
    [curve] = sweep.curves(cells, "off", RUNS)
    assert curve["param"] == "users" and [p["value"] for p in curve["points"]] == [1, 2, 4, 8]
    gains = [p["gain"] for p in curve["points"]]
    assert gains[0] > gains[1] > 1 > gains[3] and all(p["objective"] == "latency" for p in curve["points"])
    conf = [p["confidence"]["p_gain_gt_1"] for p in curve["points"]]
    assert conf[0] == 1.0 and conf[3] == 0.0 and all(0 <= c <= 1 for c in conf)
    lo, hi = curve["points"][0]["confidence"]["ci90"]
    assert lo <= gains[0] <= hi
    x = curve["crossover"]
    if gains[2] > 1:   # the 1.02x point: noise can put its median either side of 1
        assert x["value"] == 4 and x["p_gain_gt_1"] < 0.99 and x["beats_at_every_point_below"]
    else:
        assert x["value"] == 2
    assert not x["beyond_sweep"]
    # batch is scored on throughput (tok/s on / off); beating at every point: the crossover is beyond the sweep
    cells = [c for v in (1, 4) for c in (_cell("batch", "off", v, 900.0, stream=False),
                                         _cell("batch", "k4", v, 600.0, stream=False))]
    [curve] = sweep.curves(cells, "off", RUNS)
    assert all(p["objective"] == "throughput" and p["gain"] == pytest.approx(1.5) for p in curve["points"])
    assert curve["crossover"]["value"] == 4 and curve["crossover"]["beyond_sweep"]
    # a point whose run was too slow to measure stays in the curve, without a gain
    slow = _cell("batch", "k4", 8, 600.0, stream=False)
    slow["status"] = "too slow to measure here"
    cells += [_cell("batch", "off", 8, 900.0, stream=False), slow]
    [curve] = sweep.curves(cells, "off", RUNS)
    assert curve["points"][-1]["gain"] is None and curve["points"][-1]["status"]["setting"] == slow["status"]
    assert curve["crossover"]["value"] == 4 and not curve["crossover"]["beyond_sweep"]
    never = sweep.crossover([{"value": 1, "gain": 0.9, "confidence": None}])
    assert never["value"] is None and "never beats" in never["note"]


def test_prompt_files_jsonl_and_sharegpt(tmp_path, tiny_tokenizer):
    from specbuild.loadtests.tokens import TokenCounter

    counter = TokenCounter(tiny_tokenizer)
    jsonl = tmp_path / "inputs.jsonl"
    jsonl.write_text('{"text": "What is the capital of France?", "output_length": 12}\n\n'
                     '{"texts": ["Summarize:", "the fox"]}\n{"text_input": "legacy name"}\n')
    recs = load_prompt_file(jsonl)
    assert [(r.text, r.output_tokens) for r in recs] == [("What is the capital of France?", 12),
                                                         ("Summarize:\nthe fox", None), ("legacy name", None)]
    share = tmp_path / "sharegpt.json"
    reply = "The capital of France is Paris, a city on the Seine."
    share.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "Capital of France?"},
                                      {"from": "gpt", "value": reply}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only one turn"}]},     # skipped
        {"id": "c", "conversations": [{"from": "system", "value": "be brief"}, {"from": "user", "value": "Hi"},
                                      {"from": "assistant", "value": "Hello!"}]}]))
    recs = load_prompt_file(share, counter=counter)
    assert [r.text for r in recs] == ["Capital of France?", "Hi"]
    assert recs[0].output_tokens == counter.count(reply) and recs[1].output_tokens == counter.count("Hello!")
    for content, msg in (('{"text": ""}\n', "no prompt text"), ('{"text": "x", "output_length": 0}\n', ">= 1"),
                         ("not json\n", "is not a JSON object"), ("[{]", "not valid JSON")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(content)
        with pytest.raises(UsageError, match=msg):
            load_prompt_file(bad)
    with pytest.raises(UsageError, match="no usable record"):
        (tmp_path / "one.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "x"}]}]))
        load_prompt_file(tmp_path / "one.json", "sharegpt")


VLLM_TEXT = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} %d
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} %d
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} %d
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} %d
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} %d
specbuild_draft_tokens_total %d
"""


def test_vllm_schema_counters_are_read_first_with_per_position_acceptance():
    before = parse_prometheus(VLLM_TEXT % (10, 20, 12, 8, 4, 20))
    after = parse_prometheus(VLLM_TEXT % (30, 60, 36, 24, 12, 60))
    s = spec_summary(metric_deltas(before, after))
    assert s["schema"] == "vllm" and (s["drafts"], s["drafted"], s["accepted"]) == (20, 40, 24)
    assert s["acceptance_rate"] == pytest.approx(0.6) and s["mean_accepted_length"] == pytest.approx(2.2)
    assert s["per_position"] == pytest.approx([0.8, 0.4])
    assert "specbuild_draft_tokens_total" in s["counters"]   # both exported: the vLLM names are read, not summed
    # llama.cpp's server (build 11434) exports the same schema under its own prefix
    llama = {"llamacpp:spec_decode_num_drafts_total": 7.0, "llamacpp:spec_decode_num_draft_tokens_total": 21.0,
             "llamacpp:spec_decode_num_accepted_tokens_total": 11.0, "llamacpp:tokens_predicted_total": 20.0,
             'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}': 5.0,
             'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"}': 2.0}
    s = spec_summary(llama)
    assert s["schema"] == "vllm (llamacpp: prefix)" and s["acceptance_rate"] == pytest.approx(11 / 21)
    assert s["mean_accepted_length"] == pytest.approx(1 + 11 / 7) and s["per_position"] == pytest.approx([5 / 7, 2 / 7])
    # without vLLM names: matched by name, no per-position figures
    loose = spec_summary({"specbuild_accepted_tokens_total": 6.0, "specbuild_draft_tokens_total": 8.0,
                          "specbuild_drafts_total": 2.0})
    assert loose["schema"] == "matched by name" and loose["acceptance_rate"] == 0.75 and loose["per_position"] is None


def _samples(n=5, stream=True):
    return [{"ok": True, "start": 100.0 + i, "e2e_ms": 200.0 + i, "ttft_ms": 20.0 + i if stream else None,
             "itl_ms": [10.0, 12.0] if stream else [], "tpot_ms": 4.0 + i / 10, "tokens": 40 + i, "input_tokens": 9}
            for i in range(n)] + [{"ok": False, "start": 99.0, "e2e_ms": 5.0, "tokens": 0}]


def test_aiperf_export_names_statistics_and_csv_layout():
    out = export.aiperf_export(_samples(), stream=True, window_s=10.0, input_config={"profile": "chat"})
    for tag in ("time_to_first_token", "time_to_second_token", "request_latency", "inter_token_latency",
                "inter_chunk_latency", "output_token_throughput_per_user", "output_sequence_length",
                "input_sequence_length"):
        assert tuple(out[tag]) == ("unit", "avg", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99",
                                   "min", "max", "std", "count", "sum"), tag   # aiperf 0.13's keys, in its order
    assert out["request_latency"]["unit"] == "ms" and out["request_latency"]["count"] == 5
    assert out["request_latency"]["p50"] == 202.0 and out["request_latency"]["sum"] == 1010.0
    assert out["time_to_second_token"]["min"] == 10.0                      # the first gap (first -> second piece)
    assert out["inter_chunk_latency"]["count"] == 10                       # every gap (our ITL)
    assert out["output_token_throughput_per_user"]["max"] == pytest.approx(250.0)   # 1 / TPOT of 4 ms
    assert out["output_token_throughput"] == {"unit": "tokens/sec", "avg": 21.0}
    assert out["request_count"]["avg"] == 5 and out["error_request_count"]["avg"] == 1
    assert out["benchmark_duration"] == {"unit": "sec", "avg": 10.0}
    batch = export.aiperf_export(_samples(stream=False), stream=False, window_s=10.0, input_config={})
    assert "time_to_first_token" not in batch and "inter_token_latency" not in batch
    rows = list(csv.reader(io.StringIO(export.aiperf_csv(out))))
    assert rows[0] == ["Metric", *export.AIPERF_STATS]
    names = [r[0] for r in rows if r]
    assert "Request Latency (ms)" in names and "Output Token Throughput (tokens/sec)" in names
    assert "Request Count" in names and ["Metric", "Value"] in rows and [] in rows   # two sections
    records = [json.loads(line) for line in export.aiperf_records(_samples(), stream=True).splitlines()]
    assert len(records) == 6 and records[-1]["error"] and records[0]["metrics"]["request_latency"] == \
        {"value": 200.0, "unit": "ms"}
    assert records[0]["metrics"]["inter_chunk_latency"]["value"] == [10.0, 12.0]
    assert records[0]["metadata"]["request_end_ns"] - records[0]["metadata"]["request_start_ns"] == 200_000_000


def _summarized(tmp_path, setting, e2e, n=20):
    from specbuild.loadtests import report as rep
    from specbuild.loadtests.runner import CellResult

    samples = [{"kind": "request", "ok": True, "start": 100.0 + i, "e2e_ms": e2e * (1 + (i % 5) / 50),
                "ttft_ms": None, "itl_ms": [], "tpot_ms": e2e / 64, "tokens": 64, "input_tokens": 20}
               for i in range(n)]
    cell, data = rep.measure_cell(CellResult("batch", setting, tmp_path, 0, 30.0, samples=samples,
                                             stop={"reason": "complete"}), stream=False, users=4)
    cell["sweep"] = {"param": "users", "value": 4}
    return cell, data


def test_the_report_survives_a_plot_that_cannot_be_drawn_and_a_report_bug(tmp_path, monkeypatch):
    from specbuild.loadtests import report as rep
    from specbuild.loadtests import sweep_report
    from specbuild.pipeline import loadtest

    from specbuild.loadtests.rundata import run_key

    measured = [_summarized(tmp_path, "off", 900.0), _summarized(tmp_path, "k4", 600.0)]
    runs = {run_key(cell): data for cell, data in measured}

    def report():
        cells = [dict(cell) for cell, _ in measured]
        return {"url": "u", "model": "m", "protocol": "http", "started": "t", "status": "ok", "cells": cells,
                "curves": sweep.curves(cells, "off", runs), "sweep": {"batch": {"param": "users", "values": [4]}},
                "gains": []}

    r = report()
    r["curves"][0]["points"][0]["confidence"]["ci90"] = [9.0, 9.5]   # an interval beside the point gain
    rep.write_report(tmp_path / "a", r, runs)
    assert (tmp_path / "a" / "gain_vs_load.png").is_file() and (tmp_path / "a" / "pareto.png").is_file()
    assert not r["plot_errors"]
    monkeypatch.setattr(sweep_report, "sweep_plots", lambda *a: 1 / 0)
    r = report()
    rep.write_report(tmp_path / "b", r, runs)   # the plot's error is in the report, not raised
    assert "ZeroDivisionError" in r["plot_errors"][0]
    assert "could not be drawn" in (tmp_path / "b" / "report.md").read_text()
    monkeypatch.setattr(rep, "write_report", lambda *a: 1 / 0)   # a bug in the report itself
    (tmp_path / "c").mkdir()
    data = json.loads(loadtest._write_report(tmp_path / "c", report(), runs)["json"].read_text())
    assert data["status"] == "error" and "writing the report failed" in data["error"] and len(data["cells"]) == 2


def _chat_samples(ttfts: list[float], prompts: list[int], user: str = "0-1", failed_at: int | None = None):
    out = []
    for n, (t, p) in enumerate(zip(ttfts, prompts)):
        ok = n != failed_at
        out.append({"kind": "request", "ok": ok, "start": 100.0 + 2 * n, "e2e_ms": 500.0 if ok else 3.0,
                    "ttft_ms": t if ok else None, "itl_ms": [10.0] if ok else [], "tpot_ms": 7.0 if ok else None,
                    "tokens": 64 if ok else 0, "input_tokens": 40, "user": user, "prompt": p,
                    **({} if ok else {"error": "HTTPError: 500"})})
    return out


def test_ttft_is_also_compared_on_the_requests_both_runs_sent_with_the_same_prompt(tmp_path):
    """A faster setting sends more requests in a run of fixed length, and its extra ones carry other prompts: here
    long ones (TTFT 170-180 ms) beside the 4 both runs sent (58-62 ms in both). Over all requests the setting's
    median TTFT looks 2.8x worse; on the same prompts it is equal. Requests pair by (user, n-th request, prompt):
    a failed request still counts in its user's order, and the same position with another prompt does not pair."""
    from specbuild.loadtests import report as rep
    from specbuild.loadtests.rundata import run_key
    from specbuild.loadtests.runner import CellResult
    from specbuild.loadtests.sweep_report import curves_markdown

    off = _chat_samples([60.0, 62.0, 58.0, 61.0], [5, 7, 9, 11])
    on = _chat_samples([61.0, 60.0, 62.0, 58.0, 180.0, 180.0, 180.0, 180.0], [5, 7, 9, 11, 40, 41, 42, 43])
    on += _chat_samples([90.0, 170.0], [5, 8], user="0-2", failed_at=0)   # user 2: no request in the baseline
    cells, runs = [], {}
    for setting, samples in (("off", off), ("policy", on)):
        cell, data = rep.measure_cell(CellResult("chat", setting, tmp_path, 0, 30.0, samples=samples,
                                                 stop={"reason": "complete"}), stream=True, users=1)
        cell["sweep"] = {"param": "users", "value": 1}
        cells.append(cell)
        runs[run_key(cell)] = data
    keys = runs["chat/users=1/policy"].values["request_key"]
    assert keys[:5] == ["0-1/0/5", "0-1/1/7", "0-1/2/9", "0-1/3/11", "0-1/4/40"] and keys[-1] == "0-2/1/8"
    [curve] = sweep.curves(cells, "off", runs)
    [point] = curve["points"]
    assert point["ttft_speedup"] == pytest.approx(60.5 / 170.0)       # all requests: 4 vs 9 medians
    same = point["ttft_same_prompts"]
    assert same["pairs"] == 4 and same["ttft_speedup"] == pytest.approx(1.0)
    lo, hi = same["ci90"]
    assert lo < 1.0 < hi and hi - lo < 0.2
    # a run whose requests carry no user or prompt (another load generator's export) pairs nothing
    bare = {k: v for k, v in runs["chat/users=1/policy"].values.items() if k != "request_key"}
    assert sweep.same_prompt_ttft(runs["chat/users=1/off"].values, bare) is None
    table = "\n".join(curves_markdown([curve]))
    assert "TTFT, same prompts (90 %, pairs)" in table
    assert f"| 1.00x ({lo:.2f}-{hi:.2f}, 4) |" in table
    # the same 4 prompts 10 ms slower in the setting: the pairs see it
    slower = _chat_samples([71.0, 72.0, 68.0, 71.0, 180.0], [5, 7, 9, 11, 40])
    cell, data = rep.measure_cell(CellResult("chat", "slow", tmp_path, 0, 30.0, samples=slower,
                                             stop={"reason": "complete"}), stream=True, users=1)
    assert sweep.same_prompt_ttft(runs["chat/users=1/off"].values, data.values)["ttft_speedup"] == \
        pytest.approx(60.5 / 71.0)
