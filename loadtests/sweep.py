"""Sweeps: every setting at every load point, and where speculation stops paying.

`--sweep users=1,2,4,8` (closed loop: concurrent users) or `--sweep request_rate=0.5,1,2` (open loop:
Poisson arrivals per second), for every profile, or `--sweep batch:users=8,16,32` for one profile.
Distinct values are run in ascending order. A **ramp** keeps its order: values that come back
(`users=1,2,4,8,4,2,1`: a rising then falling load) or `--ramp` (`--sweep users=1,2,4,8 --ramp` = the same
ramp: up, then back down). A ramp's points are told apart by their step (`Run.step`, `cell["sweep"]["step"]`):
the same load on the way up and on the way down are two points (`loadtests/ramp.py` reads them in time order).
Each point is a profile with that load (`Profile.with_overrides`), and every setting is measured at every
point by the ordinary run path (`pipeline.loadtest.run_setting`), so each point obeys the per-run rules
(duration and min_requests, the ceiling, "too slow to measure here", server gone, Ctrl-C).

From the measured cells (`curves`):

- the **gain** of each setting over the baseline at each point, on the profile's objective (the same rule
  as `tune`: chat and other streaming profiles -> latency, the e2e median ratio off / on; batch and other
  non-streaming profiles -> throughput, tok/s on / off; an open-loop sweep -> latency, since the arrival
  rate fixes the throughput), with TTFT / TPOT / e2e / tok/s ratios beside it;
- its **confidence**: a bootstrap over the requests of both runs (B = 1000, seeded), the probability that
  the gain is > 1 and its 90 % interval. For throughput the resampled statistic is sum(tokens) /
  sum(e2e) per run (proportional to a closed loop's tok/s at fixed concurrency);
- the **crossover**: the highest load point where the setting still beats the baseline (point gain > 1),
  with the confidence there, and whether it beats it at every point below as well.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbuild.core.errors import UsageError
from specbuild.loadtests.rundata import Runs, values_of

SWEEP_PARAMS = ("users", "request_rate")
ENDPOINT_FIELDS = ("url", "grpc_url", "metrics_url")   # in a --setting: where that setting's runs go
BOOTSTRAP = 1000


@dataclass(frozen=True)
class Sweep:
    param: str                  # "users" | "request_rate"
    values: tuple[float, ...]   # in run order: ascending, or a ramp's time order
    profile: str | None = None  # None: every profile
    ramp: bool = False          # the values are a load over time (repeats allowed, order kept)

    def label(self, value: float) -> str:
        """The point's directory / display name: `users-4`, `request_rate-0.5`."""
        return f"{self.param}-{value:g}"


def ramp_values(values: list[float]) -> list[float]:
    """`--ramp`: distinct values up, then back down: [1, 2, 4, 8] -> [1, 2, 4, 8, 4, 2, 1]."""
    up = sorted(set(values))
    return up + up[-2::-1]


def parse_sweeps(items: tuple[str, ...] | list[str], profiles: list[str], *, ramp: bool = False) -> dict[str, Sweep]:
    """`["users=1,2,4"]` or `["chat:users=1,2", "batch:users=8,16"]` -> profile name -> Sweep. Values that
    come back (`users=1,4,1`) are a ramp, run in the order given; `ramp=True` (`--ramp`) turns distinct values
    into one (up, then down)."""
    out: dict[str, Sweep] = {}
    for item in items:
        m = re.fullmatch(r"\s*(?:([A-Za-z0-9_.-]+)\s*:)?\s*([a-z_]+)\s*=\s*(.+)", item)
        if not m:
            raise UsageError(f"--sweep {item!r} must look like [PROFILE:]users=1,2,4,8 or request_rate=0.5,1,2.")
        scope, param, raw = m.groups()
        if param not in SWEEP_PARAMS:
            raise UsageError(f"--sweep {item!r}: {param!r} cannot be swept; choose one of {SWEEP_PARAMS}.")
        values: list[float] = []
        for v in raw.split(","):
            try:
                x = float(v) if param == "request_rate" else int(v)
            except ValueError:
                kind = "a number of requests per second" if param == "request_rate" else "an integer"
                raise UsageError(f"--sweep {item!r}: {v.strip()!r} is not {kind}.") from None
            if x <= 0:
                raise UsageError(f"--sweep {item!r}: every {param} must be > 0, got {v.strip()}.")
            values.append(x)
        if any(a == b for a, b in zip(values, values[1:])):
            raise UsageError(f"--sweep {item!r} repeats a value back to back; a ramp changes the load at every "
                             "point (e.g. users=1,2,4,2,1).")
        is_ramp = len(set(values)) != len(values)
        if ramp and is_ramp:
            raise UsageError(f"--sweep {item!r} is already a ramp (a value comes back); drop --ramp, or give "
                             "each value once with --ramp (it goes up, then back down).")
        if ramp and len(values) < 2:
            raise UsageError(f"--ramp needs at least two load values, got --sweep {item!r}.")
        ordered = tuple(values) if is_ramp else tuple(ramp_values(values) if ramp else sorted(values))
        if scope is not None and scope not in profiles:
            raise UsageError(f"--sweep {item!r} names profile {scope!r}, which is not run (--profile: {profiles}).")
        for name in ([scope] if scope else profiles):
            if name in out and (scope is None) == (out[name].profile is None):
                raise UsageError(f"--sweep: two sweeps for profile {name!r}; give one per profile.")
            if name not in out or scope is not None:   # a profile's own sweep wins over the shared one
                out[name] = Sweep(param, ordered, scope, ramp=ramp or is_ramp)
    return out


