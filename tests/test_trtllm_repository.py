"""The generated Triton repository: every config.pbtxt parses with tritonclient's protobuf, holds the
required values, the ensemble is consistent, each family matches the version table (upstream_facts.json,
read from the tensorrtllm_backend tags) exactly, and the table matches a tag checkout when one is given
($SPECBUILD_TRTLLM_BACKEND_DIR)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from trtllm_support import context, written

from specbuild.core.contract import (CLIENT_INPUTS, CLIENT_OUTPUTS, ENSEMBLE_MODEL, SPECULATIVE_MODEL, TensorSpec,
                                contract_mismatches, inputs_for)
from specbuild.engines.trtllm import deploy
from specbuild.core import upstream_facts
from specbuild.engines.trtllm.repository import ensemble_problems, render, template, upstream_mismatches
from specbuild.core.errors import SpecbuildError, UsageError

PARAM_UNSET = "${"   # a parameter deploy does not set keeps upstream's literal placeholder (fill_template)


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def params(cfg) -> dict[str, str]:
    """The parameters deploy set (unset ones keep upstream's literal ${...})."""
    return {k: v.string_value for k, v in cfg.parameters.items() if not v.string_value.startswith(PARAM_UNSET)}


def repo_configs(tmp_path, options) -> dict[str, model_config_pb2.ModelConfig]:
    files = written(deploy.plan(context("deploy", tmp_path, options)))
    configs = {}
    for path, text in files.items():
        if path.endswith("config.pbtxt"):
            outside = [ln for ln in text.splitlines() if "${" in ln and not ln.startswith("parameters:")]
            assert not outside, f"structural placeholder left in {path}: {outside}"
            cfg = parse(text)
            assert Path(path).parent.name == cfg.name
            configs[cfg.name] = cfg
    return configs


@pytest.fixture
def opts(tiny_llama, tiny_llama_draft):
    # The 0.18 recipe (the default pin before 1.2.1): these tests keep its guarantees; the 0.20 .. 1.2.x
    # families have their own tests (test_trtllm_families.py).
    return {"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft), "trtllm_version": "0.18.0"}


def test_engine_repository_has_the_six_models_and_a_consistent_ensemble(tmp_path, opts):
    configs = repo_configs(tmp_path, opts)
    assert sorted(configs) == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls",
                               "tensorrt_llm_draft"]
    assert ensemble_problems(configs) == []
    assert [s.model_name for s in configs["ensemble"].ensemble_scheduling.step] == [
        "preprocessing", "tensorrt_llm", "postprocessing"]


def test_engine_models_hold_every_required_parameter(tmp_path, opts):
    configs = repo_configs(tmp_path, {**opts, "max_batch_size": 4})
    engines = (tmp_path / "engines").resolve()
    for name, role, frac in (("tensorrt_llm", "target", "0.5"), ("tensorrt_llm_draft", "draft", "0.2")):
        cfg = configs[name]
        p = params(cfg)
        assert cfg.backend == "tensorrtllm" and cfg.max_batch_size == 4
        assert cfg.model_transaction_policy.decoupled is False
        assert p["gpt_model_path"] == str(engines / role)
        assert p["gpt_model_type"] == "inflight_fused_batching"
        assert p["kv_cache_free_gpu_mem_fraction"] == frac      # two models on GPU 0
        assert p["enable_kv_cache_reuse"] == "true"
        assert p["exclude_input_in_output"] == "false"      # upstream DTM recipe; clients send it per request
        assert p["gpu_device_ids"] == "0"
        assert p["max_beam_width"] == "1"
        assert "participant_ids" not in p and "speculative_decoding_fast_logits" not in p
        names = {t.name for t in cfg.input}
        assert {"draft_input_ids", "draft_logits", "input_ids", "request_output_len"} <= names
    bls = {k: v.string_value for k, v in configs["tensorrt_llm_bls"].parameters.items()}
    assert bls == {"accumulate_tokens": "false", "tensorrt_llm_model_name": "tensorrt_llm",
                   "tensorrt_llm_draft_model_name": "tensorrt_llm_draft", "multimodal_encoders_name": ""}
    assert configs["tensorrt_llm_bls"].model_transaction_policy.decoupled is False
    assert configs["tensorrt_llm_bls"].instance_group[0].count == 4
    tok = str((tmp_path / "model_repository" / "tokenizer").resolve())
    assert params(configs["preprocessing"])["tokenizer_dir"] == tok
    assert params(configs["postprocessing"])["tokenizer_dir"] == tok


def test_separate_gpus_use_full_fractions_and_fast_logits_set_participants(tmp_path, opts):
    configs = repo_configs(tmp_path, {**opts, "target_gpu_ids": "1,2", "draft_gpu_ids": "0", "tp": 2,
                                      "draft_tp": 1, "fast_logits": True})
    t, d = params(configs["tensorrt_llm"]), params(configs["tensorrt_llm_draft"])
    assert (t["kv_cache_free_gpu_mem_fraction"], d["kv_cache_free_gpu_mem_fraction"]) == ("0.9", "0.9")
    assert (t["gpu_device_ids"], d["gpu_device_ids"]) == ("1,2", "0")
    assert (d["participant_ids"], t["participant_ids"]) == ("1", "2,3")
    assert t["speculative_decoding_fast_logits"] == d["speculative_decoding_fast_logits"] == "1"


@pytest.mark.parametrize("version", ["0.18.0", "0.19.0"])
@pytest.mark.parametrize("model", [ENSEMBLE_MODEL, SPECULATIVE_MODEL])
def test_client_facing_inputs_per_release(tmp_path, opts, model, version):
    extra = {} if version.startswith("0.18") else {"container_tag": "example.invalid/x:1"}
    cfg = repo_configs(tmp_path, {**opts, "trtllm_version": version, **extra})[model]
    declared = {t.name for t in cfg.input}
    # v0.18 / v0.19 call them random_seed and min_length (seed / min_tokens are later names)
    assert {"text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "random_seed", "end_id",
            "stop_words", "min_length", "exclude_input_in_output"} <= declared
    assert not {"seed", "min_tokens"} & declared
    assert ("return_perf_metrics" in declared) == version.startswith("0.19")
    outs = {t.name for t in cfg.output}
    assert ({"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"} <= outs) == \
        version.startswith("0.19")
    assert not {"acceptance_rate", "total_draft_tokens"} & outs or version.startswith("0.19")
    assert ("num_draft_tokens" in declared) == (model == SPECULATIVE_MODEL)


def test_contract_mismatches_catch_a_drifted_config():
    drifted = [t for t in inputs_for(SPECULATIVE_MODEL) if t.name != "num_draft_tokens"]
    drifted = [TensorSpec("max_tokens", "TYPE_INT64", (1,), optional=False) if t.name == "max_tokens" else t
               for t in drifted]
    problems = contract_mismatches(SPECULATIVE_MODEL, drifted, CLIENT_OUTPUTS[:1])
    assert any("missing input 'num_draft_tokens'" in p for p in problems)
    assert any("'max_tokens' is TYPE_INT64" in p for p in problems)
    assert any("missing output 'acceptance_rate'" in p for p in problems)
    assert {t.name for t in CLIENT_INPUTS} >= {"num_draft_tokens", "return_perf_metrics"}
    assert next(t for t in CLIENT_INPUTS if t.name == "text_input").datatype == "BYTES"


def test_ensemble_check_reports_broken_wiring(tmp_path, opts):
    configs = repo_configs(tmp_path, opts)
    broken = model_config_pb2.ModelConfig()
    broken.CopyFrom(configs["ensemble"])
    step = broken.ensemble_scheduling.step[1]
    del step.input_map["request_output_len"]   # input_ids is optional upstream (encoder inputs)
    step.input_map["runtime_top_k"] = "temperature"
    problems = ensemble_problems({**configs, "ensemble": broken})
    assert "tensorrt_llm required input 'request_output_len' is not mapped" in problems
    assert "tensorrt_llm.runtime_top_k dtype differs from 'temperature'" in problems
    assert "ensemble input 'top_k' is never used" in problems


def test_llmapi_repository_parses_and_carries_perf_metric_outputs(tmp_path, opts):
    configs = repo_configs(tmp_path, {**opts, "trtllm_version": "1.0.0"})
    cfg = configs["tensorrt_llm"]
    assert cfg.backend == "python"
    assert {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "text_output"} <= {
        t.name for t in cfg.output}


def test_render_refuses_missing_values():
    with pytest.raises(SpecbuildError, match="needs values for"):
        render(upstream_facts.packaged_template("0.18", "postprocessing"), {"triton_max_batch_size": 1},
               keep_unset_parameters=True)


FAMILY_VERSIONS = {"0.18": "0.18.0", "0.19": "0.19.0", "0.20": "0.20.0", "0.21": "0.21.0", "1.0": "1.0.0",
                   "1.1": "1.1.0", "1.2": "1.2.1"}


@pytest.mark.parametrize("family", sorted(upstream_facts.families()))
def test_templates_are_the_version_table(family):
    for model in upstream_facts.MODELS:
        text = upstream_facts.packaged_template(family, model).replace("${model_name}", "tensorrt_llm")
        assert upstream_facts.extract_model(text) == upstream_facts.model_facts(family, model), model
        assert upstream_facts.template_text(family, model) == upstream_facts.packaged_template(family, model)


@pytest.mark.parametrize("family", sorted(upstream_facts.families()))
def test_generated_configs_match_the_version_table_exactly(tmp_path, opts, family):
    version = FAMILY_VERSIONS[family]
    extra = {"trtllm_generation": "engine"} if family != "0.19" else {"container_tag": "example.invalid/x:1"}
    files = written(deploy.plan(context("deploy", tmp_path, {**opts, "trtllm_version": version, **extra})))
    for path, text in files.items():
        if not path.endswith("config.pbtxt"):
            continue
        model = Path(path).parent.name
        table_model = "tensorrt_llm" if model == "tensorrt_llm_draft" else model
        mine = upstream_facts.extract_model(text)
        want = upstream_facts.model_facts(family, table_model)
        for kind in ("inputs", "outputs"):
            got = [{k: v for k, v in t.items()} for t in mine[kind]]
            exp = [{k: v for k, v in t.items() if not (k == "data_type" and str(v).startswith("${"))}
                   for t in want[kind]]
            got = [{k: v for k, v in t.items() if k != "data_type" or k in e} for t, e in zip(got, exp)]
            assert got == exp, (model, kind)
        assert set(mine["parameters"]) == set(want["parameters"]), model
        assert upstream_mismatches(text, upstream_facts.template_text(family, table_model)) == [], model


def test_v018_defects_are_fixed(tmp_path, opts):
    configs = repo_configs(tmp_path, {**opts, "trtllm_version": "0.18.0"})
    trt = {t.name for t in configs["tensorrt_llm"].input}
    assert "min_length" in trt and "min_tokens" not in trt          # the BLS sends min_length to draft calls
    assert "random_seed" in trt and "seed" not in trt
    pre = configs["preprocessing"].parameters
    assert "visual_model_path" in pre and "multimodal_model_path" not in pre   # v0.18 model.py reads it
    assert "return_perf_metrics" not in {t.name for t in configs["tensorrt_llm_bls"].input}
    assert configs["tensorrt_llm"].parameters["exclude_input_in_output"].string_value == "false"
    p19 = repo_configs(tmp_path / "b", {**opts, "trtllm_version": "0.19.0",
                                        "container_tag": "example.invalid/x:1"})["preprocessing"].parameters
    assert "multimodal_model_path" in p19 and "visual_model_path" not in p19


def test_version_outside_the_table_is_refused_unless_forced(tmp_path, opts):
    with pytest.raises(UsageError, match=r"not in the version table.*0\.18\.0, 0\.18\.1, 0\.18\.2, 0\.19\.0"):
        deploy.plan(context("deploy", tmp_path, {**opts, "trtllm_version": "0.17.0", "container_tag": "x/y:1"}))
    steps = deploy.plan(context("deploy", tmp_path, {**opts, "trtllm_version": "0.17.0", "container_tag": "x/y:1",
                                                     "force_version": True}))
    assert any("not in the version table" in (s.note or "") and "backend-0.18" in (s.note or "") for s in steps)


def test_upstream_mismatch_compares_tensors_parameters_and_tensorrt_llm(tmp_path, opts):
    files = written(deploy.plan(context("deploy", tmp_path, opts)))
    by_model = {Path(p).parent.name: t for p, t in files.items() if p.endswith("config.pbtxt")}
    # v0.19 templates have numeric placeholders everywhere; the comparison never substitutes into them
    theirs19 = upstream_facts.template_text("0.19", "tensorrt_llm")
    problems = upstream_mismatches(by_model["tensorrt_llm"], theirs19)
    assert "tensorrt_llm: input 'return_perf_metrics' missing" in problems
    assert "tensorrt_llm: parameter 'num_nodes' missing" in problems
    assert "tensorrt_llm: input 'return_kv_cache_reuse_stats' is not declared upstream" in problems
    pre = upstream_mismatches(by_model["preprocessing"], upstream_facts.template_text("0.19", "preprocessing"))
    assert "preprocessing: parameter 'multimodal_model_path' missing" in pre
    assert "preprocessing: parameter 'visual_model_path' is not declared upstream" in pre
    for model in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):
        assert upstream_mismatches(by_model[model], upstream_facts.template_text("0.18", model)) == []


