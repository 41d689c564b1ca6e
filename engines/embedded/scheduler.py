"""Continuous batching: one `step()` = admit and prefill new requests, then one speculative round for every
running sequence (`_round`: K per sequence, propose, score, accept, commit), then deliver what it produced.

Requests join (admission, when a slot is free) and leave (stop, length, abort, timeout) between steps; a
request that arrives mid-round is prefilled, and its first token streamed, between the pieces of the draft step
or of the verify it arrives in (`_admit_arrivals`), or after the draft step it interrupts, without waiting for
the round to end. Each running sequence has its own K (0 = plain decoding) and proposer; drafting is batched per
proposer and the target verifies every running sequence in one forward. `Engine.generate()`, `generate_batch()`, calibration, the
benchmarks and the serving thread all run requests through this same `step()`.

The jobs live in their own modules: admission (waiting queue, limits, deadlines, prefill chunks:
`admission.py`), K per step (the policy's cut-off, adaptive K, online costs: `kplan.py`), acceptance
(`acceptor.accept_batch`), delivery of deltas to callbacks (`delivery.py`). This module is the round itself and
the bookkeeping that ties a sequence's life together (finish, stream, stats).

Containment: an exception while stepping one sequence (sampling numerics, a stop-string or detokenizer bug)
finishes THAT sequence with reason "error" and a message naming the stage; the step goes on for the others.
A batched stage (propose, score, accept) that raises is retried one sequence at a time, so only the
sequences that fail alone are stopped (re-running a stage only rewrites the same KV positions).

Thread-safety: `add`/`abort`/`set_policy` may be called from any thread; `step` runs in one thread at a time.
Model compute runs outside the lock; a sequence aborted mid-step is skipped when the step commits, and its slot
is reusable only from the next step on (`SlotAllocator.reclaim`). Callbacks run outside the engine lock, in
order, one at a time (so a callback may call submit/abort); the final delta of an abort is delivered by the
aborting thread, and nothing follows a request's final delta.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from specbuild.engines.embedded.acceptor import accept_batch
from specbuild.engines.embedded.admission import Admission
from specbuild.engines.embedded.config import EXACT, Policy
from specbuild.engines.embedded.delivery import Outbox
from specbuild.engines.embedded.kplan import KPlanner
from specbuild.engines.embedded.kvcache import SlotAllocator
from specbuild.engines.embedded.proposers import DraftModelProposer, NgramProposer, Proposal
from specbuild.engines.embedded.sampling import greedy_ids, processed_probs, sample
from specbuild.engines.embedded.scorer import TargetScorer, suppress_stop_ids
from specbuild.engines.embedded.sequence import Sequence, StreamDelta
from specbuild.engines.embedded.stats import SpecStats

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, *, scorer: TargetScorer, draft: DraftModelProposer | None, ngram: NgramProposer,
                 max_batch_size: int, policy: Policy = Policy(), calibration: dict | None = None,
                 clock: Callable[[], float] = time.perf_counter, acceptance_rule: str = EXACT,
                 max_waiting: int | None = None, queue_timeout_s: float | None = None,
                 request_timeout_s: float | None = None, online_costs: bool = True):
        self.scorer, self.draft, self.ngram = scorer, draft, ngram
        self.policy = policy
        self.acceptance_rule = acceptance_rule
        self.clock = clock
        self.lock = threading.RLock()
        self.slots = SlotAllocator(max_batch_size)
        self.admission = Admission(self.slots, clock=lambda: self.clock(), max_waiting=max_waiting,
                                   queue_timeout_s=queue_timeout_s, request_timeout_s=request_timeout_s)
        self.kplan = KPlanner(calibration=calibration, online_costs=online_costs)
        self.outbox = Outbox(self.lock, on_broken=self.abort)
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.totals = SpecStats(clock)                           # finished requests' counters
        self.requests_total = 0
        self.failed_total = 0                                    # sequences finished with reason "error"
        self.on_step: Callable[[], None] | None = None           # called after every step (metrics push)
        self._fed_this_step = False                              # a prompt chunk was fed in this step

    @property
    def waiting(self):
        return self.admission.waiting

    # ---- called from any thread -------------------------------------------------------------------
    def add(self, seq: Sequence, *, bounded: bool = False) -> None:
        """Queue a sequence; `bounded` (serving submissions): refuse when `max_waiting` already wait."""
        with self.lock:
            if seq.request_id in self.by_id:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            self.admission.add(seq, bounded=bounded)
            self.by_id[seq.request_id] = seq
            self.requests_total += 1

    def abort(self, request_id: str) -> bool:
        """Finish the request with reason "abort" and release its slot now. False if it is not (or no longer)
        live."""
        with self.lock:
            seq = self.by_id.get(request_id)
            if seq is None or seq.finished:
                return False
            self.admission.discard(seq)
            self._finish(seq, "abort")
            self._emit(seq, [])
        self.outbox.deliver()
        return True

    def set_policy(self, policy: Policy) -> None:
        """The default speculation from the next step on (sequences already running keep their K mode)."""
        with self.lock:
            self.policy = policy

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
                    self._stop(s, f"engine step failed: {type(e).__name__}: {e}")
        self.outbox.deliver()
        if self.on_step is not None:
            try:
                self.on_step()
            except Exception:  # noqa: BLE001 - an observer must not stop the engine
                log.exception("on_step observer raised")

    @torch.inference_mode()
    def _step(self) -> None:
        self.slots.reclaim()            # slots released during the last step are reusable from here on
        with self.lock:
            for s, message, kind in self.admission.overdue(self.running):
                self._stop(s, message, kind)
        self._fed_this_step = False     # _admit sets it when it feeds a prompt chunk (_admit_arrivals reads it)
        self._admit()
        with self.lock:
            seqs = [s for s in self.running if not s.finished]
        if seqs:
            self._round(seqs)

    def _round(self, seqs: list[Sequence]) -> None:
        """One speculative round for every running sequence (gpt-fast's `speculative_decode`, batched)."""
        with self.lock:
            ks, cutoff = self.kplan.plan(seqs, self.policy)             # K per sequence; 0 = a plain step
        admitted_drafting: list[float] = []      # seconds of prefill run between the draft steps' pieces
        t0 = self.clock()
        proposals = self._stage("propose", seqs, lambda ss, ix: self._propose(ss, [ks[i] for i in ix],
                                                                              admitted_drafting))
        t1 = self.clock()
        draft_s = t1 - t0 - sum(admitted_drafting)   # the draft's own time (adaptive K prices K with it)
        if self._drafted_with_model(seqs, ks) and self.admission.pending():
            # A request arrived while the draft ran (drafting stopped early for it): prefill it and stream its
            # first token now, before this round's verify, so it waits for at most one draft step — less than
            # the target step it would wait for without speculation. Its draft prefill is the next step's.
            self._admit(catch_up=False)
        admitted: list[float] = []      # seconds of prefill run between the verify's pieces
        t1b = self.clock()
        # The target scores [last, d1..dK] of every sequence in one forward: logits [K_i + 1, V] each. A request
        # that arrives meanwhile is prefilled between the forward's pieces (`_admit_arrivals`), so its first
        # token waits for a third of the layers, not for a verify of every sequence's K + 1 positions.
        logits = self._stage("score", seqs, lambda ss, ix: self.scorer.score(
            ss, [proposals[i].token_ids for i in ix], between=lambda: self._admit_arrivals(admitted),
            tokens_only=self.acceptance_rule == EXACT), skip=proposals)
        t2 = self.clock()
        verify_s = t2 - t1b - sum(admitted)          # the verify's own time (adaptive K prices K with it)
        with self.lock:                                                  # metrics() reads the samples
            self.kplan.observe(len(seqs), seqs, proposals, draft_s, verify_s)
        results = self._stage("accept", seqs, lambda ss, ix: accept_batch(
            ss, [proposals[i] for i in ix], [logits[i] for i in ix], self.acceptance_rule), skip=logits)
        timings = {"propose": draft_s, "score": verify_s, "accept": self.clock() - t2}
        with self.lock:
            for s, k, p, acc in zip(seqs, ks, proposals, results):
                if not s.finished and acc is not None:     # else: aborted while the step ran, or failed alone
                    self._commit(s, k, p, acc, timings, cutoff)

    def _admit_arrivals(self, spent: list[float]) -> None:
        """Between the pieces of a draft step or of the verify: prefill what `Admission.pending()` says can start
        now, and stream its first token (its draft prefill is the next step's); appends the seconds it took to
        `spent` (the draft's and the verify's own times leave them out). Only in a step that has fed no prompt
        yet (at its start, between pieces, or after the draft), so a step feeds no more prompt chunks than before
        (one; two where drafting stopped early for a newcomer) and the running sequences' next tokens wait for no
        more prefill. At 8 closed-loop users most newcomers arrive during a draft step (they submit as the step
        that finished their previous request ends): between its pieces they waited 2.4 ms (median) for their
        prefill, against 9.2 ms at the draft step's end and 6.6 ms without speculation (AMD EPYC Zen 4;
        bench/README.md, "2026-12-06 late"). Its failures are its own requests' (`_admit` reports them, the
        round goes on)."""
        if self._fed_this_step or not self.admission.pending():
            return
        t = self.clock()
        try:
            self._admit(catch_up=False)
        except Exception:  # noqa: BLE001 - the verify of the running sequences must not fail for a newcomer
            log.exception("admitting a request during a verify failed")
        spent.append(self.clock() - t)

    def _drafted_with_model(self, seqs: list[Sequence], ks: list[int]) -> bool:
        return self.draft is not None and any(k > 0 and s.proposer == "draft" for s, k in zip(seqs, ks))

    def _propose(self, seqs: list[Sequence], ks: list[int], admitted: list[float]) -> list[Proposal]:
        out = [Proposal([]) for _ in seqs]
        d_idx = [i for i, s in enumerate(seqs) if ks[i] > 0 and s.proposer == "draft"]
        if d_idx:
            props = self.draft.propose([seqs[i] for i in d_idx], [ks[i] for i in d_idx],
                                       stop_early=self.admission.pending,
                                       between=lambda: self._admit_arrivals(admitted))
            for i, p in zip(d_idx, props):
                out[i] = p
        for i, s in enumerate(seqs):
            if ks[i] > 0 and s.proposer == "ngram":
                out[i] = self.ngram.propose_one(s.tokens, ks[i])
        return out

    def _commit(self, s: Sequence, k: int, p: Proposal, acc, timings: dict[str, float], cutoff: bool) -> None:
        """Apply one sequence's accepted tokens (lock held): stats, cache lengths, stop conditions, stream."""
        for stage, dt in timings.items():
            s.stats.add_time(stage, dt)
        s.stats.observe_draft(len(p.token_ids), acc.num_accepted)
        s.stats.observe_step(len(p.token_ids), cutoff=cutoff and not s.forced_k and s.num_draft_tokens > 0)
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

    def _stage(self, stage: str, seqs: list[Sequence], fn, skip: list | None = None) -> list:
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
        log.warning("request %s stopped: %s failed: %s: %s", s.request_id, stage, type(e).__name__, e,
                    exc_info=not isinstance(e, ValueError))
        with self.lock:
            self._stop(s, f"{stage} failed for this request: {type(e).__name__}: {e}")

    # ---- admission and prefill --------------------------------------------------------------------
    def _admit(self, catch_up: bool = True) -> None:
        """Prefill this step's prompt chunks (`Admission.plan_prefill`). The forward over a prompt's last chunk
        yields the first token's logits: that token is sampled (stop ids suppressed before min_tokens; the
        request's generator), appended and streamed at once, like TensorRT-LLM's context phase, and the sequence
        joins `running`. Then the draft is prefilled (`_catch_up_drafts`; `catch_up=False` leaves that to the
        next step). The cache invariants of sequence.py hold afterwards."""
        with self.lock:
            live_running = sum(1 for s in self.running if not s.finished)
            chunk, ends = self.admission.plan_prefill(live_running)
        if chunk:
            self._fed_this_step = True
            try:
                t0 = self.clock()
                hidden = self.scorer.screens()          # the head's input: a greedy first token reads its screen
                out = self.scorer.feed(chunk, ends, want_logits=True, hidden=hidden)
                done = [i for i, s in enumerate(chunk) if s.target_len == len(s.tokens)]
                firsts = self._first_tokens([chunk[i] for i in done], out[done], hidden) if done else []
                dt = self.clock() - t0
            except Exception as e:  # noqa: BLE001 - reported to the requests, the engine keeps serving
                log.exception("prefill failed")  # (not re-raised: step() would also fail the other requests)
                self._fail_all(chunk, f"prefill failed: {e}")
                return
            with self.lock:
                for s in chunk:
                    s.stats.add_time("prefill", dt)
                for i, tok in zip(done, firsts):
                    s = chunk[i]
                    if tok is None:                         # failed alone (_first_tokens stopped it)
                        self.admission.discard(s)
                        continue
                    if s.finished:                          # aborted while its prompt was fed
                        continue
                    self.admission.discard(s)
                    self.running.append(s)
                    self._append(s, [tok])                  # target cache 0..n-2 holds: n = prompt + 1
            self.outbox.deliver()                           # the first tokens go out before any drafting
        if catch_up:
            self._catch_up_drafts()

    def _first_tokens(self, seqs: list[Sequence], logits: torch.Tensor, hidden: bool = False) -> list[int | None]:
        """The first generated token of each sequence from its prompt's last-position logits [B, V] (`hidden`: the
        lm_head's input [B, D]: a greedy sequence with nothing to suppress takes the head's `greedy_ids`, the
        bitwise argmax of its logits, the others the logits), exactly as a plain decode step would choose it; None
        for a sequence whose choice raised (it alone is stopped, with reason "error", as `_stage` does: one
        request's error is that request's alone)."""
        head = self.scorer.model.lm_head
        out: list[int | None] = []
        for i, s in enumerate(seqs):
            try:
                if not hidden:
                    out.append(self._first_token(s, logits[i:i + 1]))
                elif s.params.greedy and not (s.params.min_tokens and s.stop_ids):
                    out.append(head.greedy_ids(logits[i:i + 1])[0])
                else:
                    out.append(self._first_token(s, head(logits[i:i + 1]).float()))
            except Exception as e:  # noqa: BLE001 - fails this request only
                self._fail(s, "first token", e)
                out.append(None)
        return out

    @staticmethod
    def _first_token(s: Sequence, lg: torch.Tensor) -> int:
        if s.params.min_tokens and s.stop_ids:
            lg = suppress_stop_ids(lg, 0, s.params.min_tokens, s.stop_ids)
        if s.params.greedy:
            return greedy_ids(lg)[0]
        return int(sample(processed_probs(lg, s.params), s.generator)[0])

    def _catch_up_drafts(self) -> None:
        """Prefill the draft cache (positions 0..n-2) of running draft-proposer sequences whose draft has not
        seen their prompt yet (just admitted, or admitted while cut off). Skipped in a step that is cut off: no
        drafting then (but for requests that forced their K), so a batch above the cut-off never pays for draft
        prefill. Nothing to do for a draft that reads the target's cache."""
        if self.draft is None or self.draft.shares_target_kv:
            return
        with self.lock:
            live = [s for s in self.running if not s.finished]
            mc = self.policy.max_concurrency
            cutoff = mc is not None and len(live) > mc
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
            self._fail_all(lag, f"draft prefill failed: {e}")

    def _fail_all(self, seqs: list[Sequence], error: str) -> None:
        with self.lock:
            for seq in seqs:
                self.admission.discard(seq)
                self._stop(seq, error)
        self.outbox.deliver()

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
        self._emit(s, kept)

    def _stop(self, s: Sequence, error: str, kind: str = "internal") -> None:
        """Finish a live sequence with an error delivered to its callback (reason "error")."""
        if not s.finished:
            self._finish(s, "error")
            self._emit(s, [], error, kind)

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finished, s.finish_reason = True, reason
        if reason == "error":
            self.failed_total += 1
        if s in self.running:
            self.running.remove(s)
        if s.slot >= 0 and not s.slot_released:
            # Released at once; a step still running with this sequence may write its slot once more, so the
            # slot is reusable only from the next step on (SlotAllocator.reclaim), not by this step's admission.
            self.slots.free(s.slot)
            s.slot_released = True
        self.by_id.pop(s.request_id, None)
        self.totals.merge(s.stats)
        self.kplan.fold(s)

    def _emit(self, s: Sequence, token_ids: list[int], error: str | None = None, kind: str | None = None) -> None:
        """Queue a delta for delivery (lock held): the detokenized text of `token_ids`, or the final one."""
        text = ""
        if not error:
            try:
                text = s.detok.flush(s.finished)
            except Exception as e:  # noqa: BLE001 - a detokenizer bug: stop this request, not the engine
                log.warning("detokenizing %s failed: %s: %s", s.request_id, type(e).__name__, e)
                if not s.finished:
                    self._finish(s, "error")
                error = f"output failed for this request: {type(e).__name__}: {e}"
        if not token_ids and not text and not s.finished:
            return
        if error:
            s.error, kind = error, kind or "internal"
        self.outbox.put(s, StreamDelta(s.request_id, token_ids, text, s.finished, s.finish_reason,
                                       s.stats if s.finished else None, error, kind))

    # ---- metrics ------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Engine-wide counters (finished requests plus the live ones) and gauges; names are the engine's, the
        serving frontend adds its own (request-level) ones beside them."""
        with self.lock:
            t = SpecStats(self.clock)
            t.merge(self.totals)
            for s in self.running:
                t.merge(s.stats)
            a = self.admission
            return {
                "requests_total": self.requests_total,
                "generated_tokens_total": t.generated_tokens,
                "draft_tokens_total": t.num_draft_tokens,
                "accepted_tokens_total": t.num_accepted_tokens,
                "drafts_total": t.num_drafts,
                "accepted_per_pos": list(t.accepted_per_pos),
                "drafted_per_pos": list(t.drafted_per_pos),
                "running": len(self.running),
                "waiting": len(a.waiting),
                "slots_free": self.slots.num_free,
                "sequences_failed_total": self.failed_total,
                "queue_full_total": a.rejected_total,
                "queue_expired_total": a.expired_total,
                "request_timeouts_total": a.timed_out_total,
                "spec_cutoff_steps_total": self.kplan.cutoff_steps_total,
                "steps_total": self.kplan.steps_total,
                "sequence_steps_total": self.kplan.sequence_steps_total,
                "policy_max_concurrency": -1 if self.policy.max_concurrency is None else self.policy.max_concurrency,
                **self.kplan.measured_costs(self.draft is not None),
            }