@dataclass(frozen=True)
class Run:
    """One planned run: a profile (at its sweep point), a setting, its request fields and its endpoint."""

    profile: Any
    setting: str
    fields: dict[str, Any]
    endpoint: tuple[str | None, str | None, str | None]   # the setting's (url, grpc_url, metrics_url), or Nones
    point: tuple[str, float] | None = None                 # (sweep param, value)
    step: int | None = None                                # a ramp's point: its place in time (0, 1, ...)

    @property
    def key(self) -> str:
        at = "" if self.step is None else f"@{self.step}"
        return f"{self.profile.name}/" + (f"{self.point[0]}={self.point[1]:g}{at}/" if self.point else "") + \
            self.setting

    @property
    def sweep_cell(self) -> dict[str, Any] | None:
        """What a report cell records of its point (`cell["sweep"]`)."""
        if not self.point:
            return None
        return {"param": self.point[0], "value": self.point[1],
                **({} if self.step is None else {"step": self.step, "ramp": True})}

    def run_dir(self, root: Path) -> Path:
        base = root / "runs" / self.profile.name
        if self.point:
            at = "" if self.step is None else f"{self.step:02d}-"
            base = base / f"{at}{self.point[0]}-{self.point[1]:g}"
        return base / self.setting.replace("=", "-")


def plan(profiles: list, named: list[tuple[str, dict[str, Any]]], sweep_items: tuple[str, ...] = (),
         extra: dict[str, Any] | None = None, *, ramp: bool = False) -> list[Run]:
    """Every profile x sweep point x setting (settings innermost: the settings of one point run back to back,
    so they see the same machine). A setting's `url` / `grpc_url` / `metrics_url` are its endpoint, the rest
    (after `extra`, the fields sent with every request) its request fields. A ramp's points keep their order
    and carry their step."""
    if ramp and not sweep_items:
        raise UsageError("--ramp goes with a --sweep: e.g. --sweep users=1,2,4,8 --ramp.")
    sweeps = parse_sweeps(sweep_items, [p.name for p in profiles], ramp=ramp)
    runs = []
    for profile in profiles:
        sweep = sweeps.get(profile.name)
        points = [(None, None)] if sweep is None else \
            [((sweep.param, v), i if sweep.ramp else None) for i, v in enumerate(sweep.values)]
        for point, step in points:
            p = profile if point is None else profile.with_overrides(**{point[0]: point[1]})
            for name, fields in named:
                endpoint = tuple(fields.get(k) for k in ENDPOINT_FIELDS)
                request = {k: v for k, v in {**(extra or {}), **fields}.items() if k not in ENDPOINT_FIELDS}
                runs.append(Run(p, name, request, endpoint, point, step))
    return runs


def sweep_summary(runs: list[Run]) -> dict[str, Any]:
    """profile -> {"param", "values"} in run order (a ramp: every step, `"ramp": true`)."""
    out: dict[str, Any] = {}
    seen: set = set()
    for r in runs:
        if r.point:
            entry = out.setdefault(r.profile.name, {"param": r.point[0], "values": []})
            if r.step is not None:
                entry["ramp"] = True
            if (r.profile.name, r.point[1], r.step) not in seen:
                seen.add((r.profile.name, r.point[1], r.step))
                entry["values"].append(r.point[1])
    return out


