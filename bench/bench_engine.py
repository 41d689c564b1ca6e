"""`make bench`: the embedded engine against Hugging Face on SmolLM2-135M-Instruct, side by side, in one run.

Measured in one process, in this order (medians over --runs runs x 3 prompts: chat / code / summarization):
  memory bandwidth      sum over a 1 GiB fp32 tensor (read-only, like a decode step) -> roofline tok/s; again
                        right before each spec-off run, and the share of the roofline is taken per such pair
  hf_generate           transformers `generate`, greedy, fp32
  hf_assisted           the same with `assistant_model` = the int4 self-draft (the same BlockLinear modules)
  engine off / draft / ngram   the embedded engine built by `specbuild build --draft-quantize int4` (the target's
                        own Q4_1 / Q8_0 blocks as the draft; the fused decode step where it is built)
  throughput            1, 2, 4, 8 concurrent sequences, speculation off / draft (K --k, forced) / policy (the
                        build's: adaptive K with the draft, plain above its cut-off) / n-gram
Writes --out (JSON) and prints a table. The box is shared: the load average before and after is recorded;
read every figure as "on this machine, at this load".

    .venv/bin/python bench/bench_engine.py --out bench/results/engine.json --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import specbuild  # noqa: F401  (before torch: it sets torch's OpenMP wait policy, ./__init__.py)
import torch

from specbuild.pipeline.build import build
from specbuild.pipeline.convert import convert
from specbuild.engines.embedded import Engine, EngineConfig, SamplingParams
from specbuild.engines.embedded.adaptive import expected_tokens
from specbuild.engines.embedded.config import ADAPTIVE_K
from specbuild.engines.embedded.calibrate import estimate_alpha, forward_probe, time_interleaved
from specbuild.engines.embedded import fused
from specbuild.engines.embedded.quant import quantize_model_
from specbuild.loadtests.promptsets import chat_prompts, code_prompts, summarize_prompts
from specbuild.pipeline.sources import cache_dir, resolve
from specbuild.core.machine import describe  # noqa: E402
from specbuild.engines.embedded.fused import status as fused_status  # noqa: E402
from specbuild.engines.embedded.step import auto_linear_kernel, linear_kernel_of  # noqa: E402

MODEL = "demo:smollm2-135m-instruct"
KINDS = ("chat", "code", "summ")
PROMPT_TOKENS = 256        # prompts keep their last 256 tokens (chat 45, code 256, summarization 235): on 2 cores the
                           # prefill of 235-256 is ~0.3 s against ~0.8 s for 47 plain decode steps, so the end-to-end
                           # speedup is bounded by it (`e2e_model`: the figures it records say by how much)


_T0 = time.time()


def log(msg: str) -> None:
    """Progress on stderr, with the seconds since the bench started."""
    print(f"[{time.time() - _T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


def predicted_speedup(alpha: float, k: int, *, t_target: float, t_draft: float, t_verify: float) -> float:
    """E[tokens per round] / round cost in plain steps, from step times measured at the same concurrency."""
    return expected_tokens(alpha, k) / ((k * t_draft + t_verify) / t_target)


def e2e_model(off: list[tuple[float, float]], spec: list[tuple[float, float]], predicted_decode: float,
              goal: float = 2.0) -> dict:
    """What the prefill leaves of a decode speedup, per (run, prompt) pair measured back to back: `off` and `spec`
    are (wall seconds, decode span seconds: first to last token) of the same request without and with speculation.
    A request's time = its head (wall - span: prefill and first token, which speculation does not shorten) + its
    decode span. -> medians over the pairs of
      predicted_e2e   off wall / (spec head + off span / predicted_decode): the cost model's decode speedup applied
                      to the decode part only (what `predicted_decode` promises end to end, prefill included)
      ceiling         off wall / spec head: the end-to-end speedup if every token after the first were free
      decode_needed   the decode speedup that would give `goal` end to end: off span / (off wall / goal - spec
                      head), inf where even a free decode cannot (head >= off wall / goal)
      head_share      off head / off wall: the part of a plain request speculation cannot touch"""
    inf = float("inf")
    pred, ceil, need, share = [], [], [], []
    for (w_off, s_off), (w_sp, s_sp) in zip(off, spec):
        head = w_sp - s_sp
        pred.append(w_off / (head + s_off / predicted_decode))
        ceil.append(w_off / head if head > 0 else inf)
        room = w_off / goal - head
        need.append(s_off / room if room > 0 else inf)
        share.append((w_off - s_off) / w_off)
    finite = lambda v: None if v is None or v == inf else v        # noqa: E731  (JSON has no infinity: null)
    return {"predicted_e2e": median(pred), "ceiling": finite(median(ceil)), "decode_needed": finite(median(need)),
            "head_share": median(share), "goal": goal}


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def gemm_gflops(runs: int, n: int = 1024) -> float:
    """fp32 GFLOP/s of torch's own n x n x n matmul (MKL sgemm on CPU), median: this CPU's compute roof as a tuned
    library reaches it, beside which the prefill's rate is read (a prefill is compute-bound)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = time_interleaved({"mm": lambda: a @ b}, reps=max(runs, 5), warmup=2)["mm"]
    return 2 * n ** 3 / t / 1e9


