"""Run headless Locust for one profile x setting ("cell") in subprocesses, under a hard deadline.

Torch and tokenizer work stay out of the gevent loop: Locust runs in its own process(es); this
process only writes the run spec, starts `python -m locust ... --headless --csv ...` (or a master and
N workers), waits, and reads back the CSVs, the per-request samples and `stop.json` (why the run
ended: see `stopping.py`). A run that produced nothing is returned with `error` set, never raised, so
the caller keeps every other run. Ctrl-C is forwarded as SIGINT; Locust gets a few seconds to write
its CSVs, then is killed: the samples are written line by line as requests complete, so what was
measured is on disk either way, and the caller gets it within seconds even on a slow machine.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbuild.loadtests.runspec import ENV_VAR, SERVER_GONE_EXIT_CODE, STOP_FILE, RunSpec

log = logging.getLogger(__name__)
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
STARTUP_SLACK_S = 90.0        # Locust's start-up (imports, tokenizer) on a slow, busy machine
BACKSTOP_S = 15.0             # Locust's own -t: this long after the monitor's ceiling (it never should fire)
INTERRUPT_GRACE_S = 4.0       # after Ctrl-C: Locust's time to stop its users and write CSVs, then SIGKILL


@dataclass
class CellResult:
    """What one Locust run produced. `samples` are the per-request records of every Locust process."""

    profile: str
    setting: str
    run_dir: Path
    exit_code: int | None
    duration_s: float
    interrupted: bool = False
    timed_out: bool = False
    samples: list[dict[str, Any]] = field(default_factory=list)
    probes_ms: list[float] = field(default_factory=list)
    processes: list[dict[str, Any]] = field(default_factory=list)   # each Locust process: role, pid, cpu_s, wall_s
    locust_stats: dict[str, dict[str, Any]] = field(default_factory=dict)   # "E2E" -> CSV row
    log_tail: str = ""
    stop: dict[str, Any] = field(default_factory=dict)   # stop.json: reason, elapsed_s, completed, ...
    error: str | None = None                              # the run failed (nothing measured); why

    @property
    def server_gone(self) -> bool:
        return self.stop.get("reason") == "server gone" or self.exit_code == SERVER_GONE_EXIT_CODE


def locust_argv(spec: RunSpec, *, users: int, spawn_rate: float, duration: float, csv_prefix: Path,
                stop_timeout: float, role: str = "local", workers: int = 0, master_port: int = 5557) -> list[str]:
    base = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--loglevel", "WARNING"]
    if role == "worker":
        return base + ["--worker", "--master-host", "127.0.0.1", "--master-port", str(master_port)]
    argv = base + ["--headless", "-u", str(users), "-r", f"{spawn_rate:g}", "-t", f"{duration:g}s",
                   "--host", spec.url, "--csv", str(csv_prefix), "--only-summary",
                   "--stop-timeout", f"{stop_timeout:g}"]
    if role == "master":
        argv += ["--master", "--expect-workers", str(workers), "--master-bind-host", "127.0.0.1",
                 "--master-bind-port", str(master_port)]
    return argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cell(spec: RunSpec, *, profile: str, setting: str, run_dir: Path, users: int, spawn_rate: float,
             workers: int = 0, stop_timeout: float = 5.0, progress_bar: bool = False) -> CellResult:
    """One headless Locust run (local, or a master with `workers` worker processes); ends as
    `spec` says (stopping.py) or at the hard deadline. Never raises for a failed run: see `.error`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = spec.write(run_dir / "runspec.json")
    env = {**os.environ, ENV_VAR: str(spec_path), "PYTHONUNBUFFERED": "1"}
    csv_prefix = run_dir / "locust"
    port = _free_port() if workers else 0
    role = "master" if workers else "local"
    backstop = spec.max_duration_s + stop_timeout + BACKSTOP_S
    main_argv = locust_argv(spec, users=users, spawn_rate=spawn_rate, duration=backstop, csv_prefix=csv_prefix,
                            stop_timeout=stop_timeout, role=role, workers=workers, master_port=port)
    log.info("Running: %s", shlex.join(main_argv))
    logs = [run_dir / "locust.log"] + [run_dir / f"locust-worker{i}.log" for i in range(workers)]
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    interrupted = timed_out = False
    try:
        procs.append(_spawn(main_argv, env, logs[0]))
        for i in range(workers):
            w_argv = locust_argv(spec, users=users, spawn_rate=spawn_rate, duration=backstop,
                                 csv_prefix=csv_prefix, stop_timeout=stop_timeout, role="worker", master_port=port)
            procs.append(_spawn(w_argv, env, logs[i + 1]))
        deadline = t0 + backstop + STARTUP_SLACK_S
        try:
            bar = _bar(f"{profile} / {setting}", spec.min_duration_s) if progress_bar else None
            timed_out = not _wait(procs[0], deadline, bar)
        except KeyboardInterrupt:
            interrupted = True
            for p in procs:   # Locust handles SIGINT like the end of the run: CSVs and stats are written
                _signal(p, signal.SIGINT)
            _wait(procs[0], time.monotonic() + INTERRUPT_GRACE_S)   # then SIGKILL: the samples are on disk
    finally:
        for p in procs:
            _stop(p, patience=1.0 if interrupted else 10.0)
    result = CellResult(profile=profile, setting=setting, run_dir=run_dir, exit_code=procs[0].returncode,
                        duration_s=time.monotonic() - t0, interrupted=interrupted, timed_out=timed_out,
                        log_tail=_tail(logs[0]))
    _collect(result, Path(spec.samples_dir), csv_prefix)
    # Nothing completed but the stop rule ended the run at its ceiling: the setting is too slow to measure
    # here (reported as such with what was seen), not a failure of the harness.
    too_slow = result.stop.get("reason") == "too slow to measure here"
    if not interrupted and not too_slow and not result.locust_stats and not result.samples:
        result.error = (f"Locust produced no results for {profile}/{setting} (exit {result.exit_code}"
                        f"{', killed at the hard deadline' if timed_out else ''}); its log ends with:\n"
                        f"{result.log_tail}")
    return result


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as f:   # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _bar(label: str, duration: float):
    from tqdm import tqdm

    return tqdm(total=round(duration), desc=label, unit="s", leave=False, file=sys.stderr, mininterval=1.0,
                bar_format="{desc}: {bar} {n_fmt}/{total_fmt} s")


