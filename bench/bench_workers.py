"""Does Locust's distributed mode measure what one process measures? `specbuild loadtest` at one load, one Locust
process vs a master with --workers N, interleaved round by round against one server (the demo deployment); the
median over rounds of TTFT, TPOT and e2e (p50 each) and tok/s, their ratios (workers / one process) and whether each
is within --tolerance. Writes bench/results/workers.json and prints a table.

    python bench/bench_workers.py --workdir specbuild-work --rounds 3 --users 4 --duration 30

Starts `specbuild serve --background` in --workdir (and stops it) unless a server is already running there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from specbuild.core import machine  # noqa: E402
from specbuild.core.manifest import atomic_write_text  # noqa: E402

SB = [sys.executable, "-m", "specbuild.cli.main"]
METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "tokens_per_s")


def one_run(args, workers: int, out: Path) -> dict:
    cmd = [*SB, "loadtest", "--workdir", str(args.workdir), "--profile", args.profile, "--users", str(args.users),
           "--duration", str(args.duration), "--min-requests", str(args.min_requests), "--workers", str(workers),
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration * 8 + 300)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    cell = json.loads((out / "report.json").read_text())["cells"][0]
    row = {m: (cell[m] or {}).get("p50") if m != "tokens_per_s" else cell[m] for m in METRICS}
    row.update(requests=cell["requests"], client_cpu=cell.get("client_cpu"))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("specbuild-work"))
    ap.add_argument("--profile", default="chat")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--min-requests", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "workers.json")
    args = ap.parse_args(argv)
    status = subprocess.run([*SB, "status", "--workdir", str(args.workdir)], capture_output=True, text=True)
    started = status.returncode != 0
    if started:
        subprocess.run([*SB, "serve", "--workdir", str(args.workdir), "--background"], check=True)
    rows: dict[str, list[dict]] = {"one process": [], f"{args.workers} workers": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                order = [0, args.workers] if i % 2 == 0 else [args.workers, 0]   # alternate who goes first
                for w in order:
                    key = "one process" if w == 0 else f"{args.workers} workers"
                    rows[key].append(one_run(args, w, Path(tmp) / f"r{i}-w{w}"))
                    print(f"round {i + 1}/{args.rounds} {key}: {rows[key][-1]}", file=sys.stderr)
    finally:
        if started:
            subprocess.run([*SB, "stop", "--workdir", str(args.workdir)], check=False)
    one, many = rows["one process"], rows[f"{args.workers} workers"]
    med = {k: {m: statistics.median(r[m] for r in v if r[m] is not None) for m in METRICS} for k, v in rows.items()}
    ratios = {m: round(med[f"{args.workers} workers"][m] / med["one process"][m], 4) for m in METRICS}
    report = {"machine": machine.describe(), "profile": args.profile, "users": args.users, "rounds": args.rounds,
              "duration_s": args.duration, "workers": args.workers, "median_p50": med, "ratio": ratios,
              "within_tolerance": {m: abs(r - 1) <= args.tolerance for m, r in ratios.items()},
              "tolerance": args.tolerance, "runs": {"one process": one, f"{args.workers} workers": many}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=1, default=str) + "\n")
    print(f"| metric (median of {args.rounds} runs' p50) | one process | {args.workers} workers | ratio |")
    print("|---|---|---|---|")
    for m in METRICS:
        print(f"| {m} | {med['one process'][m]:.1f} | {med[f'{args.workers} workers'][m]:.1f} | {ratios[m]:.3f} |")
    print(f"wrote {args.out}")
    return 0 if all(report["within_tolerance"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
