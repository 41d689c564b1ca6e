"""Scorer: the target verifies [last, d1..dK] of every running sequence in ONE batched forward.

Rows are ragged (different K per sequence, K = 0 is a plain decode step); the result is, per sequence,
logits [K_i + 1, V] for the positions n-1 .. n-1+K_i, i.e. the target's prediction after `last` and after
each draft. Processing (min_tokens suppression of stop ids) is applied here so greedy and sampling
acceptance see the same logits as a target-only run would.
"""

from __future__ import annotations

import torch

from specbuild.engines.embedded.model import CachedRunner, ragged_forward


class TargetScorer(CachedRunner):
    length_attr = "target_len"

    @torch.inference_mode()
    def score(self, seqs, drafts: list[list[int]], between=None) -> list[torch.Tensor]:
        """-> per sequence, logits [len(drafts[i]) + 1, V] (float32). `between`: see `ragged_forward`."""
        rows = [[s.tokens[-1]] + d for s, d in zip(seqs, drafts)]
        starts = [len(s.tokens) - 1 for s in seqs]
        logits = ragged_forward(self.model, self.cache, [s.slot for s in seqs], starts, rows, "all", self.device,
                                between=between)
        out, o = [], 0
        for s, r in zip(seqs, rows):
            lg = logits[o:o + len(r)]
            o += len(r)
            if s.params.min_tokens and s.num_generated < s.params.min_tokens and s.stop_ids:
                lg = suppress_stop_ids(lg, s.num_generated, s.params.min_tokens, s.stop_ids)
            out.append(lg)
        return out


def suppress_stop_ids(logits: torch.Tensor, num_generated: int, min_tokens: int, stop_ids) -> torch.Tensor:
    """Row j predicts generated token number num_generated + j; before min_tokens, stop ids get -inf."""
    rows = min(logits.shape[0], min_tokens - num_generated)
    logits = logits.clone()
    ids = torch.tensor(sorted(stop_ids), device=logits.device)
    logits[:rows, ids] = float("-inf")
    return logits
