"""The sweep's part of the report: the gain of each setting over the baseline as a function of load (table
and `gain_vs_load.png`), the crossover per setting, and the throughput / latency Pareto plot
(`pareto.png`: output tok/s per user against total output tok/s, one line per setting, one point per load,
as GenAI-Perf / AIPerf users read it). Also the per-cell speculation table (acceptance, mean accepted
length, acceptance per draft position) from the server's counters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specbuild.loadtests.rundata import Runs, values_of


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def load_label(cell: dict[str, Any]) -> str:
    sweep = cell.get("sweep") or {}
    if sweep:
        at = "" if sweep.get("step") is None else f" @{sweep['step']}"   # a ramp's point: its step
        return f"{sweep['param']}={sweep['value']:g}{at}"
    return f"rate={cell['request_rate']:g}/s" if cell.get("request_rate") else f"users={cell.get('users')}"


def per_user_tok_s(values: dict[str, list]) -> float | None:
    """Output tokens per second per user from a run's per-request values (`RunData.values`): the mean over
    requests of 1000 / TPOT (AIPerf's output_token_throughput_per_user; non-streaming: TPOT = e2e / tokens)."""
    tpots = [t for t in values.get("tpot_ms") or [] if t]
    return sum(1000.0 / t for t in tpots) / len(tpots) if tpots else None


def curves_markdown(curves: list[dict[str, Any]]) -> list[str]:
    if not curves:
        return []
    lines = ["", "## Where speculation pays: gain over the baseline by load", "",
             "Gain on the profile's objective (latency: e2e median off / on; throughput: tok/s on / off; > 1 = "
             "the setting is better), P(gain > 1) and the 90 % interval from a bootstrap over the requests of "
             "both runs. The crossover is the highest load where the setting still beats the baseline. TTFT, "
             "TPOT, e2e: the baseline's median over the setting's, over all requests; TTFT on the same prompts: "
             "over the requests both runs sent with the same prompt (a user's n-th request), with its 90 % "
             "interval and the number of pairs (the faster setting sends more requests, with other prompts).", "",
             "| profile | setting vs baseline | load | objective | gain | P(gain > 1) | 90 % interval | TTFT | "
             "TTFT, same prompts (90 %, pairs) | TPOT | e2e | tok/s | requests (base / setting) |",
             "|" + "---|" * 13]
    for cv in curves:
        for p in cv["points"]:
            if p.get("status"):   # a run that did not measure: no gain at this point
                st = p["status"]
                lines.append(f"| {cv['profile']} | {cv['setting']} vs {cv['baseline']} | {cv['param']}={p['value']:g} | "
                             f"{p['objective']} | not measured (baseline: {st['baseline']}; setting: "
                             f"{st['setting']}) | - | - | - | - | - | - | - | {p['requests'][0]} / {p['requests'][1]} |")
                continue
            conf = p.get("confidence") or {}
            ci = conf.get("ci90")
            at = "" if p.get("step") is None else f" @{p['step']}"
            lines.append(f"| {cv['profile']} | {cv['setting']} vs {cv['baseline']} | "
                         f"{cv['param']}={p['value']:g}{at} | "
                         f"{p['objective']} | {_f(p['gain'], '{:.2f}x')} | {_f(conf.get('p_gain_gt_1'))} | "
                         f"{'-' if not ci else f'{ci[0]:.2f}-{ci[1]:.2f}'} | {_f(p['ttft_speedup'], '{:.2f}x')} | "
                         f"{_same_prompts(p.get('ttft_same_prompts'))} | {_f(p['tpot_speedup'], '{:.2f}x')} | "
                         f"{_f(p['e2e_speedup'], '{:.2f}x')} | "
                         f"{_f(p['throughput_gain'], '{:.2f}x')} | {p['requests'][0]} / {p['requests'][1]} |")
    lines += ["", "| profile | setting | crossover (highest load where it beats the baseline) | gain there | "
              "P(gain > 1) | beats at every load below | note |", "|" + "---|" * 7]
    for cv in curves:
        x = cv["crossover"]
        value = "none" if x.get("value") is None else f"{cv['param']}={x['value']:g}"
        below = "-" if x.get("value") is None else ("yes" if x.get("beats_at_every_point_below") else "no")
        lines.append(f"| {cv['profile']} | {cv['setting']} | {value} | {_f(x.get('gain'), '{:.2f}x')} | "
                     f"{_f(x.get('p_gain_gt_1'))} | {below} | {x.get('note') or ''} |")
    return lines


def _same_prompts(m: dict[str, Any] | None) -> str:
    if not m:
        return "-"
    lo, hi = m["ci90"]
    return f"{m['ttft_speedup']:.2f}x ({lo:.2f}-{hi:.2f}, {m['pairs']})"


def speculation_markdown(cells: list[dict[str, Any]]) -> list[str]:
    """Per cell: acceptance from the responses and from the server's counters (vLLM schema when exported)."""
    rows = []
    for c in cells:
        sm = (c.get("acceptance") or {}).get("server_metrics") or {}
        resp = (c.get("acceptance") or {}).get("responses") or {}
        if sm.get("drafted") or sm.get("drafts") or resp.get("drafted"):
            pos = sm.get("per_position")
            rows.append(f"| {c['profile']} | {c['setting']} | {load_label(c)} | {_f(resp.get('acceptance_rate'))} | "
                        f"{_f(sm.get('acceptance_rate'))} | {_f(sm.get('mean_accepted_length'))} | "
                        f"{' / '.join(f'{x:.2f}' for x in pos) if pos else '-'} | {sm.get('schema') or '-'} |")
    if not rows:
        return []
    return ["", "## Speculation: acceptance", "",
            "From the responses (perf metrics, or llama.cpp's `timings`) and from the server's counters over the "
            "run (the vLLM schema `vllm:spec_decode_*` when exported): acceptance rate = accepted / drafted "
            "tokens, mean accepted length = 1 + accepted / drafts, per position i = drafts whose i-th token was "
            "accepted / drafts.", "",
            "| profile | setting | load | acceptance (responses) | acceptance (server) | mean accepted length | "
            "acceptance per draft position | counters |", "|" + "---|" * 8] + rows


def sweep_plots(out_dir: Path, curves: list[dict[str, Any]], cells: list[dict[str, Any]],
                runs: Runs | None = None) -> dict[str, Path]:
    """gain_vs_load.png (one panel per profile) and pareto.png (one panel per profile)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}
    profiles = list(dict.fromkeys(cv["profile"] for cv in curves))
    if profiles:
        fig, axes = plt.subplots(1, len(profiles), figsize=(5.5 * len(profiles), 4), squeeze=False)
        for ax, profile in zip(axes[0], profiles):
            for cv in (c for c in curves if c["profile"] == profile):
                pts = [p for p in cv["points"] if p["gain"] is not None]
                if not pts:
                    continue
                xs, ys = [p["value"] for p in pts], [p["gain"] for p in pts]
                cis = [((p.get("confidence") or {}).get("ci90") or [p["gain"]] * 2) for p in pts]
                lo = [max(0.0, p["gain"] - ci[0]) for p, ci in zip(pts, cis)]   # an interval beside the point:
                hi = [max(0.0, ci[1] - p["gain"]) for p, ci in zip(pts, cis)]   # no negative error bar
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=f"{cv['setting']} vs {cv['baseline']}")
            ax.axhline(1.0, color="grey", lw=1, ls="--")
            param = next(c["param"] for c in curves if c["profile"] == profile)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(param.replace("_", " ") + (" (requests/s)" if param == "request_rate" else ""))
            obj = next((p["objective"] for c in curves if c["profile"] == profile for p in c["points"]), "")
            ax.set_ylabel(f"gain over baseline ({obj})")
            ax.set_title(f"{profile}: gain by load (90 % interval)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths["gain_vs_load"] = out_dir / "gain_vs_load.png"
        fig.savefig(paths["gain_vs_load"], dpi=100)
        plt.close(fig)
    swept = [c for c in cells if c.get("sweep") and c.get("status") == "ok" and c.get("tokens_per_s")]
    profiles = list(dict.fromkeys(c["profile"] for c in swept))
    if profiles:
        fig, axes = plt.subplots(1, len(profiles), figsize=(5.5 * len(profiles), 4), squeeze=False)
        for ax, profile in zip(axes[0], profiles):
            for setting in dict.fromkeys(c["setting"] for c in swept if c["profile"] == profile):
                pts = sorted((c for c in swept if c["profile"] == profile and c["setting"] == setting),
                             key=lambda c: c["sweep"]["value"])
                pts = [(c["tokens_per_s"], per_user_tok_s(values_of(runs, c)), c["sweep"]["value"]) for c in pts]
                pts = [p for p in pts if p[1] is not None]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=setting)
                for x, y, v in pts:
                    ax.annotate(f"{v:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
            ax.set_xlabel("total output tokens / s")
            ax.set_ylabel("output tokens / s per user")
            ax.set_title(f"{profile}: throughput vs per-user speed (points: load)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths["pareto"] = out_dir / "pareto.png"
        fig.savefig(paths["pareto"], dpi=100)
        plt.close(fig)
    return paths
