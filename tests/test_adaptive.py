"""Adaptive K, the concurrency cut-off and the deliberately broken acceptance rule of the embedded engine.

The policy (adaptive.py) is checked as pure functions; the engine on the tiny real checkpoints: adaptive K
stays lossless, turns speculation off for an unrelated draft and drafts long for draft == target; the
cut-off stops drafting while more sequences run; "unsafe-always-accept" drifts where "exact" does not.
"""

from __future__ import annotations

import json
import logging

import pytest

from specbuild.engines.embedded import Engine, EngineLimitError, Policy, SamplingParams
from specbuild.engines.embedded.config import ADAPTIVE_K
from specbuild.engines.embedded.adaptive import (AcceptanceTracker, AdaptivePolicy, CostModel,
                                                 choose_batch_k, choose_k, concurrency_costs, cost_models,
                                                 cutoff_from_speedups,
                                                 expected_tokens, fit_verify_curve, predicted_speedup, prior_alphas,
                                                 prior_strength)

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of"]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
CALIBRATION = {"proposer": "draft", "t_target_s": 0.04, "t_draft_s": 0.012, "alpha": 0.9,
               "t_verify_s": {"1": 0.046, "2": 0.048, "3": 0.050, "4": 0.052}}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the policy: pure functions ------------------------------------------------------------------
def test_k0_scores_exactly_one_and_matches_the_round_cost_formula():
    """E[tokens per round] / ((K t_draft + t_verify[K]) / t_target), the verify times on the fitted line."""
    cost = cost_models(CALIBRATION)["draft"]
    assert predicted_speedup(0.7, 0, cost) == 1.0
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    for k in (1, 2, 4):
        t_verify = 0.04 * (1 + cost.verify_overhead(k))
        assert predicted_speedup(0.7, k, cost) == pytest.approx(
            expected_tokens(0.7, k) / ((k * 0.012 + t_verify) / 0.04))


def test_high_alpha_drafts_long_low_alpha_turns_speculation_off():
    cost = CostModel(cost_ratio=0.3, verify_intercept=0.1, verify_slope=0.05)
    assert choose_k(0.1, cost, 8) == 0
    assert choose_k(0.3, cost, 8) == 0
    assert choose_k(0.9, cost, 8) == 5
    assert choose_k(1.0, cost, 8) == 8
    assert choose_k(0.99, cost, 3) == 3                        # capped by max_k
    assert choose_k(0.99, cost, 0) == 0
    free = CostModel(cost_ratio=0.0, verify_intercept=0.0, verify_slope=0.0)
    assert choose_k(0.05, free, 6) == 6                        # free drafts always pay


def test_choice_is_monotone_in_alpha_and_in_cost():
    alphas = [i / 100 for i in range(101)]
    for c in (0.0, 0.05, 0.3, 0.8):
        cost = CostModel(cost_ratio=c, verify_intercept=0.2, verify_slope=0.02)
        ks = [choose_k(a, cost, 8) for a in alphas]
        assert ks == sorted(ks) and ks[0] == 0
    for a in (0.5, 0.8, 0.95):
        ks = [choose_k(a, CostModel(cost_ratio=c, verify_intercept=0.1, verify_slope=0.05), 8)
              for c in (0.0, 0.1, 0.3, 0.6, 1.0, 2.0)]
        assert ks == sorted(ks, reverse=True)


def test_verify_curve_fit_and_calibration_reading():
    assert fit_verify_curve(1.0, {1: 1.2, 2: 1.3, 3: 1.4}) == pytest.approx((0.1, 0.1))
    a, b = fit_verify_curve(1.0, {1: 1.9, 2: 1.5, 3: 1.5, 4: 1.4})     # noise: never a falling curve
    assert b == 0.0 and a == pytest.approx(0.575)
    models = cost_models(CALIBRATION)
    assert models["draft"].cost_ratio == pytest.approx(0.3) and models["draft"].source == "calibration"
    assert models["ngram"].cost_ratio == 0.0
    assert models["draft"].verify_overhead(2) == pytest.approx(0.2)
    # An n-gram calibration says nothing about a draft model's cost: the default c stays.
    ngram_cal = {**CALIBRATION, "proposer": "ngram", "t_draft_s": 0.0}
    assert cost_models(ngram_cal)["draft"].cost_ratio == CostModel().cost_ratio
    assert cost_models(None)["draft"] == CostModel() and cost_models({})["ngram"].cost_ratio == 0.0
    assert prior_alphas(CALIBRATION) == {"draft": 0.9, "ngram": AdaptivePolicy().prior_alpha}


