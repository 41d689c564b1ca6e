"""First token at prefill and chunked prefill: the target's prefill forward yields the first token, which is
streamed before any draft or verify forward; a long prompt is fed in chunks while running sequences keep
decoding; greedy output stays token-identical to target-only output and the cache invariants hold."""

from __future__ import annotations

import time

import pytest

from specbuild.engines.embedded import Engine, SamplingParams

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of"]
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def eng(tiny_llama):
    """Draft = target (every draft accepted), so speculative rounds emit several tokens."""
    return Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=128)


@pytest.fixture(scope="module")
def plain(eng):
    return {p: eng.generate(p, GREEDY, num_draft_tokens=0).token_ids for p in PROMPTS + [LONG]}


class Events:
    """Records, in order, every draft / verify forward (with the request ids in it) and every delta."""

    def __init__(self, eng, monkeypatch):
        self.log: list[tuple[str, object]] = []
        sched = eng.scheduler
        propose, score = sched.draft.propose, sched.scorer.score

        def rec_propose(seqs, ks, **kw):
            self.log.append(("propose", {s.request_id for s, k in zip(seqs, ks) if k > 0}))
            return propose(seqs, ks, **kw)

        def rec_score(seqs, drafts, **kw):
            self.log.append(("score", {s.request_id for s in seqs}))
            return score(seqs, drafts, **kw)

        monkeypatch.setattr(sched.draft, "propose", rec_propose)
        monkeypatch.setattr(sched.scorer, "score", rec_score)

    def on_output(self, d):
        self.log.append(("delta", d))

    def before_first_delta(self, rid: str) -> list[str]:
        """Forwards that included `rid` before its first delta."""
        out = []
        for kind, x in self.log:
            if kind == "delta" and x.request_id == rid:
                return out
            if kind != "delta" and rid in x:
                out.append(kind)
        raise AssertionError(f"{rid} got no delta")


def drive(eng, until):
    steps = 0
    while not until():
        eng.scheduler.step()
        steps += 1
        assert steps < 500
    return steps


def step_with_a_slow_prefill(sched, monkeypatch, timed: str) -> tuple[float, list[float]]:
    """One step in which every admission during the round first sleeps 0.5 s -> (the step's seconds, the draft or
    verify times (`timed`) the step gave adaptive K's online costs)."""
    observed: list[float] = []
    observe, admit = sched.kplan.observe, sched._admit

    def spy(n, seqs, proposals, t_draft, t_verify):
        observed.append(t_draft if timed == "draft" else t_verify)
        return observe(n, seqs, proposals, t_draft, t_verify)

    def slow_admit(**kw):
        if kw.get("catch_up") is False:
            time.sleep(0.5)
        return admit(**kw)

    monkeypatch.setattr(sched.kplan, "observe", spy)
    monkeypatch.setattr(sched, "_admit", slow_admit)
    t0 = sched.clock()
    sched.step()
    took = sched.clock() - t0
    monkeypatch.setattr(sched, "_admit", admit)
    return took, observed


def test_first_token_streams_after_prefill_before_any_draft_or_verify(eng, plain, monkeypatch):
    ev = Events(eng, monkeypatch)
    rid = eng.submit(PROMPTS[0], GREEDY, num_draft_tokens=4, on_output=ev.on_output)
    seq = eng.scheduler.by_id[rid]
    eng.scheduler.step()
    first = [x for kind, x in ev.log if kind == "delta"][0]
    assert first.token_ids == plain[PROMPTS[0]][:1] and not first.finished
    assert ev.before_first_delta(rid) == []                 # no draft, no verify forward before it
    # ... and in the same step, after it: draft prefill, then the first speculation round.
    assert [kind for kind, _ in ev.log] == ["delta", "propose", "score", "delta"]
    assert seq.target_len == len(seq.tokens) - 1 and seq.draft_len <= len(seq.tokens) - 1
    drive(eng, lambda: seq.finished)
    assert seq.generated == plain[PROMPTS[0]]
    assert seq.stats.ttft is not None and seq.stats.ttft <= seq.stats.elapsed


