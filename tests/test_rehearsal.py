"""`serve --rehearse`: the TensorRT-LLM repository on the real CPU tritonserver with upstream's own Python models.

Needs upstream's models: a tensorrtllm_backend release checkout in $SPECBUILD_TRTLLM_BACKEND_DIR, else the newest tree
gathered by scripts/gather_trtllm_upstream.py ($SPECBUILD_TRTLLM_UPSTREAM, else ../shared/upstream/trtllm-backend beside
the repository, which a clone and CI have, else ~/.cache/specbuild/trtllm-upstream); skips with the reason otherwise.
The chain convert -> build -> deploy --backend trtllm runs with the recording tensorrt_llm stand-in and fake
trtllm-build (TensorRT-LLM cannot exist here); the rehearsal then serves the deployed configs, upstream's
preprocessing / postprocessing / tensorrt_llm_bls, and the stand-in engines on the tiny model pair.
"""

from __future__ import annotations

import os
import shutil
import sys

import httpx
import numpy as np
import pytest
from servers import serve_options
from trtllm_support import env_with_path, make_fake_trtllm_build, make_standin_tensorrt_llm, trtllm_chain, \
    upstream_backend_dir

from specbuild.pipeline import rehearse, serve
from specbuild.core.errors import CheckFailed, UsageError

pytestmark = pytest.mark.server          # starts a real tritonserver

TIMEOUT = 180.0


@pytest.fixture(scope="module")
def upstream():
    return upstream_backend_dir()


@pytest.fixture(scope="module")
def chain(tmp_path_factory, upstream, tiny_llama, tiny_llama_draft):
    models, family = upstream
    tmp = tmp_path_factory.mktemp("rehearsal")
    root = make_standin_tensorrt_llm(tmp / "standin", version=f"{family}.0")
    make_fake_trtllm_build(tmp / "bin")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    mp.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    mp.setenv("TRTLLM_STANDIN_LOG", str(tmp / "calls.jsonl"))
    mp.setenv("PATH", env_with_path(tmp / "bin"))
    try:
        extra = {} if family == "0.18" else {"container_tag": "example.invalid/tritonserver:rehearsal"}
        work = trtllm_chain(tmp / "work", tiny_llama, tiny_llama_draft, version=f"{family}.0",
                            backend_models=models, **extra)
    finally:
        mp.undo()
        for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
            del sys.modules[name]
    return work, models, family


@pytest.fixture(scope="module")
def server(chain):
    work, models, family = chain
    opts = serve_options()
    info = rehearse.start(work, opts, backend_models_dir=models)
    try:
        yield info, work, family
    finally:
        serve.stop(work, timeout=30)


def generate(info, model, **inputs):
    r = httpx.post(f"{info.http_url}/v2/models/{model}/generate", json=inputs, timeout=TIMEOUT)
    return r


def bls(info, prompt, max_tokens, k, **kw):
    body = {"text_input": prompt, "max_tokens": max_tokens, "num_draft_tokens": k, "stream": False,
            "temperature": 0.0, **kw}
    return generate(info, "tensorrt_llm_bls", **body)


PROMPTS = ["Hello world", "The quick brown fox", "speculative decoding is"]


def test_rehearsal_repository_keeps_the_deployed_configs(chain):
    work, models, _ = chain
    repo = rehearse.prepare(work, models)
    deployed = work / "model_repository" / "triton"
    for model in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert (repo / model / "config.pbtxt").read_text() == (deployed / model / "config.pbtxt").read_text()
    for model in ("tensorrt_llm", "tensorrt_llm_draft"):
        ours = (deployed / model / "config.pbtxt").read_text()
        theirs = (repo / model / "config.pbtxt").read_text()
        assert theirs == ours.replace('backend: "tensorrtllm"', 'backend: "python"')
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert (repo / model / "1" / "model.py").read_bytes() == (models / model / "1" / "model.py").read_bytes()


def test_speculative_output_through_upstream_bls_equals_target_only(server):
    info, work, _ = server
    for prompt in PROMPTS:
        off = bls(info, prompt, 24, 0)
        assert off.status_code == 200, off.text
        on = bls(info, prompt, 24, 4)
        assert on.status_code == 200, on.text
        assert on.json()["text_output"] == off.json()["text_output"]
        assert on.json()["text_output"].startswith(prompt)    # upstream's BLS returns prompt + completion
    stats = rehearse.engine_stats(work)
    assert stats["tensorrt_llm"]["draft_tokens"] > 0
    assert stats["tensorrt_llm_draft"]["requests"] > 0


def test_speculative_path_reuses_the_kv_cache_of_the_resent_prefix(server):
    info, work, _ = server
    before = rehearse.engine_stats(work)["tensorrt_llm"]
    r = bls(info, "The quick brown fox jumps over the lazy dog", 32, 4)
    assert r.status_code == 200, r.text
    after = rehearse.engine_stats(work)["tensorrt_llm"]
    reused = after["reused_tokens"] - before["reused_tokens"]
    computed = after["computed_tokens"] - before["computed_tokens"]
    # Every round resends prompt + accepted tokens; with reuse only the new tail is computed.
    assert reused > computed
    print(f"prefix reuse on the target: {reused} reused vs {computed} computed tokens")


def test_ensemble_generates_target_only_text(server):
    info, _, _ = server
    r = generate(info, "ensemble", text_input="Hello world", max_tokens=24, temperature=0.0)
    assert r.status_code == 200, r.text
    ref = bls(info, "Hello world", 24, 0).json()["text_output"]
    assert r.json()["text_output"] == ref


