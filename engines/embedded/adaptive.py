"""The one cost model of speculation, and adaptive K: each sequence's own acceptance decides how many tokens
to draft at each step.

Request side: `num_draft_tokens=-1` asks for adaptive mode, and so does a request that sends no K when the
policy's k is "adaptive" (config.py). K then varies per step in [0, max_draft_len]; K = 0 is a plain decode
step (speculation off for sequences where it does not pay).

Model (what `calibrate.py` measures the terms of; Leviathan et al. 2023 with a measured verify cost). With per-token
acceptance a and K drafted tokens one round emits E = (1 - a^(K+1)) / (1 - a) tokens and costs, relative
to a plain target step,

    cost(K) = 1 + c*K + v(K)        c = t_draft / t_target, v(K) = t_verify[K] / t_target - 1, v(0) = 0

so `choose_k` picks argmax_K E(a, K) / cost(K) over K = 0..max_k (K = 0 scores exactly 1.0).

Per sequence, `AcceptanceTracker` keeps an EWMA of a, starting from the engine's running estimate for the
proposer (the calibrated alpha at first, then moved toward each finished adaptive sequence's estimate). A
round that accepted n of k drafts is n successes then (if n < k) one failure; drafts after the first
rejection were never tested and do not count (the estimator of `calibrate.estimate_alpha`). Trial t has
weight max(1 / (t + prior_strength), min_weight): a Beta-posterior-like mean while evidence is thin (an
unrelated draft is off after ~4 rejections), then a forgetting EWMA (one rejection after a long accepted run
moves 0.93 to 0.84, not to K = 0). Once 8 sequences of the proposer have finished, the start is worth as many
trials as the spread of their acceptance allows (`prior_strength`, empirical Bayes: 4 to 16): where they accepted
alike, one rejection at a response's first token moves 0.96 to 0.90 instead of 0.77. A sequence at K = 0
learns nothing, so after `probe_every` consecutive K = 0 steps it drafts one token as a probe; a recovered
acceptance turns speculation back on. A probe that does not turn it back on doubles the wait for the next one
(up to `probe_max` steps): a probe costs a draft step, its catch-up and a wider verify, work speculation off never
does (counted in tests/test_policy_off.py: an unrelated tiny draft over 200 tokens, 26 probes at a fixed 1 in 8,
6 with the doubling).

Worked example (c = 0.3, v(K) = 0.1 + 0.05 K): a = 0.9 -> K = 5 (predicted 1.64x); a = 0.5 -> K = 1 (1.03x);
a = 0.3 -> K = 0 (no K beats plain decoding).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_DRAFT_COST_RATIO = 0.3        # c when no calibration of the draft exists
DEFAULT_VERIFY = (0.1, 0.05)          # v(K) = a + b*K when no calibration exists (intercept, slope)


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens emitted per round] = 1 + a + ... + a^K."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class CostModel:
    """Round cost relative to one plain target step: cost(K) = 1 + c*K + v(K), with v(K) = a + b*K for K >= 1."""
    cost_ratio: float = DEFAULT_DRAFT_COST_RATIO      # c (0 for n-gram: no model runs)
    verify_intercept: float = DEFAULT_VERIFY[0]        # a
    verify_slope: float = DEFAULT_VERIFY[1]            # b
    source: str = "defaults"                           # "calibration" | "defaults"

    def __post_init__(self):
        if min(self.cost_ratio, self.verify_intercept, self.verify_slope) < 0:
            raise ValueError(f"cost model terms must be >= 0, got {self}")

    def verify_overhead(self, k: int) -> float:
        return 0.0 if k <= 0 else self.verify_intercept + self.verify_slope * k

    def cost(self, k: int) -> float:
        return 1.0 + self.cost_ratio * k + self.verify_overhead(k)


def predicted_speedup(alpha: float, k: int, cost: CostModel) -> float:
    """((1 - a^(K+1)) / (1 - a)) / (1 + c*K + v(K)); exactly 1.0 at K = 0."""
    return expected_tokens(alpha, k) / cost.cost(k)


def choose_k(alpha: float, cost: CostModel, max_k: int) -> int:
    """The K in [0, max_k] with the highest predicted speedup (the smaller K on ties)."""
    best_k, best = 0, 1.0
    for k in range(1, max(max_k, 0) + 1):
        s = predicted_speedup(alpha, k, cost)
        if s > best + 1e-12:
            best_k, best = k, s
    return best_k


def _verify_points(t_target: float, t_verify: dict[int, float]) -> list[tuple[int, float]]:
    """(K, v(K) = t_verify[K] / t_target - 1) for each measured K >= 1, in K order."""
    return [(k, t / t_target - 1.0) for k, t in sorted(t_verify.items()) if k >= 1 and t > 0]


def fit_verify_curve(t_target: float, t_verify: dict[int, float]) -> tuple[float, float]:
    """Least-squares line v(K) = a + b*K through the measured t_verify[K] / t_target - 1 (K >= 1), with
    a, b >= 0: single timings on a shared machine are noisy, the line is not, and a verify over more
    positions is never cheaper."""
    pts = _verify_points(t_target, t_verify)
    if not pts:
        return DEFAULT_VERIFY
    if len(pts) == 1:
        return max(pts[0][1], 0.0), 0.0
    n = len(pts)
    mk = sum(k for k, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    var = sum((k - mk) ** 2 for k, _ in pts)
    b = max(sum((k - mk) * (v - mv) for k, v in pts) / var, 0.0)
    a = mv - b * mk
    if a < 0:                          # keep the line through the data's mean with a >= 0
        a, b = 0.0, max(mv / mk, 0.0)
    return a, b


def narrow_verify_curve(t_target: float, t_verify: dict[int, float], base: CostModel) -> tuple[float, float]:
    """The verify line where the Ks measured online span less than 2 (one K, or two neighbours): they tell the
    level of the verify cost, not how it grows with K. So the slope is the calibration's (`base`), or the points'
    own where two give a steeper one, and the intercept puts the line through the points' mean (never below 0:
    then the line is the calibration's slope from 0, dearer than the points rather than flat). Fitted as a line
    alone, one K gave b = 0 and every K was priced at that K's cost: after n-gram traffic had verified only K 1
    at 4 sequences, adaptive K chose K 8 there, a verify of 36 rows at 3.0 plain steps where K 1's cost 1.05
    (AMD EPYC Zen 4; bench/README.md, "2026-12-06 night")."""
    pts = _verify_points(t_target, t_verify)
    if not pts:
        return DEFAULT_VERIFY
    own = fit_verify_curve(t_target, t_verify)[1] if len(pts) >= 2 else 0.0
    b = max(base.verify_slope, own)
    mk = sum(k for k, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    return max(mv - b * mk, 0.0), b


def cost_models(calibration: dict | None, n: int = 1) -> dict[str, CostModel]:
    """Cost models per proposer from the calibration `build` stores in engine_config.json (`calibrate.py`
    `Calibration.to_dict()`: t_target_s, t_verify_s {"K": s}, t_draft_s, proposer); defaults when absent.

    `n` sequences in the step: the step times measured at the concurrency nearest n (`by_concurrency`, the larger
    one on a tie) replace the one-sequence times. At 2+ rows a verify of K+1 positions per sequence is
    compute-bound where one row is bandwidth-bound, so pricing it with one sequence's costs picks too large a K
    (measured on the 2-core AMD EPYC: the K that one sequence's costs pick, 0.96-0.99x at 3 sequences, where K=2
    gave 1.05x)."""
    draft, ngram = CostModel(), CostModel(cost_ratio=0.0)
    cal = dict(calibration or {})
    at = concurrency_costs(cal, n)
    if at is not None:
        cal.update(at)
    t_target = float(cal.get("t_target_s") or 0.0)
    if t_target > 0 and cal.get("t_verify_s"):
        a, b = fit_verify_curve(t_target, {int(k): float(v) for k, v in cal["t_verify_s"].items()})
        ngram = CostModel(0.0, a, b, "calibration")
        c = float(cal.get("t_draft_s") or 0.0) / t_target if cal.get("proposer") == "draft" else None
        draft = CostModel(c if c is not None else DEFAULT_DRAFT_COST_RATIO, a, b, "calibration")
    return {"draft": draft, "ngram": ngram}


def concurrency_costs(calibration: dict | None, n: int) -> dict | None:
    """The step times (t_target_s, t_verify_s, t_draft_s) measured at the concurrency nearest `n` > 1 in the
    calibration's `by_concurrency` (ties: the larger, so pricing errs toward the dearer step); None at n <= 1 or
    when none was measured. Example: measured at 2, 4, 8 -> n=3 uses 4's, n=6 uses 8's, n=16 uses 8's."""
    table = {int(m): row for m, row in ((calibration or {}).get("by_concurrency") or {}).items()}
    if n <= 1 or not table:
        return None
    return table[min(table, key=lambda m: (abs(m - n), -m))]


