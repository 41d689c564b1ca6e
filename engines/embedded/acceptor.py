"""Acceptance of drafted tokens: pure functions, vLLM vocabulary.

Terms (per request and step, K = number of drafted tokens):
- draft tokens d1..dK, proposed by the proposer (draft model or n-gram lookup);
- target distributions p_1..p_{K+1}: the scorer's processed distributions at [last, d1..dK];
- accepted tokens: the longest prefix of drafts that passes the acceptance test;
- recovered token: on the first rejection at i, a token sampled from the residual max(p_i - q_i, 0)
  renormalised (greedy: the target's argmax at i);
- bonus token: when all K drafts are accepted, a token sampled from p_{K+1};
- output tokens = accepted + [recovered | bonus]; padded to K+1 with PLACEHOLDER (-1) in `padded()`.

Example (greedy): drafts [5, 7, 9], target argmax at [last, 5, 7, 9] = [5, 7, 3, 8]
-> accepted [5, 7], recovered 3, output [5, 7, 3], padded [5, 7, 3, -1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbuild.engines.embedded.config import ACCEPTANCE_RULES, EXACT, UNSAFE_ALWAYS_ACCEPT  # noqa: F401
from specbuild.engines.embedded.sampling import greedy_ids, processed_probs, sample

PLACEHOLDER = -1


@dataclass(frozen=True)
class Accepted:
    output_token_ids: list[int]     # accepted drafts + one recovered-or-bonus token; 1..K+1 long
    num_accepted: int               # drafts accepted (0..K)
    num_draft: int                  # K

    def padded(self) -> list[int]:
        return self.output_token_ids + [PLACEHOLDER] * (self.num_draft + 1 - len(self.output_token_ids))


def greedy_accept(draft_token_ids: list[int], target_token_ids: list[int]) -> Accepted:
    """Greedy rule: accept while the draft equals the target's argmax; then emit the target's own token.

    draft_token_ids [K]; target_token_ids [K+1] = argmax of the target at [last, d1..dK].
    """
    k = len(draft_token_ids)
    if len(target_token_ids) != k + 1:
        raise ValueError(f"need K+1={k + 1} target tokens, got {len(target_token_ids)}")
    n = 0
    while n < k and draft_token_ids[n] == target_token_ids[n]:
        n += 1
    return Accepted(list(draft_token_ids[:n]) + [int(target_token_ids[n])], n, k)


def rejection_accept(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None) -> Accepted:
    """Leviathan/Chen speculative sampling; the output is distributed exactly as the target's.

    draft_token_ids [K] (long); draft_probs [K, V] the processed draft distributions the drafts were sampled
    from, or None for a deterministic proposer (n-gram: q is one-hot on the draft); target_probs [K+1, V].
    Randomness: always K uniforms then one categorical draw, so a request's stream of random numbers does
    not depend on what else is in the batch.
    """
    k = int(draft_token_ids.shape[0])
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need K+1={k + 1} target distributions, got {target_probs.shape[0]}")
    if k == 0:
        return Accepted([int(sample(target_probs[:1], generator)[0])], 0, 0)
    dev = target_probs.device
    idx = torch.arange(k, device=dev)
    p = target_probs[idx, draft_token_ids]                                   # [K]
    q = draft_probs[idx, draft_token_ids] if draft_probs is not None else torch.ones(k, device=dev)
    u = torch.rand(k, generator=generator, device=dev)
    # Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)): q <= p always accepts.
    rejected = (u * q > p).tolist()
    n = rejected.index(True) if True in rejected else k
    drafts = draft_token_ids.tolist()
    if n == k:
        bonus = int(sample(target_probs[k:k + 1], generator)[0])
        return Accepted(drafts + [bonus], k, k)
    # Rejected at n: resample from the residual max(p - q, 0), renormalised.
    if draft_probs is not None:
        q_n = draft_probs[n]
    else:
        q_n = torch.zeros_like(target_probs[n])
        q_n[drafts[n]] = 1.0
    residual = (target_probs[n] - q_n).clamp_min_(0.0)
    total = residual.sum()
    residual = residual / total if float(total) > 0 else target_probs[n]
    recovered = int(sample(residual[None], generator)[0])
    return Accepted(drafts[:n] + [recovered], n, k)


# ---- acceptance rules ----------------------------------------------------------------------------


def always_accept(draft_token_ids: list[int], bonus_token_id: int) -> Accepted:
    """DELIBERATELY WRONG, for testing the verifier only (`acceptance_rule: "unsafe-always-accept"`).

    Accepts every drafted token without looking at the target, then emits the target's token after the last
    draft (its argmax, or a sample of p_{K+1}). The output follows the draft wherever the draft is wrong, so
    it drifts from target-only output; `specbuild verify` must catch it. Never serve with this rule.
    """
    k = len(draft_token_ids)
    return Accepted(list(draft_token_ids) + [int(bonus_token_id)], k, k)


def accept_batch(seqs, proposals, logits, rule: str = EXACT) -> list[Accepted]:
    """Accept or reject every sequence's drafts: greedy sequences by the longest matching prefix (one argmax
    over the whole batch), sampling ones by the rejection-sampling rule with their own generator.
    `proposals[i].token_ids` [K_i], `.probs` [K_i, V] or None (one-hot: n-gram, greedy draft); `logits[i]`
    [K_i + 1, V] from the scorer, or for a greedy sequence its `scorer.GreedyRows` (the K_i + 1 argmax ids)."""
    if rule == UNSAFE_ALWAYS_ACCEPT:
        return [_accept_unsafe(s, p, lg) for s, p, lg in zip(seqs, proposals, logits)]
    results: list[Accepted | None] = [None] * len(seqs)
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    for i in [i for i in greedy if isinstance(logits[i], list)]:         # the scorer's GreedyRows: the argmax
        results[i] = greedy_accept(proposals[i].token_ids, logits[i])
    greedy = [i for i in greedy if results[i] is None]
    if greedy:
        argmax = greedy_ids(stacked([logits[i] for i in greedy]))             # one device sync
        o = 0
        for i in greedy:
            n = logits[i].shape[0]
            results[i] = greedy_accept(proposals[i].token_ids, argmax[o:o + n])
            o += n
    for i, s in enumerate(seqs):
        if results[i] is None:
            p = processed_probs(logits[i], s.params)                  # [K+1, V]
            d = torch.tensor(proposals[i].token_ids, dtype=torch.long, device=p.device)
            results[i] = rejection_accept(d, proposals[i].probs, p, s.generator)
    return results


def stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """The [R_i, V] tensors as one [sum R_i, V]: a view when they lie back to back in one storage (the scorer's
    slices of its one logits tensor, in order), else a copy. The copy was 0.75 ms of a 29 ms step at 8 decode rows
    (8 x 49152 fp32 logits; and a batch-1 verify of K 6 copied its 7 rows for one argmax)."""
    first = rows[0]
    if len(rows) == 1:
        return first
    step = first.shape[-1]
    ptr = first.data_ptr()
    for t in rows:
        if (t.dim() != 2 or t.shape[-1] != step or not t.is_contiguous() or t.dtype != first.dtype
                or t.device != first.device or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.data_ptr() != ptr):
            return torch.cat(rows)
        ptr += t.numel() * t.element_size()
    return first.as_strided((sum(t.shape[0] for t in rows), step), (step, 1))


def _accept_unsafe(s, proposal, logits) -> Accepted:
    """The deliberately broken rule: every draft accepted, then the target's token after the last draft."""
    last = logits[-1:]                                                 # [1, V] after the last draft
    bonus = greedy_ids(last)[0] if s.params.greedy else int(sample(processed_probs(last, s.params),
                                                                        s.generator)[0])
    return always_accept(proposal.token_ids, bonus)