def layer_flops_per_token(model) -> int:
    """2 x the multiply-adds of the layers' linears for one token (the lm_head, run on one row of a prompt, and
    attention left out): a prefill's compute is about this x its tokens."""
    total = 0
    for mod in model.layers.modules():
        i, o = getattr(mod, "in_features", None), getattr(mod, "out_features", None)
        if i and o and next(mod.children(), None) is None:
            total += 2 * i * o
    return total


def bandwidth_gbs(runs: int, x: torch.Tensor) -> dict:
    """Read bandwidth (sum of `x`, 1 GiB fp32) and copy bandwidth (1 GiB read + 1 GiB write), medians, GB/s."""
    y = torch.empty_like(x)
    t_sum = time_interleaved({"sum": lambda: x.sum(), "copy": lambda: y.copy_(x)}, reps=max(runs, 3), warmup=1)
    nbytes = x.numel() * 4
    return {"read_gbs": nbytes / t_sum["sum"] / 1e9, "copy_gbs": 2 * nbytes / t_sum["copy"] / 1e9}


class ReadProbe:
    """The read bandwidth now: the median of 3 sums over 1 GiB of fp32 (~0.1 s), taken beside each spec-off decode
    run. A shared VM's bandwidth moves with its neighbours (an AMD EPYC Zen 4 measured 49.4 GB/s at the start of a
    run and 29-31 GB/s minutes later), so a roofline from one probe at the start can put the same step at 50 % or
    at 85 %: the share is taken per pair, the probe and the decode run beside it."""

    def __init__(self):
        self.x = torch.ones(256 * 1024 * 1024)

    def __call__(self) -> float:
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            self.x.sum()
            ts.append(time.perf_counter() - t0)
        return self.x.numel() * 4 / statistics.median(ts) / 1e9


def prompts(tokenizer) -> dict[str, list[int]]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": chat_prompts()[0]}], tokenize=False,
                                         add_generation_prompt=True)
    texts = {"chat": chat, "code": code_prompts()[0], "summ": summarize_prompts()[0]}
    return {k: tokenizer.encode(t, add_special_tokens=False)[-PROMPT_TOKENS:] for k, t in texts.items()}


def engine_dir(workdir: Path, quantize: str = "int4", max_draft_len: int = 8) -> Path:
    """The documented recipe of a self-draft: convert (draft == target), build --draft-quantize QUANTIZE."""
    src = resolve(MODEL, progress=log)
    convert(src.path, src.path, workdir=workdir, progress=log)
    # An engine built by an older specbuild (no shared draft KV, a calibration measured on other linear kernels)
    # measures yesterday's engine: rebuild it.
    cfg_path = workdir / "engines" / "engine_config.json"
    stale = False
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        cal = cfg.get("calibration") or {}
        stale = (cfg.get("schema", 1) < 2 or "draft_activations" not in cfg
                 or (bool(cal) and "by_concurrency" not in cal)          # costs priced at one sequence only
                 or cal.get("linear_kernel", "aten") != auto_linear_kernel()
                 or cal.get("decode_step", "eager") != ("fused" if fused.extension() is not None else "eager")
                 or (cal.get("decode_step") == "fused" and cal.get("fused_kernels") != fused.kernels_id()))
    result = build(workdir=workdir, draft_quantize=quantize, max_batch_size=8, max_seq_len=1024, progress=log,
                   max_draft_len=max_draft_len, force=stale)
    return result.out_dir


