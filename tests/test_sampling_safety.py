"""Numerically safe sampling: the greedy epsilon, refusal of non-finite values, and top_p / top_k edge
values, under plain sampling and under the rejection-sampling rule (the output stays the target's)."""

from __future__ import annotations

import math

import pytest
import torch

from specbuild.engines.embedded import EngineLimitError, SamplingParams, rejection_accept
from specbuild.engines.embedded.errors import SamplingError
from specbuild.engines.embedded.sampling import GREEDY_EPSILON, check_probs, processed_probs

V = 50


def logits(rows=3, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 8


@pytest.mark.parametrize("kw", [dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=-0.1),
                                dict(top_p=math.nan), dict(top_p=math.inf), dict(top_p=0.0), dict(top_p=1.01),
                                dict(top_k=-1), dict(max_tokens=0), dict(temperature="1"), dict(top_k=1.5)])
def test_non_finite_and_out_of_range_values_are_refused(kw):
    with pytest.raises(EngineLimitError, match="invalid sampling parameters"):
        SamplingParams(**kw)


@pytest.mark.parametrize("t", [0.0, 1e-40, 1e-300, GREEDY_EPSILON / 2])
def test_temperatures_below_epsilon_are_greedy(t):
    p = SamplingParams(temperature=t)
    assert p.greedy
    lg = logits()
    probs = processed_probs(lg, p)
    assert torch.equal(probs.argmax(-1), lg.argmax(-1)) and torch.equal(probs.max(-1).values, torch.ones(3))


@pytest.mark.parametrize("kw", [dict(temperature=GREEDY_EPSILON), dict(temperature=1e30),
                                dict(temperature=3.4e38), dict(temperature=1.0, top_p=1e-30),
                                dict(temperature=0.7, top_k=10 ** 9), dict(temperature=0.7, top_k=1)])
def test_edge_values_give_finite_distributions(kw):
    probs = processed_probs(logits() * 1000, SamplingParams(**kw))
    check_probs(probs)
    assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_top_p_tiny_and_top_k_one_are_argmax_and_huge_temperature_is_uniform():
    lg = logits()
    for p in (SamplingParams(temperature=1.0, top_p=1e-30), SamplingParams(temperature=5.0, top_k=1)):
        probs = processed_probs(lg, p)
        assert torch.equal(probs.argmax(-1), lg.argmax(-1)) and torch.allclose(probs.max(-1).values, torch.ones(3))
    uniform = processed_probs(lg, SamplingParams(temperature=1e30))
    assert torch.allclose(uniform, torch.full_like(uniform, 1 / V))
    off = processed_probs(lg, SamplingParams(temperature=0.9, top_k=V))       # top_k >= vocab: off
    assert torch.allclose(off, processed_probs(lg, SamplingParams(temperature=0.9)))


def test_non_finite_distribution_raises_a_clear_error():
    with pytest.raises(SamplingError, match="not finite"):
        processed_probs(torch.full((1, V), math.nan), SamplingParams(temperature=1.0))
    with pytest.raises(SamplingError, match="not finite"):
        check_probs(torch.zeros(1, V))


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_k=1), dict(temperature=1.0, top_p=1e-30)])
def test_rejection_rule_with_one_hot_edges_equals_the_target_argmax(kw):
    """top_k=1 / tiny top_p make p and q one-hot: the rule must accept exactly the drafts that equal the
    target's argmax and then emit the target's argmax (never the draft's), whatever the random numbers."""
    params = SamplingParams(**kw)
    target, draft = logits(4, seed=1), logits(3, seed=2)
    p, q = processed_probs(target, params), processed_probs(draft, params)
    drafts = q.argmax(-1)
    drafts[0] = p[0].argmax()                                   # the first draft agrees with the target
    for seed in range(20):
        acc = rejection_accept(drafts, q, p, torch.Generator().manual_seed(seed))
        want = p.argmax(-1).tolist()
        n = acc.num_accepted
        assert acc.output_token_ids == drafts[:n].tolist() + [want[n]]
        assert all(drafts[i] == want[i] for i in range(n)) and (n == 3 or drafts[n] != want[n])


def test_rejection_rule_keeps_the_target_distribution_at_top_p_edge():
    """top_p keeps only 2 tokens: sampled outputs stay inside the target's kept set, with its frequencies."""
    params = SamplingParams(temperature=1.0, top_p=0.5)
    lg = torch.zeros(1, V)
    lg[0, 3], lg[0, 7] = 6.0, 5.8
    p = processed_probs(lg.repeat(2, 1), params)
    q = processed_probs(torch.zeros(1, V), SamplingParams(temperature=1.0))     # uniform draft
    counts = torch.zeros(V)
    g = torch.Generator().manual_seed(0)
    for _ in range(4000):
        d = torch.multinomial(q[0], 1, generator=g)
        counts[rejection_accept(d, q, p, g).output_token_ids[0]] += 1
    assert counts.sum() == counts[3] + counts[7]
    assert abs(counts[3] / 4000 - float(p[0, 3])) < 0.05