@dataclass(frozen=True)
class AdaptivePolicy:
    prior_strength: float = 4.0      # pseudo-trials behind the starting estimate
    min_weight: float = 0.1          # EWMA weight of one trial once evidence has built up
    prior_alpha: float = 0.8         # optimistic start: a failing draft is off after ~4 rejections, while a
                                     # pessimistic one would sit at K = 0 and learn only from probes
    probe_every: int = 8             # after this many K = 0 steps in a row, draft 1 token to re-measure ...
    probe_max: int = 128             # ... and twice as many after each probe that did not turn drafting back on

    def __post_init__(self):
        if (not 0 < self.min_weight <= 1 or self.prior_strength < 0 or not 0 <= self.prior_alpha <= 1
                or self.probe_every < 1 or self.probe_max < self.probe_every):
            raise ValueError(f"invalid adaptive policy {self}")


def prior_alphas(calibration: dict | None, policy: AdaptivePolicy = AdaptivePolicy()) -> dict[str, float]:
    """Starting alpha_hat per proposer: the calibrated alpha for the calibrated proposer, else the policy's."""
    out = {"draft": policy.prior_alpha, "ngram": policy.prior_alpha}
    cal = calibration or {}
    if cal.get("proposer") in out and cal.get("alpha") is not None:
        out[cal["proposer"]] = min(max(float(cal["alpha"]), 0.0), 1.0)
    return out


