"""`loadtest`: headless Locust per profile x setting against a running deployment, one report.

    from specbuild.pipeline.loadtest import LoadtestConfig, loadtest
    report = loadtest(LoadtestConfig(profiles=("chat", "batch"), compare="num_draft_tokens=0,4",
                                     url="http://127.0.0.1:8000", tokenizer="work/engines/tokenizer",
                                     sweep=("users=1,2,4,8",)))

Targets (`api`): Triton's KServe generate extension (HTTP or gRPC), or any OpenAI-compatible server
(`openai-completions`, `openai-chat`: vLLM, SGLang, trtllm-serve, llama.cpp's server); a setting may name
its own endpoint (`url=`, `metrics_url=`, `grpc_url=`), e.g. speculation on at one server and off at
another. A sweep (`loadtests/sweep.py`) runs every setting at every load point, each point one ordinary run.

One skeleton, shared with `tune`: `open_session` (tokenizer, pre-flight: server up, model there, every
parameter sent declared; all before any load), `smoke` (one real request per setting, before any load),
then `run_setting` per profile x setting, the one path that measures a setting: Triton metrics before,
Locust (subprocesses) until BOTH the profile's duration has passed and `min_requests` requests
completed (hard ceiling: `Profile.ceiling`, then "too slow to measure here"), metrics after, the run's
summary. A run that fails is recorded and the others kept; after a run whose server died, the
remaining runs are not started. The report (report.json/md, summary.csv, GenAI-Perf-style
profile_export_genai_perf.json, plots) is always written with what was measured, whatever happened,
and the directory is renamed into place at the end. Ctrl-C stops the run within seconds and still
writes the report (status "interrupted", exit 130); a dead server exits 4, a failed run 1, an SLO
gate 3; "too slow to measure here" is a result (exit 0), said in the report.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from specbuild.loadtests import ramp, stalls
from specbuild.loadtests.profiles import load_profiles
from specbuild.loadtests.report import overall_status  # noqa: F401  (public API)
from specbuild.loadtests.rundata import RunData, Runs, run_key
from specbuild.loadtests import session as _session
from specbuild.loadtests.session import (OPTIONAL_INPUTS, Session, default_metrics_url,  # noqa: F401 (API)
                                        input_budget, served_names, _payload, smoke)
from specbuild.pipeline.deployment import deployment, deployment_max_seq_len, resolve_tokenizer  # noqa: F401
from specbuild.loadtests.settings import parse_compare, parse_settings  # noqa: F401  (public API)
from specbuild.loadtests.sweep import ENDPOINT_FIELDS, Run, first_at, plan, sweep_summary
from specbuild.core import machine, wire
from specbuild.core.constants import ADMIN_KEY, ADMIN_TOKEN_ENV
from specbuild.core.contract import SPECULATIVE_MODEL, ENSEMBLE_MODEL
from specbuild.core.errors import SpecbuildError, UsageError
from specbuild.core.manifest import Manifest, read_manifest, stage_output, write_manifest

log = logging.getLogger(__name__)
PROTOCOLS = ("http", "grpc")
LENGTHS = ("profile", "data")


class LoadtestInterrupted(SpecbuildError):
    """Ctrl-C during a load test; the partial report was written."""

    exit_code = 130


class GatesFailed(SpecbuildError):
    """An SLO gate failed; the report was written."""

    exit_code = 3


class ServerGone(SpecbuildError):
    """The server stopped answering during a run; the report of what was measured was written."""

    exit_code = 4


class RunsFailed(SpecbuildError):
    """A run produced no results (Locust failed); the other runs and the report were kept."""


@dataclass(frozen=True)
class LoadtestConfig:
    profiles: tuple[str, ...] = ("chat",)
    url: str = "http://127.0.0.1:8000"
    grpc_url: str | None = None            # default: the --url host, port 8001
    metrics_url: str | None = None         # default: the --url host, port 8002; "" = do not scrape
    model: str | None = None               # default: tensorrt_llm_bls when comparing num_draft_tokens, else ensemble
    protocol: str = "http"
    compare: str | None = None             # "num_draft_tokens=0,4": one run per value, the first is the baseline
    settings: tuple[str, ...] = ()         # named settings "off:num_draft_tokens=0", "ngram:num_draft_tokens=4,proposer=ngram"
    tokenizer: str | None = None           # default: the deployment's, found through --workdir
    workdir: Path = Path("specbuild-work")
    out: Path = Path("report")
    users: int | None = None
    duration: float | None = None          # seconds of load per run, at least (see min_requests)
    min_requests: int | None = None        # a run goes on until this many requests completed (profile's)
    max_duration: float | None = None      # ...up to this hard ceiling, then "too slow to measure here"
    max_tokens: int | None = None
    max_input_tokens: int | None = None
    max_p95_ttft_ms: float | None = None
    max_p95_tpot_ms: float | None = None
    max_error_rate: float | None = None
    workers: int = 0
    cross_check: bool = False
    stop_timeout: float = 5.0              # seconds in-flight requests may take to finish at the end of a run
    seed: int = 0
    progress_bar: bool = False             # a tqdm bar on stderr while each run is under load
    extra: dict[str, Any] = field(default_factory=dict)   # more request fields sent with every request
    api: str = wire.KSERVE                 # wire.APIS: kserve | openai-completions | openai-chat
    sweep: tuple[str, ...] = ()            # "users=1,2,4,8", "request_rate=0.5,1", "batch:users=8,16,32"
    ramp: bool = False                     # the sweep's values up, then back down, in time order
    request_rate: float | None = None      # open loop, requests/s (Poisson) for every profile
    prompts: Path | None = None            # users' own prompts (jsonl / ShareGPT; loadtests/datasets.py)
    prompts_format: str = "auto"
    lengths: str = "profile"               # profile: its max_tokens / max_input_tokens; data: the file's

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise UsageError(f"--protocol {self.protocol!r} is not supported; choose one of {PROTOCOLS}.")
        if self.api not in wire.APIS:
            raise UsageError(f"--api {self.api!r}: choose one of {wire.APIS}.")
        if self.api != wire.KSERVE and self.protocol != "http":
            raise UsageError(f"--api {self.api} is HTTP only; drop --protocol {self.protocol}.")
        if self.lengths not in LENGTHS:
            raise UsageError(f"--lengths {self.lengths!r}: choose one of {LENGTHS}.")
        if self.lengths == "data" and self.prompts is None:
            raise UsageError("--lengths data takes the lengths from a prompt file: pass --prompts FILE too.")
        if self.request_rate is not None and self.request_rate <= 0:
            raise UsageError(f"--request-rate {self.request_rate} must be > 0 requests per second.")
        if not self.profiles:
            raise UsageError("no profile given; pass --profile chat and/or --profile batch.")
        if self.workers < 0:
            raise UsageError(f"--workers {self.workers} must be >= 0 (0 = one local Locust process).")
        if self.max_error_rate is not None and not 0 <= self.max_error_rate <= 1:
            raise UsageError(f"--max-error-rate {self.max_error_rate} must be a fraction in [0, 1] (0.01 = 1%).")
        for name in ("users", "duration", "min_requests", "max_duration", "max_tokens", "max_input_tokens",
                     "max_p95_ttft_ms", "max_p95_tpot_ms"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {v}.")
        if self.stop_timeout < 0:
            raise UsageError(f"--stop-timeout {self.stop_timeout} must be >= 0 seconds.")
        if not urlsplit(self.url).hostname:
            raise UsageError(f"--url {self.url!r} is not a URL; e.g. http://127.0.0.1:8000.")


def run_setting(session: Session, profile, setting: str, fields: dict[str, Any], run_dir: Path,
                say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """`measure_setting`'s summary alone (what `tune` scores)."""
    return measure_setting(session, profile, setting, fields, run_dir, say)[0]


