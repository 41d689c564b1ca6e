"""`bench_served`'s pair cells: the served batch path at 2 users judged against the engine's own 2 sequences on the
same requests, per run (issue 30: the served gain within 10 % of the engine's)."""

from __future__ import annotations

import pytest

from bench_support import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_served")


def cell(tok_s, decode_s, ttft_s=0.4, drafted=0):
    return {"tok_s": tok_s, "decode_s": decode_s, "ttft_s": ttft_s, "drafted": drafted, "accepted": 0}


def pair_raw(served_default, engine_default):
    """Two runs; off is 70 / 80 tok/s served / engine in both."""
    off = {"served": [cell(70, 1.2), cell(70, 1.2)], "engine": [cell(80, 1.0), cell(80, 1.0)]}
    return {"off": off,
            "default": {"served": [cell(t, 0.6, drafted=10) for t in served_default],
                        "engine": [cell(t, 0.5, drafted=10) for t in engine_default]},
            "forced": {"served": [cell(t, 0.6) for t in served_default],
                       "engine": [cell(t, 0.5) for t in engine_default]}}


def test_the_served_gain_is_divided_by_the_engines_gain_within_each_run(bench):
    # run 1: served 1.4x, engine 1.5x -> 0.933; run 2: served 1.2x, engine 1.0x -> 1.2: median 1.067
    got = bench.summarize_pair(pair_raw([98, 84], [120, 80]))
    assert got["default"]["served"]["gain"] == pytest.approx((1.4 + 1.2) / 2)
    assert got["default"]["engine"]["gain"] == pytest.approx((1.5 + 1.0) / 2)
    assert got["default"]["served_vs_engine"] == pytest.approx((1.4 / 1.5 + 1.2 / 1.0) / 2)
    assert got["default"]["served"]["decode_gain"] == pytest.approx(2.0)      # 1.2 s -> 0.6 s
    assert got["off"]["served_vs_engine"] == pytest.approx(1.0)
    assert got["default"]["served"]["drafted"] == 20


def chat_and_batch(runs=2):
    one = {"ttft": 0.05, "e2e": 1.0, "drafted": 0, "accepted": 0, "ttft_by_request": {"0.0": 0.05}}
    raw = {f"chat{u}": {m: [dict(one)] * runs for m in bench_modes()} for u in (1, 2, 4)}
    raw["batch"] = {m: [{"tok_s": 100.0, "drafted": 0, "ttft": 0.1}] * runs for m in bench_modes()}
    return raw


def bench_modes():
    return ("off", "default", "forced")


@pytest.mark.parametrize("served, engine, met", [([98, 98], [120, 120], True),     # 1.4 / 1.5 = 0.93
                                                 ([84, 84], [120, 120], False)])   # 1.2 / 1.5 = 0.80
def test_the_pair_goal_is_met_only_within_ten_percent_of_the_engine(bench, served, engine, met):
    raw = chat_and_batch()
    raw["pair"] = pair_raw(served, engine)
    got = bench.summarize(raw, 2)
    assert got["goals_met"]["pair_served_keeps_engine_gain"] is met
    assert set(got["goals"]["pair_served_vs_engine"]) == {"default", "forced"}


def test_a_result_without_pair_cells_still_summarizes(bench):
    got = bench.summarize(chat_and_batch(), 2)
    assert got["pair"] is None and "pair_served_keeps_engine_gain" not in got["goals_met"]