def test_a_step_of_n_sequences_is_priced_with_the_times_measured_nearest_n():
    """by_concurrency: one sequence's costs price n = 1 only; n uses the nearest measured concurrency (the larger
    on a tie), so a 4-sequence step whose verify is compute-bound drafts less than one sequence would."""
    at = {"2": {"t_target_s": 0.05, "t_draft_s": 0.02, "t_verify_s": {"1": 0.07, "2": 0.08, "4": 0.10}},
          "4": {"t_target_s": 0.06, "t_draft_s": 0.036, "t_verify_s": {"1": 0.09, "2": 0.11, "4": 0.15}},
          "8": {"t_target_s": 0.08, "t_draft_s": 0.06, "t_verify_s": {"1": 0.14, "2": 0.19, "4": 0.30}}}
    cal = {**CALIBRATION, "by_concurrency": at}
    assert cost_models(cal, 1) == cost_models(CALIBRATION) == cost_models(cal)
    assert concurrency_costs(cal, 1) is None and concurrency_costs(CALIBRATION, 4) is None
    assert [concurrency_costs(cal, n) for n in (2, 3, 5, 6, 7, 16)] == [at["2"], at["4"], at["4"], at["8"],
                                                                         at["8"], at["8"]]
    four = cost_models(cal, 4)["draft"]
    assert four.cost_ratio == pytest.approx(0.6) and four.source == "calibration"
    assert four.cost(4) == pytest.approx(1 + 0.6 * 4 + 0.15 / 0.06 - 1, rel=0.05)      # the fitted line, near
    assert cost_models(cal, 4)["ngram"].cost_ratio == 0.0
    ks = [choose_k(0.9, cost_models(cal, n)["draft"], 8) for n in (1, 2, 4, 8)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]


def test_prior_strength_follows_how_alike_finished_sequences_accepted():
    """Empirical Bayes: sequences that accepted alike make the starting estimate firm (at most 16 trials); a mix of
    fitting and unfitting ones leaves it at the policy's 4; too few sequences say nothing yet."""
    policy = AdaptivePolicy()
    alike = [(15, 16), (14, 16), (16, 17), (15, 16), (13, 15), (16, 16), (15, 16), (14, 15)]
    assert prior_strength(alike) == 16.0
    mixed = alike[:4] + [(1, 8), (0, 6), (2, 9), (1, 7)]
    assert prior_strength(mixed) == policy.prior_strength
    assert prior_strength(alike[:7]) == policy.prior_strength
    # in between: rates of 0.70 and 0.95 over 200 trials each, far more spread than 200 trials explain (s ~ 7.4)
    between = [(140, 200), (190, 200)] * 4
    assert policy.prior_strength < prior_strength(between) < 16.0


def test_a_firm_start_survives_an_early_rejection_and_the_planner_learns_it():
    """With 16 trials behind it, a first-round rejection moves 0.96 to 0.90 (not 0.77), and adaptive K stays high;
    the planner hands new trackers that strength once its finished sequences accepted alike."""
    from types import SimpleNamespace

    from specbuild.engines.embedded.kplan import KPlanner

    cost = cost_models(CALIBRATION)["draft"]
    weak, firm = AcceptanceTracker(0.96), AcceptanceTracker(0.96, strength=16.0)
    for tr in (weak, firm):
        tr.observe(8, 0)
    assert weak.alpha == pytest.approx(0.96 * 4 / 5) and firm.alpha == pytest.approx(0.96 * 16 / 17)
    assert choose_k(firm.alpha, cost, 8) > choose_k(weak.alpha, cost, 8)
    # the forgetting floor: min(min_weight, 1 / 32) once 2 x 16 trials are in
    for _ in range(40):
        firm.observe(1, 1)
    before = firm.alpha
    firm.observe(1, 0)
    assert firm.alpha == pytest.approx(before - before / 32)
    kp = KPlanner(calibration=CALIBRATION, online_costs=False)
    assert kp.tracker("draft").strength == AdaptivePolicy().prior_strength
    for a, n in [(15, 16)] * 8:
        tr = AcceptanceTracker(0.9)
        tr.observe(n, a)
        kp.fold(SimpleNamespace(adaptive=tr, proposer="draft"))
    assert kp.tracker("draft").strength == 16.0 and kp.tracker("ngram").strength == AdaptivePolicy().prior_strength


