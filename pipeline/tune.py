"""`tune`: sweep K (num_draft_tokens) and the proposer per traffic profile with short load runs, pick the best.

    from specbuild.pipeline.tune import TuneConfig, tune
    result = tune(TuneConfig(workdir=Path("work"), profiles=("chat", "batch"), ks=(0, 2, 4), duration=15))
    result["profiles"]["chat"]["winner"]        # e.g. {"label": "k=4/draft", "k": 4, "proposer": "draft"}

Every setting is one short `specbuild.pipeline.loadtest.run_setting(...)` run (Locust, real traffic)
against the deployment's speculative model, in one session: pre-flight and smoke requests once, no
per-candidate report. Scores per profile: chat = median TPOT (lower is better; tie within 1%
-> median e2e), batch = output tokens/s (higher is better; tie -> median e2e). A setting with a failed
request cannot win. K=0 is the baseline (speculation off); with K=0 the proposer does not matter, so it is
measured once. The proposer is swept only when the deployment's model declares an optional `proposer`
input; otherwise K alone is swept (the deployment's default proposer) and tune.json says so.

Everything that can be refused is refused before any load: unknown profile, bad K list, K above the
engine's max_draft_len, unknown proposer, server down, model missing, --apply without an embedded
repository. Output: `<out>/tune.json`, `<out>/tune.md`, `<out>/runs/<profile>/<setting>/` (each run's
Locust CSVs, samples and summary.json), written atomically.

With `apply`, the chosen setting becomes the deployment's speculation `Policy` (engines/embedded/config.py),
written into the `engine_config.json` of the engine the deployment runs (`apply_policy`): the policy's one
home, which a re-deploy leaves alone; the server must be restarted to pick it up. Every candidate was
measured with its K sent by the request (forced: drafted at every concurrency), so the applied policy is that fixed K and proposer with no concurrency cut-off: exactly what was
measured. Requests that send no K then get it (a default-built deployment's adaptive K and measured cut-off
are replaced); K = 0 switches speculation off by default.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specbuild import __version__
from specbuild.engines.embedded.config import ConfigError, EngineConfig, Policy
from specbuild.core.constants import PROPOSERS
from specbuild.core.contract import SPECULATIVE_MODEL
from specbuild.core.errors import ManifestError, SpecbuildError, UsageError
from specbuild.core.manifest import MANIFEST, Manifest, stage_output, write_manifest
from specbuild.pipeline.tune_score import (TIE_TOLERANCE, Setting, choose_default, choose_winner, cell_row, gain_vs_baseline,
                                  objective_for, render_markdown)

DEFAULT_KS = (0, 1, 2, 4, 6)
ENGINE_MODEL = "tensorrt_llm"           # the embedded deployment's engine model (names the engine directory)


class TuneFailed(SpecbuildError):
    """No setting of some profile completed without errors; tune.json was written."""

    exit_code = 3


def parse_k_list(text: str) -> tuple[int, ...]:
    """`"0,2,4"` -> (0, 2, 4); refuses non-integers, negatives and duplicates."""
    ks = []
    for raw in str(text).split(","):
        raw = raw.strip()
        try:
            ks.append(int(raw))
        except ValueError:
            raise UsageError(f"--k {text!r}: {raw!r} is not an integer; pass e.g. --k 0,1,2,4 "
                             "(0 = speculation off).") from None
    return tuple(ks)


@dataclass(frozen=True)
class TuneConfig:
    workdir: Path = Path("specbuild-work")
    profiles: tuple[str, ...] = ("chat", "batch")
    ks: tuple[int, ...] | None = None       # None: DEFAULT_KS up to the engine's max_draft_len
    proposers: tuple[str, ...] = PROPOSERS
    url: str | None = None                  # None: the server started from --workdir, else 127.0.0.1:8000
    metrics_url: str | None = None
    tokenizer: str | None = None
    model: str = SPECULATIVE_MODEL
    duration: float = 15.0                  # seconds per setting, at least (and min_requests completed)
    min_requests: int | None = None         # None: each profile's own
    users: int | None = None
    max_tokens: int | None = None
    apply: bool = False
    out: Path | None = None                 # None: <workdir>/tune
    seed: int = 0

    def __post_init__(self):
        if not self.profiles or len(set(self.profiles)) != len(self.profiles):
            raise UsageError(f"profiles {list(self.profiles)}: give each of --profile chat / batch once.")
        if self.ks is not None:
            if any(k < 0 for k in self.ks):
                raise UsageError(f"--k {list(self.ks)} has negative values; K is a draft length >= 0.")
            if len(set(self.ks)) != len(self.ks):
                raise UsageError(f"--k {list(self.ks)} repeats a value; list each K once.")
            if not any(k > 0 for k in self.ks):
                raise UsageError(f"--k {list(self.ks)} has no K > 0: nothing to tune; e.g. --k 0,2,4.")
        bad = [p for p in self.proposers if p not in PROPOSERS]
        if bad or not self.proposers or len(set(self.proposers)) != len(self.proposers):
            raise UsageError(f"--proposer {list(self.proposers)}: give one or more of {PROPOSERS}, each once.")
        for name in ("duration", "users", "max_tokens", "min_requests"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {v}.")


def engine_facts(workdir: Path) -> dict[str, Any]:
    """max_draft_len, the policy and whether a draft exists, from `<workdir>/engines/` if built."""
    path = Path(workdir) / "engines" / "engine_config.json"
    if not path.is_file():
        return {"source": None, "max_draft_len": None}
    try:
        cfg = EngineConfig.load(path.parent)
    except ConfigError as e:
        raise ManifestError(str(e)) from None
    return {"source": str(path), "max_draft_len": cfg.max_draft_len, "policy": cfg.policy.to_dict(),
            "default_proposer": cfg.policy.proposer, "has_draft": cfg.has_draft}


def sweep_ks(cfg_ks: tuple[int, ...] | None, max_draft_len: int | None) -> tuple[int, ...]:
    if cfg_ks is None:
        ks = tuple(k for k in DEFAULT_KS if max_draft_len is None or k <= max_draft_len)
        if len(ks) < 2:
            raise UsageError(f"the deployment's max_draft_len is {max_draft_len}: no K > 0 to tune; rebuild with "
                             "`specbuild build --max-draft-len 4` (and deploy again).")
        return ks
    if max_draft_len is not None and max(cfg_ks) > max_draft_len:
        raise UsageError(f"--k {list(cfg_ks)}: K={max(cfg_ks)} is above the deployment's max_draft_len "
                         f"{max_draft_len}; drop it or rebuild with `specbuild build --max-draft-len "
                         f"{max(cfg_ks)}` (and deploy again).")
    return tuple(cfg_ks)


def plan_settings(ks: tuple[int, ...], proposers: tuple[str, ...] | None) -> list[Setting]:
    """K=0 once (baseline); every K>0 per proposer (proposers=None: the deployment's default only)."""
    out = [Setting(0, None)] if 0 in ks else []
    for k in (k for k in ks if k > 0):
        out += [Setting(k, p) for p in proposers] if proposers else [Setting(k, None)]
    return out


def resolve_server(cfg: TuneConfig) -> tuple[str, str | None]:
    """(HTTP URL, metrics URL): --url, else the server `specbuild serve` started from --workdir, else :8000."""
    from specbuild.pipeline.serve import endpoints

    where = endpoints(cfg.workdir, cfg.url, metrics_url=cfg.metrics_url)
    return where.http, where.metrics


def proposers_to_sweep(proposers: tuple[str, ...], inputs, engine: dict[str, Any],
                       model: str) -> tuple[tuple[str, ...] | None, str | None]:
    """(proposers to sweep or None = the deployment's default only, a note saying why not all)."""
    if "proposer" not in inputs:
        return None, (f"model {model!r} does not declare the optional `proposer` input: K swept with the "
                      f"deployment's default proposer ({engine.get('default_proposer') or 'unknown'}) only.")
    if engine.get("has_draft") is False and "draft" in proposers:
        return (tuple(p for p in proposers if p != "draft") or None,
                "the engine has no draft model: the draft proposer was not swept.")
    return proposers, None


def machine() -> dict[str, Any]:
    from specbuild.core.machine import describe

    return {**describe(), "specbuild": __version__}


@dataclass
class _Plan:
    """What tune runs, settled (and refusable) before any load."""
    profiles: list
    engine: dict[str, Any]
    ks: tuple[int, ...]
    session: Any
    settings: list[Setting]
    proposers: tuple[str, ...] | None
    note: str | None
    url: str


def tune(cfg: TuneConfig, progress: Callable[[str], None] | None = None, show_bar: bool = False) -> dict[str, Any]:
    """Sweep, score, write `<out>/tune.{json,md}` (and apply with cfg.apply). Returns the result dict.

    The loadtest skeleton, once: one session (tokenizer, pre-flight), one smoke request per profile x
    setting, then `loadtest.run_setting` per candidate (no per-candidate report or manifest)."""
    from specbuild.pipeline.loadtest import LoadtestInterrupted, ServerGone

    say = progress or (lambda msg: None)
    workdir = Path(cfg.workdir)
    out_dir = Path(cfg.out) if cfg.out else workdir / "tune"
    plan = _plan(cfg, workdir, say)
    result = _result_header(cfg, plan)
    apply_error = None
    with stage_output(out_dir) as tmp:          # the runs go into a temp dir renamed into place
        stopped = _sweep(plan, result, tmp, say, show_bar)
        result["default"] = None if stopped else choose_default(result["profiles"])
        result["applied"] = None
        if cfg.apply and result["default"]:
            try:
                result["applied"] = apply_policy(workdir / "model_repository",
                                                 tuned_policy(result["default"], plan.engine))
            except SpecbuildError as e:
                apply_error = e
        failed = [n for n, p in result["profiles"].items() if p["winner"] is None]
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        result["status"] = stopped or ("no valid setting" if failed else "ok")
        _write(tmp, cfg, plan, result)
    say(f"tune report: {out_dir / 'tune.md'}")
    if stopped == "interrupted":
        raise LoadtestInterrupted(f"interrupted: nothing was applied; the runs finished so far are in "
                                  f"{out_dir / 'tune.md'}.")
    if stopped == "server gone":
        raise ServerGone(f"the server stopped answering during the sweep: nothing was applied; the runs "
                         f"finished so far are in {out_dir / 'tune.md'}.")
    if apply_error:
        raise apply_error
    if failed:
        raise TuneFailed(f"no setting of profile(s) {failed} completed without errors (see {out_dir / 'tune.md'}); "
                         "check the server log, or lower --users / --max-tokens.")
    return result


def _plan(cfg: TuneConfig, workdir: Path, say) -> _Plan:
    """Everything checkable without the server, then the server (up, model there, may the request choose the
    proposer?) and one smoke request per profile x setting with its exact fields, before any load."""
    from specbuild.pipeline.loadtest import load_profiles, open_session, smoke

    profiles = load_profiles(cfg.profiles, users=cfg.users, duration=cfg.duration, max_tokens=cfg.max_tokens,
                             min_requests=cfg.min_requests)
    engine = engine_facts(workdir)
    ks = sweep_ks(cfg.ks, engine["max_draft_len"])
    if cfg.apply:
        EngineConfig.load(deployed_engine_dir(workdir / "model_repository"))   # refuse now, not after the load
    url, metrics_url = resolve_server(cfg)
    session = open_session(url=url, model=cfg.model, tokenizer=cfg.tokenizer, workdir=workdir,
                           inputs=["num_draft_tokens"], metrics_url=metrics_url, seed=cfg.seed)
    proposers, note = proposers_to_sweep(cfg.proposers, session.info.inputs, engine, cfg.model)
    if note:
        say(note)
    settings = plan_settings(ks, proposers)
    for profile in profiles:
        for s in settings:
            smoke(session, profile, s.request_fields())
    return _Plan(profiles, engine, ks, session, settings, proposers, note, url)


def _result_header(cfg: TuneConfig, plan: _Plan) -> dict[str, Any]:
    return {
        "schema": 2, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "url": plan.url,
        "model": cfg.model, "tokenizer": str(plan.session.counter.path), "engine": plan.engine, "machine": machine(),
        "sweep": {"k": list(plan.ks), "proposers": list(plan.proposers) if plan.proposers else None,
                  "proposer_swept": plan.proposers is not None, "note": plan.note,
                  "settings": [s.label for s in plan.settings], "duration_s": cfg.duration, "users": cfg.users,
                  "max_tokens": cfg.max_tokens, "tie_tolerance": TIE_TOLERANCE},
        "profiles": {},
    }


def _sweep(plan: _Plan, result: dict[str, Any], tmp: Path, say, show_bar: bool) -> str | None:
    """One run per profile x setting into `tmp/runs/`, scored per profile into `result["profiles"]`.
    -> None, or why the sweep stopped early ("interrupted" | "server gone"); what was measured is kept."""
    from tqdm import tqdm

    from specbuild.pipeline.loadtest import run_setting

    bar = tqdm(total=len(plan.profiles) * len(plan.settings), desc="tune", unit="run", disable=not show_bar)
    stopped = None
    try:
        for profile in plan.profiles:
            objective = objective_for(profile)
            rows: list[dict[str, Any]] = []
            for s in plan.settings:
                bar.set_postfix_str(f"{profile.name} {s.label}")
                try:
                    cell = run_setting(plan.session, profile, s.label, s.request_fields(),
                                       tmp / "runs" / profile.name / s.slug, lambda m: say(f"  {m}"))
                except KeyboardInterrupt:
                    cell = {"status": "interrupted"}
                if cell["status"] in ("interrupted", "server gone"):
                    stopped = cell["status"]   # the cut-short run does not compete
                    break
                rows.append({**cell_row(s, cell), "status": cell["status"],
                             "report": str(Path("runs") / profile.name / s.slug / "summary.json")})
                bar.update(1)
            winner = choose_winner(rows, objective)
            result["profiles"][profile.name] = {
                "objective": objective.__dict__, "profile": profile.to_dict(), "settings": rows,
                "baseline": "k=0" if 0 in plan.ks else None,
                "winner": None if winner is None else {k: winner[k] for k in ("label", "k", "proposer", "score")},
                "gain_vs_baseline": gain_vs_baseline(rows, winner, objective)}
            if stopped:
                break
    finally:
        bar.close()
    return stopped


def _write(tmp: Path, cfg: TuneConfig, plan: _Plan, result: dict[str, Any]) -> None:
    (tmp / "tune.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (tmp / "tune.md").write_text(render_markdown(result))
    write_manifest(tmp, Manifest(stage="tune", inputs={"url": plan.url, "model": cfg.model},
                                 options={k: str(v) for k, v in cfg.__dict__.items()},
                                 outputs={"json": "tune.json", "md": "tune.md"}))


# --- writing the tuned default into the deployment ---------------------------------------------------

def read_engine_model_config(repo_dir: Path):
    """Parse `<repo>/tensorrt_llm/config.pbtxt` of an embedded deployment into a ModelConfig protobuf."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    repo_dir = Path(repo_dir)
    manifest = repo_dir / MANIFEST
    if not manifest.is_file():
        raise ManifestError(f"{repo_dir} has no {MANIFEST}: run `specbuild deploy` before `tune --apply`.")
    backend = json.loads(manifest.read_text()).get("options", {}).get("backend")
    if backend != "embedded":
        raise UsageError(f"{repo_dir} is a {backend!r} deployment; --apply writes defaults for the embedded "
                         "engine only (with TensorRT-LLM, send num_draft_tokens per request).")
    path = repo_dir / ENGINE_MODEL / "config.pbtxt"
    if not path.is_file():
        raise ManifestError(f"{path} is missing: the repository is incomplete; run `specbuild deploy --force`.")
    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(path.read_text(), cfg)
    except text_format.ParseError as e:
        raise ManifestError(f"{path} is not a valid Triton config ({e}); run `specbuild deploy --force`.") from e
    return cfg


def deployed_engine_dir(repo_dir: Path) -> Path:
    """The engine directory the embedded deployment in `repo_dir` runs (its `engine_dir` parameter)."""
    cfg = read_engine_model_config(repo_dir)
    engine_dir = cfg.parameters["engine_dir"].string_value if "engine_dir" in cfg.parameters else ""
    if not engine_dir:
        raise ManifestError(f"{Path(repo_dir) / ENGINE_MODEL / 'config.pbtxt'} names no engine_dir; run "
                            "`specbuild deploy --force`.")
    return Path(engine_dir)


def apply_policy(repo_dir: str | Path, policy: Policy) -> dict[str, Any]:
    """Write `policy` into the `engine_config.json` of the engine the deployment in `repo_dir` runs: the one
    home of the policy (the build wrote it, the engine reads it at load, a re-deploy renders nothing of it, so
    a re-deploy keeps it). Checked against that engine (K <= max_draft_len, a draft for the draft proposer)
    before an atomic write. Returns what it did."""
    repo_dir = Path(repo_dir)
    engine_dir = deployed_engine_dir(repo_dir)
    try:
        cfg = EngineConfig.load(engine_dir)
        new = cfg.replace(policy=policy)          # validates the policy against this engine
    except ConfigError as e:
        raise UsageError(str(e)) from None
    path = new.save(engine_dir)
    workdir = repo_dir.parent
    return {"policy": policy.to_dict(), "described": policy.describe(), "config": str(path),
            "applied": time.time(),
            "restart": f"specbuild stop --workdir {workdir} && specbuild serve --workdir {workdir} --background"}


def tuned_policy(default: dict[str, Any], engine: dict[str, Any]) -> Policy:
    """The Policy `tune --apply` writes for the chosen setting: its K and proposer (the deployment's proposer
    when the sweep did not choose one), no cut-off (every candidate was measured with a forced K)."""
    proposer = default.get("proposer") or engine.get("default_proposer") or "draft"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return Policy(k=int(default["k"]), proposer=proposer, max_concurrency=None,
                  source=f"tune {stamp}: {default['label']}")
