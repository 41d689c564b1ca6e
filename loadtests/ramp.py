"""A ramp: the load rising then falling (`--sweep users=1,2,4,8,4,2,1`, or `--sweep users=1,2,4,8 --ramp`), read
in time order, to see what the speculation policy did at each point and whether crossing its cut-off (the
policy's `max_concurrency`: no drafting by default in steps with more sequences) cost anything.

Per profile and setting, per point in the order it ran:

- the **policy's decision**, from the server's own counters scraped before and after the run (the embedded
  engine's `specbuild_*` families, `model_repository/embedded/triton_models.py`): draft tokens per sequence step
  (d `specbuild_draft_tokens_total` / d `specbuild_sequence_steps_total`: the mean K the engine chose, 0 = it
  did not draft), the share of engine steps over the cut-off (d `specbuild_spec_cutoff_steps_total` /
  d `specbuild_steps_total`) and the sequences per step; the cut-off itself from the gauge
  `specbuild_policy_max_concurrency` (-1 = none). A server that exports none of them (TensorRT-LLM, another
  engine) leaves these empty and the rest of the ramp stands;
- the throughput (tok/s), TTFT and e2e medians;
- a **stall**: the run's silences (`stalls.py`: requests in flight, nothing from the server for far longer than
  the run's own gaps);
- a **dip**: a point whose tok/s is below both neighbours' by more than `DIP_FLOOR` of the lower one. Between
  two loads, throughput lies between theirs (it grows with the load until the server saturates, then stays
  flat); a point below both is the server losing time, e.g. the draft catching up on every sequence when the
  load falls back under the cut-off. The margin is relative, not the neighbours' difference: on a ramp the
  neighbours are different loads (1 and 4 users around 2), their difference is the load's effect, not noise.
  A ramp's end points have one neighbour and are not judged. A dip is marked `at_crossing` when the load
  crosses the cut-off into or out of the point;
- **slower on the way down**: a load visited on the way up and again on the way down whose tok/s came back
  more than `DIP_FLOOR` lower (the policy did not return to where it was).

Nothing here depends on one machine's speed: every rule compares a run with its neighbours in the same ramp.
"""

from __future__ import annotations

from typing import Any

from specbuild.core.metrics import metric_sum

DIP_FLOOR = 0.10        # a dip is more than 10 % below the lower neighbour (run-to-run noise stays under it)
DRAFT_TOKENS, SEQ_STEPS = "specbuild_draft_tokens_total", "specbuild_sequence_steps_total"
STEPS, CUTOFF_STEPS = "specbuild_steps_total", "specbuild_spec_cutoff_steps_total"
DRAFTS, ACCEPTED = "specbuild_drafts_total", "specbuild_accepted_tokens_total"
CUTOFF_GAUGE = "specbuild_policy_max_concurrency"
STATE_GAUGES = (CUTOFF_GAUGE, "specbuild_draft_cost_ratio", "specbuild_target_step_ms")


def server_state(after: dict[str, float] | None) -> dict[str, float]:
    """The gauges a ramp reads from the scrape after a run (the cut-off, the costs adaptive K used)."""
    if not after:
        return {}
    return {g: metric_sum(after, g) for g in STATE_GAUGES if any(k.split("{")[0] == g for k in after)}


def policy_decision(cell: dict[str, Any]) -> dict[str, Any] | None:
    """What the engine chose over one run, from its counters' deltas; None when the server exports none."""
    d = cell.get("server_metrics_delta") or {}
    has = lambda name: any(k.split("{")[0] == name for k in d)  # noqa: E731
    if not has(SEQ_STEPS) and not has(DRAFT_TOKENS):
        return None
    drafted, seq_steps = metric_sum(d, DRAFT_TOKENS), metric_sum(d, SEQ_STEPS)
    steps, cut = metric_sum(d, STEPS), metric_sum(d, CUTOFF_STEPS)
    drafts, accepted = metric_sum(d, DRAFTS), metric_sum(d, ACCEPTED)
    per_step = drafted / seq_steps if seq_steps else None
    cut_share = cut / steps if steps else None
    if per_step is None:
        decision = "drafted" if drafted else "unknown"
    elif drafted == 0:
        decision = "off: over the cut-off" if cut_share and cut_share >= 0.5 else "off: K = 0"
    else:
        decision = "mostly off: over the cut-off" if cut_share and cut_share >= 0.5 else "drafts"
    return {"decision": decision, "draft_tokens": drafted, "sequence_steps": seq_steps,
            "draft_tokens_per_step": per_step, "mean_k_when_drafting": drafted / drafts if drafts else None,
            "cutoff_share": cut_share, "sequences_per_step": seq_steps / steps if steps else None,
            "acceptance_rate": accepted / drafted if drafted else None}


