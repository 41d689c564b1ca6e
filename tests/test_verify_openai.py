"""`specbuild verify` / `infer` with `--api openai-*`, without any server: where a divergence is reported (real
tokenizers: the tiny BPE trained here, and SmolLM2's when llama.cpp's export of it is built), what a request to an
OpenAI-compatible server carries, and the refusals through the CLI. The runs against real servers (llama.cpp's
llama-server with and without its draft) are tests/test_verify_llamacpp.py."""

from __future__ import annotations

import json
import socket

import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli
from specbuild.loadtests.tokens import TokenCounter
from specbuild.pipeline.client import OpenAIClient
from specbuild.pipeline.verify import compare_texts, openai_fields, verify

SPEC = ("Je voudrais une tasse de café, s'il vous plaît. The phrase is polite and common in France, "
        "where coffee is served in small cups.")
PLAIN = ("Je voudrais une tasse de café, s'il vous plaît. The phrase is polite and common in cafés, "
         "where coffee is served in small cups.")


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return TokenCounter(tiny_tokenizer)


def test_a_divergence_is_located_by_token_and_character_with_both_continuations(tok):
    case = compare_texts("Translate to French: I would like a cup of coffee, please.", SPEC, PLAIN, tok.ids,
                         spec_name="speculative", plain_name="reference")
    at = SPEC.index("France")
    assert not case.identical and case.first_divergence_char == at == PLAIN.index("cafés")
    assert SPEC[:at] == PLAIN[:at] and SPEC[at] != PLAIN[at]
    assert case.common_tail == SPEC[:at][-60:] and case.common_tail.endswith("common in ")
    assert case.spec_continuation.startswith("France, where") and case.plain_continuation.startswith("cafés, where")
    ts, tp = tok.ids(SPEC), tok.ids(PLAIN)
    k = case.first_divergence
    assert ts[:k] == tp[:k] and ts[k] != tp[k]               # the first re-tokenized token that differs
    assert (case.tokens_spec, case.tokens_plain) == (len(ts), len(tp))
    assert "speculative: 'France" in case.context and "reference: 'caf" in case.context


def test_identical_texts_and_a_shorter_text(tok):
    same = compare_texts("p", SPEC, SPEC, tok.ids)
    assert same.identical and same.first_divergence is None and same.first_divergence_char is None
    cut = compare_texts("p", SPEC, SPEC[:40], tok.ids)      # one side stopped early (EOS): a divergence too
    assert not cut.identical and cut.first_divergence_char == 40
    assert cut.plain_continuation == "" and cut.spec_continuation == SPEC[40:100]


def test_smollm2_tokenizer_counts_the_divergence_in_its_own_tokens():
    from specbuild.loadtests import llamacpp

    if llamacpp.missing():
        pytest.skip(llamacpp.missing())
    smol = TokenCounter(llamacpp.tokenizer_dir())
    case = compare_texts("p", SPEC, PLAIN, smol.ids)
    ts, tp = smol.ids(SPEC), smol.ids(PLAIN)
    assert ts[:case.first_divergence] == tp[:case.first_divergence] and ts[case.first_divergence] != tp[case.first_divergence]


def test_greedy_request_is_greedy_every_way_a_server_takes_it():
    fields = openai_fields(max_tokens=96, temperature=0.0, top_k=0, top_p=1.0, seed=None)
    url, body = OpenAIClient("http://127.0.0.1:8081/", "openai-completions", "smollm2").request("Hi", False, **fields)
    assert url == "http://127.0.0.1:8081/v1/completions"
    assert body == {"model": "smollm2", "prompt": "Hi", "max_tokens": 96, "temperature": 0.0, "top_k": 1,
                    "seed": 0, "stream": False}


