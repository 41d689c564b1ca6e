"""The one wire module (`specbuild.core.wire`): request encoding (KServe JSON, gRPC datatypes, OpenAI
bodies), SSE parsing, perf-metric absorption and error mapping, as every client uses them."""

from __future__ import annotations

import numpy as np
import pytest

from specbuild.core import wire


def test_grpc_datatypes_are_what_the_deployment_declares():
    # the contract: seed is UINT64, min_tokens INT32, temperature FP32, stream BOOL, text BYTES
    types = wire.datatypes({"text_input": "hi", "max_tokens": 4, "seed": 7, "min_tokens": 2, "temperature": 0.0,
                            "stream": True, "num_draft_tokens": 3})
    assert types == {"text_input": "BYTES", "max_tokens": "INT32", "seed": "UINT64", "min_tokens": "INT32",
                     "temperature": "FP32", "stream": "BOOL", "num_draft_tokens": "INT32"}
    # a TensorRT-LLM release's own names: random_seed is UINT64 as its config.pbtxt declares (never INT32)
    for family in ("0.18", "0.19"):
        trt = wire.datatypes({"random_seed": 7, "min_length": 2, "text_input": "x"}, target=f"trtllm-{family}",
                             model="tensorrt_llm_bls")
        assert trt == {"random_seed": "UINT64", "min_length": "INT32", "text_input": "BYTES"}
    # a field neither the contract nor the release knows: from the Python value
    assert wire.datatypes({"proposer": "ngram", "x": 1.5, "flag": False}) == {
        "proposer": "BYTES", "x": "FP32", "flag": "BOOL"}


def test_grpc_arrays_encode_values_with_those_types_and_a_batch_dimension():
    body = {"text_input": "héllo", "seed": 2 ** 40, "stop_words": ["a", "b"], "max_tokens": 8}
    arrays = {name: (arr, dtype) for name, arr, dtype in wire.grpc_arrays(body, wire.datatypes(body))}
    seed, dtype = arrays["seed"]
    assert dtype == "UINT64" and seed.dtype == np.uint64 and seed.shape == (1, 1) and int(seed[0, 0]) == 2 ** 40
    text, dtype = arrays["text_input"]
    assert dtype == "BYTES" and text[0, 0] == "héllo".encode() and text.dtype == object
    assert arrays["stop_words"][0].shape == (1, 2) and arrays["max_tokens"][0].dtype == np.int32
    flat = {n: a for n, a, _ in wire.grpc_arrays({"max_tokens": 8}, batch_dim=False)}
    assert flat["max_tokens"].shape == (1,)
    inputs = wire.grpc_inputs(body, wire.datatypes(body))
    assert [(i.name(), i.datatype(), i.shape()) for i in inputs][1] == ("seed", "UINT64", [1, 1])


