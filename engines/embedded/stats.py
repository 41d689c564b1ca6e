"""SpecStats: what speculation did for one request (or a whole engine), observe-then-derive (vLLM v1 style).

Derived figures:
- acceptance_rate      = accepted draft tokens / drafted tokens
- mean_accepted_length = 1 + accepted / drafts   (tokens emitted per target verify step that drafted)
- system_efficiency    = emitted / ((K + 1) * drafts)   (vLLM v0; 1.0 = every draft accepted)
- tok/s                = generated tokens / (last token time - start)
K may change from step to step (adaptive K, the concurrency cut-off, a short n-gram match): every count is of
tokens actually drafted. `k_counts[K]` = verify steps that drafted K tokens (K = 0: a plain decode step);
`cutoff_steps` = steps where the concurrency cut-off (the policy's `max_concurrency`) switched speculation off.
Stage timings (prefill / propose / score / accept seconds) are summed per step; a batched step's time counts
for every request in it. The clock is injectable for tests.
"""

from __future__ import annotations

import time
from typing import Callable


class SpecStats:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.start_time = clock()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_drafts = 0                 # verify steps that carried >= 1 drafted token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_in_drafts = 0      # tokens emitted by those steps (accepted + recovered/bonus)
        self.max_k_sum = 0                  # sum over drafts of (K + 1), for system efficiency
        self.accepted_per_pos: list[int] = []
        self.drafted_per_pos: list[int] = []
        self.generated_tokens = 0
        self.steps = 0
        self.k_counts: dict[int, int] = {}  # K actually drafted -> number of verify steps
        self.cutoff_steps = 0
        self.stage_seconds = {"prefill": 0.0, "propose": 0.0, "score": 0.0, "accept": 0.0}

    def observe_draft(self, num_draft: int, num_accepted: int) -> None:
        """One verify step of one request with `num_draft` drafted tokens, `num_accepted` of them accepted."""
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"num_accepted={num_accepted} not in [0, num_draft={num_draft}]")
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_in_drafts += num_accepted + 1
        self.max_k_sum += num_draft + 1
        while len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.append(0)
            self.drafted_per_pos.append(0)
        for i in range(num_draft):
            self.drafted_per_pos[i] += 1
            if i < num_accepted:
                self.accepted_per_pos[i] += 1

    def observe_step(self, num_draft: int, *, cutoff: bool = False) -> None:
        """One verify step of one request that drafted `num_draft` tokens (0 = plain decode step)."""
        self.k_counts[num_draft] = self.k_counts.get(num_draft, 0) + 1
        if cutoff:
            self.cutoff_steps += 1

    def observe_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = self._clock()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.generated_tokens += n
        self.steps += 1

    def add_time(self, stage: str, seconds: float) -> None:
        self.stage_seconds[stage] += seconds

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def system_efficiency(self) -> float:
        return self.num_emitted_in_drafts / self.max_k_sum if self.max_k_sum else 0.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    @property
    def elapsed(self) -> float:
        end = self.last_token_time if self.last_token_time is not None else self._clock()
        return max(end - self.start_time, 0.0)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start_time

    def merge(self, other: "SpecStats") -> None:
        """Add another request's counters (engine-wide totals)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_in_drafts += other.num_emitted_in_drafts
        self.max_k_sum += other.max_k_sum
        self.generated_tokens += other.generated_tokens
        self.steps += other.steps
        for i, (a, d) in enumerate(zip(other.accepted_per_pos, other.drafted_per_pos)):
            if i >= len(self.accepted_per_pos):
                self.accepted_per_pos.append(0)
                self.drafted_per_pos.append(0)
            self.accepted_per_pos[i] += a
            self.drafted_per_pos[i] += d
        for k, v in other.stage_seconds.items():
            self.stage_seconds[k] += v
        for k, v in other.k_counts.items():
            self.k_counts[k] = self.k_counts.get(k, 0) + v
        self.cutoff_steps += other.cutoff_steps

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_per_pos": self.acceptance_per_pos,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "system_efficiency": self.system_efficiency,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "k_counts": {str(k): v for k, v in sorted(self.k_counts.items())},
            "cutoff_steps": self.cutoff_steps,
            "elapsed_s": self.elapsed,
            "ttft_s": self.ttft,
            "tokens_per_second": self.tokens_per_second,
            "stage_seconds": dict(self.stage_seconds),
        }

    def __repr__(self) -> str:
        return (f"SpecStats(drafts={self.num_drafts}, drafted={self.num_draft_tokens}, "
                f"accepted={self.num_accepted_tokens}, rate={self.acceptance_rate:.3f}, "
                f"mean_len={self.mean_accepted_length:.2f}, tokens={self.generated_tokens})")
