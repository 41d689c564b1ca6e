"""Continuous batching: one `step()` = admit + prefill new requests, propose, score, accept, stream.

Requests join (admission, when a slot is free) and leave (stop, length, abort) between steps. Each running
sequence has its own K (0 = plain decoding) and proposer; drafting is batched per proposer and the target
verifies every running sequence in one forward. `generate()`, `generate_batch()` and the serving thread all
run requests through this same `step()`.

Per step, a sequence's K is: 0 when more than `spec_max_concurrency` sequences run (the concurrency cut-off,
TensorRT-LLM's `max_concurrency`: at high batch the target is compute-bound and drafting stops paying);
else its adaptive choice (`adaptive.py`, from its own acceptance and the calibrated costs) or its fixed K;
never more than max_tokens leaves room for.

Containment: an exception while stepping one sequence (sampling numerics, a stop-string or detokenizer bug)
finishes THAT sequence with reason "error" and a message naming the stage; the step goes on for the others.
A batched stage (propose, score, accept) that raises is retried one sequence at a time, so only the
sequences that fail alone are stopped (re-running a stage only rewrites the same KV positions).

Admission limits: `add` refuses (EngineUnavailableError) when `max_waiting` requests already wait for a slot;
a request still waiting after `queue_timeout_s` is finished with an "unavailable" error.

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
from specbuild.engines.embedded.adaptive import CostModel, OnlineCosts, choose_batch_k, cost_models, prior_alphas
from specbuild.engines.embedded.errors import EngineUnavailableError
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
                 acceptance_rule: str = EXACT, max_waiting: int | None = None,
                 queue_timeout_s: float | None = None, online_costs: bool = True):
        self.scorer, self.draft, self.ngram = scorer, draft, ngram
        self.costs = costs or cost_models(None)                  # proposer -> CostModel (adaptive K)
        self.online = OnlineCosts() if online_costs else None    # step costs measured while serving
        self._last_n = 0                                         # sequences in the latest step (metrics)
        self.alpha_prior = prior_alphas(None)                    # proposer -> alpha_hat a new sequence starts at
        self.spec_max_concurrency = spec_max_concurrency         # None = speculate at any concurrency
        self.acceptance_rule = acceptance_rule
        self.max_waiting = max_waiting                           # None = unbounded waiting queue
        self.queue_timeout_s = queue_timeout_s                   # None = a request may wait forever
        self.on_step: Callable[[], None] | None = None           # called after every step (metrics push)
        self.rejected_total = 0                                  # refused: queue full or waited too long
        self.failed_total = 0                                    # finished with reason "error"
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
    def add(self, seq: Sequence, *, bounded: bool = False) -> None:
        """Queue a sequence; `bounded` (serving submissions): refuse when `max_waiting` already wait."""
        with self.lock:
            if seq.request_id in self.by_id:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            if bounded and self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                self.rejected_total += 1
                raise EngineUnavailableError(
                    f"the server is busy: {len(self.waiting)} requests already wait for a batch slot "
                    f"(max_queue_size={self.max_waiting}); retry later.")
            seq.enqueued_at = self.clock()
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
        if self.on_step is not None:
            try:
                self.on_step()
            except Exception:  # noqa: BLE001 - an observer must not stop the engine
                log.exception("on_step observer raised")

    @torch.inference_mode()
    def _step(self) -> None:
        self.slots.reclaim()            # slots freed during the last step are reusable from here on
        self._expire_waiting()
        self._admit()
        with self.lock:
            seqs = [s for s in self.running if not s.finished]
        if not seqs:
            return
        cutoff = self.spec_max_concurrency is not None and len(seqs) > self.spec_max_concurrency
        if cutoff:
            self.cutoff_steps_total += 1
        n = self._last_n = len(seqs)
        explore = (self.online is not None and not any(s.forced_k for s in seqs)
                   and self.online.wants_plain(n))
        costs = {p: self._cost(p, n) for p in self.costs}          # this step's cost model per proposer
        ks = [self._effective_k(s, cutoff, costs, explore) for s in seqs]
        self._share_adaptive_k(seqs, ks, costs)
        t0 = self.clock()
        proposals = self._contained("propose", seqs, lambda ss, ix: self._propose(ss, [ks[i] for i in ix]))
        t1 = self.clock()
        if self.draft is not None and any(k > 0 and s.proposer == "draft" for s, k in zip(seqs, ks)) \
                and self._admission_pending():
            # A request arrived while the draft ran (drafting stopped early for it): prefill it and stream its
            # first token now, before this round's verify, so it waits for at most one draft step — less than
            # the target step it would wait for without speculation. Its draft prefill is the next step's.
            self._admit(catch_up=False)
        t1b = self.clock()
        logits = self._contained("score", seqs, lambda ss, ix: self.scorer.score(
            ss, [proposals[i].token_ids for i in ix]), skip=proposals)
        t2 = self.clock()
        if self.online is not None:
            drafted = [len(p.token_ids) for s, p in zip(seqs, proposals) if p is not None and s.proposer == "draft"]
            sent = [len(p.token_ids) for p in proposals if p is not None]
            with self.lock:                          # metrics() reads the samples from other threads
                self.online.observe(n, max(sent, default=0), max(drafted, default=0), t1 - t0, t2 - t1b)
        results = self._contained("accept", seqs, lambda ss, ix: self._accept(
            ss, [proposals[i] for i in ix], [logits[i] for i in ix]), skip=logits)
        t3 = self.clock()
        with self.lock:
            for s, k, p, acc in zip(seqs, ks, proposals, results):
                if s.finished or acc is None:          # aborted while the step ran, or failed alone
                    continue
                for stage, dt in (("propose", t1 - t0), ("score", t2 - t1b), ("accept", t3 - t2)):
                    s.stats.add_time(stage, dt)
                s.stats.observe_draft(len(p.token_ids), acc.num_accepted)
                s.stats.observe_step(len(p.token_ids), cutoff=cutoff and not s.forced_k and (s.num_draft_tokens > 0))
                if s.adaptive is not None:
                    s.adaptive.observe(len(p.token_ids), acc.num_accepted)
                n_before = len(s.tokens)
                s.target_len = n_before + acc.num_accepted       # [last, accepted drafts] are now cached
                if s.proposer == "draft" and k > 0:
                    s.draft_len = s.target_len if self.draft.shares_target_kv else \
                        n_before + min(acc.num_accepted, len(p.token_ids) - 1)
                try:
                    self._append(s, acc.output_token_ids)
                except Exception as e:  # noqa: BLE001 - a stop-string / detokenizer bug stops this request only
                    self._fail(s, "output", e)

    def _contained(self, stage: str, seqs: list[Sequence], fn, skip: list | None = None) -> list:
        """Run a batched stage `fn(seqs, indices) -> [result per seq]`; if it raises, run it one sequence at a
        time and stop (reason "error") only the sequences that fail alone. `skip`: the previous stage's
        results (None = that sequence already failed). -> results, None where a sequence failed."""
        idx = [i for i in range(len(seqs)) if skip is None or skip[i] is not None]
        out: list = [None] * len(seqs)
        if not idx:
            return out
        try:
            for i, r in zip(idx, fn([seqs[i] for i in idx], idx)):
                out[i] = r
            return out
        except Exception as e:  # noqa: BLE001
            if len(idx) == 1:
                self._fail(seqs[idx[0]], stage, e)
                return out
            log.warning("%s failed for a batch of %d sequences (%s: %s); retrying one at a time",
                        stage, len(idx), type(e).__name__, e)
        for i in idx:
            try:
                out[i] = fn([seqs[i]], [i])[0]
            except Exception as e:  # noqa: BLE001
                self._fail(seqs[i], stage, e)
        return out

    def _fail(self, s: Sequence, stage: str, e: BaseException) -> None:
        """Stop one sequence with reason "error"; the others go on."""
        log.warning("request %s stopped: %s failed: %s: %s", s.request_id, stage, type(e).__name__, e,
                    exc_info=not isinstance(e, ValueError))
        with self.lock:
            if not s.finished:
                self._finish(s, "error")
                self._emit(s, [], f"{stage} failed for this request: {type(e).__name__}: {e}")

    def _expire_waiting(self) -> None:
        """Finish requests that waited past queue_timeout_s for a slot (an "unavailable" error, at once)."""
        if self.queue_timeout_s is None:
            return
        now = self.clock()
        with self.lock:
            # a sequence with a slot is admitted and part-prefilled (chunked prefill), not waiting for one
            late = [s for s in self.waiting if s.slot < 0 and now - s.enqueued_at > self.queue_timeout_s]
            for s in late:
                self.waiting.remove(s)
                self.rejected_total += 1
                self._finish(s, "error")
                self._emit(s, [], f"the server is busy: the request waited {now - s.enqueued_at:.1f} s for a "
                                  f"batch slot (queue_timeout_s={self.queue_timeout_s:g}); retry later.",
                           kind="unavailable")

    def _admit(self, catch_up: bool = True) -> None:
        """Admission and prefill, under a per-step prefill token budget (chunked prefill).

        Waiting requests take free slots in FIFO order. A request holding a slot stays at the head of `waiting`
        while its prompt is fed to the target in chunks (`target_len` counts its cached positions): with
        sequences running, one step feeds at most `prefill_token_budget` prompt tokens in all, so admitting a
        long prompt never stalls them for more than one chunk; with none running, whole prompts. The forward
        over a prompt's last chunk yields the first token's logits: that token is sampled (stop ids suppressed
        before min_tokens; the request's generator), appended and streamed at once, like TensorRT-LLM's context
        phase. Only then is the draft prefilled (`_catch_up_drafts`; `catch_up=False` leaves that to the next
        step) and the sequence joins `running`; its first speculation round is this step's (or the next one's when
        it was admitted between a round's draft and verify). The cache invariants of sequence.py hold afterwards.
        """
        with self.lock:
            live_running = sum(1 for s in self.running if not s.finished)
            cands: list[Sequence] = []
            for seq in self.waiting:
                if seq.slot < 0:
                    if not self.slots.num_available:
                        break
                    seq.slot = self.slots.alloc()
                cands.append(seq)
        budget = self.prefill_token_budget if live_running else None
        chunk: list[Sequence] = []
        ends: list[int] = []
        for s in cands:
            take = len(s.tokens) - s.target_len
            if budget is not None:
                take = min(take, budget)
                budget -= take
            if take <= 0:
                break
            chunk.append(s)
            ends.append(s.target_len + take)
        if chunk:
            try:
                t0 = self.clock()
                logits = self.scorer.feed(chunk, ends, want_logits=True)
                done = [i for i, s in enumerate(chunk) if s.target_len == len(s.tokens)]
                firsts = self._first_tokens([chunk[i] for i in done], logits[done]) if done else []
                dt = self.clock() - t0
            except Exception as e:  # noqa: BLE001 - reported to the requests, the engine keeps serving
                log.exception("prefill failed")  # (not re-raised: step() would also fail the other requests)
                self._fail_prefill(chunk, f"prefill failed: {e}")
                return
            with self.lock:
                for s in chunk:
                    s.stats.add_time("prefill", dt)
                for i, tok in zip(done, firsts):
                    s = chunk[i]
                    if s.finished:                          # aborted while its prompt was fed
                        continue
                    self.waiting.remove(s)
                    self.running.append(s)
                    self._append(s, [tok])                  # target cache 0..n-2 holds: n = prompt + 1
            self._deliver()                                 # the first tokens go out before any drafting
        if catch_up:
            self._catch_up_drafts()

    def _admission_pending(self) -> bool:
        """A request the next step would admit (a free slot, or one already mid-prefill) is waiting: drafting
        stops early so its first token is not held back by a whole speculation round (lock-free read)."""
        waiting = self.waiting
        return bool(waiting) and (self.slots.num_available > 0 or any(s.slot >= 0 for s in list(waiting)))

    def _cost(self, proposer: str, n: int) -> CostModel:
        """The cost model adaptive K uses at n sequences: measured online once there is enough, else the build's."""
        base = self.costs[proposer]
        return self.online.model(n, base) if self.online is not None else base

    def _effective_k(self, s: Sequence, cutoff: bool, costs: dict[str, CostModel], explore: bool = False) -> int:
        if (cutoff and not s.forced_k) or s.num_draft_tokens <= 0:
            return 0
        # Never draft past max_tokens: a step emits at most K + 1 tokens.
        k = max(0, min(s.num_draft_tokens, s.params.max_tokens - s.num_generated - 1))
        if s.adaptive is not None:
            k = s.adaptive.next_k(costs[s.proposer], k)
            if explore and k > 0:                    # a plain step to keep the online baseline measured
                k = 0
                s.adaptive.history[-1] = 0
        return k

    def _share_adaptive_k(self, seqs: list[Sequence], ks: list[int], costs: dict[str, CostModel]) -> None:
        """With several adaptive sequences of one proposer in the step, give them one batch-optimal K
        (`adaptive.choose_batch_k`) instead of each its own, which would make the batch pay for the largest."""
        for proposer, cost in costs.items():
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
            props = self.draft.propose([seqs[i] for i in d_idx], [ks[i] for i in d_idx],
                                       stop_early=self._admission_pending)
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
        if reason == "error":
            self.failed_total += 1
        if s in self.running:
            self.running.remove(s)
        if s.slot >= 0 and not s.slot_released:
            # Free at once (released): a step still running with this sequence may write its slot once more,
            # so the slot is only reusable from the next step on (SlotAllocator.reclaim), not by this step's
            # mid-round admission.
            self.slots.free(s.slot)
            s.slot_released = True
        self.by_id.pop(s.request_id, None)
        self.totals.merge(s.stats)
        if s.adaptive is not None:
            self.alpha_prior[s.proposer] = s.adaptive.fold_into(self.alpha_prior[s.proposer])

    def _emit(self, s: Sequence, token_ids: list[int], error: str | None, kind: str | None = None) -> None:
        """Queue a delta (lock held); `_deliver` calls the callbacks without the engine lock."""
        try:
            text = s.detok.flush(s.finished) if not error else ""
        except Exception as e:  # noqa: BLE001 - a detokenizer bug: stop this request, not the engine
            log.warning("detokenizing %s failed: %s: %s", s.request_id, type(e).__name__, e)
            text = ""
            if not s.finished:
                self._finish(s, "error")
                error = f"output failed for this request: {type(e).__name__}: {e}"
        if not token_ids and not text and not s.finished:
            return
        if error:
            s.error = error
            kind = kind or "internal"
        self._outbox.append((s, StreamDelta(s.request_id, token_ids, text, s.finished, s.finish_reason,
                                            s.stats if s.finished else None, error, kind)))

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
                "slots_free": self.slots.num_free,
                "rejected_total": self.rejected_total,
                "failed_total": self.failed_total,
                "spec_cutoff_steps_total": self.cutoff_steps_total,
                **self._measured_costs(),
            }

    def _measured_costs(self) -> dict:
        """What adaptive K prices the draft with now, at the concurrency of the latest step: c (draft step / plain
        step) and the plain step in ms, measured while serving (online) or else the build's calibration."""
        n = self._last_n or 1
        model = self._cost("draft", n) if self.draft is not None else None
        plain = self.online.plain_ms(n) if self.online is not None else None
        return {"draft_cost_ratio": model.cost_ratio if model is not None else 0.0,
                "draft_cost_source": model.source if model is not None else "none",
                "target_step_ms": plain or 0.0, "cost_concurrency": n}

    # ---- prefill helpers (used by `_admit`) -------------------------------------------------------
    prefill_token_budget: int = 256     # prompt tokens fed per step while other sequences run (chunk size)

    def _first_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """The first generated token of each sequence from its prompt's last-position logits [B, V], exactly as
        a plain decode step would choose it (greedy: argmax; sampling: one draw from the processed target
        distribution with the request's generator)."""
        from specbuild.engines.embedded.scorer import suppress_stop_ids

        out = []
        for i, s in enumerate(seqs):
            lg = logits[i:i + 1]
            if s.params.min_tokens and s.stop_ids:
                lg = suppress_stop_ids(lg, 0, s.params.min_tokens, s.stop_ids)
            if s.params.greedy:
                out.append(int(lg.argmax(-1)[0]))
            else:
                out.append(int(sample(processed_probs(lg, s.params), s.generator)[0]))
        return out

    def _catch_up_drafts(self) -> None:
        """Prefill the draft cache (positions 0..n-2) of running draft-proposer sequences whose draft has not
        seen their prompt yet (just admitted, or admitted while cut off). Skipped in a step that is cut off: no
        drafting then (but for requests that forced their K), so a batch above the cut-off never pays for draft
        prefill."""
        if self.draft is None:
            return
        if self.draft.shares_target_kv:        # nothing to prefill: the draft reads the target's cache (propose
            return                             # sets draft_len = target_len)
        with self.lock:
            live = [s for s in self.running if not s.finished]
            cutoff = self.spec_max_concurrency is not None and len(live) > self.spec_max_concurrency
            # Only never-prefilled ones: a lag from adaptive K = 0 steps is caught up by the next draft step.
            lag = [s for s in live if s.proposer == "draft" and s.num_draft_tokens > 0 and s.draft_len == 0
                   and len(s.tokens) > 2 and (s.forced_k or not cutoff)]
        if not lag:
            return
        try:
            t0 = self.clock()
            self.draft.feed(lag, [len(s.tokens) - 1 for s in lag])
            dt = self.clock() - t0
            with self.lock:
                for s in lag:
                    s.stats.add_time("prefill", dt)
        except Exception as e:  # noqa: BLE001 - reported to the requests, the engine keeps serving
            log.exception("draft prefill failed")
            self._fail_prefill(lag, f"draft prefill failed: {e}")

    def _fail_prefill(self, seqs: list[Sequence], error: str) -> None:
        with self.lock:
            for seq in seqs:
                if seq in self.waiting:
                    self.waiting.remove(seq)
                if not seq.finished:
                    self._finish(seq, "error")
                    self._emit(seq, [], error)
        self._deliver()


def _zip_longest(a: list[int], b: list[int]):
    n = max(len(a), len(b))
    return zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))
