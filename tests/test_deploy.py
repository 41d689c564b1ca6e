"""`specbuild deploy` (embedded): the rendered repository, its configs (Triton's protobuf), the stage
behaviour (no-op, force, dry-run, refusals) and the perf-metric outputs of the engine model."""

from __future__ import annotations

import json
import py_compile

import numpy as np
import pytest
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from specbuild.core import contract
from specbuild.pipeline.deploy import deploy
from specbuild.engines.embedded.deploy import render
from specbuild.core.errors import ManifestError, UsageError
from specbuild.model_repository.embedded.request_params import perf_metrics


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llama, tiny_llama_draft):
    """A workdir with checkpoints/ and engines/ (no deploy yet)."""
    from specbuild.pipeline.build import build
    from specbuild.pipeline.convert import convert

    wd = tmp_path_factory.mktemp("deploy")
    convert(str(tiny_llama), str(tiny_llama_draft), workdir=wd)
    build(workdir=wd, max_batch_size=4, max_seq_len=128, max_draft_len=4, calibrate=False)
    return wd


def test_rendered_configs_parse_and_keep_the_contract(tmp_path):
    files = render(tmp_path / "engines", {"max_batch_size": 32, "device": "cpu", "threads": 2})
    assert set(files) == {f"{m}/{f}" for m in ("tensorrt_llm", "ensemble", "tensorrt_llm_bls")
                          for f in ("config.pbtxt", "1/model.py")}
    for model in contract.CLIENT_MODELS:
        cfg = parse(files[f"{model}/config.pbtxt"])
        assert cfg.name == model and cfg.backend == "python" and cfg.max_batch_size == 32
        assert cfg.model_transaction_policy.decoupled
        assert contract.contract_mismatches(model, cfg.input, cfg.output) == []
        names = {i.name for i in cfg.input}
        assert ("num_draft_tokens" in names) == (model == contract.SPECULATIVE_MODEL)
        required = {i.name for i in cfg.input if not i.optional}
        assert required == {"text_input", "max_tokens"}
        assert "min_length" in names  # GenAI-Perf sends it
    engine = parse(files["tensorrt_llm/config.pbtxt"])
    assert engine.model_transaction_policy.decoupled
    assert [(g.count, g.kind) for g in engine.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_CPU)]
    assert all(i.optional for i in engine.input)
    # the whole client contract (it serves requests like the client-facing models); no internal inputs any more
    assert {"text_input", "max_tokens", "num_draft_tokens", "proposer"} <= {i.name for i in engine.input}
    assert not {"request_key", "abort"} & {i.name for i in engine.input}
    params = {k: v.string_value for k, v in engine.parameters.items()}
    assert params == {"engine_dir": str((tmp_path / "engines").resolve()), "device": "cpu", "threads": "2",
                      "max_queue_size": "", "queue_timeout_s": "", "request_timeout_s": ""}
    # no policy parameter (engine_config.json is the policy's one home); the client models take no parameters
    assert not [m for m in ("ensemble", "tensorrt_llm_bls") if parse(files[f"{m}/config.pbtxt"]).parameters]
    default = parse(render(tmp_path / "engines", {"max_batch_size": 8, "device": "", "threads": 0})
                    ["tensorrt_llm/config.pbtxt"])
    assert default.parameters["device"].string_value == ""  # the engine runs where it was built
    for rel, text in files.items():
        if rel.endswith(".py"):
            path = tmp_path / rel.replace("/", "_")
            path.write_text(text)
            py_compile.compile(str(path), doraise=True)


