"""Request sampling parameters and the logits -> probabilities processing shared by target and draft.

Speculative sampling is lossless only if the draft's q and the target's p are the *processed*
distributions actually sampled from: temperature, top-k and top-p are applied to both with
`processed_probs`, and the output is then distributed exactly as the target's processed distribution.

Numerical safety (every rule of a sampling value lives here, once):
- `temperature` must be finite and >= 0; below `GREEDY_EPSILON` (1e-5) it is greedy (argmax), because
  logits / 1e-40 overflow float32 to inf and softmax turns them into NaN. Above it, logits / T stays finite
  for any float32 logits the model can produce (|logit| < 1e30), and very large T tends to uniform.
- `top_p` must be finite and in (0, 1]: a tiny top_p keeps exactly the most likely token (the kept prefix is
  never empty), 1 is off. `top_k` >= 0: 0 is off, k >= vocab is off, 1 is argmax (under rejection sampling
  too: p and q are then one-hot).
- `processed_probs` refuses (SamplingError) a distribution that is not finite or has no mass, so a model that
  produced NaN fails that one request with a clear message, never a torch.multinomial assertion for the batch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from specbuild.engines.embedded.errors import EngineLimitError, SamplingError

GREEDY_EPSILON = 1e-5       # temperatures below this are greedy


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0        # < GREEDY_EPSILON => greedy
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
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problems = []
        for name in ("max_tokens", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)!r} must be an integer")
        for name in ("temperature", "top_p"):
            if not _is_number(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)!r} must be a number")
        if problems:
            raise EngineLimitError("invalid sampling parameters: " + "; ".join(problems) + ".")
        if self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens} must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature={self.temperature} must be a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty strings")
        if problems:
            raise EngineLimitError("invalid sampling parameters: " + "; ".join(problems) + ".")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """logits [N, V] -> each row's argmax (the first of equal maxima, as torch.argmax): on the fused extension's
    vectorized loop for CPU fp32 logits (torch's took 44 us a 49152-token row, once per draft step and verified row),
    else torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[-1]:
        from specbuild.engines.embedded.fused import argmax_rows

        ids = argmax_rows(logits)
        if ids is not None:
            return ids
    return logits.argmax(-1).tolist()


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature, top-k and top-p (float32).

    Greedy params (temperature < GREEDY_EPSILON) give the one-hot of the argmax."""
    x = logits.float()
    if params.greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    x = x / params.temperature
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
    check_probs(probs)
    return probs


def check_probs(probs: torch.Tensor) -> None:
    """Refuse a distribution torch.multinomial would choke on (non-finite, negative or zero mass)."""
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()) or bool((probs.sum(-1) <= 0).any()):
        raise SamplingError("the sampling distribution is not finite (the model's logits or the sampling "
                            "parameters produced inf/NaN); this request was stopped")


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [N, V] -> [N] (long)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) % (2 ** 64))      # the contract's seed is UINT64: every value its own stream
    return g