def first_at(runs: list[Run], run: Run) -> Run:
    """The first run of the same profile and setting (a sweep smoke-tests each setting once per profile)."""
    return next(r for r in runs if r.profile.name == run.profile.name and r.setting == run.setting)


def point_of(cell: dict[str, Any]) -> float | None:
    return (cell.get("sweep") or {}).get("value")


def point_key(cell: dict[str, Any]) -> tuple:
    """What pairs a setting's cell with the baseline's at one point: the value, and a ramp's step."""
    sw = cell.get("sweep") or {}
    return sw.get("value"), sw.get("step")


def time_order(cell: dict[str, Any]) -> tuple:
    """Sort key: a ramp's cells by step, a plain sweep's by value."""
    sw = cell.get("sweep") or {}
    return (sw.get("step") if sw.get("step") is not None else -1, sw.get("value") or 0)


def objective(cell: dict[str, Any]) -> str:
    """latency | throughput, as `tune` scores a profile (an open loop is scored on latency)."""
    if (cell.get("sweep") or {}).get("param") == "request_rate" or cell.get("request_rate"):
        return "latency"
    if cell["profile"] in ("chat", "batch"):
        return "latency" if cell["profile"] == "chat" else "throughput"
    return "latency" if cell.get("stream") else "throughput"


