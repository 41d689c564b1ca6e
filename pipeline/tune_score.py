"""Scoring for `specbuild tune` (pure, no server): settings, objectives, winners, the deployment default,
and the Markdown tables.

Per profile a setting's *score* is its objective's metric (chat: median TPOT, lower is better; batch:
output tok/s, higher is better). Scores within TIE_TOLERANCE of the best tie; ties go to the lower median
e2e latency, then the smaller K. A setting with any failed request (or none completed) cannot win.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TIE_TOLERANCE = 0.01                    # primary scores within 1% of the best are a tie
FEW_REQUESTS = 10                       # fewer completed requests than this: a noisy median (flagged, still scored)


@dataclass(frozen=True)
class Objective:
    metric: str                  # key of a result row, e.g. "tpot_ms_p50"
    higher_is_better: bool
    tie_break: str               # lower is better
    label: str


OBJECTIVES = {
    "latency": Objective("tpot_ms_p50", False, "e2e_ms_p50", "median TPOT, ms (lower is better; tie: median e2e)"),
    "throughput": Objective("tokens_per_s", True, "e2e_ms_p50", "output tok/s (higher is better; tie: median e2e)"),
}


def objective_for(profile) -> Objective:
    """chat -> latency, batch -> throughput; a custom profile file: streaming -> latency, else throughput."""
    if profile.name in ("chat", "batch"):
        return OBJECTIVES["latency" if profile.name == "chat" else "throughput"]
    return OBJECTIVES["latency" if profile.stream else "throughput"]


@dataclass(frozen=True)
class Setting:
    k: int                       # num_draft_tokens; 0 = speculation off
    proposer: str | None         # None = the deployment's default (or irrelevant at K=0)

    @property
    def label(self) -> str:
        return f"k={self.k}" + (f"/{self.proposer}" if self.proposer else "")

    @property
    def slug(self) -> str:
        return f"k{self.k}" + (f"-{self.proposer}" if self.proposer else "")

    def request_fields(self) -> dict[str, Any]:
        return {"num_draft_tokens": self.k, **({"proposer": self.proposer} if self.proposer else {})}


def _p(dist: dict | None, key: str) -> float | None:
    return dist.get(key) if dist else None


def cell_row(setting: Setting, cell: dict[str, Any]) -> dict[str, Any]:
    """The figures of one load-test cell (a `report["cells"]` entry) that tune scores and reports."""
    acc = cell["acceptance"]
    row = {"label": setting.label, "k": setting.k, "proposer": setting.proposer,
           "requests": cell["requests"], "failures": cell["failures"], "error_rate": cell["error_rate"],
           "tokens_per_s": cell["tokens_per_s"], "requests_per_s": cell["requests_per_s"],
           "output_tokens": cell["output_tokens"],
           "acceptance_rate": acc["responses"]["acceptance_rate"], "accepted": acc["responses"]["accepted"],
           "drafted": acc["responses"]["drafted"],
           "server_acceptance_rate": acc["server_metrics"].get("acceptance_rate"),
           "mean_accepted_length": acc["server_metrics"].get("mean_accepted_length"),
           "few_requests": cell["requests"] < FEW_REQUESTS}
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        for q in ("p50", "p95"):
            row[f"{metric}_{q}"] = _p(cell.get(metric), q)
    return row


def _invalid_reason(row: dict[str, Any], objective: Objective) -> str | None:
    if row.get("status", "ok") != "ok":   # too slow to measure here, failed
        return str(row["status"])
    if not row.get("requests"):
        return "no request completed"
    if row.get("failures"):
        return f"{row['failures']} failed request(s)"
    if row.get(objective.metric) is None:
        return f"{objective.metric} not measured"
    return None


def choose_winner(rows: list[dict[str, Any]], objective: Objective) -> dict[str, Any] | None:
    """Mark each row `valid`/`why_invalid`/`score`; return the winning row (None if none is valid).

    The best primary score wins; rows within TIE_TOLERANCE (relative) of it are a tie, broken by the
    lower tie-break metric, then by the smaller K (less work per step), then by list order.
    """
    for row in rows:
        row["why_invalid"] = _invalid_reason(row, objective)
        row["valid"] = row["why_invalid"] is None
        row["score"] = row.get(objective.metric) if row["valid"] else None
    valid = [r for r in rows if r["valid"]]
    if not valid:
        return None
    sign = -1.0 if objective.higher_is_better else 1.0
    best = min(sign * r["score"] for r in valid)
    tied = [r for r in valid if sign * r["score"] <= best + TIE_TOLERANCE * abs(best)]
    inf = float("inf")
    return min(tied, key=lambda r: (r.get(objective.tie_break) if r.get(objective.tie_break) is not None else inf,
                                    r["k"], rows.index(r)))


def choose_default(per_profile: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The one default for the deployment: the setting with the least summed regret across profiles.

    Regret of a setting in a profile = how much worse its primary score is than that profile's winner
    (lower-is-better: value / best - 1; higher-is-better: best / value - 1), never below 0: a setting inside
    the winner's tie band may score a little better and still have lost the tie-break (`choose_winner`). Equal
    summed regret goes to the setting that wins more profiles, then the smaller K. A setting invalid in any
    profile is not eligible. With one profile this is that profile's winner.
    """
    totals: dict[str, float] = {}
    wins: dict[str, int] = {}
    first: dict[str, dict[str, Any]] = {}
    eligible: set[str] | None = None
    for prof in per_profile.values():
        if prof["winner"] is None:
            return None
        best, higher = prof["winner"]["score"], prof["objective"]["higher_is_better"]
        wins[prof["winner"]["label"]] = wins.get(prof["winner"]["label"], 0) + 1
        labels = set()
        for r in prof["settings"]:
            if not r["valid"]:
                continue
            s = r["score"]
            regret = (best / s - 1 if s > 0 else float("inf")) if higher else (s / best - 1 if best > 0 else 0.0)
            totals[r["label"]] = totals.get(r["label"], 0.0) + max(regret, 0.0)
            first.setdefault(r["label"], r)
            labels.add(r["label"])
        eligible = labels if eligible is None else eligible & labels
    if not eligible:
        return None
    order = list(first)
    label = min(eligible, key=lambda lb: (round(totals[lb], 9), -wins.get(lb, 0), first[lb]["k"], order.index(lb)))
    r = first[label]
    return {"label": label, "k": r["k"], "proposer": r["proposer"], "summed_regret": totals[label],
            "rule": "least summed regret vs each profile's winner (primary score)"}


