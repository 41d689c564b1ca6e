"""`loadtest`: headless Locust per profile x setting against a running deployment, one report.

    from specbuild.pipeline.loadtest import LoadtestConfig, loadtest
    report = loadtest(LoadtestConfig(profiles=("chat", "batch"), compare="num_draft_tokens=0,4",
                                     url="http://127.0.0.1:8000", tokenizer="work/engines/tokenizer"))

Order of work: validate profiles, gates and the comparison; resolve the tokenizer; check that the
server is up, the model exists and takes every parameter sent (all before any load); then for every
profile x setting: one smoke request, Triton metrics before, Locust (subprocess, hard deadline),
metrics after, optional independent cross-check. The report directory is written atomically;
Ctrl-C stops the remaining runs and still writes what was measured (status "interrupted", exit 130).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from specbuild.pipeline.contract import SPECULATIVE_MODEL, ENSEMBLE_MODEL
from specbuild.pipeline.errors import SpecbuildError, UsageError
from specbuild.pipeline.manifest import Manifest, stage_output, write_manifest

log = logging.getLogger(__name__)
PROTOCOLS = ("http", "grpc")


class LoadtestInterrupted(SpecbuildError):
    """Ctrl-C during a load test; the partial report was written."""

    exit_code = 130


class GatesFailed(SpecbuildError):
    """An SLO gate failed; the report was written."""

    exit_code = 3


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
    duration: float | None = None
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
        for name in ("users", "duration", "max_tokens", "max_input_tokens", "max_p95_ttft_ms", "max_p95_tpot_ms"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {v}.")
        if self.stop_timeout < 0:
            raise UsageError(f"--stop-timeout {self.stop_timeout} must be >= 0 seconds.")
        if not urlsplit(self.url).hostname:
            raise UsageError(f"--url {self.url!r} is not a URL; e.g. http://127.0.0.1:8000.")


def parse_compare(text: str | None) -> tuple[str | None, list[Any]]:
    """`"num_draft_tokens=0,4"` -> ("num_draft_tokens", [0, 4]); None -> (None, [None])."""
    if not text:
        return None, [None]
    m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.+)", text)
    if not m:
        raise UsageError(f"--compare {text!r} must look like NAME=V1,V2 (e.g. num_draft_tokens=0,4).")
    values = []
    for raw in m.group(2).split(","):
        raw = raw.strip()
        if raw.lower() in ("true", "false"):
            values.append(raw.lower() == "true")
            continue
        try:
            values.append(int(raw))
        except ValueError:
            try:
                values.append(float(raw))
            except ValueError:
                raise UsageError(f"--compare value {raw!r} is not a number or true/false.") from None
    if len(values) < 2 or len(set(values)) != len(values):
        raise UsageError(f"--compare {text!r} needs at least two distinct values (the first is the baseline).")
    return m.group(1), values


def _scalar(raw: str) -> Any:
    raw = raw.strip()
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def parse_settings(items: tuple[str, ...] | list[str]) -> list[tuple[str, dict[str, Any]]]:
    """`["off:num_draft_tokens=0", "ngram:num_draft_tokens=4,proposer=ngram"]` -> named request-field sets.

    The first setting is the baseline of the gain table. Names must be distinct; each needs >= 1 field.
    """
    out: list[tuple[str, dict[str, Any]]] = []
    for item in items:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*:\s*(.+)", item)
        if not m:
            raise UsageError(f"--setting {item!r} must look like NAME:FIELD=VALUE[,FIELD=VALUE...] "
                             "(e.g. ngram:num_draft_tokens=4,proposer=ngram).")
        fields: dict[str, Any] = {}
        for pair in m.group(2).split(","):
            key, sep, value = pair.partition("=")
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()) or not value.strip():
                raise UsageError(f"--setting {item!r}: {pair!r} is not FIELD=VALUE.")
            fields[key.strip()] = _scalar(value)
        out.append((m.group(1), fields))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise UsageError(f"--setting names repeat ({names}); give each setting its own name.")
    if len(out) == 1:
        raise UsageError("one --setting alone compares nothing; give at least two (the first is the baseline).")
    return out


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


def loadtest(cfg: LoadtestConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every profile x setting and write `<out>/report.{json,md}` + plots. Returns the report dict.

    Raises GatesFailed (after writing the report) when an SLO gate fails, LoadtestInterrupted on Ctrl-C.
    """
    from specbuild.loadtests import promptsets, report as rep, target
    from specbuild.loadtests.profiles import load_profile
    from specbuild.loadtests.runner import run_cell
    from specbuild.loadtests.runspec import Gates, RunSpec
    from specbuild.loadtests.tokens import TokenCounter

    say = progress or (lambda msg: log.info(msg))
    # 1. everything that can be checked without the server
    profiles = [load_profile(p).with_overrides(users=cfg.users, duration=cfg.duration, max_tokens=cfg.max_tokens,
                                               max_input_tokens=cfg.max_input_tokens) for p in cfg.profiles]
    if len({p.name for p in profiles}) != len(profiles):
        raise UsageError(f"profiles {[p.name for p in profiles]} repeat a name; give each profile once.")
    param, values = parse_compare(cfg.compare)
    settings = parse_settings(cfg.settings)
    if settings and param:
        raise UsageError("use either --compare or --setting, not both.")
    setting_fields = sorted({k for _, fields in settings for k in fields})
    speculative = param == "num_draft_tokens" or "num_draft_tokens" in setting_fields
    model = cfg.model or (SPECULATIVE_MODEL if speculative else ENSEMBLE_MODEL)
    gates = Gates(max_p95_ttft_ms=cfg.max_p95_ttft_ms, max_p95_tpot_ms=cfg.max_p95_tpot_ms,
                  max_error_rate=cfg.max_error_rate)
    counter = TokenCounter(resolve_tokenizer(cfg.tokenizer, Path(cfg.workdir)))
    grpc_url = cfg.grpc_url or _with_port(cfg.url, 8001)
    metrics_url = _with_port(cfg.url, 8002, "http") + "/metrics" if cfg.metrics_url is None else cfg.metrics_url
    max_seq_len = deployment_max_seq_len(Path(cfg.workdir))
    budgets = {p.name: input_budget(p, max_seq_len) for p in profiles}
    # 2. the server: up, model there, every parameter we send declared by the model
    info = target.preflight(cfg.url, model)
    target.check_inputs(info, ["text_input", "max_tokens"] + ([param] if param else []) + setting_fields
                        + list(cfg.extra))
    if cfg.protocol == "grpc":
        target.check_grpc(grpc_url, model)
    optional = {"stream", "temperature", "top_k", "top_p", "seed", "return_perf_metrics", "exclude_input_in_output",
                "min_tokens"}
    dropped = sorted(n for n in optional if n not in info.inputs)
    prompts = {p.name: promptsets.build_prompts(p.prompt_set, count=200, seed=cfg.seed, counter=counter,
                                                max_input_tokens=budgets[p.name], chat=p.chat_template)
               for p in profiles}
    report: dict[str, Any] = {
        "schema": 1, "url": cfg.url, "model": model, "protocol": cfg.protocol, "compare": cfg.compare,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokenizer": str(counter.path),
        "workers": cfg.workers, "dropped_inputs": dropped, "max_seq_len": max_seq_len,
        "max_input_tokens": budgets, "gates": gates.__dict__,
        "profiles": {p.name: p.to_dict() for p in profiles}, "cells": [],
        "baseline": f"{param}={values[0]}" if param else settings[0][0] if settings else None,
        "settings": {name: fields for name, fields in settings},
    }
    cells = []   # (profile, setting, payload): every one is smoke-tested before any load is sent
    for profile in profiles:
        if settings:
            for name, fields in settings:
                cells.append((profile, name, {**_payload(profile, cfg.extra, dropped), **fields}))
            continue
        for value in values:
            payload = _payload(profile, cfg.extra, dropped)
            if param:
                payload[param] = value
            cells.append((profile, f"{param}={value}" if param else "default", payload))
    for profile, setting, payload in cells:
        say(f"{profile.name} / {setting}: smoke request")
        target.smoke_request(cfg.url, model, payload, profile.stream)
    out_dir = Path(cfg.out)
    interrupted = False
    # 3. the load, into a temporary directory renamed into place at the end
    with stage_output(out_dir) as tmp:
        try:
            for profile, setting, payload in cells:
                run_dir = tmp / "runs" / profile.name / setting.replace("=", "-")
                (run_dir / "samples").mkdir(parents=True, exist_ok=True)
                spec = RunSpec(label=profile.name, protocol=cfg.protocol, url=cfg.url, grpc_url=grpc_url,
                               model=model, stream=profile.stream, payload=payload, prompts=prompts[profile.name],
                               tokenizer=str(counter.path), samples_dir=str(run_dir / "samples"),
                               wait_time=profile.wait_time, seed=cfg.seed, gates=gates, grpc_batch_dim=info.batch_dim)
                before = target.scrape(metrics_url)
                say(f"{profile.name} / {setting}: {profile.users} users for {profile.duration:g} s "
                    f"({'streaming' if profile.stream else 'non-streaming'}, max_tokens {profile.max_tokens})")
                cell = run_cell(spec, profile=profile.name, setting=setting, run_dir=run_dir, users=profile.users,
                                spawn_rate=profile.effective_spawn_rate, duration=profile.duration,
                                workers=cfg.workers, stop_timeout=cfg.stop_timeout,
                                progress_bar=cfg.progress_bar)
                interrupted = cell.interrupted
                deltas = target.metric_deltas(before, target.scrape(metrics_url))
                summary = rep.summarize_cell(cell, stream=profile.stream, users=profile.users, gates=gates,
                                             metrics=target.spec_summary(deltas))
                summary["server_metrics_delta"] = target.model_deltas(deltas, model)
                if cfg.cross_check and not interrupted and setting == cells[0][1]:
                    summary["cross_check"] = _cross_check(spec, profile, run_dir, cfg, say)
                report["cells"].append(summary)
                if interrupted:
                    break
        except KeyboardInterrupt:
            interrupted = True
        report["gains"] = rep.gain_table(report["cells"], report["baseline"])
        failed = [c for c in report["cells"] if not c.get("gates", {}).get("passed", True)]
        report["status"] = "interrupted" if interrupted else "gates failed" if failed else "ok"
        paths = rep.write_report(tmp, report)
        write_manifest(tmp, Manifest(stage="loadtest", inputs={"url": cfg.url, "model": model},
                                     options={k: str(v) for k, v in cfg.__dict__.items()},
                                     outputs={k: p.name for k, p in paths.items()}))
    say(f"report: {out_dir / 'report.md'}")
    if interrupted:
        raise LoadtestInterrupted(f"interrupted; the runs finished so far are in {out_dir / 'report.md'}.")
    if failed:
        lines = [f"{c['profile']}/{c['setting']}: {'; '.join(c['gates']['violations'])}" for c in failed]
        raise GatesFailed("SLO gate(s) failed: " + " | ".join(lines) + f". Full report: {out_dir / 'report.md'}.")
    return report


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


