"""Ramps (`loadtest --sweep users=1,2,4,2,1` / `--sweep users=1,2,4 --ramp`): the plan keeps the time order and
tells repeated loads apart, the analysis reads the policy's decision per point from the server's counters and
flags throughput dips and stalls. No server here (the served ramp is in test_loadtest_sweep_served.py)."""

from __future__ import annotations

import pytest

from specbuild.core.errors import UsageError
from specbuild.loadtests import ramp, sweep
from specbuild.loadtests.profiles import load_profiles


def test_ramp_values_keep_their_order_and_repeats_and_ramp_goes_up_then_down():
    s = sweep.parse_sweeps(["users=1,2,4,8,4,2,1"], ["chat"])["chat"]
    assert s.values == (1, 2, 4, 8, 4, 2, 1) and s.ramp
    r = sweep.parse_sweeps(["users=4,1,2,8"], ["chat"], ramp=True)["chat"]
    assert r.values == (1, 2, 4, 8, 4, 2, 1) and r.ramp
    plain = sweep.parse_sweeps(["users=4,1,2"], ["chat"])["chat"]   # distinct values: ascending, as before
    assert plain.values == (1, 2, 4) and not plain.ramp
    for bad, kw, msg in ((["users=1,2,2,1"], {}, "back to back"), (["users=1,2,1"], {"ramp": True}, "already a ramp"),
                         (["users=2"], {"ramp": True}, "at least two")):
        with pytest.raises(UsageError, match=msg):
            sweep.parse_sweeps(bad, ["chat"], **kw)


def test_a_ramp_plan_runs_in_time_order_with_a_step_per_point(tmp_path):
    profiles = load_profiles(("chat",))
    named = [("off", {"num_draft_tokens": 0}), ("default", {})]
    runs = sweep.plan(profiles, named, ("users=1,2,4",), ramp=True)
    assert [(r.point[1], r.step, r.setting) for r in runs] == \
        [(v, i, s) for i, v in enumerate((1, 2, 4, 2, 1)) for s in ("off", "default")]
    keys = [r.key for r in runs]
    assert len(set(keys)) == len(keys) and keys[2] == "chat/users=2@1/off"
    dirs = [r.run_dir(tmp_path) for r in runs]
    assert len(set(dirs)) == len(dirs) and dirs[6] == tmp_path / "runs" / "chat" / "03-users-2" / "off"
    assert runs[6].sweep_cell == {"param": "users", "value": 2, "step": 3, "ramp": True}
    assert sweep.sweep_summary(runs) == {"chat": {"param": "users", "values": [1, 2, 4, 2, 1], "ramp": True}}
    assert [r.profile.users for r in runs[::2]] == [1, 2, 4, 2, 1]
    with pytest.raises(UsageError, match="goes with a --sweep"):
        sweep.plan(profiles, named, (), ramp=True)
    # a plain sweep is unchanged: no step, the old directories
    [one] = sweep.plan(profiles, named[:1], ("users=2",))
    assert one.step is None and one.run_dir(tmp_path) == tmp_path / "runs" / "chat" / "users-2" / "off"


def test_dips_are_below_both_neighbours_by_more_than_the_noise_floor():
    assert [d["index"] for d in ramp.dips([10, 20, 12, 20, 10])] == [2]
    assert ramp.dips([10, 20, 30, 20, 10]) == []                   # rising then falling: no dip
    assert ramp.dips([30, 10, 30]) != [] and ramp.dips([10, 30, 10]) == []   # a trough is one, a peak is not
    assert ramp.dips([10, 11, 30]) == [] and ramp.dips([30, 11, 10]) == []   # between its neighbours: the load's effect
    assert [d["index"] for d in ramp.dips([60, 120, 50, 60])] == [2]         # under 1 user's tok/s at 2 users
    assert ramp.dips([20, 18.5, 20]) == []                         # 7.5 % below equal neighbours: noise
    assert [d["index"] for d in ramp.dips([20, 17.9, 20])] == [1]  # 10.5 % below: a dip
    assert ramp.dips([20, 17.9, 20], floor=0.2) == []
    assert ramp.dips([20, None, 20]) == [] and ramp.dips([5]) == []  # unmeasured / no neighbours: not judged
    d = ramp.dips([40, 30, 41])[0]
    assert d["neighbours"] == [40, 41] and d["below_by"] == pytest.approx(0.25)


def _ramp_cell(setting, step, users, tok_s, *, drafted, seq_steps, steps, cut, stalls=(), cutoff=2.0):
    return {"profile": "chat", "setting": setting, "status": "ok", "users": users, "tokens_per_s": tok_s,
            "sweep": {"param": "users", "value": users, "step": step, "ramp": True},
            "ttft_ms": {"p50": 50.0}, "e2e_ms": {"p50": 900.0},
            "silence": {"stalls": list(stalls), "threshold_s": 2.0},
            "server_metrics_delta": {"specbuild_draft_tokens_total": drafted, "specbuild_sequence_steps_total": seq_steps,
                                     "specbuild_steps_total": steps, "specbuild_spec_cutoff_steps_total": cut,
                                     "specbuild_drafts_total": drafted / 4, "specbuild_accepted_tokens_total": drafted / 2},
            "server_state": {"specbuild_policy_max_concurrency": cutoff}}


