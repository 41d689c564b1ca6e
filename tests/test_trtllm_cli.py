"""The trtllm path through the real CLI on a CPU box: every stage's --dry-run prints the exact plan and
writes nothing; without --dry-run the missing tensorrt_llm is reported with the way out."""

import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli


def _run(*args):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("pin", [["--trtllm-version", "0.18.0"], ["--trtllm-version", "0.20.0"],
                                 ["--trtllm-version", "1.2.1", "--trtllm-generation", "engine"],
                                 ["--trtllm-generation", "engine"]])          # the default pin, 1.2.1
def test_dry_run_chain_prints_the_plan_and_writes_nothing(tiny_llama, tiny_llama_draft, tmp_path, pin):
    w = tmp_path / "w"
    r = _run("convert", "--backend", "trtllm", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft),
             "--workdir", str(w), "--dtype", "float16", "--dry-run", *pin)
    assert r.exit_code == 0, r.output
    assert "convert_rank --model-class LLaMAForCausalLM" in r.output and "--tp-size 1" in r.output
    r = _run("build", "--backend", "trtllm", "--workdir", str(w), "--max-draft-len", "5", "--dtype", "float16",
             "--dry-run", *pin)
    assert r.exit_code == 0, r.output
    target = [line for line in r.output.splitlines() if "engines/target" in line and line.startswith("$ trtllm-build")]
    assert len(target) == 1
    assert "--speculative_decoding_mode draft_tokens_external --max_draft_len 5" in target[0]
    assert "--use_paged_context_fmha enable" in target[0]
    r = _run("deploy", "--backend", "trtllm", "--workdir", str(w), "--target-gpu-ids", "0", "--draft-gpu-ids", "0",
             "--dry-run", *pin)
    assert r.exit_code == 0, r.output
    assert 'name: "tensorrt_llm_draft"' in r.output and "enable_kv_cache_reuse" in r.output
    assert not w.exists() or not any(w.iterdir()), "a dry run must not write into the workdir"


@pytest.mark.parametrize("pin", [[], ["--trtllm-version", "1.0.0"]], ids=["default-1.2.1-llmapi", "1.0.0-llmapi"])
def test_dry_run_chain_on_the_default_llmapi_path_states_what_it_assumed(tiny_llama, tiny_llama_draft, tmp_path,
                                                                        pin):
    """convert, build and deploy --dry-run in a row, on the default path (llmapi): build and deploy cannot know the
    directories convert will record, so they name them as assumed instead of stopping for a --draft they lack."""
    w = tmp_path / "w"
    r = _run("convert", "--backend", "trtllm", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft),
             "--workdir", str(w), "--dry-run", *pin)
    assert r.exit_code == 0, r.output
    assert "llmapi path" in r.output
    r = _run("build", "--backend", "trtllm", "--workdir", str(w), "--max-draft-len", "5", "--dry-run", *pin)
    assert r.exit_code == 0, r.output
    assert "llm_api_options.yaml" in r.output and "max_draft_len: 5" in r.output
    assert "convert has not run" in r.output and "<the --draft given to convert>" in r.output
    r = _run("deploy", "--backend", "trtllm", "--workdir", str(w), "--dry-run", *pin)
    assert r.exit_code == 0, r.output
    assert "speculative_config:" in r.output and "trtllm-serve" in r.output
    assert "<the --target given to convert>" in r.output and "<the --draft given to convert>" in r.output
    assert "not known until convert runs" in r.output
    assert not w.exists() or not any(w.iterdir()), "a dry run must not write into the workdir"


def test_trtllm_only_deploy_flags_are_refused_for_embedded(tmp_path):
    r = _run("deploy", "--workdir", str(tmp_path), "--fast-logits")
    assert r.exit_code == 2 and "--backend trtllm only" in r.output


@pytest.mark.parametrize("pin", [["--trtllm-generation", "engine"], []], ids=["engine", "llmapi"])
def test_deploy_host_flag_reaches_the_launch(tiny_llama, tiny_llama_draft, tmp_path, pin):
    """Inside a container the server must bind 0.0.0.0 for published ports to answer: `--host` says so (default
    127.0.0.1), on both generations' launch lines."""
    w = tmp_path / "w"
    r = _run("deploy", "--backend", "trtllm", "--workdir", str(w), "--dry-run", *pin)
    assert r.exit_code == 0, r.output
    assert "0.0.0.0" not in r.output and "127.0.0.1" in r.output
    r = _run("deploy", "--backend", "trtllm", "--workdir", str(w), "--host", "0.0.0.0", "--dry-run", *pin)
    assert r.exit_code == 0, r.output
    assert "127.0.0.1" not in r.output
    assert ("--http-address=0.0.0.0" in r.output) if pin else ("--host 0.0.0.0" in r.output)
    r = _run("deploy", "--workdir", str(w), "--host", "0.0.0.0")
    assert r.exit_code == 2 and "--backend trtllm only" in r.output

