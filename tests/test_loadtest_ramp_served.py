"""A served ramp: `specbuild loadtest --sweep users=1,2 --ramp` against a real tritonserver serving the tiny embedded
deployment built with a cut-off of 1 (`spec_max_concurrency=1`): the report lists the points in ramp order (1, 2,
1) with the policy's decision at each, read from the server's own counters."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cut_off_at_one(tmp_path_factory, tiny_llama, tiny_llama_draft):
    from servers import ServerHandle, serve_options

    from specbuild.pipeline import serve
    from specbuild.pipeline.build import build
    from specbuild.pipeline.convert import convert
    from specbuild.pipeline.deploy import deploy

    workdir = tmp_path_factory.mktemp("ramp-served")
    convert(str(tiny_llama), str(tiny_llama), workdir=workdir)          # a self-draft: every draft is accepted
    build(workdir=workdir, max_batch_size=4, max_seq_len=512, max_draft_len=4, num_draft_tokens=3,
          spec_max_concurrency=1, calibrate=False)
    deploy(workdir=workdir)
    opts = serve_options()
    handle = ServerHandle(workdir, opts, serve.start(workdir, opts))
    yield handle
    handle.stop()


def test_a_ramp_lists_its_points_in_time_order_with_the_policy_decision(cut_off_at_one, tmp_path):
    srv, out = cut_off_at_one, tmp_path / "report"
    r = CliRunner().invoke(cli, ["loadtest", "--workdir", str(srv.workdir), "--url", srv.http_url,
                                 "--grpc-url", srv.grpc_url, "--metrics-url", srv.metrics_url, "--profile", "batch",
                                 "--sweep", "users=1,2", "--ramp", "--duration", "3", "--min-requests", "4",
                                 "--max-tokens", "24", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "report.json").read_text())
    assert data["sweep"]["batch"] == {"param": "users", "values": [1, 2, 1], "ramp": True}
    [ramp] = data["ramp"]
    assert ramp["cutoff"] == 1
    assert [(p["step"], p["value"]) for p in ramp["points"]] == [(0, 1), (1, 2), (2, 1)]
    assert [p["side"] for p in ramp["points"]] == ["within", "over", "within"]
    decisions = [p["policy"]["decision"] for p in ramp["points"]]
    assert decisions[0] == decisions[2] == "drafts"          # one user: the policy drafts
    assert ramp["points"][0]["policy"]["draft_tokens_per_step"] > 0
    assert ramp["points"][1]["policy"]["cutoff_share"] > 0    # two users: steps over the cut-off, plain
    assert [x["direction"] for x in ramp["crossings"]] == ["up", "down"]
    md = (out / "report.md").read_text()
    assert "## Ramp: the load over time" in md and "| 1 | 2 | over |" in md
    assert [c["run_dir"] for c in data["cells"]] == [f"runs/batch/{i:02d}-users-{u}/default"
                                                     for i, u in enumerate((1, 2, 1))]