def test_deploy_stage(built):
    out = deploy(workdir=built)
    assert not out.skipped
    repo = built / "model_repository"
    assert out.out_dir == repo
    for model in ("tensorrt_llm", "ensemble", "tensorrt_llm_bls"):
        assert (repo / model / "config.pbtxt").is_file() and (repo / model / "1" / "model.py").is_file()
    manifest = json.loads((repo / "manifest.json").read_text())
    assert manifest["stage"] == "deploy" and manifest["options"]["backend"] == "embedded"
    assert {c["name"] for c in manifest["checks"]} == {"config:tensorrt_llm", "config:ensemble",
                                                       "config:tensorrt_llm_bls"}
    engine = parse((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    assert engine.parameters["engine_dir"].string_value == str((built / "engines").resolve())
    assert deploy(workdir=built).skipped                         # unchanged: no-op
    assert not deploy(workdir=built, threads=2).skipped          # changed option: re-rendered
    assert parse((repo / "tensorrt_llm" / "config.pbtxt").read_text()).parameters["threads"].string_value == "2"
    assert not deploy(workdir=built, threads=2, force=True).skipped


def test_outputs_are_readable_by_a_server_of_another_uid(built):
    """Under the usual umask 022, manifest.json, every config.pbtxt and model.py come out 0644 (and their
    directories 0755): a tritonserver running as another user can read them. mkstemp's 0600 stayed before."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        deploy(workdir=built, force=True)
    finally:
        os.umask(old)
    repo = built / "model_repository"
    files = [p for p in repo.rglob("*") if p.is_file()]
    assert repo / "manifest.json" in files and repo / "tensorrt_llm" / "config.pbtxt" in files
    modes = {str(p.relative_to(repo)): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert {k: oct(m) for k, m in modes.items() if m & 0o044 != 0o044} == {}
    assert all(stat.S_IMODE(d.stat().st_mode) & 0o055 == 0o055 for d in [repo, *repo.rglob("*")] if d.is_dir())
    assert stat.S_IMODE((built / "checkpoints" / "manifest.json").stat().st_mode) & 0o044 == 0o044


def test_deploy_dry_run_writes_nothing(built, tmp_path):
    before = sorted(p.name for p in built.iterdir())
    out = deploy(workdir=built, max_batch_size=8, dry_run=True)
    rendered = "\n".join(s.render() for s in out.plan)
    assert "--- write" in rendered and "tensorrt_llm/config.pbtxt" in rendered and "max_batch_size: 8" in rendered
    assert sorted(p.name for p in built.iterdir()) == before


def test_deploy_refusals(built, tmp_path):
    with pytest.raises(ManifestError, match="specbuild build"):
        deploy(workdir=tmp_path)
    assert not (tmp_path / "model_repository").exists()
    with pytest.raises(UsageError, match="--device"):
        deploy(workdir=built, device="tpu", force=True)
    with pytest.raises(UsageError, match="--max-batch-size"):
        deploy(workdir=built, max_batch_size=0, force=True)
    # the refused runs left the previous repository intact
    assert (built / "model_repository" / "manifest.json").is_file()


def test_deploy_cli(built):
    from specbuild.cli.main import cli

    runner = CliRunner()
    res = runner.invoke(cli, ["deploy", "--workdir", str(built), "--dry-run"])
    assert res.exit_code == 0 and "ensemble/config.pbtxt" in res.output
    res = runner.invoke(cli, ["deploy", "--workdir", str(built), "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "models: tensorrt_llm, ensemble, tensorrt_llm_bls" in res.output
    res = runner.invoke(cli, ["deploy", "--workdir", str(built), "--device", "tpu"])
    assert res.exit_code == 2 and "--device" in res.output
    # admission limits: the flags the engine's messages name exist, and land in the engine model's parameters
    res = runner.invoke(cli, ["deploy", "--workdir", str(built), "--max-queue-size", "5", "--queue-timeout", "30",
                              "--request-timeout", "0"])
    assert res.exit_code == 0, res.output
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    cfg = text_format.Parse((built / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text(),
                            model_config_pb2.ModelConfig())
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert (params["max_queue_size"], params["queue_timeout_s"], params["request_timeout_s"]) == ("5", "30.0", "0.0")
    res = runner.invoke(cli, ["deploy", "--workdir", str(built), "--backend", "trtllm", "--request-timeout", "9",
                              "--dry-run"])
    assert res.exit_code == 2 and "apply to --backend embedded only" in res.output


# ---- perf-metric outputs of the engine model (request parsing: tests/test_frontend.py) -----------------

def test_perf_metrics():
    class S:
        num_draft_tokens, num_accepted_tokens = 8, 6
    out = perf_metrics(S())
    assert out["acceptance_rate"].dtype == np.float32 and out["acceptance_rate"][0, 0] == pytest.approx(0.75)
    assert out["total_draft_tokens"][0, 0] == 8 and out["total_accepted_draft_tokens"][0, 0] == 6
    assert perf_metrics(None)["acceptance_rate"][0, 0] == 0.0