def gain_vs_baseline(rows, winner, objective: Objective) -> float | None:
    """Winner vs K=0 on the primary metric, as a speed-up (> 1 = better than speculation off)."""
    base = next((r for r in rows if r["k"] == 0 and r["valid"]), None)
    if not winner or not base or not base["score"] or not winner["score"]:
        return None
    return winner["score"] / base["score"] if objective.higher_is_better else base["score"] / winner["score"]


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def render_markdown(result: dict[str, Any]) -> str:
    sweep = result["sweep"]
    lines = ["# Tuning report", "", f"- target: `{result['url']}` model `{result['model']}`",
             f"- started {result['started']}, finished {result.get('finished', '-')}; status: {result.get('status')}",
             f"- machine: {result['machine']['platform']}, {result['machine']['cpu_count']} CPUs",
             f"- swept K {sweep['k']}, proposers {sweep['proposers'] or 'deployment default only'}"]
    if sweep["note"]:
        lines.append(f"- note: {sweep['note']}")
    for name, prof in result["profiles"].items():
        obj, win = prof["objective"], prof["winner"]
        lines += ["", f"## {name}", "", f"Score: {obj['label']}. Winner: **{win['label'] if win else 'none'}**"
                  + (f" ({_f(prof['gain_vs_baseline'], '{:.2f}x')} vs k=0)" if prof["gain_vs_baseline"] else ""), "",
                  "| setting | req | err | TTFT p50 ms | TPOT p50 ms | e2e p50 ms | tok/s | acceptance | mean acc. len | |",
                  "|" + "---|" * 10]
        for r in prof["settings"]:
            mark = "**winner**" if win and r["label"] == win["label"] else (r["why_invalid"] or "")
            lines.append(f"| {r['label']} | {r['requests']} | {r['failures']} | {_f(r['ttft_ms_p50'])} | "
                         f"{_f(r['tpot_ms_p50'])} | {_f(r['e2e_ms_p50'])} | {_f(r['tokens_per_s'])} | "
                         f"{_f(r['acceptance_rate'], '{:.2f}')} | {_f(r['mean_accepted_length'], '{:.2f}')} | {mark} |")
        few = [r["label"] for r in prof["settings"] if r.get("few_requests")]
        if few:
            lines += ["", f"Fewer than {FEW_REQUESTS} requests completed for {', '.join(few)}: those medians are "
                          "noisy; raise --duration (or --users) for a decision you can trust."]
    d = result.get("default")
    lines += ["", "## Deployment default", "",
              f"- {d['label']} ({d['rule']})" if d else "- none (no setting was valid in every profile)"]
    if result.get("applied"):
        a = result["applied"]
        lines.append(f"- written to `{a['config']}`; restart to apply: `{a['restart']}`")
    return "\n".join(lines) + "\n"
