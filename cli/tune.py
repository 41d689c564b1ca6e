"""`specbuild tune`: sweep K and the proposer per traffic profile with short load runs; pick and apply the best."""

from __future__ import annotations

from pathlib import Path

import click

from specbuild.cli.options import workdir_option


@click.command("tune")
@workdir_option
@click.option("--profile", "profiles", multiple=True, default=("chat", "batch"), show_default=True,
              help="Traffic profile (chat: scored by median TPOT; batch: by output tok/s) or a .toml file; "
                   "repeat for several.")
@click.option("--k", "k_list", default=None, metavar="K1,K2,...",
              help="num_draft_tokens values to sweep (0 = speculation off, the baseline). "
                   "Default: 0,1,2,4,6 up to the engine's max_draft_len.")
@click.option("--proposer", "proposers", default="draft,ngram", show_default=True,
              help="Proposers to sweep (draft, ngram); swept only if the deployment lets a request choose.")
@click.option("--url", default=None,
              help="Triton HTTP endpoint (default: the server `specbuild serve` started from --workdir, "
                   "else http://127.0.0.1:8000).")
@click.option("--metrics-url", default=None,
              help="Triton metrics endpoint (default: the served one, else the --url host, port 8002).")
@click.option("--tokenizer", type=click.Path(resolve_path=True, exists=True, file_okay=False), default=None,
              help="Target tokenizer dir (default: the deployment's, found through --workdir).")
@click.option("--duration", type=float, default=15.0, show_default=True,
              help="Seconds of load per setting (a minimum: see --min-requests).")
@click.option("--min-requests", type=int, default=None,
              help="Requests each setting must complete before its run ends (default: the profile's).")
@click.option("--users", type=int, default=None, help="Concurrent users (default: each profile's own).")
@click.option("--max-tokens", type=int, default=None, help="Output tokens per request (default: the profile's).")
@click.option("--apply/--no-apply", default=False, show_default=True,
              help="Write the best setting as the policy in <workdir>/engines/engine_config.json (the "
                   "engine's defaults; a re-deploy keeps it); restart to use it.")
@click.option("--out", type=click.Path(resolve_path=True, file_okay=False), default=None,
              help="Output directory for tune.json, tune.md and runs/ (default: <workdir>/tune).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompt draw.")
def tune_command(workdir, profiles, k_list, proposers, url, metrics_url, tokenizer, duration, min_requests, users,
                 max_tokens, apply, out, seed):
    """Find the best K (num_draft_tokens) and proposer per traffic profile.

    Runs one short Locust load test per profile x setting against the running deployment, scores
    each profile (chat: median TPOT, batch: output tok/s), writes OUT/tune.json and OUT/tune.md,
    and with --apply sets the deployment's default K and proposer (restart the server after).
    Exit code 3 when no setting of a profile completed without errors.

    \b
    Example:
      specbuild serve --workdir work --background
      specbuild tune --workdir work --profile chat --profile batch --k 0,2,4 --duration 15 --apply
      specbuild stop --workdir work && specbuild serve --workdir work --background
    """
    from specbuild.pipeline.tune import TuneConfig, parse_k_list, tune

    cfg = TuneConfig(workdir=Path(workdir), profiles=tuple(profiles),
                     ks=parse_k_list(k_list) if k_list is not None else None,
                     proposers=tuple(p.strip() for p in proposers.split(",") if p.strip()), url=url,
                     metrics_url=metrics_url, tokenizer=tokenizer, duration=duration, min_requests=min_requests,
                     users=users,
                     max_tokens=max_tokens, apply=apply, out=Path(out) if out else None, seed=seed)
    result = tune(cfg, progress=lambda msg: click.echo(msg, err=True), show_bar=True)
    for name, prof in result["profiles"].items():
        click.echo(f"{name}: best {prof['winner']['label']} ({prof['objective']['metric']} "
                   f"{prof['winner']['score']:.2f})")
    if result["applied"]:
        click.echo(f"default {result['default']['label']} written to {result['applied']['config']}; "
                   f"restart to apply: {result['applied']['restart']}")