def test_joining_request_streams_its_first_token_before_its_first_round(eng, plain, monkeypatch):
    ev = Events(eng, monkeypatch)
    a = eng.submit(PROMPTS[1], GREEDY, num_draft_tokens=3, on_output=ev.on_output)
    eng.scheduler.step()
    b = eng.submit(PROMPTS[2], GREEDY, num_draft_tokens=3, on_output=ev.on_output)
    sa, sb = eng.scheduler.by_id[a], eng.scheduler.by_id[b]
    drive(eng, lambda: sa.finished and sb.finished)
    assert ev.before_first_delta(b) == []
    assert sa.generated == plain[PROMPTS[1]] and sb.generated == plain[PROMPTS[2]]


def test_chunked_prefill_keeps_running_sequences_decoding(eng, plain, monkeypatch):
    sched = eng.scheduler
    monkeypatch.setattr(sched.admission, "prefill_token_budget", 5)
    ev = Events(eng, monkeypatch)
    a = eng.submit(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True), num_draft_tokens=0,
                   on_output=ev.on_output)
    sched.step()
    sa = sched.by_id[a]
    b = eng.submit(LONG, GREEDY, num_draft_tokens=2, on_output=ev.on_output)
    sb = sched.by_id[b]
    n_prompt = len(sb.prompt_ids)
    assert n_prompt > 20
    chunks = 0
    while not sb.tokens[n_prompt:]:
        before_a, before_b = len(sa.tokens), sb.target_len
        sched.step()
        chunks += 1
        assert len(sa.tokens) == before_a + 1                  # A decodes every step while B's prompt is fed
        assert sb.target_len - before_b <= 5                    # at most the budget per step
        if not sb.tokens[n_prompt:]:
            assert sb in sched.waiting and sb not in sched.running and sb.draft_len == 0
    assert chunks == -(-n_prompt // 5)
    assert sb.target_len == len(sb.tokens) - 1                  # the invariant from the first token on
    assert ev.before_first_delta(b) == []
    drive(eng, lambda: sa.finished and sb.finished)
    assert sb.generated == plain[LONG]
    assert sa.generated[:16] == plain[PROMPTS[0]]


def test_chunked_prefill_greedy_equals_target_only_in_a_batch(eng, plain, monkeypatch):
    monkeypatch.setattr(eng.scheduler.admission, "prefill_token_budget", 3)
    outs = eng.generate_batch([(LONG, GREEDY, 3), (PROMPTS[0], GREEDY, 0), (PROMPTS[1], GREEDY, -1),
                               (PROMPTS[2], GREEDY, 2)], proposer="draft")
    assert [o.token_ids for o in outs] == [plain[LONG]] + [plain[p] for p in PROMPTS]
    ng = eng.generate_batch([(LONG, GREEDY, 3), (PROMPTS[2], GREEDY, 3)], proposer="ngram")
    assert [o.token_ids for o in ng] == [plain[LONG], plain[PROMPTS[2]]]


def test_one_token_request_finishes_at_prefill_without_drafting(eng, plain, monkeypatch):
    ev = Events(eng, monkeypatch)
    out = eng.generate(PROMPTS[0], SamplingParams(max_tokens=1, ignore_eos=True), num_draft_tokens=4)
    assert out.token_ids == plain[PROMPTS[0]][:1] and out.finish_reason == "length"
    assert [kind for kind, _ in ev.log] == []                   # neither draft nor verify ran
    assert out.stats.num_draft_tokens == 0 and eng.scheduler.slots.num_free == 4


def test_stop_rules_apply_to_the_first_token(eng, plain):
    first = plain[PROMPTS[2]][0]
    stopped = eng.generate(PROMPTS[2], SamplingParams(max_tokens=8, stop_token_ids=(first,)), num_draft_tokens=3)
    assert stopped.token_ids == [] and stopped.finish_reason == "stop"
    held = eng.generate(PROMPTS[2], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(first,)),
                        num_draft_tokens=3)
    assert len(held.token_ids) >= 2 and held.token_ids[0] != first