def prior_strength(finished: Iterable[tuple[int, int]], policy: AdaptivePolicy = AdaptivePolicy(),
                   most: float = 16.0, least_sequences: int = 8) -> float:
    """How many trials the engine's starting estimate is worth, from how much finished sequences' acceptance varied
    (empirical Bayes; `finished`: (accepted, trials) per sequence). With per-sequence rates drawn from a Beta of
    mean m and strength s, the rates vary by m(1 - m)/(s + 1) beyond what their own trials add (m(1 - m)/n each),
    so s = m(1 - m)/that excess - 1, between the policy's prior_strength and `most`. Traffic whose sequences
    accept alike (the int4 self-draft: 91-98 % per prompt) earns a firm start, and one early rejection no longer
    drags alpha_hat from 0.96 to 0.77 (K 8 -> 3 for the rest of a 16-token request); traffic that mixes drafts that
    fit with ones that do not keeps the policy's 4, so an unfit request still stops drafting after a few
    rejections. Fewer than `least_sequences` with trials: the policy's."""
    seqs = [(a, n) for a, n in finished if n > 0]
    if len(seqs) < least_sequences:
        return policy.prior_strength
    m = sum(a for a, _ in seqs) / sum(n for _, n in seqs)
    if not 0.0 < m < 1.0:
        return most                                 # every trial agreed: nothing varied
    var = sum((a / n - m) ** 2 for a, n in seqs) / (len(seqs) - 1)
    noise = m * (1 - m) * sum(1 / n for _, n in seqs) / len(seqs)
    excess = var - noise
    if excess <= 0:
        return most
    return min(max(m * (1 - m) / excess - 1.0, policy.prior_strength), most)


@dataclass
class AcceptanceTracker:
    """Per-sequence adaptive-K state: alpha_hat (EWMA) and the run of K = 0 steps (for probing).

    `strength`: the trials the starting alpha is worth (`prior_strength`); None: the policy's prior_strength and
    min_weight as they are. Given, trial t weighs max(1 / (t + strength), min(min_weight, 1 / (2 strength))): a
    firmer start also keeps its Beta-posterior phase for as many trials again before forgetting sets in."""
    alpha: float
    policy: AdaptivePolicy = field(default_factory=AdaptivePolicy)
    strength: float | None = None
    zero_steps: int = 0
    probe_gap: int = 0                                   # K = 0 steps before the next probe (0: probe_every)
    trials: int = 0                                      # acceptance trials observed
    accepted: int = 0                                    # ... of them accepted
    history: list[int] = field(default_factory=list)     # K chosen at each step (within the max_tokens cap)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """A round that drafted `num_draft` tokens and accepted `num_accepted` of them."""
        if num_draft <= 0:
            return
        outcomes = [1.0] * num_accepted + ([0.0] if num_accepted < num_draft else [])
        s, floor = self.policy.prior_strength, self.policy.min_weight
        if self.strength is not None:
            s, floor = self.strength, min(floor, 1.0 / (2.0 * self.strength))
        for x in outcomes:
            self.trials += 1
            w = max(1.0 / (self.trials + s), floor)
            self.alpha += w * (x - self.alpha)
            self.accepted += int(x)

    def fold_into(self, prior: float, weight: float = 0.3) -> float:
        """The engine-wide prior after this (finished) sequence: moved toward its alpha if it observed any."""
        return prior + weight * (self.alpha - prior) if self.trials else prior

    def next_k(self, cost: CostModel, max_k: int) -> int:
        k = choose_k(self.alpha, cost, max_k)
        gap = self.probe_gap or self.policy.probe_every
        if k == 0 and max_k > 0:
            self.zero_steps += 1
            if self.zero_steps >= gap:            # a probe; if it does not turn drafting on, wait twice as long
                self.zero_steps, k = 0, 1
                self.probe_gap = min(2 * gap, self.policy.probe_max)
        else:
            self.zero_steps = 0
            if k > 0:                             # drafting by choice again: probes start over at probe_every
                self.probe_gap = 0
        self.history.append(k)
        return k


