"""The soak's wrong answer (issue 22), reproduced deterministically.

A request aborted while the draft runs frees its KV slot at once. A waiting request can be admitted into that
slot in the SAME step (it is prefilled between the round's draft and its verify, so its first token is not held
back by the round). The aborted sequence was still in that step's verify batch, and its verify wrote its K+1
positions into the slot, which now holds the newcomer's prompt: the newcomer's next tokens attended over
another request's keys and values (the soak saw 'The quick brown foxKKKKKKKKortortort...').

A freed slot must not be reused before the step that last used it has ended.
"""

from __future__ import annotations

import pytest

from specbuild.engines.embedded import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHORT = "Paris"
LONG = ("Speculative decoding drafts tokens with a small model and verifies them with a large one. "
        "The quick brown fox jumps over the lazy dog.")


def _params(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("draft_kv", ["own", "shared"])
def test_abort_during_draft_does_not_corrupt_a_newcomer_in_the_freed_slot(tiny_llama, tiny_llama_draft, draft_kv):
    draft = tiny_llama if draft_kv == "shared" else tiny_llama_draft
    eng = Engine.from_checkpoints(tiny_llama, draft, max_batch_size=1, max_seq_len=256, max_draft_len=6,
                                  draft_kv=draft_kv, online_costs=False)
    reference = eng.generate(LONG, _params(24), num_draft_tokens=0).token_ids
    sched = eng.scheduler

    out: dict[str, list] = {"a": [], "b": []}
    finals: dict[str, str] = {}

    def collect(name):
        def on_output(d):
            out[name].extend(d.token_ids)
            if d.finished:
                finals[name] = d.finish_reason
        return on_output

    a = eng.submit(SHORT, _params(40), num_draft_tokens=6, proposer="draft", on_output=collect("a"))
    for _ in range(3):                      # A is running and drafting, B not yet submitted
        sched.step()
    assert "a" not in finals
    b = eng.submit(LONG, _params(24), num_draft_tokens=0, on_output=collect("b"))
    assert sched.waiting and sched.slots.num_free == 0

    # The client of A disconnects while A's draft runs (the frontend aborts from another thread).
    proposer = sched.draft
    real_propose = proposer.propose

    def propose_then_client_gone(seqs, ks, stop_early=None, between=None):
        props = real_propose(seqs, ks, stop_early=None, between=between)
        eng.abort(a)
        return props

    proposer.propose = propose_then_client_gone
    try:
        sched.step()                        # A aborted mid-round; B admitted (same step or the next)
    finally:
        proposer.propose = real_propose
    assert finals.get("a") == "abort"
    while "b" not in finals:
        sched.step()
    assert finals["b"] == "length"
    assert out["b"] == reference, "the newcomer's output changed: its slot was written by the aborted request"
    assert sched.slots.num_free == 1 and not sched.by_id