def hf_models(model_dir: Path, k: int):
    """HF target and the int4 self-draft as an HF model (the same BlockLinear modules the engine's draft uses)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    draft = quantize_model_(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), "int4")
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return target, draft


def latency_runs(engine: Engine, hf_target, hf_draft, ids: dict, *, tokens: int, runs: int, k: int,
                 k_ngram: int, read_probe=None) -> dict:
    """Batch-1 tok/s of every method on every prompt. Interleaved: each run does every (prompt, method) once,
    so a burst of load from other processes on the shared box hits all methods alike. ``read_probe`` (-> GB/s)
    runs right before each spec-off run; its figures land beside that run's (``read_gbs``)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine_modes = {"off": (0, None), "draft": (k, "draft"), "ngram": (k_ngram, "ngram")}
    hf_kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    out: dict = {m: {kind: {"tok_s": [], "decode_tok_s": [], "wall_s": [], "span_s": [], "acc": [], "dr": []}
                     for kind in ids}
                 for m in ("hf_generate", "hf_assisted", *engine_modes)}
    for cell in out["off"].values():
        cell["read_gbs"] = []
    for run in range(runs):
        for kind, prompt in ids.items():
            x = torch.tensor([prompt])
            for name, extra in (("hf_generate", {}), ("hf_assisted", {"assistant_model": hf_draft})):
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    hf_target.generate(x, attention_mask=torch.ones_like(x), **hf_kw, **extra)
                    out[name][kind]["tok_s"].append(tokens / (time.perf_counter() - t0))
            for mode, (kk, proposer) in engine_modes.items():
                if mode == "off" and read_probe is not None:
                    out[mode][kind]["read_gbs"].append(read_probe())
                t0 = time.perf_counter()
                res = engine.generate(prompt, params, num_draft_tokens=kk, proposer=proposer)
                wall = time.perf_counter() - t0
                cell, st = out[mode][kind], res.stats
                cell["tok_s"].append(len(res.token_ids) / wall)
                span = st.last_token_time - st.first_token_time            # decode only: after the first token
                cell["wall_s"].append(wall)
                cell["span_s"].append(span)
                cell["decode_tok_s"].append((st.generated_tokens - 1) / span if span > 0 else None)
                cell["acc"].append(st.accepted_per_pos)
                cell["dr"].append(st.drafted_per_pos)
            log(f"run {run + 1}/{runs} {kind}: " + ", ".join(f"{m} {out[m][kind]['tok_s'][-1]:.2f}" for m in out)
                + " tok/s")
    for mode in engine_modes:
        for cell in out[mode].values():
            acc, dr = cell.pop("acc"), cell.pop("dr")
            a = [sum(c) for c in zip(*acc)] if acc and acc[0] else []
            d = [sum(c) for c in zip(*dr)] if dr and dr[0] else []
            cell["alpha"] = estimate_alpha(a, d) if d else None
            cell["acceptance_rate"] = sum(a) / sum(d) if d and sum(d) else None
    return out


BATCHES = (1, 2, 4, 8)