def test_the_planner_prices_each_step_at_its_own_concurrency():
    """Before any online sample, a step of 4 adaptive sequences is planned with the build's 4-sequence costs."""
    from specbuild.engines.embedded.kplan import KPlanner

    dear = {"t_target_s": 0.04, "t_draft_s": 0.04, "t_verify_s": {"1": 0.09, "2": 0.13, "4": 0.21}}
    kp = KPlanner(calibration={**CALIBRATION, "by_concurrency": {"4": dear}}, online_costs=True)
    assert kp.cost("draft", 1) == cost_models(CALIBRATION)["draft"]
    assert kp.cost("draft", 4).cost_ratio == pytest.approx(1.0) and kp.cost("draft", 6) == kp.cost("draft", 4)
    assert choose_k(0.9, kp.cost("draft", 1), 8) > 0 and choose_k(0.9, kp.cost("draft", 4), 8) == 0
    kp.set_calibration(CALIBRATION)                      # a new calibration without them: one sequence's costs
    assert kp.cost("draft", 4) == cost_models(CALIBRATION)["draft"]


def test_tracker_counts_tested_drafts_only_and_probes_when_off():
    tr = AcceptanceTracker(0.5, AdaptivePolicy(prior_strength=2, min_weight=0.5, probe_every=3))
    tr.observe(4, 4)                                           # 4 successes, no failure: weights 1/3, 1/2 ...
    assert tr.alpha == pytest.approx(1 - 0.5 * 0.5 ** 4) and tr.trials == 4     # min_weight 0.5 dominates
    tr.alpha = 0.5
    tr.observe(4, 1)                                           # 1 success, 1 failure; d3, d4 never tested
    assert tr.alpha == pytest.approx(0.375) and tr.trials == 6
    tr.observe(0, 0)
    assert tr.alpha == pytest.approx(0.375) and tr.trials == 6
    # Thin evidence: the first trials weigh like a Beta posterior mean (prior 0.5 worth 2 trials).
    beta = AcceptanceTracker(0.5, AdaptivePolicy(prior_strength=2, min_weight=0.01))
    beta.observe(3, 2)                                         # 2 successes, 1 failure
    assert beta.alpha == pytest.approx((2 + 0.5 * 2) / (3 + 2))
    tr.alpha = 0.0
    cost = CostModel()
    # probes after 3, then 6, then 12 K = 0 steps: each probe that finds nothing doubles the wait
    probes = [0, 0, 1] + [0] * 5 + [1] + [0] * 11 + [1]
    assert [tr.next_k(cost, 4) for _ in range(len(probes))] == probes
    assert tr.history == probes
    tr.alpha = 0.95                                            # acceptance recovered: drafting by choice again
    assert tr.next_k(cost, 4) > 0
    tr.alpha = 0.0                                             # ... and off again: probes start over at 3
    assert [tr.next_k(cost, 4) for _ in range(3)] == [0, 0, 1]
    capped = AcceptanceTracker(0.0, AdaptivePolicy(probe_every=2, probe_max=4))
    assert [capped.next_k(cost, 4) for _ in range(12)] == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0]


def test_crossover_is_the_first_batch_size_where_drafting_loses():
    assert cutoff_from_speedups({8: 0.7, 1: 1.4, 4: 0.9, 2: 1.2}, 8) == (4, 2)
    assert cutoff_from_speedups({1: 0.8, 2: 1.1}, 8) == (1, 0)
    assert cutoff_from_speedups({1: 1.5, 8: 1.0}, 8) == (None, None)
    assert cutoff_from_speedups({1: 1.5, 2: 1.2, 3: 1.05, 4: 0.9}, 8) == (4, 3)
    assert cutoff_from_speedups({1: 1.3, 2: 1.1}, 8) == (None, 2)          # measuring stopped early


# ---- the engine on tiny real checkpoints ---------------------------------------------------------
@pytest.fixture(scope="module")
def eng(tiny_llama, tiny_llama_draft):
    """Target with an unrelated draft; adaptive by default."""
    return Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=4, max_seq_len=128,
                                   policy=Policy(), online_costs=False)   # adaptive: the acceptance side


@pytest.fixture(scope="module")
def plain(eng):
    return {p: eng.generate(p, GREEDY, num_draft_tokens=0) for p in PROMPTS}


def _check_stats(st):
    """Counts with K varying between steps: every drafted token counted once, at its position."""
    assert sum(k * n for k, n in st.k_counts.items()) == st.num_draft_tokens
    assert sum(n for k, n in st.k_counts.items() if k > 0) == st.num_drafts
    assert st.drafted_per_pos[:1] == ([st.num_drafts] if st.num_drafts else [])
    assert sum(st.drafted_per_pos) == st.num_draft_tokens
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    assert st.drafted_per_pos == sorted(st.drafted_per_pos, reverse=True)


