"""Proposers: who drafts the K tokens the target verifies.

- `DraftModelProposer`: runs the draft model, batched across the sequences that speculate, K_i steps each, on
  its own KV cache (same slot numbers as the target; caught up with the accepted tokens before drafting) or, a
  self-draft with the engine's `draft_kv="shared"`, on the target's cache (it writes only the positions the
  round's verify overwrites).
- `NgramProposer`: prompt lookup over the request's own tokens; no model, deterministic (q is one-hot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specbuild.engines.embedded.model import CachedRunner, ragged_forward
from specbuild.engines.embedded.sampling import greedy_ids, processed_probs, sample


@dataclass
class Proposal:
    token_ids: list[int]                  # [k] drafted tokens (k may be below the requested K, even 0)
    probs: torch.Tensor | None = None     # [k, V] processed draft distributions sampled from; None = one-hot


class NgramProposer:
    """Prompt-lookup decoding: match the last n tokens (n = max_n..min_n) earlier in the sequence and propose
    the tokens that followed the most recent match.

    Example: tokens [1 2 3 4 9 1 2 3], max_n=3, k=2: suffix [1 2 3] also occurs at 0 -> propose [4, 9].
    """

    def __init__(self, min_n: int = 1, max_n: int = 3):
        self.min_n, self.max_n = min_n, max_n

    def propose_one(self, tokens: list[int], k: int) -> Proposal:
        n_tok = len(tokens)
        if k <= 0:
            return Proposal([])
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = tokens[n_tok - n:]
            first = suffix[0]
            best: list[int] = []
            # the most recent earlier occurrence with a full k-token continuation, else the longest one
            for i in range(n_tok - n - 1, -1, -1):
                if tokens[i] == first and tokens[i:i + n] == suffix:
                    cont = tokens[i + n:i + n + k]
                    if len(cont) > len(best):
                        best = cont
                        if len(best) == k:
                            break
            if best:
                return Proposal(best)
        return Proposal([])


class DraftModelProposer(CachedRunner):
    """`shares_target_kv`: the cache is the target's (a self-draft, engine `draft_kv="shared"`): the draft reads the
    target's K/V for every accepted position and writes only at n-1.., which the round's verify overwrites."""

    length_attr = "draft_len"

    def __init__(self, model, cache, device, *, shares_target_kv: bool = False):
        super().__init__(model, cache, device)
        self.shares_target_kv = shares_target_kv
        if hasattr(model.lm_head, "prepare_screen"):
            model.lm_head.prepare_screen()          # its Q4_1 copy now, not in the first request's draft step

    @torch.inference_mode()
    def propose(self, seqs, ks: list[int], stop_early: Callable[[], bool] | None = None,
                between: Callable[[], None] | None = None) -> list[Proposal]:
        """Draft ks[i] tokens for seqs[i] (batched; rows leave the batch once they have their K).

        `stop_early()` is asked after each draft step: True (a new request can be admitted) ends drafting with
        what each row has (at least one token), so a newcomer's first token waits for one draft step and a
        short verify, not a whole round. Proposing fewer tokens never changes the output (K may vary).
        `between`: handed to each draft forward (`ragged_forward`): for a draft whose step streams
        `model.PIECES_MIN_BYTES` or more, the scheduler admits a newcomer between a draft step's pieces, so it
        waits for a third of a draft step, not for all of it."""
        out = [Proposal([]) for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        if not live:
            return out
        drafted: dict[int, list[int]] = {i: [] for i in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        if self.shares_target_kv:               # the target's cache holds 0..target_len-1 = 0..n-2 already
            for i in live:
                seqs[i].draft_len = seqs[i].target_len
        # Catch-up: feed tokens[draft_len:n] so the cache holds every accepted token.
        rows = [seqs[i].tokens[seqs[i].draft_len:] for i in live]
        starts = [seqs[i].draft_len for i in live]
        out_kind = "hidden" if self._screens(seqs, live) else "last"     # all greedy: the head's own argmax
        logits = ragged_forward(self.model, self.cache, [seqs[i].slot for i in live], starts, rows, out_kind,
                                self.device, between=between)
        step = 0
        while True:
            if out_kind == "hidden":
                for i, t in zip(live, self.model.lm_head.greedy_ids(logits)):
                    drafted[i].append(t)
            else:
                self._pick(seqs, live, logits, drafted, probs)
            step += 1
            live = [i for i in live if ks[i] > step]
            if not live or (stop_early is not None and stop_early()):
                break
            pos = [len(seqs[i].tokens) - 1 + step for i in live]
            logits = ragged_forward(self.model, self.cache, [seqs[i].slot for i in live], pos,
                                    [[drafted[i][-1]] for i in live], out_kind, self.device, between=between)
        for i in drafted:
            p = torch.stack(probs[i]) if probs[i] else None
            out[i] = Proposal(drafted[i], p)
        return out

    def _screens(self, seqs, live) -> bool:
        """Every live row greedy and a head that picks its own argmax cheaper than its logits (a Q8_0 head
        screened on a Q4_1 copy: quant.BlockLinear.greedy_ids)?"""
        head = self.model.lm_head
        return (hasattr(head, "screens") and head.screens() and all(seqs[i].params.greedy for i in live))

    def _pick(self, seqs, live, logits, drafted, probs) -> None:
        greedy = [j for j, i in enumerate(live) if seqs[i].params.greedy]
        if greedy:
            ids = greedy_ids(logits[greedy] if len(greedy) < logits.shape[0] else logits)
            for j, t in zip(greedy, ids):
                drafted[live[j]].append(t)
        for j, i in enumerate(live):
            s = seqs[i]
            if s.params.greedy:
                continue
            q = processed_probs(logits[j:j + 1], s.params)            # [1, V]
            drafted[i].append(int(sample(q, s.generator)[0]))
            probs[i].append(q[0])
