"""The generated Triton repository: every config.pbtxt parses with tritonclient's protobuf, holds the
required values, the ensemble is consistent, and the client-facing models match specbuild.pipeline.contract."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from trtllm_support import context, written

from specbuild.pipeline.contract import (CLIENT_INPUTS, CLIENT_OUTPUTS, ENSEMBLE_MODEL, SPECULATIVE_MODEL, TensorSpec,
                                contract_mismatches, inputs_for)
from specbuild.engines.trtllm import deploy
from specbuild.engines.trtllm.repository import ensemble_problems, render, template, upstream_mismatches
from specbuild.pipeline.errors import SpecbuildError


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def params(cfg) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def repo_configs(tmp_path, options) -> dict[str, model_config_pb2.ModelConfig]:
    files = written(deploy.plan(context("deploy", tmp_path, options)))
    configs = {}
    for path, text in files.items():
        assert "${" not in text, f"placeholder left in {path}"
        if path.endswith("config.pbtxt"):
            cfg = parse(text)
            assert Path(path).parent.name == cfg.name
            configs[cfg.name] = cfg
    return configs


@pytest.fixture
def opts(tiny_llama, tiny_llama_draft):
    return {"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft)}


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
    bls = params(configs["tensorrt_llm_bls"])
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


@pytest.mark.parametrize("model", [ENSEMBLE_MODEL, SPECULATIVE_MODEL])
def test_client_contract_matches_generated_configs(tmp_path, opts, model):
    cfg = repo_configs(tmp_path, opts)[model]
    assert contract_mismatches(model, cfg.input, cfg.output) == []
    declared = {t.name for t in cfg.input}
    assert {"text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed", "end_id", "stop_words",
            "min_tokens", "exclude_input_in_output", "return_perf_metrics"} <= declared
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
    del step.input_map["input_ids"]
    step.input_map["runtime_top_k"] = "temperature"
    problems = ensemble_problems({**configs, "ensemble": broken})
    assert "tensorrt_llm required input 'input_ids' is not mapped" in problems
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
        render(template("inflight_batcher_llm/postprocessing/config.pbtxt"), {"triton_max_batch_size": 1})


def test_upstream_mismatch_detects_missing_outputs(tmp_path, opts):
    ours = template("inflight_batcher_llm/postprocessing/config.pbtxt")
    ours = render(ours, {"trtllm_version": "0.18.0", "triton_max_batch_size": 8, "tokenizer_dir": "/t",
                         "skip_special_tokens": True, "postprocessing_instance_count": 1})
    extra = '  { name: "OUT_CUM_LOG_PROBS" data_type: TYPE_FP32 dims: [ -1 ] },\n'
    theirs = ours.replace('output [\n', 'output [\n' + extra)
    theirs = theirs.replace("max_batch_size: 8", "max_batch_size: ${triton_max_batch_size}")
    assert upstream_mismatches(ours, ours) == []
    assert upstream_mismatches(ours, theirs) == ["postprocessing: output 'OUT_CUM_LOG_PROBS' missing"]