def _cross_check(spec, profile, run_dir: Path, cfg: LoadtestConfig, say) -> dict[str, Any]:
    """The measurement check: the same request (one prompt, one user, no think time) measured by Locust
    and by the independent asyncio+httpx client, back to back; ratios of medians (independent / Locust)."""
    import dataclasses

    from specbuild.loadtests import report as rep
    from specbuild.loadtests.independent_client import compare_medians, measure
    from specbuild.loadtests.runner import run_cell

    duration = min(profile.duration, 10.0)
    check_dir = run_dir / "crosscheck"
    (check_dir / "samples").mkdir(parents=True, exist_ok=True)
    check = dataclasses.replace(spec, label=f"{spec.label}-crosscheck", prompts=spec.prompts[:1],
                                wait_time=(0.0, 0.0), samples_dir=str(check_dir / "samples"), protocol="http")
    say(f"{profile.name}: cross-check, Locust and an independent asyncio+httpx client side by side "
        f"({duration:g} s, one user each)")
    try:
        # Side by side, so both see the same server load and CPU contention (back to back they would not).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(run_cell, check, profile=profile.name, setting="crosscheck", run_dir=check_dir,
                                 users=1, spawn_rate=1.0, duration=duration, stop_timeout=cfg.stop_timeout)
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
