"""K per sequence per step: the policy's concurrency cut-off, adaptive K, one K per proposer batch, and the plain
steps that keep the online cost baseline measured.

For each running sequence, in this order:
1. K = 0 when the sequence asked for none, or when more than the policy's `max_concurrency` sequences run and the
   sequence did not force its K (the cut-off: at high batch a target step is compute-bound, drafting stops paying);
2. never more than max_tokens leaves room for (a round emits at most K + 1 tokens);
3. adaptive sequences: the K that maximizes the predicted speedup from their own acceptance and the cost model
   (`adaptive.py`) at this step's number of sequences (measured online, else the build's step times at the
   nearest calibrated concurrency); several adaptive sequences of one proposer in a step share one batch-optimal
   K, since a batched step drafts as often as its largest K;
4. while sequences keep drafting, one step in `OnlineCosts.explore_every` runs plain so that speculation is
   always judged against what plain decoding costs now (up to 4 times fewer where the step's predicted gain is
   far from 1: `adaptive.explore_spacing`).
"""

from __future__ import annotations

from collections import deque

from specbuild.engines.embedded.adaptive import (AcceptanceTracker, CostModel, OnlineCosts, choose_batch_k, cost_models,
                                                 expected_tokens, prior_alphas, prior_strength)
from specbuild.engines.embedded.config import Policy
from specbuild.engines.embedded.sequence import Sequence


FINISHED_WINDOW = 32      # finished sequences per proposer whose acceptance spread sets a new one's prior strength


def verify_width(n: int, sent: list[int]) -> int:
    """The K per sequence a verify of n sequences that were sent these drafts costs like: the mean, rounded half up,
    at least 1 when anything was drafted (0: a plain step). A verify scores n + sum(sent) rows. Filed under the
    longest draft instead, an n-gram step where one of 4 sequences proposed 6 tokens (10 rows) was priced as
    K 6 at 4 sequences (28 rows), so the draft's adaptive K saw K 6-8 as cheap and chose K 8 there (AMD EPYC
    Zen 4; bench/README.md, "2026-12-06 night")."""
    total = sum(sent)
    return 0 if total <= 0 else max(1, int(total / max(n, 1) + 0.5))