def _wait(proc: subprocess.Popen, deadline: float, bar=None) -> bool:
    """Wait until `proc` exits or the deadline passes (then SIGKILL it); True if it exited by itself."""
    start = time.monotonic()
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return True
            if bar is not None and (done := min(bar.total, int(time.monotonic() - start))) > bar.n:
                bar.update(done - bar.n)
            time.sleep(0.1)
        _signal(proc, signal.SIGKILL)
        proc.wait(timeout=10)
        return False
    finally:
        if bar is not None:
            bar.close()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _stop(proc: subprocess.Popen, patience: float = 10.0) -> None:
    """Workers exit when their master quits; anything still alive gets SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        try:
            proc.wait(timeout=patience)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=5)


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _collect(result: CellResult, samples_dir: Path, csv_prefix: Path) -> None:
    for path in sorted(samples_dir.glob("process-*.json")):
        try:
            result.processes.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    order = {"local": 0, "master": 1, "worker": 2}
    result.processes.sort(key=lambda p: (order.get(p.get("role"), 3), p.get("pid", 0)))
    for path in sorted(samples_dir.glob("samples-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue   # a line cut by a kill
            if rec.get("kind") == "probe":
                result.probes_ms.append(rec["ms"])
            elif rec.get("kind") == "request":
                result.samples.append(rec)
    stop = result.run_dir / STOP_FILE
    if stop.is_file():
        try:
            result.stop = json.loads(stop.read_text())
        except ValueError:
            pass
    stats = Path(f"{csv_prefix}_stats.csv")
    if stats.is_file():
        with open(stats, newline="") as f:
            for row in csv.DictReader(f):
                if row.get("Name") != "Aggregated":
                    result.locust_stats[row["Type"]] = row