def test_sampled_first_token_uses_the_request_generator(eng):
    """The first token is one draw from the target's processed distribution with the request's generator:
    the same seed gives the same first token with speculation on and off."""
    for seed in range(6):
        sp = SamplingParams(max_tokens=6, temperature=1.5, seed=seed, ignore_eos=True)
        on = eng.generate(PROMPTS[0], sp, num_draft_tokens=3)
        off = eng.generate(PROMPTS[0], sp, num_draft_tokens=0)
        assert on.token_ids[0] == off.token_ids[0]


def test_abort_during_chunked_prefill_frees_the_slot(eng, monkeypatch):
    sched = eng.scheduler
    monkeypatch.setattr(sched.admission, "prefill_token_budget", 4)
    deltas = []
    a = eng.submit(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True), num_draft_tokens=0,
                   on_output=deltas.append)
    sched.step()
    b = eng.submit(LONG, GREEDY, num_draft_tokens=2, on_output=deltas.append)
    sched.step()
    sb = sched.by_id[b]
    assert 0 < sb.target_len < len(sb.prompt_ids) and sb.slot >= 0
    assert eng.scheduler.abort(b)
    assert sb not in sched.waiting and sb.finish_reason == "abort"
    assert sched.slots.num_free == 3
    drive(eng, lambda: not sched.has_work())
    assert sched.slots.num_free == 4
    assert [d.finish_reason for d in deltas if d.request_id == b] == ["abort"]


def test_a_waiting_request_cuts_the_running_draft_round_short(tiny_llama):
    """Admission preempts drafting: with a newcomer waiting for a free slot, the running sequence's draft
    round ends after one draft step (output unchanged: K may vary), so the newcomer's first token waits for
    one draft step and a short verify, not K draft steps."""
    from specbuild.engines.embedded import Engine, SamplingParams

    eng = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=2, max_seq_len=128)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = eng.generate("hello world", params, num_draft_tokens=0).token_ids
    eng.scheduler.admission.pending = lambda: True           # as if a request arrived during every round
    out = eng.generate("hello world", params, num_draft_tokens=6)
    assert out.token_ids == ref
    assert out.stats.num_drafts > 0 and set(out.stats.k_counts) <= {0, 1}   # one draft token per round


def test_a_request_arriving_during_drafting_streams_before_that_rounds_verify(eng, plain, monkeypatch):
    """A newcomer that arrives while the running sequence drafts is prefilled between that round's draft and
    its verify: its first token waits for at most one draft step (less than a target step without
    speculation), and both outputs stay the target's."""
    ev = Events(eng, monkeypatch)
    sched = eng.scheduler
    a = eng.submit(PROMPTS[1], GREEDY, num_draft_tokens=4, on_output=ev.on_output)
    eng.scheduler.step()
    propose = sched.draft.propose
    box = {}

    def arrive_during_propose(seqs, ks, **kw):
        if "b" not in box:
            box["b"] = eng.submit(PROMPTS[2], GREEDY, num_draft_tokens=4, on_output=ev.on_output)
        return propose(seqs, ks, **kw)

    monkeypatch.setattr(sched.draft, "propose", arrive_during_propose)
    eng.scheduler.step()
    b = box["b"]
    kinds = [(kind, x.request_id if kind == "delta" else sorted(x)) for kind, x in ev.log[-4:]]
    # ... propose{a} (b submitted during it), b's first token, verify{a}, a's tokens
    assert kinds == [("propose", [a]), ("delta", b), ("score", [a]), ("delta", a)]
    sa, sb = sched.by_id[a], sched.by_id[b]
    assert sb.draft_len == 0                                 # its draft prefill is the next step's
    drive(eng, lambda: sa.finished and sb.finished)
    assert sa.generated == plain[PROMPTS[1]] and sb.generated == plain[PROMPTS[2]]