class KPlanner:
    def __init__(self, *, calibration: dict | None, online_costs: bool):
        self.calibration = calibration
        self._by_n: dict[int, dict[str, CostModel]] = {}                 # n -> proposer -> the build's cost model
        self.online = OnlineCosts() if online_costs else None           # step costs measured while serving
        self.alpha_prior = prior_alphas(calibration)                     # proposer -> a new sequence's alpha_hat
        self.finished: dict[str, deque] = {}                             # proposer -> (accepted, trials) of the
                                                                         # last FINISHED_WINDOW adaptive sequences
        self.cutoff_steps_total = 0
        self.steps_total = 0                                             # rounds planned (engine steps)
        self.sequence_steps_total = 0                                    # ... summed over their sequences
        self.last_n = 0                                                  # sequences in the latest step

    def set_calibration(self, calibration: dict | None) -> None:
        self.calibration = calibration
        self._by_n = {}
        for prop, a in prior_alphas(calibration).items():
            if (calibration or {}).get("proposer") == prop and calibration.get("alpha") is not None:
                self.alpha_prior[prop] = a

    def base_costs(self, n: int) -> dict[str, CostModel]:
        """proposer -> the build's cost model at n sequences: its step times measured at the nearest concurrency."""
        if n not in self._by_n:
            self._by_n[n] = cost_models(self.calibration, n)
        return self._by_n[n]

    @property
    def costs(self) -> dict[str, CostModel]:
        """proposer -> the build's cost model for one sequence."""
        return self.base_costs(1)

    def cost(self, proposer: str, n: int) -> CostModel:
        """The cost model adaptive K uses at n sequences: measured online once there is enough, else the build's
        (measured at the nearest concurrency, so a step's first K at a new load is priced for that load)."""
        base = self.base_costs(n)[proposer]
        return self.online.model(n, base) if self.online is not None else base

    def plan(self, seqs: list[Sequence], policy: Policy) -> tuple[list[int], bool]:
        """-> (K per sequence, whether the cut-off applies to this step)."""
        n = self.last_n = len(seqs)
        cutoff = policy.max_concurrency is not None and n > policy.max_concurrency
        self.cutoff_steps_total += cutoff
        self.steps_total += 1
        self.sequence_steps_total += n
        # priced only for the proposers of adaptive sequences that may draft in this step: a step over the
        # cut-off (or with none adaptive) plans exactly like speculation off, with no cost model to build
        costs = {p: self.cost(p, n) for p in dict.fromkeys(
            s.proposer for s in seqs if s.adaptive is not None and s.num_draft_tokens > 0 and not cutoff)}
        ks = [self._k(s, cutoff, costs) for s in seqs]
        self._share(seqs, ks, costs)
        adaptive = [i for i, s in enumerate(seqs) if s.adaptive is not None and ks[i] > 0]
        if (adaptive and self.online is not None and not any(s.forced_k for s in seqs)
                and self.online.wants_plain(n, self._gain(seqs, ks, costs, adaptive))):
            for i in adaptive:                       # a plain step to keep the online baseline measured
                ks[i] = 0
                seqs[i].adaptive.history[-1] = 0
        return ks, cutoff

    @staticmethod
    def _gain(seqs: list[Sequence], ks: list[int], costs: dict[str, CostModel], idx: list[int]) -> float:
        """The predicted speedup of the drafting the adaptive sequences `idx` planned: per proposer, their expected
        tokens over a plain step's (one each) per unit of the step's cost at its largest K; the lowest of the
        proposers (the one closest to giving its gain up)."""
        gains = []
        for p, cost in costs.items():
            mine = [i for i in idx if seqs[i].proposer == p]
            if mine:
                tokens = sum(expected_tokens(seqs[i].adaptive.alpha, ks[i]) for i in mine)
                gains.append(tokens / (len(mine) * cost.cost(max(ks[i] for i in mine))))
        return min(gains, default=1.0)

    @staticmethod
    def _cap(s: Sequence) -> int:
        return max(0, min(s.num_draft_tokens, s.params.max_tokens - s.num_generated - 1))

    def _k(self, s: Sequence, cutoff: bool, costs: dict[str, CostModel]) -> int:
        if (cutoff and not s.forced_k) or s.num_draft_tokens <= 0:
            return 0
        k = self._cap(s)
        if s.adaptive is not None:
            k = s.adaptive.next_k(costs[s.proposer], k)
        return k

    def _share(self, seqs: list[Sequence], ks: list[int], costs: dict[str, CostModel]) -> None:
        for proposer, cost in costs.items():
            idx = [i for i, s in enumerate(seqs) if s.adaptive is not None and s.proposer == proposer
                   and s.num_draft_tokens > 0]
            if len(idx) < 2 or not any(ks[i] for i in idx):
                continue                              # one sequence, or every one chose (or was cut off to) 0
            caps = [self._cap(seqs[i]) for i in idx]
            k = choose_batch_k([seqs[i].adaptive.alpha for i in idx], caps, cost)
            for i, cap in zip(idx, caps):
                ks[i] = min(k, cap)
                seqs[i].adaptive.history[-1:] = [ks[i]]

    def observe(self, n: int, seqs: list[Sequence], proposals: list, t_propose: float, t_score: float) -> None:
        """A finished round's timings (online costs): draft steps are the longest draft-model proposal; the verify
        is filed under `verify_width`, the K per sequence whose n x (K + 1) rows it scored."""
        if self.online is None:
            return
        drafted = [len(p.token_ids) for s, p in zip(seqs, proposals) if p is not None and s.proposer == "draft"]
        sent = [len(p.token_ids) for p in proposals if p is not None]
        self.online.observe(n, verify_width(n, sent), max(drafted, default=0), t_propose, t_score)

    def tracker(self, proposer: str) -> AcceptanceTracker:
        """A new adaptive sequence's tracker: the proposer's starting estimate, worth as many trials as the spread of
        its recent sequences' acceptance allows (`adaptive.prior_strength`)."""
        return AcceptanceTracker(self.alpha_prior[proposer],
                                 strength=prior_strength(self.finished.get(proposer, ())))

    def fold(self, s: Sequence) -> None:
        """A finished adaptive sequence moves its proposer's starting estimate toward its own acceptance, and joins
        the sequences whose spread sets how firm that start is."""
        if s.adaptive is not None:
            self.alpha_prior[s.proposer] = s.adaptive.fold_into(self.alpha_prior[s.proposer])
            if s.adaptive.trials:
                self.finished.setdefault(s.proposer, deque(maxlen=FINISHED_WINDOW)).append(
                    (s.adaptive.accepted, s.adaptive.trials))

    def measured_costs(self, has_draft: bool) -> dict:
        """What adaptive K prices the draft with now, at the latest step's concurrency: c and the plain step (ms),
        measured while serving (online) or else the build's calibration."""
        n = self.last_n or 1
        model = self.cost("draft", n) if has_draft else None
        plain = self.online.plain_ms(n) if self.online is not None else None
        return {"draft_cost_ratio": model.cost_ratio if model is not None else 0.0,
                "draft_cost_source": model.source if model is not None else "none",
                "target_step_ms": plain or 0.0, "cost_concurrency": n}
