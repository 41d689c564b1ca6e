"""`make bench-anchor`: the embedded engine beside llama.cpp on the same machine, model and precisions, one table.

Measured in one process, interleaved (each run does every method on every prompt, back to back, so a burst of
load from other processes hits all of them alike), greedy, the same number of new tokens (EOS ignored), the same
thread count:

  llama.cpp plain        llama-completion, the F32 GGUF (every tensor dequantized: the demo's fp32 weights)
  llama.cpp speculative  llama-speculative-simple, F32 target + the Q4_1 GGUF as its draft, K = --k-llamacpp
  ours plain             the embedded engine (fp32 target, the fused decode step where built), speculation off
  ours speculative       the int4 self-draft (the GGUF's own Q4_1 / Q8_0 blocks), K fixed and adaptive

Decode tok/s after the first token for both (llama.cpp's "decoded N tokens in S seconds"; ours from the request's
token times); the prompt is the same text (llama.cpp tokenizes it itself with the same tokenizer). Needs
`make llamacpp` (llama.cpp 11434 built once into $SPECBUILD_CACHE). Medians over --runs x 3 prompts; ratios are
taken per (run, prompt) pair and then the median.

    .venv/bin/python bench/bench_anchor.py --runs 3 --out bench/results/anchor.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import specbuild  # noqa: F401  (before torch: it sets torch's OpenMP wait policy, ./__init__.py)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import KINDS, engine_dir, log, prompts  # noqa: E402  (the same build recipe and prompts)

from specbuild.engines.embedded import Engine, EngineConfig, SamplingParams  # noqa: E402
from specbuild.core.paths import cache_dir  # noqa: E402
from specbuild.core.machine import describe, foreign_env  # noqa: E402
from specbuild.engines.embedded.fused import status as fused_status  # noqa: E402
from specbuild.engines.embedded.step import linear_kernel_of  # noqa: E402

LLAMACPP = "llama.cpp-11434"
_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds")
_ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")
_EVAL = re.compile(r"eval time =\s+([\d.]+) ms /\s+(\d+) runs")


def llamacpp_dir() -> Path:
    d = cache_dir() / LLAMACPP
    if not (d / "BUILD.json").is_file():
        raise SystemExit(f"llama.cpp is not built in {d}: run `make llamacpp` first (~8 minutes, once).")
    return d


def llama_plain(d: Path, prompt: str, tokens: int, threads: int) -> float:
    """Decode tok/s of llama-completion on the F32 GGUF (its own eval timing: generation after the prompt)."""
    out = subprocess.run([str(d / "bin" / "llama-completion"), "-m", str(d / "models" / "SmolLM2-135M-Instruct.F32.gguf"),
                          "-p", prompt, "-n", str(tokens), "--temp", "0", "--ignore-eos", "-no-cnv", "-t", str(threads),
                          "--no-warmup", "--seed", "1", "--no-display-prompt"],
                         capture_output=True, text=True, timeout=600, env=foreign_env())
    lines = [ln for ln in out.stderr.splitlines() if "eval time" in ln and "prompt eval" not in ln]
    m = _EVAL.search(lines[-1]) if lines else None
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"llama-completion failed ({out.returncode}): {out.stderr[-800:]}")
    ms, n = float(m.group(1)), int(m.group(2))
    return n / (ms / 1000.0)


def llama_spec(d: Path, prompt: str, tokens: int, threads: int, k: int) -> tuple[float, float]:
    """(decode tok/s, acceptance) of llama-speculative-simple: F32 target, Q4_1 draft, K drafts per round."""
    models = d / "models"
    out = subprocess.run([str(d / "bin" / "llama-speculative-simple"),
                          "-m", str(models / "SmolLM2-135M-Instruct.F32.gguf"),
                          "-md", str(models / "SmolLM2-135M-Instruct.Q4_1.gguf"), "--spec-type", "draft-simple",
                          "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "-p", prompt, "-n", str(tokens),
                          "--temp", "0", "--ignore-eos", "-t", str(threads), "-td", str(threads), "--seed", "1"],
                         capture_output=True, text=True, timeout=600, env=foreign_env())
    text = out.stdout + out.stderr
    m, a = _DECODED.search(text), _ACCEPT.search(text)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"llama-speculative-simple failed ({out.returncode}): {text[-800:]}")
    return int(m.group(1)) / float(m.group(2)), (float(a.group(1)) / 100 if a else float("nan"))


def ours(engine: Engine, ids: list[int], tokens: int, k) -> tuple[float, float | None]:
    """(decode tok/s after the first token, acceptance rate) of one greedy request."""
    out = engine.generate(ids, SamplingParams(max_tokens=tokens, ignore_eos=True), num_draft_tokens=k,
                          proposer=None if k == 0 else "draft")
    st = out.stats
    span = st.last_token_time - st.first_token_time
    return (st.generated_tokens - 1) / span, (st.acceptance_rate if st.num_draft_tokens else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/anchor.json", help="JSON output (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs x 3 prompts (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default: %(default)s)")
    ap.add_argument("--k", type=int, default=8, help="our fixed K (default: %(default)s)")
    ap.add_argument("--k-llamacpp", type=int, default=8, help="llama.cpp's --spec-draft-n-max (default: %(default)s)")
    ap.add_argument("--workdir", default=None, help="build workspace (default: $SPECBUILD_CACHE/bench-work)")
    args = ap.parse_args(argv)
    d = llamacpp_dir()
    torch.set_num_threads(args.threads)
    t_start, load_before = time.time(), os.getloadavg()
    log("building the engine with the int4 self-draft (no-op when up to date)")
    edir = engine_dir(Path(args.workdir) if args.workdir else cache_dir() / "bench-work", quantize="int4",
                      max_draft_len=max(args.k, 8))
    engine = Engine.from_build_dir(edir, threads=args.threads)
    log(f"decode step: {engine.decode_step}; draft: {EngineConfig.load(edir).draft_format}")
    ids = prompts(engine.tokenizer)
    texts = {kind: engine.tokenizer.decode(p) for kind, p in ids.items()}
    methods = ("llama_plain", "llama_spec", "ours_plain", "ours_spec", "ours_adaptive")
    raw = {m: {kind: [] for kind in KINDS} for m in methods}
    acc = {m: [] for m in ("llama_spec", "ours_spec", "ours_adaptive")}
    engine.generate(ids["chat"], SamplingParams(max_tokens=8, ignore_eos=True), num_draft_tokens=2)   # warm-up
    for r in range(args.runs):
        for kind in KINDS:
            raw["llama_plain"][kind].append(llama_plain(d, texts[kind], args.tokens, args.threads))
            tps, a = llama_spec(d, texts[kind], args.tokens, args.threads, args.k_llamacpp)
            raw["llama_spec"][kind].append(tps)
            acc["llama_spec"].append(a)
            raw["ours_plain"][kind].append(ours(engine, ids[kind], args.tokens, 0)[0])
            for m, k in (("ours_spec", args.k), ("ours_adaptive", -1)):
                tps, a = ours(engine, ids[kind], args.tokens, k)
                raw[m][kind].append(tps)
                acc[m].append(a)
            log(f"run {r + 1}/{args.runs} {kind}: " + ", ".join(f"{m} {raw[m][kind][-1]:.1f}" for m in methods)
                + " tok/s")
    result = summarize(raw, acc, args)
    result.update(machine=describe(), kernels={"decode_step": engine.decode_step, "linear_kernel": linear_kernel_of(engine.target),
                           "fused_extension": fused_status()}, cpu_count=os.cpu_count(),
                  cpu_flags=_cpu_flags(), load_avg_before=load_before, load_avg_after=os.getloadavg(),
                  seconds=time.time() - t_start, decode_step=engine.decode_step,
                  llamacpp=json.loads((d / "BUILD.json").read_text()).get("package"),
                  calibration=EngineConfig.load(edir).calibration, raw=raw)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


def summarize(raw: dict, acc: dict, args) -> dict:
    def med(m):
        return statistics.median(x for kind in KINDS for x in raw[m][kind])

    def ratio(a, b):
        return statistics.median(x / y for kind in KINDS for x, y in zip(raw[a][kind], raw[b][kind]))

    def acc_med(m):
        xs = [a for a in acc[m] if a is not None and a == a]
        return statistics.median(xs) if xs else None

    return {"runs": args.runs, "tokens": args.tokens, "threads": args.threads, "k": args.k,
            "k_llamacpp": args.k_llamacpp, "prompts": list(KINDS),
            "tok_s": {m: med(m) for m in raw},
            "ours_plain_vs_llama_plain": ratio("ours_plain", "llama_plain"),
            "llama_spec_speedup": ratio("llama_spec", "llama_plain"),
            "ours_spec_speedup": ratio("ours_spec", "ours_plain"),
            "ours_adaptive_speedup": ratio("ours_adaptive", "ours_plain"),
            "ours_spec_vs_llama_spec": ratio("ours_spec", "llama_spec"),
            "acceptance": {m: acc_med(m) for m in acc}}


def _cpu_flags() -> list[str]:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]


def print_table(r: dict) -> None:
    t, a = r["tok_s"], r["acceptance"]
    print(f"SmolLM2-135M-Instruct, {r['runs']} runs x 3 prompts, {r['tokens']} tokens, {r['threads']} threads, "
          f"decode tok/s (medians); {', '.join(r['cpu_flags'])}; load {r['load_avg_before'][0]:.1f} -> "
          f"{r['load_avg_after'][0]:.1f}")
    rows = [("llama.cpp F32, plain", t["llama_plain"], "1.00x", "-"),
            (f"llama.cpp F32 + Q4_1 draft, K={r['k_llamacpp']}", t["llama_spec"], f"{r['llama_spec_speedup']:.2f}x",
             f"{a['llama_spec']:.2f}" if a["llama_spec"] is not None else "-"),
            ("ours fp32, plain", t["ours_plain"], f"{r['ours_plain_vs_llama_plain']:.2f}x llama.cpp", "-"),
            (f"ours fp32 + int4 self-draft, K={r['k']}", t["ours_spec"], f"{r['ours_spec_speedup']:.2f}x",
             f"{a['ours_spec']:.2f}" if a["ours_spec"] is not None else "-"),
            ("ours fp32 + int4 self-draft, adaptive K", t["ours_adaptive"], f"{r['ours_adaptive_speedup']:.2f}x",
             f"{a['ours_adaptive']:.2f}" if a["ours_adaptive"] is not None else "-")]
    print(f"  {'method':44s} {'tok/s':>7s}  {'vs plain':>18s}  {'acceptance':>10s}")
    for name, tps, ratio, acc in rows:
        print(f"  {name:44s} {tps:7.1f}  {ratio:>18s}  {acc:>10s}")
    print(f"  ours speculative vs llama.cpp speculative: {r['ours_spec_vs_llama_spec']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
