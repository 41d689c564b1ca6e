"""Continuous batching: one `step()` = admit + prefill new requests, propose, score, accept, stream.

Requests join (admission, when a slot is free) and leave (stop, length, abort) between steps. Each running
sequence has its own K (0 = plain decoding) and proposer; drafting is batched per proposer and the target
verifies every running sequence in one forward. `generate()`, `generate_batch()` and the serving thread all
run requests through this same `step()`.

Per step, a sequence's K is: 0 when more than `spec_max_concurrency` sequences run (the concurrency cut-off,
TensorRT-LLM's `max_concurrency`: at high batch the target is compute-bound and drafting stops paying);
else its adaptive choice (`adaptive.py`, from its own acceptance and the calibrated costs) or its fixed K;
never more than max_tokens leaves room for.

Thread-safety: `add`/`abort` may be called from any thread; `step` runs in one thread at a time. Model
compute runs outside the lock; a sequence aborted mid-step is skipped when the step emits. Callbacks run
outside the engine lock, in order, one at a time (so a callback may call submit/abort); the final delta of
an abort is delivered by the aborting thread, and nothing follows a request's final delta.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import torch

from specbuild.engines.embedded.acceptor import (EXACT, UNSAFE_ALWAYS_ACCEPT, Accepted, always_accept,
                                                 greedy_accept, rejection_accept)
from specbuild.engines.embedded.adaptive import CostModel, choose_batch_k, cost_models, prior_alphas
from specbuild.engines.embedded.kvcache import SlotAllocator
from specbuild.engines.embedded.proposers import DraftModelProposer, NgramProposer, Proposal
from specbuild.engines.embedded.sampling import processed_probs, sample
from specbuild.engines.embedded.scorer import TargetScorer
from specbuild.engines.embedded.sequence import Sequence, StreamDelta
from specbuild.engines.embedded.stats import SpecStats

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, *, scorer: TargetScorer, draft: DraftModelProposer | None, ngram: NgramProposer,
                 max_batch_size: int, clock: Callable[[], float] = time.perf_counter,
                 costs: dict[str, CostModel] | None = None, spec_max_concurrency: int | None = None,
                 acceptance_rule: str = EXACT):
        self.scorer, self.draft, self.ngram = scorer, draft, ngram
        self.costs = costs or cost_models(None)                  # proposer -> CostModel (adaptive K)
        self.alpha_prior = prior_alphas(None)                    # proposer -> alpha_hat a new sequence starts at
        self.spec_max_concurrency = spec_max_concurrency         # None = speculate at any concurrency
        self.acceptance_rule = acceptance_rule
        self.cutoff_steps_total = 0
        self.slots = SlotAllocator(max_batch_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.lock = threading.RLock()
        self.clock = clock
        self.totals = SpecStats(clock)
        self.requests_total = 0
        self.by_id: dict[str, Sequence] = {}
        self._outbox: deque[tuple[Sequence, StreamDelta]] = deque()
        self._deliver_lock = threading.RLock()

    # ---- called from any thread -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        with self.lock:
            if seq.request_id in self.by_id:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            self.by_id[seq.request_id] = seq
            self.waiting.append(seq)
            self.requests_total += 1

    def abort(self, request_id: str) -> bool:
        """Finish the request with reason "abort" and free its slot now. False if it is not (or no longer) live."""
        with self.lock:
            seq = self.by_id.get(request_id)
            if seq is None or seq.finished:
                return False
            if seq in self.waiting:
                self.waiting.remove(seq)
            self._finish(seq, "abort")
            self._emit(seq, [], None)
        self._deliver()
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> None:
        """One scheduling step. A failure inside the models finishes the affected requests with reason
        "error" (the message goes to their callbacks) and the engine keeps serving."""
        try:
            self._step()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed")
            with self.lock:
                for s in list(self.running):
                    if not s.finished:
                        self._finish(s, "error")
                        self._emit(s, [], f"engine step failed: {type(e).__name__}: {e}")
        self._deliver()

    @torch.inference_mode()
    def _step(self) -> None:
        self._admit()
        with self.lock:
            seqs = [s for s in self.running if not s.finished]
        if not seqs:
            return
        cutoff = self.spec_max_concurrency is not None and len(seqs) > self.spec_max_concurrency
        if cutoff:
            self.cutoff_steps_total += 1
        ks = [self._effective_k(s, cutoff) for s in seqs]
        self._share_adaptive_k(seqs, ks)
        t0 = self.clock()
        proposals = self._propose(seqs, ks)
        t1 = self.clock()
        logits = self.scorer.score(seqs, [p.token_ids for p in proposals])
        t2 = self.clock()
        results = self._accept(seqs, proposals, logits)
        t3 = self.clock()
        with self.lock:
            for s, k, p, acc in zip(seqs, ks, proposals, results):
                if s.finished:          # aborted while the step ran
                    continue
                for stage, dt in (("propose", t1 - t0), ("score", t2 - t1), ("accept", t3 - t2)):
                    s.stats.add_time(stage, dt)
                s.stats.observe_draft(len(p.token_ids), acc.num_accepted)
                s.stats.observe_step(len(p.token_ids), cutoff=cutoff and (s.num_draft_tokens > 0))
                if s.adaptive is not None:
                    s.adaptive.observe(len(p.token_ids), acc.num_accepted)
                n_before = len(s.tokens)
                if s.proposer == "draft" and k > 0:
                    s.draft_len = n_before + min(acc.num_accepted, len(p.token_ids) - 1)
                s.target_len = n_before + acc.num_accepted       # [last, accepted drafts] are now cached
                self._append(s, acc.output_token_ids)

    def _admit(self) -> None:
        """Move waiting requests into free slots and prefill them together (one ragged forward per model)."""
        with self.lock:
            new: list[Sequence] = []
            while self.waiting and self.slots.num_free:
                seq = self.waiting.popleft()
                seq.slot = self.slots.alloc()
                self.running.append(seq)
                new.append(seq)
        if not new:
            return
        try:
            t0 = self.clock()
            self.scorer.prefill(new)
            drafting = [s for s in new if s.proposer == "draft" and s.num_draft_tokens > 0]
            if drafting and self.draft is not None:
                self.draft.prefill(drafting)
            dt = self.clock() - t0
            for s in new:
                s.stats.add_time("prefill", dt)
        except Exception as e:  # noqa: BLE001 - reported to the requests, the engine keeps serving
            log.exception("prefill failed")  # (not re-raised: step() would also fail the other requests)
            with self.lock:
                for seq in new:
                    if not seq.finished:
                        self._finish(seq, "error")
                        self._emit(seq, [], f"prefill failed: {e}")
            self._deliver()

    def _effective_k(self, s: Sequence, cutoff: bool) -> int:
        if cutoff or s.num_draft_tokens <= 0:
            return 0
        # Never draft past max_tokens: a step emits at most K + 1 tokens.
        k = max(0, min(s.num_draft_tokens, s.params.max_tokens - s.num_generated - 1))
        if s.adaptive is not None:
            k = s.adaptive.next_k(self.costs[s.proposer], k)
        return k

    def _share_adaptive_k(self, seqs: list[Sequence], ks: list[int]) -> None:
        """With several adaptive sequences of one proposer in the step, give them one batch-optimal K
        (`adaptive.choose_batch_k`) instead of each its own, which would make the batch pay for the largest."""
        for proposer, cost in self.costs.items():
            idx = [i for i, s in enumerate(seqs) if s.adaptive is not None and s.proposer == proposer
                   and s.num_draft_tokens > 0]
            if len(idx) < 2:
                continue
            caps = [max(0, min(seqs[i].num_draft_tokens, seqs[i].params.max_tokens - seqs[i].num_generated - 1))
                    for i in idx]
            if not any(ks[i] for i in idx):
                continue                       # every one chose (or was cut off to) K = 0
            k = choose_batch_k([seqs[i].adaptive.alpha for i in idx], caps, cost)
            for i, cap in zip(idx, caps):
                ks[i] = min(k, cap)
                seqs[i].adaptive.history[-1:] = [ks[i]]

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out = [Proposal([]) for _ in seqs]
        d_idx = [i for i, s in enumerate(seqs) if ks[i] > 0 and s.proposer == "draft"]
        n_idx = [i for i, s in enumerate(seqs) if ks[i] > 0 and s.proposer == "ngram"]
        if d_idx:
            props = self.draft.propose([seqs[i] for i in d_idx], [ks[i] for i in d_idx])
            for i, p in zip(d_idx, props):
                out[i] = p
        for i in n_idx:
            out[i] = self.ngram.propose_one(seqs[i].tokens, ks[i])
        return out

    def _accept(self, seqs, proposals, logits) -> list[Accepted]:
        if self.acceptance_rule == UNSAFE_ALWAYS_ACCEPT:
            return self._accept_unsafe(seqs, proposals, logits)
        results: list[Accepted | None] = [None] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            argmax = torch.cat([logits[i] for i in greedy]).argmax(-1).tolist()    # one device sync
            o = 0
            for i in greedy:
                n = logits[i].shape[0]
                results[i] = greedy_accept(proposals[i].token_ids, argmax[o:o + n])
                o += n
        for i, s in enumerate(seqs):
            if results[i] is not None:
                continue
            p = processed_probs(logits[i], s.params)                  # [K+1, V]
            d = torch.tensor(proposals[i].token_ids, dtype=torch.long, device=p.device)
            results[i] = rejection_accept(d, proposals[i].probs, p, s.generator)
        return results

    def _accept_unsafe(self, seqs, proposals, logits) -> list[Accepted]:
        """The deliberately broken rule (testing `verify` only): every draft accepted, then the target's token
        after the last draft."""
        out = []
        for s, p, lg in zip(seqs, proposals, logits):
            last = lg[-1:]                                             # [1, V] after the last draft
            bonus = int(last.argmax(-1)[0]) if s.params.greedy else int(sample(processed_probs(last, s.params),
                                                                                s.generator)[0])
            out.append(always_accept(p.token_ids, bonus))
        return out

    # ---- bookkeeping (lock held) ------------------------------------------------------------------
    def _append(self, s: Sequence, new_tokens: list[int]) -> None:
        """Apply stop conditions token by token, then stream what was kept."""
        kept: list[int] = []
        reason = None
        for t in new_tokens:
            if t in s.stop_ids and s.num_generated >= s.params.min_tokens:
                reason = "stop"                                  # the stop token itself is not output
                break
            s.tokens.append(t)
            kept.append(t)
            if s.detok.add(t):
                reason = "stop"
                break
            if s.num_generated >= s.params.max_tokens:
                reason = "length"
                break
        s.stats.observe_tokens(len(kept))
        if reason:
            self._finish(s, reason)
        self._emit(s, kept, None)

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finished, s.finish_reason = True, reason
        if s in self.running:
            self.running.remove(s)
        if s.slot >= 0 and not s.slot_released:
            # Free at once. A step still running with this sequence may write its slot once more; that is
            # harmless because the slot is only reused at the next step's admission (same thread).
            self.slots.free(s.slot)
            s.slot_released = True
        self.by_id.pop(s.request_id, None)
        self.totals.merge(s.stats)
        if s.adaptive is not None:
            self.alpha_prior[s.proposer] = s.adaptive.fold_into(self.alpha_prior[s.proposer])

    def _emit(self, s: Sequence, token_ids: list[int], error: str | None) -> None:
        """Queue a delta (lock held); `_deliver` calls the callbacks without the engine lock."""
        text = s.detok.flush(s.finished)
        if not token_ids and not text and not s.finished:
            return
        if error:
            s.error = error
        self._outbox.append((s, StreamDelta(s.request_id, token_ids, text, s.finished, s.finish_reason,
                                            s.stats if s.finished else None, error)))

    def _deliver(self) -> None:
        """Call on_output for queued deltas in order, one at a time, outside the engine lock (a callback may
        call submit/abort). Nothing is delivered to a request after its final delta."""
        with self._deliver_lock:
            while True:
                with self.lock:
                    if not self._outbox:
                        return
                    s, delta = self._outbox.popleft()
                if s.final_sent:
                    continue
                s.final_sent = delta.finished
                try:
                    s.on_output(delta)
                except Exception:  # noqa: BLE001 - a broken consumer must not take the engine down
                    log.exception("on_output callback of %s raised; aborting the request", s.request_id)
                    self.abort(s.request_id)

    def metrics(self) -> dict:
        with self.lock:
            t = self.totals
            live = SpecStats(self.clock)
            for s in self.running:
                live.merge(s.stats)
            return {
                "requests_total": self.requests_total,
                "generated_tokens_total": t.generated_tokens + live.generated_tokens,
                "draft_tokens_total": t.num_draft_tokens + live.num_draft_tokens,
                "accepted_tokens_total": t.num_accepted_tokens + live.num_accepted_tokens,
                "drafts_total": t.num_drafts + live.num_drafts,
                "accepted_per_pos": [a + b for a, b in _zip_longest(t.accepted_per_pos, live.accepted_per_pos)],
                "drafted_per_pos": [a + b for a, b in _zip_longest(t.drafted_per_pos, live.drafted_per_pos)],
                "running": len(self.running),
                "waiting": len(self.waiting),
                "spec_cutoff_steps_total": self.cutoff_steps_total,
            }


def _zip_longest(a: list[int], b: list[int]):
    n = max(len(a), len(b))
    return zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))