def test_kserve_and_openai_request_bodies():
    fields = {"max_tokens": 16, "min_tokens": 16, "stream": True, "temperature": 0.0, "top_k": 1, "seed": 3,
              "return_perf_metrics": True, "exclude_input_in_output": True, "num_draft_tokens": 4,
              "stop_words": ["\n\n"], "speculative.n_max": 4}
    path, body = wire.encode("kserve", "Hi", fields, model="tensorrt_llm_bls", stream=True)
    assert path == "/v2/models/tensorrt_llm_bls/generate_stream" and body == {"text_input": "Hi", **fields}
    assert wire.encode("kserve", "Hi", {"max_tokens": 2}, model="ensemble", stream=False)[0] == \
        "/v2/models/ensemble/generate"
    path, body = wire.encode("openai-completions", "Hi", fields, model="smol", stream=True)
    assert path == "/v1/completions"
    assert body == {"model": "smol", "prompt": "Hi", "max_tokens": 16, "min_tokens": 16, "ignore_eos": True,
                    "temperature": 0.0, "top_k": 1, "seed": 3, "stop": ["\n\n"], "speculative.n_max": 4,
                    "stream": True, "stream_options": {"include_usage": True}}
    path, body = wire.encode("openai-chat", "Hi", {"max_tokens": 4}, model=None, stream=False)
    assert path == "/v1/chat/completions"
    assert body == {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": False}
    with pytest.raises(ValueError, match="unknown API"):
        wire.encode("grpc-web", "Hi", {}, model=None, stream=False)


def test_sse_lines_of_every_server():
    # KServe generate_stream: perf metrics cumulative per request, scalars or one-element lists
    e = wire.parse_line("kserve", b'data: {"model_name":"m","text_output":" the","acceptance_rate":[0.5],'
                                  b'"total_draft_tokens":4,"total_accepted_draft_tokens":[2]}\r\n')
    assert e.text == " the" and e.perf == {"acceptance_rate": 0.5, "total_draft_tokens": 4.0,
                                           "total_accepted_draft_tokens": 2.0} and e.error is None
    assert wire.parse_line("kserve", 'data: {"error":"bad num_draft_tokens"}').error == "bad num_draft_tokens"
    for skipped in (b"\n", b": keep-alive\n", b"event: message\n", b"data: [DONE]\n", b"id: 3\n"):
        assert wire.parse_line("openai-completions", skipped) is None
    assert wire.parse_line("kserve", b"data: {not json").error.startswith("malformed stream event")
    # OpenAI completions chunk with llama.cpp's timings (its per-response draft counts)
    e = wire.parse_line("openai-completions", 'data: {"choices":[{"text":" Paris","index":0,"finish_reason":null}],'
                                              '"timings":{"draft_n":8,"draft_n_accepted":6}}')
    assert e.text == " Paris" and e.perf == {"total_draft_tokens": 8.0, "total_accepted_draft_tokens": 6.0,
                                             "acceptance_rate": 0.75}
    # chat: the first delta carries the role only (no text: not a first token), usage arrives last
    assert wire.parse_line("openai-chat", 'data: {"choices":[{"delta":{"role":"assistant"}}]}').text == ""
    assert wire.parse_line("openai-chat", 'data: {"choices":[{"delta":{"content":"Hi"}}]}').text == "Hi"
    usage = wire.parse_line("openai-chat", 'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}')
    assert usage.usage == {"prompt_tokens": 5, "completion_tokens": 9} and usage.text == ""
    assert "context length" in wire.parse_line(
        "openai-chat", 'data: {"error":{"message":"context length exceeded","type":"invalid_request_error"}}').error


def test_non_streaming_bodies_and_the_absorber():
    assert wire.parse_body("kserve", b'{"text_output":"ok","total_draft_tokens":[3]}').perf == \
        {"total_draft_tokens": 3.0}
    chat = wire.parse_body("openai-chat", '{"choices":[{"message":{"role":"assistant","content":"Paris."},'
                                          '"finish_reason":"stop"}],"usage":{"completion_tokens":2}}')
    assert chat.text == "Paris." and chat.finish_reason == "stop" and chat.usage["completion_tokens"] == 2
    assert wire.parse_body("kserve", b"<html>").error.startswith("the answer is not JSON")
    got = wire.Absorber()
    for t, line in enumerate([b'data: {"text_output":"a","total_draft_tokens":2}',
                              b'data: {"text_output":""}', b'data: {"text_output":"b","total_draft_tokens":5}']):
        got.add(wire.parse_line("kserve", line), float(t))
    assert got.text == "ab" and got.arrivals == [0.0, 2.0] and got.perf == {"total_draft_tokens": 5.0}
    lines = wire.LineBuffer()
    assert lines.feed(b"data: {\"a\"") == [] and lines.feed(b": 1}\ndata: x\n\nda") == [b'data: {"a": 1}',
                                                                                         b"data: x", b""]
    assert lines.rest() == [b"da"]


def test_error_mapping():
    assert wire.http_error(400, b'{"error":"unexpected inference input \'nope\'"}') == \
        "HTTP 400: unexpected inference input 'nope'"
    assert wire.http_error(400, '{"error":{"message":"max_tokens too large","type":"BadRequestError","code":400}}') \
        == "HTTP 400: max_tokens too large (BadRequestError)"
    assert wire.error_message('data: {"error":"refused in the stream"}\n\n') == "refused in the stream"
    assert wire.error_message("upstream connect error") == "upstream connect error"
    assert wire.is_connection_error_text("[StatusCode.UNAVAILABLE] failed to connect to all addresses")
    assert not wire.is_connection_error_text("HTTP 400: bad request")