def measure_setting(session: Session, profile, setting: str, fields: dict[str, Any], run_dir: Path,
                    say: Callable[[str], None] = lambda m: None) -> tuple[dict[str, Any], RunData]:
    """Measure one setting under one profile: the one path `loadtest` and `tune` share.

    Writes `run_dir/` (runspec, Locust CSVs and logs, samples, stop.json, summary.json,
    profile_export_genai_perf.json, profile_export_aiperf.{json,csv}, profile_export.jsonl) and returns the
    run's summary (a report cell; `status` says how it ended) and its RunData (the per-request values and
    the exports, which the report's plots, sweep confidence and export files read). Never raises for a failed
    run; Ctrl-C ends the run within seconds with status "interrupted".
    """
    from specbuild.loadtests import report as rep, target
    from specbuild.loadtests.runner import run_cell

    spec, users = _run_spec(session, profile, fields, run_dir)
    idle, left = target.wait_idle(session.metrics_url, timeout=profile.ceiling)
    if not idle:
        say(f"{profile.name} / {setting}: {left:g} requests of the previous run still in flight after "
            f"{profile.ceiling:g} s; measuring anyway (the run starts on a busy server)")
    before = target.scrape(session.metrics_url)
    after = None
    open_loop = profile.request_rate is not None
    load = (f"{profile.request_rate:g} requests/s (open loop)" if open_loop else f"{profile.users} users")
    say(f"{profile.name} / {setting}: {load}, {profile.duration:g} s and >= {profile.min_requests} "
        f"requests (ceiling {profile.ceiling:g} s; {'streaming' if profile.stream else 'non-streaming'}, "
        f"max_tokens {profile.max_tokens})")
    cpu0 = _children_cpu()
    cell = run_cell(spec, profile=profile.name, setting=setting, run_dir=run_dir, users=users,
                    spawn_rate=_spawn_rate(profile, users),
                    workers=session.workers, stop_timeout=session.stop_timeout, progress_bar=session.progress_bar)
    client_cpu_s = _children_cpu() - cpu0
    after = None if cell.interrupted else target.scrape(session.metrics_url)
    deltas = target.metric_deltas(before, after)
    summary, data = rep.measure_cell(cell, stream=profile.stream, users=profile.users, gates=session.gates,
                                 metrics=target.spec_summary(deltas),
                                 input_config={"url": session.url, "model": session.model, "api": session.api,
                                               "protocol": session.protocol, "request_fields": spec.payload,
                                               "request_rate": profile.request_rate})
    summary["server_metrics_delta"] = target.model_deltas(deltas, session.model)
    summary["server_state"] = ramp.server_state(after)
    summary["client_cpu"] = {"cpu_s": round(client_cpu_s, 3),
                             "cores": round(client_cpu_s / cell.duration_s, 3) if cell.duration_s else None,
                             "by_process": [{**p, "cores": round(p["cpu_s"] / cell.duration_s, 3)
                                             if cell.duration_s else None} for p in cell.processes],
                             "note": "user + system CPU of the load generator's processes over the run's wall "
                                     "time; by_process: each Locust process's own (a worker near 1.0 core is "
                                     "client-bound: add --workers)"}
    summary["endpoint"] = {"api": session.api, "url": session.url, "model": session.model,
                           "metrics_url": session.metrics_url}
    if open_loop:
        summary["request_rate"] = profile.request_rate
    if not idle:
        summary["started_with_in_flight"] = left
    summary["run_dir"] = str(run_dir)
    _write_run_files(run_dir, summary, data, cell.samples, profile.stream)
    stalled = stalls.describe(summary)
    if stalled:
        say(stalled)
    if summary["status"] != "ok":
        stop = cell.stop or {}
        say(f"{profile.name} / {setting}: {summary['status']} ({summary['requests']} completed, "
            f"{summary['failures']} failed in {cell.duration_s:.0f} s)"
            + (f": {stop.get('server_gone')}" if stop.get("server_gone") else ""))
    return summary, data


