"""From the CLI alone, on this machine without TensorRT-LLM: convert -> build -> deploy --backend trtllm --rehearse,
then `specbuild serve --rehearse --backend-models-dir DIR` with upstream's own Python models (the newest tree
gathered by scripts/gather_trtllm_upstream.py: tensorrtllm_backend c2e65b8, the 0.20 tree), for TensorRT-LLM 1.2.1
(engine path and llmapi path) and 0.20.0. Greedy output with drafts equals target-only output. The trees: ../shared/upstream/trtllm-backend beside the
repository (or $SPECBUILD_TRTLLM_UPSTREAM); skips with the reason when there is none."""

from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner
from servers import free_ports
from trtllm_support import upstream_llmapi_tree, upstream_tree

from specbuild.cli.main import cli
from specbuild.pipeline import rehearse

pytestmark = pytest.mark.server          # starts a real tritonserver

PROMPTS = ["The quick brown fox", "speculative decoding is"]
TOKENS = 16


def _cli(*args):
    r = CliRunner().invoke(cli, list(args))
    assert r.exit_code == 0, r.output
    return r


@pytest.fixture(params=[("1.2.1", "engine"), ("1.2.1", "llmapi"), ("0.20.0", "engine")],
                ids=["1.2.1-engine", "1.2.1-llmapi", "0.20.0-engine"])
def served(request, tmp_path, tiny_llama, tiny_llama_draft):
    version, generation = request.param
    tree, family = upstream_llmapi_tree() if generation == "llmapi" else upstream_tree()
    if generation == "llmapi":
        import importlib.util
        missing = [m for m in ("mpi4py", "yaml") if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"upstream's llmapi model.py imports {missing}: pip install mpi4py mpich pyyaml")
    w = str(tmp_path / "w")
    common = ["--backend", "trtllm", "--workdir", w, "--rehearse", "--trtllm-version", version,
              "--trtllm-generation", generation]
    _cli("convert", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), *common)
    _cli("build", "--max-seq-len", "256", "--max-batch-size", "2", "--max-draft-len", "4", *common)
    _cli("deploy", *common)
    http, grpc, metrics = free_ports(3)
    r = _cli("serve", "--workdir", w, "--rehearse", "--backend-models-dir", str(tree), "--background",
             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--timeout", "300")
    try:
        yield f"http://127.0.0.1:{http}", tmp_path / "w", version, generation, family, r.output
    finally:
        CliRunner().invoke(cli, ["stop", "--workdir", w])


def post(url, model, body):
    r = httpx.post(f"{url}/v2/models/{model}/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def test_rehearsed_from_the_cli_speculation_equals_target_only(served, tiny_llama):
    url, work, version, generation, family, output = served
    manifest = json.loads((work / "model_repository" / "manifest.json").read_text())
    assert manifest["extra"]["rehearsal"] is True and manifest["extra"]["recipe"]["trtllm_version"] == version
    info = json.loads((work / "rehearsal" / "rehearsal.json").read_text())
    if generation == "engine":
        for prompt in PROMPTS:
            body = {"text_input": prompt, "max_tokens": TOKENS, "stream": False, "temperature": 0.0}
            off = post(url, "tensorrt_llm_bls", {**body, "num_draft_tokens": 0})["text_output"]
            on = post(url, "tensorrt_llm_bls", {**body, "num_draft_tokens": 4})["text_output"]
            assert on == off and on.startswith(prompt)
            assert post(url, "ensemble", {**body, "seed": 1, "min_tokens": 1})["text_output"] == off   # 0.20 names
        stats = rehearse.engine_stats(work)
        assert stats["tensorrt_llm"]["draft_tokens"] > 0 and stats["tensorrt_llm_draft"]["requests"] > 0
        expected = "0.20" if version.startswith("1.2") else None
        assert info["backend_family"] == manifest["extra"]["recipe"]["backend_family"]
        if expected:       # 1.2 configs served by the 0.20 tree's Python models: said and recorded
            assert info["upstream_family"] == expected and "token-counts" in info["changes_not_in_upstream_models"]
            assert "family 0.20's, not 1.2's" in output
    else:
        from specbuild.engines.embedded import Engine, SamplingParams
        eng = Engine.from_checkpoints(str(tiny_llama), max_batch_size=1, max_seq_len=256, max_draft_len=1)
        try:
            for prompt in PROMPTS:
                ref = eng.generate(prompt, SamplingParams(max_tokens=TOKENS), num_draft_tokens=0).text
                out = post(url, "tensorrt_llm", {"text_input": prompt, "sampling_param_max_tokens": TOKENS,
                                                 "sampling_param_temperature": 0.0})["text_output"]
                assert out == prompt + ref      # upstream's helpers default exclude_input_from_output to False
                for how in ([], ["--no-stream"], ["--protocol", "grpc"]):   # the CLI's own client, the server
                    r = _cli("infer", "--workdir", str(work), "--prompt", prompt,          # serve recorded
                             "--max-tokens", str(TOKENS), *how)
                    assert r.output.startswith(ref) and "tensorrt_llm via" in r.output, (how, r.output)
            r = CliRunner().invoke(cli, ["infer", "--workdir", str(work), "--url", url, "--prompt", "x", "--stream"])
            assert r.exit_code != 0 and "non-decoupled" in r.output
        finally:
            eng.shutdown()
        r = CliRunner().invoke(cli, ["verify", "--workdir", str(work), "--url", url, "--seeds", "0"])
        assert r.exit_code != 0 and "--reference-url" in r.output     # K = 0 cannot be asked per request
        stats = rehearse.engine_stats(work)["tensorrt_llm"]
        assert stats["requests"] == 4 * len(PROMPTS) and stats["draft_tokens"] > 0   # a POST + 3 infers each
        assert info["generation"] == "llmapi" and "model.py" in info["upstream_python_files"]
        served_model = (work / "rehearsal" / "triton" / "tensorrt_llm" / "1" / "model.py").read_bytes()
        upstream_model = (tree_of(info) / "1" / "model.py").read_bytes()
        assert served_model == upstream_model                       # upstream's model.py runs unchanged


def tree_of(info):
    from pathlib import Path
    return Path(info["upstream_model"])
