"""`specbuild loadtest`: Locust chat/batch profiles against a running deployment, speculation on vs off."""

from __future__ import annotations

import re
from pathlib import Path

import click

from specbuild.cli.options import (api_option, lengths_option, prompts_format_option, prompts_option,
                                   request_rate_option, sweep_option, workdir_option)


@click.command("loadtest")
@click.option("--profile", "profiles", multiple=True, default=("chat",), show_default=True,
              help="Traffic profile: a built-in name (chat, batch) or a .toml file; repeat for several.")
@click.option("--compare", default=None, metavar="NAME=V1,V2",
              help="One run per value of a request field, the first is the baseline, e.g. "
                   "num_draft_tokens=0,4 (0 = speculation off). Default: one run as deployed.")
@click.option("--setting", "settings", multiple=True, metavar="NAME:FIELD=V[,FIELD=V]",
              help="A named set of request fields, one run each; repeat to compare (the first is the baseline), "
                   "e.g. --setting off:num_draft_tokens=0 --setting ngram:num_draft_tokens=4,proposer=ngram; "
                   "one alone measures that configuration. Exclusive with --compare.")
@sweep_option
@click.option("--ramp", is_flag=True, default=False,
              help="With --sweep: run its values up, then back down (--sweep users=1,2,4,8 --ramp = "
                   "users=1,2,4,8,4,2,1, a rising then falling load; values that come back, as in that list, "
                   "are a ramp too). The report shows each point in time order with the policy's decision and "
                   "flags a stall or a throughput dip where the load crosses the cut-off.")
@api_option
@click.option("--url", default=None,
              help="Triton HTTP endpoint, or with --api openai-* the server's base URL (a --setting may name its "
                   "own: url=...). Default: the server `specbuild serve` started in --workdir (its gRPC and "
                   "metrics ports too), else http://127.0.0.1:8000.")
@click.option("--grpc-url", default=None, help="Triton gRPC host:port (default: the --url host, port 8001).")
@click.option("--metrics-url", default=None,
              help="Prometheus metrics endpoint (default: the --url host, port 8002, /metrics; with --api openai-*: "
                   "<url>/metrics); '' to skip.")
@click.option("--model", default=None,
              help="Client-facing model (default: tensorrt_llm_bls when comparing num_draft_tokens, else ensemble); "
                   "with --api openai-*: the request's model field (default: the first of the server's /v1/models).")
@click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True,
              help="http: /generate_stream (SSE) and /generate; grpc: tritonclient streaming.")
@click.option("--tokenizer", type=click.Path(resolve_path=True, exists=True), default=None,
              help="Target tokenizer dir (tokenizer.json) for counting output tokens "
                   "(default: the deployment's, found through --workdir).")
@workdir_option
@click.option("--out", type=click.Path(resolve_path=True, file_okay=False), default="report", show_default=True,
              help="Report directory (report.json, report.md, PNG plots, runs/ with Locust CSVs).")
@click.option("--users", type=int, default=None, help="Override every profile's concurrent users.")
@request_rate_option
@prompts_option
@prompts_format_option
@lengths_option
@click.option("--duration", type=float, default=None,
              help="Override every profile's seconds of load per run (a minimum: see --min-requests).")
@click.option("--min-requests", type=int, default=None,
              help="Override every profile's min_requests: a run goes on past --duration until this many "
                   "requests completed (chat 10, batch 16).")
@click.option("--max-duration", type=float, default=None,
              help="Hard ceiling of one run in seconds (default max(4 x duration, duration + 60)); a setting "
                   "short of --min-requests by then is reported as \"too slow to measure here\".")
@click.option("--max-tokens", type=int, default=None, help="Override every profile's output tokens per request.")
@click.option("--max-input-tokens", type=int, default=None,
              help="Override every profile's prompt length cap (tokens); prompts are also cut to fit the "
                   "engine's max_seq_len when --workdir holds the deployment.")
@click.option("--max-p95-ttft-ms", type=float, default=None, help="SLO gate: fail if p95 TTFT exceeds this (ms).")
@click.option("--max-p95-tpot-ms", type=float, default=None, help="SLO gate: fail if p95 TPOT exceeds this (ms).")
@click.option("--max-error-rate", type=float, default=None,
              help="SLO gate: fail if the failed fraction of requests exceeds this (0.01 = 1%).")
@click.option("--workers", type=int, default=0, show_default=True,
              help="Locust distributed mode: one master plus this many worker processes (0 = one process).")
@click.option("--kubernetes", is_flag=True, default=False,
              help="Write the load test for the cluster instead of running it: per planned run, a Locust master "
                   "Job and a Job of --workers workers (default 2) against the Service of `deploy --kubernetes` in "
                   "--workdir, under OUT/ with README.txt; the pre-flight and smoke requests still go to --url "
                   "(e.g. a kubectl port-forward of that Service).")
