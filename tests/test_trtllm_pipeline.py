"""convert -> build -> deploy without --dry-run, through the real stage runner and real subprocesses.

TensorRT-LLM cannot exist here, so a stand-in `tensorrt_llm` package and a stand-in `trtllm-build`
record what our code hands them (trtllm_support.py); the test checks those exact calls, the files
and manifests the stages leave, and the refusals (target engine without speculative mode,
missing container model sources) that leave no half-written artifact.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from trtllm_support import (env_with_path, make_backend_models, make_fake_trtllm_build, make_standin_tensorrt_llm,
                            read_log)

from specbuild.engines.trtllm.build import trtllm_build_argv
from specbuild.engines.trtllm.repository import ensemble_problems, parse_config
from specbuild.core.errors import CheckFailed, ToolNotAvailable
from specbuild.core.manifest import read_manifest
from specbuild.pipeline.stage import run_stage


@pytest.fixture
def standin(tmp_path, monkeypatch):
    root = make_standin_tensorrt_llm(tmp_path / "standin")
    log = tmp_path / "calls.jsonl"
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TRTLLM_STANDIN_LOG", str(log))
    make_fake_trtllm_build(tmp_path / "bin")
    monkeypatch.setenv("PATH", env_with_path(tmp_path / "bin"))
    yield log
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        del sys.modules[name]


def test_engine_path_end_to_end(tmp_path, standin, tiny_llama, tiny_llama_draft):
    work = tmp_path / "work"
    opts = {"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft), "tp": 2, "draft_tp": 1}
    conv = run_stage("convert", backend="trtllm", workdir=work, options=opts, inputs={"pair": "x"})
    calls = read_log(standin)
    fhf = [c for c in calls if c["call"] == "from_hugging_face"]
    assert [(c["model_dir"], c["mapping"]) for c in fhf] == [
        (str(tiny_llama), {"world_size": 2, "rank": 0, "tp_size": 2, "pp_size": 1}),
        (str(tiny_llama), {"world_size": 2, "rank": 1, "tp_size": 2, "pp_size": 1}),
        (str(tiny_llama_draft), {"world_size": 1, "rank": 0, "tp_size": 1, "pp_size": 1})]
    assert all(c["cls"] == "LLaMAForCausalLM" and c["dtype"] == "float16" and c["quant"]["quant_algo"] is None
               for c in fhf)
    saves = [(c["rank"], c["save_config"]) for c in calls if c["call"] == "save_checkpoint"]
    assert saves == [(0, True), (1, False), (0, True)]
    ck = work / "checkpoints"
    assert sorted(p.name for p in (ck / "target").iterdir()) == ["config.json", "rank0.safetensors",
                                                                 "rank1.safetensors"]
    assert (ck / "tokenizer" / "tokenizer.json").is_file()
    m = read_manifest(ck, "convert")
    assert m["extra"]["recipe"]["detected"] is True and m["extra"]["tensorrt_llm"] == "0.18.0"
    assert m["outputs"]["target_checkpoint"] == "target"
    assert not conv.skipped

    bld = run_stage("build", backend="trtllm", workdir=work, upstream_stage="convert", inputs={},
                    options={"max_draft_len": 6, "use_draft_logits": True})
    builds = [c["argv"] for c in read_log(standin) if c["call"] == "trtllm-build"]
    assert len(builds) == 2
    draft_argv, target_argv = builds
    assert target_argv[target_argv.index("--speculative_decoding_mode"):][:4] == [
        "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", "6"]
    assert "--gather_generation_logits" in draft_argv
    assert target_argv[target_argv.index("--checkpoint_dir") + 1] == str(ck / "target")
    m = read_manifest(work / "engines", "build")
    checks = {c["name"]: c for c in m["checks"]}
    assert checks["target_engine"]["max_draft_len"] == 6
    assert checks["target_engine"]["speculative_decoding_mode"] == "draft_tokens_external"
    assert m["extra"]["trtllm_options"]["tp"] == 2 and m["extra"]["recipe"]["trtllm_version"] == "0.18.0"
    assert bld.out_dir == work / "engines" and (work / "engines" / "target" / "rank0.engine").is_file()

    models = make_backend_models(tmp_path / "all_models")
    dep = run_stage("deploy", backend="trtllm", workdir=work, upstream_stage="build", inputs={},
                    options={"backend_models_dir": str(models)})
    repo = work / "model_repository"
    triton = repo / "triton"
    configs = {p.parent.name: parse_config(p.read_text()) for p in triton.glob("*/config.pbtxt")}
    assert ensemble_problems(configs) == []
    gpt = {k: v.string_value for k, v in configs["tensorrt_llm"].parameters.items()}["gpt_model_path"]
    assert gpt == str((work / "engines" / "target").resolve()) and os.path.isdir(gpt)
    assert (triton / "tensorrt_llm_bls" / "1" / "lib" / "decode.py").is_file()
    assert (triton / "tensorrt_llm" / "1").is_dir() and not any((triton / "tensorrt_llm" / "1").iterdir())
    assert (repo / "tokenizer" / "tokenizer.json").is_file()
    assert os.access(repo / "launch.sh", os.X_OK)
    launch = json.loads((repo / "launch.json").read_text())
    assert f"--model-repository={triton.resolve()}" in launch["argv"]
    assert dep.manifest["outputs"]["triton_model_repository"] == "triton"
    assert dep.manifest["outputs"]["models"] == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm",
                                                 "tensorrt_llm_bls", "tensorrt_llm_draft"]


def test_build_refuses_a_target_engine_without_speculative_mode(tmp_path, standin, tiny_llama, tiny_llama_draft,
                                                                monkeypatch):
    work = tmp_path / "work"
    run_stage("convert", backend="trtllm", workdir=work, inputs={},
              options={"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft)})
    monkeypatch.setenv("STANDIN_DROP_SPEC_MODE", "1")
    with pytest.raises(CheckFailed, match="--speculative_decoding_mode draft_tokens_external"):
        run_stage("build", backend="trtllm", workdir=work, upstream_stage="convert", inputs={}, options={})
    assert not (work / "engines").exists(), "a refused build leaves no engines directory"
    assert not list(work.glob(".tmp-engines-*"))


def test_failing_trtllm_build_puts_its_stderr_in_the_error(tmp_path, standin, tiny_llama, tiny_llama_draft):
    work = tmp_path / "work"
    run_stage("convert", backend="trtllm", workdir=work, inputs={},
              options={"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft)})
    exe = tmp_path / "bin" / "trtllm-build"
    exe.write_text(f"#!{sys.executable}\nimport sys\nprint('[TRT] [E] out of GPU memory', file=sys.stderr)\n"
                   "sys.exit(1)\n")
    with pytest.raises(Exception, match=r"out of GPU memory") as e:
        run_stage("build", backend="trtllm", workdir=work, upstream_stage="convert", inputs={}, options={})
    assert "trtllm-build draft failed with exit code 1" in str(e.value)


def test_deploy_without_container_models_is_refused(tmp_path, standin, tiny_llama, tiny_llama_draft):
    work = tmp_path / "work"
    opts = {"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft)}
    run_stage("convert", backend="trtllm", workdir=work, inputs={}, options=opts)
    run_stage("build", backend="trtllm", workdir=work, upstream_stage="convert", inputs={}, options={})
    with pytest.raises(ToolNotAvailable, match="--backend-models-dir"):
        run_stage("deploy", backend="trtllm", workdir=work, upstream_stage="build", inputs={},
                  options={"backend_models_dir": str(tmp_path / "nowhere")})
    assert not (work / "model_repository").exists()


def test_build_argv_helper_matches_plan_for_draft_without_logits(tmp_path):
    from specbuild.engines.trtllm.settings import settings_from
    argv = trtllm_build_argv(settings_from({}), "draft", tmp_path / "c", tmp_path / "e", "bfloat16")
    assert argv[:7] == ["trtllm-build", "--checkpoint_dir", str(tmp_path / "c"), "--output_dir", str(tmp_path / "e"),
                        "--gemm_plugin", "bfloat16"]
    assert "--speculative_decoding_mode" not in argv and "--gather_generation_logits" not in argv


UPSTREAM_LIKE_MODEL_YAML = """# ======= TRTLLM Model Configurations =======
model: TinyLlama/TinyLlama-1.1B-Chat-v1.0
backend: "pytorch"
tensor_parallel_size: 1
pipeline_parallel_size: 1
triton_config:
  max_batch_size: 0
  decoupled: False
