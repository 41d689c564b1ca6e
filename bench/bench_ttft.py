"""TTFT with users who think between requests: a newcomer admitted between the verify's pieces, or not.

On the bench engine (bench_engine's recipe: the int4 self-draft, the build's cut-off), served by the engine's
own serving thread (`Engine.start` + `submit`, as bench_served). U users (1, 2, 4), each thinks uniform(0,
--think) s (seeded by run and user) before each of --per-user chat prompts of --tokens tokens, so requests
arrive at any point of a step (bench_served's closed-loop users submit as a step ends). Cells: speculation off
and the policy (no K sent), each with the admission between the verify's pieces (`scheduler._admit_arrivals`)
and without it (patched out: what the engine did before), round-robin over --runs runs; medians of TTFT p50 /
mean and e2e p50, and the off ÷ policy ratios within each run. Writes --out (JSON) and prints a table.

    .venv/bin/python bench/bench_ttft.py --runs 3 --out bench/results/ttft.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import specbuild  # noqa: F401  (before torch: it sets torch's OpenMP wait policy, ./__init__.py)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import engine_dir, log  # noqa: E402
from bench_served import chat_ids, one_request  # noqa: E402

from specbuild.core.machine import describe  # noqa: E402
from specbuild.core.paths import cache_dir  # noqa: E402
from specbuild.engines.embedded import Engine, SamplingParams  # noqa: E402
from specbuild.engines.embedded.scheduler import Scheduler  # noqa: E402

USERS = (1, 2, 4)
MODES = (("off", 0), ("policy", None))


def cell(engine, prompts, params, *, users: int, per_user: int, think: float, k, seed: int) -> dict:
    results, lock = [], threading.Lock()

    def user(i: int) -> None:
        rng = random.Random(1000 * seed + i)
        time.sleep(rng.uniform(0, think))
        for j in range(per_user):
            r = one_request(engine, prompts[(i * per_user + j) % len(prompts)], params, k)
            with lock:
                results.append(r)
            time.sleep(rng.uniform(0, think))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ttft = [r["ttft"] * 1000 for r in results]
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_mean_ms": statistics.fmean(ttft),
            "e2e_p50_ms": statistics.median(r["e2e"] * 1000 for r in results), "requests": len(results)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/ttft.json", help="JSON output (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs, round-robin over every cell (default 3)")
    ap.add_argument("--per-user", type=int, default=8, help="requests per user and cell (default 8)")
    ap.add_argument("--think", type=float, default=0.6, help="a user's longest think time, s (default 0.6)")
    ap.add_argument("--tokens", type=int, default=48, help="output tokens per request (default 48)")
    ap.add_argument("--workdir", default=None, help="build workspace (default: $SPECBUILD_CACHE/bench-work)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.per_user < 1 or args.think < 0:
        ap.error("--runs and --per-user must be >= 1 and --think >= 0")
    engine = Engine.from_build_dir(engine_dir(Path(args.workdir) if args.workdir else cache_dir() / "bench-work"))
    engine.start()
    prompts = chat_ids(engine.tokenizer)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    for p in prompts[:2]:                                                  # warm-up
        one_request(engine, p, params, None)
    between = Scheduler._admit_arrivals
    raw: dict[str, list[dict]] = {}
    try:
        for run in range(args.runs):
            for users in USERS:
                for pieces in (True, False):
                    Scheduler._admit_arrivals = between if pieces else (lambda self, spent: None)
                    for mode, k in MODES:
                        r = cell(engine, prompts, params, users=users, per_user=args.per_user, think=args.think,
                                 k=k, seed=run)
                        raw.setdefault(f"{users}/{'pieces' if pieces else 'whole'}/{mode}", []).append(r)
                        log(f"run {run + 1}/{args.runs} users {users} {'pieces' if pieces else 'whole'} {mode}: "
                            f"TTFT p50 {r['ttft_p50_ms']:.1f} ms")
    finally:
        Scheduler._admit_arrivals = between
        engine.shutdown()
    rows = []
    for users in USERS:
        for how in ("whole", "pieces"):
            off, pol = raw[f"{users}/{how}/off"], raw[f"{users}/{how}/policy"]
            med = {m: {k: round(statistics.median(r[k] for r in rs), 1) for k in rs[0]}
                   for m, rs in (("off", off), ("policy", pol))}
            ratio = {k: round(statistics.median(o[k] / p[k] for o, p in zip(off, pol)), 3)
                     for k in ("ttft_p50_ms", "ttft_mean_ms", "e2e_p50_ms")}
            rows.append({"users": users, "admission": how, **med, "off_over_policy": ratio})
    print("| users | admission | TTFT p50 off / policy ms | TTFT p50 off ÷ policy | mean off ÷ policy "
          "| e2e off ÷ policy |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        q = r["off_over_policy"]
        print(f"| {r['users']} | {r['admission']} | {r['off']['ttft_p50_ms']} / {r['policy']['ttft_p50_ms']} | "
              f"{q['ttft_p50_ms']:.2f}x | {q['ttft_mean_ms']:.2f}x | {q['e2e_p50_ms']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"machine": describe(), "runs": args.runs, "per_user": args.per_user,
                               "think_s": args.think, "tokens": args.tokens, "rows": rows, "raw": raw}, indent=1))
    tmp.replace(out)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