def _run_spec(session: Session, profile, fields: dict[str, Any], run_dir: Path):
    """The run spec the Locust processes read, and how many Locust users it takes (an open loop: one sender
    per process)."""
    from specbuild.loadtests.runspec import RunSpec

    (run_dir / "samples").mkdir(parents=True, exist_ok=True)
    prompts, counts = session.prompts(profile)
    payload = session.payload(profile, fields)
    users = max(1, session.workers) if profile.request_rate is not None else profile.users
    types = wire.datatypes({"text_input": "", **payload}, target=session.target, model=session.model) \
        if session.protocol == "grpc" else {}
    spec = RunSpec(label=profile.name, protocol=session.protocol, url=session.url, grpc_url=session.grpc_url,
                   model=session.model, stream=profile.stream, payload=payload,
                   prompts=prompts, prompt_tokens=counts, tokenizer=str(session.counter.path),
                   samples_dir=str(run_dir / "samples"), run_dir=str(run_dir), wait_time=profile.wait_time,
                   seed=session.seed, gates=session.gates, grpc_batch_dim=session.info.batch_dim,
                   min_duration_s=profile.duration, min_requests=profile.min_requests,
                   max_duration_s=profile.ceiling, api=session.api, datatypes=types,
                   prompt_output_tokens=session.output_tokens(profile), request_rate=profile.request_rate,
                   open_loop_users=users)
    return spec, users