def _p50(d: dict | None) -> float | None:
    return d.get("p50") if d else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def bootstrap(a: dict[str, list], b: dict[str, list], kind: str, *, n: int = BOOTSTRAP, seed: int = 0,
              point: float | None = None) -> dict[str, Any] | None:
    """P(gain > 1) and the 90 % interval of the gain, resampling each run's requests with replacement (`a`, `b`:
    the baseline's and the setting's per-request values, `RunData.values`). For
    throughput the resampled statistic is sum(tokens) / sum(e2e); its relative spread is applied to `point`
    (the runs' tok/s ratio), so the interval is around the gain the report shows."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "latency":
        x, y = np.asarray(a.get("e2e_ms") or []), np.asarray(b.get("e2e_ms") or [])
        if len(x) < 2 or len(y) < 2:
            return None
        gx = np.median(x[rng.integers(0, len(x), (n, len(x)))], axis=1)
        gy = np.median(y[rng.integers(0, len(y), (n, len(y)))], axis=1)
        gains = gx / gy                                   # off / on: > 1 = faster with the setting
    else:
        tx, ex = np.asarray(a.get("tokens") or []), np.asarray(a.get("e2e_ms") or [])
        ty, ey = np.asarray(b.get("tokens") or []), np.asarray(b.get("e2e_ms") or [])
        if len(tx) < 2 or len(ty) < 2 or len(tx) != len(ex) or len(ty) != len(ey):
            return None
        ix, iy = rng.integers(0, len(tx), (n, len(tx))), rng.integers(0, len(ty), (n, len(ty)))
        rx = tx[ix].sum(axis=1) / ex[ix].sum(axis=1)
        ry = ty[iy].sum(axis=1) / ey[iy].sum(axis=1)
        gains = ry / rx                                   # on / off: > 1 = more tokens per second
        if point is not None:   # the spread of the resampled ratio, around the run's own tok/s ratio
            gains = gains * (point / ((ty.sum() / ey.sum()) / (tx.sum() / ex.sum())))
    lo, hi = np.percentile(gains, [5, 95])
    return {"p_gain_gt_1": float((gains > 1).mean()), "ci90": [float(lo), float(hi)], "resamples": n}


def same_prompt_ttft(a: dict[str, list], b: dict[str, list], *, n: int = BOOTSTRAP,
                     seed: int = 0) -> dict[str, Any] | None:
    """TTFT over the requests both runs sent with the same prompt (paired by `request_key`: a user's n-th request,
    and its prompt): the baseline's median over the setting's (> 1 = the setting's first token came sooner), and
    a 90 % interval from a paired bootstrap. A setting that finishes sooner sends more requests in a run of fixed
    length; its extra requests carry other prompts, of other lengths, and TTFT follows the prompt's length, so
    medians over all requests compare different prompts. None: fewer than 2 pairs, or no TTFT (non-streaming)."""
    import numpy as np

    def by_key(v: dict[str, list]) -> dict[str, float]:
        return {k: t for k, t in zip(v.get("request_key") or [], v.get("ttft_ms_per_request") or [])
                if k is not None and t is not None}

    x, y = by_key(a), by_key(b)
    keys = [k for k in x if k in y]
    if len(keys) < 2:
        return None
    xs, ys = np.asarray([x[k] for k in keys]), np.asarray([y[k] for k in keys])
    idx = np.random.default_rng(seed).integers(0, len(keys), (n, len(keys)))
    gains = np.median(xs[idx], axis=1) / np.median(ys[idx], axis=1)
    lo, hi = np.percentile(gains, [5, 95])
    return {"ttft_speedup": float(np.median(xs) / np.median(ys)), "pairs": len(keys),
            "ci90": [float(lo), float(hi)], "resamples": n}


def point_gain(off: dict[str, Any], on: dict[str, Any], runs: Runs | None = None) -> dict[str, Any]:
    kind = objective(on)
    row = {
        "ttft_speedup": _ratio(_p50(off.get("ttft_ms")), _p50(on.get("ttft_ms"))),
        "tpot_speedup": _ratio(_p50(off.get("tpot_ms")), _p50(on.get("tpot_ms"))),
        "e2e_speedup": _ratio(_p50(off.get("e2e_ms")), _p50(on.get("e2e_ms"))),
        "throughput_gain": _ratio(on.get("tokens_per_s"), off.get("tokens_per_s")),
        "objective": kind, "requests": [off.get("requests"), on.get("requests")],
    }
    row["gain"] = row["e2e_speedup"] if kind == "latency" else row["throughput_gain"]
    row["confidence"] = bootstrap(values_of(runs, off), values_of(runs, on), kind, point=row["gain"])
    row["ttft_same_prompts"] = same_prompt_ttft(values_of(runs, off), values_of(runs, on))
    return row


def curves(cells: list[dict[str, Any]], baseline: str | None, runs: Runs | None = None) -> list[dict[str, Any]]:
    """Per profile and non-baseline setting: its gain at each swept point, and the crossover (the confidence from
    the runs' `RunData`). A point where either run did not measure (too slow, failed, ...) is kept, with its
    statuses and no gain."""
    if baseline is None:
        return []
    swept = [c for c in cells if c.get("sweep")]
    out = []
    for profile in dict.fromkeys(c["profile"] for c in swept):
        mine = [c for c in swept if c["profile"] == profile]
        param = mine[0]["sweep"]["param"]
        offs = {point_key(c): c for c in mine if c["setting"] == baseline}
        for setting in dict.fromkeys(c["setting"] for c in mine if c["setting"] != baseline):
            points = []
            for on in sorted((c for c in mine if c["setting"] == setting), key=time_order):
                off = offs.get(point_key(on))
                if off is None:
                    continue
                at = {"value": point_of(on), **({"step": on["sweep"]["step"]}
                                                if on["sweep"].get("step") is not None else {})}
                if off.get("status") == "ok" and on.get("status") == "ok":
                    points.append({**at, **point_gain(off, on, runs)})
                else:
                    points.append({**at, "gain": None, "objective": objective(on),
                                   "status": {"baseline": off.get("status"), "setting": on.get("status")},
                                   "requests": [off.get("requests"), on.get("requests")], "confidence": None,
                                   "ttft_same_prompts": None,
                                   **{k: None for k in ("ttft_speedup", "tpot_speedup", "e2e_speedup",
                                                        "throughput_gain")}})
            # a ramp's crossover is read off its points by load (each load's first visit: the way up)
            by_load = list({p["value"]: p for p in reversed(points)}.values())
            out.append({"profile": profile, "setting": setting, "baseline": baseline, "param": param,
                        "points": points, "crossover": crossover(sorted(by_load, key=lambda p: p["value"]))})
    return out


def crossover(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The highest point where the gain is > 1, its confidence, and whether every point below it beats too."""
    beats = [p for p in points if p["gain"] is not None and p["gain"] > 1]
    if not points:
        return {"value": None, "note": "no point measured with the baseline"}
    if not beats:
        return {"value": None, "note": f"never beats the baseline (up to {points[-1]['value']:g})"}
    top = beats[-1]
    below = [p for p in points if p["value"] <= top["value"]]
    conf = top.get("confidence") or {}
    return {"value": top["value"], "gain": top["gain"], "p_gain_gt_1": conf.get("p_gain_gt_1"),
            "ci90": conf.get("ci90"), "beats_at_every_point_below": all(p in beats for p in below),
            "beyond_sweep": top is points[-1],
            "note": (f"still beats the baseline at the highest point swept ({top['value']:g}); the crossover "
                     "is beyond the sweep") if top is points[-1] else ""}
