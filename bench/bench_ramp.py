"""`make bench-ramp`: the load rising then falling across the policy's cut-off, engine-level (no server), and the
"off by the policy" A/B.

Ramp: closed-loop users on the engine's serving thread (`Engine.start` + `submit`, as the Triton model runs it)
step 1 -> 2 -> 4 -> 8 -> 4 -> 2 -> 1 (users join when the load rises; on the way down, users leave after their
current request). Per step: tok/s over the step's window, TTFT median of the requests sent in it, the engine's own
counters over the window (draft tokens per sequence step = the mean K chosen, the share of steps over the
cut-off, sequences per step) and the longest silence (no token to anyone while requests were in flight). A
throughput dip is flagged as in `loadtests/ramp.py` (below both neighbours by more than 10 %).

A/B: policy-off (requests send no K, the policy's cut-off is 0: never drafts by default) against speculation off
(requests send num_draft_tokens=0), the same closed-loop traffic, interleaved rounds (off, policy-off, off, ...),
the median of the per-round ratios (robust to a shared machine's drifts), and the draft tokens the policy-off
rounds drafted (0 expected).

    .venv/bin/python bench/bench_ramp.py --quick --model tiny --out bench/results/ramp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import specbuild  # noqa: F401  (before torch: it sets torch's OpenMP wait policy, ./__init__.py)
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from specbuild.core.machine import describe  # noqa: E402
from specbuild.engines.embedded import Engine, SamplingParams  # noqa: E402
from specbuild.engines.embedded.config import Policy  # noqa: E402
from specbuild.loadtests.ramp import dips  # noqa: E402

PROMPTS = ["The quick brown fox jumps over", "Speculative decoding drafts tokens with", "Paris is the capital of",
           "def fibonacci(n):", "Triton Inference Server serves", "Summarize the text: the meeting",
           "import os\nimport sys\n", "Berlin is the capital of"]


def build_engine(model: str, threads: int | None) -> tuple[Engine, str]:
    if model == "tiny":
        sys.path.insert(0, str(ROOT.parent / "tests"))
        from tinymodels import make_checkpoint, make_tokenizer

        d = Path(tempfile.mkdtemp(prefix="bench-ramp-"))
        tok = make_tokenizer(d / "tok")
        target = make_checkpoint(d / "target", tok, layers=4, seed=1)
        if threads:
            torch.set_num_threads(threads)
        eng = Engine.from_checkpoints(target, target, max_batch_size=8, max_seq_len=512,
                                      policy=Policy(k="adaptive", max_concurrency=2))
        return eng, "tiny llama (4 layers, hidden 64), self-draft (shared KV), cut-off 2"
    from bench_engine import engine_dir  # the demo recipe: SmolLM2-135M-Instruct, int4 self-draft

    from specbuild.core.paths import cache_dir
    eng = Engine.from_build_dir(engine_dir(cache_dir() / "bench-work"), threads=threads)
    return eng, f"demo:smollm2-135m-instruct int4 self-draft; policy {eng.config.policy.describe()}"


class Traffic:
    """Closed-loop users; records every delta's time and each request's send / first token."""

    def __init__(self, engine: Engine, tokens: int, k=None):
        self.engine, self.k = engine, k
        self.params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        self.lock = threading.Lock()
        self.events: list[tuple[float, int]] = []        # (time, tokens)
        self.requests: list[dict] = []
        self.users: list[threading.Event] = []           # set = that user leaves after its current request
        self.threads: list[threading.Thread] = []
        self.in_flight = 0

    def _user(self, i: int, leave: threading.Event) -> None:
        j = 0
        while not leave.is_set():
            done = threading.Event()
            rec = {"sent": time.perf_counter(), "first": None}

            def on_output(d, rec=rec, done=done):
                now = time.perf_counter()
                with self.lock:
                    if d.token_ids:
                        self.events.append((now, len(d.token_ids)))
                        if rec["first"] is None:
                            rec["first"] = now
                    if d.finished:
                        rec["end"] = now
                        self.in_flight -= 1
                        done.set()

            with self.lock:
                self.in_flight += 1
                self.requests.append(rec)
            self.engine.submit(PROMPTS[(i + j) % len(PROMPTS)], self.params, num_draft_tokens=self.k,
                               on_output=on_output)
            done.wait()
            j += 1

    def set_users(self, n: int) -> None:
        while len([u for u in self.users if not u.is_set()]) < n:
            leave = threading.Event()
            t = threading.Thread(target=self._user, args=(len(self.users), leave), daemon=True)
            self.users.append(leave)
            self.threads.append(t)
            t.start()
        live = [u for u in self.users if not u.is_set()]
        for u in live[n:]:
            u.set()

    def stop(self) -> None:
        for u in self.users:
            u.set()
        for t in self.threads:
            t.join()


def window(tr: Traffic, t0: float, t1: float, m0: dict, m1: dict) -> dict:
    with tr.lock:
        ev = sorted(t for t, _ in tr.events if t0 <= t < t1)
        toks = sum(n for t, n in tr.events if t0 <= t < t1)
        ttft = [r["first"] - r["sent"] for r in tr.requests if t0 <= r["sent"] < t1 and r["first"]]
    gaps = [b - a for a, b in zip([t0] + ev, ev + [t1])]
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in ("draft_tokens_total", "sequence_steps_total", "steps_total",
                                                   "spec_cutoff_steps_total", "accepted_tokens_total")}
    return {"tok_s": toks / (t1 - t0), "tokens": toks, "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else None,
            "longest_silence_s": max(gaps) if gaps else None,
            "draft_tokens_per_step": d["draft_tokens_total"] / d["sequence_steps_total"]
            if d["sequence_steps_total"] else None,
            "cutoff_share": d["spec_cutoff_steps_total"] / d["steps_total"] if d["steps_total"] else None,
            "sequences_per_step": d["sequence_steps_total"] / d["steps_total"] if d["steps_total"] else None}


def ramp(engine: Engine, levels: list[int], step_s: float, tokens: int) -> list[dict]:
    tr = Traffic(engine, tokens)
    out = []
    try:
        for i, n in enumerate(levels):
            tr.set_users(n)
            t0, m0 = time.perf_counter(), engine.metrics()
            time.sleep(step_s)
            row = {"step": i, "users": n, **window(tr, t0, time.perf_counter(), m0, engine.metrics())}
            out.append(row)
            print(f"  step {i} users {n}: {row['tok_s']:.1f} tok/s, K/step {row['draft_tokens_per_step'] or 0:.2f}, "
                  f"cut off {100 * (row['cutoff_share'] or 0):.0f} %", file=sys.stderr, flush=True)
    finally:
        tr.stop()
    for d in dips([r["tok_s"] for r in out]):
        out[d["index"]]["dip_below_by"] = d["below_by"]
    return out


def ab(engine: Engine, users: int, rounds: int, round_s: float, tokens: int) -> dict:
    """policy-off (cut-off 0, no K sent) vs off (K = 0 sent), interleaved; median of per-round ratios."""
    base = engine.config.policy
    res: dict[str, list] = {"off": [], "policy_off": []}
    try:
        for r in range(rounds):
            for mode in ("off", "policy_off") if r % 2 == 0 else ("policy_off", "off"):
                engine.set_policy(Policy(k=base.k, proposer=base.proposer, max_concurrency=0) if mode == "policy_off"
                                  else base)
                tr = Traffic(engine, tokens, k=0 if mode == "off" else None)
                m0 = engine.metrics()
                tr.set_users(users)
                t0 = time.perf_counter()
                time.sleep(round_s)
                t1 = time.perf_counter()
                tr.stop()
                w = window(tr, t0, t1, m0, engine.metrics())
                w["e2e_p50_ms"] = 1000 * statistics.median(x["end"] - x["sent"] for x in tr.requests if "end" in x)
                w["drafted"] = engine.metrics()["draft_tokens_total"] - m0["draft_tokens_total"]
                res[mode].append(w)
    finally:
        engine.set_policy(base)
    ratio = lambda f: statistics.median(f(p, o) for p, o in zip(res["policy_off"], res["off"]))  # noqa: E731
    return {"users": users, "rounds": rounds, "round_s": round_s,
            "tok_s_ratio": ratio(lambda p, o: p["tok_s"] / o["tok_s"]),
            "ttft_ratio_off_over_policy": ratio(lambda p, o: o["ttft_p50_ms"] / p["ttft_p50_ms"]),
            "e2e_ratio_off_over_policy": ratio(lambda p, o: o["e2e_p50_ms"] / p["e2e_p50_ms"]),
            "policy_off_drafted": sum(w["drafted"] for w in res["policy_off"]), "raw": res}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/ramp.json")
    ap.add_argument("--model", choices=("demo", "tiny"), default="demo")
    ap.add_argument("--quick", action="store_true", help="short steps and rounds (a smoke run, not a measurement)")
    ap.add_argument("--step-s", type=float, default=None, help="seconds per ramp step (default 20; --quick 3)")
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds per mode (default 5)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    step_s = args.step_s or (3.0 if args.quick else 20.0)
    tokens = 16 if args.quick else 48
    engine, what = build_engine(args.model, args.threads)
    engine.start()
    try:
        levels = [1, 2, 4, 8, 4, 2, 1]
        print(f"ramp {levels} on {what}", file=sys.stderr)
        steps = ramp(engine, levels, step_s, tokens)
        print("A/B policy-off vs off", file=sys.stderr)
        pair = ab(engine, users=4, rounds=args.rounds, round_s=step_s, tokens=tokens)
    finally:
        engine.shutdown()
    result = {"model": what, "quick": args.quick, "step_s": step_s, "tokens": tokens, "ramp": steps,
              "policy_off_ab": pair, "machine": describe(), "threads": torch.get_num_threads(),
              "decode_step": engine.decode_step}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{'step':>4} {'users':>5} {'tok/s':>8} {'K/step':>7} {'cut off':>8} {'seq/step':>8} {'TTFT ms':>8} "
          f"{'silence s':>9} dip")
    for r in steps:
        f = lambda x, s="{:.2f}": "-" if x is None else s.format(x)  # noqa: E731
        print(f"{r['step']:>4} {r['users']:>5} {r['tok_s']:8.1f} {f(r['draft_tokens_per_step']):>7} "
              f"{f(r['cutoff_share'] and 100 * r['cutoff_share'], '{:.0f} %'):>8} {f(r['sequences_per_step']):>8} "
              f"{f(r['ttft_p50_ms'], '{:.0f}'):>8} {f(r['longest_silence_s']):>9} "
              f"{'%.0f %%' % (100 * r['dip_below_by']) if r.get('dip_below_by') else '-'}")
    print(f"policy-off / off at {pair['users']} users, median of {pair['rounds']} interleaved rounds: tok/s "
          f"{pair['tok_s_ratio']:.3f}x, TTFT {pair['ttft_ratio_off_over_policy']:.3f}x, e2e "
          f"{pair['e2e_ratio_off_over_policy']:.3f}x (off / policy-off; 1 = equal); policy-off drafted "
          f"{pair['policy_off_drafted']} tokens; CPU {result['machine'].get('cpu', '?')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
