"""The report in the conventions other tools use: GenAI-Perf's `profile_export_genai_perf.json` and a
one-row-per-run `summary.csv`.

GenAI-Perf format matched: `genai_perf/metrics/statistics.py` and `llm_metrics.py` of
triton-inference-server/perf_analyzer at commit 0518df1 (2025; the releases that report p1..p99 and
`request_count`). Each metric is `{"unit": ..., "avg": ..., "p1" ... "p99": ..., "min", "max", "std"}`
(numpy's linear percentiles, population std); system metrics (`request_throughput`,
`output_token_throughput`, `request_count`) have only `unit` and `avg`; `input_config` holds the run's
settings. As in GenAI-Perf, `time_to_first_token` and `inter_token_latency` are left out of a
non-streaming run, and GenAI-Perf's `inter_token_latency` is per request
`(request_latency - time_to_first_token) / (output_sequence_length - 1)`: our TPOT, not our ITL (the
gaps between streamed pieces). Names are mapped in docs/loadtests.md.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

GENAI_PERF_FILE = "profile_export_genai_perf.json"
SUMMARY_CSV = "summary.csv"
GENAI_PERF_MATCHED = "genai-perf statistics.py / llm_metrics.py, triton-inference-server/perf_analyzer@0518df1"
PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)


def genai_stats(values: list[float], unit: str) -> dict[str, Any] | None:
    """GenAI-Perf's statistics of one metric (None when nothing was measured, as GenAI-Perf skips it)."""
    if not values:
        return None
    v = sorted(float(x) for x in values)
    n = len(v)
    mean = sum(v) / n

    def pct(p: float) -> float:   # numpy.percentile's default (linear)
        k = (n - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    out: dict[str, Any] = {"unit": unit, "avg": mean}
    out.update({f"p{p}": pct(p) for p in PERCENTILES})
    out.update({"min": v[0], "max": v[-1], "std": math.sqrt(sum((x - mean) ** 2 for x in v) / n)})
    return out


def genai_perf_export(samples: list[dict[str, Any]], *, stream: bool, window_s: float,
                      input_config: dict[str, Any]) -> dict[str, Any]:
    """One run's successful requests -> GenAI-Perf's profile export dict (key order as GenAI-Perf's)."""
    ok = [s for s in samples if s.get("ok")]
    tokens = sum(s.get("tokens", 0) for s in ok)
    metrics: dict[str, Any] = {}
    if stream:
        metrics["time_to_first_token"] = genai_stats([s["ttft_ms"] for s in ok if s.get("ttft_ms") is not None],
                                                     "ms")
        metrics["inter_token_latency"] = genai_stats([s["tpot_ms"] for s in ok if s.get("tpot_ms") is not None],
                                                     "ms")
    metrics["request_latency"] = genai_stats([s["e2e_ms"] for s in ok], "ms")
    metrics["output_token_throughput_per_request"] = genai_stats(
        [s["tokens"] / (s["e2e_ms"] / 1000) for s in ok if s.get("e2e_ms")], "tokens/sec")
    metrics["output_sequence_length"] = genai_stats([s["tokens"] for s in ok], "tokens")
    metrics["input_sequence_length"] = genai_stats(
        [s["input_tokens"] for s in ok if s.get("input_tokens") is not None], "tokens")
    if window_s > 0:
        metrics["output_token_throughput"] = {"unit": "tokens/sec", "avg": tokens / window_s}
        metrics["request_throughput"] = {"unit": "requests/sec", "avg": len(ok) / window_s}
    metrics["request_count"] = {"unit": "count", "avg": len(ok)}
    out = {k: v for k, v in metrics.items() if v is not None}
    out["input_config"] = input_config
    return out


def write_genai_perf(out_dir: Path, cells: list[dict[str, Any]]) -> Path:
    """`<out>/profile_export_genai_perf.json`: {"format": ..., "runs": {"<profile>/<setting>": export}}
    (each run's export is also in its run directory, one file per run as GenAI-Perf writes it)."""
    path = out_dir / GENAI_PERF_FILE
    runs = {f"{c['profile']}/{c['setting']}": c["_genai_perf"] for c in cells if c.get("_genai_perf")}
    path.write_text(json.dumps({"format": GENAI_PERF_MATCHED, "runs": runs}, indent=2) + "\n")
    return path


SUMMARY_COLUMNS = ("profile", "setting", "status", "requests", "failures", "error_rate", "window_s",
                   "ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50", "itl_ms_p95", "tpot_ms_p50", "tpot_ms_p95",
                   "e2e_ms_p50", "e2e_ms_p95", "e2e_ms_p99", "tokens_per_s", "requests_per_s",
                   "acceptance_rate", "stop_reason", "error")


def summary_row(cell: dict[str, Any]) -> dict[str, Any]:
    def p(key: str, q: str):
        d = cell.get(key)
        return d.get(q) if d else None

    row = {k: cell.get(k) for k in ("profile", "setting", "status", "requests", "failures", "error_rate",
                                     "window_s", "tokens_per_s", "requests_per_s", "error")}
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        for q in ("p50", "p95") + (("p99",) if key == "e2e_ms" else ()):
            row[f"{key}_{q}"] = p(key, q)
    row["acceptance_rate"] = (cell.get("acceptance") or {}).get("responses", {}).get("acceptance_rate")
    row["stop_reason"] = (cell.get("stop") or {}).get("reason")
    return row


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, str):
        return value.splitlines()[0] if value else value   # an error's first line
    return value


def write_summary_csv(out_dir: Path, cells: list[dict[str, Any]]) -> Path:
    """`<out>/summary.csv`: one row per run, every run listed (failed and too-slow ones too)."""
    path = out_dir / SUMMARY_CSV
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        for c in cells:
            row = summary_row(c)
            writer.writerow({k: _cell(row.get(k)) for k in SUMMARY_COLUMNS})
    return path
