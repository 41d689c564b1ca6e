""""Off by the policy costs nothing": where the policy decides not to draft (above its cut-off, or adaptive K at 0),
the engine does the work speculation off does and no more. Counted, not timed: forwards of the draft model (a
hook on its embedding, which every forward, fused or eager, goes through) and the planning work per step."""

from __future__ import annotations

import pytest

from specbuild.engines.embedded import Engine, SamplingParams
from specbuild.engines.embedded.config import Policy
from specbuild.engines.embedded.kplan import KPlanner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def fibonacci(n):", "Triton Inference Server"]


def _count_draft_forwards(eng: Engine) -> dict:
    n = {"forwards": 0}
    eng.draft.embed.register_forward_hook(lambda *a: n.__setitem__("forwards", n["forwards"] + 1))
    return n


def _drive(eng: Engine, arrivals: list[tuple[int, str]], params: SamplingParams, k=None) -> list:
    """Step the engine by hand; arrivals (step, prompt) join the waiting queue at that step."""
    seqs, step, pending = [], 0, sorted(arrivals)
    while pending or eng.scheduler.has_work():
        while pending and pending[0][0] <= step:
            s = eng._make_sequence(pending.pop(0)[1], params, k, None, lambda d: None)
            eng.scheduler.add(s)
            seqs.append(s)
        eng.step()
        step += 1
    return seqs


def test_above_the_cut_off_the_draft_never_runs_and_no_k_is_priced(tiny_llama, tiny_llama_draft, monkeypatch):
    """An own-cache draft (the one with prompts to prefill and accepted tokens to catch up on) under a cut-off
    every step is over (max_concurrency 0: never by default): requests arriving together and while others run."""
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=4, max_seq_len=128,
                                  policy=Policy(k="adaptive", max_concurrency=0))
    calls = _count_draft_forwards(eng)
    priced = []
    real_cost = KPlanner.cost
    monkeypatch.setattr(KPlanner, "cost", lambda self, p, n: priced.append(n) or real_cost(self, p, n))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    arrivals = [(0, PROMPTS[0]), (0, PROMPTS[1]), (2, PROMPTS[2]), (5, PROMPTS[3])]
    seqs = _drive(eng, arrivals, params)
    assert calls["forwards"] == 0                              # no draft prefill, catch-up or draft step
    assert not priced, f"adaptive K was priced in {len(priced)} steps over the cut-off"
    m = eng.metrics()                                          # (the metrics report the cost model: after)
    assert m["draft_tokens_total"] == 0 and m["spec_cutoff_steps_total"] == m["steps_total"] > 0
    assert all(set(s.stats.k_counts) == {0} and s.stats.cutoff_steps == s.stats.k_counts[0] for s in seqs)
    assert m["sequence_steps_total"] == sum(s.stats.k_counts[0] for s in seqs)
    assert m["policy_max_concurrency"] == 0
    # ... and exactly the tokens of speculation off, sent by the same traffic
    off = _drive(eng, arrivals, params, k=0)
    assert [s.generated for s in seqs] == [s.generated for s in off]


def test_adaptive_k_at_zero_probes_less_and_less(tiny_llama, tiny_llama_draft):
    """An unrelated draft: adaptive K settles at 0. Each probe (one drafted token, its catch-up and a wider
    verify) that finds nothing doubles the wait for the next: at a fixed 1 probe in 8 steps this request drafted
    26 probes over 200 tokens (32 draft forwards); now a handful."""
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=2, max_seq_len=256,
                                  online_costs=False, policy=Policy(k="adaptive"))
    calls = _count_draft_forwards(eng)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    out = eng.generate(PROMPTS[0], params)
    assert out.token_ids == eng.generate(PROMPTS[0], params, num_draft_tokens=0).token_ids
    st = out.stats
    assert st.num_accepted_tokens == 0                       # nothing this draft proposes is ever right
    assert st.k_counts[0] >= 180 and st.k_counts.get(1, 0) <= 8, st.k_counts
    assert calls["forwards"] <= 16, calls