def _record_trackers(eng, monkeypatch) -> list[AcceptanceTracker]:
    """Keep each request's AcceptanceTracker (its per-step K history) as the engine makes sequences."""
    trackers = []
    make = eng._make_sequence

    def recording(*a, **kw):
        seq = make(*a, **kw)
        trackers.append(seq.adaptive)
        return seq
    monkeypatch.setattr(eng, "_make_sequence", recording)
    return trackers


def test_adaptive_is_lossless_and_turns_an_unrelated_draft_off(eng, plain, monkeypatch):
    trackers = _record_trackers(eng, monkeypatch)
    steps = zeros = 0
    for p in PROMPTS:
        eng.scheduler.kplan.alpha_prior = prior_alphas(None)        # every request starts from the same prior
        eng.scheduler.kplan.finished.clear()                            # ... as weak as a fresh engine's
        out = eng.generate(p, GREEDY)                                      # engine default: adaptive
        history = trackers[-1].history
        ngram = eng.generate(p, GREEDY, num_draft_tokens=ADAPTIVE_K, proposer="ngram")
        assert out.token_ids == plain[p].token_ids and out.text == plain[p].text
        assert ngram.token_ids == plain[p].token_ids
        _check_stats(out.stats)
        _check_stats(ngram.stats)
        assert history[0] > 0 and 0 in history[:12]          # optimistic start, off after a few rejections
        if out.stats.num_accepted_tokens == 0:
            assert history[4] == 0                            # nothing ever accepted: off by the 5th step
        assert sum(history) == out.stats.num_draft_tokens
        steps += len(history)
        zeros += history.count(0)
    # Off for most steps; the rest are probes and stretches where the tiny random models repeat themselves
    # (there the unrelated draft is right, and adaptive K rightly drafts again).
    assert zeros >= 0.5 * steps


def test_adaptive_drafts_long_when_the_draft_is_the_target(eng_self, plain):
    for p in PROMPTS:
        out = eng_self.generate(p, GREEDY, num_draft_tokens=-1)
        assert out.token_ids == plain[p].token_ids
        st = out.stats
        _check_stats(st)
        # never off by choice; one K = 0 step at the end where max_tokens leaves room for one token only
        assert st.acceptance_rate == 1.0 and st.k_counts.get(0, 0) <= 1
        assert max(st.k_counts) == 8                          # climbs to max_draft_len
        assert st.num_draft_tokens / sum(st.k_counts.values()) > 3


def test_new_requests_start_from_what_finished_ones_measured(tiny_llama, plain, monkeypatch):
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=128, online_costs=False)
    trackers = _record_trackers(eng, monkeypatch)
    assert eng.scheduler.kplan.alpha_prior["draft"] == AdaptivePolicy().prior_alpha
    first = eng.generate(PROMPTS[0], GREEDY, num_draft_tokens=-1)
    assert eng.scheduler.kplan.alpha_prior["draft"] > AdaptivePolicy().prior_alpha      # all accepted: raised
    assert eng.scheduler.kplan.alpha_prior["ngram"] == AdaptivePolicy().prior_alpha      # other proposer untouched
    second = eng.generate(PROMPTS[1], GREEDY, num_draft_tokens=-1)
    assert second.token_ids == plain[PROMPTS[1]].token_ids
    assert first.token_ids == plain[PROMPTS[0]].token_ids
    assert trackers[1].history[0] > trackers[0].history[0]    # a higher starting estimate drafts more at once
    eng.generate(PROMPTS[2], GREEDY, num_draft_tokens=3)                           # fixed K: no effect
    before = dict(eng.scheduler.kplan.alpha_prior)
    eng.generate(PROMPTS[2], GREEDY, num_draft_tokens=3)
    assert eng.scheduler.kplan.alpha_prior == before
    eng.update_calibration({**CALIBRATION, "alpha": 0.2})
    assert eng.scheduler.kplan.alpha_prior["draft"] == 0.2 and eng.scheduler.kplan.costs["draft"].cost_ratio == pytest.approx(0.3)


def test_fixed_k_still_works_on_an_adaptive_engine(eng, plain):
    out = eng.generate(PROMPTS[0], GREEDY, num_draft_tokens=3)
    assert out.token_ids == plain[PROMPTS[0]].token_ids
    kc = out.stats.k_counts                                     # 3, or less near max_tokens
    assert max(kc) == 3 and kc[3] >= sum(kc.values()) - 3


