"""Acceptor, sampling processing, n-gram proposer and SpecStats: pure functions on hand-built inputs.

The statistical test checks that speculative sampling reproduces the target's distribution: the first two
emitted tokens of a sequence are distributed as p (x) p. It runs a chi-square test with false-alarm rate
ALPHA = 1e-3 (fixed seeds, so it is deterministic), and the same harness is shown to reject two wrong rules.
"""

from __future__ import annotations

import pytest
import torch

from specbuild.engines.embedded import PLACEHOLDER, SamplingParams, SpecStats, greedy_accept, rejection_accept
from specbuild.engines.embedded.errors import EngineLimitError
from specbuild.engines.embedded.proposers import NgramProposer
from specbuild.engines.embedded.sampling import processed_probs, sample

ALPHA = 1e-3
P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])      # target, context-independent
Q = torch.tensor([0.04, 0.06, 0.10, 0.15, 0.25, 0.40])      # draft, far from the target


# ---- greedy -----------------------------------------------------------------------------------------
def test_greedy_perfect_match_accepts_all_and_adds_bonus():
    a = greedy_accept([5, 7, 9], [5, 7, 9, 11])
    assert a.output_token_ids == [5, 7, 9, 11] and a.num_accepted == 3 and a.padded() == [5, 7, 9, 11]


def test_greedy_early_mismatch_emits_recovered_target_token():
    a = greedy_accept([5, 7, 9], [5, 3, 9, 11])
    assert a.output_token_ids == [5, 3] and a.num_accepted == 1
    assert a.padded() == [5, 3, PLACEHOLDER, PLACEHOLDER]
    first = greedy_accept([4, 7, 9], [5, 7, 9, 11])
    assert first.output_token_ids == [5] and first.num_accepted == 0


def test_stacked_logits_are_a_view_when_back_to_back_and_a_copy_otherwise():
    from specbuild.engines.embedded.acceptor import stacked
    base = torch.randn(7, 11)
    pieces = [base[0:3], base[3:4], base[4:7]]               # the scorer's slices of its one logits tensor
    view = stacked(pieces)
    assert torch.equal(view, base) and view.data_ptr() == base.data_ptr()
    base[5, 2] = 100.0                                       # a view: no copy was made
    assert view[5, 2] == 100.0
    assert torch.equal(stacked(pieces[1:]), base[3:7])
    apart = [base[0:2], base[4:7]]                           # a gap (a sampling sequence between two greedy ones)
    assert torch.equal(stacked(apart), torch.cat(apart)) and stacked(apart).data_ptr() != base.data_ptr()
    swapped = [base[3:4], base[0:3]]
    assert torch.equal(stacked(swapped), torch.cat(swapped))
    cloned = [base[0:3], base[3:4].clone(), base[4:7]]       # suppress_stop_ids clones its sequence's rows
    assert torch.equal(stacked(cloned), base)
    base[0, 0] = -5.0
    assert stacked(cloned)[0, 0] == -5.0 and stacked(cloned).data_ptr() != base.data_ptr()


def test_greedy_k0_is_plain_decoding():
    a = greedy_accept([], [42])
    assert a.output_token_ids == [42] and a.num_accepted == 0 and a.padded() == [42]
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])


# ---- rejection sampling: hand-built distributions ---------------------------------------------------
def _onehot(ids, v=6):
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float()


def test_rejection_identical_distributions_accept_everything():
    d = torch.tensor([0, 3, 2])
    probs = P.repeat(3, 1)
    for seed in range(20):
        a = rejection_accept(d, probs, P.repeat(4, 1), torch.Generator().manual_seed(seed))
        assert a.num_accepted == 3 and a.output_token_ids[:3] == [0, 3, 2] and len(a.output_token_ids) == 4


def test_rejection_zero_target_mass_rejects_and_recovers_from_residual():
    # The target puts no mass on draft token 1 at position 0 -> always rejected; the residual is the target there.
    target = _onehot([4, 0, 0, 0])
    a = rejection_accept(torch.tensor([1, 2, 3]), _onehot([1, 2, 3]), target, torch.Generator().manual_seed(0))
    assert a.output_token_ids == [4] and a.num_accepted == 0 and a.padded() == [4, -1, -1, -1]


def test_rejection_early_mismatch_keeps_accepted_prefix():
    target = torch.stack([_onehot([2])[0], _onehot([5])[0], _onehot([1])[0]])
    a = rejection_accept(torch.tensor([2, 3]), None, target, torch.Generator().manual_seed(1))   # n-gram: q one-hot
    assert a.output_token_ids == [2, 5] and a.num_accepted == 1


def test_rejection_k0_samples_the_target():
    a = rejection_accept(torch.tensor([], dtype=torch.long), None, _onehot([3]), torch.Generator().manual_seed(0))
    assert a.output_token_ids == [3] and a.num_accepted == 0


