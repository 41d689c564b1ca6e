"""What a run measured besides its summary: `RunData`, carried beside the summary dict (a report cell) and never
written into report.json.

    summary, data = report.measure_cell(cell, stream=True, users=4)     # the cell dict, and its RunData
    runs = {run_key(summary): data}                                     # the report's runs, by run_key

`values` (each completed request's TTFT, ITL, e2e, tokens, TPOT, and its key: user, n-th request, prompt) feeds
the plots, the sweep's bootstraps (the TTFT one pairs the two runs' requests by key) and the per-user tok/s;
`genai_perf` / `aiperf` are the run's exports (its own profile_export_* files and the report's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass
class RunData:
    values: dict[str, list] = field(default_factory=dict)    # ttft_ms, itl_ms, e2e_ms, tokens, tpot_ms,
    #                                                         request_key, ttft_ms_per_request
    genai_perf: dict[str, Any] | None = None                  # GenAI-Perf's profile_export_genai_perf.json
    aiperf: dict[str, Any] | None = None                      # AIPerf's profile_export_aiperf.json


Runs = Mapping[str, RunData]       # run_key(cell) -> that cell's RunData


def run_key(cell: Mapping[str, Any]) -> str:
    """`<profile>/<setting>`, or `<profile>/<param>=<value>/<setting>` for a sweep point: one per report cell."""
    sweep = cell.get("sweep")
    if not sweep:
        return f"{cell['profile']}/{cell['setting']}"
    step = f"@{sweep['step']}" if sweep.get("step") is not None else ""      # a ramp visits a load twice
    return f"{cell['profile']}/{sweep['param']}={sweep['value']:g}{step}/{cell['setting']}"


def values_of(runs: Runs | None, cell: Mapping[str, Any]) -> dict[str, list]:
    """The cell's per-request values ({} when its RunData is not there)."""
    data = (runs or {}).get(run_key(cell))
    return data.values if data else {}
