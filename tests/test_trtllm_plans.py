"""--dry-run plans of the trtllm backend: exact argv per generation, files, launch command lines."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from trtllm_support import context, runs, written

from specbuild.engines.trtllm import build, convert, deploy
from specbuild.core.errors import CheckFailed, ToolNotAvailable, UsageError
from specbuild.pipeline.stage import run_stage

# a plan names the container's python3 for the converter unless tensorrt_llm imports here (inside the container)
PYTHON = sys.executable if importlib.util.find_spec("tensorrt_llm") is not None else "python3"
WORKER = [PYTHON, "-m", "specbuild.engines.trtllm.convert_rank"]


@pytest.fixture
def opts(tiny_llama, tiny_llama_draft):
    # The 0.18 recipe (the default pin before 1.2.1): these tests keep its guarantees; the 0.20 .. 1.2.x
    # families have their own tests (test_trtllm_families.py).
    return {"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft), "trtllm_version": "0.18.0"}

NO_TRTLLM = pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None,
                               reason="tensorrt_llm is installed here")


def test_convert_dry_run_through_run_stage_is_exact_per_rank(tmp_path, opts, tiny_llama, tiny_llama_draft):
    out = run_stage("convert", backend="trtllm", workdir=tmp_path, dry_run=True, inputs={},
                    options={**opts, "tp": 2, "draft_tp": 1, "dtype": "bfloat16", "quantization": "int8_wo"})
    ck = tmp_path / "checkpoints"
    target = [*WORKER, "--model-class", "LLaMAForCausalLM", "--model-dir", str(tiny_llama), "--output-dir",
              str(ck / "target"), "--dtype", "bfloat16", "--tp-size", "2", "--pp-size", "1"]
    draft = [*WORKER, "--model-class", "LLaMAForCausalLM", "--model-dir", str(tiny_llama_draft), "--output-dir",
             str(ck / "draft"), "--dtype", "bfloat16", "--tp-size", "1", "--pp-size", "1"]
    q = ["--quantization", "int8_wo"]
    assert runs(out.plan) == [target + ["--rank", "0"] + q, target + ["--rank", "1"] + q, draft + ["--rank", "0"] + q]
    sources = json.loads(written(out.plan)[str(ck / "sources.json")])
    assert sources["recipe"] == {"trtllm_version": "0.18.0", "generation": "engine",
                                 "container": "nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3",
                                 "detected": False, "backend_family": "0.18", "untested": False}
    assert sources["target"]["vocab_size"] == sources["draft"]["vocab_size"]
    assert not (tmp_path / "checkpoints").exists(), "a dry run writes nothing"


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed here")
def test_rehearsal_plan_names_the_containers_python_not_this_machines(tmp_path, opts):
    run_stage("convert", backend="trtllm", workdir=tmp_path, inputs={},
              options={**opts, "trtllm_generation": "engine", "rehearse": True})
    text = (tmp_path / "checkpoints" / "rehearsal_plan.json").read_text()
    argvs = [s["run"] for s in json.loads(text)["steps"] if "run" in s]
    assert len(argvs) == 2 and all(a[:3] == ["python3", "-m", "specbuild.engines.trtllm.convert_rank"]
                                   for a in argvs)
    assert sys.executable not in text
    assert any("python3" in s.get("note", "") and "25.03-trtllm-python-py3" in s.get("note", "")
               for s in json.loads(text)["steps"])


def test_convert_fp8_is_one_calibrated_run_per_model(tmp_path, opts, tiny_llama):
    steps = convert.plan(context("convert", tmp_path, {**opts, "quantization": "fp8", "calib_dataset": "/data/c"}))
    first = runs(steps)[0]
    assert first == [*WORKER, "--model-class", "LLaMAForCausalLM", "--model-dir", str(tiny_llama), "--output-dir",
                     str(tmp_path / "checkpoints" / "target"), "--dtype", "float16", "--tp-size", "1", "--pp-size", "1",
                     "--quantization", "fp8", "--calibrate", "--calib-dataset", "/data/c"]
    assert len(runs(steps)) == 2


def test_convert_maps_qwen2_to_qwen_class(tmp_path, tiny_qwen2, tiny_llama_draft):
    opts = {"target_dir": str(tiny_qwen2), "draft_dir": str(tiny_llama_draft), "trtllm_version": "0.18.0"}
    steps = convert.plan(context("convert", tmp_path, opts))
    assert runs(steps)[0][runs(steps)[0].index("--model-class") + 1] == "QWenForCausalLM"


def test_build_argv_engine_path_snapshot(tmp_path, opts):
    steps = build.plan(context("build", tmp_path, {**opts, "max_draft_len": 6, "max_batch_size": 4,
                                                   "max_input_len": 3200, "max_seq_len": 4800,
                                                   "max_num_tokens": 4096, "use_draft_logits": True}))
    common = ["--gemm_plugin", "float16", "--gpt_attention_plugin", "float16", "--remove_input_padding", "enable",
              "--kv_cache_type", "paged", "--context_fmha", "enable", "--use_paged_context_fmha", "enable",
              "--max_beam_width", "1", "--max_batch_size", "4", "--max_input_len", "3200", "--max_seq_len", "4800",
              "--max_num_tokens", "4096"]
    ck, en = tmp_path / "checkpoints", tmp_path / "engines"
    assert runs(steps) == [
        ["trtllm-build", "--checkpoint_dir", str(ck / "draft"), "--output_dir", str(en / "draft"), *common,
         "--gather_generation_logits"],
        ["trtllm-build", "--checkpoint_dir", str(ck / "target"), "--output_dir", str(en / "target"), *common,
         "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", "6"],
    ]


def test_build_without_draft_logits_and_fp8_plugins(tmp_path, opts):
    draft, target = runs(build.plan(context("build", tmp_path, {**opts, "quantization": "fp8"})))
    assert "--gather_generation_logits" not in draft
    assert draft[draft.index("--gemm_plugin") + 1] == "auto"
    assert target[target.index("--max_draft_len") + 1] == "4"


def test_build_reads_paths_and_options_from_the_convert_manifest(tmp_path, opts):
    upstream = {"outputs": {"target_checkpoint": "t", "draft_checkpoint": "d", "tokenizer": "tokenizer"},
                "extra": {"trtllm_options": {**opts, "tp": 2, "dtype": "float16"}}}
    draft, target = runs(build.plan(context("build", tmp_path, {"max_draft_len": 3}, upstream=upstream)))
    assert target[target.index("--checkpoint_dir") + 1] == str(tmp_path / "checkpoints" / "t")
    # tp is baked into the checkpoint shards: the converted value wins and the plan says so
    steps = build.plan(context("build", tmp_path, {"tp": 1, "dtype": "float32", "max_seq_len": 1024},
                               upstream=upstream))
    notes = [s.note for s in steps if s.kind == "note"]
    assert any(n.startswith("ignored --tp 1") and "made with 2" in n for n in notes)
    assert any(n.startswith("ignored --dtype 'float32'") for n in notes)
    draft, target = runs(steps)
    assert target[target.index("--gemm_plugin") + 1] == "float16"
    assert target[target.index("--max_input_len") + 1] == "512"   # unset: half of max_seq_len


def test_llmapi_build_writes_speculative_config_yaml(tmp_path, opts, tiny_llama_draft):
    steps = build.plan(context("build", tmp_path, {**opts, "trtllm_version": "1.1.0", "max_draft_len": 5}))
    assert runs(steps) == []
    yaml = written(steps)[str(tmp_path / "engines" / "llm_api_options.yaml")]
    assert ("speculative_config:\n  decoding_type: \"DraftTarget\"\n  max_draft_len: 5\n"
            f"  speculative_model_dir: \"{tiny_llama_draft}\"\n") in yaml
    # with a draft model upstream turns block reuse off (PR #5448): not presented as a setting, and the YAML says why
    assert "kv_cache_config:\n  free_gpu_memory_fraction: 0.5\n" in yaml      # one GPU shared with the draft
    assert "PR #5448" in yaml and "enable_block_reuse:" not in yaml
    assert "disable_overlap_scheduler: true" in yaml


def test_llmapi_deploy_launch_uses_version_specific_flag(tmp_path, opts, tiny_llama):
    files = written(deploy.plan(context("deploy", tmp_path, {**opts, "trtllm_version": "1.1.0"})))
    launch = json.loads(files[str(tmp_path / "model_repository" / "launch.json")])
    root = (tmp_path / "model_repository").resolve()
    assert launch["argv"] == ["trtllm-serve", "serve", str(tiny_llama), "--backend", "pytorch", "--host", "127.0.0.1",
                              "--port", "8000", "--extra_llm_api_options", str(root / "trtllm_serve.yaml")]
    assert launch["container"] == "nvcr.io/nvidia/tensorrt-llm/release:1.1.0"
    model_yaml = files[str(tmp_path / "model_repository" / "triton" / "tensorrt_llm" / "1" / "model.yaml")]
    assert f'model: "{tiny_llama}"' in model_yaml and "decoding_type: \"DraftTarget\"" in model_yaml
    assert "triton_config:\n  max_batch_size: 0\n  decoupled: false" in model_yaml


def test_engine_launch_orchestrator_mode_snapshot(tmp_path, opts):
    files = written(deploy.plan(context("deploy", tmp_path, {**opts, "tp": 2})))
    launch = json.loads(files[str(tmp_path / "model_repository" / "launch.json")])
    repo = (tmp_path / "model_repository" / "triton").resolve()
    assert launch["argv"] == [
        "mpirun", "--allow-run-as-root", "-n", "1", "/opt/tritonserver/bin/tritonserver",
        f"--model-repository={repo}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
        "--metrics-address=127.0.0.1", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002",
        "--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
        "--cuda-memory-pool-byte-size=0:0", "--cuda-memory-pool-byte-size=1:0",
        "--disable-auto-complete-config", "--backend-config=python,shm-region-prefix-name=prefix0_", ":"]
    assert launch["env"] == {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
    script = files[str(tmp_path / "model_repository" / "launch.sh")]
    assert "TRTLLM_ORCHESTRATOR=1 TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1 exec mpirun" in script


def test_engine_launch_fast_logits_world_size_and_explicit_loads(tmp_path, opts):
    files = written(deploy.plan(context("deploy", tmp_path, {**opts, "fast_logits": True, "tp": 2, "draft_tp": 1})))
    launch = json.loads(files[str(tmp_path / "model_repository" / "launch.json")])
    assert launch["world_size"] == 4 and launch["env"]["TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES"] == "0"
    segments = " ".join(launch["argv"]).split(" : ")
    assert len(segments) == 4
    assert "--load-model" not in segments[0]
    for i, seg in enumerate(segments[1:], start=1):
        assert "--model-control-mode=explicit --load-model=tensorrt_llm --load-model=tensorrt_llm_draft" in seg
        assert f"prefix{i}_" in seg


def test_unsupported_version_is_refused_with_the_matrix(tmp_path, opts):
    with pytest.raises(UsageError, match="supported TensorRT-LLM combinations") as e:
        convert.plan(context("convert", tmp_path, {**opts, "trtllm_version": "1.3.0"}))
    assert "0.18.0" in str(e.value) and "25.03-trtllm-python-py3" in str(e.value)


@NO_TRTLLM
def test_run_without_tensorrt_llm_points_to_dry_run(tmp_path, opts):
    with pytest.raises(ToolNotAvailable, match="--dry-run") as e:
        run_stage("convert", backend="trtllm", workdir=tmp_path, options=opts, inputs={})
    assert "nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3" in str(e.value)
    assert not (tmp_path / "checkpoints").exists()


def test_vocab_mismatch_is_refused_at_plan_time(tmp_path, tiny_llama, tiny_llama_draft):
    import shutil
    bad = tmp_path / "draft"
    shutil.copytree(tiny_llama_draft, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] += 128
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckFailed, match="vocab mismatch.*pad the draft"):
        convert.plan(context("convert", tmp_path, {"target_dir": str(tiny_llama), "draft_dir": str(bad)}))


def test_missing_sources_name_the_flag(tmp_path, tiny_llama):
    with pytest.raises(UsageError, match="--draft"):
        convert.plan(context("convert", tmp_path, {"target_dir": str(tiny_llama)}))


def test_fast_logits_need_a_draft_built_with_logits(tmp_path, opts):
    upstream = {"outputs": {"tokenizer": "tokenizer"},
                "extra": {"trtllm_options": {**opts, "use_draft_logits": False, "max_batch_size": 8}}}
    with pytest.raises(UsageError, match="rebuild with `specbuild build --backend trtllm --use-draft-logits`"):
        deploy.plan(context("deploy", tmp_path, {"fast_logits": True}, upstream=upstream))
    upstream["extra"]["trtllm_options"]["use_draft_logits"] = True
    notes = [s.note for s in deploy.plan(context("deploy", tmp_path, {"fast_logits": True, "max_batch_size": 64},
                                                 upstream=upstream)) if s.kind == "note"]
    assert any(n.startswith("ignored --max-batch-size 64") for n in notes)


def test_dry_runs_use_what_convert_recorded_and_say_what_they_cannot_know(tmp_path, tiny_llama, tiny_llama_draft,
                                                                          monkeypatch):
    """A bfloat16 --tp 2 convert: build's dry run must show bfloat16 plugins (not the CLI's float32 default) and
    deploy's dry run two target GPUs; without a convert manifest the plan says it cannot know."""
    from click.testing import CliRunner

    from specbuild.cli.main import cli
    from specbuild.core.manifest import Manifest, write_manifest
    work = tmp_path / "w"
    r = CliRunner().invoke(cli, ["build", "--backend", "trtllm", "--workdir", str(work), "--dry-run",
                                 "--trtllm-version", "0.18.0"])
    assert r.exit_code == 0, r.output
    assert "convert has not run" in r.output and "cannot know" in r.output
    assert "--gemm_plugin float16" in r.output and "--max_seq_len 4096" in r.output   # trtllm defaults
    # a convert that ran (in the container) recorded bfloat16, tp 2
    ck = work / "checkpoints"
    ck.mkdir(parents=True)
    rec = {"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft), "dtype": "bfloat16", "tp": 2,
           "draft_tp": 1, "trtllm_version": "0.18.0"}
    write_manifest(ck, Manifest(stage="convert", inputs={}, options={**rec, "backend": "trtllm"},
                                outputs={"target_checkpoint": "target", "draft_checkpoint": "draft",
                                         "tokenizer": "tokenizer"}, extra={"trtllm_options": rec}))
    r = CliRunner().invoke(cli, ["build", "--backend", "trtllm", "--workdir", str(work), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "--gemm_plugin bfloat16" in r.output and "float32" not in r.output
    assert "options recorded by convert" in r.output and "tp 2" in r.output
    assert "ignored --" not in r.output
    r = CliRunner().invoke(cli, ["deploy", "--backend", "trtllm", "--workdir", str(work), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert 'key: "gpu_device_ids" value: { string_value: "0,1" }' in r.output
    assert "ignored --max-batch-size" not in r.output         # no flag given: nothing to ignore
    assert "options recorded by convert" in r.output
