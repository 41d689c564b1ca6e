"""`loadtest`: headless Locust per profile x setting against a running deployment, one report.

    from specbuild.pipeline.loadtest import LoadtestConfig, loadtest
    report = loadtest(LoadtestConfig(profiles=("chat", "batch"), compare="num_draft_tokens=0,4",
                                     url="http://127.0.0.1:8000", tokenizer="work/engines/tokenizer"))

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from specbuild.loadtests.profiles import load_profiles
from specbuild.loadtests.report import overall_status  # noqa: F401  (public API)
from specbuild.loadtests.settings import parse_compare, parse_settings  # noqa: F401  (public API)
from specbuild.pipeline.client import deployment_target
from specbuild.pipeline.contract import SPECULATIVE_MODEL, ENSEMBLE_MODEL
from specbuild.pipeline.errors import SpecbuildError, UsageError
from specbuild.pipeline.manifest import Manifest, stage_output, write_manifest

log = logging.getLogger(__name__)
PROTOCOLS = ("http", "grpc")
OPTIONAL_INPUTS = ("stream", "temperature", "top_k", "top_p", "seed", "return_perf_metrics",
                   "exclude_input_in_output", "min_tokens")   # dropped from requests if the model lacks them


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

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise UsageError(f"--protocol {self.protocol!r} is not supported; choose one of {PROTOCOLS}.")
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


def resolve_tokenizer(explicit: str | None, workdir: Path) -> Path:
    """--tokenizer, else the deployment's tokenizer found through the workspace manifests."""
    if explicit:
        return Path(explicit)
    tried = []
    candidates = []
    manifest = workdir / "model_repository" / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        engine_dir = data.get("inputs", {}).get("engine_dir")
        if engine_dir:
            candidates.append(Path(engine_dir) / "tokenizer")
    candidates += [workdir / "engines" / "tokenizer", workdir / "checkpoints" / "target"]
    for c in candidates:
        tried.append(str(c))
        if (c / "tokenizer.json").is_file():
            return c
    raise UsageError(f"cannot find the target's tokenizer (tried {tried}); pass --tokenizer DIR (the target "
                     "model directory holding tokenizer.json) or the --workdir of the deployment.")


def deployment_max_seq_len(workdir: Path) -> int | None:
    """The engine's max_seq_len (prompt + output tokens) when the workspace holds a built engine."""
    for path, keys in ((workdir / "engines" / "engine_config.json", ("max_seq_len",)),
                       (workdir / "engines" / "manifest.json", ("options", "max_seq_len"))):
        try:
            value: Any = json.loads(path.read_text())
            for k in keys:
                value = value[k]
            return int(value)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def input_budget(profile, max_seq_len: int | None, margin: int = 8) -> int:
    """Prompt tokens allowed: the profile's max_input_tokens, capped so prompt + max_tokens fits the engine."""
    if max_seq_len is None:
        return profile.max_input_tokens
    if getattr(profile, "chat_template", False):
        margin += 64   # the template's own tokens (roles, default system prompt) come on top
    room = max_seq_len - profile.max_tokens - margin
    if room < 1:
        raise UsageError(f"profile {profile.name!r}: max_tokens {profile.max_tokens} leaves no room for a prompt "
                         f"in the engine's max_seq_len {max_seq_len}; pass a smaller --max-tokens.")
    return min(profile.max_input_tokens, room)


def _with_port(url: str, port: int, scheme: str | None = None) -> str:
    u = urlsplit(url)
    host = u.hostname or "127.0.0.1"
    return f"{scheme}://{host}:{port}" if scheme else f"{host}:{port}"


