"""The client adapts contract requests to the deployment it talks to: the embedded one takes the contract as
is; a TensorRT-LLM one serves upstream's models of its release (names read from the release tags in
core/upstream_facts.json)."""

from __future__ import annotations

import json

import pytest

from specbuild.pipeline.client import RequestError, adapt_request, deployment_target, request_body


def body(**kw):
    return request_body("Hello", max_tokens=8, **kw)


def test_embedded_takes_the_contract_unchanged():
    b = body(seed=3, min_tokens=2, num_draft_tokens=4, return_perf_metrics=True, proposer="ngram")
    assert adapt_request("embedded", "tensorrt_llm_bls", b) == (b, False)


@pytest.mark.parametrize("family", ["0.18", "0.19"])
def test_trtllm_names_of_the_release(family):
    out, echoed = adapt_request(f"trtllm-{family}", "ensemble", body(seed=3, min_tokens=2, return_perf_metrics=True))
    assert out["random_seed"] == 3 and out["min_length"] == 2 and "seed" not in out and "min_tokens" not in out
    assert ("return_perf_metrics" in out) == (family == "0.19")     # v0.18 has no perf-metric outputs
    assert not echoed


@pytest.mark.parametrize("family", ["0.18", "0.19"])
def test_trtllm_speculative_bls_request_is_sent_the_way_upstreams_loop_needs(family):
    out, echoed = adapt_request(f"trtllm-{family}", "tensorrt_llm_bls", body(num_draft_tokens=4, proposer="draft"))
    assert out["stream"] is False and out["exclude_input_in_output"] is False and echoed
    assert "proposer" not in out
    with pytest.raises(RequestError, match="cannot stream with speculation"):
        adapt_request(f"trtllm-{family}", "tensorrt_llm_bls", body(num_draft_tokens=4, stream=True))
    off, echoed = adapt_request(f"trtllm-{family}", "tensorrt_llm_bls", body(num_draft_tokens=0, stream=True))
    assert off["stream"] is True and not echoed


def test_deployment_target_from_the_deploy_manifest(tmp_path):
    assert deployment_target(tmp_path) == "embedded"
    (tmp_path / "model_repository").mkdir()
    m = tmp_path / "model_repository" / "manifest.json"
    m.write_text(json.dumps({"options": {"backend": "embedded"}}))
    assert deployment_target(tmp_path) == "embedded"
    m.write_text(json.dumps({"options": {"backend": "trtllm"}, "extra": {"recipe": {"backend_family": "0.19"}}}))
    assert deployment_target(tmp_path) == "trtllm-0.19"
    m.write_text(json.dumps({"options": {"backend": "trtllm"}, "extra": {"recipe": {"trtllm_version": "0.17.0"}}}))
    assert deployment_target(tmp_path) == "embedded"        # no release table recorded: the contract as is, no guess
    m.write_text(json.dumps({"options": {"backend": "trtllm"},
                             "extra": {"recipe": {"generation": "llmapi", "backend_family": "1.2"}}}))
    assert deployment_target(tmp_path) == "trtllm-llmapi"   # Triton's llmapi model, whatever the release


def test_llmapi_clients_speak_its_one_model_and_its_tensors():
    """infer / verify / loadtest on an llmapi deployment: model tensorrt_llm, sampling_param_* names with the
    datatypes its config.pbtxt declares, no batch dimension (max_batch_size 0), num_draft_tokens refused."""
    from specbuild.loadtests.session import served_names
    from specbuild.pipeline.client import Client, grpc_inputs

    client = Client(target="trtllm-llmapi", model="tensorrt_llm_bls")
    assert client.model == "tensorrt_llm"
    out, echoed = adapt_request("trtllm-llmapi", "ensemble", body(seed=3, stream=True))
    assert not echoed and out["streaming"] is True and out["sampling_param_seed"] == 3
    assert out["sampling_param_exclude_input_from_output"] is True       # the client strips nothing
    with pytest.raises(RequestError, match="num_draft_tokens .*--reference-url"):
        adapt_request("trtllm-llmapi", "ensemble", body(num_draft_tokens=0))
    with pytest.raises(RequestError, match="min_tokens"):
        adapt_request("trtllm-llmapi", "ensemble", body(min_tokens=2))
    inputs = {i.name(): i for i in grpc_inputs(out, target="trtllm-llmapi", model="tensorrt_llm")}
    assert inputs["sampling_param_max_tokens"].datatype() == "INT32"
    assert inputs["sampling_param_seed"].datatype() == "UINT64"
    assert inputs["streaming"].datatype() == "BOOL" and inputs["text_input"].datatype() == "BYTES"
    assert all(i.shape() == [1] for i in inputs.values())
    assert served_names("trtllm-llmapi", ["text_input", "max_tokens", "stream"]) == [
        "text_input", "sampling_param_max_tokens", "streaming"]
    assert served_names("trtllm-1.2", ["max_tokens"]) == ["max_tokens"]