def test_a_request_arriving_during_a_verify_streams_before_that_verify_ends(eng, plain, monkeypatch):
    """A newcomer that arrives while the target verifies is prefilled between the verify's pieces of layers
    (`ragged_forward(between=...)`, on the fused step): its first token waits for a piece of the verify, not for
    all of it. The verify's rows compute the same bits in pieces, so both outputs stay the target's, and the
    verify's time that adaptive K learns from leaves the newcomer's prefill out."""
    from specbuild.engines.embedded import model as model_mod
    from specbuild.engines.embedded.step import decode_step_of

    assert decode_step_of(eng.scorer.model, eng.scorer.cache) == "fused"    # the pieces need the fused step
    monkeypatch.setattr(model_mod, "PIECES_MIN_BYTES", 0)                   # a tiny model runs whole otherwise
    ev = Events(eng, monkeypatch)
    sched = eng.scheduler
    a = eng.submit(PROMPTS[1], GREEDY, num_draft_tokens=4, on_output=ev.on_output)
    sched.step()
    score, box, pieces = sched.scorer.score, {}, []

    def arrive_during_score(seqs, drafts, between=None, **kw):
        assert between is not None

        def hook():
            pieces.append(len(pieces))
            if "b" not in box:
                box["b"] = eng.submit(PROMPTS[2], GREEDY, num_draft_tokens=4, on_output=ev.on_output)
            between()
        return score(seqs, drafts, between=hook, **kw)

    monkeypatch.setattr(sched.scorer, "score", arrive_during_score)
    took, observed = step_with_a_slow_prefill(sched, monkeypatch, "verify")
    b = box["b"]
    kinds = [(kind, x.request_id if kind == "delta" else sorted(x)) for kind, x in ev.log[-3:]]
    # ... verify{a} (b submitted during it), b's first token before the verify's end, then a's tokens
    assert kinds == [("score", [a]), ("delta", b), ("delta", a)], kinds
    assert len(pieces) == 3
    assert took >= 0.5 and observed and observed[-1] < took - 0.45        # the prefill is not the verify's
    sa, sb = sched.by_id[a], sched.by_id[b]
    drive(eng, lambda: sa.finished and sb.finished)
    assert sa.generated == plain[PROMPTS[1]] and sb.generated == plain[PROMPTS[2]]


def test_a_request_arriving_during_a_draft_step_streams_before_that_step_ends(eng, plain, monkeypatch):
    """A newcomer that arrives while the draft runs is prefilled between the draft step's pieces of layers (as
    between the verify's), so its first token waits for a third of a draft step, not for all of it. The draft then
    drafts its whole K (nothing waits any more); the prefill is left out of the draft time adaptive K learns from,
    and both outputs stay the target's."""
    from specbuild.engines.embedded import model as model_mod

    monkeypatch.setattr(model_mod, "PIECES_MIN_BYTES", 0)                   # a tiny model runs whole otherwise
    sched = eng.scheduler
    a = eng.submit(PROMPTS[1], GREEDY, num_draft_tokens=4, on_output=lambda d: None)
    sched.step()
    log, box, pieces = [], {}, []
    propose = sched.draft.propose

    def arrive_during_draft(seqs, ks, stop_early=None, between=None):
        assert between is not None

        def hook():
            pieces.append(len(pieces))
            if "b" not in box:
                box["b"] = eng.submit(PROMPTS[2], GREEDY, num_draft_tokens=4,
                                      on_output=lambda d: log.append(("delta", d.request_id)))
            between()
        out = propose(seqs, ks, stop_early=stop_early, between=hook)
        log.append(("propose returned", [len(p.token_ids) for p in out]))
        return out

    monkeypatch.setattr(sched.draft, "propose", arrive_during_draft)
    took, observed = step_with_a_slow_prefill(sched, monkeypatch, "draft")
    b = box["b"]
    # b's first token before the draft step it arrived in ended; a still drafted its 4 tokens
    assert log[:2] == [("delta", b), ("propose returned", [4])], log
    assert pieces[:3] == [0, 1, 2]                            # a draft step of the tiny model ran in 3 pieces
    assert took >= 0.5 and observed and observed[-1] < took - 0.45        # the prefill is not the draft's time
    monkeypatch.setattr(sched.draft, "propose", propose)
    sa, sb = sched.by_id[a], sched.by_id[b]
    drive(eng, lambda: sa.finished and sb.finished)
    assert sa.generated == plain[PROMPTS[1]] and sb.generated == plain[PROMPTS[2]]
