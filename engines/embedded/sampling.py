"""Request sampling parameters and the logits -> probabilities processing shared by target and draft.

Speculative sampling is lossless only if the draft's q and the target's p are the *processed*
distributions actually sampled from: temperature, top-k and top-p are applied to both with
`processed_probs`, and the output is then distributed exactly as the target's processed distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbuild.engines.embedded.errors import EngineLimitError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0        # 0 => greedy
    top_k: int = 0                  # 0 => off
    top_p: float = 1.0
    seed: int | None = None         # reproducible sampling per request
    min_tokens: int = 0
    stop: tuple[str, ...] = ()      # stop strings (not included in output)
    stop_token_ids: tuple[int, ...] | None = None   # None => the tokenizer's EOS (end_id)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise EngineLimitError("invalid sampling parameters: " + "; ".join(problems) + ".")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature, top-k and top-p (float32)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, idx = probs.sort(dim=-1, descending=True)
        cum = sp.cumsum(-1)
        drop = (cum - sp) >= params.top_p             # keep the smallest prefix whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [N, V] -> [N] (long)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