def _spawn_rate(profile, users: int) -> float:
    """Users started per second: an open loop's senders all at once, a closed loop's at the profile's rate."""
    return float(users) if profile.request_rate is not None else profile.effective_spawn_rate


def _write_run_files(run_dir: Path, summary: dict[str, Any], data: RunData, samples: list, stream: bool) -> None:
    """One run's own files: GenAI-Perf's and AIPerf's exports, and summary.json."""
    from specbuild.loadtests.export import AIPERF_CSV, AIPERF_JSON, AIPERF_JSONL, aiperf_csv, aiperf_records

    (run_dir / "profile_export_genai_perf.json").write_text(json.dumps(data.genai_perf, indent=2) + "\n")
    (run_dir / AIPERF_JSON).write_text(json.dumps(data.aiperf, indent=2) + "\n")
    (run_dir / AIPERF_CSV).write_text(aiperf_csv(data.aiperf))
    (run_dir / AIPERF_JSONL).write_text(aiperf_records(samples, stream=stream))
    kept = {k: v for k, v in summary.items() if k != "run_dir"}
    (run_dir / "summary.json").write_text(json.dumps(kept, indent=2, default=str) + "\n")


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far: the Locust processes."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def loadtest(cfg: LoadtestConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every profile x (sweep point x) setting and write `<out>/report.{json,md}`, summary.csv,
    profile_export_genai_perf.json, profile_export_aiperf.{json,csv} and plots. Returns the report dict.

    Raises (after writing the report) GatesFailed when an SLO gate fails, ServerGone when the server
    died, RunsFailed when a run produced nothing, LoadtestInterrupted on Ctrl-C.
    """
    say = progress or (lambda msg: log.info(msg))
    runs, sessions, report = _prepare(cfg, say)
    measured: dict[str, RunData] = {}       # run_key(cell) -> its RunData, beside report["cells"]
    out_dir = Path(cfg.out)
    interrupted, error = False, None
    # 3. the load, into a temporary directory renamed into place at the end, whatever happened
    with stage_output(out_dir) as tmp:
        try:
            interrupted = _measure(cfg, runs, sessions, report, measured, tmp, say)
        except KeyboardInterrupt:
            interrupted = True
        except Exception as e:  # noqa: BLE001  (recorded; the report of what was measured is still written)
            error = f"{type(e).__name__}: {e}"
            log.exception("load test aborted")
        _finish_report(report, measured, interrupted, error)
        paths = _write_report(tmp, report, measured)
        write_manifest(tmp, Manifest(stage="loadtest", inputs={"url": cfg.url, "model": report["model"]},
                                     options={k: str(v) for k, v in cfg.__dict__.items()},
                                     outputs={k: p.name for k, p in paths.items()}))
    say(f"report: {out_dir / 'report.md'}")
    _raise_for(report, out_dir)
    return report


def loadtest_in_cluster(cfg: LoadtestConfig, progress: Callable[[str], None] | None = None) -> Path:
    """`loadtest --kubernetes`: what `loadtest` checks before any load (the pre-flight at `cfg.url`, e.g. a
    `kubectl port-forward` of the server's Service; one smoke request per run), then, instead of the load, Locust
    master + workers manifests of every planned run under `cfg.out` (`pipeline/k8s_locust.py`), for the deployment
    `deploy --kubernetes` rendered in `cfg.workdir` (its name, namespace, image and artefacts). Returns `cfg.out`."""
    import dataclasses
    import tempfile

    from specbuild.pipeline import k8s_locust
    from specbuild.pipeline.k8s_objects import selector

    say = progress or (lambda msg: log.info(msg))
    workdir = Path(cfg.workdir).resolve()
    try:
        o = read_manifest(workdir / "kubernetes", "kubernetes")["options"]
    except SpecbuildError as e:
        raise UsageError(f"{e} The load test inside the cluster runs against the Service of `specbuild deploy "
                         f"--kubernetes --workdir {cfg.workdir} ...`, from its image and artefacts: render that "
                         "first.") from None
    if cfg.cross_check:
        raise UsageError("--cross-check measures beside a local run; drop it with --kubernetes.")
    cfg = dataclasses.replace(cfg, workers=cfg.workers or 2)
    runs, sessions, _report = _prepare(cfg, say)
    if any(r.endpoint != (None, None, None) for r in runs):
        raise UsageError("a --setting with its own url= / grpc_url= / metrics_url= names a server outside the "
                         "cluster's Service; drop it with --kubernetes.")
    docs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="specbuild-k8s-loadtest-") as scratch:
        for run in runs:
            session = sessions[run.endpoint]
            spec, users = _run_spec(session, run.profile, run.fields, run.run_dir(Path(scratch)))
            docs[k8s_locust.run_name(run.key)] = k8s_locust.render(
                spec, users=users, spawn_rate=_spawn_rate(run.profile, users),
                workers=cfg.workers, stop_timeout=cfg.stop_timeout, key=run.key, workdir=workdir, name=o["name"],
                namespace=o["namespace"], image=o["image"], artifacts=o["artifacts"],
                artifacts_secret=o.get("artifacts_secret"), server_selector=selector(o["name"]),
                backend=o.get("backend") or "embedded")
    if len(docs) != len(runs):
        raise UsageError("two runs share a Kubernetes name; give the settings names that differ in letters or digits.")
    out = k8s_locust.write(Path(cfg.out), docs)
    say(f"{len(docs)} run(s) x (1 Locust master + {cfg.workers} workers) for the cluster: {out} "
        f"(how to run and read them: {out / 'README.txt'})")
    return out


def _write_report(tmp: Path, report: dict[str, Any], measured: Runs | None = None) -> dict[str, Path]:
    """The report files; if rendering them fails, report.json alone (with the error) and the run directories
    are kept: what was measured is never lost to a report bug."""
    from specbuild.loadtests import report as rep

    try:
        return rep.write_report(tmp, report, measured)
    except Exception as e:  # noqa: BLE001
        log.exception("writing the report failed")
        report["status"], report["error"] = "error", f"writing the report failed ({type(e).__name__}: {e})"
        path = tmp / "report.json"
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        return {"json": path}


def _prepare(cfg: LoadtestConfig, say) -> tuple[list[Run], dict, dict[str, Any]]:
    """Everything before the load: profiles, settings, the plan; the server(s) pre-flighted; one smoke request
    per run's exact fields. Raises UsageError / ServerError before any load."""
    from specbuild.loadtests.runspec import Gates

    # 1. everything that can be checked without the server
    profiles = load_profiles(cfg.profiles, users=cfg.users, duration=cfg.duration, max_tokens=cfg.max_tokens,
                             max_input_tokens=cfg.max_input_tokens, min_requests=cfg.min_requests,
                             max_duration=cfg.max_duration, request_rate=cfg.request_rate)
    param, values = parse_compare(cfg.compare)
    settings = parse_settings(cfg.settings)
    if settings and param:
        raise UsageError("use either --compare or --setting, not both.")
    setting_fields = sorted({k for _, fields in settings for k in fields if k not in ENDPOINT_FIELDS})
    speculative = param == "num_draft_tokens" or "num_draft_tokens" in setting_fields
    model = cfg.model if cfg.api != wire.KSERVE else cfg.model or (SPECULATIVE_MODEL if speculative
                                                                   else ENSEMBLE_MODEL)
    gates = Gates(max_p95_ttft_ms=cfg.max_p95_ttft_ms, max_p95_tpot_ms=cfg.max_p95_tpot_ms,
                  max_error_rate=cfg.max_error_rate)
    named = settings or [(f"{param}={v}" if param else "default", {param: v} if param else {}) for v in values]
    runs = plan(profiles, named, cfg.sweep, cfg.extra, ramp=cfg.ramp)
    # 2. the server(s): up, model there, every parameter we send declared; one smoke request per run
    session = open_session(url=cfg.url, model=model, tokenizer=cfg.tokenizer, workdir=Path(cfg.workdir),
                           inputs=([param] if param else []) + setting_fields + list(cfg.extra),
                           protocol=cfg.protocol, grpc_url=cfg.grpc_url, metrics_url=cfg.metrics_url, gates=gates,
                           workers=cfg.workers, stop_timeout=cfg.stop_timeout, seed=cfg.seed,
                           progress_bar=cfg.progress_bar, api=cfg.api, records=_records(cfg), lengths=cfg.lengths)
    sessions = {r.endpoint: None for r in runs}
    for endpoint in sessions:
        sessions[endpoint] = session.for_endpoint(*endpoint)
        if sessions[endpoint] is not session and cfg.api == wire.KSERVE:
            from specbuild.loadtests import target

            target.check_inputs(sessions[endpoint].info,
                                served_names(session.target, ["text_input", "max_tokens", *setting_fields]))
    for profile in profiles:
        session.prompts(profile)
    for r in runs:   # once per profile x setting: a sweep point changes the load, not the request
        if r is first_at(runs, r):
            say(f"{r.profile.name}/{r.setting}: smoke request")
            smoke(sessions[r.endpoint], r.profile, r.fields)
    report: dict[str, Any] = {
        "schema": 3, "url": cfg.url, "api": cfg.api, "model": session.model, "protocol": cfg.protocol,
        "compare": cfg.compare, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokenizer": str(session.counter.path), "workers": cfg.workers, "dropped_inputs": session.dropped,
        "max_seq_len": session.max_seq_len,
        "max_input_tokens": {p.name: input_budget(p, session.max_seq_len) for p in profiles},
        "gates": gates.__dict__, "profiles": {p.name: p.to_dict() for p in profiles}, "cells": [], "not_run": [],
        "baseline": named[0][0] if param or settings else None, "settings": {n: f for n, f in settings},
        "sweep": sweep_summary(runs),
        "prompts": {"file": str(cfg.prompts), "format": cfg.prompts_format, "lengths": cfg.lengths,
                    "records": len(session.records)} if cfg.prompts else None,
        "machine": machine.describe(),
    }
    return runs, sessions, report


def open_session(*, tokenizer: str | None, workdir: Path, **kw) -> Session:
    """`loadtests.session.open_session` with the facts of the deployment in `workdir` (its tokenizer unless
    `tokenizer` names one, its target, its engine's max_seq_len)."""
    from specbuild.pipeline.serve import read_state

    d = deployment(workdir)
    served = read_state(workdir)     # the server `specbuild serve` started here: its admin token opens the config
    if served is not None and served.http_url == str(kw.get("url", "")).rstrip("/"):
        kw.setdefault("admin_headers", served.admin_headers)
    elif os.environ.get(ADMIN_TOKEN_ENV):   # the token of a server started from another workdir (its server/server.json)
        kw.setdefault("admin_headers", {ADMIN_KEY: os.environ[ADMIN_TOKEN_ENV]})
    return _session.open_session(tokenizer_dir=d.tokenizer_dir(tokenizer), deployed=d.target,
                                 max_seq_len=d.max_seq_len, **kw)


def _records(cfg: LoadtestConfig):
    if cfg.prompts is None:
        return None
    from specbuild.loadtests.datasets import load_prompt_file
    from specbuild.loadtests.tokens import TokenCounter

    counter = TokenCounter(resolve_tokenizer(cfg.tokenizer, Path(cfg.workdir)))
    return load_prompt_file(cfg.prompts, cfg.prompts_format, counter=counter, seed=cfg.seed)


def _measure(cfg: LoadtestConfig, runs: list[Run], sessions: dict, report: dict[str, Any],
             measured: dict[str, RunData], tmp: Path, say) -> bool:
    """Every planned run, in order; the report's cells as they complete (their RunData into `measured`).
    Returns True when interrupted."""
    from specbuild.loadtests.crosscheck import cross_check

    t0 = time.monotonic()
    for i, run in enumerate(runs):
        elapsed = time.monotonic() - t0
        eta = f", about {elapsed / i * (len(runs) - i) / 60:.0f} min left" if i else ""
        say(f"[run {i + 1}/{len(runs)}{eta}] {run.key}")
        session = sessions[run.endpoint]
        cell, data = measure_setting(session, run.profile, run.setting, run.fields, run.run_dir(tmp), say)
        if run.point:
            cell["sweep"] = run.sweep_cell
        measured[run_key(cell)] = data
        if cfg.cross_check and cell["status"] == "ok" and run.setting == runs[0].setting and \
                (run.point is None or run.point == runs[0].point):
            cell["cross_check"] = cross_check(Path(cell["run_dir"]), duration=min(run.profile.duration, 10.0),
                                               stop_timeout=cfg.stop_timeout, say=say)
        cell["run_dir"] = str(Path(cell["run_dir"]).relative_to(tmp))
        report["cells"].append(cell)
        if cell["status"] == "interrupted":
            report["not_run"] = [r.key for r in runs[i + 1:]]
            return True
        if cell["status"] in ("server gone", "failed") and not _alive(session):
            report["not_run"] = [r.key for r in runs[i + 1:]]
            return False
    return False


def _alive(session: Session) -> bool:
    from specbuild.loadtests import target

    if session.api != wire.KSERVE:
        try:
            target.preflight_openai(session.url, session.model, timeout=3.0)
            return True
        except SpecbuildError:
            return False
    return target.alive(session.url)


def _finish_report(report: dict[str, Any], measured: Runs, interrupted: bool, error: str | None) -> None:
    from specbuild.loadtests import report as rep
    from specbuild.loadtests.sweep import curves

    ok = [c for c in report["cells"] if c["status"] == "ok"]
    report["gains"] = rep.gain_table(ok, report["baseline"])
    report["curves"] = curves(report["cells"], report["baseline"], measured) if report["sweep"] else []
    report["ramp"] = ramp.analyse(report["cells"])
    report["status"] = overall_status(report["cells"], interrupted=interrupted, error=error)
    report["error"] = error
    if report["not_run"]:
        why = "interrupted" if interrupted else "the server stopped answering"
        report["note"] = f"not run ({why}): {', '.join(report['not_run'])}"
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _raise_for(report: dict[str, Any], out_dir: Path) -> None:
    md = out_dir / "report.md"
    status, cells = report["status"], report["cells"]
    if status == "interrupted":
        raise LoadtestInterrupted(f"interrupted; the runs finished so far are in {md}.")
    if status == "server gone":
        gone = [f"{c['profile']}/{c['setting']}" for c in cells if c["status"] == "server gone"]
        raise ServerGone(f"the server stopped answering during {', '.join(gone)} (consecutive connection "
                         f"errors); what was measured is in {md}. Check the server log (`specbuild status`).")
    if status == "error":
        raise SpecbuildError(f"the load test stopped ({report['error']}); what was measured is in {md}.")
    if status == "runs failed":
        failed = [f"{c['profile']}/{c['setting']}" for c in cells if c["status"] == "failed"]
        raise RunsFailed(f"run(s) {', '.join(failed)} produced no results (see their locust.log under "
                         f"{out_dir / 'runs'}); the other runs are in {md}.")
    if status == "gates failed":
        failed = [c for c in cells if not c.get("gates", {}).get("passed", True)]
        lines = [f"{c['profile']}/{c['setting']}: {'; '.join(c['gates']['violations'])}" for c in failed]
        raise GatesFailed("SLO gate(s) failed: " + " | ".join(lines) + f". Full report: {md}.")
