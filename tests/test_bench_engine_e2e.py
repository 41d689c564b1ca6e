"""`bench_engine`'s end-to-end accounting: a request's head (prefill and first token) is not shortened by
speculation, so a decode speedup reaches the end to end only on the decode span (`e2e_model`)."""

from __future__ import annotations

import pytest

from bench_support import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_engine")


def test_a_decode_speedup_counts_only_on_the_decode_span(bench):
    # off: 0.3 s of prefill + 0.8 s decode; spec: the same prefill, decode at the predicted 2.5x (0.32 s)
    got = bench.e2e_model([(1.1, 0.8)], [(0.62, 0.32)], predicted_decode=2.5)
    assert got["predicted_e2e"] == pytest.approx(1.1 / 0.62)        # = the measured one: efficiency 1
    assert got["ceiling"] == pytest.approx(1.1 / 0.3)               # decode free: only the prefill left
    assert got["decode_needed"] == pytest.approx(0.8 / (1.1 / 2 - 0.3))    # 3.2x decode for 2.0x end to end
    assert got["head_share"] == pytest.approx(0.3 / 1.1)


def test_a_goal_the_prefill_alone_exceeds_is_unreachable_not_infinite(bench):
    # a 0.6 s prefill in a 1.0 s plain request: 2.0x end to end would need the whole request in 0.5 s
    got = bench.e2e_model([(1.0, 0.4), (1.0, 0.4)], [(0.7, 0.1), (0.7, 0.1)], predicted_decode=4.0)
    assert got["decode_needed"] is None and got["ceiling"] == pytest.approx(1.0 / 0.6)
    assert bench._x(got["decode_needed"]) == "unreachable"
