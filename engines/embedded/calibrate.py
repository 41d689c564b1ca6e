"""Calibration of a built embedded engine: what speculation costs and buys here, and the K that pays best.

Measured (medians of repeated timings, so a noisy shared machine moves them less):
- ``t_target``: one target decode step (1 new token) at a typical context length;
- ``t_verify[K]``: one target forward over K+1 new positions (the K drafts + the bonus position);
- ``t_draft``: one draft decode step (0 for the n-gram proposer, which runs no model);
- ``alpha``: per-token acceptance on a built-in prompt set (chat / code / summarization), estimated from the
  per-position acceptance counts of real speculative generations (see ``estimate_alpha``);
- ``by_concurrency``: the same three step times with n = 2, 3, 4, 8 sequences in the step (up to
  max_batch_size; verify at K = 1, 2, 4, 8), so adaptive K prices a step at the load it runs at: at 2+ rows a
  verify is compute-bound where one row is bandwidth-bound (``adaptive.cost_models(calibration, n)``).

The model is the one adaptive K serves with (`adaptive.py`: Leviathan et al. 2023 with a measured verify
cost): a round of K drafts emits E = (1 - a^(K+1)) / (1 - a) tokens on average and costs 1 + c*K + v(K) plain
steps, c = t_draft / t_target, v(K) = t_verify[K] / t_target - 1 fitted as a line through the measured verify
times. The recommended K maximises E / cost over 1..max_draft_len; when no K beats 1.0 the recommendation is
still the best K and ``worth_speculating`` is False. `measure_crossover` then times speculation against plain
decoding at rising concurrency: the last concurrency where it paid becomes the policy's ``max_concurrency``.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from specbuild.engines.embedded.adaptive import CostModel, cost_models, cutoff_from_speedups, predicted_speedup

# Short, fixed, offline prompts: a few per traffic kind, so calibration takes seconds, not minutes.
CALIBRATION_PROMPTS: dict[str, tuple[str, ...]] = {
    "chat": ("Explain why the sky is blue.",
             "What are three tips for staying focused while studying?"),
    "code": ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "import json\n\n\ndef load_records(path):\n"
             "    \"\"\"Read a JSON-lines file into a list of dicts.\"\"\"\n"),
    "summarization": (
        "Summarize the text: The city council met on Tuesday to discuss the new park. The council approved "
        "the budget for the park, which will include a playground, a pond and walking trails. Construction "
        "will start in the spring and the park will open next year.\nSummary:",
        "Summarize the text: Speculative decoding lets a small draft model propose several tokens that a "
        "large target model then verifies in a single forward pass. Accepted tokens are kept, and the first "
        "rejected token is replaced by the target's own choice, so the output is unchanged.\nSummary:"),
}


def speedup_table(alpha: float, cost: CostModel, max_k: int) -> tuple[int, dict[int, float]]:
    """(the K in 1..max_k with the highest predicted speedup, the predicted speedup of every K), from the one
    cost model adaptive K serves with (`adaptive.predicted_speedup`)."""
    if max_k < 1:
        raise ValueError("max_k must be >= 1")
    table = {k: predicted_speedup(alpha, k, cost) for k in range(1, max_k + 1)}
    return max(table, key=lambda k: (table[k], -k)), table


def estimate_alpha(accepted_per_pos: list[int], drafted_per_pos: list[int]) -> float:
    """Maximum-likelihood per-token acceptance from per-position counts.

    Position i is *tried* in a round when the round drafted it and accepted every earlier position; it
    succeeds when it is accepted too. alpha = successes / trials. Unlike accepted/drafted, this does not
    count drafts after the first rejection (which were never tested), so it does not underestimate alpha.
    Example: K=3, rounds accepting 3, 0 and 1 -> accepted_per_pos [2, 1, 1], drafted_per_pos [3, 3, 3];
    trials 3 + 2 + 1 = 6, successes 4 -> alpha = 0.667 (accepted/drafted would say 4/9 = 0.444).
    """
    trials = successes = 0
    for i, (acc, dr) in enumerate(zip(accepted_per_pos, drafted_per_pos)):
        trials += dr if i == 0 else min(accepted_per_pos[i - 1], dr)
        successes += acc
    return successes / trials if trials else 0.0


def forward_probe(model, *, new_tokens: int, context: int, batch: int = 1,
                  decode_step: str = "auto") -> Callable[[], None]:
    """A closure running one forward of ``model`` over ``new_tokens`` positions after ``context`` cached ones, for
    ``batch`` rows (sequences in slots 0..batch-1), on a KV cache of its own through `ragged_forward`: exactly what
    the scorer/proposer run (the fused step where the engine uses it; for a head that screens, as they run it for
    greedy rows: the hidden states, then the head's own argmax, `quant.BlockLinear.greedy_ids` for a draft step,
    `kernels.TiledLinear.greedy_ids` for the target's step or verify)."""
    from specbuild.engines.embedded.kvcache import KVCache
    from specbuild.engines.embedded.model import ragged_forward

    cfg = model.cfg
    device = model.embed.weight.device
    cache = KVCache(num_layers=cfg.num_layers, num_slots=batch, kv_heads=cfg.num_kv_heads,
                    max_seq=context + new_tokens, head_dim=cfg.head_dim, dtype=model.embed.weight.dtype,
                    device=device, decode_step=decode_step)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.vocab_size, (batch, new_tokens), generator=gen).tolist()

    from specbuild.engines.embedded.kernels import TiledLinear

    head = model.lm_head            # a block head screens a draft step's row; the tiled one every greedy row, exactly
    if hasattr(head, "screens") and head.screens() and (new_tokens == 1 or isinstance(head, TiledLinear)):
        head.prepare_screen()

        def step() -> None:
            head.greedy_ids(ragged_forward(model, cache, list(range(batch)), [context] * batch, rows, "hidden_all",
                                           device))
        return step

    def step() -> None:
        ragged_forward(model, cache, list(range(batch)), [context] * batch, rows, "all", device)
    return step


