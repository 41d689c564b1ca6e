"""`make verify-llamacpp`: `specbuild verify --api openai-completions` against llama.cpp's llama-server, a
speculative server nobody here wrote, and a control.

  speculative vs reference  llama-server with its draft-model speculation (F32 target, its Q4_1 GGUF as the draft,
                            --spec-draft-n-max K) against llama-server without a draft (the same F32 target)
  control                   llama-server without a draft against a second one without a draft (must pass)

Both greedy (temperature 0, top_k 1, a seed), the same max_tokens, the same prompts, each prompt in the target's
chat template (--raw: as it is, a plain completion); optionally the distribution test over seeds (--seeds). One
request at a time by default (--concurrency). Needs `make llamacpp` (build 11434). The servers run one thread each
on 127.0.0.1 (see docs/loadtests.md, "Threads on a shared machine") and are stopped by their own PIDs. Writes OUT/{speculative,control}.json (verify's reports), OUT/*.log and OUT/summary.json.

    .venv/bin/python bench/verify_llamacpp.py --raw --out bench/results/verify-llamacpp
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from specbuild.core.manifest import atomic_write_text
from specbuild.loadtests import llamacpp

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize in one sentence: The meeting covered the budget, hiring plans and the roadmap for next year.",
    "List three colors of the rainbow.",
    "Translate to French: I would like a cup of coffee, please.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the difference between TCP and UDP?",
    "Give me three tips for writing clear commit messages.",
    "Why is the sky blue during the day?",
)


def run_verify(spec_url: str, ref_url: str, out: Path, args) -> dict:
    argv = [sys.executable, "-m", "specbuild.cli.main", "verify", "--api", "openai-completions", "--url", spec_url,
            "--reference-url", ref_url, "--tokenizer", str(llamacpp.tokenizer_dir()), "--max-tokens",
            str(args.tokens), "--seeds", str(args.seeds), "--positions", str(args.positions),
            "--concurrency", str(args.concurrency), "--out", str(out)] + (["--raw"] if args.raw else [])
    for p in PROMPTS[:args.prompts]:
        argv += ["--prompt", p]
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    print(done.stdout, file=sys.stderr)
    report = json.loads(out.read_text()) if out.is_file() else None
    return {"exit_code": done.returncode, "seconds": round(time.monotonic() - t0, 1), "stdout": done.stdout,
            "stderr_tail": done.stderr[-2000:], "report": report}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=8, help="the draft's --spec-draft-n-max (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=96, help="max_tokens per greedy comparison (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--seeds", type=int, default=0, help="samples per side for the distribution test (0: greedy only)")
    ap.add_argument("--positions", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="verify's requests in flight (default: %(default)s: the target never batches two requests "
                         "together, so a divergence is the draft's doing, not the server's batch variance)")
    ap.add_argument("--parallel", type=int, default=4, help="llama-server -np: its slots (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--raw", action="store_true", help="send the prompts as they are (default: in the chat template)")
    ap.add_argument("--no-control", action="store_true", help="skip the control (no draft on both sides)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/verify-llamacpp"))
    args = ap.parse_args()
    if llamacpp.missing():
        raise SystemExit(llamacpp.missing())
    args.out.mkdir(parents=True, exist_ok=True)
    f32, q4 = llamacpp.model(llamacpp.TARGET_GGUF), llamacpp.model(llamacpp.DRAFT_GGUF)
    common = dict(threads=args.threads, parallel=args.parallel, ctx=1024 * args.parallel)
    servers = {"reference": llamacpp.LlamaServer(target=f32, log=args.out / "reference.log", **common),
               "speculative": llamacpp.LlamaServer(target=f32, draft=q4, draft_max=args.k,
                                                   log=args.out / "speculative.log", **common)}
    if not args.no_control:
        servers["control"] = llamacpp.LlamaServer(target=f32, log=args.out / "control.log", **common)
    summary = {"llamacpp": json.loads((llamacpp.install_dir() / "BUILD.json").read_text()).get("package"),
               "target": f32.name, "draft": q4.name, "k": args.k, "max_tokens": args.tokens,
               "prompts": list(PROMPTS[:args.prompts]), "seeds": args.seeds, "raw": args.raw,
               "concurrency": args.concurrency,
               "parallel": args.parallel, "threads": args.threads,
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": {}}
    try:
        for s in servers.values():
            s.start()
        summary["runs"]["speculative"] = run_verify(servers["speculative"].url, servers["reference"].url,
                                                    args.out / "speculative.json", args)
        if "control" in servers:
            summary["runs"]["control"] = run_verify(servers["control"].url, servers["reference"].url,
                                                    args.out / "control.json", args)
    finally:
        for s in servers.values():
            s.stop()
    for name, r in summary["runs"].items():
        greedy = (r["report"] or {}).get("greedy") or []
        r["identical"] = sum(c["identical"] for c in greedy)
        r["diverging"] = [{k: c[k] for k in ("prompt", "first_divergence", "first_divergence_char", "common_tail",
                                             "spec_continuation", "plain_continuation")}
                          for c in greedy if not c["identical"]]
        print(f"{name}: exit {r['exit_code']}, {r['identical']} of {len(greedy)} identical, {r['seconds']} s",
              file=sys.stderr)
    atomic_write_text(args.out / "summary.json", json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
