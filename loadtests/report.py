"""The load-test report: `report.json` (every figure), `report.md` (tables) and PNG plots (matplotlib Agg).

Latency percentiles are computed from the raw per-request samples (exact, not Locust's rounded
buckets); Locust's own CSV medians are kept beside them. Throughput is output tokens over the measured
window (first send -> last completion). The gain table ("batch vs interactive") gives, per profile,
the speculation-off / speculation-on ratios of TTFT, TPOT and e2e medians (> 1 = faster with
speculation) and the on / off ratio of tokens per second, with the acceptance figures beside them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from specbuild.loadtests import export, stalls
from specbuild.loadtests.rundata import RunData, Runs, values_of
from specbuild.loadtests.runner import CellResult
from specbuild.core.machine import one_line

PERCENTILES = (50, 90, 95, 99)


def distribution(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    v = sorted(values)

    def pct(p: float) -> float:   # linear interpolation, like numpy's default
        k = (len(v) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    out = {"count": len(v), "mean": sum(v) / len(v), "min": v[0], "max": v[-1]}
    out.update({f"p{p}": pct(p) for p in PERCENTILES})
    return out


def cell_status(cell: CellResult) -> str:
    """ok | too slow to measure here | server gone | failed | interrupted."""
    if cell.error:
        return "failed"
    if cell.interrupted:
        return "interrupted"
    if cell.server_gone:
        return "server gone"
    if cell.timed_out or cell.stop.get("reason") == "too slow to measure here":
        return "too slow to measure here"
    return "ok"


def overall_status(cells: list[dict[str, Any]], *, interrupted: bool, error: str | None = None) -> str:
    """interrupted > server gone > error > runs failed > gates failed > too slow to measure here > ok."""
    statuses = {c.get("status", "ok") for c in cells}
    for cond, status in ((interrupted, "interrupted"), ("server gone" in statuses, "server gone"),
                         (error is not None, "error"), ("failed" in statuses, "runs failed"),
                         (any(not c.get("gates", {}).get("passed", True) for c in cells), "gates failed"),
                         ("too slow to measure here" in statuses, "too slow to measure here")):
        if cond:
            return status
    return "ok"


def summarize_cell(cell: CellResult, **kw) -> dict[str, Any]:
    """The run's summary (a report cell) alone; `measure_cell` for its RunData too."""
    return measure_cell(cell, **kw)[0]


def measure_cell(cell: CellResult, *, stream: bool, users: int, gates=None, metrics: dict | None = None,
                 cross_check: dict | None = None,
                 input_config: dict | None = None) -> tuple[dict[str, Any], RunData]:
    """(the run's summary: a report cell, what report.json holds of it; its RunData, carried beside it)."""
    ok = [s for s in cell.samples if s.get("ok")]
    failed = [s for s in cell.samples if not s.get("ok")]
    total = len(ok) + len(failed)
    tokens = sum(s["tokens"] for s in ok)
    if ok:
        window = max(s["start"] + s["e2e_ms"] / 1000 for s in ok) - min(s["start"] for s in ok)
    else:
        window = 0.0
    accepted = sum(s["accepted"] for s in ok if s.get("accepted") is not None)
    drafted = sum(s["drafted"] for s in ok if s.get("drafted") is not None)
    out: dict[str, Any] = {
        "profile": cell.profile, "setting": cell.setting, "status": cell_status(cell), "stop": cell.stop,
        "error": cell.error, "stream": stream, "users": users,
        "wall_s": round(cell.duration_s, 3), "window_s": round(window, 3),
        "interrupted": cell.interrupted, "timed_out": cell.timed_out, "locust_exit_code": cell.exit_code,
        "requests": len(ok), "failures": len(failed), "error_rate": (len(failed) / total) if total else None,
        "errors": sorted({s["error"] for s in failed})[:5],
        "ttft_ms": distribution([s["ttft_ms"] for s in ok if s.get("ttft_ms") is not None]),
        "itl_ms": distribution([g for s in ok for g in s.get("itl_ms", [])]),
        "tpot_ms": distribution([s["tpot_ms"] for s in ok if s.get("tpot_ms") is not None]),
        "e2e_ms": distribution([s["e2e_ms"] for s in ok]),
        "tpot_definition": "(e2e - ttft) / (tokens - 1)" if stream else "e2e / tokens (non-streaming)",
        "output_tokens": tokens,
        "output_tokens_per_request": distribution([s["tokens"] for s in ok]),
        "input_tokens_per_request": distribution([s["input_tokens"] for s in ok if s.get("input_tokens") is not None]),
        "tokens_per_s": tokens / window if window > 0 else None,
        "requests_per_s": len(ok) / window if window > 0 else None,
        "acceptance": {
            "responses": {"accepted": accepted, "drafted": drafted,
                          "acceptance_rate": accepted / drafted if drafted else None},
            "server_metrics": metrics or {},
        },
        "harness": {"overhead_ms": distribution([s.get("overhead_ms", 0.0) for s in ok]),
                    "zero_work_probe_ms": distribution(cell.probes_ms)},
        "locust": {kind: {"count": int(row["Request Count"]), "failures": int(row["Failure Count"]),
                          "median_ms": _num(row["Median Response Time"]), "p95_ms": _num(row.get("95%")),
                          "avg_ms": _num(row["Average Response Time"])}
                   for kind, row in cell.locust_stats.items()},
    }
    out["silence"] = stalls.silences(cell.samples)
    if cross_check:
        out["cross_check"] = cross_check
    config = {"profile": cell.profile, "setting": cell.setting, "streaming": stream, "concurrency": users,
              **(input_config or {})}
    data = RunData(
        values={"request_key": request_keys(cell.samples, ok),
                "ttft_ms_per_request": [s.get("ttft_ms") for s in ok],
                "ttft_ms": [s["ttft_ms"] for s in ok if s.get("ttft_ms") is not None],
                "itl_ms": [g for s in ok for g in s.get("itl_ms", [])], "e2e_ms": [s["e2e_ms"] for s in ok],
                "tokens": [s["tokens"] for s in ok], "tpot_ms": [s.get("tpot_ms") for s in ok]},
        genai_perf=export.genai_perf_export(cell.samples, stream=stream, window_s=window, input_config=config),
        aiperf=export.aiperf_export(cell.samples, stream=stream, window_s=window, input_config=config))
    if gates is not None and gates.active:
        problems = gates.violations(p95_ttft_ms=_p(out["ttft_ms"], "p95"), p95_tpot_ms=_p(out["tpot_ms"], "p95"),
                                    p95_e2e_ms=_p(out["e2e_ms"], "p95"),
                                    error_rate=out["error_rate"] if total else 1.0)
        if not total:
            problems.append("no request completed")
        out["gates"] = {"passed": not problems, "violations": problems}
    return out, data