def test_concurrency_cutoff_stops_drafting_while_more_sequences_run(tiny_llama, plain):
    """The cut-off is the deployment's default policy: it applies to requests that leave K to the engine."""
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=128, online_costs=False,
                                  policy=Policy(k=3, max_concurrency=1))
    lens = [4, 4, 20]
    outs = eng.generate_batch([(p, SamplingParams(max_tokens=n, ignore_eos=True), None)
                               for p, n in zip(PROMPTS, lens)])
    for out, p, n in zip(outs, PROMPTS, lens):
        assert out.token_ids == plain[p].token_ids[:n]
    short, long_ = outs[0].stats, outs[2].stats
    # Three running: plain steps only (the 4-token requests: the first token at prefill, then 3 steps), then
    # the last one drafts.
    assert short.num_draft_tokens == 0 and short.k_counts == {0: 3} and short.cutoff_steps == 3
    assert long_.k_counts[0] == 3 and long_.cutoff_steps == 3
    assert long_.num_draft_tokens > 0 and long_.acceptance_rate == 1.0
    _check_stats(long_)
    assert eng.metrics()["spec_cutoff_steps_total"] == 3
    # Without the cut-off every request drafts from its first step.
    free = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=128, online_costs=False)
    outs = free.generate_batch([(p, SamplingParams(max_tokens=n, ignore_eos=True), 3) for p, n in zip(PROMPTS, lens)])
    assert all(o.stats.k_counts.get(0, 0) == 0 and o.stats.cutoff_steps == 0 for o in outs)


def test_an_explicit_k_forces_speculation_above_the_cutoff(tiny_llama, plain):
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=128, online_costs=False,
                                  policy=Policy(k=3, max_concurrency=0))   # 0 = never by default
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    default, forced, off = eng.generate_batch([(PROMPTS[0], params, None), (PROMPTS[1], params, 3),
                                               (PROMPTS[2], params, 0)])
    assert default.stats.num_draft_tokens == 0 and default.stats.cutoff_steps > 0
    assert forced.stats.num_draft_tokens > 0 and forced.stats.cutoff_steps == 0
    assert off.stats.num_draft_tokens == 0 and off.stats.cutoff_steps == 0
    for out, p in zip((default, forced, off), PROMPTS):
        assert out.token_ids == plain[p].token_ids[:12]


def test_unsafe_always_accept_drifts_and_exact_does_not(tiny_llama, tiny_llama_draft, plain, caplog):
    with caplog.at_level(logging.WARNING):
        bad = Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=4, max_seq_len=128,
                                      online_costs=False, acceptance_rule="unsafe-always-accept")
    assert "ACCEPTED WITHOUT VERIFICATION" in caplog.text
    good = Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=4, max_seq_len=128, online_costs=False)
    drifted = 0
    for p in PROMPTS:
        broken = bad.generate(p, GREEDY, num_draft_tokens=3)
        assert broken.stats.acceptance_rate == 1.0            # what a verifier without K=0 would believe
        drifted += broken.token_ids != plain[p].token_ids
        assert good.generate(p, GREEDY, num_draft_tokens=3).token_ids == plain[p].token_ids
        assert bad.generate(p, GREEDY, num_draft_tokens=0).token_ids == plain[p].token_ids   # K=0: no drafts
    assert drifted == len(PROMPTS)