def test_the_ramp_shows_the_policy_switching_and_flags_a_dip_at_a_crossing():
    # users 1, 2, 4, 2, 1 against a cut-off of 2: drafting up to 2 users, plain steps at 4; on the way down the
    # point at 2 users (crossing back) is slower than both neighbours: a dip at a crossing; a stall at step 4
    loads = [(1, 60.0, 400, 100, 100, 0), (2, 100.0, 700, 200, 100, 0), (4, 120.0, 0, 400, 100, 100),
             (2, 50.0, 650, 200, 100, 0), (1, 60.0, 380, 100, 100, 0)]
    cells = [_ramp_cell("default", i, u, t, drafted=d, seq_steps=q, steps=s, cut=c,
                        stalls=[{"at_s": 3.0, "s": 4.5, "waiting": 1}] if i == 4 else ())
             for i, (u, t, d, q, s, c) in enumerate(loads)]
    cells.append({**_ramp_cell("off", 0, 1, 30.0, drafted=0, seq_steps=100, steps=100, cut=0),
                  "server_metrics_delta": {}, "server_state": {}})   # a server that exports no counters
    found = {x["setting"]: x for x in ramp.analyse(list(reversed(cells)))}   # time order comes from the steps
    r, off = found["default"], found["off"]
    assert [p["step"] for p in r["points"]] == [0, 1, 2, 3, 4] and [p["value"] for p in r["points"]] == [1, 2, 4, 2, 1]
    assert r["cutoff"] == 2 and [p["side"] for p in r["points"]] == ["within", "within", "over", "within", "within"]
    decisions = [p["policy"]["decision"] for p in r["points"]]
    assert decisions == ["drafts", "drafts", "off: over the cut-off", "drafts", "drafts"]
    assert r["points"][1]["policy"]["draft_tokens_per_step"] == pytest.approx(3.5)
    assert r["points"][2]["policy"]["cutoff_share"] == 1.0 and r["points"][2]["policy"]["sequences_per_step"] == 4
    assert [(x["into_step"], x["direction"]) for x in r["crossings"]] == [(2, "up"), (3, "down")]
    assert [p["step"] for p in r["points"] if p["dip"]] == [3] and r["points"][3]["dip"]["at_crossing"]
    assert r["points"][4]["stall"]["s"] == 4.5
    assert any("dip at step 3" in f and "crossing" in f for f in r["flags"]) and any("stall at step 4" in f
                                                                                      for f in r["flags"])
    assert {t["value"]: round(t["down_over_up"], 2) for t in r["there_and_back"]} == {2: 0.5, 1: 1.0}
    assert any("slower on the way down at 2" in f for f in r["flags"])
    assert off["setting"] == "off" and off["points"][0]["policy"] is None and off["cutoff"] is None
    md = "\n".join(ramp.ramp_markdown([r, off]))
    assert "## Ramp" in md and "| 2 | 4 | over | off: over the cut-off | 0.00 | 100 % | 4.00 | 120.0 |" in md
    assert "up into step 2 (2 -> 4); down into step 3 (4 -> 2)" in md and "2: 0.50x" in md
    # the same ramp without the dip and the stall: said so
    cells[3]["tokens_per_s"], cells[4]["silence"]["stalls"] = 100.0, []
    [r, _] = ramp.analyse(cells)
    assert not r["flags"] and "No stall and no throughput dip" in "\n".join(ramp.ramp_markdown([r]))


def test_adaptive_k_zero_is_told_from_the_cut_off():
    c = _ramp_cell("default", 0, 1, 50.0, drafted=0, seq_steps=100, steps=100, cut=0)
    assert ramp.policy_decision(c)["decision"] == "off: K = 0"
    assert ramp.server_state({"specbuild_policy_max_concurrency": -1.0, "nv_x": 1.0}) == \
        {"specbuild_policy_max_concurrency": -1.0}
    assert ramp.server_state(None) == {}


def test_a_ramp_sweep_pairs_each_step_with_its_own_baseline():
    from test_loadtest_sweep import _cell

    cells = []
    for step, (users, speedup) in enumerate(((1, 1.5), (2, 1.1), (1, 1.4))):
        for c in (_cell("chat", "off", users, 1000.0, seed=step), _cell("chat", "on", users, 1000.0 / speedup, seed=step)):
            c["sweep"] = {**c["sweep"], "step": step, "ramp": True}
            c["acceptance"] = {"responses": {"acceptance_rate": None}, "server_metrics": {}}
            cells.append(c)
    [curve] = sweep.curves(cells, "off")
    assert [(p["value"], p["step"]) for p in curve["points"]] == [(1, 0), (2, 1), (1, 2)]
    assert curve["points"][2]["gain"] == pytest.approx(1.4, rel=0.1)
    assert curve["crossover"]["value"] == 2
    from specbuild.loadtests import report as rep

    rows = rep.gain_table(cells, "off")        # one row per step, not every pair of equal loads
    assert [r["sweep"]["step"] for r in rows] == [0, 1, 2]