def request_keys(samples: list[dict[str, Any]], ok: list[dict[str, Any]]) -> list[str | None]:
    """Per request of `ok`: "<user>/<n>/<prompt>", its user's n-th request (0-based, failed ones counted, by start
    time) and the prompt's index; None where a sample lacks its user or prompt. A user draws its prompts from its
    own seeded stream, so two runs with the same seed send the n-th request of a user with the same prompt, in
    both: the key pairs them (sweep.same_prompt_ttft), whatever else each run sent."""
    order: dict[int, str] = {}
    by_user: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        if s.get("user") is not None and s.get("prompt") is not None:
            by_user.setdefault(s["user"], []).append(s)
    for user, mine in by_user.items():
        for n, s in enumerate(sorted(mine, key=lambda s: s["start"])):
            order[id(s)] = f"{user}/{n}/{s['prompt']}"
    return [order.get(id(s)) for s in ok]


def _num(x: Any) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _p(dist: dict | None, key: str) -> float | None:
    return dist[key] if dist else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def gain_table(cells: list[dict[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    """Per profile and non-baseline setting: off/on latency ratios and on/off tok/s, with acceptance."""
    if baseline is None:
        return []
    rows = []
    point = lambda c: ((c.get("sweep") or {}).get("value"), (c.get("sweep") or {}).get("step"))  # noqa: E731
    for off in (c for c in cells if c["setting"] == baseline):
        for on in (c for c in cells if c["profile"] == off["profile"] and c["setting"] != baseline
                   and point(c) == point(off)):
            acc = on["acceptance"]
            rows.append({
                "profile": on["profile"], "setting": on["setting"], "baseline": baseline,
                "users": on.get("users"), "sweep": on.get("sweep"),
                "ttft_speedup": _ratio(_p(off["ttft_ms"], "p50"), _p(on["ttft_ms"], "p50")),
                "tpot_speedup": _ratio(_p(off["tpot_ms"], "p50"), _p(on["tpot_ms"], "p50")),
                "e2e_speedup": _ratio(_p(off["e2e_ms"], "p50"), _p(on["e2e_ms"], "p50")),
                "throughput_gain": _ratio(on["tokens_per_s"], off["tokens_per_s"]),
                "acceptance_rate": acc["responses"]["acceptance_rate"]
                if acc["responses"]["acceptance_rate"] is not None else acc["server_metrics"].get("acceptance_rate"),
                "mean_accepted_length": acc["server_metrics"].get("mean_accepted_length"),
                "acceptance_per_position": acc["server_metrics"].get("per_position"),
            })
    return rows


def write_report(out_dir: Path, report: dict[str, Any], runs: Runs | None = None) -> dict[str, Path]:
    """Write report.json, report.md, the exports and the plots into `out_dir` (`runs`: the cells' RunData, for
    the exports and the plots; report.json holds the cells alone); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    from specbuild.loadtests.sweep_report import sweep_plots

    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md",
             "genai_perf": export.write_genai_perf(out_dir, report["cells"], runs),
             **export.write_aiperf(out_dir, report["cells"], runs),
             "csv": export.write_summary_csv(out_dir, report["cells"])}
    # A plot that cannot be drawn is noted in the report; it never costs the report (or what was measured).
    report["plot_errors"] = []
    for draw in (lambda: _plots(out_dir, report["cells"], runs),
                 lambda: sweep_plots(out_dir, report.get("curves") or [], report["cells"], runs)):
        try:
            paths.update(draw())
        except Exception as e:  # noqa: BLE001  (matplotlib raises many types)
            report["plot_errors"].append(f"{type(e).__name__}: {e}")
    report["plots"] = {k: p.name for k, p in paths.items()
                       if k not in ("json", "md", "genai_perf", "aiperf_json", "aiperf_csv", "csv")}
    paths["json"].write_text(json.dumps(report, indent=2, default=str) + "\n")
    paths["md"].write_text(render_markdown(report))
    return paths


def client_cpu(cpu: dict[str, Any] | None) -> str:
    """The load generator's cores, and each Locust process's where there are workers: `0.82 (m 0.04, w 0.40 /
    0.38)`."""
    cpu = cpu or {}
    total = _f(cpu.get("cores"), "{:.2f}")
    procs = cpu.get("by_process") or []
    if not any(p.get("role") == "worker" for p in procs):
        return total
    master = [_f(p.get("cores"), "{:.2f}") for p in procs if p.get("role") == "master"]
    workers = " / ".join(_f(p.get("cores"), "{:.2f}") for p in procs if p.get("role") == "worker")
    return f"{total} ({'m ' + master[0] + ', ' if master else ''}w {workers})"


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _header(report: dict[str, Any]) -> list[str]:
    api = report.get("api", "kserve")
    lines = ["# Load test report", "", f"- target: `{report['url']}` model `{report['model']}` "
             f"over {report['protocol'] if api == 'kserve' else api}", f"- started: {report['started']}",
             f"- status: {report['status']}"]
    machine = report.get("machine") or {}
    if machine:
        lines.append(f"- machine: {one_line(machine)}, load generator on CPUs {machine.get('cpu_affinity')}")
    if report.get("sweep"):
        lines.append("- sweep: " + "; ".join(f"{p} {s['param']} = {', '.join(f'{v:g}' for v in s['values'])}"
                                            + (" (a ramp, in time order)" if s.get("ramp") else "")
                                            for p, s in report["sweep"].items()))
    if report.get("prompts"):
        pr = report["prompts"]
        lines.append(f"- prompts: {pr['records']} records from `{pr['file']}` ({pr['format']}), lengths from "
                     f"{'the data' if pr['lengths'] == 'data' else 'the profile'}")
    return lines + [""]


def _quality(report: dict[str, Any]) -> list[str]:
    from specbuild.loadtests.sweep_report import load_label as _load

    lines: list[str] = []
    lines += ["", "## Measurement quality", "",
              "| profile | setting | load | harness overhead p50 ms | zero-work probe p50 ms | Locust CSV E2E median | "
              "cross-check TTFT / e2e (independent / Locust) | longest silence s (stalls) |", "|" + "---|" * 8]
    for c in report["cells"]:
        cc = c.get("cross_check") or {}
        quiet = c.get("silence") or {}
        lines.append(f"| {c['profile']} | {c['setting']} | {_load(c)} | "
                     f"{_f(_p(c['harness']['overhead_ms'], 'p50'), '{:.3f}')} | "
                     f"{_f(_p(c['harness']['zero_work_probe_ms'], 'p50'), '{:.2f}')} | "
                     f"{_f(c['locust'].get('E2E', {}).get('median_ms'))} | "
                     f"{_f(cc.get('ttft_ratio'), '{:.3f}')} / {_f(cc.get('e2e_ratio'), '{:.3f}')} | "
                     f"{_f(quiet.get('longest_s'), '{:.2f}')} ({len(quiet.get('stalls') or [])}) |")
    stalled = [line for line in map(stalls.describe, report["cells"]) if line]
    if stalled:
        lines += ["", "Stalls (requests in flight, nothing from the server; `loadtests/stalls.py`):", ""]
        lines += [f"- {line}" for line in stalled]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    from specbuild.loadtests.ramp import ramp_markdown
    from specbuild.loadtests.sweep_report import curves_markdown, load_label as _load, speculation_markdown

    lines = _header(report)
    if report.get("note"):
        lines += [f"**{report['note']}**", ""]
    lines += ["## Latency and throughput", "",
              "| profile | setting | load | status | req | err | TTFT p50/p95 ms | ITL p50/p95 ms | TPOT p50/p95 ms | "
              "e2e p50/p95 ms | tok/s | acceptance | client CPU (cores) |", "|" + "---|" * 13]
    for c in report["cells"]:
        pair = lambda d: f"{_f(_p(d, 'p50'))} / {_f(_p(d, 'p95'))}"  # noqa: E731
        lines.append(f"| {c['profile']} | {c['setting']} | {_load(c)} | {c.get('status', 'ok')} | {c['requests']} | "
                     f"{c['failures']} | {pair(c['ttft_ms'])} | "
                     f"{pair(c['itl_ms'])} | {pair(c['tpot_ms'])} | {pair(c['e2e_ms'])} | "
                     f"{_f(c['tokens_per_s'])} | {_f(c['acceptance']['responses']['acceptance_rate'], '{:.2f}')} | "
                     f"{client_cpu(c.get('client_cpu'))} |")
    lines += curves_markdown(report.get("curves") or [])
    if report.get("gains") and not report.get("curves"):
        lines += ["", "## Batch vs interactive: what speculation buys", "",
                  "Ratios of medians, speculation off / on for latencies (> 1 = faster), on / off for tok/s.", "",
                  "| profile | setting vs baseline | TTFT | TPOT | e2e | tok/s | acceptance rate | mean accepted len |",
                  "|" + "---|" * 8]
        for g in report["gains"]:
            lines.append(f"| {g['profile']} | {g['setting']} vs {g['baseline']} | {_f(g['ttft_speedup'], '{:.2f}x')} | "
                         f"{_f(g['tpot_speedup'], '{:.2f}x')} | {_f(g['e2e_speedup'], '{:.2f}x')} | "
                         f"{_f(g['throughput_gain'], '{:.2f}x')} | {_f(g['acceptance_rate'], '{:.2f}')} | "
                         f"{_f(g['mean_accepted_length'], '{:.2f}')} |")
    lines += ramp_markdown(report.get("ramp") or [])
    lines += speculation_markdown(report["cells"]) + _quality(report)
    unmeasured = [c for c in report["cells"] if c.get("status", "ok") != "ok"]
    if unmeasured:
        lines += ["", "## Runs that did not complete a measurement", ""]
        for c in unmeasured:
            stop = c.get("stop") or {}
            saw = (f"{c['requests']} request(s) completed, {c['failures']} failed in {c['wall_s']:g} s"
                   + (f" (wanted {stop['min_requests']} in >= {stop['min_duration_s']:g} s, ceiling "
                      f"{stop['max_duration_s']:g} s)" if stop.get("min_requests") is not None else ""))
            why = c.get("error") or stop.get("server_gone") or ""
            lines.append(f"- {c['profile']} / {c['setting']}: **{c['status']}**: {saw}."
                         + (f" {why.splitlines()[0]}" if why else ""))
    gated = [c for c in report["cells"] if "gates" in c]
    if gated:
        lines += ["", "## SLO gates", ""]
        for c in gated:
            verdict = "pass" if c["gates"]["passed"] else "FAIL: " + "; ".join(c["gates"]["violations"])
            lines.append(f"- {c['profile']} / {c['setting']}: {verdict}")
    lines += ["", f"Also here: `{export.SUMMARY_CSV}` (one row per run), `{export.GENAI_PERF_FILE}` (GenAI-Perf's "
              f"metric names and statistics) and `{export.AIPERF_JSON}` / `{export.AIPERF_CSV}` (AIPerf's); see "
              "docs/loadtests.md."]
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in report["plots"].items()]
    if report.get("plot_errors"):
        lines += ["", "Plots that could not be drawn: " + "; ".join(report["plot_errors"])]
    return "\n".join(lines) + "\n"


def _plots(out_dir: Path, cells: list[dict[str, Any]], runs: Runs | None = None) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}
    raw = {(c["profile"], c["setting"]): values_of(runs, c) for c in cells}
    for key, title in (("ttft_ms", "Time to first token"), ("itl_ms", "Inter-token latency"),
                       ("e2e_ms", "End-to-end latency")):
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for (profile, setting), values in raw.items():
            v = sorted(values.get(key, []))
            if v:
                ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=f"{profile} / {setting}")
                drawn = True
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.set_title(f"{title} (CDF)" + ("" if drawn else " - not measured (no streaming run)"))
        if drawn:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        path = out_dir / f"{key.removesuffix('_ms')}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths[key.removesuffix("_ms")] = path
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{c['profile']}\n{c['setting']}" for c in cells]
    ax.bar(range(len(cells)), [c["tokens_per_s"] or 0 for c in cells], color="tab:blue")
    ax.set_xticks(range(len(cells)), labels, fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput")
    ax.grid(axis="y", alpha=0.3)
    path = out_dir / "throughput.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths["throughput"] = path
    return paths