@dataclass
class Session:
    """What every run against one deployment shares: endpoints, tokenizer, the model's inputs, gates.
    Opened once per `loadtest` / `tune` by `open_session` (which does the pre-flight)."""

    url: str
    grpc_url: str
    metrics_url: str | None
    model: str
    protocol: str
    counter: Any                            # loadtests.tokens.TokenCounter
    info: Any                               # loadtests.target.ModelInfo
    dropped: list[str]                      # optional request fields the model does not declare
    gates: Any                              # loadtests.runspec.Gates
    max_seq_len: int | None = None
    workers: int = 0
    stop_timeout: float = 5.0
    seed: int = 0
    progress_bar: bool = False
    target: str = "embedded"                # client.deployment_target: "embedded" | "trtllm-<family>"
    _prompts: dict[str, tuple[list[str], list[int]]] = field(default_factory=dict)

    def prompts(self, profile) -> tuple[list[str], list[int]]:
        """The profile's prompts (cut to fit, chat-templated) and their token counts; built once."""
        from specbuild.loadtests import promptsets

        if profile.name not in self._prompts:
            texts = promptsets.build_prompts(profile.prompt_set, count=200, seed=self.seed, counter=self.counter,
                                             max_input_tokens=input_budget(profile, self.max_seq_len),
                                             chat=profile.chat_template)
            self._prompts[profile.name] = (texts, [self.counter.count(t) for t in texts])
        return self._prompts[profile.name]

    def payload(self, profile, fields: dict[str, Any]) -> dict[str, Any]:
        """The request fields of a run: the profile's, then the setting's, less what the model lacks; for a
        TensorRT-LLM deployment, in its release's names (`client.adapt_request`)."""
        body = {**_payload(profile, {}, self.dropped), **fields}
        if self.target == "embedded":
            return body
        from specbuild.pipeline.client import RequestError, adapt_request

        full = {**_payload(profile, {}, []), **fields}       # seed/min_tokens exist under other names there
        try:
            adapted, echoed = adapt_request(self.target, self.model, {"text_input": "", **full})
        except RequestError as e:
            raise UsageError(f"profile {profile.name!r}, setting {fields}: {e}") from None
        if echoed:
            raise UsageError(
                f"profile {profile.name!r}, setting {fields}: on {self.target} the speculative path of "
                f"{self.model} answers stream=false with the prompt echoed in text_output (upstream's BLS), so "
                "the load test cannot time tokens or count them; measure that deployment with "
                "num_draft_tokens=0 here, and speculation with `specbuild verify` or GenAI-Perf's non-streaming "
                "mode.")
        adapted.pop("text_input")
        return adapted


def open_session(*, url: str, model: str, tokenizer: str | None, workdir: Path, inputs: list[str] = (),
                 protocol: str = "http", grpc_url: str | None = None, metrics_url: str | None = None,
                 gates=None, workers: int = 0, stop_timeout: float = 5.0, seed: int = 0,
                 progress_bar: bool = False) -> Session:
    """Resolve the tokenizer, check the server is up, `model` exists and declares `inputs`."""
    from specbuild.loadtests import target
    from specbuild.loadtests.runspec import Gates
    from specbuild.loadtests.tokens import TokenCounter

    counter = TokenCounter(resolve_tokenizer(tokenizer, Path(workdir)))
    grpc_url = grpc_url or _with_port(url, 8001)
    metrics_url = _with_port(url, 8002, "http") + "/metrics" if metrics_url is None else metrics_url
    info = target.preflight(url, model)
    target.check_inputs(info, ["text_input", "max_tokens", *inputs])
    if protocol == "grpc":
        target.check_grpc(grpc_url, model)
    return Session(url=url, grpc_url=grpc_url, metrics_url=metrics_url, model=model, protocol=protocol,
                   counter=counter, info=info, dropped=sorted(n for n in OPTIONAL_INPUTS if n not in info.inputs),
                   gates=gates or Gates(), max_seq_len=deployment_max_seq_len(Path(workdir)), workers=workers,
                   stop_timeout=stop_timeout, seed=seed, progress_bar=progress_bar,
                   target=deployment_target(Path(workdir)))


def smoke(session: Session, profile, fields: dict[str, Any]) -> None:
    """One short real request with the run's exact fields: a refused value fails before any load."""
    from specbuild.loadtests import target

    target.smoke_request(session.url, session.model, session.payload(profile, fields), profile.stream)