def test_build_dir_keys_kwargs_override_and_bad_values(tmp_path, tiny_llama, tiny_llama_draft):
    cfg = {"format": "specbuild-embedded-engine", "schema": 2, "target": str(tiny_llama),
           "draft": str(tiny_llama_draft), "max_batch_size": 2, "max_seq_len": 64, "max_draft_len": 4,
           "policy": {"k": "adaptive", "max_concurrency": 2}, "acceptance_rule": "unsafe-always-accept",
           "calibration": CALIBRATION}
    (tmp_path / "engine_config.json").write_text(json.dumps(cfg))
    eng = Engine.from_build_dir(tmp_path)
    assert (eng.config.policy.adaptive, eng.config.policy.max_concurrency, eng.config.acceptance_rule) == \
        (True, 2, "unsafe-always-accept")
    assert eng.scheduler.kplan.costs["draft"].cost_ratio == pytest.approx(0.3)
    eng = Engine.from_build_dir(tmp_path, policy=Policy(k=2), acceptance_rule="exact")
    assert (eng.config.policy.k, eng.config.policy.max_concurrency, eng.config.acceptance_rule) == (2, None, "exact")
    with pytest.raises(EngineLimitError, match="acceptance_rule 'sloppy'"):
        Engine.from_build_dir(tmp_path, acceptance_rule="sloppy")
    with pytest.raises(EngineLimitError, match="max_concurrency=-1"):
        Engine.from_build_dir(tmp_path, policy=Policy(max_concurrency=-1))
    with pytest.raises(EngineLimitError, match="above the engine's max_draft_len=4"):
        Engine.from_build_dir(tmp_path, policy=Policy(k=6))
    # schema 1 (loose keys, before the Policy object) still loads, as the policy it meant
    legacy = {k: v for k, v in cfg.items() if k not in ("format", "schema", "policy")}
    (tmp_path / "engine_config.json").write_text(json.dumps({**legacy, "adaptive_k": False,
                                                             "default_num_draft_tokens": 3,
                                                             "spec_max_concurrency": 1}))
    old = Engine.from_build_dir(tmp_path).config.policy
    assert (old.k, old.proposer, old.max_concurrency) == (3, "draft", 1)
    with pytest.raises(EngineLimitError, match="no draft model"):
        Engine.from_checkpoints(tiny_llama, max_seq_len=64).generate("x", GREEDY, num_draft_tokens=-1,
                                                                     proposer="draft")


def test_batch_k_is_one_k_for_the_step_and_weighs_every_sequence():
    cost = CostModel(cost_ratio=0.3, verify_intercept=0.1, verify_slope=0.05)
    solo = choose_k(0.95, cost, 8)
    assert choose_batch_k([0.95], [8], cost) == solo
    # a hopeless sequence beside a good one pulls the shared K down, never up
    mixed = choose_batch_k([0.95, 0.05], [8, 8], cost)
    assert 0 < mixed <= solo
    assert choose_batch_k([0.05, 0.05, 0.05], [8, 8, 8], cost) == 0
    assert choose_batch_k([0.99, 0.99], [2, 8], cost) >= 2           # caps bound each sequence, not the choice
    assert choose_batch_k([], [], cost) == 0


# ---- online step costs ----------------------------------------------------------------------------
def test_online_costs_price_k_with_what_the_steps_measured():
    from specbuild.engines.embedded.adaptive import OnlineCosts

    base = cost_models(CALIBRATION)["draft"]
    oc = OnlineCosts(min_samples=3, explore_every=4)
    assert oc.model(1, base) is base and not oc.wants_plain(1)      # nothing measured: the calibration
    for _ in range(3):
        oc.observe(1, 4, 4, t_propose=4 * 0.030, t_score=0.050)     # draft step 30 ms, verify of 5: 50 ms
    assert oc.wants_plain(1)                                        # drafting seen, no baseline yet
    assert oc.model(1, base) is base
    for _ in range(3):
        oc.observe(1, 0, 0, t_propose=0.0, t_score=0.040)          # plain step 40 ms
    m = oc.model(1, base)
    assert m.source == "online" and m.cost_ratio == pytest.approx(0.75)
    assert m.verify_overhead(4) == pytest.approx(0.25)               # one K: its level, the calibration's slope
    assert m.verify_overhead(8) - m.verify_overhead(4) == pytest.approx(4 * base.verify_slope)
    assert choose_k(0.96, m, 8) > 0 and choose_k(0.5, m, 8) == 0    # c 0.75: pays only at high acceptance
    assert oc.model(2, base) is base                                # per batch size
    for _ in range(3):
        oc.observe(1, 4, 4, 0.12, 0.05)
    assert not oc.wants_plain(1)
    oc.observe(1, 4, 4, 0.12, 0.05)
    assert oc.wants_plain(1)                                        # explore_every drafting steps: one plain
    oc.observe(1, 4, 4, t_propose=0.12, t_score=0.0)                # a fake clock: ignored
    assert oc.snapshot()[1]["plain_ms"] == pytest.approx(40.0)


