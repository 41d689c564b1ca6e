"""The measurement check (`loadtest --cross-check`): the same request (one prompt, one user, no think
time) measured by Locust and by the independent asyncio+httpx client side by side, so both see the same
server load and CPU contention. Reported as ratios of medians (independent / Locust); how close they
must be is a benchmark's claim, not a test's (it depends on the machine)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from pathlib import Path
from typing import Any

from specbuild.loadtests import report as rep
from specbuild.loadtests.independent_client import compare_medians, measure
from specbuild.loadtests.runner import run_cell
from specbuild.loadtests.runspec import RunSpec


def cross_check(run_dir: Path, *, duration: float, stop_timeout: float, say) -> dict[str, Any]:
    """The measurement check: the same request (one prompt, one user, no think time) measured by Locust
    and by the independent asyncio+httpx client, back to back; ratios of medians (independent / Locust)."""
    spec = RunSpec.read(run_dir / "runspec.json")
    check_dir = run_dir / "crosscheck"
    (check_dir / "samples").mkdir(parents=True, exist_ok=True)
    check = dataclasses.replace(spec, label=f"{spec.label}-crosscheck", prompts=spec.prompts[:1],
                                prompt_tokens=spec.prompt_tokens[:1], wait_time=(0.0, 0.0),
                                samples_dir=str(check_dir / "samples"), run_dir=str(check_dir), protocol="http",
                                min_duration_s=duration, min_requests=1, max_duration_s=duration + 60)
    say(f"{spec.label}: cross-check, Locust and an independent asyncio+httpx client side by side "
        f"({duration:g} s, one user each)")
    try:
        # Side by side, so both see the same server load and CPU contention (back to back they would not).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(run_cell, check, profile=spec.label, setting="crosscheck", run_dir=check_dir,
                                 users=1, spawn_rate=1.0, stop_timeout=stop_timeout)
            time.sleep(min(2.0, duration / 4))   # Locust's start-up (imports, tokenizer) before both measure
            records = asyncio.run(measure(check, users=1, duration=duration - min(2.0, duration / 4)))
            cell = future.result()
        locust = rep.summarize_cell(cell, stream=spec.stream, users=1)
        p50 = lambda d: d["p50"] if d else None  # noqa: E731
        out = compare_medians(records, locust_ttft_p50=p50(locust["ttft_ms"]), locust_e2e_p50=p50(locust["e2e_ms"]))
        out.update(locust_requests=locust["requests"], locust_ttft_p50_ms=p50(locust["ttft_ms"]),
                   locust_e2e_p50_ms=p50(locust["e2e_ms"]),
                   locust_harness_overhead_p50_ms=p50(locust["harness"]["overhead_ms"]))
        return out
    except Exception as e:  # (httpx, Locust) the check must not lose the report of the load already run
        return {"error": f"{type(e).__name__}: {e}", "within_10pct": False}
