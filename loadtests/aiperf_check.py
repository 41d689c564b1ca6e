"""The AIPerf cross-check: AIPerf and `specbuild loadtest` on the same server, the same prompts and the same
load, each measured with the server and the load generator on separate cores; their medians side by side,
and what each client cost in CPU.

    python -m specbuild.loadtests.aiperf_check --aiperf /tmp/aiperf-venv/bin/aiperf --out /tmp/xcheck \\
        [--server-cpus 0 --client-cpus 1] [--concurrency 2] [--requests 40] [--rounds 2]

It starts llama.cpp's `llama-server` (`make llamacpp`) on the demo model pinned to `--server-cpus`
(`taskset`, one thread), writes the prompts once as a JSONL input file (AIPerf's `single_turn` shape, which
`--prompts` reads too), and alternates AIPerf, specbuild and (with `--aiperf-workers N`) AIPerf with N
workers and one record processor, `--rounds` times, pinned to `--client-cpus`: closed loop at
`--concurrency`, streaming `/v1/completions`, `--output-tokens` per request forced (`ignore_eos` +
`min_tokens`, `max_tokens` sent by both), output tokens counted client-side with the same tokenizer. Each
tool's CPU is its process tree's user + system time over its wall time (resource usage of waited-for
children). With `--together`, each round runs AIPerf and specbuild at the same time instead, each with half the
concurrency: both then measure the same server at the same moments, whose speed varies between runs on a VM
(each tool's CPU from `os.wait4`). Beside each run, the server's own decode time per token over that run (llama.cpp's
`tokens_predicted_seconds_total` / `tokens_predicted_total`): the clients agree on what the server did
when their TPOT / server ratios agree, whatever the machine did between runs. Writes
`<out>/crosscheck.json` and `<out>/crosscheck.md`.

AIPerf is not a dependency of specbuild: install it in a throwaway venv (`python -m venv /tmp/aiperf-venv &&
/tmp/aiperf-venv/bin/pip install aiperf==0.13.0`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specbuild.core import http
from specbuild.loadtests import llamacpp

METRICS = (("TTFT p50 (ms)", "time_to_first_token", "ttft_ms"),
           ("ITL p50 (ms) = TPOT", "inter_token_latency", "tpot_ms"),
           ("e2e p50 (ms)", "request_latency", "e2e_ms"),
           ("output tok/s", "output_token_throughput", "tokens_per_s"))


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _server_counters(url: str) -> dict[str, float]:
    from specbuild.core.metrics import parse_prometheus

    return parse_prometheus(http.get(f"{url}/metrics", timeout=10).text)


def _server_side(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The server's own decode time per generated token over the run (llama.cpp's counters): what the server
    did, whoever measured it."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    tokens, seconds = d.get("llamacpp:tokens_predicted_total"), d.get("llamacpp:tokens_predicted_seconds_total")
    return {"decode_ms_per_token": 1000 * seconds / tokens if tokens else None, "tokens": tokens}


def _timed(argv: list[str], log: Path, url: str) -> dict[str, Any]:
    before = _server_counters(url)
    cpu0, t0 = _children_cpu(), time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}")
    return {"wall_s": wall, "cpu_s": cpu, "cores": cpu / wall, "server": _server_side(before, _server_counters(url))}


def write_inputs(path: Path, n: int, output_tokens: int) -> Path:
    from specbuild.loadtests.promptsets import chat_prompts

    prompts = chat_prompts()
    path.write_text("".join(json.dumps({"text": prompts[i % len(prompts)], "output_length": output_tokens}) + "\n"
                            for i in range(n)))
    return path


def aiperf_argv(aiperf: str, url: str, inputs: Path, out: Path, *, cpus: str, concurrency: int, requests: int,
                output_tokens: int, workers: int | None = None) -> list[str]:
    argv = ["taskset", "-c", cpus, aiperf, "profile", "--model", "smollm2", "--url", url,
            "--endpoint-type", "completions", "--streaming", "--input-file", str(inputs),
            "--custom-dataset-type", "single_turn", "--concurrency", str(concurrency),
            "--request-count", str(requests), "--warmup-request-count", str(concurrency),
            "--tokenizer", str(llamacpp.tokenizer_dir()), "--use-legacy-max-tokens",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{output_tokens}",
            "--prompt-output-tokens-mean", str(output_tokens), "--output-artifact-dir", str(out),
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--random-seed", "0"]
    if workers:   # AIPerf's own processes: fewer workers and record processors cost less CPU
        argv += ["--workers-max", str(workers), "--record-processor-service-count", "1"]
    return argv


def aiperf_figures(out: Path, tool: str) -> dict[str, Any]:
    export = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    figures = {key: (export.get(tag) or {}).get("p50" if tag != "output_token_throughput" else "avg")
               for _, tag, key in METRICS}
    return {"tool": tool, "requests": (export.get("request_count") or {}).get("avg"), **figures}


def run_aiperf(aiperf: str, url: str, inputs: Path, out: Path, *, workers: int | None = None,
               **kw: Any) -> dict[str, Any]:
    argv = aiperf_argv(aiperf, url, inputs, out, workers=workers, **kw)
    cost = _timed(argv, out.with_suffix(".log"), url)
    return {**aiperf_figures(out, "aiperf" if not workers else f"aiperf-{workers}w"), "client": cost, "argv": argv}


def specbuild_argv(url: str, inputs: Path, out: Path, *, cpus: str, concurrency: int, requests: int,
                   output_tokens: int) -> list[str]:
    profile = out.parent / f"{out.name}.toml"
    # As AIPerf's --request-count: the run ends once `requests` completed (its ceiling far away)
    profile.write_text(f'name = "xcheck"\nusers = {concurrency}\nduration = 1\nmin_requests = {requests}\n'
                       f'max_duration = 1800\nstream = true\nmax_tokens = {output_tokens}\nprompt_set = "chat"\n'
                       'wait_time = [0.0, 0.0]\nchat_template = false\nfixed_output = true\n'
                       'return_perf_metrics = false\n')
    return ["taskset", "-c", cpus, sys.executable, "-m", "specbuild.cli.main", "loadtest",
            "--api", "openai-completions", "--url", url, "--metrics-url", "", "--tokenizer",
            str(llamacpp.tokenizer_dir()), "--profile", str(profile), "--prompts", str(inputs), "--lengths", "data",
            "--out", str(out)]


def specbuild_figures(out: Path) -> dict[str, Any]:
    [cell] = json.loads((out / "report.json").read_text())["cells"]
    figures = {key: (cell[key] or {}).get("p50") if key != "tokens_per_s" else cell[key] for _, _, key in METRICS}
    return {"tool": "specbuild", "requests": cell["requests"], **figures, "locust_cpu": cell.get("client_cpu")}


def run_specbuild(url: str, inputs: Path, out: Path, **kw: Any) -> dict[str, Any]:
    argv = specbuild_argv(url, inputs, out, **kw)
    cost = _timed(argv, out.with_suffix(".log"), url)
    return {**specbuild_figures(out), "client": cost, "argv": argv}


def run_together(jobs: list[tuple[list[str], Path]], url: str) -> list[dict[str, Any]]:
    """Start every job at once against the same server (each with its share of the load) and wait for all:
    the tools measure the same server at the same moments, so its speed cannot differ between them. Each
    job's own CPU (os.wait4's resource usage) and wall time; the server's counters over the whole window."""
    before, t0 = _server_counters(url), time.monotonic()
    running = {}
    for argv, log in jobs:
        f = open(log, "w")
        running[subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT).pid] = (argv, log, f)
    done: dict[int, dict[str, Any]] = {}
    while len(done) < len(running):
        for pid, (argv, log, f) in running.items():
            if pid in done:
                continue
            got, status, usage = os.wait4(pid, os.WNOHANG)
            if got:
                f.close()
                code = os.waitstatus_to_exitcode(status)
                if code != 0:
                    raise RuntimeError(f"{argv[3]} exited {code}; see {log}:\n{log.read_text()[-2000:]}")
                wall, cpu = time.monotonic() - t0, usage.ru_utime + usage.ru_stime
                done[pid] = {"wall_s": wall, "cpu_s": cpu, "cores": cpu / wall}
        time.sleep(0.05)
    server = _server_side(before, _server_counters(url))
    return [{**done[pid], "server": server, "together": True} for pid in running]


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per tool; each tool's ratio to AIPerf's, and each tool's TPOT over the server's own
    decode time per token in the same runs (the client's reading of what the server did)."""
    out: dict[str, Any] = {"tools": list(dict.fromkeys(r["tool"] for r in rows))}
    for tool in out["tools"]:
        mine = [r for r in rows if r["tool"] == tool]
        out[tool] = {key: statistics.median(r[key] for r in mine) for _, _, key in METRICS}
        out[tool]["client_cores"] = statistics.median(r["client"]["cores"] for r in mine)
        out[tool]["client_cpu_s_per_request"] = statistics.median(r["client"]["cpu_s"] / r["requests"] for r in mine)
        server = [r["client"]["server"]["decode_ms_per_token"] for r in mine]
        out[tool]["server_decode_ms_per_token"] = statistics.median(server) if None not in server else None
        out[tool]["tpot_over_server"] = statistics.median(
            r["tpot_ms"] / r["client"]["server"]["decode_ms_per_token"] for r in mine) if None not in server else None
        out[tool]["rounds"] = len(mine)
    base = out["tools"][0]
    out["ratio"] = {t: {key: out[t][key] / out[base][key] for _, _, key in METRICS} for t in out["tools"][1:]}
    out["within_5pct"] = {t: {k: abs(r - 1) <= 0.05 for k, r in ratios.items()} for t, ratios in out["ratio"].items()}
    return out


def markdown(result: dict[str, Any]) -> str:
    c = result["comparison"]
    tools = c["tools"]
    head = " | ".join(f"{t} ({result['aiperf_version']})" if t.startswith("aiperf") else "specbuild loadtest"
                      for t in tools)
    lines = [f"| metric (median of {c[tools[0]]['rounds']} rounds) | {head} | "
             + " | ".join(f"{t} / {tools[0]}" for t in tools[1:]) + " |",
             "|" + "---|" * (1 + 2 * len(tools) - 1)]
    for label, _, key in METRICS:
        lines.append(f"| {label} | " + " | ".join(f"{c[t][key]:.1f}" for t in tools) + " | "
                     + " | ".join(f"{c['ratio'][t][key]:.3f}" for t in tools[1:]) + " |")
    for label, key, fmt in (("server's own decode ms / token (llama.cpp counters)", "server_decode_ms_per_token",
                             "{:.1f}"), ("client TPOT / server decode time", "tpot_over_server", "{:.3f}"),
                            ("client CPU, cores (whole process tree, wall)", "client_cores", "{:.2f}"),
                            ("client CPU s per request", "client_cpu_s_per_request", "{:.3f}")):
        lines.append(f"| {label} | " + " | ".join("-" if c[t][key] is None else fmt.format(c[t][key]) for t in tools)
                     + " |" + " |" * (len(tools) - 1))
    return "\n".join(lines) + "\n"


def _round_together(args, url: str, inputs: Path, i: int, kw: dict[str, Any]) -> list[dict[str, Any]]:
    half = {**kw, "concurrency": max(1, kw["concurrency"] // 2)}
    a_out, s_out = args.out / f"together-aiperf-{i}", args.out / f"together-specbuild-{i}"
    a_argv, s_argv = aiperf_argv(args.aiperf, url, inputs, a_out, **half), specbuild_argv(url, inputs, s_out, **half)
    a_cost, s_cost = run_together([(a_argv, a_out.with_suffix(".log")), (s_argv, s_out.with_suffix(".log"))], url)
    return [{**aiperf_figures(a_out, "aiperf"), "client": a_cost, "argv": a_argv},
            {**specbuild_figures(s_out), "client": s_cost, "argv": s_argv}]


def main(argv: list[str] | None = None) -> None:   # pragma: no cover - a measurement, run by hand
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", required=True, help="the aiperf executable (a throwaway venv's)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--server-cpus", default="0")
    ap.add_argument("--client-cpus", default="1")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--aiperf-workers", type=int, default=0,
                    help="also run AIPerf with this many workers and one record processor (0: only its defaults)")
    ap.add_argument("--model", default=llamacpp.DRAFT_GGUF, help="GGUF under the llama.cpp models dir")
    ap.add_argument("--together", action="store_true",
                    help="run AIPerf and specbuild at the same time, each with half of --concurrency, so both "
                         "measure the same server at the same moments (its speed varies between runs on a VM)")
    args = ap.parse_args(argv)
    if llamacpp.missing():
        sys.exit(llamacpp.missing())
    args.out.mkdir(parents=True, exist_ok=True)
    inputs = write_inputs(args.out / "inputs.jsonl", 4 * args.requests, args.output_tokens)
    version = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True).stdout.strip()
    server = llamacpp.LlamaServer(target=llamacpp.model(args.model), parallel=args.concurrency, ctx=2048 * args.concurrency,
                                  cpus=args.server_cpus, log=args.out / "llama-server.log")
    rows = []
    with server:
        for i in range(args.rounds):
            kw = dict(cpus=args.client_cpus, concurrency=args.concurrency, requests=args.requests,
                      output_tokens=args.output_tokens)
            if args.together:
                rows += _round_together(args, server.url, inputs, i, kw)
                print(json.dumps(rows[-2:], default=str)[:3000], flush=True)
                continue
            rows.append(run_aiperf(args.aiperf, server.url, inputs, args.out / f"aiperf-{i}", **kw))
            rows.append(run_specbuild(server.url, inputs, args.out / f"specbuild-{i}", **kw))
            if args.aiperf_workers:
                rows.append(run_aiperf(args.aiperf, server.url, inputs, args.out / f"aiperf-light-{i}",
                                       workers=args.aiperf_workers, **kw))
            print(json.dumps(rows[-3:], default=str)[:3000], flush=True)
    result = {"aiperf_version": version, "server": server.argv(), "machine": {"cpu_count": os.cpu_count()},
              "config": vars(args) | {"out": str(args.out)}, "rows": rows, "comparison": compare(rows)}
    (args.out / "crosscheck.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / "crosscheck.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":  # pragma: no cover
    main()