def test_plain_steps_that_remeasure_the_baseline_space_out_as_the_predicted_gain_grows():
    """One step in explore_every runs plain near a gain of 1 (or when the gain is unknown); at 1.25x twice as far
    apart, at 1.5x and more four times: there the baseline would have to be off by half to flip the choice."""
    from specbuild.engines.embedded.adaptive import OnlineCosts, explore_spacing

    assert [explore_spacing(g) for g in (None, 0.8, 1.0, 1.24, 1.25, 1.49, 1.5, 3.0)] == [1, 1, 1, 1, 2, 2, 4, 4]
    oc = OnlineCosts(min_samples=3, explore_every=4)
    for _ in range(3):
        oc.observe(1, 4, 4, t_propose=0.12, t_score=0.05)
    assert oc.wants_plain(1, 3.0)                                   # the first samples: whatever the gain
    for _ in range(3):
        oc.observe(1, 0, 0, t_propose=0.0, t_score=0.04)
    due = {}
    for gain in (None, 1.1, 1.3, 2.0):
        oc.observe(1, 0, 0, t_propose=0.0, t_score=0.04)            # a plain step: the count starts over
        steps = 0
        while not oc.wants_plain(1, gain):
            oc.observe(1, 4, 4, t_propose=0.12, t_score=0.05)
            steps += 1
        due[gain] = steps
    assert due == {None: 4, 1.1: 4, 1.3: 8, 2.0: 16}