def test_sampling_request_carries_its_seed_and_only_the_cuts_asked():
    fields = openai_fields(max_tokens=4, temperature=0.7, top_k=0, top_p=1.0, seed=17)
    _, body = OpenAIClient("http://h:1", "openai-chat", "m").request("Hi", True, **fields)
    assert body["messages"] == [{"role": "user", "content": "Hi"}] and "prompt" not in body
    assert body["seed"] == 17 and body["temperature"] == 0.7 and body["max_tokens"] == 4
    assert "top_k" not in body and "top_p" not in body and "num_draft_tokens" not in body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    _, cut = OpenAIClient("http://h:1", "openai-completions", "m").request(
        "Hi", False, **openai_fields(max_tokens=4, temperature=1.0, top_k=20, top_p=0.9, seed=3))
    assert cut["top_k"] == 20 and cut["top_p"] == 0.9


def test_report_against_a_reference_names_the_sides_and_the_place(tok, tmp_path):
    """verify() with the speculative side as deployed (num_draft_tokens None) and a reference: the routing
    contract of an OpenAI pair (None -> speculative server, 0 -> reference), the report's fields."""
    texts = {"a": (SPEC, PLAIN), "b": ("same", "same")}
    asked = []

    def generate(prompt, *, num_draft_tokens, max_tokens, temperature, top_k, top_p, seed):
        asked.append(num_draft_tokens)
        return texts[prompt][0 if num_draft_tokens is None else 1]

    out = tmp_path / "r.json"
    report = verify(generate, tok.ids, prompts=["a", "b"], num_draft_tokens=None, max_tokens=96, out=out,
                    api="openai-completions", url="http://s", reference_url="http://r")
    assert sorted(asked, key=str) == [0, 0, None, None]
    assert not report.ok and report.sides == "spec vs reference"
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["num_draft_tokens"] is None
    assert (data["api"], data["url"], data["reference_url"]) == ("openai-completions", "http://s", "http://r")
    bad = data["greedy"][0]
    assert bad["first_divergence_char"] == SPEC.index("France") and bad["spec_continuation"].startswith("France")
    assert data["greedy"][1]["identical"] is True


# --- refusals through the CLI (before any request) -------------------------------------------------------------

def _run(*args):
    return CliRunner().invoke(cli, list(args))


def test_verify_openai_without_a_reference_is_refused_with_the_reason(tmp_path):
    r = _run("verify", "--api", "openai-completions", "--url", "http://127.0.0.1:8081", "--workdir", str(tmp_path))
    assert r.exit_code == 2
    assert "no per-request num_draft_tokens" in r.output and "--reference-url" in r.output


def test_verify_openai_refuses_k_and_a_missing_url(tmp_path):
    r = _run("verify", "--api", "openai-chat", "--url", "http://a", "--reference-url", "http://b", "-k", "4",
             "--workdir", str(tmp_path))
    assert r.exit_code == 2 and "--num-draft-tokens" in r.output and "fixed when it starts" in r.output
    r = _run("verify", "--api", "openai-completions", "--reference-url", "http://b", "--workdir", str(tmp_path))
    assert r.exit_code == 2 and "needs --url" in r.output


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_verify_openai_says_when_no_server_answers(tiny_tokenizer, tmp_path):
    url = f"http://127.0.0.1:{_dead_port()}"
    r = _run("verify", "--api", "openai-completions", "--url", url, "--reference-url", url, "--tokenizer",
             str(tiny_tokenizer), "--seeds", "0", "--workdir", str(tmp_path))
    assert r.exit_code != 0 and f"no OpenAI-compatible server answers at {url}" in r.output


def test_infer_openai_refusals():
    r = _run("infer", "--api", "openai-chat", "--prompt", "Hi")
    assert r.exit_code == 2 and "needs --url" in r.output
    r = _run("infer", "--api", "openai-completions", "--url", "http://a", "--prompt", "Hi", "--num-draft-tokens", "4",
             "--protocol", "grpc")
    assert r.exit_code == 2 and "--protocol grpc, --num-draft-tokens: not with --api openai-completions" in r.output
    r = _run("infer", "--prompt", "Hi", "--model", "smollm2")   # a served model name is not a KServe client model
    assert r.exit_code == 2 and "goes with --api openai-*" in r.output
