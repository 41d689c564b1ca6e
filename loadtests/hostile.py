"""The hostile catalogue: named requests that a client-facing model must refuse with a 4xx naming what was wrong
(or serve), and how an answer is classified (ours or tritonserver's own, good or bad). The soak
(`specbuild.loadtests.soak`, `make soak`) mixes them into its load; tests/test_hostile.py sends each one to a real
tritonserver, to both client-facing models, over both endpoints."""

from __future__ import annotations

import json

from specbuild.core import wire

MODELS = ("ensemble", "tensorrt_llm_bls")
ENDPOINTS = ("generate", "generate_stream")
DEL = object()  # a patch value: leave the key out

# Hostile cases by name: a patch of the request body (DEL drops a key) or a raw body (bytes). What each gets
# (tritonserver 2.51, embedded deployment) is in docs/serving.md and in the report's `hostile_one_by_one`.
# Not here: a JSON array nested 100 000 deep, which crashes tritonserver < 2.58 (server#8172; tests/test_hostile.py).
HOSTILE: dict[str, dict | bytes] = {
    "temperature_nan": {"temperature": float("nan")},
    "temperature_inf": {"temperature": float("inf")},
    "temperature_negative": {"temperature": -1.0},
    "temperature_tiny": {"temperature": 1e-40},
    "temperature_huge": {"temperature": 3e38},
    "temperature_overflow_fp32": {"temperature": 1e300},
    "temperature_string": {"temperature": "hot"},
    "temperature_bool": {"temperature": True},
    "top_p_nan": {"top_p": float("nan")},
    "top_p_tiny": {"top_p": 1e-30, "temperature": 1.0},
    "top_p_above_1": {"top_p": 2.0},
    "top_k_negative": {"top_k": -3},
    "top_k_huge": {"top_k": 2 ** 31 - 1, "temperature": 1.0},
    "top_k_overflow_int32": {"top_k": 2 ** 40},
    "max_tokens_huge": {"max_tokens": 2 ** 31 - 1},
    "max_tokens_overflow_int32": {"max_tokens": 2 ** 31},
    "max_tokens_negative": {"max_tokens": -1},
    "max_tokens_zero": {"max_tokens": 0},
    "max_tokens_float": {"max_tokens": 1.5},
    "max_tokens_string": {"max_tokens": "8"},
    "max_tokens_null": {"max_tokens": None},
    "max_tokens_missing": {"max_tokens": DEL},
    "text_input_missing": {"text_input": DEL},
    "text_input_int": {"text_input": 42},
    "text_input_null": {"text_input": None},
    "text_input_empty": {"text_input": ""},
    "text_input_huge": {"text_input": "z" * 100_000},
    "text_input_60k_tokens": {"text_input": "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(20000))},
    "text_input_past_max_seq_len": {"text_input": "The quick brown fox " * 200},
    "text_input_batch": {"text_input": ["a", "b"]},
    "text_input_lone_surrogate": {"text_input": "\ud800"},
    "text_input_invalid_utf8": b'{"text_input": "\xff\xfe", "max_tokens": 8}',
    "seed_negative": {"seed": -1},
    "seed_overflow_uint64": {"seed": 2 ** 64},
    "seed_max_uint64": {"seed": 2 ** 64 - 1, "temperature": 1.0},
    "stop_word_long": {"stop_words": ["w" * 5000]},
    "stop_words_many": {"stop_words": ["a"] * 100},
    # 2,000,000 entries (~10 MB of JSON): refused on its count before it is encoded or decoded
    "stop_words_2m": {"stop_words": ["a"] * 2_000_000},
    "stop_words_int": {"stop_words": [1, 2]},
    "stop_words_nested": {"stop_words": [["a"]]},
    "num_draft_tokens_huge": {"num_draft_tokens": 1000},
    "num_draft_tokens_negative": {"num_draft_tokens": -5},
    "proposer_unknown": {"proposer": "oracle"},
    "min_tokens_negative": {"min_tokens": -4},
    "min_tokens_above_max": {"min_tokens": 100},
    "end_id_out_of_vocab": {"end_id": 10 ** 6},
    # with min_tokens the end id indexes the logits: out of range it failed every request of its prefill step
    "end_id_out_of_vocab_min_tokens": {"end_id": 10 ** 6, "min_tokens": 4},
    "end_id_negative_min_tokens": {"end_id": -1, "min_tokens": 4},
    "stream_string": {"stream": "yes"},
    "unknown_input": {"foo": 1},
    "duplicate_key": b'{"text_input": "a", "max_tokens": 8, "max_tokens": 9}',
    "body_not_json": b"{not json",
    "body_empty": b"",
    "body_array": b"[1, 2, 3]",
}
# tritonserver's own JSON-parsing errors: http_server.cc builds them with TRITONSERVER_ERROR_INTERNAL (its
# TRITONJSON_STATUSRETURN), which HttpCodeFromError maps to 500, before the request reaches any model.
UPSTREAM_500_PREFIXES = ("Unable to parse 'data'", "Unable to parse JSON bytes array",
                         "failed to parse the request JSON buffer", "attempt to get members for non-object")


def hostile_body(case: str, prompt: str, max_tokens: int, stream: bool) -> bytes:
    patch = HOSTILE[case]
    if isinstance(patch, bytes):
        return patch
    body = {"text_input": prompt, "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    for k, v in patch.items():
        if v is DEL:
            body.pop(k, None)
        else:
            body[k] = v
    return json.dumps(body).encode()     # allow_nan: NaN / Infinity literals, which tritonserver parses


def classify(status: int, text: str, stream: bool) -> tuple[str, str]:
    """(label, the server's message) of one answer: `status_label` of it, the error read by
    `specbuild.core.wire` (an error body, or the first error event of a 200 stream)."""
    if status != 200:
        message = wire.error_message(text)
        return status_label(status, message), message
    events = (wire.parse_line(wire.KSERVE, ln) for ln in text.splitlines()) if stream else ()
    message = wire.first_error(e for e in events if e is not None)
    return status_label(200, stream_error=message is not None), message or ""


def status_label(status: int, message: str = "", stream_error: bool = False) -> str:
    """How a hostile request was answered: "200", "400", ..., "upstream_500", or "200_stream_error"."""
    if status == 200:
        return "200_stream_error" if stream_error else "200"
    if status == 500 and message.startswith(UPSTREAM_500_PREFIXES):
        return "upstream_500"
    return str(status)


def ours_bad(label: str) -> bool:
    """A hostile request answered badly by OUR code: a 5xx that is not tritonserver's parser, a stream error
    after a 200, or a dropped connection."""
    return label.startswith("5") or label in ("200_stream_error", "transport_error")
