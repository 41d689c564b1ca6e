"""The deployment's default speculation policy behind the real tritonserver, on a build WITH calibration (the
default build: adaptive K and the measured crossover cut-off), and what `specbuild tune --apply` changes.

The tiny int8 self-draft is measured on whatever machine runs the tests, so the cut-off the build writes is
not known in advance: each check follows from the policy the build wrote, never from a speed.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from click.testing import CliRunner

from servers import ServerHandle, serve_options
from specbuild.cli.main import cli
from specbuild.engines.embedded.config import EngineConfig
from specbuild.core import contract
from specbuild.pipeline import serve
from specbuild.pipeline.client import Client, metric, parse_metrics

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox"
CONCURRENT = 3


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, tiny_llama):
    from specbuild.pipeline.build import build
    from specbuild.pipeline.convert import convert
    from specbuild.pipeline.deploy import deploy

    wd = tmp_path_factory.mktemp("policy-served")
    convert(str(tiny_llama), str(tiny_llama), workdir=wd)
    build(workdir=wd, draft_quantize="int8", max_batch_size=4, max_seq_len=256, max_draft_len=4)   # calibrated
    deploy(workdir=wd)
    opts = serve_options()
    handle = ServerHandle(wd, opts, serve.start(wd, opts))
    try:
        yield handle
    finally:
        handle.stop()


def _client(srv) -> Client:
    return Client(srv.http_url, srv.grpc_url, model=contract.SPECULATIVE_MODEL, timeout=120)


def _cutoff_steps(srv) -> float:
    return metric(parse_metrics(httpx.get(srv.metrics_url, timeout=10).text), "specbuild_spec_cutoff_steps_total")


def _concurrent_defaults(srv, n: int, tokens: int = 48) -> list:
    """n requests that leave K to the deployment, in flight together: their clients are made first and released at
    once by a barrier (a tiny model's request can finish before the next thread has built its client: under
    `slowbox -f 2` three threads ran one at a time and no step ever held more than one sequence)."""
    out: list = [None] * n
    clients = [_client(srv) for _ in range(n)]
    go = threading.Barrier(n)

    def one(i):
        go.wait(60)
        out[i] = clients[i].generate(PROMPT, max_tokens=tokens, min_tokens=tokens, return_perf_metrics=True)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(g is not None for g in out)
    return out


def test_the_calibrated_default_policy_is_what_the_server_runs(calibrated):
    policy = EngineConfig.load(calibrated.workdir / "engines").policy
    assert policy.adaptive and policy.proposer == "draft" and policy.source == "build: calibrated, measured cut-off"
    loaded = httpx.get(f"{calibrated.http_url}/v2/models/tensorrt_llm/config", headers=calibrated.info.admin_headers,
                       timeout=30).json()["parameters"]
    assert "policy" not in loaded                                    # engine_config.json's policy: its one home
    one = _client(calibrated).generate(PROMPT, max_tokens=160, min_tokens=160, return_perf_metrics=True)
    if policy.max_concurrency == 0:
        assert one.total_draft_tokens == 0                           # measured: never pays here, never drafted
    else:                                                            # adaptive K drafts (at least its probes)
        assert one.total_draft_tokens > 0 and one.total_accepted_draft_tokens > 0
    before = _cutoff_steps(calibrated)
    outs = _concurrent_defaults(calibrated, CONCURRENT, tokens=160)
    moved = _cutoff_steps(calibrated) - before
    peak = metric(parse_metrics(httpx.get(calibrated.metrics_url, timeout=10).text), "specbuild_max_running_requests")
    assert peak >= 2, "the concurrent requests never overlapped in the engine: the check below would mean nothing"
    if policy.max_concurrency is not None and policy.max_concurrency < peak:
        assert moved > 0                                             # more running than the cut-off: plain steps
    elif policy.max_concurrency is not None and policy.max_concurrency < CONCURRENT:
        pass                                                         # overlapped, never above the cut-off
    else:
        assert moved == 0
    forced = _client(calibrated).generate(PROMPT, max_tokens=48, min_tokens=48, num_draft_tokens=2,
                                          return_perf_metrics=True)
    assert forced.total_draft_tokens > 0                             # a request's own K > 0 always drafts
    assert all(o.text == outs[0].text == one.text for o in outs)     # lossless whatever the policy did


def test_tune_apply_changes_what_a_default_request_gets(calibrated, tmp_path):
    """Runs after the test above, on the same server: the build's adaptive policy (with its measured cut-off) is
    replaced by what tune measured, and a re-deploy before the restart keeps it."""
    from specbuild.pipeline.deploy import deploy

    res = CliRunner().invoke(cli, ["tune", "--workdir", str(calibrated.workdir), "--url", calibrated.http_url,
                                   "--metrics-url", calibrated.metrics_url, "--profile", "chat", "--k", "2",
                                   "--proposer", "draft", "--duration", "2", "--users", "1", "--max-tokens", "8",
                                   "--out", str(tmp_path / "tune"), "--apply"])
    assert res.exit_code == 0, res.output
    applied = json.loads((tmp_path / "tune" / "tune.json").read_text())["applied"]["policy"]
    assert (applied["k"], applied["proposer"], applied["max_concurrency"]) == (2, "draft", None)
    assert EngineConfig.load(calibrated.workdir / "engines").policy.k == 2
    calibrated.stop()
    deploy(workdir=calibrated.workdir, force=True)                    # a re-deploy: the tuned policy stays
    calibrated.restart()
    # A request that sends no K now gets exactly what tune measured: K = 2 with the draft at any concurrency,
    # the same drafts as a request that sends K = 2 itself.
    default = _client(calibrated).generate(PROMPT, max_tokens=24, min_tokens=24, return_perf_metrics=True)
    explicit = _client(calibrated).generate(PROMPT, max_tokens=24, min_tokens=24, num_draft_tokens=2,
                                            return_perf_metrics=True)
    assert default.text == explicit.text
    assert (default.total_draft_tokens, default.total_accepted_draft_tokens) == \
        (explicit.total_draft_tokens, explicit.total_accepted_draft_tokens) and default.total_draft_tokens > 0
    before = _cutoff_steps(calibrated)
    outs = _concurrent_defaults(calibrated, CONCURRENT, tokens=24)
    assert _cutoff_steps(calibrated) == before                       # no cut-off any more
    assert all(o.total_draft_tokens > 0 for o in outs)