def choose_batch_k(alphas: list[float], caps: list[int], cost: CostModel) -> int:
    """One K for the adaptive sequences sharing a batched step.

    A batched step drafts as many times as its largest K and verifies padded to it, so per-sequence choices
    make the whole batch pay for the most optimistic sequence. Instead pick the K maximizing the batch's
    expected tokens per unit of step cost: sum_i E_i(min(K, cap_i)) / cost(K), over K in [0, max(caps)].

    Example: alphas [0.9, 0.1] with c = 0.3 -> a small K (the second sequence gains nothing from drafting).
    """
    if not alphas:
        return 0
    best_k, best = 0, float(len(alphas))          # K = 0: one token each at cost 1
    for k in range(1, max(caps) + 1):
        gain = sum(expected_tokens(a, min(k, cap)) for a, cap in zip(alphas, caps)) / cost.cost(k)
        if gain > best + 1e-12:
            best_k, best = k, gain
    return best_k


def cutoff_from_speedups(speedup: dict[int, float], max_batch_size: int) -> tuple[int | None, int | None]:
    """(crossover, max_concurrency) from measured speedups by concurrency: the crossover is the lowest
    concurrency where speculation was slower than plain decoding; the cut-off is the largest measured one
    below it (0: it never paid), or None when it paid at every concurrency up to max_batch_size.

    Example: {1: 1.5, 2: 1.2, 3: 1.05, 4: 0.9}, 8 -> (4, 3); {1: 1.4, 2: 1.1}, 2 -> (None, None);
    {1: 1.3, 2: 1.1} (measuring stopped early), 8 -> (None, 2); {1: 0.8}, 8 -> (1, 0).
    """
    crossover = next((b for b in sorted(speedup) if speedup[b] < 1.0), None)
    if crossover is None and speedup and max(speedup) >= max_batch_size:
        return None, None
    paid = [b for b in sorted(speedup) if crossover is None or b < crossover]
    return crossover, (max(paid) if paid else 0)


EXPLORE_SPACING = ((1.5, 4), (1.25, 2))   # (predicted gain at least, plain steps this many times further apart)


def explore_spacing(gain: float | None) -> int:
    """How many times `OnlineCosts.explore_every` apart the plain steps that re-measure the baseline run, for a
    step whose drafting is predicted to give `gain` (its tokens per plain-step cost over plain decoding's). Near
    1 (or unknown) every `explore_every` steps: a baseline a little off flips the choice there. At 1.5x and more
    the baseline would have to be off by half to make plain decoding the better choice, so a quarter as often."""
    if gain is None:
        return 1
    return next((m for at, m in EXPLORE_SPACING if gain >= at), 1)