"""


def container_llmapi_tree(root):
    """A temp dir shaped like the container's triton_backend/all_models/llmapi/tensorrt_llm/: upstream ships a 1/
    holding model.py, helpers.py and its own model.yaml (TinyLlama, no speculative_config), and a config.pbtxt."""
    model = root / "triton_backend" / "all_models" / "llmapi" / "tensorrt_llm"
    (model / "1" / "__pycache__").mkdir(parents=True)
    (model / "1" / "model.py").write_text("# upstream llmapi model.py\n")
    (model / "1" / "helpers.py").write_text("# upstream helpers.py\n")
    (model / "1" / "model.yaml").write_text(UPSTREAM_LIKE_MODEL_YAML)
    (model / "1" / "__pycache__" / "model.cpython-312.pyc").write_bytes(b"\0")
    (model / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n')
    return root / "triton_backend" / "all_models"


def test_llmapi_deploy_against_a_container_tree_keeps_our_model_yaml(tmp_path, monkeypatch, tiny_llama,
                                                                     tiny_llama_draft):
    root = make_standin_tensorrt_llm(tmp_path / "standin", version="1.2.1")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TRTLLM_STANDIN_LOG", str(tmp_path / "calls.jsonl"))
    try:
        work = tmp_path / "work"
        common = {"trtllm_version": "1.2.1"}
        run_stage("convert", backend="trtllm", workdir=work, inputs={},
                  options={"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft), **common})
        run_stage("build", backend="trtllm", workdir=work, upstream_stage="convert", inputs={},
                  options={"max_draft_len": 4, **common})
        models = container_llmapi_tree(tmp_path / "container")
        dep = run_stage("deploy", backend="trtllm", workdir=work, upstream_stage="build", inputs={},
                        options={"backend_models_dir": str(models), **common})
    finally:
        for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
            del sys.modules[name]
    assert dep.manifest["extra"]["recipe"]["generation"] == "llmapi"
    model = work / "model_repository" / "triton" / "tensorrt_llm"
    served = (model / "1" / "model.yaml").read_text()
    assert "speculative_config:" in served and str(tiny_llama_draft) in served
    assert "TinyLlama" not in served and f'model: "{tiny_llama}"' in served
    assert (work / "model_repository" / "trtllm_serve.yaml").read_text() in served
    # upstream's Python sources came along; our config.pbtxt stayed ours; no bytecode
    assert (model / "1" / "model.py").read_text() == "# upstream llmapi model.py\n"
    assert (model / "1" / "helpers.py").is_file() and not (model / "1" / "__pycache__").exists()
    assert (model / "config.pbtxt").read_text() != (models / "llmapi" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'backend: "python"' in (model / "config.pbtxt").read_text()
    # serve --rehearse assembles its copy with deploy's own copy: the same model.yaml, upstream's model.py
    from specbuild.pipeline import rehearse
    repo = rehearse.prepare(work, models)
    assert (repo / "tensorrt_llm" / "1" / "model.yaml").read_text() == served
    assert (repo / "tensorrt_llm" / "1" / "model.py").read_text() == "# upstream llmapi model.py\n"
    assert (repo / "tensorrt_llm" / "config.pbtxt").read_text() == (model / "config.pbtxt").read_text()
