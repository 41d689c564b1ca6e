"""Scorer: the target verifies [last, d1..dK] of every running sequence in ONE batched forward.

Rows are ragged (different K per sequence, K = 0 is a plain decode step); the result is, per sequence,
logits [K_i + 1, V] for the positions n-1 .. n-1+K_i, i.e. the target's prediction after `last` and after
each draft. Processing (min_tokens suppression of stop ids) is applied here so greedy and sampling
acceptance see the same logits as a target-only run would.
"""

from __future__ import annotations

import torch

from specbuild.engines.embedded.kernels import TiledLinear
from specbuild.engines.embedded.model import CachedRunner, ragged_forward


class GreedyRows(list):
    """The target's token at each scored position of a greedy sequence (its argmax, bitwise the one of the logits
    `score` would have returned), where a verify needed no logits: the acceptor takes it as the logits' argmax."""


class TargetScorer(CachedRunner):
    length_attr = "target_len"

    def __init__(self, model, cache, device):
        super().__init__(model, cache, device)
        if self.screens():
            model.lm_head.prepare_screen()      # its Q8_0 copy now, not in the first request's step

    def screens(self) -> bool:
        """Can a greedy verify take its tokens from the lm_head's own `greedy_ids` (kernels.TiledLinear: a Q8_0
        screen with a proven bound, then the fp32 logits of the few outputs that can still be the largest)?"""
        head = self.model.lm_head            # not a block head's greedy_ids: a draft's screen is a guess, not exact
        return isinstance(head, TiledLinear) and head.screens()

    @torch.inference_mode()
    def score(self, seqs, drafts: list[list[int]], between=None, tokens_only: bool = False) -> list:
        """-> per sequence, logits [len(drafts[i]) + 1, V] (float32). `between`: see `ragged_forward`.
        tokens_only: where every sequence is greedy with nothing to suppress and the lm_head screens, each
        sequence's `GreedyRows` instead (the head reads ~a quarter of its bytes: the target's step 3.5 -> 1.2 ms
        for its head at 1 row, 4.3-4.9 -> 2.5 ms at 9, on a 49152 x 576 head, AMD EPYC Zen 4)."""
        rows = [[s.tokens[-1]] + d for s, d in zip(seqs, drafts)]
        starts = [len(s.tokens) - 1 for s in seqs]
        if tokens_only and all(s.params.greedy and not _suppresses(s) for s in seqs) and self.screens():
            h = ragged_forward(self.model, self.cache, [s.slot for s in seqs], starts, rows, "hidden_all",
                               self.device, between=between)
            ids = self.model.lm_head.greedy_ids(h)
            out, o = [], 0
            for r in rows:
                out.append(GreedyRows(ids[o:o + len(r)]))
                o += len(r)
            return out
        logits = ragged_forward(self.model, self.cache, [s.slot for s in seqs], starts, rows, "all", self.device,
                                between=between)
        out, o = [], 0
        for s, r in zip(seqs, rows):
            lg = logits[o:o + len(r)]
            o += len(r)
            if _suppresses(s):
                lg = suppress_stop_ids(lg, s.num_generated, s.params.min_tokens, s.stop_ids)
            out.append(lg)
        return out


def _suppresses(s) -> bool:
    """Are the sequence's stop ids still suppressed (min_tokens not yet generated)?"""
    return bool(s.params.min_tokens and s.num_generated < s.params.min_tokens and s.stop_ids)


def suppress_stop_ids(logits: torch.Tensor, num_generated: int, min_tokens: int, stop_ids) -> torch.Tensor:
    """Row j predicts generated token number num_generated + j; before min_tokens, stop ids get -inf."""
    rows = min(logits.shape[0], min_tokens - num_generated)
    logits = logits.clone()
    ids = torch.tensor(sorted(stop_ids), device=logits.device)
    logits[:rows, ids] = float("-inf")
    return logits