def test_the_planner_runs_fewer_plain_steps_where_drafting_is_predicted_to_pay_more():
    """Through KPlanner.plan, one adaptive sequence over 400 steps after the online costs are measured: with a
    cheap draft and an acceptance near 1 (predicted ~2x) one plain step after 4 x 16 drafting ones; with one that
    pays ~1.2x, after 16. The plain steps zero the K the sequence chose (its history says 0 for them)."""
    from types import SimpleNamespace

    from specbuild.engines.embedded.kplan import KPlanner

    def plain_steps(alpha: float, t_draft: float) -> int:
        kp = KPlanner(calibration=CALIBRATION, online_costs=True)
        tr = AcceptanceTracker(alpha, strength=1e9)                  # a fixed acceptance: nothing to learn
        s = SimpleNamespace(adaptive=tr, proposer="draft", num_draft_tokens=8, forced_k=False,
                            num_generated=0, params=SimpleNamespace(max_tokens=10_000))
        zeros = 0
        for step in range(440):
            [k], _ = kp.plan([s], Policy(k="adaptive"))
            assert tr.history[-1] == k
            if step >= 40:
                zeros += k == 0
            kp.observe(1, [s], [SimpleNamespace(token_ids=[0] * k)] if k else [None],
                       t_propose=k * t_draft, t_score=0.04 + 0.002 * k if k else 0.04)
        return zeros

    # a plain step after every 64 (16) drafting ones: one in 65 (17) steps
    assert plain_steps(0.99, 0.004) in range(400 // 65, 400 // 65 + 2)   # ~2x predicted: 6-7 plain steps
    assert plain_steps(0.5, 0.008) in range(400 // 17, 400 // 17 + 2)    # ~1.2x predicted: 23-24


def test_slow_verifies_at_a_k_no_longer_chosen_age_out_so_probes_can_turn_drafting_back_on():
    """A cold start's slow verifies at K 4 priced drafting out (K = 0). At K = 0 only K = 1 probes run, so K 4 is
    never measured again: without aging, its old median keeps the fitted verify line steep and adaptive K stays at
    0 although every probe is accepted and cheap (the demo's first 1-user policy cell drafted only probes)."""
    from specbuild.engines.embedded.adaptive import OnlineCosts

    base = cost_models(CALIBRATION)["draft"]
    oc = OnlineCosts(min_samples=3, stale_after=20)
    for _ in range(3):
        oc.observe(1, 4, 4, t_propose=4 * 0.012, t_score=0.200)     # cold: a verify of 5 at 5x a plain step
    for _ in range(3):
        oc.observe(1, 0, 0, t_propose=0.0, t_score=0.040)
    assert choose_k(0.9, oc.model(1, base), 8) == 0                  # priced out, as measured
    for _ in range(5):                                               # probes: K 1, verify 44 ms, draft 12 ms
        oc.observe(1, 1, 1, t_propose=0.012, t_score=0.044)
        for _ in range(3):
            oc.observe(1, 0, 0, t_propose=0.0, t_score=0.040)
    m = oc.model(1, base)                                            # 20 steps on: K 4's verifies are stale
    assert 4 not in oc.fresh_verify_keys(1) and oc.fresh_verify_keys(1) == [1]
    assert m.source == "online" and m.verify_overhead(1) == pytest.approx(0.1)
    assert choose_k(0.9, m, 8) > 0                                   # drafting is back on
    assert oc.verify_keys(1) == [1, 4]                               # kept (a fresh K 4 verify counts again)


def test_one_k_measured_online_does_not_price_every_k_at_its_cost():
    """At 4 sequences on an AMD EPYC Zen 4 the verify grows steeply past 12 rows (calibrated: K 1 / 2 / 4 / 8 at
    1.05 / 1.23 / 1.76 / 3.04 plain steps). After n-gram traffic had verified only K 1 there, the online line
    through that one K was flat, so K 8 looked as cheap as K 1 and adaptive K chose it (bench_adaptive's policy
    cell: K 8 and 5 at batch 4, 0.75-0.85x adaptive K). With the calibration's line where online has no spread,
    K 8 is priced near what it costs and the choice is K 2-5, where the measured optimum lies."""
    from specbuild.engines.embedded.adaptive import OnlineCosts

    cal = {**CALIBRATION, "by_concurrency": {"4": {"t_target_s": 0.0196, "t_draft_s": 0.0058, "t_verify_s": {
        "1": 0.0205, "2": 0.0242, "4": 0.0345, "8": 0.0596}}}}
    base = cost_models(cal, 4)["draft"]
    oc = OnlineCosts(min_samples=3)
    for _ in range(3):
        oc.observe(4, 0, 0, t_propose=0.0, t_score=0.0196)          # plain steps at 4 sequences
        oc.observe(4, 1, 1, t_propose=0.0058, t_score=0.0205)       # K 1 verifies only (n-gram or probes)
    m = oc.model(4, base)
    assert m.source == "online"
    assert m.verify_overhead(8) > 0.75 * (0.0596 / 0.0196 - 1)        # K 8 near its measured 2.04, not 0.05
    assert 2 <= choose_k(0.95, m, 8) <= 5
    for _ in range(3):                                               # a spread of Ks measured: online alone
        oc.observe(4, 3, 3, t_propose=3 * 0.0058, t_score=0.0290)
    assert oc.model(4, base).verify_overhead(3) == pytest.approx(0.0290 / 0.0196 - 1, rel=0.25)


def test_a_verify_is_filed_under_the_k_per_sequence_its_rows_cost_like():
    """An n-gram step where one of 4 sequences proposed 6 tokens scores 10 rows: it must not price K 6 at 4
    sequences (28 rows) for the draft's adaptive K."""
    from specbuild.engines.embedded.kplan import KPlanner, verify_width
    from specbuild.engines.embedded.proposers import Proposal

    assert verify_width(4, [6, 0, 0, 0]) == 2 and verify_width(4, [1, 0, 0, 0]) == 1
    assert verify_width(4, [0, 0, 0, 0]) == 0 and verify_width(1, [5]) == 5 and verify_width(3, [4, 4, 3]) == 4
    kp = KPlanner(calibration=CALIBRATION, online_costs=True)

    class S:
        proposer = "ngram"
    kp.observe(4, [S()] * 4, [Proposal([1] * 6), Proposal([]), Proposal([]), Proposal([])], 0.001, 0.021)
    assert kp.online.verify_keys(4) == [2]


def test_a_draft_that_is_slow_here_is_turned_off_by_measured_costs(tiny_llama, monkeypatch):
    """The calibration (absent here: c 0.3 by default) says drafting pays; the draft is made 20 ms slower per
    step than it was measured. With online costs adaptive K sees it and drafts (almost) nothing after the
    first steps; without, it keeps drafting. Output is the target's either way."""
    import time as _time

    outs = {}
    for online in (True, False):
        eng = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=2, max_seq_len=192,
                                      policy=Policy(), online_costs=online)
        from specbuild.engines.embedded import proposers

        real = proposers.ragged_forward            # every draft step (fused or eager) goes through it

        def slow(model, *a, _real=real, _draft=eng.draft, **kw):
            if model is _draft:
                _time.sleep(0.02)
            return _real(model, *a, **kw)
        monkeypatch.setattr(proposers, "ragged_forward", slow)
        params = SamplingParams(max_tokens=48, ignore_eos=True)
        plain = eng.generate(PROMPTS[0], params, num_draft_tokens=0).token_ids
        runs = [eng.generate(PROMPTS[0], params) for _ in range(2)]
        assert all(r.token_ids == plain for r in runs)
        outs[online] = runs[-1].stats.num_draft_tokens
        m = eng.metrics()
        if online:                                # what an operator sees: the measured c, well above 1
            assert m["draft_cost_source"] == "online" and m["draft_cost_ratio"] > 1.0 and m["target_step_ms"] > 0
        else:
            assert m["draft_cost_source"] == "defaults" and m["target_step_ms"] == 0.0
    assert outs[False] >= 30                    # priced by the default model: keeps drafting
    assert outs[True] <= 8                      # measured: a few probes at most
