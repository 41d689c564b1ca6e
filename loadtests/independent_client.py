"""A minimal independent client (asyncio + httpx) that measures the same kind of requests as the Locust
user, to check the harness: same prompts, payload, concurrency, think time and duration; TTFT = first
non-empty streamed piece, e2e = end of the stream (or of the /generate body). Same wire format
(`specbuild.core.wire`: KServe or OpenAI), another transport and event loop.

    python -m specbuild.loadtests.independent_client RUNSPEC.json --users 4 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx

from specbuild.loadtests.runspec import RunSpec
from specbuild.core import wire


async def _one(client: httpx.AsyncClient, spec: RunSpec, prompt: str) -> dict[str, Any]:
    path, body = wire.encode(spec.api, prompt, spec.payload, model=spec.model, stream=spec.stream)
    url = spec.url.rstrip("/") + path
    t0 = time.perf_counter()
    ttft = None
    if not spec.stream:
        resp = await client.post(url, json=body)
        e2e = (time.perf_counter() - t0) * 1000
        ok = resp.status_code == 200 and not wire.parse_body(spec.api, resp.content).error
        return {"ok": ok, "ttft_ms": None, "e2e_ms": e2e}
    lines = wire.LineBuffer()
    async with client.stream("POST", url, json=body) as resp:
        ok = resp.status_code == 200
        async for chunk in resp.aiter_raw():
            now = time.perf_counter()   # arrival time, taken before any parsing
            for line in lines.feed(chunk):
                event = wire.parse_line(spec.api, line)
                if event is None:
                    continue
                if event.error:
                    ok = False
                elif ttft is None and event.text:
                    ttft = (now - t0) * 1000
    return {"ok": ok, "ttft_ms": ttft, "e2e_ms": (time.perf_counter() - t0) * 1000}


async def _user(client, spec: RunSpec, rng: random.Random, deadline: float, out: list) -> None:
    while time.monotonic() < deadline:
        out.append(await _one(client, spec, rng.choice(spec.prompts)))
        lo, hi = spec.wait_time
        if hi > 0:
            await asyncio.sleep(rng.uniform(lo, hi))


async def measure(spec: RunSpec, *, users: int, duration: float) -> list[dict[str, Any]]:
    """Closed loop: `users` concurrent clients for `duration` seconds (requests in flight finish)."""
    out: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(timeout=spec.request_timeout_s, limits=limits) as client:
        deadline = time.monotonic() + duration
        await asyncio.gather(*(_user(client, spec, random.Random(f"indep-{spec.seed}-{i}"), deadline, out)
                               for i in range(users)))
    return out


def medians(records: list[dict[str, Any]]) -> dict[str, float | None]:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    return {"requests": len(ok), "ttft_p50_ms": statistics.median(ttft) if ttft else None,
            "e2e_p50_ms": statistics.median([r["e2e_ms"] for r in ok]) if ok else None}


def compare_medians(records: list[dict[str, Any]], *, locust_ttft_p50: float | None,
                    locust_e2e_p50: float | None) -> dict[str, Any]:
    """This client's medians next to Locust's: ratios independent / Locust, and whether both are within 10%."""
    m: dict[str, Any] = medians(records)
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    m["ttft_ratio"] = ratio(m["ttft_p50_ms"], locust_ttft_p50)
    m["e2e_ratio"] = ratio(m["e2e_p50_ms"], locust_e2e_p50)
    within = [abs(r - 1) <= 0.10 for r in (m["ttft_ratio"], m["e2e_ratio"]) if r is not None]
    m["within_10pct"] = bool(within) and all(within)
    return m


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="run spec JSON written by `specbuild loadtest` "
                                 "(<out>/runs/<profile>/<setting>/runspec.json)")
    ap.add_argument("--users", type=int, default=1)
    ap.add_argument("--duration", type=float, default=10.0)
    args = ap.parse_args(argv)
    print(json.dumps(medians(asyncio.run(measure(RunSpec.read(args.spec), users=args.users,
                                                  duration=args.duration))), indent=2))


if __name__ == "__main__":  # pragma: no cover
    main()