def test_version_table_matches_the_tag_checkout():
    from trtllm_support import upstream_backend_dir
    root, family = upstream_backend_dir()      # skips without $SPECBUILD_TRTLLM_BACKEND_DIR
    assert upstream_facts.extract_tree(root) == upstream_facts.families()[family]["models"]
    for model in upstream_facts.MODELS:
        ours = upstream_facts.template_text(family, model).replace("${model_name}", "tensorrt_llm")
        assert upstream_mismatches(ours, (root / model / "config.pbtxt").read_text()) == [], model


def test_paths_with_backslash_and_quote_survive_the_config(tmp_path, opts):
    """A workdir holding `\\` and `"` is written escaped (core.pbtxt), so every config parses back to the exact
    path; unescaped, the quote ended the string early and the config did not parse (or parsed as another path)."""
    odd = tmp_path / 'we\\ird "dir'
    odd.mkdir()
    configs = repo_configs(odd, opts)
    engines = (odd / "engines").resolve()
    assert params(configs["tensorrt_llm"])["gpt_model_path"] == str(engines / "target")
    assert params(configs["preprocessing"])["tokenizer_dir"] == str((odd / "model_repository" / "tokenizer").resolve())


def test_llmapi_yaml_and_config_escape_an_odd_target_path(tmp_path, opts):
    import yaml

    import shutil

    odd = tmp_path / 'x\\y "z'
    shutil.copytree(opts["target_dir"], odd)
    files = written(deploy.plan(context("deploy", tmp_path, {**opts, "target_dir": str(odd),
                                                             "trtllm_version": "1.0.0"})))
    [yml] = [t for p, t in files.items() if p.endswith("model.yaml")]
    assert yaml.safe_load(yml)["model"].endswith('x\\y "z')
    for path, text in files.items():
        if path.endswith("config.pbtxt"):
            parse(text)


def test_a_bare_value_that_would_change_the_structure_is_refused():
    text = 'name: "m"\nmax_batch_size: ${n}\nparameters: { key: "p" value: { string_value: "${p}" } }\n'
    assert parse(render(text, {"n": 4, "p": 'a"b\\c\nd'})).parameters["p"].string_value == 'a"b\\c\nd'
    with pytest.raises(SpecbuildError, match="unquoted"):
        render(text, {"n": "4 } input [ {", "p": "x"})