# ---- the statistical test -----------------------------------------------------------------------------
def always_accept(draft_ids, draft_probs, target_probs, generator):
    """WRONG rule: trusts the draft blindly."""
    k = len(draft_ids)
    bonus = int(sample(target_probs[k:k + 1], generator)[0])
    return type(greedy_accept([], [0]))(draft_ids.tolist() + [bonus], k, k)


def recover_from_target(draft_ids, draft_probs, target_probs, generator):
    """WRONG rule: correct acceptance test, but the replacement is sampled from p instead of max(p - q, 0)."""
    k = len(draft_ids)
    idx = torch.arange(k)
    u = torch.rand(k, generator=generator)
    rej = (u * draft_probs[idx, draft_ids] > target_probs[idx, draft_ids]).tolist()
    n = rej.index(True) if True in rej else k
    tok = int(sample(target_probs[n:n + 1], generator)[0])
    return type(greedy_accept([], [0]))(draft_ids.tolist()[:n] + [tok], n, k)


def _first_two_tokens(rule, n: int, k: int = 3) -> torch.Tensor:
    """Simulate speculative steps until 2 tokens exist; count (x1, x2) pairs over n seeded runs."""
    v = len(P)
    counts = torch.zeros(v, v)
    qk, pk = Q.repeat(k, 1), P.repeat(k + 1, 1)
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while len(out) < 2:
            drafts = torch.multinomial(Q, k, replacement=True, generator=g)     # K i.i.d. draws from q
            out += rule(drafts, qk, pk, g).output_token_ids
        counts[out[0], out[1]] += 1
    return counts


def _chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = expected_probs * n
    stat = ((counts - exp) ** 2 / exp).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


@pytest.fixture(scope="module")
def joint():
    return torch.outer(P, P).flatten()


def test_speculative_sampling_reproduces_target_distribution(joint):
    counts = _first_two_tokens(rejection_accept, 6000).flatten()
    assert _chi2_pvalue(counts, joint) > ALPHA


@pytest.mark.parametrize("wrong_rule", [always_accept, recover_from_target])
def test_chi_square_harness_rejects_wrong_acceptance_rules(joint, wrong_rule):
    counts = _first_two_tokens(wrong_rule, 6000).flatten()
    assert _chi2_pvalue(counts, joint) < ALPHA


# ---- processing of distributions ----------------------------------------------------------------------
def test_processed_probs_temperature_top_k_top_p():
    logits = torch.log(P)[None]
    assert torch.allclose(processed_probs(logits, SamplingParams(temperature=1.0)), P[None], atol=1e-6)
    topk = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert torch.allclose(topk, torch.tensor([0.40, 0.25, 0, 0, 0, 0]) / 0.65, atol=1e-6)
    topp = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))[0]   # 0.40 + 0.25 reaches 0.6
    assert torch.allclose(topp, torch.tensor([0.40, 0.25, 0, 0, 0, 0]) / 0.65, atol=1e-6)
    cold = processed_probs(logits, SamplingParams(temperature=0.05))[0]
    assert cold[0] > 0.99


def test_sampling_params_reject_bad_values():
    with pytest.raises(EngineLimitError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(EngineLimitError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(EngineLimitError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(stop="x").stop == ("x",)


# ---- n-gram proposer ------------------------------------------------------------------------------------
def test_ngram_prompt_lookup():
    ng = NgramProposer(min_n=1, max_n=3)
    assert ng.propose_one([1, 2, 3, 4, 9, 1, 2, 3], 2).token_ids == [4, 9]
    assert ng.propose_one([1, 2, 3, 4, 9, 1, 2, 3], 5).token_ids == [4, 9, 1, 2, 3]
    assert ng.propose_one([5, 6, 7, 8], 3).token_ids == []                 # no earlier match
    assert ng.propose_one([7], 3).token_ids == []
    assert ng.propose_one([1, 2, 3, 1, 2, 3], 0).token_ids == []


# ---- SpecStats --------------------------------------------------------------------------------------------
def test_spec_stats_derived_figures_with_injected_clock():
    times = iter([10.0, 10.5, 11.0, 12.0])
    st = SpecStats(clock=lambda: next(times))
    st.observe_draft(4, 4)
    st.observe_draft(4, 1)
    st.observe_draft(0, 0)                  # K = 0 steps are not drafts
    st.observe_draft(2, 0)
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 10, 5)
    assert st.accepted_per_pos == [2, 1, 1, 1] and st.drafted_per_pos == [3, 3, 2, 2]
    assert st.acceptance_rate == pytest.approx(0.5)
    assert st.mean_accepted_length == pytest.approx(1 + 5 / 3)
    assert st.system_efficiency == pytest.approx(8 / 13)
    st.observe_tokens(5)                    # t = 10.5
    st.observe_tokens(2)                    # t = 11.0
    st.add_time("score", 0.25)
    d = st.to_dict()
    assert d["generated_tokens"] == 7 and d["ttft_s"] == pytest.approx(0.5)
    assert d["tokens_per_second"] == pytest.approx(7.0) and d["stage_seconds"]["score"] == 0.25
    with pytest.raises(ValueError):
        st.observe_draft(2, 3)