@click.option("--cross-check", is_flag=True, default=False,
              help="After each run, measure the same traffic with an independent asyncio+httpx client "
                   "and report the TTFT / e2e median ratios.")
@click.option("--stop-timeout", type=float, default=5.0, show_default=True,
              help="Seconds in-flight requests may take to finish when a run's duration is over.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompt draw.")
def loadtest_command(profiles, compare, settings, sweep, ramp, api, url, grpc_url, metrics_url, model, protocol, tokenizer,
                     workdir, out, users, request_rate, prompts, prompts_format, lengths, duration, min_requests,
                     max_duration, max_tokens, max_input_tokens, max_p95_ttft_ms, max_p95_tpot_ms, max_error_rate,
                     workers, kubernetes, cross_check, stop_timeout, seed):
    """Load-test a running deployment with Locust and write one report.

    Runs headless Locust once per profile x (sweep point x) setting (--compare value or --setting), each
    until both its duration has passed and --min-requests requests completed (or its ceiling: "too slow
    to measure here"), scrapes the server's metrics before and after, and writes OUT/report.json,
    OUT/report.md, OUT/summary.csv, OUT/profile_export_genai_perf.json and
    OUT/profile_export_aiperf.{json,csv} (GenAI-Perf's and AIPerf's names) and PNG plots
    (TTFT/ITL/e2e distributions, throughput; with --sweep the gain by load and the Pareto plot). The
    report is written whatever happens. Exit code 3 when an SLO gate fails, 4 when the server stopped
    answering, 1 when a run produced nothing, 130 on Ctrl-C.

    \b
    Example:
      specbuild serve --workdir work --background
      specbuild loadtest --workdir work --profile chat --profile batch \\
          --compare num_draft_tokens=0,4 --duration 60 --out report/
      specbuild loadtest --workdir work --profile chat --setting off:num_draft_tokens=0 \\
          --setting draft:num_draft_tokens=4,proposer=draft --setting ngram:num_draft_tokens=4,proposer=ngram
      specbuild loadtest --tokenizer ./target --profile chat --users 1 --duration 10 \\
          --max-p95-ttft-ms 500 --max-error-rate 0.01
      specbuild loadtest --workdir work --profile chat --profile batch --sweep users=1,2,4,8 \\
          --setting off:num_draft_tokens=0 --setting policy:default --setting draft:num_draft_tokens=4
      specbuild loadtest --workdir work --profile chat --sweep users=1,2,4,8 --ramp
      specbuild loadtest --api openai-completions --tokenizer ./target --profile chat --sweep users=1,2,4 \\
          --setting off:url=http://127.0.0.1:8080 --setting draft:url=http://127.0.0.1:8081
      specbuild loadtest --api openai-chat --url http://127.0.0.1:8080 --tokenizer ./target \\
          --prompts sharegpt.json --lengths data --request-rate 2
      kubectl port-forward svc/specbuild 8000 8001 8002 &   # after deploy --kubernetes, in the cluster
      specbuild loadtest --workdir work --profile batch --users 64 --workers 4 --kubernetes --out lt-k8s
    """
    from specbuild.pipeline.loadtest import LoadtestConfig, loadtest, loadtest_in_cluster
    from specbuild.pipeline.serve import endpoints

    if api == "kserve":
        where = endpoints(workdir, url, grpc_url, metrics_url)
        url, grpc_url, metrics_url = where.http, where.grpc, where.metrics
    elif url is None:   # the first setting's own url= is the base endpoint
        named = [m.group(1) for s in settings if (m := re.search(r"[:,]\s*url\s*=\s*([^,]+)", s))]
        if not named:
            raise click.UsageError(f"--api {api} needs --url (the server's base URL, e.g. http://127.0.0.1:8080) "
                                   "or a url=... in a --setting.")
        url = named[0].strip()

    cfg = LoadtestConfig(profiles=tuple(profiles), compare=compare, settings=tuple(settings), url=url.rstrip("/"), grpc_url=grpc_url,
                         metrics_url=metrics_url, model=model, protocol=protocol, tokenizer=tokenizer,
                         workdir=Path(workdir), out=Path(out), users=users, duration=duration,
                         min_requests=min_requests, max_duration=max_duration, max_tokens=max_tokens,
                         max_input_tokens=max_input_tokens,
                         max_p95_ttft_ms=max_p95_ttft_ms, max_p95_tpot_ms=max_p95_tpot_ms,
                         max_error_rate=max_error_rate, workers=workers, cross_check=cross_check,
                         stop_timeout=stop_timeout, seed=seed, progress_bar=True, api=api, sweep=tuple(sweep), ramp=ramp,
                         request_rate=request_rate, prompts=Path(prompts) if prompts else None,
                         prompts_format=prompts_format, lengths=lengths)
    (loadtest_in_cluster if kubernetes else loadtest)(cfg, progress=lambda msg: click.echo(msg, err=True))
