"""Prometheus text format, parsed in one place (Triton's `:8002/metrics` and the `specbuild_*` families).

    from specbuild.core.metrics import parse_prometheus, metric_sum
    samples = parse_prometheus(httpx.get("http://127.0.0.1:8002/metrics").text)
    samples['nv_inference_count{model="ensemble",version="1"}']     # 12.0
    metric_sum(samples, "nv_inference_count")                        # every series of the family, summed

Keys are `name` or `name{labels}` exactly as the server printed the labels, so a key copied from the
text finds its value. Comment (`# HELP`, `# TYPE`) and malformed lines are skipped; `NaN`, `+Inf`,
`-Inf` and an optional trailing timestamp are understood (the text format 0.0.4 grammar).
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+-?\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}; comments and malformed lines are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))   # float() reads NaN, +Inf, -Inf too
        except ValueError:
            continue
        out[m.group(1) + (m.group(2) or "")] = value
    return out


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of every series of the family `name` whose labels include `labels` (0.0 if none).

    `metric_sum(s, "nv_inference_request_success", model="ensemble")` adds every version of that model.
    """
    total = 0.0
    for key, value in samples.items():
        family, _, rest = key.partition("{")
        if family == name and (not labels or labels.items() <= dict(_LABEL.findall(rest)).items()):
            total += value
    return total
