"""The embedded-only `proposer` input: one deployment serves speculation off / draft model / n-gram."""

import pytest

from specbuild.pipeline.client import Client, RequestError
from specbuild.core.contract import SPECULATIVE_MODEL

pytestmark = pytest.mark.server          # starts a real tritonserver

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


@pytest.fixture(scope="module")
def bls(running_server):
    return Client(running_server.http_url, running_server.grpc_url, model=SPECULATIVE_MODEL)


def test_draft_and_ngram_proposers_are_lossless_and_report_their_drafts(bls):
    plain = bls.generate(PROMPT, max_tokens=24, num_draft_tokens=0, return_perf_metrics=True)
    assert plain.total_draft_tokens == 0
    for proposer in ("draft", "ngram"):
        body = dict(max_tokens=24, num_draft_tokens=3, return_perf_metrics=True)
        gen = bls.generate(PROMPT, proposer=proposer, **body)
        assert gen.text == plain.text, proposer
        assert gen.total_draft_tokens > 0, proposer


def test_unknown_proposer_is_refused(bls):
    with pytest.raises(RequestError, match=r"proposer 'medusa' is unknown; use one of \('draft', 'ngram'\)"):
        bls.generate(PROMPT, proposer="medusa", max_tokens=4, num_draft_tokens=2)