class OnlineCosts:
    """Step costs measured while serving, per number of sequences in the step (n), for adaptive K.

    The build's calibration times bare forwards on a quiet moment; what a round costs in the engine (Python
    around the forwards, the int8 kernel against the fp32 one, other load on a shared machine) can differ
    enough to flip the sign of the gain (measured here: c = 0.74 calibrated, 0.8-0.9 in the serving loop).
    So every step reports its timings: a step where nobody drafted is a plain target step at n rows; a
    drafting step gives the time per draft step (propose time / draft steps) and the verify time for its K.
    `model(n, base)` turns the medians of the last `window` samples into the cost model adaptive K uses,
    relative to the plain step at the same n (c = draft step / plain step, v(K) = verify(K) / plain step - 1,
    fitted as a line like the calibration's; where the Ks measured span less than 2, at least the calibration's
    slope: `narrow_verify_curve`). Until `min_samples` plain and drafting steps were seen at n, it
    returns `base` (the calibration). While sequences keep drafting, every `explore_every`-th step at n is run
    plain (`wants_plain`) so the baseline stays measured: speculation is judged against what off costs now;
    `explore_spacing` times further apart where the step's predicted gain is far from 1, since there a plain step
    that measures the baseline cannot change the choice and costs the gain it gives up (by the cost model, at 2x
    with K 8 rounds of 3.3 plain steps, a plain step after 16 drafting ones costs 0.9 % of the tokens per second,
    after 64 0.2 %; two alternating `bench_adaptive` pairs on an AMD EPYC Zen 4 could not resolve it: +-3 %).
    A K not verified in the last `stale_after` steps at n leaves the fit (`fresh_verify_keys`).
    """

    def __init__(self, *, window: int = 15, min_samples: int = 3, explore_every: int = 16, stale_after: int = 64):
        self.window, self.min_samples, self.explore_every = window, min_samples, explore_every
        self.stale_after = stale_after
        self.plain: dict[int, deque] = {}
        self.draft_step: dict[int, deque] = {}
        self.verify: dict[tuple[int, int], deque] = {}
        self._since_plain: dict[int, int] = {}
        self._steps: dict[int, int] = {}                   # n -> steps observed at n
        self._verify_seen: dict[tuple[int, int], int] = {}  # (n, K) -> the step at n that last verified K

    def _add(self, table: dict, key, value: float) -> None:
        table.setdefault(key, deque(maxlen=self.window)).append(value)

    def observe(self, n: int, max_k: int, draft_steps: int, t_propose: float, t_score: float) -> None:
        if n <= 0 or t_score <= 0:
            return
        self._steps[n] = self._steps.get(n, 0) + 1
        if max_k <= 0:
            self._add(self.plain, n, t_score)
            self._since_plain[n] = 0
            return
        self._since_plain[n] = self._since_plain.get(n, 0) + 1
        self._add(self.verify, (n, max_k), t_score)
        self._verify_seen[(n, max_k)] = self._steps[n]
        if draft_steps > 0:
            self._add(self.draft_step, n, t_propose / draft_steps)

    def wants_plain(self, n: int, gain: float | None = None) -> bool:
        """Run this step plain to (re)measure the baseline at n: too few plain samples, or none for a while (
        `explore_every` steps, times `explore_spacing(gain)`: gain is the predicted speedup of what the step would
        draft; None: unknown, the closest spacing)."""
        if not self.verify_keys(n):
            return False                                  # nobody drafted at n yet: nothing to compare
        if len(self.plain.get(n, ())) < self.min_samples:
            return True
        return self._since_plain.get(n, 0) >= self.explore_every * explore_spacing(gain)

    def verify_keys(self, n: int) -> list[int]:
        return sorted(k for (m, k) in self.verify if m == n)

    def fresh_verify_keys(self, n: int) -> list[int]:
        """The Ks verified at n within the last `stale_after` steps at n (all of them if none is). A K that
        adaptive K stopped choosing is never measured again: a few slow verifies at it (a cold start, a noisy
        minute) would otherwise price it for good, and at K = 0 the probes (K = 1) could not move that price."""
        keys = self.verify_keys(n)
        now = self._steps.get(n, 0)
        fresh = [k for k in keys if now - self._verify_seen.get((n, k), 0) < self.stale_after]
        return fresh or keys

    def model(self, n: int, base: CostModel) -> CostModel:
        plain = self.plain.get(n)
        if plain is None or len(plain) < self.min_samples:
            return base
        t_plain = statistics.median(plain)
        t_verify = {k: statistics.median(self.verify[(n, k)]) for k in self.fresh_verify_keys(n)}
        if not t_verify or sum(len(self.verify[(n, k)]) for k in t_verify) < self.min_samples:
            return base
        if max(t_verify) - min(t_verify) >= 2:
            a, b = fit_verify_curve(t_plain, t_verify)
        else:
            a, b = narrow_verify_curve(t_plain, t_verify, base)
        c = base.cost_ratio
        steps = self.draft_step.get(n)
        if base.cost_ratio > 0 and steps and len(steps) >= self.min_samples:
            c = statistics.median(steps) / t_plain
        return CostModel(c, a, b, "online")

    def plain_ms(self, n: int) -> float | None:
        """Median plain target step at n sequences (ms), None before any."""
        return 1000 * statistics.median(self.plain[n]) if self.plain.get(n) else None

    def snapshot(self) -> dict:
        """Medians per n (ms) for benchmarks."""
        out = {}
        for n in sorted(set(self.plain) | {m for m, _ in self.verify}):
            row = {}
            if self.plain.get(n):
                row["plain_ms"] = self.plain_ms(n)
            if self.draft_step.get(n):
                row["draft_step_ms"] = 1000 * statistics.median(self.draft_step[n])
            row["verify_ms"] = {k: 1000 * statistics.median(self.verify[(n, k)]) for k in self.verify_keys(n)}
            out[n] = row
        return out
