"""Per-request state and the dataclasses exchanged with callers (StreamDelta, RequestOutput).

Cache invariant for a running sequence with n = len(tokens):
- the target cache holds positions 0..n-2 (`target_len == n - 1`): the last token is fed by the next step;
- the draft cache holds positions 0..draft_len-1, all equal to tokens[:draft_len] (draft_len <= n - 1 after
  a step; the proposer first feeds tokens[draft_len:n] to catch up: one token, or two after a fully
  accepted draft — the last draft token and the bonus, gpt-fast's "fill last token into draft model").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from specbuild.engines.embedded.adaptive import AcceptanceTracker
from specbuild.engines.embedded.detok import IncrementalDetokenizer
from specbuild.engines.embedded.sampling import SamplingParams
from specbuild.engines.embedded.stats import SpecStats


@dataclass
class StreamDelta:
    request_id: str
    token_ids: list[int]            # new tokens this step (accepted drafts + bonus)
    text: str                       # detokenized delta carrying its own spacing ("" allowed)
    finished: bool
    finish_reason: str | None       # "stop" | "length" | "abort" | "error"
    stats: SpecStats | None         # set on the finishing delta
    error: str | None = None
    error_kind: str | None = None   # with error: "internal" (engine failed on it) | "unavailable" (overload)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecStats


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    num_draft_tokens: int           # K requested (0 = speculation off); with `adaptive`: the most K may reach
    proposer: str                   # "draft" | "ngram"
    on_output: Callable[[StreamDelta], None]
    stop_ids: frozenset
    detok: IncrementalDetokenizer
    stats: SpecStats
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    slot: int = -1
    target_len: int = 0
    draft_len: int = 0
    finished: bool = False
    finish_reason: str | None = None
    slot_released: bool = False
    final_sent: bool = False
    error: str | None = None
    adaptive: AcceptanceTracker | None = None   # set = adaptive K (num_draft_tokens=-1 or the engine default)
    forced_k: bool = False          # the request sent its own K > 0: drafts even above the policy's max_concurrency
    enqueued_at: float = 0.0                    # scheduler clock when it joined the waiting queue

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, list(self.prompt_ids), self.generated, self.detok.text,
                             self.finish_reason or "abort", self.stats)