def test_loadtest_payload_speaks_the_release_or_refuses_with_the_reason(tiny_tokenizer):
    from specbuild.loadtests.profiles import load_profiles
    from specbuild.loadtests.runspec import Gates
    from specbuild.core.errors import UsageError
    from specbuild.pipeline.loadtest import Session

    batch, chat = load_profiles(("batch", "chat"))

    def session(target, model):
        return Session(url="http://127.0.0.1:1", grpc_url="127.0.0.1:2", metrics_url=None, model=model,
                       protocol="http", counter=None, info=None, dropped=[], gates=Gates(), target=target)

    plain = session("embedded", "tensorrt_llm_bls").payload(batch, {"num_draft_tokens": 4})
    assert plain["min_tokens"] == batch.max_tokens and plain["num_draft_tokens"] == 4
    off = session("trtllm-0.18", "tensorrt_llm_bls").payload(batch, {"num_draft_tokens": 0})
    assert off["min_length"] == batch.max_tokens and "min_tokens" not in off and "return_perf_metrics" not in off
    with pytest.raises(UsageError, match="prompt echoed"):
        session("trtllm-0.18", "tensorrt_llm_bls").payload(batch, {"num_draft_tokens": 4})
    with pytest.raises(UsageError, match="cannot stream with speculation"):
        session("trtllm-0.19", "tensorrt_llm_bls").payload(chat, {"num_draft_tokens": 4})


@pytest.mark.parametrize("family", ["0.20", "0.21", "1.0", "1.1", "1.2"])
def test_trtllm_0_20_and_later_take_the_contract_names(family):
    """From 0.20 the releases call them seed / min_tokens (the contract's names): sent as they are."""
    out, echoed = adapt_request(f"trtllm-{family}", "ensemble", body(seed=3, min_tokens=2, return_perf_metrics=True))
    assert out["seed"] == 3 and out["min_tokens"] == 2 and out["return_perf_metrics"] is True
    assert "random_seed" not in out and "min_length" not in out and not echoed
    spec, echoed = adapt_request(f"trtllm-{family}", "tensorrt_llm_bls", body(num_draft_tokens=4, seed=1))
    assert spec["stream"] is False and spec["exclude_input_in_output"] is False and spec["seed"] == 1 and echoed
    with pytest.raises(RequestError, match="cannot stream with speculation"):
        adapt_request(f"trtllm-{family}", "tensorrt_llm_bls", body(num_draft_tokens=4, stream=True))


def test_a_0_19_name_sent_to_a_0_20_deployment_is_refused_with_the_rename():
    from specbuild.core.contract import request_problems
    problems = request_problems("trtllm-1.2", "ensemble", {"text_input": "x", "max_tokens": 4, "random_seed": 1})
    assert problems and "no input 'random_seed'" in problems[0]
    assert request_problems("trtllm-0.19", "ensemble", {"text_input": "x", "max_tokens": 4, "seed": 1}) == [
        "ensemble (tensorrtllm_backend 0.19): 'seed' is called 'random_seed' in this release"]


def test_llmapi_model_takes_sampling_param_names():
    from specbuild.core.contract import llmapi_request
    out = llmapi_request(body(seed=3, temperature=0.0, return_perf_metrics=True))
    assert out == {"text_input": "Hello", "sampling_param_max_tokens": 8, "streaming": False,
                   "sampling_param_temperature": 0.0, "sampling_param_seed": 3,
                   "sampling_param_return_perf_metrics": True, "sampling_param_exclude_input_from_output": True}
    with pytest.raises(ValueError, match="num_draft_tokens .*speculative_config"):
        llmapi_request(body(num_draft_tokens=4))
