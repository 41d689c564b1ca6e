"""The report in the conventions other tools use: GenAI-Perf's `profile_export_genai_perf.json`, AIPerf's
`profile_export_aiperf.json` / `profile_export_aiperf.csv`, and a one-row-per-run `summary.csv`.

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

from specbuild.loadtests.rundata import Runs, run_key

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


def _exports(cells: list[dict[str, Any]], runs: Runs | None, kind: str) -> dict[str, dict[str, Any]]:
    """run_key -> the run's `kind` export ("genai_perf" | "aiperf"), in the cells' order."""
    out = {}
    for c in cells:
        data = (runs or {}).get(run_key(c))
        if data is not None and getattr(data, kind):
            out[run_key(c)] = getattr(data, kind)
    return out


def write_genai_perf(out_dir: Path, cells: list[dict[str, Any]], runs: Runs | None = None) -> Path:
    """`<out>/profile_export_genai_perf.json`: {"format": ..., "runs": {"<profile>/<setting>": export}}
    (each run's export is also in its run directory, one file per run as GenAI-Perf writes it)."""
    path = out_dir / GENAI_PERF_FILE
    exports = _exports(cells, runs, "genai_perf")
    path.write_text(json.dumps({"format": GENAI_PERF_MATCHED, "runs": exports}, indent=2) + "\n")
    return path


SUMMARY_COLUMNS = ("profile", "setting", "sweep_param", "sweep_value", "users", "request_rate", "status", "requests", "failures", "error_rate", "window_s",
                   "ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50", "itl_ms_p95", "tpot_ms_p50", "tpot_ms_p95",
                   "e2e_ms_p50", "e2e_ms_p95", "e2e_ms_p99", "tokens_per_s", "requests_per_s",
                   "acceptance_rate", "server_acceptance_rate", "mean_accepted_length", "client_cpu_cores",
                   "stop_reason", "error")


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
    server = (cell.get("acceptance") or {}).get("server_metrics") or {}
    row["server_acceptance_rate"] = server.get("acceptance_rate")
    row["mean_accepted_length"] = server.get("mean_accepted_length")
    row["client_cpu_cores"] = (cell.get("client_cpu") or {}).get("cores")
    sweep = cell.get("sweep") or {}
    row["sweep_param"], row["sweep_value"] = sweep.get("param"), sweep.get("value")
    row["users"], row["request_rate"] = cell.get("users"), cell.get("request_rate")
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


# --- AIPerf ------------------------------------------------------------------------------------------------

AIPERF_JSON = "profile_export_aiperf.json"
AIPERF_CSV = "profile_export_aiperf.csv"
AIPERF_JSONL = "profile_export.jsonl"
AIPERF_MATCHED = "aiperf 0.13.0 (PyPI): profile_export_aiperf.json schema 1.4, profile_export_aiperf.csv"
AIPERF_STATS = ("avg", "min", "max", "sum", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "std")
# tag -> (header, unit), in AIPerf's display order
AIPERF_METRICS = {
    "time_to_first_token": ("Time to First Token", "ms"),
    "time_to_second_token": ("Time to Second Token", "ms"),
    "request_latency": ("Request Latency", "ms"),
    "inter_token_latency": ("Inter Token Latency", "ms"),
    "inter_chunk_latency": ("Inter Chunk Latency", "ms"),
    "output_token_throughput_per_user": ("Output Token Throughput Per User", "tokens/sec/user"),
    "output_sequence_length": ("Output Sequence Length", "tokens"),
    "input_sequence_length": ("Input Sequence Length", "tokens"),
    "output_token_throughput": ("Output Token Throughput", "tokens/sec"),
    "request_throughput": ("Request Throughput", "requests/sec"),
    "request_count": ("Request Count", "requests"),
    "error_request_count": ("Error Request Count", "requests"),
    "total_output_tokens": ("Total Output Tokens", "tokens"),
    "total_isl": ("Total Input Sequence Length", "tokens"),
    "total_osl": ("Total Output Sequence Length", "tokens"),
    "benchmark_duration": ("Benchmark Duration", "sec"),
}


def aiperf_stats(values: list[float], unit: str) -> dict[str, Any] | None:
    """AIPerf's statistics of one record metric (numpy linear percentiles, population std, count, sum)."""
    base = genai_stats(values, unit)
    if base is None:
        return None
    out = {"unit": unit, **{k: base[k] for k in AIPERF_STATS if k in base}}
    out["sum"] = float(sum(values))
    out["count"] = len(values)
    return {k: out[k] for k in AIPERF_JSON_KEYS}


AIPERF_JSON_KEYS = ("unit", "avg", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "min", "max", "std",
                    "count", "sum")   # the key order of aiperf's JSON


def aiperf_export(samples: list[dict[str, Any]], *, stream: bool, window_s: float,
                  input_config: dict[str, Any]) -> dict[str, Any]:
    """One run's requests -> AIPerf's profile_export_aiperf.json dict (streaming-only metrics left out of a
    non-streaming run, as AIPerf does)."""
    ok = [s for s in samples if s.get("ok")]
    failed = [s for s in samples if not s.get("ok")]
    m: dict[str, Any] = {}
    if stream:
        m["time_to_first_token"] = aiperf_stats([s["ttft_ms"] for s in ok if s.get("ttft_ms") is not None], "ms")
        m["time_to_second_token"] = aiperf_stats([s["itl_ms"][0] for s in ok if s.get("itl_ms")], "ms")
    m["request_latency"] = aiperf_stats([s["e2e_ms"] for s in ok], "ms")
    if stream:
        tpot = [s["tpot_ms"] for s in ok if s.get("tpot_ms")]
        m["inter_token_latency"] = aiperf_stats(tpot, "ms")
        m["inter_chunk_latency"] = aiperf_stats([g for s in ok for g in s.get("itl_ms", [])], "ms")
        m["output_token_throughput_per_user"] = aiperf_stats([1000.0 / t for t in tpot], "tokens/sec/user")
    m["output_sequence_length"] = aiperf_stats([s["tokens"] for s in ok], "tokens")
    m["input_sequence_length"] = aiperf_stats([s["input_tokens"] for s in ok if s.get("input_tokens") is not None],
                                              "tokens")
    tokens = sum(s.get("tokens", 0) for s in ok)
    if window_s > 0:
        m["output_token_throughput"] = {"unit": "tokens/sec", "avg": tokens / window_s}
        m["request_throughput"] = {"unit": "requests/sec", "avg": len(ok) / window_s}
        m["benchmark_duration"] = {"unit": "sec", "avg": window_s}
    m["request_count"] = {"unit": "requests", "avg": float(len(ok))}
    if failed:
        m["error_request_count"] = {"unit": "requests", "avg": float(len(failed))}
    m["total_output_tokens"] = {"unit": "tokens", "avg": float(tokens)}
    m["total_isl"] = {"unit": "tokens", "avg": float(sum(s.get("input_tokens") or 0 for s in ok))}
    m["total_osl"] = {"unit": "tokens", "avg": float(tokens)}
    out: dict[str, Any] = {"schema_version": "1.4", "aiperf_version": None, "generated_by": "specbuild loadtest"}
    out.update({k: v for k, v in m.items() if v is not None})
    out["input_config"] = input_config
    out["was_cancelled"] = False
    return out


def aiperf_csv(export: dict[str, Any]) -> str:
    """AIPerf's profile_export_aiperf.csv layout for one run's export dict."""
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    metrics = {k: v for k, v in export.items() if k in AIPERF_METRICS and isinstance(v, dict)}
    name = lambda tag: AIPERF_METRICS[tag][0] + ("" if metrics[tag]["unit"] in ("count", "requests")  # noqa: E731
                                                  else f" ({metrics[tag]['unit']})")
    num = lambda v: "" if v is None else f"{int(v)}" if isinstance(v, int) else f"{float(v):.2f}"  # noqa: E731
    records = sorted(t for t, v in metrics.items() if "p50" in v)
    systems = sorted(t for t, v in metrics.items() if "p50" not in v)
    if records:
        w.writerow(["Metric", *AIPERF_STATS])
        for tag in records:
            w.writerow([name(tag), *(num(metrics[tag].get(k)) for k in AIPERF_STATS)])
    if records and systems:
        w.writerow([])
    if systems:
        w.writerow(["Metric", "Value"])
        for tag in systems:
            w.writerow([name(tag), num(metrics[tag].get("avg"))])
    return buf.getvalue()


def aiperf_records(samples: list[dict[str, Any]], *, stream: bool) -> str:
    """AIPerf's per-request `profile_export.jsonl` of one run."""
    lines = []
    for s in samples:
        start = int(s["start"] * 1e9)
        meta = {"request_start_ns": start, "request_end_ns": start + int((s.get("e2e_ms") or 0) * 1e6),
                "benchmark_phase": "profiling", "was_cancelled": False}
        if not s.get("ok"):
            lines.append(json.dumps({"metadata": meta, "metrics": {}, "error": {"message": s.get("error")}}))
            continue
        metrics: dict[str, Any] = {"request_latency": s["e2e_ms"], "output_sequence_length": s.get("tokens")}
        if s.get("input_tokens") is not None:
            metrics["input_sequence_length"] = s["input_tokens"]
        if stream:
            metrics["time_to_first_token"] = s.get("ttft_ms")
            if s.get("itl_ms"):
                metrics["time_to_second_token"] = s["itl_ms"][0]
                metrics["inter_chunk_latency"] = s["itl_ms"]
            if s.get("tpot_ms"):
                metrics["inter_token_latency"] = s["tpot_ms"]
                metrics["output_token_throughput_per_user"] = 1000.0 / s["tpot_ms"]
        units = {k: AIPERF_METRICS[k][1] for k in metrics}
        lines.append(json.dumps({"metadata": meta, "metrics": {k: {"value": v, "unit": units[k]}
                                                               for k, v in metrics.items() if v is not None}}))
    return "".join(line + "\n" for line in lines)


def write_aiperf(out_dir: Path, cells: list[dict[str, Any]], runs: Runs | None = None) -> dict[str, Path]:
    """`<out>/profile_export_aiperf.json` ({"format", "runs": {"<profile>/<setting>": export}}) and
    `<out>/profile_export_aiperf.csv` (each run's CSV section after a `# <profile>/<setting>` line). Each run
    directory holds its own two files in AIPerf's exact layout."""
    exports = _exports(cells, runs, "aiperf")
    json_path, csv_path = out_dir / AIPERF_JSON, out_dir / AIPERF_CSV
    json_path.write_text(json.dumps({"format": AIPERF_MATCHED, "runs": exports}, indent=2) + "\n")
    csv_path.write_text("".join(f"# {key}\n{aiperf_csv(export)}\n" for key, export in exports.items()))
    return {"aiperf_json": json_path, "aiperf_csv": csv_path}