def run_setting(session: Session, profile, setting: str, fields: dict[str, Any], run_dir: Path,
                say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Measure one setting under one profile: the one path `loadtest` and `tune` share.

    Writes `run_dir/` (runspec, Locust CSVs and logs, samples, stop.json, summary.json,
    profile_export_genai_perf.json) and returns the run's summary (a report cell; `status` says how it
    ended). Never raises for a failed run; Ctrl-C ends the run within seconds with status "interrupted".
    """
    from specbuild.loadtests import report as rep, target
    from specbuild.loadtests.runner import run_cell
    from specbuild.loadtests.runspec import RunSpec

    (run_dir / "samples").mkdir(parents=True, exist_ok=True)
    prompts, counts = session.prompts(profile)
    spec = RunSpec(label=profile.name, protocol=session.protocol, url=session.url, grpc_url=session.grpc_url,
                   model=session.model, stream=profile.stream, payload=session.payload(profile, fields),
                   prompts=prompts, prompt_tokens=counts, tokenizer=str(session.counter.path),
                   samples_dir=str(run_dir / "samples"), run_dir=str(run_dir), wait_time=profile.wait_time,
                   seed=session.seed, gates=session.gates, grpc_batch_dim=session.info.batch_dim,
                   min_duration_s=profile.duration, min_requests=profile.min_requests,
                   max_duration_s=profile.ceiling)
    idle, left = target.wait_idle(session.metrics_url, timeout=profile.ceiling)
    if not idle:
        say(f"{profile.name} / {setting}: {left:g} requests of the previous run still in flight after "
            f"{profile.ceiling:g} s; measuring anyway (the run starts on a busy server)")
    before = target.scrape(session.metrics_url)
    say(f"{profile.name} / {setting}: {profile.users} users, {profile.duration:g} s and >= {profile.min_requests} "
        f"requests (ceiling {profile.ceiling:g} s; {'streaming' if profile.stream else 'non-streaming'}, "
        f"max_tokens {profile.max_tokens})")
    cell = run_cell(spec, profile=profile.name, setting=setting, run_dir=run_dir, users=profile.users,
                    spawn_rate=profile.effective_spawn_rate, workers=session.workers,
                    stop_timeout=session.stop_timeout, progress_bar=session.progress_bar)
    deltas = target.metric_deltas(before, None if cell.interrupted else target.scrape(session.metrics_url))
    summary = rep.summarize_cell(cell, stream=profile.stream, users=profile.users, gates=session.gates,
                                 metrics=target.spec_summary(deltas),
                                 input_config={"url": session.url, "model": session.model,
                                               "protocol": session.protocol, "request_fields": spec.payload})
    summary["server_metrics_delta"] = target.model_deltas(deltas, session.model)
    if not idle:
        summary["started_with_in_flight"] = left
    summary["run_dir"] = str(run_dir)
    (run_dir / "profile_export_genai_perf.json").write_text(json.dumps(summary["_genai_perf"], indent=2) + "\n")
    kept = {k: v for k, v in summary.items() if not k.startswith("_") and k != "run_dir"}
    (run_dir / "summary.json").write_text(json.dumps(kept, indent=2, default=str) + "\n")
    if summary["status"] != "ok":
        stop = cell.stop or {}
        say(f"{profile.name} / {setting}: {summary['status']} ({summary['requests']} completed, "
            f"{summary['failures']} failed in {cell.duration_s:.0f} s)"
            + (f": {stop.get('server_gone')}" if stop.get("server_gone") else ""))
    return summary


def loadtest(cfg: LoadtestConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every profile x setting and write `<out>/report.{json,md}`, summary.csv,
    profile_export_genai_perf.json and plots. Returns the report dict.

    Raises (after writing the report) GatesFailed when an SLO gate fails, ServerGone when the server
    died, RunsFailed when a run produced nothing, LoadtestInterrupted on Ctrl-C.
    """
    from specbuild.loadtests import report as rep, target
    from specbuild.loadtests.crosscheck import cross_check
    from specbuild.loadtests.runspec import Gates

    say = progress or (lambda msg: log.info(msg))
    # 1. everything that can be checked without the server
    profiles = load_profiles(cfg.profiles, users=cfg.users, duration=cfg.duration, max_tokens=cfg.max_tokens,
                             max_input_tokens=cfg.max_input_tokens, min_requests=cfg.min_requests,
                             max_duration=cfg.max_duration)
    param, values = parse_compare(cfg.compare)
    settings = parse_settings(cfg.settings)
    if settings and param:
        raise UsageError("use either --compare or --setting, not both.")
    setting_fields = sorted({k for _, fields in settings for k in fields})
    speculative = param == "num_draft_tokens" or "num_draft_tokens" in setting_fields
    model = cfg.model or (SPECULATIVE_MODEL if speculative else ENSEMBLE_MODEL)
    gates = Gates(max_p95_ttft_ms=cfg.max_p95_ttft_ms, max_p95_tpot_ms=cfg.max_p95_tpot_ms,
                  max_error_rate=cfg.max_error_rate)
    if settings:
        named = settings
    else:
        named = [(f"{param}={v}" if param else "default", {param: v} if param else {}) for v in values]
    runs = [(p, name, {**cfg.extra, **fields}) for p in profiles for name, fields in named]
    # 2. the server: up, model there, every parameter we send declared; one smoke request per run
    session = open_session(url=cfg.url, model=model, tokenizer=cfg.tokenizer, workdir=Path(cfg.workdir),
                           inputs=([param] if param else []) + setting_fields + list(cfg.extra),
                           protocol=cfg.protocol, grpc_url=cfg.grpc_url, metrics_url=cfg.metrics_url, gates=gates,
                           workers=cfg.workers, stop_timeout=cfg.stop_timeout, seed=cfg.seed,
                           progress_bar=cfg.progress_bar)
    for profile in profiles:
        session.prompts(profile)
    for profile, setting, fields in runs:
        say(f"{profile.name} / {setting}: smoke request")
        smoke(session, profile, fields)
    report: dict[str, Any] = {
        "schema": 2, "url": cfg.url, "model": model, "protocol": cfg.protocol, "compare": cfg.compare,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokenizer": str(session.counter.path),
        "workers": cfg.workers, "dropped_inputs": session.dropped, "max_seq_len": session.max_seq_len,
        "max_input_tokens": {p.name: input_budget(p, session.max_seq_len) for p in profiles},
        "gates": gates.__dict__, "profiles": {p.name: p.to_dict() for p in profiles}, "cells": [], "not_run": [],
        "baseline": named[0][0] if param or settings else None, "settings": {n: f for n, f in settings},
    }
    out_dir = Path(cfg.out)
    interrupted, error = False, None
    # 3. the load, into a temporary directory renamed into place at the end, whatever happened
    with stage_output(out_dir) as tmp:
        try:
            for i, (profile, setting, fields) in enumerate(runs):
                cell = run_setting(session, profile, setting, fields, tmp / "runs" / profile.name /
                                   setting.replace("=", "-"), say)
                if cfg.cross_check and cell["status"] == "ok" and setting == runs[0][1]:
                    cell["cross_check"] = cross_check(Path(cell["run_dir"]), duration=min(profile.duration, 10.0),
                                                       stop_timeout=cfg.stop_timeout, say=say)
                cell["run_dir"] = str(Path(cell["run_dir"]).relative_to(tmp))
                report["cells"].append(cell)
                interrupted = cell["status"] == "interrupted"
                if interrupted or (cell["status"] in ("server gone", "failed") and not target.alive(cfg.url)):
                    report["not_run"] = [f"{p.name}/{s}" for p, s, _ in runs[i + 1:]]
                    break
        except KeyboardInterrupt:
            interrupted = True
        except Exception as e:  # noqa: BLE001  (recorded; the report of what was measured is still written)
            error = f"{type(e).__name__}: {e}"
            log.exception("load test aborted")
        report["gains"] = rep.gain_table([c for c in report["cells"] if c["status"] == "ok"], report["baseline"])
        report["status"] = overall_status(report["cells"], interrupted=interrupted, error=error)
        report["error"] = error
        if report["not_run"]:
            report["note"] = f"not run (the server stopped answering): {', '.join(report['not_run'])}"
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        paths = rep.write_report(tmp, report)
        write_manifest(tmp, Manifest(stage="loadtest", inputs={"url": cfg.url, "model": model},
                                     options={k: str(v) for k, v in cfg.__dict__.items()},
                                     outputs={k: p.name for k, p in paths.items()}))
    say(f"report: {out_dir / 'report.md'}")
    _raise_for(report, out_dir)
    return report


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


def _payload(profile, extra: dict[str, Any], dropped: list[str]) -> dict[str, Any]:
    payload = {"max_tokens": profile.max_tokens, "stream": profile.stream, "temperature": profile.temperature,
               "return_perf_metrics": profile.return_perf_metrics,
               "exclude_input_in_output": profile.exclude_input_in_output}
    for key in ("top_k", "top_p", "seed"):
        if getattr(profile, key) is not None:
            payload[key] = getattr(profile, key)
    if profile.fixed_output:
        payload["min_tokens"] = profile.max_tokens
    payload.update(extra)
    return {k: v for k, v in payload.items() if k not in dropped}