def time_interleaved(probes: dict, *, reps: int = 7, warmup: int = 2) -> dict:
    """Median seconds per probe, timed round-robin (one call of each probe per round), so a burst of load
    from other processes on a shared machine hits every probe alike instead of skewing one of them."""
    for fn in probes.values():
        for _ in range(warmup):
            fn()
    times: dict = {name: [] for name in probes}
    for _ in range(reps):
        for name, fn in probes.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


@dataclass(frozen=True)
class Calibration:
    proposer: str                        # "draft" | "ngram"
    context_tokens: int                  # context length the step times were measured at
    t_target_s: float                    # one target decode step
    t_verify_s: dict[int, float]         # K -> target forward over K+1 positions
    t_draft_s: float                     # one draft decode step (0 for n-gram)
    cost_ratio: float                    # c = t_draft / t_target
    alpha: float                         # per-token acceptance (MLE over all calibration prompts)
    alpha_by_kind: dict[str, float]      # the same per prompt kind (chat / code / summarization)
    acceptance_rate: float               # accepted / drafted at the calibration K (for comparison)
    calibration_k: int                   # K the acceptance runs used
    predicted_speedup: dict[int, float]  # K -> predicted speedup
    recommended_k: int
    worth_speculating: bool              # predicted_speedup[recommended_k] > 1
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # n -> {"t_target_s", "t_verify_s": {K: s}, "t_draft_s"} with n sequences in the step (n >= 2)
    by_concurrency: dict[int, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["t_verify_s"] = {str(k): v for k, v in self.t_verify_s.items()}
        d["by_concurrency"] = {str(n): {**row, "t_verify_s": {str(k): v for k, v in row["t_verify_s"].items()}}
                               for n, row in self.by_concurrency.items()}
        d["predicted_speedup"] = {str(k): v for k, v in self.predicted_speedup.items()}
        d["formula"] = ("predicted_speedup(K) = ((1 - alpha^(K+1)) / (1 - alpha)) / "
                        "((K * t_draft + t_verify[K]) / t_target)")
        return d


def measure_acceptance(engine, *, proposer: str, k: int, max_tokens: int,
                       progress: Callable[[str], None] | None = None) -> tuple[float, dict[str, float], float]:
    """Greedy speculative generations over CALIBRATION_PROMPTS -> (alpha, alpha per kind, accepted/drafted)."""
    from specbuild.engines.embedded import SamplingParams

    max_seq = engine.config.max_seq_len
    max_tokens = max(1, min(max_tokens, max_seq // 4))
    budget = max_seq - max_tokens           # prompt tokens that fit; longer prompts keep their tail
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tok = engine.tokenizer
    per_kind: dict[str, tuple[list[int], list[int]]] = {}
    acc_total = drafted_total = 0
    for kind, prompts in CALIBRATION_PROMPTS.items():
        acc_pos: list[int] = []
        dr_pos: list[int] = []
        for prompt in prompts:
            text = _as_chat(tok, prompt) if kind == "chat" else prompt
            ids = tok.encode(text, add_special_tokens=kind != "chat")[-budget:]
            out = engine.generate(ids, params, num_draft_tokens=k, proposer=proposer)
            st = out.stats
            _add(acc_pos, st.accepted_per_pos)
            _add(dr_pos, st.drafted_per_pos)
            acc_total += st.num_accepted_tokens
            drafted_total += st.num_draft_tokens
            if progress:
                progress(f"calibration {kind}: {st.num_accepted_tokens}/{st.num_draft_tokens} drafts accepted")
        per_kind[kind] = (acc_pos, dr_pos)
    all_acc: list[int] = []
    all_dr: list[int] = []
    for acc_pos, dr_pos in per_kind.values():
        _add(all_acc, acc_pos)
        _add(all_dr, dr_pos)
    by_kind = {kind: estimate_alpha(a, d) for kind, (a, d) in per_kind.items()}
    rate = acc_total / drafted_total if drafted_total else 0.0
    return estimate_alpha(all_acc, all_dr), by_kind, rate


def _add(acc: list[int], values) -> None:
    for i, v in enumerate(values):
        if i >= len(acc):
            acc.append(0)
        acc[i] += int(v)


def _as_chat(tokenizer, prompt: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


CONCURRENCY_LEVELS = (2, 3, 4, 8)        # sequences per step the step times are also measured at
CONCURRENCY_KS = (1, 2, 4, 8)            # verify widths measured there (a line is fitted through them)


def measure_by_concurrency(target_model, draft_model, *, proposer: str, max_draft_len: int, levels: list[int],
                           context: int, decode_step: str, reps: int = 5) -> dict[int, dict]:
    """Target step, verify at K in CONCURRENCY_KS (<= max_draft_len) and draft step with n sequences in the step,
    for each n in `levels`, timed interleaved per n. -> {n: {"t_target_s", "t_verify_s": {K: s}, "t_draft_s"}}
    (t_draft_s 0 for n-gram)."""
    out: dict[int, dict] = {}
    ks = [k for k in CONCURRENCY_KS if k <= max_draft_len]
    for n in levels:
        probes = {("verify", k): forward_probe(target_model, new_tokens=k + 1, context=context, batch=n,
                                               decode_step=decode_step) for k in [0] + ks}
        if proposer == "draft":
            probes[("draft", 1)] = forward_probe(draft_model, new_tokens=1, context=context, batch=n,
                                                 decode_step=decode_step)
        timed = time_interleaved(probes, reps=reps)
        out[n] = {"t_target_s": timed[("verify", 0)], "t_verify_s": {k: timed[("verify", k)] for k in ks},
                  "t_draft_s": timed.get(("draft", 1), 0.0)}
    return out


def calibrate(engine, target_model, draft_model, *, proposer: str, max_draft_len: int, context: int = 96,
              max_tokens: int = 32, reps: int = 7, progress: Callable[[str], None] | None = None) -> Calibration:
    """Time the target/draft forwards, measure acceptance with ``engine``, and pick K (see module docstring)."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    say(f"calibration: timing target step, target verify for K=1..{max_draft_len}"
        + (", draft step" if proposer == "draft" else ""))
    step = engine.config.decode_step
    probes = {("verify", k): forward_probe(target_model, new_tokens=k + 1, context=context, decode_step=step)
              for k in range(0, max_draft_len + 1)}          # K=0: a plain decode step (1 position)
    if proposer == "draft":
        probes[("draft", 1)] = forward_probe(draft_model, new_tokens=1, context=context, decode_step=step)
    timed = time_interleaved(probes, reps=reps)
    t_target = timed[("verify", 0)]
    t_verify = {k: timed[("verify", k)] for k in range(1, max_draft_len + 1)}
    # n-gram lookup runs no model: its cost (microseconds of list search) is left out of the round cost.
    t_draft = timed.get(("draft", 1), 0.0)
    levels = [n for n in CONCURRENCY_LEVELS if n <= engine.config.max_batch_size]
    if levels:
        say(f"calibration: the same step times with {', '.join(map(str, levels))} sequences in a step")
    by_n = measure_by_concurrency(target_model, draft_model, proposer=proposer, max_draft_len=max_draft_len,
                                  levels=levels, context=context, decode_step=step)
    calib_k = min(4, max_draft_len)
    alpha, by_kind, rate = measure_acceptance(engine, proposer=proposer, k=calib_k, max_tokens=max_tokens,
                                              progress=say)
    cost = cost_models({"t_target_s": t_target, "t_verify_s": t_verify, "t_draft_s": t_draft,
                        "proposer": proposer})[proposer]
    k_best, table = speedup_table(alpha, cost, max_draft_len)
    notes = []
    if table[k_best] <= 1.0:
        notes.append(f"no K in 1..{max_draft_len} is predicted to beat plain decoding here "
                     f"(best {table[k_best]:.2f}x at K={k_best}); serve with num_draft_tokens=0 or a cheaper draft.")
    return Calibration(proposer=proposer, context_tokens=context, t_target_s=t_target, t_verify_s=t_verify,
                       t_draft_s=t_draft, cost_ratio=t_draft / t_target if t_target else 0.0, alpha=alpha,
                       alpha_by_kind=by_kind, acceptance_rate=rate, calibration_k=calib_k,
                       predicted_speedup=table, recommended_k=k_best, worth_speculating=table[k_best] > 1.0,
                       seconds=time.perf_counter() - t0, notes=notes, by_concurrency=by_n)


# ---- the crossover concurrency: where speculation stops paying ---------------------------------------------

CROSSOVER_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def crossover_batches(max_batch_size: int) -> list[int]:
    """The concurrencies measured: 1, 2, 3, 4, 6, 8, ... up to max_batch_size (always included)."""
    out = [b for b in CROSSOVER_BATCHES if b < max_batch_size]
    return out + [max_batch_size]


def _decode_rate(engine, prompts: list[list[int]], *, k: int, proposer: str | None, steps: int,
                 max_tokens: int) -> float:
    """Output tok/s of len(prompts) sequences decoding together: the engine's own scheduler steps
    (`Engine.step`), timed after the step that admits them (prefill, first token, draft prefill), for `steps`
    steps; then aborted."""
    from specbuild.engines.embedded import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    counted = {"tokens": 0, "finished": 0}

    def on_output(d) -> None:
        counted["tokens"] += len(d.token_ids)
        counted["finished"] += d.finished

    rids = [engine.submit(p, params, num_draft_tokens=k, proposer=proposer, on_output=on_output) for p in prompts]
    try:
        engine.step()
        n0 = counted["tokens"]
        t0 = time.perf_counter()
        for _ in range(steps):
            if counted["finished"] == len(rids):
                break
            engine.step()
        dt = time.perf_counter() - t0
        return (counted["tokens"] - n0) / dt if dt > 0 else 0.0
    finally:
        for r in rids:
            engine.abort(r)


CLEAR_GAIN = 1.05       # a crossover pair's median below this is measured again (measure_crossover)


def measure_crossover(engine, *, proposer: str, k: int, max_batch_size: int, steps: int = 8, reps: int = 2,
                      confirm_reps: int = 3, prompt_tokens: int = 32, budget_s: float = 20.0,
                      progress: Callable[[str], None] | None = None) -> dict:
    """Measured speedup of speculation (K = `k`, -1 = adaptive) over plain decoding at each concurrency of
    `crossover_batches`, on the engine itself (continuous batching, greedy, built-in prompts).

    Each concurrency is measured `reps` times, off and on back to back (the ratio of each pair, then the
    median, so a load burst on a shared machine hits both alike); a median below `CLEAR_GAIN` (1.05) is
    re-measured with `confirm_reps` more pairs before it counts: one noisy pair must not switch speculation off,
    nor a gain within the probe's noise switch it on (the Intel Xeon's probe gave 1.02x at 4 sequences where
    the served bench then measured 0.90-0.97x, bench/README.md "2026-12-04"). Measuring
    stops at the first concurrency
    where speculation is slower (the crossover), or when `budget_s` is spent. -> {"speedup_by_batch": {b: x},
    "crossover": first b with x < 1 (None: it paid at every measured b), "spec_max_concurrency": the largest
    b below the crossover (0: it never paid; None: it paid everywhere measured), "k", "steps", "reps",
    "measured_up_to", "seconds"}.
    """
    t_start = time.perf_counter()
    load_before = _load_avg()
    say = progress or (lambda msg: None)
    tok = engine.tokenizer
    pool: list[list[int]] = []
    for kind, texts in CALIBRATION_PROMPTS.items():
        for text in texts:
            text = _as_chat(tok, text) if kind == "chat" else text
            pool.append(tok.encode(text, add_special_tokens=kind != "chat")[-prompt_tokens:])
    max_tokens = max(2, min(steps * (engine.config.max_draft_len + 1) + 2,
                            engine.config.max_seq_len - max(len(p) for p in pool)))
    speedup: dict[int, float] = {}
    for b in crossover_batches(max_batch_size):
        prompts = [pool[i % len(pool)] for i in range(b)]
        ratios: list[float] = []
        for rep in range(reps + confirm_reps):
            if rep == reps and statistics.median(ratios) >= CLEAR_GAIN:
                break                        # a loss or a marginal gain is confirmed with more pairs, a clear gain not
            off = _decode_rate(engine, prompts, k=0, proposer=None, steps=steps, max_tokens=max_tokens)
            on = _decode_rate(engine, prompts, k=k, proposer=proposer, steps=steps, max_tokens=max_tokens)
            ratios.append(on / off if off > 0 else 0.0)
        speedup[b] = statistics.median(ratios)
        say(f"calibration crossover ({proposer}): {speedup[b]:.2f}x at concurrency {b}")
        if speedup[b] < 1.0 or time.perf_counter() - t_start > budget_s:
            break
    crossover, cutoff = cutoff_from_speedups(speedup, max_batch_size)
    return {"speedup_by_batch": {str(b): x for b, x in speedup.items()}, "crossover": crossover,
            "spec_max_concurrency": cutoff, "k": "adaptive" if k < 0 else k, "steps": steps, "reps": reps,
            "measured_up_to": max(speedup), "seconds": time.perf_counter() - t_start,
            "load_avg": [load_before, _load_avg()], "cpu_count": os.cpu_count()}


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:          # not on every platform
        return None