def test_streaming_on_the_pinned_non_decoupled_repository_is_refused_clearly(server):
    info, _, _ = server
    r = httpx.post(f"{info.http_url}/v2/models/ensemble/generate_stream",
                   json={"text_input": "Hello", "max_tokens": 4, "stream": True}, timeout=TIMEOUT)
    body = r.text
    assert r.status_code >= 400 or "error" in body
    assert "decoupled" in body


def test_speculative_request_without_stream_is_refused_by_upstream_bls(server):
    """v0.18 and v0.19 alike: Request.validate calls self.stream.any() when num_draft_tokens is set."""
    info, _, family = server
    r = generate(info, "tensorrt_llm_bls", text_input="Hello", max_tokens=8, num_draft_tokens=4)
    assert r.status_code >= 400 and "stream" in r.text, r.text
    assert bls(info, "Hello", 8, 4).status_code == 200      # with stream=false it works


def test_genai_perf_shaped_request(server):
    """exclude_input_in_output + min_length: fine on the ensemble; on the BLS speculative path upstream's loop
    assumes output_ids hold the prompt, so the contract refuses it before sending (contract.request_problems)."""
    from specbuild.core.contract import contract_name_for, request_problems
    info, _, family = server
    min_name = contract_name_for(family, "ensemble", "min_tokens")     # min_length up to 0.19, min_tokens from 0.20
    r = generate(info, "ensemble", text_input="Hello world", max_tokens=8, **{min_name: 8},
                 exclude_input_in_output=True, temperature=0.0)
    assert r.status_code == 200, r.text
    text = r.json()["text_output"]
    assert not text.startswith("Hello world")
    problems = request_problems(f"trtllm-{family}", "tensorrt_llm_bls",
                                {"text_input": "x", "max_tokens": 8, "num_draft_tokens": 4,
                                 "exclude_input_in_output": True, min_name: 8})
    assert any("exclude_input_in_output" in p for p in problems)


def test_refusals_name_the_reason(chain, tmp_path):
    work, models, family = chain
    with pytest.raises(UsageError, match="--backend-models-dir"):
        rehearse.prepare(work, None)
    with pytest.raises(UsageError, match="no inflight_batcher_llm"):
        rehearse.prepare(work, tmp_path)
    # another release's tree: here, upstream's own tree with the parameter v0.18 and v0.19 disagree on renamed
    other = tmp_path / "other"
    shutil.copytree(models, other, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = other / "preprocessing" / "config.pbtxt"
    swap = ("visual_model_path", "multimodal_model_path")
    text = cfg.read_text()
    cfg.write_text(text.replace(*swap) if swap[0] in text else text.replace(*reversed(swap)))
    with pytest.raises(CheckFailed, match="not the release"):
        rehearse.prepare(work, other)


def test_standin_verifies_external_drafts_in_one_step(tiny_llama):
    from specbuild.engines.trtllm.standin import Request, StandinEngine
    eng = StandinEngine(tiny_llama, max_seq_len=256, slots=2)
    prompt = [5, 6, 7, 8, 9]
    ref = eng.generate(Request(prompt, 8)).new_tokens
    # correct drafts: all accepted plus one
    r = eng.generate(Request(prompt, 5, draft_input_ids=ref[:4]))
    assert r.new_tokens == ref[:5] and r.num_accepted == 4
    # a wrong second draft: first accepted, then the target's own token
    wrong = [ref[0], (ref[1] + 1) % eng.vocab_size, ref[2], ref[3]]
    r = eng.generate(Request(prompt, 5, draft_input_ids=wrong))
    assert r.new_tokens == ref[:2] and r.num_accepted == 1
    g = eng.generate(Request(prompt, 3, return_generation_logits=True))
    assert g.generation_logits.shape == (3, eng.vocab_size)
    assert list(np.argmax(g.generation_logits, -1)) == ref[:3]


def test_verify_and_infer_run_unchanged_against_the_rehearsal(server):
    """`specbuild verify` / `infer` learn from the deploy manifest that this is a TensorRT-LLM deployment of
    release <family> and adapt their requests (random_seed/min_length, no perf metrics on 0.18, stream=false +
    exclude_input_in_output=false on the BLS speculative path, the echoed prompt stripped)."""
    from click.testing import CliRunner

    from specbuild.cli.main import cli
    info, work, family = server
    runner = CliRunner()
    res = runner.invoke(cli, ["verify", "--workdir", str(work), "-k", "4", "--max-tokens", "16", "--seeds", "0",
                              "--raw", "--prompt", "Hello world", "--prompt", "The quick brown fox"])
    assert res.exit_code == 0, res.output
    assert res.output.count("identical") == 2 and "lossless" in res.output
    res = runner.invoke(cli, ["infer", "--workdir", str(work), "--prompt", "Hello world", "--max-tokens", "8",
                              "--num-draft-tokens", "4", "--no-stream"])
    assert res.exit_code == 0, res.output
    assert not res.stdout.startswith("Hello world")      # the completion only, as from the embedded deployment
    res = runner.invoke(cli, ["infer", "--workdir", str(work), "--prompt", "Hello", "--max-tokens", "8",
                              "--num-draft-tokens", "4"])                 # streaming + speculation
    assert res.exit_code != 0 and "cannot stream with speculation" in res.output