def dips(values: list[float | None], *, floor: float = DIP_FLOOR) -> list[dict[str, Any]]:
    """Interior points below both neighbours by more than `floor` of the lower one.

    Example: [10, 20, 12, 20, 10] -> the point at 2 (12 < 20 x 0.9); [10, 20, 30] -> none (a rising load);
    [10, 30, 10] -> none (a peak); [60, 120, 50, 60] -> the point at 2 (50 < 60 x 0.9)."""
    out = []
    for i in range(1, len(values) - 1):
        a, x, b = values[i - 1], values[i], values[i + 1]
        if a is None or x is None or b is None:
            continue
        lo = min(a, b)
        if x < lo * (1 - floor):
            out.append({"index": i, "tokens_per_s": x, "neighbours": [a, b], "below_by": round(1 - x / lo, 4)})
    return out


def _side(value: float, cutoff: float | None) -> str | None:
    if cutoff is None or cutoff < 0:
        return None
    return "over" if value > cutoff else "within"


def _p50(d: dict | None) -> float | None:
    return d.get("p50") if d else None


def analyse(cells: list[dict[str, Any]], *, floor: float = DIP_FLOOR) -> list[dict[str, Any]]:
    """Per profile and setting of a ramp: its points in time order, the crossings of the cut-off, the dips,
    stalls, and the way-down / way-up ratios. [] when no cell is a ramp's."""
    ramped = [c for c in cells if (c.get("sweep") or {}).get("step") is not None]
    out = []
    for key in dict.fromkeys((c["profile"], c["setting"]) for c in ramped):
        mine = sorted((c for c in ramped if (c["profile"], c["setting"]) == key), key=lambda c: c["sweep"]["step"])
        gauges = [(c.get("server_state") or {}).get(CUTOFF_GAUGE) for c in mine]
        cutoff = next((g for g in reversed(gauges) if g is not None), None)
        cutoff = None if cutoff is None or cutoff < 0 else cutoff
        points = []
        for c in mine:
            ok = c.get("status") == "ok"
            stalls = (c.get("silence") or {}).get("stalls") or []
            points.append({"step": c["sweep"]["step"], "value": c["sweep"]["value"], "status": c.get("status"),
                           "side": _side(c["sweep"]["value"], cutoff),
                           "tokens_per_s": c.get("tokens_per_s") if ok else None,
                           "ttft_p50_ms": _p50(c.get("ttft_ms")), "e2e_p50_ms": _p50(c.get("e2e_ms")),
                           "policy": policy_decision(c),
                           "stall": max(stalls, key=lambda s: s["s"]) if stalls else None, "dip": None})
        crossings = [{"into_step": b["step"], "direction": "up" if b["value"] > a["value"] else "down",
                      "from": a["value"], "to": b["value"]}
                     for a, b in zip(points, points[1:]) if a["side"] and b["side"] and a["side"] != b["side"]]
        crossed = {x["into_step"] for x in crossings} | {x["into_step"] - 1 for x in crossings}
        found = dips([p["tokens_per_s"] for p in points], floor=floor)
        for d in found:
            p = points[d["index"]]
            p["dip"] = {**{k: v for k, v in d.items() if k != "index"}, "at_crossing": p["step"] in crossed}
        first_up: dict[float, dict] = {}
        there_and_back = []
        for p in points:
            if p["value"] in first_up and p["tokens_per_s"] and first_up[p["value"]]["tokens_per_s"]:
                up = first_up[p["value"]]
                there_and_back.append({"value": p["value"], "steps": [up["step"], p["step"]],
                                       "down_over_up": p["tokens_per_s"] / up["tokens_per_s"]})
            first_up.setdefault(p["value"], p)
        flags = []
        for t in there_and_back:
            if t["down_over_up"] < 1 - floor:
                flags.append(f"slower on the way down at {t['value']:g} ({key[0]}/{key[1]}, steps {t['steps'][0]} "
                             f"and {t['steps'][1]}): {t['down_over_up']:.2f}x the tok/s on the way up")
        for p in points:
            if p["stall"]:
                flags.append(f"stall at step {p['step']} ({key[0]}/{key[1]}, load {p['value']:g}): nothing from "
                             f"the server for {p['stall']['s']:.1f} s")
            if p["dip"]:
                flags.append(f"throughput dip at step {p['step']} ({key[0]}/{key[1]}, load {p['value']:g}): "
                             f"{p['tokens_per_s']:.1f} tok/s, {100 * p['dip']['below_by']:.0f} % below the lower "
                             f"neighbour" + (" (at a crossing of the cut-off)" if p["dip"]["at_crossing"] else ""))
        out.append({"profile": key[0], "setting": key[1], "param": mine[0]["sweep"]["param"], "cutoff": cutoff,
                    "points": points, "crossings": crossings, "there_and_back": there_and_back, "flags": flags,
                    "dip_floor": floor})
    return out


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def ramp_markdown(ramps: list[dict[str, Any]]) -> list[str]:
    if not ramps:
        return []
    lines = ["", "## Ramp: the load over time, and what the policy did", "",
             "Points in the order they ran. Policy: from the server's counters over each run (draft tokens per "
             "sequence step = the mean K the engine chose; cut off = share of steps over the policy's "
             "max_concurrency). A dip: tok/s more than {100 * DIP_FLOOR:.0f} % below both neighbours'; a stall: "
             "`loadtests/stalls.py`.", ""]
    for r in ramps:
        cut = "no cut-off (or not exported)" if r["cutoff"] is None else f"cut-off: drafting by default up to " \
            f"{r['cutoff']:g} concurrent sequences"
        lines += [f"**{r['profile']} / {r['setting']}** ({cut})", "",
                  f"| step | {r['param']} | vs cut-off | policy | draft tokens / step | cut off (steps) | "
                  "sequences / step | tok/s | TTFT p50 ms | e2e p50 ms | stall | dip |", "|" + "---|" * 12]
        for p in r["points"]:
            pol = p["policy"] or {}
            stall = f"{p['stall']['s']:.1f} s" if p["stall"] else "-"
            dip = (f"{100 * p['dip']['below_by']:.0f} %" + (" (crossing)" if p["dip"]["at_crossing"] else "")) \
                if p["dip"] else "-"
            lines.append(f"| {p['step']} | {p['value']:g} | {p['side'] or '-'} | {pol.get('decision', '-')} | "
                         f"{_f(pol.get('draft_tokens_per_step'), '{:.2f}')} | "
                         f"{_f(pol.get('cutoff_share') and 100 * pol['cutoff_share'], '{:.0f} %')} | "
                         f"{_f(pol.get('sequences_per_step'), '{:.2f}')} | {_f(p['tokens_per_s'])} | "
                         f"{_f(p['ttft_p50_ms'])} | {_f(p['e2e_p50_ms'])} | {stall} | {dip} |")
        if r["crossings"]:
            lines += ["", "Crossings of the cut-off: " + "; ".join(
                f"{x['direction']} into step {x['into_step']} ({x['from']:g} -> {x['to']:g})" for x in r["crossings"])]
        if r["there_and_back"]:
            lines += ["", "Same load on the way down / on the way up (tok/s): " + "; ".join(
                f"{t['value']:g}: {t['down_over_up']:.2f}x" for t in r["there_and_back"])]
        lines += ["", ("Flags: " + "; ".join(r["flags"])) if r["flags"] else
                  "No stall and no throughput dip along the ramp.", ""]
    return lines
