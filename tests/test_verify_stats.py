"""The statistics behind `specbuild verify` (pure functions; the end-to-end check runs against a real server)."""

import random
from collections import Counter

import pytest

from specbuild.core.errors import UsageError
from specbuild.pipeline.verify import chi2_sf, first_divergence, homogeneity_test, load_prompts, verify_sampling


def test_chi2_sf_known_quantiles():
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(11.070, 5) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(0.0, 3) == pytest.approx(1.0)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def _draw(rng, weights, n):
    return Counter(rng.choices(range(len(weights)), weights=weights, k=n))


def test_false_alarm_rate_under_the_null_is_near_alpha():
    rng = random.Random(1)
    w = [8, 5, 3, 2, 1, 1, 0.5, 0.2]
    trials, alpha = 400, 0.05
    alarms = sum(homogeneity_test(_draw(rng, w, 300), _draw(rng, w, 300))[2] < alpha for _ in range(trials))
    # Binomial(400, 0.05): mean 20, sd ~4.4. A broken test (always/never alarming) lands far outside.
    assert 5 <= alarms <= 40


def test_detects_a_shifted_distribution():
    rng = random.Random(2)
    p = homogeneity_test(_draw(rng, [5, 4, 3, 2, 1], 300), _draw(rng, [3, 3, 3, 3, 3], 300))[2]
    assert p < 1e-6


def test_rare_categories_are_pooled():
    a = Counter({0: 100, 1: 100, 2: 1, 3: 1})
    b = Counter({0: 100, 1: 100, 4: 2})
    stat, dof, p, cats = homogeneity_test(a, b)
    assert cats == 3 and dof == 2 and p > 0.5


def test_sampling_check_flags_a_biased_generator_and_passes_a_fair_one():
    rng_state = {}

    def gen(lossy):
        def generate(prompt, *, num_draft_tokens, max_tokens, temperature, top_k, top_p, seed):
            rng = random.Random(seed * 1000 + (num_draft_tokens if lossy else 0) + rng_state.setdefault("salt", 7))
            weights = [6, 3, 1] if (lossy and num_draft_tokens) else [3, 3, 3]
            return " ".join(rng.choices("abc", weights=weights, k=max_tokens))
        return generate

    tokenize = lambda text: [ord(c) for c in text.split()]  # noqa: E731
    fair = verify_sampling(gen(False), tokenize, "p", num_draft_tokens=4, seeds=200, positions=3,
                           temperature=1.0, concurrency=1)
    assert not fair.drift
    biased = verify_sampling(gen(True), tokenize, "p", num_draft_tokens=4, seeds=200, positions=3,
                             temperature=1.0, concurrency=1)
    assert biased.drift and min(t.p_value for t in biased.positions) < biased.threshold
    with pytest.raises(UsageError):
        verify_sampling(gen(False), tokenize, "p", num_draft_tokens=4, seeds=10, positions=3, temperature=1.0)


def test_load_prompts_formats(tmp_path):
    (tmp_path / "a.json").write_text('["x", "y"]')
    (tmp_path / "b.jsonl").write_text('{"prompt": "x"}\n{"prompt": "y"}\n')
    (tmp_path / "c.txt").write_text("x\n\ny\n")
    for name in ("a.json", "b.jsonl", "c.txt"):
        assert load_prompts(tmp_path / name) == ["x", "y"]
    with pytest.raises(UsageError):
        load_prompts(tmp_path / "missing.txt")


@pytest.mark.parametrize("concurrency", [1, 4])
def test_progress_reports_every_request_of_each_phase_in_order(concurrency):
    from specbuild.pipeline.verify import verify

    def generate(prompt, *, num_draft_tokens, max_tokens, temperature, top_k, top_p, seed):
        rng = random.Random(seed or 0)
        return " ".join(rng.choice("abc") for _ in range(max_tokens))

    seen = []
    report = verify(generate, lambda t: [ord(c) for c in t.split()], prompts=["p1", "p2", "p3"],
                    num_draft_tokens=2, max_tokens=3, sampling_seeds=50, positions=2, concurrency=concurrency,
                    progress=lambda phase, done, total: seen.append((phase, done, total)))
    assert report.ok
    greedy = [s for s in seen if s[0] == "greedy"]
    sampling = [s for s in seen if s[0] == "sampling"]
    assert greedy == [("greedy", i, 6) for i in range(7)]          # 3 prompts x (K, 0), from 0 of 6 to 6 of 6
    assert sampling == [("sampling", i, 100) for i in range(101)]   # 50 seeds x (K, 0)
    assert seen.index(greedy[-1]) < seen.index(sampling[0])