def throughput(engine: Engine, ids: dict, *, tokens: int, runs: int, k: int, k_ngram: int,
               read_probe=None) -> tuple[dict, dict]:
    """Total tok/s with n concurrent sequences (continuous batching, speculation forced: no cut-off), interleaved
    over modes and n per run. Each (run, n, mode) is three batches, the n prompts drawn in turn from chat / code /
    summarization starting at each kind once: every n sees each prompt n times, so x1 and x8 do the same work per
    token (the chat prompt is 45 tokens, code and summarization 235-256: a batch of only the first prompts would
    favour x1). -> (medians of end-to-end tok/s, per-n detail: decode-only tok/s (from the last first token to the
    last token of each batch), the 8-vs-1 ratios taken within each run, per-run draft/off ratios and the draft's
    per-position acceptance; ``read_probe``'s GB/s before each n of each run: spec off is memory-bound and
    speculation is not, so their ratio moves with the bandwidth of the moment)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    pool = list(ids.values())
    modes = {"off": (0, None), "draft": (k, "draft"), "policy": (ADAPTIVE_K, "draft"), "ngram": (k_ngram, "ngram")}
    samples: dict = {m: {n: [] for n in BATCHES} for m in modes}
    decode: dict = {m: {n: [] for n in BATCHES} for m in modes}
    acc: dict = {n: ([], []) for n in BATCHES}
    read_gbs: dict = {n: [] for n in BATCHES}
    for run in range(runs):
        for n in BATCHES:
            if read_probe is not None:
                read_gbs[n].append(read_probe())
            for mode, (kk, proposer) in modes.items():
                toks = dec_toks = 0
                wall = span = 0.0
                for start in range(len(pool)):
                    reqs = [(pool[(start + i) % len(pool)], params, kk) for i in range(n)]
                    t0 = time.perf_counter()
                    res = engine.generate_batch(reqs, proposer=proposer)
                    wall += time.perf_counter() - t0
                    toks += sum(len(r.token_ids) for r in res)
                    span += max(r.stats.last_token_time for r in res) - max(r.stats.first_token_time for r in res)
                    dec_toks += sum(len(r.token_ids) - 1 for r in res)
                    if mode == "draft":
                        for r in res:
                            _add(acc[n][0], r.stats.accepted_per_pos)
                            _add(acc[n][1], r.stats.drafted_per_pos)
                samples[mode][n].append(toks / wall)
                decode[mode][n].append(dec_toks / span if span > 0 else None)
            log(f"throughput run {run + 1}/{runs} x{n}: " + ", ".join(f"{m} {samples[m][n][-1]:.2f}" for m in modes)
                + " tok/s" + (f" (read {read_gbs[n][-1]:.1f} GB/s before)" if read_gbs[n] else ""))
    detail = {n: {"decode_tok_s": {m: median(decode[m][n]) for m in modes},
                  "draft_decode_speedup": median([d / o for d, o in zip(decode["draft"][n], decode["off"][n])
                                                  if d and o]),
                  "policy_decode_speedup": median([d / o for d, o in zip(decode["policy"][n], decode["off"][n])
                                                   if d and o]),
                  "draft_speedup": median([d / o for d, o in zip(samples["draft"][n], samples["off"][n])]),
                  "policy_speedup": median([d / o for d, o in zip(samples["policy"][n], samples["off"][n])]),
                  "off_vs_x1": median([a / b for a, b in zip(samples["off"][n], samples["off"][1])]),
                  "off_decode_vs_x1": median([a / b for a, b in zip(decode["off"][n], decode["off"][1])
                                              if a and b]),
                  "alpha": estimate_alpha(*acc[n]) if acc[n][1] else None,
                  "read_gbs_by_run": read_gbs[n]} for n in BATCHES}
    return {m: {n: median(v) for n, v in row.items()} for m, row in samples.items()}, detail


def _add(acc: list[int], values) -> None:
    for i, v in enumerate(values):
        if i >= len(acc):
            acc.append(0)
        acc[i] += int(v)


def efficiency_by_concurrency(engine: Engine, detail: dict, *, k: int, context: int, runs: int) -> dict:
    """Speculation efficiency per concurrency n: the measured decode speedup (draft K vs off) / the speedup
    predicted from the measured alpha at n and the step costs measured at n rows (target step, verify over
    K+1 positions, draft step; interleaved medians)."""
    out = {}
    for n in BATCHES:
        probes = {"target": forward_probe(engine.target, new_tokens=1, context=context, batch=n),
                  "verify": forward_probe(engine.target, new_tokens=k + 1, context=context, batch=n),
                  "draft": forward_probe(engine.draft, new_tokens=1, context=context, batch=n)}
        t = time_interleaved(probes, reps=max(5, runs), warmup=1)
        alpha = detail[n]["alpha"]
        pred = predicted_speedup(alpha, k, t_target=t["target"], t_draft=t["draft"], t_verify=t["verify"])
        meas = detail[n]["draft_decode_speedup"]
        out[n] = {"alpha": alpha, "t_target_s": t["target"], "t_verify_s": t["verify"], "t_draft_s": t["draft"],
                  "cost_ratio": t["draft"] / t["target"], "verify_ratio": t["verify"] / t["target"],
                  "predicted_speedup": pred, "measured_decode_speedup": meas,
                  "efficiency": meas / pred if meas and pred else None}
        log(f"efficiency x{n}: measured {meas:.2f}x / predicted {pred:.2f}x = {out[n]['efficiency']:.2f}")
    return out


def thread_costs(engine: Engine, runs: int) -> dict:
    """A target and a draft step (1 row, context 128) timed in this thread, which loaded the engine, and in a new
    one, as the serving thread runs them (`Engine.start`, the Triton service), in alternating rounds ->
    {"target", "draft"}: the serving thread's median / this thread's (1.0: a step costs the same in either)."""
    import threading

    probes = {"target": forward_probe(engine.target, new_tokens=1, context=128),
              "draft": forward_probe(engine.draft, new_tokens=1, context=128)}
    here: dict = {n: [] for n in probes}
    there: dict = {n: [] for n in probes}

    def measure(into: dict) -> None:
        t = time_interleaved(probes, reps=5, warmup=1)
        for n, v in t.items():
            into[n].append(v)

    for _ in range(max(3, runs)):
        measure(here)
        th = threading.Thread(target=measure, args=(there,))
        th.start()
        th.join()
    return {n: median(there[n]) / median(here[n]) for n in probes}


def step_costs(engine: Engine, k: int, runs: int) -> dict:
    probes = {"target": forward_probe(engine.target, new_tokens=1, context=128),
              "verify": forward_probe(engine.target, new_tokens=k + 1, context=128),
              "draft": forward_probe(engine.draft, new_tokens=1, context=128)}
    return time_interleaved(probes, reps=max(5, runs))


def bf16_prefill_cell(engine: Engine, edir: Path, ids: dict, *, tokens: int, runs: int, k: int) -> dict:
    """The opt-in bf16 prefill (`build --prefill-precision bf16`) beside the default fp32 one, on the same build:
    per prompt and run, spec off and K back to back on each engine, alternating. -> each prompt's prefill (the head
    of a spec-off request) with each, the batch-1 end-to-end speedup of K with each, whether speculation stayed
    lossless with the bf16 prefill (it must), and on how many prompts its output equals the fp32 prefill's."""
    from specbuild.engines.embedded.step import bf16_prefill_unavailable

    why = bf16_prefill_unavailable()
    if why is not None:
        return {"available": False, "why": why}
    log("the bf16 prefill beside the fp32 one (the same build, prefill_precision bf16)")
    other = Engine.from_build_dir(edir, prefill_precision="bf16")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    cell = {p: {kind: {"head_s": [], "e2e": []} for kind in ids} for p in ("fp32", "bf16")}
    outs: dict = {}
    for _ in range(runs):
        for kind, prompt in ids.items():
            for p, eng in (("fp32", engine), ("bf16", other)):
                walls = {}
                for mode, kk in (("off", 0), ("k", k)):
                    t0 = time.perf_counter()
                    res = eng.generate(prompt, params, num_draft_tokens=kk, proposer="draft")
                    walls[mode] = time.perf_counter() - t0
                    outs.setdefault((p, kind), set()).add(tuple(res.token_ids))
                    if mode == "off":
                        st = res.stats
                        cell[p][kind]["head_s"].append(walls[mode] - (st.last_token_time - st.first_token_time))
                cell[p][kind]["e2e"].append(walls["off"] / walls["k"])
    kinds = list(ids)
    per_kind = {kind: {"prompt_tokens": len(ids[kind]),
                       "prefill_ms_fp32": median(cell["fp32"][kind]["head_s"]) * 1e3,
                       "prefill_ms_bf16": median(cell["bf16"][kind]["head_s"]) * 1e3,
                       "prefill_speedup": median([a / b for a, b in zip(cell["fp32"][kind]["head_s"],
                                                                        cell["bf16"][kind]["head_s"])]),
                       "e2e_speedup_fp32": median(cell["fp32"][kind]["e2e"]),
                       "e2e_speedup_bf16": median(cell["bf16"][kind]["e2e"])} for kind in kinds}
    del other
    return {"available": True, "k": k, "runs": runs, "tokens": tokens, "per_prompt": per_kind,
            "prefill_speedup": median([c["prefill_speedup"] for c in per_kind.values()]),
            "e2e_speedup_fp32": median([x for kind in kinds for x in cell["fp32"][kind]["e2e"]]),
            "e2e_speedup_bf16": median([x for kind in kinds for x in cell["bf16"][kind]["e2e"]]),
            "lossless_bf16": all(len(outs[("bf16", kind)]) == 1 for kind in kinds),
            "same_output_as_fp32": sum(outs[("bf16", kind)] == outs[("fp32", kind)] for kind in kinds),
            "prompts": len(kinds)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/engine.json", help="JSON output (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=None, help="runs per prompt and mode (default: 3; --quick: 2)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per request (default: 48; --quick: 32)")
    ap.add_argument("--quick", action="store_true", help="fewer runs and tokens (a few minutes)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--workdir", default=None, help="build workspace (default: $SPECBUILD_CACHE/bench-work)")
    ap.add_argument("--k-ngram", type=int, default=4, help="K for the n-gram proposer (default: %(default)s)")
    args = ap.parse_args(argv)
    runs = args.runs or (2 if args.quick else 3)
    tokens = args.tokens or (32 if args.quick else 48)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    t_start = time.time()
    log("building the engine (no-op when up to date)")
    edir = engine_dir(Path(args.workdir) if args.workdir else cache_dir() / "bench-work")
    cal = EngineConfig.load(edir).calibration or {}
    k = cal.get("recommended_k") or 4
    engine = Engine.from_build_dir(edir, threads=args.threads)   # every request below sends its K (forced)
    ids = prompts(engine.tokenizer)
    log(f"decode step: {engine.decode_step}; memory bandwidth")
    read_probe = ReadProbe()
    bw = bandwidth_gbs(runs, read_probe.x)
    hf_target, hf_draft = hf_models(Path(resolve(MODEL).path), k)
    gemm = gemm_gflops(runs)
    log(f"fp32 matmul 1024^3 (torch): {gemm:.0f} GFLOP/s")
    m = {"bw": bw, "gemm_gflops": gemm,
         "lat": latency_runs(engine, hf_target, hf_draft, ids, tokens=tokens, runs=runs, k=k, k_ngram=args.k_ngram,
                             read_probe=read_probe),
         "costs": step_costs(engine, k, runs), "thread": thread_costs(engine, runs)}
    m["prompt_tokens"] = {kind: len(v) for kind, v in ids.items()}
    m["thr"], m["thr_detail"] = throughput(engine, ids, tokens=tokens, runs=runs, k=k, k_ngram=args.k_ngram,
                                           read_probe=read_probe)
    log("step costs by concurrency (speculation efficiency)")
    m["eff"] = efficiency_by_concurrency(engine, m["thr_detail"], k=k, context=PROMPT_TOKENS + tokens // 2, runs=runs)
    m["bf16"] = bf16_prefill_cell(engine, edir, ids, tokens=tokens, runs=runs, k=k)
    result = summarize(engine, m, runs=runs, tokens=tokens, k=k, k_ngram=args.k_ngram, cal=cal)
    result.update(load_avg_before=load_before, load_avg_after=os.getloadavg(), seconds=time.time() - t_start)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


def summarize(engine: Engine, m: dict, *, runs: int, tokens: int, k: int, k_ngram: int, cal: dict) -> dict:
    lat, costs, thr, bw = m["lat"], m["costs"], m["thr"], m["bw"]

    def med(method: str, key: str = "tok_s", kinds=KINDS):
        return median([x for kind in kinds for x in lat[method][kind][key]])

    def ratio(a: str, b: str, kinds=KINDS):
        """Median of per-(run, prompt) ratios: each pair was measured back to back, under the same load."""
        return median([x / y for kind in kinds for x, y in zip(lat[a][kind]["tok_s"], lat[b][kind]["tok_s"])])
    off_decode = med("off", "decode_tok_s")
    weight_bytes = engine.target.step_bytes()           # what a step streams (not the embedding table)
    # the roofline beside each spec-off run (the probe right before it), and the share per pair
    paired = [(d, g) for kind in KINDS for d, g in zip(lat["off"][kind]["decode_tok_s"], lat["off"][kind]["read_gbs"])
              if d is not None]
    read_paired = median([g for _, g in paired]) if paired else bw["read_gbs"]
    roofline = read_paired * 1e9 / weight_bytes
    share = median([d * weight_bytes / (g * 1e9) for d, g in paired]) if paired else off_decode / roofline
    # a greedy step reads the lm_head's Q8_0 screen, not its fp32 panels (kernels.TiledLinear.greedy_ids): the
    # roofline above counts the fp32 model, as the goal does; this one the bytes a greedy step reads
    greedy_bytes = engine.target.greedy_step_bytes()
    share_greedy = share * greedy_bytes / weight_bytes
    alpha = median([lat["draft"][kind]["alpha"] for kind in KINDS])
    predicted = predicted_speedup(alpha, k, t_target=costs["target"], t_draft=costs["draft"],
                                  t_verify=costs["verify"])
    draft_speedup = ratio("draft", "off")
    decode_speedup = median([d / o for kind in KINDS for d, o in zip(lat["draft"][kind]["decode_tok_s"],
                                                                       lat["off"][kind]["decode_tok_s"]) if d and o])
    pairs = [(list(zip(lat["off"][kind]["wall_s"], lat["off"][kind]["span_s"])),
              list(zip(lat["draft"][kind]["wall_s"], lat["draft"][kind]["span_s"]))) for kind in KINDS]
    e2e = e2e_model([p for o, _ in pairs for p in o], [p for _, d in pairs for p in d], predicted)
    flops = layer_flops_per_token(engine.target)
    prefill = {kind: {"prompt_tokens": n, "head_s": median([w - sp for w, sp in zip(lat["off"][kind]["wall_s"],
                                                                                   lat["off"][kind]["span_s"])]),
                      } for kind, n in m["prompt_tokens"].items()}
    for cell in prefill.values():
        cell["gflops"] = flops * cell["prompt_tokens"] / cell["head_s"] / 1e9 if cell["head_s"] else None
    return {
        "model": MODEL, "draft": "SmolLM2-135M-Instruct int4 self-draft (the GGUF's own Q4_1 / Q8_0 blocks)",
        "runs": runs, "tokens": tokens, "prompts": list(KINDS), "k": k, "k_ngram": k_ngram,
        "decode_step": engine.decode_step, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "machine": describe(), "kernels": {"decode_step": engine.decode_step, "linear_kernel": linear_kernel_of(engine.target),
                    "fused_extension": fused_status()},
        "memory_read_gbs": read_paired, "memory_read_gbs_at_start": bw["read_gbs"],
        "memory_read_gbs_beside_decode": [g for _, g in paired], "memory_copy_gbs": bw["copy_gbs"], "target_weight_bytes": weight_bytes,
        "hf_generate_tok_s": med("hf_generate"), "hf_assisted_tok_s": med("hf_assisted"),
        "engine_tok_s": med("off"), "engine_draft_tok_s": med("draft"), "engine_ngram_tok_s": med("ngram"),
        "roofline_tok_s": roofline, "engine_vs_hf": ratio("off", "hf_generate"),
        "engine_decode_tok_s": off_decode, "roofline_fraction": share,
        "greedy_step_bytes": greedy_bytes, "roofline_fraction_greedy_bytes": share_greedy,
        "draft_acceptance_rate": median([lat["draft"][kind]["acceptance_rate"] for kind in KINDS]),
        "draft_alpha": alpha, "draft_cost_ratio": costs["draft"] / costs["target"],
        "t_target_s": costs["target"], "t_draft_s": costs["draft"], "t_verify_s": costs["verify"],
        "predicted_draft_speedup": predicted, "draft_speedup": draft_speedup,
        "spec_efficiency": draft_speedup / predicted, "draft_decode_speedup": decode_speedup,
        "spec_efficiency_decode": decode_speedup / predicted if decode_speedup else None,
        "predicted_e2e_speedup": e2e["predicted_e2e"], "spec_efficiency_e2e": draft_speedup / e2e["predicted_e2e"],
        "e2e_ceiling_free_decode": e2e["ceiling"], "decode_speedup_needed_for_2x": e2e["decode_needed"],
        "prefill_share_off": e2e["head_share"], "prefill": prefill, "fp32_matmul_gflops": m["gemm_gflops"],
        "ngram_summ_speedup": ratio("ngram", "off", kinds=("summ",)),
        "hf_assisted_speedup": ratio("hf_assisted", "hf_generate"),
        "throughput_tok_s": thr, "throughput_ratio_8_vs_1": m["thr_detail"][8]["off_vs_x1"],
        "decode_throughput_ratio_8_vs_1": m["thr_detail"][8]["off_decode_vs_x1"],
        "demo_draft_speedup_batch1": thr["draft"][1] / thr["off"][1],
        "demo_draft_speedup_batch8": thr["draft"][8] / thr["off"][8],
        "serving_thread_step_ratio": m["thread"],
        "throughput_detail": m["thr_detail"], "spec_efficiency_by_concurrency": m["eff"],
        "goals": {"batch1_speculation_ge_1.6x": draft_speedup >= 1.6, "batch1_speculation_ge_2.0x": draft_speedup >= 2.0,
                  "spec_efficiency_ge_0.9": draft_speedup / predicted >= 0.9,        # against the decode-only model
                  "spec_efficiency_e2e_ge_0.9": draft_speedup / e2e["predicted_e2e"] >= 0.9,   # the prefill counted
                  "draft_cost_ratio_le_0.4": costs["draft"] / costs["target"] <= 0.4},
        "build_calibration": cal, "per_prompt": lat, "prefill_bf16": m.get("bf16"),
    }


def _x(v) -> str:
    return "unreachable" if v is None else f"{v:.2f}x"


def print_table(r: dict) -> None:
    rows = [("memory read bandwidth", f"{r['memory_read_gbs']:.1f} GB/s beside the decode runs "
                                      f"({r['memory_read_gbs_at_start']:.1f} at the start)"),
            ("roofline (bytes a step reads / bandwidth)", f"{r['roofline_tok_s']:.1f} tok/s"),
            ("HF generate (greedy)", f"{r['hf_generate_tok_s']:.2f} tok/s"),
            ("HF assisted (int4 self-draft)", f"{r['hf_assisted_tok_s']:.2f} tok/s ({r['hf_assisted_speedup']:.2f}x)"),
            ("engine, speculation off", f"{r['engine_tok_s']:.2f} tok/s ({r['engine_vs_hf']:.2f}x HF, "
                                        f"decode {r['engine_decode_tok_s']:.1f} tok/s = "
                                        f"{r['roofline_fraction']:.0%} of roofline; "
                                        f"{r.get('roofline_fraction_greedy_bytes', r['roofline_fraction']):.0%} of "
                                        f"the bytes a greedy step reads)"),
            (f"engine, int4 self-draft K={r['k']}", f"{r['engine_draft_tok_s']:.2f} tok/s "
                                                    f"({r['draft_speedup']:.2f}x, "
                                                    f"predicted {r['predicted_draft_speedup']:.2f}x)"),
            ("  acceptance / alpha / c", f"{r['draft_acceptance_rate']:.2f} / {r['draft_alpha']:.2f} / "
                                         f"{r['draft_cost_ratio']:.2f}"),
            ("  spec efficiency", f"{r['spec_efficiency']:.2f} (end to end / predicted decode); decode "
                                  f"{r['draft_decode_speedup']:.2f}x / {r['predicted_draft_speedup']:.2f}x = "
                                  f"{r['spec_efficiency_decode']:.2f}; end to end / predicted with the prefill "
                                  f"{r['predicted_e2e_speedup']:.2f}x = {r['spec_efficiency_e2e']:.2f}"),
            ("  what the prefill leaves", f"{r['prefill_share_off']:.0%} of a plain request; end to end "
                                          f"{_x(r['e2e_ceiling_free_decode'])} if decode were free; 2.0x needs "
                                          f"decode {_x(r['decode_speedup_needed_for_2x'])}"),
            ("  prefill (spec off, head of a request)", ", ".join(
                f"{k} {c['prompt_tokens']} tok {c['head_s'] * 1e3:.0f} ms = {c['gflops']:.0f} GFLOP/s"
                for k, c in r["prefill"].items()) + f" (torch fp32 matmul 1024^3: {r['fp32_matmul_gflops']:.0f})"),
            ("a step in a serving thread / here", f"target {r['serving_thread_step_ratio']['target']:.2f}x, "
                                                  f"draft {r['serving_thread_step_ratio']['draft']:.2f}x"),
            ("engine, n-gram (summarization)", f"{r['ngram_summ_speedup']:.2f}x"),
            ("throughput 8 vs 1 (spec off)", f"{r['throughput_ratio_8_vs_1']:.2f}x end to end, "
                                             f"{r['decode_throughput_ratio_8_vs_1']:.2f}x decode (after the first "
                                             f"tokens: 8 prompts' prefill is 8x the compute)"),
            ("demo draft speedup batch 1 / 8", f"{r['demo_draft_speedup_batch1']:.2f}x / "
                                               f"{r['demo_draft_speedup_batch8']:.2f}x")]
    bf = r.get("prefill_bf16") or {}
    if bf.get("available"):
        rows.append(("opt-in bf16 prefill (--prefill-precision)", (
            f"prefill {bf['prefill_speedup']:.2f}x faster ("
            + ", ".join(f"{kind} {c['prefill_ms_fp32']:.0f} -> {c['prefill_ms_bf16']:.0f} ms"
                        for kind, c in bf["per_prompt"].items())
            + f"); batch-1 K {bf['k']} end to end {bf['e2e_speedup_fp32']:.2f}x -> {bf['e2e_speedup_bf16']:.2f}x; "
            f"lossless {'yes' if bf['lossless_bf16'] else 'NO'}; output = fp32 prefill's on {bf['same_output_as_fp32']}"
            f" of {bf['prompts']} prompts")))
    elif bf:
        rows.append(("opt-in bf16 prefill (--prefill-precision)", f"not measured: {bf['why']}"))
    w = max(len(a) for a, _ in rows)
    print(f"SmolLM2-135M-Instruct, {r['runs']} runs x 3 prompts, {r['tokens']} tokens, {r['threads']} threads, "
          f"load {r['load_avg_before'][0]:.1f} -> {r['load_avg_after'][0]:.1f}")
    for a, b in rows:
        print(f"  {a:<{w}}  {b}")
    thr = r["throughput_tok_s"]
    print("  throughput tok/s   " + "  ".join(f"x{n}" .rjust(8) for n in (1, 2, 4, 8)))
    for mode, row in thr.items():
        print(f"    {mode:<16}" + "  ".join(f"{row[n]:8.2f}" for n in (1, 2, 4, 8)))
    det = r["throughput_detail"]
    for key, name in (("draft_speedup", f"draft K {r['k']} / off"), ("policy_speedup", "policy / off"),
                      ("draft_decode_speedup", "  decode only"), ("policy_decode_speedup", "  policy decode")):
        if all(det[n].get(key) for n in (1, 2, 4, 8)):         # (a JSON of an older bench has no policy decode)
            print(f"    {name:<16}" + "  ".join(f"{det[n][key]:7.2f}x" for n in (1, 2, 4, 8))
                  + "   (median of per-run ratios" + (", after the first tokens)" if "decode" in key else ")"))
    eff = r["spec_efficiency_by_concurrency"]
    print("  spec efficiency    " + "  ".join(f"{(eff[n]['efficiency'] or 0):8.2f}" for n in (1, 2, 4, 8))
          + "   (measured decode speedup / predicted from alpha, c(n), verify(n))")
    print("    predicted        " + "  ".join(f"{eff[n]['predicted_speedup']:8.2f}" for n in (1, 2, 4, 8)))
    print("    measured         " + "  ".join(f"{(eff[n]['measured_decode_speedup'] or 0):8.2f}" for n in (1, 2, 4, 8)))


if __name__ == "__main__":
    sys.exit(main())
